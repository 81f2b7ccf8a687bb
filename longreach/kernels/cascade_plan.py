"""The cascading cache's packed stride plan (`BatchPlan`, built by attention/cascading/rings.py: `batch_plans`) and its
PyTorch execution: `execute_plan` resolves the challenges with one layer's importance and `apply_moves` moves the rows.
These ops are the reference of kernels/cascade_insert.py and the CPU path; attention/cascading/rings.py explains the rules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class BatchLevel:
    """A `LevelPlan` of every sequence of a batch, concatenated, with slots made flat (global cache slots) and indices
    shifted into the batch's offers and pool. Tensors on the cache's device (views into `BatchPlan.packed`)."""

    pidx: torch.Tensor
    cidx: torch.Tensor
    old_flat: torch.Tensor
    old_chal: torch.Tensor
    out_idx: torch.Tensor
    dst_flat: torch.Tensor
    src_idx: torch.Tensor


# the packed form's header: one row of PLAN_FIELDS int64 per level
#   [offers in, entries A, old tokens r, leaving k, writes w, then the offsets of pidx, cidx, old_flat, old_chal,
#    out_idx, src_idx, dst_flat in the packed buffer]
PLAN_FIELDS = 12


@dataclass
class BatchPlan:
    """The stride plans of a batch's sequences, level by level, in one device buffer (`packed`, int64: a header of
    `PLAN_FIELDS` per level, the offers, each level's arrays, then every level's destinations back to back), so the
    host sends a step's plan in one copy and a kernel (kernels/cascade_insert.py) can walk it. `offers`, `levels` and
    `dst` are views into it."""

    offers: torch.Tensor  # (m,) flat staging slots of the new tokens (level 0's offers)
    levels: list[BatchLevel]
    dst: torch.Tensor  # (w,) every written slot, level by level: the destinations `execute_plan` returns
    packed: torch.Tensor
    cur_cap: int  # most offers any level gets (scratch size of a kernel walking the plan)
    pool_cap: int  # most (old + entries) any level holds
    offers_at: int  # where the offers start in `packed` (after the header)
    dst_at: int  # where the destinations start in `packed` (the header's offsets of each level's are from 0)


def execute_plan(plan: BatchPlan, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Resolve a batched stride plan against one layer's importance `score` (num_slots, H) -> the moves: destination
    slots (w,) and the source slot per KV head (w, H). Every source is a slot as it was before the stride, so apply
    all reads before any write (`apply_moves`). PyTorch ops, a few per level: the reference of
    kernels/cascade_insert.py and the CPU path."""
    H = score.shape[1]
    cur = plan.offers[:, None].expand(-1, H)  # (m, H) the token each offer carries, per KV head
    srcs = [plan.offers.new_zeros(0, H)]

    def resolve(base: torch.Tensor, chal_ix: torch.Tensor) -> torch.Tensor:  # rule 4 where the challenger wins
        if base.shape[0] == 0:
            return base
        has = chal_ix >= 0
        chal = cur[chal_ix.clamp(min=0)]
        win = has[:, None] & (score.gather(0, chal) > score.gather(0, base))
        return torch.where(win, chal, base)

    for lv in plan.levels:
        if cur.shape[0] == 0:  # no offers here: this level and every later one write nothing
            break
        old = resolve(lv.old_flat[:, None].expand(-1, H), lv.old_chal)
        entries = resolve(cur[lv.pidx], lv.cidx)
        pool = torch.cat([old, entries])
        srcs.append(pool[lv.src_idx])
        cur = pool[lv.out_idx]
    return plan.dst, torch.cat(srcs)


def apply_moves(dst: torch.Tensor, src: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """tensors[i][dst[w], h] = tensors[i][src[w, h], h] for each tensor shaped (num_slots, H, ...); every read comes
    before every write."""
    if dst.shape[0] == 0:
        return
    heads = torch.arange(src.shape[1], device=src.device)
    for t in tensors:
        t[dst] = t[src, heads]
