"""Chunk scores from a box around each chunk's keys: a first pruning stage that does not search inside the chunks.

The retrieval ladder (docs/quality.md) found where InfiniteHiP loses a needle past the trained length: stage 0's
SelectRep, whose binary search follows first-key representatives and misses an isolated high-scoring key in a
256-token chunk. Scoring every key exactly (`infinitehip:3k-exact`) finds it, at a cost that grows with the square of
the context. A box keeps one summary per chunk instead: per KV head, a centre c and a radius r of the chunk's keys
(kernels/key_boxes.py, the key boxes PSA and Quest keep too: `minmax` is Quest's box, c = (max + min) / 2,
r = (max - min) / 2, whose score q.c + |q|.r is an upper bound of q.k over the chunk; `cuboid-mean` shrinks r to the
keys' mean distance from c, an estimate). A chunk's score is the max over the group's heads and the block's rows of
q.c + |q|.r.

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
chunk j sits at row box_table[j // per] * per + j % per of each layer's pool (key_boxes.py's one rule), at stable
addresses, so a captured decode step reads them through the table with static shapes. Each step boxes only the
chunks its new keys touch (in decode one chunk per sequence, the one holding the newest key) with key_boxes.py's
build kernel, both flavours (`box_move` gives the move), from the keys in whichever tier holds them. Outside the
engine (tests, the recall tool) the boxes are built from the keys on each call (`key_boxes`). Scoring: key_boxes.py's
score kernel through the table on a GPU, its torch reference elsewhere.
"""
from __future__ import annotations

import torch

from ..rope.strategies import RopeArgs, block_row_positions, prune_query_pos, rotation
from .index_types import head_pairs
from .key_boxes import BOX_KINDS, BoxView, box_of_keys, box_scores
from .prune_ref import chunk_bounds, moved_keys

MOVE_TO = {"rt": 1, "il": 0}  # flavour 1's key position per pruning strategy (box_mode: ci boxes as rt)


def box_mode(mode: str | None) -> str | None:
    """The strategy flavour 1 follows for a layer pruned with `mode` (None: no moved flavour)."""
    if mode is None or mode == "none":
        return None
    return "rt" if mode == "ci" else mode


def box_move(rope: RopeArgs | None) -> tuple[torch.Tensor, int] | None:
    """The move of flavour 1 for key_boxes.py's builders: (inv_freq, the strategy's key position), or None."""
    mode = box_mode(rope.mode if rope is not None else None)
    return None if mode is None else (rope.inv_freq, MOVE_TO[mode])


def chunk_boxes(keys: torch.Tensor, chunk: int, kind: str) -> torch.Tensor:
    """keys (L, H_kv, D) -> boxes (ceil(L / chunk), 2, H_kv, D) fp32: centre and radius of each chunk's keys, a
    partial last chunk over its own keys only."""
    L, H, D = keys.shape
    n = -(-L // chunk)
    k = torch.cat([keys.float(), keys.new_zeros(n * chunk - L, H, D, dtype=torch.float32)])
    valid = (torch.arange(n * chunk, device=keys.device) < L).reshape(n, chunk)
    return box_of_keys(k.reshape(n, chunk, H, D), kind, valid)


def key_boxes(keys: torch.Tensor, first: int, chunk: int, kind: str, rope: RopeArgs | None) -> torch.Tensor:
    """Boxes (n, 2 flavours, 2, H_kv, D) fp32 of keys [first, first + L) (first a multiple of chunk): as stored, and
    moved by `rope`'s strategy (module docstring; ci as rt; the stored keys again when rope is None)."""
    k = keys.float()
    stored = chunk_boxes(k, chunk, kind)
    mode = box_mode(rope.mode if rope is not None else None)
    moved = stored if mode is None else chunk_boxes(moved_keys(k, first, mode, True, rope), chunk, kind)
    return torch.stack([stored, moved], dim=1)


def box_queries(qs: torch.Tensor, row_ok: torch.Tensor, cand_end: torch.Tensor, rope: RopeArgs | None, shared=None,
                stride: int = 1):
    """(q (nb, R, H_q, D) fp32 at true positions, q moved to the strategy's query position (ci as rt), moved (nb,)
    bool: blocks that end at or past rope.rope_from read flavour 1). No host sync. Rows past a block's length repeat
    its first row, so a max over rows is the max over its real rows. `shared`, `stride`: chunk_box_scores'."""
    nb, R = row_ok.shape
    # one-row blocks (decode) have no row past their length (a block has a row at least)
    q32 = qs.float() if R == 1 else torch.where(row_ok[:, :, None, None], qs.float(), qs[:, :1].float())
    mode = box_mode(rope.mode if rope is not None else None)
    if mode is None:
        return q32, q32, torch.zeros(nb, dtype=torch.bool, device=qs.device)

    def angles():  # the rows' rotation and which blocks are moved: positions only, no query
        end = cand_end + rope.n_window
        p = block_row_positions(end, row_ok, stride)  # (nb, R)
        delta = (prune_query_pos(mode, p, rope.n_window, rope.group) - p)[:, :, None]
        c, s = rotation(delta, rope.inv_freq.to(qs.device))
        # rotate_cs as x * (c, c) + (x2, x1) * (-s, s): the same products and sums, two ops fewer per layer
        return torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1), end - 1 >= rope.rope_from

    cc, ss, moved = _made(shared, ("box_query_angles", mode, rope.n_window, rope.group, rope.rope_from,
                                   rope.inv_freq.data_ptr(), stride), angles)
    half = q32.shape[-1] // 2
    moved_q = q32 * cc + torch.cat((q32[..., half:], q32[..., :half]), dim=-1) * ss
    return q32, moved_q if R == 1 else torch.where(row_ok[:, :, None, None], moved_q, moved_q[:, :1]), moved


def score_boxes(q32: torch.Tensor, q_moved: torch.Tensor, moved: torch.Tensor, boxes: "torch.Tensor | BoxView",
                ids: torch.Tensor, chunk: int, n_sink: int, cand_end: torch.Tensor, groups: int,
                max_bytes: int = 256 << 20, shared=None) -> torch.Tensor:
    """Scores (nb, G, C) of candidate chunks `ids` (nb, G, C), -inf if invalid, from `boxes` ((>= max id + 1, 2, 2,
    H_kv, D), `key_boxes`' layout, any float dtype; or a `BoxView` of the engine's pool) and the queries of
    `box_queries`: key_boxes.py's score kernel on a GPU, its reference elsewhere."""
    nb, R, Hq, D = q32.shape
    dev = q32.device
    view = boxes if isinstance(boxes, BoxView) else BoxView.of(boxes)
    Hkv = view.pool.shape[3]
    P = len(head_pairs(Hq, Hkv, groups)[0])
    # candidates: every box, the ones wanted picked by `ids` below
    every = _made(shared, ("every_box", nb, view.n), lambda: torch.full((nb,), view.n, dtype=torch.int32, device=dev))
    out = box_scores(q32, view, 0, every, groups, q_moved, moved, max_bytes)  # (nb, P, n_chunks)
    n_chunks = out.shape[2]

    def picks():  # what `ids` reads of `out` and which of them are valid: the candidates' alone
        _, _, valid = chunk_bounds(ids, chunk, n_sink, cand_end)
        if P == groups:  # a pair per group (KV-head groups, or one per head): no pairs to gather, no max over them
            return ids, ids.clamp(0, n_chunks - 1).long(), ~valid
        pair_group, _ = pair_index(P, Hkv, groups, dev)
        return ids, ids[:, pair_group].clamp(0, n_chunks - 1).long(), ~valid[:, pair_group]  # (nb, P, C)

    made = _made(shared, ("box_picks", chunk, n_sink, n_chunks, P), picks)
    if made[0] is not ids:  # kept for other candidates than these (never in one step's stage 0): made afresh
        made = picks()
    _, where, invalid = made
    s = torch.gather(out, 2, where).masked_fill(invalid, float("-inf"))
    return s if P == groups else s.reshape(nb, groups, P // groups, -1).amax(dim=2)


def pair_index(P: int, Hkv: int, groups: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(group, KV head) of each of the P (group, KV head) pairs of executor.head_pairs, built on the device from
    their pattern (a host-to-device copy may not run inside a CUDA graph capture): pair i reads KV head i // (P /
    H_kv); its group is i, or 0 when there is one group."""
    i = torch.arange(P, device=dev)
    return (i if groups == P else torch.zeros_like(i)), i // (P // Hkv)


def chunk_box_scores(qs: torch.Tensor, row_ok: torch.Tensor, keys: torch.Tensor | None, ids: torch.Tensor, chunk: int,
                     n_sink: int, cand_end: torch.Tensor, groups: int, kind: str, rope: RopeArgs | None = None,
                     boxes: "torch.Tensor | BoxView | None" = None, max_bytes: int = 256 << 20,
                     shared=None, stride: int = 1) -> torch.Tensor:
    """Scores (nb, G, C) of candidate chunks `ids` (nb, G, C) from their boxes, -inf if invalid; the arguments are
    prune_ref.chunk_scores_reference's (qs (nb, R, H_q, D), row_ok (nb, R), keys (L, H_kv, D) as stored, `stride`).
    `boxes`: the sequence's boxes kept by the engine (a `BoxView`, or a tensor in `key_boxes`' layout); None builds
    them from `keys`. `shared`: BlockQueries.shared of the blocks, where the layers of a step share what depends on
    the blocks, candidates and positions alone (the query rotation's angles, the candidates' validity), else None."""
    if kind not in BOX_KINDS:
        raise ValueError(f"box kind must be one of {', '.join(BOX_KINDS)}, got {kind!r}")
    if boxes is None:
        boxes = key_boxes(keys, 0, chunk, kind, rope)
    q32, q_moved, moved = box_queries(qs, row_ok, cand_end, rope, shared, stride)
    return score_boxes(q32, q_moved, moved, boxes, ids, chunk, n_sink, cand_end, groups, max_bytes, shared)


def _made(shared, key, make):
    return make() if shared is None else shared(key, make)
