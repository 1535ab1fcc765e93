"""Component registries (agent.host.registry, assembled by agent.runtime.settings): lookups, lazy factories, Agent.build wiring, and a new
component added by one registration line running in real incidents (dump, run, launch, profile)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent.actors.config import CoredumpConfig
from agent.host.registry import BuildContext, Registry, UnknownComponentError
from agent.model.events import Action
from agent.runtime.agent import Agent
from agent.runtime.settings import ConfigError, env_names, load_settings, registries, settings_model
from tests import registry_fake
from tests.conftest import PROGRAMS_DIR
from tests.sdk._helpers import ProgramLauncher

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_components() -> Iterator[None]:
    registry_fake.register()
    try:
        yield
    finally:
        registry_fake.unregister()


def _titled(spawn, title: str) -> subprocess.Popen[bytes]:
    proc = spawn([sys.executable, str(PROGRAMS_DIR / "titled_target.py"), title, "--max-lifetime-s", "90"],
                 stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().decode().startswith("ready")
    return proc


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SERVEWATCH_"))}
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path), **more)
    return env


# --- lookups ------------------------------------------------------------------------------


def test_each_kind_lists_its_components_in_registration_order() -> None:
    reg: Registry[object] = Registry("actor")
    for name in ("zeta", "alpha", "mid"):
        reg.register(name, factory=f"pkg.{name}:create")
    assert reg.names() == ["zeta", "alpha", "mid"] == [e.name for e in reg]
    regs = registries()
    assert set(regs) == {"watcher", "actor", "exporter"} and all(len(r) for r in regs.values())
    for kind, registry in regs.items():
        assert all(entry.kind == kind for entry in registry)
    coredump = regs["actor"].get("cuda_coredump")
    assert coredump.table == "coredump" and coredump.config_model() is CoredumpConfig  # a table named apart
    assert regs["actor"].get("pyspy").module == "agent.actors.pyspy"


def _documented_built_ins() -> dict[str, list[str]]:
    """The built-in components docs/layout.md lists, by kind: ``watchers `a` `b`; actors ...``."""
    text = " ".join((ROOT / "docs" / "layout.md").read_text(encoding="utf-8").split())
    listed = re.search(r"The built-in components, in registration order \(.*?\): (.*?)\. ", text)
    assert listed, "docs/layout.md lost its list of the built-in components"
    kinds = (part.strip().split(" ", 1) for part in listed.group(1).split(";"))
    return {kind.removesuffix("s"): re.findall(r"`(\w+)`", names) for kind, names in kinds}


def test_the_registries_hold_exactly_the_built_ins_docs_layout_lists() -> None:
    """The one list of every built-in component (the other tests derive theirs from the
    registries): adding or removing one means saying so in docs/layout.md."""
    documented = _documented_built_ins()
    assert "mirror" in documented["exporter"] and len(documented["watcher"]) >= 5  # the list was read
    assert documented == {kind: registry.names() for kind, registry in registries().items()}


def test_an_unknown_name_is_one_line_listing_the_known_ones() -> None:
    actors = registries()["actor"]
    with pytest.raises(UnknownComponentError) as info:
        actors.get("gdb")
    assert str(info.value) == f"unknown actor 'gdb': expected one of {', '.join(actors.names())}"
    assert isinstance(info.value, KeyError) and info.value.known == tuple(actors.names())
    with pytest.raises(UnknownComponentError, match="unknown exporter 'x': expected one of"):
        registries()["exporter"].unregister("x")


def test_register_rejects_a_taken_name_a_bad_name_and_a_bad_factory_path() -> None:
    reg: Registry[object] = Registry("watcher")
    reg.register("disk_space", factory="pkg.mod:create")
    with pytest.raises(ValueError, match="watcher 'disk_space' is already registered"):
        reg.register("disk_space", factory="pkg.mod:create")
    for bad in ("DiskSpace", "disk-space", "1disk", ""):
        with pytest.raises(ValueError, match="lower_snake_case"):
            reg.register(bad, factory="pkg.mod:create")
    with pytest.raises(ValueError, match="is not 'package.module:function'"):
        reg.register("other", factory="pkg.mod.create")
    with pytest.raises(ValueError, match="is not 'package.module:Class'"):
        reg.register("other", factory="pkg.mod:create", config="pkg.mod.Config")
    with pytest.raises(ValueError, match="settings table 'Disk' is not lower_snake_case"):
        reg.register("other", factory="pkg.mod:create", config="pkg.mod:Config", table="Disk")
    with pytest.raises(ValueError, match="a settings table needs a config model"):
        reg.register("other", factory="pkg.mod:create", table="disk")
    assert reg.names() == ["disk_space"]


def test_a_component_owns_its_settings_table(tmp_path: Path) -> None:
    """A registered config model is a table of the settings (env, TOML, defaults), handed to its
    component's factory; a second claim on a table is refused."""
    registry_fake.register_configured()
    try:
        settings = load_settings({"data_dir": tmp_path, "probe_limits": {"max_bytes": 77}})
        assert settings.probe_limits == registry_fake.ProbeLimits(max_bytes=77)
        agent = Agent.build(settings)
        assert agent.actors["limited_probe"].max_bytes == 77  # type: ignore[attr-defined]
        assert "SERVEWATCH_PROBE_LIMITS__MAX_BYTES" in env_names()
        with pytest.raises(ConfigError, match=r"invalid setting probe_limits.max_bytes: Input should be greater than 0"):
            load_settings({"data_dir": tmp_path, "probe_limits": {"max_bytes": 0}})
        registries()["actor"].register("twin", factory="tests.registry_fake:create_actor",
                                       config="tests.registry_fake:ProbeLimits", table="probe_limits")
        with pytest.raises(ValueError, match="actor 'twin': settings table 'probe_limits' is taken by actor 'limited_probe'"):
            settings_model()
    finally:
        registry_fake.unregister()
    assert "probe_limits" not in settings_model().model_fields


def test_a_factory_module_is_imported_only_when_built(tmp_path: Path) -> None:
    """Listing the registries and loading the settings import no component; building one
    imports its module only."""
    probe = (
        "import json, sys\n"
        "from agent.runtime.settings import load_settings, registries\n"
        "regs = registries()\n"
        "modules = sorted({e.module for r in regs.values() for e in r})\n"
        "settings = load_settings({'health': {'url': 'http://127.0.0.1:9/health'}})\n"
        "before = [m for m in modules if m in sys.modules]\n"
        "regs['watcher'].get('health').build(settings)\n"
        "print(json.dumps({'modules': modules, 'before': before,"
        " 'health': 'agent.watchers.health' in sys.modules, 'mirror': 'exporters.mirror.mirror' in sys.modules}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=_env(tmp_path), check=True)
    got = json.loads(proc.stdout)
    assert "agent.actors.pyspy" in got["modules"] and "exporters.mirror.mirror" in got["modules"]
    assert got["before"] == []
    assert got["health"] is True and got["mirror"] is False


# --- Agent.build ----------------------------------------------------------------------------


def test_registered_actors_run_in_registration_order(tmp_path: Path) -> None:
    agent = Agent.build(load_settings({
        "data_dir": tmp_path, "host_name": "h1", "profiler": {"on_incident_steps": 3},
    }))
    order = registries()["actor"].names()
    assert list(agent.actors) == [name for name in order if name in agent.actors]
    assert [name for name, _, _ in agent.incidents.phases] == [a.action for a in agent.actors.values()]
    assert agent.incidents.deferred == {a.action for a in agent.actors.values() if a.deferred}
    assert list(agent.watchers) == [n for n in registries()["watcher"].names() if n in agent.watchers]


def test_build_wires_the_components_the_settings_turn_on(tmp_path: Path) -> None:
    agent = Agent.build(load_settings({"data_dir": tmp_path, "host_name": "h1", "target": {"pids": [os.getpid()]}}))
    assert "health" not in agent.watchers and "metrics" not in agent.watchers  # no health or metrics URL
    assert {"process", "steps"} <= set(agent.watchers)
    assert "profiler" not in agent.actors and {"pyspy", "flightrec", "cuda_coredump"} <= set(agent.actors)
    assert agent.exporters == {} and agent.telemetry is None and agent.shipper is None  # built when it starts
    assert agent.status.path == tmp_path / "h1" / "status.json"  # the agent's own board, not an exporter

    agent = Agent.build(load_settings({
        "data_dir": tmp_path, "host_name": "h1",
        "health": {"url": "http://127.0.0.1:9/health"}, "metrics": {"url": "http://127.0.0.1:9/metrics"},
        "coredump": {"enabled": False}, "flightrec": {"enabled": False}, "profiler": {"on_incident_steps": 3},
    }))
    assert {"health", "metrics"} <= set(agent.watchers)
    assert "cuda_coredump" not in agent.actors and "flightrec" not in agent.actors and "profiler" in agent.actors
    assert Action.PROFILE_SESSION in agent.incidents.deferred


def test_built_components_carry_the_settings_given(tmp_path: Path) -> None:
    settings = load_settings({
        "data_dir": tmp_path, "target": {"uids": [4242]},
        "pyspy": {"timeout_s": 7.5}, "coredump": {"delay_s": 1.25}, "watchdog": {"timeout_s": 42.0},
        "health": {"url": "http://127.0.0.1:9/health", "unhealthy_after": 5},
        "profiler": {"socket_dir": str(tmp_path / "sockets")},
    })
    agent = Agent.build(settings)
    assert agent.actors["pyspy"].config.timeout_s == 7.5  # type: ignore[attr-defined]
    coredump = agent.actors["cuda_coredump"]
    assert coredump.config.delay_s == 1.25 and 4242 in coredump.trusted_uids  # type: ignore[attr-defined]
    assert coredump.record_dirs == (tmp_path / "launched",)  # type: ignore[attr-defined]
    assert agent.actors["flightrec"].config.socket_dir == tmp_path / "sockets"  # type: ignore[attr-defined]
    assert agent.watchers["health"].config.unhealthy_after == 5
    assert agent.watchers["steps"].config.timeout_s == 42.0


def test_exporters_of_the_start_stage_attach_to_the_telemetry(tmp_path: Path) -> None:
    """The agent's own telemetry and span shipper first, then the registered exporters, on it
    (every one: each table's example turns its component on, as for the other kinds)."""
    from tests.test_settings_reach import EVERYTHING_ON

    agent = Agent.build(load_settings({**EVERYTHING_ON, "data_dir": tmp_path, "host_name": "h1", "export": {"metrics": False}}))
    telemetry = agent._start_exporters(one_shot=False)
    try:
        assert agent.telemetry is telemetry and list(agent.exporters) == registries()["exporter"].names()
        assert agent.exporters["mirror"].sink is telemetry.sink  # type: ignore[attr-defined]
        assert agent.shipper is not None and agent.shipper.processor is telemetry.processor
    finally:
        if agent.shipper is not None:
            agent.shipper.close()
        telemetry.shutdown()
    one_shot = Agent.build(load_settings({"data_dir": tmp_path, "host_name": "h1", "export": {"metrics": False}}))
    telemetry = one_shot._start_exporters(one_shot=True)
    try:
        assert one_shot.shipper is None and "mirror" in one_shot.exporters  # a dump ships no SDK spans
    finally:
        telemetry.shutdown()
    assert BuildContext().stage == "build"


# --- a new component: one registration line -------------------------------------------------


async def test_a_registered_actor_and_exporter_run_in_a_dump(tmp_path: Path, spawn, fake_components) -> None:
    target = _titled(spawn, "sglang::scheduler_TP0")
    settings = load_settings({
        "data_dir": tmp_path, "host_name": "h1", "target": {"pids": [target.pid]},
        "coredump": {"enabled": False}, "flightrec": {"enabled": False}, "export": {"metrics": False},
    })
    agent = Agent.build(settings)
    assert [name for name, _, _ in agent.incidents.phases][-1] == registry_fake.PROBE_ACTION
    with anyio.fail_after(90):
        record = await agent.dump()
    probe = [r for r in record.results if r.action == registry_fake.PROBE_ACTION]
    assert [(r.pid, r.outcome.value) for r in probe] == [(target.pid, "ok")]
    assert Path(probe[0].artifact_paths[0]).read_text() == "sglang::scheduler_TP0"  # setproctitle rewrote argv
    manifest = json.loads(record.manifest_path.read_text())
    assert [a["action"] for a in manifest["actions"]] == [Action.PYSPY_DUMP, registry_fake.PROBE_ACTION]
    assert (tmp_path / registry_fake.LOG_NAME).read_text().splitlines() == [
        "built one_shot=True", "IncidentOpened manual", "action pyspy.dump ok", "action probe.read ok",
        "IncidentClosed manual",
    ]


async def test_a_registered_watcher_opens_an_incident_in_run(tmp_path: Path, spawn, fake_components) -> None:
    registry_fake.register_watcher()
    target = _titled(spawn, "sglang::scheduler_TP0")
    settings = load_settings({
        "data_dir": tmp_path, "host_name": "h1", "target": {"pids": [target.pid]},
        "coredump": {"enabled": False}, "flightrec": {"enabled": False}, "export": {"metrics": False},
        "spans": {"ship": False},
    })
    agent = Agent.build(settings)
    assert "one_failure" in agent.watchers
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            while not agent.incidents.records:
                await anyio.sleep(0.1)
            agent.stop()
    record = agent.incidents.records[0]
    assert record.opened.trigger == "health"
    assert [r.action for r in record.results] == [Action.PYSPY_DUMP, registry_fake.PROBE_ACTION]
    log_lines = (tmp_path / registry_fake.LOG_NAME).read_text().splitlines()
    assert log_lines[0] == "built one_shot=False" and "action probe.read ok" in log_lines


# --- the CLI's one-shot commands build the same way (real `servewatch` subprocesses) ----------


def _servewatch_with_fakes(
    tmp_path: Path, *args: str, timeout_s: float = 120, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.registry_fake", *args],
        capture_output=True, text=True, timeout=timeout_s, cwd=tmp_path, check=False, stdin=subprocess.DEVNULL,
        env=_env(tmp_path, SERVEWATCH_COREDUMP__ENABLED="false", SERVEWATCH_FLIGHTREC__ENABLED="false",
                  SERVEWATCH_EXPORT__METRICS="false", **(extra_env or {})),
    )


def test_cli_dump_runs_a_registered_actor_and_exporter(tmp_path: Path, spawn) -> None:
    target = _titled(spawn, "sglang::scheduler_TP0")
    data = tmp_path / "data"
    proc = _servewatch_with_fakes(tmp_path, "dump", "--pid", str(target.pid), "--data-dir", str(data), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert [(a["action"], a["outcome"]) for a in summary["actions"]] == [("pyspy.dump", "ok"), ("probe.read", "ok")]
    assert (data / registry_fake.LOG_NAME).read_text().splitlines()[0] == "built one_shot=True"


def test_cli_launch_runs_a_registered_actor_and_exporter(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = [sys.executable, str(PROGRAMS_DIR / "titled_target.py"), "demo::server", "--exit-after-s", "1",
              "--exit-code", "3", "--max-lifetime-s", "60"]
    proc = _servewatch_with_fakes(tmp_path, "launch", "--data-dir", str(data), "--", *server)
    assert proc.returncode == 3, proc.stderr  # the server's own exit code
    lines = (data / registry_fake.LOG_NAME).read_text().splitlines()
    assert lines[0] == "built one_shot=False"
    assert "IncidentOpened exit" in lines and any(line.startswith("action probe.read ") for line in lines)


def test_cli_profile_builds_the_registered_exporters(tmp_path: Path, spawn, python: str) -> None:
    shm = tmp_path / "shm"
    launcher = ProgramLauncher(spawn, python, shm)
    try:
        _, line = launcher.start("profiled_model.py")
        pid = line.split()[1]
        data = tmp_path / "data"
        proc = _servewatch_with_fakes(
            tmp_path, "profile", "--pid", pid, "--steps", "1", "--activities", "CPU", "--timeout", "60",
            "--data-dir", str(data), "--out", str(tmp_path / "profiles"), extra_env={"SERVEWATCH_SHM_DIR": str(shm)},
        )
    finally:
        launcher.close()
    assert proc.returncode == 0, proc.stderr  # a real session on a real SDK target
    assert "spans in trace" in proc.stderr, proc.stderr
    assert (data / registry_fake.LOG_NAME).read_text().splitlines()[0] == "built one_shot=True"
    assert list((data / os.uname().nodename / "spans").glob("*.jsonl")), "its span went through the otlp exporter"
