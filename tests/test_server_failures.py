"""`longreach serve` when things fail (issue 30, items 3 and 4), against a real server with faults injected by prompt
(serve_with_faults.py: NaN logits, a forward that raises, an engine that breaks for good) and a trace of its forward
passes. One server (SmolLM2, CPU): max_model_len 512, 64-token prefill chunks. The test that kills the engine runs
last and ends the server.

Covers: one failing request leaves its concurrent neighbours' tokens as in a clean run and gets OpenAI's error
(streaming: an error event then [DONE]); a chat without max_tokens runs to the end of the context; a long logprobs
request is scored between steps, so a chat arriving meanwhile waits for at most the chunk in flight; a client leaving
mid-prefill stops its prefill at the next chunk; a dead engine fails what is in flight and the process exits 1.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import time

import httpx
import pytest
from server_harness import SMOLLM2_ARGS, RemoteServer, wait_until
from serve_with_faults import KILL, NAN, OK, RAISE, marked

MAX_LEN = 512
TESTS = pathlib.Path(__file__).resolve().parent
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("trace") / "forwards.jsonl"


@pytest.fixture(scope="module")
def server(trace):
    args = [{"2048": str(MAX_LEN), "0.5": "0.1"}.get(a, a) for a in SMOLLM2_ARGS]
    srv = RemoteServer(args + ["--max-num-batched-tokens", "64", "--keep-alive-interval", "0.2"],
                       module="serve_with_faults",
                       env={"PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
                            "LONGREACH_TEST_TRACE": str(trace)})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


def _records(trace: pathlib.Path) -> list[dict]:
    """The trace's complete lines: the server may be half-way through writing the last one (CI saw that)."""
    if not trace.exists():
        return []
    *complete, _partial = trace.read_text().split("\n")
    return [json.loads(line) for line in complete]


def _forwards(trace, head: list[int] | None = None, score: bool | None = None) -> list[dict]:
    """The traced forward passes, those with a sequence whose prompt starts with `head` / of scoring or not."""
    out = [r for r in _records(trace) if "start" in r]
    if head is not None:
        out = [r for r in out if any(s[1][:len(head)] == head for s in r["seqs"])]
    if score is not None:
        out = [r for r in out if r["score"] is score]
    return out


def _idle(http) -> bool:
    info = http.get("/server_info").json()
    return info["running"] == 0 and info["waiting"] == 0 and info["kv_cache"]["gpu_pages_used"] == 0


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _sse(r: httpx.Response) -> list:
    """The data events of an SSE response: dicts, and "[DONE]"."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in r.iter_lines() if line.startswith("data: ")]


def _greedy(server, prompt, stream: bool) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        if not stream:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = _sse(r)
        assert events[-1] == "[DONE]"
        return [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]


# ---- failure isolation -------------------------------------------------------------------------------------------
def test_a_failing_request_leaves_the_others_unchanged(server, http):
    """Four greedy requests (two streaming) run beside a NaN one, a raising one (streaming) and another NaN one
    that fails mid-stream after 3 tokens: the four get exactly their tokens of a clean run, the three their errors."""
    jobs = [(p, i % 2 == 1) for i, p in enumerate(PROMPTS)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clean = list(pool.map(lambda job: _greedy(server, *job), jobs))
    before = http.get("/metrics").text

    def bad_plain():
        return http.post("/v1/completions", json={"prompt": marked(NAN, 0, 1, 40), "max_tokens": 8})

    def bad_stream(code, after):
        with httpx.Client(base_url=server.url, timeout=120) as c, \
                c.stream("POST", "/v1/completions", json={"prompt": marked(code, after, 2, 90), "max_tokens": 8,
                                                          "ignore_eos": True, "stream": True}) as r:
            return r.status_code, _sse(r)

    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        good = [pool.submit(_greedy, server, *job) for job in jobs]
        plain, raised, mid = pool.submit(bad_plain), pool.submit(bad_stream, RAISE, 0), pool.submit(bad_stream, NAN, 3)
        assert [f.result() for f in good] == clean
        r = plain.result()
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_error" and "NaN" in err["message"] and "unaffected" in err["message"]
    status, events = raised.result()
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
    assert "forward pass raised RuntimeError: injected kernel error" in events[-2]["error"]["message"]
    status, events = mid.result()
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-2]) >= 1  # it had streamed tokens before
    assert wait_until(lambda: _idle(http), timeout=20)  # the failed ones' pages are back
    after = http.get("/metrics").text
    name = "longreach:request_failure_total"
    assert _metric(after, name, reason="non_finite_logits") - _metric(before, name, reason="non_finite_logits") == 2
    assert _metric(after, name, reason="forward_error") - _metric(before, name, reason="forward_error") == 1
    assert http.get("/health").status_code == 200


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(http):
    """No max_tokens in a chat: the bound is max_model_len minus the prompt (vLLM's), so it ends with "length"."""
    def messages(k):
        return [{"role": "user", "content": "Count: " + " one" * k}]
    k = 480
    for _ in range(3):  # aim at a prompt of MAX_LEN - 6 tokens
        count = http.post("/tokenize", json={"messages": messages(k)}).json()["count"]
        k += MAX_LEN - 6 - count
    r = http.post("/v1/chat/completions", json={"messages": messages(k), "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_LEN and usage["completion_tokens"] <= 12
    assert r.json()["choices"][0]["finish_reason"] == "length"


# ---- logprobs scoring and admission ------------------------------------------------------------------------------
def test_logprobs_scoring_does_not_hold_up_a_new_request(server, http, trace):
    """A 480-token echo + logprobs request is scored in eight 64-token chunks after it finished; a chat sent while
    that runs gets its prefill step after at most the chunk in flight when it reached the engine loop (before: after
    all of them), and scoring goes on after it."""
    body = {"prompt": marked(OK, 0, 3, 480), "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scored = pool.submit(http.post, "/v1/completions", json=body)
        assert wait_until(lambda: len(_forwards(trace, score=True)) >= 2, timeout=30, interval=0.02)
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 1, "temperature": 0})
        r = scored.result()
    assert chat.status_code == 200 and r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 481 and lp["token_logprobs"][0] is None
    records = _records(trace)
    arrived = [r["submit"] for r in records if "submit" in r][-1]  # the chat's
    mine = [f for f in _forwards(trace) if any(s[0] != "score" and s[1][:2] != [48000, 48001] for s in f["seqs"])]
    chat_start = min(f["start"] for f in mine if f["start"] > arrived)
    chunks = _forwards(trace, score=True)
    assert len([c for c in chunks if c["end"] > arrived and c["start"] < chat_start]) <= 1  # the one in flight
    assert [c for c in chunks if c["start"] > chat_start]  # scoring was not done: the chat went between its chunks
    assert wait_until(lambda: _idle(http), timeout=20)


# ---- cancellation ------------------------------------------------------------------------------------------------
def test_disconnect_mid_prefill_stops_the_prefill_at_the_next_chunk(server, http, trace):
    """A 480-token prompt prefills in eight 64-token chunks; the client leaves after the second: within a chunk or
    two its prefill stops (the abort reaches the engine between two steps), and its pages come back."""
    prompt = marked(OK, 0, 4, 480)
    head = prompt[:5]
    with httpx.Client(base_url=server.url, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line) == ": keep-alive"
        assert wait_until(lambda: len(_forwards(trace, head)) >= 2, timeout=30, interval=0.01)
        left = time.time()
    assert wait_until(lambda: _idle(http), timeout=20), http.get("/server_info").json()
    mine = _forwards(trace, head)
    assert len(mine) < 8  # it never finished its prefill
    assert len([f for f in mine if f["start"] > left]) <= 2, mine


# ---- a dead engine (last: it ends the server) --------------------------------------------------------------------
def test_a_dead_engine_fails_what_is_in_flight_and_the_process_exits_1(server, http):
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # streaming
        killed = http.post("/v1/completions", json={"prompt": marked(KILL, 0, 5, 20), "max_tokens": 4})
        rest = [line for line in lines if line.startswith("data: ")]
    assert killed.status_code == 500 and killed.json()["error"]["code"] == "engine_dead", killed.text
    assert "illegal memory access" in killed.json()["error"]["message"]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "engine_dead"
    assert server.proc.wait(30) == 1, server.log_text()
    log = server.log_text()
    assert "the engine loop stopped on an unexpected error" in log and "exiting with status 1" in log
