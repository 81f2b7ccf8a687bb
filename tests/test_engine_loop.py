"""The server's engine loop dying, without a model: a fake engine whose `step` raises. The loop fails the requests in
flight (500 `engine_dead` with the reason for those the engine had, 503 for one still in the inbox), refuses new ones
(503), `/health` answers 503 with the reason, `on_dead` fires (app.serve points it at uvicorn's should_exit) and the
exit status is 1. And the scoring queue's admission rules (a seat and pages for its pass), with a fake pass."""
from __future__ import annotations

import asyncio
import re
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from server_harness import wait_until

from longreach.sampling_params import SamplingParams
from longreach.server.app import build_app, exit_status, health_response, make_state
from longreach.server.config import ServerConfig
from longreach.server.engine_loop import PreparedPrompt, Submission
from longreach.server.validation import APIError


class FakeEngine:
    """What EngineLoop and /health touch. Requests never finish; `step` raises `broken` once it is set."""

    def __init__(self, max_num_seqs: int = 1):
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs, max_model_len=64, model="fake", attention="dense",
                                      preset=None)
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0)
        self.requests: dict[str, int] = {}
        self.broken: Exception | None = None
        self.last_step = None
        self.tokenizer = None
        self.stepped = threading.Event()
        self.on_break = lambda: None  # called on the engine thread just before `step` raises

    def kv_cache_stats(self) -> dict:
        return {"offload": False, "gpu_pages_total": 8, "gpu_pages_used": 0}

    def add_request(self, rid, token_ids, params, prompt=None) -> None:
        self.requests[rid] = params.n

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_workers(self) -> None:  # one process: no tensor-parallel workers to lose
        pass

    def num_unfinished_sequences(self) -> int:
        return sum(self.requests.values())

    def step(self):
        self.scheduler.running = [SimpleNamespace(request_id=r) for r in self.requests][:self.config.max_num_seqs]
        self.stepped.set()
        if self.broken is not None:
            self.on_break()
            raise self.broken
        time.sleep(0.001)
        return []

    def abort_request(self, rid) -> None:
        self.requests.pop(rid, None)

    def request_progress(self, rid):
        return [] if rid in self.requests else None


def _prompt() -> PreparedPrompt:
    return PreparedPrompt([1, 2, 3], None, SamplingParams(max_tokens=4))


def test_a_dead_loop_fails_in_flight_refuses_new_and_says_so():
    engine = FakeEngine(max_num_seqs=1)
    state = make_state(engine, ServerConfig())
    loop = state.loop
    dead = threading.Event()
    loop.on_dead = dead.set

    async def scenario():
        running, waiting, inbox = Submission(False), Submission(False), Submission(False)
        loop.submit(running, [_prompt()])
        assert await asyncio.to_thread(engine.stepped.wait, 5)
        loop.submit(waiting, [_prompt()])  # the fake runs one sequence: this one waits in the engine
        assert await asyncio.to_thread(wait_until, lambda: len(engine.requests) == 2, 5)
        engine.on_break = lambda: loop.submit(inbox, [_prompt()])  # arrives as the engine breaks: never reaches it
        engine.broken = RuntimeError("CUDA error: device-side assert triggered")
        assert await asyncio.to_thread(dead.wait, 5)
        return [await asyncio.wait_for(sub.queue.get(), 5) for sub in (running, waiting, inbox)]

    loop.start()
    first, second, third = asyncio.run(scenario())
    for upd in (first, second):  # both were in the engine: 500, with the reason
        assert upd.error.status == 500 and upd.error.code == "engine_dead"
        assert "device-side assert" in upd.error.message
    assert third.error.status == 503 and third.error.code == "engine_dead" and "retry" in third.error.message
    assert loop.dead == "RuntimeError: CUDA error: device-side assert triggered" and not loop.alive

    async def late():
        with pytest.raises(APIError) as e:
            loop.submit(Submission(False), [_prompt()])
        return e.value
    refused = asyncio.run(late())
    assert refused.status == 503 and refused.code == "engine_dead" and refused.headers["Retry-After"] == "5"
    r = health_response(loop)
    assert r.status_code == 503 and b"device-side assert" in r.body and b"engine_dead" in r.body
    assert exit_status(True, loop) == 1
    text = state.metrics.render().decode()
    assert 'longreach:request_failure_total{model_name="fake",reason="engine_dead"} 3.0' in text


def test_health_over_http_and_exit_status():
    engine = FakeEngine()
    state = make_state(engine, ServerConfig())
    with TestClient(build_app(state)) as client:
        assert client.get("/health").status_code == 200
        assert exit_status(True, state.loop) == 0
        engine.broken = RuntimeError("kernel launch failed")
        engine.requests["stuck"] = 1  # work for the loop: its next step raises
        state.loop.abort([])  # wake it
        assert engine.stepped.wait(5)
        state.loop._thread.join(5)
        r = client.get("/health")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_dead" and "kernel launch failed" in err["message"]
        assert "exits with status 1" in err["message"]
    assert exit_status(True, state.loop) == 1
    assert exit_status(False, make_state(FakeEngine(), ServerConfig()).loop) == 1


class FakePass:
    """A LogprobsPass of `chunks` chunks whose `reserve` answers what `pages` says."""

    def __init__(self, pages: dict, chunks: int = 2):
        self.pages, self.left, self.start, self.num_tokens = pages, chunks, 1, 10
        self.reserved = self.closed = False

    def reserve(self) -> bool:
        self.reserved = self.pages["free"]
        return self.reserved

    @property
    def done(self) -> bool:
        return self.left == 0

    def advance(self) -> None:
        assert self.reserved
        self.left -= 1

    def result(self):
        import torch
        return torch.zeros(9), torch.zeros(9, 0, dtype=torch.long), torch.zeros(9, 0)

    def close(self) -> None:
        self.closed = True


def test_scoring_queue_keeps_a_seat_and_waits_for_pages():
    from longreach.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from longreach.server.scoring_jobs import ScoringJob, ScoringQueue

    engine, pages = FakeEngine(max_num_seqs=3), {"free": False}
    passes = []
    engine.start_prompt_logprobs = lambda ids, num_top, start: passes.append(FakePass(pages)) or passes[-1]
    queue = ScoringQueue(engine)
    out = RequestOutput("r0", None, [1, 2, 3], [CompletionOutput(0, "", [4, 5], "length")], True,
                        RequestMetrics(0.0, None, None, None, 3, 2))
    assert queue.admits(3)  # no job: anything the engine takes
    queue.add(ScoringJob("r0", None, out, 0, 0))
    engine.requests = {"a": 1}
    assert queue.admits(1) and not queue.admits(2)  # a seat stays free for the pass: at most max_num_seqs - 1
    engine.requests = {"a": 1, "b": 1, "c": 1}
    assert queue.advance() is None and not passes[0].reserved  # no seat yet: it waits, taking nothing
    engine.requests = {"a": 1}
    assert queue.advance() is None and queue.short_of_pages  # a seat, but the pages are not free
    assert not queue.admits(1)  # so nothing new joins while the running requests drain
    pages["free"] = True
    assert queue.advance() is None and not queue.short_of_pages and queue.admits(1)  # first chunk
    job, error = queue.advance()  # second chunk: done
    assert error is None and len(job.scored) == 1 and job.scored[0].start == 1 and passes[0].closed
    assert not queue and queue.admits(3)
    pages["free"], engine.requests = False, {}
    queue.add(ScoringJob("r1", None, out, 0, 0))
    job, error = queue.advance()  # an idle engine and still no room: it can never fit
    assert isinstance(error, ValueError) and "cannot hold" in str(error) and not queue


def test_a_triton_compilation_inside_a_step_is_logged_with_the_step(caplog):
    """After the warm-up, a kernel that compiles inside a step stalls every stream: the loop names it (Triton's
    compile hooks, kernels/jit_watch.py) with the iteration's time and the step's rows, so the warm-up can be taught
    the shape."""
    knobs = pytest.importorskip("triton").knobs
    engine = FakeEngine()
    state = make_state(engine, ServerConfig())
    loop = state.loop

    def compiling_step(original=engine.step):
        hooks = knobs.runtime
        if hooks.jit_cache_hook is not None and not engine.requests.get("compiled"):
            hooks.jit_cache_hook(fn=None)
            time.sleep(0.01)
            hooks.jit_post_compile_hook(fn=SimpleNamespace(name="_bsa_kernel"))
            engine.requests["compiled"] = 0  # once
        engine.last_step = SimpleNamespace(num_tokens=260, num_decode_tokens=4, seconds=0.02)
        return original()

    engine.step = compiling_step
    async def scenario():
        loop.submit(Submission(False), [_prompt()])
        return await asyncio.to_thread(
            wait_until, lambda: any("Triton compiled" in r.getMessage() for r in caplog.records), 5)

    try:
        with caplog.at_level("WARNING", logger="longreach"):
            loop.start()
            assert asyncio.run(scenario())
    finally:
        loop.stop()
    line = next(r.getMessage() for r in caplog.records if "Triton compiled" in r.getMessage())
    assert re.match(r"Triton compiled 1 kernel\(s\) in \d+\.\d\d s inside a step \(the iteration took \d+\.\d ms "
                    r"with 4 decode rows and 256 prefill tokens\) while serving \(_bsa_kernel x1\)", line), line
    assert knobs.runtime.jit_cache_hook is None  # the hooks are put back when the loop ends
