"""The import graph of ``agent/`` and ``exporters/``, read from the source (AST), for the layer
tests (tests/test_import_graph.py) and for measuring the layout (``python -m tests.importgraph``).

A *unit* is a top-level entry of ``agent/`` or ``exporters/``: a module (``agent/runtime/agent.py``) or
a folder counted as one (``agent/actors/``); a package's own ``__init__`` is the unit named after
the package (``agent``, ``exporters``). Every import statement counts (top level, inside functions,
under ``TYPE_CHECKING``): ``from a import b`` names the module ``a.b`` when ``b`` is a module, else
``a``. The graph's edges are imports between different units.

Figures (``figures()``): units, imports (edges between units), the largest circle (strongly
connected component, in modules and in units), layers (the longest chain of imports, bottom up,
once every circle is broken) and back-imports (the fewest imports whose removal leaves no circle,
found greedily: each runs back up a layer).
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "exporters")


@cache
def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages by dotted name (``agent.actors.pyspy``; a package by its name)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: Mapping[str, Path]) -> str | None:
    """The longest known module that ``name`` starts with (``agent.model.events.Outcome`` -> ``agent.model.events``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports_of(path: Path, module: str, known: Mapping[str, Path]) -> set[str]:
    """The known modules ``path`` (module ``module``) imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, known)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


@cache
def module_graph(root: Path = ROOT) -> dict[str, frozenset[str]]:
    """module -> the modules it imports (of the packages)."""
    known = modules(root)
    return {m: frozenset(imports_of(p, m, known)) for m, p in known.items()}


def unit_of(module: str) -> str:
    """``agent.actors.pyspy`` -> ``agent.actors``; ``agent.runtime.agent`` -> itself; ``agent`` -> ``agent``."""
    return ".".join(module.split(".")[:2])


def unit_graph(graph: Mapping[str, Iterable[str]], unit=unit_of) -> dict[str, set[str]]:
    """The graph between units (edges inside a unit dropped)."""
    units: dict[str, set[str]] = {unit(m): set() for m in graph}
    for m, targets in graph.items():
        for t in targets:
            if unit(t) != unit(m):
                units[unit(m)].add(unit(t))
    return units


def circles(graph: Mapping[str, Iterable[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=len, reverse=True)


def back_imports(graph: Mapping[str, Iterable[str]]) -> set[tuple[str, str]]:
    """Imports whose removal leaves no circle, few (greedy, Eades-Lin-Smyth order): the ones that
    run back up a layer."""
    edges = {(a, b) for a, bs in graph.items() for b in bs if a != b}
    nodes = set(graph) | {b for _, b in edges}
    order_left: list[str] = []
    order_right: list[str] = []
    remaining = set(nodes)
    while remaining:
        changed = True
        while changed:
            changed = False
            for v in sorted(remaining):
                if not any((v, w) in edges for w in remaining if w != v):  # imports nothing left: bottom
                    order_right.append(v)
                    remaining.discard(v)
                    changed = True
                elif not any((w, v) in edges for w in remaining if w != v):  # imported by nothing left: top
                    order_left.append(v)
                    remaining.discard(v)
                    changed = True
        if remaining:
            v = max(sorted(remaining), key=lambda n: sum((n, w) in edges for w in remaining)
                    - sum((w, n) in edges for w in remaining))
            order_left.append(v)
            remaining.discard(v)
    order = order_left + list(reversed(order_right))  # top first
    position = {v: i for i, v in enumerate(order)}
    return {(a, b) for a, b in edges if position[a] > position[b]}


def layers(graph: Mapping[str, Iterable[str]]) -> dict[str, int]:
    """node -> its layer (0: imports nothing of the packages), by the longest chain of imports
    once :func:`back_imports` are left out."""
    back = back_imports(graph)
    down = {a: {b for b in bs if (a, b) not in back and b != a} for a, bs in graph.items()}
    layer: dict[str, int] = {}

    def depth(v: str) -> int:
        if v not in layer:
            layer[v] = 0
            layer[v] = 1 + max((depth(w) for w in down.get(v, ())), default=-1)
        return layer[v]

    for v in graph:
        depth(v)
    return layer


def figures(root: Path = ROOT) -> dict[str, object]:
    """The layout's figures (see the module docstring)."""
    graph = module_graph(root)
    units = unit_graph(graph)
    unit_circles = circles(units)
    module_circles = circles(graph)
    return {
        "modules": len(graph),
        "units": len(units),
        "unit_imports": sum(len(v) for v in units.values()),
        "layers": 1 + max(layers(units).values()),
        "back_imports": sorted(f"{a} -> {b}" for a, b in back_imports(units)),
        "largest_unit_circle": len(unit_circles[0]) if unit_circles else 0,
        "largest_module_circle": len(module_circles[0]) if module_circles else 0,
        "module_circle": sorted(module_circles[0]) if module_circles else [],
    }


if __name__ == "__main__":
    print(json.dumps(figures(), indent=2))
