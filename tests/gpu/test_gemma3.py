"""Gemma 3 on a GPU (issue 33), no model file needed: a small random Gemma 3 made with transformers (6 layers, one
global, window 64, head_dim 64, GQA 4:2), so that the sliding layers' ring (kvcache/window.py: the fused store into
the ring, the paged decode kernel over it), the banded SDPA prefill, the chunk and decode CUDA graphs and the sparse
methods on the global layer all run on CUDA.

    python -m pytest tests/gpu/test_gemma3.py -s
"""
from __future__ import annotations

import gc

import torch

WINDOW = 64


def _tiny_gemma3(path):
    from test_gemma3 import _tiny_gemma3 as tiny  # tests/test_gemma3.py's, at a size the kernels take

    return tiny(path, weight_std=0.08, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                head_dim=64, sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                max_position_embeddings=4096, query_pre_attn_scalar=64)


def _prompts(n_tokens=(700, 300, 90)):
    g = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in n_tokens]


def test_gemma3_ring_on_cuda_matches_transformers_and_graphs_equal_eager(tmp_path, detail):
    """fp32 on the GPU: a 700-token prompt's logits in 128-token chunks against transformers' (CPU, fp32), within
    2e-3 of their scale (the GPU's other summation order); then three prompts (700, 300, 90 tokens: past the window
    and not) decoded 32 tokens through the decode and chunk graphs, greedy tokens equal to `enforce_eager`, for
    dense and for infinitehip on the global layer (small budgets, `dense_below: 0`, so it prunes). Reported: the
    logit difference and how many tokens of bf16 (graphs) agree with fp32's."""
    from longreach import LLM, SamplingParams

    path, hf = _tiny_gemma3(tmp_path / "g3")
    ids = _prompts()[0]["prompt_token_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    base = dict(device="cuda", max_model_len=2048, kv_cache_memory_gb=1, block_size=16, max_num_batched_tokens=128)
    llm = LLM(path, dtype="float32", **base)
    got = llm.engine.prompt_logits(ids).float().cpu()
    diff, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    del llm
    # the whole prompt in one chunk: its sliding layers attend in query blocks (attention/dense.py _window_blocks)
    llm = LLM(path, dtype="float32", **{**base, "max_num_batched_tokens": 1024})
    whole = (llm.engine.prompt_logits(ids).float().cpu() - ref).abs().max().item()
    del llm
    sparse = ('{"n_sink": 16, "n_window": 64, "block_q": 16, "chunk_sizes": [32, 16, 8], "budgets": [256, 128, 64], '
              '"early_layers": 0, "refresh": [4, 2, 1], "dense_below": 0}')
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for attention, cfg in (("dense", None), ("infinitehip", sparse)):
        for dtype, eager in (("float32", True), ("float32", False), ("bfloat16", False)):
            gc.collect()
            torch.cuda.empty_cache()
            llm = LLM(path, dtype=dtype, enforce_eager=eager, attention=attention, attention_config=cfg, **base)
            tokens[attention, dtype, eager] = [o.token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
            del llm
    agree = {a: sum(x == y for p, q in zip(tokens[a, "bfloat16", False], tokens[a, "float32", False])
                    for x, y in zip(p, q)) for a in ("dense", "infinitehip")}
    detail(f"fp32 GPU vs transformers: max |logit diff| {diff:.2e} in 128-token chunks, {whole:.2e} whole (blocked "
           f"window attention; logits up to {scale:.1f}); bf16 graph tokens "
           f"equal to fp32's: dense {agree['dense']}/96, infinitehip {agree['infinitehip']}/96")
    assert diff <= 2e-3 * scale, f"fp32 logits on the GPU differ from transformers' by {diff:.3e}"
    assert whole <= 2e-3 * scale, f"fp32 logits of the whole prompt differ from transformers' by {whole:.3e}"
    for attention in ("dense", "infinitehip"):
        assert tokens[attention, "float32", False] == tokens[attention, "float32", True], \
            f"{attention}: the graph run's greedy tokens differ from enforce_eager's"
    assert tokens["infinitehip", "float32", True] != tokens["dense", "float32", True], "infinitehip did not prune"
