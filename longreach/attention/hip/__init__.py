"""HiP (Lee et al., 2024): top-k key blocks by a hierarchical tree search. config.py (HiPConfig, presets),
method.py (the search), backend.py (HiPBackend: the shared sparse backend with it)."""
from .backend import HiPBackend
from .config import DEFAULT_PRESET, PRESET_NOTES, PRESETS, HiPConfig
from .method import HiP

__all__ = ["DEFAULT_PRESET", "PRESETS", "PRESET_NOTES", "HiP", "HiPBackend", "HiPConfig"]
