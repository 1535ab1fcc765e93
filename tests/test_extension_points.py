"""Open extension points: a watcher of a new kind of trouble (tests/plugin_disk.py), an actor
(tests/registry_fake.py) and an exporter (tests/plugin_journal.py) are each their module plus one
registration line; nothing in ``agent/`` or ``exporters/`` names them, each type-checks against its
kind's Protocol (``Watcher``, ``Actor``, ``Exporter``: mypy), the exporter registry refuses what is
no ``Exporter``, and the new trigger opens real incidents like a built-in one, on which the added
actor runs after the built-in ones and which the added exporter mirrors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent.host.registry import BuildContext
from agent.incidents.manager import IncidentRecord
from agent.model.events import Action, IncidentOpened, TriggerEvent
from agent.runtime.agent import Agent
from agent.runtime.settings import env_names, load_settings, registries
from exporters import Exporter
from tests import plugin_disk, plugin_journal, registry_fake
from tests.conftest import PROGRAMS_DIR

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def disk_watcher() -> Iterator[None]:
    plugin_disk.register()
    try:
        yield
    finally:
        registries()["watcher"].unregister("disk_space")


@pytest.fixture
def probe_actor() -> Iterator[None]:
    registries()["actor"].register("probe", factory="tests.registry_fake:create_actor")  # its one registration line
    try:
        yield
    finally:
        registries()["actor"].unregister("probe")


@pytest.fixture
def journal_exporter() -> Iterator[None]:
    plugin_journal.register()
    try:
        yield
    finally:
        registries()["exporter"].unregister(plugin_journal.NAME)


def _sources_naming(*words: str) -> list[str]:
    found = []
    for folder in ("agent", "exporters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            found += [f"{path.relative_to(ROOT)}: {w}" for w in words if w in text]
    return found


def test_nothing_in_the_agent_names_the_added_watcher_actor_or_exporter() -> None:
    assert _sources_naming("plugin_disk", "disk_low", "DiskSpace", "registry_fake", "limited_probe", "probe.read",
                           "plugin_journal", "JournalConfig") == []


def test_the_added_exporter_brings_its_own_settings_table_and_is_an_exporter(journal_exporter: None, tmp_path: Path) -> None:
    assert "SERVEWATCH_JOURNAL__PATH" in env_names()
    settings = load_settings({"data_dir": tmp_path, "journal": {"path": tmp_path / "j.jsonl"}})
    assert settings.journal.path == tmp_path / "j.jsonl"
    journal = registries()["exporter"].get(plugin_journal.NAME).build(settings, BuildContext(stage="start"))
    assert isinstance(journal, plugin_journal.Journal) and isinstance(journal, Exporter)


class _NoHandle:
    """Mirrors nothing: it has ``events`` but no ``handle``."""

    events = (IncidentOpened,)


def create_no_handle(config: None, ctx: BuildContext) -> _NoHandle:
    return _NoHandle()


def test_the_exporter_registry_refuses_what_is_no_exporter() -> None:
    registries()["exporter"].register("no_handle", factory="tests.test_extension_points:create_no_handle")
    try:
        with pytest.raises(TypeError) as info:
            registries()["exporter"].get("no_handle").create(None, BuildContext(stage="start"))
    finally:
        registries()["exporter"].unregister("no_handle")
    assert str(info.value) == ("exporter 'no_handle': tests.test_extension_points:create_no_handle returned a _NoHandle,"
                               " which lacks the members of exporters.Exporter")


def test_the_added_components_type_check_against_their_kinds_protocols(tmp_path: Path) -> None:
    """mypy (the project's settings) on the three plug-ins, whose factories return their kind's
    Protocol, and on a probe whose exporter lacks ``handle``: only the probe is refused."""
    probe = tmp_path / "probe_exporter.py"
    probe.write_text('from exporters import Exporter\n\n\nclass NoHandle:\n    events = ()\n\n\n'
                     'def create(config: None, ctx: object) -> Exporter:\n    return NoHandle()\n')
    plugins = [str(m.__file__) for m in (plugin_disk, registry_fake, plugin_journal)]
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--hide-error-context", *plugins, str(probe)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "MYPYPATH": str(ROOT)}, check=False,
    )  # the project's cache (.mypy_cache, CI's lint step fills it): a probe's lines may name an earlier tmp_path
    said = [line for line in proc.stdout.splitlines() if ": error:" in line or ": note:" in line]
    assert [line for line in said if f"/{probe.name}:" not in line] == [], proc.stdout + proc.stderr
    assert [line.split(": ", 1)[1] for line in said] == [
        'error: Incompatible return value type (got "NoHandle", expected "Exporter")  [return-value]',
        'note: "NoHandle" is missing following "Exporter" protocol member:', "note:     handle"], proc.stdout + proc.stderr


def test_the_added_watcher_brings_its_own_settings_table(disk_watcher: None, tmp_path: Path) -> None:
    assert "SERVEWATCH_DISK_SPACE__MIN_FREE_BYTES" in env_names()
    settings = load_settings({"data_dir": tmp_path, "disk_space": {"folder": tmp_path}})
    assert settings.disk_space.folder == tmp_path and settings.disk_space.min_free_bytes == 1024**3
    assert issubclass(plugin_disk.DiskSpaceLow, TriggerEvent)


async def test_a_new_trigger_opens_one_incident_per_cooldown_in_run(disk_watcher: None, probe_actor: None, journal_exporter: None,
                                                                     tmp_path: Path, spawn) -> None:
    """A real file system under a floor it cannot meet, a real titled target: one incident of the
    new trigger, every registered actor on the target (the added one last), the next detections
    cooled down; the added exporter journals the incident's opening and closing."""
    proc = spawn([sys.executable, str(PROGRAMS_DIR / "titled_target.py"), "sglang::scheduler_TP0", "--max-lifetime-s", "90"],
                 stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().decode().startswith("ready")
    free = shutil.disk_usage(tmp_path).free
    settings = load_settings({
        "data_dir": tmp_path / "data", "host_name": "h1", "target": {"pids": [proc.pid]},
        "disk_space": {"folder": tmp_path, "min_free_bytes": free * 4, "interval_s": 0.2},
        "coredump": {"enabled": False}, "flightrec": {"enabled": False}, "export": {"metrics": False},
        "spans": {"ship": False}, "journal": {"path": tmp_path / "journal.jsonl"},
    })
    records: list[IncidentRecord] = []
    agent = Agent.build(settings, on_incident=records.append)
    assert "disk_space" in agent.watchers
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            while not records or agent.incidents.suppressed < 2:
                await anyio.sleep(0.1)
            agent.stop()
    [record] = records
    assert record.opened.trigger == plugin_disk.TRIGGER and f"-{plugin_disk.TRIGGER}-" in record.opened.incident_id
    assert record.opened.detail.startswith(f"{tmp_path}: ") and record.opened.detail.endswith(f"under {free * 4}")
    assert [(r.action, r.pid) for r in record.results] == [(Action.PYSPY_DUMP, proc.pid), (registry_fake.PROBE_ACTION, proc.pid)]
    probe = record.results[-1]
    assert probe.outcome.value == "ok" and Path(probe.artifact_paths[0]).read_text() == "sglang::scheduler_TP0"
    manifest = json.loads(record.manifest_path.read_text())
    assert manifest["trigger"] == plugin_disk.TRIGGER and manifest["state"] == "closed"
    journal = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert [(j["event"], j["incident_id"], j["trigger"]) for j in journal] == [
        ("IncidentOpened", record.opened.incident_id, plugin_disk.TRIGGER),
        ("IncidentClosed", record.opened.incident_id, plugin_disk.TRIGGER)]

    # reading the bundle back knows nothing of the trigger either: a plain string
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SERVEWATCH_"))}
    r = await anyio.run_process(
        [sys.executable, "-m", "agent.cli.entry", "timeline", "latest", "--data-dir", str(tmp_path / "data")],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, check=False,
    )
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    assert plugin_disk.TRIGGER in out
