"""The incident manifest model (agent.host.manifest): round trip, versions, old manifests, real bundles,
and what `servewatch timeline` / `report` say about a manifest they cannot read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import agent.host.manifest as manifest_mod
import agent.views.bundle as bundle_mod
from agent.host.manifest import (
    MANIFEST_NAME,
    MANIFEST_SCHEMA,
    IncidentState,
    Manifest,
    ManifestAction,
    ManifestError,
    ManifestTarget,
    ManifestVerdict,
    load_manifest,
    parse_manifest,
)
from agent.incidents.manager import recover_interrupted
from agent.model.bus import RecordingBus
from agent.model.events import Action, ActionResult, Outcome, Trigger
from agent.views.bundle import BundleCorruptError, load_incident
from tests.conftest import PROGRAMS_DIR

CLI = [sys.executable, "-m", "agent.cli.app"]
OPENED_NS = 1_764_437_701_000_000_000


def _exports_match(module: object) -> None:
    public = {
        n for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__  # type: ignore[attr-defined]
    }
    assert public <= set(module.__all__)  # type: ignore[attr-defined]
    assert all(hasattr(module, n) for n in module.__all__)  # type: ignore[attr-defined]


def test_all_matches_public_names() -> None:
    _exports_match(manifest_mod)
    _exports_match(bundle_mod)


def test_manifest_imports_no_component() -> None:
    import ast

    tree = ast.parse(Path(manifest_mod.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    # agent.model.kinds: the names; agent.model.events: the ActionResult a manifest entry is rebuilt into;
    # agent.model.manifest_view: the constants it shares with the light reader
    assert {m for m in imported if m.startswith(("agent", "exporters"))} == {"agent.model.kinds", "agent.model.events", "agent.errors",
                                                                            "agent.model.manifest_view"}


def _full() -> Manifest:
    result = ActionResult(
        action=Action.PYSPY_DUMP, outcome=Outcome.OK, pid=42, detail="2 threads",
        start_time_unix_nano=OPENED_NS + 10**7, end_time_unix_nano=OPENED_NS + 9 * 10**8,
        artifact_paths=("/data/h1/inc/pyspy-42.json",),
        attributes={"servewatch.pyspy.hung_frame": "f (x.py:3)", "servewatch.pyspy.idle_threads": ("a", "b"),
                    "servewatch.pyspy.thread_count": 2},
    )
    return Manifest(
        schema_version=MANIFEST_SCHEMA, incident_id="20261201T000000Z-stall-abcdef", trigger=Trigger.STALL,
        detail="busy and no forward progress", host_name="h1", trace_id="ab" * 16, span_id="cd" * 8,
        opened_time_unix_nano=OPENED_NS, closed_time_unix_nano=OPENED_NS + 2 * 10**9, duration_s=2.0,
        targets=(ManifestTarget(pid=42, title="sched\udcff TP0", create_time_s=12.5, cmdline=("python", "<redacted>")),),
        actions=(ManifestAction.from_result(result),
                 ManifestAction(action="future.action", outcome="future_outcome", detail="from a newer agent")),
        inflight_requests=3, hard_signal_sent={"42": "SIGABRT"}, state=IncidentState.CLOSED,
        phases_done=(Action.PYSPY_DUMP,), agent_pid=7, updated_time_unix_nano=OPENED_NS + 3 * 10**9,
        verdict=ManifestVerdict(kind="behind", culprit_ranks=(1,), culprit_pids=(42,), reason="r", confidence="high",
                                evidence=("rank 1 pid 42",), ranks=(0, 1), headline="Verdict: culprit rank 1", duration_s=0.5),
    )


def test_round_trip_through_json_keeps_every_field() -> None:
    m = _full()
    text = m.to_json()
    raw = json.loads(text)
    # the keys on disk are the historic ones
    assert raw["schema"] == "servewatch.incident/1" and raw["host.name"] == "h1"
    assert "schema_version" not in raw and "host_name" not in raw
    # enum names are written as plain strings; attribute tuples as lists
    assert raw["trigger"] == "stall" and raw["actions"][0]["action"] == "pyspy.dump"
    assert raw["actions"][0]["attributes"]["servewatch.pyspy.idle_threads"] == ["a", "b"]
    assert raw["actions"][0]["duration_s"] == 0.89
    assert "\\udcff" in text  # a title that is not UTF-8 survives (escaped)
    back = parse_manifest(text)
    assert back == m
    assert back.to_json() == text
    assert back.trigger is Trigger.STALL and back.actions[0].action is Action.PYSPY_DUMP
    assert back.actions[0].outcome is Outcome.OK
    # names this servewatch does not know stay plain strings
    assert (back.actions[1].action, back.actions[1].outcome) == ("future.action", "future_outcome")
    assert back.targets[0].title == "sched\udcff TP0"


def test_the_model_itself_refuses_an_unknown_version() -> None:
    data = {**_full().to_json_dict(), "schema": "servewatch.incident/2"}
    with pytest.raises(ValidationError, match="unknown manifest version"):
        Manifest.model_validate(data)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{truncated", "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"incident_id": "x"}', "no 'schema': not a servewatch incident manifest"),
        ('{"schema": "servewatch.incident/2", "incident_id": "x"}',
         "schema 'servewatch.incident/2' is an unknown manifest version (this servewatch reads servewatch.incident/1)"),
        ('{"schema": "other/1", "incident_id": "x", "trigger": "stall", "opened_time_unix_nano": 1}',
         "schema 'other/1' is an unknown manifest version"),
        ('{"schema": "servewatch.incident/1", "incident_id": "x", "trigger": "stall"}',
         "not a servewatch incident manifest: opened_time_unix_nano: field required"),
        (('{"schema": "servewatch.incident/1", "incident_id": "x", "trigger": "stall", "opened_time_unix_nano": 1,'
          ' "targets": [{"pid": "seven"}]}'), "not a servewatch incident manifest: targets.0.pid: input should be a valid integer"),
        (('{"schema": "servewatch.incident/1", "incident_id": "x", "trigger": "stall", "opened_time_unix_nano": 1,'
          ' "state": "exploded"}'), "not a servewatch incident manifest: state: input should be 'open', 'closed' or 'interrupted'"),
    ],
)
def test_a_bad_manifest_is_one_clear_error_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / MANIFEST_NAME
    path.write_text(text)
    with pytest.raises(ManifestError) as excinfo:
        load_manifest(tmp_path)  # the bundle folder works as well as the file
    assert str(excinfo.value).startswith(f"{path}: {message}")
    assert "\n" not in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)


def test_an_older_version_1_manifest_reads_with_defaults(tmp_path: Path) -> None:
    """The first form of servewatch.incident/1: no state, phases, verdict, agent pid, parent span."""
    old = {
        "schema": "servewatch.incident/1", "incident_id": "20251129T173501Z-health-a1b2c3", "trigger": "health",
        "detail": "http://127.0.0.1:30000/health failed 3 probes in a row (HTTP 503)", "host.name": "h1",
        "trace_id": "", "span_id": "", "opened_time_unix_nano": 1000, "closed_time_unix_nano": 2000,
        "targets": [{"pid": 7}], "actions": [{"action": "pyspy.dump", "pid": 7, "outcome": "timed_out"}],
        "a_key_from_nowhere": 1,
    }
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(old))
    m = load_manifest(tmp_path / MANIFEST_NAME)
    assert (m.state, m.phases_done, m.verdict, m.agent_pid, m.inflight_requests) == (IncidentState.CLOSED, (), None, None, None)
    assert m.trigger is Trigger.HEALTH and m.elapsed_s == pytest.approx(1e-6)
    assert m.targets[0] == ManifestTarget(pid=7)
    assert (m.actions[0].outcome, m.actions[0].elapsed_s, m.actions[0].attributes) == (Outcome.TIMED_OUT, 0.0, {})
    assert "a_key_from_nowhere" not in m.to_json_dict()
    # the timeline reads it too
    tl = load_incident(tmp_path)
    assert (tl.state, tl.duration_s, tl.inflight_count, tl.verdict) == ("closed", pytest.approx(1e-6), 0, None)


def test_the_loader_says_corrupt_for_an_unknown_version(tmp_path: Path) -> None:
    bundle = tmp_path / "h1" / "inc"
    bundle.mkdir(parents=True)
    (bundle / MANIFEST_NAME).write_text(json.dumps({**_full().to_json_dict(), "schema": "servewatch.incident/9"}))
    with pytest.raises(BundleCorruptError, match="unknown manifest version"):
        load_incident(bundle)


async def test_recovery_leaves_an_unreadable_manifest_alone(tmp_path: Path) -> None:
    bundle = tmp_path / "h1" / "20261201T000000Z-stall-000001"
    bundle.mkdir(parents=True)
    text = json.dumps({**_full().to_json_dict(), "schema": "servewatch.incident/9", "state": "open"})
    (bundle / MANIFEST_NAME).write_text(text)
    bus = RecordingBus()
    assert await recover_interrupted(bus, tmp_path, "h1") == []
    assert (bundle / MANIFEST_NAME).read_text() == text and not bus.events


# --- a real incident ---------------------------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env["SERVEWATCH_SHM_DIR"] = str(tmp_path / "shm")
    return env


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=90, cwd=tmp_path, env=_env(tmp_path),
                          stdin=subprocess.DEVNULL, check=False)


@pytest.fixture
def real_bundle(tmp_path: Path, spawn, python: str) -> Path:
    """A bundle written by a real incident: `servewatch dump` (py-spy) of a real titled target."""
    title = f"manifesttest{os.getpid()}::scheduler_TP0"
    proc = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), title, "--max-lifetime-s", "60"], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
    r = _cli(tmp_path, "dump", "--pid", str(proc.pid), "--json", "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 0, r.stderr
    bundle = Path(json.loads(r.stdout)["bundle_path"])
    return bundle if bundle.is_absolute() else tmp_path / bundle


def test_a_real_bundle_reads_back_losslessly(real_bundle: Path) -> None:
    raw = json.loads((real_bundle / MANIFEST_NAME).read_text())
    m = load_manifest(real_bundle / MANIFEST_NAME)
    assert m.to_json_dict() == raw  # what incidents wrote is exactly the model
    assert (m.schema_version, m.trigger, m.state, m.root_published) == (MANIFEST_SCHEMA, Trigger.MANUAL, IncidentState.CLOSED, True)
    (dump,) = [a for a in m.actions if a.action is Action.PYSPY_DUMP]
    assert (dump.action, dump.outcome, dump.pid) == (Action.PYSPY_DUMP, Outcome.OK, m.targets[0].pid)
    assert str(dump.attributes["servewatch.pyspy.hung_frame"]).startswith("hung_in_fake_allreduce (")
    assert Action.PYSPY_DUMP in m.phases_done and not m.phases_pending and m.agent_pid is not None and m.agent_pid != os.getpid()
    tl = load_incident(real_bundle)
    assert (tl.incident_id, tl.trigger, tl.state) == (m.incident_id, "manual", "closed")
    assert tl.stacks[0].hung_frame == dump.attributes["servewatch.pyspy.hung_frame"]
    assert tl.spans and {s.name for s in tl.spans} >= {"pyspy.dump"}  # read from the span files beside it


@pytest.mark.parametrize(
    ("damage", "message"),
    [("truncate", "not valid JSON"), ("version", "unknown manifest version"), ("field", "opened_time_unix_nano: field required")],
)
def test_timeline_and_report_on_a_corrupt_manifest_say_one_line_and_fail(
    real_bundle: Path, tmp_path: Path, damage: str, message: str
) -> None:
    path = real_bundle / MANIFEST_NAME
    raw = json.loads(path.read_text())
    if damage == "truncate":
        path.write_text(path.read_text()[:100])
    elif damage == "version":
        path.write_text(json.dumps({**raw, "schema": "servewatch.incident/99"}))
    else:
        path.write_text(json.dumps({k: v for k, v in raw.items() if k != "opened_time_unix_nano"}))
    for args in (["timeline", str(real_bundle)], ["timeline", str(real_bundle), "--json"],
                 ["report", str(real_bundle), "-o", str(tmp_path / "r.html")]):
        r = _cli(tmp_path, *args)
        assert r.returncode == 1, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"servewatch: {path}: ") and message in lines[0], (args, r.stderr)
        assert r.stdout == ""
    assert not (tmp_path / "r.html").exists()


def test_summary_reads_the_manifest_the_bundle_holds(tmp_path: Path) -> None:
    from agent.cli.summary import incident_summary, summary_lines
    from agent.host.targets import Target
    from agent.incidents.manager import IncidentRecord
    from agent.model.events import IncidentOpened

    opened = IncidentOpened(incident_id="20261201T000000Z-manual-000002", trigger=Trigger.MANUAL, detail="asked",
                            bundle_dir=str(tmp_path / "h1" / "inc"), time_unix_nano=OPENED_NS)
    idle = ActionResult(action=Action.PYSPY_DUMP, outcome=Outcome.OK, pid=5, start_time_unix_nano=OPENED_NS,
                        end_time_unix_nano=OPENED_NS + 25 * 10**7,
                        attributes={"servewatch.pyspy.idle_threads": ("MainThread", "worker")})
    record = IncidentRecord(opened=opened, targets=[Target(pid=5, title="srv --api-key=sk-SECRET")], results=[idle],
                            closed_time_unix_nano=OPENED_NS + 10**9, host_name="h1", state="closed")
    lines = summary_lines(record)
    assert lines[0] == "Incident 20261201T000000Z-manual-000002 (manual): asked"
    assert lines[1].split() == ["pyspy.dump", "pid", "5", "srv", "--api-key=<redacted>", "ok", "0.25s", "all", "idle",
                                "(waiting", "for", "work):", "nothing", "is", "stuck;", "stuck", "threads:", "none;",
                                "idle:", "MainThread,", "worker"]
    summary = incident_summary(record)
    assert summary["processes"] == [{"pid": 5, "title": "srv --api-key=<redacted>"}]  # as the bundle holds it
    assert (summary["trigger"], summary["duration_s"], summary["outcomes"]) == ("manual", 1.0, {"ok": 1})
    assert json.loads(json.dumps(summary))["actions"][0]["action"] == "pyspy.dump"
    assert record.to_manifest().host_name == "h1"


def test_manifest_and_bundle_errors_sit_in_the_one_tree() -> None:
    from agent import errors

    assert issubclass(ManifestError, errors.ServewatchError) and issubclass(ManifestError, ValueError)
    assert issubclass(BundleCorruptError, errors.BundleError) and issubclass(errors.BundleError, errors.ServewatchError)
    assert manifest_mod.ManifestError is errors.ManifestError and bundle_mod.BundleError is errors.BundleError
    for name in ("ManifestError", "BundleError", "BundleNotFoundError", "BundleCorruptError"):
        assert name in (errors.__doc__ or "")
