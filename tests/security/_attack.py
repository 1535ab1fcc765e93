"""Helpers of the attack tests: acting as another uid, a host that must not change.

Every unprivileged attacker runs as a real other uid (``nobody``, 65534) through ``setpriv``;
the agent runs as root, as in production. Programs the attacker runs are stdlib-only scripts
under ``tests/programs/`` (``attack_*.py``) run with the system interpreter, which nobody can
execute (the venv may sit behind a folder only root may enter).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import PROGRAMS_DIR

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
REPO = Path(__file__).resolve().parents[2]
#: An interpreter nobody can run (stdlib only).
NOBODY_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to act as another uid"
)


#: The skeleton of a hostile SDK control server (stdlib only, run as nobody): argv[1] is the socket
#: path template (``{pid}``), argv[2] (optional) a JSON document the attack reads as ``arg``. It
#: answers ``profile.start`` by running the attack's code with ``out`` = the folder it is handed
#: (the code sets ``files``, what it then reports), ``status`` with a finished session naming
#: ``files``, anything else with ``stopped``; it prints ``ready <pid>`` once it listens.
_HOSTILE_SDK = r"""
import json, os, socket, sys
path = sys.argv[1].replace("{pid}", str(os.getpid()))
arg = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)  # its user's private SDK folder
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(8)
print("ready", os.getpid(), flush=True)
srv.settimeout(120)
files = []
while True:
    try:
        conn, _ = srv.accept()
    except OSError:
        break
    with conn:
        req = json.loads(conn.makefile("rb").readline())
        if req.get("cmd") == "profile.start":
            out = req["output_dir"]
%s
            reply = {"ok": True, "session_id": "s1"}
        elif req.get("cmd") == "status":
            reply = {"ok": True, "pid": os.getpid(), "forward_ct": 1,
                     "session": {"session_id": "s1", "finished": True, "state": "completed",
                                 "steps_captured": 1, "files": files}}
        else:
            reply = {"ok": True, "status": "stopped"}
        conn.sendall(json.dumps(reply).encode() + b"\n")
"""


def hostile_sdk_source(on_profile_start: str) -> str:
    """A hostile SDK's source (:data:`_HOSTILE_SDK`) whose ``profile.start`` runs ``on_profile_start``."""
    return _HOSTILE_SDK % textwrap.indent(textwrap.dedent(on_profile_start).strip("\n"), " " * 12)


def run_as_nobody(spawn: Callable, argv: list[str], **kwargs) -> subprocess.Popen[bytes]:
    """Start ``argv`` as uid/gid 65534 with no supplementary groups (killed at teardown)."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    return spawn([*AS_NOBODY, *argv], **kwargs)


def ready_line(proc: subprocess.Popen[bytes], prefix: bytes = b"ready") -> bytes:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(prefix), line
    return line


@pytest.fixture(scope="session")
def attack_programs() -> Iterator[Path]:
    """A folder nobody can read holding a copy of every ``tests/programs/attack_*.py`` (the
    checkout itself may be closed to other users)."""
    folder = Path(tempfile.mkdtemp(prefix="sw-attack-", dir="/tmp"))
    folder.chmod(0o755)
    for src in PROGRAMS_DIR.glob("attack_*.py"):
        shutil.copyfile(src, folder / src.name)
        (folder / src.name).chmod(0o644)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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


@pytest.fixture
def shared_tmpfs() -> Iterator[Path]:
    """A real tmpfs mounted like /dev/shm (mode 1777: everyone creates names, only owners remove
    theirs); a 1777 folder under /tmp where mounting is not allowed."""
    path = Path(tempfile.mkdtemp(prefix="sw-shm-", dir="/tmp"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m,mode=1777", "tmpfs", str(path)],
                             capture_output=True, timeout=30, check=False).returncode == 0
    path.chmod(0o1777)
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)
        shutil.rmtree(path, ignore_errors=True)


def snapshot(root: Path) -> dict[str, tuple[int, int, int, int, bytes]]:
    """``{relative path: (mode, uid, gid, size, first bytes)}`` of everything under ``root``
    (symlinks not followed): what an attack must leave as it was."""
    out: dict[str, tuple[int, int, int, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            head = b""
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as fh:
                    head = fh.read(256)
            out[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, head)
    return out


@pytest.fixture
def host_files(tmp_path: Path) -> Iterator[Path]:
    """Root's files outside the agent's folders (a 0755 tree, a setuid file, a 0600 secret):
    asserted unchanged (modes, owners, sizes, contents) after the test."""
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "config").write_text("keep\n")
    tool = root / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_bytes(b"#!/bin/sh\n")
    tool.chmod(0o4755)
    secret = root / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    before = snapshot(root)
    yield root
    assert snapshot(root) == before, "the attack changed files outside the agent's folders"
