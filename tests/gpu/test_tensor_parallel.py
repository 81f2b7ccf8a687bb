"""Tensor parallelism on two GPUs of one host (NCCL; issue 32): the model's ranks on cuda:0 and cuda:1 against one
process on cuda:0. Skips with fewer than two GPUs (run it on `nvidia-h100-x2` or `nvidia-h200-x2`).

    python -m pytest -s tests/gpu/test_tensor_parallel.py --gpu-model /tmp/m/model.gguf

The CPU tests (tests/test_tensor_parallel.py, gloo) check TP=2 == TP=1 on tiny models; this is the same question
with NCCL's all-reduces and gathers, the Triton kernels and a real model (Qwen2.5-Coder-0.5B: 14 query heads and 2 KV
heads, so one KV head per rank).
"""
from __future__ import annotations

import gc

import pytest
import torch

from .common import essay_text

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
pytestmark = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs (nvidia-h100-x2 / nvidia-h200-x2)")

# small budgets, pruning from the first token (dense_below 0): the selection runs on each rank's KV head
SPARSE = ('{"n_sink": 64, "n_window": 256, "block_q": 64, "chunk_sizes": [64, 32, 8], "budgets": [1024, 512, 256], '
          '"early_last_budget": 512, "dense_below": 0}')


def _run(gpu_model, size: int, dtype: str, **kw):
    """(prompt logits (fp32, on the CPU), 24 greedy tokens) of one engine of `size` ranks, on the essays' first
    3,000 tokens (every engine has the model's tokenizer: the same ids)."""
    from longreach import LLM, SamplingParams

    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(gpu_model, device="cuda", dtype=dtype, tensor_parallel_size=size, max_model_len=8192,
              kv_cache_memory_gb=2, max_num_seqs=2, max_num_batched_tokens=1024, **kw)
    try:
        ids = llm.get_tokenizer().encode(essay_text())[:3000]
        logits = llm.engine.prompt_logits(ids).float().cpu()
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        tokens = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids
    finally:
        llm.close()
    return logits, tokens


def test_tp2_equals_tp1_on_two_gpus(gpu_model, detail):
    """A 3K-token essay prompt in 1,024-token chunks, TP=2 (NCCL) against TP=1: in fp32, dense gives equal greedy
    tokens and prompt logits within 1e-4 of their scale (the two partial sums add in another order than one
    matmul's). infinitehip (pruning; through each rank's CUDA graphs, NCCL captured in them, and eagerly) gives equal
    greedy tokens; its logits are reported, not bounded: a rank's QKV columns are a matmul of another shape, whose
    fp32 rounding on a GPU may differ in the last bits, and a top-k choice at a selection boundary can then flip
    (on a CPU, q/k/v moved by 1e-7 relative moved its logits by 3.3 at a scale of 29.5 and dense's by 8e-5:
    scripts/tp_selection_sensitivity.py, docs/design-tensor-parallel.md; the CPU's TP test, gloo, asks exact
    equality). In bf16 (dense, and fp8 weights) the greedy tokens are reported beside the logit difference, and
    must agree on the first 8 (bf16's reduction order may part later)."""
    rows = []
    for name, dtype, kw in (("dense fp32", "float32", {}),
                            ("infinitehip fp32", "float32", dict(attention="infinitehip", attention_config=SPARSE)),
                            ("infinitehip fp32 eager", "float32", dict(attention="infinitehip", attention_config=SPARSE,
                                                                      enforce_eager=True)),
                            ("dense bf16", "bfloat16", {}),
                            ("fp8 weights bf16", "bfloat16", dict(quantization="fp8"))):
        (l1, t1), (l2, t2) = (_run(gpu_model, n, dtype, **kw) for n in (1, 2))
        diff, scale = (l2 - l1).abs().max().item(), l1.abs().max().item()
        same = sum(a == b for a, b in zip(t1, t2))
        rows.append(f"{name}: max |logit diff| {diff:.2e} (scale {scale:.1f}), greedy tokens equal {same}/{len(t1)}")
        if dtype == "float32":
            assert t1 == t2 and ("infinitehip" in name or diff <= 1e-4 * scale), rows[-1]
        else:
            assert t1[:8] == t2[:8], rows[-1]
    detail("; ".join(rows))
