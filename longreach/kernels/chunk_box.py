"""Chunk scores from a box around each chunk's keys: a first pruning stage that does not search inside the chunks.

The retrieval ladder (docs/quality.md) found where InfiniteHiP loses a needle past the trained length: stage 0's
SelectRep, whose binary search follows first-key representatives and misses an isolated high-scoring key in a
256-token chunk. Scoring every key exactly (`infinitehip:3k-exact`) finds it, at a cost that grows with the square of
the context. A box keeps one summary per chunk instead: per KV head, a centre c and a radius r of the chunk's keys
(kernels/block_meta.py, PSA's metadata: `minmax` is Quest's box, c = (max + min) / 2, r = (max - min) / 2, whose score
q.c + |q|.r is an upper bound of q.k over the chunk; `cuboid-mean` shrinks r to the keys' mean distance from c, an
estimate). A chunk's score is the max over the group's heads and the block's rows of q.c + |q|.r.

Two flavours per chunk, [0] and [1] of a box's second axis:
  0  the keys as stored (true positions), read by query blocks that end inside the trained length;
  1  the keys moved to the pruning position of the layer's strategy, read by blocks past it. For rt and il that
     position depends on the key alone (rt: 1, the right-branch position an exactly scored key gets; il: 0), so a
     bound at those positions bounds the exact scores there. Chunk-indexed positions (ci) depend on the block's
     candidate list, which a box per chunk cannot follow: the box uses rt in its place (decision: rt in layers 0-2
     instead of ci changed passkey within noise, docs/quality.md "What the ladder says"). SelfExtend groups (de) change
     with the context length, so a kept box would go stale: the engine refuses de with a box stage 0 (the reference
     below still takes it, for tests).
A query block reads the flavour its position picks, chosen per block with a `where` (no host sync).
Edges: a box covers the chunk's keys [j*chunk, min((j+1)*chunk, length)), also keys before n_sink or at or past the
block's candidate end (the first and last candidate chunks): a superset, still a bound, looser there.

Where the boxes live: in the engine, a pool paged like the KV cache (attention/infinitehip/boxes.py): a sequence's
chunk j sits at row box_table[j // per] * per + j % per of each layer's pool, at stable addresses, so a captured decode
step reads them through the table with static shapes. Each step boxes only the chunks its new keys touch
(`build_boxes_*`: in decode one chunk per sequence, the one holding the newest key), from the keys in whichever tier
holds them (KV offload: straight from host memory for a missing page). Outside the engine (tests, the recall tool)
the boxes are built from the keys on each call (`key_boxes`). Scoring: the kept boxes on a GPU by a Triton kernel
that reads them through the table (`box_scores_triton`); elsewhere torch ops (gather + einsum, its reference).

Kernels (each with its PyTorch reference, tested in the interpreter: tests/test_chunk_box.py; bf16 at real sizes
in tests/gpu/test_box.py):
  * `_chunk_box_kernel`, grid (rows, NC, H_kv): row r boxes its chunks lo[r] + t for t < NC below hi[r], both
    flavours, reading keys through the block table (and the offload page table), fp8 rows dequantised. Programs
    past hi[r] load and store nothing.
  * `_box_score_kernel`, grid (blocks, (group, KV head) pairs, chunks / BLOCK_C): each chunk's max over the pair's
    heads and the block's rows of q.c + |q|.r in the block's flavour, the boxes read through the box table, two
    tensor-core dots per tile of rows (tf32 for a bf16 pool; the torch reference is fp32).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..rope.strategies import RopeArgs, prune_query_pos, rotate
from . import use_triton
from .block_meta import METADATA_KINDS, block_metadata_reference
from .index_types import head_pairs
from .kv_layout import gather_tokens
from .prune_stage import chunk_bounds, moved_keys

try:
    import triton
    import triton.language as tl

    from .block_meta import box_store
    from .paged import kv_format, load_kv, page_slots, row_base, tier_args
    from .rope import rotate_rows, swap_halves
except ImportError:  # pragma: no cover - CPU installs without Triton use the references
    triton = None

MOVE_TO = {"rt": 1, "il": 0}  # flavour 1's key position per pruning strategy (box_mode: ci boxes as rt)


def box_mode(mode: str | None) -> str | None:
    """The strategy flavour 1 follows for a layer pruned with `mode` (None: no moved flavour)."""
    if mode is None or mode == "none":
        return None
    return "rt" if mode == "ci" else mode


def chunk_boxes(keys: torch.Tensor, chunk: int, kind: str) -> torch.Tensor:
    """keys (L, H_kv, D) -> boxes (ceil(L / chunk), 2, H_kv, D) fp32: centre and radius of each chunk's keys, a
    partial last chunk over its own keys only."""
    L, H, D = keys.shape
    n = -(-L // chunk)
    k = torch.cat([keys.float(), keys.new_zeros(n * chunk - L, H, D, dtype=torch.float32)])
    valid = (torch.arange(n * chunk, device=keys.device) < L).reshape(n, chunk)
    return block_metadata_reference(k.reshape(n, chunk, H, D), kind, valid)


def key_boxes(keys: torch.Tensor, first: int, chunk: int, kind: str, rope: RopeArgs | None) -> torch.Tensor:
    """Boxes (n, 2 flavours, 2, H_kv, D) fp32 of keys [first, first + L) (first a multiple of chunk): as stored, and
    moved by `rope`'s strategy (module docstring; ci as rt; the stored keys again when rope is None)."""
    k = keys.float()
    stored = chunk_boxes(k, chunk, kind)
    mode = box_mode(rope.mode if rope is not None else None)
    moved = stored if mode is None else chunk_boxes(moved_keys(k, first, mode, True, rope), chunk, kind)
    return torch.stack([stored, moved], dim=1)


def box_queries(qs: torch.Tensor, row_ok: torch.Tensor, cand_end: torch.Tensor, rope: RopeArgs | None):
    """(q (nb, R, H_q, D) fp32 at true positions, q moved to the strategy's query position (ci as rt), moved (nb,)
    bool: blocks that end at or past rope.rope_from read flavour 1). No host sync. Rows past a block's length repeat
    its first row, so a max over rows is the max over its real rows."""
    nb, R = row_ok.shape
    q32 = torch.where(row_ok[:, :, None, None], qs.float(), qs[:, :1].float())
    mode = box_mode(rope.mode if rope is not None else None)
    if mode is None:
        return q32, q32, torch.zeros(nb, dtype=torch.bool, device=qs.device)
    end = cand_end + rope.n_window
    p = (end - row_ok.sum(1))[:, None] + torch.arange(R, device=qs.device)  # (nb, R) row positions
    moved_q = rotate(q32, (prune_query_pos(mode, p, rope.n_window, rope.group) - p)[:, :, None], rope.inv_freq)
    return q32, torch.where(row_ok[:, :, None, None], moved_q, moved_q[:, :1]), end - 1 >= rope.rope_from


class BoxView(NamedTuple):
    """A sequence's kept boxes in the engine's pool (attention/infinitehip/boxes.py): chunk j at row table[j // per] * per +
    j % per of `pool` (rows, 2, 2, H_kv, D), for chunks [0, n)."""

    pool: torch.Tensor
    table: torch.Tensor
    per: int
    n: int

    def gather(self) -> torch.Tensor:
        """The boxes of chunks [0, n) as one (n, 2, 2, H_kv, D) tensor (static shapes: graph-capturable)."""
        pages = self.table[:-(-self.n // self.per)].long()
        rows = self.pool.view(-1, self.per, *self.pool.shape[1:])[pages]
        return rows.reshape(-1, *self.pool.shape[1:])[:self.n]


def score_boxes(q32: torch.Tensor, q_moved: torch.Tensor, moved: torch.Tensor, boxes: "torch.Tensor | BoxView",
                ids: torch.Tensor, chunk: int, n_sink: int, cand_end: torch.Tensor, groups: int,
                max_bytes: int = 256 << 20) -> torch.Tensor:
    """Scores (nb, G, C) of candidate chunks `ids` (nb, G, C), -inf if invalid, from `boxes` ((>= max id + 1, 2, 2,
    H_kv, D), `key_boxes`' layout, any float dtype; or a `BoxView` of the engine's pool) and the queries of
    `box_queries`. Kept boxes on a GPU are scored by the Triton kernel straight from the pool; else torch ops."""
    nb, R, Hq, D = q32.shape
    dev = q32.device
    Hkv = boxes.pool.shape[3] if isinstance(boxes, BoxView) else boxes.shape[3]
    pairs, hpp = head_pairs(Hq, Hkv, groups)
    P = len(pairs)
    pair_group, pair_kv = pair_index(P, Hkv, groups, dev)
    if isinstance(boxes, BoxView) and use_triton(dev):
        out = box_scores_triton(q32, q_moved, moved, boxes, groups)
    else:
        out = _box_scores_torch(q32, q_moved, moved, boxes.gather() if isinstance(boxes, BoxView) else boxes, P,
                                hpp, pair_kv, max_bytes)
    n_chunks = out.shape[2]
    _, _, valid = chunk_bounds(ids, chunk, n_sink, cand_end)
    ids_p, valid_p = ids[:, pair_group], valid[:, pair_group]  # (nb, P, C)
    s = torch.gather(out, 2, ids_p.clamp(0, n_chunks - 1).long()).masked_fill(~valid_p, float("-inf"))
    return s.reshape(nb, groups, P // groups, -1).amax(dim=2)


def _box_scores_torch(q32, q_moved, moved, boxes, P, hpp, pair_kv, max_bytes) -> torch.Tensor:
    """(nb, P, n_chunks) fp32: per block and (group, KV head) pair, each chunk's max over the pair's heads and the
    block's rows of q.c + |q|.r, in the block's flavour. Host syncs only outside a CUDA graph capture, to skip a
    flavour no block reads."""
    nb, R, Hq, D = q32.shape
    dev = q32.device
    n_chunks = boxes.shape[0]
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    flavours = [0, 1] if capturing else [f for f in (0, 1) if bool((moved == bool(f)).any())]
    qf = {0: q32.reshape(nb, R, P, hpp, D), 1: q_moved.reshape(nb, R, P, hpp, D)}
    cr = {f: (boxes[:, f, 0][:, pair_kv].float(), boxes[:, f, 1][:, pair_kv].float()) for f in flavours}
    step = max(1, max_bytes // max(1, R * Hq * n_chunks * 4 * 3))
    out = torch.empty(nb, P, n_chunks, device=dev)
    for lo in range(0, nb, step):
        hi = min(nb, lo + step)
        best = None
        for f in flavours:
            u = qf[f][lo:hi]
            c, r = cr[f]
            s = (torch.einsum("nrphd,cpd->nphrc", u, c) + torch.einsum("nrphd,cpd->nphrc", u.abs(), r)).amax(dim=(2, 3))
            best = s if best is None else torch.where(moved[lo:hi, None, None], s, best)
        out[lo:hi] = best
    return out


def pair_index(P: int, Hkv: int, groups: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(group, KV head) of each of the P (group, KV head) pairs of executor.head_pairs, built on the device from
    their pattern (a host-to-device copy may not run inside a CUDA graph capture): pair i reads KV head i // (P /
    H_kv); its group is i, or 0 when there is one group."""
    i = torch.arange(P, device=dev)
    return (i if groups == P else torch.zeros_like(i)), i // (P // Hkv)


def chunk_box_scores(qs: torch.Tensor, row_ok: torch.Tensor, keys: torch.Tensor | None, ids: torch.Tensor, chunk: int,
                     n_sink: int, cand_end: torch.Tensor, groups: int, kind: str, rope: RopeArgs | None = None,
                     boxes: "torch.Tensor | BoxView | None" = None, max_bytes: int = 256 << 20) -> torch.Tensor:
    """Scores (nb, G, C) of candidate chunks `ids` (nb, G, C) from their boxes, -inf if invalid; the arguments are
    prune_stage.chunk_scores_reference's (qs (nb, R, H_q, D), row_ok (nb, R), keys (L, H_kv, D) as stored). `boxes`:
    the sequence's boxes kept by the engine (a `BoxView`, or a tensor in `key_boxes`' layout); None builds them from
    `keys`."""
    if kind not in METADATA_KINDS:
        raise ValueError(f"box kind must be one of {', '.join(METADATA_KINDS)}, got {kind!r}")
    if boxes is None:
        boxes = key_boxes(keys, 0, chunk, kind, rope)
    q32, q_moved, moved = box_queries(qs, row_ok, cand_end, rope)
    return score_boxes(q32, q_moved, moved, boxes, ids, chunk, n_sink, cand_end, groups, max_bytes)


# ---- building the engine's boxes ------------------------------------------------------------------------------------
def build_boxes_reference(k_cache, block_tables: torch.Tensor, lens: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                          box_tables: torch.Tensor, pool: torch.Tensor, per: int, chunk: int, kind: str,
                          rope: RopeArgs | None) -> None:
    """pool[row of chunk j of row r] = key_boxes of its keys, for lo[r] <= j < hi[r] (host syncs: the CPU path).

    k_cache (pages, block_size, H_kv, D), a `TierView` or fp8 rows; block_tables (n, >= pages of lens[r]); lens (n,)
    each row's keys; box_tables (n, >= ceil(hi / per)) pool pages of `per` chunks each; pool (pages * per, 2, 2,
    H_kv, D)."""
    for r, (n, a, b) in enumerate(zip(lens.tolist(), lo.tolist(), hi.tolist())):
        if b <= a:
            continue
        keys = gather_tokens(k_cache, block_tables[r], min(n, b * chunk), start=a * chunk)
        j = torch.arange(a, b, device=pool.device)
        rows = box_tables[r, j // per].long() * per + j % per
        pool[rows] = key_boxes(keys, a * chunk, chunk, kind, rope).to(pool.dtype)


if triton is not None:

    @triton.jit
    def _chunk_box_kernel(
        K, KH, Slots, BlockTables, Lens, Lo, Hi, BoxTables, Pool, InvFreq,
        stride_kp, stride_ko, stride_kh, stride_khp, stride_btb, stride_bxb, stride_pr, stride_pf, stride_pk,
        stride_ph, move_to,
        CHUNK: tl.constexpr, PAGE: tl.constexpr, PER: tl.constexpr, HEAD_DIM: tl.constexpr, MEAN: tl.constexpr,
        MOVE: tl.constexpr, TIERED: tl.constexpr, FP8: tl.constexpr,
    ):
        r = tl.program_id(1)
        j = tl.load(Lo + r) + tl.program_id(0)  # chunks on axis 0: grid axes 1 and 2 stop at 65,535
        h = tl.program_id(2)
        ok = j < tl.load(Hi + r)
        t = tl.arange(0, CHUNK)
        d = tl.arange(0, HEAD_DIM)
        pos = j * CHUNK + t
        valid = ok & (pos < tl.load(Lens + r))
        count = tl.maximum(tl.sum(valid.to(tl.float32), axis=0), 1.0)
        page = tl.load(BlockTables + r * stride_btb + pos // PAGE, mask=valid, other=0).to(tl.int64)
        base = row_base(K, KH, page, page_slots(Slots, page, TIERED), stride_kp, stride_khp, TIERED)
        k = load_kv(base, pos % PAGE, h, stride_ko, stride_kh, d, valid, HEAD_DIM, FP8).to(tl.float32)
        box_page = tl.load(BoxTables + r * stride_bxb + j // PER, mask=ok, other=0).to(tl.int64)
        out = Pool + (box_page * PER + j % PER) * stride_pr + h * stride_ph + d
        box_store(out, k, valid, count, d, stride_pk, ok, MEAN, HEAD_DIM)
        if MOVE:
            k_sw = load_kv(base, pos % PAGE, h, stride_ko, stride_kh, swap_halves(d, HEAD_DIM), valid, HEAD_DIM,
                           FP8).to(tl.float32)
            inv = tl.load(InvFreq + d % (HEAD_DIM // 2))
            km = rotate_rows(k, k_sw, move_to - pos, inv, d, HEAD_DIM)
        else:
            km = k
        box_store(out + stride_pf, km, valid, count, d, stride_pk, ok, MEAN, HEAD_DIM)


if triton is not None:

    @triton.jit
    def _box_score_kernel(
        Q, Moved, Pool, Table, Out,
        stride_qf, stride_qb, stride_qr, stride_qh, stride_pr, stride_pf, stride_pk, stride_ph, stride_ob, stride_op,
        n_chunks, n_rows,
        HPP: tl.constexpr, PAIRS_PER_KV: tl.constexpr, PER: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        p = tl.program_id(1)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        d = tl.arange(0, HEAD_DIM)
        cok = c < n_chunks
        f = tl.load(Moved + b).to(tl.int64)  # the block's flavour: 0 stored, 1 moved
        row = tl.load(Table + c // PER, mask=cok, other=0).to(tl.int64) * PER + c % PER
        base = Pool + row[:, None] * stride_pr + f * stride_pf + (p // PAIRS_PER_KV) * stride_ph + d[None, :]
        cen = tl.load(base, mask=cok[:, None], other=0.0).to(tl.float32)  # (BLOCK_C, D)
        rad = tl.load(base + stride_pk, mask=cok[:, None], other=0.0).to(tl.float32)
        best = tl.full((BLOCK_C,), float("-inf"), tl.float32)
        for m0 in range(0, n_rows, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            mok = m < n_rows
            q = tl.load(Q + f * stride_qf + b * stride_qb + (m // HPP)[:, None] * stride_qr +
                        (p * HPP + m % HPP)[:, None] * stride_qh + d[None, :], mask=mok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(cen), input_precision=DOT_PRECISION) + \
                tl.dot(tl.abs(q), tl.trans(rad), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_C)
            best = tl.maximum(best, tl.max(tl.where(mok[:, None], s, float("-inf")), axis=0))
        tl.store(Out + b * stride_ob + p * stride_op + c, best, mask=cok)


def box_scores_triton(q32: torch.Tensor, q_moved: torch.Tensor, moved: torch.Tensor, boxes: BoxView,
                      groups: int, block_c: int = 64) -> torch.Tensor:
    """`_box_scores_torch` as one launch, reading the kept boxes through the box table (no gather, no host sync):
    (nb, P, n) fp32. Queries fp32 (box_queries'); dots in tf32 for a bf16/fp16 pool, exact fp32 for an fp32 one."""
    if triton is None:
        raise RuntimeError("box_scores_triton needs Triton")
    nb, R, Hq, D = q32.shape
    pool = boxes.pool
    Hkv = pool.shape[3]
    if pool.shape[1:] != (2, 2, Hkv, D) or pool.stride(-1) != 1:
        raise ValueError(f"pool must be (rows, 2, 2, H_kv, {D}) contiguous in D, got {tuple(pool.shape)}")
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {D}")
    pairs, hpp = head_pairs(Hq, Hkv, groups)
    P = len(pairs)
    qq = torch.stack([q32, q_moved]).float().contiguous()
    out = torch.empty(nb, P, boxes.n, dtype=torch.float32, device=q32.device)
    if nb == 0 or boxes.n == 0:
        return out
    rows = R * hpp
    _box_score_kernel[(nb, P, triton.cdiv(boxes.n, block_c))](
        qq, moved.to(torch.int32), pool, boxes.table, out,
        qq.stride(0), qq.stride(1), qq.stride(2), qq.stride(3), pool.stride(0), pool.stride(1), pool.stride(2),
        pool.stride(3), out.stride(0), out.stride(1), boxes.n, rows,
        HPP=hpp, PAIRS_PER_KV=P // Hkv, PER=boxes.per, BLOCK_M=max(16, min(64, triton.next_power_of_2(rows))),
        BLOCK_C=block_c, HEAD_DIM=D, DOT_PRECISION="ieee" if pool.dtype == torch.float32 else "tf32", num_warps=4,
    )
    return out


def build_boxes_triton(k_cache, block_tables: torch.Tensor, lens: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                       box_tables: torch.Tensor, pool: torch.Tensor, per: int, chunk: int, kind: str,
                       rope: RopeArgs | None, max_chunks: int) -> None:
    """`build_boxes_reference` as one launch (no host sync, graph-capturable): chunks lo[r] + t for t < max_chunks
    that are below hi[r]. All index tensors int32; pool (rows, 2, 2, H_kv, D) contiguous in D."""
    if triton is None:
        raise RuntimeError("build_boxes_triton needs Triton")
    if kind not in METADATA_KINDS:
        raise ValueError(f"box kind must be one of {', '.join(METADATA_KINDS)}, got {kind!r}")
    K, KH, slots, stride_khp, tiered = tier_args(k_cache)
    D = pool.shape[-1]
    fp8 = kv_format(K, D)
    if any(x.dtype != torch.int32 for x in (block_tables, lens, lo, hi, box_tables)):
        raise ValueError("block_tables, lens, lo, hi and box_tables must be int32")
    if pool.shape[1:] != (2, 2, K.shape[2], D) or pool.stride(-1) != 1:
        raise ValueError(f"pool must be (rows, 2, 2, {K.shape[2]}, {D}) contiguous in D, got {tuple(pool.shape)}")
    if chunk & (chunk - 1) or chunk < 1:
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    n = lo.shape[0]
    if n == 0 or max_chunks < 1:
        return
    mode = box_mode(rope.mode if rope is not None else None)
    inv = rope.inv_freq.to(device=pool.device, dtype=torch.float32) if mode else lens  # unused without a move
    _chunk_box_kernel[(max_chunks, n, K.shape[2])](
        K, KH, slots, block_tables, lens, lo, hi, box_tables, pool, inv,
        K.stride(0), K.stride(1), K.stride(2), stride_khp, block_tables.stride(0), box_tables.stride(0),
        pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3), MOVE_TO.get(mode, 0),
        CHUNK=chunk, PAGE=K.shape[1], PER=per, HEAD_DIM=D, MEAN=kind == "cuboid-mean",
        MOVE=mode is not None, TIERED=tiered, FP8=fp8, num_warps=4,
    )
