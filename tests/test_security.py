"""The local attack surface of an agent running as root (issue 10), tried as an attacker would.

Every unprivileged case runs as a real other uid (``nobody``, 65534) through
``setpriv --reuid 65534 --regid 65534 --clear-groups``; the agent side runs as root, as in
production. Hang guards only stop a broken test; nothing here measures speed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from agent.actors.coredump import CoredumpActor, CoredumpConfig
from agent.events import IncidentOpened, Outcome
from agent.targets import discover, target_of
from tests.conftest import PROGRAMS_DIR

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
HOST = socket.gethostname()
REPO = Path(__file__).resolve().parent.parent
#: An interpreter nobody can exec again (the venv's may sit behind a 0700 home); stdlib + PYTHONPATH.
NOBODY_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to act as another uid"
)


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A folder under /tmp owned by nobody (the attacker's own files), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="sw-nobody-", dir="/tmp"))
    os.chown(path, NOBODY, NOBODY)
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def wait_for(predicate: Callable[[], object], *, timeout_s: float = 30.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _ready(proc: subprocess.Popen[bytes]) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(b"ready"), line
    return proc.pid


# --- discovery by title: uid filter, and coredump folders a foreign target chose ---------------


#: A stdlib-only process of nobody whose title (argv[0]) is chosen by its owner (nobody cannot
#: import the root interpreter's setproctitle; exec with a new argv[0] is the same to /proc).
_TITLED = (
    "import os, sys; os.execv(sys.executable, [sys.argv[1], '-c',"
    " 'import sys, time; print(\"ready\", flush=True); time.sleep(float(sys.argv[1]))', sys.argv[2]])"
)


def titled_as_nobody(spawn: Callable, python: str, title: str, lifetime_s: float = 60.0) -> int:
    proc = spawn([*AS_NOBODY, NOBODY_PYTHON, "-c", _TITLED, title, str(lifetime_s)], stdout=subprocess.PIPE)
    return _ready(proc)


def test_uid_filter_keeps_only_given_uids(spawn: Callable, python: str) -> None:
    title = f"sglang::scheduler_TP0_{uuid.uuid4().hex[:6]}"
    titled_as_nobody(spawn, python, title)
    found = discover(title_globs=[title])
    assert [t.uid for t in found] == [NOBODY]
    assert discover(title_globs=[title], uids=[0]) == []
    assert [t.uid for t in discover(title_globs=[title], uids=[0, NOBODY])] == [NOBODY]


def _start_nobody_driver(spawn: Callable, python: str, home: Path, core_template: str) -> tuple[int, Path]:
    status = home / "status.json"
    env = {
        "PATH": os.environ["PATH"],
        "CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1",
        "CUDA_COREDUMP_PIPE": str(home / "corepipe.%p"),
        "CUDA_COREDUMP_FILE": core_template,
    }
    proc = spawn([*AS_NOBODY, NOBODY_PYTHON, str(PROGRAMS_DIR / "fake_cuda_driver.py"), "--status", str(status)],
                 env=env, cwd=str(home), stdout=subprocess.PIPE)
    _ready(proc)
    return proc.pid, status


@pytest.mark.parametrize("trusted", [False, True])
async def test_foreign_target_cannot_make_root_create_its_core_folder(
    spawn: Callable, python: str, tmp_path: Path, nobody_dir: Path, trusted: bool
) -> None:
    planted = tmp_path / "root-only" / "planted"  # where nobody wants root to create folders
    pid, status = _start_nobody_driver(spawn, python, nobody_dir, f"{planted}/%h/core.%p")
    target = target_of(pid)
    assert target is not None and target.uid == NOBODY
    config = CoredumpConfig(folder=tmp_path / "dumps", min_free_bytes=0, completion_timeout_s=110.0)
    actor = CoredumpActor(config, host=HOST, trusted_uids=[NOBODY] if trusted else [])
    opened = IncidentOpened(incident_id="inc-sec", trigger="manual", source="test")
    with anyio.fail_after(60):  # the 110 s completion wait is never entered
        result = await actor.act(opened, target, timeout_s=115.0, artifact_dir=tmp_path)
    assert result.outcome is Outcome.REFUSED
    assert ("not trusted" in result.detail) != trusted
    assert "not created" in result.detail or not trusted
    assert not (tmp_path / "root-only").exists()
    import json

    assert json.loads(status.read_text())["bytes_read"] == 0  # never triggered: nothing to wait for
