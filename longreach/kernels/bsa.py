"""Block-sparse attention over the paged KV cache, in Triton: prefill and decode from one kernel.

Consumes a `SparseIndex` (index_types.py) and computes exactly what `attention/executor.py` (the PyTorch
reference, kept beside this kernel as the ground truth) computes: for every query block, softmax attention over the
sink, the block's window span and the selected key blocks, each query row masked to its own disjoint, causal share.

Grid: (query block, (selection group, KV head) pair x head subset, split). A program holds the queries of up to
`BLOCK_M` rows — several heads of one GQA group times the block's query rows — so each KV tile it gathers is used by
all of those heads (a KV block is read once per head group when the group fits one program: decode always, prefill
when heads x block_q <= 128). It walks one list of key tiles: sink tiles, then the selected key blocks packed into
tiles of BLOCK_N tokens (token -> logical block -> page through the block table), then the window span, keeping an
online softmax in base 2. Decode, and a prefill chunk of a few query blocks (`prefill_splits`), split the tile list
over `num_splits` programs (flash-decoding) and `combine.py` merges the partial results with their log-sum-exps; a
long prefill chunk has programs enough and uses one split per query block.

Returns out (T, H_q, D) in q's dtype and lse (T, H_q) fp32, natural log, -inf for a row that reads no key.
Limits: head_dim a power of two in [16, 256]; selection groups 1, H_kv or H_q. Tested: CPU interpreter
(TRITON_INTERPRET=1) in fp16/fp32 against the reference (tests/test_kernel_bsa.py); H100 in bf16
(tests/gpu/test_kernels.py).
"""
from __future__ import annotations

import math

import torch

from ..rope.strategies import RopeArgs, attend_code
from .combine import combine_splits_triton, split_count
from .index_types import QueryBlocks, SparseIndex, head_pairs
from .paged import kv_args, load_kv, page_slots, row_base
from .rope import rotate_halves, rotate_rows, swap_halves
from .softmax import online_softmax_finish, online_softmax_step

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton use the reference executor
    triton = None


# Arguments that change with the step (the batch's rows and lengths, the split count, the selection's width) are
# not specialised: Triton would otherwise compile a variant per value class (== 1, a multiple of 16, a 16-byte
# aligned pointer), e.g. the Lse of a prefill part after 9 decode rows, which the server's warm-up cannot all reach
# (docs/serving.md, run 8: 0.9-1.1 s compilations inside serving steps). The data pointers whose alignment the
# model's shapes fix (Q, K, V, Out, OutP) stay specialised. Names Triton does not find are ignored silently: tests
# check them (tests/test_kernel_bsa.py).
STEP_INTS = ("stride_btb", "stride_bb", "stride_bg", "stride_cb", "stride_pt", "stride_ph", "stride_ps",
             "stride_lpt", "stride_lph", "num_splits", "n_sink", "n_window", "rope_from", "de_group")
STEP_POINTERS = ("Slots", "BlockTables", "QbSeq", "QbStart", "QbLen", "QbPos", "Blocks", "Counts", "PairGroup",
                 "PairKv", "InvFreq", "Lse", "LseP")

if triton is not None:

    @triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=STEP_POINTERS)
    def _bsa_kernel(
        Q, K, V, KH, VH, Slots, BlockTables, QbSeq, QbStart, QbLen, QbPos, Blocks, Counts, PairGroup, PairKv, InvFreq,
        Out, Lse, OutP, LseP,
        stride_qt, stride_qh,
        stride_kp, stride_ko, stride_kh,
        stride_vp, stride_vo, stride_vh,
        stride_khp, stride_vhp,
        stride_btb,
        stride_bb, stride_bg,
        stride_cb,
        stride_ot, stride_oh,
        stride_lt,
        stride_pt, stride_ph, stride_ps,
        stride_lpt, stride_lph,
        qk_scale, num_splits, n_sink, n_window, rope_from, de_group,
        ROPE: tl.constexpr, HPP: tl.constexpr, HEADS_PER_PROG: tl.constexpr, N_HSUB: tl.constexpr,
        BQ_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        BK: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        TIERED: tl.constexpr, FP8: tl.constexpr, HALVES: tl.constexpr,
    ):
        qb = tl.program_id(0)
        pair = tl.program_id(1) // N_HSUB
        hsub = tl.program_id(1) % N_HSUB
        split = tl.program_id(2)

        seq = tl.load(QbSeq + qb)
        start = tl.load(QbStart + qb)
        length = tl.load(QbLen + qb)
        pos0 = tl.load(QbPos + qb)
        group = tl.load(PairGroup + pair)
        kvh = tl.load(PairKv + pair)
        count = tl.load(Counts + qb * stride_cb + group)

        r = tl.arange(0, BLOCK_M)
        hh = hsub * HEADS_PER_PROG + r // BQ_PAD  # head offset within the pair
        qi = r % BQ_PAD
        row_ok = (qi < length) & (hh < HPP)
        head = pair * HPP + hh
        row = start + qi
        p_row = pos0 + qi  # absolute position of each row
        d = tl.arange(0, HEAD_DIM)
        h = tl.arange(0, HEAD_DIM // 2)
        q_ptr = Q + row[:, None] * stride_qt + head[:, None] * stride_qh
        if HALVES:  # the rows as two halves (R, D/2): a dot per half (rope.py's rotate_halves)
            q = tl.load(q_ptr + h[None, :], mask=row_ok[:, None], other=0.0)
            q_hi = tl.load(q_ptr + HEAD_DIM // 2 + h[None, :], mask=row_ok[:, None], other=0.0)
        else:
            q = tl.load(q_ptr + d[None, :], mask=row_ok[:, None], other=0.0)
            q_hi = q

        if ROPE != 0:
            inv = tl.load(InvFreq + h) if HALVES else tl.load(InvFreq + d % (HEAD_DIM // 2))
            if ROPE != 4:  # far keys and the queries facing them move (rope/strategies.py); the window keeps its own
                remap = pos0 + length - 1 >= rope_from
                if ROPE == 1:  # st: one past the selected keys plus the window
                    new_q = p_row * 0 + (n_sink + count * BK + n_window - 1)
                elif ROPE == 2:  # il
                    new_q = p_row * 0 + (n_sink + n_window)
                else:  # de
                    new_q = p_row // de_group + n_window - n_window // de_group
                dq = tl.where(remap, new_q - p_row, 0)
                if HALVES:
                    q_far, q_far_hi = rotate_halves(q, q_hi, dq, inv)
                    q_far, q_far_hi = q_far.to(q.dtype), q_far_hi.to(q.dtype)
                else:
                    q_sw = tl.load(q_ptr + swap_halves(d, HEAD_DIM)[None, :], mask=row_ok[:, None], other=0.0)
                    q_far = rotate_rows(q, q_sw, dq, inv, d, HEAD_DIM).to(q.dtype)
                    q_far_hi = q_far

        n_win = tl.where(n_window > 0, length + n_window - 1, 0)
        sink_tiles = tl.cdiv(n_sink, BLOCK_N)
        sel_tokens = count * BK
        sel_tiles = tl.cdiv(sel_tokens, BLOCK_N)
        win_tiles = tl.cdiv(n_win, BLOCK_N)
        total = sink_tiles + sel_tiles + win_tiles
        per_split = tl.cdiv(total, num_splits)
        t_lo = split * per_split
        t_hi = tl.minimum(t_lo + per_split, total)
        last_pos = pos0 + length - 1
        blk_base = Blocks + qb * stride_bb + group * stride_bg
        bt_base = BlockTables + seq * stride_btb

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for t in range(t_lo, t_hi):
            is_sink = t < sink_tiles
            is_sel = (t >= sink_tiles) & (t < sink_tiles + sel_tiles)
            j_sink = t * BLOCK_N + n
            j_sel = (t - sink_tiles) * BLOCK_N + n
            j_win = (t - sink_tiles - sel_tiles) * BLOCK_N + n
            ok_sel = is_sel & (j_sel < sel_tokens)
            blk = tl.load(blk_base + j_sel // BK, mask=ok_sel, other=0)
            kpos = tl.where(is_sink, j_sink, tl.where(is_sel, blk * BK + j_sel % BK, pos0 - n_window + 1 + j_win))
            k_ok = tl.where(is_sink, j_sink < n_sink, tl.where(is_sel, ok_sel, j_win < n_win))
            safe = tl.minimum(tl.maximum(kpos, 0), last_pos)
            page = tl.load(bt_base + safe // PAGE).to(tl.int64)
            off = safe % PAGE
            slot = page_slots(Slots, page, kvh, TIERED)
            kb = row_base(K, KH, page, slot, kvh, stride_kp, stride_khp, stride_kh, PAGE, TIERED)
            if HALVES:
                k = load_kv(kb, off, kvh, stride_ko, stride_kh, h, k_ok, HEAD_DIM, FP8).to(q.dtype)
                k_hi = load_kv(kb, off, kvh, stride_ko, stride_kh, h + HEAD_DIM // 2, k_ok, HEAD_DIM, FP8).to(q.dtype)
            else:
                k = load_kv(kb, off, kvh, stride_ko, stride_kh, d, k_ok, HEAD_DIM, FP8).to(q.dtype)
            vb = row_base(V, VH, page, slot, kvh, stride_vp, stride_vhp, stride_vh, PAGE, TIERED)
            v = load_kv(vb, off, kvh, stride_vo, stride_vh, d,
                        k_ok, HEAD_DIM, FP8).to(q.dtype)
            if ROPE == 0:
                qq = q
            else:
                if ROPE == 4:  # cache: keys stored un-rotated, each rotated at its position; queries arrive rotated
                    dk = kpos
                    qq, qq_hi = q, q_hi
                    k_sw_ok = k_ok
                else:
                    far = (is_sink | is_sel) & remap
                    if ROPE == 1:
                        new_k = tl.where(is_sink, j_sink, n_sink + j_sel)
                    elif ROPE == 2:
                        new_k = tl.where(is_sink, j_sink, n_sink)
                    else:
                        new_k = kpos // de_group
                    dk = tl.where(far, new_k - kpos, 0)
                    qq, qq_hi = tl.where(far, q_far, q), tl.where(far, q_far_hi, q_hi)
                    k_sw_ok = k_ok & far
                if HALVES:
                    k, k_hi = rotate_halves(k, k_hi, dk, inv)
                    k, k_hi = k.to(q.dtype), k_hi.to(q.dtype)
                else:
                    k_sw = load_kv(kb, off, kvh, stride_ko, stride_kh, swap_halves(d, HEAD_DIM), k_sw_ok, HEAD_DIM,
                                   FP8).to(q.dtype)
                    k = rotate_rows(k, k_sw, dk, inv, d, HEAD_DIM).to(q.dtype)
            s = tl.dot(qq, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
            if HALVES:
                s = tl.dot(qq_hi, tl.trans(k_hi), s, input_precision=DOT_PRECISION)
            s = s * qk_scale  # log2 units
            kp = kpos[None, :]
            pr = p_row[:, None]
            m_sink = kp <= pr
            m_sel = (kp >= n_sink) & (kp <= pr - n_window)
            m_win = (kp >= tl.maximum(pr - n_window + 1, n_sink)) & (kp <= pr) & (kp >= 0)
            allowed = k_ok[None, :] & row_ok[:, None] & tl.where(is_sink, m_sink, tl.where(is_sel, m_sel, m_win))
            s = tl.where(allowed, s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

        out, lse = online_softmax_finish(m_i, l_i, acc)
        if SPLIT:
            tl.store(OutP + row[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :],
                     out, mask=row_ok[:, None])
            tl.store(LseP + row * stride_lpt + head * stride_lph + split, lse, mask=row_ok)
        else:
            tl.store(Out + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=row_ok[:, None])
            tl.store(Lse + row * stride_lt + head, lse, mask=row_ok)


def query_block_tensors(qb: QueryBlocks, device) -> tuple[torch.Tensor, ...]:
    """(seq, start, length, position) of every query block as int32 device tensors (one host-to-device copy)."""
    t = torch.tensor([qb.seq, qb.start, qb.length, qb.pos], dtype=torch.int32).reshape(4, -1).to(device)
    return t[0], t[1], t[2], t[3]


_PAIRS: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}


def _pair_tensors(num_heads: int, num_kv_heads: int, groups: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(selection group, KV head) of every pair as int32 device tensors and heads per pair, made once per shape:
    a host-to-device copy is not allowed while a CUDA graph is being captured."""
    key = (num_heads, num_kv_heads, groups, str(torch.device(device)))
    if key not in _PAIRS:
        pairs, hpp = head_pairs(num_heads, num_kv_heads, groups)
        t = torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2).to(device)
        _PAIRS[key] = (t[:, 0].contiguous(), t[:, 1].contiguous(), hpp)
    return _PAIRS[key]


def _program_shape(hpp: int, block_q: int, block_m: int | None = None) -> tuple[int, int, int, int]:
    """(padded query rows per block, rows per program, heads per program, programs per (group, KV head) pair)."""
    bq_pad = 1 << max(0, block_q - 1).bit_length()  # next power of two
    if block_m is None:
        block_m = max(16, min(128, 1 << max(0, hpp * bq_pad - 1).bit_length()))
    block_m = max(block_m, bq_pad, 16)
    heads_per_prog = max(1, block_m // bq_pad)
    return bq_pad, block_m, heads_per_prog, -(-hpp // heads_per_prog)


def prefill_splits(index: SparseIndex, num_heads: int, num_kv_heads: int, num_sms: int, block_n: int = 64,
                   most: int = 16) -> int:
    """Split-K for a prefill launch whose programs do not fill the GPU: a chunk of a few query blocks (a paced
    256-token chunk beside decodes is 4 blocks: with SmolLM2's 3 KV heads, 24 programs on 132 SMs, each walking
    ~53 key tiles at 128K) is latency-bound on its tile walk, while a long chunk has programs enough and keeps one
    split. Each split walks at least 4 tiles of the longest list (sink, the padded selection, the window span);
    at most `most` splits. A function of the launch's shape only (the host knows it), as decode's split_count."""
    pairs, hpp = head_pairs(num_heads, num_kv_heads, index.groups)
    programs = index.queries.num_blocks * len(pairs) * _program_shape(hpp, index.block_q)[3]
    selected = index.blocks.shape[-1] * index.block_k if index.blocks.dim() == 3 else 0
    tiles = (-(-index.n_sink // block_n) + -(-selected // block_n)
             + -(-(index.block_q + index.n_window - 1) // block_n))
    return split_count(programs, num_sms, max(1, min(most, tiles // 4)))


class BSAPlan:
    """The device-side tensors of a SparseIndex (built once per index, reused by every launch).

    `queries`: the query-block tensors when the caller already has them (the same query blocks serve every layer of
    an engine step; only the selected blocks change).
    """

    def __init__(self, index: SparseIndex, num_heads: int, num_kv_heads: int, device,
                 queries: tuple[torch.Tensor, ...] | None = None):
        self.seq, self.start, self.len, self.pos = queries or query_block_tensors(index.queries, device)
        self.pair_group, self.pair_kv, self.hpp = _pair_tensors(num_heads, num_kv_heads, index.groups, device)
        self.num_pairs = self.pair_group.shape[0]
        self.blocks = index.blocks.to(device=device, dtype=torch.int32).contiguous()
        self.counts = index.counts.to(device=device, dtype=torch.int32).contiguous()
        self.index = index


def block_sparse_attention_triton(q, k_cache, v_cache, block_tables, index: SparseIndex, scale: float,
                                  num_splits: int = 1, plan: BSAPlan | None = None,
                                  block_m: int | None = None, block_n: int = 64, num_warps: int | None = None,
                                  workspace=None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                                  rope: RopeArgs | None = None):
    """Triton version of `attention.executor.block_sparse_attention` (same arguments and results, `rope` included).

    `out`/`lse` (and the split `workspace`) may be passed preallocated, e.g. poisoned by tests; rows that belong to
    no query block are left untouched.
    """
    if triton is None:
        raise RuntimeError("block_sparse_attention_triton needs Triton")
    T, Hq, D = q.shape
    K, V, KH, VH, slots, stride_khp, stride_vhp, tiered, fp8, page, Hkv = kv_args(q, k_cache, v_cache)
    k_cache, v_cache = K, V
    if block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be int32")
    plan = plan or BSAPlan(index, Hq, Hkv, q.device)
    nqb = index.queries.num_blocks
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device) if lse is None else lse
    if nqb == 0:
        return out, lse
    bq_pad, block_m, heads_per_prog, n_hsub = _program_shape(plan.hpp, index.block_q, block_m)
    split = num_splits > 1
    if split:
        out_p, lse_p = workspace if workspace is not None else (
            torch.empty(T, Hq, num_splits, D, dtype=torch.float32, device=q.device),
            torch.empty(T, Hq, num_splits, dtype=torch.float32, device=q.device))
    else:
        out_p, lse_p = out, lse  # unused placeholders
    mode = attend_code(rope.mode) if rope is not None else 0
    inv_freq = rope.inv_freq.to(device=q.device, dtype=torch.float32) if mode else plan.counts  # unused when mode 0
    grid = (nqb, plan.num_pairs * n_hsub, num_splits)
    _bsa_kernel[grid](
        q, k_cache, v_cache, KH, VH, slots, block_tables, plan.seq, plan.start, plan.len, plan.pos, plan.blocks,
        plan.counts, plan.pair_group, plan.pair_kv, inv_freq, out, lse, out_p, lse_p,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_khp, stride_vhp,
        block_tables.stride(0),
        plan.blocks.stride(0), plan.blocks.stride(1),
        plan.counts.stride(0),
        out.stride(0), out.stride(1),
        lse.stride(0),
        out_p.stride(0), out_p.stride(1), out_p.stride(2) if split else 0,
        lse_p.stride(0), lse_p.stride(1),
        scale * math.log2(math.e), num_splits, index.n_sink, index.n_window,
        rope.rope_from if mode else 0, rope.group if mode else 1,
        ROPE=mode, HPP=plan.hpp, HEADS_PER_PROG=heads_per_prog, N_HSUB=n_hsub, BQ_PAD=bq_pad, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_DIM=D, BK=index.block_k, PAGE=page, SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TIERED=tiered, FP8=fp8,
        HALVES=mode != 0 and D >= 32, num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=2,
    )
    if split:
        combine_splits_triton(out_p, lse_p, out, lse)
    return out, lse
