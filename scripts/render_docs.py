"""Tables in the docs rendered from their results JSON, so that a figure cannot drift from the run that made it.

    python scripts/render_docs.py            # rewrite every rendered block in docs/*.md and README.md
    python scripts/render_docs.py --check    # exit 1 and print a diff where a block differs from its render

A rendered block is written between two markers in a Markdown file:

    <!-- render: ladder docs/results/qwen05-ladder-h200-run1 -->
    ...the tables, as the renderer prints them...
    <!-- /render -->

Renderers: `ladder DIR` (scripts/ladder_table.py's passkey and RULER tables of the reports in DIR; traces are not
part of it). tests/test_docs.py runs `--check`, so a hand edit inside a block, or a JSON changed without
re-rendering, fails CI.
"""
from __future__ import annotations

import argparse
import difflib
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
    raise ValueError(f"unknown renderer {kind!r} (known: ladder)")


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
