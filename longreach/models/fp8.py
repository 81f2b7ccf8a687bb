"""fp8 weights (`--quantization fp8`): the decoder's linear layers in float8 e4m3 with a scale per output channel.

Why: a batch-1 decode step reads every weight once; in fp8 that is half the bytes of bf16 (an 8B model: 8 GB instead
of 16 GB), so the step's floor halves (issue 31).

The weights (as vLLM's fp8 and torchao's float8 rowwise):
  w ~ q_w * s_w, q_w = round_e4m3(w / s_w), s_w = amax(|w[n, :]|) / 448 per output channel n (fp32).
The product depends on M, the rows of one call (all the tokens of a step's forward, every sequence together):
  * M <= 16 (GEMV_ROWS; decode steps of up to 16 sequences, and a prefill of at most 16 tokens in all): weight-only,
    W8A16. y = x @ (q_w * s_w)^T (+ bias), the activations as they are (bf16, fp16 or fp32, not quantised),
    accumulated in fp32, returned in x's dtype. On a GPU of compute capability >= 8.9 with Triton:
    kernels/fp8_gemv.py, which reads the e4m3 weights and widens them in registers (CUDA-core products up to 4 rows,
    tensor-core tiles at 5-16; measured speeds against bf16 in that module's docstring);
    elsewhere (CPU, older GPUs) its reference `fp8_gemv_reference` in fp32.
    Why not W8A8 here: at one row, `torch._scaled_mm` was barely faster than the bf16 matmul or slower (H200, eager,
    Llama-8B's four projections: 19.3 / 19.3 / 46.4 / 44.3 us against 15.9 / 17.3 / 58.7 / 33.1), and quantising the
    activations costs several small kernels per call (~60 us eager): the 8B shape decoded at 118.8 tok/s with fp8
    weights against 184.6 in bf16 (4K context, dense).
  * M > 16 (prefill, mixed steps, decode batches of more than 16): W8A8, "rowwise". The input is quantised per row
    (token) at every call, x ~ q_x * s_x, the same way as the weights; y = (q_x @ q_w^T) * s_x * s_w^T (+ bias),
    accumulated in fp32, returned in the input's dtype. On a GPU of compute capability >= 8.9 (with N and K multiples
    of 16): `torch._scaled_mm` (cuBLASLt's rowwise-scaled fp8 GEMM; 1.7x the bf16 matmul's speed at 2,048 rows on an
    H200); elsewhere `reference_fp8_linear`, the same quantised values multiplied in fp32.
Every device follows the same scheme at a given M (CPU and GPU differ only by the order of the fp32 sums and where
the weight scale is applied). A token's activations are therefore quantised in a call of more than 16 rows and not in
a smaller one: a position's logits from a prefill differ slightly from those of a decode step. A captured decode step
runs the scheme of the eager step it replays (graphs are captured at 1, 2, 4, 8 rows and multiples of 16: a batch of
at most 16 sequences is replayed at at most 16 rows). The embeddings, the norms and the LM head stay in the model's
dtype (the head's logits are what sampling reads).
Under tensor parallelism (models/shard.py) the column-parallel layers (qkv_proj, gate_up_proj) hold whole rows of
the weight and see whole activation rows, so their scales are one process's. The row-parallel ones (o_proj,
down_proj) hold a slice of every row's K: their weight scales are maxima over the ranks (one all-reduce per layer at
load) and, in W8A8 calls, so are their inputs' per-token scales (an all-reduce of M floats per call), so each rank
multiplies its slice of one process's quantised values and the sum over the ranks differs from one process's only
by the order of its fp32 sums (tests/test_tensor_parallel.py). vLLM quantises a row-parallel layer's inputs per rank
instead (no collective); we keep TP=N's tokens equal to TP=1's.
What was measured: the CPU tests (tests/test_fp8.py) bound the error against the unquantised layer and the model's
logits and check the GEMV kernel in Triton's interpreter; the GPU kernels' agreement with the references and any
speed figure from tests/gpu/test_fp8.py and scripts/fp8_gemv_sweep.py (kernel times, above); `bench decode
--quantization fp8` has not run end to end with the GEMV yet.
"""
from __future__ import annotations

import torch
from torch import nn

from ..distributed.group import TPGroup
from ..kernels import triton_available
from ..kernels.fp8_gemv import MAX_ROWS, fp8_gemv, fp8_gemv_reference

E4M3_MAX = 448.0
EPS = 1e-12
GEMV_ROWS = MAX_ROWS  # calls of at most this many rows: weight-only (W8A16); more: W8A8 (module docstring)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # models/llama.py's linear layers per block
ROW_PARALLEL = ("o_proj", "down_proj")  # under tensor parallelism each rank holds a slice of their inputs (shard.py)


def quantize_rows(x: torch.Tensor, tp: TPGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) -> (e4m3 values, fp32 scale (..., 1)) with one scale per row: x ~ values * scale. `tp`: x is this
    rank's slice of rows that span every rank's K (a row-parallel layer's weights or inputs): the scale is the
    maximum over the ranks, so each rank's values are its slice of what one process quantises."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    if tp is not None:
        tp.all_reduce_max(amax)
    scale = amax.clamp(min=EPS) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def reference_fp8_linear(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                         tp: TPGroup | None = None) -> torch.Tensor:
    """The W8A8 product in fp32 from the quantised values (any device): `torch._scaled_mm`'s reference. `tp`: a
    row-parallel layer's group (`quantize_rows`)."""
    qx, sx = quantize_rows(x, tp)
    y = (qx.float() * sx) @ (qw.float() * sw).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    """A linear layer with e4m3 weights and one fp32 scale per output channel (module docstring)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 tp: TPGroup | None = None):
        """`tp`: the group of a row-parallel layer split over several ranks (o_proj, down_proj under tensor
        parallelism), whose inputs' per-token scales are then maxima over the ranks (one small all-reduce per call
        of more than GEMV_ROWS rows); None for every other layer."""
        super().__init__()
        self.tp = tp
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)  # (N, K) e4m3, row-major: its .t() is the column-major B of the GEMM
        self.register_buffer("scale", scale)  # (N, 1) fp32
        self.register_buffer("bias", bias)
        fp8_gpu = scaled_mm_supported(qweight.device)
        self._gpu = fp8_gpu and self.in_features % 16 == 0 and self.out_features % 16 == 0  # W8A8: torch._scaled_mm
        self._gemv = fp8_gpu and triton_available()  # W8A16: kernels/fp8_gemv.py (Triton's fp8 needs sm >= 8.9 too)

    @classmethod
    def from_linear(cls, lin: nn.Linear, tp: TPGroup | None = None) -> "Fp8Linear":
        qw, s = quantize_rows(lin.weight.data, tp)
        bias = None if lin.bias is None else lin.bias.data.clone()
        return cls(qw.contiguous(), s, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        m = x2.shape[0]
        if m <= GEMV_ROWS:  # decode: weight-only, the activations as they are
            if self._gemv and m:
                y = fp8_gemv(x2 if x2.stride(-1) == 1 else x2.contiguous(), self.qweight, self.scale, self.bias)
            else:
                y = fp8_gemv_reference(x2, self.qweight, self.scale, self.bias)
        elif self._gpu:
            y = self._scaled_mm(x2)
        else:
            y = reference_fp8_linear(x2, self.qweight, self.scale, self.bias, self.tp)
        return y.reshape(*shape[:-1], self.out_features)

    def _scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """W8A8 on fp8 tensor cores: x2 (M, K) -> (M, N)."""
        m = x2.shape[0]
        pad = -m % 16  # the fp8 GEMM wants every dimension a multiple of 16: pad the rows
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        qx, sx = quantize_rows(x2, self.tp)
        y = torch._scaled_mm(qx, self.qweight.t(), scale_a=sx, scale_b=self.scale.reshape(1, -1), out_dtype=x2.dtype)
        y = y[:m]
        if self.bias is not None:  # added here: not every fp8 GEMM path takes a bias with row-wise scales
            y = y + self.bias.to(x2.dtype)
        return y


def quantize_model_fp8(model: nn.Module, tp: TPGroup | None = None) -> tuple[int, int]:
    """Replace every decoder block's projections (PROJECTIONS) with Fp8Linear, in place. Returns (bytes before, bytes
    after) of this process's replaced weights. `tp`: the model's tensor-parallel group: its row-parallel layers
    (ROW_PARALLEL) take their scales over every rank's inputs, so that each rank holds its slice of one process's
    quantised weights and quantises its inputs as one process would (every rank must call this: it all-reduces)."""
    split = tp is not None and tp.world_size > 1
    before = after = 0
    for block in model.modules():
        for name in PROJECTIONS:
            lin = getattr(block, name, None)
            if isinstance(lin, nn.Linear):
                before += lin.weight.numel() * lin.weight.element_size()
                q = Fp8Linear.from_linear(lin, tp if split and name in ROW_PARALLEL else None)
                after += q.qweight.numel() + q.scale.numel() * 4
                setattr(block, name, q)
    if before == 0:
        raise ValueError("--quantization fp8 found no linear layers to quantise in this model")
    return before, after
