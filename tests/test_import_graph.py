"""The import graph's rules (issue 29): kernels/ is a leaf, kernels/, attention/ and kvcache/ import each other without
a circle, and the package-level graph of the whole of longreach follows a declared order of layers.

Every import statement counts, at module level and inside functions (a function-level import is a dependency all the
same, only hidden) and under `if TYPE_CHECKING:`, with relative imports resolved against the importing module.

Layers, lowest first (`LAYERS`): an arrow may only point to a lower layer or stay inside its package:
  rope, progress, sampling_params, distributed < kernels < kvcache, models < attention < config < engine < longreach (the root
  package: `__version__`, lazy `LLM`), commands < server < tools (the lab: bench, eval, calibrate, demo) < cli <
  __main__
(a package not named in LAYERS is still in the circle test). Nothing of the runtime imports the lab (tools/), so that
`pip install longreach` needs none of the lab's dependencies; inside tools/, report < eval < bench, demo < calibrate.

Circles removed and kept out by these tests: kernels -> rope -> models -> kernels (RopeConfig now lives in
rope/config.py, models/config.py re-exports it), models.loader <-> models.random_init (random_init returns the config
and the model, loader wraps them), config <-> attention (attention/backend.py types the settings it reads with its own
EngineSettings protocol, and the preset check that needs an EngineConfig is config.parse_method), and inside
attention/ sparse <-> graph_decode <-> box_pool (one class in three mixin files: now the sparse backend owns a
GraphDecoder and the method's kept boxes). No module of longreach imports another in a circle
(`test_no_circle_among_the_modules_of_longreach`).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "longreach"
# what kernels/ may not import: everything above it
FORBIDDEN = tuple(f"longreach.{p}" for p in ("attention", "kvcache", "engine", "models", "server", "tools"))
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


# Every subpackage and top-level module of longreach, lowest layer first; "longreach" is the root package itself.
LAYERS = (
    ("rope", "progress", "sampling_params", "distributed"),
    ("kernels",),
    ("kvcache", "models"),
    ("attention",),
    ("config",),
    ("engine",),
    ("longreach", "commands"),
    ("server",),
    ("tools",),
    ("cli",),
    ("__main__",),
)
# arrows against the order that are known and listed in the module docstring: (from, to) -> the files that make them
KNOWN_UPWARD: dict = {}  # (src, dst) -> files allowed to import against the order of LAYERS: none


def unit_of(module: str) -> str | None:
    """The node of a longreach module in the package-level graph: its top-level subpackage or module, "longreach" for
    the root package (and a name imported from it, such as `__version__`), None outside longreach."""
    parts = module.split(".")
    if parts[0] != "longreach":
        return None
    if len(parts) == 1 or not ((PKG / parts[1]).is_dir() or (PKG / f"{parts[1]}.py").is_file()):
        return "longreach"
    return parts[1]


def whole_graph() -> dict[str, dict[str, set[str]]]:
    """node -> {imported node -> the files (relative to the repo) whose imports make that arrow}."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        src = unit_of(mod)
        arrows = graph.setdefault(src, {})
        for _, target in imports(path.read_text(), mod, path.name == "__init__.py"):
            dst = unit_of(target)
            if dst is not None and dst != src:
                arrows.setdefault(dst, set()).add(str(path.relative_to(ROOT)))
    return graph


def circles(graph: dict[str, dict[str, set[str]]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_graph_sees_every_package_and_the_root():
    graph = whole_graph()
    assert {"rope", "kernels", "kvcache", "models", "attention", "config", "engine", "longreach"} <= set(graph)
    assert unit_of("longreach.__version__") == "longreach" and unit_of("longreach.models.config") == "models"
    assert unit_of("torch") is None
    assert circles({"a": {"b": set()}, "b": {"c": set()}, "c": {"a": set()}, "d": {"a": set()}}) == [{"a", "b", "c"}]


def test_rope_imports_nothing_but_itself():
    graph = whole_graph()
    assert set(graph["rope"]) == set(), f"rope/ imports {graph['rope']}"


def test_no_circle_in_the_package_graph():
    """kernels -> rope -> models -> kernels, config <-> attention and every other package-level circle stay gone."""
    got = circles(whole_graph())
    assert not got, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in got)


def test_packages_import_only_downwards():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    graph = whole_graph()
    bad = []
    for src, arrows in sorted(graph.items()):
        for dst, files in sorted(arrows.items()):
            if src in layer and dst in layer and layer[dst] >= layer[src]:
                extra = files - KNOWN_UPWARD.get((src, dst), set())
                if extra:
                    bad.append(f"{src} -> {dst} ({', '.join(sorted(extra))})")
    assert not bad, "imports against the order of LAYERS:\n" + "\n".join(bad)


def test_no_circle_among_the_modules_of_models_and_rope():
    """models.loader <-> models.random_init (and any other circle inside models/ or rope/) stays gone."""
    for pkg in ("models", "rope"):
        graph: dict[str, dict[str, set[str]]] = {}
        for path in package_files(pkg):
            mod = module_name(path)
            arrows = graph.setdefault(mod, {})
            for _, target in imports(path.read_text(), mod, path.name == "__init__.py"):
                if in_package(target, f"longreach.{pkg}"):
                    is_module = (ROOT / (target.replace(".", "/") + ".py")).is_file()
                    owner = target if is_module else target.rpartition(".")[0]  # `from .x import name`: x
                    if owner != mod and owner != f"longreach.{pkg}":
                        arrows.setdefault(owner, set()).add(str(path.relative_to(ROOT)))
        assert circles(graph) == [], f"module circles in {pkg}/: {circles(graph)}"


def test_the_runtime_never_imports_the_lab():
    """Only the lab itself (tools/), the CLI and __main__ may import longreach.tools: the engine, the server and the
    commands of the engine run with the runtime's dependencies alone."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        if in_package(mod, "longreach.tools") or mod in ("longreach.cli", "longreach.__main__"):
            continue
        for line, target in imports(path.read_text(), mod, path.name == "__init__.py"):
            if in_package(target, "longreach.tools"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "the runtime imports the lab:\n" + "\n".join(bad)


# inside the lab, lowest first: the provenance record (report) under everything that writes JSON; the evaluations are
# what the benchmarks, calibration and demo build on; calibrate's crossover times steps with the benchmarks' machinery
LAB_LAYERS = (("report",), ("eval",), ("bench", "demo"), ("calibrate",))


def test_the_lab_imports_only_downwards():
    layer = {name: i for i, names in enumerate(LAB_LAYERS) for name in names}
    lab = PKG / "tools"
    assert {p.stem if p.is_file() else p.name for p in lab.iterdir() if p.name != "__init__.py"
            and not p.name.startswith("__")} == set(layer), "a part of tools/ missing from LAB_LAYERS"
    bad = []
    for path in sorted(lab.rglob("*.py")):
        mod = module_name(path)
        parts = mod.split(".")
        if len(parts) < 3:
            continue
        src = parts[2]
        for line, target in imports(path.read_text(), mod, path.name == "__init__.py"):
            t = target.split(".")
            if len(t) >= 3 and t[:2] == ["longreach", "tools"] and t[2] in layer and t[2] != src \
                    and layer[t[2]] >= layer[src]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({src}) imports {target}")
    assert not bad, "imports against the order of LAB_LAYERS:\n" + "\n".join(bad)


def module_of(target: str) -> str | None:
    """The longreach module (a .py file or a package's __init__) that an import target names: the target itself, or
    the module that defines the name it ends with; None outside longreach."""
    parts = target.split(".")
    if parts[0] != "longreach":
        return None
    while parts:
        path = ROOT.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    return None


def module_graph() -> dict[str, dict[str, set[str]]]:
    """module -> {imported module -> the lines that import it}, over every module of longreach. `from P import m` with
    m a submodule of P counts as an import of m alone: that P's __init__ runs first is Python importing a parent
    package, which every submodule does and which is no dependency of its own."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        arrows = graph.setdefault(mod, {})
        by_line: dict[int, set[str]] = {}
        for line, target in imports(path.read_text(), mod, path.name == "__init__.py"):
            found = module_of(target)
            if found is not None and found != mod:
                by_line.setdefault(line, set()).add(found)
        for line, found in by_line.items():
            for m in found:
                if any(other != m and other.startswith(m + ".") for other in found):
                    continue  # `from P import m`: P only as m's parent package
                arrows.setdefault(m, set()).add(f"{path.relative_to(ROOT)}:{line}")
    return graph


def test_the_module_graph_resolves_submodules_and_names():
    assert module_of("longreach.attention.sparse.SparseBackend") == "longreach.attention.sparse"
    assert module_of("longreach.attention.sparse.graph.GraphDecoder") == "longreach.attention.sparse.graph"
    assert module_of("torch.nn") is None
    graph = module_graph()
    assert "longreach.attention.sparse.graph" in graph["longreach.attention.sparse.backend"]
    # minference/method.py: `from . import index as mi` is an arrow to minference.index, not to minference/__init__
    assert "longreach.attention.minference" not in graph["longreach.attention.minference.method"]


def test_no_circle_among_the_modules_of_longreach():
    """No module-level circle anywhere in the package (function-level imports included): e.g. the sparse backend's
    graph decode and kept boxes, once mixins of one class in three files that imported each other, are objects the
    backend owns (attention/sparse/backend.py)."""
    got = circles(module_graph())
    assert not got, "module import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in got)
