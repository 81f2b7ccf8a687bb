"""Block tables kept on the device between graph-decoded steps: each step writes only the page ids added since.

A decode step's block tables used to be rebuilt from the sequences' Python lists and copied whole to the device every
step: O(context pages) of host work and transfer per sequence and step (65,536 entries a step at 1M tokens and a
16-token page). `DeviceBlockTables` keeps one device row per sequence it has seen (a slot); a step brings each of its
sequences' rows up to date, writing only the entries appended since the row was last written, and the runner gathers
the step's rows (longest first) into the graph's static table with one device op.

What it relies on: a sequence's live table (`BlockManager.table`, `MirroredBlocks.table`) only ever grows by
appending while the sequence holds its pages; freeing the pages drops the list, and the sequence's next table is a new
list object. A row is rewritten whole when the list it mirrors is not the one it holds (the sequence's first step
here, or its pages freed and handed out again: a preemption), or when its last written entry no longer matches
(defensive: a table changed in place). Slots are handed back by `release` (the scheduler's release of a sequence's
pages) and, when none is free, taken from a sequence that is not in the step.
"""
from __future__ import annotations

import torch


class DeviceBlockTables:
    def __init__(self, num_slots: int, max_pages: int, scratch_page: int, device: torch.device):
        # one row per slot and a last row of scratch pages: the rows a graph's padding reads
        self.rows = torch.full((num_slots + 1, max_pages), scratch_page, dtype=torch.int32, device=device)
        self.scratch_row = num_slots
        self.scratch_page = scratch_page
        self._slot: dict[int, int] = {}  # seq_id -> slot
        self._held: list[tuple[int, list[int] | None, int]] = [(-1, None, 0)] * num_slots  # (seq_id, table, written)
        self._last = [-1] * num_slots  # the last page id written to each slot's row (entry `written - 1`)
        self._free = list(range(num_slots))[::-1]
        self.entries_written = 0  # page ids written to the device so far (tests: a step writes only new ones)

    def slots(self, seq_ids: list[int], tables: list[list[int]]) -> list[int]:
        """Each sequence's slot, its device row holding `tables[i]` (only the entries appended since its last call
        written now)."""
        out = []
        for seq_id, table in zip(seq_ids, tables):
            slot = self._slot.get(seq_id)
            if slot is None:
                slot = self._take(seq_id, seq_ids)
            _, held, written = self._held[slot]
            if held is not table or written > len(table) or (written and table[written - 1] != self._last[slot]):
                if written:
                    self.rows[slot, :written].fill_(self.scratch_page)  # a shorter new table reads scratch past it
                written = 0
            n = len(table)
            if n > written:
                self.rows[slot, written:n].copy_(torch.tensor(table[written:n], dtype=torch.int32), non_blocking=True)
                self.entries_written += n - written
                self._last[slot] = table[n - 1]
            self._held[slot] = (seq_id, table, n)
            out.append(slot)
        return out

    def _take(self, seq_id: int, step_ids: list[int]) -> int:
        if not self._free:  # every slot held: hand over one whose sequence is not in this step
            busy = set(step_ids)
            victim = next(sid for sid in self._slot if sid not in busy)
            self.release(victim)
        slot = self._free.pop()
        self._slot[seq_id] = slot
        return slot

    def release(self, seq_id: int) -> None:
        """The sequence gave its pages back: its slot is free (its row is rewritten by the next holder)."""
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            held = self._held[slot]
            self._held[slot] = (-1, held[1], held[2])  # the row's contents stay known: the next holder clears them
            self._free.append(slot)
