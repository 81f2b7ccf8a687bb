"""Graph decode for the sparse backends: the decode step as CUDA-graph variants (a mixin of `SparseBackend`).

A captured decode step replays the same kernels every time, yet each sequence's mask cache recomputes stage i
only every refresh[i] steps, and a short context attends densely. So the step comes in variants, keyed by
  bucket  a power of two >= the batch's longest sequence (capped at max_model_len): the stages' candidate
          widths are sized by it, so one variant serves every length up to it (extra candidates are -1);
  level   the earliest stage any sequence of the batch recomputes this step (len(stages): none does);
  dense   for each distinct `dense_below` limit, whether the longest sequence is within it (those layers
          attend densely, as in an eager step);
  catchup whether some row boxes more than one chunk this step (a box-scored stage 0, attention/box_pool.py: a
          sequence just past the shortest limit, or the first decode step after another backend's prefill); the
          box kernel then covers every chunk of the bucket instead of one per row;
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
rows' new chunks inside the graph (inputs in the static "box" buffer, attention/box_pool.py) before any selection.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from .backend import AttentionMetadata
from .index import QueryBlocks


class GraphDecode:
    """The graph-decode half of `SparseBackend` (attention/sparse.py): host bookkeeping, static buffers, variants."""

    def _init_graph_decode(self) -> None:
        self._g = None  # static buffers (slots, refresh levels, stage caches), made on first use
        self._variant = None  # the graph variant forward() is running, see graph_step
        self._slot: dict[int, int] = {}  # seq_id -> row of the stage caches
        self._cached: set[tuple[int, int]] = set()  # (seq_id, layer) whose stage cache is filled

    def _free_graph_state(self, seq_id: int) -> None:
        if seq_id in self._slot:
            self._free_slots.append(self._slot.pop(seq_id))
        self._cached = {key for key in self._cached if key[0] != seq_id}

    def graph_unsupported(self) -> str | None:
        m = self.method
        if not self.supports_cuda_graph or any(m.graph_stage_widths(layer) is None
                                               for layer in range(self.model_config.num_layers)):
            return f"{m.name}'s decode selection is not graph-capturable"
        if any(name == "de" for spec in (m.prune_spec, m.attend_spec) for name, _, _ in spec):
            return "SelfExtend (de) positions change their group size with the context length"
        return None

    def graph_keys_upfront(self) -> list:
        return []

    def _graph_buffers(self):
        if self._g is None:
            m, slots, dev = self.method, self.engine_config.max_num_seqs, self.device
            L = self.model_config.num_layers
            self._g = {
                "box": torch.zeros(4, slots, dtype=torch.int32, device=dev),  # rows, lens, lo, hi (box_pool.py)
                "slot": torch.full((slots,), slots, dtype=torch.long, device=dev),
                "first": torch.zeros(L, slots, dtype=torch.long, device=dev),
                "cache": [[torch.full((slots + 1, m.groups, w), -1, dtype=torch.int32, device=dev)
                           for w in m.graph_stage_widths(layer)] for layer in range(L)],
            }
            self._free_slots = list(range(slots))[::-1]
        return self._g

    def _num_stages(self) -> int:
        return len(self.method.graph_stage_widths(0))

    def graph_scratch(self) -> None:
        g = self._graph_buffers()
        g["slot"].fill_(self.engine_config.max_num_seqs)
        g["first"].fill_(self._num_stages())
        self._scratch_boxes(g["box"])

    def _scratch_boxes(self, box: torch.Tensor) -> None:
        """Box inputs that box nothing: the scratch table row, length 1, no chunks."""
        box.zero_()
        box[0].fill_(self._boxes.scratch if self._boxes is not None else 0)
        box[1].fill_(1)

    @contextlib.contextmanager
    def graph_variant(self, key: tuple):
        self._variant = key
        try:
            yield
        finally:
            self._variant = None

    def graph_step(self, seq_ids, seq_lens):
        g = self._graph_buffers()
        m, L, N = self.method, self.model_config.num_layers, self._num_stages()
        longest = max(seq_lens)
        bucket = min(1 << (longest - 1).bit_length(), max(longest, self.engine_config.max_model_len))
        limits = self._limits()
        dense = tuple(longest <= lim for lim in limits)
        sparse_layers = [layer for layer in range(L) if layer not in self.config.dense_layers
                         and longest > self.dense_below(layer)]
        first = np.full((L, len(seq_ids)), N, dtype=np.int64)
        slots = []
        for row, (seq_id, length) in enumerate(zip(seq_ids, seq_lens)):
            step = self._decode_step[seq_id] = self._decode_step.get(seq_id, -1) + 1
            if seq_id not in self._slot:
                self._slot[seq_id] = self._free_slots.pop()
            slots.append(self._slot[seq_id])
            for layer in sparse_layers:
                if length <= self.dense_below(layer):  # reads every key block: its stages are not needed (stay N)
                    continue
                if (seq_id, layer) not in self._cached:  # the cache starts once the sequence is past the limit
                    first[layer, row] = 0
                    self._cached.add((seq_id, layer))
                else:
                    first[layer, row] = m.refresh_from(step)
        level = int(first[sparse_layers].min()) if sparse_layers else N
        shortest_limit = min(self.dense_below(layer) for layer in sparse_layers) if sparse_layers else None
        need = 0 if shortest_limit is None else sum(length > shortest_limit for length in seq_lens)
        if need and any(a < b for a, b in zip(seq_lens, seq_lens[1:])):
            raise ValueError("graph decode needs the batch ordered longest first (engine/model_runner.py)")
        select = 0 if need == 0 else 1 << (need - 1).bit_length()
        catchup = self._boxes is not None and self._boxes.plan(seq_ids, seq_lens) > 1

        def load(rows: int) -> None:
            n = len(slots)
            g["slot"][:n].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
            g["slot"][n:rows].fill_(self.engine_config.max_num_seqs)
            g["first"][:, :n].copy_(torch.from_numpy(first), non_blocking=True)
            g["first"][:, n:rows].fill_(N)
            if self._boxes is not None:  # the pool exists: a forward (at least the capture's warm-up) made it
                self._scratch_boxes(g["box"][:, :rows])
                g["box"][:, :n].copy_(torch.tensor(self._boxes.assign(), dtype=torch.int32), non_blocking=True)
                self._boxes.commit()
        return (bucket, level, dense, select, catchup), load

    def _limits(self) -> list[int]:
        return sorted({self.dense_below(layer) for layer in range(self.model_config.num_layers)})

    def _graph_forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        from .sparse import BlockQueries, SequenceKeys, use_kernels  # sparse.py imports this module

        bucket, level, dense, select, catchup = self._variant
        n = q.shape[0]
        box_tables = None
        if self._boxes is not None:  # box this step's new chunks (one per row; every chunk of the bucket to catch up)
            b = self._g["box"][:, :n]
            most = -(-bucket // self._boxes.chunk) if catchup else 1
            box_tables = self._build_boxes(layer, q, k_cache, meta, step=(b[0], b[1], b[2], b[3], most))
        limit = self.dense_below(layer)
        if layer in self.config.dense_layers or dense[self._limits().index(limit)]:
            return self.dense.forward(layer, q, k, v, k_cache, v_cache, meta)
        m, g, dev = self.method, self._g, q.device
        caches = g["cache"][layer]
        slot = g["slot"][:n]
        cached = [c[slot] for c in caches]  # (n, G, w_i)
        first = g["first"][layer, :n]
        ends = meta.seq_lens[:n].long()
        zero, one = torch.zeros(1, dtype=torch.long, device=dev), torch.ones(1, dtype=torch.long, device=dev)
        # rows [0, sel) run the stages; the rest are no longer than every limit and read every key block below
        sel = min(select, n)
        fresh: list[list[torch.Tensor]] = [[] for _ in caches[level:]]
        for i in range(sel):
            blocks = BlockQueries(zero, one, ends[i:i + 1], 1, bucket)
            keys = SequenceKeys(k_cache, meta.block_tables[i], bucket, self._seq_boxes(layer, box_tables, i))
            outs = m.graph_select(layer, q[i:i + 1], blocks, keys, [c[i:i + 1] for c in cached], first[i:i + 1],
                                  level)
            for j, o in enumerate(outs):
                fresh[j].append(o)
        stages = cached[:level] + [torch.cat(f) if f else c[:0] for f, c in zip(fresh, cached[level:])]
        for c, st in zip(caches[level:], stages[level:]):
            c.index_copy_(0, slot[:sel], st)
        if stages:  # the unselected rows' blocks are replaced by "every block" below; any values do
            blocks = torch.cat([stages[-1], cached[-1][sel:]]) if level < len(caches) else stages[-1]
        else:
            blocks = torch.empty(n, m.groups, 0, dtype=torch.int32, device=dev)
        if limit > 0:  # a row no longer than the limit reads every key block, as in an eager step
            width = max(blocks.shape[2], -(-limit // m.block_k))
            blocks = torch.nn.functional.pad(blocks, (0, width - blocks.shape[2]), value=-1)
            ids = torch.arange(width, dtype=torch.int32, device=dev)
            every = torch.where(ids[None, :] < torch.div(ends + m.block_k - 1, m.block_k, rounding_mode="floor")[:, None],
                                ids[None, :], -1)
            blocks = torch.where((ends <= limit)[:, None, None], every[:, None, :], blocks)
        counts = (blocks >= 0).sum(-1).to(torch.int32)
        if use_kernels(q):
            rows = torch.arange(n, dtype=torch.int32, device=dev)
            plan_queries = (rows, rows, torch.ones_like(rows), meta.seq_lens[:n] - 1)
            qb = QueryBlocks(list(range(n)), list(range(n)), [1] * n, [0] * n)  # host mirror: only its size is read
        else:  # the reference executor reads host positions (no graph to break off CUDA)
            plan_queries = None
            qb = QueryBlocks(list(range(n)), list(range(n)), [1] * n, [int(x) - 1 for x in meta.seq_lens[:n].tolist()])
        return self._attend(layer, q, k_cache, v_cache, meta, qb, plan_queries, blocks, counts, bucket)
