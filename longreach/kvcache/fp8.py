"""fp8 (e4m3) KV cache rows: the format lives with the kernels that decode it (kernels/fp8.py, which says why it is
what it is); re-exported here for the KV cache's users, who name it with the cache."""
from __future__ import annotations

from ..kernels.fp8 import (  # noqa: F401
    E4M3_MAX, FP8, PAD, as_bytes, dequantize, encode, quantize, row_bytes, row_elems, row_width, values)
