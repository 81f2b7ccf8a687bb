"""`longreach demo`: the long-context demo — a pass key hidden in a document longer than the model's trained context.

One prompt (eval/passkey.py: the classic haystack, key at `--depth`), answered by the sparse method and then by
dense attention for contrast; prints each answer, whether it is right, and the time. The default length suits the default
model (SmolLM2, trained on 8K tokens): 16K tokens on a GPU, 10K on a CPU, where the dense contrast is quadratic and
slow; `--length` changes it.
"""
from __future__ import annotations

import sys
import time

from .eval.common import make_llm, parse_methods
from .eval.passkey import passkey_prompt, score


def add_arguments(p) -> None:
    from .eval.passkey import context_length

    p.add_argument("--model", default="smollm2", help="model (default: smollm2)")
    p.add_argument("--attention", default="infinitehip", metavar="METHOD[:PRESET]",
                   help="the sparse method (default: infinitehip)")
    p.add_argument("--length", type=context_length, default=None,
                   help="prompt tokens, e.g. 32k (default: 16k on CUDA, 10k on CPU)")
    p.add_argument("--depth", type=float, default=0.5, help="where the key hides, a fraction in [0, 1] (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="picks the key (default: 0)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense contrast")
    p.add_argument("--device", default="auto", help="device (default: auto)")
    p.add_argument("--dtype", default="auto", help="dtype (default: auto)")


def main(args) -> int:
    import gc

    import torch

    from .sampling_params import SamplingParams

    if not 0.0 <= args.depth <= 1.0:
        raise ValueError(f"--depth must be in [0, 1], got {args.depth}")
    sparse = parse_methods([args.attention])[0]
    if sparse.name == "dense":
        raise ValueError("--attention names the sparse method to show; dense runs anyway as the contrast")
    runs = [sparse] + ([] if args.no_dense else parse_methods(["dense"]))
    params = SamplingParams(temperature=0, max_tokens=8)
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    length = args.length or (16384 if cuda else 10240)
    prompt = key = None
    for spec in runs:
        llm = make_llm(args.model, spec, None, args.device, args.dtype, length + params.max_tokens, max_num_seqs=1)
        if prompt is None:
            prompt, key = passkey_prompt(llm.get_tokenizer(), length, args.depth, args.seed)
            trained = llm.engine.model_config.max_position_embeddings
            print(f"A pass key ({key}) is hidden at {args.depth:.0%} of a {length:,}-token document; the model "
                  f"({llm.engine.model_config.name or args.model}) was trained on {trained:,}-token contexts"
                  + ("" if length > trained else " (the document fits: give a longer --length)") + ".", flush=True)
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=sys.stderr.isatty())[0]
        seconds = time.perf_counter() - t0
        verdict = "right" if score(out.text, key) else "wrong"
        print(f"{spec.label:>12} on {llm.engine.device}: {out.text.strip()!r:<24} {verdict:<5}  {seconds:6.1f} s",
              flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0
