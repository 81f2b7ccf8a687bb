"""How far a sparse method's prompt logits move when the q/k/v projections change in their last bits (issue 32).

Why: on two GPUs, tests/gpu/test_tensor_parallel.py found infinitehip's fp32 prompt logits 0.886 apart (scale 29.5)
between TP=2 and TP=1 with every greedy token equal, while dense agreed within 1e-4 of the scale. A rank computes
its columns of the QKV projection as a matmul of another shape, whose fp32 rounding on a GPU may differ from the
whole matmul's in the last bits. This runs the same prompt, model and sparse config on the CPU (fp32) twice: once
as is, once with each layer's QKV output multiplied by (1 + eps * N(0, 1)) (eps 1e-7, about fp32's rounding), and
prints the largest logit difference for dense and the sparse method. A sparse difference of the GPU's size beside a
dense one near eps says a last-bit change in q or k can flip a top-k choice at a selection boundary, enough to
explain the GPU result without a TP bug; a sparse difference near eps says it cannot.

    python scripts/tp_selection_sensitivity.py [--model qwen2.5-coder-0.5b] [--tokens 3000] [--eps 1e-7] [--out F]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

# the GPU test's sparse configuration (tests/gpu/test_tensor_parallel.py)
SPARSE = ('{"n_sink": 64, "n_window": 256, "block_q": 64, "chunk_sizes": [64, 32, 8], "budgets": [1024, 512, 256], '
          '"early_last_budget": 512, "dense_below": 0}')


def prompt_logits(model: str, ids: list[int], eps: float, seed: int, **kw) -> torch.Tensor:
    from longreach import LLM

    llm = LLM(model, device="cpu", dtype="float32", max_model_len=8192, kv_cache_memory_gb=1, max_num_seqs=2,
              max_num_batched_tokens=1024, **kw)
    gen = torch.Generator().manual_seed(seed)
    hooks = []
    if eps:
        for layer in llm.engine.model.layers:
            def perturb(module, args, out, layer=layer):
                return out * (1 + eps * torch.randn(out.shape, generator=gen, dtype=out.dtype))
            hooks.append(layer.self_attn.qkv_proj.register_forward_hook(perturb))
    try:
        return llm.engine.prompt_logits(ids).float()
    finally:
        for h in hooks:
            h.remove()
        llm.close()
        del llm
        gc.collect()  # two engines' weights and KV at once outgrow a 24 GiB machine beside the logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--eps", type=float, default=1e-7)
    ap.add_argument("--seeds", type=int, default=1, help="perturbed runs per method")
    ap.add_argument("--out", help="write the rows as JSON, with the run's provenance")
    args = ap.parse_args(argv)
    from longreach import LLM
    from longreach.tools.eval.data import paul_graham_text

    tok = LLM(args.model, device="cpu", dtype="float32", max_model_len=4096, kv_cache_memory_gb=0.2).get_tokenizer()
    ids = tok.encode(paul_graham_text())[:args.tokens]
    out = {"model": args.model, "tokens": len(ids), "eps": args.eps, "rows": []}
    for name, kw in (("dense", {}), ("infinitehip", {"attention": "infinitehip", "attention_config": SPARSE})):
        base = prompt_logits(args.model, ids, 0.0, 0, **kw)
        for seed in range(args.seeds):
            moved = prompt_logits(args.model, ids, args.eps, seed, **kw)
            row = {"method": name, "seed": seed, "max_abs_diff": (moved - base).abs().max().item(),
                   "scale": base.abs().max().item(),
                   "argmax_equal": int((moved.argmax(-1) == base.argmax(-1)).sum()), "positions": base.shape[0]}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        import shlex

        from longreach.tools.report import provenance, write_json
        typed = ["python", "scripts/tp_selection_sensitivity.py", *(sys.argv[1:] if argv is None else argv)]
        out["provenance"] = provenance(shlex.join(typed), "cpu")
        write_json(out, args.out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
