"""Issue 34 item 7: ``profile.start`` over a server's control socket writes traces only into the
session folder the agent created for it, never ``/etc`` nor a folder reached through a symlink
another user planted.

The server is a real SDK server process (``tests/programs/sdk_server.py --hang``: a hung
forward, so a session it accepted stays pending and writes nothing) running as root, as servers
in containers do: the case where ``/etc`` (root's, 0755) passed the old "a folder of the
server's user nobody else can write to" rule. The planted symlink is made by a real other uid
(``nobody``, through ``setpriv``) in the sticky ``/tmp``. The client is root, like the agent.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.host.fsutil import SessionFolder
from tests.conftest import PROGRAMS_DIR
from tests.security._attack import AS_NOBODY, NOBODY, REPO, needs_root, snapshot

pytestmark = needs_root


def _ask(path: Path, request: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(json.dumps(request).encode() + b"\n")
        return json.loads(s.makefile("rb").readline())


@pytest.fixture
def hung_root_server(spawn: Callable, python: str) -> Iterator[Path]:
    """A real SDK server (root), hung with work pending; its control socket's path. Any session
    still pending at the end is cancelled."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = spawn([python, str(PROGRAMS_DIR / "sdk_server.py"), "--hang"], env=env, stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().startswith(b"pid ")
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    started = json.loads(proc.stdout.readline())
    assert started["control_running"], started
    from agent.sdk.control import control_path

    path = control_path(proc.pid)
    try:
        yield path
    finally:
        _ask(path, {"cmd": "profile.stop"})


@pytest.fixture
def root_etc() -> Iterator[Path]:
    """Root's own 0755 folder, like ``/etc``, in /tmp; asserted unchanged afterwards."""
    root = Path(tempfile.mkdtemp(prefix="sw-rootetc-", dir="/tmp"))
    (root / "config").write_text("keep\n")
    root.chmod(0o755)
    (root / "config").chmod(0o644)
    before = snapshot(root)
    try:
        yield root
        assert snapshot(root) == before
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def planted_link(root_etc: Path) -> Iterator[Path]:
    """A symlink nobody planted in the sticky /tmp, pointing at ``root_etc``."""
    link = Path(f"/tmp/sw-planted-{secrets.token_hex(6)}")
    subprocess.run([*AS_NOBODY, "ln", "-s", str(root_etc), str(link)], check=True, timeout=30)
    assert link.lstat().st_uid == NOBODY
    try:
        yield link
    finally:
        link.unlink(missing_ok=True)


def test_profile_start_into_etc_is_refused_with_the_reason(hung_root_server: Path) -> None:
    reply = _ask(hung_root_server, {"cmd": "profile.start", "num_steps": 1, "output_dir": "/etc"})
    assert reply["ok"] is False and reply["error"] == "invalid", reply
    assert reply["detail"] == (
        "output_dir '/etc' refused: not the session folder the agent created for this server:"
        f" '/etc' has mode {os.stat('/etc').st_mode & 0o7777:o}, a session folder is 0700;"
        " outside the allowed folders (set SERVEWATCH_PROFILE_ALLOWED_DIRS to allow one)"
    ), reply
    status = _ask(hung_root_server, {"cmd": "status"})
    assert status["profiler"]["session"] is None  # nothing pending that would write there


def test_profile_start_through_a_symlink_another_user_planted_is_refused(
    hung_root_server: Path, planted_link: Path, root_etc: Path
) -> None:
    reply = _ask(hung_root_server, {"cmd": "profile.start", "num_steps": 1, "output_dir": str(planted_link)})
    assert reply["ok"] is False and reply["error"] == "invalid", reply
    assert f"output_dir {str(planted_link)!r} refused: not the session folder the agent created" in reply["detail"]
    assert "cannot be opened as a folder without following a symlink" in reply["detail"], reply
    assert _ask(hung_root_server, {"cmd": "status"})["profiler"]["session"] is None


def test_profile_start_into_the_session_folder_the_agent_made_is_accepted(hung_root_server: Path, tmp_path: Path) -> None:
    base = tmp_path / "out"
    base.mkdir(mode=0o755)
    base.chmod(0o755)  # an operator's --out, not private: the agent makes a session folder inside
    folder = SessionFolder.create(base)
    assert folder.path.parent == base and folder.path.name.startswith("session-")
    reply = _ask(hung_root_server, {"cmd": "profile.start", "num_steps": 1, "output_dir": str(folder.path)})
    assert reply["ok"] is True, reply
    assert reply["session"]["state"] == "pending" and reply["session"]["output_dir"] == str(folder.path)
    refused = _ask(hung_root_server, {"cmd": "profile.start", "num_steps": 1, "output_dir": str(base)})
    assert refused["ok"] is False and "has mode 755, a session folder is 0700" in refused["detail"], refused
