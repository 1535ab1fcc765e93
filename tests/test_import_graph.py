"""The import graph of agent/ and exporters/ (tests/importgraph.py reads it from the source): no
circle, at most one import running back up a layer, and a runtime that only wires (small, simple
functions)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.importgraph import ROOT, back_imports, circles, figures, layers, module_graph, unit_graph


def test_no_circle_between_units() -> None:
    assert circles(unit_graph(module_graph())) == []


def test_no_circle_between_modules() -> None:
    assert circles(module_graph()) == []


def test_at_most_one_import_runs_back_up_a_layer() -> None:
    units = unit_graph(module_graph())
    assert len(back_imports(units)) <= 1
    assert figures()["layers"] >= 8  # layered, not flat


def test_the_checker_finds_a_circle_and_its_back_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [{"a", "b", "c"}]
    assert len(back_imports(graph)) == 1
    assert layers({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == {"b": 0, "a": 1, "c": 2}


def test_the_reader_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    (tmp_path / "agent").mkdir()
    (tmp_path / "exporters").mkdir()
    (tmp_path / "agent" / "__init__.py").write_text("")
    (tmp_path / "exporters" / "__init__.py").write_text("")
    (tmp_path / "agent" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agent.b import X\ndef f():\n    from exporters import c\n"
    )
    (tmp_path / "agent" / "b.py").write_text("from . import a\n")
    (tmp_path / "exporters" / "c.py").write_text("")
    graph = module_graph(tmp_path)
    assert graph["agent.a"] == {"agent.b", "exporters.c"} and graph["agent.b"] == {"agent.a"}


def test_the_runtime_only_wires_in_small_functions() -> None:
    runtime = ROOT / "agent" / "runtime" / "agent.py"
    assert len(runtime.read_text(encoding="utf-8").splitlines()) < 500
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "C901", "--config",
         "lint.mccabe.max-complexity=10", "--output-format", "concise", str(runtime)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stdout
