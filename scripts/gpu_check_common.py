"""Helpers shared by the GPU checks (scripts/gpu_check.py and its check modules)."""
from __future__ import annotations

import torch


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _inv_freq(D):
    from longreach.models.config import RopeConfig
    from longreach.rope.scaling import rope_inv_freq

    return rope_inv_freq(RopeConfig(theta=500000.0), D)[0].cuda()


def _tier(kc, vc, share, g):
    """A two-tier copy of one-tier caches kc/vc (P, page, H_kv, D): host pinned, `share` of the pages resident in a
    pool at random slots (the rest read over PCIe)."""
    from longreach.kvcache.offload import TierView

    P = kc.shape[0]
    res = torch.randperm(P, device=kc.device, generator=g)[: int(P * share)]
    S = res.numel() + 3
    slot = torch.randperm(S, device=kc.device, generator=g)[: res.numel()]
    slots = torch.full((P,), -1, dtype=torch.int32, device=kc.device)
    slots[res] = slot.int()
    views = []
    for c in (kc, vc):
        pool = torch.randn(S + 1, *c.shape[1:], device=c.device, generator=g).to(c.dtype)  # other slots: junk
        pool[slot] = c[res]
        views.append(TierView(pool, c.cpu().pin_memory(), slots))
    return views


def _median_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[reps // 2]
