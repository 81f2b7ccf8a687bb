"""HiP: hierarchically pruned attention, top-k keys by a tree search over key blocks (Lee et al., 2024).

Per query block (b_q queries) and selection group, with key blocks of b_k tokens over the selectable range
[n_sink, end of the block - n_window):
  1. split the range into K = budget / b_k equal branches (if it has <= K blocks, keep them all);
  2. split every branch at its midpoint; score each half by its *centre* key block: the max of q . k over the block's
     queries, the b_k keys of that key block and the heads of the group;
  3. keep the K best halves; repeat until every branch is one key block (about log2(range / K) rounds).
Defaults from the paper: b_q = 32, b_k = 2, the first l_d = 3 layers dense; the budget (512/1K/2K in its tables) and
the sink/window sizes are not given there: longreach uses 2048 selected + 256 sink + 1024 window, the same token
budget as infinitehip 3k, so the two compare at equal cost. During decode the selection is reused for
`refresh` steps (HiP's n_r).
Settled ambiguity (digest §8.7): the representative is the centre block of each branch, as in HiP's method section.
"""
from __future__ import annotations

import torch

from ..sparse.selection import SelectionMethod, use_kernels
from .config import DEFAULT_PRESET, PRESETS, HiPConfig


class HiP(SelectionMethod):
    name = "hip"
    config_cls = HiPConfig
    presets = PRESETS
    default_preset = DEFAULT_PRESET

    @property
    def block_k(self) -> int:
        return self.cfg.block_k

    def selected_budget(self, layer: int) -> int:
        return self.cfg.budget

    def _select(self, layer, q, blocks, keys, state, step):
        if state is not None and "blocks" in state and step % self.cfg.refresh != 0:
            return state["blocks"]
        cfg = self.cfg
        per_block = 0 if use_kernels(q) else self.num_heads * (2 * cfg.budget // cfg.block_k) * cfg.block_k * q.shape[-1] * 12
        out = torch.cat([self._search(layer, q, blocks[sl], keys) for sl in self.slices(blocks.num_blocks, per_block)])
        if state is not None:
            state["blocks"] = out
        return out

    def graph_stage_widths(self, layer: int) -> tuple[int, ...]:
        return (self.cfg.budget // self.cfg.block_k,)  # one "stage": the selection, reused for `refresh` steps

    def refresh_from(self, step: int) -> int:
        return 0 if step % self.cfg.refresh == 0 else 1

    def graph_select(self, layer, q, blocks, keys, cached, row_first, level, out=None):
        if level > 0:
            return []
        fresh = self._search(layer, q, blocks, keys)
        return [torch.where((row_first > 0)[:, None, None], cached[0], fresh)]

    def _search(self, layer, q, blocks, keys) -> torch.Tensor:
        cfg, bk = self.cfg, self.cfg.block_k
        K = cfg.budget // bk
        dev = q.device
        nb, G = blocks.num_blocks, self.groups
        cand_end = self.candidate_end(blocks.ends)
        lo = torch.full((nb,), -(-cfg.n_sink // bk), device=dev)  # first key block wholly past the sink
        hi = torch.div(cand_end, bk, rounding_mode="floor")  # blocks wholly before the window
        span = (hi - lo).clamp(min=0)
        # initial branches: K equal pieces of [lo, hi) per block; empty pieces when the range is short
        j = torch.arange(K + 1, device=dev)
        edges = lo[:, None] + torch.div(span[:, None] * j[None, :], K, rounding_mode="floor")  # (nb, K+1)
        start = edges[:, :-1, None].expand(nb, K, G).transpose(1, 2).contiguous()  # (nb, G, K)
        stop = edges[:, 1:, None].expand(nb, K, G).transpose(1, 2).contiguous()
        # halvings until every branch is one key block, from the host-side bound on the range (no device sync)
        widest = -(-max(0, (blocks.max_end - cfg.n_window) // bk - -(-cfg.n_sink // bk)) // K)
        for _ in range(max(0, (widest - 1).bit_length())):
            mid = torch.div(start + stop, 2, rounding_mode="floor")
            starts = torch.cat([start, mid], dim=-1)  # (nb, G, 2K): left halves then right halves
            stops = torch.cat([mid, stop], dim=-1)
            nonempty = stops > starts
            centre = torch.div(starts + stops - 1, 2, rounding_mode="floor").clamp(min=0)
            score = self.chunk_scores(layer, q, blocks, keys, centre, bk, True, cand_end)  # the centre block's best key
            score = score.masked_fill(~nonempty, float("-inf"))
            top = score.topk(min(K, score.shape[-1]), dim=-1).indices
            start, stop = starts.gather(-1, top), stops.gather(-1, top)
            # halves that were empty come back as empty branches; they are dropped at the end
        big = torch.iinfo(start.dtype).max
        chosen = torch.where(stop > start, start, big).sort(dim=-1).values  # branches come back in score order
        return torch.where(chosen == big, -1, chosen).to(torch.int32)
