"""Progress of long work (longreach/progress.py) and the CPU thread count (longreach/engine/cpu_runtime.py)."""
import io
import os
import re
import subprocess
import sys
import time

import pytest

from longreach.engine import cpu_runtime as cpu_threads
from longreach.progress import Progress, format_seconds

LINE = re.compile(r"^\[longreach\] (?P<desc>[\w ]+): (?P<n>[\d,]+)/(?P<total>[\d,]+) tok \(\d+%\) \| [\d,.]+ tok/s \| "
                  r"(?:done in [^|]+|[^|]+ \| ETA [^|]+)(?: \| .*)?$")


def test_format_seconds():
    assert [format_seconds(s) for s in (3.24, 42, 130, 4000)] == ["3.2 s", "42 s", "2 min 10 s", "1 h 06 min"]


def test_a_log_gets_periodic_lines_and_a_last_one():
    out = io.StringIO()  # not a terminal
    with Progress(100, "prefill", stream=out, interval=0.05) as p:
        for _ in range(4):
            time.sleep(0.06)
            p.update(10)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and "\r" not in out.getvalue()
    assert all(LINE.match(line) for line in lines), lines
    assert "ETA" in lines[0] and "done in" in lines[-1]
    assert lines[-1].startswith("[longreach] prefill: 40/100 tok (40%)")


def test_short_work_writes_nothing_to_a_log():
    out = io.StringIO()
    with Progress(10, "decode", stream=out, interval=60) as p:
        p.update(10)
    assert out.getvalue() == ""
    disabled = Progress(10, "decode", stream=out, interval=0.01, enabled=False)
    time.sleep(0.05)
    disabled.update(3)
    disabled.close()
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with Progress(50, "prefill", stream=out) as p:
        p.update(50)
    assert "\r" in out.getvalue() and "100%" in out.getvalue() and "[longreach]" not in out.getvalue()


def test_generate_logs_progress_lines_when_stderr_is_not_a_terminal():
    """The CLI's generate with stderr to a pipe: one-line progress (count, rate, ETA), no bar redraws. The interval is
    shortened so that a short run writes some."""
    code = ("import sys, longreach.progress as p; p.INTERVAL_S = 0.2; from longreach.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "generate", "--prompt", "Once upon a time", "--max-tokens", "24",
                        "--ignore-eos", "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("[longreach] decode:")]
    assert lines and all(LINE.match(line) for line in lines), r.stderr
    assert "ETA" in lines[0] and "done in" in lines[-1] and lines[-1].split()[2] == "23/23"  # + the prefill's token


# ---- CPU threads ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cores, busy, threads", [
    (2, 0.0, 2), (2, 0.2, 2), (2, 0.3, 1), (2, 1.0, 1), (2, 1.2, 1), (2, 2.0, 1), (1, 0.0, 1), (8, 2.5, 5),
    (16, 0.9, 15),
])
def test_thread_rule(cores, busy, threads):
    """Free cores = usable cores - cores others keep busy, a core counting as taken above a quarter of it."""
    assert cpu_threads.choose_threads(cores, busy) == threads


@pytest.fixture
def torch_threads():
    import torch

    before = torch.get_num_threads()
    # start from a count torch picks by itself: an earlier test (or conftest) may have set another one
    torch.set_num_threads(max(cpu_threads._torch_defaults()))
    cpu_threads._applied = None
    yield torch
    torch.set_num_threads(before)
    cpu_threads._applied = None


def test_explicit_settings_win(torch_threads, monkeypatch):
    torch = torch_threads
    assert cpu_threads.apply(3, None) == "CPU threads: 3 (--cpu-threads)" and torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "(OMP_NUM_THREADS=3)" in cpu_threads.apply(None, cpu_threads.LoadSample())
    assert torch.get_num_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    cpu_threads._applied = None
    odd = max(cpu_threads._torch_defaults()) + 3  # no count torch picks by itself: the user's torch.set_num_threads
    torch.set_num_threads(odd)
    assert "torch.set_num_threads" in cpu_threads.apply(None, cpu_threads.LoadSample())
    assert torch.get_num_threads() == odd


def test_auto_follows_the_load(torch_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    sample = cpu_threads.LoadSample()
    monkeypatch.setattr(sample, "busy_elsewhere", lambda: 0.9)
    monkeypatch.setattr(sample, "cpus", [0, 1])
    text = cpu_threads.apply(None, sample)
    assert torch_threads.get_num_threads() == 1 and text.startswith("CPU threads: 1 of 2 cores (auto"), text
    monkeypatch.setattr(sample, "busy_elsewhere", lambda: 0.0)
    cpu_threads.apply(None, sample)  # longreach's own earlier choice is not the user's: auto again
    assert torch_threads.get_num_threads() == 2


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="measures /proc/stat")
def test_load_sample_sees_another_process_and_not_its_own():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        sample = cpu_threads.LoadSample()
        t = time.monotonic()
        while time.monotonic() - t < 0.6:  # this process's own work is not "other processes"
            sum(range(1000))
        seen = sample.busy_elsewhere()
    finally:
        busy.kill()
        busy.wait()
    assert seen is not None and 0.4 <= seen <= len(sample.cpus), seen
