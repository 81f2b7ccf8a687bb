"""Weight-only fp8 GEMV for decode rows (W8A16): y = x @ (q_w * s_w)^T (+ bias), the activations not quantised.

Why: a decode step multiplies a few rows by every weight once, so it is bound by reading the weights; e4m3 halves
those bytes. `torch._scaled_mm` (W8A8) needs the activations quantised at every call (abs, amax, divide, clamp, cast,
pad: several small kernels) and was barely faster than bf16 or slower at one row (H200, Llama-8B's projections:
models/fp8.py).
This kernel reads the e4m3 weights and the activations as they are, by one of two strategies (STRATEGIES; `strategy`
names one; `default_strategy` picks by the number of rows, from the measurements below):

"dot": the grid is (blocks of BLOCK_N output channels, K splits). Each program loads a (BLOCK_N, BLOCK_K) tile of
e4m3 weights once per step along K, widens it in registers to the activations' dtype (exact: every e4m3 value is a
bf16, fp16 and fp32 value), and multiplies it with the (BLOCK_M = 16, BLOCK_K) tile of activations by `tl.dot`
(the rows padded to the MMA's 16 with zeros), accumulating in fp32 as (BLOCK_N, BLOCK_M): the weight tile is the
MMA's long side, "swap AB" as small-batch GEMMs do. Blocks: BLOCK_N = 64 (Hopper's wgmma takes the weight tile as its
64-row A operand from registers), BLOCK_K = 256 (128 for fp32 activations), 4 warps, 4 stages (cp.async pipelining of
both tiles). Compiled for sm_90 with bf16 activations, as launched: 173 registers and 80 KiB of shared memory a
program, so two programs per SM. Measured (H200, one row, CUDA graphs; one run,
`docs/results/gpu-tests-h200-fp8-fma.json`): 1.25-1.91 TB/s of fp8 weights, 0.86-1.05x the bf16 matmul's speed --
far from the ~4 TB/s a weight stream can reach; it is for 5-16 rows (below).
"fma" (no tensor cores; for the memory-bound rows of decode): the same grid, BLOCK_N small (8, or 4 where 8 would
give under two programs per SM) and BLOCK_K large (1024), so that Llama-8B's projections fill the SMs without
splitting K (`launch_config`). Each step
loads a (BLOCK_N, BLOCK_K) weight tile and the (ROWS, BLOCK_K) activations (16-byte vectors; with STAGES > 1 by
cp.async into a ring of shared-memory buffers, `tl.range(num_stages=...)`: Triton pipelines a loop without a dot
only when asked), widens both to fp32 and multiplies them broadcast to (ROWS, BLOCK_N, BLOCK_K); each thread sums its
VEC consecutive products (one 16-byte vector of activations) into an fp32 accumulator (ROWS, BLOCK_N, BLOCK_K / VEC)
in registers, and the sum across threads happens once, after the loop. ROWS = M rounded up to a power of two, a
constexpr (one row, batch-1 decode, compiles to a kernel of its own); more rows shrink the tiles (FMA_PRODUCTS) to
keep the accumulators in registers. Rows past N or M read the last real one (no masks along them) and are never
stored; EVEN_K drops the masks along K. Compiled for sm_90 (bf16, one row, 8 x 1024, 3 stages): 52 registers, 20 KiB
of shared memory, no spills.

Measured (H200, CUDA graphs, L2 flushed, Llama-8B's four projections, the bf16 matmul timed in the same run; the
kernels of 0591eeb):
- `docs/results/gpu-tests-h200-fp8-fma.json` (one run; "fma" with the block rule of then, 4-16 channels a
  program): at one row "fma" 1.76-1.92x the bf16 matmul's speed, "dot" 0.86-1.05x; at 4 rows "fma" 1.05-1.23x,
  "dot" 0.83-1.05x; at 16 rows "fma" 0.38-0.47x (16 products per weight byte on CUDA cores), "dot" 0.84-1.04x.
  Hence FMA_ROWS = 4 (5-8 rows, not measured, go to "dot").
- `docs/results/fp8-gemv-sweep-h200.json` (another run, one row; its JSON's commit field is the device copy's stale
  dc01256): 8 channels a program was the fastest BLOCK_N on every projection, so it is the rule now. Its row "fma
  8x1024 w4 s3", today's default launch: 2.3-3.5 TB/s, 1.77-2.05x bf16, the four projections in 67.7 us against
  130.6. Stages 1-4 at 8 x 1024 differ by at most 10%.

Both: the channel scale multiplies the fp32 sum once per channel (sum_k x q s = s sum_k x q). With one split the
program adds the bias and stores y in x's dtype; with several (`gemv_plan`: splits of K when N alone gives fewer than
about two programs per SM, by `split_count`, the attention decode kernels' rule) each writes fp32 partials and a
second small kernel sums them in a fixed order (deterministic, no atomics: a captured step == eager) and adds the
bias. Block sizes follow fixed rules, not autotuning (compile time; and autotuning cannot run inside a CUDA-graph
capture); `fp8_gemv`'s keywords override them.

Inputs: x (M, K) with M <= 16, bf16/fp16/fp32, unit stride along K; qw (N, K) float8_e4m3fn, row-major; scale (N, 1)
or (N,) fp32; bias (N,) or None. Returns y (M, N) in x's dtype.
Numerics: the products are exact for bf16/fp16 activations (fp32: rounded once) and summed in fp32 (the dot strategy
uses the ieee dot for fp32 activations), so either kernel is the reference `fp8_gemv_reference` up to the order of
the fp32 sum and where the scale is applied.
CUDA graphs: no host sync; the output (and the partials) are allocated with torch.empty; the split count and every
block size are functions of the shapes only.
Limits: Triton's fp8e4nv needs compute capability >= 8.9 (Ada, Hopper); M <= 16.
Tested: CPU interpreter (TRITON_INTERPRET=1) in fp16/fp32 against `fp8_gemv_reference`, both strategies
(tests/test_fp8.py); compiled for sm_90 (scripts/compile_check.py). tests/gpu/test_fp8.py checks both in bf16 at
Llama-8B's projection sizes and under CUDA graphs, and times them beside the bf16 matmul; scripts/fp8_gemv_sweep.py
times a handful of block sizes, warps and stages of each.
"""
from __future__ import annotations

import torch

from .combine import sm_count, split_count

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path never needs Triton
    triton = None

MAX_ROWS = 16  # rows one launch takes: the MMA's smallest M (decode batches beyond it go to the W8A8 GEMM)
STRATEGIES = ("dot", "fma")  # tensor-core tiles, or CUDA-core products summed along K (module docstring)
FMA_ROWS = 4  # fp8_gemv's default strategy: "fma" up to this many rows, "dot" above (measured: module docstring)
FMA_PRODUCTS = 16384  # the fma kernel's rows x BLOCK_N x BLOCK_K at most (its registers: `launch_config`)


def fp8_gemv_reference(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) @ (qw (N, K) e4m3 * scale (N, 1) fp32)^T (+ bias (N,)) in fp32, returned in x's dtype: the weight-only
    product, activations unquantised (any device)."""
    y = x.float() @ (qw.float() * scale.reshape(-1, 1)).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _fp8_gemv_kernel(
        X, W, S, Bias, Y, P,
        M, N, K,
        stride_xm, stride_wn, stride_ym, stride_ps, stride_pm,
        tiles_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
        HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        nmask = n < N
        mmask = m < M
        kk = tl.arange(0, BLOCK_K)
        t_start = split * tiles_per_split
        t_end = tl.minimum(t_start + tiles_per_split, tl.cdiv(K, BLOCK_K))
        w_rows = W + n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1); 64-bit: N * K may pass 2^31 bytes
        x_rows = X + m[:, None] * stride_xm  # (BLOCK_M, 1)

        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for t in range(t_start, t_end):
            k = t * BLOCK_K + kk
            kmask = k < K
            w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
            x = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)

        s = tl.load(S + n, mask=nmask, other=0.0)
        acc = acc * s[:, None]
        out_mask = nmask[:, None] & mmask[None, :]
        if SPLIT:
            tl.store(P + split * stride_ps + m[None, :] * stride_pm + n[:, None], acc, mask=out_mask)
        else:
            if HAS_BIAS:
                acc += tl.load(Bias + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
            tl.store(Y + m[None, :] * stride_ym + n[:, None], acc.to(Y.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _fp8_gemv_reduce_kernel(
        P, Bias, Y,
        N, num_splits,
        stride_ps, stride_pm, stride_ym,
        BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        row = tl.program_id(0)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nmask = n < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(num_splits):  # in order: the same sum at every call
            acc += tl.load(P + s * stride_ps + row * stride_pm + n, mask=nmask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_ym + n, acc.to(Y.dtype.element_ty), mask=nmask)

    @triton.jit
    def _fp8_gemv_fma_kernel(
        X, W, S, Bias, Y, P,
        M, N, K,
        stride_xm, stride_wn, stride_ym, stride_ps, stride_pm,
        tiles_per_split,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr,
        EVEN_K: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, ROWS)
        kk = tl.arange(0, BLOCK_K)
        n_in = tl.minimum(n, N - 1)  # rows past N (and M) read the last real one: no masks along N; never stored
        m_in = tl.minimum(m, M - 1)
        w_ptrs = W + n_in.to(tl.int64)[None, :, None] * stride_wn + kk[None, None, :]  # (1, BLOCK_N, BLOCK_K)
        x_ptrs = X + m_in[:, None, None] * stride_xm + kk[None, None, :]  # (ROWS, 1, BLOCK_K)
        t_start = split * tiles_per_split
        t_end = tl.minimum(t_start + tiles_per_split, tl.cdiv(K, BLOCK_K))
        # each thread's VEC consecutive products are summed in registers every step; the sum across threads once
        acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        for t in tl.range(t_start, t_end, num_stages=STAGES):  # STAGES > 1: cp.async ring (no dot: Triton's default 1)
            k = t * BLOCK_K
            if EVEN_K:
                w = tl.load(w_ptrs + k)
                x = tl.load(x_ptrs + k)
            else:
                kmask = (k + kk < K)[None, None, :]
                w = tl.load(w_ptrs + k, mask=kmask, other=0.0)
                x = tl.load(x_ptrs + k, mask=kmask, other=0.0)
            prod = w.to(tl.float32) * x.to(tl.float32)  # (ROWS, BLOCK_N, BLOCK_K)
            acc += tl.sum(tl.reshape(prod, [ROWS, BLOCK_N, BLOCK_K // VEC, VEC]), axis=3)
        y = tl.sum(acc, axis=2) * tl.load(S + n_in)[None, :]  # (ROWS, BLOCK_N)
        out_mask = (m < M)[:, None] & (n < N)[None, :]
        if SPLIT:
            tl.store(P + split * stride_ps + m[:, None] * stride_pm + n[None, :], y, mask=out_mask)
        else:
            if HAS_BIAS:
                y += tl.load(Bias + n_in).to(tl.float32)[None, :]
            tl.store(Y + m[:, None] * stride_ym + n[None, :], y.to(Y.dtype.element_ty), mask=out_mask)


def gemv_plan(N: int, K: int, device: torch.device, block_n: int, block_k: int,
              splits: int | None = None) -> tuple[int, int]:
    """(splits, tiles per split) of an (N, K) weight: by default splits of K when N alone gives fewer than ~2
    programs per SM (`split_count`; Llama-8B's o_proj and down_proj: N = 4096, 64 blocks of 64), every split at least
    one tile of K and none empty."""
    tiles = -(-K // block_k)
    if splits is None:
        splits = split_count(-(-N // block_n), sm_count(device), tiles)
    per = -(-tiles // max(1, min(splits, tiles)))
    return -(-tiles // per), per


def default_strategy(rows: int) -> str:
    """The faster strategy at this many rows on an H200 (module docstring): "fma" up to FMA_ROWS, "dot" above."""
    return "fma" if rows <= FMA_ROWS else "dot"


def launch_config(strategy: str, M: int, N: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The block sizes, warps and pipeline depth of a launch whose caller names none (module docstring's rules)."""
    if strategy == "dot":
        return dict(block_n=64, block_k=128 if dtype == torch.float32 else 256, num_warps=4, num_stages=4)
    rows = triton.next_power_of_2(M) if triton is not None else M
    sms = sm_count(device)
    block_n = 8 if -(-N // 8) >= 2 * sms else 4  # >= 2 programs per SM without splitting K (the sweep's best: 8)
    block_k = 1024  # a 16-byte vector of activations per thread and row across 4 warps (8 bf16; fp32: two of 4)
    while rows * block_n * block_k > FMA_PRODUCTS and block_k > 256:  # more rows: the accumulators take registers
        block_k //= 2
    while rows * block_n * block_k > FMA_PRODUCTS and block_n > 4:
        block_n //= 2
    return dict(block_n=block_n, block_k=block_k, num_warps=4, num_stages=3)


def fp8_gemv(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
             strategy: str | None = None, block_n: int | None = None, block_k: int | None = None,
             num_warps: int | None = None, num_stages: int | None = None, splits: int | None = None,
             out: torch.Tensor | None = None, partials: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), M <= MAX_ROWS -> (M, N) in x's dtype (module docstring). strategy: "dot" or "fma"
    (`default_strategy(M)` by default); block_n, block_k, num_warps, num_stages: `launch_config`'s where not given (tests and
    scripts/fp8_gemv_sweep.py name them); splits: `gemv_plan`'s by default. `out` and `partials` (tests):
    preallocated (M, N) in x's dtype and (splits, M, N) fp32 buffers, e.g. poisoned with NaN."""
    if triton is None:
        raise RuntimeError("fp8_gemv needs Triton; use fp8_gemv_reference on CPU")
    strategy = strategy or default_strategy(x.shape[0])
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown fp8_gemv strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    if x.dim() != 2 or qw.dim() != 2 or x.shape[1] != qw.shape[1]:
        raise ValueError(f"x (M, K) and qw (N, K) expected, got {tuple(x.shape)} and {tuple(qw.shape)}")
    M, K = x.shape
    N = qw.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"fp8_gemv takes 1 to {MAX_ROWS} rows, got {M}")
    if qw.dtype != torch.float8_e4m3fn or qw.stride(1) != 1:
        raise ValueError(f"qw must be float8_e4m3fn with unit stride along K, got {qw.dtype}, strides {qw.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.stride(1) != 1:
        raise ValueError(f"x must be bf16/fp16/fp32 with unit stride along K, got {x.dtype}, strides {x.stride()}")
    if scale.dtype != torch.float32 or scale.numel() != N or not scale.is_contiguous():
        raise ValueError(f"scale must be {N} contiguous fp32 values (one per output channel)")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({N},) tensor, got {tuple(bias.shape)}")
    if any(t.device != x.device for t in (qw, scale) + ((bias,) if bias is not None else ())):
        raise ValueError("x, qw, scale and bias must be on one device")
    cfg = launch_config(strategy, M, N, x.dtype, x.device)
    block_n, block_k = block_n or cfg["block_n"], block_k or cfg["block_k"]
    num_warps, num_stages = num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
    vec = 16 // x.element_size()  # activations per 16-byte load
    if any(b & (b - 1) for b in (block_n, block_k)) or block_k < vec:
        raise ValueError(f"block_n and block_k must be powers of two (block_k >= {vec}), got {block_n}, {block_k}")
    sp, per = gemv_plan(N, K, x.device, block_n, block_k, splits)
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if y.shape != (M, N) or y.dtype != x.dtype or y.stride(1) != 1:
        raise ValueError(f"out must be ({M}, {N}) {x.dtype} with unit stride along N")
    p = y  # the partials: unused with one split
    if sp > 1:
        p = partials if partials is not None else torch.empty(sp, M, N, dtype=torch.float32, device=x.device)
        if p.shape != (sp, M, N) or p.dtype != torch.float32 or p.stride(2) != 1:
            raise ValueError(f"partials must be ({sp}, {M}, {N}) fp32 with unit stride along N")
    args = (x, qw, scale, bias if bias is not None else scale, y, p,
            M, N, K,
            x.stride(0), qw.stride(0), y.stride(0), p.stride(0), p.stride(1),
            per)
    grid = (triton.cdiv(N, block_n), sp)
    if strategy == "dot":
        _fp8_gemv_kernel[grid](
            *args,
            BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=sp > 1, HAS_BIAS=bias is not None,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=num_warps, num_stages=num_stages,
        )
    else:
        _fp8_gemv_fma_kernel[grid](
            *args,
            ROWS=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, VEC=vec, STAGES=num_stages,
            EVEN_K=K % block_k == 0, SPLIT=sp > 1, HAS_BIAS=bias is not None,
            num_warps=num_warps,
        )
    if sp > 1:
        block = min(1024, triton.next_power_of_2(N))
        _fp8_gemv_reduce_kernel[(M, triton.cdiv(N, block))](
            p, bias if bias is not None else scale, y,
            N, sp,
            p.stride(0), p.stride(1), y.stride(0),
            BLOCK=block, HAS_BIAS=bias is not None,
            num_warps=4,
        )
    return y
