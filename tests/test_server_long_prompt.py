"""A long prompt does not freeze the server (issue 30): while it is being prefilled, chunk by chunk, short chats are
admitted, decoded and answered. A real `longreach serve` (SmolLM2 on the CPU, small prefill chunks)."""
from __future__ import annotations

import threading
import time

import pytest

from server_harness import SMOLLM2_ARGS, RemoteServer, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    # 32 tokens a step: a 1,600-token prompt needs 50 steps alone, 200 while others run (its chunks capped at 8)
    srv = RemoteServer(SMOLLM2_ARGS + ["--max-num-batched-tokens", "32", "--warmup-tokens", "16"])
    yield srv
    srv.stop()


def test_short_chats_finish_while_a_long_prompt_is_prefilled(server):
    client = server.client()
    long_prompt = " ".join(f"item {i} is the number {i * 7 % 101}." for i in range(140))  # ~1,600 tokens
    long_first_token = {}

    def long_request():
        t0 = time.perf_counter()
        stream = client.completions.create(model="smollm2", prompt=long_prompt, max_tokens=2, temperature=0,
                                           stream=True)
        for _ in stream:
            long_first_token.setdefault("t", time.perf_counter())
        long_first_token["total"] = time.perf_counter() - t0

    thread = threading.Thread(target=long_request)
    thread.start()
    with server.http() as http:  # the long prompt is in its prefill now
        assert wait_until(lambda: http.get("/server_info").json()["running"] == 1, timeout=60)
    shorts = []

    def short_request(i):
        t0 = time.perf_counter()
        out = client.completions.create(model="smollm2", prompt=f"Count: {i}, {i + 1},", max_tokens=4,
                                        temperature=0)
        shorts.append((time.perf_counter(), time.perf_counter() - t0, out.usage.completion_tokens))

    threads = [threading.Thread(target=short_request, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads + [thread]:
        t.join(300)
    assert "t" in long_first_token, "the long request never produced a token"
    done_before = [t for t, _, _ in shorts if t < long_first_token["t"]]
    assert all(n == 4 for _, _, n in shorts)
    # every short chat was answered in full (4 tokens each) before the long prompt's prefill ended
    relative = [round(t - long_first_token["t"], 2) for t, _, _ in shorts]
    assert len(done_before) == 3, (f"short chats finished at {relative} s relative to the long prompt's first token; "
                                   f"latencies {[round(s, 2) for _, s, _ in shorts]} s")
