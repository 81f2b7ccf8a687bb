"""Prometheus metrics (`GET /metrics`) and the periodic throughput log line, both fed by the engine thread.

Names are `longreach:`-prefixed with a `model_name` label, vLLM's vocabulary where one exists:

  longreach:num_requests_running / num_requests_waiting          gauges
  longreach:time_to_first_token_seconds                           histogram (server arrival -> first token)
  longreach:time_per_output_token_seconds                         histogram (per request: decode time / (tokens - 1))
  longreach:e2e_request_latency_seconds, request_queue_time_seconds  histograms
  longreach:prompt_tokens_total, generation_tokens_total          counters
  longreach:request_success_total{finished_reason}                counter (stop, length, abort)
  longreach:request_rejected_total{reason}                        counter (queue_full)
  longreach:request_failure_total{reason}                         counter (requests the engine failed: see below)
  longreach:num_preemptions_total                                 counter
  longreach:kv_cache_usage_perc                                   gauge, GPU tier, 0..1
  longreach:kv_cache_pages_total / kv_cache_pages_used{tier}      gauges, tier = gpu (and host when offloading)
  longreach:process_resident_memory_bytes                         gauge, the server process's RSS (at scrape time)
  longreach:gpu_memory_allocated_bytes / gpu_memory_reserved_bytes  gauges, the torch allocator's, on a GPU
  with offloading on (--kv-offloading-size):
  longreach:kv_offload_hit_ratio                                  gauge, pages hit / (hit + missed), cumulative
  longreach:kv_offload_pages_hit_total / pages_missed_total / pages_evicted_total, kv_offload_h2d_bytes_total

`request_failure_total` reasons: non_finite_logits, forward_error, sampling_error, postprocess_error (the engine
failed one request and the others went on: engine/outputs.py RequestFailure), scoring_error (its logprobs pass raised),
engine_dead (in flight when the engine loop died).

Engine-side values (KV pages, offload counters, preemptions) are snapshots the engine thread publishes after each
step, so a scrape never touches the engine.
"""
from __future__ import annotations

import logging
import os
import statistics
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("longreach")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)  # up to a 1M-token prefill
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)


def device_memory(engine) -> dict:
    """The torch allocator's allocated and reserved bytes on the engine's GPU (empty on a CPU engine)."""
    device = getattr(engine, "device", None)
    if device is None or device.type != "cuda":
        return {}
    import torch

    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}


def resident_bytes() -> int | None:
    """This process's resident set size from /proc/self/statm (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def kv_cache_stats(engine) -> dict:
    """`engine.kv_cache_stats()`, or the same keys from the block manager for an engine without that method."""
    fn = getattr(engine, "kv_cache_stats", None)
    if fn is not None:
        return fn()
    b = engine.blocks
    return {"offload": False, "gpu_pages_total": b.num_blocks, "gpu_pages_used": b.num_blocks - b.num_free_blocks,
            "host_pages_total": 0, "host_pages_used": 0, "pages_hit": 0, "pages_missed": 0, "pages_evicted": 0,
            "bytes_h2d": 0}


class ServerMetrics:
    """Thread-safe (prometheus_client objects are): the engine thread observes, HTTP scrapes render."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        disable_created_metrics()  # no `_created` series beside each counter and histogram (as vLLM)
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("longreach:time_to_first_token_seconds", "Time from the request's arrival to its first "
                              "token", lab, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("longreach:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", lab, buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("longreach:e2e_request_latency_seconds", "Time from arrival to the last token", lab,
                             buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.iteration = Histogram("longreach:iteration_seconds", "One engine-loop iteration: the engine step (every "
                                   "running request's next token, prefill chunks) and the loop's own work around it "
                                   "(admissions, detokenizing, handing the tokens to the HTTP side)", lab,
                                   buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("longreach:request_queue_time_seconds", "Time from arrival to the first "
                                    "scheduled step", lab, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("longreach:prompt_tokens", "Prompt tokens of finished requests", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("longreach:generation_tokens", "Generated tokens of finished and aborted "
                                         "requests", lab, registry=r).labels(model_name)
        self._success = Counter("longreach:request_success", "Requests ended, by the (first) sample's reason: stop, "
                                "length, abort",
                                lab + ["finished_reason"], registry=r)
        self._rejected = Counter("longreach:request_rejected", "Requests refused before reaching the engine",
                                 lab + ["reason"], registry=r)
        self._failed = Counter("longreach:request_failure", "Requests that failed in the engine, by reason",
                               lab + ["reason"], registry=r)
        self.state = {"running": 0, "waiting": 0, "preemptions": 0, "kv": {}, "memory": {}}
        r.register(_EngineStateCollector(self))

    # ---- called by the engine thread -----------------------------------------------------------------------------
    def observe_finished(self, out, arrival: float) -> None:
        """A finished RequestOutput; `arrival` is when the server accepted it (time.perf_counter)."""
        m = out.metrics
        if m.first_token_time is not None:
            self.ttft.observe(max(m.first_token_time - arrival, 0.0))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(m.first_scheduled_time - arrival, 0.0))
        if m.finished_time is not None:
            self.e2e.observe(max(m.finished_time - arrival, 0.0))
        per_sample = m.num_generated_tokens / max(len(out.outputs), 1)
        if m.decode_seconds is not None and per_sample > 1:
            self.tpot.observe(m.decode_seconds / (per_sample - 1))
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_generated_tokens)
        self._success.labels(self.model_name, out.outputs[0].finish_reason or "abort").inc()

    def observe_aborted(self, generated_tokens: int) -> None:
        self.generation_tokens.inc(generated_tokens)
        self._success.labels(self.model_name, "abort").inc()

    def observe_failed(self, reason: str, generated_tokens: int, count: int = 1) -> None:
        """`count` requests failed in the engine (after `generated_tokens` tokens between them)."""
        self.generation_tokens.inc(generated_tokens)
        self._failed.labels(self.model_name, reason).inc(count)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def set_state(self, running: int, waiting: int, preemptions: int, kv: dict, memory: dict | None = None) -> None:
        self.state = {"running": running, "waiting": waiting, "preemptions": preemptions, "kv": dict(kv),
                      "memory": dict(memory or {})}

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStateCollector:
    """Gauges and counters read from the engine thread's latest snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def collect(self):
        st, name = self.m.state, self.m.model_name
        kv = st["kv"]

        def gauge(metric, doc, value, **labels):
            g = GaugeMetricFamily(metric, doc, labels=["model_name", *labels])
            g.add_metric([name, *labels.values()], value)
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        yield gauge("longreach:num_requests_running", "Requests with a sequence in the running batch", st["running"])
        yield gauge("longreach:num_requests_waiting", "Requests accepted but not yet running", st["waiting"])
        yield counter("longreach:num_preemptions", "Sequences preempted (pages freed, recomputed later)",
                      st["preemptions"])
        rss = resident_bytes()
        if rss is not None:
            yield gauge("longreach:process_resident_memory_bytes", "Resident memory of the server process", rss)
        for kind, value in st.get("memory", {}).items():
            yield gauge(f"longreach:gpu_memory_{kind}_bytes", f"GPU memory {kind} by the torch allocator", value)
        if not kv:
            return
        total, used = kv.get("gpu_pages_total", 0), kv.get("gpu_pages_used", 0)
        yield gauge("longreach:kv_cache_usage_perc", "Share of the GPU-tier KV pages in use (0..1)",
                    used / total if total else 0.0)
        tiers = [("gpu", total, used)]
        if kv.get("offload"):
            tiers.append(("host", kv.get("host_pages_total", 0), kv.get("host_pages_used", 0)))
        pages_total = GaugeMetricFamily("longreach:kv_cache_pages_total", "KV-cache pages per tier",
                                        labels=["model_name", "tier"])
        pages_used = GaugeMetricFamily("longreach:kv_cache_pages_used", "KV-cache pages in use per tier",
                                       labels=["model_name", "tier"])
        for tier, t, u in tiers:
            pages_total.add_metric([name, tier], t)
            pages_used.add_metric([name, tier], u)
        yield pages_total
        yield pages_used
        if kv.get("offload"):
            hit, missed = kv.get("pages_hit", 0), kv.get("pages_missed", 0)
            yield gauge("longreach:kv_offload_hit_ratio", "Pages found in the GPU page cache / pages read, cumulative",
                        hit / (hit + missed) if hit + missed else 0.0)
            yield counter("longreach:kv_offload_pages_hit", "Pages read from the GPU page cache", hit)
            yield counter("longreach:kv_offload_pages_missed", "Pages read from host memory", missed)
            yield counter("longreach:kv_offload_pages_evicted", "Pages evicted from the GPU page cache",
                          kv.get("pages_evicted", 0))
            yield counter("longreach:kv_offload_h2d_bytes", "Bytes copied host -> GPU", kv.get("bytes_h2d", 0))


class ThroughputLog:
    """vLLM's periodic operator line, every `interval` s while there is traffic:
    `Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s, Running: N reqs, Waiting: M reqs,
    KV cache usage: Z%` (+ the offload hit ratio when offloading), then the interval's engine-loop iterations:
    `Iterations: N, median X ms, max Y ms (its step Z ms: D decode rows, P prefill tokens), over 100 ms: K`. An
    iteration is what every running request waits between two of its tokens: the engine step and the loop's own work
    around it, so a long iteration whose step was short points at the loop (or the HTTP side holding the GIL), one
    whose step was long at the engine."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._t0 = time.monotonic()
        self._prompt = self._gen = 0
        self._iters: list[float] = []
        self._worst: tuple[float, object] = (0.0, None)  # the longest iteration and its step
        self._compiles = 0  # Triton kernels compiled inside the interval's steps (engine_loop.py logs each)

    def on_step(self, step) -> None:
        if step is None:
            return
        self._prompt += step.num_tokens - step.num_decode_tokens
        self._gen += step.num_decode_tokens

    def on_iteration(self, seconds: float, step) -> None:
        """One loop iteration that ran an engine step (`step`: its StepStats) took `seconds` in all."""
        self._iters.append(seconds)
        if seconds > self._worst[0]:
            self._worst = (seconds, step)

    def on_compiles(self, n: int) -> None:
        """`n` Triton kernels compiled inside the last iteration's step."""
        self._compiles += n

    def _iterations(self) -> str:
        if not self._iters:
            return ""
        worst, step = self._worst
        parts = ""
        if step is not None:
            parts = (f" (its step {1e3 * step.seconds:.1f} ms: {step.num_decode_tokens} decode rows, "
                     f"{step.num_tokens - step.num_decode_tokens} prefill tokens)")
        over = sum(t > 0.1 for t in self._iters)
        compiled = f", kernels compiled in steps: {self._compiles}" if self._compiles else ""
        return (f"; Iterations: {len(self._iters)}, median {1e3 * statistics.median(self._iters):.1f} ms, max "
                f"{1e3 * worst:.1f} ms{parts}, over 100 ms: {over}{compiled}")

    def maybe_log(self, running: int, waiting: int, kv: dict) -> None:
        now = time.monotonic()
        dt = now - self._t0
        if dt < self.interval:
            return
        if self._prompt or self._gen or running or waiting:
            total = kv.get("gpu_pages_total") or 1
            extra = ""
            if kv.get("offload"):
                hit, missed = kv.get("pages_hit", 0), kv.get("pages_missed", 0)
                extra = f", KV offload hit ratio: {100 * hit / max(hit + missed, 1):.1f}%"
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                        "reqs, Waiting: %d reqs, KV cache usage: %.1f%%%s%s", self._prompt / dt, self._gen / dt,
                        running, waiting, 100 * kv.get("gpu_pages_used", 0) / total, extra, self._iterations())
        self._iters, self._worst, self._compiles = [], (0.0, None), 0
        self._t0, self._prompt, self._gen = now, 0, 0
