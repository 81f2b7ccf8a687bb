"""`SparseIndex`: the one contract between *selection* (which keys each query block reads) and *execution*.

A step's queries are cut into **query blocks**: runs of at most `block_q` consecutive query rows of one sequence,
aligned to absolute positions (block m of a sequence holds positions [m*block_q, (m+1)*block_q) that are in this
step), so a prefill split into chunks that are multiples of `block_q` sees the same blocks as an unchunked one. A
decode step has one block of one row per sequence. With `last_rows` > 0 each of a prompt's last `last_rows` rows
(positions [prompt_len - last_rows, prompt_len), `prompt_lens`; default: the prompt ends in this step) is a block of
one row: the row that predicts the first output token, and the question's rows before it, then select their keys by
themselves (`SparseConfig.last_rows`). The blocks before them keep the alignment. Both rules depend on positions
only, so a chunked prefill sees exactly the blocks of an unchunked one, even when the last rows span two chunks.

For every query block and selection group, the index lists **key blocks** (logical ids: key block j is positions
[j*block_k, (j+1)*block_k) of that sequence), ascending and padded with -1, plus a count. On top of them every query
attends to the always-on **sink** (positions [0, n_sink)) and **window** (its own last n_window positions). The three
parts never overlap, so nothing is counted twice; for a query at position p:
    sink      k in [0, n_sink)                      and k <= p
    window    k in [max(n_sink, p - n_window + 1), p]
    selected  k in a listed block, n_sink <= k <= p - n_window          (causal by construction)
A selection that lists every block reproduces dense causal attention exactly.

Selection groups (`groups`): 1 = one selection shared by all heads of the layer (InfiniteHiP's max over heads);
H_kv = one per KV-head group; H_q = one per head. Query head h uses group h // (H_q // groups).
Default in longreach: per KV group. The kernels load each KV block once per GQA group, so a per-group selection costs
the same to execute as a per-layer one, while it covers more attention mass (docs/sparse.md, "The index format");
per-head selections would force one key load per head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QueryBlocks:
    """The query blocks of a step. All tensors (NQB,) int64 on the queries' device; host lists mirror them."""

    seq: list[int]  # batch index of each block's sequence
    start: list[int]  # first row of the block in the flattened (T, ...) queries
    length: list[int]  # rows in the block (<= block_q)
    pos: list[int]  # absolute position of the block's first row

    @property
    def num_blocks(self) -> int:
        return len(self.seq)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_q: int, last_rows: int = 0,
              prompt_lens: list[int] | None = None) -> "QueryBlocks":
        seq, start, length, pos = [], [], [], []
        row = 0
        for i, (n, c) in enumerate(zip(query_lens, context_lens)):
            p, end = c, c + n
            prompt_len = end if prompt_lens is None else prompt_lens[i]
            tail = max(c, prompt_len - last_rows) if last_rows > 0 else end  # rows from here on: blocks of one row
            while p < end:
                stop = p + 1 if p >= tail else min(end, (p // block_q + 1) * block_q)
                if p < tail < stop:
                    stop = tail
                seq.append(i)
                start.append(row + p - c)
                length.append(stop - p)
                pos.append(p)
                p = stop
            row += n
        return cls(seq, start, length, pos)

    def of_sequence(self, i: int) -> list[int]:
        return [b for b, s in enumerate(self.seq) if s == i]


@dataclass
class SparseIndex:
    block_q: int
    block_k: int
    n_sink: int
    n_window: int
    groups: int
    queries: QueryBlocks
    blocks: torch.Tensor  # (NQB, groups, max_blocks) int32 key-block ids, ascending, -1 padded
    counts: torch.Tensor  # (NQB, groups) int32

    def __post_init__(self) -> None:
        nqb = self.queries.num_blocks
        if self.blocks.dim() != 3 or self.blocks.shape[:2] != (nqb, self.groups):
            raise ValueError(f"blocks must be (num_query_blocks={nqb}, groups={self.groups}, max_blocks), "
                             f"got {tuple(self.blocks.shape)}")
        if self.counts.shape != (nqb, self.groups):
            raise ValueError(f"counts must be ({nqb}, {self.groups}), got {tuple(self.counts.shape)}")

    @property
    def max_blocks(self) -> int:
        return self.blocks.shape[2]

    @staticmethod
    def pack(selections: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Selections -> (blocks int32, counts int32). Each entry is (nb_i, groups, n_i) for consecutive query blocks,
        or (groups, n_i) for one block, holding ascending ids followed by -1 padding (what every method returns)."""
        parts = [s.unsqueeze(0) if s.dim() == 2 else s for s in selections]
        groups = parts[0].shape[1] if parts else 1
        width = max([p.shape[2] for p in parts] + [1])
        parts = [torch.nn.functional.pad(p.to(device=device, dtype=torch.int32), (0, width - p.shape[2]), value=-1)
                 for p in parts]
        blocks = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else \
            torch.full((0, groups, width), -1, dtype=torch.int32, device=device)
        return blocks, (blocks >= 0).sum(-1).to(torch.int32)

    def attended_positions(self, b: int, group: int, row_pos: int) -> torch.Tensor:
        """All key positions query row at `row_pos` of block b attends to (reference / tests; slow)."""
        sink = torch.arange(min(self.n_sink, row_pos + 1))
        win_start = max(self.n_sink, row_pos - self.n_window + 1)
        win = torch.arange(win_start, max(win_start, row_pos + 1))
        ids = self.blocks[b, group, : int(self.counts[b, group])].long().cpu()
        sel = (ids[:, None] * self.block_k + torch.arange(self.block_k)[None, :]).flatten()
        sel = sel[(sel >= self.n_sink) & (sel <= row_pos - self.n_window)]
        return torch.cat([sink, sel, win])


@dataclass
class RangeIndex:
    """The sibling of `SparseIndex` for methods that read key *ranges* and single key *columns* (MInference).

    Per query block and selection group (`groups`, as in `SparseIndex`; query head h uses group h // (H_q // groups)):
      tiles    (NQB, G, MAXT, 2) int32 [start, end) key ranges of at most `tile` keys each, ascending, disjoint,
               -1 padded; tile_counts (NQB, G). A vertical-slash head's slash ranges, a block-sparse head's blocks
               and a Λ-shape head's sink and local window all become tiles.
      columns  (NQB, G, MAXC) int32 key positions, ascending, none inside a tile of the same block and group, -1
               padded; col_counts (NQB, G). A vertical-slash head's vertical lines.
    A query row at position p reads key k iff k <= p and k lies in one of its block's tiles or columns: causality is
    applied per row at execution, so an index may list keys past a block's first row. Nothing is read twice (tiles
    are disjoint, columns avoid tiles). There is no implicit sink or window: a method lists everything it reads.
    A tile list covering [0, end of the block) reproduces dense causal attention exactly (tested).
    """

    block_q: int
    tile: int
    groups: int
    queries: QueryBlocks
    tiles: torch.Tensor  # (NQB, G, MAXT, 2) int32
    tile_counts: torch.Tensor  # (NQB, G) int32
    columns: torch.Tensor  # (NQB, G, MAXC) int32
    col_counts: torch.Tensor  # (NQB, G) int32

    def __post_init__(self) -> None:
        nqb, g = self.queries.num_blocks, self.groups
        if self.tiles.dim() != 4 or self.tiles.shape[:2] != (nqb, g) or self.tiles.shape[3] != 2:
            raise ValueError(f"tiles must be (num_query_blocks={nqb}, groups={g}, max_tiles, 2), "
                             f"got {tuple(self.tiles.shape)}")
        if self.columns.dim() != 3 or self.columns.shape[:2] != (nqb, g):
            raise ValueError(f"columns must be (num_query_blocks={nqb}, groups={g}, max_columns), "
                             f"got {tuple(self.columns.shape)}")
        for name in ("tile_counts", "col_counts"):
            if getattr(self, name).shape != (nqb, g):
                raise ValueError(f"{name} must be ({nqb}, {g}), got {tuple(getattr(self, name).shape)}")

    @property
    def max_tiles(self) -> int:
        return self.tiles.shape[2]

    @property
    def max_columns(self) -> int:
        return self.columns.shape[2]

    def attended_positions(self, b: int, group: int, row_pos: int) -> torch.Tensor:
        """All key positions query row at `row_pos` of block b attends to, ascending (reference / tests; slow)."""
        t = self.tiles[b, group, : int(self.tile_counts[b, group])].long().cpu()
        c = self.columns[b, group, : int(self.col_counts[b, group])].long().cpu()
        keys = torch.cat([torch.arange(int(s), int(e)) for s, e in t.tolist()] + [c])
        return keys[keys <= row_pos].sort().values


def head_pairs(num_heads: int, num_kv_heads: int, groups: int) -> tuple[list[tuple[int, int]], int]:
    """(selection group, KV head) pairs that heads read from, and heads per pair (heads of a pair are contiguous)."""
    gqa = num_heads // num_kv_heads
    if groups == num_heads:
        return [(h, h // gqa) for h in range(num_heads)], 1
    if groups == num_kv_heads:
        return [(g, g) for g in range(groups)], gqa
    if groups == 1:
        return [(0, kv) for kv in range(num_kv_heads)], gqa
    raise ValueError(f"groups must be 1, num_kv_heads ({num_kv_heads}) or num_heads ({num_heads}), got {groups}")
