"""Kept key boxes (kernels/key_boxes.py): which units of each sequence are boxed, step by step, and the page-indexed
store that PSA and Quest keep.

Every store of kept boxes does the same host bookkeeping (`BoxSteps`): per step it notes which units each sequence
boxes (`plan`: lo, hi), gives the rows their box-table row (`assign`), and once the step's forward has built them
records the complete units (`commit`), so a step the backend does not run (a composed backend's prefill) boxes
nothing and the next step catches up. A graph-decoded step keeps its inputs (rows, lens, lo, hi per batch row) in the
store's own static buffer. Two stores use it:
  * `PageBoxes` (here): a unit is one KV page, boxes indexed by page id beside the page pool (PSA's block metadata,
    Quest's page bounds). Nothing to allocate per sequence: the box tables are the KV block tables.
  * `BoxPool` (infinitehip/boxes.py): infinitehip's 64-token chunks, in box pages of its own with a box table per
    sequence.
Both are driven through the `KeptBoxes` interface (sparse/selection.py): the sparse backend calls `begin_step`, then
`build` in every non-dense layer before any selection reads the boxes; PSA's backend does the same at decode.
"""
from __future__ import annotations

import logging
from collections import deque

import torch

from ..kernels import use_triton
from ..kernels.key_boxes import build_boxes_reference, build_boxes_triton

logger = logging.getLogger("longreach")


def layer_slots(layers) -> dict[int, int]:
    """Model layer -> its index in a box store that keeps `layers` (an int n: layers 0 .. n-1; or the layers that
    select, ascending: a model's always-dense layers, e.g. Gemma 3's sliding-window ones, keep no boxes)."""
    layers = range(layers) if isinstance(layers, int) else layers
    return {layer: i for i, layer in enumerate(layers)}


class BoxSteps:
    """Which units (`unit` tokens each) of each sequence longer than `min_len` are boxed; subclasses give the store.

    partial: the partial last unit is boxed too, and boxed again each step until it is complete (Quest;
    infinitehip with a window shorter than a chunk); else only the units complete before the step's newest key (PSA's
    blocks, which end before its tail; infinitehip's chunks, which end before its window)."""

    def __init__(self, unit: int, kind: str, min_len: int, partial: bool, max_seqs: int, device: torch.device):
        self.unit, self.kind, self.min_len, self.partial = unit, kind, min_len, partial
        self.max_seqs, self.device = max_seqs, device
        self.pool: torch.Tensor | None = None  # the store, per layer; made by `ensure` (subclasses)
        self.scratch = 0  # the box-table row of rows that box nothing (short sequences, graph padding)
        self.done: dict[int, int] = {}  # seq_id -> complete units boxed
        self._pending: dict[int, int] = {}  # seq_id -> complete units once this step's boxes are built
        self._step: list[tuple] = []  # this step's (seq_id or None, length, lo, hi), see plan
        # an eager step's parts (one, or a mixed step's decode and prefill parts): each part's plan (meta, step,
        # pending) from begin_step, and its assigned columns (meta, rows, lens, lo, hi, most) from its first build
        self._plans: deque[tuple] = deque(maxlen=2)
        self._eager: deque[tuple] = deque(maxlen=2)
        self._graph_in: torch.Tensor | None = None  # (4, max_seqs) int32 rows, lens, lo, hi of a graph step
        self.tables: torch.Tensor | None = None  # per table row, its box pages (a store with box tables: BoxPool)
        self._graph_tables: torch.Tensor | None = None  # the graph step's rows of `tables`, gathered as it loads

    def _row(self, seq_id: int, length: int) -> int:
        """The box-table row of a sequence of `length` tokens (its store grown to hold it)."""
        return self.scratch

    def reset(self, seq_id: int) -> None:
        """A prefill from position 0: the sequence's boxes are built again."""
        self.done.pop(seq_id, None)
        self._pending.pop(seq_id, None)

    def free(self, seq_id: int) -> None:
        self.reset(seq_id)

    def plan(self, seq_ids, seq_lens) -> int:
        """Note this step's sequences and lengths (host only); returns the most units any row boxes (> 1: a
        catch-up). Rows are assigned by `assign`, once the store exists."""
        self._step = []
        self._pending = {}
        most = 0
        for seq_id, length in zip(seq_ids, seq_lens):
            if length <= self.min_len:
                self._step.append((None, length, 0, 0))
                continue
            complete = length // self.unit if self.partial else (length - 1) // self.unit
            hi = -(-length // self.unit) if self.partial else complete
            lo = min(self.done.get(seq_id, 0), hi)
            self._step.append((seq_id, length, lo, hi))
            self._pending[seq_id] = complete
            most = max(most, hi - lo)
        return most

    def assign(self) -> list[list[int]]:
        """[rows, lens, lo, hi] of the planned step, one entry per sequence: its box-table row, length and the units
        [lo, hi) it boxes; short sequences get the scratch row and nothing to box. Needs the store (`ensure`)."""
        if self.pool is None:
            raise RuntimeError("the box store is made at the first forward; assign() came before it")
        out: list[list[int]] = [[], [], [], []]
        for seq_id, length, lo, hi in self._step:
            row = self.scratch if seq_id is None else self._row(seq_id, length)
            for col, x in zip(out, (row, length, lo, hi)):
                col.append(x)
        return out

    def commit(self) -> None:
        """This step's boxes are built: complete units need no rebuilding."""
        self.done.update(self._pending)
        self._pending = {}

    def begin_step(self, meta) -> None:
        """An eager step (or one part of a mixed step) begins: a prefill from position 0 builds its boxes afresh;
        note every row's new units, as this part's plan."""
        if meta.is_prefill:
            for seq_id, context in zip(meta.seq_ids, meta.context_lens):
                if context == 0:
                    self.reset(seq_id)
        self.plan(meta.seq_ids, [c + n for c, n in zip(meta.context_lens, meta.query_lens)])
        self._plans.append((meta, self._step, self._pending))

    def step_inputs(self, meta, q: torch.Tensor, graph: tuple[int, bool] | None) -> tuple:
        """(rows, lens, lo, hi, most) of this step's build, for the batch rows of `q`: a graph step's from the static
        buffer (`graph`: (bucket, `graph_plan`'s field); none, one unit per row, or every unit of the bucket to catch
        up), an eager part's assigned at its first layer (its boxes then count as built)."""
        if graph is not None:
            b = self._graph_in[:, :q.shape[0]]
            return b[0], b[1], b[2], b[3], -(-graph[0] // self.unit) if graph[1] > 1 else int(graph[1])
        found = next((e for e in self._eager if e[0] is meta), None)
        if found is None:  # this part's first layer: assign its plan's rows
            plan = next((p for p in self._plans if p[0] is meta), None)
            if plan is not None:
                _, self._step, self._pending = plan
            cols = self.assign()
            self.commit()
            t = torch.tensor(cols, dtype=torch.int32).reshape(4, -1).to(q.device)
            found = (meta, t[0], t[1], t[2], t[3], max([b - a for a, b in zip(cols[2], cols[3])] + [0]))
            self._eager.append(found)
        return found[1:]

    def build_into(self, pool: torch.Tensor, per: int, q, k_cache, meta, graph: tuple[int, bool] | None,
                   move: tuple[torch.Tensor, int] | None, tables: torch.Tensor | None = None) -> torch.Tensor:
        """Box the step's new units into one layer's `pool` (rows, F, 2, H_kv, D) through the rows' box tables: rows
        of the store's `tables`, or (None) the KV block tables themselves (page-indexed). Returns those tables (a
        graph step's rows of `tables` were gathered once, as it loaded: `graph_load`)."""
        rows, lens, lo, hi, most = self.step_inputs(meta, q, graph)
        block_tables = meta.block_tables[:rows.shape[0]]
        if tables is None:
            box_tables = block_tables
        elif graph is not None and tables is self.tables:
            box_tables = self._graph_tables[:rows.shape[0]]
        else:
            box_tables = tables[rows.long()]
        args = (k_cache, block_tables, lens, lo, hi, box_tables, pool, per, self.unit, self.kind)
        if use_triton(q):
            build_boxes_triton(*args, most, move)
        elif most > 0:
            build_boxes_reference(*args, move)
        return box_tables

    # ---- graph decode -----------------------------------------------------------------------------------------------
    def graph_plan(self, seq_ids, seq_lens) -> int:
        """`plan` for a graph step, as the variant's box field: 0 when no row boxes anything (a step of a store
        without partial units that completes none: its variant launches no build), 1 when each boxes at most one
        unit, 2 when some row boxes more (the catch-up variant)."""
        return min(self.plan(seq_ids, seq_lens), 2)

    def graph_scratch(self, rows: int | None = None) -> None:
        """Graph inputs that box nothing (the scratch row, length 1, no units) in the first `rows` rows."""
        self._graph_write([[self.scratch], [1], [0], [0]], self.max_seqs if rows is None else rows)

    def graph_load(self, rows: int) -> None:
        """The planned step's inputs into the static buffer, padding rows to `rows` with scratch; its complete units
        count as built (the graph replays next). The store exists: a forward (at least a capture's warm-up) made it."""
        cols = self.assign()
        self._graph_write(cols, rows)
        self.commit()

    def _graph_write(self, cols: list[list[int]], rows: int) -> None:
        """(rows, lens, lo, hi) of the first len(cols[0]) batch rows, the rest up to `rows` scratch, into the static
        buffer in one host-to-device copy; and, with box tables, those rows' tables gathered into theirs (one
        kernel per step, outside the graph, instead of one per layer inside it)."""
        if self._graph_in is None:
            self._graph_in = torch.zeros(4, self.max_seqs, dtype=torch.int32, device=self.device)
        n = min(len(cols[0]), rows)
        pad = rows - n
        host = torch.tensor([c[:n] + [fill] * pad for c, fill in zip(cols, (self.scratch, 1, 0, 0))],
                            dtype=torch.int32).reshape(4, rows)
        self._graph_in[:, :rows].copy_(host, non_blocking=True)
        if self.tables is not None:
            if self._graph_tables is None:
                self._graph_tables = torch.zeros(self.max_seqs, self.tables.shape[1], dtype=torch.int32,
                                                 device=self.device)
            torch.index_select(self.tables, 0, self._graph_in[0, :rows], out=self._graph_tables[:rows])


class PageBoxes(BoxSteps):
    """Boxes of KV pages, by page id: per layer (pages, 2, H_kv, D) in the run dtype, beside the page pool.

    kind: minmax or cuboid-mean; move: (inv_freq, position) boxes the keys rotated to that position (PSA's `rope:
    rank`), None the keys as stored; partial: box the partial last page too (see BoxSteps); prefill: build in prefill
    steps too. Not with KV offloading, whose prefill attends on a staging area with page ids of its own (the boxes
    are then built at the first decode step, and a prefill selection reads none: `build` returns None)."""

    def __init__(self, name: str, layers, num_kv_heads: int, head_dim: int, block_size: int, kind: str,
                 partial: bool, prefill: bool, max_seqs: int, device: torch.device, min_len: int = 0,
                 move: tuple[torch.Tensor, int] | None = None):
        """layers: the model layers that keep boxes (`layer_slots`)."""
        super().__init__(block_size, kind, min_len, partial, max_seqs, device)
        self.name, self.move, self.prefill = name, move, prefill
        self.slots = layer_slots(layers)
        self.shape = (len(self.slots), 2, num_kv_heads, head_dim)

    def page_state_bytes(self, dtype: torch.dtype, block_size: int | None = None) -> int:
        """GPU bytes of boxes per KV page (the layers that keep boxes): the engine counts them in the KV budget."""
        L, two, H, D = self.shape
        return L * two * H * D * torch.empty((), dtype=dtype).element_size()

    def ensure(self, capacity_tokens: int, dtype: torch.dtype) -> None:
        """Make the store for a KV cache of `capacity_tokens` tokens (with offloading, the host tier's), in `dtype`.
        A store made for a smaller cache is made again while no sequence holds boxes (the engine's memory probe runs a
        prefill on a small cache before it sizes the real one)."""
        pages = capacity_tokens // self.unit + 1  # and the cache's scratch page, which padded graph rows write to
        if self.pool is not None:
            if pages <= self.pool.shape[1]:
                return
            if self.done:
                raise RuntimeError(f"the {self.name} page boxes were made for {self.pool.shape[1]} pages and sequences "
                                   f"hold boxes in them; they cannot grow to {pages} pages now")
        L, two, H, D = self.shape
        self.pool = torch.zeros(L, pages, two, H, D, dtype=dtype, device=self.device)
        logger.info("%s: page boxes for %d pages x %d layers, %.2f GiB on the %s", self.name, pages, L,
                    self.pool.numel() * self.pool.element_size() / 2**30, self.device.type.upper())

    def layer(self, layer: int) -> torch.Tensor:
        """The boxes of `layer`, (pages, 2, H_kv, D) by page id."""
        return self.pool[self.slots[layer]]

    def build(self, layer, q, k_cache, meta, rope=None, graph: tuple[int, bool] | None = None) -> torch.Tensor | None:
        """Box this step's new pages of `layer` (before any selection reads them); returns the rows' box tables (the
        block tables), or None in a prefill step that builds nothing (`prefill` off). `rope` is not read: the move
        is the store's. `graph`: (bucket, catch-up) of a graph step, its inputs in the static buffer."""
        if meta.is_prefill and not self.prefill:
            return None
        self.ensure((k_cache.shape[0] - 1) * k_cache.shape[1], q.dtype)  # no-op once bind_kv_cache made it
        return self.build_into(self.pool[self.slots[layer]][:, None], 1, q, k_cache, meta, graph, self.move)

    def seq_boxes(self, layer: int, tables: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """SequenceKeys.boxes of batch row `row` in `layer`: (the layer's store, one flavour; its block table; 1)."""
        return self.pool[self.slots[layer]][:, None], tables[row], 1
