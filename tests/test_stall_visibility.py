"""A stall the cooldown suppresses is said (once per cooldown window) and counted, and
`servewatch status` shows a stalled target and the incidents: a real SDK server
(tests/programs/fake_server.py) that freezes twice, watched by a real ``servewatch run``."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.programs import fake_server
from tests.test_targeting import CLI, cli_env, manifests


def _wait(what: Callable[[], bool], timeout_s: float, why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, why()
        time.sleep(0.1)


def _status(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "status", "--data-dir", "data", *args], capture_output=True, text=True, timeout=60,
        cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )


def test_a_stall_suppressed_by_the_cooldown_is_said_once_and_status_shows_it(spawn, tmp_path: Path) -> None:
    env = cli_env(tmp_path)  # the server's SDK counter and the agent share the shm folder
    server = fake_server.start(spawn, "--step-interval-s", "0.05", env=env)
    err = tmp_path / "run.err"
    with err.open("wb") as err_fh:
        run = spawn(
            [*CLI, "run", "--pid", str(server.pid), "--watchdog-timeout", "1", "--cooldown", "600",
             "--no-pyspy", "--duration", "100", "--data-dir", "data"],
            stdout=subprocess.PIPE, stderr=err_fh, cwd=tmp_path, env=env,
        )
    log = err.read_text
    _wait(lambda: "steps: 1 rank via shm counter" in log(), 60, log)

    server.control(mode="freeze")  # the first stall: an incident
    _wait(lambda: any(m["state"] == "closed" for m in manifests(tmp_path / "data")), 60, log)
    (first,) = manifests(tmp_path / "data")
    first_id = first["incident_id"]
    assert first["trigger"] == "stall", first["trigger"]
    server.control(mode="run")
    _wait(lambda: "stalled:" not in _status(tmp_path).stdout, 30, lambda: _status(tmp_path).stdout)

    server.control(mode="freeze")  # the second stall, within the cooldown: said, counted, shown
    _wait(lambda: "suppressed by cooldown" in log(), 30, log)
    said = [line for line in log().splitlines() if "suppressed by cooldown" in line]
    assert len(said) == 1, said
    assert re.fullmatch(
        rf"servewatch: warning: stall detected \(busy and no forward progress for .*pid {server.pid}\)\),"
        rf" suppressed by cooldown \(incident {first_id} opened \d+ s ago; no new stall incident for \d+ s more,"
        r" incident.cooldown_s 600\); more within this window are counted in `servewatch status`",
        said[0],
    ), said[0]
    status = _status(tmp_path)
    assert status.returncode == 1, (status.stdout, status.stderr)  # a stalled target is not "all fine"
    assert "steps: 1 rank via shm counter" in status.stdout
    assert re.search(
        rf"^stalled: pid {server.pid} busy, no forward progress for \d+ s \(timeout 1 s\); stall suppressed by cooldown"
        rf" \(incident {first_id}\)$", status.stdout, re.MULTILINE,
    ), status.stdout
    assert re.search(rf"^incidents: 1 written \(last {first_id}, stall, \d+ s ago\); 1 trigger suppressed by cooldown$",
                     status.stdout, re.MULTILINE), status.stdout
    doc = json.loads(_status(tmp_path, "--json").stdout)
    assert doc["incidents"]["suppressed"] == 1 and doc["incidents"]["stalled"][0]["pid"] == server.pid

    server.control(mode="run")  # resumed: the stall line goes, the count stays
    _wait(lambda: "stalled:" not in _status(tmp_path).stdout, 30, lambda: _status(tmp_path).stdout)
    server.control(mode="freeze")  # a third stall in the same window: counted, not said again
    _wait(lambda: "2 triggers suppressed by cooldown" in _status(tmp_path).stdout, 30, lambda: _status(tmp_path).stdout)
    server.control(mode="run")
    _wait(lambda: _status(tmp_path).returncode == 0, 30, lambda: _status(tmp_path).stdout)
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=60)
    assert sum("suppressed by cooldown" in line for line in log().splitlines()) == 1, log()
    assert len(manifests(tmp_path / "data")) == 1
