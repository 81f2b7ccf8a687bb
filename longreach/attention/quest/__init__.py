"""Quest (Tang et al., 2024): top pages by a min/max upper bound on q.k. config.py (QuestConfig, presets),
method.py (the selection, PyTorch: page bounds from the keys at each call), backend.py (QuestBackend)."""
from .backend import QuestBackend
from .config import DEFAULT_PRESET, PRESET_NOTES, PRESETS, QuestConfig
from .method import Quest

__all__ = ["DEFAULT_PRESET", "PRESETS", "PRESET_NOTES", "Quest", "QuestBackend", "QuestConfig"]
