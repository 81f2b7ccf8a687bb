"""Scheduler and engine: mixed lengths, chunked prefill, continuous batching, preemption, outputs and metrics."""
import pytest
import torch

from longreach import SamplingParams
from longreach.config import EngineConfig
from longreach.engine.llm import LLM
from longreach.engine.llm_engine import LLMEngine

from conftest import make_tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)
    return path


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in lengths]


def _llm(path, **kw):
    cfg = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01)
    cfg.update(kw)
    return LLM(path, **cfg)


LENGTHS = [5, 130, 37, 300, 1, 64]


def test_mixed_lengths_chunked_prefill_equals_unchunked_and_alone(tiny):
    prompts = _prompts(LENGTHS)
    big = _llm(tiny, max_num_batched_tokens=4096)
    together = [o.token_ids for o in big.generate(prompts, GREEDY, use_tqdm=False)]
    chunked = _llm(tiny, max_num_batched_tokens=48, block_size=8, max_num_seqs=3)
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)] == together
    alone = [big.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    assert alone == together
    assert all(len(t) == GREEDY.max_tokens for t in together)
    big.engine.blocks.check_integrity()
    assert big.engine.blocks.num_free_blocks == big.engine.blocks.num_blocks


def test_continuous_batching_requests_join_while_others_decode(tiny):
    llm = _llm(tiny)
    engine: LLMEngine = llm.engine
    prompts = _prompts([40, 200, 9], seed=3)
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    engine.add_request("a", prompts[0]["prompt_token_ids"], GREEDY)
    outputs = {}
    for step in range(60):
        if step == 5:
            engine.add_request("b", prompts[1]["prompt_token_ids"], GREEDY)
        if step == 9:
            engine.add_request("c", prompts[2]["prompt_token_ids"], GREEDY)
        if step == 7:
            assert not engine.last_step.is_prefill and engine.last_step.num_seqs == 2  # b joined a's decode
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    assert not engine.has_unfinished_requests()
    assert [outputs[r] for r in "abc"] == expected


def test_preemption_under_kv_pressure_gives_same_tokens(tiny):
    prompts = _prompts([100, 120, 90, 110], seed=5)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    roomy = [o.token_ids for o in _llm(tiny).generate(prompts, params, use_tqdm=False)]
    # 272 KV slots per sequence are needed at the end; give room for ~1.6 sequences (but >= max_model_len)
    tight = _llm(tiny, kv_cache_memory_gb=768 * 512 / 2**30, max_model_len=512, block_size=8)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == tight.engine.scheduler.num_preemptions
    assert [o.token_ids for o in outs] == roomy
    tight.engine.blocks.check_integrity()


def test_max_tokens_none_runs_to_max_model_len(tiny):
    llm = _llm(tiny, max_model_len=64)
    out = llm.generate(_prompts([50]), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 14 and out.outputs[0].finish_reason == "length"


def test_outputs_keep_prompt_order_and_report_metrics(tiny):
    llm = _llm(tiny)
    prompts = _prompts([300, 3, 40])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    for o in outs:
        m = o.metrics
        assert m.num_prompt_tokens == len(o.prompt_token_ids) and m.num_generated_tokens == GREEDY.max_tokens
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.prefill_tokens_per_s > 0 and m.decode_tokens_per_s > 0


def test_n_samples_with_seed_are_distinct_and_reproducible(tiny):
    llm = _llm(tiny)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = llm.generate(_prompts([20]), params, use_tqdm=False)[0]
    b = llm.generate(_prompts([20]), params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert [c.index for c in a.outputs] == [0, 1, 2]


def test_smollm2_chat_answers(smollm2):
    llm = LLM.__new__(LLM)  # reuse the session engine
    llm.engine, llm.config = smollm2, smollm2.config
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert out.text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop" and out.token_ids[-1] == 2


@pytest.mark.slow
def test_smollm2_chunked_batched_greedy_equals_one_by_one(smollm2):
    tok = smollm2.tokenizer
    texts = ["The history of the Roman Empire", "Photosynthesis is the process by which " * 12,
             "def fibonacci(n):", "Once upon a time, " * 30]
    llm = LLM.__new__(LLM)
    llm.engine, llm.config = smollm2, smollm2.config
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(texts, params, use_tqdm=False)]
    chunked = LLMEngine(EngineConfig(model="smollm2", device="cpu", dtype="float32", max_model_len=2048,
                                     kv_cache_memory_gb=0.5, max_num_batched_tokens=64, max_num_seqs=2))
    for text in texts:
        chunked.add_request(text[:20], tok.encode(text), params)
    got = {}
    while chunked.has_unfinished_requests():
        for o in chunked.step():
            got[o.request_id] = o.token_ids
    assert [got[t[:20]] for t in texts] == together
