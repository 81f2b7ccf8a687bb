"""Cascading KV cache, the attention backend: against a brute-force oracle (`Driver`), the slot layout, and the kernels
in the interpreter."""
import json
import random

import numpy as np
import pytest
import torch

from longreach.attention.backend import AttentionMetadata
from longreach.attention.cascading import CascadeLayout, CascadingBackend, ema_weights
from longreach.config import EngineConfig
from longreach.kvcache.block_manager import BlockManager
from longreach.attention.cascading.rings import ReferenceCascade
from longreach.kvcache.paged import PagedKVCache
from longreach.models.config import ModelConfig
from longreach.rope.scaling import _base_inv_freq, apply_rope

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one intra-op thread


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


@pytest.mark.parametrize("cfg, kernels, gathered", [(SMALL, False, False), (NO_SINK, False, False),
                                                    (SMALL, True, False), (SMALL, False, True)],
                         ids=["small", "no-sink", "small-insert-kernels", "small-gathered-prefill"])
def test_backend_equals_oracle_with_drops_strides_and_a_batch(cfg, kernels, gathered, monkeypatch):
    """Two sequences in one batch, chunks longer than the stride (strides inside a step), decode steps, hundreds of
    drops: every row's output equals exact attention over the tokens its KV head's cache holds (at StreamingLLM
    positions), the cache holds what the literal rules give with the oracle's importance, and the stored
    importance equals the brute-force EMA. `kernels`: the insertion and RoPE run the Triton kernels (interpreter).
    `gathered`: prefill strides take the gathered path (gather_virtual + causal_attention_lse, its fp32 reference
    standing in for FlashAttention), their key mass over the gathered keys."""
    monkeypatch.setattr(CascadingBackend, "step_kernels", staticmethod(lambda t: kernels))
    calls = []
    if gathered:
        monkeypatch.setattr(CascadingBackend, "_gathered_kernel", lambda self, q: calls.append(1) or "reference")
    d = Driver(cfg)
    d.add(0, 90)
    d.add(1, 60)
    rng = random.Random(1)
    while any(s["t"] < len(s["q"]) for s in d.seqs.values()):
        left = {sid: len(s["q"]) - s["t"] for sid, s in d.seqs.items() if len(s["q"]) > s["t"]}
        decode = rng.random() < 0.3
        chunks = {sid: 1 if decode else min(rng.randrange(1, 17), n) for sid, n in left.items()}
        d.step(chunks, prefill=not decode)
    assert bool(calls) == gathered
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


def _random_stride_plans(seed, H):
    """Several sequences, random sink/sub-cache sizes, advanced by random strides until their rings are full and
    cascading; returns the last stride's batched plan, its flat slot count, and EMA inputs over each sequence's slots
    (like `CascadingBackend._batch`: cached slots decay, the stride's new ones start from 0)."""
    from longreach.attention.cascading.rings import CascadeRings, batch_plans

    rng = random.Random(seed)
    seqs, off = [], 0
    for _ in range(3):
        S, sizes = rng.randrange(0, 4), [rng.randrange(1, 7) for _ in range(rng.randrange(1, 5))]
        rings = CascadeRings(S, sizes)
        for _ in range(rng.randrange(0, 12)):  # history: fills the rings, advances the offer parities
            n = rng.randrange(1, 9)
            rings.plan(n, np.arange(n - max(0, min(S, rings.tokens + n) - rings.tokens)))
        seqs.append((rings, off, rng.randrange(1, 14)))
        off += S + rings.capacity + 16
    plans, maps, e_slots, e_key = [], [], [], []
    vmax = max(r.n_sink + r.capacity + n for r, _, n in seqs)
    for b, (rings, base, n) in enumerate(seqs):
        past = n - max(0, min(rings.n_sink, rings.tokens + n) - rings.tokens)
        stage = rings.n_sink + rings.capacity + np.arange(past)
        cached = rings.chronological()
        plans.append(rings.plan(n, stage))
        maps.append(lambda a, base=base: np.asarray(a) + base)
        slots = np.concatenate([cached, stage])
        e_slots.append(slots + base)
        e_key.append(b * vmax + np.array(rng.sample(range(vmax), len(slots)), dtype=np.int64))
    plan = batch_plans(plans, maps, "cpu")
    g = torch.Generator().manual_seed(seed)
    e_slots = torch.from_numpy(np.concatenate(e_slots))
    # values on a coarse grid, exact in fp32: many ties after the EMA (a tie keeps the token already there)
    decay = torch.randint(0, 2, (len(e_slots),), generator=g).float()
    mass = torch.randint(0, 3, (len(seqs), H, vmax), generator=g).float() / 2
    score = torch.randint(0, 3, (off, H), generator=g).float() / 2
    return plan, off, score, mass, e_slots, torch.from_numpy(np.concatenate(e_key)), decay


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_insert_and_move_kernels_equal_torch(seed, dtype):
    """The fused insertion (importance EMA + the plan's rules, one program per KV head) gives the same sources and
    importances as `cascade_insert_reference` (torch EMA + `execute_plan`), and the two-phase move kernel moves K/V
    rows, importance and positions exactly as `apply_moves`, on random multi-sequence plans with challenges and ties
    (small blocks: several tiles per level)."""
    from longreach.kernels.cascade_insert import cascade_insert_reference, cascade_insert_triton, move_rows_triton
    from longreach.attention.cascading.rings import apply_moves

    H, Dk = 3, 16
    plan, nslots, score, mass, e_slots, e_key, decay = _random_stride_plans(seed, H)
    assert plan.dst.shape[0] > 0 and any(lv.cidx.ge(0).any() or lv.old_chal.ge(0).any() for lv in plan.levels)
    s_ref, s_got = score.clone(), score.clone()
    src_ref = cascade_insert_reference(plan, s_ref, mass, e_slots, e_key, decay)
    src = cascade_insert_triton(plan, s_got, mass, e_slots, e_key, decay, block=4)
    assert torch.equal(s_got, s_ref)
    assert torch.equal(src, src_ref)
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(nslots, H, Dk, generator=g).to(dtype) for _ in range(2))
    pos = torch.randint(0, 1000, (nslots, H), generator=g, dtype=torch.int32)
    want = [t.clone() for t in (k, v, s_ref, pos)]
    apply_moves(plan.dst, src_ref, want)
    got = [t.clone() for t in (k, v, s_ref, pos)]
    move_rows_triton(plan.dst, src, *got, block_w=4)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kernel_equals_torch(dtype):
    """The step's RoPE kernel: keys un-rotated into their slots with their positions, queries moved to their virtual
    positions, from q and k as strided views of one projection (as the model hands them), 3 query heads per KV head;
    equal to `cascade_rope_reference`, slots not written left alone."""
    from longreach.attention.cascading.attend import unrotation
    from longreach.kernels.cascade_insert import cascade_rope_reference, cascade_rope_triton
    from longreach.rope.strategies import rotation

    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, Dk, nslots = 7, 6, 2, 16, 40
    qkv = torch.randn(T, Hq + 2 * Hkv, Dk, generator=g).to(dtype)
    q, k = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv]
    pos = torch.tensor([0, 5, 9, 100, 4096, 70000, 1 << 20])
    virt = torch.randint(0, 5000, (T,), generator=g)
    inv = _base_inv_freq(10000.0, Dk)
    tables = unrotation(pos, inv), rotation(virt[:, None], inv)
    slots = torch.randperm(nslots, generator=g)[:T]
    ks = torch.randn(nslots, Hkv, Dk, generator=g).to(dtype)
    ps = torch.full((nslots, Hkv), -7, dtype=torch.int32)
    want_k, want_p, got_k, got_p = ks.clone(), ps.clone(), ks.clone(), ps.clone()
    pos32 = pos[:, None].to(torch.int32)
    want_q = cascade_rope_reference(q, k, want_k, want_p, slots, pos32, *tables)
    got_q = cascade_rope_triton(q, k, got_k, got_p, slots, pos32, *tables)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert got_q.dtype == dtype and (got_q.float() - want_q.float()).abs().max() < tol
    assert (got_k.float() - want_k.float()).abs().max() < tol and torch.equal(got_p, want_p)
    others = torch.ones(nslots, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(got_k[others], ks[others]) and (got_p[others] == -7).all()


def test_causal_attention_lse_aligns_at_the_bottom_right_and_refuses_bad_input():
    """The gathered path's reference: row i of n sees keys [0, V - n + i]; its lse is the log of the scaled scores'
    exp-sum; grouped heads use KV head h // group. Checked against a per-row loop."""
    from longreach.attention.cascading.attend import causal_attention_lse

    g = torch.Generator().manual_seed(0)
    n, V = 5, 9
    q = torch.randn(n, HQ, D, generator=g)
    k, v = torch.randn(V, HKV, D, generator=g), torch.randn(V, HKV, D, generator=g)
    out, lse = causal_attention_lse(q, k, v, 0.3, "reference")
    assert out.shape == (n, HQ, D) and lse.shape == (n, HQ)
    for i in range(n):
        for h in range(HQ):
            s = k[:V - n + i + 1, h // (HQ // HKV)] @ q[i, h] * 0.3
            assert torch.allclose(lse[i, h], torch.logsumexp(s, 0), atol=1e-5)
            assert torch.allclose(out[i, h], s.softmax(0) @ v[:V - n + i + 1, h // (HQ // HKV)], atol=1e-5)
    with pytest.raises(ValueError, match="at least 5 keys"):
        causal_attention_lse(q, k[:4], v[:4], 0.3, "reference")
    with pytest.raises(ValueError, match="'flash' or 'reference'"):
        causal_attention_lse(q, k, v, 0.3, "cudnn")


def test_gather_virtual_rotates_each_key_at_its_virtual_position_in_chunks():
    """gather_virtual: row j is the key in slots[j] rotated at position j (the chunked fp32 rotation gives the same
    rows as one pass), values gathered as they are."""
    from longreach.attention.cascading.attend import gather_virtual
    from longreach.rope.strategies import rotate, rotation

    g = torch.Generator().manual_seed(3)
    kf, vf = torch.randn(40, HKV, D, generator=g), torch.randn(40, HKV, D, generator=g)
    slots = torch.randperm(40, generator=g)[:23].int()
    inv = _base_inv_freq(10000.0, D)
    cs = rotation(torch.arange(30), inv)
    k, v = gather_virtual(kf, vf, slots, *cs, chunk=5)
    assert torch.equal(v, vf[slots.long()])
    assert torch.allclose(k, rotate(kf[slots.long()], torch.arange(23)[:, None], inv), atol=1e-6)
    assert torch.equal(k, gather_virtual(kf, vf, slots, *cs)[0])
