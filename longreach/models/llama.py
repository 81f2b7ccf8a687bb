"""The Llama family in one module: Llama 2/3/3.x, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm), Gemma 3
(the same decoder with its options, models/config.py: q/k norms, four norms per layer, GeGLU, scaled embeddings,
sliding-window layers with a RoPE of their own; the window itself is attention's, `ModelConfig.window_of`).

Tokens of all sequences in a step are flattened into one (T, hidden) batch; only attention needs to know which
token belongs to which sequence, and it learns that from the engine's `AttentionMetadata` through `ForwardContext`.
q/k/v and gate/up are fused into single matmuls at load time (fewer launches per decode step).

Tensor parallelism (docs/design-tensor-parallel.md): built with a `TPGroup` of N ranks, the model holds its rank's part
(models/shard.py: its query heads and their KV heads, a 1/N slice of the MLP and of the vocabulary); o_proj and
down_proj are followed by an all-reduce, the embedding by one, and the LM head's logits are gathered to rank 0. With
one rank (the default) every collective is the identity and the layers are the full ones.

Numerics follow transformers (RMSNorm in fp32 then cast, RoPE in the activation dtype) so that greedy outputs can be
compared token for token. Gemma's RMSNorm multiplies by (1 + w): the 1 is added to the weights at load
(`ModelConfig.norm_offset`), so the norm is Llama's, bit for bit the same in fp32 (Gemma casts after the weight
multiply, Llama before: bf16 results may differ in the last bit). On a GPU the residual add + RMSNorm, the rotary embedding and SiLU * up run as one Triton
kernel each (kernels/fused.py: the same arithmetic, ~30 fewer launches per layer in a decode step); elsewhere their
PyTorch references. The residual stream is carried beside each layer's output (vLLM's layout) so that the add fuses
into the next norm.

The forward pass is written as pieces split at each attention call (`embed`, `DecoderLayer.pre_attention` /
`post_attention`, `finish`): `forward` composes them around `ctx.attention`, and engine/chunk_graphs.py captures
the same pieces in CUDA graphs for prefill chunks, with attention still called eagerly between them.
"""
from __future__ import annotations

import functools
from typing import Iterable, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from ..distributed.group import TPGroup
from ..kernels.fused import add_rms_norm, rms_norm, rms_norm_reference, rope_qk_, silu_mul
from ..rope.scaling import RotaryEmbedding, apply_rope
from .config import ModelConfig
from .shard import ModelShard


@functools.lru_cache(maxsize=None)  # read by every forward pass: made once per (value, dtype)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (bf16, fp16, fp32), as a host float: multiplying a tensor of that dtype by it gives
    what multiplying by a one-element tensor of that dtype gives."""
    return torch.tensor(value, dtype=dtype).item()


class ForwardContext(Protocol):
    """What the model needs from the engine for one forward pass (see engine/model_runner.py)."""

    max_position: int | None

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k/v (T, H_kv, D) in the KV cache and return attention output (T, H_q, D) for q (T, H_q, D)."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x) over the last dim; with `residual`, (RMSNorm(residual + x), residual + x)."""
        if residual is not None:
            return add_rms_norm(x, residual, self.weight, self.eps)
        if x.dim() == 2:
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)  # q/k norms (T, H, D)


class Attention(nn.Module):
    """The projections around attention; the attention itself is the engine's (`ForwardContext.attention`), called by
    the decoder layer between `project` and `output`."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, shard: ModelShard):
        super().__init__()
        self.layer, self.tp = layer, tp
        # this rank's heads: all of them with one rank
        self.num_heads, self.num_kv_heads, self.head_dim = len(shard.q_heads), len(shard.kv_heads), cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)  # column-par.
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)  # row-parallel
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The layer's work before attention: x (T, hidden) -> q (T, H_q, D), k, v (T, H_kv, D), RoPE applied."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (H_q + 2 H_kv) D)
        if self.q_norm is None:  # q and k heads side by side: one in-place rotation for both
            qk = rope_qk_(qkv[:, :self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads,
                                                                   self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
            v = v.view(T, self.num_kv_heads, self.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def output(self, attn_out: torch.Tensor) -> torch.Tensor:
        """The layer's work after attention: attn_out (T, H_q, D) -> o_proj (T, hidden), summed over the ranks."""
        return self.tp.all_reduce(self.o_proj(attn_out.reshape(attn_out.shape[0], self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, shard: ModelShard):
        super().__init__()
        self.tp = tp
        width = len(shard.inter)  # this rank's slice of the intermediate dim
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=cfg.mlp_bias)  # column-parallel
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)  # row-parallel
        self.geglu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.geglu:  # Gemma: GeGLU, gelu-tanh
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        else:
            h = silu_mul(gate_up)
        return self.tp.all_reduce(self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, shard: ModelShard):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp, shard)
        # Llama: post_attention_layernorm is the norm before the MLP (the residual add fused into it). Gemma (HF
        # names kept): post_attention_layernorm normalises attention's output, pre_feedforward_layernorm is the norm
        # before the MLP, post_feedforward_layernorm normalises the MLP's output.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp, shard)
        # which of the model's RoPEs this layer takes when there are two (embed's cos/sin are then pairs): 0 the
        # global one, 1 the sliding layers' own; None: one RoPE, cos/sin are tensors
        self.rope_slot = None if cfg.rope_local is None else int(cfg.window_of(layer) is not None)

    def pre_attention(self, x, residual, cos, sin):
        """x: the previous layer's MLP output (the embeddings, with residual None, in layer 0) -> (q, k, v, the
        residual stream with x added)."""
        if self.rope_slot is not None:
            cos, sin = cos[self.rope_slot], sin[self.rope_slot]
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        return (*self.self_attn.project(h, cos, sin), residual)

    def post_attention(self, attn_out, residual):
        """attn_out (T, H_q, D), the residual stream -> (this layer's MLP output, the residual stream before it)."""
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(self.self_attn.output(attn_out)),
                                                         residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(self.self_attn.output(attn_out), residual)
        return self.mlp(h), residual

    def forward(self, x, residual, cos, sin, ctx):
        """x: the previous layer's MLP output (the embeddings, with residual None, in layer 0) -> (this layer's MLP
        output, the residual stream before it). The stream is the same sum `x + attn(...)`, `x + mlp(...)` as
        before, the adds fused into the norms. Split at the attention call (`pre_attention`, `post_attention`) so
        that engine/chunk_graphs.py can capture the pieces around it."""
        q, k, v, residual = self.pre_attention(x, residual, cos, sin)
        return self.post_attention(ctx.attention(self.self_attn.layer, q, k, v), residual)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        """`tp`: the tensor-parallel group this rank belongs to (default: one rank, the whole model). Raises
        ValueError naming the allowed sizes when its size cannot split the model."""
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup.single()
        self.shard = ModelShard.of(cfg, self.tp.rank, self.tp.world_size)
        self.embed_tokens = nn.Embedding(self.shard.vocab_rows, cfg.hidden_size)  # vocab-parallel (all: one rank)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.tp, self.shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.rotary_local = None if cfg.rope_local is None else RotaryEmbedding(cfg.rope_local, cfg.head_dim)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, self.shard.vocab_rows, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden). Call `logits` on the rows you need.

        The composition of `embed`, each layer's `pre_attention`, attention and `post_attention`, and `finish`:
        engine/chunk_graphs.py runs the same pieces, captured, around eager attention calls."""
        x, cos, sin = self.embed(input_ids, positions, ctx.max_position)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.finish(x, residual)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int | None):
        """input_ids, positions (T,) -> embeddings x (T, hidden) and the rotary cos, sin (T, D/2); with a second
        RoPE for the sliding layers (Gemma 3), cos and sin are pairs (global, local) (`DecoderLayer.rope_slot`).

        `max_position` (host int): read only by dynamic NTK RoPE (rope/scaling.py), so None gives the same cos/sin
        for every other RoPE type."""
        x = self._embed_tokens(input_ids)
        if self.config.scale_embeddings:  # Gemma: the factor rounded to the model dtype, as transformers does; a
            # host float, exact in that dtype (a host tensor copied here would break CUDA graph capture)
            x = x * _rounded(self.config.hidden_size ** 0.5, x.dtype)
        cos, sin = self.rotary(positions, x.dtype, max_position)
        if self.rotary_local is not None:
            cos_l, sin_l = self.rotary_local(positions, x.dtype, max_position)
            cos, sin = (cos, cos_l), (sin, sin_l)
        return x, cos, sin

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> (T, hidden). Vocab-parallel: each rank looks up the ids of its vocab range, zeros for the
        others, and the all-reduce sums the one non-zero row per token."""
        if self.shard.whole:
            return self.embed_tokens(input_ids)
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_rows)
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)

    @staticmethod
    def finish(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's MLP output and residual stream -> the final hidden states (T, hidden), before the norm."""
        return x if residual is None else residual + x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden (N, hidden) -> fp32 logits (N, vocab). Tensor-parallel: every rank computes its vocab shard's and
        they are gathered to rank 0, where the sampler runs; the other ranks get None (each must call it, with the
        same rows)."""
        h = self.norm(hidden)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, w).float()
        if not self.shard.whole:
            logits = self.tp.gather_last_dim(logits)  # (N, size * Vp) on rank 0, None elsewhere
            if logits is None:
                return None
            logits = logits[:, :self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    # ---- weights -------------------------------------------------------------------------------------------------
    _STACKED = {  # checkpoint name part -> (our fused param part, slot)
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors ("model.layers.3.self_attn.q_proj.weight", ...); every parameter must be covered.
        Each tensor is cut to this rank's part as it arrives (models/shard.py: `ModelShard.cut`)."""
        params = dict(self.named_parameters())
        cfg = self.config
        splits = self._fused_splits()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes also store the head
            target, slot = name, None
            for part, (fused, idx) in self._STACKED.items():
                if f".{part}." in f".{name}":
                    target, slot = name.replace(part, fused), idx
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {cfg.architecture} model")
            param = params[target]
            module = _module_of(target)
            if slot is None:
                dst = param
            else:
                sizes = splits[module]
                start = sum(sizes[:slot])
                dst = param.narrow(0, start, sizes[slot])
            if not self.shard.whole:
                full = tuple(tensor.shape)
                tensor = self.shard.cut(module, slot, tensor, target.endswith(".bias"))
                if dst.shape != tensor.shape:
                    raise ValueError(f"tensor {name!r} has shape {full}, the model's rank {self.shard.rank} of "
                                     f"{self.shard.size} expects {tuple(dst.shape)} of it, got {tuple(tensor.shape)}")
            if dst.shape != tensor.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dst.shape)}")
            if cfg.norm_offset and target.endswith("norm.weight"):  # Gemma's (1 + w), see ModelConfig.norm_offset
                tensor = tensor.float() + cfg.norm_offset
            dst.copy_(tensor)
            loaded.add(target if slot is None else f"{target}#{slot}")
        expected = set()
        for pname in params:
            key = _module_of(pname)
            if key in splits:
                expected.update(f"{pname}#{i}" for i in range(len(splits[key])))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")

    def _fused_splits(self) -> dict[str, list[int]]:
        """The fused parameters' parts (rows of this rank's q, k, v; gate, up)."""
        a, width = self.layers[0].self_attn, len(self.shard.inter)
        return {"self_attn.qkv_proj": [a.q_size, a.kv_size, a.kv_size], "mlp.gate_up_proj": [width, width]}

    def cut_fused(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter `name` given the whole model's value of it (fused layout: q, k, v rows;
        gate, up rows): random weights drawn whole (models/random_init.py), then cut like a checkpoint's."""
        if self.shard.whole:
            return full
        module, is_bias = _module_of(name), name.endswith(".bias")
        if module == "self_attn.qkv_proj":
            cfg = self.config
            sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        elif module == "mlp.gate_up_proj":
            sizes = [self.config.intermediate_size] * 2
        else:
            return self.shard.cut(module, None, full, is_bias)
        return torch.cat([self.shard.cut(module, i, part, is_bias) for i, part in enumerate(full.split(sizes))])


def _module_of(param: str) -> str:
    """"layers.3.self_attn.qkv_proj.weight" -> "self_attn.qkv_proj"; "embed_tokens.weight" -> "embed_tokens"."""
    path = param.rsplit(".", 1)[0]
    return path.split(".", 2)[2] if path.startswith("layers.") else path
