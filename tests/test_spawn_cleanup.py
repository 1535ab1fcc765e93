"""The ``spawn`` fixture's cleanup (tests/conftest.py): a test's processes die with it, also a
child left in the group by a launcher that exited first (``tests/programs/retitled_listener.py
--orphan`` once leaked a ``VLLM::APIServer_0`` per run)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.conftest import _kill_group

LAUNCHER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
"""


def test_a_child_left_behind_by_its_exited_launcher_is_killed_with_the_group() -> None:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    child = psutil.Process(int(proc.stdout.readline()))
    try:
        assert proc.wait(timeout=30) == 0 and child.is_running()  # the launcher is gone, its child lives on
        _kill_group(proc)
        child.wait(timeout=10)
        assert not child.is_running()
    finally:
        if child.is_running():
            child.kill()


def test_a_reaped_leader_whose_pid_names_another_process_kills_nothing(monkeypatch) -> None:
    """The leader's pid given to a new process: its group is not ours and is left alone."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
                                 stdin=subprocess.DEVNULL)
    try:
        proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True, stdin=subprocess.DEVNULL)
        proc.wait(timeout=30)
        monkeypatch.setattr(proc, "pid", bystander.pid)  # as if the number had been reused
        _kill_group(proc)
        time.sleep(0.2)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(timeout=10)
