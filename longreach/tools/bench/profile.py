"""Where a decode step's time goes: the last N decode steps of a `bench decode` run under torch.profiler.

The question it answers is the one a missed speed goal raises (docs/benchmarks.md): of a step's wall time, how much
is device work, and which kernels take it. Reported per profiled step: wall ms (host clock around `engine.step()`,
synchronized), device ms (the sum of every kernel's own device time: kernels replayed inside CUDA graphs included),
and the top kernels by device time with their calls per step. Wall minus device is what the GPU spent waiting on the
host (Python, scheduling, host syncs, launches). On a CPU the table ranks operators by their own CPU time instead.
Profiled steps are left out of the decode rate (the profiler slows them down).
"""
from __future__ import annotations

TOP = 15


class StepProfiler:
    """Profiles the engine steps it is told to (decode or prefill); `report()` summarises them (None when none ran)."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._acts = acts
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
        return {"steps": self.steps, "clock": "device" if self.cuda else "cpu",
                "wall_ms_per_step": self.wall_s * 1000 / n, "busy_ms_per_step": busy, "top": rows[:TOP]}


def format_report(label: str, rep: dict) -> str:
    lines = [f"{label}: {rep['steps']} profiled steps, wall {rep['wall_ms_per_step']:.2f} ms/step, "
             f"{rep['clock']} busy {rep['busy_ms_per_step']:.2f} ms/step"]
    for r in rep["top"]:
        lines.append(f"  {r['ms_per_step']:8.3f} ms  {r['calls_per_step']:7.1f}x  {r['name'][:90]}")
    return "\n".join(lines)
