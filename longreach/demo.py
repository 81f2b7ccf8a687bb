"""`longreach demo`: the long-context demo — a number hidden in a document longer than the model's trained context.

One prompt, RULER's niah_single_1 (eval/ruler_tasks.py: "One of the special magic numbers for <word> is: <7 digits>."
hidden in a long filler text, then the question), answered by the sparse method and then by dense attention for
contrast; prints each answer, whether it holds the number, and the time. (The classic pass-key prompt of
eval/passkey.py is harder for SmolLM2 under sparse attention: right in 60–67% of prompts at 8K–16K, docs/quality.md.)
The default length suits the default model (SmolLM2, trained on 8K tokens): 16K tokens, where dense attention is
already past the model's trained length and fails, on a GPU and on a CPU (about 6 minutes on 2 cores); `--length`
changes it.
"""
from __future__ import annotations

import sys
import time

from .eval.common import make_llm, parse_methods


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


def main(args) -> int:
    import gc

    import torch

    from .sampling_params import SamplingParams

    sparse = parse_methods([args.attention])[0]
    if sparse.name == "dense":
        raise ValueError("--attention names the sparse method to show; dense runs anyway as the contrast")
    runs = [sparse] + ([] if args.no_dense else parse_methods(["dense"]))
    params = SamplingParams(temperature=0, max_tokens=12)
    length = args.length or 16384
    prompt = key = None
    for spec in runs:
        llm = make_llm(args.model, spec, None, args.device, args.dtype, length + params.max_tokens, max_num_seqs=1)
        if prompt is None:
            from .eval.ruler_tasks import generate

            sample = generate("niah_single_1", length, 1, args.seed, llm.get_tokenizer())[0]
            prompt, key = [int(t) for t in sample.prompt_ids], sample.outputs[0]
            trained = llm.engine.model_config.max_position_embeddings
            print(f"A magic number ({key}) is hidden in a {len(prompt):,}-token document; the model "
                  f"({llm.engine.model_config.name or args.model}) was trained on {trained:,}-token contexts"
                  + ("" if length > trained else " (the document fits: give a longer --length)") + ".", flush=True)
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=sys.stderr.isatty())[0]
        seconds = time.perf_counter() - t0
        verdict = "right" if key in out.text else "wrong"
        print(f"{spec.label:>12} on {llm.engine.device}: {out.text.strip()!r:<24} {verdict:<5}  {seconds:6.1f} s",
              flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0
