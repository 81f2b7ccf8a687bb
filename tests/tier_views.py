"""Two-tier views of a paged cache for the kernel tests (KV offloading, kernels/kv_layout.py's `TierView`): some pages
(or, with head units, some KV heads' pages) resident at random slots of a pool whose other slots hold junk, the host
copies of the resident ones poisoned, so that a kernel reading the wrong tier gives other bits."""
from __future__ import annotations

import torch

from longreach.kernels.kv_layout import TierView


def two_tiers(kc: torch.Tensor, vc: torch.Tensor, g: torch.Generator, share: float = 0.5, units: int = 1
              ) -> list[TierView]:
    """TierViews of kc/vc (P, page, H, D). `units` 1: a slot per page; H: a slot per KV head's page, the host tier
    (P, H, page, D) and the page table (P, H) as kvcache/offload.py keeps them with `unit="head"`."""
    P, page, H, D = kc.shape
    if units not in (1, H):
        raise ValueError(f"units must be 1 or the KV heads ({H}), got {units}")
    cells = P * units  # page-major: cell = page * units + head
    res = torch.randperm(cells, generator=g)[: int(cells * share)]
    S = res.numel() + 3
    slot = torch.randperm(S, generator=g)[: res.numel()]
    slots = torch.full((cells,), -1, dtype=torch.int32)
    slots[res] = slot.int()
    out = []
    for c in (kc, vc):
        per_cell = c if units == 1 else c.transpose(1, 2).reshape(cells, page, 1, D)  # (cells, page, H / units, D)
        pool = (torch.randn(S + 1, *per_cell.shape[1:], generator=g) * 100).to(c.dtype)
        pool[slot] = per_cell[res]
        home = per_cell.clone()
        home[res] = (torch.randn(res.numel(), *per_cell.shape[1:], generator=g) * 100).to(c.dtype)  # stale
        if units == 1:
            out.append(TierView(pool, home, slots))
        else:
            out.append(TierView(pool, home.reshape(P, H, page, D), slots.view(P, H), units))
    return out
