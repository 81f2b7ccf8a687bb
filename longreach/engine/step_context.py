"""`StepContext`: what the model sees of the engine during one forward pass (models/llama.py's `ForwardContext`):
where each layer's new K/V goes and how its attention runs, for a decode, prefill or mixed step (engine/model_runner.py
builds one per step)."""
from __future__ import annotations

import torch

from ..attention.backend import AttentionBackend, AttentionMetadata
from ..kvcache.base import KVCache


class StepContext:
    """The model's view of the engine for one forward pass (models/llama.py: ForwardContext).

    `staged`: a prefill step's view of a store whose pages are not all on the GPU (kvcache/base.py: prefill_view)
    runs the attention itself (the offloaded store: on the staging area it fills per layer).
    `parts`: a mixed step's rows as (first row, metadata) per part, decode rows first: every layer's projections and
    MLP run over all rows at once, and the attention runs once per part with that part's metadata, so each part
    attends exactly as it would in a step of its own. (Where decode runs through CUDA graphs, a mixed step replays
    the decode rows' graph and runs the prefill chunks after it instead: ModelRunner._graph_and_prefill.)"""

    def __init__(self, kv_cache: KVCache, backend: AttentionBackend, meta: AttentionMetadata,
                 max_position: int | None, staged=None, parts: list[tuple[int, AttentionMetadata]] | None = None):
        self.kv_cache, self.backend, self.meta, self.max_position = kv_cache, backend, meta, max_position
        self.staged = staged
        self.parts = parts

    def attention(self, layer, q, k, v):
        if self.staged is not None and layer not in self.kv_cache.window_layers:
            return self.staged.attention(layer, q, k, v, self.backend)
        if self.parts is None:
            return self._attend(layer, q, k, v, self.meta)
        bounds = [first for first, _ in self.parts[1:]] + [q.shape[0]]
        return torch.cat([self._attend(layer, q[a:b], k[a:b], v[a:b], meta)
                          for (a, meta), b in zip(self.parts, bounds)])

    def _attend(self, layer, q, k, v, meta: AttentionMetadata):
        if layer in self.kv_cache.window_layers:
            return self._attend_window(layer, q, k, v, meta)
        self.kv_cache.store(layer, k, v, meta.slot_mapping)
        k_cache, v_cache = self.kv_cache.layer(layer)
        out = self.backend.forward(layer, q, k, v, k_cache, v_cache, meta)
        reads = meta.page_reads
        if reads:  # what the layer attended, handed to the store now (device ops: inside a captured step too)
            for r in reads:
                self.kv_cache.record_reads(r)
            reads.clear()
        return out

    def _attend_window(self, layer, q, k, v, meta: AttentionMetadata):
        """A sliding-window layer whose keys sit in a ring of `window` rows per sequence (kvcache/window.py): decode
        stores the new token and then attends over the ring; a prefill chunk attends first (the window before it from
        the ring, its own keys directly) and is stored after, so that the ring never has to hold a chunk."""
        k_cache, v_cache = self.kv_cache.layer(layer)
        if not meta.is_prefill:
            self.kv_cache.store(layer, k, v, meta.window_mapping)
            return self.backend.forward(layer, q, k, v, k_cache, v_cache, meta)
        out = self.backend.forward(layer, q, k, v, k_cache, v_cache, meta)
        self.kv_cache.store(layer, k, v, meta.window_mapping)
        return out
