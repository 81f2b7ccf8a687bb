"""The shared toolkit of the top-k selection methods (infinitehip, hip, quest, streaming).

  config.py     SparseConfig: the fields every such method has (sink, window, query blocks, dense layers, RoPE)
  selection.py  SelectionMethod (what a method implements), SequenceKeys / BlockQueries (what it reads), KeptBoxes
                (the interface of key boxes a method keeps across steps)
  backend.py    SparseBackend: dense fallback, per-sequence decode state, packing, block-sparse attention
  graph.py      GraphDecoder: the decode step as CUDA-graph variants, owned by SparseBackend
"""
from .backend import SparseBackend
from .config import GRANULARITIES, SparseConfig
from .graph import GraphDecoder
from .selection import BlockQueries, KeptBoxes, SelectionMethod, SequenceKeys, use_kernels

__all__ = ["GRANULARITIES", "BlockQueries", "GraphDecoder", "KeptBoxes", "SelectionMethod", "SequenceKeys",
           "SparseBackend", "SparseConfig", "use_kernels"]
