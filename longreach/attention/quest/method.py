"""Quest: query-aware page selection by an upper bound on the attention score (Tang et al., 2024).

Each page of `page_size` keys keeps the element-wise min and max of its keys; for a query q the bound
sum_d max(q_d * min_d, q_d * max_d) >= q . k for every key of the page. A query block keeps the `budget / page_size`
pages with the highest bound (max over the block's queries and the heads of a selection group) among the pages
before the window. Quest's own recipe keeps the first two layers dense. The reference computes page bounds from the
cached keys at each call; a kernel implementation would maintain them as pages fill.
"""
from __future__ import annotations

import torch

from ..sparse.selection import SelectionMethod
from .config import DEFAULT_PRESET, PRESETS, QuestConfig


class Quest(SelectionMethod):
    name = "quest"
    config_cls = QuestConfig
    presets = PRESETS
    default_preset = DEFAULT_PRESET

    @property
    def block_k(self) -> int:
        return self.cfg.page_size

    def selected_budget(self, layer: int) -> int:
        return self.cfg.budget

    def _select(self, layer, q, blocks, keys, state, step):
        cfg, P = self.cfg, self.cfg.page_size
        keys = keys.dense()  # reference only: page bounds from all keys
        L = keys.shape[0]
        n_pages = -(-L // P)
        padded = torch.cat([keys.float(), keys[-1:].float().expand(n_pages * P - L, *keys.shape[1:])])
        pages = padded.reshape(n_pages, P, *keys.shape[1:])  # (pages, P, H_kv, D); padding repeats a real key
        kmin = pages.amin(dim=1)[:, self.kv_of_head].transpose(0, 1)  # (H_q, pages, D)
        kmax = pages.amax(dim=1)[:, self.kv_of_head].transpose(0, 1)
        qs, ok = self.query_rows(q, blocks)  # (nb, R, H_q, D)
        # upper bound = q+ . max + q- . min, then max over the block's rows
        bound = torch.einsum("nrhd,hpd->nhrp", qs.clamp(min=0), kmax) + torch.einsum("nrhd,hpd->nhrp", qs.clamp(max=0), kmin)
        bound = bound.masked_fill(~ok[:, None, :, None], float("-inf")).amax(dim=2)  # (nb, H_q, pages)
        score = self.group_max(bound)  # (nb, G, pages)
        ids = torch.arange(n_pages, device=q.device)
        cand_end = self.candidate_end(blocks.ends)  # (nb,)
        usable = ((ids + 1) * P > cfg.n_sink)[None, :] & (ids[None, :] * P < cand_end[:, None])  # page meets range
        score = score.masked_fill(~usable[:, None, :], float("-inf"))
        return self.keep_top(ids.expand(score.shape).clone(), score, cfg.budget // P)
