"""The cascading cache's small per-layer work on the GPU, in few launches instead of many PyTorch ops
(attention/cascading/ runs it once per layer and stride; a 1M-token prefill with stride 4,096 has 7,680 of those on
SmolLM2, a decode step one per layer): the importance EMA, the stride plan's rules 3/4 and the slot moves in three
launches instead of ~10 ops per ring level, and the step's RoPE work in one launch instead of ~20 ops.

  * `_insert_kernel`, grid (KV heads,): one program per KV head, which owns column h of the layer's importance, so
    the program may update it and then read it back after a barrier. It
      1. applies the EMA: score[slot, h] <- decay * score[slot, h] + mass[b, h, v] for the stride's cached and new
         slots (attention/cascading/: `SubStride.ema_*`);
      2. walks the packed plan (cascade_plan.py: `BatchPlan`) level by level, exactly as `execute_plan` does:
         the old ring tokens a level reads and its accepted entries, each replaced by its challenger where the
         challenger is strictly more important (rule 4), form the level's pool; the written slots take
         pool[src_idx], the next level's offers pool[out_idx]. Scratch rows `cur` and `pool` per head hold the
         level's tokens (as flat slots); a `tl.debug_barrier` separates a level's writes from the reads after them.
    Output: src (w, H), the source slot of every written slot per head (`BatchPlan.dst` gives the destinations).
  * `_move_kernel`, grid (write tiles, KV heads), launched twice: phase 0 gathers the K and V rows, importance and
    positions of every source into temporaries, phase 1 scatters them to the destinations. Two launches because a
    source slot may be another move's destination (ring slots are reused within a stride): every read must come
    before every write, which one grid cannot order.
  * `_rope_kernel`, grid (rows,): a row's keys un-rotated from its true position (the model stored them rotated)
    into its cache slot, with the slot's position, and its queries un-rotated and rotated to the row's virtual
    position; the cos/sin tables are the step's (built once for all layers).

References: `cascade_insert_reference` (the EMA in torch + `execute_plan`), `cascade_plan.apply_moves` and
`cascade_rope_reference`, which are also the CPU path. Tested in the interpreter (tests/test_cascading_backend.py)
in fp32 and fp16 rows; the GPU (bf16, real sizes) check is tests/gpu/test_cascading.py::test_cascading_insert. The
EMA may round differently from torch on a GPU (the compiler may fuse the multiply-add), so a near-tie there can
resolve the other way: the check compares the sources against the rules applied to the kernel's own importances.
"""
from __future__ import annotations

import torch

from .cascade_plan import PLAN_FIELDS, BatchPlan, execute_plan

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def cascade_insert_reference(plan: BatchPlan, score: torch.Tensor, mass: torch.Tensor, ema_slots: torch.Tensor,
                             ema_key: torch.Tensor, ema_decay: torch.Tensor) -> torch.Tensor:
    """score (num_slots, H) fp32, updated in place; mass (B, H, V_max) fp32 (kernels/key_mass.py); ema_slots /
    ema_key (K,) int64: the slots whose importance this stride updates and their key (b * V_max + v); ema_decay (K,)
    fp32 -> src (w, H) int64 (the destinations are plan.dst)."""
    H = score.shape[1]
    gained = mass.permute(0, 2, 1).reshape(-1, H)[ema_key]
    score[ema_slots] = ema_decay[:, None] * score[ema_slots] + gained
    return execute_plan(plan, score)[1]


def cascade_rope_reference(q: torch.Tensor, k: torch.Tensor, k_slots: torch.Tensor, pos_slots: torch.Tensor,
                           slot_mapping: torch.Tensor, pos32: torch.Tensor, unrot: tuple, virt: tuple) -> torch.Tensor:
    """q (T, H_q, D), k (T, H_kv, D) rotated by the model at the rows' true positions; k_slots (num_slots, H_kv, D)
    and pos_slots (num_slots, H_kv) int32 written in place at slot_mapping (T,): the keys un-rotated, the positions
    pos32 (T, 1); unrot / virt: (cos, sin) tables (T, 1, D/2) that un-rotate a row and rotate it to its virtual
    position. Returns the queries at their virtual positions, in q's dtype."""
    from ..rope.strategies import rotate_cs

    k_slots[slot_mapping] = rotate_cs(k, *unrot).to(k_slots.dtype)
    pos_slots[slot_mapping] = pos32
    return rotate_cs(rotate_cs(q, *unrot), *virt).to(q.dtype)


if triton is not None:

    @triton.jit
    def _rot(x1, x2, c, s):
        """(x1 c - x2 s, x2 c + x1 s): rope/strategies.py's rotate_cs on the two halves of rows."""
        return x1 * c - x2 * s, x2 * c + x1 * s

    @triton.jit
    def _rope_kernel(Q, K, KS, PS, Slots, Pos, UC, US, VC, VS, QOut,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_ks, stride_ksh, stride_ps, stride_ot,
                     stride_oh, n_q, n_kv,
                     BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF)
        uc = tl.load(UC + t * HALF + d)[None, :]
        us = tl.load(US + t * HALF + d)[None, :]
        # keys: un-rotated into the row's slot, with its position
        hk = tl.arange(0, BLOCK_HKV)
        okk = (hk < n_kv)[:, None]
        kp = K + t * stride_kt + hk[:, None] * stride_kh + d[None, :]
        k1, k2 = _rot(tl.load(kp, mask=okk, other=0.0).to(tl.float32),
                      tl.load(kp + HALF, mask=okk, other=0.0).to(tl.float32), uc, us)
        slot = tl.load(Slots + t).to(tl.int64)
        ks = KS + slot * stride_ks + hk[:, None] * stride_ksh + d[None, :]
        tl.store(ks, k1.to(KS.dtype.element_ty), mask=okk)
        tl.store(ks + HALF, k2.to(KS.dtype.element_ty), mask=okk)
        tl.store(PS + slot * stride_ps + hk, tl.full([BLOCK_HKV], 0, tl.int32) + tl.load(Pos + t), mask=hk < n_kv)
        # queries: un-rotated, then rotated to the row's virtual position
        hq = tl.arange(0, BLOCK_HQ)
        okq = (hq < n_q)[:, None]
        qp = Q + t * stride_qt + hq[:, None] * stride_qh + d[None, :]
        q1, q2 = _rot(tl.load(qp, mask=okq, other=0.0).to(tl.float32),
                      tl.load(qp + HALF, mask=okq, other=0.0).to(tl.float32), uc, us)
        q1, q2 = _rot(q1, q2, tl.load(VC + t * HALF + d)[None, :], tl.load(VS + t * HALF + d)[None, :])
        op = QOut + t * stride_ot + hq[:, None] * stride_oh + d[None, :]
        tl.store(op, q1.to(QOut.dtype.element_ty), mask=okq)
        tl.store(op + HALF, q2.to(QOut.dtype.element_ty), mask=okq)

    @triton.jit
    def _resolve(Score, stride_s, h, Cur, base, chal, ok):
        """The token each place keeps: `base`, or the offer `chal` indexes where it is strictly more important."""
        has = ok & (chal >= 0)
        c = tl.load(Cur + chal, mask=has, other=0)
        s_base = tl.load(Score + base * stride_s + h, mask=ok, other=0.0)
        s_chal = tl.load(Score + c * stride_s + h, mask=has, other=0.0)
        return tl.where(has & (s_chal > s_base), c, base)

    @triton.jit
    def _insert_kernel(Score, Mass, EmaSlots, EmaKey, EmaDecay, Plan, Cur, Pool, Src,
                       stride_s, stride_mb, stride_mh, n_ema, vmax, n_levels, off_offers, n_offers, off_dst,
                       cur_cap, pool_cap, n_heads,
                       FIELDS: tl.constexpr, BLOCK: tl.constexpr):
        h = tl.program_id(0)
        i_blk = tl.arange(0, BLOCK)
        # 1. the importance EMA of this stride's slots, column h
        for i0 in range(0, n_ema, BLOCK):
            i = i0 + i_blk
            ok = i < n_ema
            slot = tl.load(EmaSlots + i, mask=ok, other=0)
            key = tl.load(EmaKey + i, mask=ok, other=0)
            dec = tl.load(EmaDecay + i, mask=ok, other=0.0)
            gained = tl.load(Mass + (key // vmax) * stride_mb + h * stride_mh + key % vmax, mask=ok, other=0.0)
            old = tl.load(Score + slot * stride_s + h, mask=ok, other=0.0)
            tl.store(Score + slot * stride_s + h, dec * old + gained, mask=ok)
        # level 0's offers: the stride's staged tokens, the same in every head
        cur = Cur + h.to(tl.int64) * cur_cap
        pool = Pool + h.to(tl.int64) * pool_cap
        for i0 in range(0, n_offers, BLOCK):
            i = i0 + i_blk
            ok = i < n_offers
            tl.store(cur + i, tl.load(Plan + off_offers + i, mask=ok, other=0), mask=ok)
        tl.debug_barrier()
        # 2. the plan, level by level (cascade_plan.py: execute_plan)
        for j in range(n_levels):
            hdr = Plan + j * FIELDS
            A = tl.load(hdr + 1).to(tl.int32)
            r = tl.load(hdr + 2).to(tl.int32)
            k = tl.load(hdr + 3).to(tl.int32)
            w = tl.load(hdr + 4).to(tl.int32)
            o_pidx = tl.load(hdr + 5).to(tl.int32)
            o_cidx = tl.load(hdr + 6).to(tl.int32)
            o_old = tl.load(hdr + 7).to(tl.int32)
            o_chal = tl.load(hdr + 8).to(tl.int32)
            o_out = tl.load(hdr + 9).to(tl.int32)
            o_src = tl.load(hdr + 10).to(tl.int32)
            w_at = tl.load(hdr + 11).to(tl.int32) - off_dst  # first row of src: dst is packed level by level
            for i0 in range(0, r, BLOCK):  # old ring tokens the level reads (the newest may be challenged)
                i = i0 + i_blk
                ok = i < r
                base = tl.load(Plan + o_old + i, mask=ok, other=0)
                chal = tl.load(Plan + o_chal + i, mask=ok, other=-1)
                tl.store(pool + i, _resolve(Score, stride_s, h, cur, base, chal, ok), mask=ok)
            for i0 in range(0, A, BLOCK):  # accepted entries, each challenged by the odd offer after it
                i = i0 + i_blk
                ok = i < A
                p = tl.load(Plan + o_pidx + i, mask=ok, other=0)
                base = tl.load(cur + p, mask=ok, other=0)
                chal = tl.load(Plan + o_cidx + i, mask=ok, other=-1)
                tl.store(pool + r + i, _resolve(Score, stride_s, h, cur, base, chal, ok), mask=ok)
            tl.debug_barrier()
            for i0 in range(0, w, BLOCK):  # written slots take pool[src_idx]
                i = i0 + i_blk
                ok = i < w
                s = tl.load(Plan + o_src + i, mask=ok, other=0)
                tl.store(Src + (w_at + i) * n_heads + h, tl.load(pool + s, mask=ok, other=0), mask=ok)
            for i0 in range(0, k, BLOCK):  # tokens leaving the ring: the next level's offers
                i = i0 + i_blk
                ok = i < k
                s = tl.load(Plan + o_out + i, mask=ok, other=0)
                tl.store(cur + i, tl.load(pool + s, mask=ok, other=0), mask=ok)
            tl.debug_barrier()

    @triton.jit
    def _move_kernel(Dst, Src, K, V, Score, Pos, TK, TV, TS, TP, w, n_heads,
                     stride_ks, stride_kh, stride_vs, stride_vh, stride_s, stride_p,
                     PHASE: tl.constexpr, BLOCK_W: tl.constexpr, HEAD_DIM: tl.constexpr):
        i = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
        h = tl.program_id(1)
        ok = i < w
        d = tl.arange(0, HEAD_DIM)
        t = (i * n_heads + h).to(tl.int64)  # temporaries are (w, H, ...)
        if PHASE == 0:  # gather every source, as the state was before the stride
            s = tl.load(Src + t, mask=ok, other=0)
            kr = tl.load(K + s[:, None] * stride_ks + h * stride_kh + d[None, :], mask=ok[:, None])
            vr = tl.load(V + s[:, None] * stride_vs + h * stride_vh + d[None, :], mask=ok[:, None])
            tl.store(TK + t[:, None] * HEAD_DIM + d[None, :], kr, mask=ok[:, None])
            tl.store(TV + t[:, None] * HEAD_DIM + d[None, :], vr, mask=ok[:, None])
            tl.store(TS + t, tl.load(Score + s * stride_s + h, mask=ok), mask=ok)
            tl.store(TP + t, tl.load(Pos + s * stride_p + h, mask=ok), mask=ok)
        else:  # scatter to the destinations
            dst = tl.load(Dst + i, mask=ok, other=0)
            kr = tl.load(TK + t[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None])
            vr = tl.load(TV + t[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None])
            tl.store(K + dst[:, None] * stride_ks + h * stride_kh + d[None, :], kr, mask=ok[:, None])
            tl.store(V + dst[:, None] * stride_vs + h * stride_vh + d[None, :], vr, mask=ok[:, None])
            tl.store(Score + dst * stride_s + h, tl.load(TS + t, mask=ok), mask=ok)
            tl.store(Pos + dst * stride_p + h, tl.load(TP + t, mask=ok), mask=ok)


def cascade_insert_triton(plan: BatchPlan, score: torch.Tensor, mass: torch.Tensor, ema_slots: torch.Tensor,
                          ema_key: torch.Tensor, ema_decay: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Triton version of `cascade_insert_reference` (same arguments and result; score updated in place)."""
    if triton is None:
        raise RuntimeError("cascade_insert_triton needs Triton")
    H = score.shape[1]
    if score.dtype != torch.float32 or score.stride(1) != 1 or mass.dtype != torch.float32 or mass.stride(2) != 1:
        raise ValueError("score (num_slots, H) and mass (B, H, V) must be fp32 with unit stride in the last dimension")
    if not ema_slots.shape == ema_key.shape == ema_decay.shape:
        raise ValueError(f"ema_slots, ema_key and ema_decay must have one shape, got {tuple(ema_slots.shape)}, "
                         f"{tuple(ema_key.shape)}, {tuple(ema_decay.shape)}")
    dev = score.device
    w = plan.dst.shape[0]
    src = torch.empty(w, H, dtype=torch.int64, device=dev)
    cur = torch.empty(H, max(1, plan.cur_cap), dtype=torch.int64, device=dev)
    pool = torch.empty(H, max(1, plan.pool_cap), dtype=torch.int64, device=dev)
    _insert_kernel[(H,)](
        score, mass, ema_slots, ema_key, ema_decay.float(), plan.packed, cur, pool, src,
        score.stride(0), mass.stride(0), mass.stride(1), ema_slots.shape[0], max(1, mass.shape[2]),
        len(plan.levels), plan.offers_at, plan.offers.shape[0], plan.dst_at,
        cur.shape[1], pool.shape[1], H,
        FIELDS=PLAN_FIELDS, BLOCK=block, num_warps=4,
    )
    return src


def move_rows_triton(dst: torch.Tensor, src: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: torch.Tensor,
                     pos: torch.Tensor, block_w: int = 32) -> None:
    """Triton version of `apply_moves(dst, src, (k, v, score, pos))`: k, v (num_slots, H, D) with unit stride in D
    (D a power of two); score (num_slots, H) fp32, pos (num_slots, H) int32."""
    if triton is None:
        raise RuntimeError("move_rows_triton needs Triton")
    w, H = src.shape
    D = k.shape[-1]
    if w == 0:
        return
    if D & (D - 1) or k.stride(-1) != 1 or v.stride(-1) != 1 or v.shape[-1] != D:
        raise ValueError(f"k and v rows must be contiguous with a power-of-two size, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    tk = torch.empty(w, H, D, dtype=k.dtype, device=k.device)
    tv = torch.empty(w, H, D, dtype=v.dtype, device=v.device)
    ts = torch.empty(w, H, dtype=score.dtype, device=k.device)
    tp = torch.empty(w, H, dtype=pos.dtype, device=k.device)
    src = src.contiguous()
    for phase in (0, 1):
        _move_kernel[(triton.cdiv(w, block_w), H)](
            dst, src, k, v, score, pos, tk, tv, ts, tp, w, H,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), score.stride(0), pos.stride(0),
            PHASE=phase, BLOCK_W=block_w, HEAD_DIM=D, num_warps=4,
        )


def cascade_rope_triton(q: torch.Tensor, k: torch.Tensor, k_slots: torch.Tensor, pos_slots: torch.Tensor,
                        slot_mapping: torch.Tensor, pos32: torch.Tensor, unrot: tuple, virt: tuple) -> torch.Tensor:
    """Triton version of `cascade_rope_reference` (same arguments and result)."""
    if triton is None:
        raise RuntimeError("cascade_rope_triton needs Triton")
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if D & (D - 1) or D < 4 or q.stride(-1) != 1 or k.stride(-1) != 1 or k_slots.stride(-1) != 1:
        raise ValueError(f"q, k and the cache rows must be contiguous with a power-of-two head_dim, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    tables = [x.reshape(T, D // 2).float().contiguous() for x in (*unrot, *virt)]
    _rope_kernel[(T,)](
        q, k, k_slots, pos_slots, slot_mapping, pos32.reshape(T).to(torch.int32).contiguous(), *tables, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k_slots.stride(0), k_slots.stride(1),
        pos_slots.stride(0), out.stride(0), out.stride(1), Hq, Hkv,
        BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HKV=triton.next_power_of_2(Hkv), HALF=D // 2, num_warps=4,
    )
    return out
