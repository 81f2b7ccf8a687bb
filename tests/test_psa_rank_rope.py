"""PSA's `rope: rank` positions (attention/psa/; kernels/psa_decode.py `rank_order_deltas`): rows at or past
rope_from see their sink moved beyond the ranked blocks, the ranked blocks just before the tail in rank order and
the tail at true distances, so every attended key lies within rope_from - 1 of the query. Interpreter, small sizes.
"""
import pytest
import torch

from longreach.kernels.key_boxes import build_page_boxes_reference, build_page_boxes_triton
from longreach.kernels.psa_decode import (
    fixed_positions,
    psa_decode_reference,
    psa_decode_triton,
    rank_order_deltas,
)
from longreach.kernels.psa_waves import psa_decode_waves
from longreach.models.config import RopeConfig
from longreach.rope.scaling import rope_inv_freq
from longreach.rope.strategies import rotate
from tests.test_psa import _setup
from tests.test_psa_engine import tiny  # noqa: F401 - the engine tests' model fixture

CASE = (6, 2, 16, 4, 4, [150, 61, 9])  # GQA 3; rows past, near and before rope_from
ROPE_FROM = 60


def _inv(D):
    return rope_inv_freq(RopeConfig(theta=10000.0), D)[0].float()


def _explicit(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, counts, scale, inv, rope_from):
    """Attention over exactly the keys a (row, KV head) read, each rotated to its documented position, built key by
    key: sink s at p - rope_from + 1 + s, ranked block of rank i at max(T0 - (i + 1) B + t, p - rope_from + 1 + S),
    tail at its true position (rows before rope_from: all true). Also returns the largest query-key distance."""
    n, Hq, D = q.shape
    page, Hkv = kc.shape[1], kc.shape[2]
    hpg = Hq // Hkv
    out = torch.zeros(n, Hq, D)
    far = 0
    for r in range(n):
        p = int(seq_lens[r]) - 1
        S, T0 = cand_lo * page, int(cand_hi[r]) * page
        act = p >= rope_from
        for g in range(Hkv):
            keys = []  # (true position, new position)
            keys += [(s, s + (p - rope_from + 1 if act else 0)) for s in range(min(S, p + 1))]
            for i in range(int(counts[r, g])):
                b = int(ranked[r, g, i])
                for t in range(page):
                    new = max(T0 - (i + 1) * page + t, p - rope_from + 1 + S) if act else b * page + t
                    keys.append((b * page + t, new))
            keys += [(x, x) for x in range(T0, p + 1)]
            true = torch.tensor([k for k, _ in keys])
            new = torch.tensor([k for _, k in keys])
            if act:
                far = max(far, int((p - new).max()))
            slots = tables[r, true // page].long() * page + true % page
            k = kc.reshape(-1, Hkv, D)[slots, g].float()
            v = vc.reshape(-1, Hkv, D)[slots, g].float()
            k = rotate(k, new - true, inv)
            qh = q[r, g * hpg:(g + 1) * hpg].float()
            out[r, g * hpg:(g + 1) * hpg] = torch.softmax(qh @ k.T * scale, dim=-1) @ v
    return out, far


def test_reference_attends_at_the_documented_positions():
    """The reference's output equals attention built key by key at the documented positions, every key within
    rope_from - 1 of the query; rows before rope_from equal the true-position reference."""
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, _ = _setup(CASE, torch.float32, 5)
    inv, scale = _inv(16), 0.25
    args = (q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, 0.9, 4, scale)
    out, _, counts = psa_decode_reference(*args, rope=(inv, ROPE_FROM))
    want, far = _explicit(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, counts, scale, inv, ROPE_FROM)
    assert (out - want).abs().max() < 1e-5
    assert 0 < far <= ROPE_FROM - 1
    true_pos = psa_decode_reference(*args)
    before = seq_lens - 1 < ROPE_FROM
    assert before.any() and (~before).any()
    assert torch.equal(out[before], true_pos[0][before]) and torch.equal(counts[before], true_pos[2][before])
    assert not torch.allclose(out[~before], true_pos[0][~before])


def test_rank_order_deltas_put_rank_zero_just_before_the_tail():
    p, cand_hi = torch.tensor([149, 30]), torch.tensor([33, 5])
    shift, ranked = rank_order_deltas(p, 2, cand_hi, 4, 60)
    assert shift.tolist() == [90, 0]
    block, t = torch.tensor([[10], [3]]), torch.tensor([[1], [1]])
    d = ranked(torch.tensor([[0]]), block, t)
    assert d[0, 0] == (33 * 4 - 4 + 1) - (10 * 4 + 1) and d[1, 0] == 0  # rank 0 ends where the tail starts
    far = ranked(torch.tensor([[500]]), block, t)  # clamped nearer than the sink (p - 59 + 8 = 98)
    assert far[0, 0] == 98 - 41
    pos, ok = fixed_positions(p[:1].int() + 1, 2, cand_hi[:1], 4)
    assert pos[0, ok[0]].max() == 149


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kernel", ["loop", "waves"])
def test_kernels_match_the_reference_at_rank_positions(dtype, kernel):
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, _ = _setup(CASE, dtype, 7)
    rope = (_inv(16), ROPE_FROM)
    for eps in (0.9, 1.0):
        args = (q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, 0.25)
        ref, ref_lse, ref_counts = psa_decode_reference(*args, rope=rope)
        if kernel == "loop":
            out, lse, counts = psa_decode_triton(*args, rope=rope)
        else:
            out, lse, counts = psa_decode_waves(*args, rope=rope, first_wave=1, chunk=2, max_programs=2)
        assert torch.equal(counts, ref_counts)
        # fp16: the kernels round the rotated keys to fp16 before the dot (the reference keeps them in fp32)
        tol, tol_lse = (1e-5, 1e-4) if dtype == torch.float32 else (2e-3, 5e-3)
        assert (out.float() - ref.float()).abs().max() <= tol and (lse - ref_lse).abs().max() <= tol_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moved_metadata_kernel_matches_reference(dtype):
    """Boxes of the keys moved to position 0: the kernel equals the reference, and differs from the stored boxes."""
    q, kc, vc, tables, seq_lens, *_ = _setup(CASE, dtype, 9)
    inv = _inv(16)
    lo = torch.zeros(3, dtype=torch.int32)
    hi = ((seq_lens - 1) // 4).int()
    want = torch.zeros(kc.shape[0], 2, 2, 16)
    build_page_boxes_reference(kc, tables, lo, hi, want, "cuboid-mean", inv_freq=inv)
    got = torch.full((kc.shape[0], 2, 2, 16), float("nan"), dtype=dtype)
    build_page_boxes_triton(kc, tables, lo, hi, int(hi.max()), got, "cuboid-mean", inv_freq=inv)
    built = tables[0, :int(hi[0])].long()
    assert (got[built].float() - want[built]).abs().max() < (1e-5 if dtype == torch.float32 else 2e-3)
    stored = torch.zeros_like(want)
    build_page_boxes_reference(kc, tables, lo, hi, stored, "cuboid-mean")
    assert not torch.allclose(stored[built[1:]], want[built[1:]])  # block 0 sits at positions 0..3 already


def test_inv_freq_shape_is_checked():
    q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, _ = _setup(CASE, torch.float32, 3)
    with pytest.raises(ValueError, match=r"inv_freq must be \(8,\) fp32"):
        psa_decode_triton(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, 0.9, 4, 0.25,
                          rope=(torch.ones(16), 60))


def test_engine_rank_rope_graph_path_equals_eager_and_changes_decode(tiny):
    """`rope: rank` through the engine on the tiny model with rope_from 64: the static-buffer (graph) path equals eager
    decoding, and past rope_from the logits differ from true positions (the keys moved)."""
    from longreach import SamplingParams
    from longreach.engine.llm import LLM
    from tests.test_psa_engine import SMALL, _prompts, _record_logits

    rank = SMALL.replace('"epsilon": 0.8', '"epsilon": 0.8, "rope": "rank", "rope_from": 64')
    assert rank != SMALL
    prompts = [p["prompt_token_ids"] for p in _prompts(5, (130, 90))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def llm(config, **kw):
        return LLM(tiny, device="cpu", dtype="float32", attention="psa", attention_config=config,
                   kv_cache_memory_gb=0.01, **kw)
    eager = llm(rank, enforce_eager=True)
    logits_rank = _record_logits(eager)
    expected = [o.token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                    use_tqdm=False)]
    engine = llm(rank).engine
    engine.runner.capture_graphs(emulate=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    assert [out[str(i)] for i in range(2)] == expected
    plain = llm(SMALL, enforce_eager=True)
    logits_true = _record_logits(plain)
    plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert torch.equal(logits_rank[0], logits_true[0])  # the prefill is dense either way
    assert max((a - b).abs().max() for a, b in zip(logits_rank[1:], logits_true[1:])) > 1e-4


def test_rope_config_errors():
    from longreach.attention.psa import PSAConfig

    with pytest.raises(ValueError, match="rope must be 'none'"):
        PSAConfig(rope="st")
    with pytest.raises(ValueError, match="rope_from must be None"):
        PSAConfig(rope="rank", rope_from=0)
