"""An agent says which servers it watches, so a server's first spans wait for it in the ring.

Owns the watch declaration, a file layout shared by the agent (writer) and the SDK (reader): for
each server it watches, the agent writes ``servewatch-watched.<server pid>`` into that server's
private folder (:mod:`agent.sdk.folders`: ``<shm dir>/servewatch-<uid>/``, 0700, owned by the
server's uid; or its ``mkdtemp`` fallback), holding one JSON object ``{"pid": <agent pid>,
"target": <server pid>}``, written atomically (temp file + rename), touched (mtime) at each of
the agent's heartbeats and removed when the agent stops watching it. When the server's canonical
folder does not exist yet (its first span is its first use of the SDK) an agent running as root
or as that uid creates it for the server's uid (0700, then ``fchown``): the canonical name, or,
when another user took that name, a ``mkdtemp`` fallback, which is the folder the server then
takes.

Why: a server creates its span ring at its first span; until the agent attaches (its next ring
poll) the ring has no heartbeat, and without this declaration the first request's spans would
take the server's own fallback path (a no-op unless it installed the OTel SDK: lost). A server
declared watched by a live agent instead holds those spans in the ring for a bounded time
(:data:`HOLD_S`, the ring's capacity) until the agent attaches and ships them
(:mod:`agent.sdk.channel`).

Cost, on the server: a look (:func:`look`) opens one file by name in the server's own private
folder: O(1) system calls whatever else lies in the shared shm folder (another user's 200,000
files there are never listed), and nobody but the server's user or root can create a name in
that folder, so no other user can slow the look or squat a declaration's name. (Before, every
agent's declaration was a flat ``<shm dir>/servewatch-agent.<pid>`` that the server listed on
its request path.) The request path (:func:`watched`, from the channel) looks once, at a new
ring's first span; after that a daemon thread looks every :data:`REFRESH_S` seconds while it
is asked and the request path reads its last answer.

Trust: a declaration counts only when it is a regular file (never through a symlink) owned by
root or by the server's own user, in the server's own private folder, fresh (touched within
:data:`STALE_S`), naming this server, and written by a live process.

The agent side (:class:`Declarations`) opens the server's folder with ``O_NOFOLLOW |
O_DIRECTORY``, checks it is a private folder of that uid (or root) on the open descriptor, and does
every create, rename, touch and unlink relative to it: a user swapping its folder for a symlink
cannot make a root agent write anywhere else.

Imports the standard library and the SDK's own folder and file helpers only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from agent.sdk._files import read_regular
from agent.sdk.folders import FOLDER_PREFIX, folder_problem, own_dir, shm_dir

__all__ = ["HOLD_S", "PREFIX", "REFRESH_S", "RETRY_S", "STALE_S", "Declarations", "declaration_path", "look", "watched"]

#: File name prefix of a declaration, in the watched server's private folder
#: (``servewatch-watched.<server pid>``).
PREFIX = "servewatch-watched."
#: A declaration not touched for this long belongs to an agent that is gone, seconds.
STALE_S = 10.0
#: How long a new ring holds its spans for a declared agent that has not attached yet, seconds
#: (the agent polls rings every 0.5 s by default; ``SERVEWATCH_SPAN_HOLD_S`` overrides it).
HOLD_S = 10.0
#: Seconds between two looks of a server's refresher thread at its declaration (:func:`watched`).
REFRESH_S = 0.5
#: The refresher thread ends once :func:`watched` was not asked for this long, seconds.
_IDLE_S = 2.0
#: Least time between two tries to declare a server that could not be declared (its folder is
#: not there yet, or squatted: finding a fallback folder lists the shared folder), seconds.
RETRY_S = 1.0
#: Largest declaration read, bytes (one JSON object of two pids).
_MAX_BYTES = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def declaration_path(pid: int, folder: Path) -> Path:
    """Path of the declaration that server ``pid`` is watched, in its private ``folder``."""
    return folder / f"{PREFIX}{pid}"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_declaration(path: Path, now_s: float) -> dict | None:
    """The JSON object of the declaration at ``path`` when it is a fresh regular file of root or
    this process's user (``None`` otherwise). Opens the one file: O(1)."""
    got = read_regular(path, _MAX_BYTES, (os.geteuid(),))
    if got is None or now_s - got[1].st_mtime > STALE_S:
        return None
    try:
        data = json.loads(got[0])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def look(pid: int, directory: Path | None = None, *, now_s: float | None = None) -> bool:
    """Whether a live agent declares it watches ``pid`` (this process), per the module docstring,
    looked at now: opens one file in this process's private folder
    (:func:`agent.sdk.folders.own_dir`, created when missing): O(1) system calls, never a listing
    of the shared folder. Never raises.

    Args:
        pid: this server's pid (the declaration's name and its ``target``).
        directory: the base folder of the SDK's files (default :func:`agent.sdk.folders.shm_dir`).
        now_s: the time to judge freshness by, Unix seconds (default now).
    """
    now = time.time() if now_s is None else now_s
    try:
        folder = own_dir(directory)
    except OSError:
        return False
    data = _read_declaration(declaration_path(pid, folder), now)
    if data is None or data.get("target") != pid:
        return False
    agent = data.get("pid")
    return isinstance(agent, int) and not isinstance(agent, bool) and _alive(agent)


class _Answers:
    """The answers of :func:`watched` (default folder), refreshed off the caller's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: pid -> the last answer
        self.known: dict[int, bool] = {}
        #: pid -> monotonic seconds it was last asked about
        self.asked: dict[int, float] = {}
        self.thread: threading.Thread | None = None
        #: the refresh thread parks on this between looks (never set): a parked helper to a stack
        #: reader (agent.model.stacks), not a thread "stuck" in ``time.sleep`` in the server's dump
        self.park = threading.Event()


_answers = _Answers()


def _refresh(answers: _Answers) -> None:
    """Look again every :data:`REFRESH_S` at the pids asked about within :data:`_IDLE_S`; end
    (forgetting every answer) once none was."""
    while True:
        answers.park.wait(REFRESH_S)
        with answers.lock:
            now = time.monotonic()
            pids = [pid for pid, at in answers.asked.items() if now - at < _IDLE_S]
            if not pids or answers is not _answers:  # nobody asks any more (or a fork replaced them)
                answers.known.clear()
                answers.asked.clear()
                answers.thread = None
                return
        fresh = {pid: look(pid) for pid in pids}
        with answers.lock:
            answers.known.update(fresh)


def watched(pid: int, directory: Path | None = None, *, now_s: float | None = None) -> bool:
    """Whether a live agent declares it watches ``pid`` (this process): :func:`look`, but for
    the default folder the answer of a daemon thread that looks again every :data:`REFRESH_S`
    seconds while it is asked (ending :data:`_IDLE_S` after the last question). Only the first
    question (a new ring's first span) looks on the caller's thread: one O(1) look; later ones
    read the last answer. Never raises.

    Args:
        pid: this server's pid.
        directory: a base folder other than the default: looked at now (:func:`look`).
        now_s: judge freshness at this time, Unix seconds: looked at now (:func:`look`).
    """
    if directory is not None or now_s is not None:
        return look(pid, directory, now_s=now_s)
    answers = _answers
    with answers.lock:
        answers.asked[pid] = time.monotonic()
        known = answers.known.get(pid)
        thread = None
        if answers.thread is None:
            thread = answers.thread = threading.Thread(target=_refresh, args=(answers,), name="servewatch-presence", daemon=True)
    if thread is not None:
        thread.start()
    if known is not None:
        return known
    answer = look(pid)
    with answers.lock:
        answers.known.setdefault(pid, answer)
    return answer


def _after_fork_in_child() -> None:
    global _answers
    _answers = _Answers()  # the parent's refresher is not in the child, and its answers are of another pid


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the agent side -------------------------------------------------------------------------


def _ids(pid: int) -> tuple[int, int] | None:
    """``(effective uid, effective gid)`` of ``pid`` from ``/proc``; ``None`` when it is gone."""
    uid = gid = -1
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    uid = int(line.split()[2])
                elif line.startswith("Gid:"):
                    gid = int(line.split()[2])
    except (OSError, ValueError, IndexError):
        return None
    return (uid, gid) if uid >= 0 else None


@contextlib.contextmanager
def _open_folder(folder: Path, uid: int) -> Iterator[int]:
    """A descriptor of ``folder`` when it is a private folder of ``uid`` or root (checked on the
    descriptor itself, never through a symlink).

    Raises:
        OSError: it cannot be opened, or it is not such a folder (``EPERM``, saying why).
    """
    fd = os.open(folder, _DIR_FLAGS)
    try:
        problem = folder_problem(os.fstat(fd), (uid,))
        if problem is not None:
            raise OSError(errno.EPERM, f"{folder} {problem}: no declaration written there")
        yield fd
    finally:
        os.close(fd)


def _make_folder(base: Path, uid: int, gid: int) -> Path:
    """Create a private folder (0700) for ``uid`` in ``base``, the one a server of that uid then
    takes (:func:`agent.sdk.folders.own_dir`): the canonical ``servewatch-<uid>`` when the name is
    free, else (another user took it) a ``servewatch-<uid>.<random>`` made with ``mkdtemp``.
    Created by this process and handed over with ``fchown`` on its own descriptor.

    Raises:
        OSError: it cannot be created or handed over.
    """
    folder = base / f"{FOLDER_PREFIX}{uid}"
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{uid}.", dir=base))
    fd = os.open(folder, _DIR_FLAGS)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):  # never another's (a sticky base)
            raise OSError(errno.EPERM, f"{folder} changed hands while it was made")
        os.fchmod(fd, 0o700)
        if uid != st.st_uid:
            os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
    return folder


def _private_folders(base: Path, uid: int) -> list[Path]:
    """The private folders of ``uid`` in ``base`` that a server of that uid may use: the canonical
    one and, only when that is not a private folder of ``uid``, its ``mkdtemp`` fallbacks (a glob
    of ``base``: the one case that lists the shared folder, on the agent's side)."""
    canonical = base / f"{FOLDER_PREFIX}{uid}"
    try:
        if folder_problem(os.lstat(canonical), (uid,)) is None:
            return [canonical]
    except OSError:
        return []
    try:
        fallbacks = sorted(base.glob(f"{FOLDER_PREFIX}{uid}.*"))
    except OSError:
        return []
    out = []
    for folder in fallbacks:
        try:
            if folder_problem(os.lstat(folder), (uid,)) is None:
                out.append(folder)
        except OSError:
            continue
    return out


def _write(fd: int, name: str, data: bytes) -> None:
    """Write ``name`` atomically in the folder open as ``fd`` (temp + rename, both relative to it).

    Raises:
        OSError: the write failed.
    """
    temp = f".{name}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        out = os.open(temp, flags, 0o644, dir_fd=fd)
    except FileExistsError:  # a killed agent's, or anything the folder's user put there: never followed
        os.unlink(temp, dir_fd=fd)
        out = os.open(temp, flags, 0o644, dir_fd=fd)
    try:
        os.write(out, data)
        os.fchmod(out, 0o644)
    finally:
        os.close(out)
    os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)


class Declarations:
    """This agent's declarations that it watches servers (the agent side of the module).

    Thread-safe. The agent's folder for a server of another uid is made only when it runs as
    root (never a name of another user squatted by an unprivileged agent).

    Args:
        base: the base folder of the SDK's files (default :func:`agent.sdk.folders.shm_dir`).
    """

    def __init__(self, base: Path | None = None) -> None:
        self.base = base
        self._lock = threading.Lock()
        #: server pid -> ``(uid, folders holding its declaration)``
        self._written: dict[int, tuple[int, tuple[Path, ...]]] = {}
        #: server pid -> monotonic seconds before which it is not tried again
        self._retry_at: dict[int, float] = {}

    @property
    def declared(self) -> frozenset[int]:
        """The server pids declared watched now."""
        return frozenset(self._written)

    def update(self, targets: Mapping[int, int | None]) -> list[str]:
        """Declare every server of ``targets`` (pid -> effective uid, ``None``: read from
        ``/proc``) not declared yet, and withdraw the declarations of servers no longer in it.
        A server with no private folder yet gets one made (see the module docstring); one that
        cannot be declared now is tried again at a call :data:`RETRY_S` later or more.

        Returns:
            One line per server that could not be declared now (empty when all were).
        """
        with self._lock:
            return self._update(targets)

    def _update(self, targets: Mapping[int, int | None]) -> list[str]:
        for pid in [p for p in self._written if p not in targets]:
            self._withdraw(pid)
        self._retry_at = {p: t for p, t in self._retry_at.items() if p in targets}
        problems = []
        now = time.monotonic()
        for pid, uid in targets.items():
            if pid in self._written or self._retry_at.get(pid, 0.0) > now:
                continue
            try:
                self._declare(pid, uid)
                self._retry_at.pop(pid, None)
            except OSError as exc:
                self._retry_at[pid] = now + RETRY_S
                if exc.errno != errno.ESRCH:  # a server that exited needs no declaration
                    problems.append(f"pid {pid}: {exc.strerror or exc}")
        return problems

    def _declare(self, pid: int, uid: int | None) -> None:
        base = self.base or shm_dir()
        ids = _ids(pid)
        if ids is None:
            raise OSError(errno.ESRCH, "no such process")
        owner = ids[0] if uid is None else uid
        folders = _private_folders(base, owner)
        if not folders and os.geteuid() in (0, owner):  # the server has none yet: made for it
            _make_folder(base, owner, ids[1])
            folders = _private_folders(base, owner)
        if not folders:
            raise OSError(errno.ENOENT, f"no private folder of uid {owner} in {base} yet")
        data = json.dumps({"pid": os.getpid(), "target": pid}, separators=(",", ":")).encode()
        written = []
        for folder in folders:
            with _open_folder(folder, owner) as fd:
                _write(fd, f"{PREFIX}{pid}", data)
            written.append(folder)
        self._written[pid] = (owner, tuple(written))

    def touch(self) -> None:
        """Keep every declaration fresh (its mtime); a declaration found gone is written again at
        the next :meth:`update`. Skipped while an update runs (it writes them fresh). Never raises."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._touch()
        finally:
            self._lock.release()

    def _touch(self) -> None:
        for pid, (uid, folders) in list(self._written.items()):
            for folder in folders:
                try:
                    with _open_folder(folder, uid) as fd:
                        os.utime(f"{PREFIX}{pid}", dir_fd=fd, follow_symlinks=False)
                except OSError:
                    self._written.pop(pid, None)

    def _withdraw(self, pid: int) -> None:
        uid, folders = self._written.pop(pid, (0, ()))
        name = f"{PREFIX}{pid}"
        for folder in folders:
            try:
                with _open_folder(folder, uid) as fd:
                    if _names_us(fd, name):  # another agent's declaration of the same server stays
                        os.unlink(name, dir_fd=fd)
            except OSError:
                continue

    def withdraw_all(self) -> None:
        """Remove every declaration of this agent (it stops); never raises."""
        with self._lock:
            for pid in list(self._written):
                self._withdraw(pid)


def _names_us(fd: int, name: str) -> bool:
    try:
        out = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return False
    try:
        data = json.loads(os.read(out, _MAX_BYTES))
    except (OSError, ValueError):
        return False
    finally:
        os.close(out)
    return isinstance(data, dict) and data.get("pid") == os.getpid()
