"""PSA: Progressive Sparse Attention (Zhou, Zuo, Yin, Cheng; digest §5) as `--attention psa [--preset EPSILON]`.

A decode-time method whose budget is a threshold on attended attention mass instead of a top-k: per decode query and
KV group, rank the context's blocks by a metadata score, attend to them in rank order in micro-batches of m blocks,
and stop once the estimated attended share P_acc = AS_acc / (AS_acc + AS_min * N_left) reaches epsilon (Alg. 1;
kernels/psa_waves.py has the default decode kernel, ranked blocks read in parallel waves, kernels/psa_decode.py the
loop kernel and the reference, kernels/block_meta.py the metadata). The number of keys read therefore varies per
query, layer and KV head, which is the method's point; `longreach eval recall` reports its distribution.

Decisions on what the paper leaves open (digest §5.3, §8.9; docs/sparse.md has the reasons at length):
  * GQA / heads: one ranking and one loop per (sequence, KV head). A block's score is the max over the group's query
    heads of the metadata score; AS_acc, AS_min and P_acc are kept per query head, and the group stops when every
    one of its heads has P_acc >= epsilon. Each K/V block is loaded once for the whole group (the kernels' rule), and
    no head of the group stops short of epsilon by its own estimate.
  * Blocks: a block is one KV page (`--block-size`; the paper's analysis uses 32, vLLM's default is 16). Metadata is
    per page, so it lives beside the page pool (pages x layers on the GPU, `page_state_bytes`).
  * Metadata: cuboid-mean by default (ArkVale's box: centre (max + min) / 2, radius the keys' mean |k - centre|),
    score q.c + |q|.r; `metadata: "minmax"` gives Quest's upper bound in the same form.
  * AS_min is the smallest *block* mass seen (Alg. 1's m = 1 rule kept for m > 1), N_left counts blocks, and the
    comparison is "P_acc >= epsilon" (the text's "exceeds" or "equals"): epsilon = 1 reads every block (== dense).
  * Always read, outside the ranking: the sink (n_sink tokens, rounded up to whole blocks) and the tail (the last
    n_window tokens extended down to a block boundary, so the partial last page is in it). Their mass counts in
    AS_acc, not in AS_min or N_left: they are read first, before any ranked block. The paper has neither; a few
    sink tokens hold much of the mass in the models measured here (docs/sparse.md).
  * Metadata is built at decode: every decode step first builds the blocks completed since the sequence's last step
    (after a prefill, the whole prompt: one read of its keys), so it does not matter which backend prefilled
    (dense, or any method through `--decode-attention psa`) nor whether the prefill ran on the offloaded staging
    area. Candidate blocks end before the tail, so they are complete before the step's own token is written.
  * Numerics: log-sum-exp throughout (base 2 in the kernel); the stop test is
    log N_left + lse_min - lse_acc <= log((1 - eps) / eps).
  * Prefill is dense (the paper's: prefill unchanged); compose a sparse prefill with `--attention M
    --decode-attention psa`. RoPE positions stay true by default (PSA targets long-context models); see `rope`.
  * Ranking ties go to the lower block id (a stable sort).
  * Positions past the trained length (`rope: rank`; an extension, not the paper's: PSA keeps true positions, and
    past a model's trained length its attention is out of distribution and diffuse, docs/sparse.md). Rows at or
    past rope_from (default: the trained length) attend at rank-order positions: the tail at true distances, the
    ranked block of rank i just before the tail (i + 1 blocks back), clamped nearer than the sink, and the sink
    rope_from - 1 - s back, so every key lies within the trained distance and each block's move is known when the
    kernel reads it (the stop rule's masses and the output use the same positions). Ranking uses boxes of the keys
    moved to position 0 and each query moved to rank 0's distance (every row, so the metadata is built once per
    block). On SmolLM2 past its 8K it answers passkey as infinitehip does to 64K (H100, docs/sparse.md).
Device side (CUDA): metadata build, scoring, sort, the decode kernel and the offloaded store's read report are all
device ops with static shapes, so the decode step is captured in CUDA graphs: variants per context bucket, plus a
"catch-up" variant for steps in which a sequence has more than one block to build (its first decode step). Tested
on CPU through the runner's emulated graph path, and captured through the engine on an H100 (docs/benchmarks.md).
The stop test runs on the device, inside the decode kernels, not in a verifying kernel that signals the host (the
paper's): no host round trip per micro-batch. `decode_kernel: waves` (default) reads a wave of micro-batches in
parallel and merges them in rank order; `loop` walks them in one program per (row, KV head), which is as fast when a
query stops early and 17-20x slower when it reads most blocks (H100, docs/kernel-notes.md v13).
"""
from __future__ import annotations

import contextlib
import logging
import typing
from dataclasses import dataclass

import torch

from ..kernels.block_meta import (
    METADATA_KINDS,
    block_scores_reference,
    block_scores_triton,
    build_block_meta_reference,
    build_block_meta_triton,
)
from ..kernels.psa_decode import psa_decode_reference, psa_decode_triton
from ..kernels.psa_waves import psa_decode_waves
from ..rope.strategies import RopeFrame, rotate
from .backend import AttentionBackend, AttentionMetadata
from .dense import DenseBackend
from .index import QueryBlocks, SparseIndex
from .sparse import config_from, preset_and_overrides, use_kernels

logger = logging.getLogger("longreach")

DECODE_KERNELS = {"loop": psa_decode_triton, "waves": psa_decode_waves}  # kernels/psa_{decode,waves}.py: same results


@dataclass(frozen=True)
class PSAConfig:
    epsilon: float = 0.95  # stop once the estimated attended share of the attention mass is >= epsilon
    microbatch: int = 4  # m: ranked blocks attended per iteration (a power of two; m x block_size >= 16)
    metadata: str = "cuboid-mean"  # block metadata: cuboid-mean (ArkVale's, the paper's) or minmax (Quest's bound)
    n_sink: int = 64  # first tokens always read (rounded up to whole blocks)
    n_window: int = 128  # last tokens always read (>= 1; extended down to a block boundary)
    block_size: int | None = None  # tokens per block = the KV page; None: the engine's --block-size (must match)
    dense_layers: tuple[int, ...] = ()  # layers that always attend densely
    # CUDA decode kernel: waves (ranked blocks read in parallel waves) or loop (one program per KV head walks them);
    # same reads and outputs (fp32 rounding). waves by default: on flat attention, where a query reads most blocks,
    # the loop's H_kv programs are serial (8B shape at 128K, H100: 4.8 tok/s with loop, 44.2 with waves)
    decode_kernel: str = "waves"
    # positions: "none" (the paper's: true positions) or "rank" (past rope_from, attend at rank-order positions
    # within the trained distance and rank by keys moved to a fixed distance; module docstring)
    rope: str = "none"
    rope_from: int | None = None  # rows at or past this position move (rope "rank"); None: the trained length
    # meter the keys each decode query reads (PSABackend.decode_reads; eval passkey and bench decode report it):
    # a few device ops per layer and step, so off unless asked for
    count_reads: bool = False

    def __post_init__(self) -> None:
        eps = self.epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 < eps <= 1.0:
            raise ValueError(f"epsilon must be a number in (0, 1], the share of the attention mass a query reads "
                             f"before it stops (presets 0.9, 0.95, 0.98; 1 = dense), got {eps!r}")
        m = self.microbatch
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or m > 64 or m & (m - 1):
            raise ValueError(f"microbatch must be a power of two in [1, 64] (blocks per iteration), got {m!r}")
        if self.metadata not in METADATA_KINDS:
            raise ValueError(f"metadata must be one of {', '.join(METADATA_KINDS)}, got {self.metadata!r}")
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be an integer >= 0, got {self.n_sink!r}")
        if isinstance(self.n_window, bool) or not isinstance(self.n_window, int) or self.n_window < 1:
            raise ValueError(f"n_window must be an integer >= 1 (a query always reads itself), got {self.n_window!r}")
        b = self.block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1)):
            raise ValueError(f"block_size must be None (the engine's --block-size) or a power of two, got {b!r}")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.dense_layers):
            raise ValueError(f"dense_layers must be layer indices >= 0, got {self.dense_layers}")
        if not isinstance(self.decode_kernel, str) or self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {', '.join(DECODE_KERNELS)}, got {self.decode_kernel!r}")
        if not isinstance(self.count_reads, bool):
            raise ValueError(f"count_reads must be true or false, got {self.count_reads!r}")
        if self.rope not in ("none", "rank"):
            raise ValueError(f"rope must be 'none' (true positions) or 'rank' (rank-order positions past rope_from), "
                             f"got {self.rope!r}")
        r = self.rope_from
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"rope_from must be None (the model's trained length) or an integer >= 1, got {r!r}")


class PSA:
    """The method apart from the engine: candidates, ranking, the progressive loop, what was read (the backend and
    `longreach eval recall` use it)."""

    name = "psa"
    config_cls = PSAConfig
    presets = {"0.9": PSAConfig(epsilon=0.9), "0.95": PSAConfig(epsilon=0.95), "0.98": PSAConfig(epsilon=0.98)}
    default_preset = "0.95"

    def __init__(self, cfg: PSAConfig, num_heads: int, num_kv_heads: int):
        self.cfg, self.num_heads, self.num_kv_heads = cfg, num_heads, num_kv_heads
        self.groups = num_kv_heads  # one ranking and one loop per KV head (module docstring)
        self.rope_frame: RopeFrame | None = None  # set by the backend (the model's frequencies); None: true positions

    def rope(self) -> tuple[torch.Tensor, int] | None:
        """(inv_freq, rope_from) when `rope: rank` applies (a backend gave the model's frame), else None."""
        f = self.rope_frame
        if self.cfg.rope != "rank" or f is None:
            return None
        return f.inv_freq, f.rope_from

    def sink_blocks(self, page: int) -> int:
        """Blocks of the sink: n_sink tokens rounded up to whole blocks."""
        return -(-self.cfg.n_sink // page)

    def candidates(self, seq_lens: torch.Tensor, page: int) -> tuple[int, torch.Tensor]:
        """(cand_lo, cand_hi (n,) int32): row r ranks blocks [cand_lo, cand_hi[r]); everything else up to its
        position is read always (sink below, tail above)."""
        lo = self.sink_blocks(page)
        hi = torch.div((seq_lens.long() - self.cfg.n_window).clamp(min=0), page, rounding_mode="floor")
        return lo, hi.clamp(min=lo).to(torch.int32)

    def tail_blocks(self, page: int) -> int:
        """Most blocks a row's tail spans: the last n_window keys plus the rest of the block they start in."""
        return (self.cfg.n_window - 1) // page + 2

    def attend(self, q, k_cache, v_cache, block_tables, seq_lens, meta, width: int, scale: float, kernels: bool):
        """One decode query per row: rank the row's blocks [0, width) and run the progressive loop.
        Returns out (n, H_q, D), counts (n, H_kv) blocks read, ranked (n, H_kv, width) int32 and cand_hi (n,)."""
        page = k_cache.shape[1]
        cand_lo, cand_hi = self.candidates(seq_lens, page)
        rope = self.rope()
        qs = q
        if rope is not None:  # moved metadata (keys at position 0): the query at rank 0's distance, page - T0 away
            qs = rotate(q, page - cand_hi.long()[:, None] * page, rope[0]).to(q.dtype)
        score = (block_scores_triton if kernels else block_scores_reference)(qs, meta, block_tables, cand_lo, cand_hi,
                                                                              width)
        ranked = score.sort(dim=-1, descending=True, stable=True).indices.to(torch.int32)
        run = DECODE_KERNELS[self.cfg.decode_kernel] if kernels else psa_decode_reference
        out, _, counts = run(q, k_cache, v_cache, block_tables, seq_lens, ranked, cand_lo, cand_hi,
                             self.cfg.epsilon, self.cfg.microbatch, scale, rope=rope)
        return out, counts, ranked, cand_hi

    def read_blocks(self, ranked: torch.Tensor, counts: torch.Tensor, cand_hi: torch.Tensor, seq_lens: torch.Tensor,
                    page: int) -> torch.Tensor:
        """Blocks each (row, group) read besides the sink, (n, H_kv, W + tail) int32, -1 padded, unordered: the
        ranked blocks it attended and its tail blocks. No host sync (the offloaded store's `note_reads` input)."""
        n, G, W = ranked.shape
        sel = torch.where(torch.arange(W, device=ranked.device) < counts[..., None], ranked, -1)
        last = (seq_lens.long() - 1) // page
        tail = cand_hi.long()[:, None] + torch.arange(self.tail_blocks(page), device=ranked.device)
        tail = torch.where(tail <= last[:, None], tail, -1).to(torch.int32)
        return torch.cat([sel, tail[:, None, :].expand(n, G, -1)], dim=2)

    def keys_read(self, counts: torch.Tensor, cand_hi: torch.Tensor, seq_lens: torch.Tensor, page: int) -> torch.Tensor:
        """(n,) keys each row read, summed over its KV groups: the ranked blocks it attended (whole pages), plus the
        sink and the tail, which every group reads (a row shorter than the sink reads its seq_len keys)."""
        lens = seq_lens.long()
        sink = torch.clamp(lens, max=self.sink_blocks(page) * page)
        tail = (lens - cand_hi.long() * page).clamp(min=0)
        return counts.long().sum(-1) * page + counts.shape[-1] * (sink + tail)

    def read_index(self, ranked, counts, cand_hi, seq_lens, page: int) -> SparseIndex:
        """What the rows read as a `SparseIndex` (one query block of one row per sequence, sink as n_sink, the tail
        among the listed blocks, n_window 0): block_sparse_attention over it equals the PSA output (tested)."""
        blocks = self.read_blocks(ranked, counts, cand_hi, seq_lens, page)
        big = torch.iinfo(torch.int32).max
        blocks = torch.where(blocks >= 0, blocks, big).sort(dim=-1).values
        blocks = torch.where(blocks == big, -1, blocks)
        n = ranked.shape[0]
        pos = (seq_lens.long() - 1).tolist()
        qb = QueryBlocks(list(range(n)), list(range(n)), [1] * n, pos)
        counts = (blocks >= 0).sum(-1).to(torch.int32)
        return SparseIndex(1, page, self.sink_blocks(page) * page, 0, self.groups, qb, blocks, counts)

    def selection_mask(self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(R, H_q, L) keys read by each evaluated row, each row run as a decode query at its position (eval recall):
        q (R, H_q, D) of the rows at `positions`, k (L, H_kv, D) every key. Block size: the config's, else 16."""
        page = self.cfg.block_size or 16
        R, (L, Hkv, D) = positions.numel(), k.shape
        n_pages = -(-L // page)
        cache = torch.nn.functional.pad(k.float(), (0, 0, 0, 0, 0, n_pages * page - L)).view(n_pages, page, Hkv, D)
        tables = torch.arange(n_pages, dtype=torch.int32)[None].expand(R, n_pages).contiguous()
        meta = torch.zeros(n_pages, 2, Hkv, D)
        rope = self.rope()
        build_block_meta_reference(cache, tables[:1], torch.zeros(1, dtype=torch.int32),
                                   torch.tensor([L // page], dtype=torch.int32), meta, self.cfg.metadata,
                                   None if rope is None else rope[0])
        seq_lens = (positions + 1).to(torch.int32)
        scale = D ** -0.5  # the model's softmax scale (AttentionBackend.scale): the stop rule depends on it
        _, counts, ranked, cand_hi = self.attend(q.float(), cache, cache, tables, seq_lens, meta, n_pages, scale,
                                                 False)
        blocks = self.read_blocks(ranked, counts, cand_hi, seq_lens, page).long()  # (R, G, W')
        per_group = torch.zeros(R, Hkv, n_pages + 1, dtype=torch.bool)
        per_group.scatter_(2, torch.where(blocks >= 0, blocks, n_pages), True)
        tokens = per_group[..., :n_pages].repeat_interleave(page, dim=2)[..., :L]  # (R, G, L)
        j = torch.arange(L)
        sink = j[None, :] < self.sink_blocks(page) * page
        mask = (tokens | sink[:, None, :]) & (j[None, None, :] <= positions[:, None, None])
        return mask.repeat_interleave(self.num_heads // Hkv, dim=1)


class PSABackend(AttentionBackend):
    """PSA: per query, blocks in metadata-rank order until the attended mass reaches epsilon; dense prefill."""

    name = "psa"
    supports_cuda_graph = True
    method_cls = PSA
    preset_notes = {
        "0.95": "read pages until 95% of the estimated attention mass (default)",
        "0.9": "stop at 90% of the mass: fewer keys, less exact",
        "0.98": "stop at 98% of the mass: more keys, closer to dense",
    }

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        self.config = self.resolve_config(engine_config)
        self.method = PSA(self.config, model_config.num_heads, model_config.num_kv_heads)
        if self.config.rope == "rank":
            self.method.rope_frame = RopeFrame.of_model(model_config, self.config.rope_from, device)
        self.dense = DenseBackend(model_config, engine_config, device)
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
        return config_from(PSAConfig, *preset_and_overrides("psa", PSA.presets, PSA.default_preset, engine_config))

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
        if meta.is_prefill or layer in self.config.dense_layers:
            return self.dense.forward(layer, q, k, v, k_cache, v_cache, meta)
        page = k_cache.shape[1]
        if self._variant is not None:  # graph decode: this step's lo / hi sit in static buffers (graph_step)
            bucket, catchup = self._variant
            n = q.shape[0]
            width = -(-bucket // page)
            lo, hi, most = self._g[0, :n], self._g[1, :n], width if catchup else 1
        else:
            width = -(-meta.max_seq_len // page)
            lo, hi, most = self._step
        kernels = use_kernels(q)
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
        if meta.kv_store is not None:  # offloaded: the store installs the pages this step read (LRU)
            rows = torch.arange(q.shape[0], device=q.device)
            pos = meta.seq_lens.long() - 1
            reads = m.read_blocks(ranked, counts, cand_hi, meta.seq_lens, page)
            meta.kv_store.note_reads(layer, meta.block_tables, rows, pos, pos, 1, reads, page,
                                     m.sink_blocks(page) * page, 0)
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
    def graph_keys_upfront(self) -> list:
        return []  # variants depend on the context length: captured on first use

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
