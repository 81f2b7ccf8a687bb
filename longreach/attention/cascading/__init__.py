"""Cascading KV cache (Willette, Lee, Lee, Jeon, Hwang 2024): a bounded cache per sequence (sink + sub-caches with an
exponential acceptance schedule and importance-based eviction) with strided batched prefill.

  config.py   CascadingConfig, its presets, CascadeLayout (where a sequence's tokens live among its own KV slots)
  rings.py    the eviction rules: ReferenceCascade (the oracle), CascadeRings (one sequence's ring structure) and
              its stride plans, packed per batch (its kernels: kernels/cascade_plan.py, cascade_insert.py)
  plan.py     the per-step plan every layer shares (strides, virtual sequences, attention indexes, insertion)
  attend.py   how a stride attends: RoPE tables that undo the model's, the gathered FlashAttention prefill
  backend.py  CascadingBackend (the design at length, in its docstring)
"""
from .backend import CascadingBackend
from .config import DEFAULT_PRESET, PRESET_NOTES, PRESETS, CascadeLayout, CascadingConfig
from .plan import ema_weights

__all__ = ["DEFAULT_PRESET", "PRESETS", "PRESET_NOTES", "CascadeLayout", "CascadingBackend", "CascadingConfig",
           "ema_weights"]
