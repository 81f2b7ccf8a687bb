"""The KV store of a model with sliding-window layers (Gemma 3): the global layers' pages, paged (paged.py) or offloaded
(offload.py), and a bounded **ring** for the sliding layers (docs/gemma3.md, "a bounded KV for the sliding-window
layers").

The ring keeps, per sequence slot and sliding layer, the last `window` tokens' K and V: the token at position t of the
sequence in slot s lives at ring row `s * window + t % window`. It is a `PagedKVCache` over the sliding layers whose
pages hold `gcd(window, block_size)` tokens, slot s owning the `window // page` consecutive pages from
`s * window // page`, so the ring is stored by the paged store and read by the paged decode kernel. Its last slot
(`num_slots`) is scratch. Slots are handed out by the block manager with a sequence's pages (block_manager.py).

Order of a step (engine/step_context.py: StepContext): decode stores a sliding layer's new token first and then
attends; a prefill chunk attends first (the window before it from the ring, its own keys directly) and is stored
after, only its last `window` tokens (the others go to the scratch slot): so the ring never needs to hold a chunk.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .base import PageReads
from .fp8 import row_bytes
from .paged import PagedKVCache


def ring_page_size(window: int, block_size: int) -> int:
    """Tokens per ring page: the largest size dividing both the window and the engine's page size."""
    return math.gcd(window, block_size)


def ring_bytes_per_slot(num_sliding: int, window: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one sequence slot of the ring: K and V of `window` tokens in every sliding layer."""
    return num_sliding * 2 * window * num_kv_heads * row_bytes(head_dim, dtype)


def layer_split(mc) -> tuple[list[int], list[int]]:
    """(global layers, sliding layers) of ModelConfig `mc`, ascending."""
    sliding = [i for i in range(mc.num_layers) if mc.window_of(i) is not None]
    return [i for i in range(mc.num_layers) if i not in sliding], sliding


class WindowedKVCache:
    """The KVCache protocol (kvcache/base.py) over `inner` (the global layers' store, its layer i = the i-th global
    layer) and `ring` (the sliding layers', its layer j = the j-th sliding layer). Everything not named here is the
    inner store's (its counters, `host_nbytes`, `check_integrity`, ...)."""

    def __init__(self, inner, ring: PagedKVCache, global_layers: list[int], sliding_layers: list[int], window: int,
                 num_slots: int):
        self.inner, self.ring = inner, ring
        self.window, self.num_slots = window, num_slots  # slot `num_slots` is the scratch slot
        self.window_layers = frozenset(sliding_layers)
        self._where = {layer: (inner, i) for i, layer in enumerate(global_layers)}
        self._where.update({layer: (ring, j) for j, layer in enumerate(sliding_layers)})
        self._global = {layer: i for i, layer in enumerate(global_layers)}

    def __getattr__(self, name):  # only reached for names this class does not define
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def max_prefill_pages(self):
        return self.inner.max_prefill_pages

    @property
    def wants_reads(self) -> bool:
        return self.inner.wants_reads

    @property
    def nbytes(self) -> int:
        """Device bytes: the inner store's (its GPU side) and the ring."""
        return self.inner.nbytes + self.ring.nbytes

    def layer(self, layer: int) -> tuple:
        """(k_cache, v_cache) of a model layer: a global layer's pages, or a sliding layer's ring ((num_slots + 1) *
        window // page pages of `page` tokens)."""
        store, i = self._where[layer]
        return store.layer(i)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write k, v (T, H_kv, D) at `slot_mapping`: page slots for a global layer, ring rows
        (`AttentionMetadata.window_mapping`) for a sliding one."""
        store, i = self._where[layer]
        store.store(i, k, v, slot_mapping)

    def prefill_view(self, meta, tables: list[list[int]]):
        view = self.inner.prefill_view(meta, tables)
        return None if view is None else _GlobalLayers(view, self._global)

    def record_reads(self, reads: PageReads) -> None:
        self.inner.record_reads(dataclasses.replace(reads, layer=self._global[reads.layer]))

    def end_step(self):
        return self.inner.end_step()

    def release_transient(self) -> None:
        self.inner.release_transient()

    def occupancy(self, blocks) -> dict:
        return self.inner.occupancy(blocks)


class _GlobalLayers:
    """A staged prefill (staging.py: StagedPrefill) of the global layers, called with model layers."""

    def __init__(self, view, index: dict[int, int]):
        self.view, self.index = view, index

    def attention(self, layer: int, q, k, v, backend):
        return self.view.attention(layer, q, k, v, backend, cache_layer=self.index[layer])


def make_ring(mc, num_slots: int, block_size: int, dtype: torch.dtype, device) -> PagedKVCache:
    """The ring of ModelConfig `mc`'s sliding layers for `num_slots` sequences (and the scratch slot)."""
    sliding = layer_split(mc)[1]
    window = mc.sliding_window
    page = ring_page_size(window, block_size)
    return PagedKVCache(len(sliding), (num_slots + 1) * (window // page), page, mc.num_kv_heads, mc.head_dim, dtype,
                        device)


def resident_cache(mc, num_blocks: int, block_size: int, dtype: torch.dtype, device, num_slots: int):
    """A GPU-resident store of `num_blocks` pages (the scratch page besides) for ModelConfig `mc`: a `PagedKVCache` of
    every layer, or for a model with sliding layers one of its global layers with a ring of `num_slots` slots."""
    if not mc.has_layer_windows:
        return PagedKVCache(mc.num_layers, num_blocks + 1, block_size, mc.num_kv_heads, mc.head_dim, dtype, device)
    glob, sliding = layer_split(mc)
    inner = PagedKVCache(len(glob), num_blocks + 1, block_size, mc.num_kv_heads, mc.head_dim, dtype, device)
    return WindowedKVCache(inner, make_ring(mc, num_slots, block_size, dtype, device), glob, sliding,
                           mc.sliding_window, num_slots)
