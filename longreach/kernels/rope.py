"""Re-rotating rows inside a kernel: the Triton side of rope/strategies.py (`rotate` is its PyTorch reference).

A row rotated at position p becomes one rotated at p + delta by a second rotation of `delta`. The kernel loads the
row twice — as stored and with its halves swapped (`swap_halves` gives the column offsets) — so the rotate-half
layout needs no register shuffles: out = x * cos + sign * x_swapped * sin, sign = -1 on the first half. A kernel
that can keep its rows as two halves (`rotate_halves`: a dot over each half, summed) loads each element once and
computes each angle once.
"""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    # The GPU's approximate sin/cos (one special-function instruction each; abs. error ~5e-7 on [-pi, pi], where the
    # angle is reduced first) instead of libdevice's accurate ones (dozens of instructions each): a probe of the
    # pruning kernel rotates every key it reads, and with the accurate functions the trig dominated RoPE-remapped
    # prefill (docs/kernel-notes.md v7). The CPU interpreter has no fast variants: it keeps tl.sin/cos.
    FAST_TRIG: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

    @triton.jit
    def swap_halves(d, HEAD_DIM: tl.constexpr):
        """Column offsets that read a row with its two halves swapped."""
        return (d + HEAD_DIM // 2) % HEAD_DIM

    @triton.jit
    def cos_sin(delta, inv_freq):
        """cos and sin (N, F) fp32 of the angles delta (N,) x inv_freq (F,), each reduced to [-pi, pi] first."""
        ang = delta.to(tl.float32)[:, None] * inv_freq[None, :]
        ang = ang - 6.283185307179586 * tl.floor(ang * 0.15915494309189535 + 0.5)
        if FAST_TRIG:
            return libdevice.fast_cosf(ang), libdevice.fast_sinf(ang)
        else:
            return tl.cos(ang), tl.sin(ang)

    @triton.jit
    def rotate_rows(x, x_sw, delta, inv_freq, d, HEAD_DIM: tl.constexpr):
        """Rotate rows x (N, D) by delta (N,) positions; x_sw: the same rows with halves swapped; inv_freq (D,) (each
        frequency twice, column d uses inv_freq[d % (D/2)]). fp32 out. The angle is reduced to [-pi, pi] first."""
        cos, sin = cos_sin(delta, inv_freq)
        sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
        return x.to(tl.float32) * cos + sign[None, :] * x_sw.to(tl.float32) * sin

    @triton.jit
    def rotate_halves(x1, x2, delta, inv_half):
        """`rotate_rows` on rows held as their two halves x1, x2 (N, D/2), inv_half (D/2,) the frequencies once each:
        one load of each element and half the sines and cosines. fp32 halves out."""
        cos, sin = cos_sin(delta, inv_half)
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin
