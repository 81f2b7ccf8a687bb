"""How the kernels and their references see a layer's paged KV: one tier, a (pages, block_size, H_kv, row) tensor, or
two (`TierView`: the GPU slots of kvcache/offload.py's page pool over the host tier), plus the reference helpers that
read either as plain values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import values


@dataclass
class TierView:
    """One layer's K (or V) across both tiers, as the kernels read it (kernels/paged.py).

    Two units of residency (kvcache/offload.py, docs/design-offload-heads.md): a slot holds a page with all its KV
    heads (`units` 1), or one KV head's page (`units` = H_kv); then the host tier keeps each page's heads one after
    the other, (P, H_kv, block_size, D), so that one head's page is contiguous, as its slot is, and the page table
    has one entry per page and head."""

    pool: torch.Tensor  # (S + 1, block_size, H_kv / units, D): the slots' K or V
    host: torch.Tensor  # (P, block_size, H_kv, D), or (P, H_kv, block_size, D) with head units: the layer's K or V
    slots: torch.Tensor  # (P,) or (P, H_kv) int32: page (and head) -> slot, -1 when not resident
    units: int = 1  # slots per page: 1 (a page of every head) or H_kv (one per head)

    @property
    def shape(self) -> torch.Size:
        """(P, block_size, H_kv, D), whichever the unit."""
        if self.units == 1:
            return self.host.shape
        P, H, bs, D = self.host.shape
        return torch.Size((P, bs, H, D))

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def _home(self, idx: torch.Tensor) -> torch.Tensor:
        """Host pages idx as (n, block_size, H_kv, D) on the pool's device."""
        out = self.host[idx.cpu()].to(self.pool.device)
        return out if self.units == 1 else out.transpose(1, 2).contiguous()

    def pages(self, idx: torch.Tensor) -> torch.Tensor:
        """Pages idx (n,) as (n, block_size, H_kv, D) on the pool's device, each (head) from its slot or its home."""
        idx = idx.to(self.slots.device).long()
        slot = self.slots[idx].long()
        out = self._home(idx)
        if self.units == 1:
            res = (slot >= 0).nonzero().squeeze(1)
            out[res] = self.pool[slot[res]]
        else:
            n, h = (slot >= 0).nonzero().unbind(1)
            out[n, :, h] = self.pool[slot[n, h], :, 0]
        return out

    def resolve(self) -> torch.Tensor:
        """The layer as one (P, block_size, H_kv, D) tensor on the pool's device: resident pages from their slots,
        the rest from the host tier (reference paths; on a GPU this copies the whole layer)."""
        return self.pages(torch.arange(self.shape[0]))


def as_tensor(cache, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A one-tier cache of plain values for reference code: a `TierView` resolved, fp8 rows dequantised to `dtype`,
    anything else as it is."""
    return values(cache.resolve() if isinstance(cache, TierView) else cache, dtype)


def gather_tokens(cache: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """Tokens [start, length) of one sequence as a contiguous (length - start, H_kv, D) tensor (float32 values for
    an fp8 cache); only the pages that hold them are read.

    cache (num_blocks, block_size, H_kv, D), or a two-tier `TierView` (kvcache/offload.py: each page from its GPU
    slot or its host home); block_table (>= ceil(length / block_size),) page ids.
    """
    bs = cache.shape[1]
    first = start // bs
    n = -(-length // bs) - first
    idx = block_table[first:first + n].long()
    pages = cache.pages(idx) if hasattr(cache, "pages") else cache[idx]
    skip = start - first * bs
    return values(pages.reshape(n * bs, *cache.shape[2:])[skip:skip + length - start], torch.float32)
