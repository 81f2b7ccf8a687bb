"""PSA's engine backend: dense prefill, progressive decode over block metadata kept per KV page (method.py has the
method and its decisions). The metadata are key boxes by page id (attention/box_store.py: PageBoxes, which Quest keeps
too), built at decode: each step first boxes the pages completed since the sequence's last step."""
from __future__ import annotations

import contextlib
import typing

import torch

from ...kernels import use_triton
from ...kvcache.base import PageReads
from ...rope.strategies import RopeFrame
from ..backend import AttentionBackend, AttentionMetadata, Capabilities, GraphSupport
from ..box_store import PageBoxes
from ..dense import DenseFallback
from ..presets import missing_layers, resolve
from .config import PRESET_NOTES, PSAConfig
from .method import PSA


class PSABackend(AttentionBackend):
    """PSA: per query, blocks in metadata-rank order until the attended mass reaches epsilon; dense prefill."""

    name = "psa"
    honours_layer_windows = True  # sliding-window layers go to the dense fallback (DenseFallback's docstring)
    capabilities = Capabilities(graph=GraphSupport.VARIANTS, mixed_batches=True)  # graphs: per context bucket
    method_cls = PSA
    preset_notes = PRESET_NOTES

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        self.config = self.resolve_config(engine_config)
        self.method = PSA(self.config, model_config.num_heads, model_config.num_kv_heads)
        if self.config.rope == "rank":
            self.method.rope_frame = RopeFrame.of_model(model_config, self.config.rope_from, device)
        self.fallback = DenseFallback(model_config, engine_config, device, self.config.dense_layers)
        mc, ec = model_config, engine_config
        rope = self.method.rope()  # rope "rank": boxes of the keys moved to position 0
        self.boxes = PageBoxes("psa", self.fallback.sparse_layers(), mc.num_kv_heads, mc.head_dim, ec.block_size,
                               self.config.metadata, partial=False, prefill=False, max_seqs=ec.max_num_seqs,
                               device=device,
                               move=None if rope is None else (rope[0], 0))
        # graph decode: (max_num_seqs,) int32, 1 for a real row (0: padding, capture scratch), for the read meter
        self._real: torch.Tensor | None = None
        # count_reads: float64 (keys read, queries, context keys) summed over decode rows x PSA layers x KV groups
        self._reads = torch.zeros(3, dtype=torch.float64, device=device) if self.config.count_reads else None
        self._variant: tuple | None = None

    @classmethod
    def resolve_config(cls, engine_config) -> PSAConfig:
        return resolve(PSAConfig, "psa", PSA.presets, PSA.default_preset, engine_config)

    def always_dense_layers(self) -> tuple[int, ...]:
        return tuple(self.config.dense_layers)

    @classmethod
    def config_problems(cls, cfg, model_config, engine_config) -> list[str]:
        page, out = engine_config.block_size, []
        if cfg.block_size is not None and cfg.block_size != page:
            out.append(f"psa block_size {cfg.block_size} differs from --block-size {page}: a PSA block is one KV "
                       f"page, set --block-size {cfg.block_size}")
        if cfg.microbatch * page < 16:
            out.append(f"microbatch x block size = {cfg.microbatch} x {page} < 16 (the kernel's tile); raise "
                       "microbatch or --block-size")
        if cfg.rope == "rank" and model_config.rope.rope_type == "dynamic" and model_config.rope.freq_factors is None:
            out.append("psa rope 'rank' moves stored keys with fixed frequencies; dynamic NTK RoPE changes them with "
                       "the sequence length: use rope 'none'")
        return out + missing_layers(cfg.dense_layers, model_config.num_layers)

    def page_state_bytes(self, dtype: torch.dtype) -> int:
        """GPU bytes of block metadata per KV page (all layers): the engine counts them in the KV budget."""
        return self.boxes.page_state_bytes(dtype)

    def bind_kv_cache(self, capacity_tokens: int, dtype: torch.dtype) -> None:
        self.boxes.ensure(capacity_tokens, dtype)

    # ---- per-sequence bookkeeping: which blocks have metadata (PageBoxes) ------------------------------------------
    def begin_step(self, meta: AttentionMetadata) -> None:
        self.boxes.begin_step(meta)  # decode: the blocks completed since each sequence's last step

    def free_sequence(self, seq_id: int) -> None:
        self.boxes.free(seq_id)

    # ---- attention -------------------------------------------------------------------------------------------------
    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        if meta.is_prefill or self.fallback.applies(layer, meta.max_seq_len, True):
            return self.fallback.forward(layer, q, k, v, k_cache, v_cache, meta)
        page = k_cache.shape[1]
        # graph decode: this step's blocks to box sit in the store's static buffer (graph_step); its width is the
        # variant's bucket
        bucket = meta.max_seq_len if self._variant is None else self._variant[0]
        width = -(-bucket // page)
        kernels = use_triton(q)
        self.boxes.build(layer, q, k_cache, meta, graph=self._variant)
        store = self.boxes.layer(layer)
        m = self.method
        out, counts, ranked, cand_hi = m.attend(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, store, width,
                                                self.scale, kernels)
        if self.config.count_reads:
            self._count_reads(m, counts, cand_hi, meta.seq_lens, page)
        if meta.page_reads is not None:  # the store learns what this layer read (offloading: installs it, LRU)
            rows = torch.arange(q.shape[0], device=q.device)
            pos = meta.seq_lens.long() - 1
            reads = m.read_blocks(ranked, counts, cand_hi, meta.seq_lens, page)
            meta.page_reads.append(PageReads(layer, meta.block_tables, rows, pos, pos, 1, reads, page,
                                             m.sink_blocks(page) * page, 0))
        return out

    def _count_reads(self, m: PSA, counts, cand_hi, seq_lens, page: int) -> None:
        """Add this layer's reads to the meter, on the device (capturable): real rows only under graphs."""
        n = counts.shape[0]
        real = (self._real[:n] if self._variant is not None else torch.ones(n, device=counts.device)).double()
        G = counts.shape[-1]
        self._reads += torch.stack([(real * m.keys_read(counts, cand_hi, seq_lens, page)).sum(), real.sum() * G,
                                    (real * seq_lens.double()).sum() * G])

    def decode_reads(self) -> dict | None:
        """Cumulative decode reads (count_reads), or None when not metered: keys read, queries (decode rows x PSA
        layers x KV groups) and the keys their contexts held. Syncs the device."""
        if not self.config.count_reads:
            return None
        keys, queries, context = self._reads.tolist()
        return {"keys": keys, "queries": queries, "context_keys": context}

    # ---- graph decode (attention/backend.py) -----------------------------------------------------------------------
    def graph_step(self, seq_ids, seq_lens):
        """Variant (bucket, catchup): bucket a power of two >= the longest sequence (capped at max_model_len) sizes
        the ranking; catchup when a sequence has more than one block to build (its first decode step after a
        prefill), which launches the metadata kernel over every block of the bucket (programs outside a row's
        range do nothing) instead of one block per row."""
        if self._real is None:
            self._real = torch.zeros(self.engine_config.max_num_seqs, dtype=torch.int32, device=self.device)
        catchup = self.boxes.graph_plan(seq_ids, seq_lens)
        longest = max(seq_lens)
        bucket = min(1 << (longest - 1).bit_length(), max(longest, self.engine_config.max_model_len))
        n = len(seq_ids)

        def load(rows: int) -> None:
            self.boxes.graph_load(rows)
            self._real[:n].fill_(1)
            self._real[n:rows].zero_()
        return (bucket, catchup), load

    def graph_scratch(self) -> None:
        if self._real is None:
            self._real = torch.zeros(self.engine_config.max_num_seqs, dtype=torch.int32, device=self.device)
        self._real.zero_()
        self.boxes.graph_scratch()

    @contextlib.contextmanager
    def graph_variant(self, key: tuple) -> typing.Iterator[None]:
        self._variant = key
        try:
            yield
        finally:
            self._variant = None
