"""Squatting the SDK's shared-memory names (issue 23, item 6), as a real other user.

/dev/shm is shared (1777): any user can create a name there first. Before, the SDK's files were
flat names (``servewatch-steps.<pid>``): another user pre-created them for the next thousands of
pids, a root server started afterwards could not publish its step counter, and its hang was never
detected. Now each user's files live in a private folder (:mod:`agent.sdk.folders`); when its
name is taken too, the SDK makes an unguessable one, the agent still finds it, and says what it
refused on the status board.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.watchers.status import read_status_file, status_path
from tests.conftest import PROGRAMS_DIR
from tests.security._attack import NOBODY_PYTHON, REPO, needs_root, ready_line, run_as_nobody

pytestmark = needs_root


def _squat(spawn: Callable, attack_programs: Path, shm: Path, kind: str, pids: int = 10000) -> None:
    squatter = run_as_nobody(spawn, [NOBODY_PYTHON, str(attack_programs / "attack_shm_squat.py"), "--dir", str(shm),
                                     "--pids", str(pids), "--uids", "0", "--kind", kind])
    ready_line(squatter)
    squatter.wait(timeout=60)


def _sdk_server(spawn: Callable, python: str, shm: Path, *args: str) -> tuple[subprocess.Popen[bytes], dict]:
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "PYTHONPATH": str(REPO)}
    proc = spawn([python, str(PROGRAMS_DIR / "sdk_server.py"), *args], env=env, stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().startswith(b"pid ")
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    return proc, json.loads(proc.stdout.readline())


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "why"), [("folder", "is owned by uid 65534"), ("symlink", "is a symlink owned by uid 65534"),
                                           ("file", "is not a folder (owned by uid 65534)")])
def test_a_root_server_that_hangs_is_detected_after_another_user_squatted_the_sdk_names(
    spawn: Callable, python: str, tmp_path: Path, shared_tmpfs: Path, attack_programs: Path, host_files: Path,
    kind: str, why: str,
) -> None:
    _squat(spawn, attack_programs, shared_tmpfs, kind)
    server, state = _sdk_server(spawn, python, shared_tmpfs, "--hang")
    assert state["published"] is True and state["control_running"] is True, state  # published all the same
    counter = Path(state["counter"])
    assert counter.parent.name.startswith("servewatch-0.") and counter.parent.stat().st_uid == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(shared_tmpfs), SERVEWATCH_COREDUMP__ENABLED="false", SERVEWATCH_HOST_NAME="node-a",
               SERVEWATCH_WATCHDOG__TIMEOUT_S="2", SERVEWATCH_WATCHDOG__POLL_INTERVAL_S="0.5")
    data = tmp_path / "data"
    run = subprocess.run([sys.executable, "-m", "agent.cli.app", "run", "--pid", str(server.pid), "--duration", "8",
                          "--data-dir", str(data)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    manifests = [json.loads(p.read_text()) for p in data.rglob("manifest.json")]
    assert [m["trigger"] for m in manifests] == ["stall"], run.stderr  # the hang was seen
    steps = read_status_file(status_path(data, "node-a")).get("steps")
    assert steps is not None and f"counter refused: {shared_tmpfs}/servewatch-0 {why}" in steps.reason, steps


def test_a_forged_counter_in_a_squatted_folder_never_opens_a_stall(
    spawn: Callable, python: str, shared_tmpfs: Path, attack_programs: Path, host_files: Path
) -> None:
    from agent.watchers.steps import ShmStepSource, discover_shm_counters

    _squat(spawn, attack_programs, shared_tmpfs, "folder", pids=2000)
    victim = spawn([python, "-c", "import time; time.sleep(60)"])  # a root server without the SDK, in the squatted range
    forged = shared_tmpfs / "servewatch-0" / f"servewatch-steps.{victim.pid}"
    assert forged.exists() and forged.stat().st_uid == 65534  # well-formed, busy, stalled: if anyone believed it
    assert ShmStepSource(victim.pid, directory=shared_tmpfs).read_now() is None
    assert victim.pid not in discover_shm_counters(directory=shared_tmpfs)
