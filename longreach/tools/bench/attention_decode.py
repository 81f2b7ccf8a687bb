"""`bench attention`'s decode measurements (bench/attention.py has the shape, the timers and the prefill side): one
query at position N-1 against dense cuDNN SDPA, infinitehip's step with its mask cached or refreshed from a stage,
the amortised step of a preset's refresh cycle, and hip 2k. Each variant is replayed from a CUDA graph.
"""
from __future__ import annotations

import math
import traceback

ORDER = ("full refresh", "from stage 2", "from stage 3", "cached")  # refreshing from stage i, i = 0..3 (cached)
DERIVED = ("mean over the preset's refresh cycle of the measured step kinds (cached, from stage 3, from stage 2, "
           "full refresh): computed from the rows above, not timed as a run of its own")


def amortised(times: dict, refresh: tuple[int, ...]) -> dict:
    """The mean step over one refresh cycle of a preset (`refresh`: stage i refreshes every refresh[i] steps; a
    step refreshes from its first due stage, InfiniteHiP Alg. 4), from the measured cost of each step kind
    (`times`, keyed by ORDER). A derived value: the record says so (`derived`)."""
    cycle = math.lcm(*refresh)
    total = 0.0
    for s in range(cycle):
        first = next((i for i, r in enumerate(refresh) if s % r == 0), len(refresh))
        total += times[ORDER[first]]
    return {"total_s": total / cycle, "refresh": list(refresh), "derived": DERIVED}


def decode(ctx, repeats: int, A) -> dict:
    """Every decode variant at one context (`ctx`: an attention.Context): {label: {"total_s", "graph", ...}}. `A`:
    bench/attention.py itself, which passes itself in (the shape, device and timers live there, and the CPU test
    shrinks them there); taken as an argument, not imported, so that the two modules make no circle."""
    import torch

    from ...attention.index import SparseIndex
    from ...attention.sparse import BlockQueries
    from ...kernels.bsa import BSAPlan, block_sparse_attention_triton

    DEVICE, DTYPE, HQ, HKV, D = A.DEVICE, A.DTYPE, A.HQ, A.HKV, A.D
    _sdpa, _graph_time, _method = A._sdpa, A._graph_time, A._method

    n = ctx.n
    g = torch.Generator(device=DEVICE).manual_seed(2)
    q = torch.randn(1, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
    res: dict = {}
    qd = q.view(1, HQ, 1, D)
    with _sdpa("CUDNN_ATTENTION"):
        t, graphed = _graph_time(lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, ctx.k, ctx.v, enable_gqa=True), repeats)
    res["dense cuDNN"] = {"total_s": t, "graph": graphed, "gbps": 2 * n * HKV * D * 2 / t / 1e9}
    keys = ctx.keys()
    blocks_host = [(0, 1, n - 1)]
    bqs = BlockQueries.build(blocks_host, DEVICE)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 4
    splits = max(1, min(32, 2 * sms // HKV))

    def attention_step(m, sel_fn):
        """One decode step: sel_fn() -> (ids, counts) or None (mask cached), then block-sparse attention."""
        from ...attention.index import QueryBlocks

        sel = sel_fn()
        ids0, counts0 = sel if sel is not None else cached
        qb = QueryBlocks([0], [0], [1], [n - 1])
        index = SparseIndex(1, m.block_k, m.cfg.n_sink, m.cfg.n_window, m.groups, qb, ids0.int(), counts0.int())
        plan = BSAPlan(index, HQ, HKV, DEVICE)

        def step():
            sel = sel_fn()
            if sel is not None:  # a refreshed mask lands in the plan's buffers
                plan.blocks.copy_(sel[0])
                plan.counts.copy_(sel[1])
            return block_sparse_attention_triton(q, ctx.k_cache, ctx.v_cache, ctx.table[None], index, D ** -0.5,
                                                 num_splits=splits, plan=plan)
        return step

    for tag, extra in A.DECODE_VARIANTS:
        ih = _method("infinitehip", "3k", extra)
        stages, counts = ih.run_stages(3, q, bqs, keys, return_counts=True, lookahead=ih.cfg.lookahead)
        cached = (stages[-1], counts)

        def from_stage(first, ih=ih, stages=stages):
            def fn():
                out, c = ih.run_stages(3, q, bqs, keys, first, stages[first - 1] if first else None,
                                       return_counts=True, lookahead=ih.cfg.lookahead)
                return out[-1], c
            return fn

        variants = {"cached": lambda: None, "from stage 3": from_stage(2), "from stage 2": from_stage(1),
                    "full refresh": from_stage(0)}
        if extra:  # the cached step is the same kernel whatever the selection's flavour
            variants.pop("cached")
        times = {"cached": res.get("infinitehip cached", {}).get("total_s")}
        for label, fn in variants.items():
            try:
                t, graphed = _graph_time(attention_step(ih, fn), repeats)
                times[label] = t
                res[f"{tag} {label}"] = {"total_s": t, "graph": graphed}
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                res[f"{tag} {label}"] = {"error": f"{type(e).__name__}: {e}"}
        if len(times) == 4 and all(v is not None for v in times.values()):
            for preset in ("3k", "3k-fast", "3k-flash"):
                res[f"{tag} {preset} amortised"] = amortised(times, type(ih).presets[preset].refresh)
    hip = _method("hip", "2k")

    def hip_select():
        ids = hip.select(3, q, bqs, keys)
        return ids, (ids >= 0).sum(-1).int()

    try:
        cached = hip_select()
        t, graphed = _graph_time(attention_step(hip, hip_select), repeats)
        res["hip 2k"] = {"total_s": t, "graph": graphed}
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res["hip 2k"] = {"error": f"{type(e).__name__}: {e}"}
    return res
