"""One attention layer at long context: longreach's sparse kernels vs dense cuDNN / flash SDPA, in the same run.

Shape: Llama-3.1-8B (32 query heads, 8 KV heads, head dim 128), bf16, batch 1, keys in a paged cache of 16-token
pages (longreach) or contiguous (SDPA). Inputs are random: the selection's cost does not depend on what it finds.

Prefill is measured as the *last* 32K-query chunk of a context of N tokens (the costliest chunk of a chunked prefill,
InfiniteHiP's protocol):
  * dense cuDNN / flash SDPA: the chunk's queries against the N - 32K prefix keys without a mask plus against the
    chunk's own keys with a causal mask (two calls: exactly the dense work; the merge is not counted);
  * FlexAttention (compiled) with a block mask assembled from infinitehip's own 3k selection: 128x128 blocks covering
    the selected 8-token blocks, the sink and the window, causal mask_mod (a superset of the keys longreach reads);
  * infinitehip 3k / 5k and hip 2k: selection (all stages) + block-sparse attention, reported separately;
  * minference (prefill only): every head vertical-slash (500, 1500), Λ-shape (1024, 4096) or block-sparse (100),
    vertical-slash with one index per KV group, and, with `minference_patterns` (a `longreach calibrate` file for
    this shape: 32 heads, 8 KV heads), the calibrated mix of one layer; index building (estimation from the chunk's
    last 64 queries against all N keys, merge) + the range/column kernel, reported separately.
Decode is one query at position N-1, each variant captured in a CUDA graph and replayed (bench/attention_decode.py):
  * dense cuDNN SDPA (enable_gqa);
  * infinitehip with the mask fully cached (attention only), refreshed from stage 3, from stage 2, fully refreshed,
    and the average over a preset's refresh cycle (3k, 3k-fast, 3k-flash) — the amortised decode cost, computed
    from the measured step kinds (`derived` in the JSON, "not timed" in the table);
  * hip 2k (selection every step + attention).
Times are medians of CUDA-event measurements after warm-up. Key counts per query are approximate (`estimated`).
Prints a table and writes JSON with its provenance (tools/report.py).
"""
from __future__ import annotations

import statistics
import sys
import time
import traceback

import torch

HQ, HKV, D = 32, 8, 128
PAGE = 16
CHUNK = 32768
DTYPE = torch.bfloat16
DEVICE = "cuda"  # tests run the whole benchmark logic on CPU at toy sizes (Triton interpreter, host timers)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats: int, warmup: int = 1) -> float:
    """Median seconds of fn() by CUDA events (host clock on CPU)."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeats):
        if DEVICE != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _graph_time(fn, repeats: int = 50) -> tuple[float, bool]:
    """Median seconds of a CUDA-graph replay of fn (falls back to eager timing if capture fails)."""
    fn()
    _sync()
    if DEVICE != "cuda":
        return _time(fn, repeats), False
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return _time(g.replay, repeats, warmup=3), True
    except Exception:  # noqa: BLE001 - reported as eager timing
        traceback.print_exc()
        return _time(fn, repeats, warmup=2), False


def _sdpa(backend):
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, backend)]) if DEVICE == "cuda" else contextlib.nullcontext()


class Context:
    """A context of n tokens: a paged cache (identity page order) and contiguous copies for SDPA."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        self.n = n
        pages = -(-n // PAGE)
        self.k_cache = torch.randn(pages, PAGE, HKV, D, device=DEVICE, generator=g).to(DTYPE)
        self.v_cache = torch.randn(pages, PAGE, HKV, D, device=DEVICE, generator=g).to(DTYPE)
        self.table = torch.arange(pages, device=DEVICE, dtype=torch.int32)
        self.k = self.k_cache.view(-1, HKV, D)[:n].permute(1, 0, 2).unsqueeze(0).contiguous()  # (1, H_kv, n, D)
        self.v = self.v_cache.view(-1, HKV, D)[:n].permute(1, 0, 2).unsqueeze(0).contiguous()

    def keys(self):
        from ...attention.sparse import SequenceKeys

        return SequenceKeys(self.k_cache, self.table, self.n)


CONFIG_OVERRIDES: dict[str, dict] = {}  # per method name; the CPU smoke test shrinks budgets to toy contexts


def _method(name: str, preset: str, extra: dict | None = None):
    import dataclasses

    from ...attention.hip import HiP
    from ...attention.infinitehip import InfiniteHiP

    cls = {"infinitehip": InfiniteHiP, "hip": HiP}[name]
    cfg = dataclasses.replace(cls.presets[preset], **CONFIG_OVERRIDES.get(name, {}), **(extra or {}))
    return cls(cfg, HQ, HKV)


# (label, method, preset, config overrides): the paper's per-head SelectRep and longreach's per-KV-head variant
PREFILL_METHODS = (("infinitehip 3k", "infinitehip", "3k", {}),
                   ("infinitehip 3k kv-rep", "infinitehip", "3k", {"rep_per_head": False}),
                   ("infinitehip 5k", "infinitehip", "5k", {}),
                   ("hip 2k", "hip", "2k", {}))
DECODE_VARIANTS = (("infinitehip", {}), ("infinitehip kv-rep", {"rep_per_head": False}))
# (label, pattern of every head or None = the calibration file's layer, granularity)
MINFERENCE_METHODS = (("minference vs", ("vertical_slash", 500, 1500), "head"),
                      ("minference vs kv-group", ("vertical_slash", 500, 1500), "kv_head"),
                      ("minference a-shape", ("a_shape", 1024, 4096), "head"),
                      ("minference bs", ("block_sparse", 100), "head"),
                      ("minference mix", None, None))
MINFERENCE_LAYER = 16  # the layer of a calibration file the mix is taken from (a middle layer)


def _index(method, blocks_host, selection):
    from ...attention.index import QueryBlocks, SparseIndex

    qb = QueryBlocks(*[list(x) for x in zip(*[(0, s, n, p) for s, n, p in blocks_host])])
    blocks, counts = SparseIndex.pack([selection], DEVICE)
    return SparseIndex(method.cfg.block_q if len(blocks_host) > 1 else 1, method.block_k, method.cfg.n_sink,
                       method.cfg.n_window, method.groups, qb, blocks, counts)


def _dense_prefill(ctx: Context, q: torch.Tensor, repeats: int) -> dict:
    """cuDNN and flash SDPA on the chunk: prefix without a mask + the chunk's own keys with a causal mask."""
    n, c = ctx.n, q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H_q, c, D)
    k32 = ctx.k.repeat_interleave(HQ // HKV, dim=1)  # the fused SDPA prefill kernels need expanded K/V
    v32 = ctx.v.repeat_interleave(HQ // HKV, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    res: dict = {}
    for backend, label in (("CUDNN_ATTENTION", "dense cuDNN"), ("FLASH_ATTENTION", "dense flash")):
        def dense(backend=backend):
            with _sdpa(backend):
                if n > c:
                    sdpa(qh, k32[:, :, : n - c], v32[:, :, : n - c])
                sdpa(qh, k32[:, :, n - c:], v32[:, :, n - c:], is_causal=True)
        try:
            res[label] = {"total_s": _time(dense, repeats)}
        except Exception as e:  # noqa: BLE001
            res[label] = {"error": f"{type(e).__name__}: {e}"}
    flops = 4 * HQ * D * (c * (n - c) + c * c / 2)
    for v in res.values():
        if "total_s" in v:
            v["tflops"] = flops / v["total_s"] / 1e12
    return res


def _minference_prefill(ctx: Context, q, pattern, granularity, patterns_file, repeats: int) -> dict:
    """MInference on the last chunk: index building (estimation + merge) and the range kernel, timed separately."""
    import dataclasses

    from ...attention.index import QueryBlocks
    from ...attention.minference import MInference, MInferenceConfig, index_cost
    from ...kernels.vertical_slash import RangePlan, range_attention_triton

    n, c = ctx.n, q.shape[0]
    base = dataclasses.replace(MInferenceConfig(), **CONFIG_OVERRIDES.get("minference", {}))
    if pattern is None:  # the calibrated mix of one layer
        cfg = dataclasses.replace(base, patterns=patterns_file)
        m = MInference(cfg, HQ, HKV)
        layer = min(MINFERENCE_LAYER, len(m.table) - 1)
        pats = m.layer_patterns(layer)
    else:
        m = MInference(dataclasses.replace(base, pattern=pattern, granularity=granularity), HQ, HKV)
        pats = None
    B = m.cfg.block
    qb = QueryBlocks.build([c], [n - c], B)
    blocks = list(zip(qb.start, qb.length, qb.pos))

    def build():
        return m.build(0, q, blocks, (ctx.k_cache, ctx.table), n, D ** -0.5, patterns=pats)

    sel_s = _time(build, repeats)
    tiles, cols = build()
    index = m.index(qb, [tiles], [cols])
    plan = RangePlan(index, HQ, HKV, DEVICE)
    att_s = _time(lambda: range_attention_triton(q, ctx.k_cache, ctx.v_cache, ctx.table[None], index, D ** -0.5,
                                                 plan=plan, block_n=B), repeats)
    out = {"total_s": sel_s + att_s, "selection_s": sel_s, "attention_s": att_s,
           "keys_per_query_approx": index_cost(index), "estimated": ["keys_per_query_approx"]}
    if pats is not None:
        kinds = [p[0] for p in pats]
        out["mix"] = {k: kinds.count(k) for k in sorted(set(kinds))}
    return out


def prefill(ctx: Context, methods, repeats: int, flex: bool, minference_patterns: str | None = None) -> dict:
    from ...kernels.bsa import BSAPlan, block_sparse_attention_triton

    n, c = ctx.n, min(CHUNK, ctx.n)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.randn(c, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
    res = _dense_prefill(ctx, q, repeats)

    keys = ctx.keys()
    ih_selection = None
    for label, name, preset, extra in methods:
        m = _method(name, preset, extra)
        bq = m.cfg.block_q
        blocks_host = [(r, min(bq, c - r), n - c + r) for r in range(0, c, bq)]
        from ...attention.sparse import BlockQueries

        bqs = BlockQueries.build(blocks_host, DEVICE)
        select = lambda: m.select(3, q, bqs, keys)  # noqa: E731  layer 3: not one of the early, larger layers
        try:
            sel_s = _time(select, repeats)
            sel = select()
            index = _index(m, blocks_host, sel)
            plan = BSAPlan(index, HQ, HKV, DEVICE)
            attend = lambda: block_sparse_attention_triton(q, ctx.k_cache, ctx.v_cache, ctx.table[None], index,  # noqa: E731
                                                           D ** -0.5, plan=plan)
            att_s = _time(attend, repeats)
            keys_per_q = ((index.counts.float().mean() * m.block_k).item() + m.cfg.n_sink + m.cfg.n_window)
            res[label] = {"total_s": sel_s + att_s, "selection_s": sel_s, "attention_s": att_s,
                          "keys_per_query_approx": keys_per_q, "estimated": ["keys_per_query_approx"]}
            if label == "infinitehip 3k":
                ih_selection = (m, sel)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res[label] = {"error": f"{type(e).__name__}: {e}"}
    for label, pattern, gran in MINFERENCE_METHODS:
        if pattern is None and not minference_patterns:
            continue
        try:
            res[label] = _minference_prefill(ctx, q, pattern, gran, minference_patterns, repeats)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res[label] = {"error": f"{type(e).__name__}: {e}"}
    if flex and ih_selection is not None:
        try:
            res["flex (ih 3k mask)"] = {"total_s": _flex_prefill(ctx, q, *ih_selection, repeats)}
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["flex (ih 3k mask)"] = {"error": f"{type(e).__name__}: {e}"}
    return res


def _flex_prefill(ctx: Context, q, method, sel, repeats: int) -> float:
    """FlexAttention with a 128x128 block mask covering infinitehip's selection (+ sink, window), causal."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    n, c = ctx.n, q.shape[0]
    QB = KB = 128
    nq, nk = c // QB, -(-n // KB)
    off = n - c
    # (qblocks of 64) -> (qblocks of 128): union of two consecutive selections; ids in 8-token blocks -> 128 blocks
    bk = method.block_k
    sel = sel.long()  # (c // 64, G, W)
    hit = torch.zeros(nq, sel.shape[1], nk, dtype=torch.bool, device=DEVICE)
    kb = torch.where(sel >= 0, sel * bk // KB, 0)
    qi = torch.arange(sel.shape[0], device=DEVICE) // (QB // method.cfg.block_q)
    hit[qi[:, None, None].expand_as(kb), torch.arange(sel.shape[1], device=DEVICE)[None, :, None].expand_as(kb), kb] |= sel >= 0
    hit[:, :, : -(-method.cfg.n_sink // KB)] = True
    qpos0 = off + torch.arange(nq, device=DEVICE) * QB
    kpos = torch.arange(nk, device=DEVICE) * KB
    in_window = (kpos[None, :] + KB > qpos0[:, None] - method.cfg.n_window) & (kpos[None, :] <= qpos0[:, None] + QB - 1)
    hit |= in_window[:, None, :]
    hit = hit.repeat_interleave(HQ // sel.shape[1], dim=1)  # per query head
    num = hit.sum(-1).int()[None]  # (1, H, nq)
    idx = torch.argsort(hit.int(), dim=-1, descending=True, stable=True).int()[None]  # selected blocks first

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + off

    mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(QB, KB), mask_mod=causal, seq_lengths=(c, n))
    qh = q.transpose(0, 1).unsqueeze(0)
    compiled = torch.compile(flex_attention)
    return _time(lambda: compiled(qh, ctx.k, ctx.v, block_mask=mask, enable_gqa=True), repeats, warmup=2)


def run(contexts: list[int], repeats: int = 5, out_path: str | None = None, flex: bool = True,
        prefill_methods=PREFILL_METHODS, decode_repeats: int = 20, minference_patterns: str | None = None,
        command: str | None = None) -> dict:
    """Prefill and decode at each context; prints each context's table and rewrites the JSON after each. Records
    not timed as runs of their own say so: `derived` (the amortised decode steps), `estimated` (key counts)."""
    from ..report import attention_record, provenance, samples, write_json
    from .attention_decode import decode

    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench attention needs a CUDA GPU")
    methods = [attention_record(name, preset, {**CONFIG_OVERRIDES.get(name, {}), **extra}, label)
               for label, name, preset, extra in prefill_methods]
    report = {"provenance": provenance(command, DEVICE, attention=methods, samples=samples(
                  repeats, "prefill measurement", f"timed repeats, median (decode: {decode_repeats} graph replays, "
                                                  "median)")),
              "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "minference_patterns": minference_patterns,
              "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16", "page": PAGE,
                        "prefill_chunk": CHUNK}, "contexts": {}}
    for n in contexts:
        t0 = time.perf_counter()
        ctx = Context(n)
        entry = {"prefill": prefill(ctx, list(prefill_methods), repeats, flex, minference_patterns),
                 "decode": decode(ctx, decode_repeats, sys.modules[__name__])}
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        report["contexts"][str(n)] = entry
        del ctx
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        print(format_table(report, only=str(n)), flush=True)
        write_json(report, out_path)
    return report


def format_table(report: dict, only: str | None = None) -> str:
    lines = []
    for n, entry in report["contexts"].items():
        if only and n != only:
            continue
        lines.append(f"--- context {int(n):,} tokens ({report['gpu']}) ---")
        for phase, unit, scale in (("prefill", "ms", 1e3), ("decode", "us", 1e6)):
            rows = entry[phase]
            base = rows.get("dense cuDNN", {}).get("total_s")
            lines.append(f"{phase + ' (last 32K chunk)' if phase == 'prefill' else phase:<36} {unit:>10} "
                         f"{'vs cuDNN':>9}  detail")
            for label, r in rows.items():
                if "error" in r:
                    lines.append(f"  {label:<34} {'error':>10}            {r['error'][:60]}")
                    continue
                t = r["total_s"]
                extra = []
                if "selection_s" in r:
                    extra.append(f"select {r['selection_s'] * scale:.2f} + attend {r['attention_s'] * scale:.2f}")
                if "tflops" in r:
                    extra.append(f"{r['tflops']:.0f} TFLOP/s")
                if "gbps" in r:
                    extra.append(f"{r['gbps']:.0f} GB/s")
                if r.get("graph") is False:
                    extra.append("eager")
                if r.get("derived"):
                    extra.append("computed from the step kinds above, not timed")
                ratio = f"{base / t:8.1f}x" if base else ""
                lines.append(f"  {label:<34} {t * scale:>10.2f} {ratio:>9}  {'; '.join(extra)}")
    return "\n".join(lines)
