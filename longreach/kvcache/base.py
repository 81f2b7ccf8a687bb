"""What the engine sees of a KV store: one protocol for the GPU-resident cache (paged.py) and the host-offloaded one
(offload.py), so that engine/ holds no branch on which it is.

A step's life as the engine drives it:
  * prefill: `prefill_view(meta, tables)` gives the object whose `attention(layer, q, k, v, backend)` runs the step's
    attention (the offloaded store stages the sequences' pages on the GPU), or None: attention then reads the cache's
    `layer(...)` views after `store(...)`;
  * decode: where `wants_reads` is true, the attention backend returns, as data, the index each layer attended
    (`PageReads`, in `AttentionMetadata.page_reads`) and the runner hands it to `record_reads(reads)` after the layer
    (the offloaded store marks those pages to install); after the step `end_step()` returns the step's page counts
    (hit, missed, evicted, installed) or None;
  * between steps: `release_transient()` when no prefill is pending (the offloaded store frees its staging area);
  * `max_prefill_pages`: the most pages one prefill step may cover (the staging area's size), None for no limit;
  * `occupancy(blocks)`: the counters `LLMEngine.kv_cache_stats` and the server's metrics report;
  * `window_layers`, `window`: a model's sliding-window layers whose keys sit in a ring of `window` tokens per
    sequence (window.py), empty for the plain stores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

# the keys of `occupancy` (the server's /metrics and `kv_cache_stats` read them)
OCCUPANCY_KEYS = ("offload", "gpu_pages_total", "gpu_pages_used", "host_pages_total", "host_pages_used", "pages_hit",
                  "pages_missed", "pages_evicted", "pages_installed", "pages_installed_in_step",
                  "pages_installed_ahead", "bytes_h2d")


@dataclass(frozen=True)
class PageReads:
    """What one layer's decode attention read, as the index it attended (device tensors: no host sync, so a captured
    decode step records it too). Per query block i: row seq[i] of block_tables (B, W), queries at positions
    first[i]..last[i] (last - first < max_rows), the selected key blocks blocks[i] (G, K) of block_k tokens (-1
    padded); besides them the block reads keys [0, n_sink) and its window [first - n_window + 1, last]."""

    layer: int
    block_tables: torch.Tensor  # (B, W) int32
    seq: torch.Tensor  # (nb,)
    first: torch.Tensor  # (nb,)
    last: torch.Tensor  # (nb,)
    max_rows: int
    blocks: torch.Tensor  # (nb, G, K)
    block_k: int
    n_sink: int
    n_window: int
    # a selection stage's probes (the keys it scored, `blocks` its candidate chunks of `block_k` tokens), not the
    # attention: a store installs them only where its unit makes room for them (kvcache/offload.py)
    probe: bool = False
    # with `probe`, handed to `install_reads`: pages a stage will score at a later step (infinitehip's `ahead`), to be
    # copied in the background (kvcache/prefetch.py) rather than now
    ahead: bool = False


@dataclass(frozen=True)
class KVNeeds:
    """What an attention backend asks of the KV store (`AttentionBackend.kv_needs`), declared, not probed."""

    layout: object = None  # a bounded cache's slot layout (attention/backend.py: KVLayout); None: token t in slot t
    page_state_bytes: int = 0  # GPU bytes of backend state per KV page (psa's block metadata, stage-0 boxes)
    dense_layers: tuple[int, ...] = ()  # layers that always attend densely (each reads every page)


@runtime_checkable
class KVCache(Protocol):
    max_prefill_pages: int | None
    wants_reads: bool  # does it learn from what decode attention read (`record_reads`)?
    # sliding-window layers kept in a ring (window.py; the step's `window_mapping` places their tokens, and a prefill
    # chunk stores them after attending), and that window; empty and None for every other store
    window_layers: frozenset
    window: int | None

    def layer(self, layer: int) -> tuple: ...

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def prefill_view(self, meta, tables: list[list[int]]): ...

    def record_reads(self, reads: PageReads) -> None: ...

    def end_step(self) -> dict | None: ...

    def release_transient(self) -> None: ...

    def occupancy(self, blocks) -> dict: ...


def resident_occupancy(blocks) -> dict:
    """The occupancy of a cache whose pages all live on the GPU: the block manager's pages, no host tier."""
    used = blocks.num_blocks - blocks.num_free_blocks
    return {"offload": False, "gpu_pages_total": blocks.num_blocks, "gpu_pages_used": used, "host_pages_total": 0,
            "host_pages_used": 0, "pages_hit": 0, "pages_missed": 0, "pages_evicted": 0, "pages_installed": 0,
            "pages_installed_in_step": 0, "pages_installed_ahead": 0, "bytes_h2d": 0}
