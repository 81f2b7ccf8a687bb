"""Presets for evaluation, not for use: the rungs of the retrieval ladder (docs/quality.md, "The retrieval ladder"),
which separate where a method loses the needle (its selection, its budget or its positions) from the model's limit.

They are registered into infinitehip's preset table by `register()` (attention/registry.register_presets) rather than
listed in attention/infinitehip/config.py, so that the runtime's table and `longreach backends` hold only what a user should
pick. Every lab command checks its methods through eval/common.parse_methods, which registers them first: `longreach
eval passkey --attention infinitehip:oracle` works, `longreach generate --attention infinitehip:oracle` is an unknown
preset. A Python caller that builds an `LLM` with one of them calls `register()` first.
"""
from __future__ import annotations

from ...attention.infinitehip import InfiniteHiPConfig
from ...attention.registry import register_presets

# name -> (config, the line `longreach backends` shows once registered)
INFINITEHIP = {
    # the best selection of 3k's size: the top 2048 tokens (4096 in layers 0-2) in 8-token chunks ranked by their
    # exact best key, recomputed every decode step; attention as 3k (rolling positions). Past the trained length the
    # keys are scored at relative positions (rt, the method's own for layers 3+: every key one step beyond the
    # window); `oracle-true` scores them at true positions, which the model never saw there
    "oracle": (InfiniteHiPConfig(chunk_sizes=(8,), budgets=(2048,), refresh=(1,), exact_below=8, prune_rope="rt"),
               "evaluation: the exact top 2,048 tokens per query block, recomputed every decode step"),
    "oracle-true": (InfiniteHiPConfig(chunk_sizes=(8,), budgets=(2048,), refresh=(1,), exact_below=8,
                                      prune_rope="none"),
                    "evaluation: the oracle scored at true positions"),
    # every key (up to 1M tokens), only the positions remapped past the trained length: rolling (st) or SelfExtend
    # groups (de). `dense_below` 0: with its default (the token budget, here 1M, or "trained": at least the budget)
    # every context below 1M went to dense attention at true positions, so from 71ebbf5 to 2026-11-27 these rungs
    # measured dense, not positions (docs/quality.md, run 15); tests/test_ladder.py now checks they differ from dense
    "positions-st": (InfiniteHiPConfig(chunk_sizes=(64,), budgets=(1 << 20,), early_last_budget=None, refresh=(1,),
                                       prune_rope="none", attend_rope="st", dense_below=0),
                     "evaluation: every key, only the positions remapped (rolling, StreamingLLM's)"),
    "positions-de": (InfiniteHiPConfig(chunk_sizes=(64,), budgets=(1 << 20,), early_last_budget=None, refresh=(1,),
                                       prune_rope="none", attend_rope="de", dense_below=0),
                     "evaluation: every key, only the positions remapped (SelfExtend's groups)"),
}


def register() -> None:
    """Add the evaluation presets to infinitehip's table (idempotent; process-wide)."""
    register_presets("infinitehip", INFINITEHIP)
