"""HiP's config and presets (the method: method.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ...rope.strategies import PRUNE_CODES, parse_layer_spec
from ..sparse.config import SparseConfig


@dataclass(frozen=True)
class HiPConfig(SparseConfig):
    block_q: int = 32
    block_k: int = 2
    budget: int = 2048
    dense_layers: tuple[int, ...] = (0, 1, 2)
    refresh: int = 1  # decode steps a selection is reused (HiP's n_r)
    attend_rope: str = "st"  # rolling positions after selection (the BLOG's HiP/InfiniteHiP extension, §3.2)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_k < 1 or self.budget < self.block_k or self.budget % self.block_k:
            raise ValueError(f"budget ({self.budget}) must be a positive multiple of block_k ({self.block_k})")
        if self.refresh < 1:
            raise ValueError(f"refresh must be >= 1, got {self.refresh}")
        if any(name == "ci" for name, _, _ in parse_layer_spec(self.prune_rope, PRUNE_CODES, "prune_rope")):
            raise ValueError("hip cannot prune with ci positions (its branches are not in position order); "
                             "use none, rt, il or de")


PRESETS = {"512": HiPConfig(budget=512), "1k": HiPConfig(budget=1024), "2k": HiPConfig(budget=2048),
           "2k-r8": HiPConfig(budget=2048, refresh=8)}
DEFAULT_PRESET = "2k"

PRESET_NOTES = {  # preset -> what it is for (`longreach backends`)
    "2k": "2,048 keys per query block by hierarchical top-k, selected every decode step (default)",
    "1k": "1,024 keys per query block: faster, retrieves less",
    "512": "512 keys per query block: the smallest",
    "2k-r8": "2k with each selection reused for 8 decode steps: faster decode",
}
