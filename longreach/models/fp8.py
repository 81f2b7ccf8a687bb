"""fp8 weights (`--quantization fp8`): the decoder's linear layers in float8 e4m3 with a scale per output channel.

Why: a batch-1 decode step reads every weight once; in fp8 that is half the bytes of bf16 (an 8B model: 8 GB instead
of 16 GB), so the step's floor halves (issue 31).

The scheme (W8A8, "rowwise", as vLLM's fp8 and torchao's float8 rowwise):
  weight  w ~ q_w * s_w, q_w = round_e4m3(w / s_w), s_w = amax(|w[n, :]|) / 448 per output channel n (fp32);
  input   x ~ q_x * s_x, the same per row (token) of the activations, computed at every call;
  output  y = (q_x @ q_w^T) * s_x * s_w^T (+ bias), accumulated in fp32, returned in the input's dtype.
On a GPU with fp8 tensor cores (compute capability >= 8.9) the product is `torch._scaled_mm` (cuBLASLt / CUTLASS
rowwise-scaled fp8 GEMM); elsewhere (CPU, older GPUs) the same quantised values are multiplied in fp32 by
`reference_fp8_linear`, which is the GPU path's numerics up to the accumulation order, not a different scheme. The
embeddings, the norms and the LM head stay in the model's dtype (the head's logits are what sampling reads).
What was measured: the CPU tests (tests/test_fp8.py) bound the error against the unquantised layer and the model's
logits; the GPU kernel's agreement with the reference and any speed or quality figure come from tests/gpu/test_fp8.py
and `bench decode --quantization fp8` on a GPU.
"""
from __future__ import annotations

import torch
from torch import nn

E4M3_MAX = 448.0
EPS = 1e-12
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # models/llama.py's linear layers per block


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) -> (e4m3 values, fp32 scale (..., 1)) with one scale per row: x ~ values * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=EPS) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def reference_fp8_linear(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The W8A8 product in fp32 from the quantised values (any device): the GPU kernel's reference."""
    qx, sx = quantize_rows(x)
    y = (qx.float() * sx) @ (qw.float() * sw).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    """A linear layer with e4m3 weights and one fp32 scale per output channel (module docstring)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)  # (N, K) e4m3, row-major: its .t() is the column-major B of the GEMM
        self.register_buffer("scale", scale)  # (N, 1) fp32
        self.register_buffer("bias", bias)
        self._gpu = scaled_mm_supported(qweight.device) and self.in_features % 16 == 0 and self.out_features % 16 == 0

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "Fp8Linear":
        qw, s = quantize_rows(lin.weight.data)
        bias = None if lin.bias is None else lin.bias.data.clone()
        return cls(qw.contiguous(), s, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._gpu:
            return reference_fp8_linear(x, self.qweight, self.scale, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        m = x2.shape[0]
        pad = -m % 16  # the fp8 GEMM wants every dimension a multiple of 16: pad the rows (a decode batch is small)
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        qx, sx = quantize_rows(x2)
        y = torch._scaled_mm(qx, self.qweight.t(), scale_a=sx, scale_b=self.scale.reshape(1, -1), out_dtype=x.dtype)
        y = y[:m]
        if self.bias is not None:  # added here: not every fp8 GEMM path takes a bias with row-wise scales
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


def quantize_model_fp8(model: nn.Module) -> tuple[int, int]:
    """Replace every decoder block's projections (PROJECTIONS) with Fp8Linear, in place. Returns (bytes before, bytes
    after) of the replaced weights."""
    before = after = 0
    for block in model.modules():
        for name in PROJECTIONS:
            lin = getattr(block, name, None)
            if isinstance(lin, nn.Linear):
                before += lin.weight.numel() * lin.weight.element_size()
                q = Fp8Linear.from_linear(lin)
                after += q.qweight.numel() + q.scale.numel() * 4
                setattr(block, name, q)
    if before == 0:
        raise ValueError("--quantization fp8 found no linear layers to quantise in this model")
    return before, after
