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

The boxes live in a `ChunkBoxIndex`: complete chunks are boxed once, from their keys alone, and the index grows as
the sequence does; the partial last chunk is boxed again on every call. The engine keeps the index per (sequence,
layer) across prefill chunks and decode steps (SequenceKeys.indexes), so a call reads only the keys that arrived
since the last one, not the whole context (which, with KV offload, sits in host memory). Memory: two fp32
vectors per chunk and KV head, 1/16 of the keys' bf16 size at 64-token chunks per flavour (true / moved positions).
This is plain PyTorch on GPU tensors (scoring is einsum); no Triton kernel yet, and decode stays eager.
"""
from __future__ import annotations

import torch

from ..rope.strategies import RopeArgs
from .block_meta import block_metadata_reference
from .prune_stage import chunk_bounds, moved_keys, prune_queries


def chunk_boxes(keys: torch.Tensor, chunk: int, kind: str) -> torch.Tensor:
    """keys (L, H_kv, D) -> boxes (ceil(L / chunk), 2, H_kv, D) fp32: centre and radius of each chunk's keys. The
    last chunk, when partial, is padded with copies of the last key (no change to its min and max)."""
    L = keys.shape[0]
    n = -(-L // chunk)
    k = keys.float()
    if n * chunk > L:
        k = torch.cat([k, k[-1:].expand(n * chunk - L, *k.shape[1:])])
    return block_metadata_reference(k.reshape(n, chunk, *k.shape[1:]), kind)


class ChunkBoxIndex:
    """Boxes of one sequence's key chunks in one layer: as stored (true positions) and moved to the pruning positions
    (`moved`: a strategy whose key positions depend on the key alone, rt/il/de), each extended as the sequence grows.

    Valid while the keys of complete chunks do not change: prefill chunks and decode append keys; a prefill from
    position 0 (also after a preemption) starts a fresh index. A call with fewer keys than indexed starts over.
    """

    def __init__(self, chunk: int, kind: str):
        self.chunk, self.kind = chunk, kind
        self._full: dict = {}  # flavour (None, or (mode, group)) -> (complete chunks, 2, H_kv, D) fp32

    def boxes(self, read, length: int, mode: str | None = None, rope: RopeArgs | None = None) -> torch.Tensor:
        """(ceil(length / chunk), 2, H_kv, D) fp32 boxes of keys [0, length): stored keys (mode None) or moved by
        `mode`. read(a, b) -> keys [a, b) (b - a, H_kv, D) as stored; only keys not yet in a complete box are read."""
        flavour = None if mode is None else (mode, rope.group)
        done = self._full.get(flavour)
        n_done = 0 if done is None else done.shape[0]
        n_full = length // self.chunk
        if n_done > n_full:  # fewer keys than indexed: not the sequence this index was built on
            done, n_done = None, 0
        if n_full > n_done:
            new = self._box(read, n_done * self.chunk, n_full * self.chunk, mode, rope)
            done = new if done is None else torch.cat([done, new])
            self._full[flavour] = done
        if n_full * self.chunk == length:
            return done
        tail = self._box(read, n_full * self.chunk, length, mode, rope)
        return tail if done is None else torch.cat([done, tail])

    def _box(self, read, a: int, b: int, mode: str | None, rope: RopeArgs | None) -> torch.Tensor:
        k = read(a, b).float()
        if mode is not None:  # at the exactly scored (right-branch) position
            k = moved_keys(k, a, mode, True, rope)
        return chunk_boxes(k, self.chunk, self.kind)


def chunk_box_scores(qs: torch.Tensor, row_ok: torch.Tensor, keys, ids: torch.Tensor, chunk: int,
                     n_sink: int, cand_end: torch.Tensor, groups: int, kind: str, rope: RopeArgs | None = None,
                     index: ChunkBoxIndex | None = None, max_bytes: int = 256 << 20) -> torch.Tensor:
    """Scores (nb, G, C) of candidate chunks `ids` (nb, G, C) from their boxes, -inf if invalid; the arguments are
    prune_stage.chunk_scores_reference's (qs (nb, R, H_q, D), row_ok (nb, R)), with `keys` the sequence's keys as
    stored: a tensor (L, H_kv, D), or (length, read) with read(a, b) -> keys [a, b). `index`: boxes kept from
    earlier calls over the same keys (a fresh one when None)."""
    from ..attention.executor import head_pairs

    if isinstance(keys, torch.Tensor):
        L, read = keys.shape[0], (lambda a, b, k=keys: k[a:b])
    else:
        L, read = keys
    index = index if index is not None else ChunkBoxIndex(chunk, kind)
    nb, R, Hq, D = qs.shape
    dev = qs.device
    mode = None if rope is None or rope.mode != "ci" else "rt"
    q32, mode, remap = prune_queries(qs, row_ok, cand_end, rope, mode)
    moved_all = remap[:, 0, 0] if remap is not None else torch.zeros(nb, dtype=torch.bool, device=dev)
    flavours = [m for m in (False, True) if bool((moved_all == m).any())]  # only the boxes some block reads
    boxes = {m: index.boxes(read, L, mode if m else None, rope) for m in flavours}
    n_chunks, _, Hkv = boxes[flavours[0]].shape[:3]
    pairs, hpp = head_pairs(Hq, Hkv, groups)
    P = len(pairs)
    pair_group = torch.tensor([g for g, _ in pairs], device=dev)
    pair_kv = torch.tensor([kv for _, kv in pairs], device=dev)
    q32 = q32.reshape(nb, R, P, hpp, D)
    per_block = R * Hq * n_chunks * 4 * 3
    step = max(1, max_bytes // max(1, per_block))
    out = torch.empty(nb, P, n_chunks, device=dev)
    for lo in range(0, nb, step):
        hi = min(nb, lo + step)
        u = q32[lo:hi]  # (n, R, P, hpp, D)
        moved = moved_all[lo:hi]
        best = torch.full((hi - lo, P, n_chunks), float("-inf"), device=dev)
        for m in flavours:
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
