"""Tables in the docs rendered from their results JSON, so that a figure cannot drift from the run that made it.

    python scripts/render_docs.py            # rewrite every rendered block in docs/*.md and README.md
    python scripts/render_docs.py --check    # exit 1 and print a diff where a block differs from its render

A rendered block is written between two markers in a Markdown file:

    <!-- render: ladder docs/results/qwen05-ladder-h200-run1 -->
    ...the tables, as the renderer prints them...
    <!-- /render -->

Renderers: `ladder DIR` (scripts/ladder_table.py's passkey and RULER tables of the reports in DIR; traces are not
part of it); `ppl FILE` (one `longreach eval ppl` report: tail and whole-window perplexity per method and length, and
the tail's change from the first length). tests/test_docs.py runs `--check`, so a hand edit inside a block, or a JSON changed without
re-rendering, fails CI.
"""
from __future__ import annotations

import argparse
import difflib
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import ladder_table  # noqa: E402

BLOCK = re.compile(r"(<!-- render: (\w+) ([^>]*?) -->\n)(.*?)(<!-- /render -->)", re.S)


def render(kind: str, arg: str) -> str:
    if kind == "ladder":
        directory = ROOT / arg
        if not directory.is_dir():
            raise ValueError(f"render ladder: {arg} is not a folder of results")
        return ladder_table.tables(ladder_table.load(directory)).strip("\n") + "\n"
    if kind == "ppl":
        path = ROOT / arg
        if not path.is_file():
            raise ValueError(f"render ppl: {arg} is not a file")
        return ppl_table(json.loads(path.read_text()))
    raise ValueError(f"unknown renderer {kind!r} (known: ladder, ppl)")


def _k(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K"


def ppl_table(report: dict) -> str:
    """Rows: each method's tail PPL (the same last tokens at every length: eval/ppl.py's windows end together),
    its change from the method's first measured length, and its whole-window PPL; `-` where a length was skipped."""
    lengths = report["lengths"]
    head = "| method | " + " | ".join(_k(n) for n in lengths) + " |\n|---|" + "---|" * len(lengths) + "\n"
    rows = []
    for method, cells in report["methods"].items():
        got = [cells.get(str(n)) or {} for n in lengths]
        tails = [c.get("ppl_tail") for c in got]
        first = next((t for t in tails if t is not None), None)
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append(f"| {method}, tail PPL | " + " | ".join(fmt(t) for t in tails) + " |")
        if first is not None and sum(t is not None for t in tails) > 1:
            rows.append(f"| {method}, tail change | " + " | ".join(
                "-" if t is None else f"{(t / first - 1) * 100:+.1f}%" for t in tails) + " |")
        rows.append(f"| {method}, whole-window PPL | " + " | ".join(fmt(c.get("ppl_all")) for c in got) + " |")
    tail = report.get("tail")
    note = (f"\nTail: the last {tail:,} tokens, the same tokens at every length; text `{report.get('text')}`, "
            f"{len(report['windows']['ends'])} window(s) per length; {report.get('provenance', {}).get('gpu', report.get('device'))}, "
            f"commit {report.get('provenance', {}).get('commit', '?')}.\n")
    return head + "\n".join(rows) + "\n" + note


def rendered(text: str) -> str:
    return BLOCK.sub(lambda m: m[1] + render(m[2], m[3].strip()) + m[5], text)


def files() -> list[pathlib.Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 where a block differs")
    args = p.parse_args()
    stale = 0
    for path in files():
        text = path.read_text()
        new = rendered(text)
        if new == text:
            continue
        stale += 1
        if args.check:
            rel = str(path.relative_to(ROOT))
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), rel,
                                                       rel + " (rendered)"))
        else:
            path.write_text(new)
            print(f"rendered {path.relative_to(ROOT)}")
    if args.check and stale:
        print(f"\n{stale} file(s) differ from their render: run python scripts/render_docs.py")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
