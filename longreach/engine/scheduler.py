"""Which sequences run in the next step, and with how many tokens.

Policy (continuous batching, prefill first, as nano-vllm):
  * A step is either a *prefill* step or a *decode* step. Prefill steps carry up to `max_num_batched_tokens` tokens:
    first the next chunks of running sequences whose prefill is unfinished (chunked prefill), then newly admitted
    requests while fewer than `max_num_seqs` run. A long prompt is therefore split into chunks across steps and each
    chunk attends to the prefix already in the paged cache.
  * When no prefill work is pending, every running sequence decodes one token.
  * A backend with a bounded cache of its own (cascading) inserts a prompt into it stride by stride: its chunks then
    end on multiples of `chunk_align` (except at the prompt's end), so results do not depend on how steps cut them.
  * Pages are reserved per step. If a running sequence cannot get a page, the most recently admitted other sequence
    is preempted (pages freed, moved to the front of the queue, recomputed later); if there is none, the sequence
    preempts itself. New requests are only admitted when pages are free: they never evict running ones.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..kvcache.block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    is_prefill: bool
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens fed to the model per sequence, starting at seq.num_computed

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 on_release: Callable[[Sequence], None] = lambda seq: None, max_prefill_pages: int | None = None,
                 chunk_align: int = 1):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_release = on_release  # called when a sequence loses its pages (finish or preemption)
        # KV offloading: most pages a prefill step may cover (its sequences' whole contexts sit in the GPU staging
        # area, kvcache/offload.py); a step always takes its first sequence
        self.max_prefill_pages = max_prefill_pages
        self.chunk_align = chunk_align
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        pages = 0
        for seq in list(self.running):  # continue chunked prefills, oldest first
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or not seq.is_prefilling:
                continue
            n = self.chunk(seq, budget)
            if n == 0 or seqs and not self._stages(pages, seq.num_computed + n):
                break
            if self._reserve(seq, seq.num_computed + n):
                pages += self.blocks.blocks_for(seq.num_computed + n)
                seqs.append(seq)
                counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self.chunk(seq, budget)
            if n == 0 or seqs and not self._stages(pages, seq.num_computed + n):
                break
            # Admit only when the whole (re-)prefill fits the free pages: one admitted for its first chunk alone could
            # fill the cache, preempt itself and be re-admitted at once, forever (a livelock under KV pressure).
            if self.blocks.extra_blocks_needed(seq.seq_id, seq.num_tokens) > self.blocks.num_free_blocks:
                break
            if not self.blocks.ensure(seq.seq_id, seq.num_computed + n):
                break
            pages += self.blocks.blocks_for(seq.num_computed + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        if seqs:
            return ScheduledBatch(True, seqs, counts)
        decodes = [s for s in list(self.running) if s.status is SequenceStatus.RUNNING and self._reserve(s, s.num_tokens)]
        return ScheduledBatch(False, decodes, [1] * len(decodes)) if decodes else None

    def chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq`'s prefill to run within `budget`: ending on a multiple of `chunk_align` unless the prompt
        ends first (0: none fit)."""
        n = min(seq.num_uncomputed, budget)
        end = seq.num_computed + n
        if end < seq.num_tokens and self.chunk_align > 1:
            n = max(0, end // self.chunk_align * self.chunk_align - seq.num_computed)
        return n

    def _stages(self, pages: int, num_tokens: int) -> bool:
        """Does a sequence of `num_tokens` fit the prefill step's staging pages beside `pages` already taken?"""
        return self.max_prefill_pages is None or pages + self.blocks.blocks_for(num_tokens) <= self.max_prefill_pages

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for `num_tokens` tokens of `seq`, preempting later-admitted sequences if needed."""
        while not self.blocks.ensure(seq.seq_id, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        self.on_release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence (status already FINISHED) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        self.on_release(seq)
