"""scripts/render_docs.py's renderers of `longreach eval` reports (passkey, RULER, perplexity).

  passkey FILE...            accuracy % [95% Wilson interval] per method and length (one table per haystack), the
                             prompts per cell, and the keys read per decode query where a method metered them
  ruler FILE...              score [95% interval] per method and length, one table per task
  passkey-depth LEN DIR...   right/prompts per needle depth at one length, from ladder folders (ladder_table.py)
  ppl FILE                   tail and whole-window perplexity per method and length, the tail's change
  ppl-compare A=F[,F] B=F..  perplexity per method and length side by side for two settings (e.g. bf16 vs fp8 KV)
  trace-compare A=F B=F...   needle traces side by side: per (length, depth) each setting's layers and answer
  traces DIR                 the needle-trace lines of a ladder folder, as a code block

With several files, a row's label carries the file's tag ([1], [2], ...) and the sources are listed below the table.
"""
from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import ladder_table  # noqa: E402
from render_common import ROOT, length, load, options, parse_length, sources, table  # noqa: E402


def _tag(i: int, many: bool) -> str:
    return f" [{i}]" if many else ""


def passkey(args: list[str]) -> str:
    files, _ = options(args)
    items = [load(f) for f in files]
    many = len(items) > 1
    merged: dict = {}
    reads: dict = {}
    for i, (_, report) in enumerate(items, 1):
        hay = report.get("haystack", "filler")
        for label, m in report["methods"].items():
            row = merged.setdefault(("passkey", hay, label + _tag(i, many)), {})
            for cell in m["cells"]:
                c = row.setdefault(cell["length"], {"correct": 0, "n": 0})
                c["correct"] += bool(cell["correct"])
                c["n"] += 1
            if m.get("decode_reads"):
                reads[label + _tag(i, many)] = {int(n): r for n, r in m["decode_reads"].items() if r}
    out = ladder_table.tables(merged).strip("\n") + "\n"
    if reads:
        lens = sorted({n for r in reads.values() for n in r})
        rows = [[label] + [f"{r[n]['keys_per_query']:,.0f} ({100 * r[n]['share']:.1f}%)" if n in r and
                           r[n].get("keys_per_query") is not None else "-" for n in lens]
                for label, r in reads.items()]
        out += "\nkeys read per decode query (share of the context), where metered\n\n" + table(
            ["method"] + [length(n) for n in lens], rows)
    return out + sources(items, many)


def ruler(args: list[str]) -> str:
    files, _ = options(args)
    items = [load(f) for f in files]
    many = len(items) > 1
    merged: dict = {}
    for i, (_, report) in enumerate(items, 1):
        for label, m in report["methods"].items():
            for task, cells in m["tasks"].items():
                row = merged.setdefault(("ruler", task, label + _tag(i, many)), {})
                for n, cell in cells.items():
                    row[int(n)] = {"score": cell["score"], "n": cell["n"]}
    return ladder_table.tables(merged).strip("\n") + "\n" + sources(items, many)


def passkey_depth(args: list[str]) -> str:
    """Right answers out of the prompts at each depth, one length, every passkey job of the ladder folders."""
    (at, *dirs), _ = options(args)
    n = parse_length(at)
    rows: dict = {}
    depths: set = set()
    for i, d in enumerate(dirs, 1):
        folder = ROOT / d
        if not folder.is_dir():
            raise ValueError(f"{d} is not a folder of results")
        for path in sorted(folder.glob("passkey__*__*__*.json")):
            _, hay, label, _ = path.stem.split("__")
            for m in json.loads(path.read_text())["methods"].values():
                for cell in m["cells"]:
                    if cell["length"] == n:
                        c = rows.setdefault(f"{label} ({hay}) [{i}]", {}).setdefault(cell["depth"], [0, 0])
                        c[0] += bool(cell["correct"])
                        c[1] += 1
                        depths.add(cell["depth"])
    ds = sorted(depths)
    body = [[label] + [f"{c[d][0]}/{c[d][1]}" if d in c else "-" for d in ds] for label, c in rows.items()]
    notes = "\n".join(f"- [{i}] `{d}`" for i, d in enumerate(dirs, 1))
    return f"passkey at {length(n)}, right/prompts per needle depth\n\n" + table(
        ["method (haystack)"] + [str(d) for d in ds], body) + "\nFrom:\n" + notes + "\n"


def ppl(args: list[str]) -> str:
    (f,), _ = options(args)
    path, report = load(f)
    return ppl_table(report) + sources([(path, report)])


def ppl_table(report: dict) -> str:
    """Rows: each method's tail PPL (the same last tokens at every length: eval/ppl.py's windows end together),
    its change from the method's first measured length, and its whole-window PPL; `-` where a length was skipped."""
    lengths = report["lengths"]
    rows = []
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for method, cells in report["methods"].items():
        got = [cells.get(str(n)) or {} for n in lengths]
        tails = [c.get("ppl_tail") for c in got]
        first = next((t for t in tails if t is not None), None)
        rows.append([f"{method}, tail PPL"] + [fmt(t) for t in tails])
        if first is not None and sum(t is not None for t in tails) > 1:
            rows.append([f"{method}, tail change"] + [
                "-" if t is None else f"{(t / first - 1) * 100:+.1f}%" for t in tails])
        rows.append([f"{method}, whole-window PPL"] + [fmt(c.get("ppl_all")) for c in got])
    tail = report.get("tail")
    windows = len(report["windows"]["ends"]) if report.get("windows") else "?"
    return table(["method"] + [length(n) for n in lengths], rows) + (
        f"\nTail: the last {tail:,} tokens, the same tokens at every length; text `{report.get('text')}`, "
        f"{windows} window(s) per length.\n")


def ppl_compare(args: list[str]) -> str:
    """Perplexity side by side for settings named on the block (`bf16=F1,F2 fp8=F3,F4`): rows (method, length)."""
    _, named = options(args)
    if len(named) != 2:
        raise ValueError("ppl-compare takes two settings, NAME=FILE[,FILE...] each")
    (a, fa), (b, fb) = named.items()
    cells: dict = {}
    items = []
    for side, files in ((0, fa), (1, fb)):
        for f in files.split(","):
            path, report = load(f)
            items.append((path, report))
            for method, per in report["methods"].items():
                for n, c in per.items():
                    if c and c.get("ppl_all") is not None:
                        cells.setdefault((method, int(n)), [None, None])[side] = c
    rows = []
    for (method, n), (x, y) in cells.items():
        def change(key):
            return "-" if not (x and y) else f"{(y[key] / x[key] - 1) * 100:+.1f}%"
        rows.append([f"{method}, {length(n)}"] + [f"{c[k]:.3f}" if c else "-" for k, c in (("ppl_all", x),
                                                                                           ("ppl_all", y))]
                    + [change("ppl_all")] + [f"{c['ppl_tail']:.3f}" if c else "-" for c in (x, y)]
                    + [change("ppl_tail")])
    head = ["method, window", f"PPL {a}", f"PPL {b}", "change", f"tail {a}", f"tail {b}", "change"]
    return table(head, rows) + sources(items, True)


def trace_compare(args: list[str]) -> str:
    """Needle traces (scripts/passkey_needle_trace.py) side by side: per (length, depth), each setting's per-layer
    string and its answer."""
    _, named = options(args)
    items, runs = [], {}
    for name, f in named.items():
        path, report = load(f)
        items.append((path, report))
        for r in report["runs"]:
            runs.setdefault((r["length"], r["depth"]), {})[name] = r
    rows = [[f"{length(n)}, {d}"] + [x for name in named for x in
                                     ((f"`{c[name]['layers']}`", "right" if c[name]["right"] else "wrong")
                                      if name in c else ("-", "-"))]
            for (n, d), c in sorted(runs.items())]
    head = ["length, depth"] + [x for name in named for x in (name, "answer")]
    return table(head, rows) + sources(items, True)


def traces(args: list[str]) -> str:
    """ladder_table.py's trace lines of a ladder folder (finished and cut-off jobs), as a code block."""
    (d,), _ = options(args)
    folder = ROOT / d
    if not folder.is_dir():
        raise ValueError(f"{d} is not a folder of results")
    lines = ladder_table.traces(folder).strip("\n").splitlines()[1:]
    return "```\n" + "\n".join(lines) + "\n```\n"


RENDERERS = {"passkey": passkey, "ruler": ruler, "passkey-depth": passkey_depth, "ppl": ppl, "ppl-compare": ppl_compare,
             "trace-compare": trace_compare, "traces": traces}
