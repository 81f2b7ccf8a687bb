"""The model hyper-parameters longreach needs, normalised from a HF `config.json` or GGUF metadata.

One frozen `ModelConfig` describes every supported Llama-family variant; the differences are a few flags
(`qkv_bias` for Qwen2, `qk_norm` for Qwen3, `tie_word_embeddings`), never separate model classes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# HF `architectures` entry -> our family name. Mistral and Llama share code; Qwen2 adds qkv bias, Qwen3 q/k norm.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the checkpoint (the *model-level* scaling; per-method re-indexing lives elsewhere).

    `freq_factors` (GGUF `rope_freqs`): per-frequency divisors already baked by llama.cpp for llama3-style
    scaling; when present they replace the `rope_type` computation of the divisors.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn: cos/sin multiplier; derived from factor/mscale when None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.rope_type != "default" and self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.partial_rotary_factor != 1.0:
            raise ValueError("partial rotary embeddings are not supported (partial_rotary_factor must be 1.0)")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "RopeConfig":
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs use `rope_theta` + `rope_scaling`.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        params = {**scaling, **params}
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
        known = {f for f in cls.__dataclass_fields__ if f not in ("theta", "rope_type", "freq_factors")}
        kwargs = {k: v for k, v in params.items() if k in known and v is not None}
        if "partial_rotary_factor" in cfg and cfg["partial_rotary_factor"] is not None:
            kwargs["partial_rotary_factor"] = float(cfg["partial_rotary_factor"])
        if rope_type in ("linear", "dynamic", "llama3", "yarn") and "original_max_position_embeddings" not in kwargs:
            kwargs["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
        return cls(theta=float(theta), rope_type=rope_type, **kwargs)


def rope_override(model_rope: RopeConfig, trained_len: int, override: Mapping[str, Any]) -> RopeConfig:
    """`--rope-scaling`: the model's RoPE with a scaling given in Hugging Face / vLLM form (`rope_type` or `type`,
    `factor`, ...). The model's theta stays unless `rope_theta` is given; `original_max_position_embeddings`
    defaults to the trained length. Unknown keys raise ValueError listing the valid ones."""
    valid = {f for f in RopeConfig.__dataclass_fields__ if f not in ("theta", "rope_type", "freq_factors")}
    valid |= {"rope_type", "type", "rope_theta"}
    unknown = sorted(set(override) - valid)
    if unknown:
        raise ValueError(f"unknown rope_scaling key(s) {unknown}; valid: {', '.join(sorted(valid))}")
    if "rope_type" not in override and "type" not in override:
        raise ValueError(f"rope_scaling needs a rope_type (one of {', '.join(ROPE_TYPES)}), got {dict(override)}")
    try:
        return RopeConfig.from_hf({"rope_theta": model_rope.theta, "rope_scaling": dict(override),
                                   "max_position_embeddings": trained_len})
    except TypeError as e:
        raise ValueError(f"bad rope_scaling {dict(override)}: {e}") from None


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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], name: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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
