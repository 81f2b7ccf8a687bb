"""PSA's decode attention with the ranked blocks read in parallel waves (`psa_decode_waves`).

It computes what `psa_decode_triton` (kernels/psa_decode.py) does. At batch 1 that loop kernel has only H_kv
programs, each walking its blocks one micro-batch after another. The micro-batches [0, ceil(W / m)) (W: ranked's
width) are cut into waves of first_wave x growth^w (32, 64, 128, ...), the last one cut short: O(log W) waves whose
number follows from the shapes, so the launches need no host sync and are CUDA-graph capturable. A (row, KV head)
pair that stops in wave w has read the whole wave: start_w + size_w micro-batches where it needed more than start_w,
so (growth 2) up to 3x what it needed when it stops early in wave 1, tending to 2x in later waves, and at most
first_wave micro-batches in wave 0. Each wave is two launches:
  A. grid (min(size_w, max_programs), rows, KV heads), plus one program per pair in wave 0: program z attends to
     micro-batches start_w + z, start_w + z + P, ... (P programs stride over the wave) each on its own (the loop
     kernel's tile code) and writes their partials: per head the base-2 softmax state m, l, the unnormalised
     output acc (D fp32) and the smallest block log-mass. A pair already stopped (a flag set by the previous
     merge) or a micro-batch past the row's candidates reads nothing. The cap keeps the late waves of a long
     context (16,384 micro-batches in the last wave at 1M) from launching a program per micro-batch that only
     reads a flag: at 1M those launches cost more than the loop kernel's whole walk when a pair stops early
     (docs/kernel-notes.md v13). The extra program of wave 0 attends to the fixed keys and writes the pair's
     running state.
  B. grid (rows, KV heads, D / merge_cols): merge the wave's partials into the running state in rank order. The
     scalars go first, a chunk at a time: a prefix scan of the associative merge of (m, l, lse_min), the stop test
     of the loop kernel after every micro-batch, the first micro-batch that passes ends it. Then the program's acc
     columns: the state's and the merged partials', rescaled to the final max. A stopped pair writes out, lse and
     counts and sets its flag; the others keep their state for the next wave; the last wave finishes every pair.
     A pair's programs all take the same decision; one writes the scalar state, which is double-buffered by wave
     parity because the others read it meanwhile.
Exactness: the same blocks in the same micro-batches and the same stop test after each micro-batch; only fp32 sums
are associated differently (a micro-batch's softmax is taken against its own max and rescaled when merged, the
loop rescales against the running max; the prefix follows the scan's tree). out and lse agree to fp32 rounding, and
counts are equal unless a pair's gap lies within rounding of the threshold, where the two kernels may stop at
different micro-batches (the reference, in natural-log fp32, can differ from both the same way). Scratch: 4 B x
H_kv x (heads per group, rounded up to a power of two >= 2) x (D + 3) per row and micro-batch of the largest wave
(Llama-8B at 128K, page 16, m 4: 1024 x 16 KB = 16 MB per row), capped by `scratch_bytes` (waves stop growing).

Arguments, results and limits are psa_decode.py's. Tested: interpreter in fp16/fp32 against the loop kernel and the
reference (tests/test_psa_waves.py); bf16 at real sizes in tests/gpu/test_psa.py (docs/kernel-notes.md v11).
"""
from __future__ import annotations

import math

import torch

from .combine import sm_count
from .psa_decode import _prepare, log_odds

try:
    import triton
    import triton.language as tl

    from .psa_decode import _fixed_keys, _passes, _ranked_blocks
    from .softmax import online_softmax_finish, online_softmax_step
except ImportError:  # pragma: no cover - CPU installs without Triton use the reference
    triton = None


if triton is not None:
    @triton.jit
    def _psa_wave_kernel(
        Q, K, V, KH, VH, Slots, BlockTables, SeqLens, Ranked, CandHi, InvFreq, Part, PartAcc, State, StateAcc, Flags,
        stride_qn, stride_qh,
        stride_kp, stride_ko, stride_kh,
        stride_vp, stride_vo, stride_vh,
        stride_khp, stride_vhp,
        stride_btb, stride_rn, stride_rg,
        qk_scale, cand_lo, rope_from, start, size, wave_max, pairs, par,
        HPG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, MB: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, TIERED: tl.constexpr,
        FP8: tl.constexpr, FIRST: tl.constexpr, ROPE: tl.constexpr,
    ):
        """Kernel A of a wave: programs [0, P) (P = the grid's axis 0, less the extra one of the first wave) stride
        over the wave's micro-batches: program z attends to micro-batches start + z, start + z + P, ... of pair
        (n, g), each on its own, and writes their partial states; in the first wave, program P attends to the fixed
        keys and writes the pair's state."""
        z0 = tl.program_id(0)
        nprog = tl.num_programs(0) - (1 if FIRST else 0)
        n = tl.program_id(1)
        g = tl.program_id(2)
        pair = n * tl.num_programs(2) + g
        hi = tl.load(CandHi + n)
        n_cand = tl.maximum(hi - cand_lo, 0)
        hh = tl.arange(0, BLOCK_M)
        row_ok = hh < HPG
        d = tl.arange(0, HEAD_DIM)
        qp = Q + n * stride_qn + (g * HPG + hh)[:, None] * stride_qh + d[None, :]
        bt = BlockTables + n * stride_btb
        kv = (K, V, KH, VH, Slots)
        strides = (stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_khp, stride_vhp)
        if ROPE:
            inv = tl.load(InvFreq + d % (HEAD_DIM // 2))
        else:
            inv = tl.zeros([HEAD_DIM], tl.float32)
        rp = (inv, rope_from)
        p = tl.load(SeqLens + n) - 1
        live = z0 < nprog
        if not FIRST:
            live = live & (tl.load(Flags + par * pairs + pair) == 0)  # stopped in an earlier wave: read nothing
        if live:
            q = tl.load(qp, mask=row_ok[:, None], other=0.0)
            z = z0
            while (z < size) & ((start + z) * MB < n_cand):  # past the row's candidates: nothing more to read
                s, v, bmin = _ranked_blocks(q, kv, strides, bt, Ranked + n * stride_rn + g * stride_rg, g,
                                            (start + z) * MB, n_cand, qk_scale, rp, p, hi, cand_lo, BLOCK_M, MB, PAGE,
                                            HEAD_DIM, DOT_PRECISION, TIERED, FP8, ROPE)
                m_b, l_b, acc = online_softmax_step(s, v, tl.full([BLOCK_M], float("-inf"), tl.float32),
                                                    tl.zeros([BLOCK_M], tl.float32),
                                                    tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), DOT_PRECISION)
                slot = (pair * wave_max + z).to(tl.int64)  # (pairs, wave_max, {m, l, lse_min}, BLOCK_H)
                ps = Part + slot * 3 * BLOCK_H + hh
                tl.store(ps, m_b, mask=row_ok)
                tl.store(ps + BLOCK_H, l_b, mask=row_ok)
                tl.store(ps + 2 * BLOCK_H, bmin, mask=row_ok)
                tl.store(PartAcc + (slot * BLOCK_H + hh[:, None]) * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
                z += nprog
        if FIRST:  # (a constexpr: the other waves do not compile the fixed keys)
            if z0 == nprog:
                q = tl.load(qp, mask=row_ok[:, None], other=0.0)
                m_i, l_i, acc = _fixed_keys(q, kv, strides, bt, g, p, hi, cand_lo, qk_scale, rp, BLOCK_M, BLOCK_N,
                                            PAGE, HEAD_DIM, DOT_PRECISION, TIERED, FP8, ROPE)
                st = State + pair * BLOCK_H + hh  # parity 0 of (2, {m, l, lse_min}, pairs, BLOCK_H)
                tl.store(st, m_i, mask=row_ok)
                tl.store(st + pairs * BLOCK_H, l_i, mask=row_ok)
                tl.store(StateAcc + (pair * BLOCK_H + hh[:, None]).to(tl.int64) * HEAD_DIM + d[None, :], acc,
                         mask=row_ok[:, None])

    @triton.jit
    def _merge(m1, l1, b1, m2, l2, b2):
        """Two softmax states (max, sum; base 2) as one, and the smaller of their smallest block log-masses."""
        m = tl.maximum(m1, m2)
        ms = tl.where(m == float("-inf"), 0.0, m)
        return m, l1 * tl.exp2(m1 - ms) + l2 * tl.exp2(m2 - ms), tl.minimum(b1, b2)

    @triton.jit
    def _psa_wave_merge_kernel(
        CandHi, Part, PartAcc, State, StateAcc, Flags, Out, Lse, Count,
        stride_on, stride_oh, stride_ln, stride_cn,
        log2_odds, cand_lo, start, size, wave_max, pairs, par,
        HPG: tl.constexpr, BLOCK_H: tl.constexpr, MB: tl.constexpr, HEAD_DIM: tl.constexpr, COLS: tl.constexpr,
        CHUNK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    ):
        """Kernel B of a wave: merge pair (n, g)'s partials in rank order, CHUNK at a time (a prefix scan), stop at the
        first micro-batch after which the stop rule holds; then the output columns [c * COLS, (c + 1) * COLS).
        Every program of a pair takes the same decision; program c = 0 writes the scalars. The scalar state is
        double-buffered (read parity `par`, write 1 - par) since the pair's programs read it while c = 0 writes."""
        n = tl.program_id(0)
        g = tl.program_id(1)
        c = tl.program_id(2)
        first = c == 0
        pair = n * tl.num_programs(1) + g
        n_cand = tl.maximum(tl.load(CandHi + n) - cand_lo, 0)
        hh = tl.arange(0, BLOCK_H)
        h_ok = hh < HPG
        rd = State + (par * 3 * pairs + pair) * BLOCK_H + hh
        wr = State + ((1 - par) * 3 * pairs + pair) * BLOCK_H + hh
        m0 = tl.load(rd, mask=h_ok, other=float("-inf"))
        l_c = tl.load(rd + pairs * BLOCK_H, mask=h_ok, other=0.0)
        if FIRST:
            b_c = tl.full([BLOCK_H], float("inf"), tl.float32)
            done = n_cand * 0
        else:
            b_c = tl.load(rd + 2 * pairs * BLOCK_H, mask=h_ok, other=float("inf"))
            done = tl.load(Flags + par * pairs + pair)
        if done != 0:
            tl.store(Flags + (1 - par) * pairs + pair, done, mask=first)
        else:
            # 1. the stop point: prefix states of the wave's micro-batches, CHUNK per step
            jj = tl.arange(0, CHUNK)
            m_c = m0
            stopped = start * MB >= n_cand  # only a row without candidates stops before its first micro-batch
            nm = n_cand * 0  # micro-batches of this wave merged
            ch = n_cand * 0
            while (ch * CHUNK < size) & (stopped == 0):
                loc = ch * CHUNK + jj
                blocks = (start + loc + 1) * MB  # ranked blocks read once micro-batch `loc` is merged
                valid = (loc < size) & (blocks - MB < n_cand)
                mk = valid[:, None] & h_ok[None, :]
                ps = Part + ((pair * wave_max + loc).to(tl.int64) * 3 * BLOCK_H)[:, None] + hh[None, :]
                pm = tl.load(ps, mask=mk, other=float("-inf"))  # masked entries: the merge's identity
                pl = tl.load(ps + BLOCK_H, mask=mk, other=0.0)
                pb = tl.load(ps + 2 * BLOCK_H, mask=mk, other=float("inf"))
                pm, pl, pb = tl.associative_scan((pm, pl, pb), 0, _merge)
                pm, pl, pb = _merge(m_c[None, :], l_c[None, :], b_c[None, :], pm, pl, pb)
                n_left = tl.maximum(n_cand - blocks, 0).to(tl.float32)
                lse_acc = tl.where(pl > 0.0, pm + tl.log2(tl.where(pl > 0.0, pl, 1.0)), float("-inf"))
                ok = _passes(lse_acc, pb, n_left[:, None], log2_odds) | (hh >= HPG)[None, :]
                stop = valid & ((tl.min(ok.to(tl.int32), axis=1) > 0) | (blocks >= n_cand))
                k = tl.min(tl.where(stop, jj, CHUNK), axis=0)
                at = jj[:, None] == tl.minimum(k, CHUNK - 1)
                m_c = tl.max(tl.where(at, pm, float("-inf")), axis=0)
                l_c = tl.sum(tl.where(at, pl, 0.0), axis=0)
                b_c = tl.min(tl.where(at, pb, float("inf")), axis=0)
                stopped = k < CHUNK
                nm = tl.minimum(ch * CHUNK + tl.minimum(k + 1, CHUNK), size)
                ch += 1
            if LAST:  # a pair with more candidates than `ranked` is wide ends with it
                stopped = nm >= 0

            # 2. the output columns: the state's and the merged partials' acc, rescaled to the final max
            ms = tl.where(m_c == float("-inf"), 0.0, m_c)
            cols = c * COLS + tl.arange(0, COLS)
            sa = StateAcc + (pair * BLOCK_H + hh[:, None]).to(tl.int64) * HEAD_DIM + cols[None, :]
            acc = tl.load(sa, mask=h_ok[:, None], other=0.0) * tl.exp2(m0 - ms)[:, None]
            for t in range(0, tl.cdiv(nm, CHUNK)):
                loc = t * CHUNK + jj
                mk = (loc < nm)[:, None] & h_ok[None, :]
                slot = (pair * wave_max + loc).to(tl.int64)
                pm = tl.load(Part + (slot * 3 * BLOCK_H)[:, None] + hh[None, :], mask=mk, other=float("-inf"))
                pa = tl.load(PartAcc + ((slot * BLOCK_H)[:, None] + hh[None, :])[:, :, None] * HEAD_DIM
                             + cols[None, None, :], mask=mk[:, :, None], other=0.0)  # (CHUNK, BLOCK_H, COLS)
                acc += tl.sum(tl.exp2(pm - ms[None, :])[:, :, None] * pa, axis=0)

            if stopped:
                out, lse = online_softmax_finish(m_c, l_c, acc)
                head = g * HPG + hh
                tl.store(Out + n * stride_on + head[:, None] * stride_oh + cols[None, :], out.to(Out.dtype.element_ty),
                         mask=h_ok[:, None])
                tl.store(Lse + n * stride_ln + head, lse, mask=h_ok & first)
                tl.store(Count + n * stride_cn + g, tl.minimum((start + nm) * MB, n_cand), mask=first)
                tl.store(Flags + (1 - par) * pairs + pair, 1, mask=first)
            else:
                tl.store(sa, acc, mask=h_ok[:, None])
                tl.store(wr, m_c, mask=h_ok & first)
                tl.store(wr + pairs * BLOCK_H, l_c, mask=h_ok & first)
                tl.store(wr + 2 * pairs * BLOCK_H, b_c, mask=h_ok & first)
                tl.store(Flags + (1 - par) * pairs + pair, 0, mask=first)


def wave_plan(n_mb: int, first_wave: int, growth: int, max_wave: int | None = None) -> list[tuple[int, int]]:
    """(start, size) in micro-batches of each wave over [0, n_mb): sizes first_wave x growth^w, none above
    `max_wave` (the scratch cap), the last cut at n_mb. Never empty: with no micro-batch, one wave of size 0 still
    attends to the fixed keys."""
    cap = max_wave if max_wave is not None else n_mb
    waves, start, size = [], 0, first_wave
    while start < n_mb:
        take = max(1, min(size, cap, n_mb - start))
        waves.append((start, take))
        start, size = start + take, size * growth
    return waves or [(0, 0)]


def scratch_per_microbatch(pairs: int, heads_per_group: int, head_dim: int) -> int:
    """Bytes of partials one micro-batch of a wave takes for all (row, KV head) pairs: m, l, lse_min and the D-wide
    accumulator per head of a group (rounded up to a power of two >= 2), fp32."""
    return pairs * max(2, triton.next_power_of_2(heads_per_group)) * (3 + head_dim) * 4


def psa_decode_waves(q, k_cache, v_cache, block_tables, seq_lens, ranked, cand_lo: int, cand_hi, epsilon: float,
                     microbatch: int, scale: float, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                     counts: torch.Tensor | None = None, block_n: int = 64, num_warps: int = 4, first_wave: int = 32,
                     growth: int = 2, chunk: int = 32, merge_cols: int = 32, max_programs: int | None = None,
                     rope: tuple[torch.Tensor, int] | None = None, scratch_bytes: int = 512 << 20):
    """`psa_decode_triton` with the ranked blocks read in parallel waves (module docstring): same arguments and
    results. Tuning: `first_wave` micro-batches in the first wave, each next one `growth` times larger; the merge
    walks `chunk` partials per step and `merge_cols` output columns per program (powers of two). A wave launches at
    most `max_programs` programs per (row, KV head), each striding over the wave's micro-batches (default: about
    8 x the GPU's SMs in all, 1056 on an H100; a wave of 16,384 micro-batches at 1M would otherwise launch that many
    programs per pair, most of which only read a flag and leave). No wave is larger than `scratch_bytes` of partials
    allows (default 512 MiB: a batch of 256 on Llama-8B's shape at 128K would otherwise take 4.4 GB in its last
    wave); smaller waves only mean more launches, the results are the same."""
    kv, out, lse, counts, inputs, strides, meta = _prepare(q, k_cache, v_cache, block_tables, seq_lens, ranked,
                                                           cand_hi, epsilon, microbatch, out, lse, counts,
                                                           "psa_decode_waves", rope)
    n, D = q.shape[0], q.shape[2]
    pow2 = all(x >= 1 and not x & (x - 1) for x in (chunk, merge_cols))
    if first_wave < 1 or growth < 1 or not pow2 or chunk < 2 or (max_programs is not None and max_programs < 1) \
            or scratch_bytes < 1:
        raise ValueError(f"first_wave ({first_wave}) and growth ({growth}) must be >= 1, chunk ({chunk}) and "
                         f"merge_cols ({merge_cols}) powers of two (chunk >= 2), max_programs ({max_programs}) None "
                         f"or >= 1, scratch_bytes ({scratch_bytes}) >= 1")
    if n == 0:
        return out, lse, counts
    Hkv, hpg, cols = kv.num_kv_heads, meta["HPG"], min(merge_cols, D)
    block_h = max(2, triton.next_power_of_2(hpg))
    pairs = n * Hkv
    waves = wave_plan(-(-ranked.shape[2] // microbatch), first_wave, growth,
                      max(1, scratch_bytes // scratch_per_microbatch(pairs, hpg, D)))
    wave_max = max(size for _, size in waves)
    if max_programs is None:
        max_programs = max(1, 8 * sm_count(q.device) // pairs)
    f32 = dict(dtype=torch.float32, device=q.device)
    part = torch.empty(pairs, wave_max, 3, block_h, **f32)  # per micro-batch: m, l, lse_min per head
    part_acc = torch.empty(pairs, wave_max, block_h, D, **f32)
    state = torch.empty(2, 3, pairs, block_h, **f32)  # (parity, {m, l, lse_min}, pair, head)
    state_acc = torch.empty(pairs, block_h, D, **f32)
    flags = torch.empty(2, pairs, dtype=torch.int32, device=q.device)  # (parity, pair): stopped
    qk_scale, log2_odds = scale * math.log2(math.e), log_odds(epsilon) * math.log2(math.e)
    for w, (start, size) in enumerate(waves):
        first, last, par = w == 0, w == len(waves) - 1, w % 2
        _psa_wave_kernel[(min(size, max_programs) + first, n, Hkv)](  # strided micro-batches on axis 0
            *inputs, part, part_acc, state, state_acc, flags, *strides,
            qk_scale, cand_lo, rope[1] if rope else 0, start, size, wave_max, pairs, par,
            BLOCK_H=block_h, BLOCK_N=block_n, FIRST=first, num_warps=num_warps, num_stages=2, **meta,
        )
        _psa_wave_merge_kernel[(n, Hkv, D // cols)](
            cand_hi, part, part_acc, state, state_acc, flags, out, lse, counts,
            out.stride(0), out.stride(1), lse.stride(0), counts.stride(0),
            log2_odds, cand_lo, start, size, wave_max, pairs, par,
            HPG=hpg, BLOCK_H=block_h, MB=microbatch, HEAD_DIM=D, COLS=cols, CHUNK=chunk, FIRST=first, LAST=last,
            num_warps=num_warps,
        )
    return out, lse, counts
