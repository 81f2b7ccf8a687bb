"""Cascading KV cache through the engine on the tiny test model: bounded pages, equal to dense while nothing is dropped
and to StreamingLLM with one sub-cache, chunking and batching, config errors."""
import json
import logging

import pytest
import torch

from longreach.attention.cascading import PRESETS, CascadingConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one intra-op thread


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


TINY = {"n_sink": 4, "num_subcaches": 3, "subcache_size": 8, "stride": 16, "block_q": 8, "block_k": 4}  # 28 tokens


def _llm(path, cfg=None, **kw):
    from longreach.engine.llm import LLM

    args = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_model_len=4096, max_num_batched_tokens=64)
    args.update(kw)
    if cfg is not None:
        args.update(attention="cascading", attention_config=json.dumps(cfg))
    return LLM(path, **args)


def _ids(n, seed=0):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_longer_than_the_cache_runs_in_a_bounded_number_of_pages(tiny, caplog):
    """A 700-token prompt and 150 generated tokens with a 28-token cache: the sequence never holds more than the
    layout's pages (stated at start-up), holds exactly that many once the cache is full, and every step keeps the
    block manager's and the cache's invariants; everything is returned at the end."""
    from longreach import SamplingParams

    with caplog.at_level(logging.INFO, logger="longreach"):
        llm = _llm(tiny, TINY, max_num_batched_tokens=48)
    engine = llm.engine
    lay = engine.backend.kv_layout
    pages = -(-lay.max_slots // engine.config.block_size)
    assert f"keeps every sequence in at most {pages} pages" in caplog.text
    engine.add_request("r", _ids(700), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    held, steps = [], 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        seq = engine.scheduler.running[0] if engine.scheduler.running else None
        if seq is not None:
            held.append(len(engine.blocks.table(seq.seq_id)))
            engine.backend.check_integrity(seq.seq_id)
            assert engine.backend.cache_stats(seq.seq_id)["cached"] <= 4 + 24
        engine.blocks.check_integrity()
    assert len(outs[0].outputs[0].token_ids) == 150 and steps == -(-700 // 48) + 149
    assert max(held) <= pages and held[-1] == pages and len(set(held[20:])) == 1
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.backend._rings


def test_equals_dense_while_nothing_is_dropped(tiny):
    """Sink 4 + sub-caches 0 and 1 of 64 hold a 120-token prompt: no token is dropped, the virtual positions are the
    true ones, and the logits equal dense attention's (up to fp32 angle rounding of the re-rotation)."""
    ids = _ids(120, 1)
    dense = _llm(tiny).engine.prompt_logits(ids)
    big = {**TINY, "subcache_size": 64}
    for chunk in (64, 24):
        casc = _llm(tiny, big, max_num_batched_tokens=chunk).engine.prompt_logits(ids)
        assert (casc - dense).abs().max() < 2e-4


def test_one_subcache_token_by_token_equals_streaming(tiny):
    """One sub-cache of W and stride 1 is StreamingLLM with a window of W + 1 (the query included), sink positions
    rolled as StreamingLLM rolls them once the window is full: the same logits."""
    S, W = 4, 24
    ids = _ids(160, 2)
    casc = _llm(tiny, {**TINY, "num_subcaches": 1, "subcache_size": W, "stride": 1},
                max_num_batched_tokens=32).engine.prompt_logits(ids)
    stream = _llm(tiny, None, attention="streaming", max_num_batched_tokens=32, attention_config=json.dumps(
        {"n_sink": S, "n_window": W + 1, "block_q": 1, "last_rows": 0, "rope_from": S + W, "dense_below": 0})
    ).engine.prompt_logits(ids)
    assert (casc - stream).abs().max() < 2e-4


def test_chunked_prefill_equals_unchunked_and_batch_equals_alone(tiny):
    """Strides sit at fixed positions: a step holding several runs them one after the other, and a budget that is no
    multiple of the stride (40 vs 16) ends chunks on stride boundaries, so the logits do not depend on the chunking;
    for the same reason sequences in one batch (the scheduler splits budgets between them) equal each alone."""
    from longreach import SamplingParams

    ids = _ids(300, 3)
    whole = _llm(tiny, TINY, max_num_batched_tokens=256).engine.prompt_logits(ids)
    cut = _llm(tiny, TINY, max_num_batched_tokens=40)
    assert cut.engine.scheduler.chunk_align == 16
    assert (whole - cut.engine.prompt_logits(ids)).abs().max() < 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": _ids(n, 4 + n)} for n in (230, 90, 3)]
    llm = _llm(tiny, TINY)
    together = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts]
    assert together == alone


def test_config_errors_are_clear(tiny):
    from longreach.engine.llm import LLM

    assert PRESETS["65k"].cache_tokens == 65536 and PRESETS["65k"].num_subcaches == 8
    assert PRESETS["16k"].cache_tokens == 16384 and PRESETS["4k"].cache_tokens == 4096
    for bad, msg in (({"num_subcaches": 0}, "num_subcaches must be an integer >= 1"),
                     ({"ema": 1.0}, r"ema must be a number in \[0, 1\)"),
                     ({"subcache_size": 2.5}, "subcache_size must be an integer >= 1"),
                     ({"stride": True}, "stride must be an integer >= 1")):
        with pytest.raises(ValueError, match=msg):
            CascadingConfig(**bad)
    kw = dict(device="cpu", kv_cache_memory_gb=0.01, attention="cascading")
    with pytest.raises(ValueError, match=r"unknown CascadingConfig field\(s\) \['window'\]"):
        LLM(tiny, attention_config='{"window": 3}', **kw)
    with pytest.raises(ValueError, match="unknown cascading preset 'x'; available: 65k, 16k, 4k"):
        LLM(tiny, preset="x", **kw)
    with pytest.raises(ValueError, match="cannot be composed with another method"):
        LLM(tiny, decode_attention="dense", **kw)
    with pytest.raises(ValueError, match="KV offloading"):
        LLM(tiny, kv_offloading_size=1, **kw)
    with pytest.raises(ValueError, match="fp8"):
        LLM(tiny, kv_cache_dtype="fp8", **kw)
    with pytest.raises(ValueError, match="the 4180 slots one cascading sequence needs"):
        LLM(tiny, device="cpu", attention="cascading", preset="4k", kv_cache_memory_gb=1e-4, max_model_len=8192,
            max_num_batched_tokens=84)
