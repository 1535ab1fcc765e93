"""SDK files of dead processes: a rank killed with SIGKILL leaves its step counter and control
socket behind; the next SDK start (and the agent at its start) removes them, and only them.

Real processes (tests/programs/sdk_server.py), a real SIGKILL, a real second uid
(``setpriv --reuid=65534``), a real lock holder standing for a live writer in another pid
namespace that shares the folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agent.sdk.control import control_path
from agent.sdk.counter import counter_path, remove_dead_sdk_files
from tests.conftest import PROGRAMS_DIR

SDK_SERVER = str(PROGRAMS_DIR / "sdk_server.py")
REPO = PROGRAMS_DIR.parent.parent


def _start(spawn, shm: Path) -> tuple[subprocess.Popen[bytes], int]:
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "PYTHONPATH": str(REPO)}
    proc = spawn([sys.executable, SDK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    pid = int(proc.stdout.readline().split()[1])
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    state = json.loads(proc.stdout.readline())
    assert state["published"] and state["control_running"], state
    return proc, pid


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_rank_s_files_are_removed_by_the_next_sdk_start(spawn, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    crashed, old_pid = _start(spawn, shm)
    crashed.kill()  # SIGKILL: no atexit, no close
    crashed.wait(timeout=10)
    left = {counter_path(old_pid, shm), control_path(old_pid, shm)}
    assert all(p.exists() for p in left)  # what the issue saw: they stay
    # files that are not ours to remove, named like dead processes' files
    decoy_pid = _dead_pid()
    symlink = counter_path(decoy_pid, shm)
    symlink.symlink_to(tmp_path / "elsewhere")
    held_pid = _dead_pid()
    held = counter_path(held_pid, shm)  # a live writer holds it (another pid namespace, say)
    held.write_bytes(b"\0" * 64)
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    _, new_pid = _start(spawn, shm)  # the restarted rank
    assert not any(p.exists() for p in left), sorted(os.listdir(shm))
    assert counter_path(new_pid, shm).exists() and control_path(new_pid, shm).exists()
    assert symlink.is_symlink()  # never followed, never removed
    assert held.exists()  # its lock is held: a live writer's
    os.close(holder)
    assert remove_dead_sdk_files(shm) == [held]  # once released, it goes
    assert symlink.is_symlink()


def test_files_of_another_uid_are_left_alone(spawn, tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv for a real second uid")
    shm = Path(tempfile.mkdtemp(prefix="servewatch-hk-", dir="/tmp"))  # reachable by the other uid
    try:
        shm.chmod(0o1777)
        env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "PYTHONPATH": str(REPO)}
        proc = spawn([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, SDK_SERVER],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd="/")
        assert proc.stdin is not None and proc.stdout is not None
        pid = int(proc.stdout.readline().split()[1])
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["published"]
        proc.kill()
        proc.wait(timeout=10)
        left = sorted((shm / "servewatch-65534").glob(f"servewatch-*{pid}*"))  # their private folder
        # (its death notice stays too: agent.sdk.exitnotice)
        assert [p.name for p in left if not p.name.startswith("servewatch-exit.")] == [
            f"servewatch-ctl.{pid}.sock", f"servewatch-steps.{pid}"], left
        assert f"servewatch-exit.{pid}" in [p.name for p in left], left
        assert all(p.lstat().st_uid == 65534 for p in left)
        assert remove_dead_sdk_files(shm) == []  # root, but not the owner: not ours to remove
        assert all(os.path.lexists(p) for p in left)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_the_agent_removes_them_at_its_start(spawn, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    crashed, old_pid = _start(spawn, shm)
    crashed.kill()
    crashed.wait(timeout=10)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(shm))
    r = subprocess.run([sys.executable, "-m", "agent.cli.app", "run", "--match", f"nothing{os.getpid()}::*", "--duration", "1",
                        "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**env, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr
    assert not counter_path(old_pid, shm).exists() and not control_path(old_pid, shm).exists(), sorted(os.listdir(shm))
