"""kernels/kv_store.py: the fused K/V write (quantisation, one tier or host + GPU slot) against the PyTorch path of
PagedKVCache.store / OffloadedKVCache.store, byte for byte, in the interpreter (fp32, fp16 and fp8 caches)."""
import pytest
import torch

from longreach.kernels.kv_store import store_kv
from longreach.kvcache.fp8 import FP8, quantize
from longreach.kvcache.offload import OffloadedKVCache
from longreach.kvcache.paged import PagedKVCache


def _kv(T, H, D, g, dtype, strided):
    """k, v (T, H, D); `strided`: views into a wider projection output, as the model hands them over."""
    if strided:
        qkv = torch.randn(T, (3 * H + 2) * D, generator=g).to(dtype)
        k = qkv[:, 2 * D:(2 + H) * D].view(T, H, D)
        v = qkv[:, (2 + H) * D:(2 + 2 * H) * D].view(T, H, D)
        return k, v
    return torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, H, D, generator=g).to(dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, FP8])
@pytest.mark.parametrize("strided", [False, True])
def test_one_tier_store_matches_the_pytorch_path(cache_dtype, strided):
    g = torch.Generator().manual_seed(3)
    L, P, bs, H, D, T = 2, 9, 4, 3, 32, 11
    act = torch.float16 if cache_dtype == torch.float16 else torch.float32
    k, v = _kv(T, H, D, g, act, strided)
    k[0, 0] = 0.0  # an all-zero row: the scale's floor
    slots = torch.randperm(P * bs, generator=g)[:T]
    ref = PagedKVCache(L, P, bs, H, D, cache_dtype, torch.device("cpu"))
    got = PagedKVCache(L, P, bs, H, D, cache_dtype, torch.device("cpu"))
    for c in (ref, got):
        c.kv.view(torch.uint8).fill_(7)  # poison: every written byte must be the reference's, the rest untouched
    ref.store(1, k, v, slots)
    kc, vc = got.layer(1)
    store_kv(k, v, slots, kc, vc)
    assert torch.equal(got.kv.view(torch.uint8), ref.kv.view(torch.uint8))


@pytest.mark.parametrize("unit", ["page", "head"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_two_tier_store_writes_host_and_resident_slots_only(cache_dtype, unit):
    """Host rows equal the PyTorch path's; a resident page's slot equals its host page; the slots of other pages
    and the scratch slot are untouched (the PyTorch path writes non-resident rows to scratch, the kernel skips them).
    Head units (a slot per KV head's page): some pages with one head resident, one with both."""
    g = torch.Generator().manual_seed(4)
    L, P, S, bs, H, D, T = 2, 12, 5, 4, 2, 32, 17
    k, v = _kv(T, H, D, g, torch.float32, True)
    slots = torch.randperm(P * bs, generator=g)[:T]
    ref = OffloadedKVCache(L, P, S, bs, H, D, cache_dtype, torch.device("cpu"), unit=unit)
    got = OffloadedKVCache(L, P, S, bs, H, D, cache_dtype, torch.device("cpu"), unit=unit)
    resident = [(2, 0), (5, 3), (7, 1)]  # page, slot (head units: head 0 of 2, head 1 of 5, both heads of 7)
    for c in (ref, got):
        c.host.view(torch.uint8).fill_(5)
        c.pool.view(torch.uint8).fill_(9)
        if unit == "page":
            c.slot_of[1, torch.tensor([2, 5, 7])] = torch.tensor([0, 3, 1], dtype=torch.int32)
        else:
            c.slot_of[1, 2, 0], c.slot_of[1, 5, 1], c.slot_of[1, 7, 0], c.slot_of[1, 7, 1] = 0, 3, 1, 2
    if unit == "head":
        resident.append((7, 2))
    ref.store(1, k, v, slots)
    pool_before = got.pool.clone()
    store_kv(k, v, slots, got.pool[:, 0], got.pool[:, 1], host=(got.host[1, 0], got.host[1, 1]),
             slot_of=got.slot_of[1], head_slots=unit == "head")
    assert torch.equal(got.host.view(torch.uint8), ref.host.view(torch.uint8))
    assert not torch.equal(got.host.view(torch.uint8), torch.full_like(got.host.view(torch.uint8), 5))
    for page, slot in resident:
        assert torch.equal(got.pool[slot].view(torch.uint8), ref.pool[slot].view(torch.uint8))
    for slot in sorted({0, 1, 2, 3, 4} - {s for _, s in resident}) + [S]:  # free slots and the scratch slot
        assert torch.equal(got.pool[slot].view(torch.uint8), pool_before[slot].view(torch.uint8))
    if unit == "head":  # each written row of a resident head: its slot's row equals its home row
        written = 0
        for t in slots.tolist():
            for page, head, slot in ((2, 0, 0), (5, 1, 3), (7, 0, 1), (7, 1, 2)):
                if t // bs == page:
                    home = got.host[1, :, page, head, t % bs]
                    assert torch.equal(got.pool[slot, :, t % bs, 0].view(torch.uint8), home.view(torch.uint8))
                    written += 1
        assert written > 0


def test_fp8_rows_are_bit_exact_at_every_rounding_boundary():
    """Every e4m3 value and every midpoint between neighbours (ties to even), times a row maximum of 448."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = vals[~vals.isnan()].unique()
    x = torch.cat([vals, (vals[1:] + vals[:-1]) / 2, torch.tensor([448.0])])
    D = 128
    rows = x[: (x.numel() // (D - 1)) * (D - 1)].view(-1, D - 1)
    rows = torch.cat([rows, torch.full((rows.shape[0], 1), 448.0)], 1)  # scale exactly 1: values land as they are
    T = rows.shape[0]
    k = rows.view(T, 1, D)
    cache = torch.zeros(T, 1, 1, D + 16, dtype=FP8)
    store_kv(k, k, torch.arange(T), cache, cache.clone())
    assert torch.equal(cache.view(T, D + 16).view(torch.uint8), quantize(k).view(T, D + 16).view(torch.uint8))
