"""StreamingLLM: attention sinks plus a sliding window, nothing selected (Xiao et al., 2023).

The simplest sparse baseline: it forgets the middle of the context. Presets match the token budgets of
InfiniteHiP's: `3k` reads 256 sink + 3072 window tokens (3328, as infinitehip 3k's 256 + 1024 + 2048).
"""
from __future__ import annotations

import torch

from ..sparse.selection import SelectionMethod
from .config import DEFAULT_PRESET, PRESETS, StreamingConfig


class Streaming(SelectionMethod):
    name = "streaming"
    config_cls = StreamingConfig
    presets = PRESETS
    default_preset = DEFAULT_PRESET
    block_k = 1

    def selected_budget(self, layer: int) -> int:
        return 0

    def _select(self, layer, q, blocks, keys, state, step):
        return torch.empty(blocks.num_blocks, self.groups, 0, dtype=torch.long, device=q.device)

    def graph_stage_widths(self, layer: int) -> tuple[int, ...]:
        return ()  # nothing selected, nothing cached

    def graph_select(self, layer, q, blocks, keys, cached, row_first, level, out=None):
        return []
