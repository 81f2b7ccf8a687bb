"""Launches per layer of the cascading backend's forward, counted on the CPU (no GPU): every PyTorch op it dispatches
that would launch a kernel on a GPU (views and allocations excluded), with the attention, key-mass and (where the
tree has them) kernels/cascade_insert.py's Triton kernels counted as the launches they are on a GPU and run outside
the count. Sizes do not matter, the number of ring levels does: 8 sub-caches (the presets'), rings full, a prefill
step of 4 strides and a decode step, driven by tests/test_cascading_backend.py's `Driver`. docs/kernel-notes.md v16.

    TRITON_INTERPRET=1 python scripts/cascade_op_count.py [--repo DIR]

`--repo`: count another checkout's code (e.g. a `git worktree` of an older commit) with this script.
"""
from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    args = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    root = os.path.abspath(args.repo)
    sys.path[:0] = [os.path.join(root, "tests"), root]
    os.chdir(root)
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    import test_cascading_backend as T
    from longreach.attention.cascading import CascadingBackend

    free = ("view", "slice", "expand", "permute", "select", "unsqueeze", "_unsafe_view", "alias", "detach", "empty",
            "as_strided", "t.default", "squeeze", "_reshape_alias", "lift_fresh", "split", "unbind")
    count = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any(k in str(func) for k in free):
                count[0] += 1
            return func(*args, **(kwargs or {}))

    def outside(f, launches):  # a GPU kernel: counted as its launches, run outside the count
        def g(*a, **kw):
            count[0] += launches
            with _disable_current_modes():
                return f(*a, **kw)
        return g

    class Launch:  # a Triton kernel: kernel[grid](...) is one launch
        def __init__(self, k):
            self.k = k

        def __getitem__(self, grid):
            return outside(self.k[grid], 1)

    CascadingBackend._attend = outside(CascadingBackend._attend, 1)
    CascadingBackend._key_mass = outside(CascadingBackend._key_mass, 2)  # zeros + kernel
    kernels = hasattr(CascadingBackend, "step_kernels")
    if kernels:
        from longreach.kernels import cascade_insert as ci

        CascadingBackend.step_kernels = staticmethod(lambda t: True)
        for name in ("_insert_kernel", "_move_kernel", "_rope_kernel"):
            setattr(ci, name, Launch(getattr(ci, name)))
    fwd, seen = CascadingBackend.forward, []

    def counted(self, *a, **kw):
        count[0] = 0
        with Count():
            out = fwd(self, *a, **kw)
        seen.append(count[0])
        return out

    CascadingBackend.forward = counted
    cfg = {"n_sink": 2, "num_subcaches": 8, "subcache_size": 3, "ema": 0.8, "stride": 4, "block_q": 4, "block_k": 2}
    d = T.Driver(cfg, max_step=16)
    d.add(0, 1600 + 16)
    while d.seqs[0]["t"] < 1600:  # past the cache's reach, 3 x (2^8 - 1) = 765 tokens: every ring full
        d.step({0: 16}, prefill=True)
    prefill = sum(seen[-8:]) / 8
    for _ in range(16):
        d.step({0: 1}, prefill=False)
    decode = sum(seen[-16:]) / 16
    print(f"{root} ({'insertion and RoPE kernels' if kernels else 'PyTorch ops only'}): launches per layer, "
          f"8 sub-caches, rings full: prefill step of 4 strides {prefill:.0f}, decode step {decode:.0f} "
          f"(means of 8 and 16 steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
