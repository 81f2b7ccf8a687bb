"""Page bookkeeping: which KV-cache pages each sequence owns (no tensors here; CPU-testable).

A sequence's block table is the ordered list of its pages: token t lives in page `table[t // block_size]` at offset
`t % block_size`. Pages are handed out from a free list and returned when a sequence finishes or is preempted.
With `slots_for` (a bounded cache's layout, attention/backend.py: KVLayout) a sequence of n tokens gets the pages of
`slots_for(n)` slots instead of n, and the layout says where its tokens live.
With `num_slots` (a model with sliding-window layers: kvcache/window.py) a sequence also gets one of `num_slots`
sequence slots (its ring of window keys) with its first pages, and gives it back with them: a sequence finding no
free slot is refused as one finding no pages.
"""
from __future__ import annotations

from collections import deque
from typing import Callable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, on_free: Callable[[list[int]], None] | None = None,
                 slots_for: Callable[[int], int] | None = None, num_slots: int | None = None):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one page, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self.on_free = on_free  # called with the pages a sequence returns (the offloaded store drops their slots)
        self.slots_for = slots_for  # tokens -> slots a sequence uses (None: one slot per token)
        self.num_slots = num_slots  # sequence slots (None: none kept)
        self._free_slots: deque[int] = deque(range(num_slots or 0))
        self._slot: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        slots = num_tokens if self.slots_for is None else self.slots_for(num_tokens)
        return -(-slots // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        """The live block table of `seq_id` (empty if it owns no pages). It only grows, by appending (`ensure`);
        `free` drops it, and the sequence's next table is a new list (engine/block_tables.py relies on both)."""
        return self._tables.setdefault(seq_id, [])

    def slot(self, seq_id: int) -> int:
        """The sequence slot `seq_id` holds (with `num_slots`; from its first `ensure` to its `free`)."""
        return self._slot[seq_id]

    def owns(self, seq_id: int) -> bool:
        """Does `seq_id` hold a block table (possibly empty) now? False once `free` returned its pages."""
        return seq_id in self._tables

    def extra_blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def ensure(self, seq_id: int, num_tokens: int) -> bool:
        """Grow `seq_id`'s table to hold `num_tokens` tokens. All or nothing: False (and no change) if pages run out."""
        need = self.extra_blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            return False
        if self.num_slots is not None and seq_id not in self._slot:
            if not self._free_slots:
                return False
            self._slot[seq_id] = self._free_slots.popleft()
        table = self.table(seq_id)
        for _ in range(need):
            table.append(self._free.popleft())
        return True

    def free(self, seq_id: int) -> None:
        """Return all pages of `seq_id` to the free list (no-op if it owns none)."""
        pages = self._tables.pop(seq_id, [])
        self._free.extend(pages)
        if seq_id in self._slot:
            self._free_slots.append(self._slot.pop(seq_id))
        if pages and self.on_free is not None:
            self.on_free(pages)

    def check_integrity(self) -> None:
        """Every page is either free or owned by exactly one sequence; raises AssertionError otherwise."""
        owned = [b for table in self._tables.values() for b in table]
        seen = set(owned)
        if len(seen) != len(owned):
            raise AssertionError("a KV page is owned twice")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a KV page is on the free list twice")
        if seen & free:
            raise AssertionError(f"pages both owned and free: {sorted(seen & free)[:8]}")
        if seen | free != set(range(self.num_blocks)):
            lost = set(range(self.num_blocks)) - seen - free
            raise AssertionError(f"pages neither owned nor free (leaked): {sorted(lost)[:8]}")
        if self.num_slots is not None:
            held = list(self._slot.values())
            if sorted(held + list(self._free_slots)) != list(range(self.num_slots)):
                raise AssertionError("sequence slots lost or held twice")
