"""Paged decode attention (one query token per sequence), flash-decoding style, in Triton.

Algorithm: the grid is (sequence, KV head, split). Each program owns one KV head and the GQA group of query heads
that share it, so every key/value tile is loaded once per group; it walks its share of the sequence's tokens in tiles
of BLOCK_N (translating token -> page through the block table), keeps an online softmax, and writes a partial output
and its log-sum-exp. A second, tiny kernel (combine.py) merges the splits.
Splitting the key range keeps all SMs busy at batch 1 with long contexts (FlashDecoding).

Inputs: q (B, H_q, D); k_cache/v_cache (num_pages, page_size, H_kv, D); block_tables (B, max_pages) int32;
seq_lens (B,) int32. Returns out (B, H_q, D) in q's dtype and lse (B, H_q) fp32 (natural log).
Limits: head_dim a power of two in [16, 256]; GQA group <= 64. Shapes are static for a given batch size and
num_splits, so the launch can be captured in a CUDA graph (sequence lengths are read on the device).
Tested: CPU interpreter (TRITON_INTERPRET=1) in fp16/fp32 against `paged_decode_reference`; H100 in bf16
(tests/gpu/test_kernels.py).
"""
from __future__ import annotations

import math

import torch

from .combine import combine_splits_triton, split_count
from .kv_layout import as_tensor

try:
    import triton
    import triton.language as tl

    from .paged import kv_args, load_kv, page_slots, row_base
    from .softmax import online_softmax_finish, online_softmax_step
except ImportError:  # the CPU path never needs Triton
    triton = None


def paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Plain PyTorch (fp32 math) equivalent of `paged_decode`: gathers every sequence's pages and masks the tail."""
    k_cache, v_cache = as_tensor(k_cache, q.dtype), as_tensor(v_cache, q.dtype)
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    n_pages = block_tables.shape[1]
    idx = block_tables.long()
    valid = torch.arange(n_pages * page, device=q.device)[None, :] < seq_lens[:, None].long()  # (B, N)
    # slots past a sequence's end hold whatever the cache had (possibly NaN): zero them, 0 * NaN would poison the sum
    k = k_cache[idx].reshape(B, n_pages * page, Hkv, D).float().masked_fill(~valid[..., None, None], 0.0)
    v = v_cache[idx].reshape(B, n_pages * page, Hkv, D).float().masked_fill(~valid[..., None, None], 0.0)
    qg = q.float().view(B, Hkv, G, D)
    s = torch.einsum("bhgd,bnhd->bhgn", qg, k) * scale  # (B, H_kv, G, N)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhgn,bnhd->bhgd", torch.softmax(s, dim=-1), v)
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        Q, K, V, KH, VH, Slots, BlockTables, SeqLens, OutPartial, LsePartial,
        stride_qb, stride_qh,
        stride_kp, stride_ko, stride_kh,
        stride_vp, stride_vo, stride_vh,
        stride_khp, stride_vhp,
        stride_btb,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        qk_scale,  # softmax scale * log2(e): exponentials are taken in base 2
        num_splits,  # a runtime value: one compiled kernel serves every batch size
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, TIERED: tl.constexpr,
        FP8: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(SeqLens + b)
        num_tiles = tl.cdiv(seq_len, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        t_start = split * tiles_per_split
        t_end = tl.minimum(t_start + tiles_per_split, num_tiles)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        gmask = g < GROUP
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for t in range(t_start, t_end):
            n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < seq_len
            page = tl.load(BlockTables + b * stride_btb + n // PAGE, mask=nmask, other=0).to(tl.int64)
            off = n % PAGE
            slot = page_slots(Slots, page, kvh, TIERED)
            kb = row_base(K, KH, page, slot, kvh, stride_kp, stride_khp, stride_kh, PAGE, TIERED)
            k = load_kv(kb, off, kvh, stride_ko, stride_kh, d,
                        nmask, HEAD_DIM, FP8).to(q.dtype)
            vb = row_base(V, VH, page, slot, kvh, stride_vp, stride_vhp, stride_vh, PAGE, TIERED)
            v = load_kv(vb, off, kvh, stride_vo, stride_vh, d,
                        nmask, HEAD_DIM, FP8).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (GROUP_PAD, BLOCK_N), log2 units
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

        out, lse = online_softmax_finish(m_i, l_i, acc)
        tl.store(OutPartial + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
                 mask=gmask[:, None])
        tl.store(LsePartial + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)


def default_num_splits(batch: int, num_kv_heads: int, max_len: int, block_n: int = 64, num_sms: int = 132) -> int:
    """Enough programs to fill the GPU about twice (kernels/combine.py: split_count), never more splits than tiles of
    the longest sequence, at most 64."""
    return split_count(batch * num_kv_heads, num_sms, min(64, -(-max_len // block_n)))


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float, num_splits: int, block_n: int = 64,
                 workspace: tuple[torch.Tensor, torch.Tensor] | None = None):
    """`workspace` (tests): preallocated (B, H_q, S, D) / (B, H_q, S) fp32 partial buffers, e.g. poisoned with NaN."""
    if triton is None:
        raise RuntimeError("paged_decode needs Triton; use paged_decode_reference on CPU")
    B, Hq, D = q.shape
    K, V, KH, VH, slots, stride_khp, stride_vhp, tiered, fp8, page, Hkv = kv_args(q, k_cache, v_cache)
    k_cache, v_cache = K, V
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError("block_tables / seq_lens batch size differs from q")
    G = Hq // Hkv
    if workspace is None:
        out_p = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        lse_p = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        out_p, lse_p = workspace
    grid = (B, Hkv, num_splits)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, KH, VH, slots, block_tables, seq_lens, out_p, lse_p,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_khp, stride_vhp,
        block_tables.stride(0),
        out_p.stride(0), out_p.stride(1), out_p.stride(2),
        lse_p.stride(0), lse_p.stride(1),
        scale * math.log2(math.e),
        num_splits,
        GROUP=G, GROUP_PAD=max(16, triton.next_power_of_2(G)), HEAD_DIM=D,
        PAGE=page, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TIERED=tiered, FP8=fp8,
        num_warps=4, num_stages=2,
    )
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    combine_splits_triton(out_p, lse_p, out, lse)
    return out, lse
