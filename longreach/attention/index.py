"""The sparse indexes (`QueryBlocks`, `SparseIndex`, `RangeIndex`): the contract between selection and execution.
They live with the kernels that consume them (kernels/index_types.py, whose docstring defines the format); this
module keeps the import path the methods use.
"""
from __future__ import annotations

from ..kernels.index_types import QueryBlocks, RangeIndex, SparseIndex

__all__ = ["QueryBlocks", "RangeIndex", "SparseIndex"]
