"""Chunk scoring for context pruning: one kernel for every InfiniteHiP stage and every HiP iteration.

Given query blocks of one sequence and, per block and selection group, a list of candidate chunk ids of `chunk`
tokens (chunk j = positions [j*chunk, (j+1)*chunk), clipped to the selectable range [n_sink, cand_end) of its block),
return each chunk's score: the max over the group's heads and the block's query rows of <q, k_rep>, where k_rep is
  * SelectRep (InfiniteHiP Alg. 3): a top-1 binary search — ceil(log2 chunk) halvings, each half represented by its
    first key, the half with the higher score kept — run per head; or
  * exact: the chunk's best key (every valid key is scored). HiP scores its branch representatives this way
    (`chunk` = its key-block size b_k).
Top-k over the scores and the stage bookkeeping stay in attention/infinitehip.py and attention/hip.py, shared by the
reference and the kernel.

Kernel: grid (query block, group, tile of BLOCK_C chunks). Each program keeps one head's query rows in registers and
walks its chunks' binary searches in lockstep: every iteration gathers one key per chunk (token -> page through the
block table) and scores it against all rows with one tl.dot. No iteration needs a result from another program, so
the whole search is one launch with no global synchronisation, parallel over the key dimension like flash-decoding.
Keys are read as stored (rotated at their true positions) and so are the queries.
Tested: CPU interpreter in fp16/fp32 against `chunk_scores_reference` (tests/test_kernel_prune.py); H100 in bf16
(scripts/gpu_check.py). Limits: head_dim a power of two in [16, 256].
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def chunk_bounds(ids: torch.Tensor, chunk: int, n_sink: int, cand_end: torch.Tensor):
    """Valid part [a, b) of each chunk and whether it is non-empty; ids (nb, G, C), cand_end (nb,)."""
    a = torch.clamp(ids * chunk, min=n_sink)
    b = torch.minimum((ids + 1) * chunk, cand_end[:, None, None])
    return a, b, (ids >= 0) & (a < b)


def chunk_scores_reference(qs: torch.Tensor, row_ok: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor,
                           chunk: int, exact: bool, n_sink: int, cand_end: torch.Tensor, groups: int) -> torch.Tensor:
    """qs (nb, R, H_q, D) block queries, row_ok (nb, R), keys (L, H_kv, D) -> scores (nb, G, C), -inf if invalid."""
    nb, _, Hq, _ = qs.shape
    dev = qs.device
    L, Hkv = keys.shape[:2]
    keys_h = keys.float()[:, torch.arange(Hq, device=dev) // (Hq // Hkv)]  # (L, H_q, D)
    group_of_head = torch.arange(Hq, device=dev) // (Hq // groups)
    a, b, valid = chunk_bounds(ids, chunk, n_sink, cand_end)
    a_h, b_h, valid_h = a[:, group_of_head], b[:, group_of_head], valid[:, group_of_head]  # (nb, H_q, C)
    heads = torch.arange(Hq, device=dev)[None, :, None]
    row_mask = ~row_ok[:, None, None, :]
    q32 = qs.float()

    def rep_score(pos):  # max over rows of <q_h, k_h[pos]>: (nb, H_q, C)
        s = torch.einsum("nrhd,nhcd->nhcr", q32, keys_h[pos.clamp(0, L - 1), heads])
        return s.masked_fill(row_mask, float("-inf")).amax(-1)

    if exact:
        pos = a_h[..., None] + torch.arange(chunk, device=dev)  # (nb, H_q, C, chunk)
        s = torch.einsum("nrhd,nhcjd->nhcrj", q32, keys_h[pos.clamp(0, L - 1), heads[..., None]])
        s = s.masked_fill(row_mask[..., None], float("-inf"))
        s = s.masked_fill((pos >= b_h[..., None])[:, :, :, None, :], float("-inf")).amax(dim=(-1, -2))
    else:
        first, last = a_h.clone(), b_h - 1
        s = rep_score(first)
        for _ in range(math.ceil(math.log2(chunk))):
            length = last - first + 1
            active = length > 1
            mid = first + length // 2
            s_mid = rep_score(mid)
            right = active & (s_mid > s)
            first = torch.where(right, mid, first)
            last = torch.where(active & ~right, mid - 1, last)
            s = torch.where(right, s_mid, s)
    s = s.masked_fill(~valid_h, float("-inf"))
    return s.reshape(nb, groups, Hq // groups, -1).amax(dim=2)


if triton is not None:

    @triton.jit
    def _rep_scores(q, K, bt_base, kv, pos, ok, row_ok, stride_kp, stride_ko, stride_kh,
                    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """max over rows of <q_row, k[pos]> for a vector of key positions -> (BLOCK_C,), -inf where not ok."""
        d = tl.arange(0, HEAD_DIM)
        safe = tl.maximum(pos, 0)
        page = tl.load(bt_base + safe // PAGE, mask=ok, other=0).to(tl.int64)
        k = tl.load(K + page[:, None] * stride_kp + (safe % PAGE)[:, None] * stride_ko + kv * stride_kh + d[None, :],
                    mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (ROWS, BLOCK_C)
        s = tl.where(row_ok[:, None], s, float("-inf"))
        return tl.where(ok, tl.max(s, axis=0), float("-inf"))

    @triton.jit
    def _chunk_score_kernel(
        Q, K, BlockTable, QbStart, QbLen, CandEnd, Ids, Scores,
        stride_qt, stride_qh, stride_kp, stride_ko, stride_kh,
        stride_ib, stride_ig, stride_sb, stride_sg,
        num_chunks, n_sink,
        HPG: tl.constexpr, GQA: tl.constexpr, CHUNK: tl.constexpr, EXACT: tl.constexpr, N_ITER: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        qb = tl.program_id(0)
        g = tl.program_id(1)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        start = tl.load(QbStart + qb)
        length = tl.load(QbLen + qb)
        cand_end = tl.load(CandEnd + qb)
        ids = tl.load(Ids + qb * stride_ib + g * stride_ig + c, mask=c < num_chunks, other=-1)
        a = tl.maximum(ids * CHUNK, n_sink)
        b = tl.minimum((ids + 1) * CHUNK, cand_end)
        valid = (ids >= 0) & (a < b)
        r = tl.arange(0, ROWS)
        row_ok = r < length
        d = tl.arange(0, HEAD_DIM)
        best = tl.full([BLOCK_C], float("-inf"), tl.float32)
        for i in tl.static_range(HPG):
            head = g * HPG + i
            kv = head // GQA
            q = tl.load(Q + (start + r)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=row_ok[:, None],
                        other=0.0)
            if EXACT:
                hs = tl.full([BLOCK_C], float("-inf"), tl.float32)
                for j in tl.static_range(CHUNK):
                    pos = a + j
                    s = _rep_scores(q, K, BlockTable, kv, pos, valid & (pos < b), row_ok, stride_kp, stride_ko,
                                    stride_kh, PAGE, HEAD_DIM, DOT_PRECISION)
                    hs = tl.maximum(hs, s)
            else:
                first = a
                last = b - 1
                hs = _rep_scores(q, K, BlockTable, kv, first, valid, row_ok, stride_kp, stride_ko, stride_kh,
                                 PAGE, HEAD_DIM, DOT_PRECISION)
                for _ in tl.static_range(N_ITER):
                    span = last - first + 1
                    active = valid & (span > 1)
                    mid = first + span // 2
                    s_mid = _rep_scores(q, K, BlockTable, kv, mid, active, row_ok, stride_kp, stride_ko, stride_kh,
                                        PAGE, HEAD_DIM, DOT_PRECISION)
                    right = active & (s_mid > hs)
                    first = tl.where(right, mid, first)
                    last = tl.where(active & (s_mid <= hs), mid - 1, last)
                    hs = tl.where(right, s_mid, hs)
            best = tl.maximum(best, hs)
        tl.store(Scores + qb * stride_sb + g * stride_sg + c, tl.where(valid, best, float("-inf")),
                 mask=c < num_chunks)


def chunk_scores_triton(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, starts: torch.Tensor,
                        lens: torch.Tensor, cand_end: torch.Tensor, ids: torch.Tensor, chunk: int, exact: bool,
                        n_sink: int, groups: int, block_c: int = 64, max_rows: int | None = None) -> torch.Tensor:
    """Triton version of `chunk_scores_reference` reading keys from the paged cache of one sequence.

    q (n, H_q, D) the sequence's queries this step; starts/lens (nb,) each block's rows in q; cand_end (nb,);
    ids (nb, G, C) int; block_table (pages,) int32 of the sequence; max_rows: a bound on lens known on the host
    (without it lens is read back, a host sync). Returns (nb, G, C) fp32.
    """
    if triton is None:
        raise RuntimeError("chunk_scores_triton needs Triton")
    _, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {D}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the cache must be contiguous in the head dimension")
    nb, G, C = ids.shape
    ids32 = ids.to(torch.int32).contiguous()
    scores = torch.empty(nb, G, C, dtype=torch.float32, device=q.device)
    if nb == 0 or C == 0:
        return scores
    rows = max(16, triton.next_power_of_2(max_rows if max_rows is not None else int(lens.max())))
    grid = (nb, G, triton.cdiv(C, block_c))
    _chunk_score_kernel[grid](
        q, k_cache, block_table, starts.to(torch.int32), lens.to(torch.int32), cand_end.to(torch.int32), ids32,
        scores,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ids32.stride(0), ids32.stride(1), scores.stride(0), scores.stride(1),
        C, n_sink,
        HPG=Hq // G, GQA=Hq // Hkv, CHUNK=chunk, EXACT=exact, N_ITER=max(0, math.ceil(math.log2(chunk))),
        ROWS=rows, BLOCK_C=block_c, HEAD_DIM=D, PAGE=page,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    return scores
