"""Time the chunk-scoring and top-k kernels at InfiniteHiP's 1M-token shapes under several launch settings (GPU).

    python scripts/tune_prune.py [--out DIR]

Llama-3.1-8B heads (32 / 8, d=128), bf16, random keys in 16-token pages. Prefill: the last 32K-query chunk at 1M
(512 query blocks of 64 rows); decode: one row. Prints one line per setting; the choice goes into the launcher's
heuristics and docs/kernel-notes.md.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from longreach.kernels.prune_stage import chunk_scores_triton  # noqa: E402
from longreach.kernels.topk import topk_ascending_triton  # noqa: E402


def bench(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


SETTINGS = {  # stage -> [(rep_per_head, block_c, tiles, tile_first)], prefill at 1M only: few compiles per run
    "s1": [(False, 32, 1, False), (False, 32, 4, False), (False, 32, 1, True), (False, 64, 1, False)],
    "s2": [(False, 32, 1, False), (False, 32, 4, False)],
    "s3": [(False, 16, 1, False), (False, 16, 4, False), (False, 8, 1, False), (False, 4, 1, False)],
}


def main():
    import time

    deadline = time.time() + float(os.environ.get("TUNE_SECONDS", "200"))
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else os.environ.get("OUT", ".")
    dev = "cuda"
    Hq, Hkv, D, L, page = 32, 8, 128, 1 << 20, 16
    g = torch.Generator(device=dev).manual_seed(0)
    kc = torch.randn(L // page, page, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.arange(L // page, device=dev, dtype=torch.int32)
    rows_all = []
    for phase, nb, rows in (("prefill", 512, 64),):
        q = torch.randn(nb * rows, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
        starts = torch.arange(nb, device=dev) * rows
        lens = torch.full((nb,), rows, device=dev)
        cand_end = torch.full((nb,), L - 1024, device=dev)
        for stage, chunk, C, exact in (("s1", 256, 4096, False), ("s2", 32, 1024, False), ("s3", 8, 1024, True)):
            ids = (torch.arange(C, device=dev) + 1).expand(nb, Hkv, C).contiguous()
            for per_head, bc, tiles, tf in SETTINGS[stage]:
                if time.time() > deadline:
                    print("time budget spent", flush=True)
                    break
                try:
                    ms = bench(lambda: chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, exact,
                                                           256, Hkv, rep_per_head=per_head, max_rows=rows,
                                                           block_c=bc, tiles=tiles, tile_first=tf))
                except Exception as e:  # noqa: BLE001
                    ms = float("nan")
                    print("error", phase, stage, per_head, bc, tiles, tf, type(e).__name__, str(e)[:200])
                row = dict(phase=phase, stage=stage, per_head=per_head, block_c=bc, tiles=tiles, tile_first=tf, ms=ms)
                rows_all.append(row)
                print(f"{phase:<8} {stage} {'head' if per_head else 'kv  '} block_c={bc:<3} tiles={tiles} "
                      f"tile_first={int(tf)}  {ms * (1000 if phase == 'decode' else 1):9.3f} "
                      f"{'us' if phase == 'decode' else 'ms'}", flush=True)
                with open(os.path.join(out, "tune_prune.json"), "w") as f:
                    json.dump(rows_all, f, indent=1)
        for C, k in ((4096, 128), (1024, 256)):
            sc = torch.randn(nb, Hkv, C, device=dev, generator=g)
            ids = torch.arange(C, device=dev).expand(nb, Hkv, C).contiguous()
            ms = bench(lambda: topk_ascending_triton(ids, sc, k))
            rows_all.append(dict(phase=phase, stage=f"topk C={C} k={k}", ms=ms))
            print(f"{phase:<8} topk C={C} k={k}  {ms * (1000 if phase == 'decode' else 1):9.3f} "
                  f"{'us' if phase == 'decode' else 'ms'}", flush=True)
            tk = bench(lambda: sc.topk(k, dim=-1))
            print(f"{phase:<8} torch.topk C={C} k={k} (for scale)  {tk * (1000 if phase == 'decode' else 1):9.3f}",
                  flush=True)
    with open(os.path.join(out, "tune_prune.json"), "w") as f:
        json.dump(rows_all, f, indent=1)


if __name__ == "__main__":
    main()
