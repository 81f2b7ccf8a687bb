"""The import graph's rules (issue 29): kernels/ is a leaf, and kernels/, attention/ and kvcache/ import each other
without a circle.

Every import statement counts, at module level and inside functions (a function-level import is a dependency all the
same, only hidden), with relative imports resolved against the importing module.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "longreach"
# what kernels/ may not import: everything above it
FORBIDDEN = tuple(f"longreach.{p}" for p in ("attention", "kvcache", "engine", "models", "server", "eval", "bench"))
CORE = ("kernels", "attention", "kvcache")  # no circle among these packages


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute target) of every import in `source`, anywhere in it. `from X import a` gives X.a as well as X
    (a may be a submodule); relative imports are resolved against `module`."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names if a.name != "*"]
    return found


def package_files(name: str) -> list[pathlib.Path]:
    return sorted((PKG / name).rglob("*.py"))


def in_package(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def test_the_resolver_sees_hidden_and_relative_imports():
    src = "import torch\nfrom . import paged\ndef f():\n    from ..attention.index import SparseIndex\n"
    got = imports(src, "longreach.kernels.bsa")
    assert (2, "longreach.kernels.paged") in got and (1, "torch") in got
    assert (4, "longreach.attention.index") in got
    assert (1, "longreach.kernels.fp8") in imports("from .fp8 import FP8", "longreach.kernels", is_package=True)


def test_kernels_import_nothing_above_them():
    files = package_files("kernels")
    assert len(files) > 10
    bad = {}  # "file:line" -> its first offending target
    for path in files:
        mod = module_name(path)
        for line, target in imports(path.read_text(), mod, path.name == "__init__.py"):
            if any(in_package(target, f) for f in FORBIDDEN):
                where = f"{path.relative_to(ROOT)}:{line}"
                bad.setdefault(where, f"{where} ({mod}) imports {target}")
    assert not bad, "kernels/ must stay a leaf (torch, triton, stdlib, rope/, kernels/ only):\n" + "\n".join(
        bad.values())


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {p: set() for p in CORE}
    for pkg in CORE:
        for path in package_files(pkg):
            for _, target in imports(path.read_text(), module_name(path), path.name == "__init__.py"):
                for other in CORE:
                    if other != pkg and in_package(target, f"longreach.{other}"):
                        graph[pkg].add(other)
    return graph


def test_no_circle_among_kernels_attention_kvcache():
    graph = _package_graph()
    assert graph["kernels"] == set(), f"kernels/ imports {sorted(graph['kernels'])}"

    def walk(node: str, trail: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in trail:
                pytest.fail("import circle: " + " -> ".join(trail[trail.index(nxt):] + [nxt]))
            walk(nxt, trail + [nxt])

    for start in CORE:
        walk(start, [start])
