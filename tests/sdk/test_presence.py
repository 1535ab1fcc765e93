"""agent.sdk.presence: an agent declares the servers it watches in each server's private folder;
a server trusts a declaration only when the file is root's or its own, fresh, names it, and its
agent is alive. The agent never writes through a folder another user swapped for a symlink."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.sdk import presence
from agent.sdk.folders import own_dir

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to act as another uid")


def test_a_fresh_declaration_of_a_live_agent_names_its_server(tmp_path: Path) -> None:
    me = os.getpid()
    declarations = presence.Declarations(tmp_path)
    assert declarations.update({me: os.geteuid()}) == [] and declarations.declared == {me}
    path = own_dir(tmp_path) / f"servewatch-watched.{me}"
    assert path.parent.name == f"servewatch-{os.geteuid()}" and oct(path.stat().st_mode & 0o777) == "0o644"
    assert json.loads(path.read_text()) == {"pid": me, "target": me}
    assert presence.watched(me, tmp_path)
    assert not presence.watched(4242, tmp_path)  # no declaration of that server
    # stale: its agent stopped touching it; a touch makes it fresh again
    assert not presence.watched(me, tmp_path, now_s=time.time() + presence.STALE_S + 1)
    os.utime(path, (time.time() - presence.STALE_S - 5,) * 2)
    assert not presence.watched(me, tmp_path)
    declarations.touch()
    assert presence.watched(me, tmp_path)
    declarations.withdraw_all()
    assert not path.exists() and not presence.watched(me, tmp_path) and declarations.declared == frozenset()


def test_a_server_no_longer_watched_is_withdrawn_and_a_vanished_declaration_is_written_again(tmp_path: Path) -> None:
    me = os.getpid()
    declarations = presence.Declarations(tmp_path)
    declarations.update({me: None})  # uid read from /proc
    path = own_dir(tmp_path) / f"servewatch-watched.{me}"
    path.unlink()  # the server's user may remove what is in its folder
    declarations.touch()
    assert declarations.declared == frozenset()
    declarations.update({me: None})
    assert path.exists() and presence.watched(me, tmp_path)
    declarations.update({})
    assert not path.exists()


def test_the_declaration_of_a_dead_agent_or_of_another_server_does_not_count(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True, timeout=30)
    me = os.getpid()
    path = own_dir(tmp_path) / f"servewatch-watched.{me}"
    path.write_text(json.dumps({"pid": int(dead.stdout), "target": me}))
    assert not presence.watched(me, tmp_path)
    path.write_text(json.dumps({"pid": me, "target": me + 1}))
    assert not presence.watched(me, tmp_path)
    path.write_text(json.dumps({"pid": me, "target": me}))
    assert presence.watched(me, tmp_path)


def test_a_server_gone_is_not_declared_and_not_reported(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True, timeout=30)
    declarations = presence.Declarations(tmp_path)
    assert declarations.update({int(dead.stdout): None}) == [] and declarations.declared == frozenset()


@pytest.fixture
def nobody_server(spawn: Callable) -> subprocess.Popen[bytes]:
    """A process of uid 65534 standing for a server of another user."""
    return spawn([*AS_NOBODY, "sleep", "60"])


def _wait_uid(pid: int, uid: int) -> None:
    deadline = time.monotonic() + 30
    while os.stat(f"/proc/{pid}").st_uid != uid:  # setpriv execs sleep once it switched
        assert time.monotonic() < deadline
        time.sleep(0.02)


@needs_root
def test_a_root_agent_makes_the_folder_of_a_server_that_has_none_yet_for_its_uid(
    tmp_path: Path, nobody_server: subprocess.Popen[bytes]
) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    base.chmod(0o1777)
    _wait_uid(nobody_server.pid, NOBODY)
    declarations = presence.Declarations(base)
    assert declarations.update({nobody_server.pid: NOBODY}) == []
    folder = base / f"servewatch-{NOBODY}"
    st = folder.stat()
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o777)) == (NOBODY, NOBODY, "0o700")
    declaration = folder / f"servewatch-watched.{nobody_server.pid}"
    assert declaration.stat().st_uid == 0
    assert json.loads(declaration.read_text()) == {"pid": os.getpid(), "target": nobody_server.pid}


@needs_root
def test_a_root_agent_never_writes_through_a_symlink_at_the_servers_folder_name(
    tmp_path: Path, nobody_server: subprocess.Popen[bytes]
) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    base.chmod(0o1777)
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir(mode=0o700)
    (base / f"servewatch-{NOBODY}").symlink_to(elsewhere)
    os.lchown(base / f"servewatch-{NOBODY}", NOBODY, NOBODY)
    _wait_uid(nobody_server.pid, NOBODY)
    declarations = presence.Declarations(base)
    assert declarations.update({nobody_server.pid: NOBODY}) == []
    assert list(elsewhere.iterdir()) == []  # nothing written through the symlink
    # the server of that uid takes a mkdtemp folder of its own (agent.sdk.folders): made for it, declared there
    (folder,) = base.glob(f"servewatch-{NOBODY}.*")
    st = folder.stat()
    assert (st.st_uid, oct(st.st_mode & 0o777)) == (NOBODY, "0o700")
    assert json.loads((folder / f"servewatch-watched.{nobody_server.pid}").read_text())["target"] == nobody_server.pid


@needs_root
def test_a_declaration_planted_by_another_user_is_ignored() -> None:
    shared = Path(tempfile.mkdtemp(prefix="sw-shm-", dir="/tmp"))
    shared.chmod(0o1777)  # like /dev/shm: everyone may create files
    try:
        _planted(shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _planted(shared: Path) -> None:
    me = os.getpid()
    body = json.dumps({"pid": me, "target": me, "targets": [me]})  # names a live process (this one) as its agent
    names = [f"servewatch-agent.{me}", f"servewatch-watched.{me}"]  # the old flat layout's name, and the new name
    code = f"for n in {names!r}: open({str(shared)!r} + '/' + n, 'w').write({body!r})"
    subprocess.run([*AS_NOBODY, sys.executable, "-c", code], check=True, timeout=30)
    assert all((shared / n).stat().st_uid == NOBODY for n in names)
    assert not presence.watched(me, shared)
    # nor in the server's own folder, should one be found there (only root could have put it)
    planted = own_dir(shared) / f"servewatch-watched.{me}"
    planted.write_text(body)
    os.chown(planted, NOBODY, NOBODY)
    assert not presence.watched(me, shared)


def test_only_the_first_question_looks_on_the_callers_thread_a_daemon_thread_refreshes_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The channel asks (default folder) at each span of a new ring's first seconds: one look on
    the request path, then the refresher's answers."""
    import threading

    me = os.getpid()
    looks: list[str] = []
    real_look = presence.look

    def counting(pid: int, directory: Path | None = None, *, now_s: float | None = None) -> bool:
        looks.append(threading.current_thread().name)
        return real_look(pid, directory, now_s=now_s)

    monkeypatch.setattr(presence, "look", counting)
    monkeypatch.setattr(presence, "_answers", presence._Answers())
    declarations = presence.Declarations()  # the default folder ($SERVEWATCH_SHM_DIR of the test run)
    try:
        assert not presence.watched(me)  # not declared yet: looked at once, here
        declarations.update({me: os.geteuid()})
        deadline = time.monotonic() + 30
        while not presence.watched(me):  # the refresher sees the declaration
            assert time.monotonic() < deadline, looks
            time.sleep(0.05)
        assert looks.count(threading.current_thread().name) == 1, looks
        assert looks.count("servewatch-presence") >= 1
    finally:
        declarations.withdraw_all()
    deadline = time.monotonic() + 30
    while presence.watched(me):  # and the withdrawal
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert looks.count(threading.current_thread().name) == 1, looks


def test_the_refresh_thread_reads_as_an_idle_helper_in_a_real_dump(spawn, python) -> None:
    """py-spy's dump of a server whose presence thread runs: the thread is idle (parked between
    looks), never one of the server's "stuck threads" in an incident summary."""
    from agent.model.stacks import idle_and_stuck, parse_dump

    code = ("import sys, time, os; from agent.sdk import presence; presence.watched(os.getpid()); "
            "print('ready', flush=True); time.sleep(60)")
    proc = spawn([python, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    assert pyspy is not None
    done = subprocess.run([pyspy, "dump", "--json", "--pid", str(proc.pid)], capture_output=True, timeout=60, check=True)
    threads = parse_dump(done.stdout)
    assert "servewatch-presence" in {t.thread_name for t in threads}
    idle, stuck = idle_and_stuck(threads)
    assert "servewatch-presence" in idle and "servewatch-presence" not in stuck
