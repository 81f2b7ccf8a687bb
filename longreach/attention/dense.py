"""Dense attention: every query attends to every earlier key.

Prefill: PyTorch SDPA per sequence (cuDNN first on GPU, then flash / mem-efficient; the math kernel on CPU). A chunk
with a cached prefix gathers the prefix from the paged cache and uses a bottom-right-aligned causal mask.
Decode: the Triton paged flash-decoding kernel on CUDA (CUDA-graph capturable), its PyTorch reference on CPU.

`DenseFallback` is the sparse methods' shared rule for when they attend densely instead (always-dense layers, short
contexts) and the dense backend that then runs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.nn import functional as F

from ..kernels import use_triton
from ..kernels.combine import sm_count
from ..kernels.paged_decode import default_num_splits, paged_decode, paged_decode_reference
from ..kvcache.paged import gather_tokens
from .backend import AttentionBackend, AttentionMetadata, Capabilities, GraphSupport


def _sdpa_context(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, H_q, D) are the last n positions of a sequence whose keys are k, v (L, H_kv, D), L >= n -> (n, H_q, D)."""
    n, Hq, _ = q.shape
    L, Hkv, _ = k.shape
    g = Hq // Hkv
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H_q, n, D)
    # (1, H_q, L, D): expand K/V over the GQA group (the fused GPU kernels have no GQA path)
    kh = k.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
    vh = v.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
    with _sdpa_context(q.device):
        if n == L:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            from torch.nn.attention.bias import causal_lower_right

            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, L), scale=scale)
    return out.squeeze(0).transpose(0, 1)


class DenseBackend(AttentionBackend):
    name = "dense"
    capabilities = Capabilities(graph=GraphSupport.STATIC, mixed_batches=True)

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        if meta.is_prefill:
            return self._prefill(q, k, v, k_cache, v_cache, meta)
        return self._decode(q, k_cache, v_cache, meta)

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        out = torch.empty_like(q)
        start = 0
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            rows = slice(start, start + n)
            if ctx == 0:
                ki, vi = k[rows], v[rows]
            else:  # chunked prefill: the prefix lives in the paged cache (this chunk was stored there too)
                ki = gather_tokens(k_cache, meta.block_tables[i], ctx + n).to(q.dtype)
                vi = gather_tokens(v_cache, meta.block_tables[i], ctx + n).to(q.dtype)
            out[rows] = causal_attention(q[rows], ki, vi, self.scale)
            start += n
        return out

    @classmethod
    def resolve_config(cls, engine_config) -> None:
        if engine_config.preset or engine_config.attention_config is not None:
            raise ValueError("dense attention (the default --attention) takes no --preset or --attention-config: "
                             "they configure a sparse method, e.g. --attention infinitehip --preset 3k-fast "
                             "(`longreach backends` lists each method's presets)")
        return None

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        self._num_sms = sm_count(device)

    def num_splits(self, batch: int) -> int:
        """Split count for the decode kernel: a function of the batch size only, so eager and graph runs agree."""
        return default_num_splits(batch, self.model_config.num_kv_heads, self.engine_config.max_model_len,
                                  num_sms=self._num_sms)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata):
        if use_triton(q):
            out, _ = paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                  num_splits=self.num_splits(q.shape[0]))
        else:
            out, _ = paged_decode_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale)
        return out


class DenseFallback:
    """When a method attends densely instead of by its own rule, and the dense backend that then runs: in its
    always-dense layers, and for a context no longer than the layer's limit (`limit(layer, decoding)` tokens; 0:
    never). Prefill and decode may have different limits (sparse/config.py's `dense_below_decode`): a decode step
    asks with decoding=True, a prefill chunk with False, and decode's CUDA-graph variants are keyed by the decode
    limits (`limits(True)`)."""

    def __init__(self, model_config, engine_config, device: torch.device, dense_layers: tuple[int, ...],
                 limit: Callable[[int, bool], int] = lambda layer, decoding: 0):
        self.backend = DenseBackend(model_config, engine_config, device)
        self.num_layers = model_config.num_layers
        self.layers = tuple(dense_layers)
        self.limit = limit

    def applies(self, layer: int, length: int, decoding: bool = False) -> bool:
        """Does `layer` attend densely when the longest sequence of the step holds `length` tokens?"""
        return layer in self.layers or length <= self.limit(layer, decoding)

    def sparse_layers(self) -> list[int]:
        return [layer for layer in range(self.num_layers) if layer not in self.layers]

    def limits(self, decoding: bool = False) -> list[int]:
        """The distinct limits over every layer, ascending."""
        return sorted({self.limit(layer, decoding) for layer in range(self.num_layers)})

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, k_cache, v_cache, meta)
