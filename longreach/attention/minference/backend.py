"""MInference's engine backend: per-head sparse prefill from the layer's patterns, dense decode (method.py has the
method and its decisions)."""
from __future__ import annotations

import dataclasses
import logging

import torch

from ...kernels import use_triton
from ..backend import AttentionBackend, AttentionMetadata, Capabilities, GraphSupport
from ..dense import DenseFallback
from ..index import QueryBlocks, RangeIndex
from ..presets import config_from, missing_layers, preset_and_overrides
from .config import PATTERN_CHOICE, PRESET_NOTES, MInferenceConfig, resolve_patterns, shipped_patterns
from .method import MInference

logger = logging.getLogger("longreach")


class MInferenceBackend(AttentionBackend):
    """MInference: per-head Λ-shape / vertical-slash / block-sparse prefill from a calibration file; dense decode."""

    name = "minference"
    honours_layer_windows = True  # sliding-window layers go to the dense fallback (DenseFallback's docstring)
    # decode is dense (the dense backend's graphs), or composed, another backend's (attention/compose.py)
    capabilities = Capabilities(graph=GraphSupport.STATIC, prefill_only=True)
    method_cls = MInference
    preset_notes = PRESET_NOTES

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        self.config = self.resolve_config(engine_config, by_alias=True)
        self.method = MInference(self.config, model_config.num_heads, model_config.num_kv_heads,
                                 model_config.num_layers, model_config)  # a rank: its heads' patterns
        dense_config = dataclasses.replace(engine_config, attention="dense", preset=None, attention_config=None)
        self.fallback = DenseFallback(model_config, dense_config, device, self.config.dense_layers,
                                      lambda layer, decoding: self.config.dense_below)
        if self.config.patterns is None:
            logger.info("minference: no pattern file, %s (shipped files: %s; `longreach calibrate --method "
                        "minference` writes one, loaded with --attention-config '{\"patterns\": \"P.json\"}')",
                        self.method.describe(), ", ".join(shipped_patterns()) or "none")
        elif self.config.patterns == shipped_patterns().get(engine_config.model):
            logger.info("minference: patterns %s (%s, shipped for %s: the default for this alias; a preset or "
                        "--attention-config '{\"patterns\": null}' gives every head one pattern)",
                        self.method.describe(), self.config.patterns, engine_config.model)
        else:
            logger.info("minference: patterns %s (%s)", self.method.describe(), self.config.patterns)

    @classmethod
    def resolve_config(cls, engine_config, by_alias: bool = False) -> MInferenceConfig:
        """The config of the preset and overrides; `by_alias`: engine_config.model is the model that runs, so a
        model run by its alias gets its shipped patterns when the pattern choice is open (method.py's docstring)."""
        base, overrides = preset_and_overrides("minference", MInference.presets, MInference.default_preset,
                                               engine_config)
        if "pattern" in overrides and "patterns" in overrides:
            raise ValueError("give either patterns (a calibration file) or pattern (one for every head), not both")
        cfg = config_from(MInferenceConfig, base, overrides)
        if by_alias and engine_config.preset is None and not set(PATTERN_CHOICE) & set(overrides):
            cfg = dataclasses.replace(cfg, patterns=resolve_patterns(None, engine_config.model))
        return cfg

    def always_dense_layers(self) -> tuple[int, ...]:
        return tuple(self.config.dense_layers)

    @classmethod
    def unsupported_reasons(cls, model_config, engine_config) -> list[str]:
        if cls.layer_window_problems(model_config):
            return cls.layer_window_problems(model_config)
        try:
            cfg = cls.resolve_config(engine_config, by_alias=True)
            MInference(cfg, model_config.num_heads, model_config.num_kv_heads, model_config.num_layers, model_config)
        except ValueError as e:
            return [str(e)]
        return missing_layers(cfg.dense_layers, model_config.num_layers)

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        cfg = self.config
        if not meta.is_prefill or self.fallback.applies(layer, meta.max_seq_len):
            return self.fallback.forward(layer, q, k, v, k_cache, v_cache, meta)
        m = self.method
        qb = QueryBlocks.build(meta.query_lens, meta.context_lens, cfg.block)
        tiles, cols, row0 = [], [], 0
        for i, n in enumerate(meta.query_lens):
            blocks = [(qb.start[b] - row0, qb.length[b], qb.pos[b]) for b in qb.of_sequence(i)]
            length = meta.context_lens[i] + n
            if length <= cfg.dense_below:  # short sequence in a long batch: every earlier key
                tiles.append(m.full_tiles(blocks, q.device))
                cols.append(torch.full((len(blocks), m.groups, 0), -1, dtype=torch.long, device=q.device))
            else:
                t, c = m.build(layer, q[row0:row0 + n], blocks, (k_cache, meta.block_tables[i]), length, self.scale)
                tiles.append(t)
                cols.append(c)
            row0 += n
        index = m.index(qb, tiles, cols)
        return self.attend(q, k_cache, v_cache, meta.block_tables, index)

    def attend(self, q, k_cache, v_cache, block_tables, index: RangeIndex) -> torch.Tensor:
        if use_triton(q):
            from ...kernels.vertical_slash import range_attention_triton

            return range_attention_triton(q, k_cache, v_cache, block_tables, index, self.scale,
                                          block_n=self.config.block)[0]
        from ..executor import range_attention

        return range_attention(q, k_cache, v_cache, block_tables, index, self.scale, need_lse=False)[0]
