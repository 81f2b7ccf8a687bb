"""Count the torch ops one pruned infinitehip decode step launches inside the attention backend, on a CPU.

A proxy for the GPU's small kernels (issue 31): a decode step is replayed from a CUDA graph, so every torch op the
selection runs is a kernel launch inside the graph (~2-5 us each on an H200) whatever its size. Here the step runs
on the emulated graph path (`capture_graphs(emulate=True)`: the static-buffer code a CUDA graph captures) with the
Triton kernels forced on and run by Triton's CPU interpreter (TRITON_INTERPRET=1), so the code path is the GPU's.
Counted: every aten op dispatched inside `SparseBackend.forward` that is not a view, an allocation or a metadata
op, outside the Triton launches themselves (the interpreter's own copies are not the GPU's). Each Triton launch is
counted once, by kernel name. CPU op counts are not GPU kernel counts (a CPU op may be fused or split differently
by the CUDA backend, e.g. a cross-device copy or a `.to()` that is a no-op here); they move together.

The model: random weights in a 4-layer tiny Llama shape (layers 0-2 are infinitehip's "early" layers with chunk-
indexed pruning positions, layer 3 relative, as on the 8B shape), trained length 1,024 so that the contexts past it
use the pruning strategies as the 8B run at 128K does; 3k-box's stage structure (chunks 64/32/8, min/max boxes)
with budgets scaled down, dense_below null so the pruned path runs at a 2K context.

  PYTHONPATH=$PWD python scripts/count_decode_ops.py [--steps 16] [--context 2048] [--top 30]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# refresh (16, 8, 4), the paper's, so that 16 steps visit every refresh level; the default 3k-box's (8, 4, 1)
# refreshes the last stage (level 2) or more at every step, so its steady step costs what level 2 counts
CONFIG = {"chunk_sizes": [64, 32, 8], "budgets": [1024, 256, 64], "early_last_budget": 128, "n_sink": 64,
          "n_window": 128, "stage0_scores": "minmax", "dense_below": None, "refresh": [16, 8, 4]}
# ops that launch no kernel on a GPU (views, allocations, metadata); a view-like op that copies (`.to(dtype)`,
# `.contiguous()` or `.reshape()` of a strided tensor) is counted
FREE = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "detach_", "alias", "set_", "resize_"}


def _copies(out, args) -> bool:
    """A view-like op that made a new tensor (a dtype cast, a contiguous copy)."""
    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return (isinstance(out, torch.Tensor) and src is not None
            and out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr())


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.active = False
        self.in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active and not self.in_kernel:
            name = func.overloadpacket.__name__
            if name not in FREE and (not func.is_view or _copies(out, args)):
                self.ops["aten::" + name] += 1
        return out


def counting_patches(counter: Counter, on_launch) -> list:
    """(object, attribute, replacement) patches every op count here applies: the Triton kernels forced on in each
    module that chooses them (the GPU code path, run by Triton's interpreter), each launch made while the counter is
    active handed to `on_launch("triton::NAME")` (the interpreter's own torch ops not counted), and the counter active
    inside `SparseBackend.forward`. Apply them with `patched`."""
    import triton.runtime.interpreter as interp

    import longreach.attention.box_store as box_store
    import longreach.attention.sparse.backend as sparse_backend
    import longreach.attention.sparse.selection as selection
    import longreach.kernels.key_boxes as key_boxes
    from longreach.attention.sparse.backend import SparseBackend

    real_call, real_forward = interp.GridExecutor.__call__, SparseBackend.forward

    def launch(self, *a, **k):
        counter.in_kernel += 1
        try:
            if counter.active:
                on_launch("triton::" + self.fn.__name__)
            return real_call(self, *a, **k)
        finally:
            counter.in_kernel -= 1

    def forward(self, *a, **k):
        counter.active = True
        try:
            return real_forward(self, *a, **k)
        finally:
            counter.active = False

    on = lambda *where, interpreter=False: True  # noqa: E731 - the GPU code path, kernels interpreted
    return ([(m, "use_triton", on) for m in (selection, sparse_backend, box_store, key_boxes)]
            + [(interp.GridExecutor, "__call__", launch), (SparseBackend, "forward", forward)])


@contextlib.contextmanager
def patched(patches: list):
    """Apply (object, attribute, replacement) patches for the block, then put the originals back."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def build(context: int, layers: int, refresh=None):
    from longreach.engine.llm import LLM
    from longreach.models import random_init
    from longreach.models.config import ModelConfig, RopeConfig

    random_init.SHAPES["ops"] = random_init.RandomShape("op-count Llama", ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=layers, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=1024,
        rope=RopeConfig(theta=10000.0), tie_word_embeddings=False, name="random:ops"), "(op counts)")
    import json
    llm = LLM("random:ops", device="cpu", dtype="float32", attention="infinitehip", preset="3k-box",
              attention_config=json.dumps({**CONFIG, **({"refresh": list(refresh)} if refresh else {})}), max_model_len=max(4096, 2 * context), kv_cache_memory_gb=0.05,
              max_num_batched_tokens=1024)
    return llm


def count(steps: int = 16, context: int = 2048, layers: int = 4, seed: int = 0, graph: bool = True, refresh=None):
    """{"per_step": [op count of each decode step], "kernels": [Triton launches of each step], "ops": Counter over
    every step, "levels": the refresh level of each step's variant (None: eager), "by_level": Counter per level,
    "tokens": the sampled tokens, "picked": (layer, blocks, counts) of every attended layer of every step}.
    `graph` False: the eager decode step (no graph variants), the same kernels forced on. `refresh`: the schedule
    (default CONFIG's (16, 8, 4))."""
    from longreach.attention.sparse.backend import SparseBackend
    from longreach.attention.sparse.graph import GraphDecoder
    from longreach.sampling_params import SamplingParams

    llm = build(context, layers, refresh)
    engine = llm.engine
    if graph:
        engine.runner.capture_graphs(emulate=True)
    ids = torch.randint(3, 500, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    engine.add_request("0", ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    while engine.scheduler.prefill_pending():
        engine.step()  # the prefill, eagerly, on the PyTorch references

    counter = Counter()
    kernels: collections.Counter = collections.Counter()
    real_attend = SparseBackend.attend
    picked: list = []  # per attended layer of each step: (blocks, counts) as the attention reads them

    def attend(self, layer, q, k_cache, v_cache, meta, qb, plan_queries, blocks, counts, context_len):
        active, counter.active = counter.active, False  # the copies are not the step's
        picked.append((layer, blocks.clone(), counts.clone()))
        counter.active = active
        return real_attend(self, layer, q, k_cache, v_cache, meta, qb, plan_queries, blocks, counts, context_len)
    real_step = GraphDecoder.step
    keys: list = []

    def graph_step(self, *a, **k):
        key, load = real_step(self, *a, **k)
        keys.append(key)
        return key, load

    patches = counting_patches(counter, lambda name: kernels.update([name]))
    patches += [(GraphDecoder, "step", graph_step), (SparseBackend, "attend", attend)]
    per_step, per_kernels, levels, total = [], [], [], collections.Counter()
    by_level: dict = {}
    tokens = None
    with patched(patches):
        with counter:
            for _ in range(steps):
                counter.ops.clear()
                kernels.clear()
                keys.clear()
                for o in engine.step():
                    tokens = list(o.token_ids)
                per_step.append(sum(counter.ops.values()))
                per_kernels.append(sum(kernels.values()))
                total.update(counter.ops)
                total.update(kernels)
                levels.append(keys[0][1] if keys else None)
                by_level.setdefault(levels[-1], collections.Counter()).update(counter.ops + kernels)
    return {"per_step": per_step, "kernels": per_kernels, "ops": total, "levels": levels, "tokens": tokens,
            "layers": layers, "by_level": by_level, "picked": picked}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="decode steps counted (16: one full refresh cycle)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--by-level", action="store_true", help="the ops of each refresh level, per layer")
    ap.add_argument("--refresh", type=int, nargs="+", help="the decode schedule (default 16 8 4; the default preset's "
                    "is 8 4 1)")
    ap.add_argument("--dump", help="save the sampled tokens and every attended layer's (blocks, counts) here (torch.save)")
    args = ap.parse_args(argv)
    r = count(args.steps, args.context, args.layers, refresh=args.refresh)
    if args.dump:
        torch.save({"tokens": r["tokens"], "picked": r["picked"]}, args.dump)
    n = len(r["per_step"])
    print(f"infinitehip decode, {args.layers} sparse layers, context {args.context}: torch ops inside the attention "
          f"backend per decode step (and Triton launches)")
    for i, (ops, k, lv) in enumerate(zip(r["per_step"], r["kernels"], r["levels"])):
        print(f"  step {i:2d} (refresh level {lv}): {ops:5d} torch ops, {k:3d} Triton launches")
    mean_ops, mean_k = sum(r["per_step"]) / n, sum(r["kernels"]) / n
    print(f"mean: {mean_ops:.1f} torch ops/step ({mean_ops / args.layers:.1f} per layer), "
          f"{mean_k:.1f} Triton launches/step")
    print("per step, by op:")
    for name, c in r["ops"].most_common(args.top):
        print(f"  {c / n:7.2f}  {name}")
    if args.by_level:
        for lv, ops in sorted(r["by_level"].items(), key=lambda x: -1 if x[0] is None else x[0]):
            m = r["levels"].count(lv)
            print(f"refresh level {lv} ({m} steps), per step and layer:")
            for name, c in ops.most_common(args.top):
                print(f"  {c / m / args.layers:7.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
