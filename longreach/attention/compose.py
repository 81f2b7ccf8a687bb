"""Prefill and decode methods composed: one backend runs the prefill steps, another the decode steps.

`--attention M` picks the method of both phases, as before. `--decode-attention D[:PRESET]` (with
`--decode-attention-config JSON` for D's fields) gives decode its own method: `--attention minference
--decode-attention infinitehip:3k-fast` prefills with MInference and decodes with InfiniteHiP's cached masks; any
sparse prefill can feed any decode method, because both read the same paged KV cache and a decode backend keeps no
state that its own prefill must have made (a decode method's per-sequence state starts at the first decode step:
`begin_step` of a prefill step resets it in both backends). MInference is prefill-only: alone it decodes densely
(the paper's protocol), and it cannot be the decode method.

The engine builds its backend with `make_backend`; everything else sees one `AttentionBackend`. CUDA graphs follow
the decode backend (its variants, its static buffers).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

from ..kvcache.base import KVNeeds
from .backend import AttentionBackend, AttentionMetadata, Capabilities
from .registry import MethodSpec, available_backends, get_backend_class

logger = logging.getLogger("longreach")


def decode_config(config):
    """The EngineConfig the decode backend sees: its own name, preset and attention_config."""
    name, preset = MethodSpec.parse(config.decode_attention, what="decode_attention")
    return dataclasses.replace(config, attention=name, preset=preset, attention_config=config.decode_attention_config,
                               decode_attention=None, decode_attention_config=None)


def _checked(cls, model_config, config, role: str):
    reasons = cls.unsupported_reasons(model_config, config)
    if reasons:
        raise ValueError(f"{role}attention backend {config.attention!r} cannot run this model: {'; '.join(reasons)}")
    return cls


def make_backend(model_config, config, device) -> AttentionBackend:
    """The engine's attention backend for `config` (an EngineConfig): one backend, or a prefill and a decode backend
    composed. Raises ValueError with what is wrong and what is allowed."""
    prefill_cls = _checked(get_backend_class(config.attention), model_config, config, "")
    spec = getattr(config, "decode_attention", None)
    same = spec is not None and MethodSpec.parse(spec) == (config.attention, config.preset) \
        and config.decode_attention_config == config.attention_config
    if spec is None or same:
        backend = prefill_cls(model_config, config, device)
        if config.offload and prefill_cls.capabilities.prefill_only:
            logger.warning("%s decodes densely: with KV offloading every decode step reads the whole context from "
                           "host memory; --decode-attention infinitehip (or hip, streaming) reads a few thousand "
                           "tokens per step", config.attention)
        return backend
    dcfg = decode_config(config)
    decode_cls = get_backend_class(dcfg.attention)
    for cls in (prefill_cls, decode_cls):
        if cls.capabilities.bounded_cache:
            raise ValueError(f"{cls.name} keeps a bounded cache of its own (it forgets tokens), so it cannot be "
                             "composed with another method: drop --decode-attention")
    if decode_cls.capabilities.prefill_only:
        decoders = [n for n in available_backends() if not get_backend_class(n).capabilities.prefill_only]
        raise ValueError(f"{dcfg.attention} is a prefill-only method and cannot decode; --decode-attention takes one "
                         f"of {', '.join(decoders)}")
    _checked(decode_cls, model_config, dcfg, "decode ")
    if config.offload and dcfg.attention == "dense":
        logger.warning("dense decode with KV offloading reads every page of every layer from host memory at each "
                       "decode step (PCIe-bound, slow)")
    backend = ComposedBackend(prefill_cls(model_config, config, device), decode_cls(model_config, dcfg, device))
    logger.info("attention: %s prefill, %s decode", config.attention + (f":{config.preset}" if config.preset else ""),
                spec)
    return backend


class ComposedBackend(AttentionBackend):
    """Prefill steps go to `prefill`, decode steps (eager or graph-captured) to `decode`."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        super().__init__(decode.model_config, prefill.engine_config, decode.device)
        self.prefill, self.decode = prefill, decode
        self.name = f"{prefill.name}+{decode.name}"
        # decodes as `decode` does; a mixed step's parts go to both halves (begin_step), so both must take them
        self.capabilities = Capabilities(graph=decode.capabilities.graph, mixed_batches=(
            prefill.capabilities.mixed_batches and decode.capabilities.mixed_batches))
        self.config = getattr(decode, "config", None)  # the decode method's config, for tools that inspect it

    def kv_needs(self, dtype) -> KVNeeds:
        """Per-page state of both halves (each keeps its own: Quest's page boxes in prefill, PSA's in decode), and the
        decode half's dense layers: it reads the cache every step (no bounded cache here)."""
        return KVNeeds(page_state_bytes=self.prefill.page_state_bytes(dtype) + self.decode.page_state_bytes(dtype),
                       dense_layers=self.decode.always_dense_layers())

    def begin_step(self, meta: AttentionMetadata) -> None:
        self.prefill.begin_step(meta)
        self.decode.begin_step(meta)

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        backend = self.prefill if meta.is_prefill else self.decode
        return backend.forward(layer, q, k, v, k_cache, v_cache, meta)

    def decode_reads(self) -> dict | None:
        return self.decode.decode_reads()

    def free_sequence(self, seq_id: int) -> None:
        self.prefill.free_sequence(seq_id)
        self.decode.free_sequence(seq_id)

    def capture_prefill(self, kv_cache, chunk_rows: list[int]) -> int:
        return self.prefill.capture_prefill(kv_cache, chunk_rows)

    def warm_context(self) -> int:
        return max(self.prefill.warm_context(), self.decode.warm_context())

    def bind_kv_cache(self, capacity_tokens: int, dtype) -> None:
        self.prefill.bind_kv_cache(capacity_tokens, dtype)
        self.decode.bind_kv_cache(capacity_tokens, dtype)

    def graph_unsupported(self):
        return self.decode.graph_unsupported()

    def graph_step(self, seq_ids, seq_lens):
        return self.decode.graph_step(seq_ids, seq_lens)

    def graph_scratch(self) -> None:
        self.decode.graph_scratch()

    def graph_warm_keys(self) -> list[tuple[int, tuple]]:
        return self.decode.graph_warm_keys()

    @contextlib.contextmanager
    def graph_variant(self, key):
        with self.decode.graph_variant(key):
            yield
