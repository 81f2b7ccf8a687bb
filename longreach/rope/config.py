"""The checkpoint's rotary embedding as configured (`RopeConfig`, the `rope_scaling` types) and `--rope-scaling`.

It lives in rope/, the lowest layer, so that rope/ imports nothing from models/ (models/config.py re-exports it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

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
