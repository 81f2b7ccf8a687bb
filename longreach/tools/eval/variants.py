"""Decode variants over one prefill: an eval's methods that differ only in decode-time fields share each prompt's
prefill (`--share-prefill`).

A ruler or passkey cell costs its prompts' prefills: at 512K on Qwen2.5-Coder-0.5B ~14 s each against a second of
decoding. Candidates that change only how decode steps select (InfiniteHiP's `refresh` schedule, `lookahead`,
`dense_below_decode`: each config class's `DECODE_ONLY` fields) prefill identically, so one engine prefills each
prompt once and decodes it under every variant in turn:

  * the engine's own backend is variant 0 and runs every prefill; each other variant is a backend of the same class
    built with its own overrides (`DecodeVariants`, an `AttentionBackend` that hands decode steps to the selected
    one; its graph variant keys carry the variant's index, so no two variants share a captured graph);
  * the prompts run as `keep_kv` requests; after each variant's pass, `LLMEngine.redecode` restarts every sample
    from its first generated token (sampled from the prefill, the same for every variant) with the prompt's KV as
    the prefill left it, the selected variant's per-sequence decode state starting afresh (a decode method keeps no
    state its prefill must have made: attention/compose.py's contract); `release_kv` frees the pages at the end.

What it assumes, checked before any model loads (`check_variants`): every method of the group is the same method and
preset, none composed (`+`), and their resolved configs differ only in `DECODE_ONLY` fields. tests/test_eval_variants.py
checks that each variant's predictions equal those of an engine of its own. Not with tensor parallelism or KV
offloading (the engine's `keep_kv` refuses them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

from ...attention.backend import AttentionBackend, AttentionMetadata, Capabilities


def check_variants(specs, configs: list[dict | None]) -> None:
    """Raise ValueError unless `specs` (RunSpecs with their `configs`, the --attention-config entries they read) can
    share one prefill: one method and preset, not composed, configs apart only in the method's DECODE_ONLY fields."""
    from ...attention.registry import get_backend_class
    from ...config import EngineConfig

    labels = [s.label for s in specs]
    if len({(s.name, s.preset) for s in specs}) != 1 or any(s.decode for s in specs) or specs[0].name == "dense":
        raise ValueError(f"--share-prefill needs runs of one sparse method and preset, none composed with '+': "
                         f"got {labels}")
    cls = get_backend_class(specs[0].name)
    resolved = [cls.resolve_config(EngineConfig(attention=s.name, preset=s.preset, attention_config=c))
                for s, c in zip(specs, configs)]
    allowed = getattr(type(resolved[0]), "DECODE_ONLY", frozenset())
    if not allowed:
        raise ValueError(f"--share-prefill: {specs[0].name} declares no decode-only config fields, so its runs "
                         "cannot share a prefill")
    for spec, cfg in zip(specs[1:], resolved[1:]):
        apart = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(resolved[0], f.name)]
        bad = [f for f in apart if f not in allowed]
        if bad:
            raise ValueError(f"--share-prefill: {spec.label} differs from {specs[0].label} in {', '.join(bad)}, "
                             f"which prefill reads; runs sharing a prefill may differ only in "
                             f"{', '.join(sorted(allowed))}")


class DecodeVariants(AttentionBackend):
    """Prefill steps to `backends[0]`; decode steps (eager or graph) to `backends[active]`."""

    def __init__(self, backends: list[AttentionBackend]):
        first = backends[0]
        super().__init__(first.model_config, first.engine_config, first.device)
        self.backends, self.active = backends, 0
        self.name = first.name
        self.kv_layout = first.kv_layout
        self.capabilities = Capabilities(graph=first.capabilities.graph,
                                         mixed_batches=all(b.capabilities.mixed_batches for b in backends))
        self.config = getattr(first, "config", None)

    @classmethod
    def install(cls, engine, configs: list[dict | None]) -> "DecodeVariants":
        """Wrap `engine`'s backend (variant 0, `configs[0]`'s) with one more backend per later config, each bound to
        the engine's KV cache, and put the wrapper where the engine, its runner and its scorer hold their backend."""
        first = engine.backend
        backends = [first]
        for cfg in configs[1:]:
            config = dataclasses.replace(engine.config, attention_config=cfg)
            b = type(first)(engine.rank_model_config, config, engine.device)
            b.bind_kv_cache(engine.blocks.num_blocks * engine.config.block_size, engine.dtype)
            backends.append(b)
        wrapper = cls(backends)
        engine.backend = engine.runner.backend = engine.scorer.backend = wrapper
        return wrapper

    def select(self, i: int) -> None:
        self.active = i

    @property
    def _decode(self) -> AttentionBackend:
        return self.backends[self.active]

    def kv_needs(self, dtype):
        return self.backends[0].kv_needs(dtype)

    def begin_step(self, meta: AttentionMetadata) -> None:
        for b in (self.backends if meta.is_prefill else [self._decode]):  # a prefill resets every variant's state
            b.begin_step(meta)

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        return (self.backends[0] if meta.is_prefill else self._decode).forward(layer, q, k, v, k_cache, v_cache, meta)

    def capture_prefill(self, kv_cache, chunk_rows: list[int]) -> int:
        return self.backends[0].capture_prefill(kv_cache, chunk_rows)

    def graph_unsupported(self):
        return next((why for b in self.backends if (why := b.graph_unsupported())), None)

    def graph_step(self, seq_ids, seq_lens):
        key, load = self._decode.graph_step(seq_ids, seq_lens)
        return (self.active, key), load

    def graph_scratch(self) -> None:
        self._decode.graph_scratch()

    def graph_warm_keys(self):
        return [(rows, (self.active, key)) for rows, key in self._decode.graph_warm_keys()]

    @contextlib.contextmanager
    def graph_variant(self, key):
        i, inner = key
        previous, self.active = self.active, i
        try:
            with self._decode.graph_variant(inner):
                yield
        finally:
            self.active = previous

    def decode_reads(self):
        return self._decode.decode_reads()

    def free_sequence(self, seq_id: int) -> None:
        for b in self.backends:
            b.free_sequence(seq_id)


def generate_variants(llm, prompts: list[list[int]], params, variants: DecodeVariants
                      ) -> tuple[list[list], list[float]]:
    """Each prompt prefilled once and decoded under every variant: per variant, the RequestOutputs in prompt order,
    and the seconds of its pass (the first variant's includes the prefill)."""
    engine = llm.engine
    blocks = engine.blocks
    per = [blocks.blocks_for(len(p) + (params.max_tokens or 0)) for p in prompts]
    if max(per) > blocks.num_free_blocks:
        raise ValueError(f"--share-prefill: a prompt needs {max(per)} KV pages with its output, and the cache has "
                         f"{blocks.num_free_blocks} free: raise --kv-cache-memory-gb")
    # groups of prompts whose KV fits at once (each keeps its pages through every variant's pass)
    groups, group, used = [], [], 0
    for i, n in enumerate(per):
        if group and (used + n > blocks.num_free_blocks or len(group) == engine.config.max_num_seqs):
            groups.append(group)
            group, used = [], 0
        group.append(i)
        used += n
    groups.append(group)
    results = [[None] * len(prompts) for _ in variants.backends]
    seconds = [0.0] * len(variants.backends)
    for group in groups:
        outs, secs = _generate_group(engine, [prompts[i] for i in group], params, variants)
        for v, (o, t) in enumerate(zip(outs, secs)):
            for i, out in zip(group, o):
                results[v][i] = out
            seconds[v] += t
    return results, seconds


def _generate_group(engine, prompts: list[list[int]], params, variants: DecodeVariants
                    ) -> tuple[list[list], list[float]]:
    ids = [f"variants-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params, keep_kv=True)
    results, seconds = [], []
    try:
        for i in range(len(variants.backends)):
            t0 = time.perf_counter()
            variants.select(i)
            done = {}
            if i:
                for rid in ids:
                    out = engine.redecode(rid)
                    if out is not None:
                        done[rid] = out
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id} failed under variant {i}: {out.error}")
                    done[out.request_id] = out
            results.append([done[rid] for rid in ids])
            seconds.append(time.perf_counter() - t0)
    finally:
        for rid in ids:
            with contextlib.suppress(ValueError):
                engine.release_kv(rid)
        variants.select(0)
    return results, seconds
