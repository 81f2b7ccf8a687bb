"""Server configuration: one frozen dataclass whose fields are the `longreach serve` flags beside the engine's.

Pure Python, validated in `__post_init__` with messages that say what is allowed (the CLI turns them into exit 2).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

API_KEY_ENV = "LONGREACH_API_KEY"
MiB = 1 << 20


def _f(default: Any, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerConfig:
    host: str = _f("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = _f(8000, "TCP port")
    served_model_name: tuple[str, ...] = _f((), "model name(s) the API answers to; the first is reported in "
                                                "responses (default: the model argument)", nargs="+")
    api_key: str | None = _f(None, f"require `Authorization: Bearer KEY` on every route but /health, /metrics and "
                                   f"/version (default: ${API_KEY_ENV}, else no key)")
    max_queued_requests: int = _f(1024, "most requests waiting for a place in the running batch; beyond it a new "
                                        "request gets 503 with Retry-After")
    max_request_bytes: int = _f(64 * MiB, "largest request body in bytes (413 beyond it); a 1M-token prompt is "
                                          "about 4 MB of text")
    keep_alive_interval: float = _f(5.0, "seconds between SSE keep-alive comments while a stream waits (e.g. on "
                                         "a long prefill)")
    warmup_tokens: int | None = _f(None, "before listening, run one request of this many prompt tokens (+4 "
                                         "generated) so that kernel compilation happens at startup, not during the "
                                         "first requests (a fresh process compiles for ~30-50 s), then capture a "
                                         "sparse method's prefill-selection graphs and long-context decode variants; "
                                         "default: on a GPU one prefill chunk + 1024 tokens past the longest context a "
                                         "sparse method attends densely at (its dense_below), on a CPU none; 0: none")

    def __post_init__(self) -> None:
        def bad(what: str) -> None:
            raise ValueError(what)

        if not isinstance(self.host, str) or not self.host:
            bad("host must be a non-empty address, e.g. 127.0.0.1 or 0.0.0.0")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            bad(f"port must be an integer in [0, 65535], got {self.port!r}")
        if any(not isinstance(n, str) or not n for n in self.served_model_name):
            bad(f"served_model_name must be non-empty strings, got {self.served_model_name!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.isprintable()
                                         or not self.api_key.strip()):
            bad("api_key must be a non-empty printable string")
        if not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 1:
            bad(f"max_queued_requests must be an integer >= 1, got {self.max_queued_requests!r}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            bad(f"max_request_bytes must be an integer >= 1024, got {self.max_request_bytes!r}")
        if not isinstance(self.keep_alive_interval, (int, float)) or not 0.01 <= self.keep_alive_interval <= 3600:
            bad(f"keep_alive_interval must be in [0.01, 3600] seconds, got {self.keep_alive_interval!r}")
        if self.warmup_tokens is not None and (not isinstance(self.warmup_tokens, int) or self.warmup_tokens < 0):
            bad(f"warmup_tokens must be an integer >= 0 (0: no warm-up), got {self.warmup_tokens!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


_TYPES = {"port": int, "served_model_name": str, "api_key": str, "max_queued_requests": int,
          "max_request_bytes": int, "keep_alive_interval": float, "host": str, "warmup_tokens": int}


def add_server_args(p: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field (names, defaults and help come from the dataclass)."""
    g = p.add_argument_group("server")
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        shown = f" (default: {f.default})" if f.default not in (None, ()) and f.name != "api_key" else ""
        kw = {"nargs": f.metadata["nargs"]} if "nargs" in f.metadata else {}
        g.add_argument(flag, type=_TYPES[f.name], default=f.default, metavar=f.name.upper(),
                       help=f.metadata["help"] + shown, **kw)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = {name: getattr(args, name) for name in ServerConfig.field_names()}
    values["served_model_name"] = tuple(values["served_model_name"] or ())
    if values["api_key"] is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return ServerConfig(**values)
