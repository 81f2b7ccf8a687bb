"""MInference 1.0 (Jiang et al., 2024): dynamic sparse *prefill* with one of three patterns per head; dense decode.

Each head (or KV-head group, `granularity`) is assigned offline, by `longreach calibrate` (attention/minference_search
.py), one pattern; at prefill the pattern's index is built online from the prompt (attention/minference_index.py)
and one `RangeIndex` (attention/index.py: key tiles + key columns per query block) holds every head of the layer, so
one kernel launch (kernels/vertical_slash.py; the PyTorch reference is executor.range_attention) runs the layer.
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
  * Budgets are counts of distinct items visible to the block (minference_index.py); the main diagonal (slash
    offset 0) is always kept for vertical-slash heads, key block 0 and the diagonal block for block-sparse heads.
  * Λ-shape windows are per 64-query block (the paper's static block mask), not per row.
  * Which pattern file, in one place (`resolve_patterns`): `patterns` is a path (it ends in .json or holds a /) or
    the name of a file shipped in attention/patterns/ (a model alias: `{"patterns": "qwen2.5-coder-0.5b"}`); an
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

import dataclasses
import json
import logging
import os
import typing
from dataclasses import dataclass

import torch

from . import minference_index as mi
from .backend import AttentionBackend, AttentionMetadata
from .dense import DenseBackend
from .index import QueryBlocks, RangeIndex

logger = logging.getLogger("longreach")

PATTERN_KINDS = {"a_shape": 2, "vertical_slash": 2, "block_sparse": 1}  # name -> number of integer parameters
DEFAULT_PATTERN = ("vertical_slash", 500, 1500)
PATTERNS_FORMAT = "longreach-minference-patterns/1"
PATTERNS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patterns")  # <alias>.json, package data
PATTERN_CHOICE = ("patterns", "pattern", "granularity", "block")  # config fields that leave no room for a default


def shipped_patterns() -> dict[str, str]:
    """Model alias -> path of the calibration file shipped for it (attention/patterns/<alias>.json)."""
    names = sorted(n for n in os.listdir(PATTERNS_DIR) if n.endswith(".json")) if os.path.isdir(PATTERNS_DIR) else []
    return {n[:-len(".json")]: os.path.join(PATTERNS_DIR, n) for n in names}


def resolve_patterns(patterns: str | None, model: str | None = None) -> str | None:
    """The calibration file minference loads: a path, or None for `pattern` on every head.

    `patterns` ending in .json or holding a path separator is a path, returned as given (loading checks it); any
    other string is the name of a shipped file, i.e. a model alias, and an unknown one raises ValueError listing
    them. `patterns` None with `model` an alias that has a shipped file gives that file (the by-alias default; pass
    `model` only when the user left the pattern choice open, see the module docstring); otherwise None."""
    shipped = shipped_patterns()
    if patterns is None:
        return shipped.get(model) if model is not None else None
    if patterns.endswith(".json") or os.sep in patterns or "/" in patterns:
        return patterns
    if patterns not in shipped:
        names = ", ".join(shipped) or "none"
        raise ValueError(f"unknown minference patterns {patterns!r}: give a shipped name ({names}) or the path of a "
                         ".json file written by `longreach calibrate --method minference`")
    return shipped[patterns]


def check_pattern(p, where: str = "pattern") -> tuple:
    """A pattern as a tuple (kind, ints...) or ValueError saying what is allowed."""
    if not isinstance(p, (list, tuple)) or not p or p[0] not in PATTERN_KINDS \
            or len(p) != 1 + PATTERN_KINDS[p[0]] or not all(isinstance(x, int) and x >= 0 for x in p[1:]):
        raise ValueError(f"{where} must be one of [\"a_shape\", n_sink, n_local], [\"vertical_slash\", k_v, k_s] or "
                         f"[\"block_sparse\", k_b] with integers >= 0, got {p!r}")
    if p[-1] < 1:  # the local window, the slash count (the main diagonal is always one) and the block count
        raise ValueError(f"{where}: the local window, slash count and block count must be >= 1, got {p!r}")
    return tuple(p)


@dataclass(frozen=True)
class MInferenceConfig:
    patterns: str | None = None  # a calibration file or a shipped name (resolve_patterns); None: `pattern` everywhere
    pattern: tuple = DEFAULT_PATTERN  # every head's pattern when there is no file (presets: vs, a-shape, bs)
    block: int = 64  # B: query rows per block, key tile width, block-sparse block size
    last_q: int = 64  # vertical-slash estimation queries
    segment: int = 32768  # estimation segment (see the module docstring); a multiple of block
    granularity: str | None = None  # "head" or "kv_head"; None: the pattern file's, else "head"
    dense_layers: tuple[int, ...] = ()  # layers that always attend densely
    dense_below: int = 5120  # sequences this short attend densely (Λ 1024 + 4096: the candidates' budget)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", check_pattern(self.pattern))
        if self.patterns is not None and not isinstance(self.patterns, str):
            raise ValueError(f"patterns must be a path to a calibration JSON or a shipped name "
                             f"({', '.join(shipped_patterns())}), got {self.patterns!r}")
        object.__setattr__(self, "patterns", resolve_patterns(self.patterns))
        if self.block not in (16, 32, 64, 128):
            raise ValueError(f"block must be 16, 32, 64 or 128, got {self.block!r}")
        if not isinstance(self.last_q, int) or self.last_q < 1:
            raise ValueError(f"last_q must be an integer >= 1, got {self.last_q!r}")
        if not isinstance(self.segment, int) or self.segment < self.block or self.segment % self.block:
            raise ValueError(f"segment must be a positive multiple of block ({self.block}), got {self.segment!r}")
        if self.granularity not in (None, "head", "kv_head"):
            raise ValueError(f"granularity must be head or kv_head, got {self.granularity!r}")
        if any(not isinstance(x, int) or x < 0 for x in self.dense_layers):
            raise ValueError(f"dense_layers must be layer indices >= 0, got {self.dense_layers}")
        if not isinstance(self.dense_below, int) or self.dense_below < 0:
            raise ValueError(f"dense_below must be an integer >= 0, got {self.dense_below!r}")

    @property
    def block_q(self) -> int:  # the name the eval tools read
        return self.block


def load_patterns(path: str, num_layers: int | None, num_heads: int, num_kv_heads: int, block: int | None = None
                  ) -> tuple[str, list[list[tuple]]]:
    """(granularity, per layer a pattern per group) from a calibration file, checked against the model's shape
    (num_layers None: any layer count, e.g. the recall tool)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the minference patterns file {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"minference patterns file {path!r} is not JSON ({e.msg})") from None
    if not isinstance(data, dict) or data.get("format") != PATTERNS_FORMAT:
        raise ValueError(f"{path!r} is not a minference patterns file (format {PATTERNS_FORMAT!r}); write one with "
                         "`longreach calibrate --method minference`")
    if block is not None and data.get("block", block) != block:
        raise ValueError(f"{path!r} was calibrated with block {data.get('block')}; set block to it or recalibrate")
    gran = data.get("granularity")
    groups = {"head": num_heads, "kv_head": num_kv_heads}.get(gran)
    if groups is None:
        raise ValueError(f"{path!r}: granularity must be head or kv_head, got {gran!r}")
    layers = data.get("layers")
    num_layers = len(layers) if num_layers is None and isinstance(layers, list) else num_layers
    if not isinstance(layers, list) or len(layers) != num_layers:
        raise ValueError(f"{path!r} holds {len(layers) if isinstance(layers, list) else 'no'} layers; the model has "
                         f"{num_layers} (calibrated for {data.get('provenance', {}).get('model', '?')})")
    out = []
    for i, layer in enumerate(layers):
        choice = layer.get("choice") if isinstance(layer, dict) else None
        if not isinstance(choice, list) or len(choice) != groups:
            raise ValueError(f"{path!r}: layer {i} must list {groups} patterns (one per {gran}), got "
                             f"{len(choice) if isinstance(choice, list) else choice!r}")
        out.append([check_pattern(p, f"{path!r} layer {i} group {g}") for g, p in enumerate(choice)])
    return gran, out


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
    presets: typing.ClassVar[dict[str, MInferenceConfig]] = {
        "vs": MInferenceConfig(),  # every head vertical-slash (500, 1500): the default without a pattern file
        "a-shape": MInferenceConfig(pattern=("a_shape", 1024, 4096)),  # = StreamingLLM's 1K + 4K baseline
        "bs": MInferenceConfig(pattern=("block_sparse", 100)),
    }
    default_preset = "vs"

    def __init__(self, cfg: MInferenceConfig, num_heads: int, num_kv_heads: int, num_layers: int | None = None):
        self.cfg = cfg
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.table: list[list[tuple]] | None = None
        gran = cfg.granularity or "head"
        if cfg.patterns is not None:
            file_gran, self.table = load_patterns(cfg.patterns, num_layers, num_heads, num_kv_heads, cfg.block)
            if cfg.granularity not in (None, file_gran):
                raise ValueError(f"granularity {cfg.granularity!r} differs from the patterns file's ({file_gran!r}); "
                                 "leave it unset or recalibrate")
            gran = file_gran
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


class MInferenceBackend(AttentionBackend):
    """MInference: per-head Λ-shape / vertical-slash / block-sparse prefill from a calibration file; dense decode."""

    name = "minference"
    supports_cuda_graph = True  # decode is dense (or, composed, another backend's: attention/compose.py)
    method_cls = MInference
    preset_notes = {
        "vs": "every head vertical-slash (500 columns, 1,500 diagonals); the default where no pattern file is shipped "
              "for the model's alias (shipped: attention/patterns/<alias>.json)",
        "a-shape": "every head Λ-shape: 1,024 sink + 4,096 window tokens (StreamingLLM's baseline)",
        "bs": "every head block-sparse: its top 100 key blocks of 64 tokens",
    }
    prefill_only: typing.ClassVar[bool] = True

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        self.config = self.resolve_config(engine_config, by_alias=True)
        self.method = MInference(self.config, model_config.num_heads, model_config.num_kv_heads,
                                 model_config.num_layers)
        self.dense = DenseBackend(model_config, dataclasses.replace(engine_config, attention="dense", preset=None,
                                                                    attention_config=None), device)
        if self.config.patterns is None:
            logger.info("minference: no pattern file, %s (shipped files: %s; `longreach calibrate --method "
                        "minference` writes one, loaded with --attention-config '{\"patterns\": \"P.json\"}')",
                        self.method.describe(), ", ".join(shipped_patterns()) or "none")
        elif self.config.patterns == shipped_patterns().get(engine_config.model):
            logger.info("minference: patterns %s (%s, shipped for %s: the default for this alias; a preset or "
                        "--attention-config '{\"patterns\": null}' gives every head one pattern)",
                        self.method.describe(), self.config.patterns, engine_config.model)
        else:
            logger.info("minference: patterns %s (%s)", self.method.describe(), self.config.patterns)

    @classmethod
    def resolve_config(cls, engine_config, by_alias: bool = False) -> MInferenceConfig:
        """The config of the preset and overrides; `by_alias`: engine_config.model is the model that runs, so a
        model run by its alias gets its shipped patterns when the pattern choice is open (module docstring)."""
        from .sparse import config_from, preset_and_overrides

        base, overrides = preset_and_overrides("minference", MInference.presets, MInference.default_preset,
                                               engine_config)
        if "pattern" in overrides and "patterns" in overrides:
            raise ValueError("give either patterns (a calibration file) or pattern (one for every head), not both")
        cfg = config_from(MInferenceConfig, base, overrides)
        if by_alias and engine_config.preset is None and not set(PATTERN_CHOICE) & set(overrides):
            cfg = dataclasses.replace(cfg, patterns=resolve_patterns(None, engine_config.model))
        return cfg

    def always_dense_layers(self) -> tuple[int, ...]:
        return tuple(self.config.dense_layers)

    @classmethod
    def unsupported_reasons(cls, model_config, engine_config) -> list[str]:
        try:
            cfg = cls.resolve_config(engine_config, by_alias=True)
            MInference(cfg, model_config.num_heads, model_config.num_kv_heads, model_config.num_layers)
        except ValueError as e:
            return [str(e)]
        bad = [layer for layer in cfg.dense_layers if layer >= model_config.num_layers]
        return [f"dense_layers {bad} do not exist (the model has {model_config.num_layers} layers)"] if bad else []

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        cfg = self.config
        if not meta.is_prefill or layer in cfg.dense_layers or meta.max_seq_len <= cfg.dense_below:
            return self.dense.forward(layer, q, k, v, k_cache, v_cache, meta)
        m = self.method
        qb = QueryBlocks.build(meta.query_lens, meta.context_lens, cfg.block)
        tiles, cols, row0 = [], [], 0
        for i, n in enumerate(meta.query_lens):
            blocks = [(qb.start[b] - row0, qb.length[b], qb.pos[b]) for b in qb.of_sequence(i)]
            length = meta.context_lens[i] + n
            if length <= cfg.dense_below:  # short sequence in a long batch: every earlier key
                tiles.append(m.full_tiles(blocks, q.device))
                cols.append(torch.full((len(blocks), m.groups, 0), -1, dtype=torch.long, device=q.device))
            else:
                t, c = m.build(layer, q[row0:row0 + n], blocks, (k_cache, meta.block_tables[i]), length, self.scale)
                tiles.append(t)
                cols.append(c)
            row0 += n
        index = m.index(qb, tiles, cols)
        return self.attend(q, k_cache, v_cache, meta.block_tables, index)

    def attend(self, q, k_cache, v_cache, block_tables, index: RangeIndex) -> torch.Tensor:
        from .sparse import use_kernels

        if use_kernels(q):
            from ..kernels.vertical_slash import range_attention_triton

            return range_attention_triton(q, k_cache, v_cache, block_tables, index, self.scale,
                                          block_n=self.config.block)[0]
        from .executor import range_attention

        return range_attention(q, k_cache, v_cache, block_tables, index, self.scale, need_lse=False)[0]

    # decode is the dense backend's, CUDA graphs included
    def graph_unsupported(self):
        return self.dense.graph_unsupported()
