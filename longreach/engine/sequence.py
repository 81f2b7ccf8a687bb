"""One generated sequence: its tokens, how many have their KV in the cache, its sampling state and timings.

Token accounting: a step feeds tokens [num_computed, num_computed + n) to the model. When that reaches the end of the
known tokens (`num_computed == num_tokens`), the step also samples the next token. A decode step is the case n = 1;
a preempted sequence restarts from num_computed = 0 and re-prefills prompt + output so far.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ..sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples this is
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved: params.max_tokens capped by max_model_len - prompt length
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    text: str = ""
    times: SequenceTimes = field(default_factory=SequenceTimes)
    generator: object | None = None  # torch.Generator for seeded sampling (created by the model runner)
    decoder: object | None = None  # IncrementalDecoder
    num_preemptions: int = 0
    kv_counts: dict = field(default_factory=dict)  # offloading: page counts summed over this sequence's decode steps

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """More than the single newest token still needs the model: a (re-)prefill, possibly chunked."""
        return self.num_uncomputed > 1 or not self.output_token_ids

    def rewind_to_first_token(self, decoder) -> int:
        """Back to the prompt as prefilled, its outputs, text and finish cleared (`decoder`: a fresh detokenizer, or
        None); returns the first generated token, for the caller to record again (LLMEngine.redecode)."""
        first = self.output_token_ids[0]
        self.output_token_ids.clear()
        self.text, self.finish_reason, self.stop_reason = "", None, None
        self.decoder = decoder
        self.num_computed = len(self.prompt_token_ids)
        self.status = SequenceStatus.RUNNING
        self.times.finished = None
        return first

    @property
    def last_token(self) -> int:
        """The newest known token: what a decode step feeds."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:  # a decode step's token: no copy of a long prompt
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
