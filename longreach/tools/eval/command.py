"""`longreach eval`: recall and agreement's flags and runs here; passkey, ruler and ppl keep theirs in their own
modules (each: HELP, DESCRIPTION, add_arguments(parser), main(args) -> int). Importing this module imports no torch."""
from __future__ import annotations

import importlib
import sys

HELP = "quality evaluations (JSON out)"
DESCRIPTION = "Quality evaluations."
_EVAL_COMMANDS = ("passkey", "ruler", "ppl")  # modules beside this one


def add_arguments(p) -> None:
    esub = p.add_subparsers(dest="eval", metavar="EVAL", required=True)
    r = esub.add_parser(
        "recall", help="how much exact attention a sparse method keeps, on a model's real queries and keys",
        description="Run the model densely on a text, capture its queries and keys, and measure for each method the "
                    "attention-mass recall, top-k key recall and output error of its selection, per layer. Prints "
                    "JSON.")
    _add_common(r)
    r.add_argument("--queries", type=int, default=256, help="evaluate the last N query positions (default: 256)")
    a = esub.add_parser(
        "agreement", help="greedy continuations of a long prompt: each method against dense",
        description="Generate greedily after a long prompt with dense attention and with each method; report how "
                    "many generated tokens agree with dense and where they first differ. Prints JSON.")
    _add_common(a)
    a.add_argument("--new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    for name in _EVAL_COMMANDS:
        mod = importlib.import_module(f".{name}", __package__)
        e = esub.add_parser(name, help=mod.HELP, description=mod.DESCRIPTION)
        mod.add_arguments(e)


def main(args) -> int:
    run = {"recall": _recall, "agreement": _agreement}.get(args.eval)
    return run(args) if run else importlib.import_module(f".{args.eval}", __package__).main(args)


def _add_common(r) -> None:
    r.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file", metavar="PATH", help="text to read")
    src.add_argument("--text-source", choices=["paul-graham"], help="a built-in text (from the RULER data package)")
    r.add_argument("--length", type=int, required=True, help="context length in tokens")
    r.add_argument("--attention", nargs="+", required=True, metavar="METHOD[:PRESET]",
                   help="methods to evaluate, e.g. infinitehip:3k hip quest streaming dense")
    r.add_argument("--preset", default=None, help="preset for methods given without one")
    r.add_argument("--attention-config", default=None, metavar="JSON",
                   help="config overrides: a JSON object applied to every method, or one keyed by method name or "
                        "method:preset, e.g. "
                        "'{\"infinitehip\": {\"exact_below\": 0}, \"quest\": {\"budget\": 1024}}'")
    r.add_argument("--device", default="auto", help="device (default: auto)")
    r.add_argument("--dtype", default="float32", help="dtype (default: float32)")
    r.add_argument("--out", default=None, help="also write the JSON here")


def _inputs(args):
    """(text, [RunSpec]) from the shared recall / agreement arguments."""
    from .common import parse_methods
    from .data import TEXT_SOURCES, read_text_file

    methods = parse_methods(args.attention, args.preset, args.attention_config)
    if args.text_file:
        return read_text_file(args.text_file), methods
    return TEXT_SOURCES[args.text_source](), methods


def _recall(args) -> int:
    from ..report import samples
    from .common import emit
    from .recall import run

    text, methods = _inputs(args)
    report = run(args.model, text, args.length, methods, args.attention_config, args.queries, args.device, args.dtype)
    emit(report, args.out, args, samples(args.queries, "method x layer", "query rows (the prompt's last)"))
    def keys(v):  # keys read per query over every layer, row and head: a mass threshold (psa) spreads them
        d = v["keys_per_query"]["all_layers"]
        return f"{d['mean']:.0f} keys/query (p50 {d['p50']:.0f}, p90 {d['p90']:.0f}, max {d['max']:.0f})"
    summary = ", ".join(f"{k}: mass {v['mean']['mass_recall']:.4f}, top-k {v['mean']['topk_recall']:.4f}, {keys(v)}"
                        for k, v in report["methods"].items())
    print(f"[longreach] recall at {args.length} tokens: {summary}", file=sys.stderr)
    return 0


def _agreement(args) -> int:
    from ..report import samples
    from .agreement import run
    from .common import emit

    text, methods = _inputs(args)
    report = run(args.model, text, args.length, args.new_tokens, methods, args.attention_config, args.device,
                 args.dtype)
    emit(report, args.out, args, samples(1, "method", f"prompt ({args.new_tokens} greedy tokens)"))
    summary = ", ".join(f"{k}: {v['tokens_equal']}/{args.new_tokens} equal" for k, v in report["methods"].items()
                        if "tokens_equal" in v)
    print(f"[longreach] greedy agreement with dense after {args.length - args.new_tokens} tokens: {summary}",
          file=sys.stderr)
    return 0
