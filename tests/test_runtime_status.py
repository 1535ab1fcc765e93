"""The runtime's side of watcher status: supervision (a crash is a blind status, then a restart
with backoff), and `servewatch run` + `servewatch status` as real processes against real HTTP
servers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from agent.model.events import WatcherStatusChanged
from agent.runtime import supervision
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from tests.watchers import wait_until
from tests.watchers.scripted_http import scripted_http


class Exploding:
    """A watcher that is ready, then raises (a bug in a watcher)."""

    name = "boom"
    runs = 0

    async def run(self, bus: object, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        type(self).runs += 1
        task_status.started()
        await anyio.sleep(0.01)
        raise RuntimeError("parser exploded")


async def test_a_crashing_watcher_turns_blind_with_its_exception_and_is_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervision, "RESTART_BACKOFF_S", 0.05)
    agent = Agent(load_settings({"data_dir": tmp_path}))
    sub = agent.bus.subscribe(WatcherStatusChanged, max_buffer=1000)
    Exploding.runs = 0
    async with anyio.create_task_group() as tg:
        await tg.start(agent.supervised, "boom", Exploding)
        await wait_until(lambda: Exploding.runs >= 3)
        tg.cancel_scope.cancel()
    statuses = []
    while True:
        try:
            statuses.append(sub.receive_nowait())
        except anyio.WouldBlock:
            break
    sub.close()
    assert statuses and all(s.watcher == "boom" and s.state == "blind" for s in statuses)
    assert "watcher crashed: RuntimeError: parser exploded; restarting in" in statuses[0].reason
    assert agent.restarts["boom"] >= 2


CLI = [sys.executable, "-m", "agent.cli.app"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env["SERVEWATCH_SHM_DIR"] = str(tmp_path / "shm")
    return env


def test_servewatch_status_shows_what_a_running_agent_cannot_see(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        refused_port = sock.getsockname()[1]
    data = tmp_path / "data"
    with scripted_http() as srv:
        srv.route("/metrics", (401, {}, b"no"))
        log = (tmp_path / "run.err").open("wb")
        proc = subprocess.Popen(
            [*CLI, "run", "--metrics-url", srv.base + "/metrics", "--health-url",
             f"http://127.0.0.1:{refused_port}/health", "--data-dir", str(data), "--duration", "60"],
            cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 60
            lines: list[str] = []
            while time.monotonic() < deadline:
                r = subprocess.run([*CLI, "status", "--data-dir", str(data), "--json"], capture_output=True, text=True,
                                   timeout=60, cwd=tmp_path, env=_env(tmp_path), check=False)
                if r.returncode in (0, 1) and r.stdout.strip():
                    doc = json.loads(r.stdout)
                    states = {w["name"]: w["state"] for w in doc["watchers"]}
                    if states.get("metrics") == "blind" and states.get("health") == "blind":
                        break
                time.sleep(0.3)
            else:
                pytest.fail(f"no blind status reported: {r.stdout} {r.stderr}")
            assert doc["agent_running"] is True and doc["agent_pid"] == proc.pid
            r = subprocess.run([*CLI, "status", "--data-dir", str(data)], capture_output=True, text=True, timeout=60,
                               cwd=tmp_path, env=_env(tmp_path), check=False)
            assert r.returncode == 1  # a watcher is blind
            lines = r.stdout.splitlines()
            assert any(line.startswith("metrics: BLIND — 401 Unauthorized from") for line in lines), lines
            assert any(line.startswith("health: BLIND — connection refused at") for line in lines), lines
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            log.close()
    err = (tmp_path / "run.err").read_text()
    # shown at start, one line per detector, and on each change
    assert "servewatch: health: waiting for first 200 from" in err
    assert "servewatch: metrics: BLIND — 401 Unauthorized" in err
    assert "servewatch: pyspy:" in err
    # the agent is gone now: status says so in words and exits 1
    r = subprocess.run([*CLI, "status", "--data-dir", str(data)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env=_env(tmp_path), check=False)
    assert r.returncode == 1 and "is NOT running" in r.stderr


def test_status_of_a_gone_agent_says_so_first_and_does_not_grow_its_stalls(tmp_path: Path) -> None:
    """On a terminal the "NOT running" line comes before the lines it qualifies, and a stall the
    agent last saw 12 s long is not reported as 10 min long because the agent stopped 10 min ago."""
    import pty

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)  # a real pid, not running any more
    now = time.time_ns()
    last_word = now - 600 * 10**9
    doc = {
        "schema": "servewatch.status/1", "host.name": "h1", "agent_pid": gone.pid,
        "started_time_unix_nano": last_word - 60 * 10**9, "updated_time_unix_nano": last_word,
        "watchers": [{"name": "steps", "state": "ready", "reason": "2 ranks via shm counter",
                      "since_time_unix_nano": last_word - 50 * 10**9}],
        "incidents": {"open": None, "last": None, "written": 0, "suppressed": 0,
                      "stalled": [{"pid": 4242, "series": "", "timeout_s": 10.0, "incident": "", "suppressed": False,
                                   "since_time_unix_nano": last_word - 12 * 10**9}]},
    }
    (tmp_path / "data" / "h1").mkdir(parents=True)
    (tmp_path / "data" / "h1" / "status.json").write_text(json.dumps(doc))
    main_fd, tty_fd = pty.openpty()
    try:
        proc = subprocess.Popen([*CLI, "status", "--data-dir", str(tmp_path / "data")], stdin=subprocess.DEVNULL,
                                stdout=tty_fd, stderr=tty_fd, cwd=tmp_path,
                                env={**_env(tmp_path), "SERVEWATCH_HOST_NAME": "h1", "COLUMNS": "400"})
        os.close(tty_fd)
        chunks = []
        while True:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=60) == 1  # the agent is gone
    finally:
        os.close(main_fd)
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", b"".join(chunks).decode())  # the terminal's colours
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert lines[0].startswith(f"servewatch: agent pid {gone.pid} on h1 is NOT running (status below"), lines
    assert "stalled: pid 4242 busy, no forward progress for 12 s (timeout 10 s)" in lines, lines


# --- runtime hygiene ------------------------------------------------------------------------------


async def test_per_target_step_tasks_end_when_the_target_exits_and_clients_are_closed(tmp_path: Path, spawn) -> None:
    from tests.programs import fake_server

    server = fake_server.start(spawn, "--title", "sglang::scheduler_TP0")
    settings = load_settings({
        "data_dir": tmp_path, "host_name": "h1", "target": {"pids": [server.pid]},
        "metrics": {"url": server.metrics_url}, "coredump": {"enabled": False},
        "incident": {"on_exit_codes_only_nonzero": True}, "export": {"metrics": False},
    })
    agent = Agent.build(settings)
    sources: list = [agent.watchers["metrics"].source]  # the registered Prometheus watchdog's
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            await wait_until(lambda: server.pid in agent.watched_step_pids, timeout_s=30)
            # every bus subscription is bounded (the span mirror's too); drops are counted by the bus
            subs = agent.bus._subscriptions
            assert subs and all(s._send.statistics().max_buffer_size != float("inf") for s in subs)
            # the status row follows through the bus (written off the loop): wait for it, bounded
            await wait_until(lambda: (row := agent.status.get("steps")) is not None and row.line() == "steps: 1 rank via shm counter", timeout_s=30)
            assert agent.status.get("steps").line() == "steps: 1 rank via shm counter"
            os.killpg(server.pid, signal.SIGKILL)
            await wait_until(lambda: server.pid not in agent.watched_step_pids, timeout_s=30)
            await wait_until(lambda: agent.status.get("steps").state.value == "waiting", timeout_s=30)
            await wait_until(lambda: sources and sources[0]._client is not None, timeout_s=30)
            agent.stop()
    assert sources and all(s._client is None for s in sources)  # the Prometheus client was closed
    assert agent.bus.statistics().subscribers == 0


def test_a_reused_pid_with_a_new_create_time_is_watched_again() -> None:
    from agent.host.targets import Target
    from agent.watchers.process import ProcessWatcher

    w = ProcessWatcher([Target(pid=4242, title="old", create_time_s=100.0)])
    w.watch(Target(pid=4242, title="old", create_time_s=100.0))
    assert w._watched[4242].target.title == "old"
    w.watch(Target(pid=4242, title="new", create_time_s=200.0))
    assert w._watched[4242].target.title == "new"


async def test_a_failing_discovery_round_is_reported_and_the_agent_goes_on(tmp_path: Path, spawn, python: str) -> None:
    target = spawn([python, "-c", "import time; time.sleep(60)"])
    agent = Agent(load_settings({"data_dir": tmp_path, "target": {"pids": [target.pid]}, "export": {"metrics": False}}))
    calls = {"n": 0}
    real_watch = agent.process_watcher.watch

    def flaky_watch(t, **kw):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom in discovery")
        return real_watch(t, **kw)

    agent.process_watcher.watch = flaky_watch  # type: ignore[method-assign]
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            await wait_until(lambda: (s := agent.status.get("process")) is not None and "boom in discovery" in s.reason)
            await wait_until(lambda: agent.status.get("process").state.value == "ready", timeout_s=30)
            agent.stop()


async def test_a_bug_handling_one_trigger_does_not_stop_the_incident_loop(tmp_path: Path) -> None:
    from agent.incidents.manager import IncidentConfig, IncidentManager
    from agent.model.bus import RecordingBus
    from agent.model.events import TargetExited

    bus = RecordingBus()
    manager = IncidentManager(bus=bus, config=IncidentConfig(), data_dir=tmp_path, host_name="h", discover=list)
    real = manager.classify
    manager.classify = lambda e: (_ for _ in ()).throw(RuntimeError("bug")) if e.pid == 1 else real(e)  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        await tg.start(manager.run)
        await bus.publish(TargetExited(pid=1, exit_code=1))
        await bus.publish(TargetExited(pid=2, exit_code=1))
        await wait_until(lambda: manager.records)
        tg.cancel_scope.cancel()
    assert [r.opened.trigger for r in manager.records] == ["exit"]
    assert manager.exits_handled == {1, 2}


async def test_a_stable_target_set_is_rescanned_rarely_and_at_once_when_a_target_goes(
    tmp_path: Path, spawn, python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervision, "REDISCOVER_INTERVAL_S", 0.1)
    monkeypatch.setattr(supervision, "REDISCOVER_STABLE_AFTER_S", 0.5)
    monkeypatch.setattr(supervision, "REDISCOVER_STABLE_INTERVAL_S", 30.0)
    a = spawn([python, "-c", "import time; time.sleep(60)"])
    b = spawn([python, "-c", "import time; time.sleep(60)"])
    settings = {"data_dir": tmp_path, "target": {"pids": [a.pid, b.pid]}, "export": {"metrics": False}}
    agent = Agent(load_settings(settings))
    scans: list[float] = []
    real_discover = agent.discover

    def counting_discover():  # type: ignore[no-untyped-def]
        scans.append(time.monotonic())
        return real_discover()

    agent.discover = counting_discover  # type: ignore[method-assign]
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            await wait_until(lambda: (s := agent.status.get("process")) is not None and "2 target" in s.reason)
            await anyio.sleep(1.0)  # stable by now
            before = len(scans)
            await anyio.sleep(1.5)  # fast mode would scan ~15 times here
            assert len(scans) - before <= 1
            b.kill()
            await anyio.to_thread.run_sync(b.wait)  # reaped: the pid is gone
            gone_at = time.monotonic()
            await wait_until(lambda: "1 target" in agent.status.get("process").reason, timeout_s=10)
            assert any(t >= gone_at for t in scans)  # a full scan right after, not 30 s later
            agent.stop()
