"""Which Triton kernels compile while something is timed, and for how long: inside a benchmark's timed steps
(`bench decode`), or inside a server's steps after its warm-up (server/engine_loop.py logs each such step, since
a compilation there stalls every stream).

A kernel specialised by a length bucket (a power of two of the candidate count, a stage width) compiles the first
time a run reaches that bucket. `bench decode` warms each engine up on a prompt of one prefill chunk + 4K tokens, so a
1M-token run on a fresh machine can still compile a variant inside its timed prefill (docs/benchmarks.md has one
such stall).
`JitWatch` records every in-process compilation (Triton's `jit_cache_hook` fires before it, `jit_post_compile_hook`
after; a hit in Triton's disk cache counts too, at a few ms), so the report can say what its time includes.
"""
from __future__ import annotations

import time
from collections import Counter


def summarize(events: list[tuple[str, float]]) -> dict:
    """{"count", "seconds", "kernels": {name: count}} of (kernel name, seconds) compilation events."""
    return {"count": len(events), "seconds": round(sum(s for _, s in events), 3),
            "kernels": dict(Counter(name for name, _ in events))}


class JitWatch:
    """Context manager: `events` gets (kernel name, seconds) for each Triton compilation while active. Hooks that
    were installed before are chained (called after ours, their return value kept: a hook may veto a compile). A
    no-op without Triton or without its hook knobs (older versions, the CPU-only case)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self._stack: list[float] = []
        self._knobs = None
        self._prev: tuple = (None, None)

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.events)

    def since(self, mark: int) -> dict:
        """Summary of the events from index `mark` on: {"count", "seconds", "kernels": {name: count}}."""
        return summarize(self.events[mark:])

    def __enter__(self) -> JitWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> JitWatch:
        """Install the hooks (what `with` does on entry); a second start while installed does nothing."""
        if self._knobs is not None:
            return self
        try:
            from triton import knobs
            runtime = knobs.runtime
            self._prev = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        except (ImportError, AttributeError):
            return self
        self._knobs = runtime
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return self

    def stop(self) -> None:
        """Put the earlier hooks back (what `with` does on exit), only where ours are still the installed ones: a
        watch started after this one (another server loop, a benchmark) keeps its own."""
        if self._knobs is not None:
            if self._knobs.jit_cache_hook == self._before:
                self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._prev
            self._knobs = None

    def _before(self, **kw):
        self._stack.append(time.perf_counter())
        prev = self._prev[0]
        vetoed = prev(**kw) if prev is not None else None
        if vetoed:  # the earlier hook skips this compile: no post hook will come
            self._stack.pop()
        return vetoed

    def _after(self, **kw):
        if self._stack:
            fn = kw.get("fn")
            self.events.append((getattr(fn, "name", "?"), time.perf_counter() - self._stack.pop()))
        prev = self._prev[1]
        return prev(**kw) if prev is not None else None
