"""`longreach calibrate crossover`: where a sparse method's decode step starts beating dense attention's, measured
through the whole engine and written to the file `"dense_below_decode": "auto"` reads (attention/sparse/crossover.py).

    longreach calibrate crossover --model M --attention METHOD[:PRESET] [--lengths 4k 8k ...] [--attention-config J]

At each length (default: 4K, 8K, ... doubling, and the trained context, up to it) one engine runs dense and one runs
the method with `dense_below` and `dense_below_decode` 0 (sparse at every length), in this process, one after the
other; each prefills one prompt of that length and decodes --decode-tokens tokens. The time of a step is
`bench decode`'s (bench/decode.py `_measure`: warm-up prompt, steps timed between synchronisations, CUDA-graph
captures and compilations left out): the median decode step. Whole-engine steps, not one attention layer: the fixed
costs that decide the crossover (selection launches, graph variants) are outside the kernel. The crossover is the
smallest length from which the method stays faster (`crossover_length`). Prefill's crossover is not measured (prefill
keeps `dense_below`). The file goes to <cache>/crossover/ (or --out-dir); a table is printed.

On a CPU the command refuses (exit 2): CPU step times say nothing about a GPU's crossover. `--allow-cpu` (hidden)
lets tests and a dry run through.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

HELP = "measure where sparse decode beats dense (the file dense_below_decode \"auto\" reads)"
DESCRIPTION = ("Time whole-engine decode steps of dense attention and of a sparse method at each context length (one "
               "process, bench decode's timing), pick the smallest length from which the method stays faster, and "
               "write it with the step times to the crossover file that \"dense_below_decode\": \"auto\" reads. "
               "Needs a GPU.")


def add_arguments(p) -> None:
    from ..eval.common import context_length

    p.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    p.add_argument("--attention", required=True, metavar="METHOD[:PRESET]",
                   help="the sparse method (one with dense_below_decode: infinitehip, hip, quest, streaming)")
    p.add_argument("--attention-config", default=None, metavar="JSON", help="overrides of the method's config")
    p.add_argument("--lengths", nargs="+", type=context_length, default=None, metavar="N",
                   help="context lengths, e.g. 4k 8k 32k (default: 4K doubling, and the trained context, up to it)")
    p.add_argument("--decode-tokens", type=int, default=64, help="decode steps per run (default: 64)")
    p.add_argument("--device", default="auto", help="device (default: auto)")
    p.add_argument("--dtype", default="auto", help="dtype (default: auto)")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype (default: auto)")
    p.add_argument("--out-dir", default=None, metavar="DIR",
                   help="write the file here instead of the crossover cache (the engine reads only the cache)")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # tests, dry runs


def default_lengths(trained: int, start: int = 4096) -> list[int]:
    """4K, 8K, ... doubling up to the trained context, and the trained context itself."""
    out, n = [], start
    while n < trained:
        out.append(n)
        n *= 2
    return out + [trained]


def measure(lengths: list[int], step_s: Callable[[int, str], float]) -> dict:
    """Dense's and the method's decode step seconds at each length (`step_s(length, "dense" | "method")`), and the
    crossover."""
    from ...attention.sparse.crossover import crossover_length

    lengths = sorted(set(lengths))
    dense, method = [], []
    for n in lengths:
        dense.append(step_s(n, "dense"))
        method.append(step_s(n, "method"))
    return {"lengths": lengths, "dense_step_s": dense, "method_step_s": method,
            "crossover": crossover_length(lengths, dense, method)}


def format_table(result: dict, label: str) -> str:
    rows = [f"{'context':>9} {'dense ms':>9} {label + ' ms':>{max(9, len(label) + 3)}} {'speed-up':>8}"]
    for n, d, m in zip(result["lengths"], result["dense_step_s"], result["method_step_s"]):
        rows.append(f"{n:>9} {1e3 * d:>9.2f} {1e3 * m:>{max(9, len(label) + 3)}.2f} {d / m:>7.2f}x")
    c = result["crossover"]
    rows.append(f"crossover: {c if c is not None else 'none (the method is not faster at the longest length)'}")
    return "\n".join(rows)


def _engine_step(model: str, spec, overrides: dict | None, kwargs: dict, decode_tokens: int, state: dict
                 ) -> Callable[[int, str], float]:
    """step_s(length, side): the median decode step seconds of one bench-decode run (bench/decode.py `_measure`)."""
    from ...engine.llm_engine import resolve_device, resolve_dtype
    from ..eval.common import RunSpec
    from .decode import _measure
    from .decode_memory import _kv_budget_gb, _kv_need_bytes

    device = resolve_device(kwargs["device"])
    run_dtype = resolve_dtype(kwargs["dtype"], device)

    def step_s(length: int, side: str) -> float:
        kw = dict(kwargs)
        if side == "dense":
            run = RunSpec("dense", None, "dense")
        else:
            run, kw["attention_config"] = spec, overrides
        if device.type == "cuda":  # the KV sized to the context (as bench decode), not to the free memory
            kw["kv_cache_memory_gb"] = _kv_budget_gb(_kv_need_bytes(state["model_config"], length, decode_tokens, 1,
                                                                    kw, run_dtype))
        row = _measure(model, length, run, kw, 1, decode_tokens, 0, state)
        if row["step_s_median"] is None:
            raise RuntimeError(f"{run.label} at {length}: no decode step counted (raise --decode-tokens)")
        return row["step_s_median"]
    return step_s


def main(args, step_s: Callable[[int, str], float] | None = None) -> int:
    """The command; `step_s` replaces the engine timing (tests)."""
    from ...attention.registry import MethodSpec, get_backend_class
    from ...attention.sparse import crossover
    from ...config import EngineConfig
    from ...engine.llm_engine import resolve_device
    from ...models.loader import model_config_of
    from ..eval.common import RunSpec
    from ..report import command_line, provenance

    device = resolve_device(args.device)
    if device.type != "cuda" and not args.allow_cpu:
        raise ValueError("calibrate crossover needs a GPU: step times on a CPU say nothing about where sparse decode "
                         "beats dense on a GPU")
    name, preset = MethodSpec.parse(args.attention, what="--attention")
    overrides = {**(args.attention_config or {}), "dense_below": 0, "dense_below_decode": 0}  # sparse everywhere
    engine_config = EngineConfig(model=args.model, attention=name, preset=preset, attention_config=overrides,
                                 dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    cls = get_backend_class(name)
    config = cls.resolve_config(engine_config)
    if not hasattr(config, "dense_below_decode"):
        raise ValueError(f"--attention {name}: only the top-k sparse methods have dense_below_decode "
                         f"(infinitehip, hip, quest, streaming)")
    mc = model_config_of(args.model)
    trained = mc.max_position_embeddings
    lengths = sorted(set(args.lengths or default_lengths(trained)))
    if lengths[-1] > trained:
        raise ValueError(f"--lengths: {lengths[-1]} is past the model's trained context ({trained}): dense decode "
                         "is only used inside it")
    key = crossover.key_fields(mc, cls.method_cls.name, config, engine_config, device)
    if step_s is None:
        kwargs = {"device": args.device, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}
        step_s = _engine_step(args.model, RunSpec(name, preset, args.attention), overrides, kwargs,
                              args.decode_tokens, {"model_config": mc})
    result = measure(lengths, step_s)
    record = {"key": key, **provenance(command_line(args), device), "attention": args.attention,
              "attention_config": args.attention_config, "trained": trained, "decode_tokens": args.decode_tokens,
              **result}
    path = crossover.write(record, args.out_dir)
    print(format_table(result, args.attention))
    print(f"[longreach] calibrate crossover: {path} (\"dense_below_decode\": \"auto\" decodes densely up to "
          f"{crossover.decode_limit(result, trained)} tokens)", file=sys.stderr)
    return 0
