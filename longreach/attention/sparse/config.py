"""The fields every top-k selection method shares (`SparseConfig`); each method's own config derives from it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...rope.strategies import ATTEND_CODES, PRUNE_CODES, parse_layer_spec

GRANULARITIES = ("layer", "kv_head", "head")


@dataclass(frozen=True)
class SparseConfig:
    # fields that only decode steps read: configs differing in these alone prefill identically (an eval may then
    # prefill a prompt once and decode it under each: tools/eval/variants.py)
    DECODE_ONLY: ClassVar[frozenset[str]] = frozenset({"dense_below_decode"})
    n_sink: int = 256  # first tokens every query reads
    n_window: int = 1024  # last tokens every query reads (the streaming window)
    block_q: int = 64  # query rows per block in prefill (decode blocks have one row)
    # prefill: each of a prompt's last `last_rows` rows is a query block of one row (0: none, the paper), so the row
    # that predicts the first output token and the question's rows before it pick their own keys instead of sharing
    # a max over block_q rows (a 64-row block's max dropped the pass key in the retrieval heads of SmolLM2's layers
    # 18 and 20; passkey at 8K/16K/32K, 15 prompts each: 40/53/20% with 1 row alone, 60/67/53% with 16; quality.md)
    last_rows: int = 16
    granularity: str = "kv_head"  # one selection per layer, per KV-head group, or per head (see index.py)
    dense_layers: tuple[int, ...] = ()  # layers that always attend densely
    # sequences this short attend densely; None: the method's token budget; "trained": the model's trained context
    # (max_position_embeddings; at least the budget), inside which dense attention is exact and the model's own
    dense_below: int | str | None = None
    # decode steps' limit, where it differs (sparse decode can win inside the trained context while sparse prefill
    # loses there: docs/design-crossover.md). None: dense_below's limit, exactly; an integer; "trained"; "auto": the
    # measured decode crossover of this model shape, GPU, method config and KV dtype (`longreach calibrate
    # crossover`), at most the trained context, and dense_below's limit while no measurement exists (sparse/crossover.py)
    dense_below_decode: int | str | None = None
    # RoPE position strategies (rope/strategies.py), "strategy[:first-last],...", first match per layer wins
    prune_rope: str = "none"  # while scoring chunks: none, rt, ci, il, de
    attend_rope: str = "none"  # in block-sparse attention: none, st, il, de
    rope_from: int | None = None  # remap query blocks ending at or past this position; None: the trained length
    de_group: int | None = None  # SelfExtend group for de; None: the smallest that fits the trained length

    def __post_init__(self) -> None:
        for name in ("n_sink", "n_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_q < 1:
            raise ValueError(f"block_q must be >= 1, got {self.block_q}")
        if not isinstance(self.last_rows, int) or not 0 <= self.last_rows <= 4096:
            raise ValueError(f"last_rows must be an integer in [0, 4096], got {self.last_rows!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if any(layer < 0 for layer in self.dense_layers):
            raise ValueError(f"dense_layers must be layer indices >= 0, got {self.dense_layers}")
        parse_layer_spec(self.prune_rope, PRUNE_CODES, "prune_rope")
        parse_layer_spec(self.attend_rope, ATTEND_CODES, "attend_rope")
        if self.dense_below is not None and self.dense_below != "trained" and (
                isinstance(self.dense_below, bool) or not isinstance(self.dense_below, int) or self.dense_below < 0):
            raise ValueError(f"dense_below must be an integer >= 0, \"trained\" (the model's trained context) or "
                             f"None (the method's token budget), got {self.dense_below!r}")
        d = self.dense_below_decode
        if d is not None and d not in ("trained", "auto") and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(f"dense_below_decode must be an integer >= 0, \"trained\", \"auto\" (the measured decode "
                             f"crossover, at most the trained context) or None (dense_below's limit), got {d!r}")
        for name in ("rope_from", "de_group"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < (0 if name == "rope_from" else 1)):
                raise ValueError(f"{name} must be None or an integer >= {0 if name == 'rope_from' else 1}, got {v!r}")
