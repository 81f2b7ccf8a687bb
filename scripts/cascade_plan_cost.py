"""Host time of the cascading backend's per-step planning (no model, no GPU): `CascadingBackend.begin_step` for one
sequence prefilled in strides, then decoding token by token, i.e. the ring plan of every sub-cache level, the
batched index tensors and the step's RoPE tables. This is
work every prefill stride and decode step does on the CPU before its layers run (docs/sparse.md, Cascading).

    python scripts/cascade_plan_cost.py [--preset 16k] [--strides 64] [--decode 64]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from longreach.attention.cascading import CascadingBackend  # noqa: E402
from longreach.config import EngineConfig  # noqa: E402
from longreach.models.random_init import random_shape  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="16k")
    ap.add_argument("--strides", type=int, default=64, help="prefill strides to plan (default: 64)")
    ap.add_argument("--decode", type=int, default=64, help="decode steps to plan after them (default: 64)")
    args = ap.parse_args()
    mc = dataclasses.replace(random_shape("random:tiny").config, num_layers=30)  # SmolLM2's layer count
    ec = EngineConfig(model="x", attention="cascading", preset=args.preset, max_model_len=1 << 21, device="cpu")
    backend = CascadingBackend(mc, ec, torch.device("cpu"))
    stride = backend.stride
    pages = backend.kv_layout.max_slots // ec.block_size + 1
    table = torch.arange(pages, dtype=torch.int32)[None]
    times = []
    for k in range(args.strides):
        meta = types.SimpleNamespace(seq_ids=[0], context_lens=[k * stride], query_lens=[stride], block_tables=table,
                                     is_prefill=True)
        t0 = time.perf_counter()
        backend.begin_step(meta)
        times.append(time.perf_counter() - t0)
    steady = sorted(times[len(times) // 2:])  # once the rings are full
    print(f"cascading:{args.preset}, stride {stride}: planning {sum(times) / len(times) * 1e3:.1f} ms per stride on "
          f"average, {steady[len(steady) // 2] * 1e3:.1f} ms median once full ({args.strides} strides, "
          f"{args.strides * stride:,} tokens); at 1M tokens: {(1 << 20) // stride} strides")
    dec = []
    for k in range(args.decode):  # one token per step, as decoding after that prompt
        meta = types.SimpleNamespace(seq_ids=[0], context_lens=[args.strides * stride + k], query_lens=[1],
                                     block_tables=table, is_prefill=False)
        t0 = time.perf_counter()
        backend.begin_step(meta)
        dec.append(time.perf_counter() - t0)
    if dec:
        dec.sort()
        print(f"decode: planning {dec[len(dec) // 2] * 1e3:.2f} ms median per step ({args.decode} steps after "
              f"{args.strides * stride:,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
