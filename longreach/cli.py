"""The `longreach` command line.

  longreach generate   complete a prompt (or answer a chat message) with a model
  longreach serve      an OpenAI-compatible HTTP server over the engine
  longreach backends   list the attention backends

Bad input exits with status 2 and a one-line message on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
import time

from . import __version__
from .config import EngineConfig
from .sampling_params import SamplingParams

_EVAL_COMMANDS = ("passkey", "ruler", "ppl")  # modules under longreach/eval/
_ENGINE_TYPES = {"cpu_threads": int, "max_model_len": int, "kv_cache_memory_gb": float, "kv_offloading_size": float,
                 "rope_scaling": str, "preset": str, "attention_config": str, "decode_attention": str,
                 "decode_attention_config": str}


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field (the dataclass is the single source of names, defaults and help), except the
    fields in `skip`, which the command sets itself."""
    g = p.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            g.add_argument(flag, action="store_true", help=f.metadata["help"])
            continue
        kind = _ENGINE_TYPES.get(f.name, type(default))
        shown = "" if default is None else f" (default: {default})"
        g.add_argument(flag, type=kind, default=default, metavar=f.name.upper(), help=f.metadata["help"] + shown)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()})


def _generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="complete a prompt or answer a chat message",
        description="Generate text with a model. The completion goes to stdout; timings (prefill and decode "
                    "tokens/s, peak memory) go to stderr.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a file ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", help="system message (with --chat)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=int, nargs="+", default=[], metavar="ID", help="token ids that stop")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)


def _serve_parser(sub) -> None:
    from .server.config import add_server_args

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (continuous batching, streaming, metrics)",
        description="Serve a model over HTTP: OpenAI's /v1/completions and /v1/chat/completions, SGLang's /generate, "
                    "/tokenize, /metrics and more (docs/serving.md). Engine flags mean what they mean for "
                    "`longreach generate`. SIGTERM drains the requests in flight, then exits.")
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="model: an alias (smollm2), a HF model directory or a .gguf file (same as --model)")
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args) -> int:
    from .server.config import server_config_from_args

    if args.model_arg is not None:
        if args.model != EngineConfig.model and args.model != args.model_arg:
            raise ValueError(f"two models given: {args.model_arg!r} and --model {args.model!r}; give one")
        args.model = args.model_arg
    server_config = server_config_from_args(args)
    engine_config = engine_config_from_args(args)
    from .server.app import serve

    return serve(engine_config, server_config, verbose=args.verbose)


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read --prompt-file {args.prompt_file!r}: {e.strerror}") from None


def _peak_memory(device) -> str:
    import torch

    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB GPU"
    import resource

    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB RSS"


def _cmd_generate(args) -> int:
    prompt = _read_prompt(args)
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,  # --seed (engine group) seeds the request too
        max_tokens=args.max_tokens, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos)
    config = engine_config_from_args(args)
    from .engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(config))
    load_s = time.perf_counter() - t0
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
        out = llm.chat(messages, params, use_tqdm=not args.no_progress)[0]
    else:
        if args.system:
            raise ValueError("--system needs --chat")
        out = llm.generate(prompt, params, use_tqdm=not args.no_progress)[0]
    sys.stdout.write(out.text + ("\n" if not out.text.endswith("\n") else ""))
    sys.stdout.flush()
    m = out.metrics
    pre = m.prefill_tokens_per_s
    dec = m.decode_tokens_per_s
    print(f"[longreach] {config.attention} attention on {llm.engine.device} ({str(llm.engine.dtype).replace('torch.', '')}); "
          f"load {load_s:.1f} s | prefill {m.num_prompt_tokens} tokens in {m.prefill_seconds:.2f} s "
          f"({pre:,.0f} tok/s) | decode {m.num_generated_tokens} tokens"
          + (f" in {m.decode_seconds:.2f} s ({dec:,.1f} tok/s)" if dec else "")
          + f" | finish: {out.outputs[0].finish_reason} | peak memory {_peak_memory(llm.engine.device)}",
          file=sys.stderr)
    return 0


def _cmd_backends(args) -> int:
    from .attention.registry import available_backends, get_backend_class

    print(f"{'backend':<14} {'CUDA graphs':<12} description; below it, its presets (--preset), the default first")
    for name in available_backends():
        cls = get_backend_class(name)
        doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        print(f"{name:<14} {'yes' if cls.supports_cuda_graph else 'no':<12} {doc}")
        for preset, note in cls.preset_notes.items():
            print(f"    {preset:<14} {note}")
    return 0


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (always with the baseline measured in the same run)",
                       description="Benchmarks. Each prints a table and saves JSON.")
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
    e.set_defaults(func=_cmd_bench_engine)
    from .eval.common import context_length

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
    a.set_defaults(func=_cmd_bench_attention)
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
    lg.set_defaults(func=_cmd_bench_long)
    sv = importlib.import_module(".bench.serve", __package__)
    s = bsub.add_parser("serve", help=sv.HELP, description=sv.__doc__.split("\n\n")[0] + " " +
                        sv.__doc__.split("\n\n")[1])
    sv.add_arguments(s)
    s.set_defaults(func=sv.main)

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
                         "out of the numbers (default: one prefill chunk + 4096, at most half the context; 0: none)")
    dc.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="run the last N decode steps of each run under torch.profiler and print where a step's "
                         "time goes (wall vs device ms, top kernels); they are left out of the rate (default: 0)")
    dc.add_argument("--profile-prefill-steps", type=int, default=0, metavar="N",
                    help="run prefill steps 2..N+1 of each run under torch.profiler and print their top kernels "
                         "(their seconds stay in the prefill time, profiler overhead included) (default: 0)")
    src = dc.add_mutually_exclusive_group()
    src.add_argument("--text-file", metavar="PATH", help="prompt: this text repeated to each length (default: random "
                     "token ids; a text needs a model with a tokenizer)")
    src.add_argument("--text-source", choices=["paul-graham", "squad"], help="prompt: a built-in text repeated to "
                     "each length (RULER's package)")
    add_engine_args(dc, skip=_DECODE_SETS)
    dc.set_defaults(func=_cmd_bench_decode)


def _cmd_bench_engine(args) -> int:
    import os

    from .bench.engine import run
    from .models.loader import resolve_model_path

    hf = resolve_model_path(args.hf_model or args.model)
    hf_dir, hf_file = (os.path.dirname(hf), os.path.basename(hf)) if hf.endswith(".gguf") else (hf, None)
    if min(args.batch_sizes) < 1 or args.new_tokens < 2 or args.prefill_len < 1:
        raise ValueError("batch sizes must be >= 1, --new-tokens >= 2 and --prefill-len >= 1")
    run(args.model, hf_dir, hf_file, args.device, tuple(args.batch_sizes), args.new_tokens,
        prefill_len=args.prefill_len, repeats=args.repeats, out_path=args.out)
    return 0


def _add_eval_common(r) -> None:
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


def _eval_inputs(args):
    """(text, [RunSpec]) from the shared eval arguments."""
    from .eval.common import parse_methods
    from .eval.data import TEXT_SOURCES

    methods = parse_methods(args.attention, args.preset, args.attention_config)
    if args.text_file:
        try:
            with open(args.text_file, encoding="utf-8") as f:
                return f.read(), methods
        except OSError as e:
            raise ValueError(f"cannot read --text-file {args.text_file!r}: {e.strerror}") from None
    return TEXT_SOURCES[args.text_source](), methods


def _cmd_eval_agreement(args) -> int:
    from .eval.agreement import run
    from .eval.common import emit

    text, methods = _eval_inputs(args)
    report = run(args.model, text, args.length, args.new_tokens, methods, args.attention_config, args.device,
                 args.dtype)
    emit(report, args.out)
    summary = ", ".join(f"{k}: {v['tokens_equal']}/{args.new_tokens} equal" for k, v in report["methods"].items()
                        if "tokens_equal" in v)
    print(f"[longreach] greedy agreement with dense after {args.length - args.new_tokens} tokens: {summary}",
          file=sys.stderr)
    return 0


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="quality evaluations (JSON out)", description="Quality evaluations.")
    esub = p.add_subparsers(dest="eval", metavar="EVAL", required=True)
    r = esub.add_parser(
        "recall", help="how much exact attention a sparse method keeps, on a model's real queries and keys",
        description="Run the model densely on a text, capture its queries and keys, and measure for each method the "
                    "attention-mass recall, top-k key recall and output error of its selection, per layer. Prints "
                    "JSON.")
    _add_eval_common(r)
    r.add_argument("--queries", type=int, default=256, help="evaluate the last N query positions (default: 256)")
    r.set_defaults(func=_cmd_eval_recall)
    a = esub.add_parser(
        "agreement", help="greedy continuations of a long prompt: each method against dense",
        description="Generate greedily after a long prompt with dense attention and with each method; report how "
                    "many generated tokens agree with dense and where they first differ. Prints JSON.")
    _add_eval_common(a)
    a.add_argument("--new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    a.set_defaults(func=_cmd_eval_agreement)
    for name in _EVAL_COMMANDS:  # each module: HELP, DESCRIPTION, add_arguments(parser), main(args) -> int
        mod = importlib.import_module(f".eval.{name}", __package__)
        e = esub.add_parser(name, help=mod.HELP, description=mod.DESCRIPTION)
        mod.add_arguments(e)
        e.set_defaults(func=mod.main)


def _cmd_eval_recall(args) -> int:
    from .eval.common import emit
    from .eval.recall import run

    text, methods = _eval_inputs(args)
    report = run(args.model, text, args.length, methods, args.attention_config, args.queries, args.device, args.dtype)
    emit(report, args.out)
    def keys(v):  # keys read per query over every layer, row and head: a mass threshold (psa) spreads them
        d = v["keys_per_query"]["all_layers"]
        return f"{d['mean']:.0f} keys/query (p50 {d['p50']:.0f}, p90 {d['p90']:.0f}, max {d['max']:.0f})"
    summary = ", ".join(f"{k}: mass {v['mean']['mass_recall']:.4f}, top-k {v['mean']['topk_recall']:.4f}, {keys(v)}"
                        for k, v in report["methods"].items())
    print(f"[longreach] recall at {args.length} tokens: {summary}", file=sys.stderr)
    return 0


def _cmd_bench_attention(args) -> int:
    from .bench.attention import run

    if any(n < 1 for n in args.contexts) or args.repeats < 1:
        raise ValueError("--contexts and --repeats must be positive")
    run(sorted(args.contexts), repeats=args.repeats, out_path=args.out, flex=not args.no_flex,
        minference_patterns=args.minference_patterns)
    return 0


def _cmd_bench_long(args) -> int:
    from .attention.registry import MethodSpec
    from .bench.engine import run_long
    from .eval.common import parse_methods
    from .eval.data import paul_graham_text

    parse_methods(args.attention, attention_config=args.attention_config)  # a bad method fails before any loads
    if args.text_file:
        try:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot read --text-file {args.text_file!r}: {e.strerror}") from None
    else:
        text = paul_graham_text()
    methods = [MethodSpec.parse(a, check_preset=False) for a in args.attention]  # checked by parse_methods
    run_long(args.model, text, sorted(args.lengths), methods, args.new_tokens, args.device, args.out, args.eager_too,
             args.attention_config)
    return 0


_DECODE_SETS = ("model", "attention", "preset", "max_model_len", "max_num_seqs")  # bench decode sets these itself


def _cmd_bench_decode(args) -> int:
    import shlex

    from .bench.decode import run
    from .eval.common import parse_methods
    from .models.random_init import is_random_model, random_shape

    if args.batch < 1 or args.decode_tokens < 2:
        raise ValueError("--batch must be >= 1 and --decode-tokens >= 2")
    if not 0 <= args.profile_steps < args.decode_tokens - 1:
        raise ValueError(f"--profile-steps must be in [0, --decode-tokens - 1) = [0, {args.decode_tokens - 1}) (the "
                         f"first token comes from the prefill), got {args.profile_steps}")
    if args.profile_prefill_steps < 0:
        raise ValueError(f"--profile-prefill-steps must be >= 0, got {args.profile_prefill_steps}")
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
        from .eval.data import paul_graham_text, squad_text

        text = paul_graham_text() if args.text_source == "paul-graham" else squad_text()
        label = f"text source {args.text_source}"
    report = run(args.model, args.lengths, methods, engine, batch=args.batch, decode_tokens=args.decode_tokens,
                 dense_lengths=args.dense_lengths, out_path=args.out,
                 command=shlex.join(["longreach", *getattr(args, "argv", [])]), text=text, text_label=label,
                 warmup_tokens=args.warmup_tokens, profile_steps=args.profile_steps,
                 profile_prefill_steps=args.profile_prefill_steps)
    return 1 if any("error" in r for r in report["runs"]) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longreach",
        description="longreach: million-token inference for pretrained Llama-family models on one GPU.")
    parser.add_argument("--version", action="version", version=f"longreach {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors in the log")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug log (one line per engine step)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    _eval_parser(sub)
    d = sub.add_parser("demo", help="a pass key hidden past the trained context: sparse attention vs dense",
                       description=importlib.import_module(".demo", __package__).__doc__.split("\n\n")[1])
    importlib.import_module(".demo", __package__).add_arguments(d)
    d.set_defaults(func=lambda args: importlib.import_module(".demo", __package__).main(args))
    cal = importlib.import_module(".calibrate", __package__)
    c = sub.add_parser("calibrate", help=cal.HELP, description=cal.DESCRIPTION)
    cal.add_arguments(c)
    c.set_defaults(func=cal.main)
    hub = importlib.import_module(".models.hub", __package__)
    dl = sub.add_parser("download", help=hub.HELP, description=hub.DESCRIPTION)
    hub.add_arguments(dl)
    dl.set_defaults(func=hub.main)
    b = sub.add_parser("backends", help="list the attention backends", description="List the attention backends.")
    b.set_defaults(func=_cmd_backends)
    return parser


def _stack_dumps_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr and the run goes on: where a long run is
    (scripts/device_runs.sh sends it when a command outlives its time, before killing it)."""
    import faulthandler
    import signal

    if not hasattr(signal, "SIGUSR1"):
        return
    for stream in (sys.stderr, sys.__stderr__):  # a stderr without a file descriptor (captured): the process's own
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError and a ValueError
            continue


def _parse_json_configs(args: argparse.Namespace) -> None:
    """--attention-config and --decode-attention-config arrive as JSON text: parsed here, once, into the dicts that
    every command passes on (ValueError says what was wrong)."""
    from .config import config_dict

    for name in ("attention_config", "decode_attention_config"):
        if isinstance(getattr(args, name, None), str):
            setattr(args, name, config_dict(getattr(args, name), name))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for reports
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="[longreach] %(message)s", stream=sys.stderr)
    _stack_dumps_on_sigusr1()
    try:
        _parse_json_configs(args)
        return args.func(args)
    except ValueError as e:
        print(f"longreach {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("longreach: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
