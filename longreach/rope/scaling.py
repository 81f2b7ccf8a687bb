"""Model-level rotary embeddings: the inverse frequencies of a checkpoint and the rotation itself.

Covers the `rope_scaling` types of the Llama family: default, linear, dynamic (NTK), llama3 and yarn; they differ only in
how `inv_freq` (and, for yarn, a cos/sin multiplier) is computed. Rotation uses the "rotate half" layout that HF
checkpoints use (GGUF q/k rows are un-permuted into it at load).

Composition: the rotation angle is `position * inv_freq`, so a key rotated at position p can be moved to position p'
by rotating it again by `p' - p` (`rotate_by`). This is what lets the KV cache store keys rotated at their true
positions while sparse methods attend with other positions.
"""
from __future__ import annotations

import math

import torch

from .config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(rope: RopeConfig, head_dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) fp32, attention_factor) for this checkpoint.

    `seq_len` matters only for `dynamic`: the base grows once the sequence is longer than the trained length.
    """
    dim = head_dim
    if rope.freq_factors is not None:
        return _base_inv_freq(rope.theta, dim) / torch.tensor(rope.freq_factors, dtype=torch.float32), 1.0
    kind = rope.rope_type
    if kind == "default":
        return _base_inv_freq(rope.theta, dim), 1.0
    if kind == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0
    if kind == "dynamic":
        max_pos = rope.original_max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        base = rope.theta * ((rope.factor * seq_len / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if kind == "llama3":
        inv_freq = _base_inv_freq(rope.theta, dim)
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(rope, dim)
    raise AssertionError(kind)  # RopeConfig validated the type


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor, base, orig = rope.factor, rope.theta, rope.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:  # which dimension completes `rotations` turns over `orig` tokens
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 for high-frequency dims (kept), 0 for low-frequency dims (interpolated)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin for a batch of positions, computed on the fly (no table: contexts reach millions of tokens)."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        inv_freq, self.attention_factor = rope_inv_freq(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dynamic = rope.rope_type == "dynamic" and rope.freq_factors is None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None):
        """positions (T,) int -> cos, sin (T, head_dim/2) in `dtype`.

        `max_position` (host int, largest position in the batch) is needed only by dynamic NTK, which, like
        transformers, recomputes the base from the batch's longest sequence.
        """
        inv_freq = self.inv_freq
        if self.dynamic and max_position is not None and max_position + 1 > self.rope.original_max_position_embeddings:
            inv_freq = rope_inv_freq(self.rope, self.head_dim, max_position + 1)[0].to(inv_freq.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2), fp32 as in transformers
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, D) by cos/sin (T, D/2), rotate-half layout; computed in x's dtype like transformers."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
