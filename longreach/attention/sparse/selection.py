"""What every top-k selection method shares: the keys and query blocks it sees, and the `SelectionMethod` interface.

A method (infinitehip/, hip/, quest/, streaming/) implements `SelectionMethod.select`: for the query blocks of one
sequence it returns which key blocks each block reads. The engine side of every such method is one class,
sparse/backend.py's `SparseBackend`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from ...kernels import use_triton
from ...kvcache.paged import gather_tokens
from ...rope.strategies import (
    ATTEND_CODES,
    PRUNE_CODES,
    RopeArgs,
    RopeFrame,
    de_group_size,
    parse_layer_spec,
    strategy_for,
)
from .config import SparseConfig


def probe_reads(meta, layer: int, seq: torch.Tensor, pos: torch.Tensor):
    """`SequenceKeys.probes` for one decode row (seq (1,) its row of meta.block_tables, pos (1,) its query's
    position): each call appends the stage's probes to `meta.page_reads` as a `PageReads` with `probe` set, which
    the runner hands to the store after the layer. None when the step collects no reads (prefill, a one-tier
    store)."""
    if meta.is_prefill or meta.page_reads is None:
        return None
    from ...kvcache.base import PageReads

    def note(ids: torch.Tensor, chunk: int) -> None:
        meta.page_reads.append(PageReads(layer, meta.block_tables, seq, pos, pos, 1, ids, chunk, 0, 0, probe=True))
    return note


def install_now(meta, layer: int, seq: torch.Tensor, pos: torch.Tensor):
    """`SequenceKeys.install` for one decode row (as `probe_reads`): each call hands a stage's candidate chunks to
    the store's `install_reads` before the stage scores them (kvcache/offload.py). None when the step's store
    cannot install inside a step (prefill, a one-tier store, page units install nothing there)."""
    if meta.is_prefill or meta.install_reads is None:
        return None
    from ...kvcache.base import PageReads

    def install(ids: torch.Tensor, chunk: int, ahead: bool = False) -> None:
        meta.install_reads(PageReads(layer, meta.block_tables, seq, pos, pos, 1, ids, chunk, 0, 0, probe=True,
                                     ahead=ahead))
    return install


@dataclass
class StageAhead:
    """A selection's first stage kept one refresh ahead (infinitehip's `ahead`) for one refresh: `held` (nb, G, C0)
    the output of the refresh before (a row of only -1: none kept; None: nothing kept at all), `next` what the
    method leaves to keep for the next one (graph.py keeps it in a static buffer, the eager path in its state)."""

    held: torch.Tensor | None
    next: torch.Tensor | None = None


class SequenceKeys:
    """One sequence's keys as the selection sees them: the paged cache and the sequence's block table.

    Kernels read through the table; reference code calls `dense()`, which gathers (L, H_kv, D) once and keeps it,
    and the reference scorer keeps its position-moved copies of those keys in
    `prune_tables`. One object serves one layer of one step (the keys do not change while it lives). `boxes`: the
    engine's kept key boxes of this sequence in this layer (`KeptBoxes.seq_boxes`: infinitehip's chunk boxes,
    Quest's page boxes): (the layer's store, the sequence's box table row, units per box page), or None (built from
    the keys when needed). `probes`: see __init__.
    """

    def __init__(self, k_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                 boxes: tuple[torch.Tensor, torch.Tensor, int] | None = None, probes=None, install=None):
        self.k_cache, self.block_table, self.length = k_cache, block_table, length
        self.boxes = boxes
        # probes(ids, chunk): a decode step's stage reports the candidate chunks whose keys it scored (the KV store
        # may install them: kvcache/offload.py); None when nobody listens (prefill, a one-tier cache)
        self.probes = probes
        # install(ids, chunk, ahead=False): a decode step's stage about to score candidates that are new this step
        # (infinitehip's stage 1 after stage 0 was rescored) asks the store to install their pages first
        # (`install_now`); with ahead, candidates it will score at a later step, copied in the background
        # (kvcache/prefetch.py); None: no store installs inside a step
        self.install = install
        self._dense: torch.Tensor | None = None
        self.prune_tables: dict = {}  # the reference scorer's moved keys, per strategy (valid while this object is)

    @classmethod
    def from_dense(cls, keys: torch.Tensor) -> "SequenceKeys":
        """Contiguous keys (L, H_kv, D) viewed as a cache of one-token pages (tests, the recall tool)."""
        out = cls(keys[:, None], torch.arange(keys.shape[0], dtype=torch.int32, device=keys.device), keys.shape[0])
        out._dense = keys
        return out

    def dense(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = gather_tokens(self.k_cache, self.block_table, self.length)
        return self._dense

    def chunk_boxes(self, chunk: int):
        """The kept boxes of chunks [0, ceil(length / chunk)) (a chunk: a KV page with page boxes) as a
        kernels.key_boxes.BoxView (read through the box table with static shapes: graph-capturable), or None
        without kept boxes."""
        if self.boxes is None:
            return None
        from ...kernels.key_boxes import BoxView

        pool, table, per = self.boxes
        return BoxView(pool, table, per, -(-self.length // chunk))


@dataclass
class BlockQueries:
    """The query blocks of one sequence as device tensors, plus host-side bounds that fix every shape.

    Selection code reads only these (no host sync), so a decode step can be captured in a CUDA graph once the
    tensors live in static buffers.
    """

    starts: torch.Tensor  # (nb,) first row of each block in the sequence's queries
    lens: torch.Tensor  # (nb,) rows of each block
    ends: torch.Tensor  # (nb,) position after each block's last row
    max_rows: int  # >= every len
    max_end: int  # >= every end
    # the method's `candidate_end(ends)` when the caller made it already (a graph decode step makes it once for all
    # its layers: sparse/graph.py), else None
    cand_end: torch.Tensor | None = None
    # tensors derived from these blocks alone (never from a layer's queries or keys), kept for the next layer of the
    # same graph decode step, which hands every layer the same BlockQueries (sparse/graph.py): on a GPU each is a
    # kernel inside the captured step, made once instead of once per layer. None: nothing kept (`shared`)
    memo: dict | None = None

    @property
    def num_blocks(self) -> int:
        return self.starts.shape[0]

    def shared(self, key, make):
        """make(), kept under `key` for the step's later layers where `memo` is set (its value must depend only on
        the blocks and on what the key names)."""
        if self.memo is None:
            return make()
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    @classmethod
    def build(cls, blocks: "list[tuple[int, int, int]] | BlockQueries", device) -> "BlockQueries":
        """From (first row, rows, position of the first row) per block."""
        if isinstance(blocks, BlockQueries):
            return blocks
        t = torch.tensor([[b[0], b[1], b[2] + b[1]] for b in blocks], dtype=torch.long).reshape(-1, 3).to(device)
        return cls(t[:, 0], t[:, 1], t[:, 2], max([b[1] for b in blocks] + [1]), max([b[2] + b[1] for b in blocks] + [0]))

    def __getitem__(self, sl: slice) -> "BlockQueries":  # a slice keeps nothing (`memo`: of the whole blocks)
        return BlockQueries(self.starts[sl], self.lens[sl], self.ends[sl], self.max_rows, self.max_end,
                            None if self.cand_end is None else self.cand_end[sl])


class KeptBoxes(Protocol):
    """Key boxes a method keeps across steps (attention/box_store.py: PageBoxes, Quest's page boxes; infinitehip/
    boxes.py: BoxPool, its stage 0's chunk boxes), as `SparseBackend` and its `GraphDecoder` drive them. Every step
    boxes the units its new keys touch, in every non-dense layer before any selection reads them; `build` returns the
    batch rows' box tables (n, width), or None when the step reads no kept boxes (then built from the keys)."""

    min_len: int  # sequences of at most this many tokens are not boxed (the shortest context any layer selects in)

    def ensure(self, capacity_tokens: int, dtype: torch.dtype) -> None:
        """Size the boxes for a KV cache of `capacity_tokens` tokens (`AttentionBackend.bind_kv_cache`)."""

    def page_state_bytes(self, dtype: torch.dtype, block_size: int) -> int:
        """GPU bytes of boxes per KV page of `block_size` tokens (all layers)."""

    def begin_step(self, meta) -> None:
        """An eager step begins (host bookkeeping of the rows' new chunks)."""

    def build(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, meta, rope: RopeArgs | None,
              graph: tuple[int, bool] | None = None) -> torch.Tensor | None:
        """Box the step's new chunks of `layer`; `graph`: (bucket, catch-up) of a graph-decoded step, whose inputs
        `graph_load` wrote. Returns the rows' box tables."""

    def seq_boxes(self, layer: int, tables: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`SequenceKeys.boxes` of batch row `row` in `layer`."""

    def scratch_boxes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`SequenceKeys.boxes` of the scratch row in `layer` (graph captures up front: shapes, no real boxes)."""

    def free(self, seq_id: int) -> None: ...

    def graph_plan(self, seq_ids: list[int], seq_lens: list[int]) -> int:
        """Host side of a graph-decoded step: 0 when no row boxes a chunk this step (the variant launches no build),
        1 when each boxes at most one, 2 when some row boxes more (a catch-up variant)."""

    def graph_load(self, rows: int) -> None:
        """Write the planned step's inputs into the static graph buffer (`rows` rows, the padding boxes nothing)."""

    def graph_scratch(self) -> None:
        """Point the static graph buffer at inputs that box nothing (warm-up and capture)."""


def use_kernels(t: torch.Tensor) -> bool:
    """Triton kernels on CUDA tensors; the PyTorch references everywhere else (the one switch: kernels.use_triton)."""
    return use_triton(t)


class SelectionMethod(ABC):
    """Chooses key blocks for query blocks of one sequence. Subclasses set the class attributes."""

    name: ClassVar[str]
    config_cls: ClassVar[type]
    presets: ClassVar[dict[str, SparseConfig]]
    default_preset: ClassVar[str]

    def __init__(self, cfg: SparseConfig, num_heads: int, num_kv_heads: int):
        self.cfg = cfg
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.groups = {"layer": 1, "kv_head": num_kv_heads, "head": num_heads}[cfg.granularity]
        self.group_of_head = torch.arange(num_heads) // (num_heads // self.groups)
        self.kv_of_head = torch.arange(num_heads) // (num_heads // num_kv_heads)
        self.prune_spec = parse_layer_spec(cfg.prune_rope, PRUNE_CODES, "prune_rope")
        self.attend_spec = parse_layer_spec(cfg.attend_rope, ATTEND_CODES, "attend_rope")
        self.rope_frame: RopeFrame | None = None  # set by the backend (the model's frequencies); None: no remapping
        self._aranges: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []  # outgrown aranges: a captured graph may still read them

    def rope_mode(self, layer: int, phase: str) -> str:
        """The strategy code of `phase` ("prune" or "attend") in `layer`; "none" when positions stay true (strategy
        none, or no model frame)."""
        if self.rope_frame is None:
            return "none"
        return strategy_for(self.prune_spec if phase == "prune" else self.attend_spec, layer)

    def rope_args(self, layer: int, phase: str, context_len: int) -> RopeArgs | None:
        """The strategy of `phase` in `layer` (`rope_mode`) for a context of `context_len` tokens, or None when
        positions stay true."""
        mode = self.rope_mode(layer, phase)
        f = self.rope_frame
        if mode == "none":
            return None
        group = self.cfg.de_group or de_group_size(context_len, f.trained_len, self.cfg.n_window)
        return RopeArgs(mode, f.inv_freq, f.rope_from, group, self.cfg.n_window)

    @property
    @abstractmethod
    def block_k(self) -> int:
        """Tokens per key block of the selections this method returns."""

    @abstractmethod
    def selected_budget(self, layer: int) -> int:
        """Most tokens selected per query block (beyond sink and window) in `layer`."""

    def token_budget(self, layer: int) -> int:
        return self.cfg.n_sink + self.cfg.n_window + self.selected_budget(layer)

    def select(self, layer: int, q: torch.Tensor, blocks: "list[tuple[int, int, int]] | BlockQueries",
               keys: "SequenceKeys | torch.Tensor", state: dict | None = None, step: int | None = None) -> torch.Tensor:
        """Key blocks for each query block of one sequence: (nb, groups, W) ascending ids, -1 padded.

        q: (n, H_q, D) this step's queries of the sequence (RoPE applied); blocks: (first row in q, rows, position of
        the first row) per query block, or a `BlockQueries`; keys: the sequence's keys (rotated at true positions) in
        the paged cache, or a plain (L, H_kv, D) tensor. state/step: the sequence's per-layer decode state (a dict the
        method may fill) and the decode step number since the last prefill, or None in prefill.
        """
        if isinstance(keys, torch.Tensor):
            keys = SequenceKeys.from_dense(keys)
        return self._select(layer, q, BlockQueries.build(blocks, q.device), keys, state, step)

    @abstractmethod
    def _select(self, layer: int, q: torch.Tensor, blocks: BlockQueries, keys: SequenceKeys, state: dict | None,
                step: int | None) -> torch.Tensor:
        """`select` with normalised arguments."""

    # ---- captured decode (CUDA graphs; see graph.py) ----------------------------------------------------------
    def graph_stage_widths(self, layer: int) -> tuple[int, ...] | None:
        """Widths of the per-stage outputs one decode step caches for a sequence in `layer`: () when the selection
        keeps no state, None when the method's decode step cannot be captured (the default)."""
        return None

    def refresh_from(self, step: int) -> int:
        """First stage recomputed at decode step `step` of a sequence whose cache is filled (len(widths): none)."""
        return 0

    def refreshed_every_step(self, stage: int) -> bool:
        """Is `stage` recomputed at every decode step of every sequence that selects? Its cached output is then
        never kept, so a captured step need not gather it (graph.py)."""
        return False

    def graph_last_direct(self) -> bool:
        """May a captured step have the last stage's top-k write its output straight into the layer's attention
        index (`graph_select`'s `out`)? Only where every selecting row recomputes that stage at every step (its
        cached copy is never kept) and the top-k's ids and counts are the index as they are."""
        return False

    def graph_ahead(self) -> bool:
        """Does a decode step keep, per sequence and layer, stage 0's newest output besides the one it uses
        (infinitehip's `ahead`)? A captured step then hands `graph_select` that buffer's row (graph.py)."""
        return False

    def graph_select(self, layer: int, q: torch.Tensor, blocks: BlockQueries, keys: SequenceKeys,
                     cached: list[torch.Tensor], row_first: torch.Tensor, level: int,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None, ahead=None) -> list[torch.Tensor]:
        """Stage outputs level..N-1 for one sequence's decode block, without host syncs. Stage i is recomputed for
        the blocks whose `row_first` <= i; the others keep `cached[i]`, and the next stage builds on what was kept.
        `out` (only where `graph_last_direct`): (ids (1, G, C_last), counts (1, G)) int32 views the last stage's
        top-k writes into; that stage's output is then left out of the returned list. `ahead` (only where
        `graph_ahead`): the method's holder of stage 0's kept output (infinitehip/method.py, `StageAhead`)."""
        raise NotImplementedError

    # ---- helpers shared by the methods ---------------------------------------------------------------------------
    def arange(self, n: int, device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """torch.arange(n) as a view of a buffer kept per device and dtype: no kernel once the buffer is long enough
        (a captured decode step launches none for it). Grown only outside a CUDA graph capture (during one a short
        buffer gives a fresh arange, a kernel in the graph); an outgrown buffer is kept alive, since a captured
        graph reads it by address. Read-only: nothing may write into the view."""
        device = torch.device(device)
        key = (str(device), dtype)
        buf = self._aranges.get(key)
        if buf is None or buf.shape[0] < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return torch.arange(n, dtype=dtype, device=device)
            if buf is not None:
                self._retired.append(buf)
            buf = self._aranges[key] = torch.arange(max(1024, 1 << max(0, n - 1).bit_length()), dtype=dtype,
                                                    device=device)
        return buf[:n]

    @staticmethod
    def slices(n: int, bytes_per_item: int, budget: int = 256 << 20):
        """Cut range(n) into slices whose working set stays near `budget` bytes."""
        step = max(1, budget // max(1, bytes_per_item))
        return [slice(i, min(n, i + step)) for i in range(0, n, step)]

    def query_rows(self, q: torch.Tensor, blocks: BlockQueries, stride: int = 1):
        """(nb, R, H_q, D) fp32 queries of the blocks and the (nb, R) row mask: every row (R = max_rows), or with
        `stride` every stride-th row counted back from each block's last (R = ceil(max_rows / stride);
        rope/strategies.py `block_row_positions` gives their positions)."""
        def index():
            r = self.arange(-(-blocks.max_rows // stride), q.device, torch.long)
            off = (blocks.lens[:, None] - 1) % stride + r * stride  # row offsets in the block; stride 1: r
            return (blocks.starts[:, None] + off).clamp(max=q.shape[0] - 1), off < blocks.lens[:, None]

        rows, ok = blocks.shared(("query_rows", q.shape[0], stride), index)
        return q[rows].float(), ok

    def chunk_scores(self, layer: int, q: torch.Tensor, blocks: BlockQueries, keys: SequenceKeys, ids: torch.Tensor,
                     chunk: int, exact: bool, cand_end: torch.Tensor, sub: int | None = None,
                     stride: int = 1) -> torch.Tensor:
        """Scores (nb, G, C) of candidate chunks (kernels/prune_stage.py), with the layer's pruning RoPE strategy:
        the Triton kernel on CUDA, else the reference. `sub` (exact only): a score per run of `sub` keys instead,
        (nb, G, C * chunk // sub). `stride`: from every stride-th query row of each block (`query_rows`)."""
        from ...kernels.prune_ref import chunk_scores_reference
        from ...kernels.prune_stage import chunk_scores_triton

        per_head = getattr(self.cfg, "rep_per_head", True)
        rope = self.rope_args(layer, "prune", blocks.max_end)
        if use_kernels(q):
            return chunk_scores_triton(q, keys.k_cache, keys.block_table, blocks.starts, blocks.lens, cand_end, ids,
                                       chunk, exact, self.cfg.n_sink, self.groups, rep_per_head=per_head,
                                       max_rows=blocks.max_rows, rope=rope, sub=sub, stride=stride)
        qs, ok = self.query_rows(q, blocks, stride)
        return chunk_scores_reference(qs, ok, keys.dense(), ids, chunk, exact, self.cfg.n_sink, cand_end, self.groups,
                                      rep_per_head=per_head, rope=rope, table_cache=keys.prune_tables, sub=sub,
                                      stride=stride)

    def candidate_end(self, block_end: torch.Tensor) -> torch.Tensor:
        """Exclusive end of the selectable range: keys before every query's window (causal by construction)."""
        return block_end - self.cfg.n_window

    def group_max(self, per_head: torch.Tensor) -> torch.Tensor:
        """(nb, H_q, ...) -> (nb, groups, ...): a group's score is the max over its heads."""
        nb, H = per_head.shape[:2]
        return per_head.reshape(nb, self.groups, H // self.groups, *per_head.shape[2:]).amax(dim=2)

    @staticmethod
    def top_k(ids: torch.Tensor, scores: torch.Tensor, k: int,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (block, group) the k best-scoring ids (scores -inf = invalid; ties to the lower position), ascending,
        -1 padded, int32 (nb, G, k), and their counts (nb, G), written into `out` when given. ids must be ascending
        among the valid ones."""
        from ...kernels.topk import topk_ascending_reference, topk_ascending_triton

        fn = topk_ascending_triton if use_kernels(ids) else topk_ascending_reference
        return fn(ids, scores, k, out)

    def keep_top(self, ids: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
        return self.top_k(ids, scores, k)[0]
