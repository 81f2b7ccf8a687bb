"""`longreach serve` on bad input: every bad request body, route and method as an OpenAI-shaped 4xx (raw HTTP and the
official openai client), and a hypothesis fuzz of the POST endpoints that never gets a 5xx.

The server (SmolLM2, CPU, in a subprocess) and the HTTP clients are tests/test_server.py's module fixtures: this module
starts a server of its own with the same arguments.
"""
from __future__ import annotations

import json

import openai
import pytest
import test_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import wait_until
from test_server import MODEL, _server_idle, assert_openai_error

server, client, http = test_server.server, test_server.client, test_server.http  # module fixtures, one set per module


# ---- bad input -------------------------------------------------------------------------------------------------------
BAD = [
    # (path, body (dict, or bytes sent as is), status, param, code)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None, "invalid_json"),
    ("/v1/completions", b"", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "invalid_encoding"),
    ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}', 400, "prompt[0]", "invalid_encoding"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "n": True}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate", None),
    ("/v1/completions", {"prompt": 42}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [7] * 2048}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [1, 10 ** 6]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", 3]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, None, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0]", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000}, 400,
     "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model",
     "model_not_found"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, "text", None),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, 400, "sampling_params.max_new_tokens",
     None),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokenz": 2}}, 400, "sampling_params.max_new_tokenz",
     None),
    ("/generate", {"text": "hi", "sampling_params": [{}, {}]}, 400, "sampling_params", None),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt", None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", None),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", None),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD,
                         ids=[f"{p}:{i}" for i, (p, *_rest) in enumerate(BAD)])
def test_bad_input_is_an_openai_shaped_4xx(http, path, body, status, param, code):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    assert_openai_error(http.post(path, **kw), status, param, code)


def test_bad_routes_and_methods_and_openai_client_errors(http, client):
    assert_openai_error(http.get("/v1/nope"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 3000}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=7)


# ---- fuzz ------------------------------------------------------------------------------------------------------------
BASES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}
FIELDS = ["prompt", "messages", "max_tokens", "n", "temperature", "top_p", "top_k", "stop", "stream", "echo",
          "logprobs", "top_logprobs", "seed", "stream_options", "min_tokens", "stop_token_ids", "ignore_eos", "model",
          "text", "input_ids", "sampling_params", "tokens", "add_special_tokens", "return_token_ids", "best_of",
          "max_completion_tokens", "min_p", "chat_template_kwargs", "add_generation_prompt", "rid"]
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10)


def _cheap(body):
    """Keep valid requests cheap: at most a few tokens and samples each (invalid values are left alone)."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens", "n", "best_of"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 3 < v <= 4096:
            body[key] = 2
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2
    sp = body.get("sampling_params")
    for d in sp if isinstance(sp, list) else [sp]:
        if isinstance(d, dict):
            v = d.get("max_new_tokens")
            if v is None or (isinstance(v, int) and 3 < v <= 4096):
                d["max_new_tokens"] = 2
            if isinstance(d.get("n"), int) and d["n"] > 3:
                d["n"] = 2
    if "text" in body and sp is None:
        body["sampling_params"] = {"max_new_tokens": 2}
    return body


@st.composite
def garbled(draw, path):
    kind = draw(st.sampled_from(["set", "set", "drop", "replace", "bytes", "truncate"]))
    body = json.loads(json.dumps(BASES[path]))
    if kind == "set":
        for _ in range(draw(st.integers(1, 3))):
            body[draw(st.sampled_from(FIELDS) | st.text(max_size=6))] = draw(_json)
    elif kind == "drop":
        body.pop(draw(st.sampled_from(sorted(body))))
    elif kind == "replace":
        body = draw(_json)
    elif kind == "bytes":
        return draw(st.binary(max_size=64))
    raw = json.dumps(_cheap(body)).encode()
    if kind == "truncate":
        raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
    return raw


@pytest.mark.parametrize("path", list(BASES))
def test_fuzzed_bodies_never_give_5xx(server, http, path):
    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(garbled(path))
    def check(raw):
        with http.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
            r.read()
            assert r.status_code < 500, (raw, r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert http.get("/health").status_code == 200
    assert server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    assert wait_until(lambda: _server_idle(http), timeout=20)
