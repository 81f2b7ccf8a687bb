"""Dequantisation of GGUF tensors to torch, vectorised over blocks.

Own torch code for the float types and the llama.cpp block formats below, bit-exact with the `gguf` package's numpy
reference; any other type that package can decode (IQ*, TQ*, MXFP4) goes through that reference, which is slower.
Layouts (ggml-common.h; fields in storage order, `d`/`dmin` fp16 unless said, "b:i" = bits i.. of a byte):
  32-weight blocks
  Q8_0: d, int8 q[32]                    -> d * q
  Q4_0: d, u8 qs[16] (two 4-bit q each)  -> d * (q - 8)   (q[j] = low nibble of qs[j], q[j+16] = high nibble)
  Q4_1: d, m, u8 qs[16]                  -> d * q + m
  Q5_0: d, u32 qh, u8 qs[16]             -> d * (q - 16), q = nibble | (bit j of qh) << 4
  Q5_1: d, m, u32 qh, u8 qs[16]          -> d * q + m
  256-weight super-blocks, split into sub-blocks that each have a scale (and a min)
  Q2_K: u8 scales[16] (b:0 scale, b:4 min), qs[64], d, dmin      -> 16 x 16: d * sc * q - dmin * m, q 2-bit
  Q3_K: u8 hmask[32], qs[64], scales[12] (16 x 6 bit), d          -> 16 x 16: d * (sc - 32) * (q - 4), q 3-bit
  Q4_K: d, dmin, scales[12] (8 scales + 8 mins, 6 bit), qs[128]   -> 8 x 32: d * sc * q - dmin * m, q 4-bit
  Q5_K: d, dmin, scales[12], qh[32], qs[128]                      -> 8 x 32: as Q4_K, q 5-bit
  Q6_K: ql[128], qh[64], int8 scales[16], d                       -> 16 x 16: d * sc * (q - 32), q 6-bit
  Q8_K: fp32 d, int8 q[256], int16 bsums[16] (unused here)       -> d * q
Where the bits of q sit: 2-bit fields of a 32-byte run (Q2_K, Q3_K low bits, Q6_K high bits) give 4 consecutive runs
of 32 weights (b:0, b:2, b:4, b:6); nibbles of a run give 2 (b:0 then b:4); a bit plane (Q3_K hmask, Q5_K qh) gives
bit i to run i. The 6-bit K scales keep their low bits in the first bytes and their top 2 bits in spare high bits.
"""
from __future__ import annotations

import numpy as np
import torch


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(nb, 2) uint8 -> (nb, 1) fp32."""
    return b.contiguous().view(torch.float16).float()


def _unpack(x: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) uint8 -> (..., 8 // bits, n): field i holds bits [i * bits, (i + 1) * bits) of each byte."""
    x = x.contiguous()  # scalar shifts of a contiguous tensor vectorise; a broadcast shift tensor does not
    mask = (1 << bits) - 1
    fields = [x & mask] + [(x >> shift) & mask for shift in range(bits, 8 - bits, bits)] + [x >> (8 - bits)]
    return torch.stack(fields, dim=-2)


def _scaled(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """q (nb, G, n) integers, scale / offset (nb, G) fp32 -> (nb, G * n) fp32 scale * q - offset, rounded like the
    reference (the product, then the difference)."""
    out = q.float().mul_(scale.unsqueeze(-1))
    if offset is not None:
        out.sub_(offset.unsqueeze(-1))
    return out.reshape(q.shape[0], -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(nb, 16) uint8 -> (nb, 32): low nibbles, then high nibbles."""
    return _unpack(qs, 4).reshape(-1, 32)


# byte -> its 8 bits, bit k moved to bit 4 of byte k of an int64: indexing with a u32's 4 bytes gives 32 bytes
_BIT4_OF_BYTE = torch.tensor([sum(((v >> k) & 1) << (8 * k + 4) for k in range(8)) for v in range(256)])


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """(nb, 4) uint8, a little-endian u32 -> (nb, 32) uint8: bit j of the u32, shifted to 16."""
    return _BIT4_OF_BYTE.index_select(0, qh.reshape(-1).long()).view(torch.uint8).view(-1, 32)


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(b[:, 0:2]))


def _q4_0(b):
    return (_nibbles(b[:, 2:]).view(torch.int8) - 8).float().mul_(_f16(b[:, 0:2]))


def _q4_1(b):
    return _nibbles(b[:, 4:]).float().mul_(_f16(b[:, 0:2])).add_(_f16(b[:, 2:4]))


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | _q5_high(b[:, 2:6])
    return (q.view(torch.int8) - 16).float().mul_(_f16(b[:, 0:2]))


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | _q5_high(b[:, 4:8])
    return q.float().mul_(_f16(b[:, 0:2])).add_(_f16(b[:, 2:4]))


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """(nb, 64) uint8 -> (nb, 256) 2-bit values: each 32-byte half gives 4 runs of 32 (b:0, b:2, b:4, b:6)."""
    return _unpack(qs.reshape(-1, 2, 32), 2).reshape(-1, 256)


def _q2_k(b):
    sc, d, dmin = b[:, 0:16], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = _crumbs(b[:, 16:80]).reshape(-1, 16, 16)
    return _scaled(q, d * (sc & 15).float(), dmin * (sc >> 4).float())


def _q3_k(b):
    s = b[:, 96:108]  # scale i: low 4 bits from nibble (i // 8) of byte i % 8, top 2 from b:2(i // 4) of byte 8 + i % 4
    sc = _unpack(s[:, 0:8], 4).reshape(-1, 16) | _unpack(s[:, 8:12], 2).reshape(-1, 16) << 4
    q = _crumbs(b[:, 32:96]) | _unpack(b[:, 0:32], 1).reshape(-1, 256) << 2  # hmask bit set: no -4 offset
    return _scaled(q.view(torch.int8).reshape(-1, 16, 16) - 4, _f16(b[:, 108:110]) * (sc.float() - 32))


def _scales_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K (nb, 12) uint8 -> 8 scales, 8 mins (nb, 8) fp32. Bytes 0-3: scales 0-3 (b:0) + top bits of
    scales 4-7 (b:6); bytes 4-7: mins likewise; bytes 8-11: low nibbles of scales 4-7 (b:0) and mins 4-7 (b:4)."""
    a, m, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((a & 63, (c & 15) | (a >> 6) << 4), dim=1)
    mn = torch.cat((m & 63, (c >> 4) | (m >> 6) << 4), dim=1)
    return sc.float(), mn.float()


def _q4_k(b):
    sc, mn = _scales_k4(b[:, 4:16])
    q = _unpack(b[:, 16:144].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    return _scaled(q, _f16(b[:, 0:2]) * sc, _f16(b[:, 2:4]) * mn)


def _q5_k(b):
    sc, mn = _scales_k4(b[:, 4:16])
    q = _unpack(b[:, 48:176].reshape(-1, 4, 32), 4).reshape(-1, 8, 32) | _unpack(b[:, 16:48], 1) << 4
    return _scaled(q, _f16(b[:, 0:2]) * sc, _f16(b[:, 2:4]) * mn)


def _q6_k(b):
    low = _unpack(b[:, 0:128].reshape(-1, 2, 64), 4).reshape(-1, 256)  # per 128-weight half: 64 b:0 then 64 b:4
    high = _unpack(b[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, 256)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    return _scaled((low | high << 4).view(torch.int8).reshape(-1, 16, 16) - 32, _f16(b[:, 208:210]) * sc)


def _q8_k(b):
    return b[:, 4:260].contiguous().view(torch.int8).float().mul_(b[:, 0:4].contiguous().view(torch.float32))


# type name -> (bytes per block, decoder: (n_blocks, bytes) uint8 -> (n_blocks, weights) fp32)
_BLOCK_FORMATS = {
    "Q8_0": (34, _q8_0),
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
    "Q5_0": (22, _q5_0),
    "Q5_1": (24, _q5_1),
    "Q2_K": (84, _q2_k),
    "Q3_K": (110, _q3_k),
    "Q4_K": (144, _q4_k),
    "Q5_K": (176, _q5_k),
    "Q6_K": (210, _q6_k),
    "Q8_K": (292, _q8_k),
}
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
NATIVE_TYPES = (*_FLOAT_TYPES, *_BLOCK_FORMATS)
# Weights decoded at a time: below torch's intra-op grain (32768 elements), so each op of a chunk runs on one thread
# (no thread barrier per op, which costs milliseconds when other processes hold the cores) and stays in L2.
_CHUNK_WEIGHTS = 32000


def _bytes(data: np.ndarray) -> torch.Tensor:
    """Any numpy payload -> flat uint8 tensor over the same memory (copied only when numpy marks it read-only)."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return torch.from_numpy(raw if raw.flags.writeable else raw.copy())


def dequantize(kind: str, data: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGUF tensor payload -> torch tensor of logical `shape` (outermost dimension first) in `dtype`, each weight
    computed in fp32 and rounded once. An F32 payload read as fp32 comes back as a view of `data` (no copy)."""
    if kind in _FLOAT_TYPES:
        return _bytes(data).view(_FLOAT_TYPES[kind]).to(dtype).reshape(shape)
    if kind in _BLOCK_FORMATS:
        block_bytes, decode = _BLOCK_FORMATS[kind]
        blocks = _bytes(data).view(-1, block_bytes)
        out = torch.empty(shape, dtype=dtype).view(blocks.shape[0], -1)  # (blocks, weights per block)
        step = max(1, _CHUNK_WEIGHTS // out.shape[1])
        for i in range(0, len(blocks), step):
            out[i:i + step] = decode(blocks[i:i + step])
        return out.view(shape)
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType[kind]
        out = gguf.quants.dequantize(np.asarray(data), qtype)
    except (KeyError, NotImplementedError) as e:
        raise ValueError(
            f"unsupported GGUF tensor type {kind}; supported natively: {', '.join(NATIVE_TYPES)}, "
            "plus the types the installed gguf package can dequantise (IQ*, TQ*)"
        ) from e
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(dtype).reshape(shape)
