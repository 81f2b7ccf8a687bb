"""PSA (attention/psa/): the stop rule by hand, the kernels against their references, semantics, config and eval
recall (the engine paths: tests/test_psa_engine.py).

Kernels run in Triton's interpreter (fp16/fp32, small sizes) on machines without a GPU; bf16 at real sizes is
tests/gpu/test_psa.py.
"""
import math

import pytest
import torch

from longreach.attention.executor import block_sparse_attention
from longreach.attention.psa import PSA, PSAConfig
from longreach.kernels.key_boxes import (
    box_of_keys,
    build_page_boxes_reference,
    build_page_boxes_triton,
    page_box_scores_reference,
    page_box_scores_triton,
)
from longreach.kernels.paged_decode import paged_decode_reference
from longreach.kernels.psa_decode import psa_decode_reference, psa_decode_triton
from longreach.kvcache.fp8 import quantize
from tier_views import two_tiers
from tests.test_kernel_bsa import _cache as _bsa_cache


# ---- the stop rule, by hand -----------------------------------------------------------------------------------------
# 12 candidate blocks of 4 keys, micro-batches of 4, a tail of 2 keys (the partial last page) holding mass 10.
# Head 0 has the block masses of the paper's Fig. 4 (digest §5.3), head 1 a flatter distribution.
MASSES = [[98, 84, 68, 55, 31, 22, 15, 10, 8.2, 6.1, 4.9, 4.3],
          [40, 38, 36, 34, 30, 28, 26, 24, 22, 20, 18, 16]]
TAIL = 10.0


def _example(heads: int, dtype=torch.float64):
    """A cache where every key of a block has the same score per head, so block masses are exact: head h's query is
    the unit vector e_h and a key of the block ranked r is log(mass / 4) on dim h (scale 1). The ranked blocks sit at
    scrambled positions, so the loop must follow the ranking, not the position."""
    D, page = 16, 4
    perm = torch.tensor([7, 2, 10, 0, 5, 11, 3, 8, 1, 9, 6, 4])  # block id of rank r
    k = torch.zeros(13, page, 1, D, dtype=torch.float64)
    for h in range(heads):
        for r, mass in enumerate(MASSES[h]):
            k[perm[r], :, 0, h] = math.log(mass / page)
        k[12, :2, 0, h] = math.log(TAIL / 2)
    v = torch.randn(13, page, 1, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = torch.eye(D, dtype=torch.float64)[:heads][None]  # (1, heads, D)
    table = torch.arange(13, dtype=torch.int32)[None]
    ranked = torch.cat([perm, torch.tensor([12])]).int()[None, None]  # the tail block past the candidates
    return q.to(dtype), k.to(dtype), v.to(dtype), table, torch.tensor([50], dtype=torch.int32), ranked


def _expected_trace(masses):
    """AS_acc, AS_min, N_left, P_acc after each micro-batch of 4, straight from Alg. 1 (AS_min per block)."""
    acc, low, left, out = TAIL, math.inf, 12, []
    for i in range(0, 12, 4):
        acc += sum(masses[i:i + 4])
        low = min(low, *masses[i:i + 4])
        left -= 4
        out.append((acc, low, left, acc / (acc + low * left)))
    return out


def test_stopping_rule_against_a_hand_computed_example():
    """Head 0 alone (Fig. 4's masses): P_acc = 315/755 = 0.417, 393/433 = 0.908, then 1.0. At epsilon 0.9 it stops
    after two micro-batches (8 blocks). Note that the figure itself shows 0.61, 0.91, 0.98 for these masses: they do
    not follow the formula (without our tail, 305/745 = 0.41 after the first micro-batch); the formula is what we
    implement. With head 1 in the same KV group (0.367, 0.735, 1.0) the group reads all 12 blocks at 0.9, since every
    head must reach epsilon; at 0.7 both heads pass after 8 blocks."""
    q, k, v, table, seq_lens, ranked = _example(heads=1)
    trace: list = []
    out, lse, counts = psa_decode_reference(q, k, v, table, seq_lens, ranked, 0, torch.tensor([12]), 0.9, 4, 1.0,
                                            trace=trace)
    expected = _expected_trace(MASSES[0])
    assert [round(e[3], 4) for e in expected] == [0.4172, 0.9076, 1.0]
    assert len(trace) == 2 and counts.tolist() == [[8]]
    for step, (as_acc, as_min, n_left, p_acc) in zip(trace, expected):
        assert math.isclose(step["as_acc"].item(), as_acc, rel_tol=1e-12)
        assert math.isclose(step["as_min"].item(), as_min, rel_tol=1e-12)
        assert step["n_left"].item() == n_left
        assert math.isclose(step["p_acc"].item(), p_acc, rel_tol=1e-12)
    # the merged output is exact softmax attention over what was read: tail + the 8 best blocks
    pos = torch.cat([torch.tensor([48, 49]), (ranked[0, 0, :8, None].long() * 4 + torch.arange(4)).flatten()])
    keys, vals = k.reshape(-1, 1, 16)[pos, 0], v.reshape(-1, 1, 16)[pos, 0]
    ref = torch.softmax(keys @ q[0, 0], 0) @ vals
    assert torch.allclose(out[0, 0], ref, atol=1e-12)
    assert math.isclose(lse.item(), math.log(expected[1][0]), rel_tol=1e-6)  # lse is fp32

    q2, k2, v2, _, _, _ = _example(heads=2)
    for eps, blocks in ((0.9, 12), (0.7, 8), (0.3, 4)):
        trace = []
        _, _, counts = psa_decode_reference(q2, k2, v2, table, seq_lens, ranked, 0, torch.tensor([12]), eps, 4, 1.0,
                                            trace=trace)
        assert counts.tolist() == [[blocks]], eps
        for step, e0, e1 in zip(trace, _expected_trace(MASSES[0]), _expected_trace(MASSES[1])):
            assert torch.allclose(step["p_acc"][0], torch.tensor([e0[3], e1[3]], dtype=torch.float64), rtol=1e-12)
    # the kernel takes the same decisions (fp32, interpreter)
    q32, k32, v32 = (x.float() for x in (q2, k2, v2))
    for eps, blocks in ((0.9, 12), (0.7, 8), (0.3, 4)):
        _, _, counts = psa_decode_triton(q32, k32, v32, table, seq_lens, ranked, 0, torch.tensor([12]).int(), eps, 4,
                                         1.0)
        assert counts.tolist() == [[blocks]], eps


# ---- kernels against references --------------------------------------------------------------------------------------
def _cache(lengths, Hkv, D, page, dtype, g):
    """test_kernel_bsa's scattered paged cache (NaN in unowned slots: stale memory must never be read); an fp8 cache
    holds the same values quantised, with zeros where the others hold NaN (a NaN would poison a row's scale)."""
    if dtype != torch.float8_e4m3fn:
        return _bsa_cache(lengths, Hkv, D, page, dtype, g)
    kc, vc, tables = _bsa_cache(lengths, Hkv, D, page, torch.float32, g)
    return quantize(kc.nan_to_num(0.0)), quantize(vc.nan_to_num(0.0)), tables


def _tiered(kc, vc, g, units=1):
    """Two-tier views of kc/vc: half the pages (of the KV heads' pages with `units` = H_kv) resident at random pool
    slots, the host copies of those poisoned (tests/tier_views.py)."""
    return two_tiers(kc, vc, g, 0.5, units)


def _setup(case, dtype, seed):
    Hq, Hkv, D, page, mb, lengths = case
    g = torch.Generator().manual_seed(seed)
    kc, vc, tables = _cache(lengths, Hkv, D, page, dtype, g)
    qdt = torch.float32 if dtype in (torch.float32, torch.float8_e4m3fn) else dtype
    q = (torch.randn(len(lengths), Hq, D, generator=g) * 2).to(qdt)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    cfg = PSAConfig(epsilon=0.9, microbatch=mb, n_sink=page + 1, n_window=page + 3)  # sink: 2 blocks
    m = PSA(cfg, Hq, Hkv)
    meta = torch.zeros(kc.shape[0], 2, Hkv, D, dtype=qdt)
    build_page_boxes_reference(kc, tables, torch.zeros(len(lengths), dtype=torch.int32), (seq_lens - 1) // page,
                               meta, cfg.metadata)
    cand_lo, cand_hi = m.candidates(seq_lens, page)
    ranked = page_box_scores_reference(q, meta, tables, cand_lo, cand_hi, tables.shape[1]).sort(
        dim=-1, descending=True, stable=True).indices.int()
    return q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, meta


CASES = [  # Hq, Hkv, D, page, microbatch, lengths, dtype
    (6, 2, 16, 4, 4, [150, 61, 9], torch.float32),  # GQA 3; a row too short to have candidates
    (6, 2, 16, 4, 4, [150, 61, 9], torch.float16),
    (4, 4, 32, 8, 2, [141, 77], torch.float32),  # MHA
    (8, 1, 16, 16, 1, [333, 130, 47], torch.float16),  # GQA 8, one block per iteration
    (4, 1, 64, 4, 8, [77, 256], torch.float32),  # GQA 4, head dim 64
]


@pytest.mark.parametrize("case", CASES, ids=[f"h{c[0]}-kv{c[1]}-d{c[2]}-p{c[3]}-m{c[4]}-{str(c[6])[6:]}"
                                             for c in CASES])
def test_decode_kernel_matches_reference(case):
    """Same blocks read (counts), same output and lse, at epsilon 0.9, 0.98 and 1; every output row written."""
    dtype = case[6]
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, _ = _setup(case[:6], dtype, sum(case[:5]))
    Hkv = case[1]
    scale = case[2] ** -0.5
    for eps in (0.9, 0.98, 1.0):
        ref, ref_lse, ref_counts = psa_decode_reference(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps,
                                                        case[4], scale)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"))
        counts = torch.full((q.shape[0], Hkv), -7, dtype=torch.int32)
        psa_decode_triton(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps, case[4], scale, out=out, lse=lse,
                          counts=counts)
        assert torch.equal(counts, ref_counts), eps
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert (out.float() - ref.float()).abs().max() <= tol, eps
        assert (lse - ref_lse).abs().max() <= 1e-4
    n_cand = (cand_hi.long() - cand_lo).clamp(min=0)
    assert torch.equal(ref_counts.long(), n_cand[:, None].expand_as(ref_counts))  # epsilon 1 reads every candidate


@pytest.mark.parametrize("fmt", ["tiered", "fp8", "fp8-tiered", "tiered-heads", "fp8-tiered-heads"])
def test_kernels_read_through_the_page_table_and_fp8_rows(fmt):
    """Metadata build, scoring and decode on a two-tier cache (resident pages from the pool, the rest from the host;
    the host copies of resident pages are poisoned) and on fp8 rows give what the references give."""
    dtype = torch.float8_e4m3fn if fmt.startswith("fp8") else torch.float32
    case = (6, 2, 16, 4, 4, [110, 45])
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, meta = _setup(case, dtype, 11)
    kt, vt = _tiered(kc, vc, torch.Generator().manual_seed(12), 2 if fmt.endswith("heads") else 1) \
        if "tiered" in fmt else (kc, vc)
    ref = psa_decode_reference(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, 0.95, 4, 0.25)
    got = psa_decode_triton(q, kt, vt, tables, seq_lens, ranked, cand_lo, cand_hi, 0.95, 4, 0.25)
    assert torch.equal(got[2], ref[2]) and (got[0] - ref[0]).abs().max() < 1e-5
    built = torch.full_like(meta, float("nan"))
    lo, hi = torch.zeros(2, dtype=torch.int32), ((seq_lens - 1) // 4).int()
    build_page_boxes_triton(kt, tables, lo, hi, int(hi.max()), built, "cuboid-mean")
    done = tables[0, :int(hi[0])].long()
    assert (built[done] - meta[done]).abs().max() < 1e-5
    assert torch.isnan(built[tables[0, int(hi[0])].long()]).all()  # the partial last page: not built


@pytest.mark.parametrize("kind", ["cuboid-mean", "minmax"])
def test_metadata_and_scoring_kernels_match_references(kind):
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D, page = 8, 2, 32, 8
    kc, _, tables = _cache([120, 77, 200], Hkv, D, page, torch.float32, g)
    lo = torch.tensor([0, 3, 10], dtype=torch.int32)
    hi = torch.tensor([14, 9, 24], dtype=torch.int32)
    ref = torch.zeros(kc.shape[0], 2, Hkv, D)
    build_page_boxes_reference(kc, tables, lo, hi, ref, kind)
    got = torch.zeros_like(ref)
    build_page_boxes_triton(kc, tables, lo, hi, 14, got, kind)
    assert (got - ref).abs().max() < 1e-5
    built = torch.cat([tables[r, int(a):int(b)] for r, (a, b) in enumerate(zip(lo, hi))]).long()
    assert (ref[built, 1] >= 0).all() and (ref.index_select(0, torch.tensor(
        sorted(set(range(kc.shape[0])) - set(built.tolist())))) == 0).all()  # only [lo, hi) written
    q = torch.randn(3, Hq, D, generator=g)
    cand_hi = torch.tensor([12, 9, 20], dtype=torch.int32)
    s_ref = page_box_scores_reference(q, ref, tables, 2, cand_hi, tables.shape[1])
    s_got = page_box_scores_triton(q, ref, tables, 2, cand_hi, tables.shape[1], block_w=16)
    fin = torch.isfinite(s_ref)
    assert torch.equal(fin, torch.isfinite(s_got)) and (s_ref[fin] - s_got[fin]).abs().max() < 1e-4
    if kind == "minmax":  # Quest's bound: no key of a block scores above its block's score, for any head
        keys = kc[tables[0, 2:12].long()].float()  # (10, page, Hkv, D)
        for h in range(Hq):
            exact = torch.einsum("d,bpd->bp", q[0, h], keys[:, :, h // (Hq // Hkv)]).amax(-1)
            assert (exact <= s_ref[0, h // (Hq // Hkv), 2:12] + 1e-4).all()


def test_block_metadata_definitions():
    keys = torch.tensor([[1.0, -2.0], [3.0, 0.0], [2.0, 4.0], [0.0, 2.0]])[None, :, None]  # one block, one head
    mean = box_of_keys(keys, "cuboid-mean")[0, :, 0]
    box = box_of_keys(keys, "minmax")[0, :, 0]
    assert mean[0].tolist() == [1.5, 1.0] and box[0].tolist() == [1.5, 1.0]
    assert mean[1].tolist() == [1.0, 2.0] and box[1].tolist() == [1.5, 3.0]


# ---- semantics ------------------------------------------------------------------------------------------------------
def test_epsilon_one_equals_dense_and_the_read_index_reproduces_the_output():
    """epsilon = 1 reads every candidate: dense decode attention. At any epsilon the block-sparse executor over
    `read_index` (what PSA reports it read) reproduces PSA's output: the merge is exact softmax over the read set."""
    case = (6, 2, 16, 4, 4, [150, 61, 9])
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, _ = _setup(case, torch.float32, 5)
    m = PSA(PSAConfig(epsilon=1.0, microbatch=4, n_sink=5, n_window=7), 6, 2)
    dense, _ = paged_decode_reference(q, kc.nan_to_num(), vc.nan_to_num(), tables, seq_lens, 0.25)
    for kernel in (False, True):
        fn = psa_decode_triton if kernel else psa_decode_reference
        out, _, _ = fn(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, 1.0, 4, 0.25)
        assert (out - dense).abs().max() < 1e-5
    for eps in (0.5, 0.9):
        out, _, counts = psa_decode_reference(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, 0.25)
        index = m.read_index(ranked, counts, cand_hi, seq_lens, 4)
        via, _ = block_sparse_attention(q, kc, vc, tables, index, 0.25)
        assert (out - via).abs().max() < 1e-5
        assert (counts.long() < (cand_hi.long() - cand_lo)[:, None]).any()  # it really stopped early somewhere


def test_batch_rows_stop_independently():
    """Row 0's query finds one block that holds almost all of its mass and stops after one micro-batch; row 1 (flat
    scores) reads on. Each row, run alone, reads exactly what it reads in the batch (reference and kernel)."""
    g = torch.Generator().manual_seed(8)
    Hq, Hkv, D, page, L = 4, 2, 16, 8, 160
    kc = torch.randn(2 * L // page, page, Hkv, D, generator=g) * 0.1
    vc = torch.randn_like(kc)
    tables = torch.arange(2 * L // page, dtype=torch.int32).view(2, -1)
    q = torch.randn(2, Hq, D, generator=g) * 0.1
    u = torch.nn.functional.normalize(torch.randn(Hkv, D, generator=g), dim=-1)
    q[0] = u.repeat_interleave(Hq // Hkv, 0) * 3.0
    kc[17] += u * 12.0  # row 0, block 17: the needle (logits ~ 3 * 12 / 4 = 9 above the rest)
    seq_lens = torch.tensor([L, L], dtype=torch.int32)
    m = PSA(PSAConfig(epsilon=0.9, microbatch=2, n_sink=4, n_window=8), Hq, Hkv)
    meta = torch.zeros(kc.shape[0], 2, Hkv, D)
    build_page_boxes_reference(kc, tables, torch.zeros(2, dtype=torch.int32), (seq_lens - 1) // page, meta,
                               "cuboid-mean")
    results = {}
    for kernels in (False, True):
        out, counts, ranked, _ = m.attend(q, kc, vc, tables, seq_lens, meta, tables.shape[1], 0.25, kernels)
        assert (counts[0] == 2).all() and (counts[1] > 10).all(), counts  # one micro-batch vs many
        assert int(ranked[0, 0, 0]) == 17
        for r in range(2):
            alone, c1, _, _ = m.attend(q[r:r + 1], kc, vc, tables[r:r + 1], seq_lens[r:r + 1], meta,
                                       tables.shape[1], 0.25, kernels)
            assert torch.equal(c1, counts[r:r + 1]) and (alone - out[r:r + 1]).abs().max() < 1e-6
        results[kernels] = counts
    assert torch.equal(results[False], results[True])


# ---- config --------------------------------------------------------------------------------------------------------
def test_config_presets_and_validation_errors():
    from longreach.config import EngineConfig

    assert {k: v.epsilon for k, v in PSA.presets.items()} == {"0.9": 0.9, "0.95": 0.95, "0.98": 0.98}
    assert PSA.default_preset == "0.95"
    bad = [({"epsilon": 0}, r"epsilon must be a number in \(0, 1\]"), ({"epsilon": 1.5}, "epsilon"),
           ({"epsilon": True}, "epsilon"), ({"microbatch": 3}, "microbatch must be a power of two"),
           ({"metadata": "mean"}, "metadata must be one of cuboid-mean, minmax"),
           ({"n_window": 0}, "n_window must be an integer >= 1"), ({"n_sink": -1}, "n_sink"),
           ({"block_size": 24}, "block_size must be None"), ({"dense_layers": (-1,)}, "dense_layers")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            PSAConfig(**kw)
    from longreach.attention.psa import PSABackend

    with pytest.raises(ValueError, match=r"unknown psa preset '0.5'; available: 0.9, 0.95, 0.98"):
        PSABackend.resolve_config(EngineConfig(attention="psa", preset="0.5"))
    with pytest.raises(ValueError, match="unknown PSAConfig field"):
        PSABackend.resolve_config(EngineConfig(attention="psa", attention_config='{"eps": 0.9}'))
    assert PSABackend.resolve_config(EngineConfig(attention="psa", preset="0.98",
                                                  attention_config='{"microbatch": 8}')).microbatch == 8

    class MC:
        num_layers, has_layer_windows = 3, False
    reasons = PSABackend.unsupported_reasons(MC, EngineConfig(attention="psa", block_size=2, attention_config=
                                                              '{"block_size": 4, "dense_layers": [5]}'))
    assert any("set --block-size 4" in r for r in reasons)
    assert any("microbatch x block size = 4 x 2 < 16" in r for r in reasons)
    assert any("dense_layers [5] do not exist" in r for r in reasons)


# ---- eval recall ----------------------------------------------------------------------------------------------------
def test_recall_reports_a_keys_read_distribution_and_psa_finds_planted_blocks():
    """Four 16-key spans aligned with the queries hold almost all the mass (test_sparse.py's construction): PSA at
    0.95 ranks their blocks first and stops after reading a small share of the context, with mass recall >= 0.95; at
    epsilon 1 it reads every causal key. The report carries the keys-read distribution for every method."""
    from longreach.attention.quest import Quest, QuestConfig
    from longreach.tools.eval.recall import Capture, evaluate

    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D, L, R = 6, 2, 16, 640, 16
    u = torch.nn.functional.normalize(torch.randn(Hkv, D, generator=g), dim=-1)
    q = torch.randn(R, Hq, D, generator=g) * 0.3 + u.repeat_interleave(Hq // Hkv, 0) * 3.0
    k = torch.randn(L, Hkv, D, generator=g) * 0.3
    for s in (96, 256, 400, 512):
        k[s:s + 16] += u * 10.0
    v = torch.randn(L, Hkv, D, generator=g)
    cap = Capture(torch.arange(L - R, L), [q], [k], [v])
    common = dict(n_sink=16, n_window=32, microbatch=1)
    methods = {"psa": PSA(PSAConfig(epsilon=0.95, **common), Hq, Hkv),
               "psa1": PSA(PSAConfig(epsilon=1.0, **common), Hq, Hkv),
               "quest": Quest(QuestConfig(block_q=1, page_size=16, budget=64, n_sink=16, n_window=32,
                                          dense_layers=()), Hq, Hkv)}
    report = evaluate(methods, cap, D ** -0.5)
    psa, full = report["psa"]["mean"], report["psa1"]["mean"]
    assert full["mass_recall"] == pytest.approx(1.0, abs=1e-6)
    assert full["keys_per_query"] == pytest.approx(L - R / 2 + 0.5)  # every causal key of rows L-16 .. L-1
    assert psa["mass_recall"] >= 0.95 and psa["keys_per_query"] < L / 4
    for name in methods:
        dist = report[name]["keys_per_query"]["all_layers"]
        assert dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
        assert dist["mean"] == pytest.approx(report[name]["mean"]["keys_per_query"])
        assert {"keys_per_query_p50", "keys_per_query_p90", "keys_per_query_max"} <= set(report[name]["per_layer"][0])


def test_recall_selection_mask_reads_what_the_decode_path_reads():
    """eval recall's mask for a row == the keys the decode path (metadata, ranking, loop at the model's scale) reads
    for that row on a paged cache, as reported by `read_index`."""
    g = torch.Generator().manual_seed(4)
    Hq, Hkv, D, L, R, page = 6, 2, 16, 300, 5, 16
    q, k = torch.randn(R, Hq, D, generator=g) * 2, torch.randn(L, Hkv, D, generator=g)
    positions = torch.arange(L - R, L)
    m = PSA(PSAConfig(epsilon=0.8, n_sink=16, n_window=20), Hq, Hkv)
    mask = m.selection_mask(0, q, k, positions)
    n_pages = -(-L // page)
    cache = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, n_pages * page - L)).view(n_pages, page, Hkv, D)
    tables = torch.arange(n_pages, dtype=torch.int32)[None].expand(R, n_pages).contiguous()
    seq_lens = (positions + 1).int()
    meta = torch.zeros(n_pages, 2, Hkv, D)
    build_page_boxes_reference(cache, tables, torch.zeros(R, dtype=torch.int32), (seq_lens - 1) // page, meta,
                               "cuboid-mean")
    _, counts, ranked, cand_hi = m.attend(q, cache, cache, tables, seq_lens, meta, n_pages, D ** -0.5, False)
    assert (counts.long() < (cand_hi.long() - 1)[:, None]).any()  # pruned somewhere
    index = m.read_index(ranked, counts, cand_hi, seq_lens, page)
    for r in range(R):
        for h in range(Hq):
            keys = index.attended_positions(r, h // (Hq // Hkv), int(positions[r]))
            assert torch.equal(mask[r, h].nonzero().squeeze(1), keys.sort().values), (r, h)
