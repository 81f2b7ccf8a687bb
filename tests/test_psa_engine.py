"""PSA (attention/psa/) through the engine on the random tiny model: epsilon 1 == dense, offload on == off, the
graph decode path == eager, a composed prefill, and the keys-read meter (count_reads). The kernels and the stop rule
are tests/test_psa.py's.
"""
import pytest
import torch
from conftest import run_with_joins

from tests.test_offload_engine import _record_logits

# ---- through the engine ---------------------------------------------------------------------------------------------
SMALL = '{"n_sink": 8, "n_window": 8, "microbatch": 1, "epsilon": 0.8}'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


def _prompts(seed, lengths=(150, 90)):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in lengths]


def _llm(path, config=SMALL, attention="psa", **kw):
    from longreach.engine.llm import LLM

    kw.setdefault("kv_cache_memory_gb", 0.01)
    return LLM(path, device="cpu", dtype="float32", attention=attention, attention_config=config, **kw)


def test_engine_epsilon_one_equals_dense_and_lower_epsilon_prunes(tiny):
    from longreach import SamplingParams

    prompts, params = _prompts(1, (120, 70)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    dense_llm = _llm(tiny, None, attention="dense")
    dense_logits = _record_logits(dense_llm)
    dense = [o.token_ids for o in dense_llm.generate(prompts, params, use_tqdm=False)]
    full_llm = _llm(tiny, SMALL.replace('"epsilon": 0.8', '"epsilon": 1.0'))
    full_logits = _record_logits(full_llm)
    assert [o.token_ids for o in full_llm.generate(prompts, params, use_tqdm=False)] == dense
    assert all((a - b).abs().max() < 1e-4 for a, b in zip(dense_logits, full_logits))
    low = _llm(tiny, SMALL.replace('"epsilon": 0.8', '"epsilon": 0.3'))
    low_logits = _record_logits(low)
    low.generate(prompts, params, use_tqdm=False)
    assert max((a - b).abs().max() for a, b in zip(dense_logits[1:], low_logits[1:])) > 1e-3  # decode steps differ


def test_engine_offload_on_equals_off_bit_for_bit(tiny):
    """A GPU pool of 12 slots for 3 layers: decode reads miss, install and evict; every logit equals the one-tier
    run's exactly, and the store stays consistent."""
    from longreach import SamplingParams

    prompts, params = _prompts(2, (120, 70)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pool = 12 * 2 * 16 * 2 * 16 * 4 / 2**30
    runs = {}
    for offload in (False, True):
        kw = dict(kv_cache_memory_gb=pool, kv_offloading_size=0.004) if offload else {}
        llm = _llm(tiny, max_num_batched_tokens=48, **kw)
        llm.engine.scheduler.mixed = False  # the offloaded store's steps (no mixed ones) in both runs, to compare
        logits = _record_logits(llm)
        runs[offload] = ([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], logits, llm)
    assert runs[False][0] == runs[True][0]
    assert len(runs[False][1]) == len(runs[True][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))
    llm = runs[True][2]
    llm.engine.kv_cache.check_integrity()
    stats = llm.engine.kv_cache_stats()
    assert stats["pages_missed"] > 0 and stats["pages_hit"] > 0 and stats["pages_evicted"] > 0


def test_graph_decode_path_equals_eager_with_joining_sequences(tiny):
    """The static-buffer decode path CUDA graphs capture (run eagerly on CPU: emulate), while sequences join mid-way:
    their first decode step builds the whole prompt's metadata (the catch-up variant), later steps one block."""
    from longreach import SamplingParams

    prompts = [p["prompt_token_ids"] for p in _prompts(5, (130, 90))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eager = _llm(tiny, enforce_eager=True)
    expected = [eager.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].token_ids for p in prompts]
    engine = _llm(tiny).engine
    engine.runner.capture_graphs(emulate=True)
    assert run_with_joins(engine, prompts, params, {0: 0, 3: 1}, 60) == expected
    # every box variant ran: no block completed (no build launch), one block each, a joining sequence's catch-up
    assert {key[1] for _, key in engine.runner._graphs} == {0, 1, 2}
    assert not engine.backend.boxes.done  # finished sequences gave their state back


def test_composed_prefill_then_psa_decode_equals_psa(tiny):
    """`--attention dense --decode-attention psa` (the path any sparse prefill takes) decodes exactly like psa."""
    from longreach import SamplingParams

    prompts, params = _prompts(3, (120, 70)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = [o.token_ids for o in _llm(tiny).generate(prompts, params, use_tqdm=False)]
    composed = _llm(tiny, None, attention="dense", decode_attention="psa", decode_attention_config=SMALL)
    assert [o.token_ids for o in composed.generate(prompts, params, use_tqdm=False)] == alone


def test_decode_read_meter_counts_keys_per_query_eager_and_under_graphs(tiny):
    """count_reads meters (keys read, queries, context keys) over decode rows x layers x KV groups: epsilon 1 reads
    every key of the context; a lower epsilon reads fewer, and the graph path (3 rows in a 4-row graph: one padding
    row, plus the capture's scratch run) meters exactly what eager decode meters. Off by default: None."""
    from longreach import SamplingParams
    from longreach.tools.eval.common import reads_between

    lengths, steps = (150, 90, 120), 4
    prompts = _prompts(7, lengths)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)  # token 1 comes from the prefill
    metered = SMALL.replace("}", ', "count_reads": true}')
    layers, groups = 3, 2  # the tiny model's
    full = _llm(tiny, metered.replace('"epsilon": 0.8', '"epsilon": 1.0'), enforce_eager=True)
    full.generate(prompts, params, use_tqdm=False)
    got = full.engine.backend.decode_reads()
    context = sum(n + j for n in lengths for j in range(1, steps + 1)) * layers * groups
    assert got == {"keys": context, "queries": len(lengths) * steps * layers * groups, "context_keys": context}
    eager = _llm(tiny, metered, enforce_eager=True)
    eager.generate(prompts, params, use_tqdm=False)
    graph = _llm(tiny, metered).engine
    graph.runner.capture_graphs(emulate=True)
    for i, p in enumerate(prompts):
        graph.add_request(str(i), p["prompt_token_ids"], params)
    while graph.has_unfinished_requests():
        graph.step()
    assert {rows for rows, _ in graph.runner._graphs} == {4}  # the 4-row graph ran
    e, g = eager.engine.backend.decode_reads(), graph.backend.decode_reads()
    assert g == e and e["queries"] == got["queries"] and e["context_keys"] == context and 0 < e["keys"] < context
    summary = reads_between({"keys": 0.0, "queries": 0.0, "context_keys": 0.0}, e)
    assert summary["share"] == round(e["keys"] / context, 5) and summary["queries"] == e["queries"]
    assert _llm(tiny).engine.backend.decode_reads() is None
