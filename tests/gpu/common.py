"""Helpers shared by the GPU tests: error measures, RoPE frequencies, two-tier caches, timing, the essay text."""
from __future__ import annotations

import os

import torch


def rel_err(out, ref) -> float:
    """|out - ref| / |ref| (Frobenius norms) in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def llama_inv_freq(D: int) -> torch.Tensor:
    """Llama-3's RoPE frequencies (theta 500,000) for head size D, on the GPU: (D // 2,)."""
    from longreach.models.config import RopeConfig
    from longreach.rope.scaling import rope_inv_freq

    return rope_inv_freq(RopeConfig(theta=500000.0), D)[0].cuda()


def two_tier(kc, vc, share, g):
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


def median_us(fn, reps: int = 50) -> float:
    """The median time of fn() in microseconds, by CUDA events around each call (3 warm-up calls first)."""
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


def essay_text() -> str:
    """The Paul Graham essays: from .carry/b/pg.txt where a device call carried them, else longreach's copy."""
    from longreach.tools.eval.data import paul_graham_text

    if os.path.exists(".carry/b/pg.txt"):
        with open(".carry/b/pg.txt") as f:
            return f.read()
    return paul_graham_text()
