"""fp8 (e4m3) KV cache: one fp32 scale per token and KV head, stored in the row itself.

Format: a cache row (one token, one KV head) of head_dim D holds D e4m3 values followed by 16 bytes whose first 4 are
the row's fp32 scale (the rest is padding): row width D + 16 bytes. value = e4m3 * scale, scale = max|x| / 448 of the
row (448: e4m3's largest finite value), so no value saturates and every row uses the whole exponent range.

Decisions (--kv-cache-dtype fp8):
  * **Granularity: per token and KV head.** A per-tensor scale (vLLM's default is 1.0 unless calibrated) needs
    calibration data or risks overflow (e4m3 has no infinity: Qwen-style key outliers of several hundred would
    saturate) and loses small values to subnormals; per-token scales are computed when the token is written, need
    no state and cost 4 bytes per 128-value row. Measured on SmolLM2 in docs/quality.md.
  * **The scale lives in the row** rather than in a parallel tensor: every page is one block of bytes, so the two-tier
    store, its copy kernels and the staging area move fp8 pages exactly as bf16 pages, and a kernel finds the scale
    with the pointer it already has (paged.py: load_kv). 16 bytes keep rows 16-byte aligned, so the value
    loads stay full-width: 12.5% more bytes than bare e4m3 at head_dim 128 (25% at 64), 1.78x (1.6x) fewer than
    bf16.
  * Queries, the attention math and the outputs stay in the run dtype: kernels dequantise on load.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PAD = 16  # bytes after the values of a row: the fp32 scale and 12 bytes of padding


def row_width(head_dim: int) -> int:
    return head_dim + PAD


def quantize(x: torch.Tensor) -> torch.Tensor:
    """(..., D) values -> (..., D + 16) fp8 rows with their scales (no host sync; graph-capturable)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    q = (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(torch.uint8)
    tail = torch.zeros(*x.shape[:-1], PAD, dtype=torch.uint8, device=x.device)
    tail[..., :4] = scale.view(torch.uint8)
    return torch.cat([q, tail], dim=-1).view(FP8)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., D + 16) fp8 rows -> (..., D) values in `dtype`."""
    D = rows.shape[-1] - PAD
    b = rows.view(torch.uint8)
    scale = b[..., D:D + 4].contiguous().view(torch.float32)  # (..., 1)
    return (rows[..., :D].float() * scale).to(dtype)


def values(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache tensor (…, row) as plain values for reference code: fp8 rows dequantised, anything else as it is."""
    return dequantize(cache, dtype) if cache.dtype == FP8 else cache


def row_elems(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row (a token's K or V for one KV head) in a cache of `dtype`."""
    return row_width(head_dim) if dtype == FP8 else head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    return row_elems(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New K or V (..., D) as the cache stores it: fp8 rows with scales, or cast to the cache dtype."""
    return quantize(x) if dtype == FP8 else x.to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 for plain copies (index_copy_ has no fp8 kernel on CPU); others unchanged."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
