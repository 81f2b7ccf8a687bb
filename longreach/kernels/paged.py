"""Reading rows of the paged KV cache inside a kernel: token position -> page (block table) -> row.

Two tiers (KV offloading, kvcache/offload.py): a layer's pages have their home in pinned host memory, and a GPU pool
of slots holds copies of some of them. A kernel then gets three extra things per cache: `XH`, the host tier of that
layer (its pointer is a host address, valid on the GPU through unified virtual addressing), `Slots`, the layer's page
table (page -> slot, -1 when not resident), and `stride_hp`, the host tier's page stride. A resident page is read
from its slot, a missing one straight from host memory (zero-copy, over PCIe). The two tiers share the inner layout
(offset, head, dim), so only the page's base address differs. With `TIERED` false, `X` is the one-tier cache and the
extra arguments are unused.

`TIERED` is a constexpr code: 0 one tier; 1 two tiers whose slots hold a page of every KV head; 1 + H_kv two tiers
whose slots hold one KV head's page each (docs/design-offload-heads.md). With head slots the page table is (P, H_kv)
and the host tier keeps a page's heads one after another, (P, H_kv, block_size, D): `page_slots` and `row_base` take
the KV head, and `row_base` returns the base such that `base + off * stride_o + head * stride_h` is the row, in the
slot (whose only head is at offset 0) or at home. No launcher passes anything more: H_kv is in the code, and one
head's page in the host tier is PAGE rows of the row's stride.
"""
from __future__ import annotations

import typing

from .fp8 import FP8, row_width
from .kv_layout import TierView

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def page_slots(Slots, page, head, TIERED: tl.constexpr):
        """GPU slot of each page (N,) int64 (of `head`'s page with head slots): -1 when not resident. One-tier
        caches: the page itself."""
        if TIERED > 1:
            return tl.load(Slots + page * (TIERED - 1) + head).to(tl.int64)
        elif TIERED:
            return tl.load(Slots + page).to(tl.int64)
        else:
            return page

    @triton.jit
    def row_base(X, XH, page, slot, head, stride_p, stride_hp, stride_h, PAGE: tl.constexpr, TIERED: tl.constexpr):
        """Base pointer of each token's page (N,): its GPU slot in X, or (not resident) its home in the host tier.
        With head slots, less `head * stride_h`: `load_kv` adds it back (module docstring). A head's page at home is
        PAGE rows of stride_h (= the row) elements: written so, not as stride_hp / H_kv, the compiler keeps the
        16-element divisibility of the strides and vectorises the loads (a division lost it: 2.5 KB of spills in
        the block-sparse decode, scripts/compile_check.py)."""
        if TIERED > 1:
            home = XH + page * stride_hp + head * (PAGE * stride_h)
            return tl.where(slot >= 0, X + slot * stride_p, home) - head * stride_h
        elif TIERED:
            return tl.where(slot >= 0, X + slot * stride_p, XH + page * stride_hp)
        else:
            return X + page * stride_p

    @triton.jit
    def load_at(base, off, head, stride_o, stride_h, d, mask):
        """rows base[n] + off[n] of `head` for dims d -> (N, D); rows outside `mask` read as 0."""
        return tl.load(base[:, None] + off[:, None] * stride_o + head * stride_h + d[None, :], mask=mask[:, None],
                       other=0.0)

    @triton.jit
    def load_kv(base, off, head, stride_o, stride_h, d, mask, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
        """`load_at` for K/V rows. FP8 caches (fp8.py) keep each row's fp32 scale in the 4 bytes after its
        HEAD_DIM values: the row comes back dequantised (value * scale, fp32); callers cast to the query dtype."""
        x = load_at(base, off, head, stride_o, stride_h, d, mask)
        if FP8:
            sp = (base + off * stride_o + head * stride_h + HEAD_DIM).to(tl.pointer_type(tl.float32))
            sc = tl.load(sp, mask=mask, other=0.0)
            return x.to(tl.float32) * sc[:, None]
        else:
            return x


def kv_format(cache, head_dim: int) -> bool:
    """Is `cache` (pages, block_size, H_kv, row) fp8 with scales (row = head_dim + 16, fp8.py)? Raises
    ValueError for a row that fits neither format."""
    row = cache.shape[-1]
    if cache.dtype == FP8:
        if row != row_width(head_dim):
            raise ValueError(f"fp8 cache rows must hold {row_width(head_dim)} bytes for head_dim {head_dim}, got {row}")
        return True
    if row != head_dim:
        raise ValueError(f"cache rows of {row} values do not match head_dim {head_dim}")
    return False


def tier_args(cache) -> tuple:
    """(X, XH, Slots, stride_hp, TIERED) for a launcher: a `TierView` (kv_layout.py) gives its pool, host tier
    and page table; a plain (pages, block_size, H_kv, D) tensor is the one tier (the other entries are unused)."""
    from .offload_copy import kernel_arg

    if isinstance(cache, TierView):
        return cache.pool, kernel_arg(cache.host), cache.slots, cache.host.stride(0), tier_code(cache)
    return cache, cache, cache, 0, 0


def tier_code(cache) -> int:
    """The kernels' `TIERED` code of a cache (module docstring): 0, 1, or 1 + H_kv for head slots."""
    if not isinstance(cache, TierView):
        return 0
    return 1 if cache.units == 1 else 1 + cache.units


class KVArgs(typing.NamedTuple):
    """What a launcher that reads K and V through `load_kv` passes to its kernel (see `kv_args`)."""

    K: object  # the GPU pages (a one-tier cache, or the pool of slots)
    V: object
    KH: object  # host tiers (K, V): kernel arguments (UVA pointers); the caches themselves when one-tier
    VH: object
    slots: object  # page -> slot table (tiered), else unused
    stride_khp: int
    stride_vhp: int
    tiered: int  # the `TIERED` code
    fp8: bool
    page: int  # tokens per page
    num_kv_heads: int


def kv_args(q, k_cache, v_cache) -> KVArgs:
    """`tier_args` for both caches plus the checks every attention launcher makes before it launches: K and V alike,
    head_dim (q's last dim) a power of two in [16, 256], query heads a multiple of KV heads, rows contiguous.
    Raises ValueError saying what was wrong."""
    Hq, D = q.shape[-2], q.shape[-1]
    K, KH, slots, stride_khp, tiered = tier_args(k_cache)
    V, VH, _, stride_vhp, _ = tier_args(v_cache)
    fp8 = kv_format(K, D)
    if V.shape[1:] != K.shape[1:] or V.dtype != K.dtype:
        raise ValueError(f"cache shapes {tuple(K.shape)} / {tuple(V.shape)} do not match q {tuple(q.shape)}")
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {D}")
    if Hq % k_cache.shape[2]:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({k_cache.shape[2]})")
    if q.stride(-1) != 1 or K.stride(-1) != 1 or V.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous in the head dimension")
    return KVArgs(K, V, KH, VH, slots, stride_khp, stride_vhp, tiered, fp8, K.shape[1], k_cache.shape[2])
