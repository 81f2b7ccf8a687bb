"""InfiniteHiP's engine backend: the shared sparse backend with its method, plus the stage-0 boxes it keeps."""
from __future__ import annotations

from ..backend import Capabilities, GraphSupport
from ..sparse.backend import SparseBackend
from .boxes import BoxPool
from .config import PRESET_NOTES
from .method import InfiniteHiP


class InfiniteHiPBackend(SparseBackend):
    """InfiniteHiP: multi-stage context pruning + block-sparse attention, per-stage mask caching in decode."""

    name = "infinitehip"
    method_cls = InfiniteHiP
    preset_notes = PRESET_NOTES
    capabilities = Capabilities(graph=GraphSupport.VARIANTS, mixed_batches=True)

    def make_boxes(self) -> BoxPool | None:
        """A box-scored stage 0's boxes (boxes.py), kept for the sequences longer than the shortest limit any
        sparse layer has (a shorter one attends densely everywhere); None with SelectRep or exact scoring."""
        spec = self.method.box_spec()
        if spec is None:
            return None
        mc, ec = self.model_config, self.engine_config
        min_len = self.shortest_dense_below()
        return BoxPool(self.fallback.sparse_layers(), *spec, mc.num_kv_heads, mc.head_dim, min_len, ec.max_num_seqs,
                       ec.max_model_len, self.device, partial=self.method.cfg.n_window < spec[0])
