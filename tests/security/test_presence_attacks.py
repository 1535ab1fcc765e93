"""Presence: slowing new SDK servers and blocking agents' declarations, as a real other user
(issue 34, item 5).

Before, an agent declared the servers it watches in a flat ``<shm>/servewatch-agent.<agent pid>``
file, and a server with a new ring listed the whole shared folder on its request path (every
0.5 s for its first 10 s) to find one. A local user planting 200,000 ``servewatch-agent.<n>``
files in ``/dev/shm`` made each look take seconds: a new server served a few requests in the time
it serves hundreds. Squatting ``servewatch-agent.<n>`` for the next pids blocked future agents'
declarations, so their servers' first spans went to the fallback path. Now the declaration lives
in the watched server's own private folder (0700, nobody else can create a name there) and the
server opens that one file by name (:mod:`agent.sdk.presence`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.watchers.status import WatcherState, read_status_file, status_path
from tests.conftest import PROGRAMS_DIR
from tests.sdk._helpers import read_line
from tests.security._attack import (
    NOBODY,
    NOBODY_PYTHON,
    REPO,
    needs_root,
    ready_line,
    run_as_nobody,
)

pytestmark = needs_root

SPAN_SERVER = str(PROGRAMS_DIR / "span_server.py")
#: Files the attacker plants in the shared folder (the issue's figure).
PLANTED = 200_000
#: How long each server serves before its requests are counted, seconds (within its 10 s hold window).
WINDOW_S = 3.0

#: Stdlib-only program the attacker runs (as nobody): ``PLANT folder prefix first count suffix``
#: creates ``count`` empty files ``<prefix><n><suffix>`` for ``n`` from ``first`` (empty: 200,000 of them take no
#: blocks of the tmpfs, and no check reads another user's file); with ``wrap`` = 1, names past the
#: kernel's pid_max wrap as pids do (to 300, :func:`_wrapped`); prints ``ready <created>``.
PLANT = """
import os, sys
folder, prefix, first, count, suffix = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
wrap = sys.argv[6] == "1"
pid_max = int(open("/proc/sys/kernel/pid_max").read())
made = 0
for i in range(count):
    n = first + i
    n = n if n < pid_max or not wrap else 300 + (n - pid_max) % (pid_max - 300)
    try:
        os.close(os.open(os.path.join(folder, prefix + str(n) + suffix), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError:
        continue
    made += 1
print("ready", made, flush=True)
"""


def _plant(spawn: Callable, folder: Path, prefix: str, first: int, count: int, suffix: str = "", *, wrap: bool = False) -> int:
    planter = run_as_nobody(spawn, [NOBODY_PYTHON, "-c", PLANT, str(folder), prefix, str(first), str(count), suffix,
                                    "1" if wrap else "0"])
    made = int(ready_line(planter, b"ready").split()[1])
    assert planter.wait(timeout=300) == 0
    return made


def _wrapped(first: int, count: int) -> set[int]:
    """The ``count`` pids the kernel hands out from ``first`` on, wrapping past ``pid_max`` to 300
    as Linux does (a busy CI host wraps within a test: its next 30,000 pids are not ``first + n``)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return {n if n < pid_max else 300 + (n - pid_max) % (pid_max - 300) for n in range(first, first + count)}


def _base(parent: Path, name: str) -> Path:
    base = parent / name
    base.mkdir()
    base.chmod(0o1777)  # like /dev/shm: every user creates names
    return base


def _say(proc: subprocess.Popen[bytes], line: str, timeout_s: float = 120) -> str:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()
    return read_line(proc, timeout_s=timeout_s)


def _server(spawn: Callable, base: Path, *args: str) -> subprocess.Popen[bytes]:
    """A root SDK server whose first span creates its ring (no agent watches it)."""
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(base), "PYTHONPATH": str(REPO), "OTEL_SERVICE_NAME": "tiny-llm",
           "SERVEWATCH_SPAN_FALLBACK": "drop"}
    proc = spawn([sys.executable, SPAN_SERVER, "--lazy-ring", "--max-lifetime-s", "150", *args], env=env,
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert read_line(proc, timeout_s=60).startswith("ready")
    return proc


def test_planted_agent_files_in_the_shared_folder_do_not_slow_a_new_server(
    spawn: Callable, shared_tmpfs: Path
) -> None:
    clean, busy = _base(shared_tmpfs, "clean"), _base(shared_tmpfs, "busy")
    assert _plant(spawn, busy, "servewatch-agent.", 2, PLANTED) == PLANTED
    assert all(p.stat().st_uid == NOBODY for p in list(busy.iterdir())[:10])
    # both serve at once (the same CPU contention), each counted after the same window
    servers = {"clean": _server(spawn, clean, "--rate", "200"), "busy": _server(spawn, busy, "--rate", "200")}
    time.sleep(WINDOW_S)
    served = {name: json.loads(_say(proc, "stats"))["served"] for name, proc in servers.items()}
    print(f"requests served in {WINDOW_S} s: {served}")
    # without planted files a server serves hundreds of requests in the window (200/s asked)
    assert served["clean"] >= 100, served
    # with them, about as many (before: each presence look listed 200,000 names on the request path)
    assert served["busy"] * 3 >= served["clean"], served


def _agent(spawn: Callable, tmp_path: Path, base: Path, server_pid: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(base), SERVEWATCH_HOST_NAME="node-a", PYTHONPATH=str(REPO),
               SERVEWATCH_COREDUMP__ENABLED="false")
    argv = [sys.executable, "-m", "agent.cli.app", "run", "--pid", str(server_pid), "--data-dir", str(tmp_path / "data")]
    return spawn(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _declared(base: Path, server_pid: int) -> bool:
    """The declaration where the server looks for it (root's private folder, or its fallback)."""
    return any(base.glob(f"servewatch-0.*/servewatch-watched.{server_pid}")) or (
        base / "servewatch-0" / f"servewatch-watched.{server_pid}").exists()


def _watching(tmp_path: Path) -> bool:
    """The agent's status file says it watches its target process (and its spans row is up)."""
    try:
        snap = read_status_file(status_path(tmp_path / "data", "node-a"))
    except (OSError, ValueError):
        return False
    process, spans = snap.get("process"), snap.get("spans")
    return process is not None and process.state is WatcherState.READY and spans is not None


def test_squatted_presence_names_do_not_stop_an_agent_declaring_its_server(
    spawn: Callable, tmp_path: Path, shared_tmpfs: Path, attack_programs: Path
) -> None:
    base = _base(shared_tmpfs, "shm")
    first = os.getpid()
    span = 30_000  # the next pids, the agent's among them: its declaration's name and temp name (a
    # root agent replaces another user's file in a sticky folder, never its exclusive temp file);
    # and the new layout's name, in the shared folder
    for prefix, suffix in (("servewatch-agent.", ""), (".servewatch-agent.", ".tmp"), ("servewatch-watched.", "")):
        assert _plant(spawn, base, prefix, first, span, suffix, wrap=True) == span
    squat = run_as_nobody(spawn, [NOBODY_PYTHON, str(attack_programs / "attack_shm_squat.py"), "--dir", str(base),
                                  "--pids", "10", "--uids", "0", "--kind", "folder"])  # root's private folder name too
    ready_line(squat)
    assert squat.wait(timeout=60) == 0
    server = _server(spawn, base, "--paused")
    agent = _agent(spawn, tmp_path, base, server.pid)
    assert agent.pid in _wrapped(first, span) and (base / f"servewatch-agent.{agent.pid}").stat().st_uid == NOBODY
    deadline = time.monotonic() + 60
    while not _watching(tmp_path):  # the agent watches the server, which has no ring yet
        assert agent.poll() is None, agent.communicate(timeout=10)
        if time.monotonic() > deadline:
            pytest.fail("the agent never watched the server")
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while not _declared(base, server.pid) and time.monotonic() < deadline:  # its next poll declares it
        time.sleep(0.1)
    assert _say(server, "serve 5").startswith("served")  # the first spans: no ring before, no agent attached yet
    stats = json.loads(_say(server, "stats"))["channel"]
    # held in the ring for the declared agent, not dropped as "no agent"
    assert stats["dropped_no_agent"] == 0 and stats["fallback_spans"] == 0 and stats["written"] == 10, stats
    deadline = time.monotonic() + 60
    while json.loads(_say(server, "stats"))["channel"]["attached"] != 1:
        assert agent.poll() is None and time.monotonic() < deadline, "the agent never attached"
        time.sleep(0.1)
