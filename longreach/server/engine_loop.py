"""The one thread that drives the engine while the server runs: continuous batching over HTTP.

`LLMEngine` is not thread-safe, so exactly one thread touches it: this loop. HTTP handlers (asyncio) hand it work
through a locked inbox; between two `step()` calls it admits new requests and applies aborts, so new prompts join the
running batch and a long prompt's prefill chunks alternate with the other requests' decode steps (the scheduler's
policy: see engine/scheduler.py). After each step it sends each streaming request its new text and tokens, and each
finished request its RequestOutput, to the asyncio side through `loop.call_soon_threadsafe`.

Logprobs (OpenAI `logprobs` / `echo`) come from re-scoring prompt + output with `LLMEngine.prompt_logprobs`, which needs
an idle engine: a finished request that wants them joins a scoring queue; while that queue is not empty, new requests
are held back so the running ones drain, then the queue is scored and admission resumes.

Admission control: a request is *waiting* from its acceptance until one of its sequences runs. `submit` refuses
(503 + Retry-After) once more than `max_queued` requests would wait beyond the running batch's free places
(max_num_seqs minus the sequences running after the last step), so a burst that the batch can take is not refused.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..engine.outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics, ThroughputLog, kv_cache_stats
from .validation import APIError

logger = logging.getLogger("longreach")
_IDLE_WAKEUP_S = 1.0  # an idle loop still wakes this often (the throughput log, a stop request)


@dataclass
class PreparedPrompt:
    """One engine request, validated and tokenized by the HTTP side."""

    token_ids: list[int]
    text: str | None
    params: SamplingParams
    num_top_logprobs: int | None = None  # None: no logprobs; else the alternatives per position (0 = none)
    score_from: int = 0  # first position of prompt + output whose logprob is wanted (0 with echo)


@dataclass
class SampleDelta:
    """What one sample added since the last update (streaming)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class ScoredSample:
    """Logprobs of positions [start, T) of one sample's prompt + output (position 0 has none: start >= 1)."""

    start: int
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per position, (token id, logprob), most likely first


@dataclass
class Update:
    """One message from the engine thread about one prompt (`slot`) of a submission."""

    slot: int
    deltas: list[SampleDelta] = field(default_factory=list)
    output: RequestOutput | None = None  # set once, when this prompt is done
    scored: list[ScoredSample] | None = None  # with output, when logprobs were asked for
    error: APIError | None = None  # set once, instead of output, when it failed


class Submission:
    """The engine requests of one HTTP request (one per prompt) and the asyncio queue all their updates arrive on.
    Create it inside the event loop; the engine thread only calls `push`."""

    def __init__(self, stream: bool):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.stream = stream
        self.request_ids: list[str] = []
        self.arrival = time.perf_counter()

    def push(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass


@dataclass
class _Live:
    """Engine-thread state of one engine request."""

    sub: Submission
    slot: int
    prompt: PreparedPrompt
    sent_tokens: list[int]
    sent_chars: list[int]
    finish_sent: list[bool]
    holdback: int  # characters kept back while streaming: a later stop string may still cut them

    @classmethod
    def new(cls, sub: Submission, slot: int, prompt: PreparedPrompt) -> _Live:
        n, stops = prompt.params.n, prompt.params.stop
        return cls(sub, slot, prompt, [0] * n, [0] * n, [False] * n, max((len(s) for s in stops), default=1) - 1)


class EngineLoop:
    def __init__(self, engine, metrics: ServerMetrics, max_queued: int):
        self.engine = engine
        self.metrics = metrics
        self.max_queued = max_queued
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, str, _Live | None]] = []  # ("add", id, live) | ("abort", id, None)
        self._stopping = False
        self._stopped_why = "the engine loop has stopped after an error (the server log has it); restart the server"
        self._in_flight = 0  # accepted, not yet done (guarded by _cv)
        self._running = 0  # requests with a sequence in the running batch after the last step (guarded by _cv)
        self._free_slots = engine.config.max_num_seqs  # places left in the running batch after the last step
        self._ids = itertools.count()
        # engine-thread state
        self._live: dict[str, _Live] = {}
        self._deferred: deque[tuple[str, _Live]] = deque()  # adds held back while prompts wait to be scored
        self._scoring: deque[tuple[str, _Live, RequestOutput]] = deque()
        self._outbox: list[tuple[Submission, Update]] = []  # sent after the state is published (see _flush)
        self._log = ThroughputLog()
        self._kv: dict = {}
        self._thread = threading.Thread(target=self._run, name="longreach-engine", daemon=True)

    # ---- asyncio side ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left (uvicorn has drained the connections by now) and join the thread."""
        with self._cv:
            self._stopping = True
            self._stopped_why = "the server is shutting down"
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, sub: Submission, prompts: list[PreparedPrompt]) -> None:
        """Queue one engine request per prompt; APIError 503 when the waiting queue is full or the server stops."""
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                raise APIError(503, self._stopped_why, code="shutting_down", headers={"Retry-After": "5"})
            waiting = self._in_flight - self._running
            if waiting + len(prompts) > self.max_queued + self._free_slots:
                self.metrics.rejected("queue_full")
                raise APIError(503, f"the server is overloaded: {waiting} requests are waiting to run and the limit is "
                                    f"{self.max_queued} (--max-queued-requests); retry later", code="queue_full",
                               headers={"Retry-After": "1"})
            for slot, p in enumerate(prompts):
                rid = f"r{next(self._ids)}"
                sub.request_ids.append(rid)
                self._inbox.append(("add", rid, _Live.new(sub, slot, p)))
            self._in_flight += len(prompts)
            self._cv.notify()

    def abort(self, request_ids: list[str]) -> None:
        """Abort these engine requests (no-op for those already done); their KV pages go back to the free list."""
        with self._cv:
            self._inbox.extend(("abort", rid, None) for rid in request_ids)
            self._cv.notify()

    def snapshot(self) -> dict:
        with self._cv:
            return {"running": self._running, "waiting": self._in_flight - self._running, "kv_cache": dict(self._kv)}

    # ---- engine thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._publish()
            while True:
                with self._cv:
                    if not self._inbox and not self._stopping and not self._has_work():
                        self._cv.wait(_IDLE_WAKEUP_S)
                    inbox, self._inbox = self._inbox, []
                    stopping = self._stopping
                if stopping:
                    break
                for op, rid, live in inbox:
                    self._add(rid, live) if op == "add" else self._abort(rid)
                if not self._scoring:
                    while self._deferred:
                        self._start(*self._deferred.popleft())
                if self.engine.has_unfinished_requests():
                    self._step()
                elif self._scoring:
                    self._score_next()
                self._publish()
                self._flush()
        except Exception:
            logger.exception("the engine loop stopped on an unexpected error; the server can no longer generate")
        finally:
            self._close()

    def _has_work(self) -> bool:
        return bool(self.engine.has_unfinished_requests() or self._scoring or self._deferred)

    def _add(self, rid: str, live: _Live) -> None:
        if self._scoring:
            self._deferred.append((rid, live))
        else:
            self._start(rid, live)

    def _start(self, rid: str, live: _Live) -> None:
        p = live.prompt
        try:
            self.engine.add_request(rid, p.token_ids, p.params, prompt=p.text)
        except ValueError as e:  # the HTTP side validated already; this is a last line of defence
            self._fail(live, APIError(400, str(e)))
            return
        self._live[rid] = live

    def _abort(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is not None:
            progress = self.engine.request_progress(rid) or []
            self.engine.abort_request(rid)
            self.metrics.observe_aborted(sum(len(c.token_ids) for c in progress))
            self._release()
            return
        for queue in (self._deferred, self._scoring):
            for item in list(queue):
                if item[0] == rid:
                    queue.remove(item)
                    self.metrics.observe_aborted(0)
                    self._release()

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing the %d requests in it", len(self._live))
            self._fail_all(APIError(500, "the engine failed while running this request; see the server log",
                                    code="engine_error"))
            return
        self._log.on_step(self.engine.last_step)
        done = {o.request_id: o for o in finished}
        for rid, live in self._live.items():
            if live.sub.stream and rid not in done:
                deltas = self._deltas(live, self.engine.request_progress(rid) or [], final=False)
                if deltas:
                    self._send(live, Update(live.slot, deltas))
        for rid, out in done.items():
            live = self._live.pop(rid, None)
            if live is None:
                continue
            if live.prompt.num_top_logprobs is not None:
                self._scoring.append((rid, live, out))
            else:
                self._finish(live, out, None)

    def _deltas(self, live: _Live, samples: list[CompletionOutput], final: bool) -> list[SampleDelta]:
        out = []
        for s in samples:
            i = s.index
            if live.finish_sent[i]:
                continue
            done = final or s.finish_reason is not None
            end = len(s.text) if done else len(s.text) - live.holdback
            end = max(end, live.sent_chars[i])  # never take back what was sent
            text, tokens = s.text[live.sent_chars[i]:end], list(s.token_ids[live.sent_tokens[i]:])
            if text or tokens or done:
                out.append(SampleDelta(i, text, tokens, s.finish_reason if done else None,
                                       s.stop_reason if done else None))
                live.sent_chars[i], live.sent_tokens[i] = end, live.sent_tokens[i] + len(tokens)
                live.finish_sent[i] = done
        return out

    def _finish(self, live: _Live, out: RequestOutput, scored: list[ScoredSample] | None) -> None:
        deltas = self._deltas(live, out.outputs, final=True) if live.sub.stream else []
        self.metrics.observe_finished(out, live.sub.arrival)
        self._send(live, Update(live.slot, deltas, output=out, scored=scored))
        self._release()

    def _score_next(self) -> None:
        _, live, out = self._scoring.popleft()
        p = live.prompt
        try:
            scored = []
            for c in out.outputs:
                ids = p.token_ids + c.token_ids
                start = max(p.score_from, 1)
                if start >= len(ids):
                    scored.append(ScoredSample(start, [], []))
                    continue
                lp, top_ids, top_lp = self.engine.prompt_logprobs(ids, p.num_top_logprobs or 0, start)
                scored.append(ScoredSample(start, lp.tolist(),
                                           [list(zip(a, b)) for a, b in zip(top_ids.tolist(), top_lp.tolist())]))
        except Exception:
            logger.exception("scoring a prompt for logprobs failed")
            self._fail(live, APIError(500, "computing logprobs failed; see the server log", code="engine_error"))
            return
        self._finish(live, out, scored)

    def _fail(self, live: _Live, error: APIError) -> None:
        self._send(live, Update(live.slot, error=error))
        self._release()

    def _fail_all(self, error: APIError) -> None:
        for rid, live in list(self._live.items()) + [(r, lv) for r, lv, _ in self._scoring] + list(self._deferred):
            try:
                self.engine.abort_request(rid)
            except Exception:  # the engine is already in trouble; the request is failed either way
                logger.exception("aborting %s failed", rid)
            self._fail(live, error)
        self._live.clear()
        self._scoring.clear()
        self._deferred.clear()

    def _send(self, live: _Live, update: Update) -> None:
        self._outbox.append((live.sub, update))

    def _flush(self) -> None:
        """Deliver this iteration's updates. After `_publish`, so a client that has its answer sees metrics and
        /server_info without it (no request still counted as running once its response is out)."""
        for sub, update in self._outbox:
            sub.push(update)
        self._outbox.clear()

    def _release(self, n: int = 1) -> None:
        with self._cv:
            self._in_flight -= n

    def _publish(self) -> None:
        seqs = self.engine.scheduler.running
        running = len({s.request_id for s in seqs})
        kv = kv_cache_stats(self.engine)
        with self._cv:
            self._running = running
            self._free_slots = max(self.engine.config.max_num_seqs - len(seqs), 0)
            waiting = self._in_flight - running
            self._kv = kv
        self.metrics.set_state(running, waiting, self.engine.scheduler.num_preemptions, kv)
        self._log.maybe_log(running, waiting, kv)

    def _close(self) -> None:
        with self._cv:
            self._stopping = True
            inbox, self._inbox = self._inbox, []
        for op, rid, live in inbox:
            if op == "add":
                self._deferred.append((rid, live))
        self._fail_all(APIError(503, self._stopped_why, code="shutting_down", headers={"Retry-After": "5"}))
        self._flush()
