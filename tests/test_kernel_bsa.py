"""Triton block-sparse attention and chunk-scoring kernels vs their PyTorch references.

On a machine without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest) in fp16/fp32 at
small sizes; tests/gpu/test_kernels.py runs the same comparisons in bf16 at real sizes on a GPU.
"""
import pytest
import torch

from longreach.attention.executor import block_sparse_attention
from longreach.attention.index import QueryBlocks, SparseIndex
from longreach.kernels.bsa import block_sparse_attention_triton
from longreach.kernels.prune_ref import chunk_scores_reference
from longreach.kernels.prune_stage import chunk_scores_triton
from longreach.kvcache.paged import gather_tokens

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(lengths, Hkv, D, page, dtype, g):
    """A shared paged cache holding each sequence's tokens in scattered pages, and the block tables."""
    need = [-(-n // page) for n in lengths]
    n_pages = sum(need) + 3
    perm = torch.randperm(n_pages, generator=g)
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    o = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[o:o + k]
        o += k
    kc = torch.randn(n_pages, page, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(n_pages, page, Hkv, D, generator=g).to(dtype)
    # stale cache memory may hold anything: NaN in every slot no sequence owns must not leak into results
    kc[perm[o:]] = vc[perm[o:]] = float("nan")
    for i, n in enumerate(lengths):
        if n % page:
            kc[tables[i, need[i] - 1], n % page:] = vc[tables[i, need[i] - 1], n % page:] = float("nan")
    return kc.to(DEV), vc.to(DEV), tables.to(DEV)


BSA_CASES = [  # Hq, Hkv, D, page, n_sink, n_window, block_q, block_k, groups, splits
    (6, 2, 16, 4, 3, 5, 8, 4, 2, 1),
    (8, 2, 32, 16, 4, 16, 16, 2, 8, 1),  # per-head selections
    (4, 4, 16, 8, 2, 1, 1, 8, 1, 3),  # decode rows, MHA, split-K
    (9, 3, 64, 16, 8, 32, 64, 8, 3, 1),  # SmolLM2's shape, GQA 3
    (9, 3, 64, 16, 8, 32, 64, 8, 3, 4),  # ... a prefill chunk split four ways (prefill_splits: a paced chunk)
    (8, 1, 16, 4, 0, 0, 8, 4, 1, 2),  # GQA 8, no sink / window, split
    (4, 1, 128, 16, 5, 7, 4, 16, 1, 1),  # head dim 128, GQA 4
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", BSA_CASES, ids=[f"h{c[0]}-kv{c[1]}-d{c[2]}-bq{c[6]}-g{c[8]}-s{c[9]}" for c in BSA_CASES])
def test_bsa_kernel_matches_reference(dtype, case):
    Hq, Hkv, D, page, S, W, BQ, BK, G, splits = case
    g = torch.Generator().manual_seed(sum(case))
    ctx, qlen = ([37, 0, 11], [13, 21, 5]) if BQ > 1 else ([37, 12, 3], [1, 1, 1])
    kc, vc, tables = _cache([c + n for c, n in zip(ctx, qlen)], Hkv, D, page, dtype, g)
    q = torch.randn(sum(qlen), Hq, D, generator=g).to(dtype).to(DEV)
    qb = QueryBlocks.build(qlen, ctx, BQ)
    sels = []
    for b in range(qb.num_blocks):
        L = ctx[qb.seq[b]] + qlen[qb.seq[b]]
        nb = -(-L // BK)
        sels.append(torch.stack([torch.randperm(nb, generator=g)[: max(1, nb // 2)].sort().values for _ in range(G)]))
    blocks, counts = SparseIndex.pack(sels, DEV)
    idx = SparseIndex(BQ, BK, S, W, G, qb, blocks, counts)
    ref, ref_lse = block_sparse_attention(q.float(), kc.float(), vc.float(), tables, idx, D ** -0.5)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], Hq), float("nan"), device=DEV)
    ws = (torch.full((q.shape[0], Hq, splits, D), float("nan"), device=DEV),
          torch.full((q.shape[0], Hq, splits), float("nan"), device=DEV)) if splits > 1 else None
    block_sparse_attention_triton(q, kc, vc, tables, idx, D ** -0.5, num_splits=splits, block_n=16, out=out, lse=lse,
                                  workspace=ws)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()  # every row written
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out.float() - ref).abs().max() <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max() <= 1e-4


PRUNE_CASES = [  # Hq, Hkv, D, page, rows, chunk, exact, groups, rep_per_head, chunk tiles per program
    (6, 2, 16, 4, 8, 8, False, 2, True, 1),
    (6, 2, 16, 4, 8, 8, False, 2, False, 1),  # SelectRep shared by the heads of a KV head
    (6, 2, 16, 4, 8, 8, False, 2, False, 3),  # ... with each program walking 3 chunk tiles
    (6, 2, 16, 4, 8, 4, True, 2, False, 2),
    (6, 2, 16, 4, 8, 8, True, 2, True, 1),
    (9, 3, 64, 16, 1, 32, False, 3, True, 1),  # decode row, SmolLM2's shape
    (9, 3, 64, 16, 1, 32, False, 3, False, 1),
    (8, 1, 32, 16, 5, 16, False, 1, True, 1),  # GQA 8, one selection per layer, odd rows
    (8, 2, 32, 16, 5, 16, False, 1, False, 1),  # one selection per layer over two KV heads, shared SelectRep
    (4, 4, 16, 1, 3, 2, True, 4, True, 1),  # MHA, HiP-style 2-key blocks scored exactly, one-token pages
    (8, 2, 128, 16, 4, 256, False, 8, True, 1),  # head dim 128, stage-1 chunks of 256, per-head selection
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", PRUNE_CASES, ids=[
    f"h{c[0]}-kv{c[1]}-d{c[2]}-r{c[4]}-c{c[5]}-{'x' if c[6] else 's'}-g{c[7]}-{'ph' if c[8] else 'sh'}-t{c[9]}"
    for c in PRUNE_CASES])
def test_chunk_score_kernel_matches_reference(dtype, case):
    Hq, Hkv, D, page, rows, chunk, exact, G, per_head, tiles = case
    g = torch.Generator().manual_seed(sum(map(int, case)))
    L = 3 * chunk + 29 if chunk > 16 else 211
    kc, _, tables = _cache([L], Hkv, D, page, dtype, g)
    nb = 3
    q = torch.randn(nb * rows, Hq, D, generator=g).to(dtype).to(DEV)
    starts = torch.arange(nb, device=DEV) * rows
    lens = torch.tensor([rows, max(1, rows - 1), rows], device=DEV)
    cand_end = torch.tensor([L - 3, L // 2 + 1, L], device=DEV)
    n_chunks = -(-L // chunk)
    ids = torch.stack([torch.stack([torch.randperm(n_chunks, generator=g)[: n_chunks - 1] for _ in range(G)])
                       for _ in range(nb)]).to(DEV)
    ids[0, 0, 0] = -1  # padding
    # then a graph variant's padding (prefill_graph.py): whole tiles of -1, which the kernel skips
    ids = torch.cat([ids, torch.full((nb, G, 40), -1, dtype=ids.dtype, device=DEV)], dim=-1)
    n_sink = 3
    got = chunk_scores_triton(q, kc, tables[0], starts, lens, cand_end, ids, chunk, exact, n_sink, G,
                              rep_per_head=per_head, block_c=16 if not exact else None, tiles=tiles)
    keys = gather_tokens(kc, tables[0], L)
    r = torch.arange(rows, device=DEV)
    qs = q[(starts[:, None] + r).clamp(max=q.shape[0] - 1)].reshape(nb, rows, Hq, D)
    ok = r[None, :] < lens[:, None]
    ref = chunk_scores_reference(qs.float(), ok, keys.float(), ids.long(), chunk, exact, n_sink, cand_end, G,
                                 rep_per_head=per_head)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite)
    # fp16 keys/queries: products are exact in fp32, sums may differ by rounding; a SelectRep branch decided by such
    # a near-tie could differ, so fp16 compares values loosely and fp32 tightly
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    assert (got[finite] - ref[finite]).abs().max() <= tol * max(1.0, ref[finite].abs().max().item())
    if exact and rows > 1:  # the long-prefill layout: row tiles streaming the chunks, several per block and one
        for rows_tile in (16, 64):
            alt = chunk_scores_triton(q, kc, tables[0], starts, lens, cand_end, ids, chunk, exact, n_sink, G,
                                      rep_per_head=per_head, rows_tile=rows_tile)
            assert torch.equal(torch.isfinite(alt), finite)
            assert (alt[finite] - ref[finite]).abs().max() <= tol * max(1.0, ref[finite].abs().max().item())


@pytest.mark.parametrize("levels", [3, 50, 0])
def test_topk_kernel_matches_reference_with_many_ties(levels):
    """Scores from a few levels (ties everywhere, also straddling the k-th) or all distinct (levels 0: the search
    stops early, where exactly k lie at or above its midpoint): the kernel keeps the reference's ids."""
    from longreach.kernels.topk import topk_ascending_reference, topk_ascending_triton

    g = torch.Generator().manual_seed(levels)
    rows, C = 16, 300
    ids = torch.arange(C).expand(rows, C).clone()
    scores = torch.randint(0, levels, (rows, C), generator=g).float() if levels else torch.randn(rows, C, generator=g)
    scores[::3, ::5] = float("-inf")
    for k in (1, 7, 64, 299):
        want = topk_ascending_reference(ids.to(DEV), scores.to(DEV), k)
        got = topk_ascending_triton(ids.to(DEV), scores.to(DEV), k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), k


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_topk_writes_into_the_first_columns_of_a_wider_buffer(impl):
    """`out=`: a captured decode step's top-k writes the attention index's rows in place (sparse/graph.py): the ids
    into the first k columns of (rows, G, W) int32, the counts into (rows, G); the other columns keep their -1."""
    from longreach.kernels import topk

    fn = topk.topk_ascending_triton if impl == "triton" else topk.topk_ascending_reference
    g = torch.Generator().manual_seed(3)
    G, C, k, W = 2, 40, 6, 11
    ids = (torch.arange(C) * 2).expand(1, G, C).clone().to(DEV)
    scores = torch.randn(1, G, C, generator=g).to(DEV)
    want, want_n = topk.topk_ascending_reference(ids, scores, k)
    index = torch.full((3, G, W), -1, dtype=torch.int32, device=DEV)
    counts = torch.zeros(3, G, dtype=torch.int32, device=DEV)
    got = fn(ids, scores, k, out=(index[1:2, :, :k], counts[1:2]))
    assert got[0].data_ptr() == index[1:2].data_ptr()  # returned: the views it wrote
    assert torch.equal(index[1, :, :k], want[0]) and torch.equal(counts[1], want_n[0])
    assert (index[1, :, k:] == -1).all() and (index[[0, 2]] == -1).all() and (counts[[0, 2]] == 0).all()
    if impl == "triton":
        with pytest.raises(ValueError, match=r"expected int32 \(1, 2, 6\)"):
            fn(ids, scores, k, out=(index[1:2, :, :k + 1], counts[1:2]))


@pytest.mark.parametrize("rows, C, k", [(3, 50, 8), (4, 3000, 256), (2, 10, 16), (5, 40, 40), (2, 1, 4), (3, 5000, 100)])
def test_topk_kernel_matches_reference(rows, C, k):
    from longreach.kernels.topk import topk_ascending_reference, topk_ascending_triton

    g = torch.Generator().manual_seed(C + k)
    ids = (torch.arange(C).expand(rows, C) * 3 + 5).clone()
    scores = torch.randn(rows, C, generator=g)
    scores[:, ::7] = float("-inf")  # not candidates
    ids[scores == float("-inf")] = -1
    scores[0, 1:6] = 0.5  # ties at various ranks
    scores[-1] = torch.where(torch.isfinite(scores[-1]), torch.tensor(1.0), scores[-1])  # a row of ties
    ids, scores = ids.to(DEV), scores.to(DEV)
    want, want_n = topk_ascending_reference(ids, scores, k)
    got, got_n = topk_ascending_triton(ids, scores, k)
    assert torch.equal(got, want) and torch.equal(got_n, want_n)
    valid = torch.isfinite(scores)
    assert torch.equal(want_n, torch.clamp(valid.sum(-1), max=k).int())
    for r in range(rows):  # the kept ids are the k best, ascending
        kept = want[r][want[r] >= 0]
        assert torch.equal(kept, kept.sort().values)
        if valid[r].sum() > k:
            worst_kept = scores[r][torch.isin(ids[r], kept)].min()
            assert (scores[r][valid[r] & ~torch.isin(ids[r], kept)] <= worst_kept).all()


def test_prefill_splits_fill_the_gpu_for_a_short_chunk_only():
    """A 256-token chunk at 118K (5 query blocks, SmolLM2's 9 heads / 3 KV heads: 30 programs) splits its key tiles to
    fill 132 SMs about twice; a 2,048-token chunk needs fewer splits and an 8,192-token one none; each split walks at
    least 4 tiles (a short context has few)."""
    from longreach.kernels.bsa import prefill_splits

    def splits(qlen, ctx, per_group_blocks=256):
        qb = QueryBlocks.build([qlen], [ctx], 64)
        blocks = torch.zeros(qb.num_blocks, 3, per_group_blocks, dtype=torch.int32)
        idx = SparseIndex(64, 8, 256, 1024, 3, qb, blocks, torch.zeros(qb.num_blocks, 3, dtype=torch.int32))
        return prefill_splits(idx, 9, 3, 132)

    assert splits(256, 118000) == 9  # ceil(264 / 30), under 53 tiles / 4
    assert splits(2048, 118000) == 2 and splits(8192, 118000) == 1
    assert splits(256, 118000, per_group_blocks=0) == 5  # sink + window: 21 tiles, 4 each at least


@pytest.mark.parametrize("module, kernel, ints, pointers", [
    ("bsa", "_bsa_kernel", "STEP_INTS", "STEP_POINTERS"),
    ("key_boxes", "_box_build_kernel", "BUILD_STEP_INTS", "BUILD_STEP_POINTERS"),
    ("combine", "_combine_kernel", "STEP_INTS", "STEP_POINTERS"),
])
def test_unspecialised_arguments_are_the_kernels_own(module, kernel, ints, pointers):
    """The arguments a kernel does not specialise (they change with the step: Triton would compile a variant per
    value class while serving) name its parameters: Triton ignores an unknown name silently. Integers are not data
    pointers, and vice versa (by the kernels' naming: strides and counts in lower case, tensors capitalised)."""
    import importlib
    import inspect

    mod = importlib.import_module(f"longreach.kernels.{module}")
    fn = getattr(mod, kernel)
    params = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    assert set(getattr(mod, ints)) <= set(params) and set(getattr(mod, pointers)) <= set(params)
    assert all(n[0].islower() for n in getattr(mod, ints)) and all(n[0].isupper() for n in getattr(mod, pointers))
