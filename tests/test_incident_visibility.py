"""An incident is visible from its first second: manifest at open and after each phase, each
action published when it finishes, `servewatch timeline latest` on an open incident, a profile
that never delays the summary, SIGTERM/SIGINT mid-incident (interrupted, recovered on the next
start), exit rules, and `servewatch launch` printing summaries — on real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from agent.actors import act_all
from agent.host.targets import Target
from agent.incidents.manager import (
    IncidentConfig,
    IncidentManager,
    IncidentRecord,
    recover_interrupted,
)
from agent.model.bus import RecordingBus
from agent.model.events import (
    ActionResult,
    IncidentClosed,
    IncidentOpened,
    Outcome,
    ProfileStopped,
    StacksDumped,
    TargetExited,
    now_ns,
)
from agent.model.progress import ActionSink
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from tests.conftest import PROGRAMS_DIR
from tests.programs import fake_server
from tests.watchers import wait_until

CLI = [sys.executable, "-m", "agent.cli.app"]
FAKE_PYSPY = str(PROGRAMS_DIR / "fake_pyspy.py")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env["SERVEWATCH_SHM_DIR"] = str(tmp_path / "shm")
    env.update(extra)
    return env


def _manifest(record_or_dir: IncidentRecord | Path) -> dict:
    path = record_or_dir.manifest_path if isinstance(record_or_dir, IncidentRecord) else record_or_dir / "manifest.json"
    return json.loads(path.read_text())


class SlowActor:
    """Acts on real pids; the target named ``slow`` waits for ``release`` (a stuck dump)."""

    name = "fake"

    def __init__(self, slow_pid: int) -> None:
        self.slow_pid = slow_pid
        self.release = anyio.Event()

    async def act(self, trigger: IncidentOpened, target: Target, *, timeout_s: float, artifact_dir: Path) -> ActionResult:
        start = now_ns()
        if target.pid == self.slow_pid:
            await self.release.wait()
        return ActionResult(action="pyspy.dump", outcome=Outcome.OK, pid=target.pid,
                            start_time_unix_nano=start, end_time_unix_nano=now_ns())


async def test_manifest_is_open_at_once_and_each_action_is_published_when_it_finishes(tmp_path: Path) -> None:
    targets = [Target(pid=os.getpid(), title="fast"), Target(pid=os.getppid(), title="slow")]
    actor = SlowActor(os.getppid())
    profile_gate = anyio.Event()

    async def dump(opened: IncidentOpened, ts: Sequence[Target], bundle: Path, report: ActionSink) -> list[ActionResult]:
        return await act_all(actor, opened, ts, timeout_s=10, artifact_dir=bundle, report=report)

    async def profile(opened: IncidentOpened, ts: Sequence[Target], bundle: Path, report: ActionSink) -> list[ActionResult]:
        await profile_gate.wait()
        t = now_ns()
        return [ActionResult(action="profile.session", outcome=Outcome.OK, start_time_unix_nano=t, end_time_unix_nano=t)]

    bus = RecordingBus()
    summaries: list[tuple[str, list[str]]] = []
    manager = IncidentManager(
        bus=bus, config=IncidentConfig(), data_dir=tmp_path, host_name="h1", discover=lambda: list(targets),
        phases=[("pyspy.dump", dump, StacksDumped), ("profile.session", profile, ProfileStopped)],
        on_summary=lambda r: summaries.append((r.state, list(r.phases_pending))),
    )
    result: list[IncidentRecord] = []

    async def run_it() -> None:
        result.append(await manager.open_incident("manual", detail="test"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_it)
        await wait_until(lambda: bus.of_type(StacksDumped))
        # the fast target's dump is out (its span with it) while the slow one still runs
        [first] = bus.of_type(StacksDumped)
        assert first.result.pid == os.getpid()
        record = manager.current
        assert record is not None
        m = _manifest(record)
        assert m["state"] == "open" and m["phases_done"] == []
        assert m["phases_pending"] == ["pyspy.dump", "profile.session"]

        # `servewatch timeline latest` shows it, open, while it runs
        r = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [*CLI, "timeline", "latest", "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
            env=_env(tmp_path), cwd=tmp_path, check=False))
        assert r.returncode == 0, r.stderr
        assert "OPEN — still running" in r.stdout and "done: nothing yet" in r.stdout

        actor.release.set()
        # the summary point comes before the profile ends: the profile never delays it
        await wait_until(lambda: summaries)
        assert summaries == [("open", ["profile.session"])]
        m = _manifest(record)
        assert m["state"] == "open" and m["phases_done"] == ["pyspy.dump"] and len(m["actions"]) == 2
        assert not bus.of_type(IncidentClosed)
        profile_gate.set()
    [record] = result
    m = _manifest(record)
    assert m["state"] == "closed" and m["phases_done"] == ["pyspy.dump", "profile.session"]
    assert [r.action for r in record.results] == ["pyspy.dump", "pyspy.dump", "profile.session"]
    assert len(bus.of_type(StacksDumped)) == 2  # each published once, not again at phase end
    assert not [p for p in record.bundle_dir.iterdir() if p.name.endswith(".swtmp")]


async def test_a_stalled_server_ends_the_incident_profile_at_once(tmp_path: Path, spawn) -> None:
    server = fake_server.start(spawn, "--title", "sglang::scheduler_TP0", "--freeze-after-steps", "10")
    settings = load_settings({
        "data_dir": tmp_path, "host_name": "h1", "target": {"pids": [server.pid]},
        "watchdog": {"timeout_s": 1.0, "poll_interval_s": 0.2}, "coredump": {"enabled": False},
        "profiler": {"on_incident_steps": 5, "max_duration_s": 60},
        "export": {"metrics": False},
    })
    records: list[IncidentRecord] = []
    agent = Agent(settings, on_incident=records.append)
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            try:
                await wait_until(lambda: records, timeout_s=60)
            except TimeoutError:  # CI saw this once in a full run (9/9 alone): say what the agent had
                server_state = await anyio.to_thread.run_sync(server.control)
                pytest.fail(f"no incident record in 60 s; server {server_state}; data dir:\n{_files(tmp_path)}")
            agent.stop()
    [record] = records
    assert record.opened.trigger == "stall"
    prof = next(r for r in record.results if r.action == "profile.session")
    assert prof.outcome is Outcome.SKIPPED and prof.detail == "no steps: server stalled"


def _files(folder: Path) -> str:
    """Every file under ``folder`` with its size, and the text of the small JSON ones (a failing
    test's account of what the agent wrote)."""
    lines = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        size = path.stat().st_size
        text = path.read_text(errors="replace")[:2000] if path.suffix == ".json" and size < 20000 else ""
        lines.append(f"{path.relative_to(folder)} ({size} B) {text}")
    return "\n".join(lines)


# --- exit rules ---------------------------------------------------------------------------------


def _manager(tmp_path: Path, **config: object) -> IncidentManager:
    return IncidentManager(bus=RecordingBus(), config=IncidentConfig(**config), data_dir=tmp_path, host_name="h",
                           discover=list)


def test_exit_rules_zero_operator_stop_and_hard_mode_are_no_new_incident(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    assert m.classify(TargetExited(pid=10, exit_code=0)) is None
    m.expect_exit(11)
    assert m.classify(TargetExited(pid=11, signal=15)) is None
    m._hard_signalled.add(12)
    assert m.classify(TargetExited(pid=12, signal=6)) is None
    # configurable
    m2 = _manager(tmp_path, operator_stop_is_incident=True, hard_mode_exit_is_incident=True)
    m2.expect_exit(11)
    m2._hard_signalled.add(12)
    assert m2.classify(TargetExited(pid=11, signal=15))[0] == "exit"
    assert "signal 6 (SIGABRT)" in m2.classify(TargetExited(pid=12, signal=6))[2]
    # the code is known, or said unknown in words — never "exit code None"
    assert "exit code 3" in m.classify(TargetExited(pid=13, exit_code=3))[2]
    detail = m.classify(TargetExited(pid=14))[2]
    assert "None" not in detail and "exit status unknown" in detail


def test_hard_mode_exit_of_a_real_process_opens_no_second_incident(tmp_path: Path, spawn, python: str) -> None:
    async def main() -> list[IncidentRecord]:
        proc = spawn([python, "-c", "import time; time.sleep(60)"])
        bus = RecordingBus()
        manager = IncidentManager(bus=bus, config=IncidentConfig(), data_dir=tmp_path, host_name="h",
                                  discover=lambda: [Target(pid=proc.pid, title="victim")], hard_signal=signal.SIGTERM)
        from agent.watchers.process import ProcessWatcher

        watcher = ProcessWatcher([proc.pid], poll_interval_s=0.1)
        async with anyio.create_task_group() as tg:
            await tg.start(manager.run)
            await tg.start(watcher.run, bus)
            await manager.open_incident("stall", detail="stuck", pid=proc.pid)
            await wait_until(lambda: proc.pid in manager.exits_handled)
            tg.cancel_scope.cancel()
        return manager.records

    records = anyio.run(main)
    assert [r.opened.trigger for r in records] == ["stall"]
    assert records[0].hard_signal_sent


# --- SIGTERM / SIGINT mid-incident ----------------------------------------------------------------


def _hanging_pyspy(tmp_path: Path) -> str:
    exe = tmp_path / "py-spy-hangs"
    exe.write_text(
        f"#!{sys.executable}\nimport runpy, sys\n"
        f"sys.argv = [sys.argv[0], 'hang', {str(tmp_path / 'pyspy.log')!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({FAKE_PYSPY!r}, run_name='__main__')\n"
    )
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_dump_interrupted_mid_phase_is_written_interrupted_and_closed_on_next_start(
    tmp_path: Path, spawn, python: str, signum: int
) -> None:
    target = spawn([python, "-c", "import time; time.sleep(120)"])
    data = tmp_path / "data"
    env = _env(tmp_path, SERVEWATCH_PYSPY__EXECUTABLE=_hanging_pyspy(tmp_path), SERVEWATCH_PYSPY__TIMEOUT_S="100",
               SERVEWATCH_INCIDENT__INTERRUPT_GRACE_S="1", SERVEWATCH_HOST_NAME="h1")
    proc = subprocess.Popen([*CLI, "dump", "--pid", str(target.pid), "--data-dir", str(data)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "pyspy.log").exists():
            time.sleep(0.1)  # py-spy (hanging) has started: the incident is mid-phase
        bundles = list((data / "h1").glob("*/manifest.json"))
        assert len(bundles) == 1 and json.loads(bundles[0].read_text())["state"] == "open"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    assert proc.returncode == 1, err
    m = json.loads(bundles[0].read_text())
    assert m["state"] == "interrupted"
    assert signal.Signals(signum).name in m["interrupted_reason"] and "pyspy.dump" in m["interrupted_reason"]
    assert "Interrupted:" in out

    # the next start closes it (spans already sent: root_published)
    async def recover() -> list[str]:
        bus = RecordingBus()
        closed = await recover_interrupted(bus, data, "h1")
        assert not bus.of_type(IncidentClosed)  # its root span went out when it was interrupted
        return closed

    assert anyio.run(recover) == [m["incident_id"]]
    m = json.loads(bundles[0].read_text())
    assert m["state"] == "closed" and m["interrupted"] is True


async def test_a_bundle_left_open_by_a_killed_agent_gets_its_root_span_on_next_start(tmp_path: Path) -> None:
    bundle = tmp_path / "h1" / "20261130T000000Z-stall-abc123"
    bundle.mkdir(parents=True)
    async with await anyio.open_process([sys.executable, "-c", "pass"]) as dead:
        await dead.wait()
    (bundle / "manifest.json").write_text(json.dumps({
        "schema": "servewatch.incident/1", "incident_id": bundle.name, "trigger": "stall", "detail": "stuck",
        "trace_id": "ab" * 16, "span_id": "cd" * 8, "opened_time_unix_nano": now_ns() - 10**9,
        "closed_time_unix_nano": 0, "updated_time_unix_nano": now_ns(), "targets": [{"pid": 7}],
        "actions": [{"action": "pyspy.dump", "outcome": "ok"}], "state": "open", "agent_pid": dead.pid,
    }))
    bus = RecordingBus()
    assert await recover_interrupted(bus, tmp_path, "h1") == [bundle.name]
    [opened] = bus.of_type(IncidentOpened)
    [closed] = bus.of_type(IncidentClosed)
    assert (opened.trace_id, opened.span_id) == ("ab" * 16, "cd" * 8)
    assert closed.state == "interrupted" and closed.outcomes == (("pyspy.dump", "ok"),)
    m = _manifest(bundle)
    assert m["state"] == "closed" and m["interrupted"] and "killed" in m["interrupted_reason"]
    # a live agent's open incident is left alone
    (bundle / "manifest.json").write_text(json.dumps({**m, "state": "open", "agent_pid": os.getppid()}))
    assert await recover_interrupted(RecordingBus(), tmp_path, "h1") == []


def test_run_sigterm_during_an_incident_finishes_the_phase_then_stops(tmp_path: Path, spawn, python: str) -> None:
    """`servewatch run`: SIGTERM mid-incident -> interrupted with what was captured, bounded."""
    server = fake_server.start(spawn, "--title", "sglang::scheduler_TP0", "--freeze-after-steps", "5")
    data = tmp_path / "data"
    env = _env(tmp_path, SERVEWATCH_PYSPY__EXECUTABLE=_hanging_pyspy(tmp_path), SERVEWATCH_PYSPY__TIMEOUT_S="100",
               SERVEWATCH_INCIDENT__INTERRUPT_GRACE_S="1", SERVEWATCH_HOST_NAME="h1",
               SERVEWATCH_WATCHDOG__POLL_INTERVAL_S="0.2", SERVEWATCH_SHM_DIR=os.environ["SERVEWATCH_SHM_DIR"])
    proc = subprocess.Popen([*CLI, "run", "--pid", str(server.pid), "--watchdog-timeout", "1", "--data-dir", str(data)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "pyspy.log").exists():
            time.sleep(0.1)
        assert (tmp_path / "pyspy.log").exists(), "no incident started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    [manifest] = (data / "h1").glob("*/manifest.json")
    m = json.loads(manifest.read_text())
    assert m["state"] == "interrupted" and "SIGTERM" in m["interrupted_reason"], m
    assert m["root_published"] is True
    assert "Interrupted:" in err


def test_launch_prints_each_incident_summary_as_run_does(tmp_path: Path) -> None:
    script = "import time, sys; time.sleep(1.5); sys.exit(3)"
    r = subprocess.run(
        [*CLI, "launch", "--data-dir", "data", "--", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 3, r.stderr
    assert "servewatch: process: " in r.stderr  # watcher status lines, as run prints them
    [line] = [x for x in r.stderr.splitlines() if x.startswith("Incident ")]
    assert "(exit)" in line and "exited (exit code 3)" in line
    assert "View: servewatch timeline" in r.stderr


def test_launch_exit_zero_is_no_incident(tmp_path: Path) -> None:
    r = subprocess.run(
        [*CLI, "launch", "--data-dir", "data", "--", sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 0, r.stderr
    assert not list((tmp_path / "data").glob("*/*/manifest.json"))
    assert "Incident " not in r.stderr


async def test_a_manual_incident_on_a_stalled_server_ends_its_profile_at_once(tmp_path: Path, spawn) -> None:
    """Any trigger: the SDK counter says busy with no step for the watchdog timeout -> no wait."""
    from agent.runtime.agent import dump_once
    from agent.watchers.steps import ShmStepSource

    server = fake_server.start(spawn, "--title", "sglang::scheduler_TP0", "--freeze-after-steps", "5")
    await wait_until(lambda: (r := ShmStepSource(server.pid).read_now()) is not None and r.forward_ct >= 5, timeout_s=30)
    await anyio.sleep(1.2)  # frozen, busy, for longer than the watchdog timeout below
    settings = load_settings({
        "data_dir": tmp_path, "host_name": "h1", "target": {"pids": [server.pid]},
        "watchdog": {"timeout_s": 1.0}, "coredump": {"enabled": False},
        "profiler": {"on_incident_steps": 5, "max_duration_s": 60}, "export": {"metrics": False},
    })
    with anyio.fail_after(60):
        record = await dump_once(settings)
    prof = next(r for r in record.results if r.action == "profile.session")
    assert prof.outcome is Outcome.SKIPPED and prof.detail == "no steps: server stalled"


def test_an_agent_killed_mid_incident_has_its_bundle_closed_and_root_span_sent_on_next_start(
    tmp_path: Path, spawn
) -> None:
    server = fake_server.start(spawn, "--title", "sglang::scheduler_TP0", "--freeze-after-steps", "5")
    data = tmp_path / "data"
    base = {"SERVEWATCH_HOST_NAME": "h1", "SERVEWATCH_SHM_DIR": os.environ["SERVEWATCH_SHM_DIR"]}
    env = _env(tmp_path, SERVEWATCH_PYSPY__EXECUTABLE=_hanging_pyspy(tmp_path), SERVEWATCH_PYSPY__TIMEOUT_S="100",
               SERVEWATCH_WATCHDOG__POLL_INTERVAL_S="0.2", **base)
    proc = subprocess.Popen([*CLI, "run", "--pid", str(server.pid), "--watchdog-timeout", "1", "--data-dir", str(data)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "pyspy.log").exists():
            time.sleep(0.1)
        assert (tmp_path / "pyspy.log").exists(), "no incident started"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no chance to write anything more
        proc.wait(timeout=10)
        for line in (tmp_path / "pyspy.log").read_text().splitlines():
            for key in ("pid", "child_pid"):
                pid = json.loads(line).get(key)
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    [manifest] = (data / "h1").glob("*/manifest.json")
    m = json.loads(manifest.read_text())
    assert m["state"] == "open" and m["root_published"] is False

    # the next start (a normal one) closes it and sends its root span with the same ids
    r = subprocess.run([*CLI, "run", "--pid", str(server.pid), "--watchdog-timeout", "300", "--duration", "2",
                        "--data-dir", str(data)], cwd=tmp_path, env=_env(tmp_path, **base), capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    m = json.loads(manifest.read_text())
    assert m["state"] == "closed" and m["interrupted"] is True and "killed" in m["interrupted_reason"]
    spans = [s for f in data.rglob("*.jsonl") for line in f.read_text().splitlines() if '"resourceSpans"' in line
             for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    [root] = [s for s in spans if s["name"] == "incident" and s["spanId"] == m["span_id"]]
    assert root["traceId"] == m["trace_id"]
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    assert attrs["servewatch.incident.state"] == {"stringValue": "interrupted"}
