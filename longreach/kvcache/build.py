"""The one place where the KV store is sized and built: GPU-resident pages (paged.py) or host pages with a GPU page
cache (offload.py), from the engine config, the model's shape and what the attention backend needs.

What the backend needs (`KVNeeds`, kvcache/base.py) it declares through `AttentionBackend.kv_needs`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .base import KVCache, KVNeeds
from .block_manager import BlockManager
from .offload import GiB, build_offloaded_cache
from .paged import PagedKVCache

logger = logging.getLogger("longreach")

CPU_KV_DEFAULT_GB = 4.0  # the KV budget of a CPU run without --kv-cache-memory-gb (capped by what max_num_seqs need)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def build_kv_cache(cfg, mc, kv_dtype: torch.dtype, device: torch.device, needs: KVNeeds,
                   free_gpu_bytes: Callable[[], float]) -> tuple[BlockManager, KVCache]:
    """The block manager and the KV store for EngineConfig `cfg` and ModelConfig `mc`. `free_gpu_bytes()` profiles
    the GPU bytes left for KV (called only when the budget is sized from free memory). Raises ValueError with what to
    change when the cache cannot hold one longest sequence."""
    if cfg.offload:
        return build_offloaded_cache(cfg, mc, kv_dtype, device, needs.dense_layers, free_gpu_bytes,
                                     needs.page_state_bytes)
    layout = needs.layout
    num_blocks = _num_resident_blocks(cfg, mc, kv_dtype, device, needs, free_gpu_bytes)
    blocks = BlockManager(num_blocks, cfg.block_size, slots_for=layout and layout.slots_for)
    # One extra page: the scratch page that padded CUDA-graph rows write to.
    cache = PagedKVCache(mc.num_layers, num_blocks + 1, cfg.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype, device)
    logger.info("KV cache: %d pages x %d tokens = %d tokens (%.2f GiB, %s)", num_blocks, cfg.block_size,
                num_blocks * cfg.block_size, cache.nbytes / GiB, dtype_name(kv_dtype))
    if layout is not None:
        per_seq = blocks.blocks_for(cfg.max_model_len)
        logger.info("KV cache: %s keeps every sequence in at most %d pages (%d slots: its bounded cache plus one "
                    "prefill chunk), whatever its length; %d pages serve %d such sequences at once",
                    cfg.attention, per_seq, layout.max_slots, num_blocks, num_blocks // per_seq)
    return blocks, cache


def _num_resident_blocks(cfg, mc, kv_dtype, device, needs: KVNeeds, free_gpu_bytes) -> int:
    per_block = PagedKVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype)
    layout = needs.layout  # a bounded cache: a sequence needs at most layout.max_slots slots
    need = cfg.max_model_len if layout is None else layout.slots_for(cfg.max_model_len)
    if layout is not None:
        per_block += layout.side_bytes_per_token * cfg.block_size
    pages_per_seq = -(-need // cfg.block_size)
    if cfg.kv_cache_memory_gb is None and device.type == "cuda":
        per_block += needs.page_state_bytes  # sized from free memory: leave room for per-page backend state
    if cfg.kv_cache_memory_gb is not None:
        budget = cfg.kv_cache_memory_gb * GiB
    elif device.type == "cuda":
        budget = free_gpu_bytes()
    else:
        budget = min(CPU_KV_DEFAULT_GB * GiB, per_block * pages_per_seq * cfg.max_num_seqs)
    num_blocks = int(budget // per_block)
    if layout is not None:  # more pages than max_num_seqs bounded sequences can use would sit idle
        num_blocks = min(num_blocks, pages_per_seq * cfg.max_num_seqs)
    if num_blocks * cfg.block_size < need:
        what = f"max_model_len={cfg.max_model_len}" if layout is None else \
            f"the {need} slots one {cfg.attention} sequence needs (its cache plus one prefill chunk)"
        raise ValueError(
            f"the KV cache fits {num_blocks * cfg.block_size} tokens ({budget / GiB:.2f} GiB), fewer than "
            f"{what}; raise kv_cache_memory_gb / gpu_memory_utilization or lower max_model_len")
    return num_blocks
