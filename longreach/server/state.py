"""What every HTTP handler shares: the server state and a request's life after validation (tokenize off the event
loop, check it fits, submit it, wait for or stream its updates, abort it when the client goes away).

Abort on disconnect: a streaming response aborts its engine requests when its ASGI call ends (Starlette cancels it when
the client disconnects); a non-streaming handler polls `request.is_disconnected()` while it waits. Either way the
engine loop frees the request's KV pages before its next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse

from .config import ServerConfig
from .engine_loop import EngineLoop, PreparedPrompt, Submission, Update
from .metrics import ServerMetrics
from .validation import APIError, bad_request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while its non-streaming request ran (nobody to answer)."""


@dataclass
class ServerState:
    engine: Any  # LLMEngine; used read-only here (tokenizer, config): only the engine loop's thread drives it
    loop: EngineLoop
    config: ServerConfig
    metrics: ServerMetrics
    model_names: tuple[str, ...]
    started: float = field(default_factory=time.time)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names and name != self.engine.config.model:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}", param="model",
                           code="model_not_found")

    @property
    def tokenizer(self):
        if self.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token-id prompts")
        return self.engine.tokenizer

    def check_prompt(self, token_ids: list[int], max_tokens: int | None, param: str = "prompt") -> None:
        """400 unless `token_ids` plus `max_tokens` (None: at least one) fit max_model_len and are in the vocab."""
        limit, n = self.engine.config.max_model_len, len(token_ids)
        if n == 0:
            raise bad_request(f"'{param}' is empty: it has no tokens", param=param)
        if n >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has {n} "
                              f"tokens (at most {limit - 1} leave room for one generated token). Shorten the prompt "
                              "or start the server with a larger --max-model-len.", param=param,
                              code="context_length_exceeded")
        if max_tokens is not None and n + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). Reduce "
                              "the prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
        try:
            self.engine.check_prompt(token_ids, f"'{param}'")
        except ValueError as e:
            raise bad_request(str(e), param=param) from None

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 -- a string the tokenizer refuses is the client's input, not our fault
            raise bad_request(f"'{param}' could not be tokenized: {e}", param=param) from None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **(kwargs or {}))
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 -- jinja's raise_exception, bad chat_template_kwargs
            raise bad_request(f"the model's chat template rejected these messages: {e}", param="messages") from None

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- a request's life ------------------------------------------------------------------------------------------
    async def in_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` off the event loop: tokenizing or rendering a 1M-token prompt (or its logprobs) takes seconds."""
        return await asyncio.to_thread(fn)

    def submit(self, prompts: list[PreparedPrompt], stream: bool) -> Submission:
        sub = Submission(stream)
        self.loop.submit(sub, prompts)
        return sub

    async def updates(self, sub: Submission, tick: float) -> AsyncIterator[Update | None]:
        """The submission's updates as they come; None after `tick` seconds without one (keep-alive / disconnect
        checks). Raises the APIError of a failed prompt."""
        pending = len(sub.request_ids)
        while pending:
            try:
                upd = await asyncio.wait_for(sub.queue.get(), tick)
            except asyncio.TimeoutError:
                yield None
                continue
            if upd.error is not None:
                raise upd.error
            if upd.output is not None:
                pending -= 1
            yield upd

    async def collect(self, sub: Submission, request) -> list[Update]:
        """Wait for every prompt of a non-streaming submission; the final update of each, in prompt order. Aborts
        what is left if the client disconnects (ClientGone) or a prompt fails."""
        finals: list[Update | None] = [None] * len(sub.request_ids)
        tick = min(1.0, self.config.keep_alive_interval)
        try:
            async with contextlib.aclosing(self.updates(sub, tick)) as ups:
                async for upd in ups:
                    if upd is None:
                        if await request.is_disconnected():
                            raise ClientGone()
                    elif upd.output is not None:
                        finals[upd.slot] = upd
        finally:
            if any(f is None for f in finals):
                self.loop.abort(sub.request_ids)
        return finals  # type: ignore[return-value]

    def stream(self, sub: Submission, render: Callable[[Update], list[dict]],
               finish: Callable[[], list[dict]] = list, first: list[dict] = ()) -> StreamingResponse:
        """Server-sent events: the `first` chunks, then `data: {chunk}` per rendered chunk, a `: keep-alive` comment
        every keep_alive_interval without one (a long prefill), `data: {"error": ...}` if the request fails, and
        `data: [DONE]` at the end. When the response ends for any reason (done, client gone) the submission's engine
        requests are aborted; for those already finished that is a no-op."""
        async def body() -> AsyncIterator[str]:
            for chunk in first:
                yield sse_data(chunk)
            try:
                async with contextlib.aclosing(self.updates(sub, self.config.keep_alive_interval)) as ups:
                    async for upd in ups:
                        if upd is None:
                            yield ": keep-alive\n\n"
                            continue
                        for chunk in render(upd):
                            yield sse_data(chunk)
                for chunk in finish():
                    yield sse_data(chunk)
            except APIError as e:
                yield sse_data(e.body())
            yield "data: [DONE]\n\n"

        return _AbortingStream(body(), lambda: self.loop.abort(sub.request_ids))


class _AbortingStream(StreamingResponse):
    """An SSE response that runs `on_close` when the ASGI call ends, however it ends (even if the client left before
    the body generator started, so no `finally` inside it would run)."""

    def __init__(self, body, on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                          "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"

