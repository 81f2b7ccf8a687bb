"""`longreach bench`: the flags and runs of its benchmarks (engine, attention, long, serve, decode); the measuring
code is in the modules beside this one. Importing this module imports no torch."""
from __future__ import annotations

import importlib

from ...commands.engine_args import add_engine_args
from ...config import EngineConfig
from ..eval.common import context_length

HELP = "benchmarks (always with the baseline measured in the same run)"
DESCRIPTION = "Benchmarks. Each prints a table and saves JSON."
_DECODE_SETS = ("model", "attention", "preset", "max_model_len", "max_num_seqs")  # bench decode sets these itself


def add_arguments(p) -> None:
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    e = bsub.add_parser("engine", help="longreach vs transformers: decode tok/s, prefill tok/s, greedy agreement",
                        description="End-to-end engine benchmark against transformers on the same device.")
    e.add_argument("--model", default="smollm2", help="model for longreach (default: smollm2)")
    e.add_argument("--hf-model", default=None, metavar="PATH",
                   help="the same model for transformers: a HF directory or a .gguf file (default: --model's path)")
    e.add_argument("--device", default="cuda", help="device (default: cuda)")
    e.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32], metavar="N", help="decode batch sizes")
    e.add_argument("--new-tokens", type=int, default=256, help="tokens generated per sequence (default: 256)")
    e.add_argument("--prefill-len", type=int, default=8191, help="prompt tokens for the prefill test (default: 8191)")
    e.add_argument("--repeats", type=int, default=3, help="timed repeats, median reported (default: 3)")
    e.add_argument("--out", default="bench-engine.json", help="JSON output path (default: bench-engine.json)")

    a = bsub.add_parser("attention", help="one layer at 32K-1M tokens: sparse kernels vs cuDNN/flash SDPA (GPU)",
                        description="One Llama-3.1-8B-shaped attention layer (32/8 heads, d=128, bf16, batch 1): "
                                    "the last 32K-query prefill chunk and one decode step at each context length, "
                                    "infinitehip / hip / minference kernels against dense cuDNN and flash SDPA and "
                                    "FlexAttention.")
    a.add_argument("--contexts", type=context_length, nargs="+", default=[32768, 131072, 524288, 1048576], metavar="N",
                   help="context lengths in tokens (default: 32K 128K 512K 1M)")
    a.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement, median (default: 5)")
    a.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles for a while)")
    a.add_argument("--minference-patterns", default=None, metavar="P.json",
                   help="also run minference with the pattern mix of a calibration file for this shape (32/8 heads)")
    a.add_argument("--out", default="bench-attention.json", help="JSON output path")

    lg = bsub.add_parser("long", help="end to end at long context: a sparse backend vs dense through the engine",
                         description="Prefill a long prompt and decode through the whole engine with each attention "
                                     "backend; reports prefill seconds, decode tokens/s and the generated text.")
    lg.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    lg.add_argument("--text-file", default=None, help="text for the prompt (default: the Paul Graham essays)")
    lg.add_argument("--lengths", type=context_length, nargs="+", default=[32768, 131072], metavar="N", help="prompt tokens")
    lg.add_argument("--attention", nargs="+", default=["dense", "infinitehip:3k-fast"], metavar="METHOD[:PRESET]")
    lg.add_argument("--new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    lg.add_argument("--device", default="auto")
    lg.add_argument("--attention-config", default=None, metavar="JSON",
                    help="config overrides for every sparse method, e.g. '{\"prune_rope\": \"none\"}'")
    lg.add_argument("--eager-too", action="store_true",
                    help="also run each method without CUDA graphs (enforce_eager) and compare speed and tokens")
    lg.add_argument("--out", default="bench-long.json", help="JSON output path")

    sv = importlib.import_module(".serve", __package__)
    s = bsub.add_parser("serve", help=sv.HELP, description=sv.__doc__.split("\n\n")[0] + " " +
                        sv.__doc__.split("\n\n")[1])
    sv.add_arguments(s)

    mx = bsub.add_parser(
        "mixed", help="a long prompt's prefill beside decoding requests, offline: step times, prefill vs standalone",
        description=importlib.import_module(".mixed", __package__).__doc__.split("\n\n")[0])
    mx.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    mx.add_argument("--attention", nargs="+", default=["dense", "infinitehip"], metavar="METHOD[:PRESET]",
                    help="methods, each its own engine (default: dense infinitehip)")
    mx.add_argument("--context", type=context_length, default=131072, help="the long prompt's tokens (default: 128K)")
    mx.add_argument("--decodes", type=int, default=32, help="requests decoding beside it (default: 32)")
    mx.add_argument("--decode-prompt", type=int, default=512, help="their prompt tokens (default: 512)")
    mx.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="profile N mixed steps (from the fifth, or see --profile-at) under torch.profiler "
                         "(default: 0)")
    mx.add_argument("--profile-at", type=float, default=0.0, metavar="F",
                    help="start the profiled steps once this share of the long prompt is prefilled, 0-1 (default: "
                         "0, the fifth step; 0.9: deep in the prompt, where a sparse method selects over most of it)")
    mx.add_argument("--cprofile", action="store_true", help="also the host's Python functions over those steps")
    mx.add_argument("--prefill-graphs", choices=["on", "off", "both"], default="on",
                    help="a sparse method's prefill selection through CUDA graphs (on, where supported), eagerly "
                         "(off), or each method both ways (default: on)")
    mx.add_argument("--out", default="bench-mixed.json", help="JSON output path (default: bench-mixed.json)")
    add_engine_args(mx, skip=_DECODE_SETS)

    dc = bsub.add_parser(
        "decode", help="decode tok/s at 128K-3M tokens, 8B-shaped random model: sparse (+ KV offload) vs dense",
        description="Prefill random-token prompts of each length and decode through the whole engine with each "
                    "method: prefill seconds, decode tok/s, GPU memory split, host memory and KV offload counters, "
                    "with dense attention measured in the same run where its KV fits and extrapolated beyond. "
                    "The default model has random weights in the Llama-3.1-8B shape (no 8B checkpoint offline).")
    dc.add_argument("--model", default="random:llama-3.1-8b",
                    help="model (default: random:llama-3.1-8b; random:tiny for a CPU check)")
    dc.add_argument("--lengths", type=context_length, nargs="+", default=[131072, 524288, 1048576], metavar="N",
                    help="context lengths in tokens, e.g. 128k 1M (default: 131072 524288 1048576)")
    dc.add_argument("--attention", nargs="+", default=["infinitehip:3k-fast", "infinitehip:3k-flash"],
                    metavar="METHOD[:PRESET]", help="methods (default: infinitehip:3k-fast infinitehip:3k-flash); "
                    "PREFILL+DECODE composes two (infinitehip+psa: infinitehip prefills, psa decodes), @VARIANT names "
                    "a repeat whose --attention-config is keyed by its label (psa@waves)")
    dc.add_argument("--batch", type=int, default=1, help="sequences decoding together (default: 1)")
    dc.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per sequence (default: 128)")
    dc.add_argument("--dense-lengths", type=context_length, nargs="*", default=None, metavar="N",
                    help="contexts for the dense baseline, each tried where its KV fits on the GPU (default: "
                         "--lengths plus 4096 below them; give none to skip dense)")
    dc.add_argument("--out", default="bench-decode.json", help="JSON output path (default: bench-decode.json)")
    dc.add_argument("--warmup-tokens", type=lambda v: 0 if v.strip() == "0" else context_length(v), default=None,
                    metavar="N",
                    help="an untimed prompt of N tokens run on each engine first, so that kernel compilation stays "
                         "out of the numbers (default: the server's warm-up length, one prefill chunk + 1024 past the "
                         "longest context the method attends densely at, at most half the context; 0: none)")
    dc.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="run the last N decode steps of each run under torch.profiler and print where a step's "
                         "time goes (wall vs device ms, top kernels); they are left out of the rate (default: 0)")
    dc.add_argument("--profile-trace", metavar="DIR",
                    help="with --profile-steps: also write each run's profiled decode steps as a Chrome trace, "
                         "DIR/<context>-<method>-decode.json (a timeline: where the GPU waits between kernels)")
    dc.add_argument("--profile-prefill-steps", type=int, default=0, metavar="N",
                    help="run prefill steps 2..N+1 of each run under torch.profiler and print their top kernels "
                         "(their seconds stay in the prefill time, profiler overhead included) (default: 0)")
    dc.add_argument("--profile-prefill-at", type=float, default=0.0, metavar="F",
                    help="with --profile-prefill-steps: profile the N prefill steps from the first one that starts "
                         "past this share of the prompt tokens, e.g. 0.9 for the long prefixes of a 1M prefill "
                         "(default: 0, steps 2..N+1)")
    src = dc.add_mutually_exclusive_group()
    src.add_argument("--text-file", metavar="PATH", help="prompt: this text repeated to each length (default: random "
                     "token ids; a text needs a model with a tokenizer)")
    src.add_argument("--text-source", choices=["paul-graham", "squad"], help="prompt: a built-in text repeated to "
                     "each length (RULER's package)")
    add_engine_args(dc, skip=_DECODE_SETS)


def main(args) -> int:
    if args.bench == "serve":
        return importlib.import_module(".serve", __package__).main(args)
    return {"engine": _engine, "attention": _attention, "long": _long, "decode": _decode,
            "mixed": _mixed}[args.bench](args)


def _mixed(args) -> int:
    from ..eval.common import parse_methods
    from ..report import command_line
    from .mixed import run

    if args.decodes < 1 or args.decode_prompt < 1 or args.profile_steps < 0:
        raise ValueError("--decodes and --decode-prompt must be >= 1 and --profile-steps >= 0")
    if not 0 <= args.profile_at < 1:
        raise ValueError(f"--profile-at is a share of the long prompt in [0, 1), got {args.profile_at}")
    methods = parse_methods(args.attention, attention_config=args.attention_config)
    engine = {name: getattr(args, name) for name in EngineConfig.field_names() if name not in _DECODE_SETS}
    run(args.model, methods, engine, args.context, args.decodes, args.decode_prompt, args.seed or 0, args.profile_steps,
        args.cprofile, args.out, command_line(args), args.prefill_graphs, args.profile_at)
    return 0


def _engine(args) -> int:
    import os

    from ...models.loader import resolve_model_path
    from ..report import command_line
    from .engine import run

    hf = resolve_model_path(args.hf_model or args.model)
    hf_dir, hf_file = (os.path.dirname(hf), os.path.basename(hf)) if hf.endswith(".gguf") else (hf, None)
    if min(args.batch_sizes) < 1 or args.new_tokens < 2 or args.prefill_len < 1:
        raise ValueError("batch sizes must be >= 1, --new-tokens >= 2 and --prefill-len >= 1")
    run(args.model, hf_dir, hf_file, args.device, tuple(args.batch_sizes), args.new_tokens,
        prefill_len=args.prefill_len, repeats=args.repeats, out_path=args.out, command=command_line(args))
    return 0


def _attention(args) -> int:
    from ..report import command_line
    from .attention import run

    if any(n < 1 for n in args.contexts) or args.repeats < 1:
        raise ValueError("--contexts and --repeats must be positive")
    run(sorted(args.contexts), repeats=args.repeats, out_path=args.out, flex=not args.no_flex,
        minference_patterns=args.minference_patterns, command=command_line(args))
    return 0


def _long(args) -> int:
    from ...attention.registry import MethodSpec
    from ..eval.common import parse_methods
    from ..eval.data import paul_graham_text, read_text_file
    from ..report import command_line
    from .engine import run_long

    parse_methods(args.attention, attention_config=args.attention_config)  # a bad method fails before any loads
    text = read_text_file(args.text_file) if args.text_file else paul_graham_text()
    methods = [MethodSpec.parse(a) for a in args.attention]  # checked by parse_methods
    run_long(args.model, text, sorted(args.lengths), methods, args.new_tokens, args.device, args.out, args.eager_too,
             args.attention_config, command=command_line(args))
    return 0


def _decode(args) -> int:
    from ..eval.common import parse_methods
    from ...models.random_init import is_random_model, random_shape
    from ..report import command_line
    from .decode import run

    if args.batch < 1 or args.decode_tokens < 2:
        raise ValueError("--batch must be >= 1 and --decode-tokens >= 2")
    if not 0 <= args.profile_steps < args.decode_tokens - 1:
        raise ValueError(f"--profile-steps must be in [0, --decode-tokens - 1) = [0, {args.decode_tokens - 1}) (the "
                         f"first token comes from the prefill), got {args.profile_steps}")
    if args.profile_prefill_steps < 0:
        raise ValueError(f"--profile-prefill-steps must be >= 0, got {args.profile_prefill_steps}")
    if args.profile_trace and not args.profile_steps:
        raise ValueError("--profile-trace writes the profiled decode steps' timeline: it needs --profile-steps N")
    if not 0 <= args.profile_prefill_at < 1:
        raise ValueError(f"--profile-prefill-at is a share of the prompt tokens in [0, 1), got {args.profile_prefill_at}")
    if args.profile_prefill_steps and args.batch > 1 and args.kv_offloading_size:
        raise ValueError("--profile-prefill-steps with --batch > 1 and --kv-offloading-size: an offloaded batch "
                         "alternates decode steps with its prefill steps, which the profile would take in; profile "
                         "the prefill with --batch 1")
    if args.profile_prefill_at and not args.profile_prefill_steps:
        raise ValueError("--profile-prefill-at says where the profiled prefill steps start: it needs "
                         "--profile-prefill-steps N")
    if is_random_model(args.model):
        random_shape(args.model)  # an unknown shape fails here, before any engine is built
    # a bad preset or --attention-config fails here (the decode side of "A+B" too), not after an hour of runs
    methods = parse_methods(args.attention, attention_config=args.attention_config)
    engine = {name: getattr(args, name) for name in EngineConfig.field_names() if name not in _DECODE_SETS}
    text, label = None, None
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            text, label = f.read(), f"text file {args.text_file}"
    elif args.text_source:
        from ..eval.data import paul_graham_text, squad_text

        text = paul_graham_text() if args.text_source == "paul-graham" else squad_text()
        label = f"text source {args.text_source}"
    report = run(args.model, args.lengths, methods, engine, batch=args.batch, decode_tokens=args.decode_tokens,
                 dense_lengths=args.dense_lengths, out_path=args.out,
                 command=command_line(args), text=text, text_label=label,
                 warmup_tokens=args.warmup_tokens, profile_steps=args.profile_steps,
                 profile_prefill_steps=args.profile_prefill_steps, profile_prefill_at=args.profile_prefill_at,
                 profile_trace=args.profile_trace)
    return 1 if any("error" in r for r in report["runs"]) else 0
