"""Split-K: how many splits a decode launch gets (`split_count`, the one rule every decode path uses), and the merge
of their partial results (flash-decoding's second pass), in one Triton kernel.

Each row has S partial outputs o_s (already normalised within their split) with log-sum-exps l_s; the merged output is
sum_s w_s o_s / sum_s w_s with w_s = exp(l_s - max l), and the merged lse is max l + log sum w. Splits that read no key
carry l_s = -inf and weigh nothing; a row whose splits are all empty gets out 0, lse -inf.
Reference: `combine_splits_reference` (plain torch, below). Tested with the kernels that use it.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 elsewhere: the interpreter's grids follow the H100's)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(programs: int, num_sms: int, most: int) -> int:
    """Splits of a decode launch that runs `programs` programs per split (rows x KV heads or selection groups): enough
    to fill the GPU about twice, at least 1 and at most `most` (the caller's bound: a cap, the tiles a row can read).
    A function of the batch's shape only, so an eager step and its captured graph agree."""
    return max(1, min(most, -(-2 * num_sms // max(1, programs))))


def combine_splits_reference(out_p: torch.Tensor, lse_p: torch.Tensor, dtype: torch.dtype):
    """(..., S, D) partial outputs and (..., S) lse -> (..., D) in `dtype` and (...) lse."""
    m = lse_p.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_p - m)
    denom = w.sum(dim=-1, keepdim=True)
    out = (out_p * w.unsqueeze(-1)).sum(dim=-2) / denom.clamp(min=1e-30)
    return out.to(dtype), (m + denom.log()).squeeze(-1)


# the split count and the rows' outputs change with the step: not specialised (bsa.py's STEP_INTS says why)
STEP_INTS = ("num_splits", "stride_pr", "stride_ps", "stride_lr", "stride_or")
STEP_POINTERS = ("LseP", "Lse")

if triton is not None:

    @triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=STEP_POINTERS)
    def _combine_kernel(OutP, LseP, Out, Lse, num_splits,
                        stride_pr, stride_ps, stride_lr, stride_or,
                        S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        row = tl.program_id(0)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, HEAD_DIM)
        ok = s < num_splits
        lse = tl.load(LseP + row * stride_lr + s, mask=ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m)
        denom = tl.sum(w, axis=0)
        o = tl.load(OutP + row * stride_pr + s[:, None] * stride_ps + d[None, :], mask=ok[:, None], other=0.0)
        merged = tl.sum(o * w[:, None], axis=0) / tl.maximum(denom, 1e-30)
        tl.store(Out + row * stride_or + d, merged.to(Out.dtype.element_ty))
        tl.store(Lse + row, m + tl.log(denom))


def combine_splits_triton(out_p: torch.Tensor, lse_p: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Write the merge of out_p (..., S, D) / lse_p (..., S) into out (..., D) and lse (...), in place."""
    *lead, S, D = out_p.shape
    rows = 1
    for x in lead:
        rows *= x
    op = out_p.reshape(rows, S, D)
    lp = lse_p.reshape(rows, S)
    o = out.view(rows, D)
    ls = lse.view(rows)
    if rows == 0:
        return
    _combine_kernel[(rows,)](op, lp, o, ls, S, op.stride(0), op.stride(1), lp.stride(0), o.stride(0),
                             S_PAD=max(2, triton.next_power_of_2(S)), HEAD_DIM=D, num_warps=4)
