"""infinitehip's `ahead` (attention/infinitehip/method.py): at a decode step that rescores stage 0, the next stages
build on the stage-0 output of the refresh before (a sequence's first refresh: its own), the new one kept for the
next; with an offloaded store its pages are reserved and copied in the background (kvcache/prefetch.py)."""
import json

import pytest
import torch
from conftest import run_with_joins

from longreach.attention.infinitehip import InfiniteHiP, InfiniteHiPConfig
from longreach.attention.sparse.selection import BlockQueries, SequenceKeys

Hq, Hkv, D = 6, 2, 16
CFG = dict(block_q=8, chunk_sizes=(32, 8, 2), budgets=(128, 32, 8), n_sink=8, n_window=16, early_layers=1,
           early_last_budget=16, refresh=(4, 2, 1), dense_below=0)


def test_a_refresh_builds_on_the_stage0_output_of_the_refresh_before():
    """Eager decode, 13 steps (stage 0 rescored at 0, 4, 8, 12): with ahead, stage 0's listed output at refresh s is
    the plain method's at the refresh before (at step 0 its own), the kept one is the plain method's at s, and the
    later stages are the plain method's stages run from the listed stage 0; steps between refreshes keep them."""
    plain, ahead = (InfiniteHiP(InfiniteHiPConfig(**CFG, ahead=a), Hq, Hkv) for a in (False, True))
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(800, Hkv, D, generator=g)
    differs = 0
    for layer in (0, 1):
        state, s0, before = {}, {}, None
        for step in range(13):
            L = 640 + 5 * step
            q = torch.randn(1, Hq, D, generator=g)
            blocks = BlockQueries.build([(0, 1, L - 1)], q.device)
            sk = SequenceKeys.from_dense(keys[:L])
            last = ahead.select(layer, q, blocks, sk, state, step)
            stages = state["stages"]
            assert torch.equal(last, stages[-1])
            if step % 4:
                assert all(torch.equal(a, b) for a, b in zip(stages[:1], before[:1]))
                before = [x.clone() for x in stages]
                continue
            s0[step] = plain.run_stages(layer, q, blocks, sk)[0]  # the plain method's stage 0 at this step
            used = s0[max(step - 4, 0)]
            assert torch.equal(stages[0], used) and torch.equal(state["ahead"], s0[step])
            assert all(torch.equal(a, b) for a, b in zip(stages[1:], plain.run_stages(layer, q, blocks, sk, 1, used)))
            differs += step > 0 and not torch.equal(used, s0[step])
            before = [x.clone() for x in stages]
    assert differs > 0  # the delay changed stage 0's output at some refresh


def test_ahead_must_be_a_bool_and_needs_two_stages():
    from longreach.attention.presets import config_from

    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="ahead must be true or false"):
            InfiniteHiPConfig(ahead=bad)
    with pytest.raises(ValueError, match="ahead needs two stages or more"):
        InfiniteHiPConfig(chunk_sizes=(8,), budgets=(64,), refresh=(1,), early_last_budget=None, ahead=True)
    assert config_from(InfiniteHiPConfig, InfiniteHiPConfig(), {"ahead": True}).ahead
    assert "ahead" in InfiniteHiPConfig.DECODE_ONLY  # a --share-prefill variant may differ in it


# ---- through the engine -----------------------------------------------------------------------------------------
ENGINE_CFG = {"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [64, 32, 8],
              "early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], "dense_below": 100}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


def _llm(path, ahead, eager, offload=False):
    from longreach.engine.llm import LLM

    mem = dict(kv_cache_memory_gb=0.01)
    if offload:  # 40 slots of one KV head's page: reads miss and slots churn, and reservations find victims
        mem = dict(kv_cache_memory_gb=40 * 2 * 16 * 16 * 4 / 2**30, kv_offloading_size=0.004, kv_offload_unit="head")
    return LLM(path, device="cpu", dtype="float32", attention="infinitehip", cpu_threads=1,
               attention_config=json.dumps({**ENGINE_CFG, "ahead": ahead}), enforce_eager=eager, **mem)


def test_graph_decode_and_an_offloaded_store_give_the_eager_tokens_with_ahead(tiny):
    """`{"ahead": true}` through the engine: the static-buffer decode path that CUDA graphs capture (emulated on a
    CPU; stage 0's kept output in a buffer per layer, reset when a sequence takes a slot) gives the eager run's
    tokens, also with sequences joining mid-way (refresh schedules out of phase, slots reused); an offloaded store
    of head units gives them too, eager and through the graph path, its reservations copied and activated
    (pages_installed_ahead > 0) and the store consistent; and ahead decodes other tokens than without it."""
    from longreach import SamplingParams

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (150, 120, 170)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def each(llm):
        return [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].token_ids for p in prompts]
    expected = each(_llm(tiny, True, True))
    assert expected != each(_llm(tiny, False, True))
    llm = _llm(tiny, True, False)
    llm.engine.runner.capture_graphs(emulate=True)
    assert run_with_joins(llm.engine, prompts, params, {0: 0, 5: 1, 9: 2}, 120) == expected
    assert {key[1] for _, key in llm.engine.runner._graphs} >= {0, 1}  # stage-0 refreshes ran in graphs
    for eager in (True, False):
        llm = _llm(tiny, True, eager, offload=True)
        if not eager:
            llm.engine.runner.capture_graphs(emulate=True)
        assert run_with_joins(llm.engine, prompts, params, {0: 0, 5: 1, 9: 2}, 120) == expected
        store = llm.engine.kv_cache
        assert store.counters["pages_installed_ahead"] > 0, eager
        store.check_integrity()
