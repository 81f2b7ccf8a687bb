"""Key boxes: one summary per unit of a sequence's keys, built once the keys are cached and scored against queries.
One store layout, one build kernel and one score kernel serve PSA's block metadata, Quest's page bounds and
infinitehip's box-scored stage 0.

A box, per KV head, is a centre c and a radius r (D values each) around the keys of one unit:
  minmax       (Quest's bound)              c = (max + min) / 2,  r = (max - min) / 2
  cuboid-mean  (ArkVale's, PSA's default)  c = (max + min) / 2,  r = mean over the unit's keys of |k - c|
A query's score for the unit is q.c + |q|.r. For minmax that is exactly Quest's upper bound sum_d max(q_d min_d,
q_d max_d) >= q.k for every key of the unit (in exact arithmetic; the store rounds c and r to its dtype);
cuboid-mean shrinks the box to the keys' mean distance from its centre: an estimate, not a bound. A selection group's
score is the max over its query heads and over the query block's rows.

Where a box lives, the one rule: a layer's store is (rows, F, 2, H_kv, D) ([:, f, 0] centres, [:, f, 1] radii) in
the run dtype, and unit j of a sequence sits at row table[j // per] * per + j % per. Two placements use it:
  * page-indexed (PSA, Quest: attention/box_store.py, PageBoxes): a unit is one KV page, the table is the sequence's
    KV block table and per = 1, so the boxes sit beside the page pool, indexed by page id, with nothing to allocate
    per sequence (a freed page is simply boxed again once it holds new keys).
  * pooled (infinitehip's 64-token chunks, which are not pages: attention/infinitehip/boxes.py, BoxPool): the store
    has box pages of `per` units of one sequence and a box table per sequence.
F flavours: 1, the keys as stored or all moved to one position (PSA's `rope: rank` boxes keys moved to position 0);
or 2, [0] as stored and [1] moved (infinitehip's pruning strategies, kernels/chunk_box.py), a query block reading
the flavour its position picks. A unit may be partial (the sequence's last keys): its box covers its own keys.

Kernels (each with its PyTorch reference below; interpreter tests in fp16/fp32: tests/test_psa.py,
tests/test_chunk_box.py, tests/test_quest.py; bf16 at real sizes: tests/gpu/test_psa.py, test_box.py, test_quest.py):
  * `_box_build_kernel`, grid (units, rows, H_kv): row r boxes its units lo[r] + t for t < the grid's units that
    are below hi[r], reading keys through the block table (and, with offloading, the page table: kernels/paged.py),
    fp8 rows dequantised; keys at or past lens[r] are left out. Programs past hi[r] load and store nothing.
  * `_box_score_kernel`, grid (query blocks, (group, KV head) pairs, units / BLOCK_C): per pair, each unit's max
    over the pair's heads and the block's rows of q.c + |q|.r, boxes read through the table (one shared by every
    block, or one per block), -inf outside the block's candidates [cand_lo, cand_hi[b]). Two tensor-core dots per
    tile of rows: exact products in fp32 for bf16/fp16 queries and boxes, tf32 for fp32 queries on a bf16/fp16
    store, ieee for fp32 on fp32.
  * `_box_score_rows_kernel`, grid (query blocks, pairs, tiles of rows): the same scores for a long prefill step,
    where the first layout re-read every row of a block (in fp32) once per box tile: each program keeps one tile of
    rows and streams the block's candidate boxes past it, row tiles combined by atomic max; the queries are
    rounded to a bf16/fp16 store's dtype (bf16 tensor-core dots, where the first layout runs tf32 on fp32 queries).
Limits: head_dim a power of two in [16, 256]; unit and block_size powers of two.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..rope.strategies import rotate
from . import use_triton
from .index_types import head_pairs
from .kv_layout import gather_tokens

try:
    import triton
    import triton.language as tl

    from .paged import kv_format, load_kv, page_slots, row_base, tier_args
    from .rope import rotate_rows, swap_halves
except ImportError:  # pragma: no cover - CPU installs without Triton use the references
    triton = None

BOX_KINDS = ("cuboid-mean", "minmax")
# the score kernel's long-prefill layout (`box_scores_triton`): taken from this many (block, pair, 128-row tile)
# programs; its row tile and box tile
ROWS_LAYOUT_PROGRAMS = 2048
ROWS_TILE = 256
ROWS_BLOCK_C = 64


def box_of_keys(keys: torch.Tensor, kind: str, valid: torch.Tensor | None = None) -> torch.Tensor:
    """keys (n, unit, H_kv, D) -> boxes (n, 2, H_kv, D) fp32: centre and radius (module docstring), over the keys
    where `valid` (n, unit) holds (all of them when None: partial units)."""
    keys = keys.float()
    if valid is None:
        valid = torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device)
    ok = valid[:, :, None, None]
    kmax = keys.masked_fill(~ok, float("-inf")).amax(dim=1)
    kmin = keys.masked_fill(~ok, float("inf")).amin(dim=1)
    centre = (kmax + kmin) / 2
    if kind == "cuboid-mean":
        radius = ((keys - centre[:, None]).abs() * ok).sum(dim=1) / ok.sum(dim=1).clamp(min=1)
    else:
        radius = (kmax - kmin) / 2
    return torch.stack([centre, radius], dim=1)


class BoxView(NamedTuple):
    """One sequence's boxes in a store: unit j at row table[j // per] * per + j % per of `pool` (rows, F, 2, H_kv, D),
    for units [0, n)."""

    pool: torch.Tensor
    table: torch.Tensor  # int32
    per: int
    n: int

    @classmethod
    def of(cls, boxes: torch.Tensor) -> "BoxView":
        """Boxes (n, F, 2, H_kv, D) of units [0, n) in order, as a view (boxes built from the keys at a call)."""
        n = boxes.shape[0]
        return cls(boxes, torch.arange(n, dtype=torch.int32, device=boxes.device), 1, n)


def box_scores(q: torch.Tensor, view: BoxView, cand_lo: int, cand_hi: torch.Tensor, groups: int,
               q_moved: torch.Tensor | None = None, moved: torch.Tensor | None = None,
               max_bytes: int = 256 << 20) -> torch.Tensor:
    """Scores (nb, pairs, view.n) of one sequence's units (`box_scores_reference`'s arguments): the Triton kernel on
    CUDA, else the reference (in slices of about `max_bytes`)."""
    args = (q, view.pool, view.table, view.per, cand_lo, cand_hi, view.n, groups, q_moved, moved)
    return box_scores_triton(*args) if use_triton(q) else box_scores_reference(*args, max_bytes=max_bytes)


# ---- references -----------------------------------------------------------------------------------------------------
def build_boxes_reference(k_cache, block_tables: torch.Tensor, lens: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                          box_tables: torch.Tensor, pool: torch.Tensor, per: int, unit: int, kind: str,
                          move: tuple[torch.Tensor, int] | None = None) -> None:
    """pool[row of unit j of row r] = the box of its keys [j * unit, min((j + 1) * unit, lens[r])), for
    lo[r] <= j < hi[r] (host syncs: the CPU path). k_cache (pages, block_size, H_kv, D), a `TierView` or fp8 rows;
    block_tables (n, pages) and box_tables (n, >= ceil(hi / per)); pool (rows, F, 2, H_kv, D). move: (inv_freq
    (D/2,), position): flavour F - 1 boxes the keys rotated to that position (module docstring); None: as stored."""
    for r, (n, a, b) in enumerate(zip(lens.tolist(), lo.tolist(), hi.tolist())):
        if b <= a:
            continue
        keys = gather_tokens(k_cache, block_tables[r], min(n, b * unit), start=a * unit)  # (m, H_kv, D) fp32
        m, size = keys.shape[0], (b - a) * unit
        keys = torch.cat([keys, keys.new_zeros(size - m, *keys.shape[1:])]).view(b - a, unit, *keys.shape[1:])
        valid = (torch.arange(size, device=keys.device) < m).view(b - a, unit)
        stored = box_of_keys(keys, kind, valid)
        moved = stored
        if move is not None:
            pos = a * unit + torch.arange(size, device=keys.device).view(b - a, unit, 1)
            moved = box_of_keys(rotate(keys, move[1] - pos, move[0]), kind, valid)
        flavours = [stored, moved] if pool.shape[1] == 2 else [moved]
        j = torch.arange(a, b, device=pool.device)
        rows = box_tables[r, j // per].long() * per + j % per
        pool[rows] = torch.stack(flavours, dim=1).to(pool.device, pool.dtype)


def box_scores_reference(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, per: int, cand_lo: int,
                         cand_hi: torch.Tensor, width: int, groups: int, q_moved: torch.Tensor | None = None,
                         moved: torch.Tensor | None = None, max_bytes: int = 256 << 20) -> torch.Tensor:
    """Scores (nb, pairs, width) fp32 of units [0, width): per query block and (group, KV head) pair
    (index_types.head_pairs), each unit's max over the pair's heads and the block's rows of q.c + |q|.r; -inf outside
    the block's candidates [cand_lo, cand_hi[b]).

    q (nb, R, H_q, D): each block's rows (rows past a block's length repeat a real row); pool (rows, F, 2, H_kv, D);
    tables (T,) one table for every block, or (nb, T) one per block; cand_hi (nb,). With two flavours, block b reads
    flavour moved[b] with q_moved's rows. Host syncs only outside a CUDA graph capture (to skip an unread flavour)."""
    nb, R, Hq, D = q.shape
    dev = q.device
    Hkv = pool.shape[3]
    pairs, hpp = head_pairs(Hq, Hkv, groups)
    P = len(pairs)
    pair_kv = torch.arange(P, device=dev) // (P // Hkv)
    u = torch.arange(width, device=dev)
    cand = (u[None, :] >= cand_lo) & (u[None, :] < cand_hi.long()[:, None])  # (nb, W)
    rows = tables[..., u // per].long() * per + u % per  # (W,) or (nb, W)
    if rows.dim() == 2:  # one table per block: entries past a block's candidates may be padding
        rows = torch.where(cand, rows, 0)
    boxes = pool[rows]  # (W, F, 2, H_kv, D) or (nb, W, F, 2, H_kv, D)
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    flavours = [0] if moved is None else [f for f in (0, 1) if capturing or bool((moved == bool(f)).any())]
    qf = {0: q, 1: q_moved}
    cr = {f: [boxes[..., f, i, :, :].index_select(-2, pair_kv).float() for i in (0, 1)] for f in flavours}
    eq = "nrphd,nwpd->nphrw" if rows.dim() == 2 else "nrphd,wpd->nphrw"  # boxes (nb, W, P, D) or (W, P, D)
    step = max(1, max_bytes // max(1, R * Hq * width * 4 * 3))
    out = torch.empty(nb, P, width, device=dev)
    for lo in range(0, nb, step):
        hi = min(nb, lo + step)
        best = None
        for f in flavours:
            x = qf[f][lo:hi].float().reshape(hi - lo, R, P, hpp, D)
            c, r = (t[lo:hi] if rows.dim() == 2 else t for t in cr[f])
            s = torch.einsum(eq, x, c) + torch.einsum(eq, x.abs(), r)
            s = s.amax(dim=(2, 3))
            best = s if best is None else torch.where(moved[lo:hi, None, None], s, best)
        out[lo:hi] = best
    return out.masked_fill(~cand[:, None, :], float("-inf"))


# the step's rows, lengths and tables are not specialised (bsa.py's STEP_INTS says why)
BUILD_STEP_INTS = ("stride_btb", "stride_bxb", "move_to")
BUILD_STEP_POINTERS = ("Slots", "BlockTables", "Lens", "Lo", "Hi", "BoxTables", "InvFreq")

if triton is not None:

    @triton.jit
    def box_store(out, k, valid, count, d, stride_k, ok, MEAN: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Store the box of rows k (N, D) fp32 where `valid` (N,): centre at out, radius at out + stride_k (`count`
        valid rows, for the mean), both masked by `ok`. `box_of_keys` is its reference."""
        kmax = tl.max(tl.where(valid[:, None], k, float("-inf")), axis=0)
        kmin = tl.min(tl.where(valid[:, None], k, float("inf")), axis=0)
        centre = (kmax + kmin) * 0.5
        if MEAN:
            radius = tl.sum(tl.where(valid[:, None], tl.abs(k - centre[None, :]), 0.0), axis=0) / count
        else:
            radius = (kmax - kmin) * 0.5
        tl.store(out, centre.to(out.dtype.element_ty), mask=(d < HEAD_DIM) & ok)
        tl.store(out + stride_k, radius.to(out.dtype.element_ty), mask=(d < HEAD_DIM) & ok)

    @triton.jit(do_not_specialize=BUILD_STEP_INTS, do_not_specialize_on_alignment=BUILD_STEP_POINTERS)
    def _box_build_kernel(
        K, KH, Slots, BlockTables, Lens, Lo, Hi, BoxTables, Pool, InvFreq,
        stride_kp, stride_ko, stride_kh, stride_khp, stride_btb, stride_bxb, stride_pr, stride_pf, stride_pk,
        stride_ph, move_to,
        UNIT: tl.constexpr, PAGE: tl.constexpr, PER: tl.constexpr, HEAD_DIM: tl.constexpr, MEAN: tl.constexpr,
        FLAVOURS: tl.constexpr, MOVE: tl.constexpr, TIERED: tl.constexpr, FP8: tl.constexpr,
    ):
        r = tl.program_id(1)
        j = tl.load(Lo + r) + tl.program_id(0)  # units on axis 0: grid axes 1 and 2 stop at 65,535
        h = tl.program_id(2)
        ok = j < tl.load(Hi + r)
        t = tl.arange(0, UNIT)
        d = tl.arange(0, HEAD_DIM)
        pos = j * UNIT + t
        valid = ok & (pos < tl.load(Lens + r))
        count = tl.maximum(tl.sum(valid.to(tl.float32), axis=0), 1.0)
        page = tl.load(BlockTables + r * stride_btb + pos // PAGE, mask=valid, other=0).to(tl.int64)
        slot = page_slots(Slots, page, h, TIERED)
        base = row_base(K, KH, page, slot, h, stride_kp, stride_khp, stride_kh, PAGE, TIERED)
        k = load_kv(base, pos % PAGE, h, stride_ko, stride_kh, d, valid, HEAD_DIM, FP8).to(tl.float32)
        box_page = tl.load(BoxTables + r * stride_bxb + j // PER, mask=ok, other=0).to(tl.int64)
        out = Pool + (box_page * PER + j % PER) * stride_pr + h * stride_ph + d
        if MOVE:  # each key rotated to position move_to
            k_sw = load_kv(base, pos % PAGE, h, stride_ko, stride_kh, swap_halves(d, HEAD_DIM), valid, HEAD_DIM,
                           FP8).to(tl.float32)
            km = rotate_rows(k, k_sw, move_to - pos, tl.load(InvFreq + d % (HEAD_DIM // 2)), d, HEAD_DIM)
        else:
            km = k
        if FLAVOURS == 2:  # [0] as stored, [1] moved (the stored keys again without a move)
            box_store(out, k, valid, count, d, stride_pk, ok, MEAN, HEAD_DIM)
            box_store(out + stride_pf, km, valid, count, d, stride_pk, ok, MEAN, HEAD_DIM)
        else:
            box_store(out, km, valid, count, d, stride_pk, ok, MEAN, HEAD_DIM)

    @triton.jit
    def _box_score_kernel(
        Q, Moved, Pool, Table, CandHi, Out,
        stride_qf, stride_qb, stride_qr, stride_qh, stride_pr, stride_pf, stride_pk, stride_ph, stride_tb, stride_ob,
        stride_op, cand_lo, width, n_rows,
        HPP: tl.constexpr, PAIRS_PER_KV: tl.constexpr, PER: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, MOVED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        p = tl.program_id(1)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        d = tl.arange(0, HEAD_DIM)
        if MOVED:
            f = tl.load(Moved + b).to(tl.int64)  # the block's flavour: 0 stored, 1 moved
        else:
            f = 0
        cand = (c >= cand_lo) & (c < tl.load(CandHi + b))
        # a tile past every candidate (the -1 padding of a graph variant sized for a larger context bucket) reads
        # nothing: its -inf is stored without loading boxes or queries
        best = tl.full((BLOCK_C,), float("-inf"), tl.float32)
        if tl.max(cand.to(tl.int32), axis=0) > 0:
            row = tl.load(Table + b * stride_tb + c // PER, mask=cand, other=0).to(tl.int64) * PER + c % PER
            base = Pool + row[:, None] * stride_pr + f * stride_pf + (p // PAIRS_PER_KV) * stride_ph + d[None, :]
            cen = tl.load(base, mask=cand[:, None], other=0.0).to(Q.dtype.element_ty)  # (BLOCK_C, D)
            rad = tl.load(base + stride_pk, mask=cand[:, None], other=0.0).to(Q.dtype.element_ty)
            for m0 in range(0, n_rows, BLOCK_M):  # rows m = row of the block * HPP + head of the pair
                m = m0 + tl.arange(0, BLOCK_M)
                mok = m < n_rows
                q = tl.load(Q + f * stride_qf + b * stride_qb + (m // HPP)[:, None] * stride_qr +
                            (p * HPP + m % HPP)[:, None] * stride_qh + d[None, :], mask=mok[:, None], other=0.0)
                s = tl.dot(q, tl.trans(cen), input_precision=DOT_PRECISION) + \
                    tl.dot(tl.abs(q), tl.trans(rad), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_C)
                best = tl.maximum(best, tl.max(tl.where(mok[:, None], s, float("-inf")), axis=0))
        tl.store(Out + b * stride_ob + p * stride_op + c, tl.where(cand, best, float("-inf")), mask=c < width)


    @triton.jit
    def _box_score_rows_kernel(
        Q, Moved, Pool, Table, CandHi, Out,
        stride_qf, stride_qb, stride_qr, stride_qh, stride_pr, stride_pf, stride_pk, stride_ph, stride_tb, stride_ob,
        stride_op, cand_lo, n_rows,
        HPP: tl.constexpr, PAIRS_PER_KV: tl.constexpr, PER: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, MOVED: tl.constexpr, DOT_PRECISION: tl.constexpr,
        ATOMIC: tl.constexpr, LOWP: tl.constexpr,
    ):
        """The long-prefill layout of `_box_score_kernel`: a program keeps one tile of BLOCK_M rows (row of the
        block * HPP + head of the pair) in registers and streams every candidate box past it, so the queries are
        read once instead of once per box tile. Several row tiles of a block combine by atomic max into Out, which
        the launcher fills with -inf first. LOWP: queries rounded to the store's dtype (bf16/fp16 tensor-core dots
        instead of tf32 on fp32 queries)."""
        b = tl.program_id(0)
        p = tl.program_id(1)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        if MOVED:
            f = tl.load(Moved + b).to(tl.int64)
        else:
            f = 0
        mok = m < n_rows
        q = tl.load(Q + f * stride_qf + b * stride_qb + (m // HPP)[:, None] * stride_qr +
                    (p * HPP + m % HPP)[:, None] * stride_qh + d[None, :], mask=mok[:, None], other=0.0)
        if LOWP:
            q = q.to(Pool.dtype.element_ty)
        qa = tl.abs(q)
        hi = tl.load(CandHi + b)
        kv = (p // PAIRS_PER_KV) * stride_ph
        for c0 in tl.range((cand_lo // BLOCK_C) * BLOCK_C, hi, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cand = (c >= cand_lo) & (c < hi)
            row = tl.load(Table + b * stride_tb + c // PER, mask=cand, other=0).to(tl.int64) * PER + c % PER
            base = Pool + row[:, None] * stride_pr + f * stride_pf + kv + d[None, :]
            cen = tl.load(base, mask=cand[:, None], other=0.0).to(q.dtype)  # (BLOCK_C, D)
            rad = tl.load(base + stride_pk, mask=cand[:, None], other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(cen), input_precision=DOT_PRECISION)
            s = tl.dot(qa, tl.trans(rad), s, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_C)
            best = tl.max(tl.where(mok[:, None], s, float("-inf")), axis=0)
            if ATOMIC:
                tl.atomic_max(Out + b * stride_ob + p * stride_op + c, best, mask=cand)
            else:
                tl.store(Out + b * stride_ob + p * stride_op + c, best, mask=cand)


def build_boxes_triton(k_cache, block_tables: torch.Tensor, lens: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                       box_tables: torch.Tensor, pool: torch.Tensor, per: int, unit: int, kind: str, max_units: int,
                       move: tuple[torch.Tensor, int] | None = None) -> None:
    """`build_boxes_reference` as one launch (no host sync, graph-capturable): units lo[r] + t for t < max_units
    that are below hi[r]. Index tensors int32; pool (rows, F, 2, H_kv, D) contiguous in D."""
    if triton is None:
        raise RuntimeError("build_boxes_triton needs Triton")
    if kind not in BOX_KINDS:
        raise ValueError(f"box kind must be one of {', '.join(BOX_KINDS)}, got {kind!r}")
    K, KH, slots, stride_khp, tiered = tier_args(k_cache)
    D = pool.shape[-1]
    Hkv = k_cache.shape[2]  # the view's KV heads (a pool of head slots holds one per slot)
    fp8 = kv_format(K, D)
    if any(x.dtype != torch.int32 for x in (block_tables, lens, lo, hi, box_tables)):
        raise ValueError("block_tables, lens, lo, hi and box_tables must be int32")
    if pool.shape[1] not in (1, 2) or pool.shape[2:] != (2, Hkv, D) or pool.stride(-1) != 1:
        raise ValueError(f"pool must be (rows, 1 or 2, 2, {Hkv}, {D}) contiguous in D, got {tuple(pool.shape)}")
    if unit < 1 or unit & (unit - 1):
        raise ValueError(f"unit must be a power of two, got {unit}")
    n = lo.shape[0]
    if n == 0 or max_units < 1:
        return
    inv = lens if move is None else move[0].to(device=pool.device, dtype=torch.float32)  # unused without a move
    _box_build_kernel[(max_units, n, Hkv)](
        K, KH, slots, block_tables, lens, lo, hi, box_tables, pool, inv,
        K.stride(0), K.stride(1), K.stride(2), stride_khp, block_tables.stride(0), box_tables.stride(0),
        pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3), 0 if move is None else move[1],
        UNIT=unit, PAGE=K.shape[1], PER=per, HEAD_DIM=D, MEAN=kind == "cuboid-mean", FLAVOURS=pool.shape[1],
        MOVE=move is not None, TIERED=tiered, FP8=fp8, num_warps=4,
    )


def box_scores_triton(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, per: int, cand_lo: int,
                      cand_hi: torch.Tensor, width: int, groups: int, q_moved: torch.Tensor | None = None,
                      moved: torch.Tensor | None = None, block_c: int = 64, rows_tile: int | None = None,
                      rows_block_c: int | None = None, rows_warps: int | None = None) -> torch.Tensor:
    """`box_scores_reference` as one launch: the boxes read through the table (no gather, no host sync). q in the
    store's dtype or fp32.

    Two layouts: many programs over box tiles, each reading every row (`_box_score_kernel`: decode, short
    prefill), or, once there are at least ROWS_LAYOUT_PROGRAMS (block, pair, 128-row tile) programs (a long
    prefill step), tiles of `rows_tile` rows each streaming every box past its rows (`_box_score_rows_kernel`,
    queries rounded to a bf16/fp16 store's dtype). rows_tile 0 forces the first, a power of two the second;
    rows_block_c / rows_warps: the second's box tile and warps (defaults ROWS_BLOCK_C, 8 warps at 128+ rows)."""
    if triton is None:
        raise RuntimeError("box_scores_triton needs Triton")
    nb, R, Hq, D = q.shape
    Hkv = pool.shape[3]
    if pool.shape[1] not in (1, 2) or pool.shape[2:] != (2, Hkv, D) or pool.stride(-1) != 1:
        raise ValueError(f"pool must be (rows, 1 or 2, 2, H_kv, {D}) contiguous in D, got {tuple(pool.shape)}")
    if q.dtype not in (pool.dtype, torch.float32) or q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in D, in the store's dtype {pool.dtype} or fp32, got {q.dtype}")
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {D}")
    if tables.dtype != torch.int32 or cand_hi.dtype != torch.int32:
        raise ValueError("tables and cand_hi must be int32")
    if moved is not None and pool.shape[1] != 2:
        raise ValueError("per-block flavours (moved) need a store of two flavours")
    pairs, hpp = head_pairs(Hq, Hkv, groups)
    P = len(pairs)
    qq = q[None] if moved is None else torch.stack([q, q_moved.to(q.dtype)])  # (F, nb, R, H_q, D)
    out = torch.empty(nb, P, width, dtype=torch.float32, device=q.device)
    if nb == 0 or width == 0:
        return out
    rows = R * hpp
    if rows_tile is None and nb * P * triton.cdiv(rows, 128) >= ROWS_LAYOUT_PROGRAMS:
        rows_tile = ROWS_TILE
    if rows_tile:  # a long prefill: queries stationary, boxes streamed (`_box_score_rows_kernel`)
        block_m = max(16, min(rows_tile, triton.next_power_of_2(rows)))
        tiles = triton.cdiv(rows, block_m)
        out.fill_(float("-inf"))
        lowp = pool.dtype in (torch.bfloat16, torch.float16)
        _box_score_rows_kernel[(nb, P, tiles)](
            qq, cand_hi if moved is None else moved.to(torch.int32), pool, tables, cand_hi, out,
            qq.stride(0), qq.stride(1), qq.stride(2), qq.stride(3), pool.stride(0), pool.stride(1), pool.stride(2),
            pool.stride(3), tables.stride(0) if tables.dim() == 2 else 0, out.stride(0), out.stride(1),
            cand_lo, rows,
            HPP=hpp, PAIRS_PER_KV=P // Hkv, PER=per, BLOCK_M=block_m, BLOCK_C=rows_block_c or ROWS_BLOCK_C,
            HEAD_DIM=D, MOVED=moved is not None,
            DOT_PRECISION="ieee" if q.dtype == pool.dtype == torch.float32 else "tf32", ATOMIC=tiles > 1, LOWP=lowp,
            num_warps=rows_warps or (8 if block_m >= 128 else 4), num_stages=3,
        )
        return out
    block_c = min(block_c, max(16, 8192 // D))  # the box tiles (2 x 2 x BLOCK_C x D fp32) fit shared memory at D 256
    _box_score_kernel[(nb, P, triton.cdiv(width, block_c))](
        qq, cand_hi if moved is None else moved.to(torch.int32), pool, tables, cand_hi, out,
        qq.stride(0), qq.stride(1), qq.stride(2), qq.stride(3), pool.stride(0), pool.stride(1), pool.stride(2),
        pool.stride(3), tables.stride(0) if tables.dim() == 2 else 0, out.stride(0), out.stride(1),
        cand_lo, width, rows,
        HPP=hpp, PAIRS_PER_KV=P // Hkv, PER=per, BLOCK_M=max(16, min(64, triton.next_power_of_2(rows))),
        BLOCK_C=block_c, HEAD_DIM=D, MOVED=moved is not None,
        DOT_PRECISION="ieee" if q.dtype == pool.dtype == torch.float32 else "tf32", num_warps=4,
    )
    return out


# ---- page-indexed boxes of complete pages (PSA's block metadata; boxes (P, 2, H_kv, D) by page id) -----------------
def build_page_boxes_reference(k_cache, block_tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                               boxes: torch.Tensor, kind: str, inv_freq: torch.Tensor | None = None) -> None:
    """boxes[page of block j of row r] = the box of that complete page, for lo[r] <= j < hi[r]; inv_freq (D/2,): of
    the keys moved to position 0 (PSA's `rope: rank`), None: as stored."""
    page = k_cache.shape[1]
    build_boxes_reference(k_cache, block_tables, hi.int() * page, lo, hi, block_tables, boxes[:, None], 1, page,
                          kind, None if inv_freq is None else (inv_freq, 0))


def build_page_boxes_triton(k_cache, block_tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                            max_blocks: int, boxes: torch.Tensor, kind: str,
                            inv_freq: torch.Tensor | None = None) -> None:
    """`build_page_boxes_reference` as one launch: blocks lo[r] + t for t < max_blocks that are below hi[r]."""
    page = k_cache.shape[1]
    build_boxes_triton(k_cache, block_tables, hi * page, lo, hi, block_tables, boxes[:, None], 1, page, kind,
                       max_blocks, None if inv_freq is None else (inv_freq, 0))


def page_box_scores_reference(q: torch.Tensor, boxes: torch.Tensor, block_tables: torch.Tensor, cand_lo: int,
                              cand_hi: torch.Tensor, width: int) -> torch.Tensor:
    """Scores (n, H_kv, width) fp32 of each row's blocks [0, width) for one decode query per row, q (n, H_q, D), from
    boxes (P, 2, H_kv, D) by page id read through the rows' block tables (n, >= width): one ranking per KV head,
    -inf outside [cand_lo, cand_hi[r])."""
    return box_scores_reference(q[:, None], boxes[:, None], block_tables, 1, cand_lo, cand_hi, width, boxes.shape[2])


def page_box_scores_triton(q: torch.Tensor, boxes: torch.Tensor, block_tables: torch.Tensor, cand_lo: int,
                           cand_hi: torch.Tensor, width: int, block_w: int = 64) -> torch.Tensor:
    """`page_box_scores_reference` as one launch of the score kernel."""
    return box_scores_triton(q[:, None], boxes[:, None], block_tables, 1, cand_lo, cand_hi, width, boxes.shape[2],
                             block_c=block_w)
