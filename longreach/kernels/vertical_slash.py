"""Attention over key ranges then gathered key columns with one online softmax (MInference's Alg. 5), in Triton.

Consumes a `RangeIndex` (index_types.py) and computes exactly what `attention.executor.range_attention` (the
PyTorch reference) computes: each query row attends to the keys of its block's tiles and columns at or before its
own position (causal inside the kernel; no mask tensor).

Grid: (query block, (selection group, KV head) pair x head subset). A program holds up to `BLOCK_M` query rows —
several heads of one GQA group times the block's rows, as in kernels/bsa.py — so every K/V tile it loads serves all
of them when the selection is per KV group; per-head selections (the paper's) give one head per pair. It walks
  1. the block's tiles: contiguous key ranges [start, end) of at most BLOCK_N keys (slash ranges, sparse blocks,
     the sink and the local window), masked at `end`;
  2. the columns, BLOCK_N at a time, gathering K and V at those positions into one dense tile (the paper's PIT
     step);
keeping the running max, sum and output in base 2 across both loops (kernels/softmax.py; the paper's Alg. 5 typo
l_new = rowsum(S) is rowsum(P) here). Keys are read through the block table, from a one-tier cache or (constexpr
TIERED) a GPU pool + host tier with a page table, in bf16/fp16/fp32 or (constexpr FP8) fp8 rows with a scale
(kernels/paged.py). Prefill under offloading runs on a staging area, so in practice this kernel sees one tier.

Returns out (T, H_q, D) in q's dtype and lse (T, H_q) fp32, natural log, -inf for a row that reads no key.
Limits: head_dim a power of two in [16, 256]; tiles of at most BLOCK_N keys; selection groups 1, H_kv or H_q.
Tested: CPU interpreter (TRITON_INTERPRET=1) in fp16/fp32 against the reference (tests/test_minference.py);
compiled for sm_90 by scripts/compile_check.py; bf16 at real sizes in tests/gpu/test_kernels.py (on a GPU).
"""
from __future__ import annotations

import math

import torch

from .bsa import _pair_tensors, query_block_tensors
from .index_types import RangeIndex
from .paged import kv_args, load_kv, page_slots, row_base
from .softmax import online_softmax_finish, online_softmax_step

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton use the reference executor
    triton = None


if triton is not None:

    @triton.jit
    def _range_attention_kernel(
        Q, K, V, KH, VH, Slots, BlockTables, QbSeq, QbStart, QbLen, QbPos, Tiles, TileCounts, Cols, ColCounts,
        PairGroup, PairKv, Out, Lse,
        stride_qt, stride_qh,
        stride_kp, stride_ko, stride_kh,
        stride_vp, stride_vo, stride_vh,
        stride_khp, stride_vhp,
        stride_btb,
        stride_tb, stride_tg, stride_tt,
        stride_tcb,
        stride_cb, stride_cg,
        stride_ccb,
        stride_ot, stride_oh,
        stride_lt,
        qk_scale,
        HPP: tl.constexpr, HEADS_PER_PROG: tl.constexpr, N_HSUB: tl.constexpr, BQ_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, TIERED: tl.constexpr, FP8: tl.constexpr,
    ):
        qb = tl.program_id(0)
        pair = tl.program_id(1) // N_HSUB
        hsub = tl.program_id(1) % N_HSUB

        seq = tl.load(QbSeq + qb)
        start = tl.load(QbStart + qb)
        length = tl.load(QbLen + qb)
        pos0 = tl.load(QbPos + qb)
        group = tl.load(PairGroup + pair)
        kvh = tl.load(PairKv + pair)
        n_tiles = tl.load(TileCounts + qb * stride_tcb + group)
        n_cols = tl.load(ColCounts + qb * stride_ccb + group)

        r = tl.arange(0, BLOCK_M)
        hh = hsub * HEADS_PER_PROG + r // BQ_PAD  # head offset within the pair
        qi = r % BQ_PAD
        row_ok = (qi < length) & (hh < HPP)
        head = pair * HPP + hh
        row = start + qi
        p_row = pos0 + qi  # absolute position of each row
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                    other=0.0)
        last_pos = pos0 + length - 1
        bt_base = BlockTables + seq * stride_btb
        tile_base = Tiles + qb * stride_tb + group * stride_tg
        col_base = Cols + qb * stride_cb + group * stride_cg

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        n = tl.arange(0, BLOCK_N)
        # 1. key ranges (block-sparse part)
        for t in range(n_tiles):
            t_start = tl.load(tile_base + t * stride_tt)
            t_end = tl.load(tile_base + t * stride_tt + 1)
            kpos = t_start + n
            k_ok = kpos < t_end
            safe = tl.minimum(tl.maximum(kpos, 0), last_pos)  # masked keys still need a readable slot
            page = tl.load(bt_base + safe // PAGE).to(tl.int64)
            off = safe % PAGE
            slot = page_slots(Slots, page, kvh, TIERED)
            kb = row_base(K, KH, page, slot, kvh, stride_kp, stride_khp, stride_kh, PAGE, TIERED)
            k = load_kv(kb, off, kvh, stride_ko, stride_kh, d,
                        k_ok, HEAD_DIM, FP8).to(q.dtype)
            vb = row_base(V, VH, page, slot, kvh, stride_vp, stride_vhp, stride_vh, PAGE, TIERED)
            v = load_kv(vb, off, kvh, stride_vo, stride_vh, d,
                        k_ok, HEAD_DIM, FP8).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
            allowed = k_ok[None, :] & row_ok[:, None] & (kpos[None, :] <= p_row[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
        # 2. gathered columns (vertical lines), BLOCK_N at a time
        for c0 in range(0, n_cols, BLOCK_N):
            j = c0 + n
            c_ok = j < n_cols
            kpos = tl.load(col_base + j, mask=c_ok, other=0)
            safe = tl.minimum(tl.maximum(kpos, 0), last_pos)
            page = tl.load(bt_base + safe // PAGE).to(tl.int64)
            off = safe % PAGE
            slot = page_slots(Slots, page, kvh, TIERED)
            kb = row_base(K, KH, page, slot, kvh, stride_kp, stride_khp, stride_kh, PAGE, TIERED)
            k = load_kv(kb, off, kvh, stride_ko, stride_kh, d,
                        c_ok, HEAD_DIM, FP8).to(q.dtype)
            vb = row_base(V, VH, page, slot, kvh, stride_vp, stride_vhp, stride_vh, PAGE, TIERED)
            v = load_kv(vb, off, kvh, stride_vo, stride_vh, d,
                        c_ok, HEAD_DIM, FP8).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            allowed = c_ok[None, :] & row_ok[:, None] & (kpos[None, :] <= p_row[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

        out, lse = online_softmax_finish(m_i, l_i, acc)
        tl.store(Out + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(Lse + row * stride_lt + head, lse, mask=row_ok)


class RangePlan:
    """The device-side tensors of a RangeIndex (query blocks, head pairs, tiles, columns), built once per index.
    `queries`: the query-block tensors when the caller already has them (shared by every layer of a step)."""

    def __init__(self, index: RangeIndex, num_heads: int, num_kv_heads: int, device,
                 queries: tuple[torch.Tensor, ...] | None = None):
        self.seq, self.start, self.len, self.pos = queries or query_block_tensors(index.queries, device)
        self.pair_group, self.pair_kv, self.hpp = _pair_tensors(num_heads, num_kv_heads, index.groups, device)
        self.num_pairs = self.pair_group.shape[0]

        def as_i32(t):
            return t.to(device=device, dtype=torch.int32).contiguous()

        self.tiles, self.tile_counts = as_i32(index.tiles), as_i32(index.tile_counts)
        self.columns, self.col_counts = as_i32(index.columns), as_i32(index.col_counts)
        if self.columns.shape[2] == 0:  # a zero-width tensor has no valid pointer stride to pass; never read
            self.columns = torch.full((*self.columns.shape[:2], 1), -1, dtype=torch.int32, device=device)
        if self.tiles.shape[2] == 0:
            self.tiles = torch.full((*self.tiles.shape[:2], 1, 2), -1, dtype=torch.int32, device=device)
        self.index = index


def range_attention_triton(q, k_cache, v_cache, block_tables, index: RangeIndex, scale: float,
                           plan: RangePlan | None = None, block_m: int | None = None, block_n: int = 64,
                           num_warps: int | None = None, out: torch.Tensor | None = None,
                           lse: torch.Tensor | None = None):
    """Triton version of `attention.executor.range_attention` (same arguments and results). `out`/`lse` may be passed
    preallocated (e.g. poisoned by tests); rows that belong to no query block are left untouched."""
    if triton is None:
        raise RuntimeError("range_attention_triton needs Triton")
    T, Hq, D = q.shape
    K, V, KH, VH, slots, stride_khp, stride_vhp, tiered, fp8, page, Hkv = kv_args(q, k_cache, v_cache)
    if block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be int32")
    if index.tile > block_n:
        raise ValueError(f"tiles of {index.tile} keys do not fit block_n={block_n}")
    plan = plan or RangePlan(index, Hq, Hkv, q.device)
    nqb = index.queries.num_blocks
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device) if lse is None else lse
    if nqb == 0:
        return out, lse
    bq_pad = max(1, triton.next_power_of_2(index.block_q))
    if block_m is None:
        block_m = max(16, min(128, triton.next_power_of_2(plan.hpp * bq_pad)))
    block_m = max(block_m, bq_pad, 16)
    heads_per_prog = max(1, block_m // bq_pad)
    n_hsub = -(-plan.hpp // heads_per_prog)
    grid = (nqb, plan.num_pairs * n_hsub)
    _range_attention_kernel[grid](
        q, K, V, KH, VH, slots, block_tables, plan.seq, plan.start, plan.len, plan.pos, plan.tiles, plan.tile_counts,
        plan.columns, plan.col_counts, plan.pair_group, plan.pair_kv, out, lse,
        q.stride(0), q.stride(1),
        K.stride(0), K.stride(1), K.stride(2),
        V.stride(0), V.stride(1), V.stride(2),
        stride_khp, stride_vhp,
        block_tables.stride(0),
        plan.tiles.stride(0), plan.tiles.stride(1), plan.tiles.stride(2),
        plan.tile_counts.stride(0),
        plan.columns.stride(0), plan.columns.stride(1),
        plan.col_counts.stride(0),
        out.stride(0), out.stride(1),
        lse.stride(0),
        scale * math.log2(math.e),
        HPP=plan.hpp, HEADS_PER_PROG=heads_per_prog, N_HSUB=n_hsub, BQ_PAD=bq_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=D, PAGE=page, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TIERED=tiered,
        FP8=fp8, num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=2,
    )
    return out, lse
