"""Moving KV between the host tier and the GPU (KV offloading, kvcache/offload.py): two copy kernels.

* `copy_chunks(src, src_idx, dst, dst_idx)`: dst.view(-1, E)[dst_idx[i]] = src.view(-1, E)[src_idx[i]] for every i
  with src_idx[i] >= 0.
  With src the pinned host tier and dst the GPU pool (installing missed pages) or the prefill staging area (a layer's
  prefix), the kernel reads host memory directly (UVA zero-copy): one launch gathers any number of scattered pages,
  where a CPU gather + copy would stage them first, several times slower for scattered rows (docs/offload.md).
* `scatter_rows(dst, dst_rows, src)`: dst.view(-1, R)[dst_rows[t]] = src[t]: new tokens' K or V written into the
  host tier from the GPU (write-through), graph-capturable, no host sync.
On CPU tensors both run their PyTorch references (plain indexing), which are also what the tests compare against.
Tested: CPU interpreter in fp16/fp32 (tests/test_offload.py); H100/H200 in bf16 and fp8 (tests/gpu/test_offload.py).
"""
from __future__ import annotations

import os

import torch

from . import use_triton
from .fp8 import as_bytes

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


class HostPointer:
    """A pinned host tensor as a kernel argument: Triton reads `data_ptr()` and `dtype`, and under unified virtual
    addressing the host address is valid on the GPU. (Passing the CPU tensor itself trips device checks.)"""

    def __init__(self, t: torch.Tensor):
        if t.device.type != "cpu" or not t.is_pinned():
            raise ValueError("HostPointer needs a pinned CPU tensor")
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def kernel_arg(t: torch.Tensor):
    """`t` as a Triton argument: pinned host tensors through `HostPointer` on a GPU run, as they are otherwise (the
    interpreter reads CPU tensors directly)."""
    if t.device.type == "cpu" and t.is_pinned() and os.environ.get("TRITON_INTERPRET") != "1":
        return HostPointer(t)
    return t


if triton is not None:

    @triton.jit
    def _copy_chunks_kernel(Src, SrcIdx, Dst, DstIdx, E, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        part = tl.program_id(1)
        s = tl.load(SrcIdx + i).to(tl.int64)
        t = tl.load(DstIdx + i).to(tl.int64)
        e = part * BLOCK + tl.arange(0, BLOCK)
        ok = (e < E) & (s >= 0)  # a negative source index: nothing copied (a fixed-width install's unused entries)
        tl.store(Dst + t * E + e, tl.load(Src + s * E + e, mask=ok), mask=ok)

    @triton.jit(do_not_specialize=["n"])  # one compile whatever the count (a 16-multiple or not)
    def _copy_chunks_loop_kernel(Src, SrcIdx, Dst, DstIdx, n, E, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # a fixed grid, each program looping over tiles of ROWS chunks (several host reads in flight per program):
        # a background copy that leaves the other SMs to the decode steps it overlaps
        r0 = tl.arange(0, ROWS)
        e0 = tl.arange(0, BLOCK)
        for start in range(tl.program_id(0) * ROWS, n, tl.num_programs(0) * ROWS):
            r = start + r0
            rok = r < n
            s = tl.load(SrcIdx + r, mask=rok, other=-1).to(tl.int64)
            t = tl.load(DstIdx + r, mask=rok, other=0).to(tl.int64)
            for part in range(0, E, BLOCK):
                e = part + e0
                ok = (s >= 0)[:, None] & (e < E)[None, :]
                x = tl.load(Src + s[:, None] * E + e[None, :], mask=ok)
                tl.store(Dst + t[:, None] * E + e[None, :], x, mask=ok)

    @triton.jit
    def _scatter_rows_kernel(Src, Rows, Dst, R, stride_s, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        part = tl.program_id(1)
        row = tl.load(Rows + t).to(tl.int64)
        e = part * BLOCK + tl.arange(0, BLOCK)
        ok = e < R
        tl.store(Dst + row * R + e, tl.load(Src + t * stride_s + e, mask=ok), mask=ok)


def copy_chunks_reference(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
                          chunk: int) -> None:
    d = dst.view(-1, chunk)
    keep = src_idx >= 0
    s, t = src_idx[keep], dst_idx[keep]
    d[t.to(d.device).long()] = src.view(-1, chunk)[s.to(src.device).long()].to(d.device)


def copy_chunks(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
                chunk: int, programs: int | None = None) -> None:
    """Copy chunks of `chunk` elements: chunk src_idx[i] of src to chunk dst_idx[i] of dst (src, dst contiguous, same
    dtype; the indices int on dst's device). Rows of dst_idx must be distinct where src_idx >= 0; an entry with a
    negative src_idx copies nothing (its dst_idx must still be a valid chunk). `programs`: run on that many programs,
    each looping over the chunks (a background copy beside other work: kvcache/prefetch.py); None: one program per
    chunk (and per 4096 elements of it), the fastest alone."""
    if src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_chunks needs contiguous tensors of one dtype")
    if src.numel() % chunk or dst.numel() % chunk or src_idx.shape != dst_idx.shape:
        raise ValueError(f"bad copy_chunks shapes: {src.numel()} / {dst.numel()} elements, chunk {chunk}, "
                         f"{tuple(src_idx.shape)} / {tuple(dst_idx.shape)} indices")
    n = src_idx.numel()
    if n == 0:
        return
    if not use_triton(dst, interpreter=True):
        return copy_chunks_reference(src, src_idx, dst, dst_idx, chunk)
    block = min(4096, triton.next_power_of_2(chunk))
    if programs is not None:
        if programs < 1:
            raise ValueError(f"copy_chunks needs at least one program, got {programs}")
        rows = max(1, min(8, 16384 // block))  # chunks per tile: ~16K elements in flight per program
        _copy_chunks_loop_kernel[(min(programs, triton.cdiv(n, rows)),)](
            kernel_arg(src), src_idx, kernel_arg(dst), dst_idx, n, chunk, ROWS=rows, BLOCK=block, num_warps=8)
        return
    _copy_chunks_kernel[(n, triton.cdiv(chunk, block))](kernel_arg(src), src_idx, kernel_arg(dst), dst_idx, chunk,
                                                         BLOCK=block, num_warps=4)


def scatter_rows_reference(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    R = src[0].numel() if src.shape[0] else 1
    as_bytes(dst).view(-1, R).index_copy_(0, rows.to(dst.device).long(),
                                          as_bytes(src).reshape(src.shape[0], R).to(dst.device))


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """dst.view(-1, R)[rows[t]] = src[t] (src (T, ...) contiguous per row, R its elements per row; rows int on
    src's device, distinct)."""
    T = src.shape[0]
    if T == 0:
        return
    R = src[0].numel()
    if src.dtype != dst.dtype or not dst.is_contiguous() or dst.numel() % R:
        raise ValueError("scatter_rows needs a contiguous dst of src's dtype and whole rows")
    if not use_triton(src, interpreter=True):
        return scatter_rows_reference(dst, rows, src)
    s = src.reshape(T, R)
    block = min(4096, triton.next_power_of_2(R))
    _scatter_rows_kernel[(T, triton.cdiv(R, block))](s, rows, kernel_arg(dst), R, s.stride(0), BLOCK=block,
                                                      num_warps=4)
