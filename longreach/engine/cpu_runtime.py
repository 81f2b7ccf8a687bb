"""How torch runs on a CPU: its thread count (`--cpu-threads N`, or chosen from the cores that are actually free) and
glibc's allocator.

Threads. Torch starts one thread per core, and every op waits for all of its threads. When another process keeps a
core busy, each op waits for the thread that shares that core, so a run of many small ops (the sparse methods'
PyTorch references) crawls: no faster than one thread alone once another process takes half a core, and slower
beyond (docs/benchmarks.md, "On a CPU", has the measurements).
Auto: the cores this process may run on (its affinity) minus the cores other processes kept busy while the engine
loaded its model (from /proc/stat, less this process's own CPU time), at least 1. A core counts as taken once others
use more than `TAKEN_FROM` of it, below the break-even half: one thread too few costs at most its share of the work,
one too many can cost several times the run. The user's own choice wins: OMP_NUM_THREADS or MKL_NUM_THREADS in the
environment, or a `torch.set_num_threads` call made before the engine starts, are left as they are.

Allocator. glibc serves every allocation above 32 MiB with its own mmap and unmaps it when freed, so each large
temporary (a prefill chunk's scores) is faulted in page by page again, a share of a CPU prefill worth saving
(docs/benchmarks.md, "On a CPU"). `keep_freed_memory` has glibc serve them from its heap and keep what is freed for
the next one, as MALLOC_MMAP_MAX_=0 would; the process's peak memory stays what it was, but it is not returned to the
system until the process exits. Left alone when the user set any MALLOC_* variable, and outside glibc.
"""
from __future__ import annotations

import math
import os
import time

TAKEN_FROM = 0.25  # share of a core that other processes must use for it to count as taken
MIN_SAMPLE_S = 0.3  # the shortest window the load is measured over
_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_applied: int | None = None  # what this module last gave torch.set_num_threads (not the user's own setting)


def choose_threads(cores: int, busy_elsewhere: float) -> int:
    """Threads for `cores` usable cores when other processes keep `busy_elsewhere` cores busy (0.0 = idle)."""
    taken = math.floor(max(busy_elsewhere, 0.0) + 1.0 - TAKEN_FROM)
    return max(1, cores - taken)


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _cpu_busy_ticks(cpus: list[int]) -> int | None:
    """Busy clock ticks (everything but idle and iowait; steal too: a hypervisor's other guests) summed over
    `cpus`, from /proc/stat; None where there is no /proc."""
    want = {f"cpu{c}" for c in cpus}
    try:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    total = 0
    for row in rows:
        if row[0] in want:
            ticks = [int(x) for x in row[1:9]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks) - ticks[3] - ticks[4]
    return total


def _own_ticks() -> int | None:
    """This process's CPU time (user + system, every thread) in clock ticks."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # the command name may hold spaces
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


class LoadSample:
    """Cores kept busy by other processes between `LoadSample()` and `busy_elsewhere()`: start it, do the work
    you would anyway (load the model), then read it."""

    def __init__(self):
        self.cpus = usable_cpus()
        self._t0 = time.monotonic()
        self._busy0, self._own0 = _cpu_busy_ticks(self.cpus), _own_ticks()

    def busy_elsewhere(self) -> float | None:
        """Cores busy with other processes over the window (None where /proc cannot say)."""
        if self._busy0 is None or self._own0 is None:
            return None
        wait = MIN_SAMPLE_S - (time.monotonic() - self._t0)
        if wait > 0:
            time.sleep(wait)
        busy, own = _cpu_busy_ticks(self.cpus), _own_ticks()
        seconds = time.monotonic() - self._t0
        if busy is None or own is None:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        return max(0.0, ((busy - self._busy0) - (own - self._own0)) / hz / seconds)


def _torch_defaults() -> set[int]:
    """Thread counts torch may have chosen by itself: one per logical CPU, usable CPU or physical core."""
    counts = {os.cpu_count() or 1, len(usable_cpus())}
    cores = set()
    for cpu in usable_cpus():
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as a, open(base + "core_id") as b:
                cores.add((a.read().strip(), b.read().strip()))
        except OSError:
            break
    if cores:
        counts.add(len(cores))
    return counts


def apply(setting: int | None, sample: LoadSample | None) -> str:
    """Set torch's thread count for a CPU run: `setting` threads, or with None the auto rule over `sample`.
    Returns the startup-log text that says how many threads and why."""
    global _applied
    import torch

    if setting is not None:
        torch.set_num_threads(setting)
        _applied = setting
        return f"CPU threads: {setting} (--cpu-threads)"
    for name in _ENV:
        if os.environ.get(name):
            return f"CPU threads: {torch.get_num_threads()} ({name}={os.environ[name]})"
    now = torch.get_num_threads()
    if now != _applied and now not in _torch_defaults():
        return f"CPU threads: {now} (set with torch.set_num_threads)"
    cores = len(sample.cpus) if sample is not None else len(usable_cpus())
    busy = sample.busy_elsewhere() if sample is not None else None
    if busy is None:
        return f"CPU threads: {now} (torch's default; --cpu-threads N to choose)"
    threads = choose_threads(cores, busy)
    torch.set_num_threads(threads)
    _applied = threads
    return (f"CPU threads: {threads} of {cores} cores (auto: other processes kept {busy:.1f} busy; "
            f"--cpu-threads N to choose)")


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)
_malloc_kept = False


def keep_freed_memory() -> bool:
    """Have glibc serve large allocations from its heap and keep freed memory (see the module docstring); once per
    process. True when it is in effect."""
    global _malloc_kept
    if _malloc_kept:
        return True
    if any(k.startswith("MALLOC_") for k in os.environ):
        return False
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    _malloc_kept = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    return _malloc_kept
