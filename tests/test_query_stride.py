"""infinitehip's `query_stride` (HiP's b_sq): a stage scores a prefill query block's candidates with every n-th of
its rows, counted back from the block's last. The rows taken, their positions under a RoPE strategy, the exact
scoring kernel (both layouts, interpreter) against the reference, the box stage, and the method's stages."""
import pytest
import torch

from longreach.attention.infinitehip import InfiniteHiP, InfiniteHiPConfig
from longreach.attention.sparse.selection import BlockQueries, SequenceKeys
from longreach.kernels.chunk_box import box_queries
from longreach.kernels.prune_ref import chunk_scores_reference, prune_queries
from longreach.kernels.prune_stage import chunk_scores_triton
from longreach.models.config import RopeConfig
from longreach.rope.scaling import rope_inv_freq
from longreach.rope.strategies import RopeArgs, RopeFrame, block_row_positions, prune_query_pos, rotate
from tests.test_rope_strategies import _scoring_case


def _taken(length: int, stride: int) -> list[int]:
    """The offsets in a block of `length` rows that a stride takes, written out: its last row and every stride-th
    before it."""
    return sorted(o for o in range(length) if (length - 1 - o) % stride == 0)


def _strided(q, starts, lens, stride):
    """(qs (nb, R, H, D), ok (nb, R), offsets (nb, R)) of the taken rows, built row by row from `_taken`."""
    offs = [_taken(int(n), stride) for n in lens]
    R = max(len(o) for o in offs)
    off = torch.tensor([o + [o[0]] * (R - len(o)) for o in offs], device=q.device)
    ok = torch.tensor([[i < len(o) for i in range(R)] for o in offs], device=q.device)
    return q[starts[:, None] + off], ok, off


@pytest.mark.parametrize("stride", [1, 2, 3, 4])
def test_the_rows_taken_and_their_positions(stride):
    method = InfiniteHiP(InfiniteHiPConfig(block_q=8, chunk_sizes=(32, 8, 2), budgets=(128, 32, 8)), 4, 2)
    lens = torch.tensor([8, 7, 1, 5, 2])
    starts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), lens[:-1]]), 0)
    ends = torch.tensor([100, 300, 301, 500, 640])
    blocks = BlockQueries(starts, lens, ends, 8, 640)
    q = torch.randn(int(lens.sum()), 4, 16)
    qs, ok = method.query_rows(q, blocks, stride)
    want_q, want_ok, off = _strided(q, starts, lens, stride)
    assert qs.shape[1] == -(-8 // stride) == want_ok.shape[1]
    assert torch.equal(ok, want_ok) and torch.equal(qs[ok], want_q[want_ok])
    assert bool(ok[:, 0].all())  # a block's last row is always taken
    true = (ends - lens)[:, None] + off  # each taken row's true position
    assert torch.equal(block_row_positions(ends, ok, stride)[ok], true[ok])


@pytest.mark.parametrize("mode", ["rt", "de"])
def test_the_references_move_each_taken_row_from_its_own_position(mode):
    """prune_queries (exact and SelectRep) and box_queries (stage 0's boxes) rotate row j by the strategy's query
    position minus the row's true position."""
    stride, D, W = 3, 16, 10
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([8, 7, 4])
    starts = torch.tensor([0, 8, 15])
    cand_end = torch.tensor([200, 250, 400])
    q = torch.randn(19, 2, D, generator=g)
    qs, ok, off = _strided(q, starts, lens, stride)
    inv = rope_inv_freq(RopeConfig(theta=10000.0), D)[0]
    rope = RopeArgs(mode, inv, rope_from=0, group=3, n_window=W)
    true = (cand_end + W - lens)[:, None] + off
    want = rotate(qs, (prune_query_pos(mode, true, W, 3) - true)[:, :, None], inv)
    got, _, _ = prune_queries(qs, ok, cand_end, rope, stride=stride)
    assert torch.allclose(got[ok], want[ok], atol=1e-5)
    _, moved, _ = box_queries(qs, ok, cand_end, rope, stride=stride)
    want_rt = rotate(qs, (prune_query_pos("rt", true, W, 3) - true)[:, :, None], inv)  # boxes move ci/rt as rt
    if mode == "rt":
        assert torch.allclose(moved[ok], want_rt[ok], atol=1e-5)
    wrong, _, _ = prune_queries(qs, ok, cand_end, rope)  # the same rows taken as consecutive: other positions
    assert not torch.allclose(wrong[ok], want[ok], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", [None, "rt", "ci", "de"])
@pytest.mark.parametrize("stride, D, exact", [(2, 16, True), (3, 32, True), (2, 16, False), (4, 32, True)])
def test_kernel_with_a_query_stride_matches_the_reference(dtype, mode, stride, D, exact):
    chunk, G, n_sink = (4 if exact else 8), 2, 3
    kc, table, q, starts, lens, cand_end, ids, _, _, keys = _scoring_case(dtype, D, chunk, 60, 21 + stride)
    qs, ok, _ = _strided(q, starts, lens, stride)
    inv = rope_inv_freq(RopeConfig(theta=10000.0), D)[0]
    rope = None if mode is None else RopeArgs(mode, inv, rope_from=100, group=3, n_window=10)
    ref = chunk_scores_reference(qs.float(), ok, keys.float(), ids.long(), chunk, exact, n_sink, cand_end, G,
                                 rep_per_head=not exact, rope=rope, stride=stride)
    every = chunk_scores_reference(*_strided(q, starts, lens, 1)[:2], keys.float(), ids.long(), chunk, exact, n_sink,
                                   cand_end, G, rep_per_head=not exact, rope=rope)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(every), finite)
    if exact:  # fewer rows: a max over a subset, never above every row's (exact scores only: SelectRep branches)
        assert bool((ref[finite] <= every[finite] + 1e-4).all()) and not torch.allclose(ref, every)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    scale = max(1.0, ref[finite].abs().max().item())
    for rows_tile in ((None, 0, 16) if exact else (None,)):
        got = chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, exact, n_sink, G,
                                  rep_per_head=not exact, block_c=None if exact else 16, rope=rope,
                                  rows_tile=rows_tile, stride=stride)
        assert torch.equal(torch.isfinite(got), finite)
        assert (got[finite] - ref[finite]).abs().max() <= tol * scale
    with pytest.raises(ValueError, match="query stride"):
        chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, exact, n_sink, G, stride=0)


def test_config_validation_and_the_stages():
    with pytest.raises(ValueError, match="query_stride needs one integer in"):
        InfiniteHiPConfig(query_stride=(2, 2))
    with pytest.raises(ValueError, match="query_stride"):
        InfiniteHiPConfig(query_stride=(2, 0, 1))
    assert InfiniteHiPConfig().query_strides == (1, 1, 1)
    cfg = dict(block_q=8, chunk_sizes=(32, 8, 2), budgets=(128, 32, 8), n_sink=8, n_window=16, early_layers=1,
               early_last_budget=16, dense_below=0, exact_below=8)
    frame = RopeFrame(rope_inv_freq(RopeConfig(theta=10000.0), 16)[0], rope_from=300, trained_len=300)
    g = torch.Generator().manual_seed(5)
    keys = SequenceKeys.from_dense(torch.randn(700, 2, 16, generator=g))
    blocks = BlockQueries.build([(0, 8, 250), (8, 8, 500), (16, 8, 692), (24, 1, 699)], "cpu")
    q = torch.randn(25, 6, 16, generator=g)
    out = {}
    for strides in ((1, 1, 1), (1, 2, 2), (2, 2, 1)):
        m = InfiniteHiP(InfiniteHiPConfig(**cfg, query_stride=strides), 6, 2)
        m.rope_frame = frame
        out[strides] = m.run_stages(1, q, blocks, keys)
        # the next stage from runs only where both stages take the same rows
        assert (m.runs_for_next(1, [(64, True)] * 3, None, 0, None, False) is not None) == (strides[1] == strides[2])
    for strides in ((1, 2, 2), (2, 2, 1)):
        assert all(a.shape == b.shape for a, b in zip(out[strides], out[(1, 1, 1)]))
        # the decode row (one row) selects the same whatever the stride
        assert all(torch.equal(a[-1], b[-1]) for a, b in zip(out[strides], out[(1, 1, 1)]))
    assert any(not torch.equal(a, b) for a, b in zip(out[(2, 2, 1)], out[(1, 1, 1)]))


def test_through_the_engine(tmp_path):
    """The engine with a query stride (and with 16-row blocks, a stride of 4) runs the prompt and decodes, the
    prompt's selections differing from every row's; an explicit stride of 1 is the default, token for token and
    selection for selection."""
    import json

    from conftest import make_tiny_hf_model
    from longreach import SamplingParams
    from longreach.engine.llm import LLM
    from tests.test_infinitehip_lookahead import ENGINE_CFG, _record

    path = make_tiny_hf_model(tmp_path / "m", arch="llama", max_position_embeddings=512)[0]
    prompt = torch.randint(3, 256, (180,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    mp = pytest.MonkeyPatch()
    for name, extra in (("default", {}), ("one", {"query_stride": [1, 1, 1]}), ("two", {"query_stride": [2, 2, 2]}),
                        ("q16s4", {"block_q": 16, "query_stride": [4, 4, 4]})):
        llm = LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, attention="infinitehip",
                  attention_config=json.dumps({**ENGINE_CFG["infinitehip"], **extra}), enforce_eager=True)
        picked = _record(mp)
        tokens = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].token_ids
        runs[name] = (tokens, [p for p in picked if not p[0]])
        mp.undo()
    assert runs["one"] == runs["default"]
    assert len(runs["two"][0]) == len(runs["q16s4"][0]) == 8
    for name in ("two", "q16s4"):
        assert runs[name][1] and runs[name][1] != runs["default"][1]  # the prompt selected from fewer rows
