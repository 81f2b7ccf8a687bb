"""A real `longreach serve` in a subprocess on 127.0.0.1 for the server tests (vLLM's RemoteOpenAIServer pattern).

Starts the server on a free loopback port, waits for `/health` (bounded), hands out the official `openai` client and an
httpx client, and always stops the process it started (SIGTERM, then SIGKILL) — the log is printed on failure.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

HOST = "127.0.0.1"
SMOLLM2_ARGS = ["smollm2", "--device", "cpu", "--dtype", "float32", "--max-model-len", "2048",
                "--kv-cache-memory-gb", "0.5"]  # the same engine as tests/conftest.py's `smollm2` fixture


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, args: list[str], api_key: str | None = None, env: dict | None = None,
                 startup_timeout: float = 240.0, module: str = "longreach"):
        """`module`: what `python -m` runs with `serve ARGS` (serve_with_faults: the server with faults injected)."""
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 -- closed and removed in stop()
            "w+", prefix="longreach-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", module, "serve", *args, "--host", HOST, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"longreach serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"longreach serve did not answer /health within {timeout:.0f} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-6000:]

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", self.api_key or "none")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def http(self, **kw) -> httpx.Client:
        kw.setdefault("headers", self.headers)
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)
        return self.proc.returncode


def wait_until(fn, timeout: float = 20.0, interval: float = 0.1):
    """Poll `fn()` until it returns something truthy; the last value (falsy on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
