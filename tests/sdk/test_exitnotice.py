"""The SDK's death notice on real processes (tests/programs/exit_notice_target.py): each way a
process ends is said in its notice, and the process still ends exactly as it would have (its
parent's waitpid sees the same code or signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from agent.host.exits import sdk_notice, sdk_notice_fact
from agent.model.events import ExitSource
from agent.sdk._files import NOTICE_KEEP_S
from agent.sdk.counter import counter_path, remove_dead_sdk_files
from agent.sdk.exitnotice import ENV_EXIT_NOTICE, ExitNotice, notice_path, read_exit_notice
from tests.conftest import PROGRAMS_DIR

TARGET = str(PROGRAMS_DIR / "exit_notice_target.py")
REPO = PROGRAMS_DIR.parent.parent


def _start(spawn, shm: Path, mode: str, **env: str) -> tuple[subprocess.Popen[bytes], int, float]:
    proc = spawn([sys.executable, TARGET, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 env={**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "PYTHONPATH": str(REPO), **env})
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line and line[0] == b"ready", (line, proc.stderr.read() if proc.stderr else b"")
    return proc, int(line[1]), psutil.Process(proc.pid).create_time()


def _notice(shm: Path, pid: int) -> ExitNotice:
    notice = read_exit_notice(notice_path(pid, shm, (os.geteuid(),)), (os.geteuid(),))
    assert notice is not None
    return notice


@pytest.mark.parametrize(("mode", "returncode", "how", "code", "sig"), [
    ("exit3", 3, "exit", 3, None),
    ("end", 0, "exit", 0, None),
    ("raise", 1, "exception", 1, None),
    ("segv", -signal.SIGSEGV, "signal", None, signal.SIGSEGV),
])
def test_the_notice_says_how_the_process_ended_and_the_status_stays_its_own(
        spawn, tmp_path: Path, mode: str, returncode: int, how: str, code: int | None, sig: int | None) -> None:
    before = time.time_ns()
    proc, pid, created_s = _start(spawn, tmp_path, mode)
    assert proc.wait(timeout=60) == returncode  # what its parent's waitpid sees, as without the SDK
    notice = _notice(tmp_path, pid)
    assert (notice.pid, notice.how, notice.exit_code, notice.signal) == (pid, how, code, sig), notice
    assert before < notice.time_unix_nano <= time.time_ns()
    assert abs(notice.start_time_unix_nano - created_s * 1e9) < 0.05e9  # psutil's create_time: the same clock
    if mode == "raise":
        raised_at = Path(TARGET).read_text().splitlines().index('        raise ValueError("a prompt that must never be written")') + 1
        assert notice.exception == "ValueError" and notice.where == f"{TARGET}:{raised_at}", notice
        written = b"".join(p.read_bytes() for p in notice_path(pid, tmp_path).parent.iterdir())
        assert b"prompt" not in written  # the message is never written
    if mode == "segv":
        assert notice.fault == "Fatal Python error: Segmentation fault", notice
    fact = sdk_notice_fact(pid, created_s, (os.geteuid(),), tmp_path)
    assert fact is not None and (fact.exit_code, fact.signal, fact.source) == (code, sig, ExitSource.SDK), fact
    assert fact.ended_time_unix_nano == notice.time_unix_nano and fact.ended_source == "sdk"


def test_a_sigtermed_process_still_dies_by_sigterm_and_its_notice_says_so(spawn, tmp_path: Path) -> None:
    proc, pid, _ = _start(spawn, tmp_path, "wait")
    os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # the default action, as without the SDK
    notice = _notice(tmp_path, pid)
    assert (notice.how, notice.signal) == ("signal", signal.SIGTERM), notice
    assert notice.describe() == "killed by SIGTERM"


def test_a_server_s_own_sigterm_handler_is_chained_not_replaced(spawn, tmp_path: Path) -> None:
    proc, pid, _ = _start(spawn, tmp_path, "own-handler")  # its handler exits 0
    os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    notice = _notice(tmp_path, pid)
    assert (notice.how, notice.exit_code) == ("exit", 0), notice
    assert b'"after_signal":15' in notice_path(pid, tmp_path, (os.geteuid(),)).read_bytes()


def test_a_sigkilled_process_leaves_its_running_notice_which_says_killed_without_a_notice(
        spawn, tmp_path: Path) -> None:
    proc, pid, created_s = _start(spawn, tmp_path, "wait")
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    notice = _notice(tmp_path, pid)
    assert notice.how == "running" and notice.describe() == "killed without a notice (SIGKILL, likely)"
    assert sdk_notice(pid, created_s, (os.geteuid(),), tmp_path) == notice
    assert sdk_notice_fact(pid, created_s, (os.geteuid(),), tmp_path) is None  # no status: it stays unknown


def test_a_notice_is_trusted_only_for_the_same_process_and_uid(spawn, tmp_path: Path) -> None:
    proc, pid, created_s = _start(spawn, tmp_path, "exit3")
    assert proc.wait(timeout=60) == 3
    me = (os.geteuid(),)
    assert sdk_notice(pid, created_s, me, tmp_path) is not None
    assert sdk_notice(pid, created_s + 5.0, me, tmp_path) is None  # a later process with this pid
    assert sdk_notice(pid, created_s, (65534,), tmp_path) is None  # not in that uid's folder
    path = notice_path(pid, tmp_path, me)
    moved = path.with_name("elsewhere")
    path.rename(moved)
    path.symlink_to(moved)
    assert sdk_notice(pid, created_s, me, tmp_path) is None  # never through a symlink


def test_the_notice_can_be_turned_off(spawn, tmp_path: Path) -> None:
    proc, pid, _ = _start(spawn, tmp_path, "exit3", **{ENV_EXIT_NOTICE: "0"})
    assert proc.wait(timeout=60) == 3
    assert read_exit_notice(notice_path(pid, tmp_path, (os.geteuid(),))) is None
    assert not any(p.name.startswith("servewatch-exit.") for p in counter_path(pid, tmp_path).parent.iterdir())


def test_dead_processes_notices_are_swept_once_old_and_their_counter_gone(spawn, tmp_path: Path) -> None:
    proc, pid, _ = _start(spawn, tmp_path, "wait")
    proc.kill()  # its counter stays behind, unheld
    proc.wait(timeout=30)
    folder = notice_path(pid, tmp_path, (os.geteuid(),)).parent
    notices = sorted(p for p in folder.iterdir() if p.name.startswith(f"servewatch-exit.{pid}"))
    assert len(notices) >= 2 and counter_path(pid, tmp_path).exists()
    assert remove_dead_sdk_files(tmp_path) == [counter_path(pid, tmp_path)]  # fresh: kept for the agent
    live, live_pid, _ = _start(spawn, tmp_path, "wait")  # its first step sweeps too
    assert all(p.exists() for p in notices)
    old = time.time() - NOTICE_KEEP_S - 1
    for p in [*notices, notice_path(live_pid, tmp_path, (os.geteuid(),))]:
        os.utime(p, (old, old))
    assert sorted(remove_dead_sdk_files(tmp_path)) == notices  # old, counter gone: swept
    assert notice_path(live_pid, tmp_path, (os.geteuid(),)).exists()  # a live process's stays
    live.kill()


def test_a_forked_child_writes_nothing_into_its_parent_s_notice(spawn, tmp_path: Path) -> None:
    proc, pid, _ = _start(spawn, tmp_path, "fork")
    assert proc.stdout is not None
    status = int(proc.stdout.readline().split()[1])
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV  # it died as without the SDK
    assert proc.wait(timeout=60) == 0
    notice = _notice(tmp_path, pid)
    assert (notice.how, notice.exit_code, notice.fault) == ("exit", 0, ""), notice  # the child's fault is not the parent's
