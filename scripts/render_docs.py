"""Tables in the docs rendered from their results JSON, so that a figure cannot drift from the run that made it.

    python scripts/render_docs.py            # rewrite every rendered block in docs/*.md and README.md
    python scripts/render_docs.py --check    # exit 1 and print a diff where a block differs from its render
    python scripts/render_docs.py --list     # the renderers and their arguments

A rendered block is written between two markers in a Markdown file:

    <!-- render: ladder docs/results/qwen05-ladder-h200-run1 -->
    ...the tables, as the renderer prints them...
    <!-- /render -->

The marker names a renderer and its arguments (files and folders relative to the repository root, KEY=VALUE
options). Renderers: `ladder DIR` (scripts/ladder_table.py's passkey and RULER tables of the reports in DIR; traces
are not part of it); the eval reports' in scripts/render_eval.py (passkey, ruler, passkey-depth, ppl, ppl-compare)
and the benchmarks' in scripts/render_bench.py (bench-engine, bench-attention, bench-attention-at, bench-long,
bench-decode, bench-serve). Each table ends with the files it came from: device, date, commit where recorded, and
the methods and settings that ran (the presets, from the provenance; for older reports, their `args`).
tests/test_docs.py runs `--check`, so a hand edit inside a block, or a JSON changed without re-rendering, fails CI.
A table with no JSON behind it is typed, and says so ("typed, no JSON").
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
sys.path.insert(1, str(ROOT))
import ladder_table  # noqa: E402
import render_bench  # noqa: E402
import render_eval  # noqa: E402

BLOCK = re.compile(r"(<!-- render: ([\w-]+) ([^>]*?) -->\n)(.*?)(<!-- /render -->)", re.S)


def _ladder(args: list[str]) -> str:
    """ladder_table.py's tables of a folder, then the devices and commits of its reports; a row whose JSON ran
    something else than its label names (another preset, overrides, RoPE scaling) is marked † and what ran is
    listed under the tables, from each report's provenance or args."""
    (arg,) = args
    directory = ROOT / arg
    if not directory.is_dir():
        raise ValueError(f"{arg} is not a folder of results")
    reports = {p: json.loads(p.read_text()) for p in sorted(directory.glob("*__*__*__*.json"))
               if p.name.split("__")[0] in ("passkey", "ruler")}
    ran: dict[str, set] = {}
    shared = 0
    for p, r in reports.items():
        shared += bool(r.get("share_prefill"))
        if len(r["methods"]) > 1:  # several methods in one report (decode variants sharing a prefill): a row each
            for label in r["methods"]:
                ran.setdefault(ladder_table.row_label(label), set()).add(_ran_method(r, label))
        else:
            ran.setdefault(p.name.split("__")[2], set()).add(_ran(r))
    flagged = {label: sorted(runs) for label, runs in ran.items()
               if any(run not in _named_by(label) for run in runs)}
    text = ladder_table.tables(ladder_table.load(directory)).strip("\n")
    for label in flagged:
        text = text.replace(f"\n| {label} |", f"\n| {label} † |")
    seen = lambda key: ", ".join(sorted({str(v) for v in map(key, reports.values()) if v})) or "not recorded"  # noqa
    devices = seen(lambda r: (r.get("provenance") or {}).get("device") or (r.get("provenance") or {}).get("gpu")
                   or r.get("device"))
    commits = seen(lambda r: (r.get("provenance") or {}).get("commit"))
    text += f"\n\nFrom the {len(reports)} reports in `{arg}`: device {devices}; commit {commits}.\n"
    if shared:
        text += (f"\n{shared} of them ran several methods that differ only in decode-time fields, each prompt "
                 "prefilled once and decoded under each (`--share-prefill`, tools/eval/variants.py).\n")
    if flagged:
        text += "\n† ran as: " + "; ".join(f"{label}: " + ", ".join(f"`{r}`" for r in runs)
                                         for label, runs in flagged.items()) + ".\n"
    return text


def _ran(report: dict) -> str:
    """What one report ran: its --attention (the preset named, else the provenance's resolved one), overrides and
    RoPE scaling, as a command-line fragment."""
    args = report.get("args") or {}
    prov = _attention_records(report)
    specs = [_spec(prov[a]) if a in prov else a for a in args.get("attention") or []]
    out = " ".join(specs)
    config = args.get("attention_config")
    if isinstance(config, str):
        config = json.loads(config) if config.strip() else None
    if config:  # an empty object changes nothing
        out += f" --attention-config {json.dumps(config)}"
    if args.get("rope_scaling"):
        out += f" --rope-scaling {args['rope_scaling']}"
    return out


def _attention_records(report: dict) -> dict:
    """label -> the provenance's record of that method run (tools/report.py: attention_record)."""
    return {a["label"]: a for a in (report.get("provenance") or {}).get("attention") or []}


def _spec(record: dict) -> str:
    """METHOD:PRESET of one provenance record (METHOD alone for a method without presets)."""
    return record["method"] + (f":{record['preset']}" if record.get("preset") else "")


def _ran_method(report: dict, label: str) -> str:
    """What one method of a several-method report ran: METHOD:PRESET and its own overrides."""
    a = _attention_records(report).get(label)
    if a is None:
        return label
    out = _spec(a)
    if a.get("attention_config"):
        out += f" --attention-config {json.dumps(a['attention_config'])}"
    return out


def _named_by(label: str) -> set[str]:
    """The runs a ladder label names by itself: METHOD, METHOD:LABEL, or METHOD:PRESET for a METHOD-PRESET label
    (with a method's default preset named or not)."""
    from longreach.attention.registry import available_backends
    from longreach.tools.report import default_preset

    out = set()
    for method in available_backends():
        default = default_preset(method)
        if label == method:
            out |= {method} | ({f"{method}:{default}"} if default else set())
        out.add(f"{method}:{label}")
        if label.startswith(method + "-"):
            preset = label[len(method) + 1:]
            out.add(f"{method}:{preset}")
            if preset == default:
                out.add(method)
    return out


RENDERERS = {"ladder": _ladder, **render_eval.RENDERERS, **render_bench.RENDERERS}


def render(kind: str, arg: str) -> str:
    if kind not in RENDERERS:
        raise ValueError(f"unknown renderer {kind!r} (known: {', '.join(sorted(RENDERERS))})")
    try:
        return RENDERERS[kind](arg.split())
    except (ValueError, KeyError) as e:
        raise ValueError(f"render {kind} {arg}: {e}") from None


def rendered(text: str) -> str:
    return BLOCK.sub(lambda m: m[1] + render(m[2], m[3].strip()) + m[5], text)


def files() -> list[pathlib.Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 where a block differs")
    p.add_argument("--list", action="store_true", help="print the renderers and their arguments")
    args = p.parse_args()
    if args.list:
        print(render_eval.__doc__ + "\n" + render_bench.__doc__)
        return 0
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
