"""Layers import one way (DESIGN.md "Rooms and doors"): watchers and actors never import each
other, exporters never import an actor, and the pure models import no component."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Every module named by an import statement in ``path`` (top level or inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    files = [ROOT / folder] if folder.endswith(".py") else sorted((ROOT / folder).rglob("*.py"))
    for path in files:
        bad = sorted(m for m in _imports(path) if m.startswith(forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("agent/watchers", ("agent.actors",)),
        ("agent/actors", ("agent.watchers",)),
        ("exporters", ("agent.actors",)),
        ("agent/stacks.py", ("agent.actors", "agent.watchers", "exporters")),
        ("agent/sdk", ("agent.actors", "agent.watchers", "agent.runtime", "agent.incidents", "exporters")),
        ("agent/errors.py", ("agent.actors", "agent.watchers", "agent.incidents", "agent.runtime", "agent.sdk", "exporters")),
        # the profiler and flightrec actors reach the SDK through agent.sdkclient, not incidents
        ("agent/actors", ("agent.incidents", "agent.runtime")),
        # incidents pick their ids with agent.ids, never from an exporter
        ("agent/incidents.py", ("exporters", "agent.actors", "agent.watchers")),
        ("agent/ids.py", ("agent.", "exporters")),
        # CUDA environment planning is one stdlib-only module; launch plans through it, not an actor
        ("agent/cudaenv.py", ("agent.", "exporters")),
        ("agent/launch.py", ("agent.actors", "agent.watchers", "exporters")),
        # the step watcher and the judge read the SDK's public counter layout, not a private module
        ("agent/watchers", ("agent.sdk._",)),
        ("agent/judge.py", ("agent.sdk._",)),
        ("agent/sdkclient.py", ("agent.actors", "agent.watchers", "agent.incidents", "agent.runtime", "exporters")),
    ],
)
def test_layers_import_one_way(folder: str, forbidden: tuple[str, ...]) -> None:
    assert _offenders(folder, forbidden) == {}


def test_the_sdk_imports_only_itself_and_the_error_tree() -> None:
    # the SDK runs inside the user's server: of the agent it may import agent.errors, a stdlib-only leaf
    reached = {m for path in (ROOT / "agent" / "sdk").rglob("*.py") for m in _imports(path) if m.startswith("agent")}
    assert {m for m in reached if not m.startswith(("agent.sdk", "agent.errors"))} == set()
    assert "agent.errors" in reached


def test_the_error_tree_loads_no_other_agent_module() -> None:
    # agent.events is named for type checking only: importing agent.errors runs the stdlib alone
    code = "import sys, agent.errors; print(sorted(m for m in sys.modules if m.startswith(('agent', 'exporters'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "['agent', 'agent.errors']"


def test_the_checker_sees_a_function_level_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from agent.actors.pyspy import PySpyActor\n")
    assert _imports(probe) == {"agent.actors.pyspy"}
