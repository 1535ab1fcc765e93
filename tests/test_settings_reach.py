"""Every Settings field reaches what reads it: each table belongs to the agent or to the one
registered component whose settings model it is, each field is read by the code that owns it, and
changing it changes what Agent.build builds (every registered component built from its settings
model's example, none listed here)."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel

from agent.runtime.agent import Agent
from agent.runtime.settings import (
    AgentSettings,
    ConfigError,
    load_settings,
    registries,
    settings_model,
)

ROOT = Path(__file__).resolve().parent.parent

#: Modules holding the agent's own use of its tables (its own parts' included: the telemetry reads
#: ``[export]``, the span shipper ``[spans]``), and of the few component settings that configure
#: what the CLI starts (launch's Flight Recorder buffer, the crash-dump folder).
AGENT_MODULES = ["agent.runtime.settings", "agent.runtime.agent", "agent.incidents.manager", "agent.incidents.admission", "agent.incidents.evidence", "agent.host.stall",
                 "agent.host.startup", "agent.host.targets", "agent.fleet", "agent.cli.app", "agent.cli.launch",
                 "exporters.otlp.provider", "exporters.otlp.shipper"]


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    out: list[str] = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaves(ann, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


LEAVES = _leaves(settings_model())


def _owners() -> dict[str, list[str]]:
    """table (or top-level setting) -> the modules that own it: the registered component's
    factory module and its settings model's module (whose derived properties, such as
    ``all_urls``, the factory reads) for its table, the agent's modules for the agent's own."""
    found: dict[str, list[str]] = {name: list(AGENT_MODULES) for name in AgentSettings.model_fields}
    for registry in registries().values():
        for table, entry in registry.tables().items():
            found[table] = list(dict.fromkeys([entry.module, entry.config_model().__module__]))
    return found


def test_the_walk_sees_nested_tables() -> None:
    assert "data_dir" in LEAVES and "health.url" in LEAVES and "coredump.completion_timeout_s" in LEAVES
    assert "health" not in LEAVES and len(LEAVES) > 100


def test_every_table_is_the_agents_or_one_registered_components() -> None:
    owners = _owners()
    assert [leaf for leaf in LEAVES if leaf.split(".")[0] not in owners] == []
    assert set(owners) == set(settings_model().model_fields)


def test_each_component_table_is_the_settings_model_its_registration_names() -> None:
    model = settings_model()
    for registry in registries().values():
        for table, entry in registry.tables().items():
            assert model.model_fields[table].annotation is entry.config_model()
            default = entry.default_config()
            assert default == entry.config_model()() and default is not entry.default_config()  # a new one each call


def _module_files(module: str) -> list[Path]:
    path = ROOT.joinpath(*module.split("."))
    if path.is_dir():
        return sorted(path.rglob("*.py"))
    return [path.with_suffix(".py")]


@functools.cache
def _names_read_in(path: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return frozenset(names)


def _names_read(files: list[Path]) -> set[str]:
    """Attribute names read (``cfg.timeout_s``) and strings (``getattr(cfg, "client_key")``) in
    ``files``; a keyword ``f(timeout_s=1)`` is no read of a setting."""
    return set().union(*(_names_read_in(path) for path in files))


def test_every_settings_field_is_read_by_the_code_that_owns_it() -> None:
    """A field nobody reads is a dead setting: remove it (or make its component use it)."""
    owners = _owners()
    unread = []
    for leaf in LEAVES:
        modules = owners[leaf.split(".")[0]]
        reads = _names_read([f for m in [*modules, *AGENT_MODULES] for f in _module_files(m)])
        if leaf.rsplit(".", 1)[-1] not in reads:
            unread.append(f"{leaf} (owned by {', '.join(modules)})")
    assert unread == []


def test_docstrings_name_only_tables_that_exist() -> None:
    """A docstring that sends the user to a TOML table ``[x]`` names a real Settings table."""
    tables = {leaf.rsplit(".", 1)[0] for leaf in LEAVES if "." in leaf}
    advertised = {
        f"{path.relative_to(ROOT)}: [{name}]"
        for folder in ("agent", "exporters")
        for path in sorted(ROOT.joinpath(folder).rglob("*.py"))
        for name in re.findall(r"``\[([a-z_][a-z0-9_.]*)\]``", path.read_text(encoding="utf-8"))
        if name not in tables
    }
    assert advertised == set()


def test_the_read_check_finds_an_unread_name(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f(cfg):\n    return cfg.timeout_s + g(interval_s=1) + getattr(cfg, 'client_key')\n")
    assert {"timeout_s", "client_key"} <= _names_read([probe])
    assert "interval_s" not in _names_read([probe]) and "max_body_bytes" not in _names_read([probe])


# --- changing a value changes the built component --------------------------------------------

def _example(model: type[BaseModel]) -> dict[str, Any]:
    """The first of a settings model's ``examples`` (its ``json_schema_extra``): settings that turn
    its component on; ``{}`` without one (its defaults do)."""
    extra = model.model_config.get("json_schema_extra")
    examples = extra.get("examples") if isinstance(extra, dict) else None
    return dict(examples[0]) if isinstance(examples, list) and examples else {}


#: Settings under which every registered component is built: each table's example
#: (test_every_registered_component_is_built_from_the_examples says they are enough).
EVERYTHING_ON: dict[str, Any] = {
    "host_name": "h1",
    **{table: _example(entry.config_model()) for registry in registries().values() for table, entry in registry.tables().items()},
}


def test_every_registered_component_is_built_from_the_examples(tmp_path: Path) -> None:
    """A component whose defaults leave it off gives an example that turns it on (its settings
    model's ``examples``), or this fails naming it; the exporters are built when the agent starts."""
    assert EVERYTHING_ON["health"]["url"] and EVERYTHING_ON["profiler"]["on_incident_steps"] > 0
    agent = Agent.build(load_settings({**EVERYTHING_ON, "data_dir": tmp_path, "export": {"metrics": False}}))
    telemetry = agent._start_exporters(one_shot=True)
    try:
        built = {"watcher": list(agent.watchers), "actor": list(agent.actors), "exporter": list(agent.exporters)}
        assert built == {kind: registry.names() for kind, registry in registries().items()}
    finally:
        telemetry.shutdown()


def _other_values(annotation: Any, default: Any) -> list[Any]:
    """Valid-looking values different from ``default`` for a field of this type."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return [a for a in args if a != default]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [v for a in args if a is not type(None) for v in _other_values(a, default)]
    if annotation is bool:
        return [not default]
    if annotation is int:
        return [(default or 0) + 1, max(1, (default or 0) * 2)]
    if annotation is float:
        return [(default or 1.0) * 2, (default or 1.0) / 2, 0.5]
    if origin is tuple and default:
        return [tuple(default[:-1])]
    return []


def _components_with_config(settings: Any) -> dict[str, Any]:
    agent = Agent.build(settings)
    return {**agent.watchers, **agent.actors, **agent.exporters}


@pytest.mark.parametrize("table", sorted({t for r in registries().values() for t in r.tables()} - {"metrics"}))
def test_changing_a_field_changes_the_built_component(table: str, tmp_path: Path) -> None:
    base = load_settings({**EVERYTHING_ON, "data_dir": tmp_path})
    model = type(getattr(base, table))
    holders = [name for name, c in _components_with_config(base).items() if isinstance(getattr(c, "config", None), model)]
    assert holders, f"no built component holds the {table} settings"
    checked = 0
    for field, info in model.model_fields.items():
        default = getattr(getattr(base, table), field)
        for value in _other_values(info.annotation, default):
            overrides = {**EVERYTHING_ON, "data_dir": tmp_path, table: {**EVERYTHING_ON.get(table, {}), field: value}}
            try:
                changed = load_settings(overrides)
            except ConfigError:  # an out-of-range guess: try the next value
                continue
            built = _components_with_config(changed)
            for name in holders:
                if name in built:
                    assert getattr(built[name].config, field) == getattr(getattr(changed, table), field), (table, field, name)
            checked += 1
            break
    assert checked >= min(2, len(model.model_fields)), f"only {checked} field(s) of {table} could be varied"


def test_the_stall_rule_reaches_the_watchdogs(tmp_path: Path) -> None:
    """The agent's [watchdog] timing reaches every watchdog the agent builds (its own table)."""
    settings = load_settings({**EVERYTHING_ON, "data_dir": tmp_path, "watchdog": {"timeout_s": 42.0, "poll_interval_s": 0.25}})
    agent = Agent.build(settings)
    assert agent.watchers["metrics"].config.timeout_s == 42.0 and agent.watchers["metrics"].config.poll_interval_s == 0.25
    assert agent.watchers["steps"].config.timeout_s == 42.0 and agent.watchers["steps"].config.poll_interval_s == 0.25
    # one object by one road (issue 37): the [watchdog] table as loaded, never split into scalars and rebuilt
    assert agent.context.agent.watchdog is settings.watchdog
    assert agent.watchers["metrics"].config is settings.watchdog and agent.watchers["steps"].config is settings.watchdog


def test_the_startup_budget_reaches_the_startup_rule(tmp_path: Path) -> None:
    """The agent's [startup] budget reaches the start-up rule the agent runs (its own table), and
    the rule's word on ranks starting reaches the watchers that probe the server over HTTP."""
    agent = Agent.build(load_settings({**EVERYTHING_ON, "data_dir": tmp_path, "startup": {"budget_s": 42.0}}))
    assert agent.startup.config.budget_s == 42.0 and agent.startup.config == agent.settings.startup
    assert agent.context.starting == agent.startup.starting and agent.watchers["health"].starting == agent.startup.starting


def test_importing_the_factories_resolves_every_registration() -> None:
    for registry in registries().values():
        for entry in registry:
            module, _, attr = entry.factory.partition(":")
            assert callable(getattr(importlib.import_module(module), attr)), entry.factory
            if entry.config is not None:
                assert issubclass(entry.config_model(), BaseModel), entry.config


def test_the_export_destination_is_resolved_once_and_every_reader_gets_that_one(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37, one value one road: ``[export]`` over ``OTEL_*`` is resolved once, at first use
    (the CLI's check at load); the span pipeline the agent builds ships to that same value, even
    when the environment changed since."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector.example:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    settings = load_settings({"data_dir": tmp_path})
    destination = settings.export_destination
    assert (destination.endpoint, destination.protocol) == ("http://collector.example:4318", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://elsewhere.example:4318")
    agent = Agent.build(settings)
    telemetry = agent._start_exporters(one_shot=True)
    try:
        assert telemetry.destination is destination and settings.export_destination is destination
    finally:
        telemetry.processor.shutdown(timeout_s=1.0)
