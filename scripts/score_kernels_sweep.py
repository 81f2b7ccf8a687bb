"""Time the selection stages' scoring kernels of a long prefill step in both layouts, on a GPU; print a table, write
JSON.

    python scripts/score_kernels_sweep.py OUT.json [--shape 8b-1m] [--prefix P] [--step S] [--stages 0 1 2]
    TRITON_INTERPRET=1 python scripts/score_kernels_sweep.py OUT.json --device cpu --prefix 3000 --step 128 \
        --candidates 16  # a smoke run

The shape is the 1M prefill profile's (docs/benchmarks.md, "Where the default's 1M time goes"): one layer of the 8B
shape (32 query heads, 8 KV heads, head dim 128, 16-token pages, fp8 KV rows with their scales), a 65,536-token
prefill step after a prefix of 85% of 1M, 64-row query blocks, `3k-box`'s stages with `rt` pruning positions:
  stage 0   every 64-token chunk of the prefix scored from its bf16 min/max box (kernels/key_boxes.py), moved and
            stored flavours;
  stage 1   1,024 candidate 32-token chunks per block and KV head scored exactly (kernels/prune_stage.py);
  stage 2   1,024 candidate 8-token chunks (`--candidates`: both stages' count).
Each kernel runs in its first layout (many programs over candidate tiles, every row per program: `rows_tile` 0) and
in the long-prefill layout at several row tiles, candidate tiles and warps. Every configuration is checked against
the first layout (the largest difference relative to the scores' scale; the top-k sets' overlap at the stage's
budget), then timed by CUDA events (median of 5 after a warm-up call). A configuration that fails to compile or run
is reported with its error and skipped. Random keys and queries: the timings do not depend on the values.

`--shape qwen05-128k`: Qwen2.5-Coder-0.5B's layer instead (14 query heads, 2 KV heads, head dim 64, bf16 KV rows,
RoPE theta 1e6, trained 32K) at the last 32,768-token step of a 128K prefill (prefix 98,304): where its 128K prefill
loses to dense (issue 31).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

PAGE, BQ, N_WINDOW, N_SINK = 16, 64, 1024, 256
# name -> (query heads, KV heads, head dim, fp8 KV, RoPE theta, trained length, prefix, step)
SHAPES = {"8b-1m": (32, 8, 128, True, 500000.0, 131072, 891289, 65536),
          "qwen05-128k": (14, 2, 64, False, 1000000.0, 32768, 98304, 32768)}
# (rows_tile, candidate tile, warps); rows_tile 0: the first layout at its own defaults
BOX_CONFIGS = [(0, None, None), (64, 64, 4), (128, 32, 8), (128, 64, 8), (128, 64, 4), (128, 128, 8),
               (256, 32, 8), (256, 64, 8), (512, 32, 8), (512, 64, 16)]
EXACT_CONFIGS = [(0, None, None), (64, None, 4), (128, None, 8), (128, None, 4), (128, "wide", 8),
                 (256, None, 8), (256, "narrow", 8), (512, None, 8), (512, None, 16)]


def median_ms(fn, reps: int = 5) -> float:
    """tests/gpu/common.py's CUDA-event median in ms; in the interpreter's smoke run, one wall-clock call."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from gpu.common import median_us

    return median_us(fn, reps) / 1e3


def compare(got: torch.Tensor, ref: torch.Tensor, k: int) -> tuple[float, float]:
    """(largest |got - ref| over finite scores / the scores' largest |value|, mean top-k overlap)."""
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(got)):
        return float("inf"), 0.0
    rel = ((got[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item()
    k = min(k, ref.shape[-1])
    a = ref.topk(k, dim=-1).indices.sort(dim=-1).values
    b = got.topk(k, dim=-1).indices.sort(dim=-1).values
    hit = torch.zeros(ref.shape, dtype=torch.bool, device=ref.device).scatter_(-1, a, True)
    overlap = hit.gather(-1, b).float().mean().item()
    return rel, overlap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b-1m")
    ap.add_argument("--prefix", type=int, help="tokens before the step (default: the shape's)")
    ap.add_argument("--step", type=int, help="the prefill step's tokens (default: the shape's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--candidates", type=int, default=1024, help="candidate chunks per block in stages 1 and 2")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2], help="the stages to time")
    args = ap.parse_args()
    HQ, HKV, D, fp8, theta, trained, prefix, step = SHAPES[args.shape]
    args.prefix = prefix if args.prefix is None else args.prefix
    args.step = step if args.step is None else args.step
    from longreach.kernels.chunk_box import box_move, box_queries
    from gpu.common import random_fp8_key_pages, random_paged_kv
    from longreach.kernels.key_boxes import box_scores_triton, build_boxes_triton
    from longreach.kernels.prune_stage import chunk_scores_triton
    from longreach.models.config import RopeConfig
    from longreach.rope.scaling import rope_inv_freq
    from longreach.rope.strategies import RopeArgs

    dev = args.device
    g = torch.Generator(device=dev).manual_seed(0)
    if fp8:
        kc, table = random_fp8_key_pages(dev, g, args.prefix + args.step, PAGE, HKV, D)
    else:
        kc, _, tables = random_paged_kv(dev, g, [args.prefix + args.step], PAGE, HKV, D,
                                        torch.bfloat16 if dev == "cuda" else torch.float16)
        table = tables[0]
    inv = rope_inv_freq(RopeConfig(theta=theta), D)[0].to(dev)
    rope = RopeArgs("rt", inv, rope_from=trained, n_window=N_WINDOW)
    nb = args.step // BQ
    q = torch.randn(args.step, HQ, D, device=dev, generator=g).to(torch.bfloat16 if dev == "cuda" else torch.float16)
    starts = torch.arange(nb, device=dev, dtype=torch.int32) * BQ
    lens = torch.full((nb,), BQ, dtype=torch.int32, device=dev)
    cand_end = (args.prefix + starts + BQ - N_WINDOW).int()
    rows = []
    info = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if dev == "cuda" else dev,
            "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "shape": dict(name=args.shape, Hq=HQ, Hkv=HKV, D=D, fp8=fp8, page=PAGE, block_q=BQ),
            "prefix": args.prefix, "step": args.step, "rows": rows}

    def run(stage: str, fn, configs, k: int) -> None:
        ref = None
        for cfg in configs:
            label = "first layout" if cfg[0] == 0 else f"rows {cfg[0]}, tile {cfg[1]}, warps {cfg[2]}"
            row = dict(stage=stage, config=label)
            try:
                out = fn(cfg)
                if ref is None:
                    ref = out
                row["rel_diff"], row["topk_overlap"] = compare(out, ref, k)
                row["ms"] = median_ms(lambda: fn(cfg))
                row["x_first"] = rows[[r["stage"] for r in rows].index(stage)]["ms"] / row["ms"] if cfg[0] else 1.0
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(row, flush=True)
            if dev == "cuda":
                torch.cuda.empty_cache()

    # stage 0: boxes of every 64-token chunk, two flavours (stored, moved to rt's key position)
    chunk0, per = 64, 16
    n_chunks = -(-args.prefix // chunk0)
    span = -(-n_chunks // per)
    box_table = torch.randperm(span, device=dev, generator=g).int()
    # bf16 as the engine's store (fp16 in the interpreter, whose bf16 is broken)
    pool = torch.zeros(span * per, 2, 2, HKV, D, dtype=torch.bfloat16 if dev == "cuda" else torch.float16,
                       device=dev)
    lens1 = torch.tensor([args.prefix], dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    build_boxes_triton(kc, table[None], lens1, zero, torch.tensor([n_chunks], dtype=torch.int32, device=dev),
                       box_table[None], pool, per, chunk0, "minmax", n_chunks, box_move(rope))
    qs = q.view(nb, BQ, HQ, D)
    ok = torch.ones(nb, BQ, dtype=torch.bool, device=dev)
    q32, q_moved, moved = box_queries(qs, ok, cand_end, rope)
    every = torch.full((nb,), n_chunks, dtype=torch.int32, device=dev)  # as score_boxes: every box a candidate

    def box(cfg):
        rt, bc, w = cfg
        return box_scores_triton(q32, pool, box_table, per, 0, every, n_chunks, HKV, q_moved, moved,
                                 rows_tile=rt, rows_block_c=bc, rows_warps=w)

    if 0 in args.stages:
        run("stage 0 (boxes)", box, BOX_CONFIGS, 32768 // chunk0)
    # stages 1 and 2: 1,024 candidate chunks per block and KV head, scored exactly with rt positions
    for i, stage, chunk, k in ((1, "stage 1 (exact, 32)", 32, 8192), (2, "stage 2 (exact, 8)", 8, 2048)):
        if i not in args.stages:
            continue
        hi_c = (cand_end // chunk).long()
        ids = (torch.rand(nb, HKV, args.candidates, device=dev, generator=g) * hi_c[:, None, None]).long()
        ids = ids.sort(dim=-1).values.int()

        def exact(cfg, chunk=chunk, ids=ids):
            rt, bc, w = cfg
            keys = {"wide": 256, "narrow": 64}.get(bc, 128)
            return chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, True, N_SINK, HKV,
                                       max_rows=BQ, rope=rope, rows_tile=rt, rows_warps=w,
                                       block_c=None if rt == 0 else keys // chunk)

        run(stage, exact, EXACT_CONFIGS, k // chunk)
    pathlib.Path(args.out).write_text(json.dumps(info, indent=1))
    print(f"\n{'stage':22} {'config':30} {'ms':>9} {'x first':>8} {'rel diff':>9} {'top-k':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['stage']:22} {r['config']:30} {r['error'][:60]}")
        else:
            print(f"{r['stage']:22} {r['config']:30} {r['ms']:9.2f} {r['x_first']:8.2f} {r['rel_diff']:9.1e} "
                  f"{r['topk_overlap']:6.3f}")


if __name__ == "__main__":
    main()
