"""`longreach generate`: complete a prompt (or answer a chat message) with a model; timings go to stderr."""
from __future__ import annotations

import dataclasses
import sys
import time

from ..sampling_params import SamplingParams
from .engine_args import add_engine_args, engine_config_from_args

HELP = "complete a prompt or answer a chat message"
DESCRIPTION = ("Generate text with a model. The completion goes to stdout; timings (prefill and decode tokens/s, peak "
               "memory) go to stderr.")


def add_arguments(p) -> None:
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


def main(args) -> int:
    config = engine_config_from_args(args)
    from ..engine.llm_engine import LLMEngine
    from ..engine.tp_workers import serve_if_worker

    serve_if_worker(config, LLMEngine)  # under torchrun, ranks > 0 run rank 0's steps and end here
    prompt = _read_prompt(args)
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,  # --seed (engine group) seeds the request too
        max_tokens=args.max_tokens, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos)
    from ..engine.llm import LLM

    t0 = time.perf_counter()
    with LLM(**dataclasses.asdict(config)) as llm:  # closed on the way out: tensor-parallel workers end
        return _generate(llm, args, prompt, params, config, time.perf_counter() - t0)


def _generate(llm, args, prompt, params, config, load_s: float) -> int:
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
