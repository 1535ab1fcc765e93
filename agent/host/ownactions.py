"""What servewatch itself does to a server, recorded so that the rules never read it as a fault.

Owns :class:`OwnAction` (one action: a profile window, a blocking py-spy stop, a hard-mode signal,
a coredump pause) and :class:`OwnActionLog`, the record of the actions running now on one data
dir: one small JSON file per action under ``<data_dir>/<host>/own-actions/`` (0600 in a 0700
folder), so the agent (``servewatch run``) also sees what the separate ``servewatch profile`` and
``servewatch dump`` processes on the same host do. Each file carries its own end
(``until_unix_s``: the action's bound plus a margin): a file a killed writer left is ignored once
that passed, and removed by the next writer. Besides the files, every action of this process is
kept in memory (:func:`local_actions`), so a reader in the same process needs no file.

Trust: a file is read only when it and its folder belong to root or to this process's effective
uid, are not writable by anyone else, are regular (never through a symlink: ``O_NOFOLLOW``) and
small (:data:`MAX_FILE_BYTES`); at most :data:`MAX_FILES` are read. A file a watched process
could write (another uid) is skipped, never believed. Nothing here raises for a bad file.

:func:`stopped_by_us` answers "is this stop (``/proc`` state T/t) ours?": the tracer
(``TracerPid``) is a py-spy this host's servewatch runs (recorded as a ``pyspy_stop``, or an
early run of this process), or a ``pyspy_stop`` of that pid runs now.

Imports the standard library, :mod:`agent.model.datadir` and :mod:`agent.host.fsutil` only (the
profiler actor, py-spy actor, incidents, watchdog and judge all use it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from agent.model.datadir import OWN_ACTIONS_DIR, DataDir

__all__ = [
    "KINDS",
    "MAX_ACTION_S",
    "MAX_FILES",
    "MAX_FILE_BYTES",
    "OWN_ACTIONS_DIR",
    "PROFILE_MARGIN_S",
    "OwnAction",
    "OwnActionLog",
    "local_actions",
    "process_group",
    "stopped_by_us",
]

log = logging.getLogger("servewatch.ownactions")

# OWN_ACTIONS_DIR: the folder of action files, under ``<data_dir>/<host>/`` (agent.model.datadir's)
#: Most action files read at once (more are skipped: a flood never stalls a reader).
MAX_FILES = 256
#: Largest action file read, bytes.
MAX_FILE_BYTES = 4096
#: Seconds a profile window lasts beyond the session's own bound (stop, trace writing).
PROFILE_MARGIN_S = 30.0
#: Longest an action may last, seconds: a record claiming more (or one starting in the future) is
#: not believed, so no file can pause a rule for good.
MAX_ACTION_S = 4 * 3600.0

Kind = Literal["profile", "pyspy_stop", "hard_signal", "coredump_pause"]
#: What an action can be, and how it reads in a line.
KINDS: dict[str, str] = {
    "profile": "servewatch profile running",
    "pyspy_stop": "servewatch's py-spy holds it stopped (ptrace) while it dumps",
    "hard_signal": "killed by servewatch --hard",
    "coredump_pause": "servewatch's CUDA coredump pauses it",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnAction:
    """One thing servewatch does to a server now.

    Attributes:
        kind: one of :data:`KINDS`.
        pid: the process acted on (``None``: a server reached by URL only).
        pgid: its process group when recorded (a server's ranks share their launcher's group),
            ``None`` when unknown.
        port: the server's port when reached by URL (``profile --url``), else ``None``.
        by_pid: the servewatch process that acts.
        tracer_pid: the py-spy process holding ``pid`` stopped (``pyspy_stop``), else ``None``.
        incident_id: the incident it acts for (``hard_signal``), else ``""``.
        started_unix_s: when it began, seconds since the epoch.
        until_unix_s: when it ends at the latest (its bound plus a margin), seconds since the epoch.
        detail: one line (which signal, how many steps).
    """

    kind: str
    pid: int | None = None
    pgid: int | None = None
    port: int | None = None
    by_pid: int = 0
    tracer_pid: int | None = None
    incident_id: str = ""
    started_unix_s: float = 0.0
    until_unix_s: float = 0.0
    detail: str = ""

    def covers(self, pid: int | None = None, *, pgid: int | None = None, port: int | None = None) -> bool:
        """Whether this action is about that process (same pid or process group) or port."""
        if pid is not None and pid == self.pid:
            return True
        if pgid is not None and self.pgid is not None and pgid == self.pgid and pgid > 1:
            return True
        return port is not None and port == self.port

    def describe(self) -> str:
        """``servewatch profile running (since 17:02:03, until at most 17:03:33)`` (local time)."""
        since = time.strftime("%H:%M:%S", time.localtime(self.started_unix_s))
        until = time.strftime("%H:%M:%S", time.localtime(self.until_unix_s))
        what = KINDS.get(self.kind, self.kind)
        extra = f", incident {self.incident_id}" if self.incident_id else ""
        return f"{what} (pid {self.by_pid}{extra}; since {since}, until at most {until})"


_LOCAL: dict[str, OwnAction] = {}
_LOCK = threading.Lock()


def local_actions(now_s: float | None = None) -> list[OwnAction]:
    """The actions of this process not over (in memory; no file read)."""
    now = time.time() if now_s is None else now_s
    with _LOCK:
        return [a for a in _LOCAL.values() if a.until_unix_s > now]


def process_group(pid: int) -> int | None:
    """``pid``'s process group, ``None`` when gone or unreadable."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _trusted(st: os.stat_result, *, folder: bool) -> bool:
    owner_ok = st.st_uid in (0, os.geteuid())
    kind_ok = stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)
    return owner_ok and kind_ok and not stat.S_IMODE(st.st_mode) & 0o022


def _parse(raw: bytes) -> OwnAction | None:
    """One record, or ``None`` when malformed, or its times are not believable (not finite,
    starting more than a minute from now, lasting more than :data:`MAX_ACTION_S`)."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("kind") not in KINDS:
            return None
        ints = {k: (int(doc[k]) if doc.get(k) is not None else None) for k in ("pid", "pgid", "port", "tracer_pid")}
        started, until = float(doc["started_unix_s"]), float(doc["until_unix_s"])
        if not (math.isfinite(started) and math.isfinite(until)) or started > time.time() + 60 or until - started > MAX_ACTION_S:
            return None
        return OwnAction(kind=str(doc["kind"]), by_pid=int(doc.get("by_pid", 0)), incident_id=str(doc.get("incident_id", ""))[:64],
                         started_unix_s=started, until_unix_s=until, detail=str(doc.get("detail", ""))[:200], **ints)
    except (ValueError, TypeError, KeyError, OverflowError):
        return None


class OwnActionLog:
    """The own-action record of one data dir (see the module docstring).

    Args:
        data_dir: the data dir (``--data-dir``); ``None``: memory only (nothing written or read).
        host_name: the host's folder in it.
        create: create ``<data_dir>/<host>`` when missing; without it an action is written only
            when that folder exists already (an agent runs there): a command run alone leaves
            nothing behind.
        cache_s: reuse one reading of the files for this many seconds (many watchdogs share one
            log and read it every poll); 0: read every time.
    """

    def __init__(self, data_dir: str | os.PathLike[str] | None, host_name: str = "localhost", *, create: bool = False,
                 cache_s: float = 0.0) -> None:
        self.folder = None if data_dir is None else DataDir(Path(data_dir), host_name).own_actions
        self.create = create
        self.cache_s = cache_s
        self._cached: tuple[float, list[OwnAction]] = (-1e18, [])
        self._cache_lock = threading.Lock()

    # -- writing --------------------------------------------------------------------------------

    def begin(self, kind: Kind, *, pid: int | None = None, port: int | None = None, bound_s: float,
              tracer_pid: int | None = None, incident_id: str = "", detail: str = "") -> str:
        """Record an action that starts now and lasts at most ``bound_s`` seconds (blocking:
        writes a file). Never raises: a file that cannot be written is logged; the action is
        still kept in memory.

        Returns:
            Its token, for :meth:`end`.
        """
        now = time.time()
        action = OwnAction(kind=kind, pid=pid, pgid=process_group(pid) if pid is not None else None, port=port,
                           by_pid=os.getpid(), tracer_pid=tracer_pid, incident_id=incident_id,
                           started_unix_s=now, until_unix_s=now + min(max(0.0, bound_s), MAX_ACTION_S), detail=detail)
        token = f"{kind}-{pid if pid is not None else 'port' + str(port)}-{os.getpid()}-{secrets.token_hex(4)}"
        with _LOCK:
            _LOCAL[token] = action
        self._write(token, action)
        return token

    def extend(self, token: str, *, bound_s: float) -> None:
        """Push the end of action ``token`` to ``bound_s`` seconds from now (blocking: a file)."""
        with _LOCK:
            action = _LOCAL.get(token)
            if action is None:
                return
            until = min(time.time() + bound_s, action.started_unix_s + MAX_ACTION_S)
            action = _LOCAL[token] = replace(action, until_unix_s=until)
        self._write(token, action)

    def end(self, token: str) -> None:
        """The action is over: forget it and remove its file (gone already: fine). Never raises."""
        with _LOCK:
            _LOCAL.pop(token, None)
        if self.folder is not None:
            try:
                (self.folder / f"{token}.json").unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", self.folder / f"{token}.json", exc)

    @contextmanager
    def window(self, kind: Kind, *, pid: int | None = None, port: int | None = None, bound_s: float,
               tracer_pid: int | None = None, incident_id: str = "", detail: str = "") -> Iterator[str]:
        """:meth:`begin` on entry, :meth:`end` on exit (also on an exception)."""
        token = self.begin(kind, pid=pid, port=port, bound_s=bound_s, tracer_pid=tracer_pid,
                           incident_id=incident_id, detail=detail)
        try:
            yield token
        finally:
            self.end(token)

    def _write(self, token: str, action: OwnAction) -> None:
        if self.folder is None:
            return
        from agent.host.fsutil import atomic_write_text, ensure_private_dir

        try:
            if not self.create and not self.folder.parent.is_dir():
                return  # no agent runs on this data dir: nobody reads it
            ensure_private_dir(self.folder)
            atomic_write_text(self.folder / f"{token}.json", json.dumps(asdict(action)), durable=False)
            self._remove_expired()
        except OSError as exc:
            log.warning("cannot record %s in %s: %s", action.kind, self.folder, exc)

    def _remove_expired(self) -> None:
        assert self.folder is not None
        now = time.time()
        for action, path in self._read(include_expired=True):
            if action.until_unix_s <= now:
                with suppress(OSError):
                    path.unlink()

    # -- reading --------------------------------------------------------------------------------

    def active(self, now_s: float | None = None) -> list[OwnAction]:
        """The actions not over: this process's and those of the trusted files (blocking: reads
        the folder). Never raises."""
        now = time.time() if now_s is None else now_s
        found = {(a.by_pid, a.kind, a.pid, a.port, a.started_unix_s): a for a in local_actions(now)}
        with self._cache_lock:
            at, files = self._cached
            if time.monotonic() - at >= self.cache_s:
                files = [a for a, _ in self._read()]
                self._cached = (time.monotonic(), files)
        for action in files:
            if action.until_unix_s > now:
                found.setdefault((action.by_pid, action.kind, action.pid, action.port, action.started_unix_s), action)
        return list(found.values())

    def files(self) -> list[OwnAction]:
        """The actions recorded in the trusted files and not over, of every servewatch process
        on this data dir (this one's too; blocking: reads the folder). Never raises."""
        return [a for a, _ in self._read()]

    def _read(self, *, include_expired: bool = False) -> list[tuple[OwnAction, Path]]:
        if self.folder is None:
            return []
        try:
            dfd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return []
        out: list[tuple[OwnAction, Path]] = []
        try:
            if not _trusted(os.fstat(dfd), folder=True):
                return []
            names = sorted(n for n in os.listdir(dfd) if n.endswith(".json") and not n.startswith("."))[:MAX_FILES]
            for name in names:
                action = self._read_one(dfd, name)
                if action is not None and (include_expired or action.until_unix_s > time.time()):
                    out.append((action, self.folder / name))
        except OSError:
            pass
        finally:
            os.close(dfd)
        return out

    @staticmethod
    def _read_one(dfd: int, name: str) -> OwnAction | None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not _trusted(st, folder=False) or st.st_size > MAX_FILE_BYTES:
                return None
            return _parse(os.read(fd, MAX_FILE_BYTES + 1)[:MAX_FILE_BYTES])
        except OSError:
            return None
        finally:
            os.close(fd)


def _tracer_pid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("TracerPid:"):
                    return int(line.split(":", 1)[1].strip() or 0)
    except (OSError, ValueError):
        return 0
    return 0


def _thread_group(tid: int) -> int:
    """The process a task id belongs to (``Tgid``; a tracer is recorded per thread)."""
    try:
        with open(f"/proc/{tid}/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Tgid:"):
                    return int(line.split(":", 1)[1].strip() or 0)
    except (OSError, ValueError):
        return tid
    return tid


def _stop_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return ""
    return text[text.rfind(")") + 2 : text.rfind(")") + 3]


def _traced_by_our_dump(pid: int, dumps: list[OwnAction]) -> bool:
    """Whether ``pid``'s tracer is an early run of this process or a py-spy of ``dumps``."""
    from agent import early

    tracer = _tracer_pid(pid)
    if tracer > 0:
        group = _thread_group(tracer)
        if early.is_early_tracer(tracer) or any(a.tracer_pid in (tracer, group) for a in dumps):
            return True
    return False


def stopped_by_us(pid: int, actions: list[OwnAction] | None = None) -> bool:
    """Whether ``pid``'s stop (``/proc`` state ``T``/``t``) is servewatch's own py-spy (blocking:
    reads ``/proc``): its tracer is a py-spy recorded as a ``pyspy_stop`` (``actions``; default:
    this process's own) or an early run of this process, or it was stopped only while such a dump
    of it ran (state ``t`` and a ``pyspy_stop`` of ``pid`` running now: the tracer may have
    detached between two reads), or a ``coredump_pause`` of ``pid`` runs now. ``False`` for a
    process not stopped now."""
    from agent import early

    acts = local_actions() if actions is None else actions
    dumps = [a for a in acts if a.kind == "pyspy_stop"]
    pauses = [a for a in acts if a.kind == "coredump_pause" and a.pid == pid]
    if _traced_by_our_dump(pid, dumps):
        return True
    state = _stop_state(pid)
    if state not in ("T", "t"):
        return False
    if pauses:  # the CUDA driver writing its core file: the process waits for it
        return True
    return state == "t" and (any(a.pid == pid for a in dumps) or early.dumping(pid))
