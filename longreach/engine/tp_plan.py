"""Tensor parallelism's step plans: what rank 0 tells the other ranks before each forward pass, and how a worker
rebuilds the step from it.

Rank 0 alone schedules (docs/design-tensor-parallel.md: one decision maker cannot diverge). Before each
`ModelRunner.execute` it broadcasts a `StepPlan`: per sequence of the step its id, how many tokens it has computed
and knows, the tokens fed, and its block table's new entries since the last plan (the whole table when it was
replaced); and the sequences whose pages were freed since. A worker mirrors the block tables (`MirroredBlocks`) and
runs the same `execute` on stand-in sequences (`PlannedSeq`), so every rank builds the same batch tensors and meets
the same collectives in the same order.

Per-sequence backend state follows rank 0's: a freed sequence's is dropped (`free_sequence`), and a sequence fed
from position 0 starts afresh, as on rank 0, where a sequence at position 0 has never run or was released.
"""
from __future__ import annotations

from dataclasses import dataclass

from .scheduler import ScheduledBatch


@dataclass
class SeqPlan:
    seq_id: int
    num_computed: int
    num_tokens: int  # tokens the sequence knows (prompt + output): the step samples when it feeds up to here
    tokens: list[int]  # the tokens fed this step, from num_computed on
    table_start: int  # the block-table entries below this index are the ones already sent
    table_tail: list[int]  # the entries from table_start on
    slot: int = -1  # its sequence slot (the ring of a model's sliding-window layers: kvcache/window.py), or -1


@dataclass
class StepPlan:
    is_prefill: bool
    num_decodes: int
    all_logits: bool
    seqs: list[SeqPlan]
    freed: list[int]  # sequences whose pages were freed since the last plan


class PlanSender:
    """Rank 0's side: `send(batch, all_logits)` broadcasts the plan of a step about to run (a ModelRunner's
    `before_step`). Mutates its record of the tables the workers hold; not thread-safe.

    A block table only grows, by appending, while its sequence holds pages, and a sequence's next table is a new list
    (kvcache/block_manager.py); so, as engine/block_tables.py does, the record is the live list object, how many of
    its entries were sent and the last of them: a step's plan costs the new entries only, not a compare of the whole
    table (65,536 entries per sequence at 1M tokens, in every step)."""

    def __init__(self, tp, blocks, check_workers=lambda: None):
        self.tp, self.blocks, self.check_workers = tp, blocks, check_workers
        self.sent: dict[int, tuple[list[int], int, int]] = {}  # seq id -> (its table, entries sent, the last sent)

    def plan(self, batch: ScheduledBatch, all_logits: bool) -> StepPlan:
        freed = [sid for sid in self.sent if not self.blocks.owns(sid)]
        for sid in freed:
            del self.sent[sid]
        seqs = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            table = self.blocks.table(seq.seq_id)
            held, start, last = self.sent.get(seq.seq_id, (None, 0, -1))
            if held is not table or start > len(table) or (start and table[start - 1] != last):
                start = 0  # a new table (the sequence was freed and re-admitted): sent whole
            self.sent[seq.seq_id] = (table, len(table), table[-1] if table else -1)
            c = seq.num_computed
            slot = self.blocks.slot(seq.seq_id) if self.blocks.num_slots is not None else -1
            seqs.append(SeqPlan(seq.seq_id, c, seq.num_tokens, seq.token_slice(c, c + n), start, table[start:], slot))
        return StepPlan(batch.is_prefill, batch.num_decodes, all_logits, seqs, freed)

    def send(self, batch: ScheduledBatch, all_logits: bool) -> None:
        self.check_workers()  # a dead worker: raise here, before a collective that would wait for it
        self.tp.broadcast_object(self.plan(batch, all_logits))

    def stop(self) -> None:
        """The plan that ends the workers' loops."""
        self.tp.broadcast_object(None)


@dataclass
class PlannedSeq:
    """What `ModelRunner.execute` reads of a sequence, on a worker."""

    seq_id: int
    num_computed: int
    num_tokens: int
    tokens: list[int]

    @property
    def last_token(self) -> int:
        """The newest token the sequence knows (a decode step's fed token): the plan's tokens end at num_tokens."""
        return self.tokens[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        return self.tokens[start - self.num_computed:stop - self.num_computed]


class MirroredBlocks:
    """A worker's copy of rank 0's block tables: what `ModelRunner` reads of a `BlockManager`.

    `on_free(pages)` (the offloaded store's `free_pages`, as on rank 0's BlockManager) drops the GPU slots of pages
    whose owner changed: those of freed sequences, and every page a plan hands out (a table's new tail). A page rank 0
    hands out came off its free list, so rank 0's store holds no slot for it; the worker may not have heard of the
    free (a sequence freed and re-admitted between two plans is not in `freed`), so it drops the slot then, before
    the step writes the page."""

    def __init__(self, num_blocks: int, block_size: int, on_free=None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._tables: dict[int, list[int]] = {}
        self.on_free = on_free
        self._slots: dict[int, int] = {}

    def table(self, seq_id: int) -> list[int]:
        return self._tables.setdefault(seq_id, [])

    def slot(self, seq_id: int) -> int:
        return self._slots[seq_id]

    def apply(self, plan: StepPlan, backend, release=None) -> ScheduledBatch:
        """Take `plan`'s table changes and frees (dropping the backend's state of freed and restarted sequences, and
        the store's slots of pages that changed hands; `release(seq_id)`: the runner's per-sequence state of a freed
        one, its device block-table row); returns the step's batch of stand-in sequences."""
        for sid in plan.freed:
            pages = self._tables.pop(sid, [])
            self._slots.pop(sid, None)
            backend.free_sequence(sid)
            if release is not None:
                release(sid)
            if pages and self.on_free is not None:
                self.on_free(pages)
        seqs = []
        for p in plan.seqs:
            if p.num_computed == 0:
                backend.free_sequence(p.seq_id)
            table = self.table(p.seq_id)
            if p.table_start < len(table):  # a new list, not one cut in place: a live table only grows by appending
                table = self._tables[p.seq_id] = table[:p.table_start]  # (engine/block_tables.py relies on it)
            table.extend(p.table_tail)
            if p.table_tail and self.on_free is not None:
                self.on_free(p.table_tail)
            self._slots[p.seq_id] = p.slot
            seqs.append(PlannedSeq(p.seq_id, p.num_computed, p.num_tokens, p.tokens))
        return ScheduledBatch(plan.is_prefill, seqs, [len(p.tokens) for p in plan.seqs], plan.num_decodes)
