"""MInference 1.0 (Jiang et al., 2024): dynamic sparse prefill with one of three patterns per head; dense decode.

  config.py    MInferenceConfig, its presets, the pattern files (which one: resolve_patterns; format: load_patterns)
  method.py    the pattern table and the online index per layer (no engine state); the decisions on the paper's gaps
  index.py     the online index building (Λ-shape, vertical-slash, block-sparse), pure functions over tensors
  search.py    the offline pattern search of `longreach calibrate`
  backend.py   MInferenceBackend: sparse prefill (kernels/vertical_slash.py on CUDA), dense decode
  patterns/    calibrated pattern files shipped per model alias (package data)
"""
from .backend import MInferenceBackend
from .config import (
    DEFAULT_PRESET,
    PATTERNS_FORMAT,
    PRESET_NOTES,
    PRESETS,
    MInferenceConfig,
    load_patterns,
    resolve_patterns,
    shipped_patterns,
)
from .method import MInference, index_cost

__all__ = ["DEFAULT_PRESET", "PATTERNS_FORMAT", "PRESETS", "PRESET_NOTES", "MInference", "MInferenceBackend",
           "MInferenceConfig", "index_cost", "load_patterns", "resolve_patterns", "shipped_patterns"]
