"""The one thread that drives the engine while the server runs: continuous batching over HTTP.

`LLMEngine` is not thread-safe, so exactly one thread touches it: this loop. HTTP handlers (asyncio) hand it work
through a locked inbox; between two `step()` calls it admits new requests and applies aborts, so new prompts join the
running batch and a long prompt's prefill chunks alternate with the other requests' decode steps (the scheduler's
policy: see engine/scheduler.py). After each step it sends each streaming request its new text and tokens, and each
finished request its RequestOutput, to the asyncio side through `loop.call_soon_threadsafe`.

Logprobs (OpenAI `logprobs` / `echo`) come from re-scoring prompt + output once a request is done: its job joins a
scoring queue that the loop advances one chunk per iteration, after its engine step, so admission and the running
requests go on while a long prompt is scored (scoring_jobs.py has the rules that keep that safe).

Failures: a request the engine fails alone (`RequestOutput.error`: NaN logits, its forward or sampling raising) gets
a 500 `engine_error` and the others go on. An exception out of `engine.step()` means the engine itself is broken: the
loop dies, every request in flight gets its error, new ones get 503, `/health` answers 503 with the reason, and
`on_dead` (set by app.serve) makes uvicorn drain and the process exit 1, so a supervisor restarts it. A tensor-parallel
worker rank that dies is such an error (`WorkerDied`, naming the rank and its exit code): out of the step that needed
it, or, while the loop idles, from the check it makes on each wake-up (at least every second).

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
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.outputs import CompletionOutput, RequestOutput
from ..kernels.jit_watch import JitWatch
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics, ThroughputLog, device_memory, kv_cache_stats
from .scoring_jobs import ScoredSample, ScoringJob, ScoringQueue
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
        self._stopped_why = "the server is shutting down"
        self.dead: str | None = None  # why the engine loop died (an error out of the engine), None while it has not
        self.on_dead: Callable[[], None] | None = None  # called on the engine thread once it has died and drained
        self._in_flight = 0  # accepted, not yet done (guarded by _cv)
        self._running = 0  # requests with a sequence in the running batch after the last step (guarded by _cv)
        self._free_slots = engine.config.max_num_seqs  # places left in the running batch after the last step
        self._ids = itertools.count()
        # engine-thread state
        self._live: dict[str, _Live] = {}
        self._deferred: deque[tuple[str, _Live]] = deque()  # accepted, not yet in the engine (see _admit)
        self._scoring = ScoringQueue(engine)
        self._outbox: list[tuple[Submission, Update]] = []  # sent after the state is published (see _flush)
        self._log = ThroughputLog()
        self._jit = JitWatch()  # Triton compilations inside the loop's steps (after the warm-up): logged, see _run
        self._kv: dict = {}
        self._thread = threading.Thread(target=self._run, name="longreach-engine", daemon=True)

    # ---- asyncio side ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left (uvicorn has drained the connections by now) and join the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def finished(self) -> bool:
        """The engine thread has ended (or never started): nothing touches the engine any more."""
        return not self._thread.is_alive()

    def submit(self, sub: Submission, prompts: list[PreparedPrompt]) -> None:
        """Queue one engine request per prompt; APIError 503 when the waiting queue is full or the server stops."""
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                raise APIError(503, self._stopped_why, code="engine_dead" if self.dead else "shutting_down",
                               headers={"Retry-After": "5"})
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
        self._jit.start()
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
                began = time.perf_counter()
                self.engine.check_workers()  # a dead tensor-parallel rank kills the loop even while it idles
                for op, rid, live in inbox:
                    self._deferred.append((rid, live)) if op == "add" else self._abort(rid)
                self._admit()
                stepped = self.engine.has_unfinished_requests()
                compiled = len(self._jit.events)
                if stepped:
                    self._step()
                step_compiles = self._jit.events[compiled:]  # a scoring pass's are logged on their own below
                if self._scoring:
                    compiled = len(self._jit.events)
                    self._score_chunk()
                    if len(self._jit.events) > compiled:
                        self._log_compiles(self._jit.events[compiled:], "a logprobs scoring pass")
                self._publish()
                self._flush()
                if stepped:  # the gap every running request saw between two of its tokens (metrics.ThroughputLog)
                    took = time.perf_counter() - began
                    self.metrics.iteration.observe(took)
                    self._log.on_iteration(took, self.engine.last_step)
                    if step_compiles:
                        step = self.engine.last_step
                        rows = "" if step is None else (f" with {step.num_decode_tokens} decode rows and "
                                                        f"{step.num_tokens - step.num_decode_tokens} prefill tokens")
                        self._log_compiles(step_compiles, f"a step (the iteration took {1e3 * took:.1f} ms{rows})")
                        self._log.on_compiles(len(step_compiles))
        except Exception as e:  # noqa: BLE001 -- the engine is broken: die loudly (see the module docstring)
            logger.exception("the engine loop stopped on an unexpected error; the server can no longer generate and "
                             "exits once the requests in flight have their errors")
            with self._cv:
                self.dead = f"{type(e).__name__}: {e}"
                self._stopped_why = (f"the engine failed ({self.dead}); the server is exiting so that its "
                                     "supervisor restarts it: retry shortly")
        finally:
            self._close()

    @staticmethod
    def _log_compiles(events: list[tuple[str, float]], inside: str) -> None:
        """Triton compiled kernels inside `inside` (a step, a scoring pass) after the warm-up: every stream waited
        for them. Say which, so that the warm-up (server/app.py warm_up) can be taught the shape."""
        names = ", ".join(f"{name} x{n}" for name, n in Counter(name for name, _ in events).items())
        logger.warning("Triton compiled %d kernel(s) in %.2f s inside %s while serving (%s); a shape the warm-up did "
                       "not reach", len(events), sum(s for _, s in events), inside, names)

    def _has_work(self) -> bool:
        return bool(self.engine.has_unfinished_requests() or self._scoring or self._deferred)

    def _admit(self) -> None:
        """Hand the accepted requests to the engine in order, as far as the scoring queue lets them in (it keeps a
        seat and pages for its pass: scoring_jobs.py); the rest wait here."""
        while self._deferred:
            rid, live = self._deferred[0]
            if not self._scoring.admits(live.prompt.params.n):
                return
            self._deferred.popleft()
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
        for item in list(self._deferred):
            if item[0] == rid:
                self._deferred.remove(item)
                self.metrics.observe_aborted(0)
                self._release()
        job = self._scoring.remove(rid)
        if job is not None:
            self.metrics.observe_aborted(job.output.metrics.num_generated_tokens)
            self._release()

    def _step(self) -> None:
        finished = self.engine.step()  # raises only when the engine itself is broken: the loop dies (_run)
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
            if out.error is not None:
                self._failed(live, out.error.reason, out.metrics.num_generated_tokens, out.error.message)
            elif live.prompt.num_top_logprobs is not None:
                p = live.prompt
                self._scoring.add(ScoringJob(rid, live, out, p.num_top_logprobs or 0, p.score_from))
            else:
                self._finish(live, out, None)

    def _failed(self, live: _Live, reason: str, generated_tokens: int, why: str) -> None:
        """The engine failed this request alone: a 500 for it (the others go on), counted by reason."""
        n = len(live.sub.request_ids)
        which = f"prompt {live.slot} of this request" if n > 1 else "this request"
        self.metrics.observe_failed(reason, generated_tokens)
        self._fail(live, APIError(500, f"the engine failed on {which} ({why}); it was stopped and its KV cache "
                                       "freed, and the other requests on the server are unaffected",
                                  code="engine_error"))

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

    def _score_chunk(self) -> None:
        done = self._scoring.advance()
        if done is None:
            return
        job, error = done
        if error is not None:
            logger.error("scoring %s for logprobs failed: %s: %s", job.request_id, type(error).__name__, error,
                         exc_info=error)
            self._failed(job.owner, "scoring_error", job.output.metrics.num_generated_tokens,
                         f"computing its logprobs raised {type(error).__name__}: {error}")
            return
        self._finish(job.owner, job.output, job.scored)

    def _fail(self, live: _Live, error: APIError) -> None:
        self._send(live, Update(live.slot, error=error))
        self._release()

    def _fail_all(self, ran: APIError, waited: APIError) -> None:
        """Fail every request in flight: `ran` for those the engine has had, `waited` for those it has not."""
        jobs = self._scoring.drain()
        if self.dead:
            self.metrics.observe_failed("engine_dead", 0, len(self._live) + len(jobs) + len(self._deferred))
        for rid, live in self._live.items():
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 -- the engine is already in trouble; the request is failed either way
                logger.exception("aborting %s failed", rid)
            self._fail(live, ran)
        for job in jobs:
            self._fail(job.owner, ran)
        for _, live in self._deferred:
            self._fail(live, waited)
        self._live.clear()
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
        self.metrics.set_state(running, waiting, self.engine.scheduler.num_preemptions, kv,
                               device_memory(self.engine))
        self._log.maybe_log(running, waiting, kv)

    def _close(self) -> None:
        with self._cv:
            self._stopping = True
            inbox, self._inbox = self._inbox, []
        try:
            for op, rid, live in inbox:
                if op == "add":
                    self._deferred.append((rid, live))
            waited = APIError(503, self._stopped_why, code="engine_dead" if self.dead else "shutting_down",
                              headers={"Retry-After": "5"})
            ran = APIError(500, f"the engine failed while this request ran ({self.dead}); the server is exiting so "
                                "that its supervisor restarts it", code="engine_dead") if self.dead else waited
            self._fail_all(ran, waited)
            self._flush()
        finally:
            self._jit.stop()
            if self.dead and self.on_dead is not None:
                self.on_dead()
