"""Paged KV storage for all layers.

Layout: one tensor (num_layers, 2, num_blocks, block_size, H_kv, D); layer l's keys are `kv[l, 0]`, values `kv[l, 1]`.
A token's slot is `page * block_size + offset`. Keys are stored *rotated at their true positions*: dense attention
reads them as they are, and a method that attends with other positions (rolling / chunk-indexed RoPE) re-rotates a
key by the position delta (rope/scaling.py: rotations compose), so no second copy of the cache is needed.

The engine talks to it through the KVCache protocol (kvcache/base.py), which the host-offloaded store (offload.py)
implements too; for this cache every step hook is a no-op.
"""
from __future__ import annotations

import torch

from ..kernels import kv_store, use_triton
from ..kernels.kv_layout import gather_tokens  # noqa: F401 (re-exported for the cache's readers)
from .base import PageReads, resident_occupancy
from .fp8 import as_bytes, encode, row_bytes, row_elems


class PagedKVCache:
    max_prefill_pages = None  # a prefill step reads its pages where they are: no limit
    wants_reads = False  # every page is on the GPU: what attention reads changes nothing here
    window, window_layers = None, frozenset()  # no ring of sliding-window layers here (kvcache/window.py wraps one)

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv = torch.empty(num_layers, 2, num_blocks, block_size, num_kv_heads, row_elems(head_dim, dtype),
                              dtype=dtype, device=device)
        # every layer's (K, V) views, made once: indexing `kv` costs ~20 us of host time per call, twice a layer
        self._layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * row_bytes(head_dim, dtype)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each (num_blocks, block_size, H_kv, D) (D + 16 fp8 bytes with scales:
        kernels/fp8.py)."""
        return self._layers[layer]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write k, v (T, H_kv, D) into slots (T,) of `layer` (quantised for an fp8 cache): one fused kernel on a
        GPU (kernels/kv_store.py), the PyTorch ops elsewhere."""
        kc, vc = self.layer(layer)
        if use_triton(k):
            return kv_store.store_kv(k, v, slot_mapping, kc, vc)
        for c, x in ((kc, k), (vc, v)):
            as_bytes(c).view(-1, *c.shape[2:]).index_copy_(0, slot_mapping, as_bytes(encode(x, c.dtype)))

    # ---- the KVCache protocol's step hooks (kvcache/base.py): nothing to do for a GPU-resident cache --------------
    def prefill_view(self, meta, tables: list[list[int]]) -> None:
        return None

    def record_reads(self, reads: PageReads) -> None:
        pass

    def end_step(self) -> None:
        return None

    def release_transient(self) -> None:
        pass

    def occupancy(self, blocks) -> dict:
        return resident_occupancy(blocks)
