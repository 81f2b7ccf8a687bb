"""infinitehip's `lookahead` (attention/infinitehip/method.py): in decode, each stage keeps its survivors plus the next
`lookahead` candidate chunks after each; prefill, and every selection with lookahead 0, are unchanged."""
import dataclasses
import json
import pathlib

import pytest
import torch
from conftest import run_with_joins

from longreach.attention.infinitehip import InfiniteHiP, InfiniteHiPConfig
from longreach.attention.sparse.selection import BlockQueries, SequenceKeys

Hq, Hkv, D = 6, 2, 16

CFG = dict(block_q=8, chunk_sizes=(32, 8, 2), budgets=(128, 32, 8), n_sink=8, n_window=16, early_layers=1,
           early_last_budget=16, refresh=(4, 2, 1), dense_below=0)
CASES = {
    "selectrep": CFG,
    # stage 0 keeps 2 chunks and stage 1 has room for 8 sub-chunks: without lookahead its 8 candidates fit unscored,
    # with it up to 16 do not (stage_widths must say "score")
    "tight": {**CFG, "budgets": (64, 64, 8)},
    "box": {**CFG, "budgets": (64, 32, 8), "exact_below": 8, "stage0_scores": "minmax", "granularity": "layer"},
}


def _method(case: str, **kw) -> InfiniteHiP:
    return InfiniteHiP(InfiniteHiPConfig(**{**CASES[case], **kw}), Hq, Hkv)


def _valid(c: int, chunk: int, n_sink: int, cand_end: int) -> bool:
    """Chunk c of `chunk` tokens overlaps the candidate range [n_sink, cand_end)."""
    return max(c * chunk, n_sink) < min((c + 1) * chunk, cand_end)


def _top(m: InfiniteHiP, layer, q, blocks, keys, i, ids, k) -> list[list[int]]:
    """Per group, the k candidate ids of stage i with the best scores (ties: the lower position), from the method's
    scorers but a top-k of the test's own."""
    cfg, l = m.cfg, m.cfg.chunk_sizes[i]
    cand_end = m.candidate_end(blocks.ends)
    if i == 0 and cfg.stage0_scores != "selectrep" and l > cfg.exact_below:
        score = m.box_scores(layer, q, blocks, keys, ids, l, cand_end)
    else:
        score = m.chunk_scores(layer, q, blocks, keys, ids, l, l <= cfg.exact_below, cand_end)
    out = []
    for g in range(m.groups):
        pairs = [(-s, p, c) for p, (c, s) in enumerate(zip(ids[0, g].tolist(), score[0, g].tolist()))
                 if s != float("-inf")]
        out.append([c for _, _, c in sorted(pairs)[:k]])
    return out


def _rows(out: torch.Tensor) -> list[list[int]]:
    """The listed ids of each group of a (1, G, C) stage output, checked ascending, unique and -1 padded."""
    rows = []
    for row in out[0].tolist():
        ids = [c for c in row if c >= 0]
        assert row == ids + [-1] * (len(row) - len(ids)), row
        assert ids == sorted(set(ids)), row
        rows.append(ids)
    return rows


@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_stage_is_its_survivors_and_their_next_candidate_chunks(case, lookahead):
    """Every stage a decode step recomputes lists exactly its survivors' union with their next `lookahead` chunks that
    are candidates (a plain-Python reference on the method's scores), ascending, unique, -1 padded; a stage that is
    not refreshed keeps its output; the next stage's candidates are the sub-chunks of what the previous one lists.
    Lookahead 0 lists the survivors alone (the paper's Alg. 4, as before the option)."""
    m = _method(case, lookahead=lookahead)
    cfg = m.cfg
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(700, Hkv, D, generator=g)
    added = outside = 0
    for layer in (0, 1):
        state, before = {}, None
        for step in range(6):
            L = 600 + 3 * step
            q = torch.randn(1, Hq, D, generator=g)
            blocks = BlockQueries.build([(0, 1, L - 1)], q.device)
            sk = SequenceKeys.from_dense(keys[:L])
            last = m.select(layer, q, blocks, sk, state, step)
            stages = state["stages"]
            assert torch.equal(last, stages[-1])
            first = 0 if step == 0 else m.refresh_from(step)
            cand_end = L - cfg.n_window
            for i, (l, k) in enumerate(zip(cfg.chunk_sizes, m.stage_budgets(layer))):
                got = _rows(stages[i])
                for ids in got:
                    assert all(_valid(c, l, cfg.n_sink, cand_end) for c in ids)  # never in the window nor past it
                if i < first:
                    assert torch.equal(stages[i], before[i])
                    continue
                if i == 0:
                    n = -(-cand_end // l)
                    ids = torch.tensor([[[c for c in range(cfg.n_sink // l, n)]] * m.groups])
                else:
                    ratio = cfg.chunk_sizes[i - 1] // l
                    parents = _rows(stages[i - 1])
                    width = max(len(p) for p in parents) * ratio
                    ids = torch.tensor([[[p * ratio + r for p in ps for r in range(ratio)] +
                                         [-1] * (width - len(ps) * ratio) for ps in parents]])
                survivors = _top(m, layer, q, blocks, sk, i, ids, k // l)
                for gi, (top, ids_g) in enumerate(zip(survivors, got)):
                    want = sorted({c + j for c in top for j in range(lookahead + 1)
                                   if _valid(c + j, l, cfg.n_sink, cand_end)})
                    assert ids_g == want, (layer, step, i, gi)
                    added += len(want) - len(top)
                    if i:
                        outside += len(set(want) - set(ids[0, gi].tolist()))
            before = [s.clone() for s in stages]
    if lookahead:  # successors were added, some of them outside the stage's own candidates
        assert added > 0 and outside > 0
    else:
        assert added == outside == 0


@pytest.mark.parametrize("n", [1, 2, 3])
def test_lookahead_chunks_of_padded_rows_at_the_candidate_end(n):
    """`lookahead_chunks` on rows as a stage can leave them: -1 padding (whose "successors" 0, 1, ... would be
    candidates: the sink is shorter than a chunk here), survivors next to each other, survivors at the candidate end
    (blocks of different lengths): the plain-Python union, ascending, unique, -1 padded, (1 + n) times as wide."""
    chunk, n_sink, C = 16, 4, 6
    m = InfiniteHiP(InfiniteHiPConfig(chunk_sizes=(chunk,), budgets=(chunk * C,), refresh=(1,), n_sink=n_sink,
                                      n_window=8, early_last_budget=None), Hq, Hkv)
    g = torch.Generator().manual_seed(n)
    cand_end = torch.tensor([40, 100, 163, 200, 16])
    rows = []
    for end in cand_end.tolist():
        valid = [c for c in range(-(-end // chunk)) if _valid(c, chunk, n_sink, end)]
        rows.append([])
        for _ in range(3):
            pick = sorted(torch.randperm(len(valid), generator=g)[:int(torch.randint(0, C + 1, (1,), generator=g))])
            rows[-1].append([valid[i] for i in pick] + [-1] * (C - len(pick)))
    out = m.lookahead_chunks(torch.tensor(rows, dtype=torch.int32), chunk, cand_end, n)
    assert out.shape == (len(rows), 3, (1 + n) * C) and out.dtype == torch.int32
    for b, (end, groups) in enumerate(zip(cand_end.tolist(), rows)):
        for gi, ids in enumerate(groups):
            want = sorted({c + j for c in ids if c >= 0 for j in range(n + 1) if _valid(c + j, chunk, n_sink, end)})
            assert out[b, gi].tolist() == want + [-1] * ((1 + n) * C - len(want))


@pytest.mark.parametrize("case", sorted(CASES))
def test_lookahead_zero_is_the_default_and_prefill_ignores_lookahead(case):
    """A config without `lookahead` selects as lookahead 0 in decode, its first step the prefill selection of its
    block, and the captured stage widths are the budgets' (k / l_c; (1 + lookahead) times that with lookahead);
    prefill selects the same blocks whatever the lookahead (it applies to decode steps only)."""
    default, zero, two = _method(case), _method(case, lookahead=0), _method(case, lookahead=2)
    assert default.cfg.lookahead == 0 and default.cfg == zero.cfg
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(500, Hkv, D, generator=g)
    q = torch.randn(40, Hq, D, generator=g)
    prefill = [(0, 8, 300), (8, 8, 308), (16, 24, 316)]
    for layer in (0, 1):
        assert zero.graph_stage_widths(layer) == tuple(k // l for k, l in zip(zero.stage_budgets(layer),
                                                                             zero.cfg.chunk_sizes))
        assert two.graph_stage_widths(layer) == tuple(3 * w for w in zero.graph_stage_widths(layer))
        a = default.select(layer, q, prefill, keys[:340])
        assert torch.equal(a, two.select(layer, q, prefill, keys[:340]))
        states = {}, {}
        for step in range(5):
            qd = torch.randn(1, Hq, D, generator=g)
            block = [(0, 1, 400 + step)]
            sel = [m.select(layer, qd, block, keys[:401 + step], s, step) for m, s in zip((default, zero), states)]
            assert torch.equal(*sel)
            if step == 0:  # the first step runs every stage: the prefill selection of its block
                assert torch.equal(sel[0], default.select(layer, qd, block, keys[:401]))


def test_lookahead_must_be_an_integer_at_least_zero():
    from longreach.attention.presets import config_from

    for bad in (-1, 1.5, True, "1", None):
        with pytest.raises(ValueError, match=r"lookahead must be an integer >= 0"):
            InfiniteHiPConfig(lookahead=bad)
    with pytest.raises(ValueError, match=r"lookahead must be an integer >= 0"):  # as --attention-config gives it
        config_from(InfiniteHiPConfig, InfiniteHiPConfig(), {"lookahead": -1})
    with pytest.raises(ValueError, match=r"field lookahead must be int, got 1.5"):
        config_from(InfiniteHiPConfig, InfiniteHiPConfig(), {"lookahead": 1.5})
    assert config_from(InfiniteHiPConfig, InfiniteHiPConfig(), {"lookahead": 2}).lookahead == 2


def test_crossover_key_of_lookahead_zero_is_the_measured_one():
    """The field leaves the crossover key of the config a file measured as it was (the file keeps applying);
    lookahead 1 selects differently and gets a key of its own. The file measured 3k-box when its decode schedule was
    (16, 8, 4); today's default (8, 4, 1) decodes at another cost, so the file does not apply to it."""
    from types import SimpleNamespace

    from longreach.attention.infinitehip import PRESETS
    from longreach.attention.sparse import crossover

    path = pathlib.Path(__file__).parents[1] / "docs/results/crossover-8b-h200/infinitehip-6f2d1fb160b9629f.json"
    record = json.loads(path.read_text())
    mc = SimpleNamespace(**{k: record["key"][k] for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim",
                                                          "hidden_size", "intermediate_size")})
    ec = SimpleNamespace(dtype=record["key"]["dtype"], kv_cache_dtype=record["key"]["kv_cache_dtype"])
    keys = {}
    for la in (0, 1):
        cfg = dataclasses.replace(PRESETS["3k-box"], lookahead=la, refresh=(16, 8, 4))
        keys[la] = crossover.key_fields(mc, "infinitehip", cfg, ec, "cpu")["config_sha256"]
    assert keys[0] == record["key"]["config_sha256"] != keys[1]
    assert crossover.key_fields(mc, "infinitehip", PRESETS["3k-box"], ec, "cpu")["config_sha256"] != keys[0]


# ---- through the engine -----------------------------------------------------------------------------------------
ENGINE_CFG = {  # tests/test_sparse_graphs.py's GRAPH_CFG: no stage recomputed at some steps, dense_below 100
    "infinitehip": {"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [128, 32, 8],
                    "early_layers": 1, "early_last_budget": 16, "refresh": [6, 3, 2], "dense_below": 100},
    "infinitehip-box": {"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [64, 32, 8],
                        "early_layers": 1, "early_last_budget": 16, "refresh": [6, 3, 2], "dense_below": 100,
                        "exact_below": 8, "stage0_scores": "minmax"},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


def _llm(path, case, lookahead, eager):
    from longreach.engine.llm import LLM

    return LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, attention="infinitehip",
               attention_config=json.dumps({**ENGINE_CFG[case], "lookahead": lookahead}), enforce_eager=eager)


def _record(monkeypatch) -> list:
    """Every attended layer's selection as the attention reads it, (decode?, layer, per row and group the listed
    blocks), appended to the returned list as the engine runs."""
    from longreach.attention.sparse.backend import SparseBackend

    picked, attend = [], SparseBackend.attend

    def record(self, layer, q, k_cache, v_cache, meta, qb, plan_queries, blocks, counts, context_len):
        picked.append((not meta.is_prefill, layer,
                       [[b[:int(c)].tolist() for b, c in zip(rb, rc)] for rb, rc in zip(blocks, counts)]))
        return attend(self, layer, q, k_cache, v_cache, meta, qb, plan_queries, blocks, counts, context_len)

    monkeypatch.setattr(SparseBackend, "attend", record)
    return picked


@pytest.mark.parametrize("case", sorted(ENGINE_CFG))
def test_graph_decode_selects_what_eager_decode_does_with_lookahead(tiny, case, monkeypatch):
    """`{"lookahead": 1}` through the engine: the static-buffer decode path that CUDA graphs capture (emulated on a
    CPU), its stage caches (1 + lookahead) times as wide, attends to the very blocks of the eager decode step in
    every step and layer, at most (1 + lookahead) times the budget and more than lookahead 0 reads; the prompt's
    selections are lookahead 0's. Then sequences joining mid-way (refresh schedules out of phase, a prompt growing
    past dense_below) get the eager run's tokens."""
    from longreach import SamplingParams

    prompt = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for name, la, eager in (("eager", 1, True), ("graph", 1, False), ("off", 0, True)):
        llm = _llm(tiny, case, la, eager)
        if not eager:
            llm.engine.runner.capture_graphs(emulate=True)
        picked = _record(monkeypatch)
        tokens = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].token_ids
        runs[name] = (tokens, picked, llm.engine)
        monkeypatch.undo()
    (tokens, eager, _), (graph_tokens, graph, engine), (_, off, _) = runs["eager"], runs["graph"], runs["off"]
    assert graph_tokens == tokens and [p[2] for p in graph] == [p[2] for p in eager]
    assert len({key[1] for _, key in engine.runner._graphs}) >= 2  # decoded through graphs, several refresh levels
    m = engine.backend.method
    for layer in range(3):
        widths = [c.shape[-1] for c in engine.backend.graph._g["cache"][layer]]
        assert widths == [2 * (k // l) for k, l in zip(m.stage_budgets(layer), m.cfg.chunk_sizes)]
    decode = [(layer, len(ids)) for is_decode, layer, rows in graph if is_decode for g in rows for ids in g]
    assert decode and all(n * m.block_k <= 2 * m.selected_budget(layer) for layer, n in decode)
    assert any(n * m.block_k > m.selected_budget(layer) for layer, n in decode)  # past lookahead 0's budget
    assert sum(n for _, n in decode) > sum(len(ids) for p in off if p[0] for g in p[2] for ids in g)
    assert [p for p in eager if not p[0]] == [p for p in off if not p[0]] != []  # the prompt's: as lookahead 0's

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (150, 90, 120)]
    expected = [_llm(tiny, case, 1, True).generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].token_ids
                for p in prompts]
    llm = _llm(tiny, case, 1, False)
    llm.engine.runner.capture_graphs(emulate=True)
    assert run_with_joins(llm.engine, prompts, params, {0: 0, 3: 1, 8: 2}, 80) == expected
    assert len({key[1] for _, key in llm.engine.runner._graphs}) >= 2  # several refresh levels ran
