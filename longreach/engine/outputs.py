"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput shapes, plus timing metrics."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop string or stop token), "length", or "error" (RequestOutput.error)
    stop_reason: str | int | None = None  # the stop string / stop token id that matched, None for EOS or length


@dataclass
class RequestMetrics:
    arrival_time: float  # time.perf_counter() clock
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int = 0
    # KV offloading: pages of the decode steps this request took part in (a batch shares its steps' counts): read from
    # the GPU page cache, read from host memory, evicted, and installed (copied host -> GPU) after the step
    kv_pages_hit: int = 0
    kv_pages_missed: int = 0
    kv_pages_evicted: int = 0
    kv_pages_installed: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def prefill_seconds(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_seconds(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def prefill_tokens_per_s(self) -> float | None:
        s = self.prefill_seconds
        return self.num_prompt_tokens / s if s else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first one, over the time since the first one."""
        s = self.decode_seconds
        return (self.num_generated_tokens - 1) / s if s and self.num_generated_tokens > 1 else None


@dataclass
class RequestFailure:
    """Why the engine stopped one request and freed its pages while the others went on (LLMEngine.step)."""

    reason: str  # "non_finite_logits" | "forward_error" | "sampling_error" | "postprocess_error"
    message: str  # for a person: what failed, with the exception's type and text where there was one

    def __str__(self) -> str:
        return self.message


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # set when the engine failed this request alone (its samples that were unfinished end with finish_reason
    # "error"; their text and tokens are what came before the failure); None for a request that ended normally
    error: RequestFailure | None = None

    @property
    def text(self) -> str:
        """Text of the first completion (the only one unless n > 1)."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids
