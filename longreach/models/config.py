"""The model hyper-parameters longreach needs, normalised from a HF `config.json` or GGUF metadata.

One frozen `ModelConfig` describes every supported Llama-family variant; the differences are a few flags
(`qkv_bias` for Qwen2, `qk_norm` for Qwen3, `tie_word_embeddings`), never separate model classes.
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
}


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
