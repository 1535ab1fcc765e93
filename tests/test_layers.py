"""Layers import one way (DESIGN.md "Rooms and doors", docs/layout.md), checked on the source (AST:
top-level, function-level and TYPE_CHECKING imports, ``from pkg import module`` and relative
imports): every folder of agent/ and exporters/ has a layer (bottom up: sdk, model, host,
watchers/actors/verdict, incidents/fleet/exporters, runtime/views, demo, cli) and imports nothing
of a layer above its own; agent/ holds no flat module but ``__init__``, ``early`` and ``errors``;
watchers and actors never import each other; exporters never import an actor; no component
imports the orchestration (the runtime, the incident manager, the settings, the judge, the CLI);
incidents import no exporter (ids come from agent.model.ids); the pure models import no component;
the SDK imports only itself and the error tree; nothing outside the SDK reaches into a private
``agent.sdk._*`` module."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module named by an import statement in ``path`` (top level, inside functions or
    under ``TYPE_CHECKING``): ``import a.b``, ``from a.b import c`` (``a.b`` and ``a.b.c``: ``c``
    may be a submodule, as in ``from agent.incidents import manager``), relative imports resolved;
    and every module a call imports by a constant name (``importlib.import_module("a.b")``)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1]) if path.is_relative_to(root) else ""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names if a.name != "*")
        elif _dynamic_import(node):
            names.add(node.args[0].value)  # type: ignore[attr-defined]
    return names


def _dynamic_import(node: ast.AST) -> bool:
    """``importlib.import_module("a.b")``, ``import_module("a.b")`` or ``__import__("a.b")``: a
    module named by a constant, imported at run time."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def _offenders(folder: str, forbidden: tuple[str, ...], root: Path = ROOT) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    files = [root / folder] if folder.endswith(".py") else sorted((root / folder).rglob("*.py"))
    for path in files:
        bad = sorted(m for m in _imports(path, root) if m.startswith(forbidden))
        if bad:
            found[str(path.relative_to(root))] = bad
    return found


#: The layers, bottom up: a folder imports its own layer and the ones below, never one above
#: (agent.early and agent.errors, stdlib leaves, lie under them all; see their own rules below).
_LAYERS: tuple[tuple[str, ...], ...] = (
    ("agent.sdk",),
    ("agent.model",),
    ("agent.host",),
    ("agent.watchers", "agent.actors", "agent.verdict"),
    ("agent.incidents", "agent.fleet", "exporters"),
    ("agent.runtime", "agent.views"),
    ("agent.demo",),
    ("agent.cli",),
)
#: The flat modules agent/ keeps: the package's face and the two stdlib leaves.
_FLAT = ("__init__.py", "early.py", "errors.py")
#: The orchestration (the runtime wires components, the incident manager decides, the settings
#: and the CLI read settings, the judge gathers evidence): no component, model or exporter imports it.
_ORCHESTRATION = ("agent.runtime.agent", "agent.runtime.settings", "agent.incidents.manager", "agent.verdict.judge", "agent.cli")
#: Components: watchers publish, actors act, exporters mirror; none imports another kind.
_WATCHERS, _ACTORS, _EXPORTERS = ("agent.watchers",), ("agent.actors",), ("exporters",)
#: The SDK's private modules; their public faces are agent.sdk.counter, .ring, .control, .flightrec.
_SDK_PRIVATE = ("agent.sdk._",)


def _agent_modules_but(*allowed: str) -> tuple[str, ...]:
    """Every agent module and package (``agent.x.y``, an import prefix) but ``allowed`` and the
    packages holding them (``agent.model`` for ``agent.model.kinds``)."""
    names = set()
    for path in (ROOT / "agent").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return tuple(sorted(n for n in names if not any(a == n or a.startswith(f"{n}.") for a in allowed)))


def _folders(root: Path = ROOT) -> list[str]:
    """Every top-level folder of agent/ (``agent.model``) and exporters/ (``exporters``)."""
    return [*sorted(f"agent.{p.name}" for p in (root / "agent").iterdir() if (p / "__init__.py").is_file()), "exporters"]


def _above(folder: str) -> tuple[str, ...]:
    """The folders of every layer above ``folder``'s."""
    index = next(i for i, layer in enumerate(_LAYERS) if folder in layer)
    return tuple(f for layer in _LAYERS[index + 1 :] for f in layer)


def test_every_folder_has_a_layer_and_agent_has_no_other_flat_module() -> None:
    assert sorted(_folders()) == sorted(f for layer in _LAYERS for f in layer)
    assert sorted(p.name for p in (ROOT / "agent").glob("*.py")) == sorted(_FLAT)


@pytest.mark.parametrize("folder", [f for layer in _LAYERS for f in layer])
def test_a_folder_imports_no_layer_above_its_own(folder: str) -> None:
    assert _offenders(folder.replace(".", "/"), _above(folder)) == {}


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        # DESIGN "Rooms and doors": watchers and actors never import each other
        ("agent/watchers", _ACTORS + _EXPORTERS + _ORCHESTRATION + _SDK_PRIVATE),
        ("agent/actors", _WATCHERS + _EXPORTERS + _ORCHESTRATION + _SDK_PRIVATE),
        # exporters mirror and decide nothing: no actor, watcher or orchestration
        ("exporters", _ACTORS + _WATCHERS + _ORCHESTRATION + _SDK_PRIVATE),
        # the OTLP pipeline sends what it is given: it never imports the mirror feeding it
        ("exporters/otlp", ("exporters.mirror",)),
        # the offline views read bundles: no component, no orchestration
        ("agent/views", _ACTORS + _WATCHERS + _ORCHESTRATION + ("exporters.mirror", "agent.incidents", "agent.fleet")),
        ("agent/fleet", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION + _SDK_PRIVATE),
        # pure models: import no component
        ("agent/model/stacks.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        ("agent/verdict/rules.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        ("agent/verdict/flightrec.py", ("agent.", "exporters")),
        ("agent/verdict/servers.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        ("agent/host/manifest.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        # the manifest read back by timeline/report without pydantic: the names only
        ("agent/model/manifest_view.py", (*_agent_modules_but("agent.model.kinds"), "exporters")),
        # the events and the names they carry (agent.model.kinds, split so a bundle's reader needs no dataclass)
        ("agent/model/events.py", (*_agent_modules_but("agent.model.kinds"), "exporters")),
        ("agent/model/kinds.py", ("agent.", "exporters")),
        ("agent/model/ids.py", ("agent.", "exporters")),
        ("agent/host/cudaenv.py", ("agent.", "exporters")),
        # early py-spy runs start before every other import: the standard library only
        ("agent/early.py", ("agent.", "exporters")),
        ("agent/errors.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION + ("agent.sdk",)),
        # the SDK runs inside the server: never the agent side (see also the test below)
        ("agent/sdk", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        # the SDK client serves actors and incidents alike, so it imports neither
        ("agent/host/sdkclient.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION + _SDK_PRIVATE),
        # incidents pick ids with agent.model.ids and read requests with agent.host.sdkclient: no exporter, no actor
        ("agent/incidents/manager.py", _ACTORS + _WATCHERS + _EXPORTERS + _SDK_PRIVATE),
        # the judge reads the SDK's public counter, the stack model and ranks: no actor
        ("agent/verdict/judge.py", _ACTORS + _WATCHERS + _EXPORTERS + _SDK_PRIVATE),
        # launch plans the CUDA environment through agent.host.cudaenv, not an actor
        ("agent/cli/launch.py", _ACTORS + _WATCHERS + _EXPORTERS),
        # the incidents' policies and the stall rule: no component, no orchestration (issue 28)
        ("agent/host/stall.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        ("agent/incidents/admission.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        ("agent/incidents/lifecycle.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        ("agent/incidents/evidence.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        ("agent/model/progress.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        ("agent/model/backoff.py", ("agent.", "exporters")),
        ("agent/host/registry.py", _ACTORS + _WATCHERS + _EXPORTERS + _ORCHESTRATION),
        # the runtime's helpers: supervision and its own status rows, never an actor
        ("agent/runtime/supervision.py", _ACTORS + _EXPORTERS + _ORCHESTRATION),
        ("agent/runtime/runstatus.py", _ACTORS + _ORCHESTRATION),
        ("agent/runtime", _SDK_PRIVATE),
        ("agent/cli", _SDK_PRIVATE),
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
    # agent.model.events is named for type checking only: importing agent.errors runs the stdlib alone
    code = "import sys, agent.errors; print(sorted(m for m in sys.modules if m.startswith(('agent', 'exporters'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "['agent', 'agent.errors']"


def test_the_checker_sees_a_function_level_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from agent.actors.pyspy import PySpyActor\n")
    assert _imports(probe) == {"agent.actors.pyspy", "agent.actors.pyspy.PySpyActor"}


def test_the_checker_sees_a_module_imported_by_its_name_at_run_time(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib\nfrom importlib import import_module\n"
                     "def f(name):\n    importlib.import_module('agent.runtime.settings')\n"
                     "    import_module('agent.cli.app')\n    __import__('agent.runtime.agent')\n"
                     "    importlib.import_module(name)\n")
    assert _imports(probe) == {"importlib", "importlib.import_module", "agent.runtime.settings", "agent.cli.app",
                               "agent.runtime.agent"}


def test_the_checker_sees_submodules_named_by_from_imports_and_relative_imports(tmp_path: Path) -> None:
    probe = tmp_path / "agent" / "watchers" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from agent.incidents import manager\nfrom ..actors import pyspy\nfrom . import health\n")
    assert {"agent.incidents.manager", "agent.actors.pyspy", "agent.watchers.health"} <= _imports(probe, tmp_path)
    assert _offenders("agent/watchers", _ACTORS + _ORCHESTRATION, tmp_path) == {
        "agent/watchers/probe.py": ["agent.actors", "agent.actors.pyspy", "agent.incidents.manager"]
    }


def _incident_manager_writes(source: str) -> list[str]:
    """``x.incidents.<attr> = ...`` / ``incidents.<attr> = ...`` in ``source``: an attribute of
    the incident manager written from outside it (augmented and annotated writes too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and (
                    isinstance(t.value, ast.Attribute) and t.value.attr == "incidents"
                    or isinstance(t.value, ast.Name) and t.value.id == "incidents"):
                found.append(f"{t.lineno}: .incidents.{t.attr} =")
    return found


def test_the_incident_managers_seams_are_given_to_it_never_written_into_it() -> None:
    """Its contributions (admission, placement, companions, the server tree, the phase and state
    listeners) come through its constructor or :meth:`run`, not by attribute writes from the
    runtime, the fleet or the CLI (issue 37)."""
    assert _incident_manager_writes("agent.incidents.on_phase = f\nincidents.admit += g\nx.incidents.judge.y = 1\n") == [
        "1: .incidents.on_phase =", "2: .incidents.admit ="]
    writes = [f"{p.relative_to(ROOT)}:{w}" for folder in ("agent", "exporters") for p in sorted((ROOT / folder).rglob("*.py"))
              if p != ROOT / "agent" / "incidents" / "manager.py"
              for w in _incident_manager_writes(p.read_text(encoding="utf-8"))]
    assert writes == []


def _layout_tree() -> dict[str, str]:
    """docs/layout.md's tree: each folder (``agent/host``, ``exporters/otlp``) and the text of its
    row(s)."""
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    block = text.split("```\n", 2)[1]
    rows: dict[str, str] = {}
    top, folder = "", ""
    for line in block.splitlines():
        if line and not line.startswith(" "):
            top, folder = line.split("/")[0], ""
            continue
        head = line.strip().split(" ")[0]
        if line.startswith("  ") and not line.startswith("   ") and head.endswith("/"):
            folder = f"{top}/{head.rstrip('/')}"
            rows[folder] = line.strip()[len(head):]
        elif folder:
            rows[folder] += " " + line.strip()
    return rows


def test_the_layout_page_names_every_folder_and_module_as_they_are() -> None:
    """docs/layout.md's tree (the README links it as the layout) names every package folder of
    agent/ and exporters/ and every module in it: a module added or moved without the tree fails."""
    rows = _layout_tree()
    assert {"agent/sdk", "agent/fleet", "exporters/otlp"} <= set(rows)
    block = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8").split("```\n", 2)[1]
    missing = [f"{p.relative_to(ROOT)} (a flat module)" for top in ("agent", "exporters") for p in sorted((ROOT / top).glob("*.py"))
               if f"{p.name}" not in block.split()]
    # a module below a package folder of its own (agent/views/templates/compiled/ is generated, not a package)
    missing += [f"{p.relative_to(ROOT)} (below a package folder)" for top in ("agent", "exporters")
                for p in sorted((ROOT / top).glob("*/*/**/*.py")) if not p.is_relative_to(ROOT / "agent" / "views" / "templates")]
    for top in ("agent", "exporters"):
        for init in sorted((ROOT / top).glob("*/__init__.py")):
            folder = f"{top}/{init.parent.name}"
            words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", rows.get(folder, "")))
            if folder not in rows:
                missing.append(f"{folder}/ (the folder)")
                continue
            missing += [f"{folder}/{p.stem}.py" for p in sorted(init.parent.glob("*.py"))
                        if p.stem != "__init__" and p.stem not in words]
    assert missing == [], f"docs/layout.md's tree does not name: {missing}"
