"""Tables of the retrieval ladder (scripts/device_ladder.sh): one passkey table per haystack and one RULER table.

    python scripts/ladder_table.py DIR [--json OUT.json]

DIR holds the jobs' JSON reports, named KIND__HAYSTACK__LABEL__LENGTHS.json (the eval commands' --out). Reports of
one (kind, haystack, label) at different lengths are merged, and so are reports of one cell split over several jobs
(passkey: one depth per job; RULER: one seed per job; the cell's prompts are summed). A passkey cell reads "accuracy% [95% Wilson interval]",
with the prompt count per cell in the row's last column when every cell of the row has the same count (else per cell).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from longreach.tools.eval.common import format_length as length_label, wilson  # noqa: E402


def load(directory: pathlib.Path) -> dict:
    """{(kind, haystack, label): {length: cell}} with cell = {"correct", "n"} (passkey) or {"score", "n"} per task."""
    merged: dict = {}
    for path in sorted(directory.glob("*__*__*__*.json")):
        kind, hay, label, _ = path.stem.split("__")
        if kind not in ("passkey", "ruler"):  # traces are printed by traces(); ppl reports are read on their own
            continue
        report = json.loads(path.read_text())
        several = len(report["methods"]) > 1  # decode variants sharing one prefill (--share-prefill): a row each
        for name, method in report["methods"].items():
            if several:
                label = row_label(name)
            if kind == "passkey":
                for cell in method["cells"]:
                    c = merged.setdefault((kind, hay, label), {}).setdefault(cell["length"], {"correct": 0, "n": 0})
                    c["correct"] += bool(cell["correct"])
                    c["n"] += 1
            else:
                for task, per_len in method["tasks"].items():
                    for n, cell in per_len.items():  # one cell split over jobs (other seeds): n-weighted mean score
                        c = merged.setdefault((kind, task, label), {}).setdefault(int(n), {"score": 0.0, "n": 0})
                        total = c["n"] + cell["n"]
                        c["score"] = (c["score"] * c["n"] + cell["score"] * cell["n"]) / total
                        c["n"] = total
    return merged


def row_label(method_label: str) -> str:
    """A report's method label as a ladder row: "infinitehip:3k-box@fresh" -> "infinitehip-3k-box-fresh" (the jobs'
    own naming, so rows of one-method and several-method reports line up)."""
    return method_label.replace(":", "-").replace("@", "-").replace("+", "-")


def _cell(c: dict, with_n: bool) -> str:
    if "correct" in c:
        lo, hi = wilson(c["correct"], c["n"])
        text = f"{100 * c['correct'] / c['n']:.0f} [{100 * lo:.0f}-{100 * hi:.0f}]"
    else:
        lo, hi = wilson(c["score"] / 100 * c["n"], c["n"])
        text = f"{c['score']:.0f} [{100 * lo:.0f}-{100 * hi:.0f}]"
    return f"{text} ({c['n']})" if with_n else text


def tables(merged: dict) -> str:
    out = []
    for kind, group in (("passkey", "haystack"), ("ruler", "task")):
        for what in sorted({h for (k, h, _) in merged if k == kind}):
            rows = {label: cells for (k, h, label), cells in merged.items() if k == kind and h == what}
            lengths = sorted({n for cells in rows.values() for n in cells})
            out.append(f"\n{kind}, {group} {what}\n")
            out.append("| method | " + " | ".join(length_label(n) for n in lengths) + " | prompts per cell |")
            out.append("|---" * (len(lengths) + 2) + "|")
            for label, cells in rows.items():
                counts = {c["n"] for c in cells.values()}
                same = len(counts) == 1
                row = [_cell(cells[n], not same) if n in cells else "-" for n in lengths]
                out.append(f"| {label} | " + " | ".join(row) + f" | {counts.pop() if same else 'per cell'} |")
    return "\n".join(out)


def traces(directory: pathlib.Path) -> str:
    """One line per traced prompt (finished jobs and ones cut off at the deadline): right or wrong, and per layer
    where the needle was lost (the trace script's legend: K kept, k partly, N lost after stage N, w window, . dense)."""
    out = []
    # finished jobs (.json), jobs cut off at the deadline (.part on the device, .partial.json once saved in docs/)
    for path in sorted([*directory.glob("trace__*.json"), *directory.glob("trace__*.part")]):
        label = path.name.split("__")[2]
        for run in json.loads(path.read_text())["runs"]:
            out.append(f"{label:<10} {length_label(run['length']):>5} depth {run['depth']:.1f} "
                       f"{'right' if run['right'] else 'wrong'}  {run['layers']}")
    return ("\ntraces (needle in paul-graham essays)\n" + "\n".join(out)) if out else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=pathlib.Path)
    p.add_argument("--json", type=pathlib.Path, help="also write the merged cells here")
    args = p.parse_args()
    merged = load(args.dir)
    print(tables(merged))
    print(traces(args.dir))
    if args.json:
        args.json.write_text(json.dumps({"__".join(k): v for k, v in merged.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
