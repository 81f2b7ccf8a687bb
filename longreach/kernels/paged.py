"""Reading rows of the paged KV cache inside a kernel: token position -> page (block table) -> row."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def load_rows(X, page, off, head, stride_p, stride_o, stride_h, d, mask):
        """X[page, off, head, d] for vectors page/off (N,) and d (D,) -> (N, D); rows outside `mask` read as 0."""
        return tl.load(X + page[:, None] * stride_p + off[:, None] * stride_o + head * stride_h + d[None, :],
                       mask=mask[:, None], other=0.0)
