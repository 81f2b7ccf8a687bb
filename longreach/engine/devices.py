"""The engine's device and dtypes from their flag values (`--device`, `--dtype`, `--kv-cache-dtype`): one place, so
that the lab's estimates size the cache exactly as the engine does."""
from __future__ import annotations

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available here; use --device cpu")
    return torch.device(name)


def resolve_kv_dtype(name: str, run_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: auto = the run dtype; fp8 = e4m3 (kernels dequantise on load)."""
    if name == "auto":
        return run_dtype
    if name == "fp8":
        return torch.float8_e4m3fn
    return _DTYPES[name]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def triton_cache_line() -> str:
    """Where Triton keeps compiled kernels and how many it holds: a fresh cache means the first steps of a sparse
    method compile (tens of seconds on a GPU; the server's warm-up pays it before listening), a warm one loads them."""
    import os

    try:
        from triton import knobs
        where = knobs.cache.dir
    except (ImportError, AttributeError):
        where = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    n = len(os.listdir(where)) if os.path.isdir(where) else 0
    state = (f"{n} compiled kernels cached, reused" if n else
             "empty: kernels compile on first use (set TRITON_CACHE_DIR to keep them across machines)")
    return f"Triton kernel cache {where}: {state}"
