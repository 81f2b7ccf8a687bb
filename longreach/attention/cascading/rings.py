"""Cascading KV cache bookkeeping (Willette et al. 2024, digest §3.3): sink tokens + N sub-caches as ring buffers, the
exponential acceptance schedule and the four eviction rules. Plain Python / numpy (the plan) and a few torch gathers
(its execution); no kernels, CPU-testable.

The rules, as settled here (docs/sparse.md lists the decisions). A token that is not a sink token enters sub-cache 0,
which takes every token. Whenever a token enters a *full* sub-cache j, the oldest token y of C_j leaves it and is
*offered* to C_{j+1}; the k-th offer to C_{j+1} (counted from 0 over the sequence's life) meets:
  rule 1  C_{j+1} is not full: y is accepted unconditionally (empty space gets used).
  rule 2  C_{j+1} is full and accepting (k even: it accepts every other token C_j evicts, hence C_j sees about one
          token in 2^j): y is accepted, and C_{j+1}'s own oldest leaves in turn (the cascade).
  rule 3  C_{j+1} is full, not accepting (k odd), and y is not more important than z, C_{j+1}'s newest token: y is
          dropped (ties keep z: nothing moves).
  rule 4  as rule 3, but y is more important: y replaces z, which is dropped.
The oldest token of the last sub-cache, when pushed, leaves the cache (StreamingLLM's window edge). Within a ring the
order stays chronological: y is newer than everything in C_{j+1} and older than everything left in C_j, also when it
replaces z.

The pieces:
  * `ReferenceCascade`: the rules literally, one token at a time, on Python lists, with a counter per rule hit. The
    oracle of the tests.
  * `CascadeRings`: the *structure* of one sequence's cache: each ring's slot range, oldest index, fill and offer
    count. Which slot a token moves to and which two tokens compete depend only on how many tokens arrived, never on
    what they are, so one instance serves every layer and KV head. `plan(n, ...)` advances it by n tokens at once (a
    stride) and returns a `StridePlan`, level by level: which offers are accepted, which offer challenges which
    (rules 3/4), which tokens leave to the next level and which ring slots get written.
  * `batch_plans` concatenates a step's stride plans over the batch and packs them into one device buffer
    (`BatchPlan`); `execute_plan` (torch) resolves the challenges with one layer's importance per (slot, KV head) and
    returns the slot moves (destination, source per KV head), all sources read from the state before the stride.
    Applying them (`apply_moves`) moves K/V rows, importance and positions together. On a GPU one Triton kernel walks
    the packed plan instead (kernels/cascade_insert.py; these ops are its reference).
Batched stride insertion equals token-by-token insertion when importances are held fixed during the stride (tested):
at one level, an accepted offer and the odd offer right after it are exactly a pair whose winner stays (rules 3/4),
and pairs never interleave.

Local slots: a sequence's own slots, sink at [0, n_sink), ring j at [n_sink + sum(sizes[:j]), + sizes[j]).
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ...kernels.cascade_plan import (  # noqa: F401 (execute_plan, apply_moves: the plan's torch execution)
    PLAN_FIELDS, BatchLevel, BatchPlan, apply_moves, execute_plan)


# ---- the reference: the rules literally ---------------------------------------------------------------------------
class ReferenceCascade:
    """One sequence's cascading cache of token ids, one token at a time. `score(token)` gives importance (fixed here;
    the engine's changes between strides). `hits` counts rule1..rule4 and "fall" (left the last sub-cache)."""

    def __init__(self, n_sink: int, sizes: Sequence[int]):
        self.n_sink, self.sizes = n_sink, list(sizes)
        self.sink: list = []
        self.subs = [deque() for _ in self.sizes]
        self.offers = [0] * len(self.sizes)
        self.hits: Counter = Counter()

    def insert(self, token, score: Callable) -> None:
        if len(self.sink) < self.n_sink:
            self.sink.append(token)
        else:
            self._enter(0, token, score)

    def _enter(self, j: int, token, score) -> None:
        """`token` was accepted by sub-cache j."""
        sub = self.subs[j]
        if len(sub) < self.sizes[j]:
            self.hits["rule1"] += 1
            sub.append(token)
            return
        if j > 0:
            self.hits["rule2"] += 1
        y = sub.popleft()
        sub.append(token)
        if j + 1 == len(self.subs):
            self.hits["fall"] += 1
        else:
            self._offer(j + 1, y, score)

    def _offer(self, j: int, y, score) -> None:
        k = self.offers[j]
        self.offers[j] += 1
        nxt = self.subs[j]
        if len(nxt) < self.sizes[j] or k % 2 == 0:  # rule 1 / rule 2 (counted in _enter)
            self._enter(j, y, score)
        elif score(y) > score(nxt[-1]):
            self.hits["rule4"] += 1
            nxt[-1] = y
        else:
            self.hits["rule3"] += 1

    def contents(self) -> list:
        """Cached tokens, oldest first: the sink, then the deepest sub-cache ... sub-cache 0."""
        return list(self.sink) + [t for sub in reversed(self.subs) for t in sub]


# ---- the structure and its plans ----------------------------------------------------------------------------------
@dataclass
class LevelPlan:
    """One ring's share of a stride, in indices of the ring's incoming offers (`offers`: from the level before; level
    0: the stride's new tokens) and of the level's *pool* = [old ring tokens it references, its entries]."""

    num_offers: int
    pidx: np.ndarray  # (A,) entries: the offer each accepted entry starts as
    cidx: np.ndarray  # (A,) the odd offer challenging that entry (rules 3/4), -1: none
    old_slots: np.ndarray  # (r,) local slots of the ring's previous tokens this stride reads: the leaving ones, in
    #                        order, then the newest if offer 0 challenges it and it stays
    old_chal: np.ndarray  # (r,) offer challenging that old token (only the newest can be), -1: none
    out_idx: np.ndarray  # (k,) pool indices of the tokens leaving the ring, in order: the next level's offers
    dst: np.ndarray  # (w,) local ring slots written
    src_idx: np.ndarray  # (w,) pool index each written slot takes
    fills: int = 0  # rule-1 acceptances (not-full ring), for statistics
    compares: int = 0  # offers that meet rule 3 or 4


@dataclass
class StridePlan:
    first_token: int  # position of the stride's first token
    num_tokens: int
    stage_slots: np.ndarray  # (m,) local slots of the stride's tokens past the sink (level 0's offers), in order
    levels: list[LevelPlan] = field(default_factory=list)


class CascadeRings:
    """The structure of one sequence's cascading cache (no tensors; shared by all layers and KV heads).

    Mutated only by `plan` (which advances it) and never by tensor work, so the host can plan a whole step up front.
    """

    def __init__(self, n_sink: int, sizes: Sequence[int]):
        if n_sink < 0 or not sizes or min(sizes) < 1:
            raise ValueError(f"need n_sink >= 0 and sub-cache sizes >= 1, got {n_sink}, {list(sizes)}")
        self.n_sink, self.sizes = n_sink, [int(s) for s in sizes]
        self.bases = [n_sink + int(b) for b in np.cumsum([0] + self.sizes[:-1])]
        n = len(self.sizes)
        self.start = [0] * n  # ring index of the oldest token
        self.fill = [0] * n
        self.offers = [0] * n  # offers received (ring 0: tokens past the sink)
        self.tokens = 0  # tokens seen, sink included
        self.stats: Counter = Counter()  # rule1 (fills), rule2 (scheduled accepts into a full ring), compare, fall

    @property
    def capacity(self) -> int:
        return sum(self.sizes)

    @property
    def cached(self) -> int:
        """Tokens in the rings (the sink not counted)."""
        return sum(self.fill)

    def chronological(self) -> np.ndarray:
        """Local slots of the cached tokens past the sink, oldest first (the deepest ring first)."""
        parts = [b + (s + np.arange(f)) % w for b, s, f, w in
                 zip(self.bases, self.start, self.fill, self.sizes)]
        return np.concatenate(parts[::-1]).astype(np.int64) if parts else np.zeros(0, np.int64)

    def plan(self, n: int, stage_slots: np.ndarray) -> StridePlan:
        """Advance by `n` tokens (positions tokens .. tokens + n - 1). `stage_slots`: local slots holding those of them
        past the sink, in order (their staging place). Returns what moves where."""
        t0 = self.tokens
        past = n - max(0, min(self.n_sink, t0 + n) - t0)
        stage_slots = np.asarray(stage_slots, dtype=np.int64)
        if len(stage_slots) != past:
            raise ValueError(f"{past} of the {n} tokens go past the sink, got {len(stage_slots)} staging slots")
        plan = StridePlan(t0, n, stage_slots)
        m = past
        for j in range(len(self.sizes)):
            lv = self._level(j, m)
            plan.levels.append(lv)
            m = len(lv.out_idx)
        self.stats["fall"] += m
        self.tokens += n
        return plan

    def _level(self, j: int, m: int) -> LevelPlan:
        W, occ, start, k0, base = self.sizes[j], self.fill[j], self.start[j], self.offers[j], self.bases[j]
        e = np.arange(m)
        if j == 0:
            accept = np.ones(m, dtype=bool)  # sub-cache 0 takes every token
        else:
            accept = (e < W - occ) | ((k0 + e) % 2 == 0)  # rule 1 while not full, then every other offer
        compare = ~accept
        pidx = np.flatnonzero(accept)
        nxt = pidx + 1
        cidx = np.full(len(pidx), -1, dtype=np.int64)
        ok = nxt < m
        ok[ok] = compare[nxt[ok]]
        cidx[ok] = nxt[ok]
        newest_challenged = m > 0 and bool(compare[0])  # its partner, offer k0 - 1, is the ring's newest token
        A = len(pidx)
        L = occ + A
        k_out = max(0, L - W)
        k_ring = min(k_out, occ)
        old_c = np.arange(k_ring, dtype=np.int64)
        old_chal = np.full(k_ring, -1, dtype=np.int64)
        if newest_challenged:
            if occ - 1 < k_ring:
                old_chal[occ - 1] = 0
            else:
                old_c, old_chal = np.append(old_c, occ - 1), np.append(old_chal, 0)
        r = len(old_c)
        ring_slot = lambda c: base + (start + c) % W  # noqa: E731 - combined index -> local slot (arrays too)
        old_slots = ring_slot(old_c)
        # combined = previous ring tokens (occ) ++ entries (A); pool = [old_c ..., entries ...]
        c = np.arange(k_out, dtype=np.int64)
        out_idx = np.where(c < occ, c, r + c - occ)
        kept = np.arange(max(k_out, occ), L, dtype=np.int64)  # entries that stay: written into the ring
        dst, src = ring_slot(kept), r + kept - occ
        if newest_challenged and occ - 1 >= k_out:
            dst, src = np.append(dst, ring_slot(occ - 1)), np.append(src, r - 1)
        fills = int(min(A, W - occ)) if j > 0 else int(min(m, W - occ))
        self.stats["rule1"] += fills
        self.stats["rule2"] += A - fills if j > 0 else 0
        self.stats["compare"] += int(compare.sum())
        self.start[j] = (start + k_out) % W
        self.fill[j] = min(L, W)
        self.offers[j] = k0 + m
        return LevelPlan(m, pidx, cidx, old_slots, old_chal, out_idx, dst.astype(np.int64), src.astype(np.int64),
                         fills, int(compare.sum()))

    def check_integrity(self) -> None:
        """Structural invariants; raises AssertionError. Rings fill in order, each from its first slot; sizes bound
        every fill; the offer counters follow the token count."""
        past = max(0, self.tokens - self.n_sink)
        if self.offers[0] != past:
            raise AssertionError(f"sub-cache 0 saw {self.offers[0]} tokens, {past} arrived past the sink")
        for j, (w, f, s) in enumerate(zip(self.sizes, self.fill, self.start)):
            if not 0 <= f <= w:
                raise AssertionError(f"sub-cache {j} holds {f} tokens, its size is {w}")
            if not 0 <= s < w or (f < w and s != 0):
                raise AssertionError(f"sub-cache {j}: oldest at ring index {s} with {f}/{w} tokens")
            if j > 0 and f > 0 and self.fill[j - 1] < self.sizes[j - 1]:
                raise AssertionError(f"sub-cache {j} holds tokens while sub-cache {j - 1} is not full")
            if j > 0 and self.offers[j] < f:
                raise AssertionError(f"sub-cache {j} holds {f} tokens but was offered {self.offers[j]}")
        if self.cached > self.capacity or self.cached > past:
            raise AssertionError(f"{self.cached} tokens cached, capacity {self.capacity}, {past} arrived")


# ---- packing a batch's plans (executed by kernels/cascade_plan.py) ------------------------------------------------
def batch_plans(plans: list[StridePlan], to_flat: list[Callable[[np.ndarray], np.ndarray]], device) -> BatchPlan:
    """Concatenate the stride plans of several sequences (each with its local -> flat slot map) level by level, and
    pack them (`BatchPlan`)."""
    offers = np.concatenate([f(p.stage_slots) for p, f in zip(plans, to_flat)] + [np.zeros(0, np.int64)])
    cur = [len(p.stage_slots) for p in plans]  # offers per sequence at the current level
    e = np.zeros(0, np.int64)
    cat = lambda xs: np.concatenate(xs + [e]).astype(np.int64)  # noqa: E731
    host = []  # per level: (m, [pidx, cidx, old_flat, old_chal, out_idx, src_idx, dst_flat])
    for j in range(max([len(p.levels) for p in plans] + [0])):  # a sequence with fewer sub-caches drops its falls
        lvs = [p.levels[j] if j < len(p.levels) else LevelPlan(cur[i], e, e, e, e, e, e, e)
               for i, p in enumerate(plans)]
        o = np.cumsum([0] + cur[:-1])
        r = [len(lv.old_slots) for lv in lvs]
        a = [len(lv.pidx) for lv in lvs]
        R = sum(r)
        r0, a0 = np.cumsum([0] + r[:-1]), np.cumsum([0] + a[:-1])

        def pool_ix(ix, i):  # a sequence's pool index -> the batch pool [all old ..., all entries ...]
            ix = np.asarray(ix, dtype=np.int64)
            return np.where(ix < r[i], r0[i] + ix, R + a0[i] + ix - r[i])

        host.append((sum(cur), [
            cat([o[i] + lv.pidx for i, lv in enumerate(lvs)]),
            cat([np.where(lv.cidx >= 0, o[i] + lv.cidx, -1) for i, lv in enumerate(lvs)]),
            cat([to_flat[i](lv.old_slots) for i, lv in enumerate(lvs)]),
            cat([np.where(lv.old_chal >= 0, o[i] + lv.old_chal, -1) for i, lv in enumerate(lvs)]),
            cat([pool_ix(lv.out_idx, i) for i, lv in enumerate(lvs)]),
            cat([pool_ix(lv.src_idx, i) for i, lv in enumerate(lvs)]),
            cat([to_flat[i](lv.dst) for i, lv in enumerate(lvs)]),
        ]))
        cur = [len(lv.out_idx) for lv in lvs]
    # pack: header | offers | per level pidx cidx old_flat old_chal out_idx src_idx | every level's dst_flat
    L = len(host)
    header = np.zeros((L, PLAN_FIELDS), np.int64)
    parts = [header.reshape(-1), offers.astype(np.int64)]
    at = header.size + len(offers)
    for j, (m, arrs) in enumerate(host):
        header[j, :5] = m, len(arrs[0]), len(arrs[2]), len(arrs[4]), len(arrs[6])
        for f, x in enumerate(arrs[:6]):
            header[j, 5 + f] = at
            parts.append(x)
            at += len(x)
    dst0 = at
    for j, (_, arrs) in enumerate(host):
        header[j, 11] = at
        parts.append(arrs[6])
        at += len(arrs[6])
    packed = torch.from_numpy(np.concatenate(parts)).to(device)
    view = lambda o, n: packed[o:o + n]  # noqa: E731
    levels = []
    for h in header.tolist():
        m, A, r, k, w, o_p, o_c, o_old, o_ch, o_out, o_src, o_dst = h
        levels.append(BatchLevel(pidx=view(o_p, A), cidx=view(o_c, A), old_flat=view(o_old, r), old_chal=view(o_ch, r),
                                 out_idx=view(o_out, k), dst_flat=view(o_dst, w), src_idx=view(o_src, w)))
    return BatchPlan(offers=view(header.size, len(offers)), levels=levels, dst=packed[dst0:at], packed=packed,
                     cur_cap=int(max([len(offers)] + [h[0] for h in host])),
                     pool_cap=int(max([0] + [header[j, 1] + header[j, 2] for j in range(L)])),
                     offers_at=int(header.size), dst_at=int(dst0))
