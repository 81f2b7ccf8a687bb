"""KV offloading (kvcache/offload.py) and the fp8 KV format (kvcache/fp8.py), on CPU.

The GPU pool is a small CPU tensor here, so every path of the store runs: misses read from the host tier, installs,
LRU eviction, write-through, prefill staging, preemption and freed sequences. The Triton kernels run in the
interpreter (fp16/fp32, and fp8 rows), reading through a page table whose "host" tier is another CPU tensor; real
UVA reads of pinned memory and bf16 are covered by tests/gpu/test_offload.py on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from longreach.kvcache.block_manager import BlockManager
from longreach.kvcache.fp8 import FP8, dequantize, quantize
from longreach.kvcache.offload import OffloadedKVCache
from tier_views import two_tiers


# ---- fp8 rows -------------------------------------------------------------------------------------------------------
def test_fp8_rows_keep_a_per_row_scale_and_three_mantissa_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.logspace(-3, 3, 7)[:, None, None]  # rows over six decades
    q = quantize(x)
    assert q.dtype == FP8 and q.shape == (7, 3, 80)
    back = dequantize(q)
    rel = (back - x).abs() / x.abs().amax(-1, keepdim=True)
    assert rel.max() <= 2 ** -4 + 1e-6  # half an e4m3 step of the row's largest value, at every magnitude
    assert torch.equal(dequantize(quantize(torch.zeros(2, 64))), torch.zeros(2, 64))  # an all-zero row stays zero


# ---- the copy kernels (interpreter) vs their references -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, FP8])
def test_copy_kernels_equal_their_references(dtype, monkeypatch):
    from longreach.kernels import offload_copy as oc

    g = torch.Generator().manual_seed(1)
    src = torch.randn(40, 3, 4, 8, generator=g).to(dtype)
    si, di = torch.randperm(40, generator=g)[:13], torch.randperm(30, generator=g)[:13]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = torch.zeros(30, 3, 4, 8).to(dtype)
    si[::4] = -1  # a negative source copies nothing
    oc.copy_chunks(src, si, got, di, 96)
    ref = torch.zeros(30, 3, 4, 8).to(dtype)
    oc.copy_chunks_reference(src, si, ref, di, 96)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert not got[di[::4]].view(torch.uint8).any() and got[di[1]].view(torch.uint8).any()
    for programs in (1, 2, 5):  # the looping variant (a background copy's small grid): tiles past n and partial
        got = torch.zeros(30, 3, 4, 8).to(dtype)
        oc.copy_chunks(src, si, got, di, 96, programs=programs)
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), programs
    big = torch.randn(6, 5000, generator=g).to(dtype)  # chunks of two 4096-element parts, the second partial
    got, ref = torch.zeros(5, 5000).to(dtype), torch.zeros(5, 5000).to(dtype)
    bs, bd = torch.tensor([4, -1, 0, 5]), torch.tensor([1, 2, 3, 0])
    oc.copy_chunks(big, bs, got, bd, 5000, programs=3)
    oc.copy_chunks_reference(big, bs, ref, bd, 5000)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    with pytest.raises(ValueError, match="at least one program"):
        oc.copy_chunks(src, si, torch.zeros(30, 3, 4, 8).to(dtype), di, 96, programs=0)
    rows = torch.randperm(120, generator=g)[:17]
    new = torch.randn(17, 4, 8, generator=g).to(dtype)
    got = torch.zeros(120, 4, 8).to(dtype)
    oc.scatter_rows(got, rows, new)
    ref = torch.zeros(120, 4, 8).to(dtype)
    oc.scatter_rows_reference(ref, rows, new)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(got[rows].view(torch.uint8), new.view(torch.uint8))


# ---- kernels reading through the page table (interpreter) ---------------------------------------------------------
@pytest.mark.parametrize("units", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, FP8])
def test_kernels_read_resident_pages_from_the_pool_and_the_rest_from_the_host(dtype, units):
    """bsa (decode, split-K), paged decode and chunk scoring give the same bits through the page table as on one
    tier; the host copies of resident pages are poisoned, so reading the wrong tier shows. `units` 2: one slot per
    KV head's page (kvcache/offload.py's head units), some heads of a page resident and others not. Head dim 32:
    exact scoring with a pruning strategy then keeps its rows as two halves (kernels/prune_stage.py, HALVES)."""
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import block_sparse_attention_triton
    from longreach.kernels.paged_decode import paged_decode
    from longreach.kernels.prune_stage import chunk_scores_triton
    from longreach.models.config import RopeConfig
    from longreach.rope.scaling import rope_inv_freq
    from longreach.rope.strategies import RopeArgs

    g = torch.Generator().manual_seed(2)
    Hq, Hkv, D, page = 4, 2, 32, 4
    L = [70, 45]
    need = [-(-x // page) for x in L]
    P = sum(need) + 2
    qdt = torch.float16 if dtype == torch.float16 else torch.float32
    mk = (lambda: quantize(torch.randn(P, page, Hkv, D, generator=g))) if dtype == FP8 else (
        lambda: torch.randn(P, page, Hkv, D, generator=g).to(dtype))
    kc, vc = mk(), mk()
    perm = torch.randperm(P, generator=g).int()
    tables = torch.zeros(2, max(need), dtype=torch.int32)
    tables[0, :need[0]], tables[1, :need[1]] = perm[:need[0]], perm[need[0]:need[0] + need[1]]
    kt, vt = two_tiers(kc, vc, g, 0.5, units)
    assert torch.equal(kt.resolve(), kc) or dtype == FP8  # the reference view agrees (fp8: bytes, below)
    assert torch.equal(kt.resolve().view(torch.uint8), kc.view(torch.uint8))

    q = torch.randn(2, Hq, D, generator=g).to(qdt)
    qb = QueryBlocks.build([1, 1], [L[0] - 1, L[1] - 1], 1)
    sels = [torch.stack([torch.randperm(-(-L[i] // 8), generator=g)[:3] for _ in range(Hkv)]) for i in range(2)]
    blocks, counts = SparseIndex.pack(sels, "cpu")
    idx = SparseIndex(1, 8, 4, 8, Hkv, qb, blocks, counts)
    for splits in (1, 3):
        a, _ = block_sparse_attention_triton(q, kc, vc, tables, idx, D ** -0.5, num_splits=splits)
        b, _ = block_sparse_attention_triton(q, kt, vt, tables, idx, D ** -0.5, num_splits=splits)
        assert torch.equal(a, b), splits
    sl = torch.tensor(L, dtype=torch.int32)
    a, _ = paged_decode(q, kc, vc, tables, sl, D ** -0.5, num_splits=2)
    b, _ = paged_decode(q, kt, vt, tables, sl, D ** -0.5, num_splits=2)
    assert torch.equal(a, b)
    one = torch.zeros(1, dtype=torch.long)
    rt = RopeArgs("rt", rope_inv_freq(RopeConfig(theta=10000.0), D)[0], rope_from=16, n_window=8)
    for exact, chunk, rope in ((False, 8, None), (True, 4, None), (True, 4, rt)):
        ids = torch.arange(L[0] // chunk, dtype=torch.int32)[None, None].expand(1, Hkv, -1)
        end = torch.tensor([L[0] - 8])
        a = chunk_scores_triton(q[:1], kc, tables[0], one, one + 1, end, ids, chunk, exact, 4, Hkv, max_rows=1,
                                rope=rope)
        b = chunk_scores_triton(q[:1], kt, tables[0], one, one + 1, end, ids, chunk, exact, 4, Hkv, max_rows=1,
                                rope=rope)
        assert torch.equal(a, b), (exact, rope)


def test_fp8_kernels_match_the_dequantising_references():
    """The kernels dequantise fp8 rows on load exactly as the references do (interpreter, fp32 queries)."""
    from longreach.attention.executor import block_sparse_attention
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import block_sparse_attention_triton
    from longreach.kernels.paged_decode import paged_decode, paged_decode_reference

    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D, page, P = 4, 2, 16, 4, 30
    kc, vc = quantize(torch.randn(P, page, Hkv, D, generator=g)), quantize(torch.randn(P, page, Hkv, D, generator=g))
    tables = torch.randperm(P, generator=g).int()[:28].view(2, 14)
    q = torch.randn(2, Hq, D, generator=g)
    sl = torch.tensor([53, 40], dtype=torch.int32)
    a, _ = paged_decode(q, kc, vc, tables, sl, D ** -0.5, num_splits=2)
    r, _ = paged_decode_reference(q, kc, vc, tables, sl, D ** -0.5)
    assert (a - r).abs().max() < 1e-5
    qb = QueryBlocks.build([1, 1], [52, 39], 1)
    sels = [torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(Hkv)]) for _ in range(2)]
    blocks, counts = SparseIndex.pack(sels, "cpu")
    idx = SparseIndex(1, 8, 4, 8, Hkv, qb, blocks, counts)
    a, _ = block_sparse_attention_triton(q, kc, vc, tables, idx, D ** -0.5, num_splits=2)
    r, _ = block_sparse_attention(q, kc, vc, tables, idx, D ** -0.5)
    assert (a - r).abs().max() < 1e-5


# ---- the store's bookkeeping ---------------------------------------------------------------------------------------
def _store(pages=24, slots=5, layers=2, bs=4, dtype=torch.float32, unit="page"):
    return OffloadedKVCache(layers, pages + 1, slots, bs, 2, 8, dtype, torch.device("cpu"), staging_pages=pages + 4,
                            unit=unit)


def test_reads_are_installed_lru_evicts_and_nothing_is_lost():
    st = _store()
    blocks = BlockManager(24, 4, on_free=st.free_pages)
    assert blocks.ensure(7, 40)  # 10 pages
    table = torch.tensor([blocks.table(7)], dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    for layer in range(2):
        k, v = torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)
        st.store(layer, k, v, table[0].long().repeat_interleave(4) * 4 + torch.arange(40) % 4)
    seq, pos = torch.zeros(1, dtype=torch.long), torch.tensor([39])
    sel = torch.tensor([[[1, 3]]])  # key blocks of 4 tokens: pages 1 and 3
    st.note_reads(0, table, seq, pos, pos, 1, sel, 4, 4, 8)  # + sink page 0, window [32, 39]: pages 8 and 9
    c = st.end_step()
    assert c == {"hit": 0, "missed": 5, "evicted": 0, "installed": 5}
    st.check_integrity()
    st.note_reads(0, table, seq, pos, pos, 1, sel, 4, 4, 8)
    assert st.end_step() == {"hit": 5, "missed": 0, "evicted": 0, "installed": 0}
    st.note_reads(1, table, seq, pos, pos, 1, torch.tensor([[[5]]]), 4, 0, 0)  # layer 1, page 5: evicts the LRU slot
    assert st.end_step() == {"hit": 0, "missed": 1, "evicted": 1, "installed": 1}
    st.check_integrity()
    pages = list(blocks.table(7))
    blocks.free(7)  # the freed pages give their slots back
    assert not bool((st.slot_of.view(-1)[torch.tensor([pages[1], 24 + 1 + pages[5]])] >= 0).any())
    assert st.stats()["gpu_slots_used"] == 0
    st.check_integrity()


def test_head_units_install_only_the_heads_that_read():
    """With a slot per KV head's page, a selection whose two KV heads read different pages installs each head's
    own pages, not both heads of each: 1/H_kv of the bytes page units install; the sink and window pages install
    both heads (every head reads them). Writes reach the resident heads' slots and the host tier."""
    counts = {}
    for unit in ("page", "head"):
        st = _store(slots=40, unit=unit)
        table = torch.arange(12, dtype=torch.int32)[None]
        g = torch.Generator().manual_seed(9)
        st.store(0, torch.randn(48, 2, 8, generator=g), torch.randn(48, 2, 8, generator=g), torch.arange(48))
        seq, pos = torch.zeros(1, dtype=torch.long), torch.tensor([47])
        sel = torch.tensor([[[1, 3], [5, 7]]])  # group 0 (KV head 0): pages 1, 3; group 1 (head 1): pages 5, 7
        st.note_reads(0, table, seq, pos, pos, 1, sel, 4, 4, 4)  # + sink page 0 and window page 11, both heads
        counts[unit] = (st.end_step(), st.counters["bytes_h2d"])
        st.check_integrity()
        if unit == "head":
            assert (st.slot_of[0, [1, 3], 0] >= 0).all() and (st.slot_of[0, [1, 3], 1] < 0).all()
            assert (st.slot_of[0, [5, 7], 1] >= 0).all() and (st.slot_of[0, [5, 7], 0] < 0).all()
            assert (st.slot_of[0, [0, 11]] >= 0).all()
            st.store(0, torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8, generator=g), torch.tensor([4]))
            st.check_integrity()  # page 1: head 0's slot written through, head 1 at home only
    assert counts["page"][0] == {"hit": 0, "missed": 6, "evicted": 0, "installed": 6}
    assert counts["head"][0] == {"hit": 0, "missed": 8, "evicted": 0, "installed": 8}
    assert counts["head"][1] * 3 == counts["page"][1] * 2  # 8 head-pages of half a page against 6 whole pages


def test_a_step_never_evicts_what_it_reads_itself():
    st = _store(slots=3)
    table = torch.arange(12, dtype=torch.int32)[None]
    seq, pos = torch.zeros(1, dtype=torch.long), torch.tensor([47])
    st.note_reads(0, table, seq, pos, pos, 1, torch.tensor([[[0, 2, 4, 6, 8]]]), 4, 0, 0)
    c = st.end_step()
    assert c["missed"] == 5 and c["installed"] == 3 and c["evicted"] == 0  # the other two stay on the host
    st.check_integrity()


def test_install_reads_installs_a_stage_candidates_inside_the_step():
    """`install_reads` (a selection stage's candidates installed before it scores them, inside the step): the
    head-pages of the candidate chunks become resident and equal their host copies; each unit once (two groups of
    one KV head, chunks smaller than a page); slots read in the previous step or stamped in this one are never
    victims (a clock over the rest, free slots first); what finds no victim stays at home; `end_step` counts the
    early installs as misses installed; page units install nothing here."""
    from longreach.kvcache.base import PageReads

    def probe(layer, blocks, chunk=8):
        return PageReads(layer, table, seq, pos, pos, 1, torch.tensor(blocks), chunk, 0, 0, probe=True)

    table = torch.arange(12, dtype=torch.int32)[None]
    seq, pos = torch.zeros(1, dtype=torch.long), torch.tensor([47])  # 48 tokens: pages 0..11 of 4 tokens
    page_store = _store(slots=6, unit="page")
    page_store.install_reads(probe(0, [[[0, 1], [2, 3]]]))
    assert int((page_store.slot_of >= 0).sum()) == 0
    st = _store(slots=6, unit="head")
    g = torch.Generator().manual_seed(3)
    for layer in range(2):
        st.store(layer, torch.randn(48, 2, 8, generator=g), torch.randn(48, 2, 8, generator=g), torch.arange(48))
    # 2 groups (one per KV head): chunks of 8 tokens = 2 pages; group 0 reads chunk 1 (pages 2, 3) on head 0, group 1
    # chunks 1 and 5 (pages 2, 3, 10, 11) on head 1; a -1 candidate is nothing
    st.install_reads(probe(0, [[[1, -1], [1, 5]]]))
    assert st.slot_of[0, [2, 3], 0].ge(0).all() and st.slot_of[0, [2, 3, 10, 11], 1].ge(0).all()
    assert int((st.slot_of >= 0).sum()) == 6 and int(st.stats()["gpu_slots_used"]) == 6
    assert st.end_step() == {"hit": 0, "missed": 6, "evicted": 0, "installed": 6}
    assert st.counters["pages_installed"] == st.counters["pages_installed_in_step"] == 6
    st.check_integrity()  # (between steps: the installed units are marked read until `end_step`)
    # step 1: every slot was stamped in step 0 (the previous step): none is a victim, nothing is installed
    st.install_reads(probe(1, [[[0], [0]]]))
    assert int((st.slot_of[1] >= 0).sum()) == 0
    assert st.end_step()["installed"] == 0
    st.check_integrity()
    # step 2: the slots of step 0 are old now; the resident units are stamped first (never victims), the clock
    # evicts the others for the new ones; two groups of one KV head (4 groups, 2 heads) ask for each unit once
    st.install_reads(probe(0, [[[1], [1], [0], [0]]], chunk=4))  # head 0: page 1; head 1: page 0
    assert int(st.slot_of[0, 1, 0]) >= 0 and int(st.slot_of[0, 0, 1]) >= 0
    assert int((st.slot_of >= 0).sum()) == 6  # two evicted, two installed
    c = st.end_step()
    st.check_integrity()
    assert c["installed"] == 2 and c["evicted"] == 2 and c["missed"] == 2
    assert st.counters["pages_installed"] == 8 and st.counters["bytes_h2d"] == 8 * st.slot_nbytes


def test_install_ahead_reserves_in_the_step_copies_after_and_activates_later():
    """`PageReads.ahead` (kvcache/prefetch.py): the units are reserved inside the step (victims from the clock, old
    owners out of the table, the slots marked reserved: no read reaches them, the after-step LRU never takes them),
    copied after it and put in the table at a later `end_step`; at most one reservation in flight (a second one in
    the meantime reserves nothing); a unit read and installed after a step meanwhile keeps that slot and its
    reserved one is freed; freeing pages settles the copy first. The table only ever points at the unit's bytes."""
    from longreach.kvcache.base import PageReads
    from longreach.kvcache.prefetch import RESERVED

    table = torch.arange(12, dtype=torch.int32)[None]
    seq, pos = torch.zeros(1, dtype=torch.long), torch.tensor([47])

    def probe(layer, blocks, ahead=True):
        return PageReads(layer, table, seq, pos, pos, 1, torch.tensor(blocks), 8, 0, 0, probe=True, ahead=ahead)

    st = _store(slots=6, unit="head")
    blocks = BlockManager(24, 4, on_free=st.free_pages)
    assert blocks.ensure(3, 48) and blocks.table(3) == list(range(12))
    g = torch.Generator().manual_seed(5)
    for layer in range(2):
        st.store(layer, torch.randn(48, 2, 8, generator=g), torch.randn(48, 2, 8, generator=g), torch.arange(48))
    st.note_reads(0, table, seq, pos, pos, 1, torch.tensor([[[0, 1], [0, 1]]]), 4, 0, 0)  # pages 0, 1: 4 units
    st.end_step()
    st.end_step()  # step 1 reads nothing: step 0's slots are old enough to be victims from step 2 on
    # step 2: layer 0's chunk 1 (pages 2, 3) on both heads, 4 units, reserved: the 2 free slots and 2 of step 0's
    st.install_reads(probe(0, [[[1], [1]]]))
    assert int((st.slot_of >= 0).sum()) == 2  # the new units are not in the table, and the 2 evicted no longer
    assert int((st.stamp == RESERVED).sum()) == 4 and int((st.owner >= 0).sum()) == 2
    st.note_reads(1, table, seq, pos, pos, 1, torch.tensor([[[5], [5]]]), 4, 0, 0)  # layer 1 page 5, both heads
    c = st.end_step()  # installs layer 1's two units (into the 2 unreserved slots), launches the copy
    st.check_integrity()
    assert c["evicted"] == 2 + 2 and c["installed"] == 2 and st.prefetch.in_flight
    assert int((st.slot_of[0] >= 0).sum()) == 0 and int((st.stamp == RESERVED).sum()) == 4
    # step 3: another reservation while one is in flight reserves nothing; an attention read of page 2, head 0 (a
    # reserved unit) is installed after the step into a slot of its own (a layer-1 unit out: the only victim that
    # is not reserved); then the copy is activated, and page 2 head 0's reserved slot freed
    st.install_reads(probe(1, [[[3], [3]]]))
    assert int((st.stamp == RESERVED).sum()) == 4
    st.note_reads(0, table, seq, pos, pos, 1, torch.tensor([[[2], [-1]]]), 4, 0, 0)
    c = st.end_step()
    assert not st.prefetch.in_flight and c["installed"] == 1 + 3 and c["evicted"] == 1
    assert st.counters["pages_installed_ahead"] == 3
    assert bool((st.slot_of[0, [2, 3]] >= 0).all()) and int((st.stamp == RESERVED).sum()) == 0
    assert int((st.owner >= 0).sum()) == 5  # a layer-1 unit, page 2 head 0 once, the other three ahead
    st.check_integrity()
    # step 4: a reservation in flight when the sequence is freed: the copy is settled, then every slot given back
    st.install_reads(probe(0, [[[5], [5]]]))
    st.end_step()
    assert st.prefetch.in_flight
    blocks.free(3)
    assert not st.prefetch.in_flight and int((st.owner >= 0).sum()) == 0 and int((st.stamp == RESERVED).sum()) == 0
    st.check_integrity()
    # free slots to spare: a second reservation while the first is in flight still reserves nothing
    st = _store(slots=12, unit="head")
    st.install_reads(probe(0, [[[1], [1]]]))
    st.end_step()
    st.install_reads(probe(0, [[[4], [4]]]))
    assert int((st.stamp == RESERVED).sum()) == 4 and st.prefetch.in_flight
    st.end_step()
    st.check_integrity()
    assert int((st.owner >= 0).sum()) == 4 and not st.prefetch.in_flight


@pytest.mark.parametrize("unit", ["page", "head"])
def test_integrity_check_catches_a_corrupted_table_and_a_stale_slot(unit):
    st = _store(unit=unit)
    table = torch.arange(12, dtype=torch.int32)[None]
    st.store(0, torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.arange(4))
    st.note_reads(0, table, torch.zeros(1, dtype=torch.long), torch.tensor([3]), torch.tensor([3]), 1,
                  torch.tensor([[[0]]]), 4, 0, 0)
    st.end_step()
    st.check_integrity()
    first = st.slot_of[0, 0].reshape(-1)[0].long()
    st.pool[first, 0, 0, 0, 0] += 1  # a slot that no longer equals its page's home
    with pytest.raises(AssertionError, match="differs from the host copy"):
        st.check_integrity()
    st.pool[first, 0, 0, 0, 0] -= 1
    st.slot_of[1, 3] = st.slot_of[0, 0]  # two pages on one slot
    with pytest.raises(AssertionError, match="one GPU slot"):
        st.check_integrity()


def test_page_table_under_random_operations():
    """Random alloc / write / read / free sequences over several sequences and both layers: after every step the
    table and its inverse agree and every resident slot equals its host page (check_integrity)."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st_

    ops = st_.lists(st_.tuples(st_.sampled_from(["grow", "read", "free"]), st_.integers(0, 3), st_.integers(1, 30),
                               st_.integers(0, 1)), min_size=1, max_size=40)

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(ops, st_.sampled_from(["page", "head"]))
    def run(seq_ops, unit):
        st = _store(pages=20, slots=4, bs=2, unit=unit)
        blocks = BlockManager(20, 2, on_free=st.free_pages)
        lens: dict[int, int] = {}
        g = torch.Generator().manual_seed(5)
        for op, sid, n, layer in seq_ops:
            if op == "grow":
                new = lens.get(sid, 0) + n
                if blocks.ensure(sid, new):
                    t = torch.arange(lens.get(sid, 0), new)
                    tab = torch.tensor(blocks.table(sid))
                    for lay in range(2):
                        st.store(lay, torch.randn(len(t), 2, 8, generator=g), torch.randn(len(t), 2, 8, generator=g),
                                 tab[t // 2] * 2 + t % 2)
                    lens[sid] = new
            elif op == "read" and lens.get(sid):
                L = lens[sid]
                tab = torch.tensor([blocks.table(sid)], dtype=torch.int32)
                nblk = -(-L // 2)
                sel = torch.randperm(nblk, generator=g)[: min(3, nblk)].sort().values[None, None]
                sel = sel if layer == 0 else torch.cat([sel, sel.flip(-1)], 1)  # layer 1: a group per KV head
                pos = torch.tensor([L - 1])
                st.note_reads(layer, tab, torch.zeros(1, dtype=torch.long), pos, pos, 1, sel, 2, 2, 2)
                c = st.end_step()
                assert c["hit"] + c["missed"] >= 1 and c["installed"] <= c["missed"]
            elif op == "free" and sid in lens:
                blocks.free(sid)
                del lens[sid]
            st.check_integrity()
            blocks.check_integrity()
    run()


@pytest.mark.parametrize("block_k,bs,n_sink,n_window,max_rows,chunk,unit,G", [
    (8, 16, 4, 64, 1, 1024, "page", 2), (64, 16, 64, 1024, 1, 1024, "page", 2), (16, 16, 0, 0, 1, 1024, "page", 2),
    (64, 16, 16, 40, 64, 1024, "page", 2), (64, 16, 16, 40, 1, 4, "page", 2), (16, 16, 0, 8, 1, 2, "page", 2),
    (8, 16, 4, 64, 1, 1024, "head", 2), (64, 16, 16, 40, 64, 1024, "head", 1), (16, 16, 0, 8, 1, 2, "head", 4)])
def test_mark_reads_kernel_marks_the_pages_the_pytorch_path_marks(block_k, bs, n_sink, n_window, max_rows, chunk,
                                                                    unit, G):
    """kernels/page_reads.py (the GPU's note_reads) in the interpreter: the same `wanted` bits as the PyTorch
    note_reads, for random query blocks (several sequences, positions near the start and far in, selections with
    -1 padding, block tables with padding pointing at the scratch page). A small `chunk` spreads a selection over
    several programs (grid axis 2), as a 1M-token PSA step's 65K ranked blocks are."""
    from longreach.kernels.page_reads import mark_reads

    g = torch.Generator().manual_seed(block_k + n_window)
    L, P, W, B, K = 3, 200, 40, 3, 6
    st = OffloadedKVCache(L, P, 4, bs, 2, 8, torch.float32, torch.device("cpu"), unit=unit)
    tables = torch.randint(0, P - 1, (B, W), generator=g, dtype=torch.int32)
    tables[2, 30:] = P - 1  # a padded row's tail: the scratch page is never marked
    nb = 64
    seq = torch.randint(0, B, (nb,), generator=g)
    last = torch.randint(0, W * bs, (nb,), generator=g)
    last[0] = 3
    first = (last - torch.randint(0, max_rows, (nb,), generator=g)).clamp(min=0)
    nblk = -(-(W * bs) // block_k)
    blocks = torch.randint(-1, nblk, (nb, G, K), generator=g)
    blocks[::3] = -1  # every third block selected nothing: its marks are the sink's and the window's alone
    for part in [slice(i, i + 1) for i in range(nb)] + [slice(0, nb)]:  # each block alone, then all together
        st.wanted.zero_()
        st.note_reads(1, tables, seq[part], first[part], last[part], max_rows, blocks[part], block_k, n_sink,
                      n_window)
        want = st.wanted.clone()
        want[-1] = False  # the PyTorch path's trash entry
        got = torch.zeros_like(st.wanted)
        mark_reads(got, 1, P, tables, seq[part], first[part], last[part], max_rows, blocks[part].to(torch.int32),
                   block_k, bs, n_sink, n_window, chunk, units=st.units)
        assert torch.equal(got, want), (part, got.nonzero().squeeze(1).tolist(), want.nonzero().squeeze(1).tolist())
    assert got.any()


# ---- the prefill staging area: one buffer, or two with the next layer gathered ahead ------------------------------
def test_page_runs_join_pages_consecutive_on_both_sides():
    from longreach.kvcache.staging import page_runs

    assert page_runs([5, 6, 7, 2, 3, 9], [0, 1, 2, 3, 4, 5]) == [(5, 0, 3), (2, 3, 2), (9, 5, 1)]
    assert page_runs([4, 5], [0, 2]) == [(4, 0, 1), (5, 2, 1)]  # consecutive sources, places apart
    assert page_runs([], []) == []


@pytest.mark.parametrize("runs", [True, False], ids=["runs", "copy-kernel"])
@pytest.mark.parametrize("unit", ["page", "head"])
def test_double_buffered_staging_gives_every_layer_its_own_prefix(monkeypatch, unit, runs):
    """Three layers of a two-sequence prefill step (prefixes off the page boundaries, one table in two runs): with
    two staging buffers each layer's attention sees exactly what the one-buffer store shows it (its own prefix, this
    chunk's rows), both by runs of consecutive pages and, with MAX_DMA_RUNS 0, by the copy kernel."""
    from longreach.attention.backend import AttentionMetadata
    from longreach.kvcache import staging

    if not runs:
        monkeypatch.setattr(staging, "MAX_DMA_RUNS", 0)
    L, bs, H, D = 3, 4, 2, 8
    tables = [[9, 10, 11, 3, 4, 5, 6], [14, 15, 16]]
    ctx, q = [17, 6], [5, 4]
    g = torch.Generator().manual_seed(3)
    homes = [(torch.randn(64, H, D, generator=g), torch.randn(64, H, D, generator=g)) for _ in range(L)]
    new = [(torch.randn(sum(q), H, D, generator=g), torch.randn(sum(q), H, D, generator=g)) for _ in range(L)]
    slot_map = torch.tensor([tables[i][p // bs] * bs + p % bs for i in range(2) for p in range(ctx[i], ctx[i] + q[i])])
    seen = {}
    for nbuf in (1, 2):
        st = OffloadedKVCache(L, 20, 6, bs, H, D, torch.float32, torch.device("cpu"), staging_pages=16, unit=unit,
                              staging_buffers=nbuf)
        for layer, (k, v) in enumerate(homes):  # pages 0-15: the earlier tokens of both tables' pages
            st.store(layer, k, v, torch.arange(64))
        qsl = torch.tensor([0, q[0], sum(q)], dtype=torch.int32)
        meta = AttentionMetadata(True, [0, 1], q, ctx, qsl, torch.tensor([c + n for c, n in zip(ctx, q)]),
                                 torch.zeros(2, 7, dtype=torch.int32), slot_map, 22, 5)
        view = st.prefill_view(meta, tables)
        assert (view.runs is not None) == runs
        backend = type("Record", (), {"forward": lambda self, layer, q_, k_, v_, kc, vc, m: (kc.clone(), vc.clone(),
                                                                                            m.block_tables)})()
        seen[nbuf] = [view.attention(layer, None, *new[layer], backend) for layer in range(L)]
        assert len(st._staging) == nbuf
    for nbuf in (1, 2):  # every token a query of the step sees: its layer's home row, or this chunk's new row
        for layer, (kc, vc, t) in enumerate(seen[nbuf]):
            row = 0
            for i in range(2):
                for pos in range(ctx[i] + q[i]):
                    place = (int(t[i, pos // bs]), pos % bs)
                    if pos < ctx[i]:
                        home = tables[i][pos // bs] * bs + pos % bs
                        want = homes[layer][0][home], homes[layer][1][home]
                    else:
                        want = new[layer][0][row], new[layer][1][row]
                        row += 1
                    assert torch.equal(kc[place], want[0]) and torch.equal(vc[place], want[1]), (nbuf, layer, i, pos)
