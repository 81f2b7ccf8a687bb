"""Re-rotating rows inside a kernel: the Triton side of rope/strategies.py (`rotate` is its PyTorch reference).

A row rotated at position p becomes one rotated at p + delta by a second rotation of `delta`. The kernel loads the
row twice — as stored and with its halves swapped (`swap_halves` gives the column offsets) — so the rotate-half
layout needs no register shuffles: out = x * cos + sign * x_swapped * sin, sign = -1 on the first half.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def swap_halves(d, HEAD_DIM: tl.constexpr):
        """Column offsets that read a row with its two halves swapped."""
        return (d + HEAD_DIM // 2) % HEAD_DIM

    @triton.jit
    def rotate_rows(x, x_sw, delta, inv_freq, d, HEAD_DIM: tl.constexpr):
        """Rotate rows x (N, D) by delta (N,) positions; x_sw: the same rows with halves swapped; inv_freq (D,) (each
        frequency twice, column d uses inv_freq[d % (D/2)]). fp32 out. The angle is reduced to [-pi, pi] first."""
        ang = delta.to(tl.float32)[:, None] * inv_freq[None, :]
        ang = ang - 6.283185307179586 * tl.floor(ang * 0.15915494309189535 + 0.5)
        sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
        return x.to(tl.float32) * tl.cos(ang) + sign[None, :] * x_sw.to(tl.float32) * tl.sin(ang)
