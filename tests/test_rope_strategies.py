"""RoPE position strategies (rope/strategies.py): the rotation itself, what each strategy means on real attention,
and the Triton kernels against the PyTorch references with every strategy (interpreter on CPU, fp16/fp32)."""
import pytest
import torch

from longreach.attention.executor import block_sparse_attention
from longreach.attention.index import QueryBlocks, SparseIndex
from longreach.kernels.bsa import block_sparse_attention_triton
from longreach.kernels.prune_ref import chunk_scores_reference
from longreach.kernels.prune_stage import chunk_scores_triton
from longreach.kvcache.paged import gather_tokens
from longreach.models.config import RopeConfig
from longreach.rope.scaling import RotaryEmbedding, apply_rope, rope_inv_freq
from longreach.rope.strategies import (
    ATTEND_CODES,
    PRUNE_CODES,
    RopeArgs,
    de_group_size,
    parse_layer_spec,
    rotate,
    strategy_for,
)
from tests.test_kernel_bsa import DEV, _cache


def test_layer_spec():
    spec = parse_layer_spec("ci:0-2,rt", PRUNE_CODES, "prune_rope")
    assert [strategy_for(spec, layer) for layer in (0, 2, 3, 29)] == ["ci", "ci", "rt", "rt"]
    assert strategy_for(parse_layer_spec("st:4", ATTEND_CODES, "x"), 3) == "none"
    for bad in ("xx", "ci:2-1", "ci:a", ""):
        with pytest.raises(ValueError, match="prune_rope"):
            parse_layer_spec(bad, PRUNE_CODES, "prune_rope")
    with pytest.raises(ValueError, match="allowed: none, st, il, de"):
        parse_layer_spec("rt", ATTEND_CODES, "attend_rope")
    assert de_group_size(8192, 8192, 1024) == 2 and de_group_size(1000, 8192, 1024) == 1


def test_rotation_matches_the_model_and_composes():
    rope = RopeConfig(theta=100000.0)
    emb = RotaryEmbedding(rope, 64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g)
    pos = torch.tensor([0, 7, 1000, 65537, 1 << 20])
    cos, sin = emb(pos, torch.float32)
    inv = rope_inv_freq(rope, 64)[0]
    # both compute the angle in fp32; they may differ by a few ulp of position x frequency (~0.06 rad at 1M)
    err = (rotate(x, pos[:, None], inv) - apply_rope(x, cos, sin)).abs().amax(dim=(1, 2))
    assert (err <= 2e-4 + 2.5e-7 * pos * x.abs().max()).all(), err
    # moving a key stored at p to p' = rotating by p' - p; far positions keep ~1e-3 precision (fp32 angles)
    stored = apply_rope(x, cos, sin)
    back = rotate(stored, -pos[:, None], inv)
    assert ((back - x).abs().amax(dim=(1, 2)) <= 2e-4 + 2.5e-7 * pos * x.abs().max()).all()


def _raw_cache(L, Hkv, D, page, g):
    """A cache of keys rotated at their true positions, and the raw (un-rotated) keys."""
    k_raw = torch.randn(L, Hkv, D, generator=g)
    v = torch.randn(L, Hkv, D, generator=g)
    n_pages = -(-L // page)
    table = torch.randperm(n_pages, generator=g).int()
    kc = torch.zeros(n_pages, page, Hkv, D)
    vc = torch.zeros(n_pages, page, Hkv, D)
    return k_raw, v, kc, vc, table


def test_st_attention_is_dense_attention_over_renumbered_keys():
    """A decode row under `st` equals plain attention over its attended keys renumbered 0..n-1, query at n-1."""
    g = torch.Generator().manual_seed(1)
    Hq, Hkv, D, page, S, W, BK = 4, 2, 32, 8, 8, 16, 8
    L = 200
    rope = RopeConfig(theta=10000.0)
    inv = rope_inv_freq(rope, D)[0]
    k_raw, v, kc, vc, table = _raw_cache(L, Hkv, D, page, g)
    pos = torch.arange(L)
    flat = rotate(k_raw, pos[:, None], inv)
    for p in range(L):
        kc[table[p // page], p % page] = flat[p]
        vc[table[p // page], p % page] = v[p]
    q_raw = torch.randn(1, Hq, D, generator=g)
    p = L - 1
    q = rotate(q_raw, torch.tensor([[p]]), inv)
    sel = torch.tensor([[2, 5, 9, 13], [1, 3, 4, 20]])  # per KV group: key blocks wholly in [S, p - W]
    qb = QueryBlocks.build([1], [L - 1], 1)
    blocks, counts = SparseIndex.pack([sel], "cpu")
    idx = SparseIndex(1, BK, S, W, Hkv, qb, blocks, counts)
    out, _ = block_sparse_attention(q, kc, vc, table[None], idx, D ** -0.5,
                                    rope=RopeArgs("st", inv, rope_from=0))
    for h in range(Hq):
        grp = h // (Hq // Hkv)
        keys = idx.attended_positions(0, grp, p)
        n = len(keys)
        kk = rotate(k_raw[keys, grp], torch.arange(n), inv)
        qq = rotate(q_raw[0, h][None], torch.tensor([n - 1]), inv)[0]
        want = torch.softmax(kk @ qq * D ** -0.5, 0) @ v[keys, grp]
        assert torch.allclose(out[0, h], want, atol=1e-4), h
    # below rope_from nothing moves: the result equals true-position attention
    plain, _ = block_sparse_attention(q, kc, vc, table[None], idx, D ** -0.5)
    same, _ = block_sparse_attention(q, kc, vc, table[None], idx, D ** -0.5, rope=RopeArgs("st", inv, rope_from=L))
    assert torch.equal(plain, same)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["st", "il", "de"])
@pytest.mark.parametrize("decode", [False, True])
def test_bsa_kernel_with_rope_matches_reference(dtype, mode, decode):
    Hq, Hkv, D, page, S, W, BK, G = 6, 2, 32, 4, 3, 5, 4, 2
    BQ = 1 if decode else 8
    g = torch.Generator().manual_seed(7 + decode)
    ctx, qlen = ([53, 12], [1, 1]) if decode else ([37, 9], [13, 21])
    kc, vc, tables = _cache([c + n for c, n in zip(ctx, qlen)], Hkv, D, page, dtype, g)
    q = torch.randn(sum(qlen), Hq, D, generator=g).to(dtype).to(DEV)
    qb = QueryBlocks.build(qlen, ctx, BQ)
    sels = []
    for b in range(qb.num_blocks):
        nb = -(-(ctx[qb.seq[b]] + qlen[qb.seq[b]]) // BK)
        sels.append(torch.stack([torch.randperm(nb, generator=g)[: max(1, nb // 2)].sort().values for _ in range(G)]))
    blocks, counts = SparseIndex.pack(sels, DEV)
    idx = SparseIndex(BQ, BK, S, W, G, qb, blocks, counts)
    inv = rope_inv_freq(RopeConfig(theta=10000.0), D)[0]
    rope = RopeArgs(mode, inv, rope_from=30, group=3)  # some blocks remapped, some not
    ref, _ = block_sparse_attention(q.float(), kc.float(), vc.float(), tables, idx, D ** -0.5, rope=rope)
    plain, _ = block_sparse_attention(q.float(), kc.float(), vc.float(), tables, idx, D ** -0.5)
    assert (ref - plain).abs().max() > 1e-2  # the strategy changes the result
    out, _ = block_sparse_attention_triton(q, kc, vc, tables, idx, D ** -0.5, num_splits=2 if decode else 1,
                                           block_n=16, rope=rope)
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    assert (out.float() - ref).abs().max() <= tol


def _scoring_case(dtype, D, chunk, mid_end, seed):
    """One sequence of L = 211 keys (6 query / 2 KV heads, 4-token pages), three 8-row query blocks (the middle one a
    row short, ending at `mid_end` + the window), sorted candidate chunks of `chunk` per block and group with two -1
    at the end of one row, as the stages produce: (kc, table, q, starts, lens, cand_end, ids, qs, ok, keys)."""
    Hq, Hkv, page, rows, G, L, W, nb = 6, 2, 4, 8, 2, 211, 10, 3
    g = torch.Generator().manual_seed(seed)
    kc, _, tables = _cache([L], Hkv, D, page, dtype, g)
    q = torch.randn(nb * rows, Hq, D, generator=g).to(dtype).to(DEV)
    starts = torch.arange(nb, device=DEV) * rows
    lens = torch.tensor([rows, rows - 1, rows], device=DEV)
    cand_end = torch.tensor([L - 3 - W, mid_end, L - W], device=DEV)
    n_chunks = -(-L // chunk)
    ids = torch.stack([torch.stack([torch.randperm(n_chunks, generator=g)[: n_chunks - 3].sort().values
                                    for _ in range(G)]) for _ in range(nb)]).to(DEV)
    ids[0, 0, -2:] = -1  # padding at the end, as the stages produce
    keys = gather_tokens(kc, tables[0], L)
    r = torch.arange(rows, device=DEV)
    qs = q[(starts[:, None] + r).clamp(max=q.shape[0] - 1)].reshape(nb, rows, Hq, D)
    return kc, tables[0], q, starts, lens, cand_end, ids, qs, r[None, :] < lens[:, None], keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["rt", "ci", "il", "de"])
# exact scoring at head dim 32 keeps rows as two halves (kernels/prune_stage.py `_exact_tile`, HALVES), at 16 not
@pytest.mark.parametrize("exact, per_head, D", [(False, True, 16), (False, False, 16), (True, False, 16),
                                                (True, False, 32)])
def test_chunk_score_kernel_with_rope_matches_reference(dtype, mode, exact, per_head, D):
    chunk, G = 4 if exact else 8, 2
    kc, table, q, starts, lens, cand_end, ids, qs, ok, keys = _scoring_case(dtype, D, chunk, 60, 11)
    inv = rope_inv_freq(RopeConfig(theta=10000.0), D)[0]
    rope = RopeArgs(mode, inv, rope_from=100, group=3, n_window=10)  # block 1 ends before rope_from: not remapped
    got = chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, exact, 3, G,
                              rep_per_head=per_head, block_c=16 if not exact else None, rope=rope)
    ref = chunk_scores_reference(qs.float(), ok, keys.float(), ids.long(), chunk, exact, 3, cand_end, G,
                                 rep_per_head=per_head, rope=rope)
    plain = chunk_scores_reference(qs.float(), ok, keys.float(), ids.long(), chunk, exact, 3, cand_end, G,
                                   rep_per_head=per_head)
    cache: dict = {}  # the moved-key tables kept between calls over the same keys give the same scores
    for _ in range(2):
        again = chunk_scores_reference(qs.float(), ok, keys.float(), ids.long(), chunk, exact, 3, cand_end, G,
                                       rep_per_head=per_head, rope=rope, table_cache=cache)
        assert torch.equal(again, ref)
    assert bool(cache) == (mode != "ci")
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite)
    assert torch.equal(ref[1], plain[1])  # the block before rope_from keeps true positions
    assert (ref[0][finite[0]] - plain[0][finite[0]]).abs().max() > 1e-2
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    assert (got[finite] - ref[finite]).abs().max() <= tol * max(1.0, ref[finite].abs().max().item())
    if exact:  # the long-prefill layout (row tiles streaming the chunks) moves the same keys
        alt = chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, exact, 3, G, rope=rope,
                                  rows_tile=16)
        assert torch.equal(torch.isfinite(alt), finite)
        assert (alt[finite] - ref[finite]).abs().max() <= tol * max(1.0, ref[finite].abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", [None, "rt", "il", "de"])
@pytest.mark.parametrize("D, sub", [(16, 2), (32, 4)])
def test_exact_scores_per_run_are_the_next_stages(dtype, mode, D, sub):
    """Exact scoring with a score per run of `sub` keys (`sub`, what infinitehip's next stage reads instead of its
    keys: method.py `runs_for_next`): each run's score is the next stage's score of that sub-chunk, the runs' max is
    the chunk's score, the kernel (both layouts) matches the reference, and `scores_from_runs` gives the next stage's
    scores of the survivors' sub-chunks."""
    from longreach.attention.infinitehip.method import InfiniteHiP

    chunk, G, nb = 8, 2, 3
    R = chunk // sub
    # the middle block's candidate end (61) cuts an edge chunk inside a run
    kc, table, q, starts, lens, cand_end, ids, qs, ok, keys = _scoring_case(dtype, D, chunk, 61, 13 + D)
    g = torch.Generator().manual_seed(D)
    qs, keys = qs.float(), keys.float()
    inv = rope_inv_freq(RopeConfig(theta=10000.0), D)[0]
    rope = None if mode is None else RopeArgs(mode, inv, rope_from=100, group=3, n_window=10)
    n_sink = 5  # inside the first chunk: the sink cuts a run too

    def ref(i, c, **kw):
        return chunk_scores_reference(qs, ok, keys, i.long(), c, True, n_sink, cand_end, G, rope=rope, **kw)

    runs = ref(ids, chunk, sub=sub)  # (nb, G, C * R)
    whole = ref(ids, chunk)
    assert runs.shape == (nb, G, ids.shape[-1] * R)
    assert torch.allclose(runs.reshape(nb, G, -1, R).amax(-1), whole, rtol=1e-6, atol=1e-6)
    subs = (ids[..., None] * R + torch.arange(R, device=DEV)).reshape(nb, G, -1)  # negative under a -1 parent
    direct = ref(subs, sub)
    finite = torch.isfinite(direct)
    assert torch.equal(torch.isfinite(runs), finite) and not finite.all() and finite.any()
    assert torch.allclose(runs[finite], direct[finite], rtol=1e-6, atol=1e-6)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    scale = max(1.0, direct[finite].abs().max().item())
    for rows_tile in (None, 0, 16):  # the layout the launcher picks, the first one, the long-prefill one
        got = chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, True, n_sink, G, rope=rope,
                                  rows_tile=rows_tile, sub=sub)
        assert torch.equal(torch.isfinite(got), finite)
        assert (got[finite] - runs[finite]).abs().max() <= tol * scale
    # the next stage's candidates: the sub-chunks of a top-k of the chunks (ascending, -1 padded)
    keep = torch.where(torch.rand(ids.shape, generator=g).to(DEV) < 0.5, ids, -1).sort(-1, descending=True).values
    keep = torch.where(keep >= 0, keep, torch.iinfo(keep.dtype).max).sort(-1).values
    keep = torch.where(keep == torch.iinfo(keep.dtype).max, -1, keep)
    nxt = (keep[..., None] * R + torch.arange(R, device=DEV)).reshape(nb, G, -1)
    from_runs = InfiniteHiP.scores_from_runs(nxt, ids, runs, R)
    want = ref(nxt, sub)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(from_runs), fin) and fin.any()
    assert torch.equal(from_runs[fin], runs.gather(-1, torch.searchsorted(
        torch.where(ids >= 0, ids, torch.iinfo(ids.dtype).max), torch.div(nxt, R, rounding_mode="floor"))
        .clamp(max=ids.shape[-1] - 1) * R + nxt % R)[fin])
    assert torch.allclose(from_runs[fin], want[fin], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="exact scoring"):
        chunk_scores_reference(qs, ok, keys, ids.long(), chunk, False, n_sink, cand_end, G, sub=sub)
