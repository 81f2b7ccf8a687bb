"""`bench decode`'s report: the dense column (measured, or extrapolated along a line) and the printed table.

Split from bench/decode.py (which measures); the JSON fields are documented there.
"""
from __future__ import annotations

import math

GiB = 1 << 30


def _fmt_len(n: int) -> str:
    from ..eval.common import format_length

    return format_length(n)


def dense_fit(dense: list[dict]) -> dict | None:
    """The line through the largest and smallest dense contexts measured (decode step seconds vs context)."""
    pts = sorted((d["context"], d["step_s_mean"]) for d in dense if d.get("status") == "measured"
                 and d.get("step_s_mean"))
    if len(pts) < 2:
        return None
    (l1, t1), (l0, t0) = pts[0], pts[-1]
    slope = (t0 - t1) / (l0 - l1)
    if slope <= 0:  # noise (e.g. toy sizes on a CPU): no line worth extending
        return None
    return {"formula": "t(L) = t(L0) + (L - L0) * (t(L0) - t(L1)) / (L0 - L1); dense tok/s = batch / t(L)",
            "L0": l0, "t_L0_s": t0, "L1": l1, "t_L1_s": t1, "slope_s_per_token": slope,
            "fixed_s": t0 - slope * l0}


def _fill_dense_column(report: dict) -> None:
    fit = report["dense_extrapolation"] = dense_fit(report["dense"])
    measured = {d["context"]: d for d in report["dense"] if d.get("status") == "measured"}
    for row in report["runs"]:
        if "error" in row:
            continue
        d = measured.get(row["context"])
        if d is not None:
            tok_s, source = d["decode_tok_s"], "measured"
        elif fit is not None:
            t = fit["t_L0_s"] + (row["context"] - fit["L0"]) * fit["slope_s_per_token"]
            tok_s, source = (row["batch"] / t if t > 0 else None), "extrapolated"
        else:
            tok_s, source = None, ("not measured (dense did not run here, and no two dense contexts give a line "
                                   "to extrapolate)")
        row["dense_tok_s"], row["dense_source"] = tok_s, source
        row["ratio_to_dense"] = row["decode_tok_s"] / tok_s if tok_s and row["decode_tok_s"] else None
        row["extrapolated"] = ["dense_tok_s", "ratio_to_dense"] if source == "extrapolated" else []



def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _summary(row: dict) -> str:
    head = f"{_fmt_len(row['context'])} {row['attention']}"
    if "error" in row:
        return f"{head}: failed ({row['error']})"
    dec = row["decode_tok_s"]
    mem = row["memory"]
    return (f"{head}: prefill {row['prefill_s']:.1f} s, decode {dec or 0:.1f} tok/s "
            f"({steps_note(row)}), KV GPU {mem['kv_gpu_bytes'] / GiB:.2f} GiB "
            f"+ staging {mem['kv_staging_bytes'] / GiB:.2f} GiB while prefilling "
            f"({_staging_decoding(mem) / GiB:.2f} decoding), host {mem['kv_host_bytes'] / GiB:.2f} GiB"
            + _reads_note(row.get("decode_reads")) + _preempted_note(row))


def _preempted_note(row: dict) -> str:
    """A preemption inside the decode steps (the KV cache held fewer pages than the batch's prompts and decode
    tokens need) recomputes a sequence's prompt between decode steps: the rate is then no steady batch figure."""
    n = row.get("preemptions") or 0
    if not n:
        return ""
    return (f". WARNING: {n} preemption(s): the KV cache held fewer pages than {row['batch']} x (context + decode "
            "tokens) need, a sequence's prompt was recomputed between the decode steps and the decode rate includes "
            "that prefill; it is no steady batch figure (give the KV cache room: --kv-cache-memory-gb, or offload)")


def steps_note(row: dict) -> str:
    """Which decode steps the rate counts: "over 123 of 127 steps; left out: graph_capture 0, 1, 8, 16"."""
    total = row.get("decode_steps", 0)
    counted = row.get("steps_counted", total - row.get("warmup_steps", 0))
    out = row.get("steps_excluded")
    if out is None:  # a report from before steps_excluded: the count alone
        return f"over {counted} of {total} steps; {total - counted} warm-up steps left out"
    left = "; ".join(f"{why} {', '.join(map(str, idx))}" for why, idx in out.items())
    return f"over {counted} of {total} steps" + (f"; left out: {left}" if left else ", every step")


def _reads_note(reads: dict | None) -> str:
    if not reads or reads["keys_per_query"] is None:
        return ""
    return f"; decode read {reads['keys_per_query']:,.0f} keys per query ({100 * reads['share']:.2f}% of the context)"


def _staging_decoding(mem: dict) -> int:
    """Staging bytes still allocated while decoding (results written before the release kept it: its size)."""
    return mem.get("kv_staging_decode_bytes", mem["kv_staging_bytes"])


def format_table(r: dict) -> str:
    def num(v, spec: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    lines = [r["note"]] if r.get("note") else []
    s = r["settings"]
    lines.append(f"{r['model']} on {r['gpu']} ({r['dtype']}), batch {s['batch']}, {s['decode_tokens']} decode tokens, "
                 f"{r['date']}")
    head = (f"{'context':>8} {'method':<22} {'kv dtype':<9} {'offload':<8} {'prefill s':>9} {'decode tok/s':>12} "
            f"{'dense tok/s':>12} {'ratio':>7} {'KV GPU GiB':>10} {'KV host GiB':>11} {'RSS GiB':>8} "
            f"{'hit ratio':>9} {'GB/s':>6}")
    lines += [head, "-" * len(head)]
    rows = sorted(r["runs"] + r["dense"], key=lambda x: (x["context"], x["attention"] == "dense"))
    for x in rows:
        ctx = _fmt_len(x["context"])
        if "error" in x or x.get("status") in ("does not fit", "error"):
            lines.append(f"{ctx:>8} {x['attention']:<22} {x.get('error') or x.get('status') + ': ' + x['reason']}")
            continue
        mem, off = x["memory"], x.get("offload_stats") or {}
        offload = f"{x['kv_offloading_size_gib']:.1f}G" if x["offload"] else "no"
        if x["attention"] == "dense":
            dense_col, ratio = "", ""
        else:
            mark = "*" if x.get("dense_source") == "extrapolated" else ""
            dense_col = num(x.get("dense_tok_s"), ".1f") + mark
            ratio = num(x.get("ratio_to_dense"), ".2f") + ("x" if x.get("ratio_to_dense") else "") + mark
        rss = x["host"]["rss_bytes"]
        lines.append(
            f"{ctx:>8} {x['attention']:<22} {x['kv_cache_dtype']:<9} {offload:<8} {x['prefill_s']:>9.2f} "
            f"{num(x['decode_tok_s'], '.1f'):>12} {dense_col:>12} {ratio:>7} "
            f"{(mem['kv_gpu_bytes'] + _staging_decoding(mem)) / GiB:>10.2f} "
            f"{mem['kv_host_bytes'] / GiB:>11.2f} {num(rss and rss / GiB, '.2f'):>8} "
            f"{num(off.get('hit_ratio'), '.3f'):>9} {num(off.get('h2d_gb_s'), '.1f'):>6}")
    lines.append("decode tok/s counts the steady decode steps only; left out per row (step indices): " + "; ".join(
        f"{_fmt_len(x['context'])} {x['attention']}: {steps_note(x)}" for x in rows
        if "decode_steps" in x))
    lines.append("KV GPU = the GPU tier (pages, page table) + the prefill staging area while decoding (released after "
                 "prefill; its size while prefilling is in the JSON, kv_staging_bytes); RSS: the process, after decode")
    fit = r.get("dense_extrapolation")
    if any(x.get("dense_source") == "extrapolated" for x in r["runs"]) and fit:
        lines.append(f"* extrapolated, not measured (dense tok/s and the ratio): {fit['formula']}, with "
                     f"L0 = {_fmt_len(fit['L0'])} (t = {fit['t_L0_s'] * 1e3:.2f} ms) and L1 = {_fmt_len(fit['L1'])} "
                     f"(t = {fit['t_L1_s'] * 1e3:.2f} ms)")
    return "\n".join(lines)
