"""agent.sdk.control: the control socket of a real model process (tests/programs/profiled_model.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.sdk import control
from tests.sdk._helpers import ProgramLauncher, load_trace, profiler_steps

NOBODY = 65534


def _ask(path: Path, *requests: dict[str, Any], timeout_s: float = 10.0) -> list[dict[str, Any]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(path))
        f = s.makefile("rwb")
        out = []
        for req in requests:
            f.write(json.dumps(req).encode() + b"\n")
            f.flush()
            out.append(json.loads(f.readline()))
        return out


@pytest.fixture
def target(spawn, python: str, tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], int, Path]]]:
    """Start profiled_model.py (killed by ``spawn`` at teardown); returns (proc, pid, socket)."""
    launcher = ProgramLauncher(spawn, python, tmp_path / "shm")

    def start(*extra: str) -> tuple[subprocess.Popen[bytes], int, Path]:
        proc, line = launcher.start("profiled_model.py", *extra)
        _, pid, path = line.split()  # READY <pid> <path>
        return proc, int(pid), Path(path)

    yield start
    launcher.close()


def _wait_session(path: Path, sid: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        (reply,) = _ask(path, {"cmd": "status", "session_id": sid})
        if reply["session"]["finished"]:
            return reply["session"]
        time.sleep(0.05)
    raise AssertionError(f"session {sid} not finished after {timeout_s} s")


def test_socket_is_private_and_found_from_the_pid(target, tmp_path: Path) -> None:
    _, pid, path = target()
    assert path == control.control_path(pid, tmp_path / "shm")
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    (reply,) = _ask(path, {"cmd": "status", "id": 7})
    assert reply["ok"] and reply["pid"] == pid and reply["id"] == 7
    assert reply["profiler"]["state"] == "idle"


def test_all_four_commands_against_a_real_model(target, tmp_path: Path) -> None:
    _, _pid, path = target()
    deadline = time.monotonic() + 30.0  # until a few steps ran and a request is in flight
    while True:
        status, inflight, stop = _ask(path, {"cmd": "status"}, {"cmd": "inflight"}, {"cmd": "profile.stop"})
        if (status["forward_ct"] > 0 and inflight["requests"]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status["forward_ct"] > 0 and status["inflight"] >= 1
    reqs = inflight["requests"]
    assert reqs and all(r["request_id"].startswith("req-") and len(r["span_id"]) == 16 and len(r["trace_id"]) == 32 for r in reqs)
    assert reqs[0]["model"] == "tiny-mlp" and reqs[0]["input_tokens"] == 8
    assert stop == {"ok": True, "status": "already_stopped", "session": None}
    out = tmp_path / "traces"  # what the agent hands a server: an existing 0700 folder of its uid
    out.mkdir(mode=0o700)
    out.chmod(0o700)
    (start,) = _ask(path, {"cmd": "profile.start", "num_steps": 12, "activities": ["CPU"], "output_dir": str(out)})
    assert start["ok"], start
    (busy,) = _ask(path, {"cmd": "profile.start", "num_steps": 1})
    assert busy["ok"] is False and busy["error"] == "busy"
    info = _wait_session(path, start["session_id"])
    assert info["state"] == "completed" and info["steps_captured"] == 12
    (f,) = info["files"]
    assert Path(f).parent == out
    trace = load_trace(f)
    assert profiler_steps(trace) == [f"ProfilerStep#{i}" for i in range(12)]
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "forward" in names and any(str(n).startswith("request:req-") for n in names)
    (again,) = _ask(path, {"cmd": "profile.stop"})
    assert again["status"] == "already_stopped"


def test_bad_requests_get_clear_errors(target) -> None:
    _, _, path = target()
    replies = _ask(
        path,
        {"cmd": "profile.start"},
        {"cmd": "profile.start", "num_steps": 2, "activities": ["TPU"]},
        {"cmd": "reboot"},
        [1, 2],  # type: ignore[arg-type]
    )
    assert [r["error"] for r in replies] == ["invalid", "invalid", "unknown_command", "invalid"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(b"{not json\n")
        assert json.loads(s.makefile("rb").readline())["error"] == "invalid"


def test_idle_server_request_expires_with_zero_steps(target, tmp_path: Path) -> None:
    _, _, path = target("--idle")
    (start,) = _ask(path, {"cmd": "profile.start", "num_steps": 3, "max_duration_s": 0.3, "output_dir": str(tmp_path)})
    info = _wait_session(path, start["session_id"], timeout_s=20)
    assert info["state"] == "expired" and info["steps_captured"] == 0 and info["files"] == []


_CLIENT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit(0)
s.sendall(b'{"cmd": "status"}\\n')
print(s.makefile("rb").readline().decode().strip())
"""


#: an interpreter another uid can run (the venv's lives under /root, mode 0700)
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs /usr/bin/python3 for the other-uid client")
def test_other_uids_are_refused(target) -> None:
    python = SYSTEM_PYTHON
    # pytest's tmp dirs are 0700: use a folder another uid can traverse, so only the socket's
    # own mode and the peer check are tested
    folder = Path(tempfile.mkdtemp(prefix="sw-ctl-"))
    folder.chmod(0o755)
    try:
        _other_uid_checks(python, target("--socket", str(folder / "ctl.sock"))[2])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _other_uid_checks(python: str, path: Path) -> None:
    as_nobody = {"user": NOBODY, "group": NOBODY, "capture_output": True, "timeout": 60, "cwd": "/"}
    # the file mode alone keeps another uid out
    out = subprocess.run([python, "-c", _CLIENT, str(path)], **as_nobody, check=True)
    assert out.stdout.decode().strip() == "EACCES"
    # and with the mode opened up, the peer-uid check still refuses it
    path.chmod(0o666)
    out = subprocess.run([python, "-c", _CLIENT, str(path)], **as_nobody, check=True)
    reply = json.loads(out.stdout)
    assert reply == {"ok": False, "error": "permission_denied", "detail": "peer uid not allowed"}
