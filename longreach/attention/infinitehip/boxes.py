"""The chunk boxes of a box-scored stage 0 (kernels/chunk_box.py), kept per sequence in a pool paged like the KV cache.

Stage 0 of `infinitehip:3k-box` scores every candidate chunk from a box around its keys. The boxes of complete chunks
never change, so they are built once and kept: each step boxes only the chunks its new keys complete (a prefill
chunk's range; in decode, the chunk that the newest key follows, one step in a chunk's length), and writes them in
place. A chunk is a candidate only once it starts before the query's window (`n_window`, 1,024 tokens in every
preset), so with a window at least a chunk long no selection reads a partial chunk's box; with a shorter one the
chunk that holds the newest key is boxed at every step (`partial`), as before 2026-11-29.

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

Bookkeeping is attention/box_store.py's `BoxSteps` (shared with PSA's and Quest's page boxes): `plan` notes which
chunks each sequence boxes (lo, hi), `assign` gives it its table row and pages once the pool exists (the first forward
of the step, or a graph's input loading; `_row` here), and `commit` records the complete chunks once the step's forward
has built them, so a step the backend does not run (a composed backend's prefill) boxes nothing and the next step
catches up. The boxes themselves are built by kernels/key_boxes.py's build kernel (both flavours).

The sparse backend drives the pool through the `KeptBoxes` interface (sparse/selection.py): `begin_step` and
`build` for an eager step, `graph_plan`, `graph_load` and `build(..., graph=...)` for a captured one, whose inputs
(rows, lens, lo, hi per row) sit in the pool's own static buffer.
"""
from __future__ import annotations

import logging

import torch

from ...kernels.chunk_box import box_move
from ..box_store import BoxSteps, layer_slots

logger = logging.getLogger("longreach")

PER_PAGE = 16  # chunks per box page


class BoxPool(BoxSteps):
    def __init__(self, layers, chunk: int, kind: str, num_kv_heads: int, head_dim: int, min_len: int,
                 max_seqs: int, max_model_len: int, device: torch.device, partial: bool = True):
        """layers: the model layers that keep boxes (box_store.py `layer_slots`: an int n is layers 0 .. n-1).
        partial: box the chunk that holds the newest key at every step (BoxSteps); False: only chunks complete
        before the newest key, which is enough when the method's window is at least a chunk long (`make_boxes`):
        a candidate chunk starts before the query's window, so it ended at least one key before the newest."""
        super().__init__(chunk, kind, min_len, partial, max_seqs, device)
        self.slots = layer_slots(layers)
        self.num_layers, self.chunk = len(self.slots), chunk
        self.shape = (2, 2, num_kv_heads, head_dim)
        self.per = PER_PAGE
        self.width = -(-max_model_len // (self.per * chunk))  # box pages of the longest sequence
        # self.pool: (L, pages * per, 2, 2, H_kv, D), made on first use
        self._capacity = 0  # KV tokens the pool is sized for
        # row max_seqs is the scratch row (short sequences, graph padding): it points at page 0 and boxes nothing
        self.scratch = max_seqs
        self.tables = torch.zeros(max_seqs + 1, self.width, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_seqs))[::-1]
        self._free_pages: list[int] = []
        self.rows: dict[int, int] = {}  # seq_id -> row of tables
        self.pages: dict[int, list[int]] = {}  # seq_id -> its box pages

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
    def free(self, seq_id: int) -> None:
        self.reset(seq_id)
        if seq_id in self.rows:
            self._free_rows.append(self.rows.pop(seq_id))
            self._free_pages.extend(self.pages.pop(seq_id))

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

    def _row(self, seq_id: int, length: int) -> int:
        """The sequence's table row, its box pages grown to hold `length` tokens."""
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

    def seq_boxes(self, layer: int, tables: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """SequenceKeys.boxes of batch row `row` in `layer`: (the layer's pool, its box table row, chunks per page)."""
        return self.pool[self.slots[layer]], tables[row], self.per

    def scratch_boxes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """SequenceKeys.boxes of the scratch row (it points at page 0 and is never a sequence's)."""
        return self.seq_boxes(layer, self.tables, self.scratch)

    def build(self, layer, q, k_cache, meta, rope, graph: tuple[int, bool] | None = None) -> torch.Tensor:
        """Box this step's new chunks of `layer` into the pool (before any selection reads them); returns the rows'
        box tables (n, width). `graph`: (bucket, catch-up) of a graph step, whose (rows, lens, lo, hi) sit in the
        static buffer (`graph_load`); None: the eager step's, assigned at its first forward."""
        if self.pool is None:  # made by bind_kv_cache in the engine; a forward before it (the memory probe) makes it
            self.ensure(k_cache.shape[0] * k_cache.shape[1], q.dtype)
        return self.build_into(self.pool[self.slots[layer]], self.per, q, k_cache, meta, graph, box_move(rope),
                               self.tables)
