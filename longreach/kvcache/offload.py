"""The two-tier KV cache: every page's home in (pinned) host memory, copies of the hot ones in one GPU pool.

Design (docs/offload.md has the byte budgets and the measurements):
  * **Host tier, the store of record**: (L, 2, P, block_size, H_kv, D), pinned. The block manager's page ids are
    host pages, so a sequence's block table means the same thing with offloading on or off.
  * **GPU pool**: (S + 1, 2, block_size, H_kv, D) slots shared by *all* layers (PSA's unified pool: a layer that reads
    more pages holds more slots). A slot holds one layer's page (K and V). Slot S is scratch: the PyTorch write path
    sends writes to pages that are not resident there (the GPU's fused write, kernels/kv_store.py, skips them).
  * **Unit** (`unit`, docs/design-offload-heads.md): "page", a slot holds a page of every KV head (above); or "head",
    a slot holds one KV head's page, (S + 1, 2, block_size, 1, D), the host tier keeps each page's heads one after
    another, (L, 2, P, H_kv, block_size, D), and every per-page array below has one entry per page and head
    (`units` = H_kv): a selection that reads one head's 8 tokens installs that head's page, not all 8 heads'.
  * **Page table** `slot_of` (L, P) int32 on the GPU (head units: (L, P, H_kv)): the slot of (layer, page), or -1.
    `owner` (S,) is its inverse (the flat index layer * P + page, or (layer * P + page) * H_kv + head; -1 for a free
    slot); `stamp` (S,) the last decode step the slot was read (LRU).
  * **Writes are write-through**: new K/V goes to the host tier (a kernel writing host memory directly) and, when the
    page is resident, to its slot. Eviction therefore never writes back and never loses anything, and a page's one
    home is always current. This replaces "flush when a page fills" with no dirty state at the cost of writing every
    token over PCIe once (128 KiB per token for an 8B model in bf16: ~2.5 us of PCIe per decode token).
  * **Reads**: kernels read a resident page from its slot and a missing page straight from host memory (UVA
    zero-copy, kernels/paged.py), so a miss costs PCIe latency, never a host round trip, and decode stays
    graph-capturable.
  * **What gets installed**: the pages the block-sparse attention of a decode step reads (sink, window and selected
    blocks: the backend returns the index it attended as `PageReads` and the runner hands it to `record_reads`).
    After the step, `end_step` stamps the hits and installs the misses into free or least-recently-used slots
    (never a slot read in this step). Dense reads pass
    through uncached, and so do the pruning stages' probes with page units (a stage-0 SelectRep refresh touches a few
    keys of every chunk of the context and would flush the pool for one use); with head units infinitehip's
    chunk-scored stages report their probes (`PageReads.probe`) and those head-pages are installed too.
  * **Installs inside the step** (`install_reads`, head units): when infinitehip rescored stage 0 in a decode step,
    each layer installs its new stage-1 candidates before scoring them (a fixed-width clock over the slots and one
    copy, captured in the step), so their keys cross PCIe once (docs/design-refresh-installs.md, option 2).
  * **Prefill** reads the prefix from a GPU staging area (kvcache/staging.py, `StagedPrefill`): per layer, the
    batch's pages are gathered from the host tier in one copy, then the ordinary kernels run on it. With two staging
    buffers (`staging_buffers`, a GPU's default: kvcache/build.py) the next layer's prefix is gathered into one on a
    copy stream while this layer's attention reads the other. The area exists only while prefill work is pending:
    the first decode step releases it (`release_staging`) and the next prefill step allocates it again.
    No state for selection is kept on the GPU besides the pool: InfiniteHiP's stage masks are cached per sequence by
    the backend (block ids, not keys).

Counters (`stats()`): pages hit / missed / evicted / installed and bytes copied host -> GPU by installs, cumulative.
Mutates: `store`, `record_reads` / `note_reads`, `end_step`, `free_pages`. Not thread-safe; the engine calls it from its
one loop. Sized and built by kvcache/build.py (`build_offloaded_cache`).
"""
from __future__ import annotations

import torch

from ..kernels import kv_store, page_reads, use_triton
from ..kernels.kv_layout import TierView, as_tensor  # noqa: F401 (as_tensor: re-exported for the store's readers)
from ..kernels.offload_copy import copy_chunks, scatter_rows
from .base import PageReads
from .fp8 import as_bytes, encode, row_bytes, row_elems
from .pinned import pinned_empty
from .read_units import attended_units, probe_units
from .prefetch import RESERVED, Prefetcher
from .staging import StagedPrefill


UNITS = ("page", "head")  # what one GPU slot holds: a page of every KV head, or of one


class OffloadedKVCache:
    wants_reads = True  # it installs on the GPU the pages decode attention read (`record_reads`, `end_step`)
    window, window_layers = None, frozenset()  # no ring of sliding-window layers here (kvcache/window.py wraps one)

    def __init__(self, num_layers: int, num_pages: int, num_slots: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, staging_pages: int = 0, unit: str = "page",
                 staging_buffers: int = 1):
        if num_slots < 1:
            raise ValueError(f"the GPU page pool needs at least one slot, got {num_slots}")
        if unit not in UNITS:
            raise ValueError(f"the offload unit must be one of {', '.join(UNITS)}, got {unit!r}")
        L, P, S, H = num_layers, num_pages, num_slots, num_kv_heads
        self.num_layers, self.num_pages, self.num_slots = L, P, S
        self.num_blocks, self.block_size = num_pages, block_size  # PagedKVCache's names
        self.num_kv_heads, self.unit = H, unit
        self.units = U = H if unit == "head" else 1  # slots a page of one layer can take
        self.device = device
        pin = device.type == "cuda"
        row = row_elems(head_dim, dtype)  # fp8: values + scale (kernels/fp8.py)
        shape = (L, 2, P, block_size, H, row) if U == 1 else (L, 2, P, H, block_size, row)
        self.host = pinned_empty(shape, dtype, self) if pin else torch.empty(shape, dtype=dtype)
        self.pool = torch.zeros(S + 1, 2, block_size, H // U, row, dtype=dtype, device=device)
        # each with one trash entry past its end (a fixed-width install's unused entries write there):
        # slot_of's at L * P * U, owner's and stamp's at S (the scratch slot)
        self._slot_all = torch.full((L * P * U + 1,), -1, dtype=torch.int32, device=device)
        self.slot_of = self._slot_all[:-1].view((L, P) if U == 1 else (L, P, U))
        self._owner_all = torch.full((S + 1,), -1, dtype=torch.long, device=device)
        self._stamp_all = torch.full((S + 1,), -1, dtype=torch.long, device=device)
        self.owner, self.stamp = self._owner_all[:S], self._stamp_all[:S]
        # `install_reads` (inside a step): this step's number on the device, the clock hand over the slots, and the
        # units it installed / evicted since the last `end_step`
        self.step_t = torch.zeros((), dtype=torch.long, device=device)
        self._hand = torch.zeros((), dtype=torch.long, device=device)
        self._now = torch.zeros(3, dtype=torch.long, device=device)  # installed, evicted, reserved (prefetch.py)
        # units read by this step's attention, flat ((layer * P + page) * U + head), plus one trash entry for
        # masked-out reads
        self.wanted = torch.zeros(L * P * U + 1, dtype=torch.bool, device=device)
        self.page_elems = block_size * H * row  # one page of one layer's K (or V), every head
        self.slot_elems = self.page_elems // U  # what one slot holds of K (or V)
        if staging_buffers not in (1, 2):
            raise ValueError(f"the prefill staging area has 1 or 2 buffers, got {staging_buffers}")
        self.staging_pages = staging_pages  # capacity of one prefill staging buffer (allocated on first use)
        # two buffers: a prefill step gathers the next layer's prefix into one while this layer's attention reads the
        # other (staging.py, `StagedPrefill`); their copies run on a stream of their own (`copy_stream`)
        self.staging_buffers = staging_buffers
        self._staging: list[torch.Tensor] | None = None
        self._copy_stream = None
        self.step = 0
        # pages_installed_in_step: of pages_installed, those `install_reads` installed inside a step (the rest after
        # one, by `end_step`)
        # pages_installed_ahead: of pages_installed, those copied in the background after a reservation (prefetch.py)
        self.counters = {"pages_hit": 0, "pages_missed": 0, "pages_evicted": 0, "pages_installed": 0,
                         "pages_installed_in_step": 0, "pages_installed_ahead": 0, "bytes_h2d": 0}
        self.prefetch = Prefetcher(self)  # installs ahead: reserved in a step, copied while later steps run

    @staticmethod
    def bytes_per_page(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Host bytes of one page of every layer (what the block manager hands out)."""
        return num_layers * 2 * block_size * num_kv_heads * row_bytes(head_dim, dtype)

    @staticmethod
    def bytes_per_slot(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       unit: str = "page") -> int:
        """GPU bytes of one slot: one layer's page, K and V (of one KV head with `unit` "head")."""
        return 2 * block_size * (1 if unit == "head" else num_kv_heads) * row_bytes(head_dim, dtype)

    @property
    def slot_nbytes(self) -> int:
        """GPU bytes of one of this store's slots."""
        return 2 * self.slot_elems * self.pool.element_size()

    @property
    def nbytes(self) -> int:
        """GPU bytes: the pool and the page-table arrays."""
        return (self.pool.numel() * self.pool.element_size() + self.slot_of.numel() * 4
                + (self.owner.numel() + self.stamp.numel()) * 8 + self.wanted.numel())

    @property
    def host_nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    # ---- the engine's view (PagedKVCache's interface) ---------------------------------------------------------------
    def layer(self, layer: int) -> tuple[TierView, TierView]:
        U = self.units
        return (TierView(self.pool[:, 0], self.host[layer, 0], self.slot_of[layer], U),
                TierView(self.pool[:, 1], self.host[layer, 1], self.slot_of[layer], U))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write k, v (T, H_kv, D) at token slots (T,) (page * block_size + offset) of `layer`: into the host tier,
        and into the page's GPU slot when it is resident. No host sync (graph-capturable)."""
        if use_triton(self.pool):  # one kernel: quantise, write through, write the resident slot (kernels/kv_store.py)
            return kv_store.store_kv(k, v, slot_mapping, self.pool[:, 0], self.pool[:, 1],
                                     host=(self.host[layer, 0], self.host[layer, 1]), slot_of=self.slot_of[layer],
                                     head_slots=self.units > 1)
        P, bs, U = self.num_pages, self.block_size, self.units
        t = slot_mapping.long()
        page, off = t // bs, t % bs
        k, v = encode(k, self.pool.dtype), encode(v, self.pool.dtype)
        if U == 1:
            for kv, x in ((0, k), (1, v)):
                scatter_rows(self.host, ((layer * 2 + kv) * P * bs) + t, x)
            slot = self.slot_of[layer][page].long()
            slot = torch.where(slot >= 0, slot, self.num_slots)  # not resident: the scratch slot
            rows = as_bytes(self.pool).view(-1, *self.pool.shape[3:])  # ((S + 1) * 2 * bs, H_kv, row)
            rows.index_copy_(0, (slot * 2) * bs + off, as_bytes(k))
            rows.index_copy_(0, (slot * 2 + 1) * bs + off, as_bytes(v))
            return
        # head slots: a row per (token, head), at home ((layer, kv, page, head) pages of bs rows) and in its slot
        T = k.shape[0]
        h = torch.arange(U, device=t.device)
        home = ((page[:, None] * U + h) * bs + off[:, None]).reshape(-1)  # (T * U,) rows of one (layer, kv)
        slot = self.slot_of[layer][page].long()  # (T, U)
        slot = torch.where(slot >= 0, slot, self.num_slots).reshape(-1)
        rows = as_bytes(self.pool).view(-1, *self.pool.shape[4:])  # ((S + 1) * 2 * bs, row)
        for kv, x in ((0, k), (1, v)):
            scatter_rows(self.host, (layer * 2 + kv) * P * U * bs + home, x.reshape(T * U, 1, -1))
            rows.index_copy_(0, (slot * 2 + kv) * bs + off.repeat_interleave(U), as_bytes(x).reshape(T * U, -1))

    def gather_pages(self, layer: int, pages: torch.Tensor, dst_pos: torch.Tensor, dst: torch.Tensor,
                     runs: list[tuple[int, int, int]] | None = None) -> None:
        """dst (2, n, ...) contiguous, n pages of the host tier's layout: dst[:, dst_pos[i]] = the layer's page
        pages[i], from the host tier (always current). One copy kernel for the whole prefix (prefill staging), or,
        with `runs` ((first page, first place, count): the same pages as runs of consecutive ones), one copy of each
        run's K and V (on a GPU, the copy engine's DMA: no SMs taken from the compute it overlaps)."""
        if runs is not None:
            for s, d, n in runs:
                for kv in (0, 1):  # each a contiguous block on both sides: one DMA from pinned memory
                    dst[kv, d:d + n].copy_(self.host[layer, kv, s:s + n], non_blocking=True)
            return
        P = self.num_pages
        p = pages.long()
        src = torch.cat([(layer * 2) * P + p, (layer * 2 + 1) * P + p])
        d = dst_pos.long()
        copy_chunks(self.host, src, dst, torch.cat([d, dst.shape[1] + d]), self.page_elems)

    def copy_stream(self):
        """The CUDA stream the prefill's prefix gathers for the next layer run on (None on a CPU)."""
        if self.device.type != "cuda":
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    def staging(self, i: int = 0) -> torch.Tensor:
        """Prefill staging buffer i (2, staging_pages, block_size, H_kv, D) on the GPU; every buffer is allocated on
        first use. With head units its pages keep the host tier's order, (block_size and H_kv swapped in memory: a
        strided view), so that the prefix arrives in whole-page copies; the kernels read it through its strides."""
        raw = self.staging_pages_raw(i)
        return raw if self.units == 1 else raw.transpose(2, 3)

    def staging_pages_raw(self, i: int = 0) -> torch.Tensor:
        """Staging buffer i's own (contiguous) tensor, pages in the host tier's layout: what `gather_pages` fills."""
        if self._staging is None:
            bs, row = self.block_size, self.pool.shape[-1]
            inner = (bs, self.num_kv_heads, row) if self.units == 1 else (self.num_kv_heads, bs, row)
            self._staging = [torch.empty(2, self.staging_pages, *inner, dtype=self.pool.dtype, device=self.device)
                             for _ in range(self.staging_buffers)]
        return self._staging[i]

    @property
    def staging_nbytes(self) -> int:
        """The staging area's size, every buffer (allocated or not)."""
        return self.staging_buffers * 2 * self.staging_pages * self.page_elems * self.pool.element_size()

    @property
    def staging_allocated_nbytes(self) -> int:
        """The staging area's GPU bytes now: its size while allocated, 0 after `release_staging`."""
        return 0 if self._staging is None else self.staging_nbytes

    def release_staging(self) -> None:
        """Give the staging area back to the GPU (decode never reads it; the next prefill step allocates it again).
        The engine calls this (as `release_transient`) on a decode step, i.e. when no prefill work is pending, so the
        KV side of a decoding engine is the pool alone. Freed through the caching allocator and `empty_cache`, so
        other processes see it, after any gather still running on the copy stream (a step that failed midway)."""
        if self._staging is not None:
            if self._copy_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            self._staging = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def prefill_step(self, meta, tables: list[list[int]]) -> "StagedPrefill":
        return StagedPrefill(self, meta, tables)

    # ---- the KVCache protocol (kvcache/base.py) ---------------------------------------------------------------------
    @property
    def max_prefill_pages(self) -> int:
        """A prefill step's sequences' whole contexts sit in the staging area: at most its pages per step."""
        return self.staging_pages

    def prefill_view(self, meta, tables: list[list[int]]) -> "StagedPrefill":
        return self.prefill_step(meta, tables)

    def release_transient(self) -> None:
        self.release_staging()

    def occupancy(self, blocks) -> dict:
        """The host tier is what the block manager hands out; the GPU holds `num_slots` of its pages at a time."""
        st = self.stats()
        return {"offload": True, "gpu_pages_total": st["gpu_slots_total"], "gpu_pages_used": st["gpu_slots_used"],
                "host_pages_total": blocks.num_blocks, "host_pages_used": blocks.num_blocks - blocks.num_free_blocks,
                **{k: st[k] for k in ("pages_hit", "pages_missed", "pages_evicted", "pages_installed",
                                      "pages_installed_in_step", "pages_installed_ahead", "bytes_h2d")}}

    # ---- decode: what attention read, installs after the step --------------------------------------------------------
    def record_reads(self, reads: PageReads) -> None:
        """Mark the pages one layer's decode attention read (the index it attended, `PageReads`) for `end_step`.
        A selection stage's probes (`reads.probe`) are marked with head units only: stages 1-2 reread their
        candidates' keys at every refresh, and one KV head's pages of them fit the pool (8B shape at 1M: 0.6 GB of
        stage 2's, docs/design-offload-heads.md); whole pages of every head would not, and pass through uncached."""
        r = reads
        if r.probe and self.units == 1:
            return
        self.note_reads(r.layer, r.block_tables, r.seq, r.first, r.last, r.max_rows, r.blocks, r.block_k, r.n_sink,
                        r.n_window)

    def note_reads(self, layer: int, block_tables: torch.Tensor, seq: torch.Tensor, first: torch.Tensor,
                   last: torch.Tensor, max_rows: int, blocks: torch.Tensor, block_k: int, n_sink: int,
                   n_window: int) -> None:
        """Record the pages that block-sparse attention reads in `layer` (device ops, no host sync: graph-capturable;
        the arguments: kvcache/read_units.py's `attended_units`)."""
        bs, dev = self.block_size, self.wanted.device
        nb = seq.shape[0]
        if nb == 0:
            return
        U = self.units
        if use_triton(dev):  # one kernel instead of ~25 small ops (kernels/page_reads.py)
            return page_reads.mark_reads(self.wanted, layer, self.num_pages, block_tables.to(dev), seq.to(dev),
                                         first.to(dev), last.to(dev), max_rows, blocks.to(dev), block_k, bs, n_sink,
                                         n_window, units=U)
        trash = self.num_layers * self.num_pages * U  # the last entry of `wanted` takes the masked-out reads
        idx = attended_units(self.num_pages, U, layer, trash, block_tables.to(dev), seq, first, last, max_rows, blocks,
                             block_k, bs, n_sink, n_window)
        self.wanted.index_fill_(0, idx.reshape(-1), True)

    def end_step(self) -> dict:
        """After a decode step: stamp the hits, install the misses (LRU victims). Returns this step's counts."""
        self.wanted[-1] = False
        ids = self.wanted.nonzero().squeeze(1)  # a host sync: the step's logits are read right after anyway
        # `install_reads` in this step: units installed, evicted (for them or for reservations), reserved
        early_installed, early_evicted, reserved = (int(x) for x in self._now.tolist())
        self._now.zero_()
        if ids.numel() == 0:
            n_hit = n_miss = evicted = installed = 0
        else:
            self.wanted[ids] = False
            slots = self.slot_of.view(-1)[ids]
            hit = slots >= 0
            self.stamp[slots[hit].long()] = self.step
            miss = ids[~hit]
            n_hit, n_miss = ids.numel() - miss.numel(), miss.numel()
            evicted, installed = self._install(miss) if n_miss else (0, 0)
        # an earlier step's reservation, copied by now: in the table from the next step (its units installed just
        # above keep their slots); then this step's reservation, if any, starts copying
        ahead = self.prefetch.poll()
        if reserved:
            self.prefetch.launch()
        # a unit installed by `install_reads` counts as a miss installed (it was not resident when the step began);
        # it marked itself read, so the marks counted it as a hit
        n_hit -= early_installed
        n_miss += early_installed
        evicted += early_evicted
        installed += early_installed + ahead
        c = self.counters
        c["pages_hit"] += n_hit
        c["pages_missed"] += n_miss
        c["pages_evicted"] += evicted
        c["pages_installed"] += installed
        c["pages_installed_in_step"] += early_installed
        c["pages_installed_ahead"] += ahead
        c["bytes_h2d"] += installed * self.slot_nbytes
        self.step += 1
        self.step_t.fill_(self.step)
        return {"hit": n_hit, "missed": n_miss, "evicted": evicted, "installed": installed}

    def install_reads(self, reads: PageReads) -> None:
        """Install now, inside the step, the head-pages a selection stage is about to score (`reads.probe`: its
        candidate chunks, `reads.blocks`), so that their keys cross PCIe once, into the pool, and the scoring and the
        attention read them there; `end_step` would otherwise install them after a step that read them in place
        (docs/design-refresh-installs.md, option 2). Device ops of a fixed width (the candidates' head-pages), no host
        sync: a captured decode step runs it too. Head units only (with page units probes are never installed).

        Victims come from a clock over the slots: from the hand on, the slots neither read in the previous step nor
        stamped in this one (free slots first, as every slot's stamp starts at -1), the k-th missing unit taking the
        k-th such slot within 4x the width; a unit with no victim there stays at home (read in place, installed
        after the step as before). The units already resident are stamped first, so that none is taken as a victim.
        A unit read in this step only by an earlier layer may be evicted (it is installed again after the step)."""
        if self.units == 1 or not reads.probe:
            return
        L, P, U, S = self.num_layers, self.num_pages, self.units, self.num_slots
        trash = L * P * U
        u = probe_units(P, U, self.block_size, trash, reads, self.wanted.device)  # (E,) ascending, each once
        if u.numel() == 0:
            return
        valid = u < trash
        cur = self._slot_all[u].long()  # the trash entry is -1
        miss = valid & (cur < 0)
        if reads.ahead:  # copied in the background, resident from a later step (kvcache/prefetch.py)
            return self.prefetch.reserve(u, miss)
        hit = valid & (cur >= 0)
        self._stamp_all.index_put_((torch.where(hit, cur, S),), self.step_t)
        do, vic = self.clock_victims(miss)
        n_do = do.sum()
        old = self._owner_all[vic]  # -1 for the scratch slot (no victim)
        gone = do & (old >= 0)
        self._slot_all.index_fill_(0, torch.where(gone, old, trash), -1)
        self._slot_all.index_put_((torch.where(do, u, trash),), vic.to(torch.int32))
        self._slot_all[trash:].fill_(-1)  # (a view: no host value copied inside a captured step)
        self._owner_all.index_put_((vic,), torch.where(do, u, -1))
        self._stamp_all.index_put_((vic,), self.step_t)
        self._now += torch.stack([n_do, gone.sum(), torch.zeros_like(n_do)])
        self.wanted.index_fill_(0, torch.where(do, u, trash), True)  # read this step: `end_step` counts them
        PU = P * U  # a unit's chunk at home: ((layer * 2 + kv) * PU + unit of the layer)
        home = (u // PU) * 2 * PU + u % PU
        src = torch.where(do, home, -1)
        copy_chunks(self.host, torch.cat([src, torch.where(do, src + PU, -1)]), self.pool,
                    torch.cat([vic * 2, vic * 2 + 1]), self.slot_elems)

    def clock_victims(self, miss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Victim slots for the units where `miss` (E,) (device ops of width 4E, no host sync): from the clock's hand
        on, the slots that are free (stamp -1) or were last read before the previous step, the k-th missing unit
        taking the k-th such slot within 4E; the hand moves past the last one taken. Returns (do, victim): whether a
        unit got one, and its slot (the scratch slot S where not)."""
        S = self.num_slots
        W = min(S, 4 * miss.numel())
        cand = torch.remainder(self._hand + torch.arange(W, device=miss.device), S)
        # eligible: free (stamp -1) or last read before the previous step (a reserved slot's stamp is the largest);
        # cumulative count along the clock
        cum = torch.cumsum(self._stamp_all[cand] < (self.step_t - 1).clamp(min=0), 0)
        rank = torch.cumsum(miss, 0)  # 1 for the first missing unit
        do = miss & (rank <= cum[-1])
        vic = torch.where(do, cand[torch.searchsorted(cum, rank).clamp(max=W - 1)], S)
        n_do = do.sum()
        last = torch.searchsorted(cum, n_do.view(1))[0]  # the position of the n_do-th eligible slot
        self._hand.copy_(torch.remainder(self._hand + torch.where(n_do > 0, last + 1, 0), S))
        return do, vic

    def _install(self, miss: torch.Tensor) -> tuple[int, int]:
        """Copy the missed (layer * P + page) ids into free or least-recently-used slots, never a slot read in this
        step (if the step's own pages fill the pool, the rest stay on the host and are read from there)."""
        taken = (self.stamp == self.step) | (self.stamp == RESERVED)  # read in this step, or being prefetched
        key = torch.where(taken, RESERVED, self.stamp)
        room = int((~taken).sum())
        k = min(miss.numel(), room)
        if k == 0:
            return 0, 0
        # the k smallest stamps: free slots (-1) first, then the oldest. Unsorted: their order does not matter, and
        # a sorted topk picks its sort kernel by k (on a GPU a new one may be loaded at its first use)
        victims = torch.topk(key, k, largest=False, sorted=False).indices
        miss = miss[:k]
        old = self.owner[victims]
        gone = old[old >= 0]
        self.slot_of.view(-1)[gone] = -1
        PU = self.num_pages * self.units  # units per layer; a unit's chunk at home: ((layer * 2 + kv) * PU + unit)
        layer, unit = miss // PU, miss % PU
        src = torch.cat([(layer * 2) * PU + unit, (layer * 2 + 1) * PU + unit])
        copy_chunks(self.host, src, self.pool, torch.cat([victims * 2, victims * 2 + 1]), self.slot_elems)
        self.slot_of.view(-1)[miss] = victims.to(torch.int32)
        self.owner[victims] = miss
        self.stamp[victims] = self.step
        return gone.numel(), k

    def free_pages(self, pages: list[int]) -> None:
        """Pages returned to the block manager (a finished or preempted sequence): drop their slots."""
        if not pages:
            return
        self.counters["pages_installed_ahead"] += self.prefetch.activate()  # its copy may hold freed pages
        p = torch.tensor(pages, dtype=torch.long, device=self.slot_of.device)
        ids = (torch.arange(self.num_layers, device=p.device)[:, None] * self.num_pages + p[None, :]).reshape(-1)
        if self.units > 1:
            ids = (ids[:, None] * self.units + torch.arange(self.units, device=p.device)).reshape(-1)
        slots = self.slot_of.view(-1)[ids].long()
        slots = slots[slots >= 0]
        self.owner[slots] = -1
        self.stamp[slots] = -1
        self.slot_of.view(-1)[ids] = -1

    # ---- introspection ---------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        used = int((self.owner >= 0).sum())
        return {"gpu_slots_total": self.num_slots, "gpu_slots_used": used, **self.counters}

    def check_integrity(self) -> None:
        """The page table and its inverse agree, every resident page's slot holds exactly its host bytes (nothing
        was lost or mixed up), and nothing is marked read between steps. Raises AssertionError."""
        owner = self.owner.cpu()
        table = self.slot_of.view(-1).cpu()
        res = (table >= 0).nonzero().squeeze(1)
        slots = table[res].long()
        if slots.numel() != slots.unique().numel():
            raise AssertionError("two pages point at one GPU slot")
        if not bool((owner[slots] == res).all()):
            bad = res[owner[slots] != res][:4].tolist()
            raise AssertionError(f"page-table entries {bad} point at slots owned by other pages")
        held = (owner >= 0).nonzero().squeeze(1)
        if not bool((table[owner[held]] == held.to(torch.int32)).all()):
            raise AssertionError("a slot claims a page whose table entry points elsewhere")
        if bool(self.wanted.any()):
            raise AssertionError("reads are marked outside a step")
        self.prefetch.check()
        if int(self._slot_all[-1]) != -1 or int(self._owner_all[-1]) != -1:
            raise AssertionError("a trash entry of the page table or of the slot owners was left written")
        P, U = self.num_pages, self.units
        pool = self.pool.cpu()
        for s, i in zip(held.tolist(), owner[held].tolist()):
            layer, page, head = i // (P * U), i % (P * U) // U, i % U
            home = self.host[layer, :, page] if U == 1 else self.host[layer, :, page, head][:, :, None]
            if not torch.equal(pool[s].view(torch.uint8), home.view(torch.uint8)):
                raise AssertionError(f"slot {s} differs from the host copy of layer {layer} page {page}"
                                     + (f" head {head}" if U > 1 else ""))
