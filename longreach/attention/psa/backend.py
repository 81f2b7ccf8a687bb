"""PSA's engine backend: dense prefill, progressive decode over block metadata kept per KV page (method.py has the
method and its decisions)."""
from __future__ import annotations

import contextlib
import logging
import typing

import torch

from ...kernels import use_triton
from ...kernels.block_meta import build_block_meta_reference, build_block_meta_triton
from ...kvcache.base import PageReads
from ...rope.strategies import RopeFrame
from ..backend import AttentionBackend, AttentionMetadata, Capabilities, GraphSupport
from ..dense import DenseFallback
from ..presets import resolve
from .config import PRESET_NOTES, PSAConfig
from .method import PSA

logger = logging.getLogger("longreach")


class PSABackend(AttentionBackend):
    """PSA: per query, blocks in metadata-rank order until the attended mass reaches epsilon; dense prefill."""

    name = "psa"
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
        self._meta: torch.Tensor | None = None  # (L, P, 2, H_kv, D) block metadata by page, made on first decode
        self._built: dict[int, int] = {}  # seq_id -> its blocks [0, n) have metadata
        self._step: tuple[torch.Tensor, torch.Tensor, int] | None = None  # eager decode step: (lo, hi, most blocks)
        # graph decode: (3, max_num_seqs) int32 per row: lo, hi, and 1 for a real row (0: padding, capture scratch)
        self._g: torch.Tensor | None = None
        # count_reads: float64 (keys read, queries, context keys) summed over decode rows x PSA layers x KV groups
        self._reads = torch.zeros(3, dtype=torch.float64, device=device) if self.config.count_reads else None
        self._variant: tuple | None = None

    @classmethod
    def resolve_config(cls, engine_config) -> PSAConfig:
        return resolve(PSAConfig, "psa", PSA.presets, PSA.default_preset, engine_config)

    def always_dense_layers(self) -> tuple[int, ...]:
        return tuple(self.config.dense_layers)

    @classmethod
    def unsupported_reasons(cls, model_config, engine_config) -> list[str]:
        try:
            cfg = cls.resolve_config(engine_config)
        except ValueError as e:
            return [str(e)]
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
        bad = [layer for layer in cfg.dense_layers if layer >= model_config.num_layers]
        if bad:
            out.append(f"dense_layers {bad} do not exist (the model has {model_config.num_layers} layers)")
        return out

    def page_state_bytes(self, dtype: torch.dtype) -> int:
        """GPU bytes of block metadata per KV page (all layers): the engine counts them in the KV budget."""
        mc = self.model_config
        return mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * torch.empty((), dtype=dtype).element_size()

    # ---- per-sequence bookkeeping: which blocks have metadata ------------------------------------------------------
    def _advance(self, seq_ids, seq_lens) -> tuple[list[int], list[int]]:
        """Blocks [lo, hi) each sequence builds this decode step (hi: blocks complete before the step's token)."""
        page, lo, hi = self.engine_config.block_size, [], []
        for seq_id, length in zip(seq_ids, seq_lens):
            end = (length - 1) // page
            lo.append(min(self._built.get(seq_id, 0), end))
            hi.append(end)
            self._built[seq_id] = end
        return lo, hi

    def begin_step(self, meta: AttentionMetadata) -> None:
        if meta.is_prefill:  # (re)written pages: build their metadata again from the first decode step
            for seq_id in meta.seq_ids:
                self._built.pop(seq_id, None)
            return
        lo, hi = self._advance(meta.seq_ids, [c + n for c, n in zip(meta.context_lens, meta.query_lens)])
        t = torch.tensor([lo, hi], dtype=torch.int32).to(self.device)
        self._step = (t[0], t[1], max(b - a for a, b in zip(lo, hi)) if lo else 0)

    def free_sequence(self, seq_id: int) -> None:
        self._built.pop(seq_id, None)

    def _store(self, k_cache, dtype) -> torch.Tensor:
        if self._meta is None:
            mc = self.model_config
            pages = k_cache.shape[0]  # every page of the cache (with offloading: of the host tier)
            self._meta = torch.zeros(mc.num_layers, pages, 2, mc.num_kv_heads, mc.head_dim, dtype=dtype,
                                     device=self.device)
            logger.info("psa: block metadata for %d pages x %d layers, %.2f GiB on the %s", pages, mc.num_layers,
                        self._meta.numel() * self._meta.element_size() / 2**30, self.device.type.upper())
        return self._meta

    # ---- attention -------------------------------------------------------------------------------------------------
    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        if meta.is_prefill or self.fallback.applies(layer, meta.max_seq_len):
            return self.fallback.forward(layer, q, k, v, k_cache, v_cache, meta)
        page = k_cache.shape[1]
        if self._variant is not None:  # graph decode: this step's lo / hi sit in static buffers (graph_step)
            bucket, catchup = self._variant
            n = q.shape[0]
            width = -(-bucket // page)
            lo, hi, most = self._g[0, :n], self._g[1, :n], width if catchup else 1
        else:
            width = -(-meta.max_seq_len // page)
            lo, hi, most = self._step
        kernels = use_triton(q)
        store = self._store(k_cache, q.dtype)[layer]
        rope = self.method.rope()
        inv = None if rope is None else rope[0]  # rope "rank": boxes of the keys moved to position 0
        if kernels:
            build_block_meta_triton(k_cache, meta.block_tables, lo, hi, most, store, self.config.metadata, inv)
        elif most > 0:
            build_block_meta_reference(k_cache, meta.block_tables, lo, hi, store, self.config.metadata, inv)
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
        real = (self._g[2, :n] if self._variant is not None else torch.ones(n, device=counts.device)).double()
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
        if self._g is None:
            self._g = torch.zeros(3, self.engine_config.max_num_seqs, dtype=torch.int32, device=self.device)
        lo, hi = self._advance(seq_ids, seq_lens)
        longest = max(seq_lens)
        bucket = min(1 << (longest - 1).bit_length(), max(longest, self.engine_config.max_model_len))
        n = len(seq_ids)

        def load(rows: int) -> None:
            self._g[:, :n].copy_(torch.tensor([lo, hi, [1] * n], dtype=torch.int32), non_blocking=True)
            self._g[:, n:rows].zero_()
        return (bucket, any(b - a > 1 for a, b in zip(lo, hi))), load

    def graph_scratch(self) -> None:
        if self._g is None:
            self._g = torch.zeros(3, self.engine_config.max_num_seqs, dtype=torch.int32, device=self.device)
        self._g.zero_()

    @contextlib.contextmanager
    def graph_variant(self, key: tuple) -> typing.Iterator[None]:
        self._variant = key
        try:
            yield
        finally:
            self._variant = None
