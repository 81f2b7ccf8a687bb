"""The one place where the KV store is sized and built: GPU-resident pages (paged.py) or host pages with a GPU page
cache (offload.py: `build_offloaded_cache` below), from the engine config, the model's shape and what the attention
backend needs.

What the backend needs (`KVNeeds`, kvcache/base.py) it declares through `AttentionBackend.kv_needs`.

A model with sliding-window layers (Gemma 3) keeps pages for its global layers only and a fixed ring for the sliding
ones (window.py): a page costs the G global layers' bytes, and the ring (`max_num_seqs + 1` slots of `window` tokens
in every sliding layer) comes off the budget first, so the same budget holds about L / G times the tokens of an
all-global cache (docs/gemma3.md). A bounded cache (cascading's layout) composes with it unchanged: its pages are
the global layers' (with its side state of the global layers), at most `slots_for(max_model_len)` per sequence.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .base import KVCache, KVNeeds
from .block_manager import BlockManager
from .offload import OffloadedKVCache
from .paged import PagedKVCache
from .window import WindowedKVCache, layer_split, make_ring, resident_cache, ring_bytes_per_slot

logger = logging.getLogger("longreach")

GiB = 1 << 30
CPU_KV_DEFAULT_GB = 4.0  # the KV budget of a CPU run without --kv-cache-memory-gb (capped by what max_num_seqs need)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def build_kv_cache(cfg, mc, kv_dtype: torch.dtype, device: torch.device, needs: KVNeeds,
                   free_gpu_bytes: Callable[[], float],
                   agree: Callable[[int], int] = lambda n: n) -> tuple[BlockManager, KVCache]:
    """The block manager and the KV store for EngineConfig `cfg` and ModelConfig `mc` (a tensor-parallel rank's: its
    KV heads). `free_gpu_bytes()` profiles the GPU bytes left for KV (called only when the budget is sized from free
    memory). `agree(pages)`: the page count every tensor-parallel rank can hold (the smallest; rank 0's block tables
    index every rank's cache). Raises ValueError with what to change when the cache cannot hold one longest
    sequence."""
    if cfg.offload:
        return build_offloaded_cache(cfg, mc, kv_dtype, device, needs.dense_layers, free_gpu_bytes,
                                     needs.page_state_bytes, agree)
    layout = needs.layout
    num_blocks, ring_slots = _num_resident_blocks(cfg, mc, kv_dtype, device, needs, free_gpu_bytes, agree)
    blocks = BlockManager(num_blocks, cfg.block_size, slots_for=layout and layout.slots_for,
                          num_slots=ring_slots or None)
    # One extra page: the scratch page that padded CUDA-graph rows write to.
    cache = resident_cache(mc, num_blocks, cfg.block_size, kv_dtype, device, ring_slots)
    if ring_slots:
        _log_ring(cache, mc, num_blocks * cfg.block_size, None if layout is None else cfg.attention)
    logger.info("KV cache: %d pages x %d tokens = %d tokens (%.2f GiB, %s)", num_blocks, cfg.block_size,
                num_blocks * cfg.block_size, cache.nbytes / GiB, dtype_name(kv_dtype))
    if layout is not None:
        per_seq = blocks.blocks_for(cfg.max_model_len)
        at_once = min(num_blocks // per_seq, ring_slots or num_blocks)  # a sequence needs a ring slot too
        logger.info("KV cache: %s keeps every sequence in at most %d pages (%d slots: its bounded cache plus one "
                    "prefill chunk), whatever its length; %d pages serve %d such sequences at once",
                    cfg.attention, per_seq, layout.max_slots, num_blocks, at_once)
    return blocks, cache


def ring_plan(cfg, mc, kv_dtype, budget: float) -> tuple[int, int, int]:
    """(global layers, ring slots, ring bytes) of ModelConfig `mc` under a KV budget of `budget` bytes: every layer
    global and no ring for a model without sliding layers; else a slot per `max_num_seqs` (and the scratch one), fewer
    where the ring would take more than half the budget (at least one). Raises ValueError for a model whose every
    layer is sliding."""
    if not mc.has_layer_windows:
        return mc.num_layers, 0, 0
    glob, sliding = layer_split(mc)
    if not glob:
        raise ValueError("every layer of the model attends within a sliding window: a cache of its windows alone is "
                         "not built (docs/gemma3.md)")
    per_slot = ring_bytes_per_slot(len(sliding), mc.sliding_window, mc.num_kv_heads, mc.head_dim, kv_dtype)
    slots = cfg.max_num_seqs
    if (slots + 1) * per_slot > budget / 2:
        slots = max(1, int(budget / 2 // per_slot) - 1)
        logger.warning("the sliding-window layers' ring for max_num_seqs=%d sequences would take %.2f GiB, more than "
                       "half the KV budget (%.2f GiB): %d sequences can run at once (lower --max-num-seqs or raise "
                       "the budget)", cfg.max_num_seqs, (cfg.max_num_seqs + 1) * per_slot / GiB, budget / GiB, slots)
    return len(glob), slots, (slots + 1) * per_slot


def _log_ring(cache: WindowedKVCache, mc, tokens: int, bounded: str | None = None) -> None:
    """The two stores of a model with sliding layers. `tokens`: the pages' slots; `bounded`: the method whose bounded
    cache they hold (each sequence's cascade: slots, not every token of the context), None: every token."""
    glob, sliding = layer_split(mc)
    pages = f"every page ({tokens} tokens)" if bounded is None else \
        f"the pages of {bounded}'s bounded cache per sequence ({tokens} slots)"
    logger.info("KV cache: %d global layers keep %s; %d sliding-window layers keep a ring of their last %d tokens "
                "per sequence, %d sequence slots and a scratch one (%.1f MiB, fixed)", len(glob), pages,
                len(sliding), cache.window, cache.num_slots, cache.ring.nbytes / 2**20)


def _num_resident_blocks(cfg, mc, kv_dtype, device, needs: KVNeeds, free_gpu_bytes, agree=lambda n: n
                         ) -> tuple[int, int]:
    """(pages, ring slots: 0 for a model without sliding layers)."""
    cpu_default = cfg.kv_cache_memory_gb is None and device.type != "cuda"
    budget = cfg.kv_cache_memory_gb * GiB if cfg.kv_cache_memory_gb is not None else \
        (free_gpu_bytes() if device.type == "cuda" else CPU_KV_DEFAULT_GB * GiB)
    num_global, ring_slots, ring_bytes = ring_plan(cfg, mc, kv_dtype, budget)
    per_block = PagedKVCache.bytes_per_block(num_global, cfg.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype)
    layout = needs.layout  # a bounded cache: a sequence needs at most layout.max_slots slots
    need = cfg.max_model_len if layout is None else layout.slots_for(cfg.max_model_len)
    if layout is not None:
        per_block += layout.side_bytes_per_token * cfg.block_size
    pages_per_seq = -(-need // cfg.block_size)
    if cfg.kv_cache_memory_gb is None and device.type == "cuda":
        per_block += needs.page_state_bytes  # sized from free memory: leave room for per-page backend state
    if cpu_default:
        budget = min(budget - ring_bytes, per_block * pages_per_seq * cfg.max_num_seqs)
    else:
        budget -= ring_bytes
    num_blocks = int(max(budget, 0) // per_block)
    if layout is not None:  # more pages than max_num_seqs (or ring slots') bounded sequences can use would sit idle
        num_blocks = min(num_blocks, pages_per_seq * (ring_slots or cfg.max_num_seqs))
    num_blocks = agree(num_blocks)
    if ring_slots:  # every tensor-parallel rank's ring has rank 0's slots
        ring_slots = agree(ring_slots)
    if num_blocks * cfg.block_size < need:
        what = f"max_model_len={cfg.max_model_len}" if layout is None else \
            f"the {need} slots one {cfg.attention} sequence needs (its cache plus one prefill chunk)"
        raise ValueError(
            f"the KV cache fits {num_blocks * cfg.block_size} tokens ({budget / GiB:.2f} GiB), fewer than "
            f"{what}; raise kv_cache_memory_gb / gpu_memory_utilization or lower max_model_len")
    return num_blocks, ring_slots


# ---- the offloaded store ------------------------------------------------------------------------------------------
CPU_POOL_DEFAULT_GB = 4.0  # the "GPU" pool on a CPU run, when --kv-cache-memory-gb is not given


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# prefill staging buffers on a GPU: 2 overlaps each layer's prefix gather with the layer before (kvcache/staging.py);
# 1 is the earlier behaviour (scripts/device_runs.sh `stagingab` sets it to time both in one call)
STAGING_BUFFERS_GPU = 2


def build_offloaded_cache(cfg, mc, kv_dtype: torch.dtype, device: torch.device, dense_layers,
                          free_gpu_bytes, page_state_bytes: int = 0,
                          agree: Callable[[int], int] = lambda n: n) -> tuple[BlockManager, OffloadedKVCache]:
    """The block manager and the two-tier store for EngineConfig `cfg` and ModelConfig `mc`:
    `kv_offloading_size` GiB of pinned host pages hold every token, a GPU pool of `kv_cache_memory_gb` (default:
    `free_gpu_bytes()` less the staging area and the backend's GPU state per host page, `page_state_bytes`: psa's
    block metadata) caches the hot pages. With tensor parallelism both sizes are per rank (each rank offloads its own
    KV heads) and `agree(pages)` makes the host page count every rank's smallest (rank 0's block tables index every
    rank's host tier; each rank's GPU page cache is its own, sized alone). Raises ValueError with what to change
    when a tier does not fit; logs both tiers in GiB and tokens."""
    bs, H, D = cfg.block_size, mc.num_kv_heads, mc.head_dim
    # a model with sliding layers: the host tier and the GPU pool hold its global layers only, the ring stays on the
    # device (sized before the pool, from the pool's budget)
    gpu_budget = cfg.kv_cache_memory_gb * GiB if cfg.kv_cache_memory_gb is not None else \
        (free_gpu_bytes() if device.type == "cuda" else CPU_POOL_DEFAULT_GB * GiB)
    L, ring_slots, ring_bytes = ring_plan(cfg, mc, kv_dtype, gpu_budget)
    if ring_slots:  # every tensor-parallel rank's ring has rank 0's slots
        ring_slots = agree(ring_slots)
    if cfg.attention == "dense" and cfg.decode_attention is None:
        logger.warning("dense attention with KV offloading reads every page of every layer from host memory at "
                       "each decode step (PCIe-bound, slow); the sparse methods (infinitehip, hip, streaming) read "
                       "a few thousand tokens per step and cache them on the GPU")
    if dense_layers:
        logger.warning("layers %s attend densely: with KV offloading they read every page of the context from "
                       "host memory at each decode step; --attention-config '{\"dense_layers\": []}' avoids it",
                       list(dense_layers))
    per_page = OffloadedKVCache.bytes_per_page(L, bs, H, D, kv_dtype)
    host_pages = agree(int(cfg.kv_offloading_size * GiB // per_page))
    longest = -(-cfg.max_model_len // bs)
    if host_pages < longest:
        raise ValueError(
            f"kv_offloading_size={cfg.kv_offloading_size} GiB holds {host_pages * bs} tokens, fewer than "
            f"max_model_len={cfg.max_model_len} ({longest * per_page / GiB:.2f} GiB at {per_page // bs} bytes per "
            "token); raise --kv-offloading-size or lower --max-model-len")
    available = host_memory_available()
    if available is not None and host_pages * per_page > 0.9 * available:
        raise ValueError(f"kv_offloading_size={cfg.kv_offloading_size} GiB does not fit the host: "
                         f"{available / GiB:.1f} GiB of memory is available; lower --kv-offloading-size (it needs "
                         f"{longest * per_page / GiB:.2f} GiB for max_model_len={cfg.max_model_len})")
    staging = longest + -(-cfg.max_num_batched_tokens // bs) + 1
    unit = cfg.kv_offload_unit
    units = H if unit == "head" else 1
    per_slot = OffloadedKVCache.bytes_per_slot(bs, H, D, kv_dtype, unit)
    # a GPU double-buffers it (the next layer's prefix gathered while this one computes: staging.py); each buffer
    # holds whole pages of one layer
    buffers = STAGING_BUFFERS_GPU if device.type == "cuda" else 1
    staging_bytes = buffers * staging * OffloadedKVCache.bytes_per_slot(bs, H, D, kv_dtype)
    # head units' page table (int32) and read marks (bool) have H_kv entries per page: the extra ones come off the
    # budget (a page unit's share is in the 32 bytes per slot below)
    table_bytes = L * (host_pages + 1) * (units - 1) * 5
    if cfg.kv_cache_memory_gb is not None:
        budget = gpu_budget - ring_bytes - table_bytes
    elif device.type == "cuda":
        budget = gpu_budget - ring_bytes - staging_bytes - host_pages * page_state_bytes - table_bytes
    else:
        budget = min(gpu_budget - ring_bytes - table_bytes, host_pages * per_page)
    slots = int(budget // (per_slot + 32))  # + the page table's share per slot (int32 entry, owner, stamp)
    if slots < 1:
        table = f" after the per-head page table's {table_bytes / GiB:.2f} GiB" if table_bytes else ""
        raise ValueError(f"the GPU page cache gets {budget / GiB:.2f} GiB{table}, less than one page; raise "
                         "--kv-cache-memory-gb or --gpu-memory-utilization, or lower --kv-offloading-size")
    blocks = BlockManager(host_pages, bs, num_slots=ring_slots or None)
    try:
        store = OffloadedKVCache(L, host_pages + 1, slots, bs, H, D, kv_dtype, device, staging_pages=staging,
                                 unit=unit, staging_buffers=buffers)
        store.staging()  # allocated now, so that a GPU too small for it fails here and not mid-prefill
        if ring_slots:
            glob, sliding = layer_split(mc)
            store = WindowedKVCache(store, make_ring(mc, ring_slots, bs, kv_dtype, device), glob, sliding,
                                    mc.sliding_window, ring_slots)
    except (RuntimeError, MemoryError) as e:  # pinning or GPU allocation refused
        raise ValueError(f"could not allocate the KV tiers ({host_pages * per_page / GiB:.2f} GiB of host "
                         f"memory, {slots * per_slot / GiB:.2f} + {staging_bytes / GiB:.2f} GiB on the "
                         f"{device.type.upper()}): {str(e).splitlines()[0]}; lower --kv-offloading-size, "
                         "--kv-cache-memory-gb or --max-model-len") from None
    blocks.on_free = store.free_pages
    if ring_slots:
        _log_ring(store, mc, host_pages * bs)
    kv = str(kv_dtype).replace("torch.", "")
    logger.info("KV cache, host tier: %d pages x %d tokens = %d tokens (%.2f GiB%s, %s)", host_pages, bs,
                host_pages * bs, store.host_nbytes / GiB, " pinned" if device.type == "cuda" else "", kv)
    logger.info("KV cache, GPU tier: %d slots of one layer's page%s = %d tokens per layer on average (%.2f GiB, "
                "shared by the %d layers it holds); prefill staging %.2f GiB (%s of %d pages)", slots,
                " of one KV head" if units > 1 else "", slots * bs // (L * units),
                (store.inner if ring_slots else store).nbytes / GiB, L, store.staging_nbytes / GiB,
                "two buffers" if buffers == 2 else "one buffer", staging)
    return blocks, store
