"""`eval ruler --share-prefill` on a GPU (tools/eval/variants.py): decode-only variants of infinitehip decoded from one
prefill per prompt give the tokens an engine of each variant's own gives, on a real model in bf16 through the CUDA
graphs (tests/test_eval_variants.py checks the same on a CPU in fp32).

    python -m pytest -s tests/gpu/test_eval_variants.py --gpu-model /tmp/m/model.gguf
"""
from __future__ import annotations

import gc

import torch

from .common import essay_text

# small budgets that prune 12K-token prompts from the first token (dense_below 0), so decode selects
BASE = {"n_sink": 64, "n_window": 256, "block_q": 64, "chunk_sizes": [64, 32, 8], "budgets": [1024, 512, 256],
        "early_last_budget": 512, "dense_below": 0}
VARIANTS = [dict(BASE), dict(BASE, refresh=[16, 8, 4]), dict(BASE, lookahead=1)]  # the default's (8, 4, 1) first


def test_share_prefill_equals_separate_engines(gpu_model, detail):
    """Three prompts of 12K tokens (the essays, with a question), 48 greedy tokens: per variant, shared-prefill
    tokens == its own engine's, prompt by prompt."""
    from longreach import LLM, SamplingParams
    from longreach.tools.eval.variants import DecodeVariants, generate_variants

    def fresh(cfg):
        gc.collect()
        torch.cuda.empty_cache()
        return LLM(gpu_model, attention="infinitehip", attention_config=cfg, max_model_len=16384,
                   kv_cache_memory_gb=4, max_num_seqs=4, max_num_batched_tokens=4096)

    llm = fresh(VARIANTS[0])
    tok = llm.get_tokenizer()
    ids = tok.encode(essay_text())
    prompts = [ids[i * 1000:i * 1000 + 12000] + tok.encode("\nWhat was this text about? It was about") for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    variants = DecodeVariants.install(llm.engine, VARIANTS)
    shared, seconds = generate_variants(llm, prompts, params, variants)
    shared = [[o.token_ids for o in outs] for outs in shared]
    del llm, variants
    own = []
    for cfg in VARIANTS:
        llm = fresh(cfg)
        own.append([o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                      use_tqdm=False)])
        del llm
    same = [sum(a == b for a, b in zip(s, o)) for s, o in zip(shared, own)]
    differ = sum(a != b for a, b in zip(own[0], own[1])) + sum(a != b for a, b in zip(own[0], own[2]))
    detail(f"shared == own engine, prompts per variant (default 8-4-1, refresh 16-8-4, lookahead 1): {same} of "
           f"{len(prompts)}; the variants' own tokens differ from the default's on {differ} prompt(s); pass seconds "
           f"{[round(s, 1) for s in seconds]}")
    assert same == [len(prompts)] * len(VARIANTS)
