"""Own GGUF dequantisation (models/quant.py) against the gguf package's numpy reference, bit for bit.

Payloads are random bytes (every bit pattern of quants, scales and high bits occurs), with the float scale fields
replaced by random finite values, so a wrong shift, mask, sign or field offset changes some weight."""
import numpy as np
import pytest
import torch

import gguf
from longreach.models import quant
from longreach.models.quant import NATIVE_TYPES, dequantize

# block type -> byte offsets of its fp16 scale fields (ggml-common.h)
_F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
_N_BLOCKS, _ROWS = 384, 3


def _finite_f16_bits(rng, n: int) -> np.ndarray:
    """n random fp16 bit patterns (both signs, zeros, subnormals), none inf or NaN."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    exp_all_ones = (bits & 0x7C00) == 0x7C00
    bits[exp_all_ones] &= 0xFBFF  # exponent 31 -> 30
    return bits


def _random_payload(kind: str, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    """(rows, bytes per row) uint8 payload and its logical (rows, cols) shape, _N_BLOCKS blocks in all."""
    rng = np.random.default_rng(seed)
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (_N_BLOCKS, block_bytes), dtype=np.uint8)
    for off in _F16_FIELDS.get(kind, ()):
        blocks[:, off:off + 2] = _finite_f16_bits(rng, _N_BLOCKS).view(np.uint8).reshape(-1, 2)
    if kind == "Q8_K":  # fp32 d
        blocks[:, 0:4] = rng.standard_normal(_N_BLOCKS).astype(np.float32).view(np.uint8).reshape(-1, 4)
    per_row = _N_BLOCKS // _ROWS
    return blocks.reshape(_ROWS, per_row * block_bytes), (_ROWS, per_row * block)


def _random_floats(kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((_ROWS, 4096)) * np.exp2(rng.uniform(-30, 30, (_ROWS, 4096)))
    return {"F32": x.astype(np.float32), "F16": x.clip(-6e4, 6e4).astype(np.float16),
            "BF16": gguf.quants.quantize(x.astype(np.float32), gguf.GGMLQuantizationType.BF16)}[kind]


def _reference(kind: str, payload: np.ndarray) -> np.ndarray:
    if kind == "Q8_K":  # not in the gguf package: dequantize_row_q8_K is y = d * q
        blocks = payload.reshape(-1, 292)
        return blocks[:, 0:4].copy().view(np.float32) * blocks[:, 4:260].view(np.int8).astype(np.float32)
    return gguf.quants.dequantize(payload, gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", NATIVE_TYPES)
def test_native_dequantize_bit_exact_on_random_blocks(kind, monkeypatch):
    monkeypatch.setattr(quant, "_CHUNK_WEIGHTS", 5000)  # several chunks per tensor, the last one short
    for seed in range(2):
        if kind in ("F32", "F16", "BF16"):
            payload = _random_floats(kind, seed)
            shape = (_ROWS, 4096)
        else:
            payload, shape = _random_payload(kind, seed)
        ref = torch.from_numpy(np.ascontiguousarray(_reference(kind, payload), dtype=np.float32).reshape(shape))
        ours = dequantize(kind, payload, shape)
        assert ours.dtype == torch.float32 and ours.shape == shape
        assert torch.isfinite(ref).all()
        assert torch.equal(ours, ref), f"{kind}: {(ours != ref).sum().item()} of {ref.numel()} weights differ"


@pytest.mark.parametrize("kind", ["F32", "F16", "Q5_0", "Q4_K"])
def test_dequantize_to_bf16_rounds_the_fp32_weights_once(kind):
    payload, shape = (_random_floats(kind, 0), (_ROWS, 4096)) if kind.startswith("F") else _random_payload(kind, 0)
    ours = dequantize(kind, payload, shape, torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, dequantize(kind, payload, shape).to(torch.bfloat16))


def test_native_types_are_decoded_without_the_numpy_reference(monkeypatch):
    """Every type NATIVE_TYPES names has a torch decoder whose block size is ggml's, and never falls back."""
    def no_fallback(*args):
        raise AssertionError("fell back to gguf.quants.dequantize")

    monkeypatch.setattr(gguf.quants, "dequantize", no_fallback)
    assert set(NATIVE_TYPES) == set(_F16_FIELDS) | {"Q8_K", "F32", "F16", "BF16"}
    for kind, (block_bytes, _) in quant._BLOCK_FORMATS.items():
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        assert block_bytes == type_size, kind
        payload, shape = _random_payload(kind, 0)
        assert dequantize(kind, payload, shape).shape == shape


def test_other_types_fall_back_to_the_gguf_reference():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (64, 18), dtype=np.uint8)  # IQ4_NL: fp16 d, 16 bytes of 4-bit codebook indices
    blocks[:, 0:2] = _finite_f16_bits(rng, 64).view(np.uint8).reshape(-1, 2)
    payload = blocks.reshape(2, -1)
    ref = gguf.quants.dequantize(payload, gguf.GGMLQuantizationType.IQ4_NL)
    assert "IQ4_NL" not in NATIVE_TYPES
    assert torch.equal(dequantize("IQ4_NL", payload, (2, 1024)), torch.from_numpy(ref))
