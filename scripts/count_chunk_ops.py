"""Count the host work one infinitehip prefill chunk's attention does outside CUDA graphs, on a CPU (issue 30).

Why: beside decoding requests a paced 256-token chunk of infinitehip costs a step of 25-35 ms on an H200 where dense's
costs ~10 ms (docs/serving.md), and the GPU is busy ~5 ms of it. On the GPU a chunk's layer runs its projections and
MLP from the chunk graphs (engine/chunk_graphs.py) and its prefill selection from a graph per layer
(attention/sparse/prefill_graph.py); everything else in the attention backend is launched op by op from Python. This
counts that remainder per layer: the torch ops dispatched inside `SparseBackend.forward` outside the selection
graph's body, and the Triton launches (the kernels forced on and run by Triton's CPU interpreter, as
scripts/count_decode_ops.py does for a decode step). The selection graph's body is counted apart (on a GPU it is one
replay). CPU op counts are a proxy for GPU launches, not their times.

The model: scripts/count_decode_ops.py's 4-layer tiny Llama (trained 1,024 tokens, 3k-box's stage structure with
budgets scaled down, pruning from the first token), one prompt of `--context` tokens in `--chunk`-token chunks.

  PYTHONPATH=$PWD python scripts/count_chunk_ops.py [--context 4096] [--chunk 256] [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from count_decode_ops import Counter, build, counting_patches, patched  # noqa: E402


def count(context: int = 4096, chunk: int = 256, layers: int = 4, seed: int = 0) -> dict:
    """{"chunks": [(eager ops, Triton launches, selection-graph ops) of each chunk past the first], "ops": Counter of
    the eager ops and launches over those chunks, "layers": layers}."""
    from longreach.attention.sparse.prefill_graph import PrefillGraphs
    from longreach.sampling_params import SamplingParams

    llm = build(context, layers)
    engine = llm.engine
    engine.scheduler.max_num_batched_tokens = chunk  # one chunk a step
    pg = engine.backend.prefill_graphs
    pg.emulate = pg.enabled = True  # the static-buffer path a CUDA graph replays, run eagerly
    counter = Counter()
    graph_ops = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    real_run = PrefillGraphs._run
    inside = {"graph": 0}

    def run(self, *a, **k):  # the selection graph's body: counted apart
        before = collections.Counter(counter.ops)
        inside["graph"] += 1
        try:
            return real_run(self, *a, **k)
        finally:
            inside["graph"] -= 1
            graph_ops.update(counter.ops - before)
            counter.ops.subtract(counter.ops - before)

    patches = counting_patches(counter, lambda name: (graph_ops if inside["graph"] else kernels).update([name]))
    patches.append((PrefillGraphs, "_run", run))
    ids = torch.randint(3, 500, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    engine.add_request("0", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    chunks, total = [], collections.Counter()
    with patched(patches), counter:
        first = True
        while engine.scheduler.prefill_pending():
            counter.ops.clear()
            kernels.clear()
            graph_ops.clear()
            engine.step()
            if first:  # the first chunk (no prefix, graphs captured): left out
                first = False
                continue
            eager = +counter.ops
            chunks.append((sum(eager.values()), sum(kernels.values()), sum(graph_ops.values())))
            total.update(eager)
            total.update(kernels)
    return {"chunks": chunks, "ops": total, "layers": layers, "replays": pg.replays}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    r = count(args.context, args.chunk, args.layers)
    n, L = len(r["chunks"]), r["layers"]
    eager = sum(c[0] for c in r["chunks"]) / n
    launches = sum(c[1] for c in r["chunks"]) / n
    inner = sum(c[2] for c in r["chunks"]) / n
    print(f"infinitehip prefill, {L} layers, {args.chunk}-token chunks of a {args.context}-token prompt ({n} chunks "
          f"counted, {r['replays']} selection-graph runs)")
    print(f"per chunk and layer, outside the selection graph: {eager / L:.1f} torch ops, {launches / L:.1f} Triton "
          f"launches; inside it (one replay on a GPU): {inner / L:.1f}")
    print("per chunk and layer, by op:")
    for name, c in r["ops"].most_common(args.top):
        print(f"  {c / n / L:7.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
