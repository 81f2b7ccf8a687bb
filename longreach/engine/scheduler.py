"""Which sequences run in the next step, and with how many tokens: one token budget for prefill and decode.

Policy (continuous batching with chunked prefill, as vLLM v1 schedules it):
  * Every step has `max_num_batched_tokens` tokens. The running sequences that decode come first, one token each;
    the rest of the budget goes to prefill chunks: first the running sequences whose prefill is unfinished, oldest
    first, then newly admitted requests while fewer than `max_num_seqs` run.
  * Decode and prefill share a step when the backend and the KV store can run both in one step
    (`mixed=True`: attention/backend.py Capabilities.mixed_batches, a GPU-resident cache). Otherwise a step is
    either all decode or all prefill, and while both kinds of work wait they alternate, one step each: a decode
    waits at most one prefill step, and a prefill at most one decode step.
  * A long prompt never takes a whole step forever: while any other sequence runs or waits, a prefill chunk is at
    most `long_prefill_token_threshold` tokens, so several prompts share the prefill budget and a short prompt that
    arrives behind long ones starts at the next step. At most `max_num_partial_prefills` sequences are mid-prefill
    at once, and of those at most `max_long_partial_prefills` are long (more than the threshold left to prefill).
    Alone, a prompt takes the whole budget (the fastest prefill).
  * With a step-time target (`mixed_step_target_s`), while sequences decode each prompt's chunk is further capped
    by a controller that halves or doubles it from the measured times of the steps it shared with decode rows
    (engine/pacing.py), and the requests a step admits share one such cap between them (their first chunks
    together); the engine reports each step's time with `observe`.
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
from .pacing import ADMISSIONS, ChunkPacer
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    is_prefill: bool  # the step has prefill work (a chunk of some sequence's prompt)
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens fed to the model per sequence, starting at seq.num_computed
    num_decodes: int = 0  # in a prefill step, the leading sequences that decode one token (a mixed step)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def mixed(self) -> bool:
        return self.is_prefill and self.num_decodes > 0


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 on_release: Callable[[Sequence], None] = lambda seq: None, max_prefill_pages: int | None = None,
                 chunk_align: int = 1, mixed: bool = False, long_prefill_token_threshold: int | None = None,
                 max_num_partial_prefills: int = 4, max_long_partial_prefills: int = 2,
                 mixed_step_target_s: float | None = None):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_release = on_release  # called when a sequence loses its pages (finish or preemption)
        # KV offloading: most pages a prefill step may cover (its sequences' whole contexts sit in the GPU staging
        # area, kvcache/offload.py); a step always takes its first sequence
        self.max_prefill_pages = max_prefill_pages
        self.chunk_align = chunk_align
        self.mixed = mixed
        threshold = long_prefill_token_threshold or max(max_num_batched_tokens // 4, 1)
        self.long_threshold = max(threshold, chunk_align)  # a capped chunk still holds one aligned stride
        self.max_partial = max_num_partial_prefills
        self.max_long_partial = max_long_partial_prefills
        self.pacer = ChunkPacer(mixed_step_target_s, self.long_threshold, chunk_align) if mixed_step_target_s else None
        self._paced: dict[int, int] = {}  # the last step's paced chunks: seq_id -> tokens (for `observe`)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._last_prefill = False  # alternation when steps cannot mix

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def prefill_pending(self) -> bool:
        """Some sequence still has prompt to prefill (running mid-prefill, or waiting)."""
        return bool(self.waiting) or any(s.is_prefilling for s in self.running)

    def schedule(self) -> ScheduledBatch | None:
        decoding = [s for s in self.running if s.status is SequenceStatus.RUNNING and not s.is_prefilling]
        prefill_first = self.prefill_pending() and not (decoding and self._last_prefill)
        seqs: list[Sequence] = []
        counts: list[int] = []
        pace = self.pacer is not None and bool(decoding)  # others decode: this step's chunks are paced
        self._paced = {}  # set by _schedule_prefill when paced
        if self.mixed:
            self._schedule_decodes(decoding, seqs, counts)
            self._schedule_prefill(seqs, counts, self.max_num_batched_tokens - len(seqs), pace)
        elif prefill_first:  # alternate: a step of prefill, then (while sequences decode) a step of decode
            self._schedule_prefill(seqs, counts, self.max_num_batched_tokens, pace)
        if not seqs and not self.mixed:  # a decode step: its turn, or the prefill could not take a step now
            self._schedule_decodes(decoding, seqs, counts)
        # a reservation may preempt a sequence this step already took (the most recently admitted): drop it
        kept = [(s, n) for s, n in zip(seqs, counts) if s.status is SequenceStatus.RUNNING]
        seqs, counts = [s for s, _ in kept], [n for _, n in kept]
        decode_ids = {s.seq_id for s in decoding}
        num_decodes = sum(1 for s in seqs if s.seq_id in decode_ids)
        is_prefill = len(seqs) > num_decodes
        self._last_prefill = is_prefill
        if self._paced:  # a chunk dropped by a reservation's preemption ran no tokens
            ran = {s.seq_id for s in seqs}
            self._paced = {k: n for k, n in self._paced.items() if k == ADMISSIONS or k in ran}
        return ScheduledBatch(is_prefill, seqs, counts, num_decodes if is_prefill else 0) if seqs else None

    def _schedule_decodes(self, decoding: list[Sequence], seqs: list[Sequence], counts: list[int]) -> None:
        for seq in decoding:
            if len(seqs) == self.max_num_batched_tokens:
                break
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, seq.num_tokens):
                seqs.append(seq)
                counts.append(1)

    def _schedule_prefill(self, seqs: list[Sequence], counts: list[int], budget: int, pace: bool = False) -> None:
        """Append this step's prefill chunks to `seqs` / `counts` within `budget` tokens (`pace`: each chunk also
        within its pacer's cap)."""
        first = len(seqs)
        pages = 0
        others = len(self.running) + len(self.waiting) > 1  # anyone to share the step with: cap the chunks
        shared = self.long_threshold if others else budget
        cap_of = (lambda seq: min(shared, self.pacer.cap(seq.seq_id))) if pace else (lambda seq: shared)
        partial = [s for s in self.running if s.status is SequenceStatus.RUNNING and s.is_prefilling]
        n_long = sum(s.num_uncomputed > self.long_threshold for s in partial)
        admit = self.pacer.cap(ADMISSIONS) if pace else budget  # what this step's new requests may take together
        paced: dict[int, int] = {}
        for seq in partial:  # continue chunked prefills, oldest first
            if budget == 0:
                break
            n = self.chunk(seq, min(budget, cap_of(seq)))
            if n == 0 or len(seqs) > first and not self._stages(pages, seq.num_computed + n):
                break
            if self._reserve(seq, seq.num_computed + n):
                pages += self.blocks.blocks_for(seq.num_computed + n)
                seqs.append(seq)
                counts.append(n)
                budget -= n
                paced[seq.seq_id] = n
        admitted = 0
        for seq in list(self.waiting):  # admit, in arrival order
            if (budget == 0 or admitted == admit or len(self.running) >= self.max_num_seqs
                    or len(partial) >= self.max_partial):
                break
            long = seq.num_uncomputed > self.long_threshold
            if long and n_long >= self.max_long_partial:
                continue  # no place for another long prompt: shorter ones behind it may still start
            n = self.chunk(seq, min(budget, cap_of(seq), admit - admitted))
            if n == 0 or len(seqs) > first and not self._stages(pages, seq.num_computed + n):
                break
            # Admit only when the whole (re-)prefill fits the free pages: one admitted for its first chunk alone could
            # fill the cache, preempt itself and be re-admitted at once, forever (a livelock under KV pressure).
            if self.blocks.extra_blocks_needed(seq.seq_id, seq.num_tokens) > self.blocks.num_free_blocks:
                break
            if not self.blocks.ensure(seq.seq_id, seq.num_computed + n):
                break
            pages += self.blocks.blocks_for(seq.num_computed + n)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            admitted += n
            paced[seq.seq_id] = n  # its own cap learns from the step as well
            if seq.num_computed + n < seq.num_tokens:
                partial.append(seq)
                n_long += long
        if pace:
            self._paced = paced | ({ADMISSIONS: admitted} if admitted else {})

    def observe(self, seconds: float) -> None:
        """The last scheduled step took `seconds` (the engine's measure, the GPU's work included): the pacer's
        input when that step's chunks were paced."""
        if self._paced:
            self.pacer.observe(self._paced, seconds)
            self._paced = {}

    def chunk_sizes(self) -> list[int]:
        """The full-size prefill chunks this scheduler cuts (a prompt alone, beside others, and every paced cap),
        largest first: the shapes worth capturing prefill graphs for before serving."""
        sizes = {self.max_num_batched_tokens, self.long_threshold, *(self.pacer.sizes() if self.pacer else ())}
        return sorted(sizes, reverse=True)

    @property
    def step_paced(self) -> bool:
        """The last scheduled step's chunks were paced: its time is wanted (`observe`)."""
        return bool(self._paced)

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

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        self.on_release(seq)
        if self.pacer is not None:
            self.pacer.forget(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def retire(self, seq: Sequence) -> None:
        """Remove a finished sequence (status already FINISHED) but keep its pages: its KV stays in the cache for
        `resume` (LLMEngine.redecode) or `finish`."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def resume(self, seq: Sequence) -> None:
        """Run a retired sequence again (status RUNNING, its pages and computed tokens as it left them)."""
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence (status already FINISHED) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
