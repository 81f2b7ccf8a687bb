"""The model hyper-parameters longreach needs, normalised from a HF `config.json` or GGUF metadata.

One frozen `ModelConfig` describes every supported Llama-family variant; the differences are a few flags
(`qkv_bias` for Qwen2, `qk_norm` for Qwen3, `tie_word_embeddings`), never separate model classes. Gemma 3 is the
same decoder with more options: per-layer sliding windows (`sliding_layers`) with their own RoPE (`rope_local`),
four norms per layer (`sandwich_norms`), GeGLU (`hidden_act`), the embeddings scaled by sqrt(hidden), its own softmax
scale (`query_pre_attn_scalar`) and optional final logit soft-capping.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# the checkpoint's RoPE lives in rope/ (below models/ and kernels/); re-exported here
from ..rope.config import ROPE_TYPES, RopeConfig, rope_override  # noqa: F401

# HF `architectures` entry -> our family name. Mistral and Llama share code; Qwen2 adds qkv bias, Qwen3 q/k norm.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
_MODEL_TYPES = {"gemma3_text": "gemma3"}  # `model_type` -> family, for configs without `architectures`
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES' values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # layers that attend to the last `sliding_window` positions only (the current one included), honoured by dense
    # attention; () with a `sliding_window`: a Mistral-style window on every layer, not honoured (a warning says so)
    sliding_layers: tuple[int, ...] = ()
    rope_local: RopeConfig | None = None  # the RoPE of the sliding layers when it differs from `rope` (Gemma 3)
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    sandwich_norms: bool = False  # Gemma: norms before and after attention and before and after the MLP
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), the factor cast to the model dtype
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (None: head_dim ** -0.5)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    # added to every RMSNorm weight at load: HF Gemma checkpoints store w for a norm that multiplies by (1 + w);
    # GGUF files already hold 1 + w (llama.cpp's converter adds the 1), so theirs is 0
    norm_offset: float = 0.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # a tensor-parallel rank's view of the model (models/shard.py: ModelShard.local_config): the whole model's
    # (query heads, KV heads) and the global indices of this config's first query head and first KV head. None and
    # (0, 0): the whole model. Backends whose per-head data is indexed by global head (MInference's pattern files)
    # read it through `global_heads`
    whole_heads: tuple[int, int] | None = None
    first_heads: tuple[int, int] = (0, 0)

    def global_heads(self, granularity: str) -> tuple[int, range]:
        """(the whole model's count of `granularity` "head" or "kv_head", the global indices of this config's own)."""
        kv = granularity == "kv_head"
        local = self.num_kv_heads if kv else self.num_heads
        total = (self.whole_heads or (self.num_heads, self.num_kv_heads))[kv]
        first = self.first_heads[kv]
        return total, range(first, first + local)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {self.hidden_act!r}; supported: {', '.join(_ACTIVATIONS)}")
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("sliding_layers need a sliding_window")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"sliding layers {bad} out of range for {self.num_layers} layers")

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within (keys at positions p - window < k <= p), or None: all."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def attn_scale(self) -> float:
        """The softmax scale of attention scores."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def has_layer_windows(self) -> bool:
        """Do some layers attend within a sliding window that attention must honour (Gemma 3)?"""
        return bool(self.sliding_layers)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], name: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = _MODEL_TYPES.get(cfg.get("model_type"))
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "gemma3":
            return _gemma3_from_hf(cfg, name)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; the Llama family uses 'silu'")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        sliding = cfg.get("sliding_window")
        if arch == "qwen2" or arch == "qwen3":
            # Qwen configs carry a sliding_window value but only use it when use_sliding_window is set.
            sliding = sliding if cfg.get("use_sliding_window") else None
        bias = bool(cfg.get("attention_bias") or False)  # Mistral has no biases; Qwen2 always has q/k/v bias
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or (arch in ("llama", "qwen3") and bias),
            o_bias=arch in ("llama", "qwen3") and bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )


def _eos_ids(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


def gemma3_sliding_layers(num_layers: int, pattern: int = 6) -> tuple[int, ...]:
    """Gemma 3's default layout: every `pattern`-th layer (5, 11, ... for 6) global, the others sliding."""
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


def _gemma3_from_hf(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    """A `Gemma3ForCausalLM` / `gemma3_text` config (transformers 4.5x or 5.x spelling)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r}; supported: gelu_pytorch_tanh")
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("bidirectional Gemma 3 (use_bidirectional_attention) is an encoder, not a causal LM")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != n:
            raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the {n} "
                             f"layers, got {types!r}")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        sliding = gemma3_sliding_layers(n, int(pattern))
    ctx = cfg.get("max_position_embeddings", 131072)
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers >= 5: one entry per layer type
        full = {"rope_theta": 1_000_000.0, **(params.get("full_attention") or {})}
        local = {"rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
        rope = RopeConfig.from_hf({"rope_parameters": full, "max_position_embeddings": ctx})
        rope_local = RopeConfig.from_hf({"rope_parameters": local, "max_position_embeddings": ctx})
    else:  # rope_theta + rope_scaling for the global layers, rope_local_base_freq for the sliding ones
        rope = RopeConfig.from_hf({"rope_theta": 1_000_000.0, **cfg})
        rope_local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10_000.0)))
    heads = cfg["num_attention_heads"]
    window = cfg.get("sliding_window")
    return ModelConfig(
        architecture="gemma3",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=n,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=ctx,
        rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias")),
        o_bias=bool(cfg.get("attention_bias")),
        qk_norm=True,
        sliding_window=window if sliding else None,
        sliding_layers=sliding if window else (),
        rope_local=rope_local,
        hidden_act="gelu_pytorch_tanh",
        sandwich_norms=True,
        scale_embeddings=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        norm_offset=1.0,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
        name=name,
    )
