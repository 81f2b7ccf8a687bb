"""The GPU tests: kernels against their references in bf16 at real sizes, and the engine on a real model.

    python -m pytest tests/gpu -m gpu --gpu-model /tmp/m/model.gguf [-k SUBSET] [-s]

Every test here is marked `gpu` and skips without CUDA (so a CPU run of the suite collects them and moves on); the
engine tests skip without a model (--gpu-model PATH or $LONGREACH_GPU_MODEL). A test records what it measured with
the `detail` fixture; the run ends with a table of every test's outcome, seconds and detail (the device tool returns
only the tail of the output) and writes them as JSON to --gpu-report PATH, or $OUT/gpu_check.json where $OUT is set,
with the command, the commit and the GPU. `-s` shows the progress lines of the long tests as they come.
"""
from __future__ import annotations

import gc
import json
import os
import pathlib
import shlex
import sys

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is False"
NO_MODEL = ("needs a model: --gpu-model PATH or LONGREACH_GPU_MODEL=PATH (on the device: /tmp/m/model.gguf, "
            "carried by scripts/device_model.sh)")
RESULTS: dict[str, dict] = {}  # node id -> outcome, seconds, detail, in the order the tests ran


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by -m gpu
def pytest_collection_modifyitems(config, items):
    """Every test under tests/gpu is marked `gpu`, and skipped where there is no CUDA."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


def pytest_configure(config):
    """On a GPU, SIGUSR1 prints every thread's Python stack and the run goes on, as with longreach's CLI
    (scripts/device_runs.sh sends it to a run past its time, before killing it)."""
    import faulthandler
    import signal

    if HAS_CUDA and hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


@pytest.fixture
def detail(request):
    """detail(text): what the test measured, one line, for the summary table and the JSON report (printed too)."""
    def record(text: str) -> None:
        request.node.user_properties.append(("detail", text))
        print(text, flush=True)
    return record


@pytest.fixture
def gpu_model(request) -> str:
    """The model of the engine tests: a path (GGUF or HF folder) or an alias; skips the test without one."""
    path = request.config.getoption("--gpu-model")
    if not path:
        pytest.skip(NO_MODEL)
    return path


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    """Each test starts with the cached memory of the one before released (the engine tests size their KV pools in
    GB and run between kernel tests that hold tens of GB)."""
    yield
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def pytest_runtest_logreport(report):
    """One row per test over its setup, call and teardown: outcome, seconds, and its detail, skip reason or error."""
    r = RESULTS.setdefault(report.nodeid, {"test": report.nodeid, "outcome": "passed", "seconds": 0.0,
                                           "detail": ""})
    r["seconds"] = round(r["seconds"] + report.duration, 2)
    if r["outcome"] in ("failed", "error"):
        return  # the first failure's message stays
    if report.skipped:
        r["outcome"] = "skipped"
        r["detail"] = str(report.longrepr[2]).removeprefix("Skipped: ") if isinstance(report.longrepr, tuple) \
            else str(report.longrepr)
    elif report.failed:
        r["outcome"] = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        r["detail"] = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
    else:
        r["detail"] = next((v for k, v in report.user_properties if k == "detail"), r["detail"])


def _report_path(config) -> str | None:
    """--gpu-report, else $OUT/gpu_check.json when $OUT is set and a GPU test ran, else None (no JSON)."""
    if config.getoption("--gpu-report"):
        return config.getoption("--gpu-report")
    if os.environ.get("OUT") and any(r["outcome"] != "skipped" for r in RESULTS.values()):
        return os.path.join(os.environ["OUT"], "gpu_check.json")
    return None


def pytest_sessionfinish(session):
    """The JSON report: the command, where the code and numbers come from (commit, GPU), and every test's row."""
    path = _report_path(session.config)
    if path is None or not RESULTS:
        return
    from longreach.tools.report import provenance

    command = "python -m pytest " + shlex.join(session.config.invocation_params.args)
    report = {"command": command, "provenance": provenance(command),
              "torch": torch.__version__, "results": list(RESULTS.values())}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def pytest_terminal_summary(terminalreporter, config):
    """The table of the GPU tests, last in the output; one line when they all skipped."""
    if not RESULTS:
        return
    tr = terminalreporter
    results = list(RESULTS.values())
    if all(r["outcome"] == "skipped" for r in results):
        reasons = sorted({r["detail"] for r in results})
        tr.write_line(f"gpu tests: {len(results)} skipped ({'; '.join(reasons)})")
        return
    gpu = torch.cuda.get_device_name() if HAS_CUDA else "no GPU"
    path = _report_path(config)
    tr.write_sep("=", f"gpu tests on {gpu}" + (f", report {path}" if path else ""))
    width = max(len(r["test"].rpartition("/")[2]) for r in results)
    for r in results:
        name = r["test"].rpartition("/")[2]
        tr.write_line(f"{r['outcome'].upper():<7} {name:<{width}} {r['seconds']:>7.1f}s  {r['detail']}")
