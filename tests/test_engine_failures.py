"""Failure isolation in `LLMEngine.step` (tiny CPU model): a NaN row, a forward, the sampler or the stop rules failing
on one request fails that request alone (error set, pages freed) and leaves the others' tokens as in a clean run; a
failure for everyone raises. The retry of a failed forward is safe with stateful backends (InfiniteHiP, Quest with
and without kept page boxes, PSA; cascading raises). A logprobs pass run between steps while requests run (what the
server does) scores the same as on an idle engine and changes nobody's tokens, with dense attention and those
backends."""
import pytest
import torch

from longreach import SamplingParams
from longreach.engine import llm_engine as llm_engine_module
from longreach.engine.llm import LLM
from longreach.engine.llm_engine import LLMEngine

from conftest import make_tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = {"a": 40, "bad": 70, "c": 9, "d": 25}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)
    # 32-token chunks: "bad" (70 tokens) prefills in three steps, beside the others' prefill and decode
    return LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=32,
               block_size=8).engine


def _prompts(seed=0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {rid: torch.randint(3, 256, (n,), generator=g).tolist() for rid, n in LENGTHS.items()}


def _drive(engine: LLMEngine, params=GREEDY, prompts=None, max_steps=200) -> dict:
    prompts = prompts or _prompts()
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    outs = {}
    for _ in range(max_steps):
        for o in engine.step():
            outs[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # the failed request's pages came back too
    return outs


@pytest.fixture(scope="module")
def clean(engine):
    return {rid: o.token_ids for rid, o in _drive(engine).items()}


def _is_bad(seq) -> bool:
    return seq.request_id == "bad"


def _with_fault(engine, monkeypatch, fault, after_steps=0):
    """Wrap the runner's execute: after `after_steps` calls, `fault(batch, logits, sample_idx)` may change the
    logits or raise."""
    real, calls = engine.runner.execute, {"n": 0}

    def execute(batch, all_logits=False):
        calls["n"] += 1
        out = real(batch, all_logits=all_logits)
        if calls["n"] > after_steps:
            with torch.inference_mode():  # the logits are inference tensors
                fault(batch, *out)
        return out
    monkeypatch.setattr(engine.runner, "execute", execute)
    return calls


def _check_failed(out, reason, clean, outs):
    assert out.error is not None and out.error.reason == reason, out.error
    assert all(c.finish_reason == "error" for c in out.outputs)
    assert {rid: o.token_ids for rid, o in outs.items() if rid != "bad"} == {r: t for r, t in clean.items()
                                                                             if r != "bad"}
    assert all(o.error is None for rid, o in outs.items() if rid != "bad")


@pytest.mark.parametrize("after_steps", [0, 4])  # in its prefill, or while decoding
def test_nan_logits_fail_one_request(engine, clean, monkeypatch, after_steps):
    def nan_row(batch, logits, sample_idx):
        for row, i in enumerate(sample_idx):
            if _is_bad(batch.seqs[i]):
                logits[row, 5] = float("nan")
    _with_fault(engine, monkeypatch, nan_row, after_steps)
    outs = _drive(engine)
    _check_failed(outs["bad"], "non_finite_logits", clean, outs)
    assert len(outs["bad"].token_ids) < GREEDY.max_tokens


def test_forward_error_retries_alone_and_fails_one_request(engine, clean, monkeypatch):
    def raise_on_bad(batch, logits, sample_idx):
        if any(_is_bad(s) for s in batch.seqs):
            raise RuntimeError("injected kernel error")
    calls = _with_fault(engine, monkeypatch, raise_on_bad, after_steps=5)
    outs = _drive(engine)
    _check_failed(outs["bad"], "forward_error", clean, outs)
    assert "injected kernel error" in outs["bad"].error.message
    assert calls["n"] > 0


def test_sampler_and_stop_rule_errors_fail_one_request(engine, clean, monkeypatch):
    real = engine.sampler.sample

    def sample(logits, seqs):
        if any(_is_bad(s) for s in seqs):
            raise ValueError("bad sampling parameters")
        return real(logits, seqs)
    monkeypatch.setattr(engine.sampler, "sample", sample)
    outs = _drive(engine)
    _check_failed(outs["bad"], "sampling_error", clean, outs)
    monkeypatch.undo()

    real_append = llm_engine_module.append_token

    def append_token(seq, tok):
        if _is_bad(seq) and len(seq.output_token_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        real_append(seq, tok)
    monkeypatch.setattr(llm_engine_module, "append_token", append_token)
    outs = _drive(engine)
    _check_failed(outs["bad"], "postprocess_error", clean, outs)
    assert len(outs["bad"].token_ids) == 3  # the tokens recorded before the failure


def test_one_failing_sample_fails_its_request_of_n(engine, monkeypatch):
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {"bad": _prompts()["bad"], "a": _prompts()["a"]}
    want = {rid: [c.token_ids for c in o.outputs] for rid, o in _drive(engine, params, prompts).items()}

    def nan_one_sample(batch, logits, sample_idx):
        for row, i in enumerate(sample_idx):
            s = batch.seqs[i]
            if _is_bad(s) and s.index == 1 and len(s.output_token_ids) == 2:
                logits[row] = float("inf")
    _with_fault(engine, monkeypatch, nan_one_sample)
    outs = _drive(engine, params, prompts)
    assert outs["bad"].error.reason == "non_finite_logits"
    assert [c.finish_reason for c in outs["bad"].outputs] == ["error", "error"]
    assert [c.token_ids for c in outs["a"].outputs] == want["a"] and outs["a"].error is None


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_failing_for_everyone_raises(engine, monkeypatch, where):
    """A sticky error (every forward raises, the canary's too; or every row's sampling, as when a CUDA error of the
    forward surfaces at the sampler's host transfer) is the engine's: step raises, for the server loop to die."""
    def always(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if where == "forward":
        _with_fault(engine, monkeypatch, always, after_steps=0)
    else:
        monkeypatch.setattr(engine.sampler, "sample", always)
    for rid, ids in _prompts().items():
        engine.add_request(rid, ids, GREEDY)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        for _ in range(60):  # a lone row may fail alone first; the first step where two or more sample raises
            engine.step()
    monkeypatch.undo()
    for rid in LENGTHS:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_lone_failing_sequence_fails_alone_while_the_device_answers(engine, monkeypatch):
    def raise_on_bad(batch, logits, sample_idx):
        if any(_is_bad(s) for s in batch.seqs):
            raise RuntimeError("injected")
    _with_fault(engine, monkeypatch, raise_on_bad)
    outs = _drive(engine, prompts={"bad": _prompts()["bad"]})
    assert outs["bad"].error.reason == "forward_error"


METHODS = {  # small configs of tests/test_sparse.py and tests/test_psa_engine.py
    "infinitehip": '{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [128, 32, 8], '
                   '"early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], "dense_below": 0}',
    "quest": '{"n_sink": 8, "n_window": 16, "block_q": 8, "page_size": 4, "budget": 16, "dense_below": 0}',
    "quest-paged": '{"n_sink": 8, "n_window": 16, "block_q": 8, "page_size": 16, "budget": 32, "dense_below": 0}',
    "psa": '{"n_sink": 8, "n_window": 8, "microbatch": 1, "epsilon": 0.8}',
    "cascading": '{"n_sink": 4, "num_subcaches": 3, "subcache_size": 8, "stride": 16, "block_q": 8, "block_k": 4}',
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_retry_after_a_decode_forward_error_with_a_stateful_backend(engine, monkeypatch, method):
    """The worst case for the retry: the batched forward ran to the end (every backend's per-sequence state advanced)
    and then raised. Sparse and PSA backends: the survivors, re-run alone after their state was dropped, decode exactly
    their clean tokens. Cascading cannot rebuild its rings from the cache: the retries raise, so the step does."""
    kw = {"max_model_len": 4096} if method == "cascading" else {}
    path = engine.config.model
    e = LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_num_batched_tokens=64,
            attention=method.removesuffix("-paged"), attention_config=METHODS[method], **kw).engine
    g = torch.Generator().manual_seed(0)
    lengths = {"a": 150, "bad": 90, "c": 120}
    prompts = {rid: torch.randint(3, 256, (n,), generator=g).tolist() for rid, n in lengths.items()}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    clean = {rid: o.token_ids for rid, o in _drive(e, params, prompts).items()}

    def after_the_forward(batch, logits, sample_idx):
        if any(_is_bad(s) and len(s.output_token_ids) >= 5 for s in batch.seqs):
            raise RuntimeError("injected after the forward")
    _with_fault(e, monkeypatch, after_the_forward)
    if method == "cascading":
        with pytest.raises(RuntimeError, match="injected after the forward"):
            _drive(e, params, prompts)
        return
    outs = _drive(e, params, prompts)
    assert outs["bad"].error.reason == "forward_error" and len(outs["bad"].token_ids) == 5
    assert {rid: o.token_ids for rid, o in outs.items() if rid != "bad"} == {"a": clean["a"], "c": clean["c"]}


@pytest.mark.parametrize("method", ["dense", *sorted(METHODS)])
def test_logprobs_pass_between_steps_changes_nothing(engine, method):
    """The server's interleaving: a LogprobsPass advanced one chunk after each step while requests run scores what
    `prompt_logprobs` scores on an idle engine, and the requests' tokens are those of a run without it."""
    if method != "dense":
        kw = {"max_model_len": 4096} if method == "cascading" else {}
        engine = LLM(engine.config.model, device="cpu", dtype="float32", kv_cache_memory_gb=0.01,
                     max_num_batched_tokens=32, attention=method.removesuffix("-paged"),
                     attention_config=METHODS[method], **kw).engine
    clean = {rid: o.token_ids for rid, o in _drive(engine).items()}
    ids = _prompts(seed=9)["bad"] + _prompts(seed=9)["a"]  # 110 tokens: four 32-token chunks
    want = engine.prompt_logprobs(ids, 3, 5)
    for rid, p in _prompts().items():
        engine.add_request(rid, p, GREEDY)
    engine.step()
    p = engine.start_prompt_logprobs(ids, 3, 5)
    assert engine.num_unfinished_sequences() == len(LENGTHS) and p.reserve()
    outs, chunks = {}, 0
    while engine.has_unfinished_requests() or not p.done:
        if engine.has_unfinished_requests():
            outs.update({o.request_id: o.token_ids for o in engine.step()})
        if not p.done:
            p.advance()
            chunks += 1
    got = p.result()
    p.close()
    assert chunks == 4 and outs == clean
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
