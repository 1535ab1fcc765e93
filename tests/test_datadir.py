"""The data dir's layout has one road (issue 37): :class:`agent.model.datadir.DataDir` names every
path under ``data_dir`` exactly as users' data dirs already hold them, and no other module of
agent/ or exporters/ builds one by hand (checked on the source: a ``/`` join, ``os.path.join``,
``joinpath`` or f-string that starts from the data dir, or that appends one of the layout's names)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from agent.model.datadir import DataDir

ROOT = Path(__file__).resolve().parent.parent
#: The one module allowed to join the layout's names.
_HOME = ROOT / "agent" / "model" / "datadir.py"

#: The folder and file names of the layout (as literals), and the constants that have named them
#: (not METRICS_SPOOL_DIR: a spool folder's own sub-folder, in ``spool/`` or a ``spool/pid-<pid>/``).
_NAMES = frozenset({
    "status.json", "agents", "own-actions", "spans", "spool", "launched", "cuda_coredumps", "fleet",
    "export-ledger.json", "trace-imports",
})
_CONSTANTS = frozenset({
    "STATUS_FILE", "AGENTS_DIR", "OWN_ACTIONS_DIR", "SPANS_DIR", "SPOOL_DIR", "METRICS_DIR",
    "LAUNCH_RECORD_DIR", "CUDA_COREDUMPS_DIR", "FLEET_DIR", "EXPORT_LEDGER_FILE", "TRACE_IMPORTS_DIR",
    "LEDGER_NAME", "LEDGER_DIR_NAME", "NONCES_PREFIX", "API_SOCKET_SUFFIX",
})
#: Pieces of f-string file names of the layout.
_NAME_PIECES = (".api.sock", "nonces-")


# --- (1) the layout, literally ------------------------------------------------------------------------


def test_every_path_is_the_layout_users_data_dirs_hold() -> None:
    d = DataDir(Path("/data"), "node-a")
    assert d.root == Path("/data") and d.host_name == "node-a"
    assert d.host == Path("/data/node-a")
    assert d.incident("20240101T000000Z-stall-ab12") == Path("/data/node-a/20240101T000000Z-stall-ab12")
    assert d.status_file == Path("/data/node-a/status.json")
    assert d.agents == Path("/data/node-a/agents")
    assert d.own_actions == Path("/data/node-a/own-actions")
    assert d.spans == Path("/data/node-a/spans")
    assert d.spool == Path("/data/node-a/spool")
    assert d.metrics_spool == Path("/data/node-a/spool/metrics")
    assert d.metrics == Path("/data/node-a/metrics")
    assert d.launches == Path("/data/launched")
    assert d.cuda_coredumps == Path("/data/cuda_coredumps")
    assert d.fleet == Path("/data/fleet")
    assert d.fleet_nonces == Path("/data/fleet/nonces-node-a")
    assert d.fleet_api_socket == Path("/data/node-a.api.sock")
    assert d.export_ledger == Path("/data/export-ledger.json")
    assert d.trace_imports == Path("/data/trace-imports")
    assert DataDir.ledger_beside("/copied") == Path("/copied/export-ledger.json")


def test_a_relative_or_str_data_dir_stays_as_given_and_the_object_is_frozen() -> None:
    d = DataDir("servewatch-data", "h")  # type: ignore[arg-type]
    assert d.root == Path("servewatch-data") and d.status_file == Path("servewatch-data/h/status.json")
    assert d == DataDir(Path("servewatch-data"), "h") and hash(d) == hash(DataDir(Path("servewatch-data"), "h"))
    with pytest.raises(AttributeError):
        d.host_name = "other"  # type: ignore[misc]


def test_the_nonce_file_name_is_the_host_name_made_safe() -> None:
    assert DataDir(Path("/d"), "a b/c").fleet_nonces == Path("/d/fleet/nonces-a_b_c")
    assert DataDir(Path("/d"), "...").fleet_nonces == Path("/d/fleet/nonces-agent")
    assert DataDir(Path("/d"), "x" * 200).fleet_nonces.name == "nonces-" + "x" * 100


def test_the_old_names_of_the_layout_are_the_same_values() -> None:
    from agent.actors.coredump_target import LAUNCH_RECORD_DIR
    from agent.host.agentfiles import AGENTS_DIR, agents_dir
    from agent.host.ownactions import OWN_ACTIONS_DIR, OwnActionLog
    from agent.host.registry import AgentValues
    from agent.watchers.status import STATUS_FILE, status_path
    from exporters.mirror.trace_imports import LEDGER_DIR_NAME
    from exporters.otlp.replay import LEDGER_NAME, ledger_path

    assert (STATUS_FILE, AGENTS_DIR, OWN_ACTIONS_DIR, LAUNCH_RECORD_DIR, LEDGER_NAME, LEDGER_DIR_NAME) == (
        "status.json", "agents", "own-actions", "launched", "export-ledger.json", "trace-imports")
    d = DataDir(Path("/data"), "node-a")
    assert status_path("/data", "node-a") == d.status_file
    assert agents_dir("/data", "node-a") == d.agents
    assert OwnActionLog("/data", "node-a").folder == d.own_actions
    assert AgentValues(data_dir=Path("/data"), host_name="node-a").layout == d
    assert ledger_path("/data/node-a/spool/rejected/x.jsonl") == d.export_ledger
    assert ledger_path("/data/node-a/spans/x.jsonl") == d.export_ledger
    assert ledger_path("/elsewhere/x.jsonl") == Path("/elsewhere/export-ledger.json")


def test_the_settings_and_the_read_only_location_give_the_same_layout(tmp_path: Path) -> None:
    from agent.runtime.location import Location
    from agent.runtime.settings import load_settings

    settings = load_settings({"data_dir": tmp_path, "host_name": "node-a"})
    assert settings.layout == DataDir(tmp_path, "node-a") == Location(tmp_path, "node-a").layout
    assert settings.agent_values().layout == settings.layout
    assert settings.coredump.folder == settings.layout.cuda_coredumps


# --- (2) no other road ------------------------------------------------------------------------------------


def _is_data_dir(node: ast.expr) -> bool:
    """``data_dir``, ``x.data_dir``, ``Path(data_dir)``/``str(...)``/``os.fspath(...)``, or a join starting from one."""
    if isinstance(node, ast.Name):
        return node.id == "data_dir"
    if isinstance(node, ast.Attribute):
        return node.attr == "data_dir"
    if isinstance(node, ast.Call) and node.args:
        func = node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(node.func, ast.Attribute) else ""
        return func in ("Path", "PurePath", "str", "fspath", "abspath", "expanduser", "resolve") and _is_data_dir(node.args[0])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("expanduser", "absolute", "resolve"):
        return _is_data_dir(node.func.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _is_data_dir(node.left)
    return False


def _is_layout_name(node: ast.expr) -> bool:
    """One of the layout's names: a literal, a constant naming one, or an f-string piece of one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in _NAMES or any(p in node.value for p in _NAME_PIECES)
    if isinstance(node, ast.Name):
        return node.id in _CONSTANTS
    if isinstance(node, ast.Attribute):
        return node.attr in _CONSTANTS
    if isinstance(node, ast.JoinedStr):
        return any(_is_layout_name(v) for v in node.values if isinstance(v, ast.Constant))
    if isinstance(node, ast.FormattedValue):
        return _is_layout_name(node.value)
    return False


def _why(node: ast.AST) -> str | None:
    """Why ``node`` builds a data-dir path by hand, or ``None``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        if _is_data_dir(node.left):
            return "joins the data dir"
        if _is_layout_name(node.right):
            return "joins a name of the data dir's layout"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "joinpath" and (_is_data_dir(node.func.value) or any(_is_layout_name(a) for a in node.args)):
            return "joinpath of a data-dir path"
        if node.func.attr == "join" and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "path" and (
                (node.args and _is_data_dir(node.args[0])) or any(_is_layout_name(a) for a in node.args[1:])):
            return "os.path.join of a data-dir path"
    if isinstance(node, ast.JoinedStr):
        for value, after in zip(node.values, node.values[1:], strict=False):
            if (isinstance(value, ast.FormattedValue) and _is_data_dir(value.value)
                    and isinstance(after, ast.Constant) and str(after.value).startswith("/")):
                return "f-string path under the data dir"
    return None


def hand_built_paths(source: str, name: str) -> list[str]:
    """``name:line: why`` for each data-dir path ``source`` builds by hand."""
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(source)):  # outer nodes first: a join chain is named once, whole
        why = _why(node)
        if why is not None and node.lineno not in found:
            found[node.lineno] = f"{name}:{node.lineno}: {why}: {ast.unparse(node)[:120]}"
    return [found[line] for line in sorted(found)]


def _sources() -> list[Path]:
    return sorted(p for folder in ("agent", "exporters") for p in (ROOT / folder).rglob("*.py")
                  if p != _HOME and "templates" not in p.relative_to(ROOT).parts)


def test_no_module_builds_a_data_dir_path_by_hand() -> None:
    found = [line for path in _sources()
             for line in hand_built_paths(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert found == [], "build these through agent.model.datadir.DataDir (ctx.agent.layout):\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "bundle = self.data_dir / self.host_name / incident_id",
    "host_dir = Path(data_dir) / host_name",
    "spool = Spool(Path(data_dir) / socket.gethostname() / 'spool')",
    "records = ctx.agent.data_dir / LAUNCH_RECORD_DIR",
    "folder = base / 'spool'",
    "path = folder / STATUS_FILE",
    "sock = root / f'{host}.api.sock'",
    "x = os.path.join(data_dir, host)",
    "x = Path(settings.data_dir).joinpath('fleet')",
    "x = f'{data_dir}/{host}/status.json'",
    "x = data_dir.expanduser() / host",
])
def test_the_checker_sees_a_hand_built_path(line: str) -> None:
    assert len(hand_built_paths(line, "probe.py")) >= 1


@pytest.mark.parametrize("line", [
    "path = ctx.agent.layout.status_file",
    "bundle = self.layout.incident(incident_id)",
    "host_dir = folder_path / host_name",  # the coredump folder's %h folder (the driver's layout, not the data dir's)
    "found = root.glob(f'*/{STATUS_FILE}')",
    "path = bundle_dir / MANIFEST_NAME",
    "x = spool_dir / 'rejected'",
])
def test_the_checker_leaves_other_paths_alone(line: str) -> None:
    assert hand_built_paths(line, "probe.py") == []
