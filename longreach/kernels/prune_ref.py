"""Chunk scoring for context pruning, the PyTorch reference of kernels/prune_stage.py (whose docstring has the
algorithm: SelectRep or exact scoring of candidate chunks, with a pruning RoPE strategy), and the helpers the box
scorer and the stage bookkeeping share with it: each chunk's valid part, the block queries and the keys as a strategy
places them."""
from __future__ import annotations

import math

import torch

from ..rope.strategies import RopeArgs, block_row_positions, prune_key_pos, prune_query_pos, rotate
from .index_types import head_pairs


def chunk_bounds(ids: torch.Tensor, chunk: int, n_sink: int, cand_end: torch.Tensor):
    """Valid part [a, b) of each chunk and whether it is non-empty; ids (nb, G, C), cand_end (nb,)."""
    a = torch.clamp(ids * chunk, min=n_sink)
    b = torch.minimum((ids + 1) * chunk, cand_end[:, None, None])
    return a, b, (ids >= 0) & (a < b)


def prune_queries(qs: torch.Tensor, row_ok: torch.Tensor, cand_end: torch.Tensor, rope: RopeArgs | None,
                  mode: str | None = None, stride: int = 1):
    """The block queries as a pruning strategy places them: (q32 (nb, R, H_q, D) fp32, mode, remap (nb, 1, 1) or
    None). Blocks ending at or past rope.rope_from are moved (`mode`, default rope.mode), the others keep their true
    positions; mode is "none" when no block is moved. Rows past a block's length repeat its first row (every block
    has one): a max over rows is then the max over its real rows, with no mask to apply to every score. `stride`:
    the rows are every stride-th of the block's, counted back from its last (`block_row_positions`)."""
    nb, R = row_ok.shape
    q32 = qs.float()
    mode = (rope.mode if mode is None else mode) if rope is not None else "none"
    remap = None
    if mode != "none" and not bool((cand_end + rope.n_window - 1 >= rope.rope_from).any()):
        mode = "none"  # no block is remapped: skip the rotations (the CPU path's cost at or below the trained length)
    if mode != "none":
        end = cand_end + rope.n_window
        remap = (end - 1 >= rope.rope_from)[:, None, None]  # (nb, 1, 1)
        p = block_row_positions(end, row_ok, stride)  # (nb, R)
        dq = torch.where(remap[:, :, 0], prune_query_pos(mode, p, rope.n_window, rope.group) - p, 0)
        q32 = rotate(q32, dq[:, :, None], rope.inv_freq)
    return torch.where(row_ok[:, :, None, None], q32, q32[:, :1]), mode, remap


def moved_keys(kf: torch.Tensor, first: int, mode: str, right: bool, rope: RopeArgs) -> torch.Tensor:
    """Keys [first, first + len(kf)) (rotated at their true positions) moved to their pruning positions as a
    left-branch (False) or right-branch / exactly scored (True) probe: a strategy whose key positions depend on the
    key alone (rt, il, de)."""
    p = torch.arange(first, first + kf.shape[0], device=kf.device)
    return rotate(kf, prune_key_pos(mode, p, right, None, rope.group)[:, None] - p[:, None], rope.inv_freq)


def moved_key_tables(kf: torch.Tensor, mode: str, rope: RopeArgs, table_cache: dict | None) -> dict:
    """{right: (2L, H_kv, D)}: rows [0, L) the keys as stored, rows [L, 2L) moved to their pruning positions as a
    left-branch (False) or right-branch / exactly scored (True) probe, for a strategy whose key positions depend on
    the key alone (rt, il, de). Kept in `table_cache` (one layer of one step) when given."""
    L = kf.shape[0]
    key = (mode, rope.group, L)
    if table_cache is not None and key in table_cache:
        return table_cache[key]
    tables = {right: torch.cat([kf, moved_keys(kf, 0, mode, right, rope)])  # rows L.. hold the moved keys
              for right in (False, True)}
    if table_cache is not None:
        table_cache[key] = tables
    return tables


def chunk_scores_reference(qs: torch.Tensor, row_ok: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor,
                           chunk: int, exact: bool, n_sink: int, cand_end: torch.Tensor, groups: int,
                           rep_per_head: bool = True, rope: RopeArgs | None = None,
                           table_cache: dict | None = None, sub: int | None = None,
                           stride: int = 1) -> torch.Tensor:
    """qs (nb, R, H_q, D) block queries, row_ok (nb, R), keys (L, H_kv, D) -> scores (nb, G, C), -inf if invalid.

    SelectRep runs per query head (`rep_per_head`, the paper) or once per KV head of the group, its halves compared
    by the max over the heads that read that KV head (shared branches: one key read per probe for all of them).
    `rope`: a pruning strategy (rope/strategies.py) applied to blocks ending at or past rope.rope_from; a block's
    rows are the last rows before its end, cand_end + rope.n_window.
    `table_cache`: a dict kept by the caller for as long as `keys` is unchanged (one layer of one step): the keys
    moved by a strategy that depends on the key alone (rt, il, de) are computed once into it instead of per call.
    `sub` (exact only, dividing `chunk`): a score per run of `sub` keys, (nb, G, C * chunk // sub), run r of chunk c
    at c * chunk // sub + r. `stride`: qs holds every stride-th row of each block, counted back from its last
    (`block_row_positions`; where a strategy moves them, their true positions are needed).
    """
    nb, R, Hq, _ = qs.shape
    dev = qs.device
    L, Hkv = keys.shape[:2]
    pairs, hpp = head_pairs(Hq, Hkv, groups)
    P = len(pairs)
    pair_group = torch.tensor([g for g, _ in pairs], device=dev)
    pair_kv = torch.tensor([kv for _, kv in pairs], device=dev)
    a, b, valid = chunk_bounds(ids, chunk, n_sink, cand_end)
    a, b, valid = a[:, pair_group], b[:, pair_group], valid[:, pair_group]  # (nb, P, C)
    q32, mode, remap = prune_queries(qs, row_ok, cand_end, rope, stride=stride)
    if mode != "none":
        n_chunk = (ids >= 0).sum(-1, keepdim=True)[:, pair_group]  # (nb, P, 1)
        from_end = torch.arange(ids.shape[-1], device=dev) - (n_chunk - 1)  # (nb, P, C)
    q32 = q32.reshape(nb, R, P, hpp, -1).permute(0, 2, 3, 1, 4).contiguous()  # (nb, P, hpp, R, D)
    kf = keys.float()
    kvs = pair_kv[None, :, None]
    # strategies whose key positions depend only on the key: every key moved once, probes just gather
    tables = moved_key_tables(kf, mode, rope, table_cache) if mode in ("rt", "il", "de") else {}

    def probe(pos, right=True):  # per head of each pair, max over rows of <q, k[pos]>; pos (nb, P, C) or (nb, P, hpp, C)
        per_head = pos.dim() == 4
        kv_idx = kvs[..., None] if per_head else kvs
        if tables:
            k = tables[right][pos.clamp(0, L - 1) + L * (remap[..., None] if per_head else remap), kv_idx]
        else:
            k = kf[pos.clamp(0, L - 1), kv_idx]  # (nb, P, [hpp,] C, D)
        if mode == "ci":  # positions depend on the block's candidate list: move the probed keys
            fe = from_end[:, :, None] if per_head else from_end
            new = prune_key_pos(mode, pos, right, fe, rope.group)
            k = rotate(k, torch.where(remap[..., None] if per_head else remap, new - pos, 0), rope.inv_freq)
        eq = "npird,npicd->npirc" if per_head else "npird,npcd->npirc"
        return torch.einsum(eq, q32, k).amax(3)  # (nb, P, hpp, R, C) -> (nb, P, hpp, C)

    sub = chunk if sub is None else sub
    if sub != chunk and (not exact or chunk % sub):
        raise ValueError(f"scores per run of keys need exact scoring and a run dividing the chunk {chunk}, got {sub}")
    if exact:  # each key of the chunk from its start, masked to the valid part [a, b); the best of each run
        start = ids[:, pair_group] * chunk
        runs = []
        for r0 in range(0, chunk, sub):
            s = torch.full(a.shape, float("-inf"), device=dev)
            for j in range(r0, r0 + sub):
                pos = start + j
                sj = probe(pos).amax(2)
                s = torch.maximum(s, sj.masked_fill((pos < a) | (pos >= b), float("-inf")))
            runs.append(s)
        s = torch.stack(runs, -1)  # (nb, P, C, R)
        s = s.masked_fill(~valid[..., None], float("-inf")).reshape(*a.shape[:2], -1)
    elif rep_per_head:
        first, last = a[:, :, None].expand(-1, -1, hpp, -1).clone(), (b - 1)[:, :, None].expand(-1, -1, hpp, -1).clone()
        s = probe(first, right=False)
        for _ in range(math.ceil(math.log2(chunk))):
            length = last - first + 1
            active = length > 1
            mid = first + length // 2
            s_mid = probe(mid)
            right = active & (s_mid > s)
            first = torch.where(right, mid, first)
            last = torch.where(active & ~right, mid - 1, last)
            s = torch.where(right, s_mid, s)
        s = s.amax(2)
    else:
        first, last = a.clone(), b - 1
        s = probe(first, right=False).amax(2)
        for _ in range(math.ceil(math.log2(chunk))):
            length = last - first + 1
            active = length > 1
            mid = first + length // 2
            s_mid = probe(mid).amax(2)
            right = active & (s_mid > s)
            first = torch.where(right, mid, first)
            last = torch.where(active & ~right, mid - 1, last)
            s = torch.where(right, s_mid, s)
    if not exact:
        s = s.masked_fill(~valid, float("-inf"))  # (nb, P, C)
    return s.reshape(nb, groups, P // groups, -1).amax(dim=2)
