"""The engine backend of every top-k selection method: `SparseBackend` does for all of them what is not selection.

Dense layers and short contexts go to the dense fallback, per-sequence decode state (mask caches) is kept and
dropped, the per-sequence selections are packed into one `SparseIndex`, and the block-sparse executor runs (the
Triton kernel on CUDA, the reference elsewhere). A method's backend is a subclass that names its `SelectionMethod`
(`method_cls`) and, where its selection keeps key boxes across steps, makes them (`make_boxes`).

Composed, not mixed in: the backend owns a `GraphDecoder` (graph.py: the decode step as CUDA-graph variants) and
the method's kept boxes, if any (a `KeptBoxes`: infinitehip/boxes.py, box_store.py), and talks to both through their
methods only.
"""
from __future__ import annotations

import json
import logging
from typing import ClassVar

import torch

from ...kernels import use_triton
from ...kernels.combine import sm_count, split_count
from ...kvcache.base import PageReads
from ...rope.strategies import RopeFrame
from ..backend import AttentionBackend, AttentionMetadata, GraphSupport
from ..dense import DenseFallback
from ..executor import block_sparse_attention
from ..index import QueryBlocks, SparseIndex
from ..presets import missing_layers, resolve
from .config import SparseConfig
from .graph import GraphDecoder
from .prefill_graph import PrefillGraphs
from .selection import BlockQueries, KeptBoxes, SelectionMethod, SequenceKeys, install_now, probe_reads, use_kernels

logger = logging.getLogger("longreach")


class SparseBackend(AttentionBackend):
    """Engine backend for a `SelectionMethod` (set `method_cls` in the subclass)."""

    method_cls: ClassVar[type[SelectionMethod]]
    honours_layer_windows = True  # sliding-window layers go to the dense fallback (DenseFallback's docstring)
    # capabilities: GraphSupport.VARIANTS for methods whose decode selection is graph-capturable (graph_stage_widths)

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        self.config = self.resolve_config(engine_config)
        self.method = self.method_cls(self.config, model_config.num_heads, model_config.num_kv_heads)
        self.method.rope_frame = RopeFrame.of_model(model_config, self.config.rope_from, device)
        self._decode_below = self._resolve_decode_below()
        self.fallback = DenseFallback(model_config, engine_config, device, self.config.dense_layers, self.dense_below)
        self._num_sms = sm_count(device)
        self._decode_step: dict[int, int] = {}  # seq_id -> decode steps since its last prefill (-1: none yet)
        self._state: dict[tuple[int, int], dict] = {}  # (seq_id, layer) -> the method's eager decode state
        self.boxes: KeptBoxes | None = self.make_boxes()
        self._step_layout = None  # (meta, layout) of the current step, see _layout
        self.graph = GraphDecoder(self.method, self.fallback, engine_config.max_num_seqs,
                                  engine_config.max_model_len, device, self.boxes)
        self.prefill_graphs = PrefillGraphs(self.method, engine_config.max_model_len, engine_config.block_size, device,
                                            enabled=not engine_config.enforce_eager and self.graph_unsupported() is None)

    @classmethod
    def resolve_config(cls, engine_config) -> SparseConfig:
        m = cls.method_cls
        return resolve(m.config_cls, m.name, m.presets, m.default_preset, engine_config)

    def make_boxes(self) -> KeptBoxes | None:
        """The key boxes the method keeps across steps (infinitehip's box-scored stage 0, Quest's page boxes), or
        None (the default)."""
        return None

    def always_dense_layers(self) -> tuple[int, ...]:
        return tuple(self.config.dense_layers)

    @classmethod
    def config_problems(cls, cfg, model_config, engine_config) -> list[str]:
        return missing_layers(cfg.dense_layers, model_config.num_layers)

    def dense_below(self, layer: int, decoding: bool = False) -> int:
        """Contexts of at most this many tokens attend densely in `layer` (the dense fallback's limit): in prefill
        chunks (the chunk's end) by `dense_below`, in decode steps by `dense_below_decode` as resolved at start-up."""
        c = self._decode_below if decoding else self.config.dense_below
        if c == "trained":
            return max(self.method.token_budget(layer), self.model_config.max_position_embeddings)
        return self.method.token_budget(layer) if c is None else c

    def shortest_dense_below(self) -> int:
        """The shortest context any sparse layer selects in, prefill or decode (kept boxes start past it)."""
        return min([min(self.dense_below(layer), self.dense_below(layer, True))
                    for layer in self.fallback.sparse_layers()] or [0])

    def warm_context(self) -> int:
        """The longest context any sparse layer attends densely at, prefill or decode (AttentionBackend's)."""
        return max([max(self.dense_below(layer), self.dense_below(layer, True))
                    for layer in self.fallback.sparse_layers()] or [0])

    def _resolve_decode_below(self) -> int | str | None:
        """`dense_below_decode` as decode steps use it: None gives dense_below's value (today's behaviour); "auto"
        becomes min(trained, the measured crossover) from this key's file (sparse/crossover.py), or dense_below's
        value, logged once, where none was measured."""
        d = self.config.dense_below_decode
        if d is None:
            return self.config.dense_below
        if d != "auto":
            return d
        from . import crossover

        key = crossover.key_fields(self.model_config, self.method.name, self.config, self.engine_config,
                                   self.device)
        record = crossover.load(key)
        if record is None:
            logger.info("%s: dense_below_decode \"auto\" has no crossover measured for this model shape, %s and "
                        "config (%s): decode uses dense_below (%s); `%s` measures it", self.method.name,
                        key["device"], crossover.path_of(key), json.dumps(self.config.dense_below),
                        crossover.MEASURE_COMMAND)
            return self.config.dense_below
        limit = crossover.decode_limit(record, self.model_config.max_position_embeddings)
        logger.info("%s: dense_below_decode \"auto\": decode attends densely up to %d tokens (crossover %s, %s)",
                    self.method.name, limit, record.get("crossover"), crossover.path_of(key))
        return limit

    # ---- the KV store's side ------------------------------------------------------------------------------------
    def bind_kv_cache(self, capacity_tokens: int, dtype: torch.dtype) -> None:
        self.prefill_graphs.dtype = dtype
        if self.boxes is not None:
            self.boxes.ensure(capacity_tokens, dtype)

    def page_state_bytes(self, dtype: torch.dtype) -> int:
        """GPU bytes of kept boxes per KV page (all layers; 0 without): the engine counts them in the KV budget."""
        return 0 if self.boxes is None else self.boxes.page_state_bytes(dtype, self.engine_config.block_size)

    # ---- per-sequence state ---------------------------------------------------------------------------------------
    def _next_decode_step(self, seq_id: int) -> int:
        step = self._decode_step[seq_id] = self._decode_step.get(seq_id, -1) + 1
        return step

    def begin_step(self, meta: AttentionMetadata) -> None:
        for seq_id in meta.seq_ids:
            if meta.is_prefill:  # a (re)prefill starts a fresh mask cache
                self._free_masks(seq_id)
                self._decode_step[seq_id] = -1
            else:
                self._next_decode_step(seq_id)
        if self.boxes is not None:
            self.boxes.begin_step(meta)

    def free_sequence(self, seq_id: int) -> None:
        self._free_masks(seq_id)
        if self.boxes is not None:
            self.boxes.free(seq_id)

    def _free_masks(self, seq_id: int) -> None:
        self._decode_step.pop(seq_id, None)
        self.graph.free(seq_id)
        for key in [k for k in self._state if k[0] == seq_id]:
            del self._state[key]

    def capture_prefill(self, kv_cache, chunk_rows: list[int]) -> int:
        """Every prefill-selection graph a chunk of these row counts can need (prefill_graph.py), captured now."""
        pg = self.prefill_graphs
        if not pg.enabled or pg.disabled_why is not None:
            return 0
        before = pg.captures
        mc = self.model_config
        for layer in range(mc.num_layers):
            if layer in self.fallback.layers:
                continue
            k_cache = kv_cache.layer(layer)[0]
            boxes = None if self.boxes is None else self.boxes.scratch_boxes(layer)
            pg.capture_all(layer, k_cache, boxes, chunk_rows, self.config.block_q, self.dense_below(layer),
                           (mc.num_heads, mc.head_dim))
        return pg.captures - before

    # ---- graph decode (attention/backend.py; the work is graph.py's) -----------------------------------------------
    def graph_unsupported(self) -> str | None:
        if self.capabilities.graph is GraphSupport.NONE:
            return f"{self.method.name}'s decode selection is not graph-capturable"
        return self.graph.unsupported()

    def graph_step(self, seq_ids, seq_lens):
        return self.graph.step(seq_ids, seq_lens, [self._next_decode_step(seq_id) for seq_id in seq_ids])

    def graph_scratch(self) -> None:
        self.graph.scratch()

    def graph_warm_keys(self) -> list[tuple[int, tuple]]:
        return self.graph.warm_keys() if self.graph_unsupported() is None else []

    def graph_variant(self, key: tuple):
        return self.graph.running(key)

    # ---- attention --------------------------------------------------------------------------------------------------
    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        if self.graph.variant is not None:
            picked = self.graph.select(layer, q, k_cache, meta)
            if picked is None:
                return self.fallback.forward(layer, q, k, v, k_cache, v_cache, meta)
            return self.attend(layer, q, k_cache, v_cache, meta, *picked)
        box_tables = None
        if self.boxes is not None and layer not in self.fallback.layers:  # before any selection reads them
            rope = self.method.rope_args(layer, "prune", meta.max_seq_len)
            box_tables = self.boxes.build(layer, q, k_cache, meta, rope)
        decoding = not meta.is_prefill
        if self.fallback.applies(layer, meta.max_seq_len, decoding):
            return self.fallback.forward(layer, q, k, v, k_cache, v_cache, meta)
        limit = self.dense_below(layer, decoding)
        m = self.method
        qb, per_seq, plan_queries = self._layout(meta, q.device)
        selections: list[torch.Tensor] = []
        for i, seq_id in enumerate(meta.seq_ids):
            row0, n, length, local = per_seq[i]
            if length <= limit:  # short sequence in a long batch: every key block
                all_blocks = torch.arange(-(-length // m.block_k), device=q.device)
                selections.append(all_blocks.expand(local.num_blocks, m.groups, -1))
            else:
                state = self._state.setdefault((seq_id, layer), {}) if decoding else None
                boxes = None if box_tables is None else self.boxes.seq_boxes(layer, box_tables, i)
                probes = install = None
                if decoding and (meta.page_reads is not None or meta.install_reads is not None):
                    row, pos = torch.tensor([i], device=q.device), torch.tensor([length - 1], device=q.device)
                    probes = None if meta.page_reads is None else probe_reads(meta, layer, row, pos)
                    install = install_now(meta, layer, row, pos)
                keys = SequenceKeys(k_cache, meta.block_tables[i], length, boxes, probes, install)
                step = self._decode_step.get(seq_id, 0) if decoding else None
                if not decoding and self.prefill_graphs.applies(n, keys):  # replayed: see prefill_graph.py
                    selections.append(self.prefill_graphs.select(layer, q[row0:row0 + n], local, keys))
                else:
                    selections.append(m.select(layer, q[row0:row0 + n], local, keys, state, step))
        blocks, counts = SparseIndex.pack(selections, q.device)
        return self.attend(layer, q, k_cache, v_cache, meta, qb, plan_queries, blocks, counts, meta.max_seq_len)

    def attend(self, layer, q, k_cache, v_cache, meta, qb, plan_queries, blocks, counts, context_len):
        """Block-sparse attention of the step's query blocks over their selections (kernels on CUDA)."""
        m = self.method
        block_q = self.config.block_q if meta.is_prefill else 1
        index = SparseIndex(block_q, m.block_k, self.config.n_sink, self.config.n_window, m.groups, qb, blocks, counts)
        rope = m.rope_args(layer, "attend", context_len)
        if meta.page_reads is not None:  # the store learns what this layer read (offloading: installs it)
            if plan_queries is not None:
                seq, _, qlen, pos = plan_queries
            else:
                seq, qlen, pos = (torch.tensor(x, device=q.device) for x in (qb.seq, qb.length, qb.pos))
            meta.page_reads.append(PageReads(layer, meta.block_tables, seq, pos, pos + qlen - 1, block_q, blocks,
                                             m.block_k, self.config.n_sink, self.config.n_window))
        if use_kernels(q):
            from ...kernels.bsa import BSAPlan, block_sparse_attention_triton, prefill_splits

            # split-K (kernels/combine.py) in decode, where the selected keys are a few thousand per sequence, and in
            # a prefill chunk of a few query blocks (a paced chunk beside decodes), whose programs do not fill the GPU
            mc = self.model_config
            splits = prefill_splits(index, mc.num_heads, mc.num_kv_heads, self._num_sms) if meta.is_prefill else \
                split_count(qb.num_blocks * max(mc.num_kv_heads, m.groups), self._num_sms, 32)
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
            from ...kernels.bsa import query_block_tensors

            plan_queries = query_block_tensors(qb, device)
        layout = (qb, per_seq, plan_queries)
        self._step_layout = (meta, layout)
        return layout
