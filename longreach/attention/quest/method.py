"""Quest: query-aware page selection by an upper bound on the attention score (Tang et al., 2024).

Each page of `page_size` keys keeps the element-wise min and max of its keys; for a query q the bound
sum_d max(q_d * min_d, q_d * max_d) >= q . k for every key of the page. A query block keeps the `budget / page_size`
pages with the highest bound (max over the block's queries and the heads of a selection group) among the pages
before the window. Quest's own recipe keeps the first two layers dense.

The page's min and max are kept as a `minmax` key box (kernels/key_boxes.py: centre c = (max + min) / 2, radius
r = (max - min) / 2), whose score q.c + |q|.r is the same bound in exact arithmetic (the store rounds c and r to the
run dtype). Where the boxes come from:
  * in the engine, with page_size == --block-size: kept per KV page by id, beside the page pool (attention/
    box_store.py: PageBoxes, as PSA keeps its block metadata), each step boxing only the pages its new keys touch
    (the partial last page again until it is complete); selection reads them through the sequence's block table;
  * otherwise (another page size, KV offloading's prefill on its staging area, tests, the recall tool): boxed from
    the sequence's keys at each call, as Quest's reference does.
Scoring, either way: key_boxes.py's score kernel on CUDA (no (blocks, heads, rows, pages) score tensor), its
PyTorch reference elsewhere; then top-k (kernels/topk.py).
"""
from __future__ import annotations

import torch

from ...kernels.chunk_box import chunk_boxes
from ...kernels.key_boxes import BoxView, box_scores
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

    def page_scores(self, q, blocks, keys) -> torch.Tensor:
        """Bounds (nb, G, pages) of every page of the sequence for each query block, -inf for pages that are not
        candidates (inside the sink, or starting at or past the block's window)."""
        cfg, P = self.cfg, self.cfg.page_size
        view = keys.chunk_boxes(P)  # the kept page boxes, else boxed from the keys
        if view is None:
            view = BoxView.of(chunk_boxes(keys.dense(), P, "minmax")[:, None])  # (pages, 1 flavour, 2, H_kv, D)
        qs, ok = self.query_rows(q, blocks)  # (nb, R, H_q, D) fp32
        qs = torch.where(ok[:, :, None, None], qs, qs[:, :1])  # rows past a block's length repeat its first
        if view.pool.dtype != torch.float32:
            qs = qs.to(view.pool.dtype)  # the run dtype: exact, and the kernel's dots multiply exactly
        # candidates: pages ending past the sink, starting before the block's window
        cand_end = self.candidate_end(blocks.ends).clamp(min=0)
        cand_hi = torch.div(cand_end + P - 1, P, rounding_mode="floor").to(torch.int32)
        per_pair = box_scores(qs, view, cfg.n_sink // P, cand_hi, self.groups)  # (nb, pairs, pages)
        nb, pairs, n_pages = per_pair.shape
        return per_pair.reshape(nb, self.groups, pairs // self.groups, n_pages).amax(dim=2)

    def _select(self, layer, q, blocks, keys, state, step):
        score = self.page_scores(q, blocks, keys)
        ids = torch.arange(score.shape[-1], device=q.device).expand(score.shape).clone()
        return self.keep_top(ids, score, self.cfg.budget // self.cfg.page_size)
