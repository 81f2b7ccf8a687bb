"""StreamingLLM (Xiao et al., 2023): attention sinks plus a sliding window, nothing selected. config.py
(StreamingConfig, presets), method.py (the empty selection), backend.py (StreamingBackend)."""
from .backend import StreamingBackend
from .config import DEFAULT_PRESET, PRESET_NOTES, PRESETS, StreamingConfig
from .method import Streaming

__all__ = ["DEFAULT_PRESET", "PRESETS", "PRESET_NOTES", "Streaming", "StreamingBackend", "StreamingConfig"]
