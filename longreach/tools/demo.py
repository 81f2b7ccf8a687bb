"""`longreach demo`: the long-context demo — a number hidden in a document longer than the model's trained context.

One prompt, RULER's niah_single_1 (eval/ruler_tasks.py: "One of the special magic numbers for <word> is: <7 digits>."
hidden in a long filler text, then the question), answered by the sparse method and then by dense attention for
contrast; says first how long that should take on this machine, shows progress while it runs (progress.py), and
prints each answer, whether it holds the number, and the time. (The classic pass-key prompt of
eval/passkey.py is harder for SmolLM2 under sparse attention, docs/quality.md.)
The default length suits the default model (SmolLM2, trained on 8K tokens): 16K tokens, where dense attention is
already past the model's trained length and fails, on a GPU and on a CPU (minutes on 2 cores: `estimate`);
`--length` changes it.
"""
from __future__ import annotations

import time

from .eval.common import make_llm, parse_methods

# What `estimate` scales from: the default model and prompt on a quiet 2-core CPU, seconds per run, and how a run's
# time follows the prompt's length (time ~ length^length_exp) and this machine's speed as `_probe` sees it (time ~
# probe^speed_exp; infinitehip's many small ops gain less from threads). The measurements: docs/benchmarks.md,
# "On a CPU".
_REFERENCE = {"model": "smollm2", "tokens": 15710, "probe_s": 0.047}
_CPU_SECONDS = {"infinitehip": (203.1, 1.85, 0.72), "dense": (69.5, 2.0, 0.89)}  # (seconds, length_exp, speed_exp)

HELP = "a pass key hidden past the trained context: sparse attention vs dense"
DESCRIPTION = __doc__.split("\n\n")[1]


def add_arguments(p) -> None:
    from .eval.common import context_length

    p.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    p.add_argument("--attention", default="infinitehip", metavar="METHOD[:PRESET]",
                   help="the sparse method (default: infinitehip)")
    p.add_argument("--length", type=context_length, default=None,
                   help="prompt tokens, e.g. 32k (default: 16k)")
    p.add_argument("--seed", type=int, default=42, help="picks the sample (default: 42, RULER's)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense contrast")
    p.add_argument("--device", default="auto", help="device (default: auto)")
    p.add_argument("--dtype", default="auto", help="dtype (default: auto)")
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="torch threads on a CPU (default: auto, from the cores other processes leave free)")


def _probe() -> float:
    """Seconds of a fixed fp32 matmul load (about 18 GFLOP, the best of 3) on the current torch threads: this CPU's
    speed now, other processes included."""
    import torch

    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        best = min(best, time.perf_counter() - t0)
    return best


def estimate(engine, model: str, runs: list, length: int) -> str:
    """One sentence, marked as an estimate: how long the runs should take on this machine (roughly), before they
    start. Scaled from the reference measurements above; nothing of it is measured in this run."""
    import torch

    from ..progress import format_seconds

    dev = engine.device
    if dev.type == "cuda":
        return (f"Estimated, not measured: on {torch.cuda.get_device_name(dev)} each run takes seconds once the "
                "Triton kernels are compiled; a first run compiles them (about a minute).")
    n = torch.get_num_threads()
    where = f"on this CPU ({n} thread{'s' if n != 1 else ''})"
    if model != _REFERENCE["model"]:
        return f"No estimate for {model} {where}: the progress lines give the rate and the time left."
    speed = _probe() / _REFERENCE["probe_s"]
    each = {}
    for spec in runs:  # eval.common.RunSpec; a sparse method without a reference of its own: infinitehip's
        seconds, length_exp, speed_exp = _CPU_SECONDS.get(spec.name, _CPU_SECONDS["infinitehip"])
        each[spec.label] = seconds * speed ** speed_exp * (length / _REFERENCE["tokens"]) ** length_exp
    parts = ", ".join(f"{label} ~{format_seconds(s)}" for label, s in each.items())
    return (f"Estimated, not measured: about {format_seconds(sum(each.values()))} {where}: {parts} (scaled from "
            "reference runs; progress below).")


def main(args) -> int:
    import gc

    import torch

    from ..progress import format_seconds
    from ..sampling_params import SamplingParams

    sparse = parse_methods([args.attention])[0]
    if sparse.name == "dense":
        raise ValueError("--attention names the sparse method to show; dense runs anyway as the contrast")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError(f"--cpu-threads must be a positive integer, got {args.cpu_threads}")
    runs = [sparse] + ([] if args.no_dense else parse_methods(["dense"]))
    params = SamplingParams(temperature=0, max_tokens=12)
    length = args.length or 16384
    prompt = key = None
    start = time.perf_counter()
    for spec in runs:
        llm = make_llm(args.model, spec, None, args.device, args.dtype, length + params.max_tokens, max_num_seqs=1,
                       cpu_threads=args.cpu_threads)
        if prompt is None:
            from .eval.ruler_tasks import generate

            sample = generate("niah_single_1", length, 1, args.seed, llm.get_tokenizer())[0]
            prompt, key = [int(t) for t in sample.prompt_ids], sample.outputs[0]
            trained = llm.engine.model_config.max_position_embeddings
            print(f"A magic number ({key}) is hidden in a {len(prompt):,}-token document; the model "
                  f"({llm.engine.model_config.name or args.model}) was trained on {trained:,}-token contexts"
                  + ("" if length > trained else " (the document fits: give a longer --length)") + ".", flush=True)
            print(estimate(llm.engine, args.model, runs, len(prompt)), flush=True)
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]  # progress: a bar, or lines in a log
        seconds = time.perf_counter() - t0
        verdict = "right" if key in out.text else "wrong"
        print(f"{spec.label:>12} on {llm.engine.device}: {out.text.strip()!r:<24} {verdict:<5}  {seconds:6.1f} s",
              flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"Done in {format_seconds(time.perf_counter() - start)}.", flush=True)
    return 0
