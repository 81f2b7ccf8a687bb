"""Time the fp8 GEMV's two strategies (kernels/fp8_gemv.py: "dot", "fma") at a handful of block sizes, warps and
pipeline depths on Llama-8B's four projections, beside the bf16 matmul, on a GPU; print a table, write JSON.

    python scripts/fp8_gemv_sweep.py OUT.json [--rows 1]

Each (configuration, projection): the kernel checked once against the float64 product (its error at most twice the
fp32 reference's rounded to bf16, as tests/gpu/test_fp8.py asks), then timed inside a CUDA graph over copies of the
weights making three times the L2 cache (tests/gpu/common.py's `graph_us`: a decode step's view, no weight in L2).
GB/s counts the weight bytes read (fp8: N * K; bf16: 2 * N * K). The defaults (`launch_config`) and bf16 are timed
at the start and again at the end: the spread of the two is the noise to read differences against. A configuration
that fails to compile or run is reported with its error and skipped. About a minute on an H100 (most of it Triton's
compiles).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

PROJECTIONS_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# (block_n, block_k, num_warps, num_stages, splits); None: launch_config's / gemv_plan's rule
CONFIGS = {
    "dot": [(None, None, None, None, None), (64, 128, 4, 4, None), (64, 256, 4, 3, None), (64, 512, 4, 3, None),
            (64, 256, 8, 4, None), (128, 256, 8, 3, None), (64, 256, 4, 4, 1)],
    "fma": [(None, None, None, None, None), (4, 1024, 4, 3, None), (8, 1024, 4, 3, None), (16, 1024, 4, 3, None),
            (32, 1024, 4, 3, None), (8, 1024, 4, 1, None), (8, 1024, 4, 2, None), (8, 1024, 4, 4, None),
            (8, 512, 4, 3, None), (8, 2048, 8, 3, None), (16, 2048, 8, 3, None), (4, 2048, 8, 4, None),
            (8, 1024, 4, 3, 2), (4, 1024, 4, 3, 2)],
}


def label(strategy: str, cfg: tuple) -> str:
    bn, bk, warps, stages, splits = cfg
    if bn is None:
        return f"{strategy} default"
    return f"{strategy} {bn}x{bk} w{warps} s{stages}" + (f" split{splits}" if splits else "")


def measure(name: str, N: int, K: int, rows: int, dev: torch.device) -> tuple[list, list, dict]:
    """One projection: (a result row per configuration, bf16 us [first, last], each default's us [first, last])."""
    from gpu.common import graph_us, l2_copies, rel_err

    from longreach.kernels.fp8_gemv import fp8_gemv, fp8_gemv_reference, gemv_plan, launch_config
    from longreach.models.fp8 import quantize_rows

    g = torch.Generator(device=dev).manual_seed(N + K)
    qws, scales = zip(*(quantize_rows(torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) * 0.02)
                        for _ in range(l2_copies(N * K))))
    w16 = [(q.float() * s).to(torch.bfloat16) for q, s in zip(qws[:l2_copies(2 * N * K)], scales)]
    x = torch.randn(rows, K, device=dev, generator=g, dtype=torch.bfloat16)
    exact = x.double() @ (qws[0].double() * scales[0].double()).t()
    own = rel_err(fp8_gemv_reference(x, qws[0], scales[0], None), exact)

    def time_bf16():
        return graph_us([lambda w=w: x @ w.t() for w in w16])

    def time_fp8(strategy, cfg):
        bn, bk, warps, stages, splits = cfg
        kw = dict(strategy=strategy, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, splits=splits)
        err = rel_err(fp8_gemv(x, qws[0], scales[0], **kw), exact)
        return graph_us([lambda q=q, s=s: fp8_gemv(x, q, s, **kw) for q, s in zip(qws, scales)]), err

    bf16 = [time_bf16()]
    first = {s: time_fp8(s, CONFIGS[s][0])[0] for s in CONFIGS}
    results = []
    for strategy, configs in CONFIGS.items():
        for cfg in configs:
            row = dict(projection=name, N=N, K=K, rows=rows, strategy=strategy, config=label(strategy, cfg))
            full = launch_config(strategy, rows, N, torch.bfloat16, dev)
            bn, bk = cfg[0] or full["block_n"], cfg[1] or full["block_k"]
            row.update(block_n=bn, block_k=bk, num_warps=cfg[2] or full["num_warps"],
                       num_stages=cfg[3] or full["num_stages"], splits=gemv_plan(N, K, dev, bn, bk, cfg[4])[0])
            try:
                us, err = time_fp8(strategy, cfg)
                row.update(us=us, gb_s=N * K / us / 1e3, rel_err=err, ok=err <= 2 * own + 1e-4, vs_bf16=bf16[0] / us)
            except Exception as e:  # noqa: BLE001 -- a configuration that does not compile is a result too
                row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else repr(e))
            results.append(row)
            print(f"{name:8} {row['config']:30} " + (f"{row['us']:8.1f} us {row['gb_s']:6.0f} GB/s "
                  f"err {row['rel_err']:.1e}{'' if row['ok'] else ' WRONG'}" if "us" in row else row["error"]),
                  flush=True)
    bf16.append(time_bf16())
    noise = {s: [first[s], time_fp8(s, CONFIGS[s][0])[0]] for s in CONFIGS}
    print(f"{name:8} {'bf16':30} {bf16[0]:8.1f} us {2 * N * K / bf16[0] / 1e3:6.0f} GB/s (again: {bf16[1]:.1f}); "
          "defaults again: " + ", ".join(f"{s} {a:.1f} -> {b:.1f}" for s, (a, b) in noise.items()), flush=True)
    return results, bf16, noise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="where the JSON goes")
    ap.add_argument("--rows", type=int, default=1, help="activation rows (decode batch), 1 to 16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    started = time.time()
    results, bf16, noise = [], {}, {}
    for name, (N, K) in PROJECTIONS_8B.items():
        r, bf16[name], noise[name] = measure(name, N, K, args.rows, dev)
        results += r
        torch.cuda.empty_cache()

    names = list(PROJECTIONS_8B)
    by_config: dict[str, dict] = {}
    for r in results:
        by_config.setdefault(r["config"], {})[r["projection"]] = r
    lines = [f"fp8 GEMV sweep, {args.rows} row(s), {torch.cuda.get_device_name(dev)}: us (GB/s of weights) per "
             "projection, in a CUDA graph; sum over the four",
             f"{'config':30} " + " ".join(f"{n + ' ' + 'x'.join(map(str, PROJECTIONS_8B[n])):>20}" for n in names)
             + f" {'sum':>8}"]
    lines.append(f"{'bf16':30} " + " ".join(
        f"{bf16[n][0]:>12.1f} ({2 * PROJECTIONS_8B[n][0] * PROJECTIONS_8B[n][1] / bf16[n][0] / 1e3:>5.0f})"
        for n in names) + f" {sum(bf16[n][0] for n in names):>8.1f}")
    best = {}
    for cfg, per in by_config.items():
        cells, total = [], 0.0
        for n in names:
            r = per.get(n, {})
            if "us" in r and r["ok"]:
                cells.append(f"{r['us']:>12.1f} ({r['gb_s']:>5.0f})")
                total += r["us"]
            else:
                cells.append(f"{'error' if 'error' in r else 'WRONG':>20}")
                total = float("inf")
        lines.append(f"{cfg:30} " + " ".join(cells) + f" {total:>8.1f}")
        strategy = cfg.split()[0]
        if total < best.get(strategy, (None, float("inf")))[1]:
            best[strategy] = (cfg, total)
    fastest = {n: min((r for r in results if r["projection"] == n and r.get("ok")), key=lambda r: r["us"],
                      default=None) for n in names}
    lines.append("best sum per strategy: " + "; ".join(f"{s}: {c} {t:.1f} us" for s, (c, t) in best.items())
                 + f"; bf16 {sum(bf16[n][0] for n in names):.1f} us")
    lines.append("fastest per projection: " + "; ".join(
        f"{n} {r['config']} {r['us']:.1f} us ({bf16[n][0] / r['us']:.2f}x bf16)" for n, r in fastest.items() if r))
    print("\n".join(lines))

    from longreach.tools.report import commit  # $LONGREACH_COMMIT first: a device copy's git view can be stale

    report = dict(device=torch.cuda.get_device_name(dev), rows=args.rows, commit=commit(),
                  command=" ".join(["python", *sys.argv]),
                  seconds=round(time.time() - started, 1), bf16_us=bf16, defaults_twice_us=noise,
                  best_sum=best, results=results, table=lines)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
