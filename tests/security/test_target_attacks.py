"""Another user's process titled like the server's ranks (issue 23, item 3).

A title is something any user can choose. With a title-only ``--match``, a process of another
uid named like a rank used to join the job: reporting a stall of its own it got the real,
root-owned rank SIGABRTed by hard mode (``--hard-targets all``), and by default it could get the
real server paused by py-spy whenever it liked. Now a process whose uid is not the server's (the
uid of ``--root-pid``/``--pid``, ``--uid``, else servewatch's own) is refused, and discovery says
whom it refused and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.host.targets import discover
from agent.watchers.status import read_status_file, status_path
from tests.conftest import PROGRAMS_DIR
from tests.security._attack import (
    NOBODY,
    NOBODY_PYTHON,
    REPO,
    needs_root,
    ready_line,
    run_as_nobody,
)

pytestmark = needs_root


def _ranks(spawn: Callable, python: str, attack_programs: Path, shm: Path) -> tuple[str, subprocess.Popen[bytes], int]:
    tag = uuid.uuid4().hex[:8]
    rank = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), f"sglang::scheduler_TP0-{tag}"], stdout=subprocess.PIPE,
                 env={**os.environ, "SERVEWATCH_SHM_DIR": str(shm)})
    assert rank.stdout is not None and rank.stdout.readline().startswith(b"ready")
    attacker = run_as_nobody(spawn, ["env", f"PYTHONPATH={REPO}", f"SERVEWATCH_SHM_DIR={shm}", NOBODY_PYTHON,
                                     str(attack_programs / "attack_titled_stall.py"), f"sglang::scheduler_TP1-{tag}"])
    pid = int(ready_line(attacker).split()[1])
    return f"sglang::scheduler_TP*-{tag}", rank, pid


@pytest.mark.slow
def test_a_process_of_another_uid_titled_like_a_rank_never_gets_the_server_signalled(
    spawn: Callable, python: str, tmp_path: Path, shared_tmpfs: Path, attack_programs: Path, host_files: Path
) -> None:
    glob, rank, attacker = _ranks(spawn, python, attack_programs, shared_tmpfs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(shared_tmpfs), SERVEWATCH_COREDUMP__ENABLED="false", SERVEWATCH_HOST_NAME="node-a",
               SERVEWATCH_WATCHDOG__TIMEOUT_S="2", SERVEWATCH_WATCHDOG__POLL_INTERVAL_S="0.5")
    data = tmp_path / "data"
    run = subprocess.run([sys.executable, "-m", "agent.cli.app", "run", "--match", glob, "--hard", "--hard-targets", "all",
                          "--duration", "8", "--data-dir", str(data)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert rank.poll() is None, "the real rank was signalled"
    assert [json.loads(p.read_text())["trigger"] for p in data.rglob("manifest.json")] == []  # no incident at all
    said = f"pid {attacker} 'sglang::scheduler_TP1-{glob[-8:]}' runs as uid {NOBODY}, not the server's (uid 0)"
    assert said in run.stderr  # discovery says whom it refused, and why
    process = read_status_file(status_path(data, "node-a")).get("process")
    assert process is not None and "refused 1 process of another uid" in process.reason and said in process.reason


def test_discovery_keeps_the_servers_uid_and_what_the_operator_allows(
    spawn: Callable, python: str, shared_tmpfs: Path, attack_programs: Path
) -> None:
    glob, rank, attacker = _ranks(spawn, python, attack_programs, shared_tmpfs)
    refused: dict[int, str] = {}
    assert [t.pid for t in discover(title_globs=[glob], refused=refused)] == [rank.pid]  # title only: our uid
    assert list(refused) == [attacker] and "add --uid 65534 or --any-uid" in refused[attacker]
    assert [t.pid for t in discover(title_globs=[glob], uids=[NOBODY])] == [rank.pid, attacker]  # root always counts
    assert [t.pid for t in discover(title_globs=[glob], any_uid=True)] == [rank.pid, attacker]
    assert [t.pid for t in discover(title_globs=[glob], pids=[attacker])] == [rank.pid, attacker]  # named by the operator
    assert [t.pid for t in discover(root_pids=[attacker], title_globs=[glob])] == [attacker]  # that tree's root's uid
