"""Issue 33, items 2 and 4: the sliding-window layers' bounded KV (a ring of `window` rows per sequence slot,
kvcache/window.py), fp32 on CPU with the tiny Gemma 3 of tests/test_gemma3.py (window 8, layers 0, 1, 3 sliding):
transformers' logits and greedy tokens with chunks smaller and larger than the window, a ring whose size does not
grow with the context, slots reused without stale keys, offloading, and the KV sizing."""
import dataclasses
import json

import pytest
import torch

from longreach import LLM, SamplingParams
from longreach.config import EngineConfig
from longreach.kvcache.base import KVNeeds
from longreach.kvcache.build import GiB, build_kv_cache
from longreach.kvcache.paged import PagedKVCache
from longreach.kvcache.window import WindowedKVCache, ring_bytes_per_slot
from longreach.models.config import ModelConfig

from test_gemma3 import WINDOW, _engine, _hf_logits, _tiny_gemma3

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return _tiny_gemma3(tmp_path_factory.mktemp("g3") / "g3")


def _ids(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(hf, ids, n):
    with torch.no_grad():
        return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def _prefill_in_chunks(eng, prompts, sizes):
    """Prefill `prompts` side by side, one step per entry of `sizes` (each prompt's chunk of that step, cycling), all
    in the same steps; returns each prompt's logits (n, V)."""
    from longreach.engine.scheduler import ScheduledBatch

    seqs = [eng.scorer.new_sequence(p) for p in prompts]
    logits = [[] for _ in prompts]
    step = 0
    while any(s.num_computed < s.num_tokens for s in seqs):
        live = [i for i, s in enumerate(seqs) if s.num_computed < s.num_tokens]
        ns = [min(sizes[(step + i) % len(sizes)], seqs[i].num_uncomputed) for i in live]
        for i, n in zip(live, ns):
            assert eng.blocks.ensure(seqs[i].seq_id, seqs[i].num_computed + n)
        out, _ = eng.runner.execute(ScheduledBatch(True, [seqs[i] for i in live], ns), all_logits=True)
        start = 0
        for i, n in zip(live, ns):
            logits[i].append(out[start:start + n])
            start += n
            seqs[i].num_computed += n
        step += 1
    for s in seqs:
        eng.scorer.release(s)
    return [torch.cat(x) for x in logits]


def test_ring_prefill_matches_transformers_with_any_chunk(gemma):
    """Two prompts prefilled in the same steps, in chunks of 1 to 16 tokens (smaller and larger than the 8-token
    window, most not a multiple of the 4-token page): the window before each chunk comes from the ring, its own keys
    directly; both prompts' logits equal transformers'."""
    path, hf = gemma
    eng = _engine(path, block_size=4)
    assert isinstance(eng.kv_cache, WindowedKVCache)
    prompts = [_ids(40, 1), _ids(29, 3)]
    for sizes in ([5, 3, 9, 16, 1, 7], [16, 12]):
        for got, ids in zip(_prefill_in_chunks(eng, prompts, sizes), prompts):
            assert (got - _hf_logits(hf, ids)).abs().max().item() <= 1e-4
    eng.blocks.check_integrity()


def test_blocked_window_prefill_matches_transformers(gemma, monkeypatch):
    """A long chunk's sliding-window attention in query blocks (dense.py `_window_blocks`: blocks of the 8-token
    window here, every chunk over two blocks long): whole prompts and 20-token chunks after a prefix equal
    transformers' logits."""
    from longreach.attention import dense

    monkeypatch.setattr(dense, "WINDOW_BLOCK_MIN", 1)
    calls = []
    blocked = dense._window_blocks
    monkeypatch.setattr(dense, "_window_blocks", lambda *a: calls.append(a[0].shape[0]) or blocked(*a))
    path, hf = gemma
    eng = _engine(path, block_size=4)
    prompts = [_ids(60, 5), _ids(37, 6)]
    for sizes in ([60], [17, 20, 20, 3]):
        for got, ids in zip(_prefill_in_chunks(eng, prompts, sizes), prompts):
            assert (got - _hf_logits(hf, ids)).abs().max().item() <= 1e-4
    assert calls and max(calls) == 60 and min(calls) == 17


@pytest.mark.parametrize("n, prefix, window, block, k_start, h_q, h_kv", [
    (100, 0, 8, 8, 0, 4, 2), (100, 7, 8, 8, 3, 4, 2), (257, 30, 16, 16, 100, 8, 2), (64, 0, 8, 16, 0, 2, 1),
    (99, 5, 4, 7, 0, 4, 4), (50, 50, 64, 16, 0, 4, 2)])
def test_window_blocks_equal_one_banded_mask(n, prefix, window, block, k_start, h_q, h_kv):
    """The blocked layout (front padding where the prefix is shorter than the window, dropped keys where it is longer,
    a last partial block) gives the single banded mask's attention, fp32."""
    from longreach.attention.dense import WINDOW_BLOCK_MIN, _window_blocks, window_attention

    g = torch.Generator().manual_seed(n + prefix)
    q = torch.randn(n, h_q, 32, generator=g)
    k, v = torch.randn(2, n + prefix, h_kv, 32, generator=g)
    assert n <= 2 * max(window, WINDOW_BLOCK_MIN)  # window_attention's own path: one mask
    want = window_attention(q, k, v, 0.2, window, k_start)
    got = _window_blocks(q, k, v, 0.2, window, block)
    assert (got - want).abs().max().item() <= 1e-5


def test_ring_holds_a_fixed_window_whatever_the_context(gemma):
    """The global layer alone has pages (1 layer of 4 in the paged store), the three sliding layers a ring of
    (max_num_seqs + 1) x 8 rows: a 100-token and a 400-token prompt use the same ring bytes, and pages only in
    proportion to the global layer's tokens; their logits match transformers."""
    path, hf = gemma
    eng = _engine(path, block_size=4, max_model_len=512, max_num_seqs=4)
    cache = eng.kv_cache
    assert cache.window == WINDOW and cache.window_layers == {0, 1, 3}
    assert cache.inner.kv.shape[0] == 1 and cache.ring.kv.shape[0] == 3
    ring_bytes = cache.ring.nbytes
    assert ring_bytes == (4 + 1) * ring_bytes_per_slot(3, WINDOW, 2, 32, torch.float32)
    per_page = PagedKVCache.bytes_per_block(1, 4, 2, 32, torch.float32)
    for n in (100, 400):
        ids = _ids(n, n)
        seen = []
        free = eng.blocks.free

        def spy(seq_id):
            seen.append(len(eng.blocks.table(seq_id)))
            free(seq_id)
        eng.blocks.free = spy
        assert (eng.prompt_logits(ids) - _hf_logits(hf, ids)).abs().max().item() <= 1e-4
        eng.blocks.free = free
        assert seen == [n // 4]  # the global layer's pages: n tokens of one layer (per_page bytes each)
        assert cache.ring.nbytes == ring_bytes and seen[0] * per_page == n * 2 * 2 * 32 * 4
    eng.blocks.check_integrity()


def test_several_sequences_and_reused_slots(gemma):
    """Two slots (max_num_seqs 2), four prompts of different lengths (one of 3 tokens, shorter than the window, and
    one of 5): the later ones run in slots the earlier ones left, as the greedy tokens of each run alone (transformers)
    show; a stale key in a reused ring would change them."""
    path, hf = gemma
    prompts = [_ids(n, 10 + n) for n in (30, 13, 3, 5)]
    lens = [14, 6, 12, 10]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_gb=0.02, block_size=4,
              max_num_seqs=2)
    assert llm.engine.blocks.num_slots == 2
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens], use_tqdm=False)
    for p, n, o in zip(prompts, lens, outs):
        assert o.token_ids == _greedy(hf, p, n)
    llm.engine.blocks.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_slot_is_freed_with_the_pages_and_refused_when_none_is_left():
    from longreach.kvcache.block_manager import BlockManager

    bm = BlockManager(8, 4, num_slots=2)
    assert bm.ensure(1, 4) and bm.ensure(2, 4)
    assert bm.slot(1) != bm.slot(2)
    assert not bm.ensure(3, 4) and not bm.owns(3) and bm.num_free_blocks == 6  # no slot: refused, nothing taken
    s = bm.slot(1)
    bm.free(1)
    assert bm.ensure(3, 4) and bm.slot(3) == s
    bm.check_integrity()


def test_offloaded_global_layers_with_the_ring(gemma):
    """With offloading only the global layer goes to the host tier (one layer), the ring stays on the device; logits
    and greedy tokens equal transformers' (and so the cache without offloading)."""
    path, hf = gemma
    ids = _ids(40, 1)
    eng = _engine(path, max_num_batched_tokens=16, block_size=4, kv_offloading_size=0.01)
    cache = eng.kv_cache
    assert isinstance(cache, WindowedKVCache) and cache.inner.host.shape[0] == 1
    assert (eng.prompt_logits(ids) - _hf_logits(hf, ids)).abs().max().item() <= 1e-4
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_gb=0.02, block_size=4,
              kv_offloading_size=0.01, max_num_batched_tokens=16)
    ids = _ids(20, 2)
    got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].token_ids
    assert got == _greedy(hf, ids, 16)


def test_kv_sizing_counts_the_global_layers_and_the_ring(gemma):
    """Same budget: tokens = (budget - ring) / (G x 2 x H_kv x D x bytes); an all-global cache holds
    budget / (L x 2 x H_kv x D x bytes): here L / G = 4 times fewer, less the ring's share."""
    path, _ = gemma
    cfg = EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256,
                       block_size=4, max_num_seqs=8)
    with open(f"{path}/config.json") as f:
        mc = ModelConfig.from_hf(json.load(f))
    dev = torch.device("cpu")
    blocks, cache = build_kv_cache(cfg, mc, torch.float32, dev, KVNeeds(), lambda: 0.0)
    plain = dataclasses.replace(mc, sliding_layers=(), sliding_window=None)
    all_blocks, all_cache = build_kv_cache(cfg, plain, torch.float32, dev, KVNeeds(), lambda: 0.0)
    assert isinstance(all_cache, PagedKVCache) and all_blocks.num_slots is None
    budget = 0.05 * GiB
    per_token = 2 * 2 * 32 * 4  # K and V, 2 KV heads of 32 fp32
    ring = (8 + 1) * 3 * WINDOW * per_token
    assert blocks.num_slots == 8 and cache.ring.nbytes == ring
    assert blocks.num_blocks == int((budget - ring) // (4 * 1 * per_token))
    assert all_blocks.num_blocks == int(budget // (4 * 4 * per_token))
    ratio = blocks.num_blocks / all_blocks.num_blocks
    assert ratio == pytest.approx(4 * (1 - ring / budget), rel=1e-3) and ratio > 3.9


def test_gemma3_12b_shape_per_token_bytes_half_llama_8b():
    """Item 4's goal in bytes: on the Gemma-3-12B shape (48 layers, 8 global, 8 KV heads of 256, window 1024) only
    the global layers grow, 64 KiB per token in bf16, half of Llama-3.1-8B's 128 KiB (32 layers, 8 KV heads of 128);
    the ring is fixed, 320 MiB per sequence slot."""
    from longreach.kvcache.build import ring_plan
    from longreach.models.config import gemma3_sliding_layers

    g12 = ModelConfig("gemma3", 262144, 3840, 15360, 48, 16, 8, 256, 1e-6, 131072, sliding_window=1024,
                      sliding_layers=gemma3_sliding_layers(48))
    cfg = EngineConfig(model="x", device="cpu", max_num_seqs=1)
    G, slots, ring = ring_plan(cfg, g12, torch.bfloat16, 80 * GiB)
    assert (G, slots) == (8, 1) and ring == 2 * 320 * 2**20
    gemma_token = PagedKVCache.bytes_per_block(G, 1, 8, 256, torch.bfloat16)
    llama_token = PagedKVCache.bytes_per_block(32, 1, 8, 128, torch.bfloat16)
    assert gemma_token == 64 * 1024 and llama_token == 2 * gemma_token
    # at 1M tokens: 64 GiB of global pages + 0.625 GiB of ring vs Llama's 128 GiB
    assert (2**20 * gemma_token + ring) / (2**20 * llama_token) < 0.51


@pytest.mark.parametrize("kv_dtype", ["fp8", "auto"])
def test_bench_decode_sizes_a_windowed_model_by_its_stores(kv_dtype):
    """bench decode's KV need for the Gemma-3-12B shape: the global layers' pages (as the paged store lays them out)
    plus the ring of `batch` slots and the scratch one (as ring_plan makes it), not every layer per token."""
    from longreach.engine.llm_engine import resolve_kv_dtype
    from longreach.kvcache.build import ring_plan
    from longreach.models.random_init import random_shape
    from longreach.tools.bench.decode_memory import _kv_bytes_per_token, _kv_need_bytes

    mc = random_shape("random:gemma-3-12b").config
    dt = resolve_kv_dtype(kv_dtype, torch.bfloat16)
    G, slots, ring = ring_plan(EngineConfig(model="x", device="cpu", max_num_seqs=2), mc, dt, 200 * GiB)
    assert (G, slots) == (8, 2)
    assert _kv_bytes_per_token(mc, kv_dtype, torch.bfloat16) * 16 == PagedKVCache.bytes_per_block(G, 16, 8, 256, dt)
    need = _kv_need_bytes(mc, 2**20, 64, 2, {"kv_cache_dtype": kv_dtype}, torch.bfloat16)
    pages = 2 * -(-(2**20 + 64) // 16)
    assert need == pages * PagedKVCache.bytes_per_block(G, 16, 8, 256, dt) + ring
