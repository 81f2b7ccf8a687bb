"""MInference's offline kernel-aware pattern search (MInference 1.0 §4.3, Alg. 1; digest §4.3), one layer at a time.

For one layer's queries, keys and values of a calibration prompt (all rows at once):
  1. **Equal-FLOPs candidate space** (ChangeSpace): the target is the kernel work of a Λ-shape head with
     `target` = (n_sink, n_local) = (1024, 4096). Work is counted as the kernel spends it (`index_cost`: key tiles x
     tile width + columns rounded up to whole tiles, per query row, averaged over the prompt's query blocks and the
     layer's groups), on this layer's own data. For each vertical count k_v of `verticals` (Table 7: 30, 100, 500,
     3000) the slash count k_s is the multiple of `step` (50) whose work is closest to the target; the block count
     k_b likewise (step 1). Λ itself is the target. So the space is Table 7's shape, re-measured per layer: how many
     slashes fit the budget depends on how the layer's slashes cluster into shared tiles.
  2. **Search per head (or KV group)**: the dense output y and each candidate's output y_c over every row; the error
     is ||y_c - y||_F / ||y||_F per head (per group: over the group's heads). The paper picks the smallest error.
     longreach adds one rule, `tie_rtol` / `tie_atol`: among candidates within (1 + tie_rtol) x best + tie_atol of the
     best, the first in the order Λ-shape, vertical-slash (in `verticals` order), block-sparse is chosen — the one
     with the least online work (no index, then the cheaper estimation, §4.7: 5-15% vs 25%). 0 / 0 is the paper's
     plain argmin.
The search runs on whatever executes attention: the Triton kernel on CUDA, the PyTorch reference elsewhere.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..index import QueryBlocks
from .method import MInference, index_cost


@dataclass(frozen=True)
class SearchSpace:
    target: tuple[int, int] = (1024, 4096)  # Λ-shape (n_sink, n_local): the FLOPs budget and the Λ candidate
    verticals: tuple[int, ...] = (30, 100, 500, 3000)  # k_v of the vertical-slash candidates (Table 7)
    step: int = 50  # ChangeSpace step for k_s
    block_sparse: bool = True  # include the block-sparse candidate
    tie_rtol: float = 0.05
    tie_atol: float = 1e-3

    def __post_init__(self) -> None:
        if len(self.target) != 2 or self.target[1] < 1 or self.target[0] < 0:
            raise ValueError(f"target must be (n_sink >= 0, n_local >= 1), got {self.target}")
        if not self.verticals or any(v < 0 for v in self.verticals):
            raise ValueError(f"verticals must be vertical counts >= 0, got {self.verticals}")
        if self.step < 1 or self.tie_rtol < 0 or self.tie_atol < 0:
            raise ValueError("step must be >= 1 and the tie tolerances >= 0")

    def to_json(self) -> dict:
        return asdict(self)


class LayerSearch:
    """The search of one layer: holds its inputs, a memo of the estimations, and builds/executes candidates."""

    def __init__(self, method: MInference, layer: int, q, k_cache, v_cache, block_table, length: int, scale: float,
                 attend):
        """q (L, H_q, D) every row of the prompt; caches + block_table: the prompt's keys/values; `attend(q, k_cache,
        v_cache, block_tables, RangeIndex) -> out` runs the layer's attention (kernel or reference)."""
        self.m, self.layer, self.q, self.length, self.scale = method, layer, q, length, scale
        self.k_cache, self.v_cache, self.table = k_cache, v_cache, block_table
        self.attend = attend
        self.qb = QueryBlocks.build([length], [0], method.cfg.block)
        self.blocks = list(zip(self.qb.start, self.qb.length, self.qb.pos))
        self.memo: dict = {}

    def index(self, pattern: tuple):
        t, c = self.m.build(self.layer, self.q, self.blocks, (self.k_cache, self.table), self.length, self.scale,
                            patterns=[pattern] * self.m.groups, memo=self.memo)
        return self.m.index(self.qb, [t], [c])

    def cost(self, pattern: tuple) -> float:
        return index_cost(self.index(pattern))

    def output(self, pattern: tuple) -> torch.Tensor:
        return self.attend(self.q, self.k_cache, self.v_cache, self.table[None], self.index(pattern))

    def _closest(self, make, lo: int, hi: int, step: int, target: float) -> tuple[int, float]:
        """The multiple of `step` in [lo, hi] whose cost is closest to `target` (cost non-decreasing in it)."""
        a, b = max(1, lo // step), max(1, hi // step)
        ca = self.cost(make(a * step))
        if ca >= target or a == b:
            return a * step, ca
        while b - a > 1:  # invariant: cost(a) < target
            mid = (a + b) // 2
            if self.cost(make(mid * step)) < target:
                a = mid
            else:
                b = mid
        ca, cb = self.cost(make(a * step)), self.cost(make(b * step))
        return (a * step, ca) if target - ca <= cb - target else (b * step, cb)

    def space(self, s: SearchSpace) -> list[tuple[tuple, float]]:
        """ChangeSpace: [(pattern, cost)], Λ first, then vertical-slash by `verticals`, then block-sparse."""
        lam = ("a_shape", *s.target)
        target = self.cost(lam)
        out = [(lam, target)]
        for kv in s.verticals:
            ks, c = self._closest(lambda k, kv=kv: ("vertical_slash", kv, k), s.step, self.length, s.step, target)
            out.append((("vertical_slash", kv, ks), c))
        if s.block_sparse:
            kb, c = self._closest(lambda k: ("block_sparse", k), 1, -(-self.length // self.m.cfg.block), 1, target)
            out.append((("block_sparse", kb), c))
        return out


def group_errors(y: torch.Tensor, ref: torch.Tensor, groups: int) -> torch.Tensor:
    """(L, H_q, D) outputs -> (groups,) ||y - ref||_F / ||ref||_F over each group's heads."""
    H = ref.shape[1]
    num = (y.double() - ref.double()).pow(2).sum((0, 2)).view(groups, H // groups).sum(1)
    den = ref.double().pow(2).sum((0, 2)).view(groups, H // groups).sum(1)
    return (num / den.clamp(min=1e-30)).sqrt().float()


def choose(errors: torch.Tensor, s: SearchSpace) -> list[int]:
    """(G, C) errors, candidates in preference order -> the chosen candidate per group (see the module docstring)."""
    best = errors.min(dim=1, keepdim=True).values
    ok = errors <= best * (1 + s.tie_rtol) + s.tie_atol
    return ok.float().argmax(dim=1).tolist()  # the first acceptable in preference order


def search_layer(ls: LayerSearch, dense_out: torch.Tensor, s: SearchSpace) -> dict:
    """One layer: {"space": [patterns], "cost": [keys/row], "errors": [[per candidate] per group], "choice": [pattern
    per group]}."""
    space = ls.space(s)
    errs = torch.stack([group_errors(ls.output(p), dense_out, ls.m.groups) for p, _ in space], dim=1)  # (G, C)
    picks = choose(errs, s)
    return {"space": [list(p) for p, _ in space], "cost": [round(c, 1) for _, c in space],
            "errors": [[round(float(e), 5) for e in row] for row in errs], "choice": [list(space[i][0]) for i in picks]}
