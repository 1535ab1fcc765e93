"""Trigger and action names: one enum each in agent.model.events, the strings bundles already hold."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from agent.model.events import Action, ActionResult, Outcome, Trigger

ROOT = Path(__file__).resolve().parent.parent


def test_values_are_the_strings_bundles_hold() -> None:
    assert {t.value for t in Trigger} == {"health", "stall", "exit", "manual", "peer", "request_stall"}
    assert Action.PYSPY_DUMP == "pyspy.dump" and Action.CUDA_COREDUMP == "cuda.coredump"
    assert Action.PROFILE_SESSION == "profile.session" and Action.FLIGHTREC_DUMP == "flightrec.dump"
    assert Action.HARD_SIGNAL == "hard.signal" and Action.PEER_CAPTURE == "peer.capture"
    # a name read back from an old manifest (a plain str) compares equal and converts back
    assert Action("pyspy.dump") is Action.PYSPY_DUMP and Trigger("stall") is Trigger.STALL
    assert f"{Trigger.STALL}" == "stall" and str(Action.CUDA_COREDUMP) == "cuda.coredump"


def test_manifest_json_writes_plain_strings() -> None:
    result = ActionResult(action=Action.PYSPY_DUMP, outcome=Outcome.OK, pid=1)
    assert json.loads(json.dumps(result.to_manifest()))["action"] == "pyspy.dump"
    assert json.dumps({"trigger": Trigger.MANUAL}) == '{"trigger": "manual"}'


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def _sources() -> list[Path]:
    paths = [*ROOT.joinpath("agent").rglob("*.py"), *ROOT.joinpath("exporters").rglob("*.py")]
    # the enums' own modules (agent.model.kinds defines them; agent.model.events re-exports them)
    return sorted(p for p in paths if p not in (ROOT / "agent" / "model" / "events.py", ROOT / "agent" / "model" / "kinds.py"))


def test_action_names_are_not_retyped_outside_the_enum() -> None:
    """Code compares and writes ``Action`` members, never the strings (docstrings may quote them)."""
    values = {m.value for m in Action}
    found = [
        f"{path.relative_to(ROOT)}:{line}: {value!r}"
        for path in _sources()
        for line, value in _string_constants(path)
        if value in values
    ]
    assert found == []


def _trigger_literals(path: Path) -> list[str]:
    """Trigger words used as triggers: compared with something named ``trigger``, or passed as
    the trigger of ``open_incident`` (a bare "health" elsewhere is a watcher or a TOML table)."""
    values = {m.value for m in Trigger}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any("trigger" in ast.unparse(o) for o in operands):
                found += [f"{path.name}:{node.lineno}" for o in operands if isinstance(o, ast.Constant) and o.value in values]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("open_incident") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and first.value in values:
                found.append(f"{path.name}:{node.lineno}")
        elif (
            isinstance(node, ast.keyword) and node.arg == "trigger"
            and isinstance(node.value, ast.Constant) and node.value.value in values
        ):
            found.append(f"{path.name}:{node.value.lineno}")
    return found


def test_trigger_names_are_not_retyped_outside_the_enum() -> None:
    assert [hit for path in _sources() for hit in _trigger_literals(path)] == []


def test_the_trigger_check_finds_a_retyped_trigger(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('if opened.trigger == "stall":\n    pass\nawait m.open_incident("manual")\nf(trigger="exit")\n')
    assert _trigger_literals(bad) == ["bad.py:1", "bad.py:3", "bad.py:4"]
