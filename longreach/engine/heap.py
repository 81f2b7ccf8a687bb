"""The Python heap of a long-lived engine: what the garbage collector costs between two tokens.

`freeze_heap`: once loaded and warmed up, collect and move every object alive into the collector's permanent
generation (`gc.freeze`, as vLLM does after its startup). The model, tokenizer, compiled kernels and captured graphs
are hundreds of thousands of objects that live as long as the engine; a full collection walked them all whenever it
ran (~140 ms for SmolLM2's engine on a 2-core CPU, measured with `gc.collect()`), a pause every running request saw
between two tokens. Objects made later are collected as usual. The server calls it after its warm-up
(server/app.py), `bench decode` after each engine's and `bench mixed` after its cold run (so that they measure what
the server runs).

`GcWatch`: the collections that ran, each (generation, seconds), from the interpreter's `gc.callbacks`; `bench
decode` records those inside each decode step, `bench mixed` inside each mixed step, and both report `pauses`.
"""
from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger("longreach")


def freeze_heap() -> None:
    """Collect, then freeze every object alive out of garbage collection (module docstring); logs how many."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info("%d objects of the loaded engine frozen out of garbage collection (gc.freeze) in %.2f s",
                gc.get_freeze_count(), time.perf_counter() - t0)


class GcWatch:
    """Records every garbage collection between `start` and `stop` as (generation, seconds) in `events`."""

    def __init__(self):
        self.events: list[tuple[int, float]] = []
        self._t0: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.events.append((info["generation"], time.perf_counter() - self._t0))
            self._t0 = None

    def start(self) -> "GcWatch":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def pauses(per_step, min_s: float = 1e-3) -> list[tuple[int, int, float]]:
    """(step index, generation, ms) of every collection of >= `min_s` seconds, from each step's GcWatch events."""
    return [(i, gen, round(1e3 * sec, 2)) for i, events in enumerate(per_step) for gen, sec in events if sec >= min_s]
