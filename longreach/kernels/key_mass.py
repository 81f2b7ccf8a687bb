"""Attention mass per key: how much softmax probability each key received from a step's queries (column sums).

The cascading cache's importance (attention/cascading/) is an exponential moving average of the attention each
cached token receives. A flash-attention kernel never holds a whole softmax row, so the mass is a second pass that
reuses the first pass's log-sum-exp: for every sequence b, KV head g and key v < num_keys[b],

    mass[b, g, v] = sum_i w[i] * mean_{h in g} exp(scale * q[i, h] . k[v, g] - lse[i, h])    (rows i with v <= pos_i)

(rows i of the sequence, at positions pos_i = first_pos[b] + i; keys addressed like the block-sparse executor:
key v -> page table[b, v // page] at offset v % page). With RoPE strategy "cache" each key, stored un-rotated, is
rotated at its position v first (rope/strategies.py). The work is that of QK^T without PV.

Grid: (sequence, KV head, key tile). A program loads one tile of BLOCK_N keys once and walks the sequence's query
rows in tiles of ROWS rows x the group's heads, skipping rows that precede the tile (causally blind to it); no
atomics (each key tile has one owner). Limits: head_dim a power of two in [16, 256]; one-tier caches (bf16/fp16/fp32
or fp8 rows). Tested: CPU interpreter (TRITON_INTERPRET=1) in fp16/fp32 against `key_mass_reference`
(tests/test_cascading.py); H100 in bf16 at real sizes (tests/gpu/test_cascading.py::test_cascading_kernels).
"""
from __future__ import annotations

import math

import torch

from ..rope.strategies import RopeArgs, rotate
from .fp8 import values
from .paged import kv_format, load_kv
from .rope import rotate_rows, swap_halves

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def key_mass_reference(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, seq_start: torch.Tensor,
                       seq_len: torch.Tensor, first_pos: torch.Tensor, num_keys: torch.Tensor,
                       lse: torch.Tensor | None, row_weight: torch.Tensor, scale: float, rope: RopeArgs | None = None,
                       max_bytes: int = 128 << 20) -> torch.Tensor:
    """q (T, H_q, D); k_cache (pages, page, H_kv, D); block_tables (B, W) int; seq_start/seq_len/first_pos/num_keys
    (B,) int; lse (T, H_q) natural log; row_weight (T,) -> mass (B, H_kv, max(num_keys)) fp32 (0 past num_keys).

    `lse=None`: the softmax is normalised here, over the same causal keys (every key <= the row): what the engine's
    CPU path does, so that its attention can run as one fused SDPA call, which returns no log-sum-exp."""
    T, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    hpp = Hq // Hkv
    B = block_tables.shape[0]
    counts = num_keys.tolist()
    out = torch.zeros(B, Hkv, max(counts + [0]), dtype=torch.float32, device=q.device)
    kv_of_head = torch.arange(Hq, device=q.device) // hpp
    for b in range(B):
        V, n, s0, p0 = counts[b], int(seq_len[b]), int(seq_start[b]), int(first_pos[b])
        if V == 0 or n == 0:
            continue
        v = torch.arange(V, device=q.device)
        slot = block_tables[b].long()[v // page] * page + v % page
        k = values(k_cache.reshape(-1, Hkv, k_cache.shape[-1])[slot], torch.float32)  # (V, H_kv, D)
        if rope is not None and rope.mode == "cache":
            k = rotate(k, v[:, None], rope.inv_freq)
        kh = k[:, kv_of_head]  # (V, H_q, D)
        acc = torch.zeros(Hq, V, dtype=torch.float32, device=q.device)
        step = max(1, max_bytes // (Hq * V * 4 * 3))
        for i0 in range(0, n, step):
            rows = torch.arange(i0, min(n, i0 + step), device=q.device)
            qq = q[s0 + rows].float()  # (r, H_q, D)
            ok = v[None, :] <= (p0 + rows)[:, None]  # (r, V) causal
            s = torch.einsum("rhd,vhd->hrv", qq, kh) * scale
            if lse is None:
                p = s.masked_fill(~ok[None], float("-inf")).softmax(-1)
            else:
                p = torch.where(ok[None], (s - lse[s0 + rows].T[:, :, None]).exp(), torch.zeros((), device=q.device))
            acc += (p * row_weight[s0 + rows].float()[None, :, None]).sum(1)
        out[b, :, :V] = acc.reshape(Hkv, hpp, V).mean(1)
    return out


if triton is not None:

    @triton.jit
    def _key_mass_kernel(
        Q, K, BlockTables, SeqStart, SeqLen, FirstPos, NumKeys, Lse, W, InvFreq, Out,
        stride_qt, stride_qh,
        stride_kp, stride_ko, stride_kh,
        stride_btb,
        stride_lt,
        stride_ob, stride_oh,
        qk_scale,
        HPP: tl.constexpr, HPP_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, ROPE: tl.constexpr, FP8: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        tile = tl.program_id(2)
        start = tl.load(SeqStart + b)
        n = tl.load(SeqLen + b)
        pos0 = tl.load(FirstPos + b)
        nk = tl.load(NumKeys + b)

        v = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        v_ok = v < nk
        d = tl.arange(0, HEAD_DIM)
        safe = tl.minimum(v, tl.maximum(nk - 1, 0))
        page = tl.load(BlockTables + b * stride_btb + safe // PAGE, mask=v_ok, other=0).to(tl.int64)
        off = safe % PAGE
        kb = K + page * stride_kp
        k = load_kv(kb, off, kvh, stride_ko, stride_kh, d, v_ok, HEAD_DIM, FP8)
        if ROPE:  # strategy "cache": keys stored un-rotated, each rotated at its position
            inv = tl.load(InvFreq + d % (HEAD_DIM // 2))
            k_sw = load_kv(kb, off, kvh, stride_ko, stride_kh, swap_halves(d, HEAD_DIM), v_ok, HEAD_DIM, FP8)
            k = rotate_rows(k, k_sw, v, inv, d, HEAD_DIM)
        k = k.to(Q.dtype.element_ty)

        r = tl.arange(0, HPP_PAD * ROWS)
        hh = r // ROWS
        head = kvh * HPP + hh
        h_ok = hh < HPP
        acc = tl.zeros([BLOCK_N], tl.float32)
        first = tl.maximum(tile * BLOCK_N - pos0, 0)  # rows before this one see no key of the tile
        lo = (first // ROWS) * ROWS
        hi = tl.where(tile * BLOCK_N < nk, n, lo)  # a tile past the sequence's keys does no work
        for i0 in range(lo, hi, ROWS):
            qi = i0 + r % ROWS
            ok = (qi < n) & h_ok
            row = start + qi
            q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=ok[:, None],
                        other=0.0)
            lse = tl.load(Lse + row * stride_lt + head, mask=ok, other=0.0)
            w = tl.load(W + row, mask=ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse[:, None] * 1.4426950408889634
            allowed = ok[:, None] & v_ok[None, :] & (v[None, :] <= pos0 + qi[:, None])
            p = tl.where(allowed, tl.exp2(s), 0.0)
            acc += tl.sum(p * w[:, None], axis=0)
        tl.store(Out + b * stride_ob + kvh * stride_oh + v, acc / HPP, mask=v_ok)


def key_mass_triton(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, seq_start: torch.Tensor,
                    seq_len: torch.Tensor, first_pos: torch.Tensor, num_keys: torch.Tensor, lse: torch.Tensor,
                    row_weight: torch.Tensor, scale: float, rope: RopeArgs | None = None,
                    max_keys: int | None = None, max_rows: int | None = None, block_n: int = 64) -> torch.Tensor:
    """Triton version of `key_mass_reference` (same arguments and result). `max_keys` / `max_rows`: host bounds of
    num_keys / seq_len (pass them to avoid a device sync)."""
    if triton is None:
        raise RuntimeError("key_mass_triton needs Triton")
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    fp8 = kv_format(k_cache, D)
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {D}")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not split into {Hkv} KV heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or lse.shape != (T, Hq) or row_weight.shape != (T,):
        raise ValueError("q and k_cache must be contiguous in the head dimension; lse (T, H_q), row_weight (T,)")
    if block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be int32")
    if rope is not None and rope.mode not in ("none", "cache"):
        raise ValueError(f"key mass supports RoPE strategies none and cache, got {rope.mode!r}")
    B = block_tables.shape[0]
    max_keys = int(num_keys.max()) if max_keys is None else max_keys
    max_rows = int(seq_len.max()) if max_rows is None else max_rows
    out = torch.zeros(B, Hkv, max(max_keys, 1), dtype=torch.float32, device=q.device)
    if B == 0 or max_keys == 0:
        return out[:, :, :max_keys]
    hpp = Hq // Hkv
    hpp_pad = triton.next_power_of_2(hpp)
    rows = max(16 // hpp_pad, min(max(1, 64 // hpp_pad), triton.next_power_of_2(max(1, max_rows))))
    use_rope = rope is not None and rope.mode == "cache"
    inv_freq = rope.inv_freq.to(device=q.device, dtype=torch.float32) if use_rope else row_weight
    i32 = lambda t: t.to(device=q.device, dtype=torch.int32).contiguous()  # noqa: E731
    lse = lse.float().contiguous()
    grid = (B, Hkv, triton.cdiv(max_keys, block_n))
    _key_mass_kernel[grid](
        q, k_cache, block_tables, i32(seq_start), i32(seq_len), i32(first_pos), i32(num_keys), lse,
        row_weight.float().contiguous(), inv_freq, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        lse.stride(0),
        out.stride(0), out.stride(1),
        scale * math.log2(math.e),
        HPP=hpp, HPP_PAD=hpp_pad, ROWS=rows, BLOCK_N=block_n, HEAD_DIM=D, PAGE=page, ROPE=use_rope, FP8=fp8,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    return out
