"""Triton kernels and their PyTorch references.

A leaf package: its modules import torch, triton, the standard library, each other and rope/ (the rotation math),
never attention/, kvcache/, engine/ or models/ (tests/test_import_graph.py checks it). The types the kernels consume
live here: the sparse indexes (index_types.py), the fp8 row format (fp8.py), the two-tier page view and the cascading
cache's packed plan (kv_layout.py, cascade_plan.py); attention/ and kvcache/ re-export them for their own
users.

`use_triton` is the one switch between a kernel and its PyTorch reference.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    """Does Triton import here? (CPU-only installs may lack it; everything then runs the references.)"""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _device(x) -> torch.device:
    if isinstance(x, torch.device):
        return x
    if isinstance(x, str):
        return torch.device(x)
    return x.device  # a tensor, or a view with a `device` (kv_layout.TierView)


def use_triton(*where, interpreter: bool = False) -> bool:
    """Run the Triton kernel rather than the PyTorch reference? Yes when Triton imports and any of `where` (tensors,
    devices, or views with a `.device` such as `TierView`) is on CUDA. `interpreter=True` also says yes under
    TRITON_INTERPRET=1, whatever the device (Triton's CPU interpreter: kernels that the tests run there by default)."""
    if not triton_available():
        return False
    if interpreter and os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return any(_device(x).type == "cuda" for x in where)
