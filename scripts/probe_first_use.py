"""Probe (not part of longreach): is the first `torch.topk` of a new k slow on a GPU (a lazily loaded sort kernel)?
The after-step install (kvcache/offload.py `_install`) runs topk over the pool's stamps with k = the missed units."""
import time

import torch

d = torch.device("cuda")
S = 909489
stamp = torch.randint(-1, 40, (S,), device=d)


def t(k, label, **kw):
    torch.cuda.synchronize()
    a = time.perf_counter()
    torch.topk(stamp, k, largest=False, **kw)
    torch.cuda.synchronize()
    print(f"{label}: topk k={k} {kw} {1000 * (time.perf_counter() - a):.2f} ms", flush=True)


t(20704, "first")
t(20704, "again")
t(256, "first")
t(256, "again")
t(300, "first", sorted=False)
t(300, "again", sorted=False)
t(100, "first", sorted=False)
t(5000, "first", sorted=False)
t(100, "first")
