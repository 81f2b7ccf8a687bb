"""Stage 0 from boxes around each chunk's keys (kernels/chunk_box.py, `stage0_scores` in attention/infinitehip/),
kept by the engine in a paged pool (attention/infinitehip/boxes.py); the build and score kernels are
kernels/key_boxes.py's, shared with PSA and Quest. Kernels run in Triton's interpreter (conftest)."""
import pytest
import torch

from longreach.kernels.chunk_box import box_move, chunk_box_scores, chunk_boxes, key_boxes
from longreach.kernels.key_boxes import build_boxes_reference, build_boxes_triton
from longreach.kernels.prune_ref import chunk_scores_reference
from longreach.models.config import RopeConfig
from longreach.rope.scaling import rope_inv_freq
from longreach.rope.strategies import RopeArgs


def _case(seed, L=400, Hq=4, Hkv=2, D=16, chunk=16, n_sink=8, n_window=32):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, Hkv, D, generator=g)
    rows = [(0, 8), (8, 1), (9, 5)]  # (first row, rows) of three blocks
    ends = torch.tensor([200, 301, L])  # each block's end; its candidates end n_window before
    qs = torch.randn(3, 8, Hq, D, generator=g)
    ok = torch.arange(8)[None, :] < torch.tensor([r for _, r in rows])[:, None]
    cand_end = ends - n_window
    C = -(-L // chunk)
    ids = torch.arange(C).expand(3, Hkv, C).clone()
    ids[ids * chunk >= cand_end[:, None, None]] = -1
    return qs, ok, keys, ids, cand_end, dict(chunk=chunk, n_sink=n_sink)


@pytest.mark.parametrize("mode", [None, "rt", "ci", "de"])
def test_minmax_box_bounds_the_exact_scores(mode):
    """The minmax box's score is an upper bound of the chunk's best key at the positions the strategy gives it (ci:
    the box scorer uses rt, so it bounds rt's exact scores); some blocks remapped, some not."""
    qs, ok, keys, ids, cand_end, kw = _case(0)
    inv = rope_inv_freq(RopeConfig(theta=10000.0), 16)[0]
    rope = None if mode is None else RopeArgs(mode, inv, rope_from=250, group=3, n_window=32)
    box = chunk_box_scores(qs, ok, keys, ids, kw["chunk"], kw["n_sink"], cand_end, 2, "minmax", rope)
    ref_rope = None if mode is None else RopeArgs("rt" if mode == "ci" else mode, inv, 250, 3, 32)
    exact = chunk_scores_reference(qs, ok, keys, ids, kw["chunk"], True, kw["n_sink"], cand_end, 2, rope=ref_rope)
    valid = torch.isfinite(exact)
    assert torch.equal(valid, torch.isfinite(box)) and int(valid.sum()) > 20
    assert bool((box[valid] >= exact[valid] - 1e-4).all())
    assert bool((box[valid] > exact[valid] + 1e-3).any())  # a bound, not the exact score


def test_one_key_chunks_score_exactly():
    qs, ok, keys, _, cand_end, kw = _case(1)
    ids = torch.arange(400).expand(3, 2, 400).clone()
    ids[ids >= cand_end[:, None, None]] = -1
    inv = rope_inv_freq(RopeConfig(theta=10000.0), 16)[0]
    rope = RopeArgs("rt", inv, rope_from=250, n_window=32)
    for kind in ("minmax", "cuboid-mean"):
        box = chunk_box_scores(qs, ok, keys, ids, 1, 8, cand_end, 2, kind, rope)
        exact = chunk_scores_reference(qs, ok, keys, ids, 1, True, 8, cand_end, 2, rope=rope)
        assert torch.allclose(box, exact, atol=1e-4)


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_pair_index_follows_head_pairs(groups):
    from longreach.attention.executor import head_pairs
    from longreach.kernels.chunk_box import pair_index

    pairs, _ = head_pairs(8, 2, groups)
    group, kv = pair_index(len(pairs), 2, groups, torch.device("cpu"))
    assert list(zip(group.tolist(), kv.tolist())) == pairs


def test_slicing_changes_nothing():
    qs, ok, keys, ids, cand_end, kw = _case(2)
    inv = rope_inv_freq(RopeConfig(theta=10000.0), 16)[0]
    rope = RopeArgs("rt", inv, rope_from=250, n_window=32)
    whole = chunk_box_scores(qs, ok, keys, ids, 16, 8, cand_end, 2, "cuboid-mean", rope)
    assert torch.equal(whole, chunk_box_scores(qs, ok, keys, ids, 16, 8, cand_end, 2, "cuboid-mean", rope,
                                               max_bytes=1))


@pytest.mark.parametrize("kind", ["minmax", "cuboid-mean"])
def test_a_partial_chunk_is_boxed_over_its_own_keys(kind):
    keys = torch.randn(40, 2, 16, generator=torch.Generator().manual_seed(3))
    boxes = chunk_boxes(keys, 16, kind)
    assert boxes.shape == (3, 2, 2, 16)
    assert torch.allclose(boxes[2], chunk_boxes(keys[32:], 8, kind)[0])
    assert torch.allclose(boxes[:2], chunk_boxes(keys[:32], 16, kind))


INV = rope_inv_freq(RopeConfig(theta=10000.0), 16)[0]


def _paged(lengths, page, dtype=torch.float32, seed=0):
    """A scattered paged cache (NaN in unowned slots) and its tables: tests/test_kernel_bsa.py's."""
    from tests.test_kernel_bsa import _cache

    kc, _, tables = _cache(lengths, 2, 16, page, dtype, torch.Generator().manual_seed(seed))
    return kc, tables


def _build_case(kind, mode, builder, dtype=torch.float32, tiered=False, fp8=False):
    """Three sequences box chunk ranges [lo, hi) (a partial last chunk, an empty range, a range from the middle)
    into a pool of 4-chunk pages through scrambled box tables; returns (pool, want) with want the rows of key_boxes
    of each sequence's keys where they were written, NaN elsewhere."""
    lengths, page, chunk, per = [70, 33, 130], 4, 8, 4
    kc, tables = _paged(lengths, page, dtype)
    if fp8:  # fp8 rows with per-row scales (kvcache/fp8.py); the boxes come from the dequantised values
        from longreach.kvcache.fp8 import quantize, values

        kc = quantize(kc.nan_to_num(0.0))
    lens = torch.tensor(lengths, dtype=torch.int32)
    lo = torch.tensor([0, 5, 6], dtype=torch.int32)
    hi = torch.tensor([9, 5, 17], dtype=torch.int32)  # 70 tokens: 9 chunks, the last partial
    box_tables = torch.tensor([[5, 0, 9, 0, 0], [1, 1, 1, 1, 1], [2, 7, 3, 8, 6]], dtype=torch.int32)
    pool = torch.full((10 * per, 2, 2, 2, 16), float("nan"), dtype=dtype)
    rope = None if mode is None else RopeArgs(mode, INV, rope_from=0, n_window=8)
    cache = kc
    if tiered:
        from tests.test_psa import _tiered

        cache, _ = _tiered(kc, kc, torch.Generator().manual_seed(9), int(tiered))  # tiered 2: head slots
    if builder == "triton":
        build_boxes_triton(cache, tables, lens, lo, hi, box_tables, pool, per, chunk, kind, 12, box_move(rope))
    else:
        build_boxes_reference(cache, tables, lens, lo, hi, box_tables, pool, per, chunk, kind, box_move(rope))
    want = torch.full_like(pool, float("nan"), dtype=torch.float32)
    plain = values(kc, torch.float32) if fp8 else kc
    for r, n in enumerate(lengths):
        keys = torch.cat([plain[p] for p in tables[r, :-(-n // page)].tolist()])[:n]
        boxes = key_boxes(keys, 0, chunk, kind, rope)
        for j in range(int(lo[r]), int(hi[r])):
            want[int(box_tables[r, j // per]) * per + j % per] = boxes[j]
    return pool, want


@pytest.mark.parametrize("mode", [None, "rt", "ci", "il"])
@pytest.mark.parametrize("kind", ["minmax", "cuboid-mean"])
def test_build_reference_writes_each_chunk_where_its_table_says(kind, mode):
    """Both flavours (stored; moved to the strategy's position, ci as rt; the stored keys again without a
    strategy), partial last chunk over its own keys, nothing outside [lo, hi) written."""
    pool, want = _build_case(kind, mode, "reference")
    assert torch.equal(torch.isnan(pool), torch.isnan(want))
    assert torch.allclose(pool.nan_to_num(), want.nan_to_num(), atol=1e-6)
    written = ~torch.isnan(want[:, 0, 0, 0, 0])
    assert int(written.sum()) == 9 + 11
    if mode is None:
        assert torch.equal(pool[written, 0], pool[written, 1])
    else:
        assert not torch.allclose(pool[written, 0], pool[written, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [("minmax", "rt", False, False), ("cuboid-mean", None, False, False),
                                  ("minmax", "il", True, False), ("minmax", "rt", True, True),
                                  ("minmax", "rt", 2, True)])
def test_build_kernel_matches_the_reference(case, dtype):
    """The Triton kernel (interpreter) against the reference, through a two-tier cache too (resident pages from the
    pool, the rest from host memory) and on fp8 rows (the pool in the run dtype)."""
    kind, mode, tiered, fp8 = case
    got, _ = _build_case(kind, mode, "triton", dtype, tiered, fp8)
    want, _ = _build_case(kind, mode, "reference", dtype, tiered, fp8)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (got.float() - want.float()).nan_to_num().abs().max() <= tol


@pytest.mark.parametrize("rows_tile", [0, 16, 64])
@pytest.mark.parametrize("dtype, groups, D", [(dt, g, 16) for dt in (torch.float32, torch.float16) for g in (2, 1, 8)]
                         + [(torch.float16, 2, 256)])
def test_score_kernel_matches_the_torch_scores(dtype, groups, D, rows_tile):
    """The Triton scorer (interpreter) reads the kept boxes through a scrambled box table and takes each block's
    flavour; the reference gathers them. Blocks of 1-8 rows (decode and prefill), some moved, candidates cut on both
    sides (-inf outside). Head dim 256 (Gemma 3) scores 32 chunks per program (64 would overflow an H100's shared
    memory), so its 37 chunks take two. rows_tile: 0 the box-tile layout, else the long-prefill layout with tiles of
    that many rows (16: several per block, combined by atomic max; 64: one)."""
    from longreach.kernels.key_boxes import box_scores_reference, box_scores_triton

    g = torch.Generator().manual_seed(groups)
    nb, R, Hq, Hkv, per, n = 4, 8, 8, 2, 4, 37
    q32, q_moved = torch.randn(2, nb, R, Hq, D, generator=g)
    q32[1, 1:] = q32[1, :1]  # a one-row block: rows past it repeat its first (box_queries)
    q_moved[1, 1:] = q_moved[1, :1]
    moved = torch.tensor([False, True, False, True])
    pool = torch.randn(12 * per, 2, 2, Hkv, D, generator=g).to(dtype)
    pool[:, :, 1] = pool[:, :, 1].abs()
    table = torch.randperm(12, generator=g)[:10].int()
    cand_hi = torch.tensor([n, 20, 3, 30], dtype=torch.int32)  # block 2: no candidate past cand_lo
    got = box_scores_triton(q32, pool, table, per, 3, cand_hi, n, groups, q_moved, moved, rows_tile=rows_tile,
                            rows_block_c=16)
    want = box_scores_reference(q32, pool, table, per, 3, cand_hi, n, groups, q_moved, moved, max_bytes=1 << 20)
    P = Hkv if groups != Hq else Hq
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    fin = torch.isfinite(want)
    assert got.shape == want.shape == (nb, P, n) and torch.equal(fin, torch.isfinite(got))
    assert int(fin.sum()) == P * (34 + 17 + 0 + 27) and (got[fin] - want[fin]).abs().max() <= tol


ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.02, max_num_batched_tokens=256,
                 max_model_len=1024)
BOX_CFG = '{"n_sink": 8, "n_window": 32, "chunk_sizes": [64, 16], "budgets": [256, 64], "refresh": [2, 1], ' \
          '"early_last_budget": null, "dense_below": %d, "stage0_scores": "%s"}'


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("box") / "m", max_position_embeddings=256)[0]


def test_infinitehip_with_a_box_stage0(tiny_long, monkeypatch):
    """Through the engine past the trained length: a box stage 0 keeps different chunks than SelectRep and selects
    within budget. The kept boxes (pool, across prefill chunks of 256 tokens and decode steps) give the logits and
    tokens of boxes built from every key at each call; the pool holds the sequence's pages only while it lives; a
    bad value is a clear error."""
    from longreach.attention.sparse import SequenceKeys
    from longreach.engine.llm import LLM
    from longreach.sampling_params import SamplingParams

    ids = torch.randint(3, 256, (900,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    logits, tokens = {}, {}
    for kind in ("selectrep", "minmax", "fresh"):
        if kind == "fresh":  # no kept boxes: every call builds them from the keys
            monkeypatch.setattr(SequenceKeys, "chunk_boxes", lambda self, chunk: None)
        llm = LLM(tiny_long, attention="infinitehip", attention_config=BOX_CFG % (0, kind.replace("fresh", "minmax")),
                  **ENGINE_KW)
        logits[kind] = llm.engine.prompt_logits(ids)
        assert torch.isfinite(logits[kind]).all()
        tokens[kind] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].token_ids
        boxes = llm.engine.backend.boxes
        if kind == "selectrep":
            assert boxes is None
        else:
            assert llm.engine.backend.graph_unsupported() is None
            boxes.check_integrity()
            assert not boxes.rows and len(boxes._free_pages) == boxes.pool.shape[1] // boxes.per  # all given back
    assert (logits["selectrep"][600:] - logits["minmax"][600:]).abs().max() > 1e-4
    assert torch.equal(logits["minmax"], logits["fresh"]) and tokens["minmax"] == tokens["fresh"]
    with pytest.raises(ValueError, match="stage0_scores must be one of selectrep, minmax, cuboid-mean"):
        LLM(tiny_long, attention="infinitehip", attention_config='{"stage0_scores": "bound"}', **ENGINE_KW)
    with pytest.raises(ValueError, match="SelfExtend"):
        LLM(tiny_long, attention="infinitehip", attention_config='{"stage0_scores": "minmax", "prune_rope": "de"}',
            **ENGINE_KW)


def test_the_pool_never_runs_out_while_the_kv_cache_has_room():
    """Sized from the KV capacity: as many of the shortest sequences that hold boxes as fit in it (each one token past
    the limit, so each needs a page of its own), or max_num_seqs of them, all get their pages; the reservation per
    token stays bounded for a limit of 0."""
    from longreach.attention.infinitehip import BoxPool

    for min_len, max_seqs in ((100, 64), (0, 8), (3328, 4)):
        pool = BoxPool(2, 64, "minmax", 2, 16, min_len, max_seqs, 1 << 16, torch.device("cpu"))
        capacity = 6000
        pool.ensure(capacity, torch.float32)
        n = min(max_seqs, capacity // (min_len + 1))
        lengths = [min_len + 1] * n
        lengths[0] += capacity - sum(lengths)  # the rest of the capacity in one long sequence
        pool.plan(list(range(n)), lengths)
        rows, lens, lo, hi = pool.assign()
        assert len(set(rows)) == n and lens == lengths and hi[0] == -(-lengths[0] // 64)
        assert sum(len(p) for p in pool.pages.values()) <= pool.pool.shape[1] // pool.per
        pool.check_integrity()
        assert pool.bytes_per_token(torch.float32) <= 2 * 2 * 4 * 2 * 16 * 4 / 64 * 2
        for seq in range(n):
            pool.free(seq)
        pool.check_integrity()
        assert not pool.rows and len(pool._free_pages) == pool.pool.shape[1] // pool.per
        pool.pages[0], pool.rows[0] = [3], pool._free_rows.pop()  # a page both owned and free: caught
        with pytest.raises(AssertionError, match="lost or duplicated"):
            pool.check_integrity()


def test_the_pool_made_for_the_memory_probe_grows_to_the_real_cache():
    """The engine's GPU memory probe runs a prefill on a cache of one step's pages before it sizes the real cache
    (the H100 run that found it: 12 box pages for a 3M-token cache, then "the box pool is full"): the real cache's
    bind makes the pool again at its size; a pool with sequences in it refuses to grow."""
    from longreach.attention.infinitehip import BoxPool

    def pages(pool):
        return pool.pool.shape[1] // pool.per

    pool = BoxPool(2, 64, "minmax", 2, 16, 100, 4, 1 << 16, torch.device("cpu"))
    fresh = BoxPool(2, 64, "minmax", 2, 16, 100, 4, 1 << 16, torch.device("cpu"))
    fresh.ensure(50_000, torch.float32)
    pool.ensure(8192, torch.float32)  # the probe's cache
    pool.plan([-1], [8192])
    pool.assign()
    pool.free(-1)  # the probe's sequence is freed
    small = pages(pool)
    pool.ensure(50_000, torch.float32)  # the engine binds the real cache
    assert pages(pool) == pages(fresh) > small
    pool.ensure(8192, torch.float32)  # a smaller cache later (a forward's k_cache): kept
    assert pages(pool) == pages(fresh)
    pool.plan([0], [40_000])
    pool.assign()
    with pytest.raises(RuntimeError, match="cannot grow"):
        pool.ensure(100_000, torch.float32)


def test_boxes_catch_up_after_another_backends_prefill(tiny_long, monkeypatch):
    """--attention dense --decode-attention infinitehip with boxes: the prefill backend builds no boxes, so the
    first decode step boxes the whole prompt (eager, and on the emulated graph path its catch-up variant); the
    tokens equal those of boxes built from the keys at every call."""
    from longreach.attention.sparse import SequenceKeys
    from longreach.engine.llm import LLM
    from longreach.sampling_params import SamplingParams

    ids = torch.randint(3, 256, (700,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = {}
    for run in ("eager", "graph", "fresh"):
        if run == "fresh":
            monkeypatch.setattr(SequenceKeys, "chunk_boxes", lambda self, chunk: None)
        llm = LLM(tiny_long, attention="dense", decode_attention="infinitehip",
                  decode_attention_config=BOX_CFG % (0, "minmax"), enforce_eager=run != "graph", **ENGINE_KW)
        if run == "graph":
            llm.engine.runner.capture_graphs(emulate=True)
        out[run] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].token_ids
        if run == "graph":
            assert any(key[4] for _, key in llm.engine.runner._graphs)  # a catch-up variant ran
    assert out["eager"] == out["fresh"] == out["graph"]


def test_graph_steps_below_the_limit_build_no_boxes(tiny_long, monkeypatch):
    """On the (emulated) graph path, a decode variant whose rows are all within the dense limit (the boxes start
    past it) launches no box build; once the sequence is past the limit the build runs (the catch-up variant boxes
    what the dense steps skipped), and the tokens equal the eager run's, which plans and builds every step."""
    from longreach.attention.infinitehip.boxes import BoxPool
    from longreach.engine.llm import LLM
    from longreach.sampling_params import SamplingParams

    builds = []
    real = BoxPool.build

    def counted(self, layer, q, k_cache, meta, rope=None, graph=None):
        if graph is not None:  # a graph step's build (the eager prefill chunks box as they always did)
            builds.append(max(meta.seq_lens.tolist()))
        return real(self, layer, q, k_cache, meta, rope, graph)

    monkeypatch.setattr(BoxPool, "build", counted)
    ids = torch.randint(3, 256, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # 300 -> 340 crosses dense_below 320
    out = {}
    for run in ("eager", "graph"):
        llm = LLM(tiny_long, attention="infinitehip", attention_config=BOX_CFG % (320, "minmax"),
                  enforce_eager=run != "graph", **ENGINE_KW)
        if run == "graph":
            llm.engine.runner.capture_graphs(emulate=True)
        builds.clear()
        out[run] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].token_ids
        if run == "graph":
            keys = {key for _, key in llm.engine.runner._graphs}
            assert {k[2] for k in keys} == {(True,), (False,)}  # steps below and past the limit both ran
            assert builds and min(builds) > 320  # no build while every row was within the limit
    assert out["eager"] == out["graph"]
