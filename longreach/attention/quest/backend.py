"""Quest's engine backend: the shared sparse backend with its method."""
from __future__ import annotations

from ..backend import Capabilities
from ..sparse.backend import SparseBackend
from .config import PRESET_NOTES
from .method import Quest


class QuestBackend(SparseBackend):
    """Quest: top pages by a min/max upper bound on q.k."""

    name = "quest"
    method_cls = Quest
    preset_notes = PRESET_NOTES
    # no graphs (its selection is the PyTorch reference, with host-sized shapes)
    capabilities = Capabilities(mixed_batches=True)
