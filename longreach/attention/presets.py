"""Config resolution, the one way every method turns `--preset` and `--attention-config` into its frozen config.

A method keeps its presets as named instances of its config dataclass (its folder's config.py); the engine names one
with `--preset` (else the method's default) and overrides fields with `--attention-config '{"n_sink": 128, ...}'`.
`preset_and_overrides` picks the preset, `config_from` applies the overrides with a type check per field, so an
unknown preset, an unknown field or a value of the wrong type fails before any model loads, saying what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing


def preset_and_overrides(method: str, presets: dict, default: str, engine_config) -> tuple[object, dict]:
    """The preset `engine_config` names (else `default`) and its `--attention-config` overrides (a dict); an unknown
    preset raises ValueError listing the method's presets. Every preset-based backend resolves its config this way."""
    preset = engine_config.preset or default
    if preset not in presets:
        raise ValueError(f"unknown {method} preset {preset!r}; available: {', '.join(presets)} (default: {default}; "
                         f"`longreach backends` says what each is for)")
    return presets[preset], dict(engine_config.attention_config or {})  # a dict: EngineConfig parsed any JSON


def _fits(value, hint) -> bool:
    """Does a JSON value fit a config field's type hint (int, float, bool, str, tuple[int, ...], X | None)?"""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in args)
    if hint is type(None):
        return value is None
    if hint is tuple or typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        return not (len(args) == 2 and args[1] is Ellipsis) or all(_fits(v, args[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):  # a bool is an int to Python, not to a user; an int is a fine float
        return isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def config_from(cls: type, base, overrides: dict):
    """`base` (an instance of the dataclass `cls`) with `overrides` applied; unknown fields, values of the wrong type
    and bad values raise ValueError naming what is allowed."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; valid: {', '.join(sorted(names))}")
    hints = typing.get_type_hints(cls)
    for k, v in overrides.items():
        if not _fits(v, hints[k]):
            want = hints[k].__name__ if isinstance(hints[k], type) else str(hints[k])
            raise ValueError(f"{cls.__name__} field {k} must be {want}, got {json.dumps(v)}")
    fixed = {k: tuple(v) if isinstance(v, list) and "tuple" in str(hints[k]) else v for k, v in overrides.items()}
    try:
        return dataclasses.replace(base, **fixed)
    except TypeError as e:  # a check in the config's __post_init__ that met a type it did not expect
        raise ValueError(f"{cls.__name__}: {e}") from None


def resolve(cls: type, method: str, presets: dict, default: str, engine_config):
    """The config of dataclass `cls` that `engine_config` asks for: its preset (else `default`) with its overrides."""
    return config_from(cls, *preset_and_overrides(method, presets, default, engine_config))


def missing_layers(dense_layers, num_layers: int) -> list[str]:
    """Why `dense_layers` cannot serve a model of `num_layers` layers (a backend's `unsupported_reasons`), or []."""
    bad = [layer for layer in dense_layers if layer >= num_layers]
    return [f"dense_layers {bad} do not exist (the model has {num_layers} layers)"] if bad else []
