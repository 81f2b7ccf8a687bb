"""`longreach backends`: the attention backends, whether each captures CUDA graphs, and their presets."""
from __future__ import annotations

import sys

HELP = "list the attention backends"
DESCRIPTION = "List the attention backends."


def add_arguments(p) -> None:
    pass


def main(args) -> int:
    from ..attention.backend import GraphSupport
    from ..attention.registry import available_backends, get_backend_class

    print(f"{'backend':<14} {'CUDA graphs':<12} description; below it, its presets (--preset), the default first")
    for name in available_backends():
        cls = get_backend_class(name)
        doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        print(f"{name:<14} {'no' if cls.capabilities.graph is GraphSupport.NONE else 'yes':<12} {doc}")
        for preset, note in cls.preset_notes.items():
            print(f"    {preset:<14} {note}")
    return 0
