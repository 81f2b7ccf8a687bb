"""Quest's config and presets (the method: method.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..sparse.config import SparseConfig


@dataclass(frozen=True)
class QuestConfig(SparseConfig):
    page_size: int = 16  # tokens per page; the engine keeps page boxes when it equals --block-size (backend.py)
    budget: int = 2048  # selected tokens per query block (beyond sink and window)
    dense_layers: tuple[int, ...] = (0, 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_size < 1 or self.budget < 0 or self.budget % self.page_size:
            raise ValueError(f"budget ({self.budget}) must be a non-negative multiple of page_size ({self.page_size})")


PRESETS = {"3k": QuestConfig(budget=2048), "5k": QuestConfig(budget=4096)}
DEFAULT_PRESET = "3k"

PRESET_NOTES = {  # preset -> what it is for (`longreach backends`)
    "3k": "2,048 keys per query block in 16-token pages, beside the sink and window (default)",
    "5k": "4,096 keys per query block: retrieves more, reads more",
}
