"""`longreach bench serve`'s report: per-group latency statistics, the stalls a long prefill causes, the server's
memory over the run, and the printed table.

Groups: `all`; with long prompts, `short`, `long` and `short_during_long_prefill` (short requests whose life overlapped
a long prompt's prefill, i.e. [its start, its first token]). Per group: completed / failed, throughput, and TTFT, TPOT,
ITL, E2EL in ms (mean, median, p99, max).

`stalls_during_long_prefill` answers "did any chat stop while a long prompt was read": every gap between two
consecutive streamed chunks of a short request that overlaps a long prompt's prefill window, as ms statistics, with
the count of gaps above 100 ms and the worst gap's request. A request's wait for its first token is not a gap (TTFT
covers it).

`server_samples` (with --sample-metrics S): the server's Prometheus gauges every S seconds (running, waiting, KV-cache
usage, process RSS, GPU memory allocated / reserved), and `server_memory`: their first, last and max over the run, and
the drift from a fifth of the way in to the end, which says whether memory stayed flat under a long load.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict

STALL_MS = 100.0  # a gap above this while a long prompt is read counts as a stall (issue 30's goal)
GAUGES = {  # /metrics name -> sample key
    "longreach:num_requests_running": "running", "longreach:num_requests_waiting": "waiting",
    "longreach:kv_cache_usage_perc": "kv_usage", "longreach:process_resident_memory_bytes": "rss_bytes",
    "longreach:gpu_memory_allocated_bytes": "gpu_allocated_bytes",
    "longreach:gpu_memory_reserved_bytes": "gpu_reserved_bytes"}


def ms_stats(values: list[float]) -> dict:
    """Seconds -> ms mean, median, p99 (nearest rank) and max; None each when there are no values."""
    if not values:
        return {"mean": None, "median": None, "p99": None, "max": None}
    v = sorted(values)
    p99 = v[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)]
    return {"mean": 1e3 * statistics.fmean(v), "median": 1e3 * statistics.median(v), "p99": 1e3 * p99,
            "max": 1e3 * v[-1]}


def group_summary(rs: list, duration: float) -> dict:
    ok = [r for r in rs if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(rs) - len(ok),
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": ms_stats([r.ttft for r in ok]), "tpot_ms": ms_stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": ms_stats([x for r in ok for x in r.itl]), "e2el_ms": ms_stats([r.e2el for r in ok]),
    }


def stalls(shorts: list, windows: list[tuple[float, float]]) -> dict:
    """The gaps between consecutive chunks of `shorts` that overlap a window (module docstring)."""
    gaps, worst = [], (0.0, None)
    for i, r in enumerate(shorts):
        if not r.success:
            continue
        for a, b in zip(r.token_times, r.token_times[1:]):
            if any(a < hi and b > lo for lo, hi in windows):
                gaps.append(b - a)
                if b - a > worst[0]:
                    worst = (b - a, {"request": i, "gap_start_s": a, "gap_ms": 1e3 * (b - a)})
    return {"gaps": len(gaps), **ms_stats(gaps), f"over_{STALL_MS:g}ms": sum(g * 1e3 > STALL_MS for g in gaps),
            "worst": worst[1]}


def parse_gauges(text: str) -> dict:
    """GAUGES' values out of a Prometheus text exposition (the first series of each name)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        key = GAUGES.get(name.strip())
        if key and key not in out:
            try:
                out[key] = float(rest.rsplit(" ", 1)[-1])
            except ValueError:
                pass
    return out


def memory_summary(samples: list[dict]) -> dict:
    """First, last and max of each gauge over the samples, and its value once a fifth of the run has passed
    (`settled`: warm-up allocations are behind it) with the change from there to the end (`drift`)."""
    keys = sorted({k for s in samples for k in s if k not in ("t", "error")})
    end = max((s["t"] for s in samples), default=0.0)
    out = {}
    for k in keys:
        pts = [(s["t"], s[k]) for s in samples if k in s]
        if pts:
            settled = next((v for t, v in pts if t >= 0.2 * end), pts[-1][1])
            out[k] = {"first": pts[0][1], "last": pts[-1][1], "max": max(v for _, v in pts), "settled": settled,
                      "drift": pts[-1][1] - settled}
    return out


def report(results: list, duration: float, meta: dict, samples: list[dict] | None = None) -> dict:
    groups = {"all": results}
    extra = {}
    longs = [r for r in results if r.group == "long"]
    if longs:
        shorts = [r for r in results if r.group == "short"]
        windows = [(r.start, r.start + r.ttft) for r in longs if r.success]  # each long prompt's prefill
        groups.update(short=shorts, long=longs, short_during_long_prefill=[
            r for r in shorts if any(r.start < b and r.start + r.e2el > a for a, b in windows)])
        extra["long_prefill_windows_s"] = windows
        extra["stalls_during_long_prefill"] = stalls(shorts, windows)
    if samples is not None:
        extra["server_samples"] = samples
        extra["server_memory"] = memory_summary(samples)
    hidden = {"itl", "token_times"}
    return {**meta, "duration_s": duration,
            "groups": {name: group_summary(rs, duration) for name, rs in groups.items() if rs},
            **extra,
            "errors": sorted({r.error for r in results if r.error})[:20],
            "requests": [{k: v for k, v in asdict(r).items() if k not in hidden} for r in results]}


def format_table(rep: dict) -> str:
    names = list(rep["groups"])
    rows = [("successful requests", lambda g: f"{g['completed']}"), ("failed requests", lambda g: f"{g['failed']}"),
            ("request throughput (req/s)", lambda g: f"{g['request_throughput']:.2f}"),
            ("output token throughput (tok/s)", lambda g: f"{g['output_throughput']:.1f}"),
            ("total token throughput (tok/s)", lambda g: f"{g['total_token_throughput']:.1f}")]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99", "max"):
            rows.append((f"{metric.upper()} {stat} (ms)", lambda g, m=metric, s=stat: "-" if g[f"{m}_ms"][s] is None
                         else f"{g[f'{m}_ms'][s]:.2f}"))
    width = max(len(r[0]) for r in rows)
    cols = [max(12, len(n)) for n in names]
    title = (f"{'=' * 20} longreach bench serve: {rep['endpoint']}, {rep['num_prompts']} requests, "
             f"{rep['duration_s']:.1f} s {'=' * 20}")
    lines = [title,
             f"{'':<{width}}  " + "  ".join(f"{n:>{c}}" for n, c in zip(names, cols))]
    for label, fn in rows:
        lines.append(f"{label:<{width}}  " + "  ".join(f"{fn(rep['groups'][n]):>{c}}" for n, c in zip(names, cols)))
    if (st := rep.get("stalls_during_long_prefill")) and st["gaps"]:
        lines.append(f"short requests' gaps while a long prompt was prefilled: {st['gaps']}, p99 {st['p99']:.1f} ms, "
                     f"max {st['max']:.1f} ms, {st[f'over_{STALL_MS:g}ms']} over {STALL_MS:g} ms")
    for key, m in rep.get("server_memory", {}).items():
        if key.endswith("_bytes"):
            lines.append(f"server {key[:-6]}: first {m['first'] / 2**20:.0f} MiB, after a fifth of the run "
                         f"{m['settled'] / 2**20:.0f} MiB, last {m['last'] / 2**20:.0f} MiB (drift "
                         f"{m['drift'] / 2**20:+.0f} MiB), max {m['max'] / 2**20:.0f} MiB")
    if rep["errors"]:
        lines.append("errors: " + "; ".join(rep["errors"][:5]))
    return "\n".join(lines)
