"""PSA, Progressive Sparse Attention (Zhou, Zuo, Yin, Cheng): per decode query, blocks in metadata-rank order until
the attended share of the attention mass reaches epsilon.

  config.py   PSAConfig, its presets and what each is for
  method.py   the method apart from the engine (candidates, ranking, the progressive loop, what was read) and the
              decisions on what the paper leaves open; its kernels are kernels/psa_decode.py, psa_waves.py and
              key_boxes.py (the block metadata: key boxes by page id, attention/box_store.py)
  backend.py  PSABackend: dense prefill, block metadata per KV page built at decode, CUDA-graph variants
"""
from .backend import PSABackend
from .config import DEFAULT_PRESET, PRESET_NOTES, PRESETS, PSAConfig
from .method import PSA

__all__ = ["DEFAULT_PRESET", "PRESETS", "PRESET_NOTES", "PSA", "PSABackend", "PSAConfig"]
