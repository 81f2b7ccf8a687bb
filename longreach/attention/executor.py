"""Block-sparse attention over the paged KV cache, in plain PyTorch: the reference the Triton kernels must match.

For every query block of a `SparseIndex` it gathers the sink, the block's window span and the selected key blocks
(through the block table), masks each query row to exactly the keys the index gives it (see index.py: the three
parts are disjoint and causal), and computes exact softmax attention in fp32. Vectorised over query blocks, heads and
keys; query blocks are processed in slices so that the score tensor stays within `max_bytes`.
Returns out (T, H_q, D) in q's dtype and the log-sum-exp (T, H_q) fp32 (natural log; -inf for a row with no key).
"""
from __future__ import annotations

import torch

from ..kernels.index_types import head_pairs
from ..rope.strategies import RopeArgs, attend_key_pos, attend_query_pos, rotate
from .index import SparseIndex


def block_sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, index: SparseIndex, scale: float,
                           max_bytes: int = 256 << 20, rope: RopeArgs | None = None, need_lse: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rope`: remap the positions of far keys (rope/strategies.py, attention strategies) for query blocks ending
    at or past rope.rope_from; None or mode "none" keeps true positions.

    Strategy "cache" (a bounded cache, attention/cascading/): keys are stored un-rotated and each is rotated at its
    position; queries are used as given.

    `need_lse=False` (the engine on CPU): the softmax runs as one fused SDPA call per slice over the same keys and
    mask, and lse comes back None. With remapped positions the far and near scores are two dot products; they become
    one by concatenating [q_far, q] against [k_far, 0] for far keys and [0, k] for near ones. Tested against the
    explicit softmax (tests/test_sparse.py)."""
    from ..kernels.kv_layout import as_tensor

    # two tiers (offloading) resolved, fp8 rows dequantised: plain values for the reference
    k_cache, v_cache = as_tensor(k_cache, q.dtype), as_tensor(v_cache, q.dtype)
    T, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    dev = q.device
    qb = index.queries
    BQ, BK, S, W, G = index.block_q, index.block_k, index.n_sink, index.n_window, index.groups
    pairs, hpp = head_pairs(Hq, Hkv, G)
    P = len(pairs)
    pair_group = torch.tensor([g for g, _ in pairs], device=dev)
    pair_kv = torch.tensor([kv for _, kv in pairs], device=dev)
    n_win = BQ + W - 1 if W > 0 else 0
    NK = S + n_win + index.max_blocks * BK
    out = torch.zeros(T, Hq, D, dtype=q.dtype, device=dev)
    lse = torch.full((T, Hq), float("-inf"), dtype=torch.float32, device=dev)
    per_block = Hq * BQ * NK * 4 * 3 + P * NK * D * 4 * 2  # scores/probs/masks + gathered K/V, fp32
    step = max(1, int(max_bytes // per_block))
    k_flat = k_cache.reshape(-1, Hkv, D)
    v_flat = v_cache.reshape(-1, Hkv, D)
    for lo in range(0, qb.num_blocks, step):
        sl = slice(lo, min(lo + step, qb.num_blocks))
        n = sl.stop - sl.start
        seq = torch.tensor(qb.seq[sl], device=dev)
        start = torch.tensor(qb.start[sl], device=dev)
        length = torch.tensor(qb.length[sl], device=dev)
        pos0 = torch.tensor(qb.pos[sl], device=dev)
        r = torch.arange(BQ, device=dev)
        row_ok = r[None, :] < length[:, None]  # (n, BQ)
        row_pos = pos0[:, None] + r[None, :]  # (n, BQ)

        # key positions (n, G, NK): sink | window span of the block | selected blocks
        parts = [torch.arange(S, device=dev).expand(n, S)]
        if n_win:
            parts.append(pos0[:, None] - W + 1 + torch.arange(n_win, device=dev)[None, :])
        shared = torch.cat(parts, dim=1) if parts else torch.empty(n, 0, dtype=torch.long, device=dev)
        ids = index.blocks[sl].long()  # (n, G, MAXK)
        sel = (ids[..., None] * BK + torch.arange(BK, device=dev)).reshape(n, G, -1)
        sel_ok = (ids >= 0)[..., None].expand(n, G, index.max_blocks, BK).reshape(n, G, -1)
        kpos = torch.cat([shared[:, None, :].expand(n, G, shared.shape[1]), sel], dim=2)  # (n, G, NK)

        # which key each row may read (n, G, BQ, NK)
        p = row_pos[:, None, :, None]
        k = kpos[:, :, None, :]
        is_sink = torch.zeros(NK, dtype=torch.bool, device=dev)
        is_sink[:S] = True
        is_win = torch.zeros(NK, dtype=torch.bool, device=dev)
        is_win[S:S + n_win] = True
        ok_sink = is_sink & (k <= p)
        ok_win = is_win & (k >= torch.clamp(p - W + 1, min=S)) & (k <= p) & (k >= 0)
        ok_sel = ~(is_sink | is_win) & torch.cat(
            [torch.zeros(n, G, S + n_win, dtype=torch.bool, device=dev), sel_ok], dim=2)[:, :, None, :] \
            & (k >= S) & (k <= p - W)
        allowed = (ok_sink | ok_win | ok_sel) & row_ok[:, None, :, None]

        # gather keys/values through the block tables: (n, P, NK, D)
        kp = kpos[:, pair_group]  # (n, P, NK)
        last = (pos0 + length - 1)[:, None, None]
        safe = torch.minimum(kp.clamp(min=0), last)  # masked positions still need a readable slot
        slots = block_tables[seq].long().gather(1, (safe // page).reshape(n, -1)).reshape(kp.shape) * page + safe % page
        kv_idx = pair_kv[None, :, None].expand_as(slots)
        kk = k_flat[slots, kv_idx].float()
        vv = v_flat[slots, kv_idx].float()

        if rope is not None and rope.mode == "cache":  # keys stored un-rotated: each at its position
            kk = rotate(kk, kp, rope.inv_freq)
        rows = (start[:, None] + r[None, :]).clamp(max=T - 1)  # (n, BQ)
        qq = q[rows].float().reshape(n, BQ, P, hpp, D).permute(0, 2, 3, 1, 4)  # (n, P, hpp, BQ, D)
        remap = (pos0 + length - 1 >= rope.rope_from)[:, None, None] if rope is not None else None  # (n, 1, 1)
        moved = rope is not None and rope.mode not in ("none", "cache") and bool(remap.any())
        mask = allowed[:, pair_group][:, :, None]  # (n, P, 1, BQ, NK)
        if moved:  # far keys and the queries facing them move; the window stays (skipped when no block moves)
            q_far, k_far, far = _moved(rope, qq, kk, kp, row_pos, is_sink, is_win, remap, index, sl, pair_group,
                                       S, n_win, W)
        if need_lse:  # the reference: explicit softmax
            s = torch.einsum("npiqd,npkd->npiqk", qq, kk) * scale
            if moved:
                s = torch.where(far, torch.einsum("npiqd,npkd->npiqk", q_far, k_far) * scale, s)
            s = s.masked_fill(~mask, float("-inf"))
            m = s.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = torch.exp(s - m)
            denom = e.sum(dim=-1, keepdim=True)
            o = torch.einsum("npiqk,npkd->npiqd", e, vv) / denom.clamp(min=1e-30)
            lse[rows[row_ok]] = (m + denom.log()).squeeze(-1).permute(0, 3, 1, 2).reshape(n, BQ, Hq)[row_ok]
        else:  # the engine on CPU: one fused SDPA call, same keys and mask
            if moved:
                qq = torch.cat([q_far, qq], dim=-1)
                kk = torch.cat([k_far * far[:, None], kk * (~far)[:, None]], dim=-1)
                vv = torch.nn.functional.pad(vv, (0, D))  # the fused kernel wants one head size for q, k and v
            o = torch.nn.functional.scaled_dot_product_attention(  # 4-D: the fused CPU kernel takes no 3-D input
                qq.reshape(n * P, 1, hpp * BQ, -1), kk.reshape(n * P, 1, NK, -1), vv.reshape(n * P, 1, NK, -1),
                attn_mask=mask.expand(n, P, hpp, BQ, NK).reshape(n * P, 1, hpp * BQ, NK), scale=scale)
            o = torch.nan_to_num(o[..., :D].reshape(n, P, hpp, BQ, D), nan=0.0)  # a row with no key: 0, as explicit
        out[rows[row_ok]] = o.permute(0, 3, 1, 2, 4).reshape(n, BQ, Hq, D)[row_ok].to(q.dtype)
    return out, (lse if need_lse else None)


def _moved(rope, qq, kk, kp, row_pos, is_sink, is_win, remap, index, sl, pair_group, S, n_win, W):
    """Queries and keys rotated to the strategy's positions for the far (sink + selected) keys, and the far mask."""
    NK = kk.shape[2]
    slot = torch.arange(NK, device=kk.device)
    far = ~is_win
    new_k = attend_key_pos(rope.mode, kp, is_sink.expand_as(kp), (slot - S - n_win).expand_as(kp), S, rope.group)
    dk = torch.where(remap & far, new_k - kp, 0)
    sel_tokens = (index.counts[sl].long() * index.block_k)[:, pair_group][..., None]  # (n, P, 1)
    new_q = attend_query_pos(rope.mode, row_pos[:, None, :], S, sel_tokens, W, rope.group)  # (n, P, BQ)
    dq = torch.where(remap, new_q - row_pos[:, None, :], 0)
    return rotate(qq, dq[:, :, None, :], rope.inv_freq), rotate(kk, dk, rope.inv_freq), far


def range_attention(q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor, index, scale: float,
                    max_bytes: int = 256 << 20, need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over a `RangeIndex` (index.py: key tiles + key columns per query block, causal per row), in plain
    PyTorch: the reference of kernels/vertical_slash.py. Same conventions as `block_sparse_attention`: out (T, H_q, D)
    in q's dtype and lse (T, H_q) fp32 (natural log, -inf for a row with no key); `need_lse=False` runs one fused SDPA
    call per slice over the same keys and mask. Caches may be two-tier or fp8 (resolved to plain values here)."""
    from ..kernels.kv_layout import as_tensor

    k_cache, v_cache = as_tensor(k_cache, q.dtype), as_tensor(v_cache, q.dtype)
    T, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    dev = q.device
    qb = index.queries
    BQ, TW, G = index.block_q, index.tile, index.groups
    pairs, hpp = head_pairs(Hq, Hkv, G)
    P = len(pairs)
    pair_group = torch.tensor([g for g, _ in pairs], device=dev)
    pair_kv = torch.tensor([kv for _, kv in pairs], device=dev)
    NK = index.max_tiles * TW + index.max_columns
    out = torch.zeros(T, Hq, D, dtype=q.dtype, device=dev)
    lse = torch.full((T, Hq), float("-inf"), dtype=torch.float32, device=dev)
    if NK == 0:  # nothing listed anywhere: every row reads no key
        return out, (lse if need_lse else None)
    per_block = Hq * BQ * max(NK, 1) * 4 * 3 + P * max(NK, 1) * D * 4 * 2
    step = max(1, int(max_bytes // per_block))
    k_flat, v_flat = k_cache.reshape(-1, Hkv, D), v_cache.reshape(-1, Hkv, D)
    r = torch.arange(BQ, device=dev)
    for lo in range(0, qb.num_blocks, step):
        sl = slice(lo, min(lo + step, qb.num_blocks))
        n = sl.stop - sl.start
        seq = torch.tensor(qb.seq[sl], device=dev)
        start = torch.tensor(qb.start[sl], device=dev)
        length = torch.tensor(qb.length[sl], device=dev)
        pos0 = torch.tensor(qb.pos[sl], device=dev)
        row_ok = r[None, :] < length[:, None]  # (n, BQ)
        row_pos = pos0[:, None] + r[None, :]
        # key positions (n, G, NK): every tile as TW slots, then the columns
        t = index.tiles[sl].long()  # (n, G, MAXT, 2)
        tpos = t[..., :1] + torch.arange(TW, device=dev)  # (n, G, MAXT, TW)
        t_ok = (t[..., :1] >= 0) & (tpos < t[..., 1:])
        cols = index.columns[sl].long()
        kpos = torch.cat([tpos.reshape(n, G, -1), cols], dim=2)
        k_ok = torch.cat([t_ok.reshape(n, G, -1), cols >= 0], dim=2)
        allowed = k_ok[:, :, None, :] & (kpos[:, :, None, :] <= row_pos[:, None, :, None]) \
            & row_ok[:, None, :, None]  # (n, G, BQ, NK)
        kp = kpos[:, pair_group]  # (n, P, NK)
        last = (pos0 + length - 1)[:, None, None]
        safe = torch.minimum(kp.clamp(min=0), last)
        slots = block_tables[seq].long().gather(1, (safe // page).reshape(n, -1)).reshape(kp.shape) * page + safe % page
        kv_idx = pair_kv[None, :, None].expand_as(slots)
        kk, vv = k_flat[slots, kv_idx].float(), v_flat[slots, kv_idx].float()  # (n, P, NK, D)
        rows = (start[:, None] + r[None, :]).clamp(max=T - 1)
        qq = q[rows].float().reshape(n, BQ, P, hpp, D).permute(0, 2, 3, 1, 4)  # (n, P, hpp, BQ, D)
        mask = allowed[:, pair_group][:, :, None]  # (n, P, 1, BQ, NK)
        if need_lse:
            s = torch.einsum("npiqd,npkd->npiqk", qq, kk) * scale
            s = s.masked_fill(~mask, float("-inf"))
            m = s.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = torch.exp(s - m)
            denom = e.sum(dim=-1, keepdim=True)
            o = torch.einsum("npiqk,npkd->npiqd", e, vv) / denom.clamp(min=1e-30)
            lse[rows[row_ok]] = (m + denom.log()).squeeze(-1).permute(0, 3, 1, 2).reshape(n, BQ, Hq)[row_ok]
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                qq.reshape(n * P, 1, hpp * BQ, D), kk.reshape(n * P, 1, NK, D), vv.reshape(n * P, 1, NK, D),
                attn_mask=mask.expand(n, P, hpp, BQ, NK).reshape(n * P, 1, hpp * BQ, NK), scale=scale)
            o = torch.nan_to_num(o.reshape(n, P, hpp, BQ, D), nan=0.0)
        out[rows[row_ok]] = o.permute(0, 3, 1, 2, 4).reshape(n, BQ, Hq, D)[row_ok].to(q.dtype)
    return out, (lse if need_lse else None)
