"""Cascading KV cache: the schedule and the four eviction rules, batched strides == token by token, the importance EMA,
the backend against a brute-force oracle, the kernels in the interpreter, and the engine (bounded pages, config)."""
import json
import logging
import random

import numpy as np
import pytest
import torch

from longreach.attention.backend import AttentionMetadata
from longreach.attention.cascading import PRESETS, CascadeLayout, CascadingBackend, CascadingConfig, ema_weights
from longreach.config import EngineConfig
from longreach.kvcache.block_manager import BlockManager
from longreach.kvcache.cascade import CascadeRings, ReferenceCascade, apply_moves, batch_plans, execute_plan
from longreach.kvcache.paged import PagedKVCache
from longreach.models.config import ModelConfig
from longreach.rope.scaling import _base_inv_freq, apply_rope


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Hundreds of tiny ops per step: on a shared 2-core machine two intra-op threads stall each other (~8 ms per
    einsum instead of 0.03). Results do not depend on it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
        offers, levels = batch_plans([rings.plan(n, stage)], [lambda a: a], "cpu")
        apply_moves(*execute_plan(offers, levels, sc), [tokpos, sc])
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
        offers, levels = batch_plans(plans, maps, "cpu")
        apply_moves(*execute_plan(offers, levels, score), [tokpos, score])
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


# ---- the backend against a brute-force oracle ---------------------------------------------------------------------
HQ, HKV, D = 6, 2, 16  # 3 query heads per KV head (not a power of two)


def _model_config(layers=1):
    return ModelConfig("llama", 32, 32, 64, layers, HQ, HKV, D, 1e-5, 512)


def _rope(x, pos):
    ang = pos.float()[:, None] * _base_inv_freq(10000.0, D)[None, :]
    return apply_rope(x, ang.cos(), ang.sin())


class Driver:
    """Feeds a one-layer CascadingBackend directly with random queries/keys/values, building each step's metadata
    as the model runner does, and keeps a brute-force oracle per sequence and KV head: the literal rules
    (`ReferenceCascade`), exact attention over what the cache holds at StreamingLLM positions, and the EMA."""

    def __init__(self, cfg: dict, max_step=16, page=4, seed=0):
        self.ec = EngineConfig(model="x", attention="cascading", attention_config=json.dumps(cfg), block_size=page,
                               max_num_batched_tokens=max_step)
        self.backend = CascadingBackend(_model_config(), self.ec, torch.device("cpu"))
        self.cfg = self.backend.config
        lay = self.backend.kv_layout
        self.blocks = BlockManager(64, page, slots_for=lay.slots_for)
        self.cache = PagedKVCache(1, 65, page, HKV, D, torch.float32, torch.device("cpu"))
        self.g = torch.Generator().manual_seed(seed)
        self.seqs: dict[int, dict] = {}

    def add(self, sid, T):
        g = self.g
        self.seqs[sid] = dict(q=torch.randn(T, HQ, D, generator=g), k=torch.randn(T, HKV, D, generator=g),
                              v=torch.randn(T, HKV, D, generator=g), t=0,
                              ref=[ReferenceCascade(self.cfg.n_sink, self.backend.sizes) for _ in range(HKV)],
                              ema=[{} for _ in range(HKV)])

    def step(self, chunks: dict[int, int], prefill=True):
        sids = list(chunks)
        lay, bs = self.backend.kv_layout, self.ec.block_size
        qs, ks, vs, slots, tables = [], [], [], [], []
        for sid in sids:
            s, n = self.seqs[sid], chunks[sid]
            c = s["t"]
            assert self.blocks.ensure(sid, c + n)
            table = np.asarray(self.blocks.table(sid), dtype=np.int64)
            local = lay.slot_index(c, n)
            assert local.max() < lay.slots_for(c + n) <= len(table) * bs
            slots.append(table[local // bs] * bs + local % bs)
            tables.append(table)
            pos = torch.arange(c, c + n)
            qs.append(_rope(s["q"][c:c + n], pos))
            ks.append(_rope(s["k"][c:c + n], pos))
            vs.append(s["v"][c:c + n])
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(sids), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.from_numpy(t)
        lens = [chunks[s] for s in sids]
        ctx = [self.seqs[s]["t"] for s in sids]
        meta = AttentionMetadata(prefill, sids, lens, ctx, torch.tensor(np.cumsum([0] + lens), dtype=torch.int32),
                                 torch.tensor([c + n for c, n in zip(ctx, lens)], dtype=torch.int32), bt,
                                 torch.from_numpy(np.concatenate(slots)), max(c + n for c, n in zip(ctx, lens)),
                                 max(lens))
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        self.cache.store(0, k, v, meta.slot_mapping)
        self.backend.begin_step(meta)
        out = self.backend.forward(0, q, k, v, *self.cache.layer(0), meta)
        row = 0
        for sid, n in zip(sids, lens):
            want = self._oracle(sid, n)
            assert (out[row:row + n] - want).abs().max() < 2e-5, sid
            row += n
        self.backend.check_integrity()
        self._compare_state()

    def _oracle(self, sid, n):
        """Exact outputs of the next n rows, stride by stride, and the oracle's own cache and EMA advanced."""
        s, cfg = self.seqs[sid], self.cfg
        out = torch.empty(n, HQ, D)
        beta, hpp = cfg.ema, HQ // HKV
        done = 0
        while done < n:
            t0 = s["t"]
            m = min((t0 // self.backend.stride + 1) * self.backend.stride, t0 + n - done) - t0  # aligned strides
            for g in range(HKV):
                held = s["ref"][g].contents()
                toks = held + [t for t in range(t0, t0 + m) if t not in held]  # the sink rows are already "held"
                first = len(toks) - m  # virtual position of the stride's first row
                kk = _rope(s["k"][toks, g][:, None], torch.arange(len(toks)))[:, 0]
                qq = _rope(s["q"][t0:t0 + m, g * hpp:(g + 1) * hpp], torch.arange(first, first + m))
                scores = torch.einsum("mhd,kd->hmk", qq, kk) * D ** -0.5
                causal = torch.arange(len(toks))[None, :] <= torch.arange(first, first + m)[:, None]
                p = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # (hpp, m, keys)
                out[done:done + m, g * hpp:(g + 1) * hpp] = torch.einsum("hmk,kd->mhd", p, s["v"][toks, g])
                gained = (torch.from_numpy(ema_weights(m, beta)).float()[:, None] * p.mean(0)).sum(0)
                ema = s["ema"][g]
                for j, t in enumerate(toks):
                    ema[t] = beta ** m * ema.get(t, 0.0) + float(gained[j]) if t < t0 else float(gained[j])
                for t in range(t0, t0 + m):
                    s["ref"][g].insert(t, lambda x: ema[x])
            s["t"] += m
            done += m
        return out

    def _compare_state(self):
        b = self.backend
        for sid, s in self.seqs.items():
            if sid not in b._rings:
                continue
            rings, table, bs = b._rings[sid], b._tables[sid], self.ec.block_size
            slots = table[rings.chronological() // bs] * bs + rings.chronological() % bs
            for g in range(HKV):
                want = s["ref"][g].contents()[min(rings.tokens, self.cfg.n_sink):]
                assert b._tokpos[0, slots, g].tolist() == want, (sid, g)
                got = b._score[0, slots, g]
                exp = torch.tensor([s["ema"][g][t] for t in want])
                assert torch.allclose(got, exp, rtol=1e-4, atol=1e-7), (sid, g)


SMALL = {"n_sink": 2, "num_subcaches": 3, "subcache_size": 3, "ema": 0.8, "stride": 5, "block_q": 4, "block_k": 2}
NO_SINK = {"n_sink": 0, "num_subcaches": 2, "subcache_size": 4, "ema": 0.5, "stride": 3, "block_q": 2, "block_k": 3}


@pytest.mark.parametrize("cfg", [SMALL, NO_SINK], ids=["small", "no-sink"])
def test_backend_equals_oracle_with_drops_strides_and_a_batch(cfg):
    """Two sequences in one batch, chunks longer than the stride (strides inside a step), decode steps, hundreds of
    drops: every row's output equals exact attention over the tokens its KV head's cache holds (at StreamingLLM
    positions), the cache holds what the literal rules give with the oracle's importance, and the stored
    importance equals the brute-force EMA."""
    d = Driver(cfg)
    d.add(0, 90)
    d.add(1, 60)
    rng = random.Random(1)
    while any(s["t"] < len(s["q"]) for s in d.seqs.values()):
        left = {sid: len(s["q"]) - s["t"] for sid, s in d.seqs.items() if len(s["q"]) > s["t"]}
        decode = rng.random() < 0.3
        chunks = {sid: 1 if decode else min(rng.randrange(1, 17), n) for sid, n in left.items()}
        d.step(chunks, prefill=not decode)
    r = d.backend._rings[0]
    assert r.stats["compare"] > 10 and r.stats["fall"] > 10  # rules 3/4 and the last window were exercised
    assert sum(sum(ref.hits[k] for k in ("rule3", "rule4")) for ref in d.seqs[0]["ref"]) == 2 * r.stats["compare"]
    d.backend.free_sequence(0)
    assert 0 not in d.backend._rings


def test_layout_slots_stay_within_the_bound_and_apart():
    """Staged tokens never overlap the ring slots already filled, and every slot is below slots_for(end)."""
    lay = CascadeLayout(3, 20, 8, 4, 0)
    rng = random.Random(0)
    for _ in range(200):
        c = rng.randrange(0, 60)
        n = rng.randrange(1, 9)
        idx = lay.slot_index(c, n)
        assert idx.max() < lay.slots_for(c + n) <= lay.max_slots
        ring_used = lay.n_sink + min(max(c + n - lay.n_sink, 0), lay.capacity)
        staged = idx[np.arange(c, c + n) >= lay.n_sink]
        assert (staged >= ring_used).all() and len(set(idx.tolist())) == n
    assert lay.slots_for(10**6) == lay.max_slots == 3 + 20 + 8


# ---- kernels in the interpreter -----------------------------------------------------------------------------------
def _virtual_case(Hq, Hkv, dtype, seed=0):
    """Two sequences reading keys through a one-token-per-page table (scattered slots), like the backend."""
    g = torch.Generator().manual_seed(seed)
    V, n = [45, 23], [9, 1]
    nslots = 100
    kc = torch.randn(nslots, 1, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(nslots, 1, Hkv, D, generator=g).to(dtype)
    perm = torch.randperm(nslots, generator=g).int()
    table = torch.zeros(2, max(V), dtype=torch.int32)
    table[0, :V[0]], table[1, :V[1]] = perm[:V[0]], perm[V[0]:V[0] + V[1]]
    q = torch.randn(sum(n), Hq, D, generator=g).to(dtype)
    return V, n, kc, vc, table, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hq, Hkv", [(6, 2), (4, 4), (8, 2)])
def test_key_mass_kernel_equals_reference_and_brute_force(Hq, Hkv, dtype):
    from longreach.kernels.key_mass import key_mass_reference, key_mass_triton
    from longreach.rope.strategies import RopeArgs, rotate

    V, n, kc, _, table, q = _virtual_case(Hq, Hkv, dtype)
    inv = _base_inv_freq(10000.0, D)
    rope = RopeArgs("cache", inv, 0)
    first = [V[0] - n[0], V[1] - n[1]]
    w = torch.rand(sum(n), generator=torch.Generator().manual_seed(3))
    lse = torch.empty(sum(n), Hq)
    brute = torch.zeros(2, Hkv, max(V))
    row = 0
    for b in range(2):  # exact softmax row by row (fp32): log-sum-exp and the weighted column sums
        kk = rotate(kc[table[b, :V[b]].long(), 0].float(), torch.arange(V[b])[:, None], inv)
        for i in range(n[b]):
            for h in range(Hq):
                s = (q[row + i, h].float() @ kk[:first[b] + i + 1, h // (Hq // Hkv)].T) * D ** -0.5
                lse[row + i, h] = torch.logsumexp(s, 0)
                brute[b, h // (Hq // Hkv), :first[b] + i + 1] += w[row + i] * s.softmax(0) / (Hq // Hkv)
        row += n[b]
    args = (q, kc, table, torch.tensor([0, n[0]]), torch.tensor(n), torch.tensor(first), torch.tensor(V), lse, w,
            D ** -0.5, rope)
    ref = key_mass_reference(*args)
    out = key_mass_triton(*args)
    own = key_mass_reference(*args[:7], None, *args[8:])  # normalising its own softmax (the engine's CPU path)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (ref - brute).abs().max() < tol and (out - ref).abs().max() < tol and (own - ref).abs().max() < tol
    assert out[1, :, V[1]:].abs().max() == 0  # nothing past a sequence's keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bsa_kernel_with_cache_rope_equals_executor(dtype):
    """Strategy "cache" (keys stored un-rotated, each rotated at its position) through a one-token-per-page table:
    the Triton kernel (prefill blocks and split decode) equals the PyTorch executor; poisoned outputs show rows it
    would skip."""
    from longreach.attention.executor import block_sparse_attention
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import block_sparse_attention_triton
    from longreach.rope.strategies import RopeArgs

    V, n, kc, vc, table, q = _virtual_case(HQ, HKV, dtype, seed=1)
    rope = RopeArgs("cache", _base_inv_freq(10000.0, D), 0)
    S, BK, W = 3, 4, 4
    for bq, splits in ((4, 1), (1, 3)):
        qb = QueryBlocks.build(n, [V[0] - n[0], V[1] - n[1]], bq)
        sel = [torch.arange(S // BK, max(S // BK, (p + ln - 1 - W) // BK + 1))[None]
               for p, ln in zip(qb.pos, qb.length)]
        blocks, counts = SparseIndex.pack(sel, "cpu")
        idx = SparseIndex(bq, BK, S, W, 1, qb, blocks, counts)
        ref, lse_ref = block_sparse_attention(q, kc, vc, table, idx, D ** -0.5, rope=rope)
        out = torch.full_like(q, float("nan"))
        got, lse = block_sparse_attention_triton(q, kc, vc, table, idx, D ** -0.5, num_splits=splits, rope=rope,
                                                 out=out)
        tol = 2e-5 if dtype == torch.float32 else 3e-3
        assert (got.float() - ref.float()).abs().max() < tol and (lse - lse_ref).abs().max() < tol


# ---- through the engine on the test model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


TINY = {"n_sink": 4, "num_subcaches": 3, "subcache_size": 8, "stride": 16, "block_q": 8, "block_k": 4}  # 28 tokens


def _llm(path, cfg=None, **kw):
    from longreach.engine.llm import LLM

    args = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_model_len=4096, max_num_batched_tokens=64)
    args.update(kw)
    if cfg is not None:
        args.update(attention="cascading", attention_config=json.dumps(cfg))
    return LLM(path, **args)


def _ids(n, seed=0):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_longer_than_the_cache_runs_in_a_bounded_number_of_pages(tiny, caplog):
    """A 700-token prompt and 150 generated tokens with a 28-token cache: the sequence never holds more than the
    layout's pages (stated at start-up), holds exactly that many once the cache is full, and every step keeps the
    block manager's and the cache's invariants; everything is returned at the end."""
    from longreach import SamplingParams

    with caplog.at_level(logging.INFO, logger="longreach"):
        llm = _llm(tiny, TINY, max_num_batched_tokens=48)
    engine = llm.engine
    lay = engine.backend.kv_layout
    pages = -(-lay.max_slots // engine.config.block_size)
    assert f"keeps every sequence in at most {pages} pages" in caplog.text
    engine.add_request("r", _ids(700), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    held, steps = [], 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        seq = engine.scheduler.running[0] if engine.scheduler.running else None
        if seq is not None:
            held.append(len(engine.blocks.table(seq.seq_id)))
            engine.backend.check_integrity(seq.seq_id)
            assert engine.backend.cache_stats(seq.seq_id)["cached"] <= 4 + 24
        engine.blocks.check_integrity()
    assert len(outs[0].outputs[0].token_ids) == 150 and steps == -(-700 // 48) + 149
    assert max(held) <= pages and held[-1] == pages and len(set(held[20:])) == 1
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.backend._rings


def test_equals_dense_while_nothing_is_dropped(tiny):
    """Sink 4 + sub-caches 0 and 1 of 64 hold a 120-token prompt: no token is dropped, the virtual positions are the
    true ones, and the logits equal dense attention's (up to fp32 angle rounding of the re-rotation)."""
    ids = _ids(120, 1)
    dense = _llm(tiny).engine.prompt_logits(ids)
    big = {**TINY, "subcache_size": 64}
    for chunk in (64, 24):
        casc = _llm(tiny, big, max_num_batched_tokens=chunk).engine.prompt_logits(ids)
        assert (casc - dense).abs().max() < 2e-4


def test_one_subcache_token_by_token_equals_streaming(tiny):
    """One sub-cache of W and stride 1 is StreamingLLM with a window of W + 1 (the query included), sink positions
    rolled as StreamingLLM rolls them once the window is full: the same logits."""
    S, W = 4, 24
    ids = _ids(160, 2)
    casc = _llm(tiny, {**TINY, "num_subcaches": 1, "subcache_size": W, "stride": 1},
                max_num_batched_tokens=32).engine.prompt_logits(ids)
    stream = _llm(tiny, None, attention="streaming", max_num_batched_tokens=32, attention_config=json.dumps(
        {"n_sink": S, "n_window": W + 1, "block_q": 1, "last_rows": 0, "rope_from": S + W, "dense_below": 0})
    ).engine.prompt_logits(ids)
    assert (casc - stream).abs().max() < 2e-4


def test_chunked_prefill_equals_unchunked_and_batch_equals_alone(tiny):
    """Strides sit at fixed positions: a step holding several runs them one after the other, and a budget that is no
    multiple of the stride (40 vs 16) ends chunks on stride boundaries, so the logits do not depend on the chunking;
    for the same reason sequences in one batch (the scheduler splits budgets between them) equal each alone."""
    from longreach import SamplingParams

    ids = _ids(300, 3)
    whole = _llm(tiny, TINY, max_num_batched_tokens=256).engine.prompt_logits(ids)
    cut = _llm(tiny, TINY, max_num_batched_tokens=40)
    assert cut.engine.scheduler.chunk_align == 16
    assert (whole - cut.engine.prompt_logits(ids)).abs().max() < 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": _ids(n, 4 + n)} for n in (230, 90, 3)]
    llm = _llm(tiny, TINY)
    together = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts]
    assert together == alone


def test_config_errors_are_clear(tiny):
    from longreach.engine.llm import LLM

    assert PRESETS["65k"].cache_tokens == 65536 and PRESETS["65k"].num_subcaches == 8
    assert PRESETS["16k"].cache_tokens == 16384 and PRESETS["4k"].cache_tokens == 4096
    for bad, msg in (({"num_subcaches": 0}, "num_subcaches must be an integer >= 1"),
                     ({"ema": 1.0}, r"ema must be a number in \[0, 1\)"),
                     ({"subcache_size": 2.5}, "subcache_size must be an integer >= 1"),
                     ({"stride": True}, "stride must be an integer >= 1")):
        with pytest.raises(ValueError, match=msg):
            CascadingConfig(**bad)
    kw = dict(device="cpu", kv_cache_memory_gb=0.01, attention="cascading")
    with pytest.raises(ValueError, match=r"unknown CascadingConfig field\(s\) \['window'\]"):
        LLM(tiny, attention_config='{"window": 3}', **kw)
    with pytest.raises(ValueError, match="unknown cascading preset 'x'; available: 65k, 16k, 4k"):
        LLM(tiny, preset="x", **kw)
    with pytest.raises(ValueError, match="cannot be composed with another method"):
        LLM(tiny, decode_attention="dense", **kw)
    with pytest.raises(ValueError, match="KV offloading"):
        LLM(tiny, kv_offloading_size=1, **kw)
    with pytest.raises(ValueError, match="fp8"):
        LLM(tiny, kv_cache_dtype="fp8", **kw)
    with pytest.raises(ValueError, match="the 4180 slots one cascading sequence needs"):
        LLM(tiny, device="cpu", attention="cascading", preset="4k", kv_cache_memory_gb=1e-4, max_model_len=8192,
            max_num_batched_tokens=84)
