"""Quest through the shared key boxes (attention/quest/, kernels/key_boxes.py, attention/box_store.py): page bounds
from the kept page boxes == Quest's bound from every page's min and max, at prefill and decode; the kernels in the
interpreter (fp16/fp32; bf16 at 128K: tests/gpu/test_quest.py, whose checks run here at small sizes); the page-box
bookkeeping; and the engine with kept page boxes == boxes from the keys at every call."""
from types import SimpleNamespace

import pytest
import torch

from longreach.attention.box_store import PageBoxes
from longreach.attention.quest import Quest, QuestConfig
from longreach.attention.sparse.selection import BlockQueries, SequenceKeys
from longreach.kernels import key_boxes
from longreach.kernels.key_boxes import build_boxes_reference, build_boxes_triton
from tests.gpu.test_quest import check_quest_kernels, quest_bound_reference
from tests.test_kernel_bsa import _cache

Hq, Hkv, D = 6, 2, 16


def _kept(L: int, page: int, dtype=torch.float32, seed=0):
    """One sequence of L keys (partial last page) in a scrambled paged cache, and its page boxes built by the
    reference as the engine keeps them: (cache, block table, store (pages, 1, 2, H_kv, D))."""
    kc, _, tables = _cache([L], Hkv, D, page, dtype, torch.Generator().manual_seed(seed))
    n = -(-L // page)
    store = torch.full((kc.shape[0], 1, 2, Hkv, D), float("nan"), dtype=dtype)
    one = torch.ones(1, dtype=torch.int32)
    build_boxes_reference(kc, tables, one * L, one * 0, one * n, tables, store, 1, page, "minmax")
    return kc, tables[0], store


def _blocks(L: int):
    """A prefill step's query blocks (two of 8 rows, then the prompt's last rows one by one) and a decode row."""
    prefill = [(0, 8, L - 19), (8, 8, L - 11), (16, 1, L - 3), (17, 1, L - 2), (18, 1, L - 1)]
    return {"prefill": (19, prefill), "decode": (1, [(0, 1, L - 1)])}


def assert_same_top(got_sel: torch.Tensor, want: torch.Tensor, k: int, tol: float) -> None:
    """Selections (nb, G, k) -1 padded are Quest's top-k of bounds `want` (nb, G, pages), ties within `tol` either
    way: every selected page scores at least the k-th best bound - tol, and no page left out beats it by more."""
    for sel, w in zip(got_sel.flatten(0, 1), want.flatten(0, 1)):
        ids = sel[sel >= 0].long()
        kk = min(k, int(torch.isfinite(w).sum()))
        assert ids.numel() == kk
        if kk:
            kth = w.topk(kk).values[-1]
            assert (w[ids] >= kth - tol).all()
            out = torch.ones_like(w, dtype=torch.bool)
            out[ids] = False
            assert not (w[out] > kth + tol).any()


@pytest.mark.parametrize("granularity", ["kv_head", "layer", "head"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_kept_page_boxes_give_quests_bound_and_selection(granularity, phase):
    """Through the block table of a scrambled cache, a partial last page: the kept boxes' bounds equal Quest's (fp32
    rounding of the centre and radius), the boxes built from the keys at a call give exactly the kept ones' scores,
    and the selections are Quest's top pages."""
    L, page = 203, 8
    kc, table, store = _kept(L, page)
    m = Quest(QuestConfig(page_size=page, budget=48, n_sink=12, n_window=24, granularity=granularity,
                          dense_below=0), Hq, Hkv)
    rows, blocks = _blocks(L)[phase]
    q = torch.randn(rows, Hq, D, generator=torch.Generator().manual_seed(1)) * 2
    bq = BlockQueries.build(blocks, "cpu")
    kept = SequenceKeys(kc, table, L, (store, table, 1))
    fresh = SequenceKeys(kc, table, L)  # no kept boxes: boxed from the keys
    want = quest_bound_reference(m, q, bq, fresh.dense())
    got = m.page_scores(q, bq, kept)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and int(fin.sum()) > 20
    assert (got[fin] - want[fin]).abs().max() <= 1e-4 * want[fin].abs().max()
    assert torch.equal(got, m.page_scores(q, bq, fresh))
    sel = m.select(0, q, blocks, kept)
    assert torch.equal(sel, m.select(0, q, blocks, fresh))
    assert_same_top(sel, want, 48 // page, 1e-4 * float(want[fin].abs().max()))


@pytest.mark.parametrize("units", [1, "heads"])  # a slot per page, per KV head's page
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quest_kernels_in_the_interpreter(dtype, units, monkeypatch):
    """tests/gpu/test_quest.py's kernel check at small sizes: the page-box build kernel (one tier, two tiers; from
    page 0 and from the middle; partial last pages) == its reference, and Quest's page scores by the score kernel from
    the kept boxes == its reference on them and Quest's bound from the keys, every granularity."""
    from tests.test_psa import _tiered

    monkeypatch.setattr(key_boxes, "use_triton", lambda *a, **k: True)  # Quest's scores through the kernel on CPU
    worst = check_quest_kernels("cpu", dtype, 611, ((6, 2, 16), (4, 4, 32)), page=8, prefill=(2, 16), budget=64,
                                tier=lambda kc, g: _tiered(kc, kc, torch.Generator().manual_seed(3),
                                                           kc.shape[2] if units == "heads" else 1)[0])
    fp32 = dtype == torch.float32
    assert worst["box"] <= (1e-6 if fp32 else 1e-3)
    assert worst["kernel"] <= (1e-5 if fp32 else 2e-3)
    assert worst["bound"] <= (1e-5 if fp32 else 2e-3)
    assert worst["overlap"] >= (1.0 if fp32 else 0.75)


def test_build_kernel_boxes_page_ranges_in_both_placements():
    """One build kernel, both placements: page-indexed (one flavour, the block table as the box table, per 1) and
    pooled (two flavours, a box table of its own, per 4, 16-token chunks over 4-token pages), fp32, against the
    reference, with the keys moved (PSA's rank boxes: position 0) and not."""
    g = torch.Generator().manual_seed(5)
    kc, _, tables = _cache([70, 33], Hkv, D, 4, torch.float32, g)
    lens = torch.tensor([70, 33], dtype=torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    for unit, per, flavours, box_tables in ((4, 1, 1, tables), (16, 4, 2, torch.tensor([[2, 0], [1, 3]]).int())):
        n = -(-lens // unit)
        lo, hi = (n // 2).int(), n.int()
        rows = int(box_tables.max() + 1) * per if per > 1 else kc.shape[0]
        for move in (None, (inv, 0)):
            want = torch.full((rows, flavours, 2, Hkv, D), float("nan"))
            got = want.clone()
            build_boxes_reference(kc, tables, lens, lo, hi, box_tables, want, per, unit, "cuboid-mean", move)
            build_boxes_triton(kc, tables, lens, lo, hi, box_tables, got, per, unit, "cuboid-mean", int(hi.max()),
                               move)
            assert torch.equal(torch.isnan(got), torch.isnan(want)) and (~torch.isnan(want)).any()
            assert (got - want).nan_to_num().abs().max() < 1e-5


def _meta(seq_ids, context, query, prefill):
    return SimpleNamespace(is_prefill=prefill, seq_ids=seq_ids, context_lens=context, query_lens=query)


def test_page_box_bookkeeping():
    """Which pages a step boxes: with the partial last page (Quest) it is boxed again each step until complete; without
    (PSA) only the pages complete before the step's newest key; short sequences box nothing; a prefill from 0 starts
    over; boxes count as built once the step's first layer built them; the store is made for the cache's pages and
    its scratch page, and refuses to grow under live sequences."""
    quest = PageBoxes("quest", 2, Hkv, D, 8, "minmax", partial=True, prefill=True, max_seqs=4,
                      device=torch.device("cpu"), min_len=10)
    quest.ensure(80, torch.float32)
    assert quest.pool.shape == (2, 11, 2, Hkv, D)  # 10 pages and the scratch page
    step = _meta([7, 8], [0, 0], [20, 5], True)
    quest.begin_step(step)
    assert quest._step == [(7, 20, 0, 3), (None, 5, 0, 0)]  # 5 tokens <= min_len: nothing
    quest.step_inputs(step, torch.zeros(2, Hq, D), None)
    assert quest.done == {7: 2}  # page 2 is partial: boxed again next step
    quest.begin_step(_meta([7], [20], [4], True))  # the next prefill chunk: 24 tokens, page 2 now complete
    assert quest._step == [(7, 24, 2, 3)]
    quest.begin_step(_meta([7], [0], [30], True))  # a prefill from position 0: boxed afresh
    assert quest._step == [(7, 30, 0, 4)]
    psa = PageBoxes("psa", 2, Hkv, D, 8, "cuboid-mean", partial=False, prefill=False, max_seqs=4,
                    device=torch.device("cpu"))
    psa.begin_step(_meta([3], [23], [1], False))  # 24 tokens: pages 0-1 complete before the newest key
    assert psa._step == [(3, 24, 0, 2)]
    psa.ensure(80, torch.float32)
    psa.step_inputs(psa._plans[-1][0], torch.zeros(1, Hq, D), None)
    with pytest.raises(RuntimeError, match="cannot grow"):
        psa.ensure(800, torch.float32)
    psa.free(3)
    psa.ensure(800, torch.float32)  # no sequence holds boxes: made again for the real cache
    assert psa.pool.shape[1] == 101 and not psa.done


# ---- through the engine ---------------------------------------------------------------------------------------------
ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.02, max_model_len=1024)
PAGED = '{"n_sink": 16, "n_window": 32, "block_q": 8, "page_size": 16, "budget": 48, "dense_below": 0}'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("quest") / "m", max_position_embeddings=512)[0]


def _ids(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_engine_keeps_page_boxes_that_select_as_boxes_from_the_keys(tiny, monkeypatch):
    """page_size == --block-size: the engine keeps each KV page's box (built across 64-token prefill chunks, in mixed
    steps as a second request joins, and in decode), and its logits and greedy tokens equal those of boxes built from
    every key at each call (Quest's reference); it prunes (differs from dense); finished sequences keep nothing."""
    from conftest import run_with_joins

    from longreach import SamplingParams
    from longreach.engine.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [_ids(330, 1), _ids(170, 2)]
    logits, tokens = {}, {}
    for run in ("kept", "fresh", "dense"):
        if run == "fresh":
            monkeypatch.setattr(SequenceKeys, "chunk_boxes", lambda self, chunk: None)
        kw = {} if run == "dense" else dict(attention="quest", attention_config=PAGED)
        llm = LLM(tiny, max_num_batched_tokens=64, **kw, **ENGINE_KW)
        logits[run] = llm.engine.prompt_logits(prompts[0])
        if run == "dense":
            break
        tokens[run] = run_with_joins(llm.engine, prompts, params, {0: 0, 3: 1}, 200)
        boxes = llm.engine.backend.boxes
        assert isinstance(boxes, PageBoxes) and not boxes.done
    assert torch.equal(logits["kept"], logits["fresh"]) and tokens["kept"] == tokens["fresh"]
    assert (logits["kept"][250:] - logits["dense"][250:]).abs().max() > 1e-3


def test_decode_after_another_prefill_and_the_kv_budget_of_both_halves(tiny, monkeypatch, caplog):
    """--attention dense --decode-attention quest: the first decode step boxes the whole prompt (no box was built in
    prefill), tokens as from the keys. Composed quest + psa: both keep page state, and the KV budget counts both.
    Another page size keeps no boxes and says so."""
    from longreach import SamplingParams
    from longreach.engine.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = {}
    for run in ("kept", "fresh"):
        if run == "fresh":
            monkeypatch.setattr(SequenceKeys, "chunk_boxes", lambda self, chunk: None)
        llm = LLM(tiny, attention="dense", decode_attention="quest", decode_attention_config=PAGED, **ENGINE_KW)
        out[run] = llm.generate([{"prompt_token_ids": _ids(300, 3)}], params, use_tqdm=False)[0].token_ids
    assert out["kept"] == out["fresh"]
    both = LLM(tiny, attention="quest", attention_config=PAGED, decode_attention="psa", **ENGINE_KW).engine.backend
    per_page = both.kv_needs(torch.float32).page_state_bytes
    assert per_page == both.prefill.page_state_bytes(torch.float32) + both.decode.page_state_bytes(torch.float32)
    # the layers that select keep boxes, the always-dense ones none: layers x (c, r) x H_kv x D x fp32
    selecting = both.prefill.fallback.sparse_layers()
    assert 0 < len(selecting) < 3 and both.prefill.boxes.shape[0] == len(selecting)
    assert both.prefill.page_state_bytes(torch.float32) == len(selecting) * 2 * 2 * 16 * 4
    other = LLM(tiny, attention="quest", attention_config=PAGED.replace('"page_size": 16', '"page_size": 8'),
                **ENGINE_KW)
    assert other.engine.backend.boxes is None and "page_size 8 is not --block-size 16" in caplog.text
