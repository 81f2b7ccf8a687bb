"""The shared half of every sparse method: config fields, the selection interface, and the engine backend.

A method (infinitehip.py, hip.py, quest.py, streaming.py) only implements `SelectionMethod.select`: for the query
blocks of one sequence it returns which key blocks each block reads. `SparseBackend` does the rest for all of them:
dense layers and short contexts go to the dense backend, per-sequence decode state (mask caches) is kept and
dropped, the per-sequence selections are packed into one `SparseIndex`, and the block-sparse executor runs.

Config: each method has a frozen dataclass deriving from `SparseConfig` and named presets. The engine picks one with
`--preset` and overrides fields with `--attention-config '{"n_sink": 128, ...}'`.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import use_triton
from ..kvcache.paged import gather_tokens
from ..rope.strategies import (
    ATTEND_CODES,
    PRUNE_CODES,
    RopeArgs,
    RopeFrame,
    de_group_size,
    parse_layer_spec,
    strategy_for,
)
from .backend import AttentionBackend, AttentionMetadata
from .dense import DenseBackend
from .executor import block_sparse_attention
from .box_pool import KeptBoxes
from .graph_decode import GraphDecode
from .index import QueryBlocks, SparseIndex

GRANULARITIES = ("layer", "kv_head", "head")


class SequenceKeys:
    """One sequence's keys as the selection sees them: the paged cache and the sequence's block table.

    Kernels read through the table; reference code calls `dense()`, which gathers (L, H_kv, D) once and keeps it,
    and the reference scorer keeps its position-moved copies of those keys in
    `prune_tables`. One object serves one layer of one step (the keys do not change while it lives). `boxes`: the
    engine's kept chunk boxes of this sequence in this layer (attention/box_pool.py): (the layer's pool, the
    sequence's box table row, chunks per box page), or None (built from the keys when needed).
    """

    def __init__(self, k_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                 boxes: tuple[torch.Tensor, torch.Tensor, int] | None = None):
        self.k_cache, self.block_table, self.length = k_cache, block_table, length
        self.boxes = boxes
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
        """The kept boxes of chunks [0, ceil(length / chunk)) as a kernels.chunk_box.BoxView (read through the box
        table with static shapes: graph-capturable), or None without kept boxes."""
        if self.boxes is None:
            return None
        from ..kernels.chunk_box import BoxView

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

    @property
    def num_blocks(self) -> int:
        return self.starts.shape[0]

    @classmethod
    def build(cls, blocks: "list[tuple[int, int, int]] | BlockQueries", device) -> "BlockQueries":
        """From (first row, rows, position of the first row) per block."""
        if isinstance(blocks, BlockQueries):
            return blocks
        t = torch.tensor([[b[0], b[1], b[2] + b[1]] for b in blocks], dtype=torch.long).reshape(-1, 3).to(device)
        return cls(t[:, 0], t[:, 1], t[:, 2], max([b[1] for b in blocks] + [1]), max([b[2] + b[1] for b in blocks] + [0]))

    def __getitem__(self, sl: slice) -> "BlockQueries":
        return BlockQueries(self.starts[sl], self.lens[sl], self.ends[sl], self.max_rows, self.max_end)


def use_kernels(t: torch.Tensor) -> bool:
    """Triton kernels on CUDA tensors; the PyTorch references everywhere else (the one switch: kernels.use_triton)."""
    return use_triton(t)


@dataclass(frozen=True)
class SparseConfig:
    n_sink: int = 256  # first tokens every query reads
    n_window: int = 1024  # last tokens every query reads (the streaming window)
    block_q: int = 64  # query rows per block in prefill (decode blocks have one row)
    # prefill: each of a prompt's last `last_rows` rows is a query block of one row (0: none, the paper), so the row
    # that predicts the first output token and the question's rows before it pick their own keys instead of sharing
    # a max over block_q rows (a 64-row block's max dropped the pass key in the retrieval heads of SmolLM2's layers
    # 18 and 20; passkey at 8K/16K/32K, 15 prompts each: 40/53/20% with 1 row alone, 60/67/53% with 16; quality.md)
    last_rows: int = 16
    granularity: str = "kv_head"  # one selection per layer, per KV-head group, or per head (see index.py)
    dense_layers: tuple[int, ...] = ()  # layers that always attend densely
    dense_below: int | None = None  # sequences this short attend densely; None: the method's token budget
    # RoPE position strategies (rope/strategies.py), "strategy[:first-last],...", first match per layer wins
    prune_rope: str = "none"  # while scoring chunks: none, rt, ci, il, de
    attend_rope: str = "none"  # in block-sparse attention: none, st, il, de
    rope_from: int | None = None  # remap query blocks ending at or past this position; None: the trained length
    de_group: int | None = None  # SelfExtend group for de; None: the smallest that fits the trained length

    def __post_init__(self) -> None:
        for name in ("n_sink", "n_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_q < 1:
            raise ValueError(f"block_q must be >= 1, got {self.block_q}")
        if not isinstance(self.last_rows, int) or not 0 <= self.last_rows <= 4096:
            raise ValueError(f"last_rows must be an integer in [0, 4096], got {self.last_rows!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if any(layer < 0 for layer in self.dense_layers):
            raise ValueError(f"dense_layers must be layer indices >= 0, got {self.dense_layers}")
        parse_layer_spec(self.prune_rope, PRUNE_CODES, "prune_rope")
        parse_layer_spec(self.attend_rope, ATTEND_CODES, "attend_rope")
        for name in ("rope_from", "de_group"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < (0 if name == "rope_from" else 1)):
                raise ValueError(f"{name} must be None or an integer >= {0 if name == 'rope_from' else 1}, got {v!r}")


def preset_and_overrides(method: str, presets: dict, default: str, engine_config) -> tuple[object, dict]:
    """The preset `engine_config` names (else `default`) and its `--attention-config` overrides (a dict); an unknown
    preset raises ValueError listing the method's presets. Every preset-based backend resolves its config this way."""
    preset = engine_config.preset or default
    if preset not in presets:
        raise ValueError(f"unknown {method} preset {preset!r}; available: {', '.join(presets)} (default: {default}; "
                         f"`longreach backends` says what each is for)")
    return presets[preset], dict(engine_config.attention_config or {})  # a dict: EngineConfig parsed any JSON


def _fits(value, hint) -> bool:
    """Does a JSON value fit a config field's type hint (int, float, bool, str, tuple[int, ...], X | None)?"""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in args)
    if hint is type(None):
        return value is None
    if hint is tuple or typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        return not (len(args) == 2 and args[1] is Ellipsis) or all(_fits(v, args[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):  # a bool is an int to Python, not to a user; an int is a fine float
        return isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def config_from(cls: type, base, overrides: dict) -> SparseConfig:
    """`base` with `overrides` applied; unknown fields, values of the wrong type and bad values raise ValueError
    naming what is allowed."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; valid: {', '.join(sorted(names))}")
    hints = typing.get_type_hints(cls)
    for k, v in overrides.items():
        if not _fits(v, hints[k]):
            want = hints[k].__name__ if isinstance(hints[k], type) else str(hints[k])
            raise ValueError(f"{cls.__name__} field {k} must be {want}, got {json.dumps(v)}")
    fixed = {k: tuple(v) if isinstance(v, list) and "tuple" in str(hints[k]) else v for k, v in overrides.items()}
    try:
        return dataclasses.replace(base, **fixed)
    except TypeError as e:  # a check in the config's __post_init__ that met a type it did not expect
        raise ValueError(f"{cls.__name__}: {e}") from None


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

    def rope_args(self, layer: int, phase: str, context_len: int) -> RopeArgs | None:
        """The strategy of `phase` ("prune" or "attend") in `layer` for a context of `context_len` tokens, or None
        when positions stay true (strategy none, or no model frame)."""
        mode = strategy_for(self.prune_spec if phase == "prune" else self.attend_spec, layer)
        f = self.rope_frame
        if mode == "none" or f is None:
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

    # ---- captured decode (CUDA graphs; see graph_decode.py) ----------------------------------------------------------
    def graph_stage_widths(self, layer: int) -> tuple[int, ...] | None:
        """Widths of the per-stage outputs one decode step caches for a sequence in `layer`: () when the selection
        keeps no state, None when the method's decode step cannot be captured (the default)."""
        return None

    def box_spec(self) -> tuple[int, str] | None:
        """(chunk, kind) of the chunk boxes the engine keeps for this method (attention/box_pool.py), or None."""
        return None

    def refresh_from(self, step: int) -> int:
        """First stage recomputed at decode step `step` of a sequence whose cache is filled (len(widths): none)."""
        return 0

    def graph_select(self, layer: int, q: torch.Tensor, blocks: BlockQueries, keys: SequenceKeys,
                     cached: list[torch.Tensor], row_first: torch.Tensor, level: int) -> list[torch.Tensor]:
        """Stage outputs level..N-1 for one sequence's decode block, without host syncs. Stage i is recomputed for
        the blocks whose `row_first` <= i; the others keep `cached[i]`, and the next stage builds on what was kept."""
        raise NotImplementedError

    # ---- helpers shared by the methods ---------------------------------------------------------------------------
    @staticmethod
    def slices(n: int, bytes_per_item: int, budget: int = 256 << 20):
        """Cut range(n) into slices whose working set stays near `budget` bytes."""
        step = max(1, budget // max(1, bytes_per_item))
        return [slice(i, min(n, i + step)) for i in range(0, n, step)]

    @staticmethod
    def query_rows(q: torch.Tensor, blocks: BlockQueries):
        """(nb, max_rows, H_q, D) fp32 queries of the blocks and the (nb, max_rows) row mask."""
        r = torch.arange(blocks.max_rows, device=q.device)
        rows = (blocks.starts[:, None] + r).clamp(max=q.shape[0] - 1)
        ok = r[None, :] < blocks.lens[:, None]
        return q[rows].float(), ok

    def chunk_scores(self, layer: int, q: torch.Tensor, blocks: BlockQueries, keys: SequenceKeys, ids: torch.Tensor,
                     chunk: int, exact: bool, cand_end: torch.Tensor) -> torch.Tensor:
        """Scores (nb, G, C) of candidate chunks (kernels/prune_stage.py), with the layer's pruning RoPE strategy:
        the Triton kernel on CUDA, else the reference."""
        from ..kernels.prune_stage import chunk_scores_reference, chunk_scores_triton

        per_head = getattr(self.cfg, "rep_per_head", True)
        rope = self.rope_args(layer, "prune", blocks.max_end)
        if use_kernels(q):
            return chunk_scores_triton(q, keys.k_cache, keys.block_table, blocks.starts, blocks.lens, cand_end, ids,
                                       chunk, exact, self.cfg.n_sink, self.groups, rep_per_head=per_head,
                                       max_rows=blocks.max_rows, rope=rope)
        qs, ok = self.query_rows(q, blocks)
        return chunk_scores_reference(qs, ok, keys.dense(), ids, chunk, exact, self.cfg.n_sink, cand_end, self.groups,
                                      rep_per_head=per_head, rope=rope, table_cache=keys.prune_tables)

    def candidate_end(self, block_end: torch.Tensor) -> torch.Tensor:
        """Exclusive end of the selectable range: keys before every query's window (causal by construction)."""
        return block_end - self.cfg.n_window

    def group_max(self, per_head: torch.Tensor) -> torch.Tensor:
        """(nb, H_q, ...) -> (nb, groups, ...): a group's score is the max over its heads."""
        nb, H = per_head.shape[:2]
        return per_head.reshape(nb, self.groups, H // self.groups, *per_head.shape[2:]).amax(dim=2)

    @staticmethod
    def top_k(ids: torch.Tensor, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (block, group) the k best-scoring ids (scores -inf = invalid; ties to the lower position), ascending,
        -1 padded, int32 (nb, G, k), and their counts (nb, G). ids must be ascending among the valid ones."""
        from ..kernels.topk import topk_ascending_reference, topk_ascending_triton

        fn = topk_ascending_triton if use_kernels(ids) else topk_ascending_reference
        return fn(ids, scores, k)

    def keep_top(self, ids: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
        return self.top_k(ids, scores, k)[0]


class SparseBackend(GraphDecode, KeptBoxes, AttentionBackend):
    """Engine backend for a `SelectionMethod` (set `method_cls` in the subclass)."""

    method_cls: ClassVar[type[SelectionMethod]]
    supports_cuda_graph = False  # set by methods whose decode selection is graph-capturable (graph_stage_widths);
    # the graph-decode half lives in graph_decode.py

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        self.config = self.resolve_config(engine_config)
        self.method = self.method_cls(self.config, model_config.num_heads, model_config.num_kv_heads)
        self.method.rope_frame = RopeFrame.of_model(model_config, self.config.rope_from, device)
        self.dense = DenseBackend(model_config, engine_config, device)
        cuda = device.type == "cuda"
        self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
        self._decode_step: dict[int, int] = {}
        self._state: dict[tuple[int, int], dict] = {}
        self._init_boxes(model_config, engine_config, device)  # stage-0 boxes, kept (box_pool.py)
        self._step_layout = None  # (meta, layout) of the current step, see _layout
        self._init_graph_decode()

    @classmethod
    def resolve_config(cls, engine_config) -> SparseConfig:
        m = cls.method_cls
        return config_from(m.config_cls, *preset_and_overrides(m.name, m.presets, m.default_preset, engine_config))

    def always_dense_layers(self) -> tuple[int, ...]:
        return tuple(self.config.dense_layers)

    @classmethod
    def unsupported_reasons(cls, model_config, engine_config) -> list[str]:
        try:
            cfg = cls.resolve_config(engine_config)
        except ValueError as e:
            return [str(e)]
        bad = [layer for layer in cfg.dense_layers if layer >= model_config.num_layers]
        return [f"dense_layers {bad} do not exist (the model has {model_config.num_layers} layers)"] if bad else []

    def dense_below(self, layer: int) -> int:
        c = self.config.dense_below
        return self.method.token_budget(layer) if c is None else c

    def begin_step(self, meta: AttentionMetadata) -> None:
        for seq_id in meta.seq_ids:
            if meta.is_prefill:  # a (re)prefill starts a fresh mask cache
                self._free_masks(seq_id)
                self._decode_step[seq_id] = -1
            else:
                self._decode_step[seq_id] = self._decode_step.get(seq_id, -1) + 1
        self._plan_boxes(meta)

    def free_sequence(self, seq_id: int) -> None:
        self._free_masks(seq_id)
        self._free_boxes(seq_id)

    def _free_masks(self, seq_id: int) -> None:
        self._decode_step.pop(seq_id, None)
        self._free_graph_state(seq_id)
        for key in [k for k in self._state if k[0] == seq_id]:
            del self._state[key]

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        if self._variant is not None:
            return self._graph_forward(layer, q, k, v, k_cache, v_cache, meta)
        box_tables = self._build_boxes(layer, q, k_cache, meta)
        limit = self.dense_below(layer)
        if layer in self.config.dense_layers or meta.max_seq_len <= limit:
            return self.dense.forward(layer, q, k, v, k_cache, v_cache, meta)
        m = self.method
        qb, per_seq, plan_queries = self._layout(meta, q.device)
        selections: list[torch.Tensor] = []
        for i, seq_id in enumerate(meta.seq_ids):
            row0, n, length, local = per_seq[i]
            if length <= limit:  # short sequence in a long batch: every key block
                all_blocks = torch.arange(-(-length // m.block_k), device=q.device)
                selections.append(all_blocks.expand(local.num_blocks, m.groups, -1))
            else:
                decoding = not meta.is_prefill
                state = self._state.setdefault((seq_id, layer), {}) if decoding else None
                keys = SequenceKeys(k_cache, meta.block_tables[i], length, self._seq_boxes(layer, box_tables, i))
                step = self._decode_step.get(seq_id, 0) if decoding else None
                selections.append(m.select(layer, q[row0:row0 + n], local, keys, state, step))
        blocks, counts = SparseIndex.pack(selections, q.device)
        return self._attend(layer, q, k_cache, v_cache, meta, qb, plan_queries, blocks, counts, meta.max_seq_len)

    def _attend(self, layer, q, k_cache, v_cache, meta, qb, plan_queries, blocks, counts, context_len):
        """Block-sparse attention of the step's query blocks over their selections (kernels on CUDA)."""
        m = self.method
        block_q = self.config.block_q if meta.is_prefill else 1
        index = SparseIndex(block_q, m.block_k, self.config.n_sink, self.config.n_window, m.groups, qb, blocks, counts)
        rope = m.rope_args(layer, "attend", context_len)
        if meta.kv_store is not None:  # offloaded decode: the store installs what this step reads
            if plan_queries is not None:
                seq, _, qlen, pos = plan_queries
            else:
                seq, qlen, pos = (torch.tensor(x, device=q.device) for x in (qb.seq, qb.length, qb.pos))
            meta.kv_store.note_reads(layer, meta.block_tables, seq, pos, pos + qlen - 1, block_q, blocks, m.block_k,
                                     self.config.n_sink, self.config.n_window)
        if use_kernels(q):
            from ..kernels.bsa import BSAPlan, block_sparse_attention_triton

            splits = 1 if meta.is_prefill else self._decode_splits(qb.num_blocks)
            plan = BSAPlan(index, self.model_config.num_heads, self.model_config.num_kv_heads, q.device, plan_queries)
            out, _ = block_sparse_attention_triton(q, k_cache, v_cache, meta.block_tables, index, self.scale,
                                                   num_splits=splits, plan=plan, rope=rope)
        else:
            out, _ = block_sparse_attention(q, k_cache, v_cache, meta.block_tables, index, self.scale, rope=rope,
                                            need_lse=False)
        return out

    def _layout(self, meta: AttentionMetadata, device):
        """The step's query blocks, built once per step and shared by every sparse layer: the batch-wide
        `QueryBlocks`, per sequence (first row, rows, length, its `BlockQueries`), and the kernels' block tensors."""
        if self._step_layout is not None and self._step_layout[0] is meta:
            return self._step_layout[1]
        block_q = self.config.block_q if meta.is_prefill else 1
        last = self.config.last_rows if meta.is_prefill else 0
        qb = QueryBlocks.build(meta.query_lens, meta.context_lens, block_q, last, meta.prompt_lens)
        per_seq = []
        row0 = 0
        for i, n in enumerate(meta.query_lens):
            local = [(qb.start[b] - row0, qb.length[b], qb.pos[b]) for b in qb.of_sequence(i)]
            per_seq.append((row0, n, meta.context_lens[i] + n, BlockQueries.build(local, device)))
            row0 += n
        plan_queries = None
        if use_triton(device):
            from ..kernels.bsa import query_block_tensors

            plan_queries = query_block_tensors(qb, device)
        layout = (qb, per_seq, plan_queries)
        self._step_layout = (meta, layout)
        return layout

    def _decode_splits(self, num_seqs: int) -> int:
        """Split-K for decode: about two programs per SM (the selected keys are a few thousand per sequence)."""
        programs = num_seqs * max(self.model_config.num_kv_heads, self.method.groups)
        return max(1, min(32, (2 * self._num_sms) // programs))
