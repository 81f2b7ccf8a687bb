"""The model's small per-layer operations as one kernel each: residual add + RMSNorm, RoPE on q and k, SiLU * up.

Why: in a captured decode step every PyTorch elementwise op is its own kernel. RMSNorm as written
(`x.float()`, `pow`, `mean`, `+ eps`, `rsqrt`, `*`, `.to()`, `* weight`) is ~8 launches, the residual add before it
one more, rotary ~7 per tensor, SiLU and the product 2: ~33 tiny kernels per layer, ~1,050 per step of a 32-layer
model, each a few microseconds however little it does. These three kernels do the same work in 4 launches per layer
(docs/kernel-notes.md v10 has the prediction).

Numerics follow the PyTorch code they replace (models/llama.py, rope/scaling.py), which follows transformers:
  * `add_rms_norm`: the residual sum is rounded to the activation dtype (as `x + residual` in that dtype), the norm is
    computed in fp32 on the rounded sum, cast to the dtype, then multiplied by the weight and rounded again. The only
    difference from PyTorch is the order of the fp32 sum of squares (and rsqrt's last bit): bf16 results differ by
    at most one unit in the last place, rarely.
  * `rope_qk`: every product, difference and sum is rounded to the dtype as PyTorch's elementwise ops do; bit-exact.
    The kernel is compiled without FMA contraction (`enable_fp_fusion=False`): with it, the result can differ
    from PyTorch by many units (0.0156 seen) where x1*c and x2*s nearly cancel (the product fused into the
    difference, unrounded).
  * `silu_mul`: SiLU in fp32 rounded to the dtype, then the product rounded; the exponential is Triton's, so a result
    may differ from PyTorch's by one unit in the last place.
On CPU (and anywhere Triton is missing) the same functions run the PyTorch references, the code the kernels replace.
Tested: the interpreter in fp32/fp16 (tests/test_fused.py); GPU bf16 at Llama-8B sizes
(tests/gpu/test_kernels.py, on a GPU).
"""
from __future__ import annotations

import torch

from . import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def _on_kernels(x: torch.Tensor, kernel: bool | None) -> bool:
    """Run the Triton kernel? By default on CUDA tensors only; `kernel=True` forces it (the interpreter tests)."""
    if kernel is None:
        return use_triton(x)
    return kernel and use_triton(x, interpreter=True)


# ---- references (the model's PyTorch code) ----------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = residual + x
    return rms_norm_reference(s, weight, eps), s


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos/sin (T, D/2), rotate-half layout, in x's dtype: the model's `apply_rope`."""
    from ..rope.scaling import apply_rope

    return apply_rope(x, cos, sin)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(X, R, W, Out, ResOut, N, stride_x, stride_r, stride_o, stride_ro, eps,
                             HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
            x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # the sum rounded, as `residual + x`
            tl.store(ResOut + row * stride_ro + cols, x, mask=ok)
        x32 = x.to(tl.float32)
        var = tl.sum(x32 * x32, axis=0) / N
        y = (x32 / tl.sqrt(var + eps)).to(x.dtype)
        w = tl.load(W + cols, mask=ok, other=0.0)
        tl.store(Out + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_kernel(X, Cos, Sin, stride_xt, stride_xh, stride_c, HALF: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (token, head); rotates the row in place
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, BLOCK)
        ok = d < HALF
        base = X + t * stride_xt + h * stride_xh
        x1 = tl.load(base + d, mask=ok, other=0.0)
        x2 = tl.load(base + HALF + d, mask=ok, other=0.0)
        dt = x1.dtype
        c = tl.load(Cos + t * stride_c + d, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(Sin + t * stride_c + d, mask=ok, other=0.0).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        # each product, difference and sum rounded to the dtype, as PyTorch's elementwise ops in that dtype
        o1 = ((a * c).to(dt).to(tl.float32) - (b * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32)).to(dt)
        tl.store(base + d, o1, mask=ok)
        tl.store(base + HALF + d, o2, mask=ok)

    @triton.jit
    def _silu_mul_kernel(GU, Out, N, stride_g, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        g = tl.load(GU + row * stride_g + cols, mask=ok, other=0.0)
        u = tl.load(GU + row * stride_g + N + cols, mask=ok, other=0.0)
        g32 = g.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)
        tl.store(Out + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def _rows(x: torch.Tensor) -> bool:
    """A (T, N) tensor whose rows are contiguous (any row stride): what the row kernels take."""
    return x.dim() == 2 and x.stride(-1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel: bool | None = None) -> torch.Tensor:
    """RMSNorm of the rows of x (T, N) -> (T, N) in x's dtype (one kernel on a GPU)."""
    if not (_on_kernels(x, kernel) and _rows(x)) or x.shape[0] == 0:
        return rms_norm_reference(x, weight, eps)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    N = x.shape[1]
    _add_rms_norm_kernel[(x.shape[0],)](x, x, weight, out, out, N, x.stride(0), 0, out.stride(0), 0, eps,
                                        HAS_RES=False, BLOCK=triton.next_power_of_2(N))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) for x, residual (T, N) (one kernel on a GPU)."""
    if not (_on_kernels(x, kernel) and _rows(x) and _rows(residual)) or x.shape[0] == 0 or x.dtype != residual.dtype:
        return add_rms_norm_reference(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res = torch.empty_like(x)
    N = x.shape[1]
    _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, res, N, x.stride(0), residual.stride(0),
                                        out.stride(0), res.stride(0), eps, HAS_RES=True,
                                        BLOCK=triton.next_power_of_2(N))
    return out, res


def rope_qk_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """Rotate the heads of qk (T, H, D) in place (q and k heads side by side in the projection's output) by cos/sin
    (T, D/2); returns qk. One kernel on a GPU; the reference, written back, elsewhere."""
    T, H, D = qk.shape
    if not _on_kernels(qk, kernel) or qk.stride(-1) != 1 or cos.stride(-1) != 1 or T == 0:
        qk.copy_(rope_reference(qk, cos, sin))
        return qk
    half = D // 2
    # no FMA contraction: fused into the difference, a*c would skip the rounding PyTorch gives every product, and
    # where the two products nearly cancel the result then differs by many units (0.0156 seen on a GPU)
    _rope_kernel[(T, H)](qk, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0), HALF=half,
                         BLOCK=triton.next_power_of_2(half), enable_fp_fusion=False)
    return qk


def silu_mul(gate_up: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """SiLU(gate) * up for gate_up (T, 2I) = [gate | up] -> (T, I) (one kernel on a GPU)."""
    if not (_on_kernels(gate_up, kernel) and _rows(gate_up)) or gate_up.shape[0] == 0:
        return silu_mul_reference(gate_up)
    T, two = gate_up.shape
    N = two // 2
    out = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(N, BLOCK))](gate_up, out, N, gate_up.stride(0), out.stride(0), BLOCK=BLOCK)
    return out
