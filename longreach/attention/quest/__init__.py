"""Quest (Tang et al., 2024): top pages by a min/max upper bound on q.k. config.py (QuestConfig, presets),
method.py (the selection: page bounds as minmax key boxes, kernels/key_boxes.py), backend.py (QuestBackend, which keeps
the boxes per KV page when a Quest page is one: attention/box_store.py)."""
from .backend import QuestBackend
from .config import DEFAULT_PRESET, PRESET_NOTES, PRESETS, QuestConfig
from .method import Quest

__all__ = ["DEFAULT_PRESET", "PRESETS", "PRESET_NOTES", "Quest", "QuestBackend", "QuestConfig"]
