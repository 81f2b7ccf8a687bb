"""Per-block key metadata for PSA (attention/psa/): built once a block is complete, scored against decode queries.

A block is one KV page (block_size tokens of one sequence). Its metadata, per KV head, is a box around its keys,
kept as a centre c and a radius r (D values each):
  cuboid-mean  (ArkVale's, PSA's default)  c = (max + min) / 2,  r = mean over the block's keys of |k - c|
  minmax       (Quest's bound)              c = (max + min) / 2,  r = (max - min) / 2
A query's criticality score for the block is q.c + |q|.r. For minmax that is exactly Quest's upper bound
sum_d max(q_d min_d, q_d max_d) >= q.k for every key of the block; cuboid-mean shrinks the box to the keys' mean
distance from its centre: an estimate, not a bound, which ranked better in ArkVale's recall measurements.
A KV-group's score is the max over the group's query heads (one ranking per sequence and KV head, attention/psa/).

Storage, per layer: (P, 2, H_kv, D) in the run dtype, indexed by page id ([:, 0] centres, [:, 1] radii), so the
metadata lives beside the page pool: nothing per sequence, a freed page is simply rebuilt when it is full again.

Kernels (each with its PyTorch reference below, tested in the interpreter, tests/test_psa.py):
  * `_block_meta_kernel`, grid (rows, NB, H_kv): row r builds blocks lo[r] + t for t < NB, those below hi[r]; keys
    are read through the block table and, with offloading, the page table (kernels/paged.py: a missing page straight
    from pinned host memory), fp8 rows dequantised. Programs past hi[r] load and store nothing.
  * `_block_score_kernel`, grid (rows, H_kv, W / BLOCK_W): scores of blocks [0, W) of each row, -inf outside the
    row's candidates [cand_lo, cand_hi[r]).
Limits: head_dim a power of two in [16, 256]; block_size a power of two.
"""
from __future__ import annotations

import torch

from .fp8 import values

try:
    import triton
    import triton.language as tl

    from .paged import kv_format, load_kv, page_slots, row_base, tier_args
    from .rope import rotate_rows, swap_halves
except ImportError:  # pragma: no cover - CPU installs without Triton use the references
    triton = None

METADATA_KINDS = ("cuboid-mean", "minmax")


def page_keys(k_cache, pages: torch.Tensor) -> torch.Tensor:
    """Keys of `pages` (n,) as fp32 values (n, block_size, H_kv, D), through both tiers and fp8 rows."""
    idx = pages.long()
    rows = k_cache.pages(idx) if hasattr(k_cache, "pages") else k_cache[idx]
    return values(rows, torch.float32).float()


def block_metadata_reference(keys: torch.Tensor, kind: str, valid: torch.Tensor | None = None) -> torch.Tensor:
    """keys (n, block_size, H_kv, D) -> metadata (n, 2, H_kv, D) fp32: centre and radius (module docstring), over
    the keys where `valid` (n, block_size) holds (all of them when None; kernels/chunk_box.py's partial chunks)."""
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


def build_block_meta_reference(k_cache, block_tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                               meta: torch.Tensor, kind: str, inv_freq: torch.Tensor | None = None) -> None:
    """meta[page of block j of row r] = the block's metadata, for lo[r] <= j < hi[r] (host sync: CPU path).
    inv_freq (D/2,): box the keys *moved* to position 0 (each rotated back by its position j * block_size + t),
    PSA's `rope: rank` ranking (attention/psa/); None: the keys as stored."""
    lo, hi = lo.long().cpu(), hi.long().cpu()
    rows = torch.repeat_interleave(torch.arange(lo.numel()), (hi - lo).clamp(min=0))
    if rows.numel() == 0:
        return
    starts = torch.repeat_interleave(lo, (hi - lo).clamp(min=0))
    first = torch.repeat_interleave(torch.cumsum((hi - lo).clamp(min=0), 0) - (hi - lo).clamp(min=0),
                                    (hi - lo).clamp(min=0))
    blocks = starts + torch.arange(rows.numel()) - first
    pages = block_tables.cpu()[rows, blocks].long()
    keys = page_keys(k_cache, pages)
    if inv_freq is not None:
        from ..rope.strategies import rotate

        page = keys.shape[1]
        pos = blocks[:, None] * page + torch.arange(page)  # (n, block_size)
        keys = rotate(keys, -pos[:, :, None].to(keys.device), inv_freq)
    meta[pages.to(meta.device)] = block_metadata_reference(keys, kind).to(meta.dtype)


def block_scores_reference(q: torch.Tensor, meta: torch.Tensor, block_tables: torch.Tensor, cand_lo: int,
                           cand_hi: torch.Tensor, width: int) -> torch.Tensor:
    """Criticality scores (n, H_kv, width) fp32 of blocks [0, width) of each row; -inf outside [cand_lo, cand_hi[r]).

    q (n, H_q, D); meta (P, 2, H_kv, D); block_tables (n, >= width)."""
    n, Hq, D = q.shape
    Hkv = meta.shape[2]
    m = meta[block_tables[:, :width].long()].float()  # (n, W, 2, H_kv, D)
    qg = q.float().view(n, Hkv, Hq // Hkv, D)
    s = qg @ m[:, :, 0].permute(0, 2, 3, 1) + qg.abs() @ m[:, :, 1].permute(0, 2, 3, 1)  # (n, H_kv, h, W)
    s = s.amax(dim=2)  # a KV group's score: the max over its heads
    w = torch.arange(width, device=q.device)
    cand = (w[None, :] >= cand_lo) & (w[None, :] < cand_hi.long()[:, None])
    return s.masked_fill(~cand[:, None, :], float("-inf"))


if triton is not None:

    @triton.jit
    def box_store(out, k, valid, count, d, stride_k, ok, MEAN: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Store the box of rows k (N, D) fp32 where `valid` (N,): centre at out, radius at out + stride_k (`count`
        valid rows, for the mean), both masked by `ok`. `block_metadata_reference` is its reference; the PSA
        metadata kernel and kernels/chunk_box.py's chunk boxes share it."""
        kmax = tl.max(tl.where(valid[:, None], k, float("-inf")), axis=0)
        kmin = tl.min(tl.where(valid[:, None], k, float("inf")), axis=0)
        centre = (kmax + kmin) * 0.5
        if MEAN:
            radius = tl.sum(tl.where(valid[:, None], tl.abs(k - centre[None, :]), 0.0), axis=0) / count
        else:
            radius = (kmax - kmin) * 0.5
        tl.store(out, centre.to(out.dtype.element_ty), mask=(d < HEAD_DIM) & ok)
        tl.store(out + stride_k, radius.to(out.dtype.element_ty), mask=(d < HEAD_DIM) & ok)

    @triton.jit
    def _block_meta_kernel(
        K, KH, Slots, BlockTables, Lo, Hi, Meta, InvFreq,
        stride_kp, stride_ko, stride_kh, stride_khp, stride_btb, stride_mp, stride_mk, stride_mh,
        PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, MEAN: tl.constexpr, TIERED: tl.constexpr, FP8: tl.constexpr,
        MOVE: tl.constexpr,
    ):
        r = tl.program_id(1)
        j = tl.load(Lo + r) + tl.program_id(0)  # blocks on axis 0: grid axes 1 and 2 stop at 65,535 (1M tokens)
        h = tl.program_id(2)
        ok = j < tl.load(Hi + r)
        t = tl.arange(0, PAGE)
        d = tl.arange(0, HEAD_DIM)
        page = tl.load(BlockTables + r * stride_btb + j, mask=ok, other=0).to(tl.int64)
        pages = page + t * 0  # (PAGE,): every row of the block lives in the same page
        slot = page_slots(Slots, pages, TIERED)
        base = row_base(K, KH, pages, slot, stride_kp, stride_khp, TIERED)
        valid = (t < PAGE) & ok
        k = load_kv(base, t, h, stride_ko, stride_kh, d, valid, HEAD_DIM, FP8).to(tl.float32)
        if MOVE:  # each key rotated back to position 0 (PSA's rope: rank)
            k_sw = load_kv(base, t, h, stride_ko, stride_kh, swap_halves(d, HEAD_DIM), valid, HEAD_DIM, FP8)
            k = rotate_rows(k, k_sw, -(j * PAGE + t), tl.load(InvFreq + d % (HEAD_DIM // 2)), d, HEAD_DIM)
        box_store(Meta + page * stride_mp + h * stride_mh + d, k, valid, PAGE * 1.0, d, stride_mk, ok, MEAN,
                  HEAD_DIM)

    @triton.jit
    def _block_score_kernel(
        Q, Meta, BlockTables, CandHi, Scores,
        stride_qn, stride_qh, stride_mp, stride_mk, stride_mh, stride_btb, stride_sn, stride_sg,
        cand_lo, width,
        HPG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, HEAD_DIM: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        n = tl.program_id(0)
        g = tl.program_id(1)
        w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
        hh = tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + n * stride_qn + (g * HPG + hh)[:, None] * stride_qh + d[None, :], mask=(hh < HPG)[:, None],
                    other=0.0)
        cand = (w >= cand_lo) & (w < tl.load(CandHi + n))
        page = tl.load(BlockTables + n * stride_btb + w, mask=cand, other=0).to(tl.int64)
        base = Meta + page[:, None] * stride_mp + g * stride_mh + d[None, :]
        c = tl.load(base, mask=cand[:, None], other=0.0)  # (BLOCK_W, D), q's dtype: exact products in fp32
        rad = tl.load(base + stride_mk, mask=cand[:, None], other=0.0)
        s = tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION) + \
            tl.dot(tl.abs(q), tl.trans(rad), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_W)
        s = tl.max(tl.where((hh < HPG)[:, None], s, float("-inf")), axis=0)
        tl.store(Scores + n * stride_sn + g * stride_sg + w, tl.where(cand, s, float("-inf")), mask=w < width)


def build_block_meta_triton(k_cache, block_tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                           max_blocks: int, meta: torch.Tensor, kind: str, inv_freq: torch.Tensor | None = None) -> None:
    """`build_block_meta_reference` as one kernel launch (no host sync, graph-capturable): blocks lo[r] + t for
    t < max_blocks that are below hi[r]. k_cache: (P, block_size, H_kv, D), a two-tier `TierView`, or fp8 rows;
    inv_freq (D/2,) fp32: box the keys moved to position 0."""
    if triton is None:
        raise RuntimeError("build_block_meta_triton needs Triton")
    if kind not in METADATA_KINDS:
        raise ValueError(f"metadata must be one of {', '.join(METADATA_KINDS)}, got {kind!r}")
    K, KH, slots, stride_khp, tiered = tier_args(k_cache)
    D = meta.shape[-1]
    fp8 = kv_format(K, D)
    if block_tables.dtype != torch.int32 or lo.dtype != torch.int32 or hi.dtype != torch.int32:
        raise ValueError("block_tables, lo and hi must be int32")
    if meta.shape[1:] != (2, K.shape[2], D) or meta.stride(-1) != 1:
        raise ValueError(f"meta must be (pages, 2, {K.shape[2]}, {D}) and contiguous in D, got {tuple(meta.shape)}")
    n = lo.shape[0]
    if n == 0 or max_blocks < 1:
        return
    move = inv_freq is not None
    _block_meta_kernel[(max_blocks, n, K.shape[2])](
        K, KH, slots, block_tables, lo, hi, meta, inv_freq.float() if move else meta,
        K.stride(0), K.stride(1), K.stride(2), stride_khp, block_tables.stride(0),
        meta.stride(0), meta.stride(1), meta.stride(2),
        PAGE=K.shape[1], HEAD_DIM=D, MEAN=kind == "cuboid-mean", TIERED=tiered, FP8=fp8, MOVE=move, num_warps=4,
    )


def block_scores_triton(q: torch.Tensor, meta: torch.Tensor, block_tables: torch.Tensor, cand_lo: int,
                        cand_hi: torch.Tensor, width: int, block_w: int = 64) -> torch.Tensor:
    """`block_scores_reference` as one kernel launch: reads each row's metadata once, no (n, W, D) gather in memory.
    q and meta share a dtype (the products are exact in the fp32 accumulator, as in the reference)."""
    if triton is None:
        raise RuntimeError("block_scores_triton needs Triton")
    n, Hq, D = q.shape
    Hkv = meta.shape[2]
    if cand_hi.dtype != torch.int32 or block_tables.dtype != torch.int32:
        raise ValueError("cand_hi and block_tables must be int32")
    if meta.dtype != q.dtype or meta.shape[1:] != (2, Hkv, D) or Hq % Hkv:
        raise ValueError(f"meta must be (pages, 2, H_kv, {D}) in q's dtype {q.dtype}, got {tuple(meta.shape)} "
                         f"{meta.dtype}")
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {D}")
    scores = torch.empty(n, Hkv, width, dtype=torch.float32, device=q.device)
    if n == 0 or width == 0:
        return scores
    hpg = Hq // Hkv
    _block_score_kernel[(n, Hkv, triton.cdiv(width, block_w))](
        q, meta, block_tables, cand_hi, scores,
        q.stride(0), q.stride(1), meta.stride(0), meta.stride(1), meta.stride(2), block_tables.stride(0),
        scores.stride(0), scores.stride(1), cand_lo, width,
        HPG=hpg, BLOCK_M=max(16, triton.next_power_of_2(hpg)), BLOCK_W=block_w, HEAD_DIM=D,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
    )
    return scores
