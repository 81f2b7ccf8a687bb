"""Page-locked host memory of an exact size for the offloaded KV cache's host tier (kvcache/offload.py)."""
from __future__ import annotations

import torch

from .fp8 import as_bytes


def pinned_empty(shape: tuple, dtype: torch.dtype, owner: object) -> torch.Tensor:
    """A page-locked host tensor of exactly `shape`, registered with CUDA (cudaHostRegister, mapped and portable)
    and unregistered when `owner` is collected.

    Not `torch.empty(..., pin_memory=True)`: PyTorch's caching host allocator rounds every pinned block up to a power
    of two, so a 72 GiB host tier would pin 128 GiB and fail on a 128 GiB host. The pages are touched first (a
    multi-threaded fill), which makes the registration itself a quick pin of resident memory. Raises RuntimeError
    when CUDA refuses (too little lockable memory)."""
    import weakref

    t = torch.empty(shape, dtype=dtype)
    as_bytes(t).view(-1).zero_()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 3)  # cudaHostRegisterPortable | cudaHostRegisterMapped
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed with CUDA error {int(err)}")
    weakref.finalize(owner, cudart.cudaHostUnregister, t.data_ptr())
    return t
