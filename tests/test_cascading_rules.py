"""Cascading KV cache, the bookkeeping of attention/cascading/rings.py: the schedule and the four eviction rules, batched strides
== token by token, the importance EMA."""
import random

import numpy as np
import pytest
import torch

from longreach.attention.cascading import ema_weights
from longreach.attention.cascading.rings import CascadeRings, ReferenceCascade, apply_moves, batch_plans, execute_plan

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one intra-op thread


# ---- the rules on hand-made sequences ---------------------------------------------------------------------------
SCORES = {3: 0.1, 4: 0.5, 5: 0.9, 6: 0.2, 7: 0.0, 8: 0.0, 9: 0.3, 10: 0.3}  # token -> importance


def _planned(n_sink, sizes, tokens, score, strides):
    """Insert `tokens` (0, 1, ...) through CascadeRings + execute_plan in strides; one KV head, importance
    score(token). Returns the cache contents, oldest first."""
    rings = CascadeRings(n_sink, sizes)
    T = len(tokens)
    stage0 = n_sink + rings.capacity
    tokpos = torch.full((stage0 + T, 1), -1, dtype=torch.long)
    sc = torch.zeros(stage0 + T, 1)
    t = 0
    for n in strides:
        past = [x for x in range(t, t + n) if x >= n_sink]
        stage = stage0 + np.arange(len(past))
        for x in range(t, t + n):
            if x < n_sink:
                tokpos[x] = x
        for i, x in enumerate(past):
            tokpos[stage[i]], sc[stage[i]] = x, score(x)
        apply_moves(*execute_plan(batch_plans([rings.plan(n, stage)], [lambda a: a], "cpu"), sc), [tokpos, sc])
        rings.check_integrity()
        assert rings.cached <= rings.capacity and all(f <= w for f, w in zip(rings.fill, rings.sizes))
        t += n
    return list(range(min(n_sink, T))) + tokpos[rings.chronological(), 0].tolist()


def test_each_rule_on_a_hand_made_sequence():
    """Sink 1, two sub-caches of 2. Traced by hand:
    1, 2 fill C0 (rule 1); 3 pushes 1 to C1 (offer 0, C1 empty: rule 1); 4 pushes 2 (offer 1, rule 1): C1 = [1, 2];
    5 pushes 3 (offer 2, even: rule 2): 1 falls off, C1 = [2, 3]; 6 pushes 4 (offer 3, odd): 4 (0.5) beats C1's
    newest 3 (0.1): rule 4, C1 = [2, 4]; 7 pushes 5 (offer 4: rule 2): 2 falls, C1 = [4, 5]; 8 pushes 6 (offer 5):
    6 (0.2) loses to 5 (0.9): rule 3, dropped. Cache: [0 | 4 5 | 7 8]."""
    ref = ReferenceCascade(1, [2, 2])
    trace = []
    for t in range(9):
        ref.insert(t, SCORES.get)
        trace.append(ref.contents())
        assert len(ref.contents()) <= 1 + 4
    assert trace[4] == [0, 1, 2, 3, 4]
    assert trace[5] == [0, 2, 3, 4, 5]
    assert trace[6] == [0, 2, 4, 5, 6]
    assert trace[8] == [0, 4, 5, 7, 8]
    assert ref.hits == {"rule1": 4, "rule2": 2, "rule3": 1, "rule4": 1, "fall": 2}
    # 9 pushes 7 (offer 6: rule 2, 4 falls); 10 pushes 8 (offer 7): 8 and C1's newest 7 both score 0, and a tie
    # keeps the token already there (rule 3)
    for t in (9, 10):
        ref.insert(t, SCORES.get)
    assert ref.contents() == [0, 5, 7, 9, 10] and ref.hits["rule3"] == 2 and ref.hits["fall"] == 3
    # the planned, batched path gives the same cache token by token and in strides of any length
    for strides in ([1] * 11, [11], [3, 5, 3], [2, 1, 8]):
        assert _planned(1, [2, 2], list(range(11)), lambda x: SCORES.get(x, 0.0), strides) == ref.contents()


def test_exponential_schedule_reach():
    """With equal importance only the schedule acts (ties drop the challenger): sub-cache j keeps every 2^j-th token
    of the stream that reached it, so the cache reaches back about W (2^N - 1) tokens."""
    S, W, N, T = 2, 4, 3, 300
    ref = ReferenceCascade(S, [W] * N)
    for t in range(T):
        ref.insert(t, lambda x: 0.0)
    subs = [list(s) for s in ref.subs]
    assert subs[0] == list(range(T - W, T))
    for j in range(1, N):
        gaps = np.diff(subs[j])
        assert len(subs[j]) == W and (gaps == 2 ** j).all(), (j, subs[j])
    assert ref.contents()[S] >= T - W * (2 ** N - 1) - 2 ** N  # the oldest cached token
    assert _planned(S, [W] * N, list(range(T)), lambda x: 0.0, [7] * (T // 7) + [T % 7]) == ref.contents()


@pytest.mark.parametrize("seed", range(4))
def test_batched_strides_equal_token_by_token(seed):
    """Random sink and sub-cache sizes, random per-head importance (ties included), random stride lengths, several
    sequences planned and executed in one batch: each sequence's cache, in every KV head, equals the literal rules
    applied one token at a time."""
    rng = random.Random(seed)
    H = 3
    seqs = []
    for s in range(3):
        S, sizes = rng.randrange(0, 4), [rng.randrange(1, 7) for _ in range(rng.randrange(1, 5))]
        T = rng.randrange(20, 160)
        sc = torch.rand(T, H, generator=torch.Generator().manual_seed(100 * seed + s))
        if s == 0:
            sc = (sc * 3).floor()  # many ties
        seqs.append(dict(S=S, sizes=sizes, T=T, sc=sc, rings=CascadeRings(S, sizes), t=0))
    base, off = [], 0
    for q in seqs:  # each sequence its own range of flat slots: sink + rings + staging room
        base.append(off)
        off += q["S"] + sum(q["sizes"]) + q["T"]
    tokpos = torch.full((off, H), -1, dtype=torch.long)
    score = torch.zeros(off, H)
    while any(q["t"] < q["T"] for q in seqs):
        plans, maps = [], []
        for q, b in zip(seqs, base):
            if q["t"] >= q["T"]:
                continue
            n = min(rng.randrange(1, 12), q["T"] - q["t"])
            t0, S = q["t"], q["S"]
            past = [x for x in range(t0, t0 + n) if x >= S]
            stage = S + q["rings"].capacity + np.arange(len(past))
            for x in range(t0, min(t0 + n, S)):
                tokpos[b + x] = x
            for i, x in enumerate(past):
                tokpos[b + stage[i]], score[b + stage[i]] = x, q["sc"][x]
            plans.append(q["rings"].plan(n, stage))
            maps.append(lambda a, b=b: a + b)
            q["t"] += n
        apply_moves(*execute_plan(batch_plans(plans, maps, "cpu"), score), [tokpos, score])
    for q, b in zip(seqs, base):
        q["rings"].check_integrity()
        for h in range(H):
            ref = ReferenceCascade(q["S"], q["sizes"])
            for t in range(q["T"]):
                ref.insert(t, lambda x: float(q["sc"][x, h]))
            got = list(range(min(q["S"], q["T"]))) + tokpos[b + q["rings"].chronological(), h].tolist()
            assert got == ref.contents()


def test_importance_ema_one_stride_equals_token_by_token():
    """s <- beta^n s + sum_i (1 - beta) beta^(n-1-i) a_i is n single-token EMA ticks."""
    beta, n = 0.9, 7
    a = np.random.default_rng(0).random(n)
    s_tick = 0.4
    for x in a:
        s_tick = beta * s_tick + (1 - beta) * x
    s_stride = beta ** n * 0.4 + (ema_weights(n, beta) * a).sum()
    assert abs(s_tick - s_stride) < 1e-12
