"""Graph decode for the sparse backends: the decode step as CUDA-graph variants (`GraphDecoder`, owned by
`SparseBackend`).

A captured decode step replays the same kernels every time, yet each sequence's mask cache recomputes stage i
only every refresh[i] steps, and a short context attends densely. So the step comes in variants, keyed by
  bucket  a power of two >= the batch's longest sequence (capped at max_model_len): the stages' candidate
          widths are sized by it, so one variant serves every length up to it (extra candidates are -1);
  level   the earliest stage any sequence of the batch recomputes this step (len(stages): none does);
  dense   for each distinct decode limit (`dense_below_decode`, which is `dense_below` unless set), whether the
          longest sequence is within it (those layers attend densely, as in an eager step);
  catchup what the rows box this step (a box-scored stage 0, infinitehip/boxes.py): 0 nothing (no build launch:
          most steps where only complete chunks are boxed), 1 at most one chunk each, 2 more for some row (a
          sequence just past the shortest limit, or the first decode step after another backend's prefill), where
          the box kernel covers every chunk of the bucket instead of one per row;
  select  how many rows run the stages (a power of two >= the number of rows longer than the smallest limit): the
          runner orders a batch longest first, so the rows that need a selection are a prefix, and the short rows of
          a mixed batch (a 128K request among short chats) skip the per-row selection entirely. Without this every
          row ran it: the first GPU serving run (SmolLM2, H100) spent 29 s capturing 48-row level-0 variants and
          decoded its 48 short rows at the long row's cost (docs/benchmarks.md).
A variant recomputes stages level..N-1 for every row, and each row keeps its cached output of a stage its own
schedule does not refresh (`SelectionMethod.graph_select`), so every sequence gets exactly the selections of an
eager run, whatever else is in the batch. The stage outputs live in static per-layer buffers with one row per
slot: a slot per running sequence, plus a scratch slot that the graph's padding rows (and capture) write to.
Host-side bookkeeping mirrors the eager path: a sequence no longer than a layer's limit reads every key block
there and starts its cache afresh once it is longer. Not capturable: methods without `graph_stage_widths`
(quest) and SelfExtend positions, whose group size follows the exact context length. A box-scored stage 0 boxes the
rows' new chunks inside the graph (inputs in the boxes' own static buffer, infinitehip/boxes.py) before any selection.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..backend import AttentionMetadata
from ..dense import DenseFallback
from ..index import QueryBlocks
from .selection import (BlockQueries, KeptBoxes, SelectionMethod, SequenceKeys, StageAhead, install_now, probe_reads,
                        use_kernels)


SHORT_WARM_MAX = 32768  # the longest short-row batch whose decode variants a warm-up captures (warm_keys)


class GraphDecoder:
    """The graph-decode half of a `SparseBackend`: host bookkeeping, static buffers, and each variant's selection.

    The backend hands it what it needs at construction (the method, its dense fallback, the kept boxes if any) and,
    per step, the sequences' decode step numbers; it keeps its own state (slots, filled stage caches) and touches
    nothing of the backend's."""

    def __init__(self, method: SelectionMethod, fallback: DenseFallback, max_num_seqs: int, max_model_len: int,
                 device: torch.device, boxes: KeptBoxes | None = None):
        self.method, self.fallback, self.boxes = method, fallback, boxes
        self.max_num_seqs, self.max_model_len, self.device = max_num_seqs, max_model_len, device
        self.num_layers = fallback.num_layers
        self.variant: tuple | None = None  # the variant forward() runs as (`running`), None: an eager step
        self.slots: dict[int, int] = {}  # seq_id -> row of the stage caches
        # seq_id -> the longest context a graph step selected for it in some layer: its stage caches are filled in
        # the sparse layers whose decode limit is below that length
        self.cached: dict[int, int] = {}
        self._limit_cache: tuple | None = None  # `_limits`
        self._g: dict | None = None  # static buffers (slots, refresh levels, stage caches), made on first use
        self._free_slots: list[int] = []
        # tensors every layer of one forward shares, made by the first layer that needs them (`_step_memo`)
        self._memo: dict = {}
        self._memo_layer = -1

    def unsupported(self) -> str | None:
        """Why this method and config cannot decode through graphs, or None."""
        m = self.method
        if any(m.graph_stage_widths(layer) is None for layer in range(self.num_layers)):
            return f"{m.name}'s decode selection is not graph-capturable"
        if any(name == "de" for spec in (m.prune_spec, m.attend_spec) for name, _, _ in spec):
            return "SelfExtend (de) positions change their group size with the context length"
        return None

    def warm_keys(self) -> list[tuple[int, tuple]]:
        """The variants a server's batches meet, for a warm-up to capture before serving, as (rows, key): short rows
        alone (below); one and two long rows (select 1 and 2), every refresh level, at every bucket past the
        largest dense limit up to max_model_len. Capturing them compiles the selection kernels of every bucket class
        on the spot, which a first-use capture otherwise pays while others wait (1.5-4.3 s on an H200 at 140K; with
        the one-row variants warm, 3.0 s for the first step that selected for two long rows; docs/serving.md)."""
        fb = self.fallback
        limits = fb.limits(True)
        if not fb.sparse_layers():
            return []
        # rows all within every decode limit (a server's chats): no selection, one variant per bucket, met at any
        # batch size (rows 0: ModelRunner.capture_warm_variants takes every graph size); from 64 tokens up to the
        # bucket holding the shortest limit, at most SHORT_WARM_MAX (a model trained to 128K would otherwise add 12
        # buckets x every batch size to the warm-up). Captured on first use, 9 of them stalled a 1M run's 64 chats
        # for up to 0.5 s each (docs/serving.md, run 7).
        keys, shortest, power = [], min(min(limits), SHORT_WARM_MAX), 64
        while power // 2 < shortest and power // 2 < self.max_model_len:  # a longest row in (power / 2, power]
            keys.append((0, (min(power, self.max_model_len), self._num_stages(), tuple(True for _ in limits), 0,
                             0)))
            power *= 2
        power = 1 << max(limits[-1], 1).bit_length()  # the first bucket past every limit (`step`'s rule)
        dense = tuple(False for _ in limits)
        while True:
            bucket = min(power, self.max_model_len)
            keys += [(select, (bucket, level, dense, select, box)) for select in (1, 2)
                     for level in range(self._num_stages() + 1) for box in self._warm_box_fields()]
            if bucket >= self.max_model_len:
                return keys
            power *= 2

    def _warm_box_fields(self) -> tuple[int, ...]:
        """The box fields (`step`'s catchup) of a long row's ordinary steps: none without boxes; 1 with partial
        chunks (boxed at every step); 0 and 1 without them (most steps box nothing, one in a chunk's length boxes
        the chunk just completed)."""
        if self.boxes is None:
            return (0,)
        return (1,) if self.boxes.partial else (0, 1)

    def free(self, seq_id: int) -> None:
        if seq_id in self.slots:
            self._free_slots.append(self.slots.pop(seq_id))
        self.cached.pop(seq_id, None)

    def _buffers(self) -> dict:
        """The static buffers, made once (outside any capture, so the constants among them hold their values in
        every graph): the rows' slots and first recomputed stage per layer; per layer the stage caches, one
        (slots + 1, groups, width) int32 tensor per stage, -1 padded, whose last stage is a view of `last`, the
        same rows padded with -1 columns to the width of the layer's attention index (`_index_width`), so that a
        gather of its rows is the index with no pad; and constants: `arange` (0, 1, ... as int32, as long as the
        widest index or the batch), `ones` and `zero` (int32: the one-row query blocks' starts and lengths)."""
        if self._g is None:
            m, slots, dev = self.method, self.max_num_seqs, self.device
            L = self.num_layers
            cache, last = [], []
            for layer in range(L):
                widths = m.graph_stage_widths(layer)
                stages = [torch.full((slots + 1, m.groups, w), -1, dtype=torch.int32, device=dev)
                          for w in widths[:-1]]
                full = None
                if widths:
                    full = torch.full((slots + 1, m.groups, self._index_width(layer, widths[-1])), -1,
                                      dtype=torch.int32, device=dev)
                    stages.append(full[..., :widths[-1]])
                cache.append(stages)
                last.append(full)
            widest = max([slots] + [self._index_width(layer, 0) for layer in range(L)] +
                         [t.shape[2] for t in last if t is not None])
            self._g = {
                "slot": torch.full((slots,), slots, dtype=torch.long, device=dev),
                "first": torch.zeros(L, slots, dtype=torch.long, device=dev),
                "cache": cache,
                "last": last,
                "arange": torch.arange(widest, dtype=torch.int32, device=dev),
                "ones": torch.ones(slots, dtype=torch.int32, device=dev),
                "zero": torch.zeros(1, dtype=torch.int32, device=dev),
                # the last stage's counts per layer and row, where its top-k writes them (`select`, direct)
                "counts": torch.zeros(L, slots, m.groups, dtype=torch.int32, device=dev),
                # `graph_ahead`: per layer, stage 0's kept output (-1 rows: none), as the stage caches; reset for a
                # slot when a sequence takes it (`step`)
                "ahead": [torch.full_like(c[0], -1) if m.graph_ahead() and c else None for c in cache],
            }
            self._free_slots = list(range(slots))[::-1]
        return self._g

    def _limits(self) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
        """The decode limits `step` plans with, made at its first call (the backend's limits are fixed once it is
        built): the distinct limits, ascending; the sparse layers; and each sparse layer's limit."""
        if self._limit_cache is None:
            fb = self.fallback
            sparse = fb.sparse_layers()
            self._limit_cache = (tuple(fb.limits(True)), np.array(sparse, dtype=np.int64),
                                 np.array([fb.limit(layer, True) for layer in sparse], dtype=np.int64))
        return self._limit_cache

    def _index_width(self, layer: int, width: int) -> int:
        """Width of `layer`'s attention index in a captured step whose last stage is `width` wide: a row no longer
        than the layer's decode limit reads every key block up to the limit."""
        limit = self.fallback.limit(layer, True)
        return max(width, -(-limit // self.method.block_k)) if limit > 0 else width

    def _step_memo(self, layer: int) -> dict:
        """Tensors the layers of one forward share (the positions of the rows' queries, the "every block" rows of
        each decode limit), made by the first layer that needs them; inside a captured graph they are that layer's
        kernels, replayed every step. A forward starts afresh at its first layer (the layers run in order) and at
        every `running`: a capture's warm-up forward and the capture itself each make their own."""
        if layer <= self._memo_layer:
            self._memo = {}
        self._memo_layer = layer
        return self._memo

    def _num_stages(self) -> int:
        return len(self.method.graph_stage_widths(0))

    def scratch(self) -> None:
        """Static buffers that point at scratch state: warm-up and capture write nothing real."""
        g = self._buffers()
        g["slot"].fill_(self.max_num_seqs)
        g["first"].fill_(self._num_stages())
        if self.boxes is not None:
            self.boxes.graph_scratch()

    @contextlib.contextmanager
    def running(self, key: tuple):
        self.variant = key
        self._memo, self._memo_layer = {}, -1
        try:
            yield
        finally:
            self.variant = None
            self._memo, self._memo_layer = {}, -1

    def step(self, seq_ids: list[int], seq_lens: list[int], steps: list[int]):
        """Host side of one graph-decoded step, the rows ordered longest first; `steps`: each sequence's decode step
        number. Returns (variant key, load(rows))."""
        g = self._buffers()
        m, L, N = self.method, self.num_layers, self._num_stages()
        limits, sparse, lim = self._limits()
        longest = max(seq_lens)
        bucket = min(1 << (longest - 1).bit_length(), max(longest, self.max_model_len))
        dense = tuple(longest <= x for x in limits)
        first = np.full((L, len(seq_ids)), N, dtype=np.int64)
        slots, taken = [], []
        for row, (seq_id, length, step) in enumerate(zip(seq_ids, seq_lens, steps)):
            if seq_id not in self.slots:
                self.slots[seq_id] = self._free_slots.pop()
                taken.append(self.slots[seq_id])
            slots.append(self.slots[seq_id])
            seen = self.cached.get(seq_id, 0)
            past = lim < length  # the sparse layers this row selects in (no longer than the limit: every key block)
            if past.any():
                first[sparse[past], row] = m.refresh_from(step)
                first[sparse[past & (lim >= seen)], row] = 0  # the cache starts once the sequence is past the limit
                self.cached[seq_id] = length
        level = int(first[sparse].min()) if len(sparse) else N
        # rows past the shortest limit run the stages (a short row among long ones reads every key block)
        need = sum(length > int(lim.min()) for length in seq_lens) if len(sparse) else 0
        if need and any(a < b for a, b in zip(seq_lens, seq_lens[1:])):
            raise ValueError("graph decode needs the batch ordered longest first (engine/model_runner.py)")
        select = 0 if need == 0 else 1 << (need - 1).bit_length()
        catchup = 0 if self.boxes is None else self.boxes.graph_plan(seq_ids, seq_lens)

        def load(rows: int) -> None:  # one host-to-device copy per buffer, the padding rows included
            n = len(slots)
            padded = np.full((L, rows), N, dtype=np.int64)
            padded[:, :n] = first
            g["slot"][:rows].copy_(torch.tensor(slots + [self.max_num_seqs] * (rows - n), dtype=torch.long),
                                   non_blocking=True)
            g["first"][:, :rows].copy_(torch.from_numpy(padded), non_blocking=True)
            if taken and g["ahead"][0] is not None:  # a new sequence's slot: nothing of stage 0 kept
                idx = torch.tensor(taken, dtype=torch.long).to(self.device, non_blocking=True)
                for buf in g["ahead"]:
                    if buf is not None:
                        buf.index_fill_(0, idx, -1)
            if self.boxes is not None:
                self.boxes.graph_load(rows)
        return (bucket, level, dense, select, catchup), load

    def _below_boxes(self, dense: tuple[bool, ...]) -> bool:
        """A variant whose rows are all too short to box anything: every decode limit holds the longest row
        (`dense`), and the kept boxes start no earlier than the shortest sparse layer's decode limit (their
        `min_len` is the shortest limit, prefill or decode), so the longest row is within `min_len` and the build
        would launch for nothing (~3 small kernels per layer). Decided from the variant key alone, as a captured
        graph must be. Why a dense-mode step was slower than the dense backend's (0.93x at 4K on the 8B shape,
        docs/benchmarks.md) is not profiled: this removes the part of it that the code shows."""
        fb = self.fallback
        sparse = fb.sparse_layers()
        return all(dense) and bool(sparse) and self.boxes.min_len >= min(fb.limit(layer, True) for layer in sparse)

    def select(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata):
        """The running variant's selection in `layer`: None when the layer attends densely, else what
        `SparseBackend.attend` takes (query blocks, the kernels' block tensors, blocks, counts, context length)."""
        bucket, level, dense, select, catchup = self.variant
        m, fb = self.method, self.fallback
        n = q.shape[0]
        self._step_memo(layer)
        box_tables = None
        if self.boxes is not None and layer not in fb.layers and not self._below_boxes(dense):
            rope = m.rope_args(layer, "prune", meta.max_seq_len)  # box the rows' new chunks before any selection
            box_tables = self.boxes.build(layer, q, k_cache, meta, rope, graph=(bucket, catchup))
        limit = fb.limit(layer, True)
        if layer in fb.layers or dense[fb.limits(True).index(limit)]:
            return None
        g, dev = self._g, q.device
        memo = self._memo
        caches = g["cache"][layer]
        N = len(caches)
        slot = g["slot"][:n]
        first = g["first"][layer, :n]
        ends = meta.seq_lens[:n]  # int32, as the kernels read it (no cast)
        # rows [0, sel) run the stages; the rest are no longer than every limit and read every key block below
        sel = min(select, n)
        # the last stage recomputed by every selecting row at every step (the default's refresh 1): its top-k writes
        # row i of `last` (indexed by batch row, not slot: that cache is never kept) and its counts, so no
        # index_copy into the cache, no gather of it by slot and, with one row, no count of the index
        direct = N > 0 and level < N and m.graph_last_direct()
        if level < N:
            # the cached stages this variant reads, one gather each: stage level - 1 (what the recomputation starts
            # from) and level.. (kept by the rows whose own schedule does not refresh them: not a stage refreshed at
            # every step); none at level N
            cached = [c[slot] if i == level - 1 or (i >= level and not m.refreshed_every_step(i)) else None
                      for i, c in enumerate(caches)]
            fresh: list[list[torch.Tensor]] = [[] for _ in caches[level:]]
            held = g["ahead"][layer] if level == 0 else None  # `graph_ahead`: stage 0's kept output, rows by slot
            nexts: list[torch.Tensor] = []
            if held is not None:
                held_rows = held[slot]
            if "cand_end" not in memo:  # the same for every layer of the step: one op, not one per layer
                memo["cand_end"] = m.candidate_end(ends)
            cand_end = memo["cand_end"]
            for i in range(sel):
                # one BlockQueries per row and step, so that what its selection derives from the blocks alone (the
                # stage-0 candidates, the query rows' rotation) is made by the first layer and kept (`memo`)
                if ("blocks", i) not in memo:
                    memo["blocks", i] = BlockQueries(g["zero"], g["ones"][:1], ends[i:i + 1], 1, bucket,
                                                     cand_end[i:i + 1], memo={})
                blocks = memo["blocks", i]
                boxes = None if box_tables is None else self.boxes.seq_boxes(layer, box_tables, i)
                probes = install = None
                if meta.page_reads is not None or meta.install_reads is not None:  # no op without a listener
                    row, pos = g["arange"][i:i + 1], ends[i:i + 1] - 1
                    probes = None if meta.page_reads is None else probe_reads(meta, layer, row, pos)
                    install = install_now(meta, layer, row, pos)
                keys = SequenceKeys(k_cache, meta.block_tables[i], bucket, boxes, probes, install)
                out = (g["last"][layer][i:i + 1, :, :caches[-1].shape[2]], g["counts"][layer, i:i + 1]) \
                    if direct else None
                ahead = None if held is None else StageAhead(held_rows[i:i + 1])
                outs = m.graph_select(layer, q[i:i + 1], blocks, keys,
                                      [None if c is None else c[i:i + 1] for c in cached], first[i:i + 1], level,
                                      out=out, **({} if ahead is None else {"ahead": ahead}))
                for j, o in enumerate(outs):
                    fresh[j].append(o)
                if ahead is not None:
                    nexts.append(ahead.next)
            if nexts:
                held.index_copy_(0, slot[:sel], nexts[0] if len(nexts) == 1 else torch.cat(nexts))
            for c, f in zip(caches[level:], fresh):
                if f:
                    c.index_copy_(0, slot[:sel], f[0] if len(f) == 1 else torch.cat(f))
        if direct:  # rows [0, sel) written just now; rows past sel are short rows, replaced below
            blocks = g["last"][layer][:n]
        elif N:  # every row's last stage (just written, or cached), already padded to the index width
            blocks = g["last"][layer][slot]
        else:
            blocks = torch.full((n, m.groups, self._index_width(layer, 0)), -1, dtype=torch.int32, device=dev)
        # a row no longer than the limit reads every key block, as in an eager step; with one row the variant's
        # `dense` says the row is longer than the limit (else this layer attended densely above)
        if limit > 0 and n > 1:
            width = blocks.shape[2]
            if ("every", limit, width) not in memo:  # the same for every layer of this limit and width
                ids = g["arange"][:width]
                n_blocks = torch.div(ends + (m.block_k - 1), m.block_k, rounding_mode="floor")
                every = torch.where(ids[None, :] < n_blocks[:, None], ids[None, :], -1)
                memo["every", limit, width] = (every[:, None, :], (ends <= limit)[:, None, None])
            every, short = memo["every", limit, width]
            blocks = torch.where(short, every, blocks)
        counts = g["counts"][layer, :1] if direct and n == 1 else (blocks >= 0).sum(-1, dtype=torch.int32)
        if use_kernels(q):
            if "queries" not in memo:
                rows = g["arange"][:n]
                memo["queries"] = (rows, rows, g["ones"][:n], meta.seq_lens[:n] - 1)
            plan_queries = memo["queries"]
            qb = QueryBlocks(list(range(n)), list(range(n)), [1] * n, [0] * n)  # host mirror: only its size is read
        else:  # the reference executor reads host positions (no graph to break off CUDA)
            plan_queries = None
            qb = QueryBlocks(list(range(n)), list(range(n)), [1] * n, [int(x) - 1 for x in meta.seq_lens[:n].tolist()])
        return qb, plan_queries, blocks, counts, bucket
