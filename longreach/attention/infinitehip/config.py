"""InfiniteHiP's config and presets (the method: method.py; the decisions behind each field are in its docstring)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...rope.strategies import PRUNE_CODES, parse_layer_spec
from ..sparse.config import SparseConfig

STAGE0_SCORES = ("selectrep", "minmax", "cuboid-mean")  # kernels/chunk_box.py for the boxes


@dataclass(frozen=True)
class InfiniteHiPConfig(SparseConfig):
    DECODE_ONLY: ClassVar[frozenset[str]] = SparseConfig.DECODE_ONLY | {"refresh", "lookahead", "ahead"}
    chunk_sizes: tuple[int, ...] = (256, 32, 8)  # l_c per stage
    budgets: tuple[int, ...] = (32768, 8192, 2048)  # k per stage: tokens kept after it
    early_layers: int = 3  # the first layers use early_last_budget as the last stage's k
    early_last_budget: int | None = 4096
    refresh: tuple[int, ...] = (16, 8, 4)  # decode steps between recomputations of each stage
    exact_below: int = 32  # chunks this small are scored by their best key; 0 = SelectRep everywhere (the paper)
    rep_per_head: bool = True  # SelectRep per query head (the paper); False: once per KV head, for all its heads
    prune_rope: str = "ci:0-2,rt"  # the paper's: chunk-indexed in the first 3 layers, relative in the rest
    attend_rope: str = "st"  # the paper's: StreamingLLM-style rolling positions over the attended keys
    stage0_scores: str = "selectrep"  # how stage 0 scores its chunks: SelectRep (the paper) or a box (STAGE0_SCORES)
    # exact attention while a sequence is inside the model's trained context, the pruning only past it: on
    # Qwen2.5-Coder-0.5B it equals dense on every in-window task (7 tasks x 4 lengths x 20 prompts) where the pruned
    # selection lost up to 35 points, and ties it past the window (docs/quality.md, run 8); None: the token budget
    dense_below: int | str | None = "trained"
    # decode only: each stage's survivors plus the next `lookahead` chunks after each one (method.py), so a mask
    # that is not refreshed this step still holds what a model copying forward reads next; 0: the paper's
    lookahead: int = 0
    # decode only: each stage-0 refresh uses the stage-0 output of the refresh before (its own at a sequence's first)
    # and keeps the new one for the next, whose pages an offloaded store copies in while the steps between run
    # (method.py; docs/design-refresh-installs.md, option 5); False: the paper's
    ahead: bool = False
    # per stage: score a prefill query block's candidates with every query_stride-th of its rows, counted back from
    # its last (HiP's b_sq, "blocks are subsampled with one stride over queries"; InfiniteHiP's paper scores every
    # row: 1, the default). The stage's scoring work shrinks with it; decode blocks have one row, untouched
    query_stride: tuple[int, ...] | None = None

    @property
    def query_strides(self) -> tuple[int, ...]:
        """query_stride, one entry per stage (1s when None)."""
        return self.query_stride or (1,) * len(self.chunk_sizes)

    def __post_init__(self) -> None:
        super().__post_init__()
        n = len(self.chunk_sizes)
        if n == 0 or len(self.budgets) != n or len(self.refresh) != n:
            raise ValueError(f"chunk_sizes, budgets and refresh need one entry per stage, got {self.chunk_sizes}, "
                             f"{self.budgets}, {self.refresh}")
        for i, (l, k) in enumerate(zip(self.chunk_sizes, self.budgets)):
            if l < 1 or k < l or k % l:
                raise ValueError(f"stage {i}: budget {k} must be a positive multiple of chunk size {l}")
            if i and self.chunk_sizes[i - 1] % l:
                raise ValueError(f"chunk sizes must each divide the previous one, got {self.chunk_sizes}")
        if self.early_last_budget is not None and self.early_last_budget % self.chunk_sizes[-1]:
            raise ValueError(f"early_last_budget must be a multiple of {self.chunk_sizes[-1]}")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"lookahead must be an integer >= 0 (the chunks after each survivor that a decode step "
                             f"also keeps; 0: none), got {self.lookahead!r}")
        if not isinstance(self.ahead, bool):
            raise ValueError(f"ahead must be true or false, got {self.ahead!r}")
        if self.ahead and n < 2:
            raise ValueError("ahead needs two stages or more: it delays stage 0's output, which with one stage would "
                             "be the attention's own selection")
        qs = self.query_stride
        if qs is not None and (not isinstance(qs, (tuple, list)) or len(qs) != n or any(
                isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= 64 for x in qs)):
            raise ValueError(f"query_stride needs one integer in [1, 64] per stage ({n} stages: the rows of a prefill "
                             f"query block each stage scores with, every n-th), or null for every row; got {qs!r}")
        if any(r < 1 for r in self.refresh):
            raise ValueError(f"refresh intervals must be >= 1, got {self.refresh}")
        if self.stage0_scores not in STAGE0_SCORES:
            raise ValueError(f"stage0_scores must be one of {', '.join(STAGE0_SCORES)}, got {self.stage0_scores!r}")
        if self.stage0_scores != "selectrep" and any(
                name == "de" for name, _, _ in parse_layer_spec(self.prune_rope, PRUNE_CODES, "prune_rope")):
            raise ValueError(f"stage0_scores {self.stage0_scores!r} keeps boxes of keys at fixed pruning positions; "
                             f"SelfExtend (de) positions change with the context length: use another prune_rope "
                             f"than {self.prune_rope!r} (none, rt, ci, il) or stage0_scores 'selectrep'")


_3K = InfiniteHiPConfig()

PRESETS = {
    "3k": _3K,
    "5k": InfiniteHiPConfig(chunk_sizes=(64, 32, 16), budgets=(32768, 16384, 4096), early_last_budget=None),
    "3k-fast": InfiniteHiPConfig(refresh=(32, 16, 8)),
    "3k-flash": InfiniteHiPConfig(refresh=(96, 24, 8)),
    # every stage scored exactly (64-token chunks first): the oracle's selection reached hierarchically (equal to
    # it where the positions agree; docs/quality.md, the ladder); stage 0 reads every candidate key, so its cost
    # grows with the square of the context
    "3k-exact": InfiniteHiPConfig(chunk_sizes=(64, 32, 8), exact_below=64),
    # 3k-exact with stage 0 scored from Quest's min/max box of each 64-token chunk (kernels/chunk_box.py) instead
    # of every key: one centre and one radius per chunk, 1/32 of exact's reads (boxes kept in a paged pool).
    # Decode refreshes its stages every (8, 4, 1) steps, not the paper's (16, 8, 4): copying a needle forward
    # (RULER's UUIDs and numbers) needs the last stage's mask to follow the copy; on Qwen2.5-Coder-0.5B at 128K-1M
    # it won each retrieval task's total over (16, 8, 4) and over lookahead 1, at 17% slower decode on the 8B
    # shape at 128K, still 1.21x dense there (docs/quality.md, runs 15 and 16)
    "3k-box": InfiniteHiPConfig(chunk_sizes=(64, 32, 8), stage0_scores="minmax", refresh=(8, 4, 1)),
    # the evaluation-only rungs of the retrieval ladder (oracle, positions-*) are registered by the lab
    # (tools/eval/presets.py), so that this table holds only what a user should pick
}
# 3k-box: on the retrieval suite it equals or beats the paper's 3k and is faster on the 8B shape (the runs that
# decided it: docs/quality.md "The retrieval ladder", docs/benchmarks.md)
DEFAULT_PRESET = "3k-box"

PRESET_NOTES = {  # preset -> what it is for (`longreach backends`)
    "3k-box": "3k's budgets, stage 0 scored from a min/max box per 64-token chunk, masks refreshed every 8/4/1 "
              "decode steps (default; every preset attends densely inside the model's trained context: dense_below "
              "\"trained\")",
    "3k": "the paper's: SelectRep pruning to 2,048 keys per query block (4,096 in layers 0-2)",
    "5k": "a bigger budget: 4,096 keys per query block in every layer",
    "3k-fast": "3k with masks refreshed every 32/16/8 decode steps (3k: 16/8/4): faster decode",
    "3k-flash": "3k with the paper's flash refresh, every 96/24/8 decode steps: the fastest decode",
    "3k-exact": "every stage scored exactly: the oracle's selection, but stage 0 grows with the square of the "
                "context",
}
