"""MInference's config: the pattern file (which one, `resolve_patterns`; its format, `load_patterns`), the config
dataclass and its presets (the method and its decisions: method.py)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

PATTERN_KINDS = {"a_shape": 2, "vertical_slash": 2, "block_sparse": 1}  # name -> number of integer parameters
DEFAULT_PATTERN = ("vertical_slash", 500, 1500)
PATTERNS_FORMAT = "longreach-minference-patterns/1"
PATTERNS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patterns")  # <alias>.json, package data
PATTERN_CHOICE = ("patterns", "pattern", "granularity", "block")  # config fields that leave no room for a default


def shipped_patterns() -> dict[str, str]:
    """Model alias -> path of the calibration file shipped for it (minference/patterns/<alias>.json)."""
    names = sorted(n for n in os.listdir(PATTERNS_DIR) if n.endswith(".json")) if os.path.isdir(PATTERNS_DIR) else []
    return {n[:-len(".json")]: os.path.join(PATTERNS_DIR, n) for n in names}


def resolve_patterns(patterns: str | None, model: str | None = None) -> str | None:
    """The calibration file minference loads: a path, or None for `pattern` on every head.

    `patterns` ending in .json or holding a path separator is a path, returned as given (loading checks it); any
    other string is the name of a shipped file, i.e. a model alias, and an unknown one raises ValueError listing
    them. `patterns` None with `model` an alias that has a shipped file gives that file (the by-alias default; pass
    `model` only when the user left the pattern choice open, see method.py's docstring); otherwise None."""
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


PRESETS = {
    "vs": MInferenceConfig(),  # every head vertical-slash (500, 1500): the default without a pattern file
    "a-shape": MInferenceConfig(pattern=("a_shape", 1024, 4096)),  # = StreamingLLM's 1K + 4K baseline
    "bs": MInferenceConfig(pattern=("block_sparse", 100)),
}
DEFAULT_PRESET = "vs"

PRESET_NOTES = {  # preset -> what it is for (`longreach backends`)
    "vs": "every head vertical-slash (500 columns, 1,500 diagonals); the default where no pattern file is shipped "
          "for the model's alias (shipped: attention/minference/patterns/<alias>.json)",
    "a-shape": "every head Λ-shape: 1,024 sink + 4,096 window tokens (StreamingLLM's baseline)",
    "bs": "every head block-sparse: its top 100 key blocks of 64 tokens",
}
