"""Dequantisation of GGUF tensors to torch, vectorised over blocks.

Own torch code for the common llama.cpp formats (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); any other type that
the `gguf` package can decode (the K-quants, IQ*) goes through its numpy reference, which is slower but exact.
Layouts (ggml-common.h): every block covers 32 weights and starts with an fp16 scale `d`.
  Q8_0: d, int8 q[32]                    -> d * q
  Q4_0: d, u8 qs[16] (two 4-bit q each)  -> d * (q - 8)   (q[j] = low nibble of qs[j], q[j+16] = high nibble)
  Q4_1: d, m, u8 qs[16]                  -> d * q + m
  Q5_0: d, u32 qh, u8 qs[16]             -> d * (q - 16), q = nibble | (bit j of qh) << 4
  Q5_1: d, m, u32 qh, u8 qs[16]          -> d * q + m
"""
from __future__ import annotations

import numpy as np
import torch

# type name -> (bytes per 32-weight block, decoder) for block formats; plain float types handled separately.
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
NATIVE_TYPES = ("F32", "F16", "BF16", *_BLOCK_BYTES)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(nb, 2) uint8 -> (nb, 1) fp32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(nb, 16) uint8 -> (nb, 32) values 0..15, low nibbles first."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(nb, 4) uint8 little-endian u32 -> (nb, 32) bit j of the u32, shifted to 16."""
    bits = (qh[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # (nb, 4, 8): byte i bit k = bit 8i+k
    return bits.reshape(-1, 32) << 4


def _dequant_blocks(kind: str, raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.reshape(-1, _BLOCK_BYTES[kind])
    if kind == "Q8_0":
        return _f16(blocks[:, 0:2]) * blocks[:, 2:].contiguous().view(torch.int8).float()
    if kind == "Q4_0":
        return _f16(blocks[:, 0:2]) * (_nibbles(blocks[:, 2:]).float() - 8)
    if kind == "Q4_1":
        return _f16(blocks[:, 0:2]) * _nibbles(blocks[:, 4:]).float() + _f16(blocks[:, 2:4])
    if kind == "Q5_0":
        q = _nibbles(blocks[:, 6:]) | _high_bits(blocks[:, 2:6])
        return _f16(blocks[:, 0:2]) * (q.float() - 16)
    if kind == "Q5_1":
        q = _nibbles(blocks[:, 8:]) | _high_bits(blocks[:, 4:8])
        return _f16(blocks[:, 0:2]) * q.float() + _f16(blocks[:, 2:4])
    raise AssertionError(kind)


def dequantize(kind: str, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """GGUF tensor payload -> fp32 torch tensor of logical `shape` (outermost dimension first)."""
    if kind == "F32":
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32).copy()).reshape(shape)
    if kind == "F16":
        return torch.from_numpy(np.ascontiguousarray(data).view(np.float16).copy()).float().reshape(shape)
    if kind == "BF16":
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy())
        return raw.view(torch.bfloat16).float().reshape(shape)
    if kind in _BLOCK_BYTES:
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy())
        return _dequant_blocks(kind, raw).reshape(shape)
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType[kind]
        out = gguf.quants.dequantize(np.asarray(data), qtype)
    except (KeyError, NotImplementedError) as e:
        raise ValueError(
            f"unsupported GGUF tensor type {kind}; supported natively: {', '.join(NATIVE_TYPES)}, "
            "plus the types the installed gguf package can dequantise (K-quants, IQ*)"
        ) from e
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)
