"""infinitehip's next stage scored from the stage before (attention/infinitehip/method.py `runs_for_next`): where two
consecutive stages score exactly, the first scores each of its chunks per run of the next stage's chunk size, and
the next stage takes its candidates' scores from those runs instead of reading their keys again. The selection is
the one each stage reading its own keys makes."""
import pytest
import torch

from longreach.attention.infinitehip import InfiniteHiP, InfiniteHiPConfig
from longreach.attention.sparse.selection import BlockQueries, SequenceKeys
from longreach.rope.scaling import RopeConfig, rope_inv_freq
from longreach.rope.strategies import RopeFrame

Hq, Hkv, D = 6, 2, 16
CFG = dict(block_q=8, chunk_sizes=(32, 8, 2), budgets=(128, 32, 8), n_sink=8, n_window=16, early_layers=1,
           early_last_budget=16, dense_below=0)


def _stages(method, reuse: bool, layer, q, blocks, keys, monkeypatch, **kw):
    """Every stage's output and the chunk sizes scored from keys, with the next stage scored from runs or not."""
    scored = []
    score = InfiniteHiP.chunk_scores

    def counted(self, layer, q, blocks, keys, ids, chunk, exact, cand_end, **kw):
        scored.append(chunk)
        return score(self, layer, q, blocks, keys, ids, chunk, exact, cand_end, **kw)

    with monkeypatch.context() as m:
        m.setattr(InfiniteHiP, "chunk_scores", counted)
        if not reuse:
            m.setattr(InfiniteHiP, "runs_for_next", lambda self, *a: None)
        return method.run_stages(layer, q, blocks, keys, **kw), scored


@pytest.mark.parametrize("exact_below, prune_rope, from_keys", [
    (8, "none", [32, 8]),  # stage 1 exact: stage 2 from its runs of 2
    (32, "none", [32, 2]),  # every stage exact: stage 1 from stage 0's runs of 8; stage 2 reads its keys
    (8, "ci:0,rt", None),  # layer 0 ci (positions count the candidates: no runs), layer 1 rt (runs)
    (2, "none", [32, 8, 2]),  # only the last stage exact: nothing to reuse
])
def test_the_next_stage_from_runs_selects_what_reading_its_keys_selects(exact_below, prune_rope, from_keys,
                                                                       monkeypatch):
    method = InfiniteHiP(InfiniteHiPConfig(**CFG, exact_below=exact_below, prune_rope=prune_rope), Hq, Hkv)
    method.rope_frame = RopeFrame(rope_inv_freq(RopeConfig(theta=10000.0), D)[0], rope_from=300, trained_len=300)
    g = torch.Generator().manual_seed(exact_below)
    L = 700
    keys = SequenceKeys.from_dense(torch.randn(L, Hkv, D, generator=g))
    # prefill-like blocks of 8 rows at three depths (one before rope_from) and a decode row
    blocks = BlockQueries.build([(0, 8, 250), (8, 8, 500), (16, 8, L - 8), (24, 1, L - 1)], "cpu")
    q = torch.randn(25, Hq, D, generator=g)
    for layer in (0, 1):
        want, keyed = _stages(method, False, layer, q, blocks, keys, monkeypatch)
        got, scored = _stages(method, True, layer, q, blocks, keys, monkeypatch)
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
        assert keyed == [32, 8, 2]
        if from_keys is not None:
            assert scored == from_keys
        else:  # ci in layer 0, rt in layer 1
            assert scored == ([32, 8, 2] if layer == 0 else [32, 8])


def test_no_runs_where_the_next_stage_does_not_build_on_this_calls_scores(monkeypatch):
    """A kept output (a captured step's rows), lookahead chunks, stage 0 under `ahead`, and a next stage whose
    candidates all fit its budget each leave the next stage reading its keys (or not scoring at all)."""
    method = InfiniteHiP(InfiniteHiPConfig(**CFG, exact_below=32), Hq, Hkv)
    widths = [(64, True), (64, True), (64, True)]
    assert method.runs_for_next(0, widths, None, 0, None, False) == 8
    assert method.runs_for_next(1, widths, None, 0, None, False) == 2
    assert method.runs_for_next(2, widths, None, 0, None, False) is None  # the last stage
    assert method.runs_for_next(0, widths, ([], torch.zeros(1)), 0, None, False) is None
    assert method.runs_for_next(0, widths, None, 1, None, False) is None
    assert method.runs_for_next(0, widths, None, 0, object(), False) is None
    assert method.runs_for_next(1, widths, None, 0, object(), False) == 2
    assert method.runs_for_next(0, widths, None, 0, None, True) is None  # ci
    assert method.runs_for_next(0, [(64, True), (64, False), (64, True)], None, 0, None, False) is None
    box = InfiniteHiP(InfiniteHiPConfig(**CFG, exact_below=8), Hq, Hkv)
    assert box.runs_for_next(0, widths, None, 0, None, False) is None  # stage 0 not exact
