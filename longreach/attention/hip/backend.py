"""HiP's engine backend: the shared sparse backend with its method."""
from __future__ import annotations

from ..backend import Capabilities, GraphSupport
from ..sparse.backend import SparseBackend
from .config import PRESET_NOTES
from .method import HiP


class HiPBackend(SparseBackend):
    """HiP: hierarchical top-k over key blocks, first layers dense."""

    name = "hip"
    method_cls = HiP
    preset_notes = PRESET_NOTES
    capabilities = Capabilities(graph=GraphSupport.VARIANTS, mixed_batches=True)
