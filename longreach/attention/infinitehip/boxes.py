"""The chunk boxes of a box-scored stage 0 (kernels/chunk_box.py), kept per sequence in a pool paged like the KV cache.

Stage 0 of `infinitehip:3k-box` scores every candidate chunk from a box around its keys. The boxes of complete chunks
never change, so they are built once and kept: each step boxes only the chunks its new keys touch (a prefill chunk's
range; in decode, the chunk that holds the newest key) and writes them in place.

Layout: per layer a pool of `pages * per` rows of (2 flavours, centre / radius, H_kv, D) in the run dtype; a page holds
the boxes of `per` consecutive chunks of one sequence (PER_PAGE = 16: 1,024 tokens at 64-token chunks). Each
sequence with boxes has a row in `tables` (its box pages, in order), so chunk j of the sequence sits at pool row
tables[row, j // per] * per + j % per. The addresses are stable while the sequence lives: a captured decode step
reads and writes them through the table with static shapes.

Which sequences: those longer than `min_len` (the shortest context any layer selects in; a shorter one attends
densely everywhere and needs no boxes). A sequence crossing it, or the first decode step after another backend's
prefill (`--decode-attention`), boxes every chunk it has at once ("catch-up": a graph variant of its own).

Size, decided once from the KV cache's capacity in tokens T (with offloading, the host tier's): ceil(T / (per *
chunk)) pages for the chunks themselves plus one partly filled page per sequence that can hold boxes at once (at most
T / (min_len + 1) of them, and at most max_num_seqs), so the pool cannot run out while the KV cache has room. The
engine reserves it per KV page (`page_state_bytes`; for a limit under one page, as if each sequence filled one).
Memory: two flavours of two vectors per chunk and KV head, 1/16 of the keys' size at 64-token
chunks (an 8B model at 1M tokens: 4 GiB in bf16), all on the GPU: stage 0 never reads host memory.

Bookkeeping is host-side and per step: `plan` notes which chunks each sequence boxes (lo, hi), `assign` gives it
its table row and pages once the pool exists (the first forward of the step, or a graph's input loading), and
`commit` records the complete chunks once the step's forward has built them, so a step the backend does not run (a
composed backend's prefill) boxes nothing and the next step catches up.

The sparse backend drives the pool through the `KeptBoxes` interface (sparse/selection.py): `begin_step` and
`build` for an eager step, `graph_plan`, `graph_load` and `build(..., graph=...)` for a captured one, whose inputs
(rows, lens, lo, hi per row) sit in the pool's own static buffer.
"""
from __future__ import annotations

import logging
from collections import deque

import torch

from ...kernels import use_triton
from ...kernels.chunk_box import build_boxes_reference, build_boxes_triton

logger = logging.getLogger("longreach")

PER_PAGE = 16  # chunks per box page


class BoxPool:
    def __init__(self, num_layers: int, chunk: int, kind: str, num_kv_heads: int, head_dim: int, min_len: int,
                 max_seqs: int, max_model_len: int, device: torch.device):
        self.num_layers, self.chunk, self.kind = num_layers, chunk, kind
        self.shape = (2, 2, num_kv_heads, head_dim)
        self.min_len, self.max_seqs = min_len, max_seqs
        self.device = device
        self.per = PER_PAGE
        self.width = -(-max_model_len // (self.per * chunk))  # box pages of the longest sequence
        self.pool: torch.Tensor | None = None  # (L, pages * per, 2, 2, H_kv, D), made on first use
        self._capacity = 0  # KV tokens the pool is sized for
        # row max_seqs is the scratch row (short sequences, graph padding): it points at page 0 and boxes nothing
        self.tables = torch.zeros(max_seqs + 1, self.width, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_seqs))[::-1]
        self._free_pages: list[int] = []
        self.rows: dict[int, int] = {}  # seq_id -> row of tables
        self.pages: dict[int, list[int]] = {}  # seq_id -> its box pages
        self.done: dict[int, int] = {}  # seq_id -> complete chunks boxed
        self._pending: dict[int, int] = {}  # seq_id -> complete chunks once this step's boxes are built
        self._step: list[tuple] = []  # this step's (seq_id or None, length, lo, hi), see plan
        # an eager step's parts (one, or a mixed step's decode and prefill parts): each part's plan (meta, step,
        # pending) from begin_step, and its assigned columns (meta, rows, lens, lo, hi, most) from its first build
        self._plans: deque[tuple] = deque(maxlen=2)
        self._eager: deque[tuple] = deque(maxlen=2)
        self._graph_in: torch.Tensor | None = None  # (4, max_seqs) int32 rows, lens, lo, hi of a graph step

    @property
    def scratch(self) -> int:
        return self.max_seqs

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        """Pool bytes per token of KV capacity: pages for the chunks plus a partial page per sequence, counting a
        sequence as at least min_len + 1 tokens and at least a page long (a `dense_below` under 1,024 tokens would
        otherwise reserve a page for every few tokens; `ensure` then allocates the exact bound, a little more)."""
        row = self.num_layers * 4 * self.shape[2] * self.shape[3] * torch.empty((), dtype=dtype).element_size()
        span = self.per * self.chunk
        return row / self.chunk * (1 + span / max(self.min_len + 1, span))

    def ensure(self, capacity_tokens: int, dtype: torch.dtype) -> None:
        """Make the pool in `dtype`, sized for a KV cache of `capacity_tokens` tokens (module docstring). A pool made
        for a smaller cache is made again while no sequence holds boxes: the engine's memory probe runs a prefill on
        a cache of one step's pages before it sizes the real one (engine/llm_engine.py), and the real one binds
        after it."""
        if self.pool is not None:
            if capacity_tokens <= self._capacity:
                return
            if self.rows:
                raise RuntimeError(f"the box pool was made for {self._capacity} tokens of KV and sequences hold "
                                   f"boxes in it; it cannot grow to {capacity_tokens} tokens now")
            self.pool = None
        self._capacity = capacity_tokens
        span = self.per * self.chunk
        seqs = min(self.max_seqs, capacity_tokens // (self.min_len + 1) + 1)  # sequences that can hold boxes
        pages = -(-capacity_tokens // span) + seqs
        self.pool = torch.zeros(self.num_layers, pages * self.per, *self.shape, dtype=dtype, device=self.device)
        self._free_pages = list(range(pages))[::-1]
        logger.info("stage-0 boxes: %d pages of %d chunks x %d layers, %.2f GiB on the %s", pages, self.per,
                    self.num_layers, self.pool.numel() * self.pool.element_size() / 2**30, self.device.type.upper())

    # ---- per sequence -------------------------------------------------------------------------------------------------
    def reset(self, seq_id: int) -> None:
        """A prefill from position 0: the sequence's boxes are built again (its pages are kept)."""
        self.done.pop(seq_id, None)
        self._pending.pop(seq_id, None)

    def free(self, seq_id: int) -> None:
        self.reset(seq_id)
        if seq_id in self.rows:
            self._free_rows.append(self.rows.pop(seq_id))
            self._free_pages.extend(self.pages.pop(seq_id))

    def plan(self, seq_ids, seq_lens) -> int:
        """Note this step's sequences and lengths (host only); returns the most chunks any row boxes (> 1: a
        catch-up). Rows and pages are assigned by `assign`, once the pool exists."""
        self._step = []
        self._pending = {}
        most = 0
        for seq_id, length in zip(seq_ids, seq_lens):
            if length <= self.min_len:
                self._step.append((None, length, 0, 0))
                continue
            lo, hi = self.done.get(seq_id, 0), -(-length // self.chunk)
            self._step.append((seq_id, length, lo, hi))
            self._pending[seq_id] = length // self.chunk
            most = max(most, hi - lo)
        return most

    def assign(self) -> list[list[int]]:
        """[rows, lens, lo, hi] of the planned step, one entry per sequence: its table row (its box pages allocated),
        length and the chunks [lo, hi) it boxes; short sequences get the scratch row and nothing to box. Needs the
        pool (`ensure`)."""
        if self.pool is None:
            raise RuntimeError("the box pool is made at the first forward; assign() came before it")
        out: list[list[int]] = [[], [], [], []]
        for seq_id, length, lo, hi in self._step:
            row = self.scratch if seq_id is None else self._grow(seq_id, length)
            for col, x in zip(out, (row, length, lo, hi)):
                col.append(x)
        return out

    def commit(self) -> None:
        """This step's boxes are built: complete chunks need no rebuilding."""
        self.done.update(self._pending)
        self._pending = {}

    def check_integrity(self) -> None:
        """Every page free or owned by one sequence, each sequence's table row listing its pages in order, rows
        unique; raises AssertionError. Cheap enough for tests and an idle engine."""
        owned = [p for pages in self.pages.values() for p in pages]
        assert len(owned) == len(set(owned)), "a box page is owned twice"
        if self.pool is not None:
            total = self.pool.shape[1] // self.per
            assert sorted(owned + self._free_pages) == list(range(total)), "box pages lost or duplicated"
        assert len(set(self.rows.values())) == len(self.rows) and self.scratch not in self.rows.values()
        assert sorted(list(self.rows.values()) + self._free_rows) == list(range(self.max_seqs)), "table rows lost"
        for seq_id, row in self.rows.items():
            pages = self.pages[seq_id]
            assert self.tables[row, :len(pages)].tolist() == pages, f"sequence {seq_id}'s box table is stale"

    def _grow(self, seq_id: int, length: int) -> int:
        if seq_id not in self.rows:
            if not self._free_rows:
                raise RuntimeError(f"no box-table row left for sequence {seq_id} (max_num_seqs={self.max_seqs})")
            self.rows[seq_id], self.pages[seq_id] = self._free_rows.pop(), []
        row, pages = self.rows[seq_id], self.pages[seq_id]
        need = -(-length // (self.per * self.chunk))
        if need > self.width:
            raise ValueError(f"sequence {seq_id} has {length} tokens, more than max_model_len allows boxes for")
        if need > len(pages):
            if need - len(pages) > len(self._free_pages):
                raise RuntimeError(f"the box pool is full ({self.pool.shape[1] // self.per} pages): it is sized for "
                                   "the KV cache's capacity, so this is a bug")
            new = [self._free_pages.pop() for _ in range(need - len(pages))]
            self.tables[row, len(pages):need] = torch.tensor(new, dtype=torch.int32).to(self.device)
            pages.extend(new)
        return row

    # ---- the engine's side (the `KeptBoxes` interface, sparse/selection.py) -----------------------------------------
    def page_state_bytes(self, dtype: torch.dtype, block_size: int) -> int:
        """GPU bytes of boxes per KV page (all layers): the engine counts them in the KV budget."""
        return int(-(-self.bytes_per_token(dtype) * block_size // 1))

    def begin_step(self, meta) -> None:
        """An eager step (or one part of a mixed step) begins: a prefill from position 0 builds its boxes afresh;
        note every row's new chunks, as this part's plan."""
        if meta.is_prefill:
            for seq_id, context in zip(meta.seq_ids, meta.context_lens):
                if context == 0:
                    self.reset(seq_id)
        self.plan(meta.seq_ids, [c + n for c, n in zip(meta.context_lens, meta.query_lens)])
        self._plans.append((meta, self._step, self._pending))

    def seq_boxes(self, layer: int, tables: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """SequenceKeys.boxes of batch row `row` in `layer`: (the layer's pool, its box table row, chunks per page)."""
        return self.pool[layer], tables[row], self.per

    def build(self, layer, q, k_cache, meta, rope, graph: tuple[int, bool] | None = None) -> torch.Tensor:
        """Box this step's new chunks of `layer` into the pool (before any selection reads them); returns the rows'
        box tables (n, width). `graph`: (bucket, catch-up) of a graph step, whose (rows, lens, lo, hi) sit in the
        static buffer (`graph_load`; one chunk per row, every chunk of the bucket to catch up); None: the eager
        step's, assigned at its first forward."""
        if self.pool is None:  # made by bind_kv_cache in the engine; a forward before it (the memory probe) makes it
            self.ensure(k_cache.shape[0] * k_cache.shape[1], q.dtype)
        if graph is not None:
            b = self._graph_in[:, :q.shape[0]]
            rows, lens, lo, hi = b[0], b[1], b[2], b[3]
            most = -(-graph[0] // self.chunk) if graph[1] else 1
        else:
            found = next((e for e in self._eager if e[0] is meta), None)
            if found is None:  # this part's first layer: assign its plan's rows and pages
                plan = next((p for p in self._plans if p[0] is meta), None)
                if plan is not None:
                    _, self._step, self._pending = plan
                cols = self.assign()
                self.commit()
                t = torch.tensor(cols, dtype=torch.int32).to(q.device)
                found = (meta, t[0], t[1], t[2], t[3], max([b - a for a, b in zip(cols[2], cols[3])] + [0]))
                self._eager.append(found)
            rows, lens, lo, hi, most = found[1:]
        tables = self.tables[rows.long()]
        if use_triton(q):
            build_boxes_triton(k_cache, meta.block_tables[:rows.shape[0]], lens, lo, hi, tables, self.pool[layer],
                               self.per, self.chunk, self.kind, rope, most)
        elif most > 0:
            build_boxes_reference(k_cache, meta.block_tables, lens, lo, hi, tables, self.pool[layer], self.per,
                                  self.chunk, self.kind, rope)
        return tables

    def graph_plan(self, seq_ids, seq_lens) -> bool:
        """`plan` for a graph step; True when some row boxes more than one chunk (the catch-up variant)."""
        return self.plan(seq_ids, seq_lens) > 1

    def _graph_buffer(self) -> torch.Tensor:
        if self._graph_in is None:
            self._graph_in = torch.zeros(4, self.max_seqs, dtype=torch.int32, device=self.device)
        return self._graph_in

    def graph_scratch(self, rows: int | None = None) -> None:
        """Graph inputs that box nothing (the scratch table row, length 1, no chunks) in the first `rows` rows."""
        box = self._graph_buffer()[:, :rows]
        box.zero_()
        box[0].fill_(self.scratch)
        box[1].fill_(1)

    def graph_load(self, rows: int) -> None:
        """The planned step's inputs into the static buffer, padding rows to `rows` with scratch; its complete chunks
        count as built (the graph replays next). The pool exists: a forward (at least a capture's warm-up) made it."""
        self.graph_scratch(rows)
        cols = self.assign()
        self._graph_in[:, :len(cols[0])].copy_(torch.tensor(cols, dtype=torch.int32), non_blocking=True)
        self.commit()
