"""Turns a scheduled batch into tensors, runs the model, returns logits for the sequences that sample this step.

Decode steps run through CUDA graphs captured per bucketed batch size (1, 2, 4, 8, then multiples of 16): inputs are
copied into static buffers and rows past the real batch point at a scratch page, so they write nothing that matters.
Prefill steps (and a mixed step's prefill part) replay each layer's work around attention from graphs captured per
padded chunk size, attention eager between them (engine/chunk_graphs.py).
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time
import typing

import numpy as np
import torch

from ..attention.backend import AttentionBackend, AttentionMetadata, GraphSupport
from ..config import EngineConfig
from ..kvcache.block_manager import BlockManager
from ..kvcache.base import KVCache
from ..models.llama import LlamaForCausalLM
from .block_tables import DeviceBlockTables
from .chunk_graphs import ChunkGraphs
from .scheduler import ScheduledBatch
from .step_context import StepContext

logger = logging.getLogger("longreach")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, kv_cache: KVCache,
                 blocks: BlockManager, backend: AttentionBackend, device: torch.device):
        self.model, self.config, self.kv_cache, self.blocks, self.backend = model, config, kv_cache, blocks, backend
        self.device = device
        self.block_size = blocks.block_size
        self.scratch_page = blocks.num_blocks  # the cache has one page more than the block manager hands out
        self.window = kv_cache.window  # sliding-window layers in a ring of this many rows per sequence, or None
        self.scratch_slot = kv_cache.num_slots if self.window else 0  # the ring's scratch slot (its last)
        self._graphs: dict[tuple, typing.Callable[[], torch.Tensor]] = {}  # (rows, backend variant) -> step
        self._graph_sizes: list[int] = []
        self.padded_replays = 0  # graph steps that replayed a larger captured size than their bucket (_graph_size)
        self.last_kv_counts: dict | None = None  # the last decode step's page counts, where the store keeps them
        self.chunk_graphs: ChunkGraphs | None = None  # prefill steps' graphs (capture_chunk_graphs)
        self.device_tables: DeviceBlockTables | None = None  # graph decode's device block tables (capture_graphs)
        # called with (batch, all_logits) before each step's forward pass: rank 0 of a tensor-parallel engine sends
        # the step's plan to the other ranks (engine/tp_plan.py)
        self.before_step: typing.Callable[[ScheduledBatch, bool], None] | None = None

    @property
    def decode_graphs(self) -> bool:
        """Decode steps run through CUDA graphs (captured, or emulated in tests)."""
        return bool(self._graph_sizes)

    def free_sequence(self, seq_id: int) -> None:
        """The sequence gave its pages back (finished or preempted): its device block-table row is free."""
        if self.device_tables is not None:
            self.device_tables.release(seq_id)

    # ---- batch tensors -------------------------------------------------------------------------------------------
    def _metadata(self, batch: ScheduledBatch):
        bs = self.block_size
        ids, pos, slots = [], [], []
        ctx_lens = [s.num_computed for s in batch.seqs]
        tables = [self.blocks.table(s.seq_id) for s in batch.seqs]
        layout = self.backend.kv_layout  # a bounded cache places tokens itself (attention/backend.py)
        for seq, n, c, table in zip(batch.seqs, batch.num_tokens, ctx_lens, tables):
            ids.extend(seq.token_slice(c, c + n))
            t = np.arange(c, c + n)
            pos.append(t)
            local = t if layout is None else layout.slot_index(c, n)
            slots.append(np.asarray(table, dtype=np.int64)[local // bs] * bs + local % bs)
        window = self.window
        if window:  # the ring rows of the new tokens: a chunk's last `window` ones, the others to the scratch slot
            wslots = [self.blocks.slot(s.seq_id) for s in batch.seqs]
            wmap = np.concatenate([np.where(np.arange(c, c + n) >= c + n - window, w, self.scratch_slot) * window
                                   + np.arange(c, c + n) % window
                                   for w, c, n in zip(wslots, ctx_lens, batch.num_tokens)])
        seq_lens = [c + n for c, n in zip(ctx_lens, batch.num_tokens)]
        width = max(len(t) for t in tables)
        bt = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        qsl = np.concatenate(([0], np.cumsum(batch.num_tokens))).astype(np.int32)
        dev = self.device
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            seq_ids=[s.seq_id for s in batch.seqs],
            query_lens=list(batch.num_tokens),
            context_lens=ctx_lens,
            query_start_loc=torch.from_numpy(qsl).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(bt).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev, non_blocking=True),
            max_seq_len=max(seq_lens),
            max_query_len=max(batch.num_tokens),
            prompt_lens=[s.num_tokens for s in batch.seqs],
            page_reads=[] if not batch.is_prefill and self.kv_cache.wants_reads else None,
            install_reads=None if batch.is_prefill else getattr(self.kv_cache, "install_reads", None),
        )
        if window:
            meta.window_slots = torch.tensor(wslots, dtype=torch.long).to(dev, non_blocking=True)
            meta.window_mapping = torch.from_numpy(wmap.astype(np.int64)).to(dev, non_blocking=True)
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        positions = torch.from_numpy(np.concatenate(pos)).to(dev, non_blocking=True)
        return input_ids, positions, meta, qsl

    # ---- execution -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, all_logits: bool = False) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns (logits (N, V) fp32, indices into batch.seqs of the N sequences that sample).

        With `all_logits`, the logits of every fed token (T, V) come back instead (scoring a prompt).
        """
        if self.before_step is not None:  # rank 0 of a tensor-parallel engine: the step's plan, once per step
            self.before_step(batch, all_logits)
        return self._execute(batch, all_logits)

    def _execute(self, batch: ScheduledBatch, all_logits: bool = False) -> tuple[torch.Tensor, list[int]]:
        """`execute` past the plan: every rank runs the same path for the same batch (a worker's plan is the batch
        rank 0 ran), so the graphs replayed, the variants captured and the collectives in them line up."""
        sample_idx = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)) if s.num_computed + n == s.num_tokens]
        self.last_kv_counts = None
        if not all_logits and not batch.is_prefill and self._graph_sizes and len(batch.seqs) <= self._graph_sizes[-1]:
            logits = self._replay(batch)
            self._end_step()
            return logits, sample_idx
        if batch.mixed and not all_logits and self._graph_sizes and batch.num_decodes <= self._graph_sizes[-1]:
            return self._graph_and_prefill(batch)
        if batch.mixed:
            hidden, qsl = self._forward_mixed(batch)
        else:
            input_ids, positions, meta, qsl = self._metadata(batch)
            self.backend.begin_step(meta)
            staged = None
            if batch.is_prefill:
                staged = self.kv_cache.prefill_view(meta, [self.blocks.table(s.seq_id) for s in batch.seqs])
            ctx = StepContext(self.kv_cache, self.backend, meta, meta.max_seq_len - 1, staged)
            hidden = self._forward(input_ids, positions, ctx, batch.is_prefill)
        if not batch.is_prefill or batch.mixed:
            self._end_step()
        if all_logits:
            return self.model.logits(hidden), sample_idx
        rows = torch.tensor([qsl[i + 1] - 1 for i in sample_idx], dtype=torch.long, device=self.device)
        return self.model.logits(hidden.index_select(0, rows)), sample_idx

    def _graph_and_prefill(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """A mixed step where decode runs through CUDA graphs: the decode rows replay their graph (a graph-decoding
        backend keeps its decode state, masks and schedules, on that path: decoding the same sequence eagerly in
        some steps would split it) and the prefill chunks run after it (through the chunk graphs where a size holds
        them, else eagerly), two passes in one step (one plan: the step's, sent by `execute`)."""
        d = batch.num_decodes
        decode_logits = self._replay(ScheduledBatch(False, batch.seqs[:d], batch.num_tokens[:d]))
        self._end_step()
        prefill_logits, idx = self._execute(ScheduledBatch(True, batch.seqs[d:], batch.num_tokens[d:]))
        idx = list(range(d)) + [d + i for i in idx]
        if decode_logits is None:  # a tensor-parallel worker: rank 0 alone holds logits
            return None, idx
        return torch.cat([decode_logits, prefill_logits]), idx

    def _forward_mixed(self, batch: ScheduledBatch) -> tuple[torch.Tensor, np.ndarray]:
        """A step of decode rows (the first `batch.num_decodes` sequences) and prefill chunks in one forward pass:
        each part gets its own metadata (and the backend's begin_step), the model runs once over all rows. Only for
        a backend that declares `mixed_batches` and a GPU-resident store (the scheduler mixes nothing else)."""
        d = batch.num_decodes
        parts = [ScheduledBatch(False, batch.seqs[:d], batch.num_tokens[:d]),
                 ScheduledBatch(True, batch.seqs[d:], batch.num_tokens[d:])]
        built = [self._metadata(part) for part in parts]
        for _, _, meta, _ in built:
            self.backend.begin_step(meta)
        ctx = StepContext(self.kv_cache, self.backend, built[0][2], max(m.max_seq_len for _, _, m, _ in built) - 1,
                          parts=[(0, built[0][2]), (d, built[1][2])])
        hidden = self._forward(torch.cat([b[0] for b in built]), torch.cat([b[1] for b in built]), ctx, True)
        qsl = np.concatenate((built[0][3], built[1][3][1:] + d))  # decode rows are one token each
        return hidden, qsl

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                 prefill: bool) -> torch.Tensor:
        """The model over a step's T rows -> hidden (T, hidden): a prefill step's (a mixed one's too: still one
        attention call per layer, split by `ctx.parts`) through the chunk graphs when a captured size holds T rows
        (engine/chunk_graphs.py), anything else eagerly."""
        if prefill and self.chunk_graphs is not None:
            hidden = self.chunk_graphs.run(input_ids, positions, ctx)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, ctx)

    def _end_step(self) -> None:
        """After a decode step: the store's page counts (the offloaded store installs the pages the step missed)."""
        self.last_kv_counts = self.kv_cache.end_step()

    @torch.inference_mode()
    def capture_prefill_graphs(self, chunk_rows: list[int]) -> int:
        """The backend's prefill graphs for chunks of these row counts, captured now (attention/backend.py)."""
        return self.backend.capture_prefill(self.kv_cache, chunk_rows)

    @torch.inference_mode()
    def capture_warm_variants(self) -> int:
        """The decode variants the backend names for a warm-up (`graph_warm_keys`), each captured now at the smallest
        graph batch size that holds its rows, at the smallest one that is a multiple of 16, and at 64, 256, ... and
        the largest size (rows 0: a variant of short rows, which any batch may be, at every graph size). A long
        sequence's first decode steps then find their kernels compiled: Triton compiles a kernel once per
        specialisation of its integer arguments (1, a multiple of 16, anything else), and a batch of 16 rows or more
        (a long prompt joining a server's chats) is the other one: captured on first use it stalled every stream for
        ~1.4 s (the serving runs' logs, docs/serving.md). The sizes past 16 give a long prompt joining any number of
        chats a graph within 4x its rows to replay padded (`_graph_size`) instead of capturing its own inside the
        step. Returns how many were new."""
        if not self._graph_sizes:
            return 0
        sizes = self._graph_sizes
        sixteens = [s for s in sizes if s % 16 == 0]
        # a variant with long rows also at 16 x 4^k rows and the largest size: any batch then finds one within 4x its
        # rows (`_graph_size` replays the smallest captured one that holds it)
        wide = sorted({s for s in sixteens if (s // 16) & (s // 16 - 1) == 0 and (s // 16).bit_length() % 2 == 1}
                      | {sizes[-1]})
        todo = []
        for rows, key in self.backend.graph_warm_keys():
            size = sizes[min(bisect.bisect_left(sizes, rows), len(sizes) - 1)]
            for n in (sizes if rows == 0 else (size, *sixteens[:1], *wide)):  # rows 0: any batch meets it
                if n >= rows and (n, key) not in self._graphs and (n, key) not in todo:
                    todo.append((n, key))
        for size, key in todo:
            self._capture(size, key)
        return len(todo)

    # ---- CUDA graphs for prefill chunks ---------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_chunk_graphs(self, sizes: list[int], emulate: bool = False) -> None:
        """Prefill steps of up to max(sizes) rows through piecewise CUDA graphs, every size captured now (sizes:
        engine/chunk_graphs.py's chunk_graph_sizes; none, i.e. --chunk-graph-max-tokens 0: eager).

        On the decode graphs' switch (graphs_supported: CUDA, no --enforce-eager, no dynamic NTK, a backend whose
        decode can be captured). The last is stricter than the chunk graphs need, their attention being eager: with
        quest and cascading prefill stays eager too, as it was, untried with the graphs. On a GPU, only the sizes
        whose estimated memory fits in half the free memory are captured, smallest first (the larger a chunk, the less
        its launches weigh); the other half stays for the eager path's activations (steps past the sizes, scoring)
        and the decode variants captured later.

        `emulate` (tests, any device): the same static-buffer path, each segment run eagerly in place of its replay.
        """
        if not emulate:
            ok, why = self.graphs_supported()
            if not ok:  # capture_graphs has logged why
                logger.debug("prefill chunks run eagerly (no CUDA graphs): %s", why)
                return
            if not sizes:
                logger.info("prefill chunks run eagerly: --chunk-graph-max-tokens is 0")
                return
        t0 = time.perf_counter()
        graphs = self.chunk_graphs or ChunkGraphs(self.model, self.device, emulate)
        if emulate:
            graphs.capture(sizes)
            self.chunk_graphs = graphs
            return
        sizes = sorted(set(sizes))
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(self.device)[0]
        need = [graphs.estimate_bytes(size) for size in sizes]
        kept = [size for size, total in zip(sizes, itertools.accumulate(need)) if total <= free / 2]
        # every rank of a tensor-parallel engine the same sizes (the smallest count any rank could keep): a chunk
        # then replays on every rank or on none (collectives meet either way; this keeps the ranks' paths equal)
        kept = kept[:self.model.tp.min_int(len(kept))]
        if len(kept) < len(sizes):
            logger.warning("prefill chunk graphs: sizes %s would keep ~%.2f GB, more than half the free GPU memory "
                           "(%.2f GB): only %s captured, larger steps run eagerly (--chunk-graph-max-tokens)", sizes,
                           sum(need) / 1e9, free / 1e9, kept or "none")
        if not kept:
            return
        before = torch.cuda.memory_reserved(self.device)
        try:
            graphs.capture(kept)
        except RuntimeError as e:  # an op that cannot be captured (a host sync): prefill stays eager, as it was
            logger.warning("prefill chunks run eagerly: capturing their graphs failed (%s)",
                           f"{type(e).__name__}: {e}".splitlines()[0][:200])
            torch.cuda.synchronize(self.device)
            return
        torch.cuda.synchronize(self.device)
        self.chunk_graphs = graphs
        logger.info("prefill chunks through CUDA graphs, attention eager between them: sizes %s; %d graphs captured "
                    "in %.1f s, %.2f GB", sorted(graphs.sizes, reverse=True), graphs.num_graphs,
                    time.perf_counter() - t0, (torch.cuda.memory_reserved(self.device) - before) / 1e9)

    # ---- CUDA graphs for decode ----------------------------------------------------------------------------------
    def graphs_supported(self, emulate: bool = False) -> tuple[bool, str]:
        """Whether decode (and prefill chunks) may run through CUDA graphs, and why not. `emulate`: the question for
        the emulated path (engine/llm_engine.py, EMULATE_GRAPHS_ENV), which runs on any device.

        With tensor parallelism each rank captures its own graphs, the all-reduces inside them (NCCL calls can be
        captured): every rank runs the same `_execute` path for a step, so a variant first needed in a step is
        captured by every rank in that step, its warm-up collectives meeting."""
        if self.device.type != "cuda" and not emulate:
            return False, "not on CUDA"
        if self.config.enforce_eager:
            return False, "enforce_eager is set"
        why = self.backend.graph_unsupported()
        if why:
            return False, why
        if self.model.rotary.dynamic:
            return False, "dynamic NTK RoPE changes its frequencies with the sequence length"
        return True, ""

    @torch.inference_mode()
    def capture_graphs(self, emulate: bool = False) -> None:
        """Set up graph decode: static input buffers, and a graph per batch-size bucket for each variant the backend
        lists up front (dense: its only one). Variants the backend names later (sparse: per context bucket and mask
        refresh level, see attention/sparse/graph.py) are captured the first time a step needs them.

        `emulate` (tests, any device): run the same static-buffer decode path eagerly instead of capturing, so the
        graph path's logic is checked on a CPU.
        """
        ok, why = self.graphs_supported(emulate)
        if not ok:
            logger.info("decode runs eagerly (no CUDA graphs): %s", why)
            return
        t0 = time.perf_counter()
        max_bs = self.config.max_num_seqs
        sizes = sorted({s for s in (1, 2, 4, 8, *range(16, max_bs + 16, 16)) if s <= max_bs} | {max_bs})
        dev, bs = self.device, self.block_size
        max_pages = -(-self.config.max_model_len // bs)
        # a step's per-row inputs in one buffer, so that one host-to-device copy feeds them all (`_replay`): token ids,
        # positions, KV slots (int64 rows 0-2) and, as int32 halves of row 3, sequence lengths and block-table slots
        self._g_in = torch.zeros(4, max_bs, dtype=torch.long, device=dev)
        self._g_ids, self._g_pos, self._g_slots = self._g_in[0], self._g_in[1], self._g_in[2]
        self._g_lens, self._g_rows = self._g_in[3].view(torch.int32)[:max_bs], self._g_in[3].view(torch.int32)[max_bs:]
        self._g_tables = torch.full((max_bs, max_pages), self.scratch_page, dtype=torch.int32, device=dev)
        self.device_tables = DeviceBlockTables(max_bs, max_pages, self.scratch_page, dev)
        # the host side of `_g_in` (pinned on CUDA: the copy runs asynchronously) and what its rows hold past a step's
        # rows (padding: token 0 at position 0, the scratch page's first slot, length 1, the scratch table row)
        self._g_host = torch.zeros(4, max_bs, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._g_host_np = self._g_host.numpy()
        self._g_pad = np.zeros((4, max_bs), dtype=np.int64)
        self._g_pad[2] = self.scratch_page * bs
        self._g_pad[3].view(np.int32)[:max_bs] = 1
        self._g_pad[3].view(np.int32)[max_bs:] = self.device_tables.scratch_row
        self._g_copied = torch.cuda.Event() if dev.type == "cuda" else None  # the last copy out of `_g_host`
        self._g_qsl = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        if self.window:  # the ring's slots and rows of the rows (the scratch slot for padded ones)
            self._g_wslots = torch.full((max_bs,), self.scratch_slot, dtype=torch.long, device=dev)
            self._g_wmap = torch.full((max_bs,), self.scratch_slot * self.window, dtype=torch.long, device=dev)
        self._emulate = emulate
        self._pool = None if emulate else torch.cuda.graph_pool_handle()
        self._graph_sizes = sizes
        # STATIC: the one variant, captured now; VARIANTS: each captured the first time a step needs it
        keys = [()] if self.backend.capabilities.graph is GraphSupport.STATIC else []
        for key in keys:
            for n in reversed(sizes):  # largest first, so smaller graphs reuse its memory
                self._capture(n, key)
        if not emulate:
            torch.cuda.synchronize()
        logger.info("decode through CUDA graphs: batch sizes %s; %d captured up front in %.1f s%s", sizes,
                    len(self._graphs), time.perf_counter() - t0,
                    "" if keys else f"; {self.backend.name} captures its variants on first use")

    def _capture(self, n: int, key) -> None:
        """Capture (or, emulating, wrap) the decode step of `n` rows in the backend's variant `key`. Inputs are the
        scratch page and the backend's scratch state while warming up and capturing, so nothing real is written.
        All graphs share one memory pool: only one replays at a time and its logits are consumed before the next."""
        t0 = time.perf_counter()
        bs = self.block_size
        self._g_slots[:n].fill_(self.scratch_page * bs)
        self._g_lens[:n].fill_(1)
        self._g_tables[:n].fill_(self.scratch_page)
        self.backend.graph_scratch()
        meta = AttentionMetadata(False, [-1] * n, [1] * n, [0] * n, self._g_qsl[: n + 1], self._g_lens[:n],
                                 self._g_tables[:n], self._g_slots[:n], self.config.max_model_len, 1,
                                 page_reads=[] if self.kv_cache.wants_reads else None,
                                 install_reads=getattr(self.kv_cache, "install_reads", None))
        if self.window:
            self._g_wslots[:n].fill_(self.scratch_slot)
            self._g_wmap[:n].fill_(self.scratch_slot * self.window)
            meta.window_slots, meta.window_mapping = self._g_wslots[:n], self._g_wmap[:n]
        ctx = StepContext(self.kv_cache, self.backend, meta, None)
        run = lambda: self.model.logits(self.model(self._g_ids[:n], self._g_pos[:n], ctx))  # noqa: E731
        if self._emulate:
            def emulated():
                with self.backend.graph_variant(key):
                    return run()
            self._graphs[(n, key)] = emulated
            return
        with self.backend.graph_variant(key):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run()  # warm-up: Triton compilation and cuBLAS handles outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = run()

        def replay():
            graph.replay()
            return out
        self._graphs[(n, key)] = replay
        if key != ():
            logger.info("captured the decode graph for %d rows, variant %s, in %.2f s", n, key,
                        time.perf_counter() - t0)

    def _graph_size(self, n: int, key) -> int:
        """The graph a step of `n` rows in variant `key` replays: the smallest size bucket holding n rows, or, where
        that one is not captured, the smallest captured larger one (its extra rows are padding: the scratch page,
        length 1, no selection); captured now only when neither exists. A capture inside a step stalls every stream
        (a server's 1M prompt joining 63 chats captured three variants in one 516 ms step, docs/serving.md run 10),
        and `capture_warm_variants` captures the long-row variants at sizes no more than 4x apart for this."""
        i = bisect.bisect_left(self._graph_sizes, n)
        for size in self._graph_sizes[i:]:
            if (size, key) in self._graphs:
                if size != self._graph_sizes[i]:
                    self.padded_replays += 1
                return size
        self._capture(self._graph_sizes[i], key)
        return self._graph_sizes[i]

    def _replay(self, batch: ScheduledBatch) -> torch.Tensor:
        """One graph-decoded step. The rows are fed longest first (a sparse backend then runs its selection only
        for the prefix of rows that need one, attention/sparse/graph.py); the logits come back in batch order."""
        n = len(batch.seqs)
        bs = self.block_size
        order = sorted(range(n), key=lambda i: -batch.seqs[i].num_tokens)  # stable: ties keep the batch order
        seqs = [batch.seqs[i] for i in order]
        ids = [s.last_token for s in seqs]
        pos = [s.num_tokens - 1 for s in seqs]
        key, load = self.backend.graph_step([s.seq_id for s in seqs], [p + 1 for p in pos])
        size = self._graph_size(n, key)
        tables = [self.blocks.table(s.seq_id) for s in seqs]
        rows = self.device_tables.slots([s.seq_id for s in seqs], tables)  # writes only pages added since
        if self._g_copied is not None:
            self._g_copied.synchronize()  # the last copy has read the pinned buffer (long done: its tokens synced)
        host = self._g_host_np
        np.copyto(host, self._g_pad)
        host[0, :n] = ids
        host[1, :n] = pos
        host[2, :n] = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
        half = host[3].view(np.int32)
        half[:n] = [p + 1 for p in pos]
        half[len(half) // 2:][:n] = rows
        self._g_in.copy_(self._g_host, non_blocking=True)
        if self._g_copied is not None:
            self._g_copied.record()
        # the rows' tables, longest first, padding rows the scratch row: one device gather
        torch.index_select(self.device_tables.rows, 0, self._g_rows[:size], out=self._g_tables[:size])
        # the ring's slots and rows (Gemma 3's sliding layers): two small copies of their own
        if self.window:
            wslots = np.full(size, self.scratch_slot, dtype=np.int64)
            wslots[:n] = [self.blocks.slot(s.seq_id) for s in seqs]
            wmap = wslots * self.window
            wmap[:n] += np.asarray(pos, dtype=np.int64) % self.window
            self._g_wslots[:size].copy_(torch.from_numpy(wslots), non_blocking=True)
            self._g_wmap[:size].copy_(torch.from_numpy(wmap), non_blocking=True)
        if load is not None:
            load(size)
        logits = self._graphs[(size, key)]()
        if logits is None:  # a tensor-parallel worker: the LM head's shards were gathered to rank 0
            return None
        logits = logits[:n]
        if order == list(range(n)):
            return logits
        back = torch.empty(n, dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(n)
        return logits.index_select(0, back.to(logits.device))
