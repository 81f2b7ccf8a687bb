"""Attention-backend registry: name -> lazily imported class, and `MethodSpec`, the one parser of `METHOD[:PRESET]`.

Built-in backends are listed as "module:Class" strings so that naming one imports nothing heavy; `register_backend`
adds a user's own class under a new name (or replaces one). Importing this module imports no torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .backend import AttentionBackend

_BUILTIN = {
    "dense": "longreach.attention.dense:DenseBackend",
    "infinitehip": "longreach.attention.infinitehip.backend:InfiniteHiPBackend",
    "hip": "longreach.attention.hip.backend:HiPBackend",
    "quest": "longreach.attention.quest.backend:QuestBackend",
    "streaming": "longreach.attention.streaming.backend:StreamingBackend",
    "minference": "longreach.attention.minference.backend:MInferenceBackend",
    "cascading": "longreach.attention.cascading.backend:CascadingBackend",
    "psa": "longreach.attention.psa.backend:PSABackend",
}
_registry: dict[str, "str | type[AttentionBackend]"] = dict(_BUILTIN)


def available_backends() -> list[str]:
    return sorted(_registry)


def check_backend_name(name: str) -> None:
    if name not in _registry:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")


class MethodSpec(NamedTuple):
    """An attention method and its preset (None: the method's default), as `METHOD[:PRESET]` names them on the
    command line (--attention, --decode-attention, eval method lists). `str(spec)` gives the text back."""

    method: str
    preset: str | None = None

    @classmethod
    def parse(cls, text: str, what: str = "attention method") -> "MethodSpec":
        """"infinitehip:3k-fast" -> MethodSpec("infinitehip", "3k-fast"); "dense" (or "dense:") -> preset None.
        Raises ValueError naming the known methods for an empty text or an unknown method; `what` names the text.
        The preset is checked by `config.parse_method` (it needs EngineConfig, which sits above attention/)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{what} must be METHOD[:PRESET] with METHOD one of {', '.join(available_backends())}, "
                             f"got {text!r}")
        method, _, preset = text.partition(":")
        check_backend_name(method)
        return cls(method, preset or None)

    def __str__(self) -> str:
        return f"{self.method}:{self.preset}" if self.preset else self.method


def check_method_config(config) -> None:
    """Raise ValueError when `config` (an EngineConfig) names a preset or `attention_config` overrides that its
    attention method does not accept. Needs no model (the backend's `resolve_config`), so a typo fails before anything
    loads; imports the backend's module."""
    get_backend_class(config.attention).resolve_config(config)


def register_backend(name: str, cls: "type[AttentionBackend] | str") -> None:
    """Register `cls` (a class or a "module:Class" string) under `name`."""
    if not name or not isinstance(name, str):
        raise ValueError("backend name must be a non-empty string")
    _registry[name] = cls


def register_presets(method: str, presets: dict[str, tuple[object, str]]) -> None:
    """Add named presets to a preset-based method's table: name -> (config, the one line `longreach backends` shows).

    For presets that serve evaluation rather than users: the lab (longreach/tools/eval/presets.py) registers the
    retrieval ladder's rungs this way, so the runtime's own table lists only what a user should pick. Registering a
    name again with an equal config does nothing; a different config under a name already taken, or a config of
    another class than the method's, raises ValueError. Imports the backend's module; mutates its class's tables
    (process-wide)."""
    cls = get_backend_class(method)
    method_cls = getattr(cls, "method_cls", None)
    if method_cls is None:
        raise ValueError(f"attention backend {method!r} has no preset table")
    for name, (config, _) in presets.items():
        if not isinstance(config, method_cls.config_cls):
            raise ValueError(f"{method} preset {name!r} must be a {method_cls.config_cls.__name__}, "
                             f"got {type(config).__name__}")
        if method_cls.presets.get(name, config) != config:
            raise ValueError(f"{method} preset {name!r} already exists with another config")
    method_cls.presets = {**method_cls.presets, **{name: config for name, (config, _) in presets.items()}}
    cls.preset_notes = {**cls.preset_notes, **{name: note for name, (_, note) in presets.items()}}


def get_backend_class(name: str) -> "type[AttentionBackend]":
    check_backend_name(name)
    entry = _registry[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        _registry[name] = entry
    return entry
