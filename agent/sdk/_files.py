"""Files the SDK creates in the shared folder (counter, control socket, worker socket, ring,
death notice).

Owns creating them safely next to other users' files: exclusive creation, and removing only
what is our own. Private to :mod:`agent.sdk`; imports only the standard library.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import stat
import time
from pathlib import Path

__all__ = ["NOTICE_KEEP_S", "create_exclusive", "hold_lock", "read_regular", "remove_dead_files", "remove_if_ours"]

#: SDK files named by the pid of the process that made them (the span ring, drained and removed
#: by the agent, is not among them: its records may still be unshipped).
_PID_FILES = re.compile(r"servewatch-steps\.(\d+)|servewatch-(?:ctl|torch)\.(\d+)\.sock")
#: Death notices and their signal files (agent.sdk.exitnotice), named by their writer's pid.
_NOTICE_FILES = re.compile(r"servewatch-exit\.(\d+)(?:\.(?:fault|sig\d+|tmp))?")
#: How long a dead process's death notice is kept for the agent to read (it reads it the moment
#: the process ends), seconds since the notice was last written.
NOTICE_KEEP_S = 600.0


def create_exclusive(path: Path, mode: int) -> int:
    """Create ``path`` with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and return its fd.

    A file already there is replaced only when it is a regular file (or socket) of our own
    effective uid, i.e. a stale one of an earlier process of ours with the same pid; anything
    else (another user's file, a symlink) is left alone.

    Raises:
        FileExistsError: the path is taken by something we do not own (or a symlink).
        OSError: any other creation failure.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, mode)
    except FileExistsError:
        remove_if_ours(path)
        return os.open(path, flags, mode)


def read_regular(path: Path, max_bytes: int, owners: tuple[int, ...] | None) -> tuple[bytes, os.stat_result] | None:
    """At most ``max_bytes`` of ``path`` and its ``fstat``, when it is a regular file (never
    through a symlink: ``O_NOFOLLOW``; never a FIFO that would block: ``O_NONBLOCK``) owned by
    one of ``owners`` or root (any owner when ``None``); ``None`` otherwise or on any OS error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (owners is not None and st.st_uid not in owners and st.st_uid != 0):
            return None
        return os.read(fd, max_bytes), st
    except OSError:
        return None
    finally:
        os.close(fd)


def remove_if_ours(path: Path) -> None:
    """Unlink ``path`` when it is our own regular file or socket (never a symlink).

    Raises:
        FileExistsError: it is someone else's, or a symlink, or a folder.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid() or not (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
        raise FileExistsError(f"{path} already exists and is not ours (uid {st.st_uid}): not replaced")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def hold_lock(fd: int) -> None:
    """Take a shared ``flock`` on ``fd`` for as long as the file is open in this process: while
    it is held, :func:`remove_dead_files` of any process (in any pid namespace sharing the
    folder) leaves the file alone. Never raises (no lock is no worse than before)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _counter_unheld(path: Path) -> bool:
    """Nobody holds the counter's lock (its writer is gone): take it, exclusively, to be sure."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live writer holds it (perhaps in another pid namespace)
    finally:
        os.close(fd)
    return True


def _socket_unserved(path: Path) -> bool:
    """Nobody listens on the socket: connecting is refused at once (a live server accepts, even
    while its model thread hangs: the control server has its own thread)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(str(path))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def _dead_notice(directory: Path, pid: int, st: os.stat_result, now_ns: int) -> bool:
    """A death notice the agent has had its time to read: its process's counter is gone (the
    counter outlives a killed writer until a sweep) and it was last written over
    :data:`NOTICE_KEEP_S` ago."""
    if now_ns - st.st_mtime_ns < NOTICE_KEEP_S * 1e9:
        return False
    return not os.path.lexists(directory / f"servewatch-steps.{pid}")


def _stale(directory: Path, path: Path, pid: int, st: os.stat_result, now_ns: int, *, notice: bool) -> bool:
    """Whether the file of dead ``pid`` is left over: a death notice old enough, an unheld
    counter, an unserved socket (anything else: never)."""
    if notice:
        return stat.S_ISREG(st.st_mode) and _dead_notice(directory, pid, st, now_ns)
    if stat.S_ISREG(st.st_mode):
        return _counter_unheld(path)
    if stat.S_ISSOCK(st.st_mode):
        return _socket_unserved(path)
    return False


def remove_dead_files(directory: Path) -> list[Path]:
    """Remove the SDK files (step counters, control and torch worker sockets, death notices) in
    ``directory`` that processes of our own uid left when they died (a crash, SIGKILL; a notice
    is left by every death).

    A file is removed only when all hold: its name carries a pid that is not alive here; it is
    a regular file or socket (never a symlink) of our effective uid; nobody holds a counter's
    lock (:func:`hold_lock`, so a live writer in another pid namespace sharing the folder keeps
    its file) or listens on a socket; a death notice (and its signal files) only once its
    process's counter is gone, as of before this sweep, and it is :data:`NOTICE_KEEP_S` old (the
    agent reads it at the death). Bounded (one listing, a few syscalls per file); never raises.

    Returns:
        The files removed.
    """
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    me, euid, now_ns = os.getpid(), os.geteuid(), time.time_ns()
    # notices first: a counter removed below keeps its notice until a later sweep
    ordered = sorted(names, key=lambda n: _NOTICE_FILES.fullmatch(n) is None)
    for name in ordered:
        notice = _NOTICE_FILES.fullmatch(name)
        m = notice or _PID_FILES.fullmatch(name)
        if m is None:
            continue
        pid = int(m.group(1) or m.group(2))
        path = directory / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if pid == me or st.st_uid != euid or _pid_alive(pid):
            continue
        if _stale(directory, path, pid, st, now_ns, notice=notice is not None):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed
