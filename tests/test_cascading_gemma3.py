"""Cascading on a model with sliding-window layers (issue 33, item 3), fp32 on CPU with the tiny Gemma 3 of
tests/test_gemma3.py (window 8, layers 0, 1, 3 sliding, layer 2 global): the cascade is the global layer's cache,
the sliding layers keep their ring and attend densely within their window. A cascade that holds the whole context
equals transformers (logits whole and in chunks, greedy tokens); one far smaller than the prompt runs through chunked
prefill and decode in a fixed number of pages and a fixed ring, its invariants kept at every step."""
import json
import logging

import pytest
import torch

from longreach import LLM, SamplingParams
from longreach.attention.dense import DenseBackend

from conftest import greedy_vs_transformers
from test_gemma3 import _engine, _hf_logits, _tiny_gemma3

pytestmark = pytest.mark.usefixtures("one_thread")

BIG = {"n_sink": 4, "num_subcaches": 2, "subcache_size": 32, "stride": 16, "block_q": 8, "block_k": 4}  # 68 tokens
SMALL = {"n_sink": 4, "num_subcaches": 3, "subcache_size": 8, "stride": 16, "block_q": 8, "block_k": 4}  # 28 tokens


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return _tiny_gemma3(tmp_path_factory.mktemp("g3") / "g3")


def _ids(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_cascade_holding_the_context_equals_transformers(gemma):
    """Nothing dropped: the virtual positions are the true ones, so the global layer is exact attention and the
    logits are transformers' (had the cascade served a sliding layer, that layer would see the whole 40-token prompt,
    not its 8-token window), whole and in chunks of 16 (strides, the sliding layers reading their window from the
    ring); 24 greedy tokens of a 20-token prompt (past the window) are transformers' too."""
    path, hf = gemma
    ids = _ids(40, 1)
    ref = _hf_logits(hf, ids)
    for chunk in (64, 16):
        eng = _engine(path, attention="cascading", attention_config=json.dumps(BIG), block_size=4,
                      max_num_batched_tokens=chunk)
        assert eng.backend.fallback.layers == (0, 1, 3) and eng.backend._cascade_layer == {2: 0}
        assert (eng.prompt_logits(ids) - ref).abs().max().item() <= 1e-4
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_gb=0.02, block_size=4,
              attention="cascading", attention_config=json.dumps(BIG), max_num_batched_tokens=16)
    want, got = greedy_vs_transformers(llm, hf, _ids(20, 2), 24)  # test_gemma3.py's: no end-of-text within 24
    assert got == want and len(set(want)) > 3


def test_a_small_cascade_runs_past_its_capacity_in_bounded_memory(gemma, caplog):
    """With a 28-token cascade, a 300-token prompt prefilled in chunks of at most 48 tokens (whole 16-token
    strides) while a 70-token one decodes between them, then 40 greedy tokens each: each sequence holds at most the
    layout's pages (and exactly that many once its cascade is full) and one ring slot, its cascade drops tokens; the
    stores and the cascade's side state (one global layer) keep their sizes; the block manager's and the cascade's
    invariants hold at every step and everything is returned at the end. The start-up log counts the global layers'
    pages as the cascade's slots."""
    path = gemma[0]
    with caplog.at_level(logging.INFO, logger="longreach"):
        llm = LLM(path, device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.02, block_size=4,
                  attention="cascading", attention_config=json.dumps(SMALL), max_num_batched_tokens=48,
                  max_num_seqs=2)
    eng = llm.engine
    lay, cache = eng.backend.kv_layout, eng.kv_cache
    pages = -(-lay.max_slots // eng.config.block_size)
    assert lay.side_bytes_per_token == 1 * 2 * 8  # one global layer, two KV heads
    assert "global layers keep the pages of cascading's bounded cache per sequence" in caplog.text
    assert f"keeps every sequence in at most {pages} pages" in caplog.text
    assert eng.blocks.num_blocks == 2 * pages and cache.num_slots == 2  # two sequences at once, no idle pages
    sizes = (cache.inner.nbytes, cache.ring.nbytes)
    for i, n in enumerate((300, 70)):
        eng.add_request(str(i), _ids(n, 10 + i), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    held, done, dropped = {}, {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for seq in eng.scheduler.running:
            held.setdefault(seq.seq_id, []).append(len(eng.blocks.table(seq.seq_id)))
            assert eng.blocks.slot(seq.seq_id) in (0, 1)
            eng.backend.check_integrity(seq.seq_id)
            stats = eng.backend.cache_stats(seq.seq_id)
            assert stats["cached"] <= 4 + 24
            dropped = max(dropped, stats["tokens"] - stats["cached"])
        eng.blocks.check_integrity()
    assert sorted(done) == ["0", "1"] and all(len(t) == 40 for t in done.values()) and dropped > 300
    for h in held.values():
        assert max(h) <= pages and h[-1] == pages
    assert (cache.inner.nbytes, cache.ring.nbytes) == sizes and eng.backend._score.shape[0] == 1
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.backend._rings
    # the cascade dropped tokens: the long prompt's tokens differ from dense attention's
    dense = LLM(path, device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.02, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert dense.generate([{"prompt_token_ids": _ids(300, 10)}], params, use_tqdm=False)[0].token_ids != done["0"]


def test_a_backend_that_does_not_honour_the_windows_is_refused(gemma):
    """Every built-in method now runs a model with sliding-window layers; a user's backend that does not declare
    `honours_layer_windows` is refused with the methods that take it."""
    class Plain(DenseBackend):
        name = "plain"
        honours_layer_windows = False

    eng = _engine(gemma[0])
    why = Plain.unsupported_reasons(eng.model_config, eng.config)
    assert len(why) == 1 and "plain does not honour" in why[0] and "cascading" in why[0]
