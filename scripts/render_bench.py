"""scripts/render_docs.py's renderers of `longreach bench` reports.

  bench-engine FILE...             decode and prefill tok/s, longreach vs transformers (files: runs, side by side)
  bench-attention FILE phase=P     one layer, prefill (ms) or decode (us) per context, each against cuDNN
  bench-attention-at LEN FILE...   one context of several runs side by side, every measured variant
  bench-long FILE                  prefill and decode through the engine per length and method (+ eager runs)
  bench-decode FILE... [extrapolate=512K,1M]
                                   bench decode's rows (several files: a run column); dense extrapolated along the
                                   file's own line to the lengths named, marked *
  bench-serve FILE... [group=G]    bench serve's latencies and throughput per run (group: all, short, long,
                                   short_during_long_prefill), with the gaps seen during long prefills
  bench-mixed FILE...              bench mixed's runs: a long prompt alone and beside decoding requests

Values that are not measurements of their own are marked: * extrapolated, "computed" for bench attention's amortised
decode steps (derived from the measured step kinds).
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from render_common import GiB, length, load, num, options, parse_length, sources, table  # noqa: E402


def _t(v: float) -> str:
    return f"{v:,.1f}" if v < 1000 else f"{v:,.0f}"


def bench_engine(args: list[str]) -> str:
    files, _ = options(args)
    items = [load(f) for f in files]
    rows = []
    first = items[0][1]
    for key, label in [(("decode_tok_s", b), f"decode tok/s, batch {b}") for b in first["longreach"]["decode_tok_s"]] \
            + [(("prefill_tok_s", None), f"prefill tok/s, {first['settings']['prefill_len']:,} tokens")]:
        def get(r, side):
            v = r[side][key[0]]
            return v[key[1]] if key[1] is not None else v
        ours = [get(r, "longreach") for _, r in items]
        base = [get(r, "transformers") for _, r in items]
        ratios = [a / b for a, b in zip(ours, base)]
        lo, hi = min(ratios), max(ratios)
        rows.append([label, " / ".join(f"{v:,.0f}" for v in ours), " / ".join(f"{v:,.0f}" for v in base),
                     f"{lo:.1f}x" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}x"])
    runs = " / ".join(f"[{i}]" for i in range(1, len(items) + 1))
    out = table(["metric", f"longreach ({runs})", f"transformers ({runs})", "ratio"], rows)
    rates = first.get("rates")
    if rates:
        out += "\n" + "\n".join(f"`{k}` counts {v['steps_counted']}; it leaves out {v['steps_excluded']}."
                                for k, v in rates.items()) + "\n"
    return out + sources(items, True)


PHASES = {"prefill": ("ms", 1e3), "decode": ("us", 1e6)}
DECODE_COLUMNS = ("dense cuDNN", "infinitehip cached", "infinitehip full refresh", "infinitehip 3k amortised",
                  "infinitehip 3k-fast amortised", "infinitehip 3k-flash amortised",
                  "infinitehip kv-rep 3k-fast amortised", "infinitehip kv-rep 3k-flash amortised", "hip 2k")


def _cell(r: dict | None, base: float | None, scale: float) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "error"
    t = r["total_s"]
    ratio = f" ({base / t:.1f}x)" if base and r is not None and t != base else ""
    return _t(t * scale) + ratio


def _head(label: str) -> str:
    return label + (" (computed)" if label.endswith("amortised") else "")


def bench_attention(args: list[str]) -> str:
    (f,), opts = options(args)
    path, report = load(f)
    phase = opts.get("phase", "prefill")
    unit, scale = PHASES[phase]
    ctxs = report["contexts"]
    seen = list(dict.fromkeys(k for e in ctxs.values() for k in e[phase]))
    cols = [c for c in DECODE_COLUMNS if c in seen] if phase == "decode" else seen
    rows = []
    for n, e in ctxs.items():
        base = e[phase].get("dense cuDNN", {}).get("total_s")
        rows.append([length(int(n))] + [_cell(e[phase].get(c), base, scale) for c in cols])
    out = table(["N"] + [f"{_head(c)}, {unit}" for c in cols], rows)
    if phase == "prefill":
        split = [f"{label} select {r['selection_s'] * 1e3:.1f} + attend {r['attention_s'] * 1e3:.1f} ms"
                 for label, r in ctxs[max(ctxs, key=int)][phase].items() if "selection_s" in r]
        out += f"\nAt {length(int(max(ctxs, key=int)))}: " + "; ".join(split) + ".\n" if split else ""
    rest = [c for c in seen if c not in cols]
    if rest:
        out += "\nAlso in the JSON: " + ", ".join(rest) + ".\n"
    out += "\n(x): cuDNN's time over the cell's; (computed): the mean over the preset's refresh cycle of the " \
           "measured step kinds, not timed itself.\n" if phase == "decode" else \
           "\n(x): cuDNN's time over the cell's.\n"
    return out + sources([(path, report)])


def bench_attention_at(args: list[str]) -> str:
    (at, *files), _ = options(args)
    n = str(parse_length(at))
    items = [load(f) for f in files]
    rows = []
    for phase, (unit, scale) in PHASES.items():
        labels = list(dict.fromkeys(k for _, r in items for k in r["contexts"][n][phase]))
        for label in labels:
            cells = []
            for _, r in items:
                e = r["contexts"][n][phase]
                x = e.get(label)
                cell = _cell(x, e.get("dense cuDNN", {}).get("total_s"), scale)
                if x and "selection_s" in x:
                    cell += f": select {x['selection_s'] * scale:.1f} + attend {x['attention_s'] * scale:.1f}"
                cells.append(cell)
            rows.append([f"{phase}, {_head(label)}, {unit}"] + cells)
    head = [f"at {length(int(n))}"] + [f"[{i}]" for i in range(1, len(items) + 1)]
    return table(head, rows) + "\n(x): cuDNN's time in the same run over the cell's.\n" + sources(items, True)


def bench_long(args: list[str]) -> str:
    (f,), _ = options(args)
    path, report = load(f)
    graphs = [r for r in report["runs"] if r.get("cuda_graphs", True)]
    eager = {(r["length"], r["attention"]): r for r in report["runs"] if not r.get("cuda_graphs", True)}
    rows = []
    for r in graphs:
        e = eager.get((r["length"], r["attention"]))
        row = [length(r["length"]), r["attention"] + (f" `{r['attention_config']}`" if r.get("attention_config")
                                                      else ""),
               f"{r['prefill_s']:.2f} s ({r['prefill_tok_s'] / 1e3:,.1f}K tok/s)", num(r["decode_tok_s"])]
        if eager:
            row += [num(e and e["decode_tok_s"]), f"{r['decode_tok_s'] / e['decode_tok_s']:.1f}x" if e else "-",
                    {True: "yes", False: "no", None: "-"}[e and e.get("same_tokens_as_graphs")]]
        rows.append(row)
    head = ["prompt", "method", "prefill", "decode tok/s, CUDA graphs"]
    if eager:
        head += ["decode tok/s, eager", "graphs / eager", "same tokens"]
    note = "\nDecode tok/s: the tokens after the first over the time since the first (an untimed generation of " \
           "the same prompt runs before each).\n"
    return table(head, rows) + note + sources([(path, report)])


def _dense_at(fit: dict, n: int, batch: int) -> tuple[float, float]:
    t = fit["t_L0_s"] + (n - fit["L0"]) * fit["slope_s_per_token"]
    return batch / t, t


def _reads(x: dict) -> str:
    r = x.get("decode_reads")
    return "-" if not r or r.get("keys_per_query") is None else f"{r['keys_per_query']:,.0f} ({100 * r['share']:.1f}%)"


def _profile(x: dict) -> str:
    p = x.get("profile")
    return "-" if not p else f"{p['wall_ms_per_step']:.1f} / {p['busy_ms_per_step']:.1f}"


def bench_decode(args: list[str]) -> str:
    files, opts = options(args)
    items = [load(f) for f in files]
    many = len(items) > 1
    rows, marks, preempted = [], False, False
    for i, (path, r) in enumerate(items, 1):
        batch = r["settings"].get("batch", 1)
        tp = (r["settings"].get("engine") or {}).get("tensor_parallel_size") or 1
        for x in sorted(r["runs"] + r["dense"], key=lambda x: (x["context"], x["attention"] == "dense")):
            row = [f"[{i}]"] if many else []
            row += [length(x["context"]), x["attention"] + (f" `{x['attention_config']}`" if x.get("attention_config")
                                                            else ""),
                    "-" if batch == 1 else str(batch), "-" if tp == 1 else str(tp)]
            if "error" in x or x.get("status") in ("does not fit", "error"):
                rows.append(row + [x.get("error") or f"{x['status']}: {x['reason']}"] + ["-"] * 11)
                continue
            dagger = "†" if x.get("preemptions") else ""
            preempted |= bool(dagger)
            mem, off = x["memory"], x.get("offload_stats") or {}
            counted = x.get("steps_counted", x["decode_steps"] - x.get("warmup_steps", 0))
            kv = x["kv_cache_dtype"] + (f", offload {x['kv_offloading_size_gib']:.1f} GiB" if x["offload"] else "")
            ratio = x.get("ratio_to_dense")
            star = "*" if x.get("dense_source") == "extrapolated" else ""
            marks |= bool(star)
            staging = mem.get("kv_staging_decode_bytes", mem["kv_staging_bytes"])
            rows.append(row + [kv, f"{x['prefill_s']:.1f}", num(x["decode_tok_s"]) + dagger,
                               f"{counted}/{x['decode_steps']}",
                               num(x["step_s_median"] and x["step_s_median"] * 1e3, ".2f"),
                               "-" if ratio is None else f"{ratio:.2f}x{star}",
                               f"{(mem['kv_gpu_bytes'] + staging) / GiB:.2f}",
                               num(mem["kv_host_bytes"] / GiB if mem["kv_host_bytes"] else None, ".2f"),
                               num(off.get("hit_ratio") if x["offload"] else None, ".3f"),
                               num(off.get("h2d_gb_s") if x["offload"] else None, ".1f"), _reads(x), _profile(x)])
        fit = r.get("dense_extrapolation")
        for text in filter(None, opts.get("extrapolate", "").split(",")):
            if fit is None:
                raise ValueError(f"{path.name} has no dense line to extrapolate along")
            tok_s, t = _dense_at(fit, parse_length(text), r["settings"]["batch"])
            marks = True
            rows.append(([f"[{i}]"] if many else []) + [length(parse_length(text)), "dense, extrapolated*", "-", "-",
                                                        "-", "-", f"{tok_s:.1f}*", "-", f"{t * 1e3:.1f}*"] + ["-"] * 7)
    head = (["run"] if many else []) + ["context", "method", "batch", "TP", "KV", "prefill s", "decode tok/s",
                                        "steps counted",
                                        "step p50 ms", "vs dense", "KV GPU GiB", "KV host GiB", "hit ratio",
                                        "host->GPU GB/s", "keys read per query", "profiled step wall / device ms"]
    out = table(head, rows, drop_empty=True)
    out += ("\nDecode tok/s counts the steps in \"steps counted\" (the rest: CUDA-graph capture, compilation, the "
            "first eager step, profiled steps). KV GPU: the GPU tier and the staging area still held while "
            "decoding.\n")
    if preempted:
        out += ("\n† a sequence was preempted and its prompt recomputed between the decode steps (the KV tier was "
                "smaller than the batch needs): the rate holds that prefill and is no steady decode rate.\n")
    if marks:
        fits = [r["dense_extrapolation"] for _, r in items if r.get("dense_extrapolation")]
        out += "\n\\* extrapolated, not measured: " + fits[0]["formula"] + "".join(
            f"; [{i}] L0 = {length(f['L0'])} ({f['t_L0_s'] * 1e3:.2f} ms), L1 = {length(f['L1'])} "
            f"({f['t_L1_s'] * 1e3:.2f} ms)" for i, f in enumerate(fits, 1)) + ".\n"
    return out + sources(items, many)


def bench_serve(args: list[str]) -> str:
    files, opts = options(args)
    group = opts.get("group", "all")
    items = [load(f) for f in files]
    rows = []
    longs = any("long" in r["groups"] and group != "long" for _, r in items)
    for i, (path, r) in enumerate(items, 1):
        g = r["groups"][group]
        version = r.get("server_version") or {}
        label = f"[{i}] {version.get('attention', '?')}" + (f":{version['preset']}" if version.get("preset") else "")
        ms = lambda m, s: num(g[f"{m}_ms"][s], ",.1f")  # noqa: E731
        row = [label, f"{g['completed']}/{g['failed']}", f"{g['request_throughput']:.1f}",
               f"{g['output_throughput']:,.0f}", f"{ms('ttft', 'median')} / {ms('ttft', 'p99')}",
               f"{ms('tpot', 'mean')} / {ms('tpot', 'p99')}", f"{ms('itl', 'median')} / {ms('itl', 'p99')}",
               ms("itl", "max") if "max" in g["itl_ms"] else "-", ms("e2el", "p99")]
        if longs:
            st = r.get("stalls_during_long_prefill")
            row.append(f"{r['groups']['long']['ttft_ms']['mean'] / 1e3:.2f}" if "long" in r["groups"] else "-")
            row.append(f"{st['gaps']} / {st['over_100ms']} / {num(st['max'], ',.0f')}" if st else "-")
        rows.append(row)
    head = ["server", "ok/failed", "req/s", "output tok/s", "TTFT p50 / p99 ms", "TPOT mean / p99 ms",
            "ITL p50 / p99 ms", "ITL max ms", "E2EL p99 ms"] + (
        ["long prompts' TTFT mean s", "gaps during a long prefill: all / > 100 ms / max ms"] if longs else [])
    dur = ", ".join(f"[{i}] {r['num_prompts']} requests in {r['duration_s']:.1f} s"
                    for i, (_, r) in enumerate(items, 1))
    return table(head, rows, drop_empty=True) + f"\nRequests of group `{group}`; {dur}.\n" + sources(items, True)


def bench_mixed(args: list[str]) -> str:
    """`bench mixed`'s runs: the long prompt alone and beside the decodes, and the steps' times."""
    files, _ = options(args)
    items = [load(f) for f in files]
    rows = []
    for i, (path, rep) in enumerate(items, 1):
        for r in rep["runs"]:
            m, prof = r["mixed_step_ms"], r.get("profile")
            rows.append([f"[{i}] {r['label']}", length(r["context"]), str(r["decodes"]),
                         f"{r['standalone_prefill_s']:.2f}", f"{r['mixed_prefill_s']:.2f}",
                         f"{r['mixed_vs_standalone']:.2f}x", f"{r['mixed_steps']} x {r['mixed_chunk_tokens_median']:.0f}",
                         f"{r['decode_step_ms']:.1f}", f"{m['median']:.1f} / {m['p99']:.1f} / {m['max']:.1f}",
                         f"{prof['wall_ms_per_step']:.1f} / {prof['busy_ms_per_step']:.1f}" if prof else "-"])
    head = ["run", "context", "decoding", "alone s", "beside them s", "ratio", "steps x prompt tokens",
            "decode-only step ms", "mixed step ms p50 / p99 / max", "profiled step wall / device ms"]
    return (table(head, rows, drop_empty=True) + "\nAlone: the long prompt's prefill by itself (the second of two "
            "runs); beside them: the same prompt while the other requests decode, every step of which is an "
            "inter-token gap of each of them.\n" + sources(items, True))


RENDERERS = {"bench-engine": bench_engine, "bench-attention": bench_attention,
             "bench-attention-at": bench_attention_at, "bench-long": bench_long, "bench-decode": bench_decode,
             "bench-serve": bench_serve, "bench-mixed": bench_mixed}
