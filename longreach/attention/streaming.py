"""StreamingLLM: attention sinks plus a sliding window, nothing selected (Xiao et al., 2023).

The simplest sparse baseline: it forgets the middle of the context. Presets match the token budgets of
InfiniteHiP's: `3k` reads 256 sink + 3072 window tokens (3328, as infinitehip 3k's 256 + 1024 + 2048).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sparse import SelectionMethod, SparseBackend, SparseConfig


@dataclass(frozen=True)
class StreamingConfig(SparseConfig):
    n_window: int = 3072
    attend_rope: str = "st"  # StreamingLLM numbers the cached keys by slot: sink, then the window, query last


class Streaming(SelectionMethod):
    name = "streaming"
    config_cls = StreamingConfig
    presets = {"3k": StreamingConfig(n_sink=256, n_window=3072), "5k": StreamingConfig(n_sink=256, n_window=5120)}
    default_preset = "3k"
    block_k = 1

    def selected_budget(self, layer: int) -> int:
        return 0

    def _select(self, layer, q, blocks, keys, state, step):
        return torch.empty(blocks.num_blocks, self.groups, 0, dtype=torch.long, device=q.device)

    def graph_stage_widths(self, layer: int) -> tuple[int, ...]:
        return ()  # nothing selected, nothing cached

    def graph_select(self, layer, q, blocks, keys, cached, row_first, level):
        return []


class StreamingBackend(SparseBackend):
    """StreamingLLM: sink + sliding window, no selection."""

    name = "streaming"
    method_cls = Streaming
    preset_notes = {
        "3k": "256 sink tokens + a 3,072-token window (default)",
        "5k": "256 sink tokens + a 5,120-token window",
    }
    supports_cuda_graph = True
