"""What the engine sees of a KV store: one protocol for the GPU-resident cache (paged.py) and the host-offloaded one
(offload.py), so that engine/ holds no branch on which it is.

A step's life as the engine drives it:
  * prefill: `prefill_view(meta, tables)` gives the object whose `attention(layer, q, k, v, backend)` runs the step's
    attention (the offloaded store stages the sequences' pages on the GPU), or None: attention then reads the cache's
    `layer(...)` views after `store(...)`;
  * decode: `decode_reads()` is what sparse attention reports the pages it reads to (`AttentionMetadata.kv_store`),
    or None where nothing needs to know; after the step `end_step()` returns the step's page counts (hit, missed,
    evicted, installed) or None;
  * between steps: `release_transient()` when no prefill is pending (the offloaded store frees its staging area);
  * `max_prefill_pages`: the most pages one prefill step may cover (the staging area's size), None for no limit;
  * `occupancy(blocks)`: the counters `LLMEngine.kv_cache_stats` and the server's metrics report.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

# the keys of `occupancy` (the server's /metrics and `kv_cache_stats` read them)
OCCUPANCY_KEYS = ("offload", "gpu_pages_total", "gpu_pages_used", "host_pages_total", "host_pages_used", "pages_hit",
                  "pages_missed", "pages_evicted", "pages_installed", "bytes_h2d")


@dataclass(frozen=True)
class KVNeeds:
    """What an attention backend asks of the KV store (`AttentionBackend.kv_needs`), declared, not probed."""

    layout: object = None  # a bounded cache's slot layout (attention/backend.py: KVLayout); None: token t in slot t
    page_state_bytes: int = 0  # GPU bytes of backend state per KV page (psa's block metadata, stage-0 boxes)
    dense_layers: tuple[int, ...] = ()  # layers that always attend densely (each reads every page)


@runtime_checkable
class KVCache(Protocol):
    max_prefill_pages: int | None

    def layer(self, layer: int) -> tuple: ...

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def prefill_view(self, meta, tables: list[list[int]]): ...

    def decode_reads(self): ...

    def end_step(self) -> dict | None: ...

    def release_transient(self) -> None: ...

    def occupancy(self, blocks) -> dict: ...


def resident_occupancy(blocks) -> dict:
    """The occupancy of a cache whose pages all live on the GPU: the block manager's pages, no host tier."""
    used = blocks.num_blocks - blocks.num_free_blocks
    return {"offload": False, "gpu_pages_total": blocks.num_blocks, "gpu_pages_used": used, "host_pages_total": 0,
            "host_pages_used": 0, "pages_hit": 0, "pages_missed": 0, "pages_evicted": 0, "pages_installed": 0,
            "bytes_h2d": 0}
