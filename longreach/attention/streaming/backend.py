"""StreamingLLM's engine backend: the shared sparse backend with its method."""
from __future__ import annotations

from ..backend import Capabilities, GraphSupport
from ..sparse.backend import SparseBackend
from .config import PRESET_NOTES
from .method import Streaming


class StreamingBackend(SparseBackend):
    """StreamingLLM: sink + sliding window, no selection."""

    name = "streaming"
    method_cls = Streaming
    preset_notes = PRESET_NOTES
    capabilities = Capabilities(graph=GraphSupport.VARIANTS, mixed_batches=True)
