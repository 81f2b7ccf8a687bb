"""Installs ahead: head-pages reserved inside a decode step and copied into the GPU pool while later steps run.

The offloaded store's third way in (kvcache/offload.py; docs/design-refresh-installs.md, option 5). A selection stage
that knows which pages it will score a few steps from now (infinitehip with `ahead`: the stage-0 output it keeps for
its next refresh) hands them to the store with `PageReads.ahead` set. Then:
  * **reserve** (inside the step, device ops of a fixed width, no host sync: a captured step runs it): the units not
    resident take victims from the store's clock (the slots neither read in this step nor in the previous one); each
    victim's old owner loses its table entry now, and the slot is marked reserved (`RESERVED` stamp, no owner): no
    read reaches it (the table does not point there) and no other install takes it. Skipped while an earlier
    reservation is still being copied (`busy`), so at most one is in flight: its units stay at home and are
    installed by whatever reads them first, as without this;
  * **copy** (after the step, `launch`, from `end_step`): one copy of every reserved slot's K and V from the host
    tier, on the store's copy stream, ordered after the step, by a kernel of `PROGRAMS` looping programs (so that the
    decode steps it overlaps keep the other SMs; kernels/offload_copy.py);
  * **activate** (at the first `end_step` whose poll finds the copy done, or before anything frees pages): the table
    entries set, owners and stamps written, on the compute stream. A unit that something else installed meanwhile
    (read by a step, installed after it) keeps that slot; its reserved slot is freed.
Correct at every point: a table entry only ever points at a slot holding that unit's bytes, and the pages reserved
are past every window (a stage's candidates end before the queries' windows), so no write-through touches them.
On CPU (tests) there is no copy stream: the copy runs at `launch` and activation still waits for the next `end_step`,
so the states between run there too.
"""
from __future__ import annotations

import torch

from ..kernels.offload_copy import copy_chunks

RESERVED = torch.iinfo(torch.long).max  # a slot's stamp while a reservation's copy fills it
PROGRAMS = 16  # the background copy's programs (SMs it may hold of an H100's 132; 1.9 GB at 1M: ~40 ms at full width)


class Prefetcher:
    """One store's reservations (`OffloadedKVCache` owns one; it reads and writes the store's page table, owners and
    stamps, which the store documents)."""

    def __init__(self, store):
        S, dev = store.num_slots, store.device
        self.store = store
        self.unit_of = torch.full((S + 1,), -1, dtype=torch.long, device=dev)  # per slot: the unit copied into it
        self.busy = torch.zeros((), dtype=torch.long, device=dev)  # 1 from a launch to its activation
        self._flight: tuple | None = None  # (units, slots, event) of the copy launched and not yet activated
        if dev.type == "cuda":  # compile the copy now, not inside the first decode step that launches one
            copy_chunks(store.host, torch.full((1,), -1, device=dev), store.pool, torch.zeros(1, dtype=torch.long,
                        device=dev), store.slot_elems, programs=PROGRAMS)

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def reserve(self, u: torch.Tensor, miss: torch.Tensor) -> None:
        """Inside a step: victims for the units `u` (E,) where `miss` (not resident, a real unit), marked reserved."""
        st = self.store
        trash = st.num_layers * st.num_pages * st.units
        do, vic = st.clock_victims(miss & (self.busy == 0))
        # a unit without a victim points at the scratch slot S (and the table's trash entry): every write there
        # below puts back the value it holds (-1), so no trash entry needs resetting
        old = st._owner_all[vic]
        gone = do & (old >= 0)
        st._slot_all.index_fill_(0, torch.where(gone, old, trash), -1)
        st._owner_all.index_fill_(0, vic, -1)
        st._stamp_all.index_put_((vic,), torch.where(do, RESERVED, st._stamp_all[vic]))
        self.unit_of.index_put_((vic,), torch.where(do, u, -1))
        st._now += torch.stack([torch.zeros_like(gone.sum()), gone.sum(), do.sum()])  # (installed, evicted, reserved)

    def launch(self) -> None:
        """After a step that reserved units: copy them on the copy stream (a host sync: `end_step` has one)."""
        st = self.store
        slots = (self.unit_of[:st.num_slots] >= 0).nonzero().squeeze(1)
        units = self.unit_of[slots]
        PU = st.num_pages * st.units  # a unit's chunk at home: ((layer * 2 + kv) * PU + unit of the layer)
        home = (units // PU) * 2 * PU + units % PU
        src, dst = torch.cat([home, home + PU]), torch.cat([slots * 2, slots * 2 + 1])
        stream = st.copy_stream()
        event = None
        if stream is None:
            copy_chunks(st.host, src, st.pool, dst, st.slot_elems, programs=PROGRAMS)
        else:
            stream.wait_stream(torch.cuda.current_stream(st.device))  # after the step that reserved (and cleared)
            with torch.cuda.stream(stream):
                copy_chunks(st.host, src, st.pool, dst, st.slot_elems, programs=PROGRAMS)
                event = torch.cuda.Event()
                event.record(stream)
            for t in (src, dst):
                t.record_stream(stream)
        self.busy.fill_(1)
        self._flight = (units, slots, event)

    def poll(self) -> int:
        """Between steps: activate the copy in flight if it is done. Returns the units installed (0 if none)."""
        if self._flight is None or (self._flight[2] is not None and not self._flight[2].query()):
            return 0
        return self.activate()

    def activate(self) -> int:
        """Wait for the copy in flight (if any) and point the table at its slots. Returns the units installed."""
        if self._flight is None:
            return 0
        units, slots, event = self._flight
        st = self.store
        if event is not None:
            torch.cuda.current_stream(st.device).wait_event(event)
        cur = st._slot_all[units]
        new = cur < 0  # else installed meanwhile into another slot, which it keeps
        st._slot_all[units[new]] = slots[new].to(torch.int32)
        st._owner_all[slots] = torch.where(new, units, -1)
        st._stamp_all[slots] = torch.where(new, st.step, -1)
        self.unit_of[slots] = -1
        self.busy.fill_(0)
        self._flight = None
        return int(new.sum())

    def check(self) -> None:
        """Reserved slots are exactly the slots of the copy in flight, unowned, and nothing points at them."""
        st = self.store
        stamp, owner = st.stamp.cpu(), st.owner.cpu()
        res = (stamp == RESERVED).nonzero().squeeze(1)
        pend = (self.unit_of[:-1].cpu() >= 0).nonzero().squeeze(1)
        if not torch.equal(res, pend):
            raise AssertionError("reserved slots and the prefetch's pending slots differ")
        if bool((owner[res] >= 0).any()):
            raise AssertionError("a reserved slot has an owner")
        if res.numel() and self._flight is None:
            raise AssertionError("slots are reserved with no copy in flight")
        if bool(self.busy.cpu()) != (self._flight is not None):
            raise AssertionError("the prefetch's busy flag disagrees with its copy in flight")
