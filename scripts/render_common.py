"""What the renderers of scripts/render_docs.py share: reading a report, naming where it came from, table text."""
from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
GiB = 1 << 30


def load(arg: str) -> tuple[pathlib.Path, dict]:
    """(path, report) of a results JSON named relative to the repository root."""
    path = ROOT / arg
    if not path.is_file():
        raise ValueError(f"{arg} is not a file")
    return path, json.loads(path.read_text())


def options(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """A block's arguments split into positional ones and KEY=VALUE options."""
    pos = [a for a in args if "=" not in a]
    return pos, dict(a.split("=", 1) for a in args if "=" in a)


def length(n: int) -> str:
    """4096 -> '4K', 1048576 -> '1M' (the docs' 1024-based lengths)."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % 1024 == 0 else str(n)


def parse_length(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text)


def num(v, spec: str = ".1f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(head: list[str], rows: list[list[str]], drop_empty: bool = False) -> str:
    """A Markdown table; `drop_empty`: leave out the columns (after the first) where every row has "-"."""
    keep = [i for i in range(len(head)) if i == 0 or not drop_empty or any(r[i] != "-" for r in rows)]
    lines = ["| " + " | ".join(head[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(r[i] for i in keep) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run_settings(report: dict) -> str:
    """The methods and settings a report ran with, from its provenance (the presets that ran) or, for a report from
    before provenance named them, its `args`/`command` (a method named without a preset ran its default of that
    commit)."""
    prov = report.get("provenance") or {}
    if prov.get("attention"):
        methods = ", ".join(f"{a['label']} = {a['method']}:{a['preset']}" if a.get("preset") and ":" not in a["label"]
                            else a["label"] for a in prov["attention"])
        config = prov.get("attention_config")
    else:
        args = report.get("args") or {}
        methods = " ".join(args.get("attention") or []) or None
        if methods and args.get("preset"):
            methods += f" (preset {args['preset']})"
        config = _used(args.get("attention_config"), args.get("attention") or [])
        if methods is None and report.get("command"):
            return f"`{report['command']}`"
        if methods is None and report.get("server_version"):
            v = report["server_version"]
            return f"the server's attention {v.get('attention')}, preset {v.get('preset') or 'its default'}"
    parts = [f"methods {methods}" if methods else None,
             f"--attention-config `{config if isinstance(config, str) else json.dumps(config)}`" if config else None]
    return "; ".join(p for p in parts if p) or "settings not recorded"


def _used(config, labels: list[str]):
    """A keyed --attention-config cut to the entries the report's methods read (one config text often served several
    runs); a flat one, or one that is not JSON, as it is."""
    try:
        parsed = json.loads(config) if isinstance(config, str) else config
    except ValueError:
        return config
    if not isinstance(parsed, dict) or not all(isinstance(v, dict) for v in parsed.values()):
        return config
    names = {x for label in labels for x in (label, label.partition("@")[0], label.partition("@")[0].partition(":")[0],
                                               label.partition("+")[2].partition("@")[0].partition(":")[0])} - {""}
    return {k: v for k, v in parsed.items() if k in names or k.partition(":")[0] in names} or None


def source(path: pathlib.Path, report: dict) -> str:
    """One line naming a report: file, device, date, commit, and what ran."""
    prov = report.get("provenance") or {}
    device = prov.get("device") or prov.get("gpu") or report.get("gpu") or report.get("device") or \
        "device not recorded"
    date = str(prov.get("date") or report.get("date") or "")[:10] or "date not recorded"
    commit = prov.get("commit") or "not recorded"
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"`{name}`: {device}, {date}, commit {commit}; {run_settings(report)}"


def sources(items: list[tuple[pathlib.Path, dict]], tags: bool = False) -> str:
    """The source lines of a table's reports, tagged [1], [2], ... where rows name them."""
    if len(items) == 1 and not tags:
        return "\nFrom " + source(*items[0]) + ".\n"
    return "\nFrom:\n" + "\n".join(f"- [{i}] {source(p, r)}." for i, (p, r) in enumerate(items, 1)) + "\n"
