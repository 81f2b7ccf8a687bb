"""LLMEngine's setup steps, as the mixin `EngineSetup` that `LLMEngine` (engine/llm_engine.py) inherits: the changes
to the loaded model (--quantization fp8, --rope-scaling), the profiling step that sizes the KV cache on a GPU, and the
warm-up capture of the backend's graphs before serving.

The methods read and set the engine's attributes (`model`, `model_config`, `rank_model_config`, `config`, `device`,
`tp`, `backend`, `kv_dtype`, `scheduler`, `runner`); `LLMEngine._build` calls the first three while it builds the
engine.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..kvcache.block_manager import BlockManager
from ..kvcache.build import GiB
from ..kvcache.window import resident_cache
from ..sampling_params import SamplingParams
from .model_runner import ModelRunner
from .scheduler import ScheduledBatch
from .sequence import Sequence

logger = logging.getLogger("longreach")


class EngineSetup:
    """The model's load-time changes, the KV-cache memory profile and the warm-up graph capture of `LLMEngine`."""

    def _override_rope(self, override: dict) -> None:
        """--rope-scaling: replace the checkpoint's RoPE scaling (model config and the rotary module)."""
        from ..models.config import rope_override
        from ..rope.scaling import RotaryEmbedding

        mc = self.model_config
        rope = rope_override(mc.rope, mc.max_position_embeddings, override)
        self.model_config = dataclasses.replace(mc, rope=rope)
        self.model.rotary = RotaryEmbedding(rope, mc.head_dim).to(self.device)
        logger.info("RoPE scaling overridden: %s (the checkpoint's: %s)", rope.rope_type, mc.rope.rope_type)

    def _quantize_fp8(self) -> None:
        """--quantization fp8: the decoder's projections to e4m3 weights (models/fp8.py), before the KV cache is
        sized, so that the memory they free goes to it."""
        from ..models.fp8 import quantize_model_fp8, scaled_mm_supported

        before, after = quantize_model_fp8(self.model, self.tp)  # every rank: the row-parallel scales all-reduce
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        how = ("the fp8 GEMV kernel for calls of at most 16 rows (decode), torch._scaled_mm above"
               if scaled_mm_supported(self.device) else
               "the fp32 references (no fp8 tensor cores here: slower than unquantised)")
        whose = f" (rank {self.tp.rank}'s share)" if self.tp.world_size > 1 else ""
        logger.info("fp8 weights: the decoder's linear layers %.2f GB -> %.2f GB%s, through %s", before / 1e9,
                    after / 1e9, whose, how)

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> float:
        """Bytes left for the KV cache after weights and the activations of a largest prefill step."""
        cfg, mc = self.config, self.rank_model_config
        n = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        layout = self.backend.kv_layout
        slots = n if layout is None else layout.slots_for(n)
        ring = 1 if mc.has_layer_windows else None  # sliding-window layers: a ring of one slot (kvcache/window.py)
        blocks = BlockManager(-(-slots // cfg.block_size), cfg.block_size, slots_for=layout and layout.slots_for,
                              num_slots=ring)
        cache = resident_cache(mc, blocks.num_blocks, cfg.block_size, self.kv_dtype, self.device, ring or 0)
        runner = ModelRunner(self.model, cfg, cache, blocks, self.backend, self.device)
        probe = Sequence(-1, "profile", 0, [0] * n, SamplingParams(max_tokens=1), frozenset(), 1)
        blocks.ensure(probe.seq_id, n)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        runner.execute(ScheduledBatch(True, [probe], [n]))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - cache.nbytes
        self.backend.free_sequence(probe.seq_id)
        del cache, runner
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)  # other processes on this GPU
        margin = 512 * 1024**2  # CUDA graphs, sampler buffers, allocator slack
        budget = total * cfg.gpu_memory_utilization - peak - others - margin
        logger.info("GPU memory: %.1f GiB total, weights + activations peak %.2f GiB, KV budget %.1f GiB",
                    total / GiB, peak / GiB, budget / GiB)
        return max(budget, 0.0)

    def warmup_prompt_tokens(self) -> int:
        """The prompt tokens of a warm-up request that runs this engine's long-prompt kernels: one chunk + 1024 past
        the longest context its backend attends densely at (`warm_context`: a sparse method's `dense_below`, e.g.
        the trained context), so that a whole chunk with a prefix runs the method's own kernels (their long-prefill
        layouts included) before the first timed or served prompt. The server's warm-up and `bench decode`'s take it
        (each caps it: max_model_len, half the measured context)."""
        return self.backend.warm_context() + self.config.max_num_batched_tokens + 1024

    def capture_warm_graphs(self) -> None:
        """Before serving or timing: the backend's prefill-selection graphs for the scheduler's chunk sizes (a prompt
        alone, beside others, and each paced size) at every context length up to max_model_len, and its decode
        variants of short rows alone and of one and two long rows (ModelRunner.capture_warm_variants), so that their
        kernels compile now and not inside the first long request, and a long row joining any batch replays a warm
        graph. With tensor parallelism each rank captures its own at first use instead
        (rank 0 alone would capture them here). The server's warm-up and `bench decode` call it after their warm-up
        request."""
        if self.tp.world_size > 1:
            logger.info("warm-up: tensor parallelism: the sparse decode variants and prefill-selection graphs are not "
                        "captured up front (every rank captures each at first use, in the same step)")
            return
        t0 = time.perf_counter()
        sizes = self.scheduler.chunk_sizes()
        n = self.runner.capture_prefill_graphs(sizes)
        if n:
            logger.info("warm-up: %d prefill-selection graphs captured (chunks of %s tokens at every context length "
                        "up to %d) in %.1f s", n, " and ".join(map(str, sorted(set(sizes)))),
                        self.config.max_model_len, time.perf_counter() - t0)
        t0 = time.perf_counter()
        n = self.runner.capture_warm_variants()
        if n:
            logger.info("warm-up: %d decode-graph variants captured (short rows alone at every batch size; one and "
                        "two long rows, alone and in batches of 16, 64, 256, ... and the largest size, every context "
                        "length and refresh level) in %.1f s",
                        n, time.perf_counter() - t0)
