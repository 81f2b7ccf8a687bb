"""Logprobs for finished requests, scored one chunk per engine-loop iteration, between the engine's steps.

OpenAI's `logprobs` / `echo` values come from re-scoring prompt + output once a request is done (one pass per sample,
engine/scoring.py: LogprobsPass). The engine loop runs one chunk of the oldest job per iteration, after its engine
step, so a request that arrives while a long prompt is scored waits for at most the chunk in flight, and running
requests keep decoding (each of their steps alternates with one scoring chunk).

A pass is one more sequence that the scheduler does not see, so this queue keeps LogprobsPass's two conditions:
  * a seat: a pass starts only when the engine holds fewer than max_num_seqs sequences, and while jobs are queued,
    `admits` lets a new request into the engine only if the engine then holds at most max_num_seqs - 1 (the request
    waits in the loop instead; with --max-num-seqs 1 nothing joins until the scoring is done);
  * pages: a pass reserves the pages of its whole text before its first chunk. While it cannot, `admits` holds every
    new request back, so the running ones drain and free pages; on an idle engine, a text the KV cache cannot hold
    fails its request.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..engine.outputs import RequestOutput

logger = logging.getLogger("longreach")


@dataclass
class ScoredSample:
    """Logprobs of positions [start, T) of one sample's prompt + output (position 0 has none: start >= 1)."""

    start: int
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per position, (token id, logprob), most likely first


@dataclass
class ScoringJob:
    """One finished request waiting for its samples' logprobs."""

    request_id: str
    owner: Any  # the engine loop's record of the request, handed back when the job is done
    output: RequestOutput
    num_top: int  # alternatives per position (0: none)
    score_from: int  # first position of prompt + output whose logprob is wanted
    scored: list[ScoredSample] = field(default_factory=list)  # one per sample done so far
    current: Any = None  # the LogprobsPass of the sample being scored


class ScoringQueue:
    """The jobs, oldest first; only the engine thread touches it."""

    def __init__(self, engine):
        self.engine = engine
        self.jobs: deque[ScoringJob] = deque()
        self.short_of_pages = False  # the head job's pass waits for pages: admission is held back

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def add(self, job: ScoringJob) -> None:
        self.jobs.append(job)

    def remove(self, request_id: str) -> ScoringJob | None:
        """Drop a job (its client went away); its pass's pages go back."""
        for job in self.jobs:
            if job.request_id == request_id:
                self.jobs.remove(job)
                self._close(job)
                if not self.jobs:
                    self.short_of_pages = False
                return job
        return None

    def drain(self) -> list[ScoringJob]:
        """Every job, removed, their passes closed (the loop is stopping)."""
        jobs = list(self.jobs)
        self.jobs.clear()
        for job in jobs:
            self._close(job)
        return jobs

    def admits(self, num_seqs: int) -> bool:
        """May a request of `num_seqs` sequences join the engine now (the module docstring's rules)?"""
        if not self.jobs:
            return True
        if self.short_of_pages:
            return False
        return self.engine.num_unfinished_sequences() + num_seqs <= self.engine.config.max_num_seqs - 1

    def advance(self) -> tuple[ScoringJob, Exception | None] | None:
        """Run the oldest job's next chunk. Returns (job, None) once the job is scored (`job.scored` complete),
        (job, error) if scoring it raised (its pass closed), and None while it has more to do or waits for a seat or
        pages. Call it while the queue is not empty."""
        job = self.jobs[0]
        try:
            p = self._pass(job)
            if p is not None:
                if not p.reserved and not self._reserve(p):
                    return None
                p.advance()
                if p.done:
                    lp, top_ids, top_lps = p.result()
                    job.scored.append(ScoredSample(p.start, lp.tolist(), [list(zip(a, b)) for a, b in
                                                                          zip(top_ids.tolist(), top_lps.tolist())]))
                    p.close()
                    job.current = None
            if len(job.scored) < len(job.output.outputs):
                return None
        except Exception as e:  # noqa: BLE001 -- this request's failure; the engine loop logs it
            self.jobs.popleft()
            self._close(job)
            return job, e
        self.jobs.popleft()
        return job, None

    def _pass(self, job: ScoringJob):
        """The pass of the job's next sample that needs one (samples with nothing to score are done at once)."""
        while job.current is None and len(job.scored) < len(job.output.outputs):
            c = job.output.outputs[len(job.scored)]
            ids = job.output.prompt_token_ids + c.token_ids
            start = max(job.score_from, 1)
            if start >= len(ids):
                job.scored.append(ScoredSample(start, [], []))
                continue
            job.current = self.engine.start_prompt_logprobs(ids, job.num_top, start)
        return job.current

    def _reserve(self, p) -> bool:
        engine = self.engine
        if engine.num_unfinished_sequences() >= engine.config.max_num_seqs:
            return False  # no seat yet; admission keeps one free once the engine drains to it
        if p.reserve():
            self.short_of_pages = False
            return True
        if not engine.has_unfinished_requests():
            raise ValueError(f"the KV cache cannot hold the {p.num_tokens} tokens of prompt + output")
        self.short_of_pages = True
        return False

    def _close(self, job: ScoringJob) -> None:
        if job.current is not None:
            p, job.current = job.current, None
            try:
                p.close()
            except Exception:  # noqa: BLE001 -- a broken engine; the job is dropped either way
                logger.exception("freeing the scoring pass of %s failed", job.request_id)
