"""From an HTTP body to a validated request, and the OpenAI-shaped error for everything that can go wrong on the way.

`read_json`: size limit (413, before reading when Content-Length says so), UTF-8, JSON, an object. `validate`: one of
protocol.py's strict pydantic models (no type coercion: "1" is not a number, true is not an integer), unknown fields
rejected the way OpenAI rejects them ("Unrecognized request argument supplied: foo"), fields OpenAI defines but
longreach does not implement rejected by name when set, a few informational ones (user, metadata, ...) dropped. Every
problem is an `APIError`, rendered as `{"error": {"message", "type", "param", "code"}}`; nothing here raises anything
else.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

# Fields the OpenAI API defines that change nothing here: accepted and dropped.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                     "safety_identifier"})
# Fields the OpenAI API defines that longreach does not implement: an error naming them when set (not null).
UNSUPPORTED = frozenset({"audio", "function_call", "functions", "modalities", "prediction", "reasoning_effort",
                         "web_search_options", "verbosity", "suffix", "prompt_cache_options", "prompt_cache_retention",
                         "moderation", "image_data", "logprob_start_len", "top_logprobs_num",
                         "return_text_in_logprobs"})


class APIError(Exception):
    """An error the client caused (4xx) or should retry (503); rendered by the app as OpenAI's error object."""

    TYPES: ClassVar[dict[int, str]] = {401: "authentication_error", 404: "invalid_request_error",
                                       413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status >= 500 and self.status != 503:
            return "internal_server_error"
        return self.TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- body -> dict ----------------------------------------------------------------------------------------------------
async def read_json(request, limit: int) -> dict:
    """The request body as a JSON object. 413 past `limit` bytes (before reading it when Content-Length says so)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request(f"invalid Content-Length header {declared[:32]!r}")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {'at least ' if size <= limit else ''}{size} bytes, more than the "
                         f"server's limit of {limit} (--max-request-bytes)", code="request_too_large")


def parse_json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})",
                          code="invalid_encoding") from None
    if not text.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON {type(obj).__name__}")
    return obj


# ---- shared field checks ---------------------------------------------------------------------------------------------
def check_text(s: str, param: str) -> str:
    """Reject strings Python accepts from JSON but UTF-8 cannot carry (unpaired surrogates such as "\\ud800")."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"'{param}' is not valid Unicode: unpaired surrogate at character {e.start}",
                          param=param, code="invalid_encoding") from None
    return s


# ---- dict -> model ---------------------------------------------------------------------------------------------------
def validate(cls: type[BaseModel], body: dict, prefix: str = "") -> Any:
    """`cls` from a JSON object, or an APIError naming the first bad field."""
    if not prefix:
        body = _drop_policy_fields(body)
    try:
        obj = cls.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e, prefix) from None
    except (TypeError, ValueError, OverflowError, RecursionError) as e:  # defensive: pydantic should not raise these
        raise bad_request(f"invalid request: {e}") from None
    if hasattr(obj, "check_supported"):
        obj.check_supported()
    return obj


def _drop_policy_fields(body: dict) -> dict:
    out = {}
    for k, v in body.items():
        if k in UNSUPPORTED and v is not None:
            raise bad_request(f"'{k}' is not supported by longreach", param=k, code="unsupported_parameter")
        if k not in IGNORED and not (k in UNSUPPORTED and v is None):
            out[k] = v
    return out


def _param(loc: tuple, prefix: str) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not any(c in str(part) for c in "[]-"):  # skip pydantic's union-branch tags such as 'list[str]'
            out += ("." if out else "") + str(part)
    return out


def _validation_error(e: ValidationError, prefix: str) -> APIError:
    err = e.errors(include_url=False)[0]
    param = _param(err["loc"], prefix)
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return bad_request(f"'{param}' is a required property", param=param)
    got = err.get("input")
    shown = "" if kind == "value_error" or isinstance(got, (dict, list)) else f", got {_short(got)}"
    return bad_request(f"Invalid value for '{param}': {msg}{shown}", param=param)


def _short(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (str, int, float, bool)) or v is None else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
