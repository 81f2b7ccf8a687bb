"""Quest's engine backend: the shared sparse backend with its method, plus the page boxes it keeps."""
from __future__ import annotations

import logging

from ..backend import Capabilities
from ..box_store import PageBoxes
from ..sparse.backend import SparseBackend
from .config import PRESET_NOTES
from .method import Quest

logger = logging.getLogger("longreach")


class QuestBackend(SparseBackend):
    """Quest: top pages by a min/max upper bound on q.k."""

    name = "quest"
    method_cls = Quest
    preset_notes = PRESET_NOTES
    # no graphs: its selection has host-sized shapes (the pages of each sequence's length)
    capabilities = Capabilities(mixed_batches=True)

    def make_boxes(self) -> PageBoxes | None:
        """The minmax box of every KV page, kept by page id (box_store.py) when a Quest page is one KV page, for the
        sequences longer than the shortest limit any sparse layer has; built in prefill and decode (with KV
        offloading from the first decode step: an offloaded prefill attends on its staging area). None for another
        page size: every call then boxes the pages from the keys."""
        mc, ec = self.model_config, self.engine_config
        if self.config.page_size != ec.block_size:
            logger.warning("quest: page_size %d is not --block-size %d, so no page boxes are kept: each selection "
                           "boxes every page from the sequence's keys (set page_size to the block size to keep them)",
                           self.config.page_size, ec.block_size)
            return None
        min_len = self.shortest_dense_below()
        return PageBoxes("quest", self.fallback.sparse_layers(), mc.num_kv_heads, mc.head_dim, ec.block_size, "minmax",
                         partial=True, prefill=not ec.offload, max_seqs=ec.max_num_seqs, device=self.device,
                         min_len=min_len)
