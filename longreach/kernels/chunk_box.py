"""Chunk scores from a box around each chunk's keys: a first pruning stage that does not search inside the chunks.

The retrieval ladder (docs/quality.md) found where InfiniteHiP loses a needle past the trained length: stage 0's
SelectRep, whose binary search follows first-key representatives and misses an isolated high-scoring key in a
256-token chunk. Scoring every key exactly (`infinitehip:3k-exact`) finds it, at a cost that grows with the square of
the context. A box keeps one summary per chunk instead: per KV head, a centre c and a radius r of the chunk's keys
(kernels/block_meta.py, PSA's metadata: `minmax` is Quest's box, c = (max + min) / 2, r = (max - min) / 2, whose score
q.c + |q|.r is an upper bound of q.k over the chunk; `cuboid-mean` shrinks r to the keys' mean distance from c, an
estimate). A chunk's score is the max over the group's heads and the block's rows of q.c + |q|.r.

Positions: the box is taken over the keys *as the pruning strategy places them*, so a bound at relative positions
(rt) bounds the exact scores at those positions: for rt, il and de the moved keys depend on the key alone
(prune_stage.moved_key_tables, the right-branch table: what an exactly scored key gets); blocks inside the trained
length use the stored keys (true positions). Chunk-indexed positions (ci) depend on the block's candidate list, which
a box per chunk cannot follow: the box scorer uses rt in its place (decision; on SmolLM2 rt in layers 0-2 changed
passkey by at most one prompt in 20 per cell, docs/quality.md).
Edges: a box covers the whole chunk [j*chunk, (j+1)*chunk), also keys before n_sink or at or past the block's
candidate end (the first and last candidate chunks). The bound then covers a superset: still a bound, looser there.

This is plain PyTorch (it runs on GPU tensors as torch ops, with the boxes of every chunk built per layer and step
from the gathered keys); no Triton kernel and no resident index yet. It is for measuring whether a box scorer keeps
what the exact one keeps (`stage0_scores` in attention/infinitehip.py) before building either.
"""
from __future__ import annotations

import torch

from ..rope.strategies import RopeArgs
from .block_meta import block_metadata_reference
from .prune_stage import chunk_bounds, moved_key_tables, prune_queries


def chunk_boxes(keys: torch.Tensor, chunk: int, kind: str) -> torch.Tensor:
    """keys (L, H_kv, D) -> boxes (ceil(L / chunk), 2, H_kv, D) fp32: centre and radius of each chunk's keys. The
    last chunk, when partial, is padded with copies of the last key (no change to its min and max)."""
    L = keys.shape[0]
    n = -(-L // chunk)
    k = keys.float()
    if n * chunk > L:
        k = torch.cat([k, k[-1:].expand(n * chunk - L, *k.shape[1:])])
    return block_metadata_reference(k.reshape(n, chunk, *k.shape[1:]), kind)


def chunk_box_scores(qs: torch.Tensor, row_ok: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor, chunk: int,
                     n_sink: int, cand_end: torch.Tensor, groups: int, kind: str, rope: RopeArgs | None = None,
                     table_cache: dict | None = None, max_bytes: int = 256 << 20) -> torch.Tensor:
    """Scores (nb, G, C) of candidate chunks `ids` (nb, G, C) from their boxes, -inf if invalid; the arguments are
    prune_stage.chunk_scores_reference's (qs (nb, R, H_q, D), row_ok (nb, R), keys (L, H_kv, D) as stored)."""
    from ..attention.executor import head_pairs

    nb, R, Hq, D = qs.shape
    dev = qs.device
    L, Hkv = keys.shape[:2]
    pairs, hpp = head_pairs(Hq, Hkv, groups)
    P = len(pairs)
    pair_group = torch.tensor([g for g, _ in pairs], device=dev)
    pair_kv = torch.tensor([kv for _, kv in pairs], device=dev)
    mode = None if rope is None or rope.mode != "ci" else "rt"
    q32, mode, remap = prune_queries(qs, row_ok, cand_end, rope, mode)
    q32 = q32.reshape(nb, R, P, hpp, D)
    kf = keys.float()
    cache_key = ("box", kind, chunk, mode, L)
    if table_cache is not None and cache_key in table_cache:
        boxes = table_cache[cache_key]
    else:
        boxes = {False: chunk_boxes(kf, chunk, kind)}
        if mode != "none":
            boxes[True] = chunk_boxes(moved_key_tables(kf, mode, rope, table_cache)[True][L:], chunk, kind)
        if table_cache is not None:
            table_cache[cache_key] = boxes
    n_chunks = boxes[False].shape[0]
    per_block = R * Hq * n_chunks * 4 * 3
    step = max(1, max_bytes // max(1, per_block))
    out = torch.empty(nb, P, n_chunks, device=dev)
    for lo in range(0, nb, step):
        hi = min(nb, lo + step)
        u = q32[lo:hi]  # (n, R, P, hpp, D)
        moved = remap[lo:hi, 0, 0] if remap is not None else torch.zeros(hi - lo, dtype=torch.bool, device=dev)
        best = torch.full((hi - lo, P, n_chunks), float("-inf"), device=dev)
        for m in ((False, True) if remap is not None else (False,)):
            sel = moved == m
            if not bool(sel.any()):
                continue
            c, r = boxes[m][:, 0][:, pair_kv], boxes[m][:, 1][:, pair_kv]  # (n_chunks, P, D)
            s = torch.einsum("nrphd,cpd->nphrc", u[sel], c) + torch.einsum("nrphd,cpd->nphrc", u[sel].abs(), r)
            best[sel] = s.amax(dim=(2, 3))
        out[lo:hi] = best
    _, _, valid = chunk_bounds(ids, chunk, n_sink, cand_end)
    ids_p, valid_p = ids[:, pair_group], valid[:, pair_group]  # (nb, P, C)
    s = torch.gather(out, 2, ids_p.clamp(0, n_chunks - 1).long()).masked_fill(~valid_p, float("-inf"))
    return s.reshape(nb, groups, P // groups, -1).amax(dim=2)
