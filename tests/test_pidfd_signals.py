"""Every signal the agent sends reaches only the process it judged: in a real pid namespace a new
process takes the culprit's pid after the verdict (tests/programs/pid_reuse.py), and neither hard
mode's SIGABRT nor py-spy's SIGCONT reaches it (issue 23 item 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.host import pidfds
from agent.host.targets import target_of
from tests.conftest import PROGRAMS_DIR

ROOT = Path(__file__).resolve().parent.parent


def _in_pid_namespace(mode: str) -> dict:
    if shutil.which("unshare") is None or not pidfds.PIDFD_SUPPORTED:
        pytest.skip("needs unshare(1) and pidfds (Linux >= 5.3)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                          str(PROGRAMS_DIR / "pid_reuse.py"), mode], check=False, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_hard_mode_never_signals_a_process_that_took_the_culprits_pid() -> None:
    got = _in_pid_namespace("hard")
    [result] = got["results"]
    assert result["pid"] == got["culprit_pid"]
    assert result["alive"], "the newcomer on the culprit's pid got hard mode's SIGABRT"
    assert result["outcome"] == "no_such_process" and "not signalled" in result["detail"], result


def test_sigcont_never_reaches_a_process_that_took_the_targets_pid() -> None:
    got = _in_pid_namespace("sigcont")
    [result] = got["results"]
    assert result["outcome"].startswith("refused"), result
    assert result["newcomer_state"] == "T", "the newcomer on the target's pid was continued"


def test_a_held_pidfd_signals_its_own_live_process(spawn) -> None:
    proc = spawn(["sleep", "60"])
    target = target_of(proc.pid)
    assert target is not None and pidfds.hold(target)
    try:
        assert pidfds.send_signal(target, 0) == "pidfd"  # signal 0: the process is there and ours to signal
    finally:
        pidfds.release(target)
    assert pidfds.send_signal(target, 0) == "pidfd-now"  # opened and verified at send
