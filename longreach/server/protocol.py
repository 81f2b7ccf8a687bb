"""The request bodies of the HTTP API: one strict pydantic model per endpoint (OpenAI's fields, then vLLM's and SGLang's
extras), the checks a type cannot express, and their translation into `SamplingParams`.

Strict means no coercion ("1" is not a number, true is not an integer) and no unknown fields (validation.py turns
pydantic's complaints into OpenAI-shaped errors naming the field). Limits keep one request from asking the engine for
unbounded work: n <= 128 samples, <= 20 logprobs per position, <= 64 stop strings, <= 1024 prompts per request.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..sampling_params import SamplingParams
from .validation import bad_request, check_text, validate

MAX_N = 128  # samples per prompt
MAX_LOGPROBS = 20  # top alternatives per position (OpenAI allows 5 for completions, 20 for chat)
MAX_STOP = 64  # stop strings / stop token ids per request
MAX_PROMPTS = 1024  # prompts in one batched request
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _stop_list(v: Any) -> list[str] | None:
    if v is None:
        return None
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError("must be a string or a list of strings")
    if len(items) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop strings, got {len(items)}")
    if any(s == "" for s in items):
        raise ValueError("stop strings must be non-empty")
    for s in items:
        check_text(s, "stop")
    return items


def _token_ids(v: Any) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise ValueError("must be a list of non-negative integer token ids")
    if len(v) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} token ids, got {len(v)}")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk


class _Sampling(_Strict):
    """The sampling fields /v1/completions and /v1/chat/completions share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling parameters
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float | None = None
    stop_token_ids: Any = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM: token ids beside the text (choices[i].token_ids, prompt_token_ids)

    @field_validator("stop")
    @classmethod
    def check_stop(cls, v: Any) -> list[str] | None:
        return _stop_list(v)

    @field_validator("stop_token_ids")
    @classmethod
    def check_stop_token_ids(cls, v: Any) -> list[int] | None:
        return _token_ids(v)

    def check_supported(self) -> None:
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            v = getattr(self, name)
            if v is not None and v != neutral:
                raise bad_request(f"'{name}' is not supported by longreach (only {neutral}), got {v}", param=name,
                                  code="unsupported_parameter")
        if self.logit_bias:
            raise bad_request("'logit_bias' is not supported by longreach", param="logit_bias",
                              code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        return make_sampling_params(
            n=self.n, temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=tuple(self.stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens)


def make_sampling_params(**kw) -> SamplingParams:
    if kw["temperature"] < 1e-5:  # as vLLM: a vanishing temperature is greedy (and avoids dividing by ~0)
        kw["temperature"] = 0.0
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise bad_request(str(e).removeprefix("SamplingParams: ")) from None


class CompletionRequest(_Sampling):
    prompt: Any
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True  # vLLM: BOS etc. when tokenizing a text prompt

    @field_validator("prompt")
    @classmethod
    def check_prompt(cls, v: Any) -> list:
        """-> a list of prompts, each a string or a list of token ids."""
        def ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or (ids(v) and v):
            items = [v]
        elif isinstance(v, list) and v and (all(isinstance(x, str) for x in v) or all(ids(x) for x in v)):
            items = v
        else:
            raise ValueError("must be a non-empty string, a list of strings, a list of token ids, or a list of "
                             "token-id lists")
        if len(items) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}")
        for i, p in enumerate(items):
            if isinstance(p, str):
                check_text(p, f"prompt[{i}]")
        return items

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"'best_of' is not supported by longreach (only equal to n={self.n})", param="best_of",
                              code="unsupported_parameter")
        if self.stream and self.logprobs is not None:
            raise bad_request("'logprobs' with 'stream' is not supported by longreach; ask without streaming",
                              param="logprobs", code="unsupported_parameter")


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: Any = None  # a string, a list of content parts, or null
    name: str | None = None

    @field_validator("content")
    @classmethod
    def check_content(cls, v: Any) -> str | list[ContentPart] | None:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list) or not all(isinstance(p, dict) for p in v):
            raise ValueError("must be a string or a list of content parts ({\"type\": \"text\", \"text\": ...})")
        parts = []
        for p in v:
            kind, text = p.get("type"), p.get("text")
            if not isinstance(kind, str) or not (text is None or isinstance(text, str)):
                raise ValueError("each content part needs a string 'type' and, for a text part, a string 'text'")
            parts.append(ContentPart(type=kind, text=text))
        return parts


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise bad_request("'tools' are not supported by longreach", param="tools", code="unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' is not supported by longreach", param="tool_choice",
                              code="unsupported_parameter")
        if self.response_format not in (None, {"type": "text"}):
            raise bad_request("'response_format' other than {\"type\": \"text\"} is not supported by longreach",
                              param="response_format", code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if self.stream and self.logprobs:
            raise bad_request("'logprobs' with 'stream' is not supported by longreach; ask without streaming",
                              param="logprobs", code="unsupported_parameter")
        message_dicts(self.messages)  # roles and content parts

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """[{"role", "content": str}] for the chat template: text parts joined, anything else rejected."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise bad_request(f"'messages[{i}].role' must be one of {', '.join(_ROLES)}, got {m.role!r}",
                              param=f"messages[{i}].role")
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"'messages[{i}].content[{j}]': only text parts ({{\"type\": \"text\", \"text\": "
                                      f"...}}) are supported by longreach, got type {part.type!r}",
                                      param=f"messages[{i}].content[{j}]", code="unsupported_parameter")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = m.content or ""
        out.append({"role": m.role, "content": check_text(content, f"messages[{i}].content")})
    return out


class SGLangSamplingParams(_Strict):
    """SGLang's `sampling_params` of /generate (its names and defaults)."""

    max_new_tokens: int | None = Field(128, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted; the tokenizer's own spacing is used
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    sampling_seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @field_validator("stop")
    @classmethod
    def check_stop(cls, v: Any) -> list[str] | None:
        return _stop_list(v)

    @field_validator("stop_token_ids")
    @classmethod
    def check_stop_token_ids(cls, v: Any) -> list[int] | None:
        return _token_ids(v)

    def to_sampling_params(self) -> SamplingParams:
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                raise bad_request(f"'sampling_params.{name}' is not supported by longreach (only {neutral})",
                                  param=f"sampling_params.{name}", code="unsupported_parameter")
        return make_sampling_params(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.sampling_seed, max_tokens=self.max_new_tokens, min_tokens=self.min_new_tokens,
            stop=tuple(self.stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.no_stop_trim, skip_special_tokens=self.skip_special_tokens)


class GenerateRequest(_Strict):
    """SGLang's native /generate: `text` or `input_ids`, one prompt or a batch; `sampling_params`, one or per prompt."""

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    stream: bool = False
    rid: Any = None
    return_logprob: bool = False

    def prompts(self) -> tuple[list, bool]:
        """([str | list[int]], is_batch)."""
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("give exactly one of 'text' and 'input_ids'", param="text")
        if self.text is not None:
            v, name = self.text, "text"
            if isinstance(v, str):
                return [check_text(v, "text")], False
            if not (isinstance(v, list) and v and all(isinstance(s, str) for s in v)):
                raise bad_request("'text' must be a string or a non-empty list of strings", param="text")
        else:
            v, name = self.input_ids, "input_ids"
            if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                return [v], False
            if not (isinstance(v, list) and v and all(isinstance(x, list) and x and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in x) for x in v)):
                raise bad_request("'input_ids' must be a list of token ids or a non-empty list of them",
                                  param="input_ids")
        if len(v) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}", param=name)
        return [check_text(s, f"text[{i}]") if isinstance(s, str) else s for i, s in enumerate(v)], True

    def params(self, count: int) -> list[SamplingParams]:
        if self.return_logprob:
            raise bad_request("'return_logprob' is not supported by longreach's /generate; use /v1/completions with "
                              "'logprobs'", param="return_logprob", code="unsupported_parameter")
        sp = self.sampling_params
        items = sp if isinstance(sp, list) else [sp] * count
        if len(items) != count:
            raise bad_request(f"'sampling_params' has {len(items)} entries for {count} prompts",
                              param="sampling_params")
        out = []
        for d in items:
            if d is not None and not isinstance(d, dict):
                raise bad_request("'sampling_params' must be a JSON object (or a list of them, one per prompt)",
                                  param="sampling_params")
            out.append(validate(SGLangSamplingParams, d or {}, "sampling_params").to_sampling_params())
        return out

    def request_ids(self, count: int) -> list[str] | None:
        r = self.rid
        if r is None:
            return None
        ids = [r] if isinstance(r, str) else r
        if not (isinstance(ids, list) and len(ids) == count and all(isinstance(x, str) and x for x in ids)):
            raise bad_request("'rid' must be a string (one prompt) or one string per prompt", param="rid")
        return ids


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
