"""The scheduler's token budget (issue 30): decodes are never starved, prefill chunks are bounded while others wait,
long prompts share the prefill budget, a short prompt behind them starts at the next step; and a mixed step (decode
rows + prefill chunks in one forward pass) gives the tokens and, to fp32 rounding, the logits of separate steps."""
from __future__ import annotations

import pytest
import torch

from longreach.config import EngineConfig
from longreach.engine.llm_engine import LLMEngine
from longreach.engine.scheduler import Scheduler
from longreach.engine.sequence import Sequence
from longreach.kvcache.block_manager import BlockManager
from longreach.sampling_params import SamplingParams

from conftest import make_tiny_hf_model

BUDGET = 1024


def _seq(i: int, prompt: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, [5] * prompt, SamplingParams(max_tokens=100), frozenset(), 100)


def _scheduler(mixed: bool, pages: int = 4096, **kw) -> Scheduler:
    return Scheduler(BlockManager(pages, 16), max_num_seqs=64, max_num_batched_tokens=BUDGET, mixed=mixed, **kw)


def _run(sched: Scheduler, batch) -> None:
    """What the engine does after a step: tokens computed; a sequence whose prompt is done samples one token."""
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.output_token_ids.append(7)


def _decoding(sched: Scheduler, n: int) -> list[Sequence]:
    seqs = [_seq(100 + i, 8) for i in range(n)]
    for s in seqs:
        sched.add(s)
    _run(sched, sched.schedule())  # one prefill step admits them all
    assert all(not s.is_prefilling for s in seqs)
    return seqs


@pytest.mark.parametrize("mixed", [True, False])
def test_decodes_are_never_starved_by_a_long_prompt(mixed):
    sched = _scheduler(mixed)
    decoders = _decoding(sched, 3)
    long = _seq(1, 20 * BUDGET)
    sched.add(long)
    decode_steps, prefill_steps = [], 0
    for step in range(30):
        batch = sched.schedule()
        ids = {s.seq_id for s in batch.seqs}
        if all(d.seq_id in ids for d in decoders):
            decode_steps.append(step)
        prefill_steps += long in batch.seqs
        if mixed:
            assert batch.num_decodes == 3 and batch.mixed and batch.seqs[:3] == decoders
        else:
            assert not batch.mixed and (batch.is_prefill == (long in batch.seqs))
        _run(sched, batch)
    if mixed:  # every step decodes, and the prompt advances in every step
        assert decode_steps == list(range(30)) and prefill_steps == 30
    else:  # they alternate: a decode waits at most one prefill step
        assert decode_steps == list(range(0, 30, 2)) and prefill_steps == 15  # (the admission step prefilled)


def test_a_prompt_alone_takes_the_whole_budget_and_is_capped_while_others_wait():
    sched = _scheduler(True)
    long = _seq(1, 10 * BUDGET)
    sched.add(long)
    batch = sched.schedule()
    assert batch.num_tokens == [BUDGET]  # alone: the fastest prefill
    _run(sched, batch)
    short = _seq(2, 8)
    sched.add(short)
    batch = sched.schedule()
    assert batch.seqs == [long, short] and batch.num_tokens == [BUDGET // 4, 8]  # capped at the threshold


def test_two_long_prompts_share_the_prefill_and_a_short_one_behind_them_starts_at_the_next_step():
    sched = _scheduler(True, long_prefill_token_threshold=256, max_long_partial_prefills=2)
    a, b = _seq(1, 8 * BUDGET), _seq(2, 8 * BUDGET)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_tokens == [256, 256]
    _run(sched, batch)
    short = _seq(3, 100)
    sched.add(short)
    batch = sched.schedule()
    assert batch.seqs == [a, b, short] and batch.num_tokens == [256, 256, 100]
    _run(sched, batch)
    batch = sched.schedule()  # the short one decodes beside the two long prefills
    assert batch.num_decodes == 1 and batch.seqs == [short, a, b] and batch.num_tokens == [1, 256, 256]


def test_a_third_long_prompt_waits_for_a_long_place_and_shorter_ones_pass_it():
    sched = _scheduler(False, long_prefill_token_threshold=128, max_long_partial_prefills=2)
    longs = [_seq(i, 4 * BUDGET) for i in range(3)]
    short = _seq(9, 64)
    for s in longs + [short]:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [longs[0], longs[1], short] and batch.num_tokens == [128, 128, 64]
    assert list(sched.waiting) == [longs[2]]
    _run(sched, batch)
    for _ in range(200):  # the third starts once one of the first two has no more than the threshold left
        left = [s.num_uncomputed for s in longs[:2] if s.is_prefilling]
        batch = sched.schedule()
        if longs[2] in batch.seqs:
            assert sum(n > 128 for n in left) < 2
            break
        _run(sched, batch)
    else:
        raise AssertionError("the third long prompt never started")


def test_partial_prefills_are_bounded():
    sched = _scheduler(True, long_prefill_token_threshold=64, max_num_partial_prefills=2, max_long_partial_prefills=2)
    for i in range(4):
        sched.add(_seq(i, 1000))
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == [0, 1] and len(sched.waiting) == 2


def test_config_checks_the_new_limits():
    with pytest.raises(ValueError, match="max_long_partial_prefills .* must be at most"):
        EngineConfig(model="x", max_num_partial_prefills=1, max_long_partial_prefills=2)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be a positive integer"):
        EngineConfig(model="x", long_prefill_token_threshold=0)


# ---- mixed steps == separate steps, bit for bit, through the engine ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)
    return path


def _logits_by_token(tiny, mixed: bool, attention: str = "dense", config: str | None = None) -> tuple[dict, int]:
    """Greedy runs where a 300-token prompt arrives while two short requests decode; every sampled row's logits, by
    (request, output position). Returns them and the number of mixed steps."""
    eng = LLMEngine(EngineConfig(model=tiny, device="cpu", dtype="float32", kv_cache_memory_gb=0.01,
                                 max_num_batched_tokens=64, attention=attention, attention_config=config))
    assert eng.scheduler.mixed  # every backend below declares mixed_batches
    eng.scheduler.mixed = mixed
    seen, n_mixed = {}, 0
    sample = eng.sampler.sample

    def recording(logits, seqs):
        for row, seq in zip(logits, seqs):
            seen[(seq.request_id, len(seq.output_token_ids))] = row.clone()
        return sample(logits, seqs)

    eng.sampler.sample = recording
    execute = eng.runner.execute

    def counting(batch, **kw):
        nonlocal n_mixed
        n_mixed += batch.mixed
        return execute(batch, **kw)

    eng.runner.execute = counting
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (20, 33, 300)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eng.add_request("a", prompts[0], params)
    eng.add_request("b", prompts[1], params)
    for step in range(80):
        if step == 2:
            eng.add_request("long", prompts[2], params)
        eng.step()
        if step > 2 and not eng.has_unfinished_requests():
            break
    return seen, n_mixed


# small budgets, so that every sparse method prunes the tiny model's contexts (as tests/test_sparse.py's SMALL)
SPARSE = {
    "dense": None,
    "infinitehip-box": '{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [64, 32, 8], '
                       '"early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], "dense_below": 0, '
                       '"exact_below": 8, "stage0_scores": "minmax"}',
    "infinitehip": '{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [128, 32, 8], '
                   '"early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], "dense_below": 0}',
    "hip": '{"n_sink": 8, "n_window": 16, "block_q": 8, "budget": 16, "dense_layers": [0], "dense_below": 0, '
           '"refresh": 2}',
    "quest": '{"n_sink": 8, "n_window": 16, "block_q": 8, "page_size": 4, "budget": 16, "dense_below": 0}',
    # a Quest page of one KV page: page boxes kept by page id (attention/box_store.py), built by each part of a step
    "quest-paged": '{"n_sink": 8, "n_window": 16, "block_q": 8, "page_size": 16, "budget": 32, "dense_below": 0}',
    "streaming": '{"n_sink": 8, "n_window": 24, "block_q": 8, "dense_below": 0}',
    "psa": '{"n_sink": 8, "n_window": 8, "microbatch": 1, "epsilon": 0.8}',
}


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_mixed_steps_give_the_tokens_and_logits_of_separate_steps(tiny, name):
    """Every sampled row's logits agree to fp32 rounding and every greedy token is equal. Not bit for bit: the
    projections' and MLP's matrix products round differently for a different number of rows (the same holds for
    any two requests batched together); the attention of each part runs alone with its own metadata."""
    method = name.split("-")[0]
    mixed, n = _logits_by_token(tiny, True, method, SPARSE[name])
    separate, _ = _logits_by_token(tiny, False, method, SPARSE[name])
    assert n > 0, "no mixed step ran: the test does not test mixing"
    assert mixed.keys() == separate.keys() and len(mixed) == 36
    worst = max((mixed[k] - separate[k]).abs().max().item() for k in mixed)
    assert worst < 1e-4, f"mixed steps moved a logit by {worst}"
    assert all(mixed[k].argmax() == separate[k].argmax() for k in mixed)


# ---- pacing: chunks sized by measured step time while others decode (engine/pacing.py) ----------------------------
def _long_chunk(batch, long) -> int:
    return dict(zip((s.seq_id for s in batch.seqs), batch.num_tokens)).get(long.seq_id, 0)


@pytest.mark.parametrize("mixed", [True, False])
def test_pacing_halves_a_slow_chunk_and_grows_a_fast_one_back(mixed):
    """A step over the target halves the long prompt's next chunk (powers of two, never under 256); a step under
    half the target doubles it back up to the long-prefill threshold. A cost model of the step: 10 ms plus 20 us a
    prompt token, target 20 ms, so the controller should settle at 256-512 tokens (15-20 ms)."""
    sched = _scheduler(mixed, mixed_step_target_s=0.020, long_prefill_token_threshold=1000)
    _decoding(sched, 2)
    long = _seq(1, 40 * BUDGET)
    sched.add(long)
    chunks = []
    for _ in range(40):
        batch = sched.schedule()
        n = _long_chunk(batch, long)
        if n:
            chunks.append(n)
        _run(sched, batch)
        sched.observe(0.010 + 20e-6 * n)
    assert chunks[0] == 512  # the threshold's power of two below
    assert all(c & (c - 1) == 0 and 256 <= c <= 512 for c in chunks)
    assert chunks[1] == 256  # 512 tokens: 20.2 ms > 20 ms
    assert 512 not in chunks[2:] or chunks.count(256) > 1  # never stuck at the slow size


def test_pacing_grows_to_the_threshold_when_steps_are_fast():
    sched = _scheduler(True, mixed_step_target_s=0.050, long_prefill_token_threshold=512)
    _decoding(sched, 2)
    long = _seq(1, 40 * BUDGET)
    sched.add(long)
    b = sched.schedule()
    assert _long_chunk(b, long) == 512
    _run(sched, b); sched.observe(0.2)  # noqa: E702 -- one slow step (a capture, say)
    b = sched.schedule()
    assert _long_chunk(b, long) == 256
    seen = []
    for _ in range(4):
        _run(sched, b); sched.observe(0.005)  # noqa: E702
        b = sched.schedule()
        seen.append(_long_chunk(b, long))
    assert seen == [512] * 4  # back to the threshold at once, and no further


def test_pacing_leaves_a_prompt_alone_at_the_full_budget_and_forgets_finished_ones():
    sched = _scheduler(True, mixed_step_target_s=0.001)
    long = _seq(1, 4 * BUDGET)
    sched.add(long)
    batch = sched.schedule()
    assert batch.num_tokens == [BUDGET] and not sched.step_paced  # nobody decodes: not paced, not timed
    sched.observe(1.0)
    _run(sched, batch)
    assert sched.pacer.cap(long.seq_id) == sched.pacer.max_chunk  # the unpaced step taught it nothing
    decoders = _decoding(sched, 1)
    batch = sched.schedule()
    assert sched.step_paced and _long_chunk(batch, long) > 0
    _run(sched, batch)
    sched.observe(1.0)
    assert sched.pacer.cap(long.seq_id) == 256
    for seq in [long, *decoders]:
        seq.status = seq.status.FINISHED
        sched.finish(seq)
    assert sched.pacer._cap == {}


def test_pacing_spreads_a_wave_of_new_prompts_over_steps():
    """Requests admitted while others decode share one cap (engine/pacing.py ADMISSIONS): twelve 200-token prompts
    arriving together take the threshold's tokens per step, not the whole budget, and a slow step halves that share
    (the 1M serving run: a step admitting 15 chats beside 35 decode rows took ~130 ms)."""
    sched = _scheduler(True, mixed_step_target_s=0.040, long_prefill_token_threshold=512)
    _decoding(sched, 4)
    wave = [_seq(10 + i, 200) for i in range(12)]
    for seq in wave:
        sched.add(seq)
    ids = {s.seq_id for s in wave}
    admitted = []
    for cost in (0.030, 0.100, 0.030, 0.030):
        batch = sched.schedule()
        assert batch.num_decodes >= 4  # the decodes ride along every step
        admitted.append(sum(n for s, n in zip(batch.seqs, batch.num_tokens) if s.seq_id in ids and s.num_computed == 0))
        _run(sched, batch)
        sched.observe(cost)
    assert admitted[:2] == [512, 512]  # the threshold's share, not the 1,024-token budget
    assert admitted[2] == 256  # after the 100 ms step: halved
    assert admitted[3] == 256  # 30 ms is not under half the target: it stays


def test_pacing_admits_at_the_full_budget_when_nobody_decodes():
    sched = _scheduler(True, mixed_step_target_s=0.001, long_prefill_token_threshold=256)
    for i in range(8):
        sched.add(_seq(i, 200))
    batch = sched.schedule()
    assert sum(batch.num_tokens) == BUDGET and not sched.step_paced


def test_mixed_step_target_is_validated():
    with pytest.raises(ValueError, match="mixed_step_target_ms must be a positive number"):
        EngineConfig(mixed_step_target_ms=0)
    with pytest.raises(ValueError, match="mixed_step_target_ms"):
        EngineConfig(mixed_step_target_ms="fast")
    assert EngineConfig(mixed_step_target_ms=40).mixed_step_target_ms == 40


def test_chunk_sizes_name_every_paced_size_for_the_warm_up():
    assert _scheduler(True).chunk_sizes() == [BUDGET, BUDGET // 4]
    paced = _scheduler(True, mixed_step_target_s=0.04, long_prefill_token_threshold=1000)
    assert paced.chunk_sizes() == [BUDGET, 1000, 512, 256]


@pytest.mark.parametrize("mixed", [True, False])
def test_pacing_never_caps_a_chunk_below_one_aligned_stride(mixed):
    """A bounded cache's prompt advances by whole strides (chunk_align, cascading's 1,024): slow steps halve its cap
    down to one stride, never below it, so it keeps advancing while others decode."""
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=64, max_num_batched_tokens=4096, mixed=mixed,
                      chunk_align=1024, mixed_step_target_s=0.001)
    _decoding(sched, 2)
    long = _seq(1, 16 * 1024)
    sched.add(long)
    chunks = []
    for _ in range(40):
        prefilling = long.is_prefilling
        batch = sched.schedule()
        if prefilling:
            chunks.append(_long_chunk(batch, long))
        _run(sched, batch)
        sched.observe(1.0)  # every step far over the target
    assert not long.is_prefilling  # its whole prompt went through
    assert chunks and all(c % 1024 == 0 for c in chunks) and 1024 in chunks


def test_the_server_warm_up_runs_a_mixed_step_and_freezes_the_heap(tiny, caplog):
    """The server's warm-up (server/app.py) runs a short request decoding beside a long one's chunks, so the mixed
    step's kernels compile before the server listens; then the loaded engine's objects leave garbage collection."""
    import gc

    from longreach.server.app import freeze_heap, warm_up
    eng = LLMEngine(EngineConfig(model=tiny, device="cpu", dtype="float32", kv_cache_memory_gb=0.01,
                                 max_num_batched_tokens=512))
    mixed, alone = [], []
    step = eng.step

    def counted():
        out = step()
        if eng.last_step.is_prefill:
            (mixed if eng.last_step.num_decode_tokens > 0 else alone).append(
                (eng.last_step.num_decode_tokens, eng.last_step.num_tokens - eng.last_step.num_decode_tokens))
        return out
    eng.step = counted
    warm_up(eng, 1000)  # a CPU skips it unless asked (tokens None)
    # mixed steps of one decode row and of 16 and fewer (Triton's integer specialisations: 1, 16, the rest)
    rows = {n for n, _ in mixed}
    assert {1, 16} <= rows and any(n not in (1, 16) for n in rows), mixed
    # and the long request alone, in chunks up to the whole budget (its 504 tokens: max_model_len 512 - 8), larger than
    # a mixed step's, whose chunk is at most the threshold (128 here)
    assert (0, 504) in alone and max(t for _, t in mixed) <= 128, (alone, mixed)
    assert not eng.has_unfinished_requests()
    try:
        with caplog.at_level("INFO", logger="longreach"):
            freeze_heap()
        assert gc.get_freeze_count() > 1000
        assert "frozen out of garbage collection" in caplog.text
    finally:
        gc.unfreeze()


def test_the_default_warm_up_prefills_a_whole_chunk_past_the_dense_limit(tiny):
    """On a GPU the warm-up request goes one chunk + 1024 tokens past the longest context a sparse method attends
    densely at (its dense_below), so that a full-size chunk runs the method's own kernels
    before the first client (run 8 compiled them while serving); dense has no such limit; a CPU warms nothing up."""
    import types

    from longreach.server.app import default_warmup_tokens

    def engine(**kw):
        eng = LLMEngine(EngineConfig(model=tiny, device="cpu", dtype="float32", kv_cache_memory_gb=0.01,
                                     max_num_batched_tokens=256, max_model_len=4096, **kw))
        assert default_warmup_tokens(eng) == 0  # on the CPU
        return types.SimpleNamespace(device=torch.device("cuda"), config=eng.config, backend=eng.backend,
                                     warmup_prompt_tokens=eng.warmup_prompt_tokens)

    assert default_warmup_tokens(engine()) == 256 + 1024
    ihip = engine(attention="infinitehip")  # dense_below "trained": the larger of the trained 512 and the budget
    limit = max(ihip.backend.dense_below(layer) for layer in ihip.backend.fallback.sparse_layers())
    assert limit >= 512 and ihip.backend.warm_context() == limit
    assert default_warmup_tokens(ihip) == limit + 256 + 1024
    pruned = engine(attention="infinitehip", attention_config='{"dense_below": 0}')
    assert pruned.backend.warm_context() == 0
    composed = engine(attention="dense", decode_attention="infinitehip")
    assert composed.backend.warm_context() == limit  # the decode method's
    # bench decode warms up with the same length, at most half the measured context (or what --warmup-tokens asks)
    from longreach.tools.bench.decode_steps import _warmup_len
    assert _warmup_len(1 << 20, ihip, None) == limit + 256 + 1024
    assert _warmup_len(2048, ihip, None) == 1024 and _warmup_len(2048, ihip, 4096) == 2048
