"""RoPE position strategies for sparse attention: which positions queries and keys take while *pruning* (scoring
chunks) and while *attending* (block-sparse attention), per layer range. InfiniteHiP §4 / App. B–D, digest §1.5,
§6.2–6.6.

Keys stay in the KV cache rotated at their true positions (rope/scaling.py). A strategy names new positions; the
kernels (and the PyTorch references here) rotate a key by `new - true` and a query by `new_q - true_q`, which is
exact because rotations compose. The angle is computed in fp32 and reduced to [-pi, pi] before cos/sin, so the
error is about position x 6e-8 positions (0.06 at 1M) — the same order as the fp32 angle the model used to store
the key.

Pruning strategies (`prune_rope`), relative to the query block's selectable candidates:
  none  true positions.
  rt    relative (IH, layers 4+): the query sits at n_window + 1; SelectRep's left-branch representative (the first
        probe of a chunk) at 0, right-branch ones (every later probe) and exactly-scored keys at 1. Comparisons are
        by content at a fixed near-window distance, with a one-position bias to the more recent half.
  ci    chunk-indexed (IH, layers 1–3): every key of a chunk takes the chunk's ordinal among the stage's candidates,
        the last candidate chunk sitting n_window before the query. Settled (digest §8.1): k = ordinal c (0-based),
        q = (n_chunk - 1) + n_window, implemented as k = c - (n_chunk - 1), q = n_window (same distances); n_chunk is
        the number of valid candidates of that query block and selection group. The paper's min(i_orig, ...) never
        binds here: a query is always past its candidates plus the window. Needs position-ordered candidate lists,
        so only infinitehip accepts it.
  il    InfLLM-style: every candidate key at 0, the query at n_window (one shared distance: the window's edge).
  de    SelfExtend grouping: k = p_k // G, q = p_q // G + W - W // G with W = n_window (candidates are all beyond
        the window, so always grouped). G: `de_group`, or the smallest group that maps the context into the trained
        length (`de_group_size`).
Attention strategies (`attend_rope`); the window part always keeps true relative positions (every strategy keeps
the neighbourhood exact), only the sink and the selected keys ("far" keys) move:
  none  true positions.
  st    StreamingLLM-style rolling positions (IH default, BLOG): the attended keys are numbered consecutively in
        their original order — sink 0..n_sink-1, then the selected keys, then the window — and the query takes the
        last number. Settled (digest §8.5): per query block the far keys get fixed numbers and a row at true
        position p takes q = n_sink + n_selected + n_window - 1 against them, so the nearest selected key is exactly
        one step beyond the window's farthest key; a row's window keys keep their true distances p - k.
  il    sink keys keep their positions, every selected key sits at n_sink, the query at n_sink + n_window.
  de    SelfExtend: far keys at p_k // G, the query at p // G + W - W // G; the window keeps true distances.
  cache a bounded cache's own (attention/cascading/), not selectable by the sparse methods: its keys are stored
        *un-rotated* (tokens move between slots and are renumbered every step) and every key is rotated at its
        position in the attended sequence — sink, the cached tokens oldest first, the chunk: StreamingLLM's numbering
        — with the queries arriving rotated at theirs. Applies to every query block (no `rope_from`).
Remapping applies to query blocks that end at or past `rope_from` (default: the model's trained context length):
inside the trained length true positions are exact and what the model knows (on SmolLM2 at 8K, relative scoring
costs recall: 0.979 -> 0.962, facts.md), beyond it they are out of distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PRUNE_CODES = {"none": 0, "rt": 1, "ci": 2, "il": 3, "de": 4}
ATTEND_CODES = {"none": 0, "st": 1, "il": 2, "de": 3}
CACHE_CODE = 4  # attend strategy "cache": keys stored un-rotated, rotated at their position (not in ATTEND_CODES)


def attend_code(mode: str) -> int:
    """The kernels' code of an attention strategy, "cache" included."""
    return CACHE_CODE if mode == "cache" else ATTEND_CODES[mode]


def parse_layer_spec(spec: str, allowed: dict[str, int], what: str) -> tuple[tuple[str, int, int | None], ...]:
    """"ci:0-2,rt" -> (("ci", 0, 2), ("rt", 0, None)): strategy[:first-last | :layer], first match wins; an entry
    without layers matches every layer."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what} must be a string like 'ci:0-2,rt'; strategies: {', '.join(allowed)}")
    out = []
    for part in spec.split(","):
        name, _, layers = part.strip().partition(":")
        if name not in allowed:
            raise ValueError(f"{what}: unknown strategy {name!r} in {spec!r}; allowed: {', '.join(allowed)}")
        lo, hi = 0, None
        if layers:
            a, _, b = layers.partition("-")
            try:
                lo, hi = int(a), int(b or a)
            except ValueError:
                raise ValueError(f"{what}: bad layer range {layers!r} in {spec!r}; write first-last, e.g. ci:0-2") \
                    from None
            if lo < 0 or hi < lo:
                raise ValueError(f"{what}: bad layer range {layers!r} in {spec!r}")
        out.append((name, lo, hi))
    return tuple(out)


def strategy_for(spec: tuple[tuple[str, int, int | None], ...], layer: int) -> str:
    for name, lo, hi in spec:
        if layer >= lo and (hi is None or layer <= hi):
            return name
    return "none"


def de_group_size(context_len: int, trained_len: int, window: int) -> int:
    """Smallest SelfExtend group G with context_len // G + window <= trained_len (at least 1)."""
    room = max(1, trained_len - window)
    return max(1, math.ceil(context_len / room))


@dataclass(frozen=True)
class RopeFrame:
    """What position remapping needs from the model: its inverse frequencies and where remapping starts."""

    inv_freq: torch.Tensor  # (D/2,) fp32
    rope_from: int  # query blocks ending at or past this position are remapped
    trained_len: int

    @classmethod
    def of_model(cls, model_config, rope_from: int | None, device) -> "RopeFrame":
        """The model's frame: its RoPE frequencies on `device`, remapping from `rope_from` (None: the trained
        length)."""
        from .scaling import rope_inv_freq

        trained = model_config.max_position_embeddings
        inv = rope_inv_freq(model_config.rope, model_config.head_dim)[0].float().to(device)
        return cls(inv, trained if rope_from is None else rope_from, trained)


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., D) (rotate-half layout) by `delta` positions (broadcast to x.shape[:-1]); fp32 out."""
    return rotate_cs(x, *rotation(delta.to(x.device), inv_freq.to(x.device)))


def rotation(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (delta.shape + (D/2,)) of a rotation by `delta` positions, angles reduced to [-pi, pi): `rotate`'s
    tables, for callers that rotate several tensors by the same positions."""
    ang = delta.to(torch.float32)[..., None] * inv_freq
    ang = ang - (2 * math.pi) * torch.floor(ang / (2 * math.pi) + 0.5)
    return ang.cos(), ang.sin()


def rotate_cs(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., D) (rotate-half layout) by the angles whose cos and sin (broadcast to x.shape[:-1] + (D/2,))
    are given; fp32 out. rotate_cs(x, c, -s) undoes rotate_cs(x, c, s)."""
    half = x.shape[-1] // 2
    x = x.float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# ---- pruning ------------------------------------------------------------------------------------------------------
def block_row_positions(end: torch.Tensor, row_ok: torch.Tensor, stride: int = 1) -> torch.Tensor:
    """True positions (nb, R) of query blocks' rows as the pruning takes them: a block ending before `end` (nb,)
    with n = row_ok.sum(1) rows taken, every `stride`-th row counted back from its last one (HiP's query stride
    b_sq; 1: every row), ascending: row j at end - 1 - (n - 1 - j) * stride. Rows past n continue the sequence
    (their scores are masked or replaced by the callers)."""
    n = row_ok.sum(1)
    j = torch.arange(row_ok.shape[1], device=row_ok.device)
    if stride == 1:  # (the same in fewer ops: a captured decode step runs this per layer)
        return (end - n)[:, None] + j
    return (end + (stride - 1) - n * stride)[:, None] + j * stride


def prune_query_pos(mode: str, p: torch.Tensor, n_window: int, group: int) -> torch.Tensor:
    """New position of query rows at true positions p while scoring chunks."""
    if mode == "rt":
        return torch.full_like(p, n_window + 1)
    if mode in ("ci", "il"):
        return torch.full_like(p, n_window)
    if mode == "de":
        return p // group + n_window - n_window // group
    return p


def prune_key_pos(mode: str, pos: torch.Tensor, right: bool, ordinal_from_end: torch.Tensor | None,
                  group: int) -> torch.Tensor:
    """New position of probed keys at true positions `pos`. `right`: a right-branch probe (or an exact score);
    `ordinal_from_end`: c - (n_chunk - 1) of each key's chunk (ci only)."""
    if mode == "rt":
        return torch.full_like(pos, 1 if right else 0)
    if mode == "ci":
        return ordinal_from_end.expand_as(pos)
    if mode == "il":
        return torch.zeros_like(pos)
    if mode == "de":
        return pos // group
    return pos


# ---- attention ----------------------------------------------------------------------------------------------------
def attend_query_pos(mode: str, p: torch.Tensor, n_sink: int, sel_tokens: torch.Tensor, n_window: int,
                     group: int) -> torch.Tensor:
    """New position of query rows (true positions p) against the far (sink + selected) keys."""
    if mode == "st":
        return p * 0 + (n_sink + sel_tokens + n_window - 1)
    if mode == "il":
        return torch.full_like(p, n_sink + n_window)
    if mode == "de":
        return p // group + n_window - n_window // group
    return p


def attend_key_pos(mode: str, kpos: torch.Tensor, is_sink: torch.Tensor, sel_rank: torch.Tensor, n_sink: int,
                   group: int) -> torch.Tensor:
    """New position of far keys at true positions kpos; `sel_rank`: index of a selected key among the selected
    tokens (block slot * block_k + offset)."""
    if mode == "st":
        return torch.where(is_sink, kpos, n_sink + sel_rank)
    if mode == "il":
        return torch.where(is_sink, kpos, torch.full_like(kpos, n_sink))
    if mode == "de":
        return kpos // group
    return kpos


@dataclass(frozen=True)
class RopeArgs:
    """One launch's remapping: strategy, the model's inverse frequencies, where remapping starts, SelfExtend group."""

    mode: str
    inv_freq: torch.Tensor
    rope_from: int
    group: int = 1  # SelfExtend group (de)
    n_window: int = 0  # pruning: the method's window (a block's rows end at its candidates' end + n_window)
