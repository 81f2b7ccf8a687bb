"""`longreach serve` under limits and faults: API key, a full queue, KV exhaustion, a disconnect mid-prefill, the
request-size limit and SIGTERM draining. One server with tight limits: two running sequences, one waiting request, a KV
cache of exactly max_model_len (1024 tokens, 64 pages), 64-token prefill chunks, a 64 KiB body limit, and the API key
from $LONGREACH_API_KEY. The SIGTERM test runs last and stops it.
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import time

import httpx
import openai
import pytest
from server_harness import SMOLLM2_ARGS, RemoteServer, wait_until

KEY = "sk-test-secret"


@pytest.fixture(scope="module")
def server():
    # max_model_len 1024 and a KV cache of 64 pages of 16 tokens (737,280 bytes each in fp32)
    args = [{"2048": "1024", "0.5": "0.044"}.get(a, a) for a in SMOLLM2_ARGS]
    srv = RemoteServer(args + ["--max-num-seqs", "2", "--max-queued-requests", "1", "--max-request-bytes", "65536",
                               "--max-num-batched-tokens", "64", "--keep-alive-interval", "0.2",
                               "--warmup-tokens", "100"],
                       api_key=KEY, env={"LONGREACH_API_KEY": KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


def _info(http) -> dict:
    return http.get("/server_info").json()


def _idle(http) -> bool:
    info = _info(http)
    return info["running"] == 0 and info["waiting"] == 0 and info["kv_cache"]["gpu_pages_used"] == 0


def test_warmup_ran_before_listening_and_left_nothing_behind(server, http):
    """--warmup-tokens 100 with 64-token chunks: a first chunk and one with a prefix ran before /health answered;
    the warm-up request is gone (no running or waiting request, every page free) and counts in no metric."""
    log = server.log_text()
    assert "warm-up: a request of 100 prompt tokens alone and beside short ones" in log
    assert log.index("warm-up:") < log.index("listening on")
    assert _idle(http)
    assert re.search(r"^longreach:prompt_tokens_total\S* 0\.0$", http.get("/metrics").text, re.M)


def test_api_key(server, http):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for path in ("/health", "/metrics", "/version"):
            assert anon.get(path).status_code == 200, path
        r = anon.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        bad = anon.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["message"] == "incorrect API key"
        assert anon.put("/generate", json={"text": "hi"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    out = server.client().completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_kv_cache_info(http):
    assert _info(http)["kv_cache"]["gpu_pages_total"] == 64


def test_full_queue_gives_503_with_retry_after(server, http):
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as a, \
            httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as b, \
            httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c, \
            a.stream("POST", "/v1/completions", json=body) as first, \
            b.stream("POST", "/v1/completions", json=body) as second:
        streams = [first.iter_lines(), second.iter_lines()]  # kept: a dropped iterator closes its connection
        for lines in streams:  # both run (--max-num-seqs 2)
            assert next(line for line in lines if line.startswith("data: {"))
        with c.stream("POST", "/v1/completions", json=body) as waiting:
            assert waiting.status_code == 200  # accepted; waits for a running slot
            assert wait_until(lambda: _info(http)["waiting"] == 1, timeout=20)
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.InternalServerError, match="overloaded"):
                server.client().completions.create(model="smollm2", prompt="hi", max_tokens=1)
    assert wait_until(lambda: _idle(http), timeout=30), _info(http)  # all disconnected: aborted, pages back
    assert 'reason="queue_full"' in http.get("/metrics").text


def test_kv_exhaustion_preempts_and_every_request_completes(server, http):
    """Two 490-token prompts take 62 of the 64 pages; decoding runs out of pages after ~22 tokens each, so the later
    one is preempted (pages freed, recomputed once the other is done) and both still finish with all their tokens."""
    def preemptions():
        text = http.get("/metrics").text
        return float(re.search(r"^longreach:num_preemptions_total\{[^}]*\} (\S+)$", text, re.MULTILINE).group(1))

    before = preemptions()
    body = {"max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}
    client = server.client()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda k: client.completions.create(
            model="smollm2", prompt=[300 + (i * 7 + k) % 1000 for i in range(490)], **body), range(2)))
    assert [o.usage.completion_tokens for o in outs] == [40, 40]
    assert [o.choices[0].finish_reason for o in outs] == ["length", "length"]
    assert preemptions() > before
    assert wait_until(lambda: _idle(http), timeout=20)


def test_disconnect_during_prefill_frees_pages(server, http):
    """A 1,000-token prompt prefills in 16 chunks of 64 tokens: leave while it does."""
    body = {"prompt": [300 + i % 1000 for i in range(1000)], "max_tokens": 5, "stream": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line) == ": keep-alive"  # prefilling, no token yet
        assert wait_until(lambda: _info(http)["kv_cache"]["gpu_pages_used"] > 0, timeout=20)  # holds pages
        assert next(line for line in lines if line) == ": keep-alive"  # still prefilling
    assert wait_until(lambda: _idle(http), timeout=30), _info(http)
    metrics = http.get("/metrics").text
    assert 'longreach:request_success_total{finished_reason="abort",model_name="smollm2"}' in metrics
    out = server.client().completions.create(model="smollm2", prompt="Hi", max_tokens=2)  # still serving
    assert out.usage.completion_tokens == 2


def test_body_over_the_limit_is_413(server, http):
    big = {"prompt": "x" * 70000, "max_tokens": 1}
    r = http.post("/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(8):
            yield b" " * 10000

    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert http.post("/v1/completions", json={"prompt": "x" * 60000, "max_tokens": 1}).status_code != 413


def test_sigterm_drains_in_flight_streams_then_exits_0(server):
    """Last in this module: it stops the server."""
    body = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    tokens, done = [], False
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if not tokens:
                    server.proc.send_signal(signal.SIGTERM)
                tokens += json.loads(line[6:])["choices"][0]["token_ids"]
            done |= line == "data: [DONE]"
    assert done and len(tokens) == 16
    t0 = time.monotonic()
    assert server.proc.wait(60) == 0, server.log_text()
    assert time.monotonic() - t0 < 60
    assert "Application shutdown complete" in server.log_text()
