"""MInference 1.0 (Jiang et al., 2024): dynamic sparse *prefill* with one of three patterns per head; dense decode.

Each head (or KV-head group, `granularity`) is assigned offline, by `longreach calibrate` (search.py), one pattern;
at prefill the pattern's index is built online from the prompt (index.py) and one `RangeIndex` (attention/index.py:
key tiles + key columns per query block) holds every head of the layer, so one kernel launch
(kernels/vertical_slash.py; the PyTorch reference is executor.range_attention) runs the layer.
  ("a_shape", n_sink, n_local)        Λ-shape: sink + local window, no index to build
  ("vertical_slash", k_v, k_s)         top k_v key columns + top k_s diagonals from the last `last_q` queries
  ("block_sparse", k_b)                top k_b 64-key blocks per 64-query block, by mean-pooled scores
Decode is dense (the paper's protocol); `--decode-attention` composes another decode method (attention/compose.py).

Settled ambiguities (digest §8 and §4.4 gaps):
  * GQA (§4.4 "not discussed"): patterns and indices are per query head by default (`granularity` "head", the
    paper's). "kv_head" gives the heads of a KV group one pattern and one index, estimated from the sum of their
    softmax scores, so the kernel loads each K/V tile once for the whole group (heads x 64 rows per program) instead
    of once per head. Recall of both is in docs/sparse.md; speed is not measured yet (no GPU in the session that
    built this).
  * (k_v, k_s) are (vertical count, slash count), as Table 7's caption reads (§8.8); top-k_b is per block row.
  * Estimation segments: the paper estimates once, from the prompt's last 64 queries. A chunked prefill does not have
    those queries before its last chunk, so a query block's index comes from the last `last_q` queries of its
    *segment* — positions [s*segment, (s+1)*segment) — that this step computes. An unchunked prompt shorter than
    `segment` is exactly the paper's; a chunked prefill whose chunks are multiples of `segment` equals the unchunked
    one (tested). With chunks shorter than `segment` each chunk estimates from its own last queries.
  * Budgets are counts of distinct items visible to the block (index.py); the main diagonal (slash
    offset 0) is always kept for vertical-slash heads, key block 0 and the diagonal block for block-sparse heads.
  * Λ-shape windows are per 64-query block (the paper's static block mask), not per row.
  * Which pattern file, in one place (`resolve_patterns`): `patterns` is a path (it ends in .json or holds a /) or
    the name of a file shipped in minference/patterns/ (a model alias: `{"patterns": "qwen2.5-coder-0.5b"}`); an
    unknown name fails listing the shipped ones. A model run by its alias gets its shipped file by default, unless
    the pattern choice is the user's (a preset, or `patterns`, `pattern`, `granularity` or `block` in the config;
    `{"patterns": null}` asks for no file). That default is applied by the backend, where the model is known:
    `resolve_config` needs none (EngineConfig validates before a model exists; the recall tool builds configs for
    whatever model it captured), so there a bare `minference` stays uncalibrated.
  * Without a file (other models, or the user's choice) every head is `pattern`, by default vertical-slash (500,
    1500), the middle of Table 7's equal-FLOPs candidates (30, 2048) ... (3000, 200); a log line says so.
  * No RoPE position strategies: MInference targets long-context models and attends at true positions.
"""
from __future__ import annotations

import os

import torch

from ..index import QueryBlocks, RangeIndex
from . import index as mi
from .config import DEFAULT_PRESET, PATTERN_KINDS, PRESETS, MInferenceConfig, load_patterns


def _index_width(pattern: tuple, B: int) -> int:
    """About how many ranges and tiles one query block of one group holds under `pattern` (slice sizing)."""
    if pattern[0] == "a_shape":
        return (pattern[1] + pattern[2]) // B + 4
    if pattern[0] == "vertical_slash":
        return 2 * (pattern[1] + pattern[2]) + 4  # a slash's range spans at most two key tiles
    return 2 * pattern[1] + 4


class MInference:
    """Per-layer pattern table and online index building for one model shape (no engine state)."""

    name = "minference"
    config_cls = MInferenceConfig
    presets = PRESETS
    default_preset = DEFAULT_PRESET

    def __init__(self, cfg: MInferenceConfig, num_heads: int, num_kv_heads: int, num_layers: int | None = None,
                 model_config=None):
        """`model_config`: a tensor-parallel rank's ModelConfig (models/shard.py: local_config), whose heads are a
        range of the model's: the pattern file lists every head (or KV head) of the model, and this rank keeps the
        patterns of its own global heads. None: num_heads and num_kv_heads are the whole model's."""
        self.cfg = cfg
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.table: list[list[tuple]] | None = None
        gran = cfg.granularity or "head"
        if cfg.patterns is not None:
            whole = model_config.whole_heads if model_config is not None else None
            file_gran, self.table = load_patterns(cfg.patterns, num_layers, *(whole or (num_heads, num_kv_heads)),
                                                  cfg.block)
            if cfg.granularity not in (None, file_gran):
                raise ValueError(f"granularity {cfg.granularity!r} differs from the patterns file's ({file_gran!r}); "
                                 "leave it unset or recalibrate")
            gran = file_gran
            if whole is not None:  # this rank's heads of each layer, by global index
                own = model_config.global_heads(gran)[1]
                self.table = [layer[own.start:own.stop] for layer in self.table]
        self.granularity = gran
        self.groups = num_heads if gran == "head" else num_kv_heads

    def layer_patterns(self, layer: int) -> list[tuple]:
        return list(self.table[layer]) if self.table is not None else [self.cfg.pattern] * self.groups

    def describe(self) -> str:
        if self.table is None:
            return f"every {self.granularity} {self.cfg.pattern[0]} {tuple(self.cfg.pattern[1:])}"
        count: dict[str, int] = {}
        for layer in self.table:
            for p in layer:
                count[p[0]] = count.get(p[0], 0) + 1
        total = sum(count.values())
        return f"{os.path.basename(self.cfg.patterns)}: " + ", ".join(
            f"{k} {v / total:.0%}" for k, v in sorted(count.items())) + f" of {total} {self.granularity}s"

    # ---- index building ------------------------------------------------------------------------------------------
    def build(self, layer: int, q: torch.Tensor, blocks: list[tuple[int, int, int]], keys, length: int, scale: float,
              patterns: list[tuple] | None = None, memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiles (nb, G, T, 2) and columns (nb, G, C) for the query blocks of one sequence.

        q (n, H_q, D): this step's queries of the sequence (RoPE applied); blocks: (first row in q, rows, position of
        the first row), aligned to `block`; keys: (k_cache, block_table) or a plain (L, H_kv, D) tensor holding the
        sequence's keys up to `length` (this step's included); `patterns`: one per group (default: the layer's).
        `memo`: a dict kept across calls on the same inputs (the calibration search) to reuse the estimations."""
        B, dev = self.cfg.block, q.device
        patterns = patterns or self.layer_patterns(layer)
        memo = {} if memo is None else memo  # estimations are shared by a segment's slices
        G = self.groups
        kinds = {k: [g for g, p in enumerate(patterns) if p[0] == k] for k in PATTERN_KINDS}
        # query blocks in slices whose index-building temporaries stay near 256 MB (a 1M-token prompt unchunked):
        # per block and group, ~`width` ranges/tiles of int64 pairs and their sort temporaries
        width = max(_index_width(p, B) for p in patterns)
        step = max(1, (256 << 20) // (G * width * 8 * 8))
        a_shapes: dict[tuple, list[int]] = {}  # Λ ranges are the same for every group with the same pattern
        for g in kinds["a_shape"]:
            a_shapes.setdefault(patterns[g], []).append(g)
        tiles, cols = [], []
        for seg_blocks in self._segments(blocks):
            last = seg_blocks[-1]  # estimation: the segment's last `last_q` rows in this step
            end_row = last[0] + last[1]
            n_est = min(self.cfg.last_q, end_row - seg_blocks[0][0])
            est = (end_row, n_est, last[2] + last[1] - n_est)
            for s0 in range(0, len(seg_blocks), step):
                part = seg_blocks[s0:s0 + step]
                pos0 = torch.tensor([b[2] for b in part], device=dev)
                lens = torch.tensor([b[1] for b in part], device=dev)
                nb = len(part)
                col = torch.full((nb, G, 0), -1, dtype=torch.long, device=dev)
                parts: list[tuple[list[int], torch.Tensor]] = []  # (groups, ranges (nb, len(groups) or 1, R, 2))
                for pat, gs in a_shapes.items():
                    parts.append((gs, mi.a_shape_ranges(pat[1], pat[2], pos0, lens)[:, None]))
                if kinds["vertical_slash"]:
                    vs_ranges, vs_cols = self._vertical_slash(q, est, keys, scale, patterns, kinds["vertical_slash"],
                                                              pos0, lens, memo)
                    parts.append((kinds["vertical_slash"], vs_ranges))
                    col = torch.full((nb, G, vs_cols.shape[-1]), -1, dtype=torch.long, device=dev)
                    col[:, kinds["vertical_slash"]] = vs_cols
                if kinds["block_sparse"]:
                    parts.append((kinds["block_sparse"], self._block_sparse(
                        q, part, keys, length, scale, patterns, kinds["block_sparse"], pos0, lens, memo)))
                if len(parts) == 1 and len(parts[0][0]) == G:  # one kind for every group (the presets)
                    t = mi.ranges_to_tiles(parts[0][1].contiguous(), B)
                    tiles.append(t.expand(nb, G, *t.shape[2:]))
                else:
                    ranges = torch.full((nb, G, max(r.shape[2] for _, r in parts), 2), -1, dtype=torch.long,
                                        device=dev)
                    for gs, r in parts:
                        ranges[:, torch.tensor(gs, device=dev), :r.shape[2]] = r
                    tiles.append(mi.ranges_to_tiles(ranges, B))
                cols.append(col)
        return mi.pad_cat(tiles, 2), mi.pad_cat(cols, 2)

    def _segments(self, blocks):
        """Group consecutive query blocks by estimation segment."""
        out: list[list[tuple[int, int, int]]] = []
        for b in blocks:
            seg = b[2] // self.cfg.segment
            if out and out[-1][0][2] // self.cfg.segment == seg:
                out[-1].append(b)
            else:
                out.append([b])
        return out

    def _vertical_slash(self, q, est, keys, scale, patterns, groups_vs, pos0, lens, memo=None):
        """est = (end row in q, rows, position of the first): the segment's estimation queries."""
        dev = q.device
        end_row, n_est, est_pos0 = est
        key = ("vs", est_pos0, n_est, tuple(groups_vs), tuple(patterns[g] for g in groups_vs))
        if memo is not None and key in memo:
            cols, offsets = memo[key]
        else:
            skey = ("vs scores", est_pos0, n_est)
            if memo is not None and skey in memo:
                vertical, slash = memo[skey]
            else:
                vertical, slash = mi.vs_scores(q[end_row - n_est:end_row], est_pos0, keys, scale, self.groups)
                if memo is not None:
                    memo[skey] = vertical, slash
            sel = torch.tensor(groups_vs, device=dev)
            vertical, slash = vertical[sel], slash[sel].clone()
            slash[:, 0] = float("inf")  # the main diagonal: every row reads itself
            k_v = torch.tensor([patterns[g][1] for g in groups_vs], device=dev)
            k_s = torch.tensor([patterns[g][2] for g in groups_vs], device=dev)
            cols, offsets = mi.top_items(vertical, k_v), mi.top_items(slash, k_s)
            if memo is not None:
                memo[key] = cols, offsets
        ranges = mi.slash_ranges(offsets, pos0, lens)  # (nb, G_vs, K, 2)
        return ranges, mi.columns_outside(cols, ranges, pos0 + lens)

    def _block_sparse(self, q, seg_blocks, keys, length, scale, patterns, groups_bs, pos0, lens, memo=None):
        B, dev = self.cfg.block, q.device
        r = torch.arange(B, device=dev)
        starts = torch.tensor([b[0] for b in seg_blocks], device=dev)
        q_ok = r[None, :] < lens[:, None]
        qb = q[(starts[:, None] + r).clamp(max=q.shape[0] - 1)]  # (nb, B, H_q, D)
        sel = torch.tensor(groups_bs, device=dev)
        k_b = torch.tensor([patterns[g][1] for g in groups_bs], device=dev)
        diag = (pos0 + lens - 1) // B
        out = []
        per_block = self.num_heads * (-(-length // B)) * 4 * 3
        step = max(1, (256 << 20) // per_block)
        kkey = ("bs keys", length)  # pooled once per build (memo: once per search); a block's causal key blocks are
        # complete except a last, partial one, which is the same whatever slice asks
        if memo is not None and kkey in memo:
            kh = memo[kkey]
        else:
            kh = mi.pooled_keys(keys, length, B, dev)
            if memo is not None:
                memo[kkey] = kh
        for s in range(0, len(seg_blocks), step):
            sl = slice(s, s + step)
            key = ("bs", int(pos0[sl][0]), int(pos0[sl][-1]))
            if memo is not None and key in memo:
                scores = memo[key]
            else:
                end = int(pos0[sl][-1] + lens[sl][-1])
                scores = mi.block_scores(qb[sl], q_ok[sl], pos0[sl], lens[sl], kh[: -(-end // B)], B, scale,
                                         self.groups)
                if memo is not None:
                    memo[key] = scores
            scores = scores[:, sel]
            out.append(mi.block_ranges(mi.top_blocks(scores, k_b, diag[sl]), B))
        return mi.pad_cat(out, 2)

    def full_tiles(self, blocks: list[tuple[int, int, int]], device) -> torch.Tensor:
        """Tiles that read every earlier key (a short sequence in a long batch): (nb, G, T, 2)."""
        pos0 = torch.tensor([b[2] for b in blocks], device=device)
        lens = torch.tensor([b[1] for b in blocks], device=device)
        ranges = torch.stack([torch.zeros_like(pos0), pos0 + lens], -1)[:, None, None].expand(-1, self.groups, 1, 2)
        return mi.ranges_to_tiles(ranges.contiguous(), self.cfg.block)

    def index(self, qb: QueryBlocks, tiles: list[torch.Tensor], cols: list[torch.Tensor]) -> RangeIndex:
        """Pack the per-sequence parts (in qb's sequence order) into one RangeIndex."""
        t = mi.pad_cat(tiles, 2).to(torch.int32)
        c = mi.pad_cat(cols, 2).to(torch.int32)
        return RangeIndex(self.cfg.block, self.cfg.block, self.groups, qb, t, (t[..., 0] >= 0).sum(-1).to(torch.int32),
                          c, (c >= 0).sum(-1).to(torch.int32))

    def selection_mask(self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(R, H_q, L) keys read by each evaluated row (eval recall): q (R, H_q, D) of the last R positions, k (L, H_kv,
        D) every key."""
        R, L = positions.numel(), k.shape[0]
        qb = QueryBlocks.build([R], [int(positions[0])], self.cfg.block)
        blocks = list(zip(qb.start, qb.length, qb.pos))
        tiles, cols = self.build(layer, q, blocks, k, L, q.shape[-1] ** -0.5)
        j = torch.arange(L)
        t = tiles.cpu()
        cover = ((j >= t[..., :1]) & (j < t[..., 1:]) & (t[..., :1] >= 0)).any(2)  # (nb, G, L)
        c = cols.cpu()
        if c.shape[2]:
            cover |= torch.zeros_like(cover).scatter_(2, c.clamp(min=0), c >= 0)
        block_of_row = torch.repeat_interleave(torch.arange(qb.num_blocks), torch.tensor(qb.length))
        per = self.num_heads // self.groups
        rows = cover[block_of_row].repeat_interleave(per, dim=1)  # (R, H_q, L)
        return rows & (j[None, None, :] <= positions.cpu()[:, None, None])


def index_cost(index: RangeIndex) -> float:
    """Mean keys the kernel computes per query row (tiles x tile width + columns rounded up to whole tiles), over
    query blocks and groups: the equal-FLOPs measure of the calibration search."""
    B = index.tile
    work = index.tile_counts.float() * B + torch.ceil(index.col_counts.float() / B) * B
    return work.mean().item() if work.numel() else 0.0
