"""Top-k candidate selection that emits the block-sparse index layout directly: ascending int32 ids and counts.

For each row (query block x selection group): keep the k highest-scoring candidates (score -inf = not a candidate);
among candidates tied at the k-th score keep the lowest positions; write the kept ids in position order (ascending, as
stage outputs and the attention index need them) followed by -1 padding, and the number kept.

Kernel: one program per row. The k-th largest score is found by bisection on the scores' bit patterns mapped to
order-preserving int32 keys (at most 32 counting passes over the row, no sort; it stops where exactly k keys lie at or
above the midpoint); the kept ids are then compacted in order with a cumulative sum. This replaces topk + gather +
mask + sort + cast + count (six to eight launches) with one.
Reference: `topk_ascending_reference`. Inputs must list each row's valid ids in ascending order (candidate lists do).
Tested: CPU interpreter in fp32 (tests/test_kernel_bsa.py); H100/H200 (tests/gpu/test_kernels.py).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def _into(out: tuple[torch.Tensor, torch.Tensor] | None, kept: torch.Tensor, counts: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return kept, counts
    out[0].copy_(kept)
    out[1].copy_(counts)
    return out


def topk_ascending_reference(ids: torch.Tensor, scores: torch.Tensor, k: int,
                             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, scores (..., C) -> (..., k) int32 ascending kept ids (-1 padded) and (...) int32 counts; `out`: tensors
    of those shapes to write them into (see `topk_ascending_triton`), returned."""
    C = ids.shape[-1]
    valid = torch.isfinite(scores)
    pos = torch.arange(C, device=ids.device).expand_as(ids)
    # order by score descending, then position ascending: sort by position first, then stable sort by score
    by_score = torch.sort(torch.where(valid, -scores.float(), float("inf")), dim=-1, stable=True).indices
    rank = torch.empty_like(by_score)
    rank.scatter_(-1, by_score, pos)
    keep = valid & (rank < k)
    counts = keep.sum(-1).to(torch.int32)
    key = torch.where(keep, pos, C + pos)  # kept first, in position order
    order = key.sort(dim=-1).indices[..., :k]
    out_ids = torch.where(torch.gather(keep, -1, order), torch.gather(ids, -1, order), -1).to(torch.int32)
    if out_ids.shape[-1] < k:
        out_ids = torch.nn.functional.pad(out_ids, (0, k - out_ids.shape[-1]), value=-1)
    return _into(out, out_ids, counts)


if triton is not None:

    @triton.jit
    def _order_key(s):
        """fp32 -> int64 with the same order (for finite values and -inf)."""
        b = s.to(tl.int32, bitcast=True)
        return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)

    @triton.jit
    def _tile(Scores, row, stride_sr, t, offs, C):
        """(candidate?, order key) of the row's scores t .. t+BLOCK-1."""
        s = tl.load(Scores + row * stride_sr + t + offs, mask=t + offs < C, other=float("-inf"))
        return s > float("-inf"), _order_key(s)

    @triton.jit
    def _topk_kernel(Ids, Scores, Out, Counts, C, K, stride_ir, stride_sr, stride_or, BLOCK: tl.constexpr,
                     SINGLE: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        zero = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)  # a scalar tensor: loop-carried counters start from it
        if SINGLE:  # the whole row fits one tile: load it once, every pass below runs in registers
            ok1, key1 = _tile(Scores, row, stride_sr, 0, offs, C)
            n_valid = tl.sum(ok1.to(tl.int32), axis=0)
        else:
            n_valid = zero
            for t in range(0, C, BLOCK):
                ok, _ = _tile(Scores, row, stride_sr, t, offs, C)
                n_valid += tl.sum(ok.to(tl.int32), axis=0)
        # threshold: the largest key t with count(key >= t) >= K (when there are more than K candidates)
        lo = zero.to(tl.int64) - 2147483647  # keys of finite scores and +inf lie above the key of -inf
        hi = zero.to(tl.int64) + 2147483647
        if n_valid > K:
            # bisection, ended early where exactly K keys lie at or above the midpoint: those K are the answer (no
            # tie straddles it), the same set the full search keeps; random scores stop after ~log2(gap) passes
            # instead of 32
            passes = zero
            searching = zero + 1
            while searching > 0:
                mid = lo + ((hi - lo + 1) >> 1)
                if SINGLE:
                    cnt = tl.sum((ok1 & (key1 >= mid)).to(tl.int32), axis=0)
                else:
                    cnt = zero
                    for t in range(0, C, BLOCK):
                        ok, key = _tile(Scores, row, stride_sr, t, offs, C)
                        cnt += tl.sum((ok & (key >= mid)).to(tl.int32), axis=0)
                lo = tl.where(cnt >= K, mid, lo)
                hi = tl.where(cnt >= K, hi, mid - 1)
                passes += 1
                searching = ((cnt != K) & (lo < hi) & (passes < 33)).to(tl.int32)
        thr = lo
        written = zero
        seen_eq = zero
        greater = zero
        for t in range(0, C, BLOCK):
            if SINGLE:
                ok, key = ok1, key1
            else:
                ok, key = _tile(Scores, row, stride_sr, t, offs, C)
            greater += tl.sum((ok & (key > thr)).to(tl.int32), axis=0)
        need_eq = K - greater
        for t in range(0, C, BLOCK):
            m = t + offs < C
            ids = tl.load(Ids + row * stride_ir + t + offs, mask=m, other=-1)
            if SINGLE:
                ok, key = ok1, key1
            else:
                ok, key = _tile(Scores, row, stride_sr, t, offs, C)
            if n_valid > K:
                eq = ok & (key == thr)
                eq_rank = seen_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
                keep = (ok & (key > thr)) | (eq & (eq_rank < need_eq))
                seen_eq += tl.sum(eq.to(tl.int32), axis=0)
            else:
                keep = ok
            slot = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(Out + row * stride_or + slot, ids.to(tl.int32), mask=keep)
            written += tl.sum(keep.to(tl.int32), axis=0)
        for t in range(0, K, BLOCK):  # -1 padding after the kept ids
            o = t + offs
            tl.store(Out + row * stride_or + o, tl.full([BLOCK], -1, tl.int32), mask=(o >= written) & (o < K))
        tl.store(Counts + row, written)


def topk_ascending_triton(ids: torch.Tensor, scores: torch.Tensor, k: int,
                          out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `topk_ascending_reference`. `out`: (ids (..., k), counts (...)) int32 to write into, e.g.
    the first k columns of a wider buffer (a captured decode step's attention index, sparse/graph.py): the ids'
    leading dims must merge into one of uniform stride (a view does), the counts be a view of (rows,)."""
    if triton is None:
        raise RuntimeError("topk_ascending_triton needs Triton")
    *lead, C = ids.shape
    rows = 1
    for x in lead:
        rows *= x
    if out is None:
        out = (torch.empty(*lead, k, dtype=torch.int32, device=ids.device),
               torch.empty(*lead, dtype=torch.int32, device=ids.device))
    kept, counts = out
    if kept.shape != (*lead, k) or counts.shape != tuple(lead) or kept.dtype != torch.int32 \
            or counts.dtype != torch.int32 or kept.stride(-1) != 1:
        raise ValueError(f"topk out: ids {tuple(kept.shape)} {kept.dtype} (last stride {kept.stride(-1)}) and counts "
                         f"{tuple(counts.shape)} {counts.dtype}; expected int32 {(*lead, k)} with unit last stride "
                         f"and int32 {tuple(lead)}")
    if rows == 0:
        return out
    ids2 = ids.reshape(rows, C)
    sc2 = scores.reshape(rows, C).float()
    if C == 0:
        kept.fill_(-1)
        counts.zero_()
        return out
    out2 = kept.view(rows, k)  # raises where the leading dims do not merge (no copy may stand in for the buffer)
    block = max(16, min(4096, triton.next_power_of_2(max(C, k))))
    _topk_kernel[(rows,)](ids2, sc2, out2, counts.view(rows), C, k, ids2.stride(0), sc2.stride(0), out2.stride(0),
                          BLOCK=block, SINGLE=C <= block, num_warps=4 if block <= 1024 else 8)
    return out
