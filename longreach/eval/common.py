"""What every `longreach eval` command shares: method arguments, one engine per method, JSON out, plots.

Importing this module imports no torch (the CLI builds its parser from it).
"""
from __future__ import annotations

import argparse
import json
import sys


def add_method_args(p: argparse.ArgumentParser, default_methods: tuple[str, ...] = ("dense", "infinitehip")) -> None:
    """--model, --attention METHOD[:PRESET]..., --preset, --attention-config, --device, --dtype, --out, --plot."""
    p.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    p.add_argument("--attention", nargs="+", default=list(default_methods), metavar="METHOD[:PRESET]",
                   help=f"methods to run side by side (default: {' '.join(default_methods)}); e.g. dense "
                        "infinitehip:3k hip streaming")
    p.add_argument("--preset", default=None, help="preset for methods given without one")
    p.add_argument("--attention-config", default=None, metavar="JSON",
                   help="config overrides: a JSON object applied to every sparse method, or one keyed by method name "
                        "or method:preset, e.g. '{\"infinitehip\": {\"attend_rope\": \"none\"}}'")
    p.add_argument("--device", default="auto", help="device (default: auto)")
    p.add_argument("--dtype", default="auto", help="dtype (default: auto = bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--out", default=None, metavar="PATH", help="also write the JSON report here")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the figure here (default: next to --out, or none)")


def parse_methods(items: list[str], default_preset: str | None = None) -> list[tuple[str, str | None]]:
    """["dense", "infinitehip:3k", "hip"] -> [("dense", None), ("infinitehip", "3k"), ("hip", default_preset)]."""
    from ..attention.registry import check_backend_name

    out = []
    for item in items:
        name, _, preset = item.partition(":")
        check_backend_name(name)
        out.append((name, preset or (default_preset if name != "dense" else None)))
    if len(set(out)) != len(out):
        raise ValueError(f"--attention lists a method twice: {items}")
    return out


def method_label(name: str, preset: str | None) -> str:
    return f"{name}:{preset}" if preset else name


def make_llm(model: str, name: str, preset: str | None, attention_config: str | None, device: str, dtype: str,
             max_model_len: int, **engine_kwargs):
    """An `LLM` for one method; `attention_config` is the eval-wide option (see `recall.config_for`)."""
    from ..engine.llm import LLM
    from .recall import config_for

    cfg = config_for(name, preset, attention_config) if name != "dense" else None
    return LLM(model, attention=name, preset=preset, attention_config=cfg, device=device, dtype=dtype,
               max_model_len=max_model_len, **engine_kwargs)


def emit(report: dict, path: str | None) -> None:
    """Print the report as JSON on stdout and also write it to `path`."""
    out = json.dumps(report, indent=1)
    print(out)
    if path:
        with open(path, "w") as f:
            f.write(out)


def plot_path(args: argparse.Namespace) -> str | None:
    """--plot, else --out with .png instead of .json, else None."""
    if args.plot:
        return args.plot
    if args.out:
        return (args.out[:-5] if args.out.endswith(".json") else args.out) + ".png"
    return None


def note(msg: str) -> None:
    print(f"[longreach] {msg}", file=sys.stderr, flush=True)
