"""Exits caused by servewatch's own signals open no incident, on the real demo server (gloo TP=2):
hard mode's SIGABRT to the hung rank and the other rank's knock-on exit (recorded on the first
incident instead), and the operator's SIGTERM forwarded by ``servewatch launch`` to the tree."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from agent.demo import TORCH_MISSING_MESSAGE, torch_available
from agent.demo.client import DemoServer
from agent.incidents.manager import IncidentRecord
from agent.model.bus import RecordingBus
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from tests.demo.hang import hang_a_watched_rank

pytestmark = pytest.mark.skipif(not torch_available(), reason=TORCH_MISSING_MESSAGE)


async def test_hard_mode_knock_on_exits_are_recorded_not_a_second_incident(tmp_path: Path) -> None:
    records: list[IncidentRecord] = []
    with anyio.fail_after(110):
        async with DemoServer(tp=2) as server:
            tp0, tp1 = server.scheduler_pids
            settings = load_settings({
                "data_dir": tmp_path, "host_name": "node-a",
                "target": {"root_pid": server.pid, "match": ["demo::scheduler*"]},
                "watchdog": {"timeout_s": 2.0, "poll_interval_s": 0.2, "hard": True},
                "pyspy": {"enabled": False},
            })
            agent = Agent(settings, on_incident=records.append)
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                await hang_a_watched_rank(agent, server, tg, tp_rank=1)
                # both ranks exit: the signalled one and, through the broken collective, the other
                while not {tp0, tp1} <= agent.incidents.exits_handled:
                    await anyio.sleep(0.1)
                while agent.incidents.current is not None:
                    await anyio.sleep(0.1)
                agent.stop()
                tg.cancel_scope.cancel("both ranks gone")

    [record] = records  # no second (exit) incident
    assert record.opened.trigger == "stall"
    signalled = {pid for pid, sig in record.hard_signal_sent.items() if sig == "SIGABRT"}
    assert signalled and signalled <= {tp0, tp1}
    assert set(record.exits_after_hard_signal) == {tp0, tp1}
    [manifest] = list((tmp_path / "node-a").glob("*/manifest.json"))
    doc = json.loads(manifest.read_text())
    assert doc["incident_id"] == record.opened.incident_id and doc["trigger"] == "stall"
    assert doc["state"] == "closed"
    assert set(doc["exits_after_hard_signal"]) == {str(tp0), str(tp1)}
    assert {str(p) for p in signalled} <= set(doc["hard_signal_sent"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sigterm_to_launch_opens_no_incident_for_any_rank_of_the_tree(tmp_path: Path) -> None:
    port = _free_port()
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env["SERVEWATCH_SHM_DIR"] = str(tmp_path / "shm")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli.app", "launch", "--match", "demo::scheduler*", "--data-dir", "data",
         "--health-url", f"http://127.0.0.1:{port}/health", "--",
         sys.executable, "-m", "agent.demo.server", "--tp", "2", "--port", str(port), "--ready-file", str(ready)],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 100
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert ready.exists(), "demo server did not start"
        info = json.loads(ready.read_text())
        assert len(info["scheduler_pids"]) == 2
        lines: list[str] = []
        assert proc.stderr is not None
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        while not any("process: watching" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("process: watching" in line for line in lines), "".join(lines)
        time.sleep(5)  # two more discoveries (every 2 s): both ranks watched, their exits would be seen
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=10)  # EOF: launch and the server (holding the pipe) are gone
        err = "".join(lines)
        assert proc.returncode in (0, 128 + signal.SIGTERM), err
        # the operator's stop: neither the server nor any rank's exit is an incident
        assert not list((tmp_path / "data").glob("*/*/manifest.json")), err
        assert "Incident" not in err, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()


def test_knock_on_window_ends_after_its_grace_and_is_configurable(tmp_path: Path) -> None:
    import time as _time

    from agent.incidents.manager import IncidentConfig, IncidentManager
    from agent.model.events import TargetExited

    def manager(**config: object) -> IncidentManager:
        return IncidentManager(bus=RecordingBus(), config=IncidentConfig(**config), data_dir=tmp_path,
                               host_name="h", discover=list)

    m = manager(hard_mode_exit_grace_s=30)
    record = object.__new__(IncidentRecord)  # only its exits_after_hard_signal is used
    record.exits_after_hard_signal = {}
    m.current = record  # still running: it writes its manifest itself
    m._hard_windows.append((_time.monotonic() + 30, frozenset({21, 22}), record))
    assert m.classify(TargetExited(pid=22, exit_code=1, title="demo::scheduler_TP0")) is None
    assert record.exits_after_hard_signal == {22: "demo::scheduler_TP0: exit code 1"}
    assert m.classify(TargetExited(pid=23, exit_code=1))[0] == "exit"  # not of that tree
    m._hard_windows[0] = (_time.monotonic() - 1, frozenset({21, 22}), record)  # the grace is over
    assert m.classify(TargetExited(pid=21, exit_code=1))[0] == "exit"
    m2 = manager(hard_mode_exit_is_incident=True)
    m2._hard_windows.append((_time.monotonic() + 30, frozenset({22}), record))
    assert m2.classify(TargetExited(pid=22, exit_code=1))[0] == "exit"
