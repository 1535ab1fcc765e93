"""Facts about a target process that /proc tells and psutil does not: how it died, who traces it,
which pid it has in its own namespace, and text from it made safe to write anywhere.

Owns: the exit registry (:func:`note_exit`, fed by the process watcher) and :func:`death_of`
(dead or zombie, with the exit status when known), :func:`tracer_of` (``TracerPid``),
:func:`dumpers_of` (other ``py-spy`` runs aimed at a pid, and which process started them),
:class:`ServerDumpLog` (the ``py-spy`` runs a watched server started itself, seen as new processes:
SGLang's soft watchdog), :func:`ns_pid` (``NSpid``), :func:`uts_hostname` (the host name inside
the target's uts namespace), :func:`deleted_mappings` (mapped files deleted or replaced since).
Imports the stdlib, anyio, psutil, :mod:`agent.model.safetext`, :mod:`agent.model.ticks`,
:mod:`agent.host.exits` and :mod:`agent.host.targets` only.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import anyio

from agent.host.exits import ExecEvents, zombie_exit_status, zombie_fact
from agent.host.targets import ProcessState, Target, process_state, runs_pyspy, target_of
from agent.model.events import ExitFact, ExitSource
from agent.model.safetext import safe_text
from agent.model.ticks import until_tick

__all__ = [
    "Death",
    "Dumper",
    "ServerDump",
    "ServerDumpLog",
    "Tracer",
    "death_of",
    "dumpers_of",
    "exit_fact_of",
    "exit_noted_at",
    "note_exit",
    "ns_pid",
    "parent_of",
    "pid_alive",
    "same_uts_namespace",
    "server_dump_lines",
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
        fact: the whole :class:`~agent.model.events.ExitFact` (OOM, when, how learnt), when known.
    """

    pid: int
    state: str
    exit_code: int | None = None
    signal: int | None = None
    fact: ExitFact | None = None

    def exit(self) -> ExitFact:
        """Its :class:`~agent.model.events.ExitFact` (derived from the status when none was noted)."""
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


@dataclass(frozen=True, slots=True)
class Dumper:
    """Another ``py-spy`` run aimed at a target (``py-spy dump --native --pid N``, or the shell
    that is about to start it: SGLang's watchdog runs ``sh -c 'py-spy dump --native --pid N'``).

    Attributes:
        pid: the py-spy (or shell) process.
        command: its command line (at most 160 chars).
        started_by: its nearest ancestor that is not a shell nor a py-spy: ``(pid, title)``
            (``(0, "")`` when unknown); SGLang's soft watchdog is the scheduler itself.
        chain: its ancestors' pids, nearest first (bounded).
    """

    pid: int
    command: str
    started_by: tuple[int, str] = (0, "")
    chain: tuple[int, ...] = ()

    def describe(self) -> str:
        by = f" started by pid {self.started_by[0]} {self.started_by[1]!r}" if self.started_by[0] else ""
        return f"py-spy pid {self.pid} {self.command!r}{by}"


_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "busybox"})


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read(64 * 1024)
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


#: ``/proc/PID/maps`` marks a mapped file removed (or replaced by a new inode) since it was mapped.
_DELETED = " (deleted)"


def deleted_mappings(pid: int, limit: int = 4) -> list[str]:
    """Files ``pid`` maps that were deleted or replaced since (``/proc/PID/maps`` says
    ``(deleted)``), executable images first — e.g. a libpython upgraded under a running server,
    which py-spy then cannot open ("No such file or directory (os error 2)", py-spy #109). At most
    ``limit`` distinct paths; empty when unreadable (blocking: reads the maps)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as fh:
            raw = fh.read(16 * 1024 * 1024)
    except OSError:
        return []
    found: dict[str, bool] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.endswith(_DELETED):
            continue
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/") or fields[5].startswith(("/dev/", "/memfd:", "/SYSV")):
            continue  # shared memory and memfd regions are "deleted" files by design
        path = safe_text(fields[5][: -len(_DELETED)])
        found[path] = found.get(path, False) or "x" in fields[1]
    ordered = sorted(found, key=lambda path: not found[path])
    return ordered[:limit]


def parent_of(pid: int) -> int | None:
    """``pid``'s parent pid (``PPid``), ``None`` when unreadable."""
    value = _status_field(pid, "PPid")
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _aims_at(argv: list[str], pid: int) -> bool:
    """``argv`` runs py-spy (itself, or a shell's ``-c`` string) on ``pid``."""
    words = [w for part in argv for w in part.split()]
    if not any(os.path.basename(w.strip("'\"")) == "py-spy" for w in words):
        return False
    want = str(pid)
    for i, word in enumerate(words):
        word = word.strip("'\"")
        if word in ("--pid", "-p") and i + 1 < len(words) and words[i + 1].strip("'\"") == want:
            return True
        if word == f"--pid={want}":
            return True
    return False


def ancestry(pid: int, limit: int = 32) -> list[int]:
    """``pid``'s ancestors, nearest first (``/proc/PID/status`` ``PPid``; bounded, pid 1 left out)."""
    chain: list[int] = []
    parent = parent_of(pid)
    while parent is not None and parent > 1 and parent not in chain and len(chain) < limit:
        chain.append(parent)
        parent = parent_of(parent)
    return chain


def _started_by(chain: list[int]) -> tuple[int, str]:
    """The nearest of ``chain`` that is not a shell nor a py-spy: ``(pid, command)``; ``(0, "")``."""
    for ancestor in chain:
        words = _cmdline(ancestor)
        base = os.path.basename(words[0]) if words else ""
        if base in _SHELLS or base == "py-spy":
            continue
        title = " ".join(words)
        return ancestor, safe_text(title if len(title) <= 160 else title[:159] + "…")
    return 0, ""


def dumpers_of(pid: int, *, exclude_parent: int | None = None) -> list[Dumper]:
    """Other ``py-spy`` runs aimed at ``pid`` now (a scan of ``/proc``: a few ms), with who started
    them; a shell whose own child is the py-spy counts once (the py-spy). ``exclude_parent``:
    runs whose parent is this pid are left out (this agent's own)."""
    found: list[Dumper] = []
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit() or int(name) in (me, pid):
            continue
        dumper = _dumper(int(name), pid, exclude_parent)
        if dumper is not None:
            found.append(dumper)
    return _one_per_run(found)


def _dumper(candidate: int, pid: int, exclude_parent: int | None) -> Dumper | None:
    """``candidate`` as a py-spy run aimed at ``pid`` (:func:`dumpers_of`); ``None``: it is not one."""
    argv = _cmdline(candidate)
    if not argv or not _aims_at(argv, pid):
        return None
    chain = ancestry(candidate)
    if exclude_parent is not None and chain[:1] == [exclude_parent]:
        return None
    started_by = _started_by(chain)
    command = " ".join(argv)
    return Dumper(candidate, safe_text(command if len(command) <= 160 else command[:159] + "…"), started_by, tuple(chain))


def _one_per_run(found: list[Dumper]) -> list[Dumper]:
    """A shell and the py-spy it started are one run: keep the py-spy."""
    pids = {d.pid for d in found}
    return [d for d in found if not any(other.chain[:1] == (d.pid,) for other in found if other.pid in pids and other is not d)]


def last_pid() -> int | None:
    """The last pid (or thread id) the kernel handed out in this agent's pid namespace: the 5th
    field of ``/proc/loadavg`` (proc(5)); ``None`` when unreadable. One ``os.read`` of ~40 bytes
    the kernel formats from two counters (allowed on the event loop, tests/blocking.py). It moves
    whenever any process or thread is created, so an unchanged value says no process is new."""
    try:
        fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 128)
        finally:
            os.close(fd)
        return int(data.split()[4])
    except (OSError, ValueError, IndexError):
        return None


class NewProcesses:
    """Whether a process (or thread) was created in this pid namespace since a look that
    succeeded (:meth:`looked`), from the kernel's last pid (:func:`last_pid`): what lets a
    periodic ``/proc`` scan be skipped while nothing new can be there. Unknown (never looked, or
    ``/proc/loadavg`` unreadable) reads as created."""

    __slots__ = ("_at",)

    def __init__(self) -> None:
        self._at: int | None = None

    @staticmethod
    def before_look() -> int | None:
        """The kernel's last pid, read before a look: a process created during the look then
        counts as created after it."""
        return last_pid()

    def looked(self, before: int | None) -> None:
        """A look that began at ``before`` (:meth:`before_look`) succeeded."""
        self._at = before

    def since(self) -> bool:
        """Whether a process may have been created since the last successful look."""
        return self._at is None or last_pid() != self._at


@dataclass(frozen=True, slots=True)
class ServerDump:
    """A ``py-spy`` run a watched server started itself (:class:`ServerDumpLog`).

    Attributes:
        dumper: the run (the shell, or the py-spy when it had no shell), with the server
            process that started it (``started_by``) and its ancestors.
        seen_unix_nano: when the scan first saw it running, ns since the epoch (it started at
            most one scan interval earlier).
    """

    dumper: Dumper
    seen_unix_nano: int


class ServerDumpLog:
    """The ``py-spy`` runs the watched servers started themselves: SGLang's soft watchdog
    (``--soft-watchdog-timeout``) runs ``sh -c 'py-spy dump --native --pid <itself>'`` from the
    stuck scheduler, its launcher ``py-spy dump`` of every scheduler before a crash.

    Each :meth:`scan` lists ``/proc`` and reads only the processes new since the previous scan
    (their command line; for a py-spy run, its ancestors): a run that lives longer than the scan
    interval (a ``py-spy dump`` of a live Python process takes ~0.1-3 s) is seen, whoever else
    attaches to the target. A run is the server's when one of its ancestors is one of the
    ``pids`` scanned for; runs started by this agent (its children) never are. Thread-safe;
    bounded to the last :data:`MAX_KEPT` runs.
    """

    #: runs remembered (the oldest forgotten first)
    MAX_KEPT = 256
    #: scans a forked process not yet exec'd is looked at again (0.25 s apart in the agent)
    UNSETTLED_SCANS = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: set[int] = set()
        self._unsettled: dict[int, int] = {}
        self._runs: OrderedDict[int, ServerDump] = OrderedDict()
        self._created = NewProcesses()
        self._execs: ExecEvents | None = None
        #: an exec came (or no scan ran) since the last scan's listing (with :meth:`follow_execs`)
        self._exec_seen = True

    def follow_execs(self) -> bool:
        """Trigger scans on the kernel's exec events (:class:`~agent.host.exits.ExecEvents`)
        instead of the kernel's last pid: a py-spy run is an exec, a new thread never is, so a
        host that creates threads all the time costs no scans. Whether that is so (``False``:
        refused, the reason in ``ExecEvents.unavailable``; the last pid stays the trigger).
        Undone by :meth:`close`."""
        if self._execs is None:
            self._execs = ExecEvents.open()
        return self._execs is not None

    def close(self) -> None:
        """Stop following exec events (safe twice; scans trigger on the last pid again)."""
        execs, self._execs = self._execs, None
        if execs is not None:
            execs.close()

    async def next_check(self, interval_s: float) -> None:
        """Wait for the next :meth:`needs_scan` worth asking: following execs, until one came
        (then to the next multiple of ``interval_s``, s, so a burst is one scan); else the next
        multiple of ``interval_s``."""
        execs = self._execs
        if execs is not None:
            await execs.wait()
        await anyio.sleep(until_tick(interval_s, anyio.current_time()))

    def needs_scan(self) -> bool:
        """Whether :meth:`scan` can find anything now. Following execs (:meth:`follow_execs`):
        a process exec'd since the last scan (reads the events waiting: call it whenever
        :meth:`next_check` returns). Else a process was created since the last scan
        (:class:`NewProcesses`) or a forked one is still to be looked at again (following
        execs its exec is the event). Cheap (a read of the events waiting, or of
        ``/proc/loadavg``), so an idle host costs no ``/proc`` listing and no worker-thread hop;
        a run that started since is never skipped."""
        execs = self._execs
        with self._lock:
            if execs is not None:
                if execs.drain():
                    self._exec_seen = True
                return self._exec_seen
            pending = any(n < self.UNSETTLED_SCANS for n in self._unsettled.values())
            return pending or self._created.since()

    def scan(self, pids: Iterable[int]) -> list[ServerDump]:
        """One scan (blocking: ``/proc``, ~0.05 ms plus the new processes); returns the runs first
        seen now. ``pids``: the servers' processes (targets and root pids).

        A new process whose command line is still its parent's (forked, not yet exec'd: the
        scheduler's shell a moment before it becomes ``sh -c 'py-spy ...'``) is looked at again
        at the next scans, up to :data:`UNSETTLED_SCANS` of them (a forked worker stays so)."""
        family = set(pids)
        before = self._created.before_look()
        with self._lock:
            exec_seen, self._exec_seen = self._exec_seen, False  # an exec from now on: scan again
        try:
            now = {int(name) for name in os.listdir("/proc") if name.isdigit()}
        except OSError:
            with self._lock:
                self._exec_seen = self._exec_seen or exec_seen  # not looked: the exec still counts
            return []
        with self._lock:
            new, self._known = sorted(now - self._known), now
            self._created.looked(before)
            self._unsettled = {pid: n for pid, n in self._unsettled.items() if pid in now}
        found = []
        for pid in new:
            argv = _cmdline(pid)
            parent = parent_of(pid)
            if argv and parent is not None and _cmdline(parent) == argv:
                with self._lock:
                    scans = self._unsettled[pid] = self._unsettled.get(pid, 0) + 1
                    if scans < self.UNSETTLED_SCANS:
                        self._known.discard(pid)
                continue
            run = self._run_of(pid, argv, family)
            if run is not None:
                found.append(run)
        return found

    def _run_of(self, pid: int, argv: list[str], family: set[int]) -> ServerDump | None:
        """``pid`` as a run of the servers' (remembered), or ``None``: not py-spy, ours, a
        stranger's, or the py-spy of a shell already seen."""
        if not argv or not runs_pyspy(argv):
            return None
        chain = ancestry(pid)
        if not chain or chain[0] == os.getpid() or not family.intersection(chain):  # ours: our children
            return None
        command = " ".join(argv)
        run = ServerDump(Dumper(pid, safe_text(command if len(command) <= 160 else command[:159] + "…"), _started_by(chain),
                                tuple(chain)), time.time_ns())
        with self._lock:
            if chain[0] in self._runs:  # the py-spy a seen shell started: the same run
                return None
            self._runs[pid] = run
            while len(self._runs) > self.MAX_KEPT:
                self._runs.popitem(last=False)
        return run

    def between(self, start_unix_nano: int, end_unix_nano: int, pids: Iterable[int]) -> list[ServerDump]:
        """The runs seen from ``start_unix_nano`` to ``end_unix_nano`` (ns since the epoch) that one
        of ``pids`` started (it, or an ancestor of it, is among them), oldest first."""
        family = set(pids)
        with self._lock:
            runs = list(self._runs.values())
        return [r for r in runs if start_unix_nano <= r.seen_unix_nano <= end_unix_nano
                and (r.dumper.started_by[0] in family or family.intersection(r.dumper.chain))]


def server_dump_lines(runs: Iterable[ServerDump], titles: Mapping[int, str] | None = None) -> list[str]:
    """One line per server process that ran py-spy itself (its watchdog fired): who, what, when.

    ``SGLang's own watchdog fired: pid 42 'sglang::scheduler' ran 'py-spy dump --native --pid 42'
    (pid 43), seen at 12:00:01.250 UTC`` (plus ``, 2 runs`` when it ran more than one); "the
    server's own watchdog" when neither the starter nor its command names SGLang. ``titles``:
    the starters' titles by pid where known (else their command lines).
    """
    by_starter: dict[int, list[ServerDump]] = {}
    for run in runs:
        by_starter.setdefault(run.dumper.started_by[0], []).append(run)
    lines = []
    for starter, starts in by_starter.items():
        first = starts[0]
        title = (titles or {}).get(starter) or first.dumper.started_by[1]
        who = "SGLang's own watchdog" if "sglang" in title.lower() else "the server's own watchdog"
        when = time.strftime("%H:%M:%S", time.gmtime(first.seen_unix_nano / 1e9)) + f".{first.seen_unix_nano // 1_000_000 % 1000:03d}"
        more = f", {len(starts)} runs" if len(starts) > 1 else ""
        lines.append(f"{who} fired: pid {starter} {title!r} ran {first.dumper.command!r} (pid {first.dumper.pid}), seen at {when} UTC{more}")
    return lines


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
