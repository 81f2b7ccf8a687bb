"""Where a decode step's time goes: the last N decode steps of a `bench decode` run under torch.profiler.

The question it answers is the one a missed speed goal raises (docs/benchmarks.md): of a step's wall time, how much
is device work, and which kernels take it. Reported per profiled step: wall ms (host clock around `engine.step()`,
synchronized), device ms (the sum of every kernel's own device time: kernels replayed inside CUDA graphs included),
and the top kernels by device time with their calls per step. Wall minus device is what the GPU spent waiting on the
host (Python, scheduling, host syncs, launches). On a CPU the table ranks operators by their own CPU time instead.
Profiled steps are left out of the decode rate (the profiler slows them down).

`breakdown` (ms per step) sorts every profiled kernel (or, on a CPU, operator) into the costs the docs discuss, by
its name (`CATEGORIES`, first match wins): the weights' matmuls, attention, the sparse selection, KV movement
(installs, staging gathers, writes), communication (NCCL); `other` is the rest of the device time, and `host` is wall
minus device time (the GPU waiting on the host; negative where streams overlapped). The parts sum to the wall time.
"""
from __future__ import annotations

TOP = 25
# (category, substrings of kernel / operator names): the first category with a match takes the kernel
CATEGORIES = (
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "broadcast")),
    ("kv_movement", ("_copy_chunks", "_store_kv", "_scatter_rows", "index_copy", "_mark_reads", "memcpy", "Memcpy")),
    ("selection", ("_chunk_score", "_exact_rows", "_topk", "_box_", "_key_mass", "_prune", "topk", "sort",
                   "_cascade_plan")),
    ("attention", ("_bsa", "_paged_decode", "_paged_prefill", "_combine", "_range_attention", "_psa_", "flash",
                   "cudnn", "fmha", "sdpa", "scaled_dot_product", "_cascade_insert")),
    ("weights", ("nvjet", "gemm", "gemv", "cutlass", "splitkreduce", "scaled_mm", "aten::linear", "aten::mm",
                 "aten::addmm", "aten::matmul", "aten::bmm")),
)


def breakdown(rows: list[dict], wall_ms: float) -> dict:
    """{category: ms per step} of `rows` (every kernel's ms_per_step), plus `other` (device time in no category) and
    `host` (wall - device): the values sum to `wall_ms`."""
    out = {name: 0.0 for name, _ in CATEGORIES}
    other = 0.0
    for r in rows:
        low = r["name"].lower()
        cat = next((name for name, keys in CATEGORIES if any(k.lower() in low for k in keys)), None)
        if cat is None:
            other += r["ms_per_step"]
        else:
            out[cat] += r["ms_per_step"]
    busy = sum(out.values()) + other
    return {**out, "other": other, "host": wall_ms - busy}


class StepProfiler:
    """Profiles the engine steps it is told to (decode or prefill); `report()` summarises them (None when none ran)."""

    def __init__(self, device, trace: str | None = None) -> None:
        import torch

        self.cuda = device.type == "cuda"
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._acts = acts
        self._trace = trace  # a path: the profiled steps' Chrome trace is written there when profiling ends
        self._prof = None
        self._stopped = False
        self.steps = 0
        self.wall_s = 0.0

    def start(self) -> None:
        import torch

        if self._prof is None:
            self._prof = torch.profiler.profile(activities=self._acts)
            self._prof.__enter__()

    def record(self, seconds: float) -> None:
        self.steps += 1
        self.wall_s += seconds

    def stop(self) -> None:
        """End profiling (the steps recorded so far are what `report` summarises); a no-op when not started."""
        if self._prof is not None and not self._stopped:
            self._prof.__exit__(None, None, None)
            self._stopped = True
            if self._trace and self.steps:
                self._prof.export_chrome_trace(self._trace)

    def report(self) -> dict | None:
        if self._prof is None:
            return None
        self.stop()
        n = max(1, self.steps)
        rows = []
        for evt in self._prof.key_averages():
            if self.cuda:
                us = getattr(evt, "self_device_time_total", None)
                if us is None:
                    us = getattr(evt, "self_cuda_time_total", 0)
            else:
                us = evt.self_cpu_time_total
            if us > 0:
                rows.append({"name": evt.key, "calls_per_step": evt.count / n, "ms_per_step": us / 1000 / n})
        rows.sort(key=lambda r: -r["ms_per_step"])
        busy = sum(r["ms_per_step"] for r in rows)
        wall = self.wall_s * 1000 / n
        return {"steps": self.steps, "clock": "device" if self.cuda else "cpu",
                "wall_ms_per_step": wall, "busy_ms_per_step": busy, "breakdown_ms_per_step": breakdown(rows, wall),
                "top": rows[:TOP]}


def format_report(label: str, rep: dict) -> str:
    lines = [f"{label}: {rep['steps']} profiled steps, wall {rep['wall_ms_per_step']:.2f} ms/step, "
             f"{rep['clock']} busy {rep['busy_ms_per_step']:.2f} ms/step"]
    if "breakdown_ms_per_step" in rep:
        lines.append("  breakdown (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                            rep["breakdown_ms_per_step"].items()))
    for r in rep["top"]:
        lines.append(f"  {r['ms_per_step']:8.3f} ms  {r['calls_per_step']:7.1f}x  {r['name'][:90]}")
    return "\n".join(lines)
