"""Process discovery: which processes servewatch watches and acts on.

Owns :class:`Target`, discovery (descendants of a root pid, process-title globs, explicit pids)
and the one place where psutil's exceptions are sorted into servewatch's terms
(:func:`psutil_errors`, :func:`process_state`). Imports psutil and :mod:`agent.events` only.

Titles: inference servers name their workers with setproctitle (SGLang ``sglang::scheduler_TP0``,
vLLM ``VLLM::Worker_TP0``). setproctitle overwrites the argv area, so ``/proc/PID/cmdline`` reads
as the title followed by empty strings, while the kernel's ``comm`` (psutil's ``name()``) is cut at
15 characters (``sglang::schedul``). A glob therefore matches the first non-empty cmdline element
or the full process name.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

from agent.events import StrEnum

__all__ = [
    "Target",
    "ProcessState",
    "ScanErrors",
    "psutil_errors",
    "process_state",
    "target_of",
    "discover",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A process to watch and act on.

    Attributes:
        pid: process id.
        title: the process title as matched (first non-empty cmdline element, else the process
            name), e.g. ``"sglang::scheduler_TP0"``.
        create_time_s: psutil's creation time (seconds since the epoch); with ``pid`` it
            identifies the process across pid reuse.
        cmdline: the full argv as the kernel reports it (empty strings removed).
        uid: the process's real uid (``None`` when unknown); the agent trusts files and sockets
            of a target only when they belong to this uid or root.
    """

    pid: int
    title: str = ""
    create_time_s: float = 0.0
    cmdline: tuple[str, ...] = ()
    uid: int | None = None


class ProcessState(StrEnum):
    """What psutil says about a pid right now (see :func:`process_state`)."""

    RUNNING = "running"  # alive and schedulable (running, sleeping, disk-sleep, idle...)
    STOPPED = "stopped"  # job-control stop (SIGSTOP) or ptrace stop ('stopped' / 'tracing-stop')
    ZOMBIE = "zombie"  # exited, not yet reaped by its parent
    GONE = "gone"  # no such process, or the pid now belongs to a different process
    ACCESS_DENIED = "access_denied"  # exists but we may not inspect it


@dataclass(slots=True)
class ScanErrors:
    """Counts of processes skipped because of what psutil raised (one scan or one probe).

    Attributes:
        vanished: ``psutil.NoSuchProcess`` (exited between listing and reading).
        zombies: ``psutil.ZombieProcess``, or status ``zombie``.
        denied: ``psutil.AccessDenied``.
        last: the state the last caught exception maps to, ``None`` if none was caught.
    """

    vanished: int = 0
    zombies: int = 0
    denied: int = 0
    last: ProcessState | None = field(default=None)


@contextmanager
def psutil_errors(errors: ScanErrors | None = None) -> Iterator[ScanErrors]:
    """Suppress psutil's per-process exceptions, counting them by kind.

    The single mapping from psutil's exceptions to servewatch's terms: ``ZombieProcess`` ->
    :attr:`ProcessState.ZOMBIE`, ``NoSuchProcess`` -> :attr:`ProcessState.GONE`,
    ``AccessDenied`` -> :attr:`ProcessState.ACCESS_DENIED`. Code after the ``with`` block must
    check whether the block finished (e.g. assign a result inside it).

    Args:
        errors: counters to add to; a fresh :class:`ScanErrors` when ``None``.

    Yields:
        The counters (``errors.last`` tells what was caught).
    """
    counts = errors if errors is not None else ScanErrors()
    try:
        yield counts
    except psutil.ZombieProcess:  # subclass of NoSuchProcess: test it first
        counts.zombies += 1
        counts.last = ProcessState.ZOMBIE
    except psutil.NoSuchProcess:
        counts.vanished += 1
        counts.last = ProcessState.GONE
    except psutil.AccessDenied:
        counts.denied += 1
        counts.last = ProcessState.ACCESS_DENIED


#: How far two readings of one process's creation time may differ, in seconds. psutil derives it
#: from the boot time in /proc/stat, which the kernel recomputes from the wall clock and can move
#: by a fraction of a second; a reused pid within this window is not told apart.
_CREATE_TIME_TOLERANCE_S = 1.0

_STOPPED_STATUSES = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})


def process_state(pid: int, *, create_time_s: float = 0.0) -> ProcessState:
    """Probe one pid's state.

    Args:
        pid: process id.
        create_time_s: the creation time (seconds since the epoch) the caller knows the process
            by; when non-zero and different from the current one, the pid was reused and the
            process the caller meant is :attr:`ProcessState.GONE`.

    Returns:
        The process's state; never raises for a vanished or inaccessible process.
    """
    state: ProcessState | None = None
    with psutil_errors() as errors:
        proc = psutil.Process(pid)
        if create_time_s and abs(proc.create_time() - create_time_s) > _CREATE_TIME_TOLERANCE_S:
            return ProcessState.GONE
        status = proc.status()
        if status == psutil.STATUS_ZOMBIE:
            state = ProcessState.ZOMBIE
        elif status in _STOPPED_STATUSES:
            state = ProcessState.STOPPED
        else:
            state = ProcessState.RUNNING
    if state is None:
        return errors.last or ProcessState.GONE
    return state


def _title_of(cmdline: Iterable[str], name: str) -> str:
    """First non-empty cmdline element, else the process name (see the module docstring)."""
    for arg in cmdline:
        if arg:
            return arg
    return name


def _target_from(proc: psutil.Process) -> Target:
    """Read one process into a :class:`Target`.

    Raises:
        psutil.ZombieProcess: the process is a zombie (also raised for status ``zombie``).
        psutil.NoSuchProcess: it exited.
        psutil.AccessDenied: it may not be read.
    """
    with proc.oneshot():
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise psutil.ZombieProcess(proc.pid)
        name = proc.name()
        cmdline = tuple(arg for arg in proc.cmdline() if arg)
        create_time_s = proc.create_time()
        uid = proc.uids().real
    return Target(pid=proc.pid, title=_title_of(cmdline, name), create_time_s=create_time_s, cmdline=cmdline, uid=uid)


def target_of(pid: int, errors: ScanErrors | None = None) -> Target | None:
    """Describe one live process as a :class:`Target`.

    Args:
        pid: process id.
        errors: counters to add to when the process is skipped.

    Returns:
        The target, or ``None`` when the process is gone, a zombie, or not readable.
    """
    target: Target | None = None
    with psutil_errors(errors):
        target = _target_from(psutil.Process(pid))
    return target


def _matches(target: Target, name: str, globs: tuple[str, ...]) -> bool:
    """Whether any glob matches the title (first non-empty cmdline element) or the full name."""
    return any(fnmatch.fnmatchcase(target.title, g) or fnmatch.fnmatchcase(name, g) for g in globs)


def discover(
    *,
    root_pids: Iterable[int] = (),
    title_globs: Iterable[str] = (),
    pids: Iterable[int] = (),
    include_roots: bool = True,
    errors: ScanErrors | None = None,
    uids: Iterable[int] = (),
) -> list[Target]:
    """Find the processes to act on (synchronous; a full scan takes milliseconds).

    The result is the union of: every descendant (recursive) of each root pid, plus the root
    itself when ``include_roots``; every process whose title matches any glob (``fnmatch``,
    case-sensitive, e.g. ``"sglang::scheduler*"``) against its first non-empty cmdline element
    or its full process name; and each explicit pid. Processes that vanish, turn zombie or deny
    access during the scan are skipped and counted in ``errors``. servewatch's own pid is never
    returned.

    Args:
        root_pids: pids whose process trees to include (e.g. the SGLang main process, whose
            schedulers are its children or grandchildren via the data-parallel controller).
        title_globs: shell-style patterns matched against process titles.
        pids: explicit pids.
        include_roots: include each root pid itself, not only its descendants.
        errors: counters of skipped processes, updated in place.
        uids: when given, keep only processes whose real uid is one of these (a process of
            another user that names itself like a scheduler is then never a target).

    Returns:
        Live targets, deduplicated by pid, sorted by pid.
    """
    own_pid = os.getpid()
    counts = errors if errors is not None else ScanErrors()
    found: dict[int, Target] = {}

    def add(proc: psutil.Process) -> None:
        if proc.pid == own_pid or proc.pid in found:
            return
        target: Target | None = None
        with psutil_errors(counts):
            target = _target_from(proc)
        if target is not None:
            found[target.pid] = target

    for root in root_pids:
        children: list[psutil.Process] = []
        with psutil_errors(counts):
            root_proc = psutil.Process(root)
            children = root_proc.children(recursive=True)
            if include_roots:
                add(root_proc)
        for child in children:
            add(child)

    globs = tuple(title_globs)
    if globs:
        for proc in psutil.process_iter():
            if proc.pid == own_pid or proc.pid in found:
                continue
            with psutil_errors(counts):
                target = _target_from(proc)
                if _matches(target, proc.name(), globs):
                    found[target.pid] = target

    for pid in pids:
        if pid == own_pid or pid in found:
            continue
        with psutil_errors(counts):
            add(psutil.Process(pid))

    allowed = frozenset(uids)
    return [found[pid] for pid in sorted(found) if not allowed or found[pid].uid in allowed]
