"""How a CUDA graph's launch cost grows with its nodes, and whether the GPU waits for the launch to return.

A decode step replays one graph: ~400 nodes for Qwen 0.5B's ordinary sparse step, ~1,000-3,000 for a stage-0 refresh
(docs/kernel-notes.md v22 saw `cudaGraphLaunch` take ~1.8 us per node under the profiler, the GPU starting when it
returned). This times graphs of N tiny kernels (an add on 1,024 floats) replayed whole and as K pieces of N/K nodes
each, back to back: the host time of the replay calls, the wall time to a synchronize, and the GPU's time between
events recorded around them. If the GPU starts only when a launch returns, K pieces hide most of the launch behind
the pieces already running. Needs a CUDA GPU; prints a table and writes JSON (--out).

    python scripts/graph_launch_probe.py --out graph-launch.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def capture(n: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    return g


def measure(graphs: list[torch.cuda.CUDAGraph], iters: int, busy_cycles: int = 0) -> dict:
    """ms per iteration: host time in the replay calls, wall to a synchronize, GPU time between two events."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = wall = gpu = 0.0
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)  # the GPU is busy with the step before when the launch starts
        e0.record()
        t1 = time.perf_counter()
        for g in graphs:
            g.replay()
        t2 = time.perf_counter()
        e1.record()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        host += t2 - t1
        wall += t3 - t0
        gpu += e0.elapsed_time(e1)
    return {"host_ms": 1e3 * host / iters, "wall_ms": 1e3 * wall / iters, "gpu_ms": gpu / iters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[250, 1000, 3000])
    ap.add_argument("--pieces", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    x = torch.zeros(1024, device="cuda")
    rows = []
    for n in args.nodes:
        for k in args.pieces:
            graphs = [capture(n // k, x) for _ in range(k)]
            for busy in (0, 2_000_000):
                r = measure(graphs, args.iters, busy)
                rows.append({"nodes": n, "pieces": k, "gpu_busy_before": bool(busy), **r})
            del graphs
    print(f"{'nodes':>6} {'pieces':>6} {'busy':>5} {'host ms':>8} {'wall ms':>8} {'gpu ms':>8}")
    for r in rows:
        print(f"{r['nodes']:6d} {r['pieces']:6d} {str(r['gpu_busy_before']):>5} {r['host_ms']:8.3f} "
              f"{r['wall_ms']:8.3f} {r['gpu_ms']:8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
