"""What every `longreach eval` command shares: method arguments, one engine per method, JSON out, plots.

Importing this module imports no torch (the CLI builds its parser from it).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import NamedTuple


def add_share_prefill_arg(p: argparse.ArgumentParser) -> None:
    """--share-prefill (eval ruler, eval passkey): decode-only variants of one method from one prefill per prompt."""
    p.add_argument("--share-prefill", action="store_true",
                   help="the --attention runs are one sparse method differing only in decode-time fields (e.g. "
                        "infinitehip's refresh, lookahead): prefill each prompt once and decode it under each run "
                        "(same predictions as separate runs, a fraction of the time; not with KV offloading)")


def add_method_args(p: argparse.ArgumentParser, default_methods: tuple[str, ...] = ("dense", "infinitehip")) -> None:
    """--model, --attention METHOD[:PRESET]..., --preset, --attention-config, --device, --dtype,
    --kv-cache-memory-gb, --kv-cache-dtype, --kv-offloading-size, --quantization, --rope-scaling,
    --max-num-batched-tokens, --enforce-eager, --cpu-threads, --out, --plot."""
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
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, metavar="GB",
                   help="KV cache size per engine (default: the engine's, most of the free GPU memory); set it to run "
                        "several evals on one GPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float16", "fp8"),
                   help="KV cache element type (default: auto, the run dtype); fp8 = e4m3 with per-token scales")
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                   help="host-memory tier of the KV cache (default: none); --kv-cache-memory-gb is then the GPU tier")
    p.add_argument("--quantization", default=None, choices=("fp8",),
                   help="weights of every method's engine: fp8 = the decoder's linear layers in float8 e4m3 with a "
                        "scale per output channel (default: the run dtype); run the eval with and without it to "
                        "compare the two")
    p.add_argument("--rope-scaling", default=None, metavar="JSON",
                   help="override the model's RoPE scaling for every method, e.g. '{\"rope_type\": \"yarn\", "
                        "\"factor\": 4}' (dense + YaRN: what users try first past the trained length)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N",
                   help="prefill chunk size (default: 8192)")
    p.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="torch threads on a CPU (default: auto, from the cores other processes leave free)")
    p.add_argument("--out", default=None, metavar="PATH", help="also write the JSON report here")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the figure here (default: next to --out, or none)")


class RunSpec(NamedTuple):
    """One method run an eval makes: backend name, preset (None = the method's default) and the label it is reported
    under. The label is `name[:preset][+decode][@variant]`; a variant is a named entry of --attention-config, so one
    method can run several times with different settings. `decode`: another method for the decode steps,
    METHOD[:PRESET] (`minference+infinitehip:3k`: minference prefill, infinitehip decode; attention/compose.py)."""

    name: str
    preset: str | None
    label: str
    decode: str | None = None


def parse_methods(items: list[str], default_preset: str | None = None, attention_config: dict | str | None = None
                  ) -> list[RunSpec]:
    """["dense", "infinitehip:3k", "infinitehip@no-rope", "hip"] -> RunSpecs (presets default to
    `default_preset`; dense has none), each checked with its share of `attention_config` (the command's
    --attention-config, parsed) before any model loads. A key of a keyed object that no listed method would read is
    an error, not silently ignored. The evaluation presets (presets.py) are registered first."""
    from ...attention.registry import MethodSpec
    from .presets import register

    register()
    attention_config = eval_config(attention_config)

    out = []
    for item in items:
        base, _, variant = item.partition("@")
        base, _, decode = base.partition("+")
        name, preset = MethodSpec.parse(base)  # check_spec checks presets, naming the run
        if decode:
            MethodSpec.parse(decode, what="the decode method after '+'")
        preset = preset or (default_preset if name != "dense" else None)
        label = (f"{name}:{preset}" if preset else name) + (f"+{decode}" if decode else "") + \
            (f"@{variant}" if variant else "")
        out.append(RunSpec(name, preset, label, decode or None))
    labels = [m.label for m in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--attention lists a method twice: {labels}; give repeats a variant, e.g. infinitehip@v2")
    check_config_keys(out, attention_config)
    for spec in out:
        check_spec(spec, attention_config)
    return out


def check_spec(spec: RunSpec, attention_config: dict | None) -> None:
    """Raise ValueError, naming the method, when its preset or overrides (or its decode method's) are not ones it
    accepts: an eval checks every method it will run before it loads a model for the first."""
    from ...config import EngineConfig

    try:
        EngineConfig(attention=spec.name, preset=spec.preset, attention_config=method_config(spec, attention_config),
                     **decode_kwargs(spec, attention_config))
    except ValueError as e:
        raise ValueError(f"{spec.label}: {e}") from None


def decode_spec(spec: RunSpec) -> RunSpec | None:
    """The decode side of a composed spec as a spec of its own: "infinitehip+psa:0.9@x" -> psa, preset 0.9, label
    "psa:0.9@x" (its --attention-config entry may be keyed "psa:0.9@x", "psa:0.9" or "psa"); None if not composed."""
    if not spec.decode:
        return None
    from ...attention.registry import MethodSpec

    name, preset = MethodSpec.parse(spec.decode)
    variant = spec.label.partition("@")[2]
    return RunSpec(name, preset, spec.decode + (f"@{variant}" if variant else ""))


def _config_keys(spec: RunSpec) -> tuple[str, ...]:
    """The keys of a keyed --attention-config that `method_config` tries for `spec`, most specific first."""
    return (spec.label, f"{spec.name}:{spec.preset}", spec.name)


def _keyed(parsed: dict) -> bool:
    from ...attention.registry import available_backends

    return bool(parsed) and all(k.partition("@")[0].partition(":")[0].partition("+")[0] in available_backends()
                                for k in parsed)


def eval_config(attention_config: dict | str | None) -> dict | None:
    """The eval-wide --attention-config as a dict (None: none): the CLI passes the dict it parsed; JSON text from a
    Python caller is parsed here (config.config_dict, which says what is wrong with anything else)."""
    if attention_config is None or isinstance(attention_config, dict):
        return attention_config
    from ...config import config_dict

    return config_dict(attention_config, "--attention-config")


def check_config_keys(specs: list[RunSpec], attention_config: dict | None) -> None:
    """Refuse a keyed --attention-config's run-specific keys (a label: "psa@e50", "infinitehip+psa") that no method
    in `specs` reads — a typo, or a variant's entry under a name its run never looks up — naming the keys each
    method does read. Entries by method name or "method:preset" may sit unread: one config can serve runs of
    different method lists."""
    parsed = eval_config(attention_config)
    if not parsed or not _keyed(parsed):
        return
    read: dict[str, str] = {}
    for spec in specs:
        if spec.name == "dense":
            continue
        for s in (spec, decode_spec(spec)):
            if s is not None:
                for key in _config_keys(s):
                    read.setdefault(key, spec.label)
    unused = [k for k in parsed if k not in read and ("@" in k or "+" in k)]
    if unused:
        wants = "; ".join(f"{spec.label}: " + ", ".join(
            k for s in (spec, decode_spec(spec)) if s is not None for k in _config_keys(s) if "None" not in k)
            for spec in specs if spec.name != "dense")
        raise ValueError(f"--attention-config has labelled entries no method reads: {', '.join(map(repr, unused))}. "
                         f"Each method reads the first of these keys that is present: "
                         f"{wants or 'none (dense only)'}")


def method_config(spec: RunSpec, attention_config: dict | None) -> dict | None:
    """The overrides for one method from the eval-wide --attention-config (a dict): a flat object applies to every
    sparse method; an object keyed by labels ("infinitehip@no-rope"), "method:preset" or method names gives each its
    own (the most specific key wins)."""
    parsed = eval_config(attention_config)
    if parsed is None or spec.name == "dense":
        return None
    if not _keyed(parsed):
        return parsed
    for key in _config_keys(spec):
        if key in parsed:
            if not isinstance(parsed[key], dict):
                raise ValueError(f"--attention-config entry {key!r} must be a JSON object, got "
                                 f"{json.dumps(parsed[key])}")
            return parsed[key]
    return None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags of `add_method_args`, as `LLM` keyword arguments."""
    return {"kv_cache_memory_gb": args.kv_cache_memory_gb, "kv_cache_dtype": args.kv_cache_dtype,
            "kv_offloading_size": args.kv_offloading_size, "quantization": args.quantization,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "rope_scaling": args.rope_scaling, "enforce_eager": args.enforce_eager, "cpu_threads": args.cpu_threads}


def decode_kwargs(spec: RunSpec, attention_config: dict | None) -> dict:
    """The engine arguments of a composed spec ("prefill+decode"): its decode method and that method's overrides
    (keyed by its name in `attention_config`); {} for a spec that is one method."""
    d = decode_spec(spec)
    if d is None:
        return {}
    return {"decode_attention": spec.decode, "decode_attention_config": method_config(d, attention_config)}


def make_llm(model: str, spec: RunSpec, attention_config: dict | None, device: str, dtype: str,
             max_model_len: int, **engine_kwargs):
    """An `LLM` running one method (`attention_config`: the eval-wide option, see `method_config`); the evaluation
    presets (presets.py) are registered first."""
    from ...engine.llm import LLM
    from .presets import register

    register()
    engine_kwargs = {**engine_kwargs, **decode_kwargs(spec, attention_config)}
    return LLM(model, attention=spec.name, preset=spec.preset, attention_config=method_config(spec, attention_config),
               device=device, dtype=dtype, max_model_len=max_model_len, **engine_kwargs)


def attention_records(specs: list[RunSpec], attention_config: dict | str | None, model: str | None = None
                      ) -> list[dict]:
    """The provenance's record of each method run (tools/report.py): the preset that ran, its overrides and its
    config as an engine of `model` resolves it."""
    from ..report import attention_record

    attention_config = eval_config(attention_config)
    out = []
    for spec in specs:
        d = decode_spec(spec)
        out.append(attention_record(spec.name, spec.preset, method_config(spec, attention_config), spec.label,
                                    spec.decode, method_config(d, attention_config) if d else None, model))
    return out


def emit(report: dict, path: str | None, args: argparse.Namespace | None = None, samples: dict | None = None
         ) -> None:
    """Print the report as JSON on stdout and also write it to `path`, with its provenance (tools/report.py): the
    command line and the methods that ran (with their presets) from `args`, the device from `report["device"]`,
    and `samples` (report.samples: what one cell of the report averages over)."""
    from ..report import command_line, provenance

    if "provenance" not in report:
        specs = parse_methods(args.attention, getattr(args, "preset", None), args.attention_config) \
            if args is not None and getattr(args, "attention", None) else None
        report["provenance"] = provenance(
            command_line(args) if args is not None else None, report.get("device"),
            attention=attention_records(specs, args.attention_config, getattr(args, "model", None)) if specs else None,
            attention_config=getattr(args, "attention_config", None), samples=samples)
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
        return args.out.removesuffix(".json") + ".png"
    return None


def note(msg: str) -> None:
    print(f"[longreach] {msg}", file=sys.stderr, flush=True)


def context_length(value: str) -> int:
    """'4096', '4k', '8K', '1M' -> tokens (k = 1024, M = 1024^2); an argparse type."""
    m = re.fullmatch(r"(\d+)([kKmM]?)", value.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a token count like 4096, 4k or 1M (k = 1024, M = 1024^2), "
                                         f"got {value!r}")
    n = int(m[1]) << {"": 0, "k": 10, "m": 20}[m[2].lower()]
    if n < 2:
        raise argparse.ArgumentTypeError(f"a context length needs at least 2 tokens (one to predict), got {value!r}")
    return n


def format_length(n: int) -> str:
    """4096 -> '4K', 1048576 -> '1M', 1000 -> '1000'."""
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % 1024 == 0 else str(n)


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval (fractions in [0, 1]) of `successes` out of `n` trials: unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0/n or n/n, which small eval cells often are.
    Fractional successes (RULER's partial-credit metrics: the sum of per-sample scores / 100) are accepted."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / d
    return max(0.0, mid - half), min(1.0, mid + half)


def reads_between(before: dict | None, after: dict | None) -> dict | None:
    """Decode reads metered between two `AttentionBackend.decode_reads()` snapshots (None when not metered):
    keys_per_query (mean over decode rows x layers x KV groups), share (of the keys their contexts held), queries."""
    if before is None or after is None:
        return None
    keys, queries, context = (after[k] - before[k] for k in ("keys", "queries", "context_keys"))
    if queries <= 0:
        return {"keys_per_query": None, "share": None, "queries": 0}
    return {"keys_per_query": round(keys / queries, 1), "share": round(keys / context, 5), "queries": int(queries)}
