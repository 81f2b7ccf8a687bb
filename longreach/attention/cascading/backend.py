"""Cascading KV cache (Willette, Lee, Lee, Jeon, Hwang 2024; digest §3.3, §6.12): a *bounded* cache per sequence —
sink tokens plus N sub-caches with an exponential acceptance schedule and importance-based eviction — with strided
batched prefill. Memory does not grow with the context: a 1M-token prompt runs in a fixed number of KV pages.

How it fits the engine (docs/sparse.md, "Cascading KV cache", has the whole design):
  * `CascadeLayout` (this backend's `kv_layout`) replaces "token t lives in slot t": a sequence owns at most
    `pages_per_seq` pages — the sink, the sub-caches' ring buffers, and staging slots for the step's new tokens —
    and the engine's block manager and model runner ask it how many slots a sequence uses and where new tokens go.
  * The backend owns what moves. The ring structure (rings.py: `CascadeRings`) is planned once per step on the host
    (plan.py), shared by every layer; `forward` executes it per layer: attention, importance update, insertion.
  * Attention reads a *virtual sequence* — sink, cached tokens oldest first, the chunk — through a one-token-per-page
    table, with the project's block-sparse executor / Triton kernel and a plain `SparseIndex` (sink, key blocks up to
    each query block's window, a causal window of `block_q`). Virtual positions are StreamingLLM's positions. On a
    GPU, prefill strides gather the virtual sequence instead (keys rotated once) and run FlashAttention over it
    (attend.py: `gather_virtual`, `causal_attention_lse`; a stride's attention is dense over its virtual
    sequence).
  * Keys are stored un-rotated (the exact inverse of the model's rotation) and RoPE strategy "cache" rotates each at
    its virtual position in the kernel; queries are rotated to theirs here.
  * Importance = an exponential moving average of the attention a token receives, per layer and KV head (mean over
    the group's query heads), one tick per query token: after a stride of n rows, s <- beta^n s + sum_i (1 - beta)
    beta^(n-1-i) p_i (kernels/key_mass.py computes the sum from the attention's log-sum-exp). A new token starts at
    0 when it arrives. So the importance is the same whether a prompt is cut into strides or fed token by token
    (given the same attention).
  * Strided prefill: a stride of the prompt attends over the cache plus itself (causally), then enters the cache.
    Strides cover positions [k * stride, (k + 1) * stride) (stride capped at max_num_batched_tokens); the scheduler
    ends prefill chunks on their boundaries (`CascadeLayout.stride`) and a chunk holding several strides runs them
    one after the other in each layer, so the result does not depend on how steps cut a prompt. Decode tokens are
    strides of one.
  * A model with sliding-window layers (Gemma 3): the cascade is the global layers' cache only. The KV store is then
    kvcache/window.py's `WindowedKVCache`, whose global store holds the cascade's slots (the same `CascadeLayout`,
    pages per sequence) and whose ring keeps each sliding layer's last `window` tokens per sequence slot; the block
    manager hands a sequence both (its pages and a ring slot). The sliding layers attend densely within their window
    through the dense fallback (attention/dense.py: `DenseFallback`), as under every other method; nothing of the
    cascade (plan, importance, positions) runs in them, and its importance and positions are kept per global layer.
    docs/gemma3.md ("Cascading on the global layers") has the design.

Not supported (refused with a reason): KV offloading, fp8 KV, composing with another method (--decode-attention),
dynamic-NTK RoPE, CUDA-graph decode (decode runs eagerly: the insertion plan is host work every step).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ...kernels.cascade_insert import (cascade_insert_reference, cascade_insert_triton, cascade_rope_reference,
                                       cascade_rope_triton, move_rows_triton)
from ...kernels import use_triton
from ...kernels.combine import sm_count, split_count
from ...rope.strategies import RopeArgs, rotation
from ..backend import AttentionBackend, AttentionMetadata, Capabilities
from ..dense import DenseFallback
from ..presets import resolve
from .attend import causal_attention_lse, gather_virtual, unrotation
from .config import DEFAULT_PRESET, PRESET_NOTES, PRESETS, CascadeLayout, CascadingConfig
from .plan import SubStride, plan_step
from .rings import CascadeRings, apply_moves

logger = logging.getLogger("longreach")


class CascadingBackend(AttentionBackend):
    """Cascading KV cache: sink + sub-caches with exponential acceptance and importance eviction; bounded memory."""

    name = "cascading"
    # no graphs (the insertion plan is host work every step); its own bounded cache: cannot be composed
    capabilities = Capabilities(bounded_cache=True)
    preset_notes = PRESET_NOTES
    honours_layer_windows = True  # sliding-window layers go to the dense fallback (the module docstring)

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        from ...rope.scaling import rope_inv_freq

        self.config = self.resolve_config(engine_config)
        c = self.config
        self.sizes = [c.subcache_size] * c.num_subcaches
        # the sliding-window layers (Gemma 3's local ones) attend densely within their window, over their ring; the
        # cascade and its side state are the other (global) layers', indexed by their rank among them
        self.fallback = DenseFallback(model_config, engine_config, device, ())
        self._cascade_layer = {layer: i for i, layer in enumerate(self.fallback.sparse_layers())}
        G, H = len(self._cascade_layer), model_config.num_kv_heads
        self.stride = min(c.stride, engine_config.max_num_batched_tokens)  # a stride fits one step
        self.kv_layout = CascadeLayout(c.n_sink, c.capacity, engine_config.max_num_batched_tokens, self.stride,
                                       G * H * 8)
        self.inv_freq = rope_inv_freq(model_config.rope, model_config.head_dim)[0].to(device)
        self.rope = RopeArgs("cache", self.inv_freq, 0)
        self._rings: dict[int, CascadeRings] = {}
        self._tables: dict[int, np.ndarray] = {}  # last block table seen per sequence (check_integrity)
        self._score: torch.Tensor | None = None  # (G, num_slots, H_kv) fp32 importance, G: the global layers
        self._tokpos: torch.Tensor | None = None  # (G, num_slots, H_kv) int32 true position of the token in a slot
        self._subs: list[SubStride] = []
        self._rope_tables: tuple = ()  # the step's RoPE tables (begin_step)
        self._pos32: torch.Tensor | None = None  # (T, 1) the step's true positions, int32
        self._virt_cs: tuple = (torch.empty(0), torch.empty(0))  # rotation tables of virtual positions 0, 1, ...
        self._key_rows = torch.empty(0, dtype=torch.int32)  # 0, 1, ...: the gathered keys' one-token "pages"
        cuda = device.type == "cuda"
        self._num_sms = sm_count(device)
        self._flash_arch = cuda and torch.cuda.get_device_capability(device)[0] >= 8  # FlashAttention-2: sm80+
        if c.stride > engine_config.max_num_batched_tokens:
            logger.info("cascading: stride %d exceeds max_num_batched_tokens %d: prefill strides are %d tokens",
                        c.stride, engine_config.max_num_batched_tokens, self.stride)

    # ---- configuration -------------------------------------------------------------------------------------------
    @classmethod
    def resolve_config(cls, engine_config) -> CascadingConfig:
        return resolve(CascadingConfig, "cascading", PRESETS, DEFAULT_PRESET, engine_config)

    @classmethod
    def config_problems(cls, cfg, model_config, engine_config) -> list[str]:
        why = []
        if engine_config.offload:
            why.append("cascading keeps a bounded cache on the GPU: KV offloading (--kv-offloading-size) has nothing "
                       "to offload")
        if engine_config.kv_cache_dtype == "fp8":
            why.append("cascading does not support an fp8 KV cache yet")
        if model_config.rope.rope_type == "dynamic" and model_config.rope.freq_factors is None:
            why.append("dynamic NTK RoPE changes its frequencies with the sequence length; cascading stores keys "
                       "un-rotated and rotates them with fixed ones")
        return why

    # ---- per-step planning (host: plan.py) ------------------------------------------------------------------------
    def begin_step(self, meta: AttentionMetadata) -> None:
        """Plan the step for every sequence (plan.py: its strides, virtual sequences, attention indexes and the
        insertion; each sequence's ring structure advances past the step's tokens) and the RoPE tables every layer
        shares."""
        self._subs, pos = plan_step(meta, self._rings, self._tables, self.config, self.kv_layout, self.stride,
                                    self.engine_config.block_size, self.device)
        # RoPE tables shared by every layer: true positions (to un-rotate keys and queries), each row's virtual one
        virt = torch.empty_like(pos)
        for sub in self._subs:
            virt[sub.rows] = sub.virt_pos
        self._rope_tables = unrotation(pos, self.inv_freq), rotation(virt[:, None], self.inv_freq)
        self._pos32 = pos[:, None].to(torch.int32)
        vmax = max((s.max_keys for s in self._subs if s.prefill), default=0)
        if vmax and self.config.flash_prefill and self._virt_cs[0].shape[0] < vmax:
            # positions 0, 1, ... of the virtual sequence, for `gather_virtual` (grown, never shrunk)
            self._virt_cs = rotation(torch.arange(max(vmax, self.kv_layout.max_slots), device=self.device),
                                     self.inv_freq)

    # ---- per-layer execution -------------------------------------------------------------------------------------
    def _side_state(self, num_slots: int) -> None:
        G, H = len(self._cascade_layer), self.model_config.num_kv_heads
        if self._score is None or self._score.shape[1] != num_slots:
            self._score = torch.zeros(G, num_slots, H, dtype=torch.float32, device=self.device)
            self._tokpos = torch.full((G, num_slots, H), -1, dtype=torch.int32, device=self.device)

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        """A global layer: the step's strides over its cascade (`k_cache`/`v_cache`: the global store's pages). A
        sliding-window layer: dense within its window (the caches are then its ring, kvcache/window.py)."""
        if layer in self.fallback.layers:
            return self.fallback.forward(layer, q, k, v, k_cache, v_cache, meta)
        H, row = k_cache.shape[2], k_cache.shape[3]
        self._side_state(k_cache.shape[0] * k_cache.shape[1])
        kf, vf = k_cache.view(-1, H, row), v_cache.view(-1, H, row)  # (num_slots, H_kv, D): flat slots
        g = self._cascade_layer[layer]
        score, tokpos = self._score[g], self._tokpos[g]
        # the step's keys were stored rotated at their true positions: store them un-rotated instead (with their
        # positions); the queries move to their virtual positions
        rope = cascade_rope_triton if self.step_kernels(q) else cascade_rope_reference
        q_virt = rope(q, k, kf, tokpos, meta.slot_mapping, self._pos32, *self._rope_tables)
        out = torch.empty_like(q)
        kview, vview = k_cache.view(-1, 1, H, row), v_cache.view(-1, 1, H, row)  # one token per "page"
        gathered = self._gathered_kernel(q)
        for sub in self._subs:
            qv = q_virt[sub.rows]
            if sub.prefill and gathered is not None:
                o, mass = self._gathered_step(qv, kf, vf, sub, gathered)
            else:
                o, lse = self._attend(qv, kview, vview, sub)
                mass = self._key_mass(qv, kview, sub.table, lse, sub, self.rope)  # (B_r, H_kv, V_max)
            out[sub.rows] = o
            self._insert(mass, sub, kf, vf, score, tokpos)
        return out

    def _gathered_kernel(self, q: torch.Tensor) -> str | None:
        """How prefill strides attend: "flash" (gather the virtual sequence, rotate its keys once, FlashAttention;
        CUDA sm80+, fp16/bf16, head_dim a multiple of 8 up to 256, `flash_prefill` on), else None: the block-sparse
        kernel (the CPU executor) over the cache in place, keys rotated per query block. Decode strides always take
        the block-sparse path (one row: split-K over the keys in place beats a gather). Tests patch this to
        "reference" to run the gathered path on the CPU."""
        D = q.shape[-1]
        ok = self.config.flash_prefill and self._flash_arch and q.dtype in (torch.float16, torch.bfloat16)
        return "flash" if ok and D % 8 == 0 and D <= 256 else None

    def _gathered_step(self, q, kf, vf, sub: SubStride, kernel: str):
        """A prefill stride's attention and key mass over gathered virtual sequences, one sequence at a time
        (`gather_virtual`, `causal_attention_lse`, then the key-mass kernel over the gathered, rotated keys: no
        RoPE in it, an identity table). -> out (T_r, H_q, D), mass (B_r, H_kv, V_max). One sequence's gathered K/V
        at a time keeps the transient memory to one virtual sequence, however many prefill together."""
        H, D = kf.shape[1], kf.shape[2]
        if sub.singles is None:  # built by the first layer, reused by the others
            i32 = lambda v: torch.tensor([v], dtype=torch.int32, device=q.device)  # noqa: E731
            sub.singles = [(i32(0), i32(n), i32(V - n), i32(V)) for _, n, V in sub.spans]
        if self._key_rows.shape[0] < sub.max_keys:
            self._key_rows = torch.arange(max(sub.max_keys, self.kv_layout.max_slots), dtype=torch.int32,
                                          device=q.device)
        per_seq = []
        for b, (r0, n, V) in enumerate(sub.spans):
            kg, vg = gather_virtual(kf, vf, sub.table[b, :V], *self._virt_cs)
            qb = q[r0:r0 + n]
            o, lse = causal_attention_lse(qb, kg, vg, self.scale, kernel)
            per_seq.append((o, self._key_mass_of(qb, kg.view(-1, 1, H, D), self._key_rows[None, :V], lse,
                                                 (*sub.singles[b], sub.row_weight[r0:r0 + n], V, n), None)))
        if len(per_seq) == 1:  # one sequence: its rows and keys are the stride's
            return per_seq[0]
        out = torch.empty_like(q)
        mass = torch.zeros(len(per_seq), H, sub.max_keys, dtype=torch.float32, device=q.device)
        for b, ((r0, n, V), (o, m)) in enumerate(zip(sub.spans, per_seq)):
            out[r0:r0 + n], mass[b, :, :V] = o, m[0]
        return out, mass

    step_kernels = staticmethod(use_triton)  # kernels/cascade_insert.py's; tests force them in the interpreter

    def _insert(self, mass, sub: SubStride, kf, vf, score, tokpos) -> None:
        """The importance EMA, the plan's rules and the moves of K/V rows, importance and positions: three launches
        on a GPU (kernels/cascade_insert.py), their PyTorch reference (~10 ops per ring level) elsewhere."""
        args = (sub.plan, score, mass, sub.ema_slots, sub.ema_key, sub.ema_decay)
        if self.step_kernels(score):
            move_rows_triton(sub.plan.dst, cascade_insert_triton(*args), kf, vf, score, tokpos)
        else:
            apply_moves(sub.plan.dst, cascade_insert_reference(*args), (kf, vf, score, tokpos))

    def _attend(self, q, kview, vview, sub: SubStride):
        if use_triton(q):
            from ...kernels.bsa import BSAPlan, block_sparse_attention_triton

            if sub.bsa_plan is None:
                sub.bsa_plan = BSAPlan(sub.index, self.model_config.num_heads, self.model_config.num_kv_heads,
                                       q.device)
            splits = 1 if sub.index.block_q > 1 else self._decode_splits(sub.index.queries.num_blocks)
            return block_sparse_attention_triton(q, kview, vview, sub.table, sub.index, self.scale,
                                                 num_splits=splits, plan=sub.bsa_plan, rope=self.rope)
        from ..executor import block_sparse_attention

        # CPU: one fused SDPA call per slice (no log-sum-exp); the key-mass reference normalises its own softmax
        return block_sparse_attention(q, kview, vview, sub.table, sub.index, self.scale, rope=self.rope,
                                      need_lse=False)

    def _key_mass(self, q, kview, table, lse, sub: SubStride, rope) -> torch.Tensor:
        return self._key_mass_of(q, kview, table, lse, (sub.seq_start, sub.seq_len, sub.first_pos, sub.num_keys,
                                                        sub.row_weight, sub.max_keys, sub.max_rows), rope)

    def _key_mass_of(self, q, kview, table, lse, seqs: tuple, rope) -> torch.Tensor:
        """kernels/key_mass.py on a GPU, its reference elsewhere; seqs = (seq_start, seq_len, first_pos, num_keys,
        row_weight, max_keys, max_rows)."""
        from ...kernels.key_mass import key_mass_reference, key_mass_triton

        *per_seq, row_weight, max_keys, max_rows = seqs
        args = (q, kview, table, *per_seq, lse, row_weight, self.scale, rope)
        if use_triton(q):
            return key_mass_triton(*args, max_keys=max_keys, max_rows=max_rows)
        return key_mass_reference(*args)

    def _decode_splits(self, num_seqs: int) -> int:
        """Split-K for decode over the cache's keys (kernels/combine.py: split_count)."""
        return split_count(num_seqs * self.model_config.num_kv_heads, self._num_sms, 32)

    # ---- sequence life -------------------------------------------------------------------------------------------
    def free_sequence(self, seq_id: int) -> None:
        self._rings.pop(seq_id, None)
        self._tables.pop(seq_id, None)

    def cache_stats(self, seq_id: int) -> dict:
        """Tokens seen and cached and rule counts so far (structural: fills, scheduled accepts, compares, falls)."""
        r = self._rings[seq_id]
        return {"tokens": r.tokens, "cached": min(r.tokens, self.config.n_sink) + r.cached,
                "fill": list(r.fill), **dict(r.stats)}

    def check_integrity(self, seq_id: int | None = None) -> None:
        """Every sequence's (or one's) ring structure, and in every global layer and KV head: the sink holds tokens
        0..n_sink-1 in order, the cached tokens are strictly in order of position (so none twice), all seen, past
        the sink. Raises AssertionError. Call between steps."""
        bs = self.engine_config.block_size
        for sid in [seq_id] if seq_id is not None else list(self._rings):
            rings, table = self._rings[sid], self._tables[sid]
            rings.check_integrity()
            if self._tokpos is None:
                continue
            flat = lambda loc: torch.from_numpy(table[loc // bs] * bs + loc % bs).to(self.device)  # noqa: E731
            sink = min(rings.tokens, rings.n_sink)
            got = self._tokpos[:, flat(np.arange(sink))].long()  # (L, sink, H)
            want = torch.arange(sink, device=self.device)[None, :, None]
            if not torch.equal(got, want.expand_as(got)):
                raise AssertionError(f"sequence {sid}: the sink does not hold tokens 0..{sink - 1}")
            pos = self._tokpos[:, flat(rings.chronological())].long()  # (L, cached, H)
            if pos.numel() and ((pos[:, 1:] <= pos[:, :-1]).any() or (pos < rings.n_sink).any()
                                or (pos >= rings.tokens).any()):
                raise AssertionError(f"sequence {sid}: cached tokens out of order, repeated or never seen")

    def describe(self) -> str:
        c = self.config
        return (f"{c.n_sink} sink + {c.num_subcaches} sub-caches x {c.subcache_size} = {c.cache_tokens} tokens, "
                f"reach ~{c.n_sink + c.subcache_size * (2 ** c.num_subcaches - 1)} tokens, stride {c.stride}, "
                f"ema {c.ema}")

