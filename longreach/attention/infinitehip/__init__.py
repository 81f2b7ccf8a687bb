"""InfiniteHiP (Lee, Park, Suh, Hwang 2025): multi-stage hierarchical context pruning, per-stage mask caching.

  config.py   InfiniteHiPConfig, its presets and what each is for
  method.py   the selection (SelectRep, the stages, the box-scored stage 0's scores); the paper's ambiguities settled
  boxes.py    BoxPool: the stage-0 chunk boxes kept per sequence in a pool paged like the KV cache
  backend.py  InfiniteHiPBackend (the shared sparse backend with this method and its boxes)
"""
from .backend import InfiniteHiPBackend
from .boxes import BoxPool
from .config import DEFAULT_PRESET, PRESET_NOTES, PRESETS, STAGE0_SCORES, InfiniteHiPConfig
from .method import InfiniteHiP

__all__ = ["DEFAULT_PRESET", "PRESETS", "PRESET_NOTES", "STAGE0_SCORES", "BoxPool", "InfiniteHiP",
           "InfiniteHiPBackend", "InfiniteHiPConfig"]
