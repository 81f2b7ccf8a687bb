"""Progress of long work, for a terminal and for a log: the one helper behind generate, demo, eval and bench.

On a terminal (the stream is a TTY) it is a tqdm bar. Anywhere else (stderr redirected to a file or a pipe, where a
bar's redraws pile up as carriage returns) it writes one line every `interval` seconds while the work runs, and a last
one when it ends:

    [longreach] prefill: 8,192/15,710 tok (52%) | 63.2 tok/s | 2 min 10 s | ETA 1 min 59 s
    [longreach] prefill: 15,710/15,710 tok (100%) | 61.7 tok/s | done in 4 min 15 s

People grep logs for these lines: treat their format as an interface. A background thread keeps both alive while one
step runs for a long time (a long prefill chunk on a CPU): the bar's clock moves and the log line repeats with the
rate so far, so a slow run never looks like a stuck one. Work shorter than `interval` prints no line to a log.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

INTERVAL_S = 30.0  # seconds between log lines; the bar on a terminal redraws every second


def format_seconds(s: float) -> str:
    """12.3 -> '12 s', 130 -> '2 min 10 s', 4000 -> '1 h 06 min'."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """Counts `unit`s of work out of `total` under the name `desc`. `update(n)` when a step did n more,
    `follow_layers` to move inside long CPU steps too, `set_total` when the work turns out smaller (requests that stop
    early), `set_postfix` for a short extra field; `close()` (or a with-block) ends it. Disabled (`enabled=False`),
    every call does nothing. One caller thread (the redraw thread is internal)."""

    def __init__(self, total: int, desc: str, unit: str = "tok", *, enabled: bool = True,
                 stream: TextIO | None = None, interval: float | None = None, leave: bool = True):
        self.total, self.desc, self.unit = max(int(total), 0), desc, unit
        self.n = 0
        self.partial = 0.0  # provisional progress inside the current step (layer by layer), replaced by update()
        self.postfix = ""
        self.enabled = enabled
        self.lines = 0  # log lines written so far
        self._stream = stream if stream is not None else sys.stderr
        self._interval = INTERVAL_S if interval is None else interval
        self._start = time.perf_counter()
        self._bar = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._hooks: list = []
        if not enabled:
            return
        if _is_tty(self._stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit, unit_scale=True, leave=leave,
                             dynamic_ncols=True, file=self._stream)
        self._thread = threading.Thread(target=self._beat, name=f"progress {desc}", daemon=True)
        self._thread.start()

    # ---- the caller's side ----------------------------------------------------------------------------------------
    def update(self, n: int = 1) -> None:
        """`n` more are done (0: none, but the current step ended: its provisional progress is dropped)."""
        if not self.enabled:
            return
        with self._lock:
            self.partial = 0.0
            self.n += max(n, 0)
            self._sync_bar()

    def add_partial(self, amount: float) -> None:
        """Provisional progress inside a long step (a layer of a prefill chunk done): shown at once, replaced by the
        step's `update`."""
        if not self.enabled:
            return
        with self._lock:
            self.partial += amount
            self._sync_bar()

    def follow_layers(self, model, device) -> "Progress":
        """On a CPU, where one prefill chunk can take minutes, advance layer by layer inside a step: each decoder
        layer's forward adds its share of the step's rows as provisional progress, which the step's `update` replaces
        (a decode step's share is dropped the same way). Until `close()`. Nothing on a GPU, where a layer's call
        returns before its kernels run."""
        layers = getattr(model, "layers", None)
        if device.type != "cpu" or not self.enabled or not layers:
            return self
        share = 1.0 / len(layers)

        def hook(module, args, output) -> None:
            self.add_partial(args[0].shape[0] * share)  # args[0]: the layer's input rows (T, hidden)

        self._hooks = [layer.register_forward_hook(hook) for layer in layers]
        return self

    def _sync_bar(self) -> None:
        if self._bar is not None and self.count != self._bar.n:
            self._bar.update(self.count - self._bar.n)

    def set_total(self, total: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.total = max(int(total), self.n)
            if self._bar is not None:
                self._bar.total = self.total
                self._bar.refresh()

    def set_postfix(self, text: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.postfix = text
            if self._bar is not None:
                self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        while self._hooks:
            self._hooks.pop().remove()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.close()
        elif self.lines:  # the last line, only where the work was long enough to have a first
            self._write(self.line(done=True))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def count(self) -> int:
        """Done so far, the current step's provisional share included."""
        return min(self.n + int(self.partial), max(self.total, self.n))

    # ---- the line ---------------------------------------------------------------------------------------------------
    def line(self, done: bool = False) -> str:
        """The log line for now: count, share, rate, elapsed time and ETA (or the total time once done)."""
        elapsed = time.perf_counter() - self._start
        n = self.count
        rate = n / elapsed if elapsed > 0 else 0.0
        parts = [f"{n:,}/{self.total:,} {self.unit}" + (f" ({100 * n / self.total:.0f}%)" if self.total else ""),
                 f"{rate:,.1f} {self.unit}/s"]
        if done:
            parts.append(f"done in {format_seconds(elapsed)}")
        else:
            left = self.total - n
            eta = format_seconds(left / rate) if rate > 0 else "?"
            parts += [format_seconds(elapsed), f"ETA {eta}"]
        if self.postfix:
            parts.append(self.postfix)
        return f"[longreach] {self.desc}: " + " | ".join(parts)

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text + "\n")
            self._stream.flush()
        except (ValueError, OSError):  # the stream was closed under us (interpreter exit)
            pass

    def _beat(self) -> None:
        """The background thread: redraw the bar every second, or write a log line every `interval` seconds."""
        period = 1.0 if self._bar is not None else self._interval
        while not self._stop.wait(period):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()
                else:
                    self.lines += 1
                    self._write(self.line())

