"""Facts about a target process that /proc tells and psutil does not: how it died, who traces it,
which pid it has in its own namespace, and text from it made safe to write anywhere.

Owns: the exit registry (:func:`note_exit`, fed by the process watcher) and :func:`death_of`
(dead or zombie, with the exit status when known), :func:`tracer_of` (``TracerPid``),
:func:`ns_pid` (``NSpid``), :func:`uts_hostname` (the host name inside the target's uts
namespace). Imports the stdlib, psutil, :mod:`agent.safetext` and :mod:`agent.targets` only.

Facts (Linux, measured here):

* ``/proc/PID/stat`` field 52 (``exit_code``) holds the wait status of a zombie (e.g. ``1280``
  for exit code 5), readable by whoever may ptrace it, until its parent reaps it.
* ``/proc/PID/status`` ``TracerPid:`` is non-zero while another process is ptrace-attached
  (gdb, strace, a profiler); py-spy then fails with EPERM even as root (it cannot attach twice).
* ``/proc/PID/status`` ``NSpid:`` lists the pid in each nested pid namespace, innermost last:
  the pid a containerised process sees as its own (what the CUDA driver puts for ``%p``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from agent.events import ExitFact, ExitSource
from agent.exits import zombie_exit_status, zombie_fact
from agent.safetext import safe_text
from agent.targets import ProcessState, Target, process_state, target_of

__all__ = [
    "Death",
    "Tracer",
    "death_of",
    "exit_fact_of",
    "exit_noted_at",
    "note_exit",
    "ns_pid",
    "pid_alive",
    "same_uts_namespace",
    "tracer_of",
    "uts_hostname",
    "zombie_exit_status",
]

_MAX_REMEMBERED_EXITS = 4096
#: How long a noted exit counts as "this target died" for an incident, in seconds.
DEAD_MEMORY_S = 3600.0

_exits: OrderedDict[int, tuple[float, ExitFact, float]] = OrderedDict()
_exits_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Death:
    """A target that is no longer running.

    Attributes:
        pid: the process.
        state: ``"zombie"`` (exited, not reaped by its parent) or ``"exited"`` (gone).
        exit_code: its exit code when known.
        signal: the signal that killed it, when known.
        fact: the whole :class:`~agent.events.ExitFact` (OOM, when, how learnt), when known.
    """

    pid: int
    state: str
    exit_code: int | None = None
    signal: int | None = None
    fact: ExitFact | None = None

    def exit(self) -> ExitFact:
        """Its :class:`~agent.events.ExitFact` (derived from the status when none was noted)."""
        if self.fact is not None:
            return self.fact
        known = self.exit_code is not None or self.signal is not None
        return ExitFact.of(self.pid, self.exit_code, self.signal, source=ExitSource.ZOMBIE if known else ExitSource.NONE)

    def status(self) -> str:
        """``exit code 7``, ``killed by SIGKILL``, ``killed by the OOM killer`` or ``exit status unknown``."""
        return self.exit().status()

    def describe(self, title: str = "") -> str:
        """One line: ``pid 42 'sglang::scheduler_TP1' is dead (exit code 7; zombie, not reaped)``."""
        who = f"pid {self.pid}" + (f" {safe_text(title)!r}" if title else "")
        how = self.status() + ("; zombie, not reaped by its parent" if self.state == "zombie" else "")
        return f"{who} is dead ({how})"

    def attributes(self) -> dict[str, str | int | bool]:
        """Span attributes: ``servewatch.target.state`` and the exit fact's (status, kind, source)."""
        attrs: dict[str, str | int | bool] = {"servewatch.target.state": self.state}
        attrs.update(self.exit().attributes())
        return attrs


def note_exit(pid: int, *, create_time_s: float = 0.0, exit_code: int | None = None, signal: int | None = None,
              fact: ExitFact | None = None) -> None:
    """Remember that ``pid`` exited (the process watcher calls this for every exit it reports).

    Args:
        pid: the process.
        create_time_s: its creation time, so a reused pid is not taken for it (0 = unknown).
        exit_code: exit code when known.
        signal: killing signal when known.
        fact: the whole exit fact (wins over ``exit_code``/``signal``).
    """
    if fact is None:
        known = exit_code is not None or signal is not None
        fact = ExitFact.of(pid, exit_code, signal, source=ExitSource.WAITID if known else ExitSource.NONE)
    with _exits_lock:
        _exits[pid] = (create_time_s, fact, time.monotonic())
        _exits.move_to_end(pid)
        while len(_exits) > _MAX_REMEMBERED_EXITS:
            _exits.popitem(last=False)


def _noted(pid: int, create_time_s: float) -> ExitFact | None:
    with _exits_lock:
        entry = _exits.get(pid)
    if entry is None:
        return None
    noted_ct, fact, when = entry
    if time.monotonic() - when > DEAD_MEMORY_S:
        return None
    if create_time_s and noted_ct and abs(noted_ct - create_time_s) > 1.0:
        return None
    return fact


def exit_fact_of(pid: int, create_time_s: float = 0.0) -> ExitFact | None:
    """The exit fact the process watcher noted for ``pid`` (``None``: none noted, too old, or of
    another process that had the pid)."""
    return _noted(pid, create_time_s)


def exit_noted_at(pid: int, create_time_s: float = 0.0) -> float | None:
    """When the process watcher noted ``pid``'s exit (:func:`time.monotonic` seconds), ``None``
    when it did not (or the note is older than :data:`DEAD_MEMORY_S`, or was of a reused pid)."""
    with _exits_lock:
        entry = _exits.get(pid)
    if entry is None:
        return None
    noted_ct, _, when = entry
    if time.monotonic() - when > DEAD_MEMORY_S or (create_time_s and noted_ct and abs(noted_ct - create_time_s) > 1.0):
        return None
    return when


def death_of(target: Target) -> Death | None:
    """Whether ``target`` died, and how.

    A zombie is dead (its status read from /proc, else from the exit registry). A process that is
    gone is dead when servewatch knew it alive (``create_time_s`` set, or an exit was noted);
    a pid that was never seen is not reported as dead (the caller says "no such process").

    Returns:
        The :class:`Death`, or ``None`` while it runs (or was never known).
    """
    state = process_state(target.pid, create_time_s=target.create_time_s)
    if state is ProcessState.ZOMBIE:
        noted = _noted(target.pid, target.create_time_s)
        if noted is None or noted.source is ExitSource.NONE:

            noted = zombie_fact(target.pid, target.create_time_s) or noted
        if noted is None:
            return Death(target.pid, "zombie")
        return Death(target.pid, "zombie", noted.exit_code, noted.signal, noted)
    if state is ProcessState.GONE:
        noted = _noted(target.pid, target.create_time_s)
        if noted is not None:
            return Death(target.pid, "exited", noted.exit_code, noted.signal, noted)
        if target.create_time_s:
            return Death(target.pid, "exited")
    return None


@dataclass(frozen=True, slots=True)
class Tracer:
    """The process ptrace-attached to a target: its pid and command line (at most 160 chars)."""

    pid: int
    title: str

    def describe(self) -> str:
        return f"pid {self.pid} {self.title!r}" if self.title else f"pid {self.pid}"


def _status_field(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key == name:
                    return value.strip()
    except OSError:
        return None
    return None


def tracer_of(pid: int) -> Tracer | None:
    """Who is ptrace-attached to ``pid`` (``TracerPid``), or ``None`` (not traced / unreadable)."""
    value = _status_field(pid, "TracerPid")
    try:
        tracer_pid = int(value) if value else 0
    except ValueError:
        return None
    if tracer_pid <= 0:
        return None
    found = target_of(tracer_pid)
    if found is None:
        return Tracer(tracer_pid, "")
    command = " ".join(found.cmdline) or found.title  # "gdb -p 42", "strace -p 42", "python holder.py 42"
    return Tracer(tracer_pid, safe_text(command if len(command) <= 160 else command[:159] + "…"))


def ns_pid(pid: int) -> int:
    """The pid ``pid`` has in its own (innermost) pid namespace (``NSpid``); ``pid`` if unknown."""
    value = _status_field(pid, "NSpid")
    if value:
        try:
            return int(value.split()[-1])
        except ValueError:
            pass
    return pid


def same_uts_namespace(pid: int) -> bool:
    """Whether ``pid`` shares servewatch's uts namespace (host name); True when unknowable."""
    try:
        return os.stat(f"/proc/{pid}/ns/uts").st_ino == os.stat("/proc/self/ns/uts").st_ino
    except OSError:
        return True


def uts_hostname(pid: int) -> str | None:
    """The host name inside ``pid``'s uts namespace, when it can be learnt without entering it.

    Read from ``/proc/PID/root/proc/sys/kernel/hostname`` (a procfs mounted in the target's
    mount namespace answers for the reader's namespaces, so this is only trusted when the uts
    namespace is ours) — in practice: our own host name when the namespace is shared, else
    ``None`` (the caller then matches ``%h`` as a wildcard).
    """
    if same_uts_namespace(pid):
        return os.uname().nodename
    return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts; ``kill(pid, 0)``, EPERM = alive).

    A pid may have been reused: callers that care compare the create time too.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
