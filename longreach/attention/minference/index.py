"""MInference's online index building (MInference 1.0, §4.4 Alg. 2-4): key ranges and columns per query block.

Pure functions over tensors; method.py decides which head group uses which pattern and packs the
result into a `RangeIndex`. Shapes: nb query blocks of one sequence, G selection groups, B = the block size (64 in the
paper: query rows per block, key tile width and block-sparse block size).

  Λ-shape (a_shape, n_sink, n_local): ranges [0, n_sink) and the n_local keys ending at the block's last row.
      Per block, not per row: a block's first row reads n_local - B + 1 local keys, its last row n_local (the
      paper's static block mask).
  vertical-slash (vertical_slash, k_v, k_s), Alg. 2 and 4: from the last `last_q` queries of the estimation segment,
      Â = softmax(q kᵀ/√d + causal); a key column's score is its column sum of Â, a diagonal's (offset o = i - j)
      the sum of Â along it. The top k_v columns and top k_s offsets are kept (offset 0, the main diagonal, always:
      every row must read at least itself). For query block [p0, p0 + n) a slash o covers keys
      [p0 - o, p0 + n - o) (clipped at 0) — the one B-wide range that holds its diagonal segment; ranges are merged
      where they touch or overlap (the point-range merge, vectorised: sort the ranges by start, a new run starts
      where a start exceeds every earlier end). Verticals inside a merged range or past the block's last row are
      dropped; the rest stay columns.
  block-sparse (block_sparse, k_b), Alg. 3: mean-pool each query block's rows and each B-aligned key block,
      Â = softmax(q̂ k̂ᵀ/√d + causal over blocks), the top k_b key blocks per query block (per block row, §8.8),
      always including key block 0 and the block on the diagonal.
Counting (settled here, the paper is silent): with several heads per selection group (granularity kv_head), scores
are the *sum* of the group's heads' softmax probabilities, so every head weighs the same. Every count k is a number
of distinct items (columns, offsets, blocks); an item that does not exist yet for a block (a column past its last row,
a slash that ends before key 0) is skipped, not replaced.
Ranges are split into tiles of at most B keys (`ranges_to_tiles`) for the kernel.
"""
from __future__ import annotations

import torch

_BIG = torch.iinfo(torch.int32).max


def key_chunks(keys, length: int, chunk: int = 1 << 16):
    """Yield (first position, (n, H_kv, D) keys) over positions [0, length) of one sequence, `chunk` at a time.

    `keys`: a plain (L, H_kv, D) tensor, or (k_cache, block_table) of the paged (or two-tier, or fp8) cache."""
    from ...kvcache.paged import gather_tokens

    if isinstance(keys, torch.Tensor):
        for s in range(0, length, chunk):
            yield s, keys[s:min(length, s + chunk)]
        return
    cache, table = keys
    page = cache.shape[1]
    chunk = max(page, chunk // page * page)
    for s in range(0, length, chunk):
        yield s, gather_tokens(cache, table[s // page:], min(chunk, length - s))


def vs_scores(q_est: torch.Tensor, est_pos0: int, keys, scale: float, groups: int, chunk: int = 1 << 15
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash scores of MInference's estimation (Alg. 2), summed over each group's heads.

    q_est (n, H_q, D): the estimation queries, consecutive positions est_pos0.. est_pos0 + n - 1 (RoPE applied);
    keys: see `key_chunks`, covering positions [0, est_pos0 + n). Returns (vertical (G, L), slash (G, L)) fp32 with
    L = est_pos0 + n: vertical[g, j] = sum over rows and heads of Â[r, j]; slash[g, o] = sum of Â[r, p_r - o]."""
    n, Hq, D = q_est.shape
    L = est_pos0 + n
    dev = q_est.device
    pos = est_pos0 + torch.arange(n, device=dev)
    qf = None

    def scores(s0, kc):  # (H_q, n, c) masked scores of one key chunk, the heads of a KV group in one matmul
        nonlocal qf
        kf = kc.to(device=dev, dtype=torch.float32).transpose(0, 1)  # (H_kv, c, D)
        if qf is None:  # the scale folded into q: one pass less over the scores
            qf = (q_est.float() * scale).transpose(0, 1).reshape(kf.shape[0], -1, D)  # (H_kv, gqa * n, D)
        s = torch.matmul(qf, kf.transpose(1, 2)).view(Hq, n, -1)
        j = s0 + torch.arange(kf.shape[1], device=dev)
        if s0 + kf.shape[1] - 1 > est_pos0:  # only chunks reaching past the first row need the causal mask
            s.masked_fill_(j[None, None, :] > pos[None, :, None], float("-inf"))
        return s, j

    # two passes over the keys: the rows' log-sum-exp, then the probabilities (memory: one chunk of scores)
    lse = torch.full((Hq, n), float("-inf"), device=dev)
    for s0, kc in key_chunks(keys, L, chunk):
        lse = torch.logaddexp(lse, torch.logsumexp(scores(s0, kc)[0], -1))
    vertical = torch.zeros(Hq, L, device=dev)
    slash = torch.zeros(Hq, L, device=dev)
    for s0, kc in key_chunks(keys, L, chunk):
        s, j = scores(s0, kc)
        p = s.sub_(lse[..., None]).exp_()  # (H_q, n, c); 0 where masked
        vertical[:, s0:s0 + kc.shape[0]] = p.sum(1)
        off = (pos[:, None] - j[None, :]).clamp(min=0)  # (n, c): masked entries carry p = 0
        slash.scatter_add_(1, off.reshape(1, -1).expand(Hq, -1), p.reshape(Hq, -1))
    per = Hq // groups
    return vertical.view(groups, per, L).sum(1), slash.view(groups, per, L).sum(1)


def top_items(scores: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """(G, L) scores, (G,) counts -> (G, max k) the k_g best positions of each row (by score, best first), -1
    padded. `topk`, not a full sort (a sort of 1M scores per head cost ~ms on the GPU): exactly equal scores at the
    cut are broken arbitrarily; the callers give the items that must stay (the main diagonal) +inf and nothing else
    ties but by coincidence."""
    G, L = scores.shape
    kmax = int(min(L, int(ks.max()))) if G else 0
    if kmax <= 0:
        return torch.full((G, 0), -1, dtype=torch.long, device=scores.device)
    order = torch.topk(scores, kmax, dim=1, sorted=True).indices
    keep = torch.arange(kmax, device=scores.device)[None, :] < ks[:, None]
    return torch.where(keep, order, -1)


def slash_ranges(offsets: torch.Tensor, pos0: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Merged key ranges of the slashes: offsets (G, K) (-1 = none), blocks pos0/lens (nb,) -> (nb, G, K, 2) sorted
    disjoint [start, end) runs, -1 padded (Alg. 4's merge). A slash o covers [p0 - o, p0 + n - o) ∩ [0, ∞)."""
    o = offsets[None]  # (1, G, K)
    end = pos0[:, None, None] + lens[:, None, None] - o
    start = (pos0[:, None, None] - o).clamp(min=0)
    valid = (o >= 0) & (end > 0)
    start = torch.where(valid, start, _BIG)
    start, order = start.sort(dim=-1)
    end = torch.where(valid, end, -1).gather(-1, order)
    valid = start < _BIG
    return merge_ranges(start, end, valid)


def merge_ranges(start: torch.Tensor, end: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Ranges sorted by start (..., K) -> their union as disjoint sorted runs (..., K, 2), -1 padded. Touching ranges
    ([a, b) and [b, c)) merge too."""
    neg = torch.full_like(end, -1)
    e = torch.where(valid, end, neg)
    prev = torch.cat([neg[..., :1], e[..., :-1]], dim=-1).cummax(dim=-1).values  # max end of the earlier ranges
    new_run = valid & (start > prev)
    run = new_run.long().cumsum(-1) - 1  # run id of each range
    run = torch.where(valid, run, run.new_full((), e.shape[-1]))  # invalid -> a dump slot past the end
    K = e.shape[-1]
    r_start = torch.full((*e.shape[:-1], K + 1), _BIG, dtype=start.dtype, device=start.device)
    r_end = torch.full((*e.shape[:-1], K + 1), -1, dtype=end.dtype, device=end.device)
    r_start.scatter_reduce_(-1, run, torch.where(valid, start, _BIG), reduce="amin")
    r_end.scatter_reduce_(-1, run, e, reduce="amax")
    r_start, r_end = r_start[..., :K], r_end[..., :K]
    ok = r_end >= 0
    return torch.stack([torch.where(ok, r_start, -1), r_end], dim=-1)


def block_ranges(block_ids: torch.Tensor, B: int) -> torch.Tensor:
    """Key-block ids (..., K) ascending, -1 padded -> ranges (..., K, 2) [id*B, id*B + B), merged where adjacent."""
    valid = block_ids >= 0
    start = torch.where(valid, block_ids * B, _BIG)
    return merge_ranges(start, torch.where(valid, start + B, -1), valid)


def a_shape_ranges(n_sink: int, n_local: int, pos0: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Λ-shape: (nb, 2, 2) ranges [0, n_sink) and [end - n_local, end) with end the block's last row + 1, merged."""
    end = pos0 + lens
    lo = (end - n_local).clamp(min=0)
    start = torch.stack([torch.zeros_like(lo), lo], dim=-1)
    stop = torch.stack([torch.minimum(torch.full_like(end, n_sink), end), end], dim=-1)
    valid = stop > start
    start = torch.where(valid, start, _BIG)
    start, order = start.sort(dim=-1)
    return merge_ranges(start, torch.where(valid, stop, -1).gather(-1, order), start < _BIG)


def columns_outside(cols: torch.Tensor, ranges: torch.Tensor, block_end: torch.Tensor) -> torch.Tensor:
    """Vertical columns (G, K) (-1 = none) for each block -> (nb, G, K) ascending, -1 padded: the columns before the
    block's end and outside its ranges (nb, G, R, 2)."""
    nb, G = ranges.shape[:2]
    c = torch.where(cols >= 0, cols, _BIG).sort(dim=-1).values  # (G, K)
    c = c[None].expand(nb, G, -1)
    rs = torch.where(ranges[..., 0] >= 0, ranges[..., 0], _BIG).contiguous()  # (nb, G, R), ascending
    idx = torch.searchsorted(rs, c.contiguous(), right=True) - 1  # the last range starting at or before the column
    inside = (idx >= 0) & (c < ranges[..., 1].gather(-1, idx.clamp(min=0)))
    keep = (c < block_end[:, None, None]) & ~inside
    c = torch.where(keep, c, _BIG).sort(dim=-1).values
    return torch.where(c < _BIG, c, -1)


def pooled_keys(keys, length: int, B: int, device) -> torch.Tensor:
    """Mean of each B-aligned key block over positions [0, length) (the last block: its valid keys): (NKB, H_kv, D)."""
    pooled = []
    for _, kc in key_chunks(keys, length, chunk=max(B, (1 << 16) // B * B)):
        kf = kc.to(device=device, dtype=torch.float32)
        nblk = -(-kf.shape[0] // B)
        pad = nblk * B - kf.shape[0]
        kf = torch.nn.functional.pad(kf, (0, 0, 0, 0, 0, pad)).view(nblk, B, *kf.shape[1:])
        cnt = torch.full((nblk,), float(B), device=device)
        cnt[-1] = B - pad
        pooled.append(kf.sum(1) / cnt[:, None, None])
    return torch.cat(pooled)


def block_scores(q_blocks: torch.Tensor, q_ok: torch.Tensor, pos0: torch.Tensor, lens: torch.Tensor,
                 kh: torch.Tensor, B: int, scale: float, groups: int) -> torch.Tensor:
    """Block-sparse estimation (Alg. 3): q_blocks (nb, BQ, H_q, D) with row mask q_ok (nb, BQ), pooled keys kh (NKB,
    H_kv, D) -> (nb, G, NKB) the group sums of softmax(mean-pooled q · mean-pooled k / √d) over the causal key blocks
    (-inf past the diagonal)."""
    nb, _, Hq, _ = q_blocks.shape
    dev = q_blocks.device
    qh = (q_blocks.float() * q_ok[..., None, None]).sum(1) / q_ok.sum(1).clamp(min=1)[:, None, None]  # (nb, H_q, D)
    gqa = Hq // kh.shape[1]
    s = torch.einsum("bhd,khd->bhk", qh * scale, kh.repeat_interleave(gqa, dim=1))  # (nb, H_q, NKB)
    diag = (pos0 + lens - 1) // B
    s = s.masked_fill_(torch.arange(kh.shape[0], device=dev)[None, None, :] > diag[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return p.view(nb, groups, Hq // groups, -1).sum(2)


def top_blocks(scores: torch.Tensor, ks: torch.Tensor, diag: torch.Tensor) -> torch.Tensor:
    """(nb, G, NKB) block scores, (G,) counts k_b, (nb,) diagonal block -> (nb, G, k_max) ascending ids, -1 padded;
    block 0 and the diagonal block are always kept (they count in k_b)."""
    NKB = scores.shape[-1]
    j = torch.arange(NKB, device=scores.device)
    causal = j[None, None, :] <= diag[:, None, None]
    s = scores.masked_fill(~causal, float("-inf"))
    # block 0 first, then the diagonal (k_b = 1 keeps block 0 only), then the best by score
    s.scatter_(-1, diag[:, None, None].expand(*s.shape[:2], 1), torch.finfo(s.dtype).max)
    s[..., 0] = float("inf")
    kmax = int(min(NKB, int(ks.max())))
    top = torch.topk(s, kmax, dim=-1, sorted=True)  # not a full sort: NKB is 16K per block row at 1M
    ids = top.indices
    keep = (torch.arange(kmax, device=s.device)[None, None, :] < ks[None, :, None]) \
        & (top.values > float("-inf"))
    ids = torch.where(keep, ids, _BIG).sort(dim=-1).values
    return torch.where(ids < _BIG, ids, -1)


def ranges_to_tiles(ranges: torch.Tensor, B: int) -> torch.Tensor:
    """Ranges (..., R, 2) sorted, disjoint, -1 padded -> tiles (..., T, 2) of at most B keys, ascending, -1 padded."""
    lead = ranges.shape[:-2]
    r = ranges.reshape(-1, *ranges.shape[-2:])
    ok = r[..., 0] >= 0
    n = torch.where(ok, (r[..., 1] - r[..., 0] + B - 1) // B, 0)  # tiles per range
    csum = n.cumsum(-1)
    T = int(csum[:, -1].max()) if csum.numel() else 0
    if T == 0:
        return torch.full((*lead, 0, 2), -1, dtype=ranges.dtype, device=ranges.device)
    t = torch.arange(T, device=r.device).expand(r.shape[0], T).contiguous()
    which = torch.searchsorted(csum.contiguous(), t, right=True).clamp(max=r.shape[1] - 1)  # range of each tile
    first = (csum - n).gather(-1, which)
    start = r[..., 0].gather(-1, which) + (t - first) * B
    end = torch.minimum(start + B, r[..., 1].gather(-1, which))
    valid = t < csum[:, -1:]
    tiles = torch.stack([torch.where(valid, start, -1), torch.where(valid, end, -1)], dim=-1)
    return tiles.reshape(*lead, T, 2)


def pad_cat(parts: list[torch.Tensor], dim: int, fill: int = -1) -> torch.Tensor:
    """Concatenate along dim 0 after padding dimension `dim` of every part to the widest."""
    width = max(p.shape[dim] for p in parts)
    out = []
    for p in parts:
        if p.shape[dim] < width:
            shape = list(p.shape)
            shape[dim] = width - p.shape[dim]
            p = torch.cat([p, p.new_full(shape, fill)], dim=dim)
        out.append(p)
    return torch.cat(out)
