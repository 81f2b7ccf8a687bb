"""PSA's wave-parallel decode kernel (kernels/psa_waves.py, `psa_decode_waves`) against the loop kernel and the
reference: the same blocks read (counts equal), the same output and lse up to fp32 reassociation.

Interpreter, fp16/fp32, small sizes; small first waves (and merge chunks) make the decisions cross wave and chunk
boundaries. bf16 at real sizes and the timing are in tests/gpu/test_psa.py.
"""
import pytest
import torch

from longreach.attention.psa import PSA, PSAConfig
from longreach.kernels.psa_decode import psa_decode_reference, psa_decode_triton
from longreach.kernels.psa_waves import psa_decode_waves, wave_plan
from tests.test_psa import CASES, _example, _setup, _tiered

SMALL_WAVES = dict(first_wave=1, growth=2, chunk=2)  # waves of 1, 2, 4, ... micro-batches, merged 2 at a time


def _poisoned(q, D, Hkv):
    """Outputs filled with NaN / -7 so that anything left unwritten shows."""
    return dict(out=torch.full_like(q, float("nan")), lse=torch.full(q.shape[:2], float("nan")),
                counts=torch.full((q.shape[0], Hkv), -7, dtype=torch.int32))


def _check(got, ref, loop, dtype):
    out, lse, counts = got
    assert torch.equal(counts, ref[2]) and torch.equal(counts, loop[2])
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # test_psa's tolerance against the reference
    assert (out.float() - ref[0].float()).abs().max() <= tol
    assert (out.float() - loop[0].float()).abs().max() <= (2e-6 if dtype == torch.float32 else 1e-3)
    assert (lse - ref[1]).abs().max() <= 1e-4 and (lse - loop[1]).abs().max() <= 1e-5


@pytest.mark.parametrize("case", CASES, ids=[f"h{c[0]}-kv{c[1]}-d{c[2]}-p{c[3]}-m{c[4]}-{str(c[6])[6:]}"
                                             for c in CASES])
def test_waves_match_reference_and_loop_kernel(case):
    """epsilon 0.01 stops every pair after its first micro-batch, 0.9 at different points per row and head (a row
    too short to have candidates reads none), 1 reads every candidate; small waves put the stop points in later waves
    and mid-chunk, the default waves (one wave here) read past the stop points speculatively."""
    _, Hkv, D, _, mb, lengths, dtype = case
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, _ = _setup(case[:6], dtype, sum(case[:5]))
    scale = D ** -0.5
    n_cand = (cand_hi.long() - cand_lo).clamp(min=0)[:, None].expand(len(lengths), Hkv)
    assert len(wave_plan(-(-ranked.shape[2] // mb), 1, 2)) >= 4
    strided = dict(SMALL_WAVES, max_programs=3)  # fewer programs than a wave's micro-batches: each strides over them
    capped = dict(scratch_bytes=1)  # the scratch cap: waves of one micro-batch
    for eps, tuning in ((0.01, SMALL_WAVES), (0.9, SMALL_WAVES), (1.0, SMALL_WAVES), (0.9, {}), (0.9, strided),
                        (1.0, dict(max_programs=1)), (0.9, capped)):
        args = (q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps, mb, scale)
        ref, loop = psa_decode_reference(*args), psa_decode_triton(*args)
        got = psa_decode_waves(*args, **_poisoned(q, D, Hkv), **tuning)
        _check(got, ref, loop, dtype)
        counts = got[2].long()
        if eps == 0.01:
            assert torch.equal(counts, n_cand.clamp(max=mb))
        elif eps == 1.0:
            assert torch.equal(counts, n_cand)
        elif tuning.get("first_wave") == 1:
            assert (counts > 3 * mb).any()  # some pair stops past the second wave (1 + 2 micro-batches)
            assert (counts < n_cand).any()  # and some stops early


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter, on the poisoned tiles
def test_blocks_past_the_stop_point_are_never_merged():
    """K/V of every ranked block a pair does not read (by the reference) set to NaN, per KV head: the waves read
    some of them speculatively (the rest of the wave) but merge none, so the output equals the clean reference."""
    case = (6, 2, 16, 4, 4, [150, 61, 9])
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, _ = _setup(case, torch.float32, 21)
    args = (tables, seq_lens, ranked, cand_lo, cand_hi, 0.9, 4, 0.25)
    ref = psa_decode_reference(q, kc, vc, *args)
    kp, vp = kc.clone(), vc.clone()
    poisoned = 0
    for r in range(q.shape[0]):
        for g in range(2):
            for b in ranked[r, g, int(ref[2][r, g]):int(cand_hi[r]) - cand_lo].long():
                page = tables[r, b].long()
                kp[page, :, g] = vp[page, :, g] = float("nan")
                poisoned += 1
    assert poisoned > 10
    for tuning in (SMALL_WAVES, {}, dict(SMALL_WAVES, max_programs=2), dict(max_programs=1)):
        out, lse, counts = psa_decode_waves(q, kp, vp, *args, **tuning)
        assert torch.equal(counts, ref[2]) and (out - ref[0]).abs().max() < 1e-5 and (lse - ref[1]).abs().max() < 1e-4


@pytest.mark.parametrize("fmt", ["tiered", "fp8", "fp8-tiered", "tiered-heads"])
def test_waves_read_through_the_page_table_and_fp8_rows(fmt):
    """test_psa's two-tier cache (host copies of resident pages poisoned) and fp8 rows."""
    dtype = torch.float8_e4m3fn if fmt.startswith("fp8") else torch.float32
    case = (6, 2, 16, 4, 4, [110, 45])
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, _ = _setup(case, dtype, 11)
    kt, vt = _tiered(kc, vc, torch.Generator().manual_seed(12), 2 if fmt.endswith("heads") else 1) \
        if "tiered" in fmt else (kc, vc)
    args = (tables, seq_lens, ranked, cand_lo, cand_hi, 0.95, 4, 0.25)
    ref = psa_decode_reference(q, kc, vc, *args)
    loop = psa_decode_triton(q, kt, vt, *args)
    got = psa_decode_waves(q, kt, vt, *args, **_poisoned(q, 16, 2), **SMALL_WAVES)
    _check(got, ref, loop, torch.float32)


def test_hand_computed_stop_points():
    """test_psa's hand example (two heads in one group, 12 candidates of 4 keys, micro-batches of 4): the group
    reads 12, 8 and 4 blocks at epsilon 0.9, 0.7 and 0.3; the waves take the same decisions, one micro-batch per
    first wave and across the merge's chunks."""
    q, k, v, table, seq_lens, ranked, = _example(heads=2, dtype=torch.float32)
    for eps, blocks in ((0.9, 12), (0.7, 8), (0.3, 4)):
        for tuning in (SMALL_WAVES, dict(first_wave=2, growth=1, chunk=2), {}):
            _, _, counts = psa_decode_waves(q, k, v, table, seq_lens, ranked, 0, torch.tensor([12]).int(), eps, 4,
                                            1.0, **tuning)
            assert counts.tolist() == [[blocks]], (eps, tuning)


def test_attend_routes_to_the_waves_kernel_and_rows_stop_independently():
    """`decode_kernel: waves` in PSAConfig runs the waves kernel from `PSA.attend`; each row run alone reads and
    returns what it does in the batch."""
    case = (8, 2, 32, 8, 2, [200, 97, 41])
    q, kc, vc, tables, seq_lens, _, _, _, meta = _setup(case, torch.float32, 3)
    loop = PSA(PSAConfig(epsilon=0.9, microbatch=2, n_sink=9, n_window=11, decode_kernel="loop"), 8, 2)
    waves = PSA(PSAConfig(epsilon=0.9, microbatch=2, n_sink=9, n_window=11, decode_kernel="waves"), 8, 2)
    W = tables.shape[1]
    out, counts, _, _ = waves.attend(q, kc, vc, tables, seq_lens, meta, W, 0.2, True)
    out_loop, counts_loop, _, _ = loop.attend(q, kc, vc, tables, seq_lens, meta, W, 0.2, True)
    assert torch.equal(counts, counts_loop) and (out - out_loop).abs().max() < 2e-6
    assert len(set(counts.flatten().tolist())) >= 3
    for r in range(3):
        one = slice(r, r + 1)
        alone, c1, _, _ = waves.attend(q[one], kc, vc, tables[one], seq_lens[one], meta, W, 0.2, True)
        assert torch.equal(c1, counts[one]) and (alone - out[one]).abs().max() < 2e-6


def test_wave_plan_and_argument_errors():
    assert wave_plan(0, 32, 2) == [(0, 0)]  # no ranked block: one empty wave (the fixed keys)
    assert wave_plan(100, 32, 2) == [(0, 32), (32, 64), (96, 4)]
    assert wave_plan(7, 2, 1) == [(0, 2), (2, 2), (4, 2), (6, 1)]
    for n_mb in (1, 31, 32, 33, 2048):
        plan = wave_plan(n_mb, 32, 2)
        assert plan[0][0] == 0 and all(a + s == b for (a, s), (b, _) in zip(plan, plan[1:]))
        assert sum(s for _, s in plan) == n_mb
    assert len(wave_plan(2048, 32, 2)) == 7  # 128K keys at page 16, micro-batches of 4
    assert wave_plan(100, 32, 2, max_wave=40) == [(0, 32), (32, 40), (72, 28)]  # the scratch cap
    assert wave_plan(5, 32, 2, max_wave=2) == [(0, 2), (2, 2), (4, 1)]
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, _ = _setup((4, 2, 16, 4, 4, [40]), torch.float32, 1)
    args = (q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi)
    for kw, msg in (({"first_wave": 0}, "first_wave"), ({"chunk": 3}, "powers of two"),
                    ({"scratch_bytes": 0}, "scratch_bytes"),
                    ({"merge_cols": 12}, "powers of two"), ({"max_programs": 0}, "max_programs")):
        with pytest.raises(ValueError, match=msg):
            psa_decode_waves(*args, 0.9, 4, 0.25, **kw)
    with pytest.raises(ValueError, match="microbatch"):
        psa_decode_waves(*args, 0.9, 3, 0.25)
    with pytest.raises(ValueError, match="epsilon"):
        psa_decode_waves(*args, 0.0, 4, 0.25)
    with pytest.raises(ValueError, match="decode_kernel must be one of loop, waves, got 'fast'"):
        PSAConfig(decode_kernel="fast")
    assert PSAConfig().decode_kernel == "waves"
