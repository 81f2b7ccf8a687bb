"""KV offloading through the engine, on CPU: offloaded == the GPU tier alone (every logit, every method), the
captured decode path, the selection stages' probes and in-step installs, preemption with fp8, sizing errors. The
store's own bookkeeping and the kernels are tests/test_offload.py's.
"""
from __future__ import annotations

import pytest
import torch

from longreach.kvcache.offload import OffloadedKVCache

# ---- the engine: offloaded == on the GPU tier alone ------------------------------------------------------------------
SMALL = {
    "infinitehip": '{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [128, 32, 8], '
                   '"early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], "dense_below": 0}',
    # stage 0 from boxes (kernels/chunk_box.py): their keys gathered through both tiers, kept across decode steps
    "infinitehip-box": '{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], '
                       '"budgets": [64, 32, 8], "early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], '
                       '"dense_below": 0, "stage0_scores": "minmax"}',
    "hip": '{"n_sink": 8, "n_window": 16, "block_q": 8, "budget": 16, "dense_layers": [0], "dense_below": 0, '
           '"refresh": 2}',
    "streaming": '{"n_sink": 8, "n_window": 24, "block_q": 8, "dense_below": 0}',
    # page boxes kept by page id (attention/box_store.py): the offloaded prefill (staging area, page ids of its own)
    # boxes from the keys, the first decode step boxes the whole prompt through both tiers
    "quest": '{"n_sink": 8, "n_window": 16, "block_q": 8, "page_size": 16, "budget": 32, "dense_below": 0}',
}
POOL_GB = 12 * 2 * 16 * 2 * 16 * 4 / 2**30  # 12 slots: a few layers' worth; most reads miss and slots churn


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


def _llm(path, method, offload, **kw):
    """offload: False (one tier), True or "page" (a slot per page), "head" (a slot per KV head's page)."""
    from longreach.engine.llm import LLM

    mem = dict(kv_cache_memory_gb=POOL_GB, kv_offloading_size=0.004) if offload else dict(kv_cache_memory_gb=0.004)
    if offload:
        mem["kv_offload_unit"] = "head" if offload == "head" else "page"
    kw.setdefault("cpu_threads", 1)  # bit-for-bit comparisons: the same threads in both engines, whatever the load
    return LLM(path, device="cpu", dtype="float32", attention=method.removesuffix("-box"),
               attention_config=SMALL.get(method),
               max_num_batched_tokens=48, **mem, **kw)


def _record_logits(llm):
    """Every step's logits, in order (the runner's execute wrapped)."""
    seen = []
    runner = llm.engine.runner
    inner = runner.execute

    def execute(batch, all_logits=False):
        logits, idx = inner(batch, all_logits)
        seen.append(logits.clone())
        return logits, idx
    runner.execute = execute
    return seen


@pytest.mark.parametrize("unit", ["page", "head"])
@pytest.mark.parametrize("method", ["infinitehip", "infinitehip-box", "hip", "streaming", "quest", "dense"])
def test_offloaded_engine_gives_the_same_tokens_and_logits_bit_for_bit(tiny, method, unit):
    """Batch of two prompts of different lengths, chunked prefill (48-token chunks), 12 GPU slots for 3 layers x up
    to 10 pages: every logit of every step equals the one-tier run exactly, and the store stays consistent."""
    from longreach import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (150, 90)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for offload in (False, True):
        llm = _llm(tiny, method, unit if offload else False)
        # the same steps in both runs: an offloaded store keeps decode and prefill in steps of their own, so the
        # one-tier run does too here (mixed steps are tests/test_scheduler.py's)
        assert llm.engine.scheduler.mixed != offload
        llm.engine.scheduler.mixed = False
        logits = _record_logits(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[offload] = ([o.token_ids for o in outs], logits, outs, llm)
    (tok0, log0, _, _), (tok1, log1, outs, llm) = runs[False], runs[True]
    assert tok0 == tok1
    assert len(log0) == len(log1) and all(torch.equal(a, b) for a, b in zip(log0, log1))
    llm.engine.kv_cache.check_integrity()
    store = llm.engine.kv_cache
    assert store.staging_allocated_nbytes == 0 < store.staging_nbytes  # released by the first decode step
    stats = llm.engine.kv_cache_stats()
    assert stats["offload"] and stats["host_pages_used"] == 0 and stats["gpu_pages_used"] == 0  # all given back
    if method != "dense":  # dense reads pass through the host tier uncached
        assert stats["pages_missed"] > 0 and stats["pages_hit"] > 0 and stats["pages_evicted"] > 0
        assert outs[0].metrics.kv_pages_missed > 0 and stats["bytes_h2d"] > 0


@pytest.mark.parametrize("unit", ["page", "head"])
@pytest.mark.parametrize("method", ["infinitehip", "infinitehip-box"])
def test_offloaded_graph_decode_path_equals_eager_one_tier(tiny, method, unit):
    """The static-buffer decode path that CUDA graphs capture, with offloading (emulated on CPU); with a box stage 0
    the boxes are built inside it from both tiers."""
    from longreach import SamplingParams

    g = torch.Generator().manual_seed(6)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (130, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in _llm(tiny, method, False, enforce_eager=True).generate(
        prompts, params, use_tqdm=False)]
    llm = _llm(tiny, method, unit)
    llm.engine.runner.capture_graphs(emulate=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.kv_cache_stats()["pages_installed"] > 0
    llm.engine.kv_cache.check_integrity()


@pytest.mark.parametrize("graphs", [False, True])
def test_stage_probes_are_installed_with_head_units_only(tiny, monkeypatch, graphs):
    """infinitehip's stages 1-2 report the candidate chunks they scored (`PageReads.probe`) on the eager and the
    (emulated) graph decode paths; a store of head units marks them for installing, one of page units passes them
    through uncached (docs/design-offload-heads.md, part 2). When stage 0 is rescored in a step, stage 1's candidates
    go to `install_reads` before stage 1 scores them, and with head units pages are installed inside the step. Either
    way the tokens are the one-tier run's and the store stays consistent."""
    from longreach import SamplingParams

    seen = {"probe": 0, "marked": 0, "calls": 0, "early": 0}
    record, note, install = OffloadedKVCache.record_reads, OffloadedKVCache.note_reads, OffloadedKVCache.install_reads

    def counted_record(self, reads):
        seen["probe"] += reads.probe
        return record(self, reads)

    def counted_note(self, *a, **k):
        seen["marked"] += 1
        return note(self, *a, **k)

    def counted_install(self, reads):
        before = int(self._now[0])
        install(self, reads)
        seen["calls"] += 1
        seen["early"] += int(self._now[0]) - before

    monkeypatch.setattr(OffloadedKVCache, "record_reads", counted_record)
    monkeypatch.setattr(OffloadedKVCache, "note_reads", counted_note)
    monkeypatch.setattr(OffloadedKVCache, "install_reads", counted_install)
    g = torch.Generator().manual_seed(8)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (160, 120)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in _llm(tiny, "infinitehip", False, enforce_eager=True).generate(
        prompts, params, use_tqdm=False)]
    marks = {}
    for unit in ("page", "head"):
        seen.update(probe=0, marked=0, calls=0, early=0)
        llm = _llm(tiny, "infinitehip", unit)
        if graphs:
            llm.engine.runner.capture_graphs(emulate=True)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        llm.engine.kv_cache.check_integrity()
        assert seen["probe"] > 0 and seen["calls"] > 0
        assert (seen["early"] > 0) == (unit == "head")  # page units install nothing inside a step
        marks[unit] = (seen["marked"], seen["probe"])
    (page_marked, _), (head_marked, head_probes) = marks["page"], marks["head"]
    assert head_marked - page_marked == head_probes  # head units mark every probe read, page units none


def test_offload_with_preemption_and_fp8(tiny):
    """A host tier too small for both requests: one is preempted and recomputed, and both still get the tokens they
    get alone; fp8 KV runs through both tiers and agrees with fp8 on one tier."""
    from longreach import SamplingParams
    from longreach.engine.llm import LLM

    g = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (200, 180)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    per_page = OffloadedKVCache.bytes_per_page(3, 16, 2, 16, torch.float32)
    small = 28 * per_page / 2**30  # 28 pages of 16 tokens: one sequence (<= 240 tokens) fits, two do not
    llm = LLM(tiny, device="cpu", dtype="float32", attention="streaming", attention_config=SMALL["streaming"],
              kv_cache_memory_gb=POOL_GB, kv_offloading_size=small, max_model_len=256)
    together = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0  # re-prefilled after decode steps released the staging area
    alone = [llm.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts]
    assert [o.token_ids for o in together] == alone
    llm.engine.kv_cache.check_integrity()
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fp8 = {off: _llm(tiny, "infinitehip", off, kv_cache_dtype="fp8", max_model_len=256).generate(
        prompts, short, use_tqdm=False) for off in (False, "page", "head")}
    assert [o.token_ids for o in fp8[False]] == [o.token_ids for o in fp8["page"]] == [
        o.token_ids for o in fp8["head"]]


def test_offload_sizing_errors_name_the_fix(tiny):
    from longreach.config import EngineConfig
    from longreach.engine.llm import LLM

    with pytest.raises(ValueError, match=r"kv_offloading_size=1e-05 GiB holds .* fewer than max_model_len=512.*"
                                         r"raise --kv-offloading-size"):
        LLM(tiny, device="cpu", kv_offloading_size=1e-5, kv_cache_memory_gb=0.01)
    with pytest.raises(ValueError, match=r"kv_offloading_size=100000 GiB does not fit the host: .* GiB of memory is "
                                         r"available; lower --kv-offloading-size"):
        LLM(tiny, device="cpu", kv_offloading_size=100000, kv_cache_memory_gb=0.01)
    with pytest.raises(ValueError, match="kv_offloading_size must be a number of GiB >= 0"):
        EngineConfig(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float16, fp8"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_offload_unit must be 'page' or 'head'"):
        EngineConfig(kv_offload_unit="layer")
