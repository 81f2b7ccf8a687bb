"""The engine flags: one per EngineConfig field, for every command that builds an engine from its flags."""
from __future__ import annotations

import argparse
import dataclasses

from ..config import EngineConfig

_ENGINE_TYPES = {"cpu_threads": int, "max_model_len": int, "long_prefill_token_threshold": int, "kv_cache_memory_gb": float,
                 "mixed_step_target_ms": float, "quantization": str, "kv_offloading_size": float,
                 "rope_scaling": str, "preset": str, "attention_config": str, "decode_attention": str,
                 "decode_attention_config": str}


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field (the dataclass is the single source of names, defaults and help), except the
    fields in `skip`, which the command sets itself."""
    g = p.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            g.add_argument(flag, action="store_true", help=f.metadata["help"])
            continue
        kind = _ENGINE_TYPES.get(f.name, type(default))
        shown = "" if default is None else f" (default: {default})"
        g.add_argument(flag, type=kind, default=default, metavar=f.name.upper(), help=f.metadata["help"] + shown)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()})
