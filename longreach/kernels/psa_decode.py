"""PSA's progressive decode attention (Zhou et al., Alg. 1): blocks in rank order until the attended mass suffices.

For one decode query per row and one KV head g (the heads of g's GQA group together), given the row's candidate
blocks ranked by criticality (kernels/key_boxes.py: page box scores):
  1. attend to the fixed keys: the sink [0, cand_lo * B) and the tail [cand_hi * B, p] (the last n_window keys
     extended down to a block boundary, the partial last page included); they count in AS_acc, not in AS_min;
  2. take the ranked blocks in micro-batches of m: attend (one online softmax carries the output and AS_acc, the
     log-sum-exp), fold each block's own mass AS_b = sum_t exp(s_t) into AS_min = min(AS_min, AS_b), subtract the
     blocks from N_left, and estimate the attended share
         P_acc = AS_acc / (AS_acc + AS_min * N_left)
     per head; stop once P_acc >= epsilon for every head of the group (or no candidate is left).
Everything is kept in log space (base 2 in the kernel): stop iff log N_left + lse_min - lse_acc <= log((1-eps)/eps),
so epsilon = 1 reads every candidate (only N_left = 0 passes) and no mass overflows.

`psa_decode_reference` is the plain-PyTorch loop: all rows and groups iterate in lock-step and a (row, group) leaves
the active set when it stops (the paper's batched form); it can record AS_acc, AS_min, N_left and P_acc after every
micro-batch (`trace`), or read a forced number of blocks (`counts`). `psa_decode_triton` runs one program per
(row, KV head) that loops over its ranked blocks with the stop rule on the device: no host round trip per
micro-batch, rows stop independently, the launch has static shapes (CUDA-graph capturable). Keys and values are
read through the block table and the two-tier page table (kernels/paged.py: resident pages from their GPU slot,
missing ones from pinned host memory), fp8 rows dequantised on load.

`psa_decode_waves` (kernels/psa_waves.py) computes the same with the ranked blocks read in parallel.

Returns out (n, H_q, D) in q's dtype, lse (n, H_q) fp32 (natural log, over the keys read) and counts (n, H_kv)
int32: ranked blocks read. Limits (kernels): head_dim a power of two in [16, 256]; micro-batch x block_size >= 16
and both powers of two; cand_hi - cand_lo <= W (the loop kernel reads past `ranked` otherwise, the waves stop at
W). Tested: interpreter in fp16/fp32 (tests/test_psa.py, tests/test_psa_waves.py); bf16 at real sizes on an H100
in tests/gpu/test_psa.py (128K, 8B shape; its results and the kernels' timings: docs/kernel-notes.md v11).
"""
from __future__ import annotations

import math

import torch

from .kv_layout import as_tensor

try:
    import triton
    import triton.language as tl

    from .paged import kv_args, load_kv, page_slots, row_base
    from .rope import rotate_rows, swap_halves
    from .softmax import online_softmax_finish, online_softmax_step
except ImportError:  # pragma: no cover - CPU installs without Triton use the reference
    triton = None


def log_odds(epsilon: float) -> float:
    """log((1 - eps) / eps): the stop threshold on log(AS_min * N_left / AS_acc); -inf for eps = 1."""
    return math.log((1.0 - epsilon) / epsilon) if epsilon < 1.0 else float("-inf")


def fixed_positions(seq_lens: torch.Tensor, cand_lo: int, cand_hi: torch.Tensor, page: int):
    """Positions (n, F) of each row's fixed keys (sink, then tail) and their mask: sink [0, cand_lo * page) and tail
    [cand_hi * page, p], both clipped to the row's position p = seq_len - 1."""
    p = seq_lens.long() - 1
    S, T0 = cand_lo * page, cand_hi.long() * page
    tail = (p - T0 + 1).clamp(min=0)
    idx = torch.arange(S + int(tail.max()) if p.numel() else 0, device=p.device)
    pos = torch.where(idx[None, :] < S, idx[None, :], T0[:, None] + idx[None, :] - S)
    ok = torch.where(idx[None, :] < S, idx[None, :] <= p[:, None], idx[None, :] - S < tail[:, None])
    return pos, ok


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, pos: torch.Tensor, heads: torch.Tensor | None, dtype):
    """cache[(page of pos) * page + offset] for positions pos (n, ...), as `dtype`; heads: (n, G, ...) KV head of
    each position, or None for all heads."""
    page = cache.shape[1]
    flat = cache.reshape(-1, *cache.shape[2:])
    n = pos.shape[0]
    pages = torch.gather(block_tables.long(), 1, (pos // page).reshape(n, -1)).reshape(pos.shape)
    slots = pages * page + pos % page
    return (flat[slots] if heads is None else flat[slots, heads]).to(dtype)


def rank_order_deltas(p: torch.Tensor, cand_lo: int, cand_hi: torch.Tensor, page: int, rope_from: int):
    """`rope: rank` (attention/psa/): for rows at positions p (n,) >= rope_from, the key moves that put the
    attended keys within the trained distance. Returns (sink_delta (n,), ranked(rank, block, t) -> delta): the sink
    moves by p - rope_from + 1 (its token s then sits rope_from - 1 - s before the query); the ranked block of rank i
    and id b, token t, moves to max(T0 - (i + 1) * page + t, p - rope_from + 1 + S) (T0 = cand_hi * page, the tail's
    first key; S = cand_lo * page, the sink), i.e. just before the tail in rank order, clamped nearer than the sink;
    the tail keeps its true positions. Rows before rope_from move nothing."""
    p = p.long()
    active = p >= rope_from
    shift = torch.where(active, p - rope_from + 1, 0)
    T0, S = cand_hi.long() * page, cand_lo * page

    def ranked(rank: torch.Tensor, block: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """rank, block, t broadcast against (n, ...): each token's delta."""
        extra = (1,) * (block.dim() - 1)
        new = torch.maximum(T0.view(-1, *extra) - (rank + 1) * page + t, (p - rope_from + 1 + S).view(-1, *extra))
        return torch.where(active.view(-1, *extra), new - (block * page + t), 0)
    return shift, ranked


def psa_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, ranked, cand_lo: int, cand_hi, epsilon: float,
                         microbatch: int, scale: float, counts: torch.Tensor | None = None, trace: list | None = None,
                         rope: tuple[torch.Tensor, int] | None = None):
    """The progressive loop in plain PyTorch (fp32 math; fp64 for fp64 inputs). See the module docstring.

    q (n, H_q, D), row r's query at position seq_lens[r] - 1; k_cache / v_cache (P, block_size, H_kv, D), two-tier
    or fp8; block_tables (n, >= W) int; ranked (n, H_kv, W): block ids by descending criticality, the first
    cand_hi[r] - cand_lo are the candidates; cand_hi (n,). `counts` (n, H_kv): read exactly that many ranked blocks
    (no stop rule). `trace`: receives after each micro-batch a dict of as_acc, as_min, p_acc (n, H_q) and n_left,
    active (n, H_kv) (active: the pairs that took part in this micro-batch). `rope` (inv_freq (D/2,), rope_from):
    rows at or past rope_from attend at rank-order positions (`rank_order_deltas`); None: true positions.
    """
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    kc, vc = as_tensor(k_cache, cdt), as_tensor(v_cache, cdt)
    n, Hq, D = q.shape
    page, Hkv = kc.shape[1], kc.shape[2]
    hpg, m = Hq // Hkv, microbatch
    dev = q.device
    qg = q.to(cdt).view(n, Hkv, hpg, D)

    # 1. the fixed keys (sink + tail): one softmax state (max, sum, weighted values) per (row, group, head)
    pos, ok = fixed_positions(seq_lens, cand_lo, cand_hi, page)
    safe = torch.where(ok, pos, 0)
    kf, vf = _gather(kc, block_tables, safe, None, cdt), _gather(vc, block_tables, safe, None, cdt)  # (n, F, Hkv, D)
    if rope is not None:
        from ..rope.strategies import rotate

        shift, ranked_delta = rank_order_deltas(seq_lens - 1, cand_lo, cand_hi, page, rope[1])
        sink = torch.arange(pos.shape[1], device=dev)[None, :] < cand_lo * page
        kf = rotate(kf, torch.where(sink, shift[:, None], 0)[:, :, None], rope[0]).to(cdt)
    s = (qg @ kf.permute(0, 2, 3, 1)) * scale  # (n, G, h, F)
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    mx = s.amax(dim=-1)
    mx_safe = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx_safe[..., None])
    l_acc, acc = e.sum(dim=-1), e @ vf.transpose(1, 2)  # (n, G, h), (n, G, h, D)

    # 2. the ranked blocks, m at a time, in lock-step; a (row, group) leaves the active set when it stops
    n_cand = (cand_hi.long() - cand_lo).clamp(min=0)
    limit = n_cand[:, None].expand(n, Hkv) if counts is None else counts.long().to(dev)
    width = ranked.shape[2]
    ranked = torch.nn.functional.pad(ranked.long(), (0, -(-width // m) * m - width))
    lse_min = torch.full((n, Hkv, hpg), float("inf"), dtype=cdt, device=dev)
    n_left = n_cand[:, None].expand(n, Hkv).to(cdt).clone()
    read = torch.zeros(n, Hkv, dtype=torch.long, device=dev)
    active = limit > 0
    threshold = log_odds(epsilon)
    heads = torch.arange(Hkv, device=dev)[None, :, None].expand(n, Hkv, m * page)
    t = torch.arange(page, device=dev)
    i = 0
    while bool(active.any()):
        okb = ((i + torch.arange(m, device=dev)) < limit[..., None]) & active[..., None]  # (n, G, m)
        tok_ok = okb.repeat_interleave(page, dim=-1)  # (n, G, m * page)
        tok = (ranked[:, :, i:i + m, None] * page + t).reshape(n, Hkv, m * page)
        tok = torch.where(tok_ok, tok, 0)
        kk = _gather(kc, block_tables, tok, heads, cdt)  # (n, G, m * page, D)
        if rope is not None:
            rank = (i + torch.arange(m * page, device=dev) // page)[None, None, :]
            kk = rotate(kk, ranked_delta(rank, tok // page, tok % page), rope[0]).to(cdt)
        vv = _gather(vc, block_tables, tok, heads, cdt)
        s = ((qg @ kk.transpose(-1, -2)) * scale).masked_fill(~tok_ok[:, :, None, :], float("-inf"))  # (n,G,h,T)
        block_lse = s.view(n, Hkv, hpg, m, page).logsumexp(dim=-1)  # (n, G, h, m): each block's own mass, log
        lse_min = torch.minimum(lse_min, block_lse.masked_fill(~okb[:, :, None, :], float("inf")).amin(dim=-1))
        new_max = torch.maximum(mx_safe, s.amax(dim=-1))  # the running merge of Alg. 1, in log-sum-exp form
        alpha = torch.exp(mx_safe - new_max)
        e = torch.exp(s - new_max[..., None])
        l_acc = l_acc * alpha + e.sum(dim=-1)
        acc = acc * alpha[..., None] + e @ vv
        mx_safe = new_max
        nb = okb.sum(dim=-1)
        n_left, read = n_left - nb, read + nb
        lse_acc = mx_safe + torch.log(l_acc)
        left = n_left[..., None].expand_as(lse_acc)
        gap = torch.where(left > 0, torch.log(left.clamp(min=1)) + lse_min - lse_acc,
                          torch.full_like(lse_acc, float("-inf")))
        stop = read >= limit
        if counts is None:
            stop |= (gap <= threshold).all(dim=-1)
        if trace is not None:
            flat = lambda x: x.reshape(n, Hq)  # noqa: E731
            trace.append({"active": active.clone(), "n_left": n_left.clone(), "as_acc": flat(torch.exp(lse_acc)),
                          "as_min": flat(torch.exp(lse_min)), "p_acc": flat(torch.sigmoid(-gap))})
        active = active & ~stop
        i += m
    out = (acc / l_acc[..., None]).reshape(n, Hq, D)
    lse = (mx_safe + torch.log(l_acc)).reshape(n, Hq)
    return out.to(q.dtype), lse.float(), read.to(torch.int32)


if triton is not None:

    @triton.jit
    def _keys_at(q, kv, strides, g, page, off, ok, qk_scale, delta, inv, HEAD_DIM: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, TIERED: tl.constexpr, FP8: tl.constexpr, ROPE: tl.constexpr,
                 PAGE: tl.constexpr):
        """Scores (BLOCK_M, N) of the group's queries against KV head g's keys at (page, off) (N,), in log2 units and
        -inf outside `ok`, and their values (N, D). kv = (K, V, KH, VH, Slots) and strides as in kernels/paged.py.
        ROPE: each key first rotated by delta (N,) positions (inv: the (D,) inverse frequencies)."""
        K, V, KH, VH, Slots = kv
        stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_khp, stride_vhp = strides
        d = tl.arange(0, HEAD_DIM)
        slot = page_slots(Slots, page, g, TIERED)
        kb = row_base(K, KH, page, slot, g, stride_kp, stride_khp, stride_kh, PAGE, TIERED)
        k = load_kv(kb, off, g, stride_ko, stride_kh, d, ok, HEAD_DIM, FP8)
        if ROPE:
            k_sw = load_kv(kb, off, g, stride_ko, stride_kh, swap_halves(d, HEAD_DIM), ok, HEAD_DIM, FP8)
            k = rotate_rows(k, k_sw, delta, inv, d, HEAD_DIM)
        k = k.to(q.dtype)
        vb = row_base(V, VH, page, slot, g, stride_vp, stride_vhp, stride_vh, PAGE, TIERED)
        v = load_kv(vb, off, g, stride_vo, stride_vh, d, ok,
                    HEAD_DIM, FP8).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        return tl.where(ok[None, :], s, float("-inf")), v

    @triton.jit
    def _fixed_keys(q, kv, strides, bt, g, p, hi, cand_lo, qk_scale, rp, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, TIERED: tl.constexpr,
                    FP8: tl.constexpr, ROPE: tl.constexpr):
        """Softmax state (m, l, acc) over the fixed keys: the sink [0, cand_lo * PAGE), then the tail [hi * PAGE, p].
        rp = (inv, rope_from): with ROPE, a row at or past rope_from sees its sink moved (`rank_order_deltas`)."""
        inv, rope_from = rp
        shift = tl.where(p >= rope_from, p - rope_from + 1, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        S = cand_lo * PAGE
        T0 = hi * PAGE
        n_fixed = S + tl.maximum(p - T0 + 1, 0)
        j = tl.arange(0, BLOCK_N)
        for t in range(0, tl.cdiv(n_fixed, BLOCK_N)):
            idx = t * BLOCK_N + j
            pos = tl.where(idx < S, idx, T0 + idx - S)
            ok = (idx < n_fixed) & (pos <= p)
            safe = tl.where(ok, pos, 0)
            page = tl.load(bt + safe // PAGE).to(tl.int64)
            delta = tl.where(idx < S, shift, 0)
            s, v = _keys_at(q, kv, strides, g, page, safe % PAGE, ok, qk_scale, delta, inv, HEAD_DIM, DOT_PRECISION,
                            TIERED, FP8, ROPE, PAGE)
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
        return m_i, l_i, acc

    @triton.jit
    def _ranked_blocks(q, kv, strides, bt, ranked, g, i, n_cand, qk_scale, rp, p, hi, cand_lo, BLOCK_M: tl.constexpr,
                       MB: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       TIERED: tl.constexpr, FP8: tl.constexpr, ROPE: tl.constexpr):
        """Scores and values of the ranked blocks [i, i + MB) that are candidates (rank < n_cand), and each head's
        smallest block log-mass (log2, +inf without a block), reduced in registers: AS_min needs blocks, not the
        micro-batch. With ROPE, a row at or past rope_from (rp = (inv, rope_from)) sees each block at its rank-order
        position (`rank_order_deltas`)."""
        tt = tl.arange(0, MB * PAGE)
        jb = i + tt // PAGE  # rank of each token's block
        ok = jb < n_cand
        blk = tl.load(ranked + jb, mask=ok, other=0)
        page = tl.load(bt + blk, mask=ok, other=0).to(tl.int64)  # a block is one page
        inv, rope_from = rp
        t = tt % PAGE
        new = tl.maximum(hi * PAGE - (jb + 1) * PAGE + t, p - rope_from + 1 + cand_lo * PAGE)
        delta = tl.where(p >= rope_from, new - (blk * PAGE + t), 0)
        s, v = _keys_at(q, kv, strides, g, page, t, ok, qk_scale, delta, inv, HEAD_DIM, DOT_PRECISION, TIERED, FP8,
                        ROPE, PAGE)
        s3 = tl.reshape(s, [BLOCK_M, MB, PAGE])
        bmax = tl.max(s3, axis=2)
        bmax = tl.where(bmax == float("-inf"), 0.0, bmax)
        bsum = tl.sum(tl.exp2(s3 - bmax[:, :, None]), axis=2)
        blse = tl.where(bsum > 0.0, bmax + tl.log2(tl.where(bsum > 0.0, bsum, 1.0)), float("inf"))
        return s, v, tl.min(blse, axis=1)

    @triton.jit
    def _passes(lse_acc, lse_min, n_left, log2_odds):
        """The stop test per head: log2 N_left + lse_min - lse_acc <= log2((1 - eps) / eps), always true at N_left 0."""
        gap = tl.where(n_left > 0.0, tl.log2(tl.maximum(n_left, 1.0)) + lse_min - lse_acc, float("-inf"))
        return gap <= log2_odds

    @triton.jit
    def _psa_decode_kernel(
        Q, K, V, KH, VH, Slots, BlockTables, SeqLens, Ranked, CandHi, InvFreq, Out, Lse, Count,
        stride_qn, stride_qh,
        stride_kp, stride_ko, stride_kh,
        stride_vp, stride_vo, stride_vh,
        stride_khp, stride_vhp,
        stride_btb, stride_rn, stride_rg,
        stride_on, stride_oh, stride_ln, stride_cn,
        qk_scale, log2_odds, cand_lo, rope_from,
        HPG: tl.constexpr, BLOCK_M: tl.constexpr, MB: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, TIERED: tl.constexpr, FP8: tl.constexpr,
        ROPE: tl.constexpr,
    ):
        n = tl.program_id(0)
        g = tl.program_id(1)
        p = tl.load(SeqLens + n) - 1
        hi = tl.load(CandHi + n)
        n_cand = tl.maximum(hi - cand_lo, 0)
        hh = tl.arange(0, BLOCK_M)
        row_ok = hh < HPG
        head = g * HPG + hh
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + n * stride_qn + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        bt = BlockTables + n * stride_btb
        kv = (K, V, KH, VH, Slots)
        strides = (stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_khp, stride_vhp)
        if ROPE:
            inv = tl.load(InvFreq + d % (HEAD_DIM // 2))
        else:
            inv = tl.zeros([HEAD_DIM], tl.float32)
        rp = (inv, rope_from)

        # 1. fixed keys: sink [0, S) then tail [T0, p]
        m_i, l_i, acc = _fixed_keys(q, kv, strides, bt, g, p, hi, cand_lo, qk_scale, rp, BLOCK_M, BLOCK_N, PAGE,
                                    HEAD_DIM, DOT_PRECISION, TIERED, FP8, ROPE)

        # 2. ranked blocks, MB per iteration, until every head of the group has P_acc >= epsilon
        ranked = Ranked + n * stride_rn + g * stride_rg
        lse_min = tl.full([BLOCK_M], float("inf"), tl.float32)
        n_left = n_cand.to(tl.float32)
        i = n_cand * 0
        go = n_cand > 0
        while go:
            s, v, bmin = _ranked_blocks(q, kv, strides, bt, ranked, g, i, n_cand, qk_scale, rp, p, hi, cand_lo,
                                        BLOCK_M, MB, PAGE, HEAD_DIM, DOT_PRECISION, TIERED, FP8, ROPE)
            lse_min = tl.minimum(lse_min, bmin)
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
            n_left = n_left - tl.minimum(n_cand - i, MB).to(tl.float32)
            i += MB
            ok = _passes(m_i + tl.log2(l_i), lse_min, n_left, log2_odds) | (hh >= HPG)
            go = (i < n_cand) & (tl.min(ok.to(tl.int32), axis=0) == 0)

        out, lse = online_softmax_finish(m_i, l_i, acc)
        tl.store(Out + n * stride_on + head[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(Lse + n * stride_ln + head, lse, mask=row_ok)
        tl.store(Count + n * stride_cn + g, tl.minimum(i, n_cand))


def _prepare(q, k_cache, v_cache, block_tables, seq_lens, ranked, cand_hi, epsilon, microbatch, out, lse, counts,
             name: str, rope: tuple[torch.Tensor, int] | None = None):
    """The checks and outputs both launchers share. Returns (kv_args, out, lse, counts, inputs, strides, meta):
    the kernels' leading pointer arguments, their strides and the constexprs both kernels take. `rope`: (inv_freq,
    rope_from) of `rope: rank` (psa_decode_reference), None: true positions."""
    if triton is None:
        raise RuntimeError(f"{name} needs Triton")
    n, Hq, D = q.shape
    kv = kv_args(q, k_cache, v_cache)
    page, Hkv = kv.page, kv.num_kv_heads
    if microbatch < 1 or microbatch & (microbatch - 1) or page & (page - 1) or microbatch * page < 16:
        raise ValueError(f"microbatch ({microbatch}) and block size ({page}) must be powers of two with "
                         "microbatch x block size >= 16 (the kernel's tile)")
    if not 0.0 < epsilon <= 1.0:
        raise ValueError(f"epsilon must be in (0, 1], got {epsilon}")
    for arg, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("ranked", ranked), ("cand_hi", cand_hi)):
        if t.dtype != torch.int32:
            raise ValueError(f"{arg} must be int32, got {t.dtype}")
    if ranked.dim() != 3 or ranked.shape[:2] != (n, Hkv) or ranked.stride(2) != 1:
        raise ValueError(f"ranked must be ({n}, {Hkv}, W) and contiguous in W, got {tuple(ranked.shape)}")
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(n, Hq, dtype=torch.float32, device=q.device) if lse is None else lse
    counts = torch.empty(n, Hkv, dtype=torch.int32, device=q.device) if counts is None else counts
    if rope is not None and (tuple(rope[0].shape) != (D // 2,) or rope[0].dtype != torch.float32):
        raise ValueError(f"rope's inv_freq must be ({D // 2},) fp32, got {tuple(rope[0].shape)} {rope[0].dtype}")
    inv = rope[0] if rope is not None else q  # without ROPE the kernels read nothing through it
    inputs = (q, kv.K, kv.V, kv.KH, kv.VH, kv.slots, block_tables, seq_lens, ranked, cand_hi, inv)
    strides = (q.stride(0), q.stride(1), *kv.K.stride()[:3], *kv.V.stride()[:3], kv.stride_khp, kv.stride_vhp,
               block_tables.stride(0), ranked.stride(0), ranked.stride(1))
    hpg = Hq // Hkv
    meta = dict(HPG=hpg, BLOCK_M=max(16, triton.next_power_of_2(hpg)), MB=microbatch, PAGE=page, HEAD_DIM=D,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TIERED=kv.tiered, FP8=kv.fp8,
                ROPE=rope is not None)
    return kv, out, lse, counts, inputs, strides, meta


def psa_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, ranked, cand_lo: int, cand_hi, epsilon: float,
                      microbatch: int, scale: float, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      counts: torch.Tensor | None = None, block_n: int = 64, num_warps: int = 4,
                      rope: tuple[torch.Tensor, int] | None = None):
    """`psa_decode_reference` (without trace / forced counts) as one kernel launch over (rows, KV heads).

    `out` / `lse` / `counts` may be passed preallocated (e.g. poisoned by tests). Integer inputs are int32."""
    kv, out, lse, counts, inputs, strides, meta = _prepare(q, k_cache, v_cache, block_tables, seq_lens, ranked,
                                                           cand_hi, epsilon, microbatch, out, lse, counts,
                                                           "psa_decode_triton", rope)
    if q.shape[0] == 0:
        return out, lse, counts
    _psa_decode_kernel[(q.shape[0], kv.num_kv_heads)](
        *inputs, out, lse, counts, *strides,
        out.stride(0), out.stride(1), lse.stride(0), counts.stride(0),
        scale * math.log2(math.e), log_odds(epsilon) * math.log2(math.e), cand_lo, rope[1] if rope else 0,
        BLOCK_N=block_n, num_warps=num_warps, num_stages=2, **meta,
    )
    return out, lse, counts
