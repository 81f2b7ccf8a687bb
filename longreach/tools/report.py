"""Where a number in a results JSON comes from: the one provenance record every lab command writes.

Every JSON the lab writes (`longreach eval ...`, `longreach bench ...`, `longreach calibrate`, the GPU tests' report)
carries a `provenance` object made here:

    {"command": "longreach eval passkey --lengths 8k ...",   # the command line, argv joined (shlex)
     "commit": "d6f5ee7+dirty",      # git short hash (+dirty: uncommitted changes), else $LONGREACH_COMMIT
     "device": "NVIDIA H200",        # the GPU's name, or "cpu"
     "date": "2026-11-26T10:12:03+00:00", "longreach": "0.x", "torch": "2.x",
     "attention": [{"label": "infinitehip", "method": "infinitehip", "preset": "3k-box", "attention_config": null,
                    "config": {...the method's resolved config...}}, ...],   # where the command runs methods
     "attention_config": ...,        # the command's --attention-config, as given
     "samples": {"n": 20, "per": "method x length", "unit": "prompts"}}      # where the numbers are per-cell means

`preset` is the preset that ran: the one named, else the method's default at that commit, so a table can check that
a row labelled `3k-box` came from `3k-box`. A value that is not a measurement of its own is marked where it sits:
`"extrapolated": [fields]` or `"estimated": [fields]` on its record (bench decode's dense column beyond the dense
runs, bench attention's approximate key counts), and rates say which steps they count (`steps_counted`,
`steps_excluded`). Importing this module imports no torch.
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys


def command_line(args=None, prefix: str = "longreach") -> str:
    """The command as typed: `prefix` + the argv the CLI saw (`args.argv`, cli.py), else this process's argv."""
    argv = getattr(args, "argv", None)
    return shlex.join([prefix, *(sys.argv[1:] if argv is None else argv)])


def commit() -> str | None:
    """The git short hash of the tree this package runs from, "+dirty" with uncommitted changes to tracked files;
    $LONGREACH_COMMIT wins (a machine without the repository: scripts/device_model.sh sets it). None if neither."""
    env = os.environ.get("LONGREACH_COMMIT")
    if env:
        return env
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # longreach/tools/
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device=None) -> str:
    """"cpu", or the GPU's name for a CUDA device (a torch.device or text such as "cuda:0"); None: this process's
    GPU if torch sees one (without initialising CUDA when torch is not imported yet), else "cpu"."""
    text = None if device is None else str(device)
    if text is not None and not text.startswith("cuda"):
        return text.split(":")[0]
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return "cpu"
    try:
        if not torch.cuda.is_available():
            return "cpu"
        return torch.cuda.get_device_name(torch.device(text) if text else None)
    except (RuntimeError, AssertionError):
        return "cpu"


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def attention_record(method: str, preset: str | None = None, overrides: dict | None = None,
                     label: str | None = None, decode: str | None = None,
                     decode_overrides: dict | None = None, model: str | None = None) -> dict:
    """What ran as one method: its label, name, the preset that ran (the named one, else the method's default),
    the overrides applied, and the resolved config (the preset with the overrides: what the numbers depend on, even
    after a default changes). `decode`: the method of the decode steps of a composed run ("A+B"). `model`: the
    model that ran, for a config that depends on it (MInference's shipped patterns of a model run by its alias)."""
    record = {"label": label or (f"{method}:{preset}" if preset else method), "method": method,
              "preset": preset or default_preset(method), "attention_config": _jsonable(overrides),
              "config": resolved_config(method, preset, overrides, model)}
    if decode:
        from ..attention.registry import MethodSpec

        name, dpreset = MethodSpec.parse(decode)
        record["decode"] = attention_record(name, dpreset, decode_overrides, label=decode, model=model)
    return record


def default_preset(method: str) -> str | None:
    """The preset a method runs when none is named (None: the method has no presets)."""
    import importlib

    from ..attention.registry import get_backend_class

    cls = get_backend_class(method)
    found = getattr(getattr(cls, "method_cls", None), "default_preset", None)
    return found or getattr(importlib.import_module(cls.__module__), "DEFAULT_PRESET", None)


def resolved_config(method: str, preset: str | None, overrides: dict | None, model: str | None = None
                    ) -> dict | None:
    """The method's config as the engine resolves it (None: the method has none, or it cannot be resolved here).
    With `model`, as an engine of that model resolves it: a backend whose `resolve_config` takes `by_alias` (a config
    that follows the model: MInference's shipped patterns) gets it, as the engine's own check does."""
    import dataclasses
    import inspect

    from ..attention.registry import get_backend_class
    from ..config import EngineConfig

    try:
        cls = get_backend_class(method)
        ec = EngineConfig(attention=method, preset=preset, attention_config=overrides,
                          **({"model": model} if model else {}))
        by_alias = model is not None and "by_alias" in inspect.signature(cls.resolve_config).parameters
        cfg = cls.resolve_config(ec, by_alias=True) if by_alias else cls.resolve_config(ec)
    except (ValueError, TypeError):
        return None
    if cfg is None:
        return None
    return _jsonable(dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg)


def provenance(command: str | None = None, device=None, *, attention: list[dict] | None = None,
               attention_config=None, samples: dict | None = None, **extra) -> dict:
    """The provenance record (module docstring). `command`: the command line (default: this process's argv after
    "longreach"); `device`: where the numbers were measured (default: this process's GPU, else "cpu");
    `attention`: `attention_record`s of the methods run; `samples`: {"n", "per", "unit"} of a cell; `extra`: more
    fields of the command's own (they may not replace the common ones)."""
    from .. import __version__

    record = {"command": command or command_line(), "commit": commit(), "device": device_name(device),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "longreach": __version__,
              "torch": getattr(sys.modules.get("torch"), "__version__", None)}
    if attention is not None:
        record["attention"] = attention
    if attention_config is not None:
        record["attention_config"] = _jsonable(attention_config)
    if samples is not None:
        record["samples"] = samples
    clash = set(extra) & set(record)
    if clash:
        raise ValueError(f"provenance: {sorted(clash)} are common fields, not a command's own")
    return {**record, **extra}


def samples(n: int, per: str, unit: str) -> dict:
    """How many samples make one cell of a report: {"n": 20, "per": "method x length", "unit": "prompts"}."""
    return {"n": n, "per": per, "unit": unit}


def write_json(report: dict, path: str | None, indent: int = 1) -> None:
    """Write `report` to `path` (its folder made if missing); nothing when `path` is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=indent)
