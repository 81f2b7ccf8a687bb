"""Writing a step's new K/V into the cache: one kernel per layer for K and V, quantisation and both tiers included.

`store_kv` replaces, on a GPU, what `PagedKVCache.store` and `OffloadedKVCache.store` do with PyTorch ops: fp8
quantisation (~10 ops per tensor), page / offset / slot arithmetic, the write-through to the pinned host tier and the
write into the page's GPU slot when it is resident (~16 ops with offloading, ~36 with fp8 too). In a captured decode
step each op is a kernel of a few microseconds; this is one (docs/kernel-notes.md v10).

One program per (token, KV head): it reads the K and V rows (D values, any row strides), and writes each
  * one tier: into its page (`slot_mapping` = page * block_size + offset);
  * two tiers: into the host tier (pinned; the host address is valid on the GPU through UVA) and, if the page has a
    GPU slot (`slot_of[page] >= 0`), into that slot too. Nothing goes to the scratch slot the PyTorch path uses for
    non-resident pages (a masked store instead).
fp8 rows (fp8.py): scale = max|x| / 448 (at least 1e-12), values x / scale rounded to e4m3 to nearest even,
the fp32 scale in the 4 bytes after the values and 12 zero bytes of padding. The e4m3 rounding is done with integer
ops (`_e4m3_bits`) rather than Triton's fp8 cast: bit-exact with PyTorch's `.to(torch.float8_e4m3fn)` on every
representable value and every tie, on the GPU and in the interpreter (whose fp8 cast mis-rounds values that round up
into the next binade, e.g. 124.3 -> 64 instead of 128).
Tested: the interpreter in fp32 / fp16 / fp8 caches, one and two tiers, bytes equal to the PyTorch path
(tests/test_kv_store.py); GPU bf16 / fp8 in tests/gpu/test_kernels.py (on a GPU).
"""
from __future__ import annotations

import torch

from .fp8 import FP8, row_elems

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _e4m3_bits(v):
        """fp32 values with |v| <= 448 -> e4m3fn bytes as int32 (0..255), rounded to nearest even."""
        b = v.to(tl.int32, bitcast=True)
        sign = (b >> 24) & 0x80
        a = tl.abs(v)
        ex = ((b >> 23) & 0xFF) - 127  # normal range, |v| >= 2^-6: keep 3 of the 23 mantissa bits
        m = b & 0x7FFFFF
        r = m >> 20
        rem = m & 0xFFFFF
        r = r + ((rem > 0x80000) | ((rem == 0x80000) & ((r & 1) == 1))).to(tl.int32)
        ex = ex + (r >> 3)  # a mantissa that rounded up to 8 carries into the exponent
        normal = ((ex + 7) << 3) | (r & 7)
        t = a * 512.0  # subnormals: k * 2^-9, k = |v| * 512 rounded to nearest even
        f = tl.floor(t)
        fi = f.to(tl.int32)
        k = fi + (((t - f) > 0.5) | (((t - f) == 0.5) & ((fi & 1) == 1))).to(tl.int32)
        return sign | tl.where(a >= 0.015625, normal, k)

    @triton.jit
    def _write_row(x, dst, d, ok, write, D: tl.constexpr, FP8: tl.constexpr):
        """Row x (BLOCK_D,) fp32 -> the cache row at `dst` (masked by `write`)."""
        if FP8:
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0), 1e-12)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
            byte = dst.to(tl.pointer_type(tl.uint8))
            tl.store(byte + d, _e4m3_bits(q).to(tl.uint8), mask=ok & write)
            tail = (byte + D).to(tl.pointer_type(tl.float32))
            w = tl.arange(0, 4)
            tl.store(tail + w, tl.where(w == 0, scale, 0.0), mask=(w < 4) & write)
        else:
            tl.store(dst + d, x.to(dst.dtype.element_ty), mask=ok & write)

    @triton.jit
    def _store_kv_kernel(K, V, Slots, KD, VD, KH, VH, SlotOf,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_dp, stride_hp,
                         BS: tl.constexpr, H: tl.constexpr, ROW: tl.constexpr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, FP8: tl.constexpr, TIERED: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        s = tl.load(Slots + t).to(tl.int64)
        page = s // BS
        inner = (s % BS) * (H * ROW) + h * ROW  # the row's place inside a page (pages are (BS, H, ROW))
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=ok, other=0.0).to(tl.float32)
        if TIERED > 1:  # head slots: a page's heads one after another at home, one head's page per slot
            hinner = (s % BS) * ROW
            _write_row(k, KH + page * stride_hp + h * (BS * ROW) + hinner, d, ok, True, D, FP8)
            _write_row(v, VH + page * stride_hp + h * (BS * ROW) + hinner, d, ok, True, D, FP8)
            slot = tl.load(SlotOf + page * H + h).to(tl.int64)
            res = slot >= 0
            slot = tl.maximum(slot, 0)
            _write_row(k, KD + slot * stride_dp + hinner, d, ok, res, D, FP8)
            _write_row(v, VD + slot * stride_dp + hinner, d, ok, res, D, FP8)
        elif TIERED:
            _write_row(k, KH + page * stride_hp + inner, d, ok, True, D, FP8)
            _write_row(v, VH + page * stride_hp + inner, d, ok, True, D, FP8)
            slot = tl.load(SlotOf + page).to(tl.int64)
            res = slot >= 0
            slot = tl.maximum(slot, 0)
            _write_row(k, KD + slot * stride_dp + inner, d, ok, res, D, FP8)
            _write_row(v, VD + slot * stride_dp + inner, d, ok, res, D, FP8)
        else:
            _write_row(k, KD + page * stride_dp + inner, d, ok, True, D, FP8)
            _write_row(v, VD + page * stride_dp + inner, d, ok, True, D, FP8)


def _check(k: torch.Tensor, v: torch.Tensor, dst: torch.Tensor, heads_per_slot: int) -> None:
    if k.dim() != 3 or k.shape != v.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"k and v must be (T, H_kv, D) with contiguous rows, got {tuple(k.shape)} / {tuple(v.shape)}")
    if dst.stride(-1) != 1 or not dst[0].is_contiguous():
        raise ValueError("cache pages must be contiguous (block_size, H_kv, row)")
    if dst.shape[2] != heads_per_slot:
        raise ValueError(f"the cache's pages hold {dst.shape[2]} KV heads, expected {heads_per_slot}")


def store_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, host: tuple | None = None, slot_of: torch.Tensor | None = None,
             head_slots: bool = False) -> None:
    """Write k, v (T, H_kv, D) at token slots `slot_mapping` (T,) = page * block_size + offset.

    One tier: k_cache / v_cache (pages, block_size, H_kv, row) are the layer's cache. Two tiers: `host` = (K, V)
    host-tier tensors of the layer (pages, block_size, H_kv, row), pinned; k_cache / v_cache are the GPU pool's K / V
    (slots, block_size, H_kv, row) and `slot_of` (pages,) int32 the layer's page table (-1: not resident).
    `head_slots` (kvcache/offload.py's head units): the host tensors are (pages, H_kv, block_size, row), the pool's
    slots (slots, block_size, 1, row) and `slot_of` (pages, H_kv).
    fp8 caches (row = D + 16) get quantised rows. No host sync (graph-capturable)."""
    from .offload_copy import kernel_arg

    T, H, D = k.shape
    if T == 0:
        return
    _check(k, v, k_cache, 1 if head_slots else H)
    fp8 = k_cache.dtype == FP8
    row = k_cache.shape[-1]
    if row != row_elems(D, k_cache.dtype):
        raise ValueError(f"cache rows of {row} elements do not fit head_dim {D} in {k_cache.dtype}")
    if host is None:
        kh = vh = k_cache
        so, stride_hp, tiered = slot_mapping, 0, 0
    else:
        kh, vh = kernel_arg(host[0]), kernel_arg(host[1])
        so, stride_hp, tiered = slot_of, host[0].stride(0), 1 + H if head_slots and H > 1 else 1
    _store_kv_kernel[(T, H)](
        k, v, slot_mapping, k_cache, v_cache, kh, vh, so,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), stride_hp,
        BS=k_cache.shape[1], H=H, ROW=row, D=D, BLOCK_D=triton.next_power_of_2(D), FP8=fp8, TIERED=tiered,
        num_warps=1 if D <= 128 else 2)
