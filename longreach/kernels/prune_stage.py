"""Chunk scoring for context pruning: one kernel for every InfiniteHiP stage and every HiP iteration.

Given query blocks of one sequence and, per block and selection group, a list of candidate chunk ids of `chunk`
tokens (chunk j = positions [j*chunk, (j+1)*chunk), clipped to the selectable range [n_sink, cand_end) of its block),
return each chunk's score: the max over the group's heads and the block's query rows of <q, k_rep>, where k_rep is
  * SelectRep (InfiniteHiP Alg. 3): a top-1 binary search — ceil(log2 chunk) halvings, each half represented by its
    first key, the half with the higher score kept — run per head; or
  * exact: the chunk's best key (every valid key is scored). HiP scores its branch representatives this way
    (`chunk` = its key-block size b_k).
Top-k over the scores and the stage bookkeeping stay in attention/infinitehip/ and attention/hip/, shared by the
reference and the kernel.

Kernel: grid (query block, group, tile of BLOCK_C chunks). Each program keeps one head's query rows in registers and
walks its chunks' binary searches in lockstep: every iteration gathers one key per chunk (token -> page through the
block table) and scores it against all rows with one tl.dot. No iteration needs a result from another program, so
the whole search is one launch with no global synchronisation, parallel over the key dimension like flash-decoding.
Keys are read as stored (rotated at their true positions) and so are the queries.
Tested: CPU interpreter in fp16/fp32 against `chunk_scores_reference` (kernels/prune_ref.py; tests/test_kernel_bsa.py);
H100 in bf16 (tests/gpu/test_kernels.py). Limits: head_dim a power of two in [16, 256].
"""
from __future__ import annotations

import math

import torch

from ..rope.strategies import PRUNE_CODES, RopeArgs
from .index_types import head_pairs

# exact scoring's long-prefill layout (`chunk_scores_triton`): taken from this many (block, pair, 128-row tile)
# programs; its row tile by head dim: 512 rows at head dim <= 64 (Qwen2.5-Coder-0.5B's 7 heads x 64 rows in one
# tile: stage 1 22.1 -> 19.8 ms, stage 2 6.5 -> 5.4 ms at its 128K step), else 256 (the 8B shape: 512 no faster;
# docs/kernel-notes.md v22)
EXACT_ROWS_PROGRAMS = 2048
EXACT_ROWS_TILE = 256
EXACT_ROWS_TILE_SMALL_D = 512

try:
    import triton
    import triton.language as tl

    from .paged import kv_format, load_kv, page_slots, row_base, tier_args
    from .rope import rotate_halves, rotate_rows, swap_halves
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _new_key_pos(pos, from_end, de_group, ROPE: tl.constexpr, RIGHT: tl.constexpr):
        """rope/strategies.prune_key_pos for a vector of probed keys."""
        if ROPE == 1:  # rt
            return pos * 0 + RIGHT
        elif ROPE == 2:  # ci
            return from_end
        elif ROPE == 3:  # il
            return pos * 0
        else:  # de (and none, unused)
            return pos // de_group

    @triton.jit
    def _key_rows(K, KH, Slots, bt_base, kv, pos, ok, stride_kp, stride_kh, stride_khp, PAGE: tl.constexpr,
                  TIERED: tl.constexpr):
        """(base, offset in its page) of the key at each position (N,): what `load_kv` reads the rows from."""
        safe = tl.maximum(pos, 0)
        page = tl.load(bt_base + safe // PAGE, mask=ok, other=0).to(tl.int64)
        base = row_base(K, KH, page, page_slots(Slots, page, kv, TIERED), kv, stride_kp, stride_khp, stride_kh, PAGE,
                        TIERED)
        return base, safe % PAGE

    @triton.jit
    def _probe(q, K, KH, Slots, bt_base, kv, pos, ok, row_ok, stride_kp, stride_ko, stride_kh, stride_khp, inv, remap,
               from_end, de_group, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
               ROPE: tl.constexpr, RIGHT: tl.constexpr, TIERED: tl.constexpr, FP8: tl.constexpr):
        """max over the valid rows of q of <q_row, k[pos]>, for a vector of key positions: (BLOCK_C,), -inf if not ok.
        With a pruning strategy (ROPE > 0) each key is first moved to its strategy position."""
        d = tl.arange(0, HEAD_DIM)
        base, off = _key_rows(K, KH, Slots, bt_base, kv, pos, ok, stride_kp, stride_kh, stride_khp, PAGE, TIERED)
        k = load_kv(base, off, kv, stride_ko, stride_kh, d, ok, HEAD_DIM, FP8).to(q.dtype)
        if ROPE != 0:
            k_sw = load_kv(base, off, kv, stride_ko, stride_kh, swap_halves(d, HEAD_DIM), ok & remap, HEAD_DIM,
                           FP8).to(q.dtype)
            dk = tl.where(remap, _new_key_pos(pos, from_end, de_group, ROPE, RIGHT) - pos, 0)
            k = rotate_rows(k, k_sw, dk, inv, d, HEAD_DIM).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (rows, BLOCK_C)
        s = tl.where(row_ok[:, None], s, float("-inf"))
        return tl.where(ok, tl.max(s, axis=0), float("-inf"))

    @triton.jit
    def _select_rep(q, K, KH, Slots, bt_base, kv, a, b, valid, row_ok, stride_kp, stride_ko, stride_kh, stride_khp, inv,
                    remap, from_end, de_group, N_ITER: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr, TIERED: tl.constexpr, FP8: tl.constexpr):
        """SelectRep over chunks [a, b) for the rows of q: halve N_ITER times, each half represented by its first key,
        keep the higher-scoring half. Returns the score of the representative found: (BLOCK_C,).
        The first probe is the left branch's representative, every later one a right branch's (rt positions)."""
        first = a
        last = b - 1
        best = _probe(q, K, KH, Slots, bt_base, kv, first, valid, row_ok, stride_kp, stride_ko, stride_kh, stride_khp,
                      inv, remap, from_end, de_group, PAGE, HEAD_DIM, DOT_PRECISION, ROPE, 0, TIERED, FP8)
        for _ in range(N_ITER):  # a loop, not unrolled: unrolling multiplied compile time (kernel-notes v6)
            span = last - first + 1
            active = valid & (span > 1)
            mid = first + span // 2
            s_mid = _probe(q, K, KH, Slots, bt_base, kv, mid, active, row_ok, stride_kp, stride_ko, stride_kh,
                           stride_khp, inv, remap, from_end, de_group, PAGE, HEAD_DIM, DOT_PRECISION, ROPE, 1, TIERED,
                           FP8)
            right = active & (s_mid > best)
            first = tl.where(right, mid, first)
            last = tl.where(active & (s_mid <= best), mid - 1, last)
            best = tl.where(right, s_mid, best)
        return best

    @triton.jit
    def _exact_tile(qa, qb, rows_ok, K, KH, Slots, bt_base, kv, a, b, valid, from_end, stride_kp, stride_ko,
                    stride_kh, stride_khp, inv, remap, de_group, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
                    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr,
                    HALVES: tl.constexpr, TIERED: tl.constexpr, FP8: tl.constexpr, SUB: tl.constexpr):
        """Exact scores (BLOCK_C * CHUNK // SUB,) of a tile of chunks [a, b): every key of every chunk in one gather
        and one dot against the query rows, the best key of each run of SUB keys (SUB = CHUNK: each chunk's).

        HALVES (a pruning strategy, head_dim >= 32): qa, qb are the rows' two halves (R, D/2) and `inv` the D/2
        frequencies; each key is loaded as its two halves, moved to its pruning position (`rotate_halves`) and
        scored by a dot over each half. Else qa holds the rows (R, D), qb is unused and `inv` has D entries (`_probe`:
        the rows of each key loaded as stored and with halves swapped)."""
        j = tl.arange(0, CHUNK)
        if SUB == CHUNK:  # the chunk's valid keys from its first, [a, b)
            p2 = a[:, None] + j[None, :]
            ok2 = valid[:, None] & (p2 < b[:, None])
        else:  # runs of SUB keys aligned to the chunk's start (a is past it where the sink cuts the chunk)
            p2 = (a // CHUNK * CHUNK)[:, None] + j[None, :]
            ok2 = valid[:, None] & (p2 >= a[:, None]) & (p2 < b[:, None])
        pos = tl.reshape(p2, [BLOCK_C * CHUNK])
        ok = tl.reshape(ok2, [BLOCK_C * CHUNK])
        fe = tl.reshape(from_end[:, None] + j[None, :] * 0, [BLOCK_C * CHUNK])
        if HALVES:
            h = tl.arange(0, HEAD_DIM // 2)
            base, off = _key_rows(K, KH, Slots, bt_base, kv, pos, ok, stride_kp, stride_kh, stride_khp, PAGE, TIERED)
            k1 = load_kv(base, off, kv, stride_ko, stride_kh, h, ok, HEAD_DIM, FP8).to(qa.dtype)
            k2 = load_kv(base, off, kv, stride_ko, stride_kh, h + HEAD_DIM // 2, ok, HEAD_DIM, FP8).to(qa.dtype)
            k1, k2 = rotate_halves(k1, k2, tl.where(remap, _new_key_pos(pos, fe, de_group, ROPE, 1) - pos, 0), inv)
            s = tl.dot(qa, tl.trans(k1.to(qa.dtype)), input_precision=DOT_PRECISION)  # (rows, BLOCK_C * CHUNK)
            s = tl.dot(qb, tl.trans(k2.to(qa.dtype)), s, input_precision=DOT_PRECISION)
            s = tl.max(tl.where(rows_ok[:, None], s, float("-inf")), axis=0)
            s = tl.where(ok, s, float("-inf"))
        else:
            s = _probe(qa, K, KH, Slots, bt_base, kv, pos, ok, rows_ok, stride_kp, stride_ko, stride_kh, stride_khp,
                       inv, remap, fe, de_group, PAGE, HEAD_DIM, DOT_PRECISION, ROPE, 1, TIERED, FP8)
        return tl.max(tl.reshape(s, [BLOCK_C * (CHUNK // SUB), SUB]), axis=1)

    @triton.jit
    def _store_scores(Scores, c, valid, best, num_chunks, R: tl.constexpr, BLOCK_C: tl.constexpr,
                      ATOMIC: tl.constexpr):
        """Store a tile's scores at (chunk c, sub-chunk r) -> c * R + r: `best` (BLOCK_C * R,), -inf where the chunk
        is not a candidate (atomic max: combined with other row tiles')."""
        cs = tl.reshape(c[:, None] * R + tl.arange(0, R)[None, :], [BLOCK_C * R])
        ok = tl.reshape(valid[:, None] & (tl.arange(0, R)[None, :] >= 0), [BLOCK_C * R])
        cm = tl.reshape((c[:, None] < num_chunks) & (tl.arange(0, R)[None, :] >= 0), [BLOCK_C * R])
        if ATOMIC:
            tl.atomic_max(Scores + cs, best, mask=ok)
        else:
            tl.store(Scores + cs, tl.where(ok, best, float("-inf")), mask=cm)

    @triton.jit
    def _query_pos(p, n_window, de_group, ROPE: tl.constexpr):
        """rope/strategies.prune_query_pos for a vector of query positions."""
        if ROPE == 1:  # rt
            return p * 0 + n_window + 1
        elif ROPE == 4:  # de
            return p // de_group + n_window - n_window // de_group
        else:  # ci, il
            return p * 0 + n_window

    @triton.jit
    def _load_q_halves(Q, rows, heads, ok, stride_qt, stride_qh, qi, length, blk_end, inv_half, remap, n_window,
                       de_group, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
        """`_load_q` (with a pruning strategy) as the rows' two halves (R, D/2) each; inv_half: the D/2 frequencies."""
        h = tl.arange(0, HEAD_DIM // 2)
        ptr = Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + h[None, :]
        q1 = tl.load(ptr, mask=ok[:, None], other=0.0)
        q2 = tl.load(ptr + HEAD_DIM // 2, mask=ok[:, None], other=0.0)
        p = blk_end - length + qi
        q1r, q2r = rotate_halves(q1, q2, tl.where(remap, _query_pos(p, n_window, de_group, ROPE) - p, 0), inv_half)
        return q1r.to(q1.dtype), q2r.to(q1.dtype)

    @triton.jit
    def _load_q(Q, rows, heads, ok, stride_qt, stride_qh, qi, length, blk_end, inv, remap, n_window, de_group,
                HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
        """Query rows (R, D); with a pruning strategy, rotated to its query position (rope/strategies.prune_query_pos);
        row qi of a block sits at blk_end - length + qi."""
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=ok[:, None],
                    other=0.0)
        if ROPE != 0:
            q_sw = tl.load(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + swap_halves(d, HEAD_DIM)[None, :],
                           mask=ok[:, None], other=0.0)
            p = blk_end - length + qi
            q = rotate_rows(q, q_sw, tl.where(remap, _query_pos(p, n_window, de_group, ROPE) - p, 0), inv, d,
                            HEAD_DIM).to(q.dtype)
        return q

    @triton.jit
    def _block_of(QbStart, QbLen, CandEnd, InvFreq, NChunk, qb, pair, stride_nb, n_window, rope_from,
                  PAIRS_PER_GROUP: tl.constexpr, PAIR_KV_DIV: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
        """What a program of (query block qb, KV-head pair) knows of its block: (group, kv head, first row, rows,
        candidate end, block end, whether the block is moved by the strategy, the D frequencies (each twice; zeros
        without a strategy), ci's candidate count)."""
        group = pair // PAIRS_PER_GROUP
        cand_end = tl.load(CandEnd + qb)
        d = tl.arange(0, HEAD_DIM)
        blk_end = cand_end + n_window
        inv = tl.load(InvFreq + d % (HEAD_DIM // 2)) if ROPE != 0 else d * 0.0
        n_chunk = tl.load(NChunk + qb * stride_nb + group) if ROPE == 2 else 0
        return (group, pair // PAIR_KV_DIV, tl.load(QbStart + qb), tl.load(QbLen + qb), cand_end, blk_end,
                blk_end - 1 >= rope_from, inv, n_chunk)

    @triton.jit
    def _row_offsets(j, length, STRIDE: tl.constexpr):
        """Offsets in the block of its taken rows j: every STRIDE-th row counted back from its last (HiP's query
        stride; rope/strategies.py `block_row_positions`), and which are rows of the block."""
        qi = tl.maximum(length - 1, 0) % STRIDE + j * STRIDE  # (a block of no rows takes none)
        return qi, qi < length

    @triton.jit
    def _pair_rows(Q, InvFreq, r, pair, start, length, stride_qt, stride_qh, blk_end, inv, remap, n_window, de_group,
                   HPP: tl.constexpr, BQ_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr,
                   HALVES: tl.constexpr, STRIDE: tl.constexpr):
        """Rows r (head of the pair * BQ_PAD + taken row of the block, `_row_offsets`) as the exact scoring takes
        them: (qa, qb, rows_ok, the frequencies `_exact_tile` takes): with HALVES the rows' two halves and the D/2
        frequencies, else the rows (qb the same) and `inv`."""
        hh = r // BQ_PAD
        qi, in_block = _row_offsets(r % BQ_PAD, length, STRIDE)
        rows_ok = (hh < HPP) & in_block
        if HALVES:
            inv_h = tl.load(InvFreq + tl.arange(0, HEAD_DIM // 2))
            qa, qb = _load_q_halves(Q, start + qi, pair * HPP + hh, rows_ok, stride_qt, stride_qh, qi, length,
                                    blk_end, inv_h, remap, n_window, de_group, HEAD_DIM, ROPE)
            return qa, qb, rows_ok, inv_h
        else:
            qa = _load_q(Q, start + qi, pair * HPP + hh, rows_ok, stride_qt, stride_qh, qi, length, blk_end, inv,
                         remap, n_window, de_group, HEAD_DIM, ROPE)
            return qa, qa, rows_ok, inv

    @triton.jit
    def _candidates(Ids, qb, group, c, stride_ib, stride_ig, num_chunks, n_sink, cand_end, CHUNK: tl.constexpr):
        """Candidates c of the block's list: their first key, end and whether any key of theirs is selectable."""
        ids = tl.load(Ids + qb * stride_ib + group * stride_ig + c, mask=c < num_chunks, other=-1)
        a = tl.maximum(ids * CHUNK, n_sink)
        b = tl.minimum((ids + 1) * CHUNK, cand_end)
        return a, b, (ids >= 0) & (a < b)

    @triton.jit
    def _chunk_score_kernel(
        Q, K, KH, Slots, BlockTable, QbStart, QbLen, CandEnd, Ids, Scores, InvFreq, NChunk,
        stride_qt, stride_qh, stride_kp, stride_ko, stride_kh, stride_khp,
        stride_ib, stride_ig, stride_sb, stride_sp, stride_nb,
        num_chunks, n_sink, n_window, rope_from, de_group,
        ROPE: tl.constexpr, HPP: tl.constexpr, PAIRS_PER_GROUP: tl.constexpr, PAIR_KV_DIV: tl.constexpr,
        CHUNK: tl.constexpr, EXACT: tl.constexpr, PER_HEAD: tl.constexpr, N_ITER: tl.constexpr,
        BQ_PAD: tl.constexpr, HPP_PAD: tl.constexpr, BLOCK_C: tl.constexpr, TILES: tl.constexpr,
        TILE_FIRST: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        TIERED: tl.constexpr, FP8: tl.constexpr, HALVES: tl.constexpr, SUB: tl.constexpr, STRIDE: tl.constexpr,
    ):
        # SUB < CHUNK (exact only): a score per run of SUB keys, Scores' last axis C * CHUNK // SUB
        # STRIDE: every STRIDE-th query row of each block (`_row_offsets`)
        # TILE_FIRST: consecutive programs take consecutive chunk tiles of one query block (its queries stay in L2);
        # otherwise consecutive programs take the same chunk tile of consecutive query blocks (keys stay in L2)
        qb = tl.program_id(2) if TILE_FIRST else tl.program_id(0)
        tile0 = tl.program_id(0) if TILE_FIRST else tl.program_id(2)
        pair = tl.program_id(1)
        group, kv, start, length, cand_end, blk_end, remap, inv, n_chunk = _block_of(
            QbStart, QbLen, CandEnd, InvFreq, NChunk, qb, pair, stride_nb, n_window, rope_from, PAIRS_PER_GROUP,
            PAIR_KV_DIV, HEAD_DIM, ROPE)
        if not PER_HEAD:  # every head of the pair in one query tile, loaded once for all the program's chunk tiles
            q_all, q_hi, rows_ok, inv_h = _pair_rows(Q, InvFreq, tl.arange(0, HPP_PAD * BQ_PAD), pair, start, length,
                                                     stride_qt, stride_qh, blk_end, inv, remap, n_window, de_group,
                                                     HPP, BQ_PAD, HEAD_DIM, ROPE, EXACT and HALVES, STRIDE)
        for t in tl.static_range(TILES):
            c = (tile0 * TILES + t) * BLOCK_C + tl.arange(0, BLOCK_C)
            a, b, valid = _candidates(Ids, qb, group, c, stride_ib, stride_ig, num_chunks, n_sink, cand_end, CHUNK)
            # a tile with no real candidate (the -1 padding of a graph variant sized for a larger context bucket,
            # attention/sparse/prefill_graph.py) scores nothing: its -inf is stored without reading keys
            best = tl.full([BLOCK_C * (CHUNK // SUB)], float("-inf"), tl.float32)
            if tl.max(valid.to(tl.int32), axis=0) > 0:
                from_end = c - (n_chunk - 1)  # ci: the chunk's ordinal counted from the last candidate
                if PER_HEAD:  # the paper's SelectRep: each query head searches on its own
                    r1, row_ok = _row_offsets(tl.arange(0, BQ_PAD), length, STRIDE)
                    for i in range(HPP):  # a loop, not unrolled (kernel-notes v6)
                        q = _load_q(Q, start + r1, r1 * 0 + pair * HPP + i, row_ok, stride_qt, stride_qh, r1, length,
                                    blk_end, inv, remap, n_window, de_group, HEAD_DIM, ROPE)
                        hs = _select_rep(q, K, KH, Slots, BlockTable, kv, a, b, valid, row_ok, stride_kp, stride_ko,
                                         stride_kh, stride_khp, inv, remap, from_end, de_group, N_ITER, PAGE, HEAD_DIM,
                                         DOT_PRECISION, ROPE, TIERED, FP8)
                        best = tl.maximum(best, hs)
                elif EXACT:  # every key of every chunk in one gather and one dot
                    best = _exact_tile(q_all, q_hi, rows_ok, K, KH, Slots, BlockTable, kv, a, b, valid, from_end,
                                       stride_kp, stride_ko, stride_kh, stride_khp, inv_h, remap, de_group, CHUNK,
                                       BLOCK_C, PAGE, HEAD_DIM, DOT_PRECISION, ROPE, HALVES, TIERED, FP8, SUB)
                else:  # SelectRep shared by the heads of the pair: one gather per probe
                    best = _select_rep(q_all, K, KH, Slots, BlockTable, kv, a, b, valid, rows_ok, stride_kp, stride_ko,
                                       stride_kh, stride_khp, inv, remap, from_end, de_group, N_ITER, PAGE, HEAD_DIM,
                                       DOT_PRECISION, ROPE, TIERED, FP8)
            _store_scores(Scores + qb * stride_sb + pair * stride_sp, c, valid, best, num_chunks, CHUNK // SUB,
                          BLOCK_C, False)


    @triton.jit
    def _exact_rows_kernel(
        Q, K, KH, Slots, BlockTable, QbStart, QbLen, CandEnd, Ids, Scores, InvFreq, NChunk,
        stride_qt, stride_qh, stride_kp, stride_ko, stride_kh, stride_khp,
        stride_ib, stride_ig, stride_sb, stride_sp, stride_nb,
        num_chunks, n_sink, n_window, rope_from, de_group,
        ROPE: tl.constexpr, HPP: tl.constexpr, PAIRS_PER_GROUP: tl.constexpr, PAIR_KV_DIV: tl.constexpr,
        CHUNK: tl.constexpr, BQ_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, TIERED: tl.constexpr,
        FP8: tl.constexpr, ATOMIC: tl.constexpr, HALVES: tl.constexpr, SUB: tl.constexpr, STRIDE: tl.constexpr,
    ):
        """Exact scoring for a long prefill step: a program keeps one tile of BLOCK_M rows (head of the pair *
        BQ_PAD + row of the block) and streams every candidate chunk of its block past it, so the rows are loaded
        once per block instead of once per few chunk tiles, and a block's rows may span several programs (combined
        by atomic max into Scores, which the launcher fills with -inf first)."""
        qb = tl.program_id(0)
        pair = tl.program_id(1)
        group, kv, start, length, cand_end, blk_end, remap, inv, n_chunk = _block_of(
            QbStart, QbLen, CandEnd, InvFreq, NChunk, qb, pair, stride_nb, n_window, rope_from, PAIRS_PER_GROUP,
            PAIR_KV_DIV, HEAD_DIM, ROPE)
        q, q_hi, rows_ok, inv = _pair_rows(Q, InvFreq, tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M), pair,
                                           start, length, stride_qt, stride_qh, blk_end, inv, remap, n_window,
                                           de_group, HPP, BQ_PAD, HEAD_DIM, ROPE, HALVES, STRIDE)
        for c0 in tl.range(0, num_chunks, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            a, b, valid = _candidates(Ids, qb, group, c, stride_ib, stride_ig, num_chunks, n_sink, cand_end, CHUNK)
            if tl.max(valid.to(tl.int32), axis=0) > 0:  # the -1 padding of a larger bucket's variant reads nothing
                best = _exact_tile(q, q_hi, rows_ok, K, KH, Slots, BlockTable, kv, a, b, valid, c - (n_chunk - 1),
                                   stride_kp, stride_ko, stride_kh, stride_khp, inv, remap, de_group, CHUNK, BLOCK_C,
                                   PAGE, HEAD_DIM, DOT_PRECISION, ROPE, HALVES, TIERED, FP8, SUB)
                # (the launcher filled Scores with -inf: a tile with no candidate needs no store)
                _store_scores(Scores + qb * stride_sb + pair * stride_sp, c, valid, best, num_chunks, CHUNK // SUB,
                              BLOCK_C, ATOMIC)


def chunk_scores_triton(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, starts: torch.Tensor,
                        lens: torch.Tensor, cand_end: torch.Tensor, ids: torch.Tensor, chunk: int, exact: bool,
                        n_sink: int, groups: int, rep_per_head: bool = True, max_rows: int | None = None,
                        block_c: int | None = None, tiles: int | None = None,
                        tile_first: bool = False, rope: RopeArgs | None = None, rows_tile: int | None = None,
                        rows_warps: int | None = None, sub: int | None = None, stride: int = 1) -> torch.Tensor:
    """Triton version of `chunk_scores_reference` reading keys from the paged cache of one sequence.

    q (n, H_q, D) the sequence's queries this step; starts/lens (nb,) each block's rows in q; cand_end (nb,);
    ids (nb, G, C) int; block_table (pages,) int32 of the sequence; max_rows: a bound on lens known on the host
    (without it lens is read back, a host sync). Returns (nb, G, C) fp32.

    Exact scoring of multi-row blocks has a second layout for long prefill steps (`_exact_rows_kernel`, taken from
    EXACT_ROWS_PROGRAMS (block, pair, 128-row tile) programs): tiles of `rows_tile` rows, each streaming its
    block's candidate chunks (block_c at a time, `rows_warps` warps). rows_tile 0 forces the first layout.
    `sub` (exact only; a power of two dividing `chunk`): a score per run of `sub` keys instead, (nb, G, C * chunk //
    sub), run r of chunk c at c * chunk // sub + r (a chunk's score is the max of its runs').
    `stride`: every stride-th query row of each block, counted back from its last (HiP's query stride).
    """
    if triton is None:
        raise RuntimeError("chunk_scores_triton needs Triton")
    _, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    k_cache, KH, slots, stride_khp, tiered = tier_args(k_cache)
    fp8 = kv_format(k_cache, D)
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {D}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the cache must be contiguous in the head dimension")
    nb, G, C = ids.shape
    sub = chunk if sub is None else sub
    if sub != chunk and (not exact or sub < 1 or sub & (sub - 1) or chunk % sub):
        raise ValueError(f"scores per run of keys need exact scoring and a power of two dividing the chunk {chunk}, "
                         f"got {sub} (exact {exact})")
    R = chunk // sub
    pairs, hpp = head_pairs(Hq, Hkv, groups)
    P = len(pairs)
    ids32 = ids.to(torch.int32)  # no copy when int32 already: the kernel reads any strides but a unit last one
    if ids32.stride(-1) != 1:
        ids32 = ids32.contiguous()
    if nb == 0 or C == 0:
        return torch.full((nb, G, C * R), float("-inf"), device=q.device)
    scores = torch.empty(nb, P, C * R, dtype=torch.float32, device=q.device)
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"the query stride must be an integer >= 1, got {stride!r}")
    rows = max(1, triton.next_power_of_2(-(-(max_rows if max_rows is not None else int(lens.max())) // stride)))
    per_head = rep_per_head and not exact
    if exact and (chunk & (chunk - 1) or chunk > 64):
        raise ValueError(f"exact scoring needs a power-of-two chunk <= 64, got {chunk}")
    hpp_pad = triton.next_power_of_2(hpp)
    bq_pad = max(16, rows) if per_head else max(16 // hpp_pad, rows)
    tile_rows = bq_pad if per_head else hpp_pad * bq_pad
    if block_c is None:  # the fastest widths on the GPU (docs/kernel-notes.md v2-v4)
        block_c = max(1, 128 // chunk) if exact else (64 if tile_rows <= 64 else 32)
    mode = PRUNE_CODES[rope.mode] if rope is not None else 0
    halves = mode != 0 and D >= 32  # exact scoring keeps rows as halves (a dot of D/2 >= 16 per half)
    inv_freq = rope.inv_freq.to(device=q.device, dtype=torch.float32) if mode else scores  # unused when mode 0
    n_chunk = (ids32 >= 0).sum(-1, dtype=torch.int32) if mode == PRUNE_CODES["ci"] else ids32
    args = (  # both layouts' tensors, strides and scalars
        q, k_cache, KH, slots, block_table, starts.to(torch.int32), lens.to(torch.int32), cand_end.to(torch.int32),
        ids32, scores, inv_freq, n_chunk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_khp,
        ids32.stride(0), ids32.stride(1), scores.stride(0), scores.stride(1), n_chunk.stride(0),
        C, n_sink, rope.n_window if mode else 0, rope.rope_from if mode else 0, rope.group if mode else 1)
    pair_kv_div = (Hq // Hkv) if groups == Hq and Hq != Hkv else 1
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if exact and rows > 1 and rows_tile is None and nb * P * triton.cdiv(tile_rows, 128) >= EXACT_ROWS_PROGRAMS:
        rows_tile = EXACT_ROWS_TILE_SMALL_D if D <= 64 else EXACT_ROWS_TILE
    if exact and rows > 1 and rows_tile:
        block_m = max(16, min(rows_tile, tile_rows))
        n_row_tiles = triton.cdiv(tile_rows, block_m)
        scores.fill_(float("-inf"))
        _exact_rows_kernel[(nb, P, n_row_tiles)](
            *args, ROPE=mode, HPP=hpp, PAIRS_PER_GROUP=P // groups, PAIR_KV_DIV=pair_kv_div, CHUNK=chunk,
            BQ_PAD=bq_pad, BLOCK_M=block_m, BLOCK_C=block_c, HEAD_DIM=D, PAGE=page, DOT_PRECISION=precision,
            TIERED=tiered, FP8=fp8, ATOMIC=n_row_tiles > 1, HALVES=halves, SUB=sub, STRIDE=stride,
            num_warps=rows_warps or (8 if block_m >= 128 else 4), num_stages=2,
        )
        return scores if P == groups else scores.reshape(nb, groups, P // groups, C * R).amax(dim=2)
    # exact scoring with plenty of programs (long prefill): each walks 4 chunk tiles so its query tile is loaded once;
    # SelectRep is latency-bound and loses from it, and decode keeps every tile a program of its own (the timings:
    # docs/kernel-notes.md v4)
    if tiles is None:
        tiles = 4 if exact and rows > 1 and nb * P * triton.cdiv(C, block_c) >= 8192 else 1
    n_tiles = triton.cdiv(C, block_c * tiles)
    grid = (n_tiles, P, nb) if tile_first else (nb, P, n_tiles)
    _chunk_score_kernel[grid](
        *args, ROPE=mode, HPP=hpp, PAIRS_PER_GROUP=P // groups, PAIR_KV_DIV=pair_kv_div,
        CHUNK=chunk, EXACT=exact, PER_HEAD=per_head, N_ITER=max(0, math.ceil(math.log2(chunk))),
        BQ_PAD=bq_pad, HPP_PAD=hpp_pad, BLOCK_C=block_c, TILES=tiles, TILE_FIRST=tile_first, HEAD_DIM=D,
        PAGE=page, DOT_PRECISION=precision, TIERED=tiered, FP8=fp8, HALVES=halves and exact and not per_head,
        SUB=sub, STRIDE=stride, num_warps=8 if tile_rows >= 128 else 4, num_stages=2,
    )
    return scores if P == groups else scores.reshape(nb, groups, P // groups, C * R).amax(dim=2)
