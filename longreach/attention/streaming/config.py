"""StreamingLLM's config and presets (the method: method.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..sparse.config import SparseConfig


@dataclass(frozen=True)
class StreamingConfig(SparseConfig):
    n_window: int = 3072
    attend_rope: str = "st"  # StreamingLLM numbers the cached keys by slot: sink, then the window, query last


PRESETS = {"3k": StreamingConfig(n_sink=256, n_window=3072), "5k": StreamingConfig(n_sink=256, n_window=5120)}
DEFAULT_PRESET = "3k"

PRESET_NOTES = {  # preset -> what it is for (`longreach backends`)
    "3k": "256 sink tokens + a 3,072-token window (default)",
    "5k": "256 sink tokens + a 5,120-token window",
}
