"""`longreach bench decode`'s accounting of what a run holds and moves: host and GPU memory, the KV bytes a context
needs (the dense fit check and the KV budget per run) and the KV store's offload counters (bench/decode.py)."""
from __future__ import annotations

GiB = 1 << 30


def _host_memory() -> dict:
    """Bytes: the process RSS and its peak, and the machine's RAM."""
    status = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    status[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    rss, total = status.get("VmRSS"), None
    try:
        import psutil

        rss, total = psutil.Process().memory_info().rss, psutil.virtual_memory().total
    except ImportError:
        pass
    return {"rss_bytes": rss, "peak_rss_bytes": status.get("VmHWM"), "host_total_bytes": total}


def _kv_store_bytes(engine) -> tuple[int, int, int, int]:
    """(GPU tier, prefill staging area on the GPU, the staging area's bytes still allocated now, host tier) bytes of
    the engine's KV store. Called after decode: the staging area is then released (kvcache/offload.py)."""
    store = getattr(engine, "kv_cache", None)
    gpu = getattr(store, "gpu_nbytes", None)
    if gpu is None:
        gpu = getattr(store, "nbytes", 0)
    staging = getattr(store, "staging_nbytes", 0)  # allocated by every prefill step
    now = getattr(store, "staging_allocated_nbytes", staging)
    return int(gpu), int(staging or 0), int(now or 0), int(getattr(store, "host_nbytes", 0) or 0)


def _kv_stats(engine) -> dict | None:
    """`engine.kv_cache_stats()` as plain numbers, or None when the engine has no such method."""
    fn = getattr(engine, "kv_cache_stats", None)
    if not callable(fn):
        return None
    out = {}
    for key, value in (fn() or {}).items():
        out[key] = value.item() if hasattr(value, "item") else value
    return out


def _counter_deltas(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    keys = ("pages_hit", "pages_missed", "pages_evicted", "pages_installed", "pages_installed_in_step",
            "pages_installed_ahead", "bytes_h2d")
    return {k: after[k] - before[k] for k in keys if isinstance(after.get(k), (int, float))
            and isinstance(before.get(k), (int, float))}


def _offload_summary(snaps: list, steps: list[dict], prefill_kv: dict | None, seconds: float) -> dict | None:
    """Counters over the steady decode steps (each step's `kv`: its snapshots before and after it; an offloaded
    batch's prefill steps may fall between decode steps) and over the prefill steps (`prefill_kv`, their deltas
    summed); `snaps`: the snapshots before decode step 0 and after each decode step (gauges: pages used). `per_step`:
    every decode step's pages installed (and of them, installed inside the step) and bytes copied to the GPU, in the
    order of `step_s` (warm-up steps included), e.g. how much a refresh step installs against an ordinary one."""
    if not snaps or snaps[0] is None:
        return None
    total: dict = {}
    for step in steps:
        if step["warmup"]:
            continue
        for k, v in (_counter_deltas(*step["kv"]) or {}).items():
            total[k] = total.get(k, 0) + v
    hit, miss = total.get("pages_hit"), total.get("pages_missed")
    h2d = total.get("bytes_h2d")
    return {
        "decode": total,
        "hit_ratio": hit / (hit + miss) if hit is not None and miss is not None and hit + miss else None,
        "h2d_gb_s": h2d / seconds / 1e9 if h2d is not None and seconds > 0 else None,
        "prefill": prefill_kv,
        "per_step": [{k: d.get(k) for k in ("pages_installed", "pages_installed_in_step", "pages_installed_ahead",
                                            "bytes_h2d")}
                     for d in (_counter_deltas(*step["kv"]) or {} for step in steps)],
        "max_gpu_pages_used": max((x.get("gpu_pages_used", 0) for x in snaps), default=None),
        "max_host_pages_used": max((x.get("host_pages_used", 0) for x in snaps), default=None),
        "final": snaps[-1],
    }


def _kv_bytes_per_token(mc, kv_cache_dtype: str, run_dtype) -> int:
    """KV bytes per token as the engine stores them: K and V rows (fp8 rows carry their scale in 16 bytes after the
    values, kvcache/fp8.py) of every layer that keeps pages, i.e. the global layers of a model with sliding-window
    layers (their ring is fixed: `_ring_bytes`)."""
    from ...engine.llm_engine import resolve_kv_dtype
    from ...kvcache.fp8 import row_bytes
    from ...kvcache.window import layer_split

    layers = len(layer_split(mc)[0]) if mc.has_layer_windows else mc.num_layers
    return 2 * layers * mc.num_kv_heads * row_bytes(mc.head_dim, resolve_kv_dtype(kv_cache_dtype, run_dtype))


def _ring_bytes(mc, batch: int, kv_cache_dtype: str, run_dtype) -> int:
    """The sliding-window layers' ring for `batch` sequences and the scratch slot (kvcache/build.py `ring_plan`,
    max_num_seqs = batch as bench decode runs it); 0 for a model without sliding layers."""
    if not mc.has_layer_windows:
        return 0
    from ...engine.llm_engine import resolve_kv_dtype
    from ...kvcache.window import layer_split, ring_bytes_per_slot

    per_slot = ring_bytes_per_slot(len(layer_split(mc)[1]), mc.sliding_window, mc.num_kv_heads, mc.head_dim,
                                   resolve_kv_dtype(kv_cache_dtype, run_dtype))
    return (batch + 1) * per_slot


def _kv_need_bytes(mc, context: int, decode_tokens: int, batch: int, kw: dict, run_dtype) -> int:
    """KV bytes that `batch` sequences of context + decode tokens occupy, in whole pages, plus the sliding layers'
    ring where the model has one."""
    block = kw.get("block_size", 16)
    pages = batch * -(-(context + decode_tokens) // block)
    dtype = kw.get("kv_cache_dtype", "auto")
    return pages * block * _kv_bytes_per_token(mc, dtype, run_dtype) + _ring_bytes(mc, batch, dtype, run_dtype)


def _kv_budget_gb(need: int) -> float:
    """A --kv-cache-memory-gb that holds `need` bytes: 2% and 64 MiB of slack (the store's exact page layout, e.g.
    its fp8 scales, is its own)."""
    return (need * 1.02 + 64 * 2**20) / GiB


def _weights_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _estimate_weights_bytes(mc, run_dtype) -> int:
    import torch

    from ...models.llama import LlamaForCausalLM

    with torch.device("meta"):  # shapes only, no memory
        return sum(p.numel() for p in LlamaForCausalLM(mc).parameters()) * run_dtype.itemsize
