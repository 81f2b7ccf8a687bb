"""Host cost of tensor parallelism's per-step plan on this machine: a decode step's `StepPlan` broadcast from rank 0 to
one worker over the gloo plan group (`TPGroup.broadcast_object`), alone and followed by one 16 KiB gloo all-reduce,
averaged over N steps (docs/design-tensor-parallel.md, "First GPU run"). CPU only; no model.

    python scripts/tp_plan_latency.py [--steps 2000]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.multiprocessing as mp

from longreach.distributed.group import TPGroup, free_port
from longreach.engine.tp_plan import SeqPlan, StepPlan


def _plan() -> StepPlan:  # one sequence decoding at 32K: one token, no new page
    return StepPlan(False, 1, False, [SeqPlan(7, 32767, 32768, [123], 2048, [], -1)], [])


def _rank(rank: int, port: int, steps: int) -> None:
    g = TPGroup.connect(rank, 2, port, torch.device("cpu"))
    x = torch.zeros(4096)
    for mode in ("plan", "plan + all-reduce"):
        t0 = time.perf_counter()
        for _ in range(steps):
            g.broadcast_object(_plan() if rank == 0 else None)
            if mode != "plan":
                g.all_reduce(x)
        if rank == 0:
            print(f"{mode}: {(time.perf_counter() - t0) / steps * 1e6:.0f} us per step", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    mp.spawn(_rank, args=(free_port(), args.steps), nprocs=2)


if __name__ == "__main__":
    main()
