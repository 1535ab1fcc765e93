"""Process discovery: which processes servewatch watches and acts on.

Owns :class:`Target` (its settings, the ``[target]`` table, are
:class:`agent.host.config.TargetConfig`), discovery (descendants of a root pid, from :class:`ParentMap`,
each process's parent read once; process-title globs, explicit pids) and the one place where psutil's exceptions are
sorted into servewatch's terms (:func:`psutil_errors`, :func:`process_state`), and the rank a
target's own environment names (:func:`rank_environ`). Imports psutil,
:mod:`agent.model.kinds`, :mod:`agent.model.ranks` and :mod:`agent.model.safetext` only.

Titles: inference servers name their workers with setproctitle (SGLang ``sglang::scheduler_TP0``,
vLLM ``VLLM::Worker_TP0``). setproctitle overwrites the argv area, so ``/proc/PID/cmdline`` reads
as the title followed by empty strings, while the kernel's ``comm`` (psutil's ``name()``) is cut at
15 characters (``sglang::schedul``). A glob therefore matches the first non-empty cmdline element
or the full process name.
"""

from __future__ import annotations

import fnmatch
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

from agent.model.kinds import StrEnum
from agent.model.ranks import RankEnviron, parse_rank_environ
from agent.model.safetext import safe_text

__all__ = [
    "PARENTS",
    "ParentMap",
    "ProcessState",
    "ProcessTree",
    "ScanErrors",
    "Target",
    "UninterruptibleThread",
    "command_words",
    "descendants",
    "discover",
    "parent_pid",
    "process_state",
    "process_trees",
    "psutil_errors",
    "rank_environ",
    "runs_pyspy",
    "server_of",
    "server_uids",
    "spread_warning",
    "target_of",
    "uninterruptible_threads",
    "zombie_descendants",
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
        ppid: its parent pid when discovered (``None`` when unknown): which server a process
            belonged to is still known after it is gone and reaped.
        rank_env: the rank variables of its environment as read while it was alive
            (:func:`rank_environ`), kept for a process that died since (a zombie's or a gone
            process's environment reads empty); ``None`` when not read or none set.
    """

    pid: int
    title: str = ""
    create_time_s: float = 0.0
    cmdline: tuple[str, ...] = ()
    uid: int | None = None
    ppid: int | None = None
    rank_env: RankEnviron | None = None


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


@dataclass(frozen=True, slots=True)
class UninterruptibleThread:
    """One thread of a process in uninterruptible sleep (``/proc`` state ``D``).

    Attributes:
        tid: the thread's id (the process's pid for its main thread).
        wchan: the kernel function it waits in (``/proc/PID/task/TID/wchan``, e.g. ``kernel_clone``,
            ``rpc_wait_bit_killable`` for NFS, ``folio_wait_bit_common`` for a page read); ``""`` when
            the kernel hides it (``0``, or unreadable without privileges).
        main: it is the process's main thread.
    """

    tid: int
    wchan: str
    main: bool

    def where(self) -> str:
        """``kernel_clone`` / ``an unknown kernel function`` (the wchan in words)."""
        return self.wchan or "an unknown kernel function"


def _thread_state(path: str) -> str:
    """The state letter of one ``/proc/.../stat`` file (the field after the last ``)``: a name
    may hold spaces and parentheses, per proc(5)); ``""`` when unreadable."""
    try:
        with open(path, "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode("ascii", "replace")
    except (OSError, IndexError):
        return ""


def _wchan(path: str) -> str:
    """``/proc/.../wchan``: the kernel symbol a sleeping task waits in; ``""`` for ``0`` or unreadable."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            text = fh.read(256).strip()
    except OSError:
        return ""
    return "" if text in ("", "0") else safe_text(text)


def uninterruptible_threads(pid: int, *, max_threads: int = 4096) -> tuple[UninterruptibleThread, ...]:
    """The threads of ``pid`` in uninterruptible sleep (state ``D``) now, main thread first.

    Read per thread (``/proc/PID/task/TID/stat`` and ``.../wchan``, proc(5)): the process's own
    ``/proc/PID/stat`` tells only its main thread's state, and a rank may block on a worker
    thread. A thread in ``D`` (a read from a hung NFS mount, a device, a ``vfork`` whose child
    never returns) takes no signal before its wait ends, not even ptrace's stop: a blocking
    ``py-spy dump``, which stops every thread and waits for each, hangs on it (py-spy 0.4.x).

    Args:
        pid: process id.
        max_threads: most threads read (a bound on the work; the first ones in ``/proc`` order).

    Returns:
        The threads in ``D`` (``()`` when none, or the process is gone or unreadable); never raises.
    """
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit())[:max_threads]
    except OSError:
        return ()
    found = []
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        if _thread_state(f"{base}/stat") == "D":
            found.append(UninterruptibleThread(tid=tid, wchan=_wchan(f"{base}/wchan"), main=tid == pid))
    return tuple(sorted(found, key=lambda t: (not t.main, t.tid)))


#: Most bytes of ``/proc/PID/environ`` read (the kernel's limit on argv plus environ is far larger;
#: a rank's variables sit among the first kilobytes of any real environment).
_ENVIRON_BYTES = 1 << 20


def rank_environ(pid: int) -> RankEnviron | None:
    """The rank variables in ``pid``'s environment as it was started (``/proc/PID/environ``:
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, :func:`agent.model.ranks.parse_rank_environ`);
    no other variable is decoded or kept. ``None`` when none is set, or unreadable (another
    user's process without root, a zombie, gone, or blanked by setproctitle without ``SPT_NOENV``)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return parse_rank_environ(fh.read(_ENVIRON_BYTES))
    except OSError:
        return None


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
        name = safe_text(proc.name())  # undecodable bytes as \xNN: titles go to files and spans
        cmdline = tuple(safe_text(arg) for arg in proc.cmdline() if arg)
        create_time_s = proc.create_time()
        uid = proc.uids().real
        ppid = proc.ppid()
    return Target(pid=proc.pid, title=_title_of(cmdline, name), create_time_s=create_time_s, cmdline=cmdline, uid=uid,
                  ppid=ppid)


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


def _uid_of(pid: int) -> int | None:
    uid: int | None = None
    with psutil_errors():
        uid = psutil.Process(pid).uids().real
    return uid


def server_uids(*, uids: Iterable[int] = (), root_pids: Iterable[int] = (), pids: Iterable[int] = ()) -> frozenset[int]:
    """The uids a server's processes may run as: ``uids`` (``--uid``), the uids of the trees'
    roots (``--root-pid``, a launched server) and of explicit pids (``--pid``); when none of
    these is given, the agent's own effective uid. Root (0) is always one of them: only root
    can make a process of root's, and root could do anything anyway."""
    found = {*uids}
    for pid in (*root_pids, *pids):
        uid = _uid_of(pid)
        if uid is not None:
            found.add(uid)
    if not found:
        found.add(os.geteuid())
    return frozenset({0, *found})


def _stat_parent(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of ``pid`` from ``/proc/PID/stat`` (fields 4
    and 22, after the comm, which may hold spaces and parentheses); ``None`` when gone or unreadable."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        fields = raw.rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


class ParentMap:
    """Every process's parent on the host, each read once and kept, keyed by pid and start time
    (what ``psutil``'s ``children(recursive=True)`` reads afresh from every ``/proc/PID/stat`` on
    each call: milliseconds on a host of a few hundred processes).

    :meth:`refresh` takes the pids now in ``/proc`` and reads only the processes that are new,
    the children of processes gone (reparented), the processes of the trees last answered (one
    whose parent ended is reparented while the parent, a zombie, is still listed) and, when a
    pid turned out reused (another start time), its children. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: dict[int, tuple[int, int]] = {}
        #: ``/proc/PID/stat`` reads done (all refreshes)
        self.reads = 0

    def refresh(self, listed: Iterable[str], members: Iterable[int] = ()) -> None:
        """Bring the map up to the pids ``listed`` (``/proc``'s names; others ignored), reading
        ``members`` (the trees' processes last answered) again too. Blocking: one small read
        per process read."""
        pids = {int(name) for name in listed if name.isdigit()}
        with self._lock:
            reused = self._read(self._stale(pids, members))
            if reused:  # its children were the earlier process's: reparented since
                self._read({pid for pid, (ppid, _) in self._of.items() if ppid in reused})

    def _stale(self, pids: set[int], members: Iterable[int]) -> set[int]:
        """Forget the processes gone; the pids to read (lock held): new, orphaned, ``members``."""
        of = self._of
        for pid in [pid for pid in of if pid not in pids]:
            del of[pid]
        todo = {pid for pid in pids if pid not in of}
        todo.update(pid for pid, (ppid, _) in of.items() if ppid and ppid not in pids)
        todo.update(pid for pid in members if pid in of)
        return todo

    def _read(self, pids: Iterable[int]) -> set[int]:
        """Read ``pids`` into the map (lock held); the pids whose start time changed (reused)."""
        of = self._of
        reused: set[int] = set()
        for pid in pids:
            self.reads += 1
            fact = _stat_parent(pid)
            if fact is None:
                of.pop(pid, None)
                continue
            old = of.get(pid)
            if old is not None and old[1] != fact[1]:
                reused.add(pid)
            of[pid] = fact
        return reused

    def descendants(self, root: int) -> list[int]:
        """The pids below ``root`` (recursive, depth first as ``psutil``), none started before it
        (a reused pid's); empty when ``root`` is not in the map."""
        with self._lock:
            entry = self._of.get(root)
            if entry is None:
                return []
            born = entry[1]
            children: dict[int, list[int]] = {}
            for pid, (ppid, started) in self._of.items():
                if started >= born:
                    children.setdefault(ppid, []).append(pid)
        found: list[int] = []
        seen: set[int] = set()
        stack = [root]
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            for child in children.get(pid, ()):
                found.append(child)
                stack.append(child)
        return found


#: The host's parents (:func:`descendants`).
PARENTS = ParentMap()

#: Descendants found per root pid, with the pids in ``/proc`` then (:func:`descendants`).
_DESCENDANTS: dict[int, tuple[frozenset[str], float, list[psutil.Process]]] = {}
_DESCENDANTS_MAX = 64


def descendants(root: psutil.Process) -> list[psutil.Process]:
    """``root.children(recursive=True)``: its processes, found from :data:`PARENTS` (each
    process's parent read once, the map brought up to date only when the pids in ``/proc``
    changed since the last answer for this root: a new process, an exit and so any
    reparenting change them; a listing of ``/proc`` costs tens of microseconds). Blocking."""
    try:
        pids = frozenset(os.listdir("/proc"))
        born = root.create_time()
    except (OSError, psutil.Error):
        return root.children(recursive=True)
    known = _DESCENDANTS.get(root.pid)
    if known is not None and known[0] == pids and known[1] == born:
        return list(known[2])
    PARENTS.refresh(pids, [root.pid, *(p.pid for p in known[2])] if known is not None else [root.pid])
    members: list[psutil.Process] = []
    for pid in PARENTS.descendants(root.pid):
        try:
            members.append(psutil.Process(pid))
        except psutil.Error:  # gone since (psutil's children() skips those too)
            continue
    if len(_DESCENDANTS) >= _DESCENDANTS_MAX:
        _DESCENDANTS.clear()
    _DESCENDANTS[root.pid] = (pids, born, members)
    return list(members)


def discover(
    *,
    root_pids: Iterable[int] = (),
    title_globs: Iterable[str] = (),
    pids: Iterable[int] = (),
    include_roots: bool = True,
    errors: ScanErrors | None = None,
    uids: Iterable[int] = (),
    any_uid: bool = False,
    refused: dict[int, str] | None = None,
) -> list[Target]:
    """Find the processes to act on (synchronous; a full scan takes milliseconds).

    Processes of the trees of ``root_pids`` (every descendant, recursive, plus each root itself
    when ``include_roots``) and processes whose title matches any glob (``fnmatch``,
    case-sensitive, e.g. ``"sglang::scheduler*"``, against the first non-empty cmdline element
    or the full process name): with both given, the INTERSECTION (the processes of those trees
    whose title matches: "the schedulers of this server", never another server's); with one
    given, that one (globs alone scan the whole host). Each explicit pid is added to that. Processes that vanish, turn zombie or deny
    access during the scan are skipped and counted in ``errors``. servewatch's own pid is never
    returned, nor a py-spy run found by tree or title (:func:`runs_pyspy`: the server's own
    watchdog dumping it, e.g. SGLang's ``--soft-watchdog-timeout``; its exit is no incident).

    Args:
        root_pids: pids whose process trees to include (e.g. the SGLang main process, whose
            schedulers are its children or grandchildren via the data-parallel controller).
        title_globs: shell-style patterns matched against process titles.
        pids: explicit pids.
        include_roots: include each root pid itself, not only its descendants.
        errors: counters of skipped processes, updated in place.
        uids: the server's uids (``--uid``); with the uids of ``root_pids`` and ``pids`` they
            make :func:`server_uids`. A process found by its tree or its title whose real uid
            is not one of those is not a target (a title alone never lets another user's
            process steer root); explicit ``pids`` always are.
        any_uid: keep processes of any uid (``--any-uid``: the operator's explicit choice).
        refused: filled with ``{pid: why}`` for each process left out for its uid.

    Returns:
        Live targets, deduplicated by pid, sorted by pid.
    """
    scan = _Scan(errors if errors is not None else ScanErrors(), tuple(title_globs))
    roots = tuple(root_pids)
    for root in roots:
        scan.tree(root, include_root=include_roots)
    if scan.globs and not roots:
        for proc in psutil.process_iter():
            scan.add(proc)
    for pid in pids:
        scan.add_pid(pid)
    explicit = frozenset(pids)
    return _of_server(scan.found, server_uids(uids=uids, root_pids=roots, pids=explicit), explicit=explicit,
                      any_uid=any_uid, refused=refused)


_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "busybox"})


def runs_pyspy(cmdline: Sequence[str]) -> bool:
    """``cmdline`` is a py-spy run: py-spy itself, a script named ``py-spy`` run by its
    interpreter, or a shell running ``-c 'py-spy ...'`` (SGLang's soft watchdog dumps its
    scheduler that way, from the scheduler: the run is in the server's tree for a second)."""
    def base(word: str) -> str:
        return os.path.basename(word.strip("'\""))

    if not cmdline:
        return False
    if base(cmdline[0]) == "py-spy" or (len(cmdline) > 1 and base(cmdline[1]) == "py-spy"):
        return True
    if base(cmdline[0]) in _SHELLS and "-c" in cmdline[1:3]:
        i = cmdline.index("-c")
        words = cmdline[i + 1].split() if i + 1 < len(cmdline) else []
        return bool(words) and base(words[0]) == "py-spy"
    return False


class _Scan:
    """The targets one discovery scan found, by pid (servewatch's own pid never among them);
    a process that vanishes, turns zombie or denies access is skipped and counted."""

    def __init__(self, counts: ScanErrors, globs: tuple[str, ...]) -> None:
        self.counts = counts
        self.globs = globs
        self.own_pid = os.getpid()
        self.found: dict[int, Target] = {}

    def add(self, proc: psutil.Process, *, match: bool = True) -> None:
        """``proc`` when its title matches the globs (any title without globs, or unless ``match`` is off)."""
        if proc.pid == self.own_pid or proc.pid in self.found:
            return
        with psutil_errors(self.counts):
            target = _target_from(proc)
            if match and runs_pyspy(target.cmdline):  # a server's own watchdog dumping itself: a tool, not the server
                return
            if not (match and self.globs) or _matches(target, proc.name(), self.globs):
                self.found[target.pid] = target

    def tree(self, root: int, *, include_root: bool) -> None:
        """The processes of ``root``'s tree (every descendant; the root itself too when asked)."""
        members: list[psutil.Process] = []
        with psutil_errors(self.counts):
            root_proc = psutil.Process(root)
            members = descendants(root_proc)
            if include_root:
                members.insert(0, root_proc)
        for member in members:
            self.add(member)

    def add_pid(self, pid: int) -> None:
        """An explicit pid, whatever its title."""
        if pid == self.own_pid or pid in self.found:
            return
        with psutil_errors(self.counts):
            self.add(psutil.Process(pid), match=False)


def _of_server(
    found: dict[int, Target], allowed: frozenset[int], *, explicit: frozenset[int], any_uid: bool,
    refused: dict[int, str] | None,
) -> list[Target]:
    """The targets found that the server may own (``allowed`` uids; explicit pids and
    ``any_uid`` always), by pid; each one left out said in ``refused``."""
    kept: list[Target] = []
    for pid in sorted(found):
        target = found[pid]
        if any_uid or pid in explicit or target.uid in allowed:
            kept.append(target)
        elif refused is not None:
            refused[pid] = (
                f"pid {pid} {target.title!r} runs as uid {target.uid}, not the server's"
                f" (uid {', '.join(map(str, sorted(allowed)))}): add --uid {target.uid} or --any-uid to act on it"
            )
    return kept


#: Logged once at start when only a health/metrics URL is watched: an incident has nothing to dump.
NO_TARGET_WARNING = "no processes to dump: add --match/--pid/--root-pid"


@dataclass(frozen=True, slots=True)
class ProcessTree:
    """Targets that belong to one process tree, told apart by process group.

    A server's workers share its process group (multiprocessing children do not call
    ``setsid``), while two servers started by a shell with job control, a supervisor, a
    container runtime or ``servewatch launch`` each lead their own group.

    Attributes:
        pgid: the process group id.
        leader_title: the group leader's title (``""`` when it is gone or unreadable).
        pids: the targets in that group, sorted.
        member_title: the title of the group's first target (what is known of a group whose
            leader is gone or unreadable); ``""`` when unknown.
    """

    pgid: int
    leader_title: str
    pids: tuple[int, ...]
    member_title: str = ""

    def describe(self) -> str:
        """``group 1234 'python -m sglang.launch_server' (pids 1240, 1241)``; without a leader:
        ``group 1234 (leader gone or unreadable; pid 1240 'sglang::scheduler_TP0') (pids 1240, 1241)``."""
        pids = f"(pids {', '.join(map(str, self.pids))})"
        if self.leader_title:
            return f"group {self.pgid} {self.leader_title!r} {pids}"
        member = f"; pid {self.pids[0]} {self.member_title!r}" if self.pids and self.member_title else ""
        return f"group {self.pgid} (leader gone or unreadable{member}) {pids}"


def process_trees(targets: Iterable[Target]) -> list[ProcessTree]:
    """Group targets by process group (see :class:`ProcessTree`); vanished targets are left out.

    Returns:
        One tree per process group, sorted by pgid.
    """
    groups: dict[int, list[int]] = {}
    titles: dict[int, str] = {}
    for target in targets:
        try:
            pgid = os.getpgid(target.pid)
        except (ProcessLookupError, PermissionError):
            continue
        groups.setdefault(pgid, []).append(target.pid)
        titles[target.pid] = target.title
    trees = []
    for pgid, pids in sorted(groups.items()):
        leader = target_of(pgid)
        first = min(pids)
        trees.append(ProcessTree(
            pgid=pgid, leader_title=leader.title if leader else "", pids=tuple(sorted(pids)), member_title=titles.get(first, ""),
        ))
    return trees


def spread_warning(targets: Iterable[Target], *, title_globs: Iterable[str], root_pids: Iterable[int]) -> str | None:
    """The warning for a host-wide ``--match`` whose matches span several process trees.

    A glob without ``--root-pid`` scans the whole host: on a node running two servers it picks
    the other server's schedulers too (dumping them, coredumping them, and opening incidents
    when they exit). Restricting to one tree is the user's call, so this only warns.

    Args:
        targets: what discovery found.
        title_globs: the ``--match`` globs.
        root_pids: the ``--root-pid`` roots (when any, matching is already one tree's).

    Returns:
        One line naming every tree, or ``None`` when there is nothing to warn about.
    """
    globs = tuple(title_globs)
    if not globs or tuple(root_pids):
        return None
    trees = process_trees(targets)
    if len(trees) < 2:
        return None
    return (
        f"--match {' '.join(globs)} matches processes of {len(trees)} process trees: "
        + "; ".join(tree.describe() for tree in trees)
        + ". Add --root-pid PID to act on one server only"
    )


#: The kernel cuts a process name (``comm``) at this many characters.
_COMM_LEN = 15


def parent_pid(pid: int) -> int | None:
    """The parent pid of ``pid`` (from ``/proc/PID/stat``), or ``None`` when it is gone or unreadable."""
    fact = _stat_parent(pid)
    return None if fact is None else fact[0]


def server_of(pid: int, targets: Iterable[int]) -> int | None:
    """The process a rank's job hangs off: its nearest ancestor that is not itself one of
    ``targets`` (a server's main process, torchrun's agent, the launcher); ``None`` when
    ``pid`` or an ancestor is unreadable. Two ranks with the same server are one job."""
    among = set(targets)
    seen: set[int] = set()
    parent = parent_pid(pid)
    while parent is not None and parent in among and parent not in seen:
        seen.add(parent)
        parent = parent_pid(parent)
    return parent


def zombie_descendants(root_pids: Iterable[int], title_globs: Iterable[str] = ()) -> list[Target]:
    """Zombies in the trees of ``root_pids`` (ranks that exited and their parent has not reaped).

    :func:`discover` skips zombies (nothing can be read from them); an incident still reports
    them, as dead. A zombie's cmdline is gone, so with globs its kernel name (``comm``, cut at 15
    characters: ``sglang::schedul``) is matched against each glob cut to the same length.

    Returns:
        One :class:`Target` per zombie (title: its ``comm``), sorted by pid.
    """
    globs = tuple(title_globs)
    found: dict[int, Target] = {}
    for root in root_pids:
        members: list[psutil.Process] = []
        with psutil_errors():
            members = psutil.Process(root).children(recursive=True)
        for proc in members:
            with psutil_errors():
                if proc.status() != psutil.STATUS_ZOMBIE:
                    continue
                name = safe_text(proc.name())
                if globs and not any(
                    fnmatch.fnmatchcase(name, g) or (len(name) >= _COMM_LEN and fnmatch.fnmatchcase(name, g[:_COMM_LEN] + "*"))
                    for g in globs
                ):
                    continue
                found[proc.pid] = Target(pid=proc.pid, title=name, create_time_s=proc.create_time(), uid=proc.uids().real,
                                         ppid=proc.ppid())
    return [found[pid] for pid in sorted(found)]


def command_words(cmdline: Sequence[str]) -> str:
    """An untitled process's command in a few words, none of its arguments (they may hold secrets):
    ``python -m vllm.entrypoints.openai.api_server``, ``vllm serve``, ``python vllm serve``,
    ``python server.py``; ``""`` for an empty command line."""
    if not cmdline:
        return ""
    words = [os.path.basename(cmdline[0])]
    rest = list(cmdline[1:4])
    if "-m" in rest and rest.index("-m") + 1 < len(cmdline) - 1:
        return " ".join([*words, "-m", cmdline[rest.index("-m") + 2]])
    if rest and not rest[0].startswith("-") and rest[0] not in _SUBCOMMANDS:  # a script: python /venv/bin/vllm
        words.append(os.path.basename(rest.pop(0)))
    if rest and rest[0] in _SUBCOMMANDS:
        words.append(rest[0])
    return " ".join(words)


#: The subcommands of a serving framework's command named by :func:`command_words` (``vllm serve``).
_SUBCOMMANDS = frozenset({"serve", "run"})
