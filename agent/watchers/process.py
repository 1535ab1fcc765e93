"""The process watcher: reports each watched process's exit once, with its status when known.

Owns: :class:`ProcessWatcher` and :func:`exit_status` (decoding a wait status). May import
:mod:`agent.model.events`, :mod:`agent.model.bus` (``Publisher``), :mod:`agent.host.targets`, :mod:`agent.host.procinfo`,
:mod:`agent.host.security` (a launched command's title, redacted), :mod:`agent.sdk.folders`
(a process's uids), anyio and psutil.

How an exit is noticed, per pid:

* Linux >= 5.3: a pidfd (``os.pidfd_open``) becomes readable when the process exits; the
  watcher waits on it with ``anyio.wait_readable`` (re-checked every :data:`PIDFD_RECHECK_S`
  at most, a safety net: no polling while the process lives).
* Elsewhere (or when ``pidfd_open`` is refused): polling every ``poll_interval_s``, with the
  process's creation time guarding against pid reuse. A zombie counts as exited.

How the exit status is learnt without stealing it from whoever owns the child (the result is
one :class:`~agent.model.events.ExitFact`: kind, status, OOM, when, and which source said so):

* a ``subprocess.Popen`` (or any ``returncode`` callable) registered for the pid: its owner's
  API reaps and reports it (launch mode);
* otherwise, for a child of this process (or an orphan adopted as child subreaper, as
  ``launch`` is), ``waitid(P_PIDFD, …, WEXITED | WNOWAIT)`` reads the status and leaves the
  zombie for its owner to reap;
* for a process that is not our child: the kernel's own exit event
  (:class:`agent.host.exits.KernelExits`, root in the host network namespace), which a server
  reaping its rank at once cannot hide; else, while it is a zombie, ``/proc/PID/stat``; else
  the process's own SDK death notice (:func:`agent.host.exits.sdk_notice_fact`: a server using
  ``agent.sdk`` says how it ended, in a pod too); else, for a container's init (pid 1 of its pid
  namespace when its watch began), its container runtime's exit record
  (:mod:`agent.host.containerexits`: conmon's exit file, Docker's ``config.v2.json`` state);
* a SIGKILL (or an unknown status) is checked against the OOM killer's record (the kernel log,
  else the cgroup's ``oom_kill`` counter read when the watch began): "killed by the OOM killer";
* an exit that may be part of its server's stop (unknown status, non-zero code, a SIGKILL not
  from the OOM killer; never a crash signal) is judged by the order of what happened, never by
  how fast the agent saw it (:meth:`ProcessWatcher._settle_tree`):

  - its server (the nearest ancestor that listened on a TCP port when the watch began, or, for
    a server found while it started, once it listens: :data:`SERVER_PORT_RECHECK_S`) still
    serves: a server that stops its engine before its HTTP port (vLLM 0.32: SIGKILL to the
    EngineCore's workers, then to the EngineCore, then the port, seconds later on a loaded
    machine) takes the whole branch below it down at once, while a crash leaves the rest of the
    branch running until the server reacts (vLLM closes its port first, then stops the engine).
    So: the rest of the branch (the ancestors below the server, their watched descendants and
    the processes below the dead one; for a child of the server itself, the server's other
    watched processes: SGLang's launcher drains, then SIGKILLs all its children at once while its
    port still listens) must be down — dead, a zombie, or with a SIGKILL pending —
    within :data:`SWEEP_WINDOW_S` while the port still listens, then the server must stop
    serving (:data:`SWEEP_STOP_S`) and end in order (:data:`SERVER_END_S`). A lone process (no
    branch around it), a branch member still running when the port closes or the window ends,
    one that ended on its own (an exit code, a crash signal, the OOM killer), or a server that
    keeps serving or crashes: a failure.
  - its server no longer serves, or it has none: its ancestors are followed up (up to
    :data:`SERVER_END_S` once a server closed its port, :data:`TREE_SETTLE_S` without one); one
    that stops in order makes the chain below it part of that stop; for an unknown status, the
    parent and the watched siblings all going down says the server stopped as a whole.

  ``tree_stopped`` and ``orderly_reason`` say so; the status itself stays what was read
  (``unknown`` included).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal as _signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import psutil
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskGroup, TaskStatus

from agent.host.containerexits import (
    DEFAULT_RECORDS,
    ContainerInit,
    RuntimeExit,
    container_init_of,
    records_visible,
    runtime_exit,
)
from agent.host.exits import KernelExits, OomCounter, OomWatch, oom_counter_of, sdk_notice_fact
from agent.host.procinfo import exit_fact_of, note_exit, zombie_exit_status
from agent.host.targets import ProcessState, Target, process_state
from agent.model.bus import Publisher
from agent.model.events import ExitFact, ExitKind, ExitSource, FrontendExited, TargetExited, now_ns
from agent.sdk.folders import process_uids

if TYPE_CHECKING:
    from agent.host.registry import BuildContext
    from agent.watchers.config import ProcessConfig


__all__ = [
    "PIDFD_RECHECK_S", "POLL_INTERVAL_S", "SERVER_PORT_LOOK_S", "SERVER_PORT_RECHECK_S", "TREE_SETTLE_S", "ProcessWatcher",
    "create", "exit_status", "launched_target", "signal_name",
]

log = logging.getLogger("servewatch.process")

#: Longest wait, after an exit whose status is unknown, for its parent and watched siblings to
#: go down too (the server stopping as a whole), seconds; also the bound on following up the
#: ancestors of a process that had no server port above it.
TREE_SETTLE_S = 5.0

#: After an exit while its server still served: how long the rest of its branch may take to go
#: down (dead, zombie, or a SIGKILL pending), seconds. A server's own kill sends every SIGKILL
#: within microseconds, and a SIGKILLed process shows it pending (``/proc/PID/status``) until it
#: runs again, so this only covers the killer being preempted between two kills; a crash leaves
#: the rest running until the server reacts (vLLM 0.32: 2-4 s, measured).
SWEEP_WINDOW_S = 1.0
#: Between two looks at the branch and the server's port during that window, seconds.
SWEEP_SAMPLE_S = 0.05
#: Deaths of one kill sweep lie this close together (the kernel's exit times), seconds: used
#: only when the port closed between two looks, to tell the sweep from a reaction.
SWEEP_SPREAD_S = 0.5
#: After its branch went down: how long the server may still serve before that counts as a
#: crash it survived, seconds.
SWEEP_STOP_S = 10.0
#: How long a server that stopped serving may take to end (a loaded machine's interpreter
#: teardown takes seconds), seconds.
SERVER_END_S = 60.0

#: ``/proc/PID/status`` pending-signal masks: bit 8 is SIGKILL (signal 9).
_SIGKILL_BIT = 1 << (int(_signal.SIGKILL) - 1)

#: After a followed parent (a frontend that is no target) ended: how long its watched processes
#: may take to go down with it (the demo's ranks see their parent gone within 0.5 s; a server
#: stopping in order takes its ranks down first) before those still running are its orphans, seconds.
ORPHAN_SETTLE_S = 5.0

#: Longest wait on a pidfd before its state is checked again, seconds (a safety net only: the
#: pidfd turns readable at the exit, so a live process costs no wakeups in between).
PIDFD_RECHECK_S = 10.0

#: While no ancestor of a watched process listens on a port (a server found while it starts:
#: vLLM forks its EngineCore before its API server binds the port), how often the ancestors'
#: ports are read again, seconds, and for how long after the watch began (a model's load).
SERVER_PORT_RECHECK_S = 2.0
SERVER_PORT_LOOK_S = 900.0

#: After a container's init died and nothing else told how: how long its runtime may take to
#: write its exit record (conmon: once it reaped the init and drained its logs; dockerd: after
#: containerd's exit event and up to 2 s of its streams' drain), seconds. Podman waits 5 s for
#: conmon's file too. Not waited for where no runtime folder is visible, nor for containerd.
RUNTIME_RECORD_WAIT_S = 5.0
#: Between two looks for that record, seconds.
RUNTIME_RECORD_POLL_S = 0.05

def exit_status(returncode: int | None) -> tuple[int | None, int | None]:
    """Split a ``Popen``-style return code into ``(exit_code, signal)``.

    A negative return code ``-N`` means "killed by signal N" (``subprocess`` convention).
    """
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, -returncode
    return returncode, None


def _waitid_nowait(pidfd: int | None, pid: int) -> tuple[int | None, int | None] | None:
    """Exit status of our own exited child, leaving it waitable; ``None`` if not our child."""
    waitid = getattr(os, "waitid", None)
    if waitid is None:
        return None
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    try:
        if pidfd is not None and hasattr(os, "P_PIDFD"):
            result = waitid(os.P_PIDFD, pidfd, flags)
        else:
            result = waitid(os.P_PID, pid, flags)
    except (ChildProcessError, OSError):
        return None
    if result is None:
        return None
    if result.si_code == os.CLD_EXITED:
        return result.si_status, None
    if result.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return None, result.si_status
    return None


#: How many ancestors of a target are followed up (the ranks' parent, the engine, the API server).
MAX_ANCESTORS = 4


@dataclass(frozen=True, slots=True)
class _Ancestor:
    """A process above a target when its watch began."""

    pid: int
    started_ns: int
    #: TCP ports it listened on then (its HTTP frontend)
    listening: frozenset[int]


def _listening_ports(pid: int) -> frozenset[int]:
    """TCP ports ``pid`` listens on now (empty when none, or unreadable)."""
    try:
        proc = psutil.Process(pid)
        conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections(kind="inet")
    except (psutil.Error, OSError):
        return frozenset()
    return frozenset(c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr)


@dataclass(frozen=True, slots=True)
class _Member:
    """A process of a dead one's branch: pid and creation time (seconds; 0 unknown)."""

    pid: int
    create_time_s: float


class _Watched:
    """One watched pid, and what was read of it while it lived."""

    def __init__(self, target: Target, returncode: Callable[[], int | None] | None) -> None:
        self.target = target
        self.returncode = returncode
        self.reported = False
        #: its ancestors when the watch began, parent first (up to :data:`MAX_ANCESTORS`; never
        #: init or this agent and its own ancestors)
        self.ancestors: tuple[_Ancestor, ...] = ()
        #: its descendants when the watch began (an engine's workers, watched or not)
        self.descendants: tuple[_Member, ...] = ()
        #: its memory cgroup's OOM-kill counter when the watch began
        self.oom_counter: OomCounter | None = None
        #: when :meth:`read_lineage` ran (monotonic seconds; 0: not yet)
        self.lineage_read_s = 0.0
        #: its uids when the watch began (whose private folder holds its SDK death notice)
        self.uids: tuple[int, ...] = ()
        #: its container, when it was its container's init at the watch's start (the runtime's
        #: exit record is then its own)
        self.container: ContainerInit | None = None
        #: where its runtime's record said it was OOM-killed (``""``: it did not)
        self.runtime_oom = ""

    def looks_for_server_port(self) -> bool:
        """No ancestor listened yet, within :data:`SERVER_PORT_LOOK_S` of the watch's start: the
        server may still be starting (its port is read again, :meth:`read_server_ports`)."""
        return bool(self.ancestors) and _server_index(self.ancestors) is None \
            and time.monotonic() - self.lineage_read_s < SERVER_PORT_LOOK_S

    def read_server_ports(self) -> None:
        """The ports the ancestors listen on now, once one does (a thread: /proc reads): an exit
        during its server's stop is then judged with its server (a restarted vLLM's engine is
        found before its API server listens; without its port, the API server's drain of its
        clients after it killed the engine read as the engine's failure)."""
        found = tuple(replace(a, listening=_listening_ports(a.pid)) if _pid_running(a.pid) else a for a in self.ancestors)
        if _server_index(found) is not None:
            self.ancestors = found

    @property
    def parent_pid(self) -> int:
        return self.ancestors[0].pid if self.ancestors else 0

    def read_lineage(self) -> None:
        """Ancestors (with the ports they listen on) and OOM counter, read once while the process
        lives (a thread: /proc reads)."""
        mine = {os.getpid()}
        try:
            mine.update(p.pid for p in psutil.Process().parents())
            chain = psutil.Process(self.target.pid).parents()
        except (psutil.Error, OSError):
            chain = []
        found = []
        for proc in chain[:MAX_ANCESTORS]:
            if proc.pid <= 1 or proc.pid in mine:
                break
            try:
                started_ns = int(proc.create_time() * 1e9)
            except (psutil.Error, OSError):
                break
            found.append(_Ancestor(proc.pid, started_ns, _listening_ports(proc.pid)))
        self.ancestors = tuple(found)
        self.lineage_read_s = time.monotonic()
        members = []
        try:
            for proc in psutil.Process(self.target.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error, OSError):
                    members.append(_Member(proc.pid, proc.create_time()))
        except (psutil.Error, OSError):
            pass
        self.descendants = tuple(members)
        self.oom_counter = oom_counter_of(self.target.pid)
        self.uids = process_uids(self.target.pid)
        self.container = container_init_of(self.target.pid)



def _swept_times(fact: ExitFact, deaths: list[ExitFact]) -> tuple[list[ExitFact], list[int]]:
    """The branch's deaths that may be part of the exit's sweep, and the known end times
    (the exit's own with them, when the kernel dated it)."""
    if fact.ended_source == "kernel":  # what died well before this exit was no part of its sweep
        earliest_ns = fact.ended_time_unix_nano - int(2 * SWEEP_SPREAD_S * 1e9)
        deaths = [f for f in deaths if not f.ended_time_unix_nano or f.ended_time_unix_nano >= earliest_ns]
    times = [f.ended_time_unix_nano for f in deaths if f.ended_time_unix_nano]
    if fact.ended_source == "kernel":
        times.append(fact.ended_time_unix_nano)
    return deaths, times


def _sweep_spread(
    fact: ExitFact, pid: int, members: int, deaths: list[ExitFact], serving: bool, last_open_ns: int, server: _Ancestor
) -> str | None:
    """``" within X s"`` (or ``""`` when not every end is known) for a branch that went down as
    a server's sweep; ``None`` (logged: a failure) when a member ended on its own or the server
    closed its port while the branch went down slowly."""
    complete = len(deaths) == members  # every member's end known (else the port's order decides alone)
    deaths, times = _swept_times(fact, deaths)
    bad = next((f"pid {f.pid} {f.status()}" for f in deaths if not _killed_or_stopped(f)), "")
    if bad:
        log.info("process: pid %d: %s in its branch ended on its own: a failure", pid, bad)
        return None
    complete = complete and len(times) == len(deaths) + (fact.ended_source == "kernel") and bool(times)
    if not serving and complete and max(times) > last_open_ns and max(times) - min(times) > SWEEP_SPREAD_S * 1e9:
        log.info("process: pid %d: its server (pid %d) closed its port while its branch went down over %.2f s:"
                 " a reaction, a failure", pid, server.pid, (max(times) - min(times)) / 1e9)
        return None
    return f" within {(max(times) - min(times)) / 1e9:.2f} s" if complete else ""


def _ancestor_verdict(
    watched: _Watched, fact: ExitFact, ancestor: _Ancestor, ended: ExitFact | None, t0: float
) -> ExitFact | None:
    """What an ancestor's end says of the exit: the fact settled (a stop, or a failure), or
    ``None`` (look further up)."""
    if ended is None:
        return None
    if ended.kind is ExitKind.ORDERLY and fact.kind is ExitKind.CODE and not ended.stop_signal:
        # a launcher that exits 0 after its children failed with codes of their own
        # (a rank crashed, the others gave up): nobody asked it to stop
        log.info("process: pid %d exited %s, then its ancestor pid %d exited %s unasked: a failure,"
                 " not a stop", watched.target.pid, fact.status(), ancestor.pid, ended.status())
        return fact
    if ended.kind is ExitKind.ORDERLY:
        took = time.monotonic() - t0
        who = "its server" if ancestor is watched.ancestors[0] else "its server's ancestor"
        return replace(fact, tree_stopped=True, orderly_reason=(
            f"{who} (pid {ancestor.pid}) stopped in order ({ended.status()}) within {took:.1f} s"))
    if not _may_be_part_of_a_stop(ended):
        return fact  # it crashed (or the OOM killer): no orderly stop up there
    return None

class ProcessWatcher:
    """Publishes ``TargetExited(pid, exit_code, signal, title)`` once per watched pid.

    Args:
        targets: pids or :class:`~agent.host.targets.Target` to watch. A ``Target`` with
            ``create_time_s`` set also guards against pid reuse: if the pid already belongs to
            another process, the target is reported as exited.
        poll_interval_s: the polling period without a pidfd (fallback), in seconds. Default 1.0.
        children: ``subprocess.Popen`` objects this process owns (launch mode); their exit
            status is read through ``Popen.poll()`` so the owner keeps its ``returncode``.
        sdk_dir: the SDK's base folder, where its death notices are (default: the SDK's own,
            ``$SERVEWATCH_SHM_DIR`` or ``/dev/shm``).
        container_exit_records: path templates of the container runtimes' exit records
            (:data:`agent.host.containerexits.DEFAULT_RECORDS`).
        config: the ``[process]`` table; when given, its ``container_exit_records`` are used.

    More pids can be added while running with :meth:`watch`.
    """

    name = "process"
    #: restarted as the same instance after a crash: it holds what discovery asked it to watch
    reusable = True

    def __init__(
        self,
        targets: Iterable[int | Target] = (),
        *,
        poll_interval_s: float = 1.0,
        children: Iterable[subprocess.Popen[Any]] = (),
        sdk_dir: Path | None = None,
        container_exit_records: Sequence[str] = DEFAULT_RECORDS,
        config: ProcessConfig | None = None,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.poll_interval_s = poll_interval_s
        #: the SDK's base folder (its death notices), ``None``: the SDK's default
        self.sdk_dir = sdk_dir
        #: where container runtimes keep a container's exit record (``{id}`` templates)
        self.container_exit_records = tuple(config.container_exit_records if config is not None else container_exit_records)
        #: the ``[process]`` table it was built from (``None``: built directly, from the arguments)
        self.config = config
        self._watched: dict[int, _Watched] = {}
        self._tg: TaskGroup | None = None
        self._bus: Publisher | None = None
        self._kernel: KernelExits | None = None
        self._oom: OomWatch | None = None
        #: every exit reported, in order (``servewatch run``/``launch`` print them when they stop)
        self.exits: list[tuple[Target, ExitFact]] = []
        #: the non-target parents (frontends) followed, by (pid, start ns): :meth:`_watch_parent`
        self._parents: set[tuple[int, int]] = set()
        #: why the kernel's exit events cannot be read here (``""``: they are)
        self.kernel_exits_unavailable = ""
        for child in children:
            args = child.args
            self.watch(launched_target(child.pid, [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)),
                       returncode=child.poll)
        for target in targets:
            self.watch(target)

    @property
    def pids(self) -> tuple[int, ...]:
        """Pids watched and not yet reported as exited."""
        return tuple(pid for pid, w in self._watched.items() if not w.reported)

    def watch(self, target: int | Target, *, returncode: Callable[[], int | None] | None = None) -> None:
        """Watch one more process (also while running).

        A process already watched (and not yet exited) is left as is; targets are keyed by
        (pid, creation time), so a pid reported as exited, or now held by a newer process, is
        watched anew (a new process that reused the pid).

        Args:
            target: pid or :class:`~agent.host.targets.Target`.
            returncode: owner's status getter, ``Popen``-style (``None`` while running,
                ``-N`` for signal N), e.g. ``popen.poll``.
        """
        if isinstance(target, int):
            target = _target_of(target)
        existing = self._watched.get(target.pid)
        if existing is not None and not existing.reported and _same_identity(existing.target, target):
            if returncode is not None and existing.returncode is None:
                existing.returncode = returncode
            return
        watched = _Watched(target, returncode)
        self._watched[target.pid] = watched
        if self._tg is not None and self._bus is not None:
            self._tg.start_soon(self._watch_one, self._bus, watched)

    def left_alive(self, pid: int) -> list[Target]:
        """The processes of ``pid``'s tree still running after it ended: those below it when
        its watch began, and the watched processes it was an ancestor of (an engine and its
        workers after their API server or launcher died). Blocking (/proc reads); ``[]`` when
        ``pid`` was never watched.

        Returns:
            One :class:`~agent.host.targets.Target` each (pid, title, creation time), pid order.
        """
        watched = self._watched.get(pid)
        if watched is None:
            return []
        members = {m.pid: m.create_time_s for m in watched.descendants}
        for other in self._watched.values():
            if other is not watched and any(_is_process(a, watched.target) for a in other.ancestors):
                members.setdefault(other.target.pid, other.target.create_time_s)
                members.update((m.pid, m.create_time_s) for m in other.descendants if m.pid not in members)
        found = []
        for member, created_s in sorted(members.items()):
            if process_state(member, create_time_s=created_s) not in (ProcessState.RUNNING, ProcessState.STOPPED):
                continue
            known = self._watched.get(member)
            found.append(known.target if known is not None and _same_identity(known.target, Target(pid=member,
                         create_time_s=created_s)) else _target_of(member))
        return found

    async def run(self, bus: Publisher, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled; ready once every initial pid is being watched."""
        async with anyio.create_task_group() as tg:
            self._tg, self._bus = tg, bus
            try:
                await self._open_sources(tg)
                for watched in tuple(self._watched.values()):
                    if not watched.reported:  # restarted after a crash: an exit is reported once
                        tg.start_soon(self._watch_one, bus, watched)
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self._tg = self._bus = None
                if self._oom is not None:
                    self._oom.close()
                    self._oom = None
                if self._kernel is not None:
                    self._kernel.close()
                    self._kernel = None

    async def _open_sources(self, tg: TaskGroup) -> None:
        """Subscribe to the kernel's exit events and follow its log (both optional)."""
        self._kernel = await anyio.to_thread.run_sync(KernelExits.open)
        if self._kernel is None:
            self.kernel_exits_unavailable = KernelExits.unavailable
            log.warning("process: %s; the exit status of a process its own parent reaps at once can only be"
                        " said unknown here", KernelExits.unavailable)
        elif hasattr(anyio, "wait_readable"):
            await tg.start(self._kernel.run)
        self._oom = await anyio.to_thread.run_sync(OomWatch.open)

    async def _watch_one(self, bus: Publisher, watched: _Watched) -> None:
        pid = watched.target.pid
        # anyio.wait_readable(fd) exists from anyio 4.7; older versions poll.
        pidfd = _open_pidfd(pid) if hasattr(anyio, "wait_readable") else None
        try:
            # A pid already gone (or reused by another process) is reported at once.
            if _same_process(watched.target):
                await anyio.to_thread.run_sync(watched.read_lineage)
                self._follow_parent(bus, watched)
                if pidfd is not None:
                    # each recheck also asks whether the pid is still our process: a pidfd opened
                    # on a pid already reaped and reused would otherwise follow the newcomer
                    while not _pidfd_exited(pidfd) and _same_process(watched.target):
                        looking = watched.looks_for_server_port()
                        with anyio.move_on_after(SERVER_PORT_RECHECK_S if looking
                                                 else max(self.poll_interval_s, PIDFD_RECHECK_S)):
                            await anyio.wait_readable(pidfd)
                        if looking and not _pidfd_exited(pidfd):
                            await anyio.to_thread.run_sync(watched.read_server_ports)
                else:
                    while _alive(watched.target):
                        await anyio.sleep(self.poll_interval_s)
                        if watched.looks_for_server_port():
                            await anyio.to_thread.run_sync(watched.read_server_ports)
            seen_ns = now_ns()
            fact = await self._fact(watched, pidfd, seen_ns)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        if _may_be_part_of_a_stop(fact) and not watched.reported:
            fact = await self._settle_tree(watched, fact)
        if watched.reported:
            return
        watched.reported = True
        note_exit(pid, create_time_s=watched.target.create_time_s, fact=fact)
        self.exits.append((watched.target, fact))
        await bus.publish(
            TargetExited(source=self.name, pid=pid, exit_code=fact.exit_code, signal=fact.signal,
                         title=watched.target.title, fact=fact)
        )

    def _follow_parent(self, bus: Publisher, watched: _Watched) -> None:
        """Follow the parent of ``watched`` when it is no target itself (a host-wide ``--match``
        watches the ranks, not their frontend): once, per parent (:meth:`_watch_parent`)."""
        if not watched.ancestors or self._tg is None:
            return
        parent = watched.ancestors[0]
        key = (parent.pid, parent.started_ns)
        if key in self._parents or self._watches(parent):
            return
        self._parents.add(key)
        self._tg.start_soon(self._watch_parent, bus, parent)

    def _watches(self, ancestor: _Ancestor) -> bool:
        """``ancestor`` is itself watched (its own exit is reported, and :meth:`left_alive` names
        what it leaves)."""
        known = self._watched.get(ancestor.pid)
        return known is not None and _is_process(ancestor, known.target)

    def _orphans_of(self, parent: _Ancestor) -> list[Target]:
        """The watched processes below ``parent`` when their watch began (and what was below
        them) still running, not being killed. Blocking (/proc reads)."""
        members: dict[int, float] = {}
        for other in self._watched.values():
            if other.reported or not any(a.pid == parent.pid and a.started_ns == parent.started_ns
                                         for a in other.ancestors):
                continue
            members.setdefault(other.target.pid, other.target.create_time_s)
            members.update((m.pid, m.create_time_s) for m in other.descendants if m.pid not in members)
        found = []
        for member, created_s in sorted(members.items()):
            if process_state(member, create_time_s=created_s) not in (ProcessState.RUNNING, ProcessState.STOPPED) \
                    or _kill_pending(member):
                continue
            known = self._watched.get(member)
            found.append(known.target if known is not None and _same_identity(known.target, Target(pid=member,
                         create_time_s=created_s)) else _target_of(member))
        return found

    async def _watch_parent(self, bus: Publisher, parent: _Ancestor) -> None:
        """Wait for a followed parent's end; when watched processes of it still run
        :data:`ORPHAN_SETTLE_S` later (their tree did not go down with it: an engine and its
        workers under pid 1 after their API server was SIGKILLed), publish one
        :class:`~agent.model.events.FrontendExited` naming them and the memory they hold."""
        pid = parent.pid
        target = Target(pid=pid, create_time_s=parent.started_ns / 1e9)
        title = await anyio.to_thread.run_sync(_title_of, pid)  # while it lives: a SIGKILLed one is reaped at once
        pidfd = _open_pidfd(pid) if hasattr(anyio, "wait_readable") else None
        try:
            if pidfd is not None:
                while not _pidfd_exited(pidfd) and _same_process(target):
                    with anyio.move_on_after(PIDFD_RECHECK_S):
                        await anyio.wait_readable(pidfd)
            else:
                while _alive(target):
                    await anyio.sleep(self.poll_interval_s)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        seen_ns = now_ns()
        ended = await self._parent_exit(pid, parent.started_ns)
        await anyio.sleep(ORPHAN_SETTLE_S)  # a server that stops its ranks after itself: they are going
        if self._watches(parent):
            return  # became a target meanwhile: its own exit says it
        left = await anyio.to_thread.run_sync(self._orphans_of, parent)
        if not left:
            return
        held = await anyio.to_thread.run_sync(_rss_of, left)
        reparented = await anyio.to_thread.run_sync(_ppid_of, left[0].pid)
        if ended is None:
            fact = ExitFact.of(pid, None, None, source=ExitSource.NONE, ended_time_unix_nano=seen_ns, ended_source="seen",
                               started_time_unix_nano=parent.started_ns)
        else:
            fact = replace(ended, ended_time_unix_nano=ended.ended_time_unix_nano or seen_ns,
                           ended_source=ended.ended_source or "seen", started_time_unix_nano=parent.started_ns)
        log.warning("process: the parent pid %d %r of watched processes ended (%s); %d of them still alive: %s", pid,
                    title, fact.status_words(), len(left), ", ".join(str(t.pid) for t in left))
        await bus.publish(FrontendExited(
            source=self.name, pid=pid, exit_code=fact.exit_code, signal=fact.signal, title=title, fact=fact,
            left_alive=tuple(t.pid for t in left), left_alive_titles=tuple(t.title for t in left), held_bytes=held,
            reparented_to=reparented,
        ))

    async def _fact(self, watched: _Watched, pidfd: int | None, seen_ns: int) -> ExitFact:
        """How the process ended, from the most direct source that knows (module docstring)."""
        pid = watched.target.pid
        started = int(watched.target.create_time_s * 1e9) if watched.target.create_time_s else 0
        status, source, ended, ended_source = await self._status(watched, pidfd)
        if not ended:
            ended, ended_source = seen_ns, "seen"
        code, sig = status if status is not None else (None, None)
        oom = ""
        if self._oom is not None and (sig == _signal.SIGKILL or status is None):
            oom = await anyio.to_thread.run_sync(self._oom.killed, pid, watched.oom_counter)
        oom = oom or watched.runtime_oom
        if oom and sig is None and code is None:
            sig = int(_signal.SIGKILL)  # the OOM killer's signal
        return ExitFact.of(pid, code, sig, oom=bool(oom), oom_evidence=oom,
                           source=source if status is not None else (ExitSource.KERNEL if oom else ExitSource.NONE),
                           ended_time_unix_nano=ended, ended_source=ended_source, started_time_unix_nano=started)

    async def _status(
        self, watched: _Watched, pidfd: int | None
    ) -> tuple[tuple[int | None, int | None] | None, ExitSource, int, str]:
        """``(status, source, ended_time_unix_nano, ended_source)``; ``status`` ``None``: unknown."""
        if watched.returncode is not None:
            # The owner's poll() reaps and keeps the code; the exit may take a moment to show
            # (longer on a loaded machine): the code must be known, not "None".
            with anyio.move_on_after(max(self.poll_interval_s, 2.0)):
                while True:
                    code = watched.returncode()
                    if code is not None:
                        return exit_status(code), ExitSource.OWNER, 0, ""
                    await anyio.sleep(0.01)
        status = _waitid_nowait(pidfd, watched.target.pid)
        if status is not None:
            return status, ExitSource.WAITID, 0, ""
        started = int(watched.target.create_time_s * 1e9) if watched.target.create_time_s else 0
        kernel = self._kernel
        if kernel is not None:
            found = await anyio.to_thread.run_sync(kernel.get, watched.target.pid, started)
            if found is not None:
                return (found.exit_code, found.signal), ExitSource.KERNEL, found.time_unix_nano, "kernel"
        # not our child: a zombie still shows its status in /proc/PID/stat
        status = await anyio.to_thread.run_sync(zombie_exit_status, watched.target.pid)
        if status is not None:
            return status, ExitSource.ZOMBIE, 0, ""
        noted = exit_fact_of(watched.target.pid, watched.target.create_time_s)  # launch reaped an orphan it adopted
        if noted is not None and noted.source is not ExitSource.NONE:
            return (noted.exit_code, noted.signal), noted.source, noted.ended_time_unix_nano, noted.ended_source
        # the process's own SDK death notice: in a pod, a rank its parent reaped at once
        told = await anyio.to_thread.run_sync(sdk_notice_fact, watched.target.pid, watched.target.create_time_s,
                                              watched.uids, self.sdk_dir)
        if told is not None:
            return (told.exit_code, told.signal), ExitSource.SDK, told.ended_time_unix_nano, told.ended_source
        record = await self._runtime_record(watched)  # a container's init: its runtime wrote how it ended
        if record is not None:
            watched.runtime_oom = record.oom_evidence
            return (record.exit_code, record.signal), ExitSource.RUNTIME, record.time_unix_nano, "runtime"
        return None, ExitSource.NONE, 0, ""

    async def _runtime_record(self, watched: _Watched) -> RuntimeExit | None:
        """Its container runtime's exit record, when it was its container's init (read when its
        watch began), waited for up to :data:`RUNTIME_RECORD_WAIT_S` (the runtime writes it once
        it reaped the init) while a folder that would hold it is visible."""
        init, records = watched.container, self.container_exit_records
        if init is None or not await anyio.to_thread.run_sync(records_visible, init, records):
            return None
        with anyio.move_on_after(RUNTIME_RECORD_WAIT_S):
            while True:
                found = await anyio.to_thread.run_sync(runtime_exit, init, records)
                if found is not None:
                    return found
                await anyio.sleep(RUNTIME_RECORD_POLL_S)
        log.info("process: pid %d was container %s's init; no trusted exit record of its runtime (%s) within %.0f s",
                 init.pid, init.container_id[:12], init.engine or "runtime not named", RUNTIME_RECORD_WAIT_S)
        return None

    async def _settle_tree(self, watched: _Watched, fact: ExitFact) -> ExitFact:
        """An exit that may be part of its server's stop (an unknown status, a non-zero code, a
        SIGKILL that is not the OOM killer's): is its server stopping? (The module docstring
        says how; :meth:`_settle_serving` while the server still serves.)

        Its server no longer serving (an HTTP frontend that closes its port first, then stops
        its engine and ranks), or none: its ancestors are followed up (each may take what is left
        of the bound to end): one that stops in order (exit 0, SIGTERM/SIGINT, 143/130: its exit
        event or zombie) makes the whole chain below it part of that stop (the engine SIGKILLs
        its workers, the API server its engine: vLLM on Ctrl-C); one that crashes (or is still
        running at the deadline) leaves the fact a failure. Status unknown and nothing told: the
        parent and the watched siblings all going down together still say so."""
        ancestors = watched.ancestors
        if not ancestors:
            return fact  # our own child (its status is ours to read), or an orphan: nothing to infer
        at = _server_index(ancestors)
        looked_ns = time.time_ns()
        if at is not None and await anyio.to_thread.run_sync(_serves, ancestors[at]):
            return await self._settle_serving(watched, fact, at, looked_ns)
        bound_s = SERVER_END_S if at is not None else TREE_SETTLE_S  # a server that closed its port is stopping
        t0 = time.monotonic()
        # never above the server: its parent (a shell, a supervisor) is no part of its stop, and
        # waiting for it to end would hold the exit (and a --root-pid agent) for the whole bound
        chain = ancestors[: at + 1] if at is not None else ancestors
        with anyio.move_on_after(bound_s):
            for ancestor in chain:
                while _pid_running(ancestor.pid):
                    await anyio.sleep(0.1)
                ended = await self._parent_exit(ancestor.pid, ancestor.started_ns)
                settled = _ancestor_verdict(watched, fact, ancestor, ended, t0)
                if settled is not None:
                    return settled
            if fact.kind is not ExitKind.UNKNOWN:
                return fact
        if fact.kind is ExitKind.UNKNOWN:
            return await self._whole_tree_down(watched, fact, t0)
        return fact

    def _branch(self, watched: _Watched, at: int) -> list[_Member]:
        """The processes that go down with ``watched`` when its server (``ancestors[at]``) takes
        its engine down: the ancestors below the server, the processes below the dead one, and
        every watched process (and what was below it) under the branch's root. A child of the
        server itself has the server as its branch's root: the server's other watched processes go
        down with it (SGLang's launcher SIGKILLs all its children at once, ``kill_process_tree``,
        while its port still listens)."""
        ancestors = watched.ancestors
        root = ancestors[at - 1] if at > 0 else ancestors[at]
        found: dict[int, _Member] = {m.pid: m for m in watched.descendants}
        found.update((a.pid, _Member(a.pid, a.started_ns / 1e9)) for a in ancestors[:at])
        root_pid = root.pid
        for other in self._watched.values():
            if other is watched:
                continue
            if other.target.pid == root_pid or any(a.pid == root_pid for a in other.ancestors):
                found.setdefault(other.target.pid, _Member(other.target.pid, other.target.create_time_s))
                found.update((m.pid, m) for m in other.descendants if m.pid not in found)
        found.pop(watched.target.pid, None)
        found.pop(ancestors[at].pid, None)
        return list(found.values())

    async def _settle_serving(self, watched: _Watched, fact: ExitFact, at: int, open_ns: int) -> ExitFact:
        """The exit happened while its server (``ancestors[at]``) still served (seen serving at
        ``open_ns`` or later, wall-clock ns): part of the
        server's stop only when the rest of its branch went down with it while the port still
        listened (a server killing its engine first), and the server then stopped serving and
        ended in order. Anything else is a failure (the module docstring)."""
        pid = watched.target.pid
        server = watched.ancestors[at]
        if fact.kind is ExitKind.CODE:
            return fact  # it ended on its own while its server served: a server's kill is a signal
        members = self._branch(watched, at)
        if not members:
            log.info("process: pid %d ended while its server (pid %d) served, alone: a failure", pid, server.pid)
            return fact  # a lone process killed while its server serves on: nothing says "stop"
        swept = await self._sweep(pid, members, server, open_ns)
        if swept is None:
            return fact
        serving, last_open_ns = swept
        deaths = await anyio.to_thread.run_sync(self._branch_deaths, members)
        spread = _sweep_spread(fact, pid, len(members), deaths, serving, last_open_ns, server)
        if spread is None:
            return fact
        return await self._server_ends(fact, server, f"took its engine down while it served ({len(members) + 1}"
                                                      f" processes{spread})")

    async def _sweep(self, pid: int, members: list[_Member], server: _Ancestor, open_ns: int) -> tuple[bool, int] | None:
        """Wait for the branch to go down while its server serves: ``(serving at the end, last
        seen serving ns)``, or ``None`` (logged: a failure) when the server closes its port
        first or the branch outlives :data:`SWEEP_WINDOW_S`."""
        t0 = time.monotonic()
        last_open_ns = open_ns
        while True:
            alive, serving, at_ns = await anyio.to_thread.run_sync(_look, members, server)
            if serving:
                last_open_ns = at_ns
            if not alive:
                return serving, last_open_ns
            if not serving:
                log.info("process: pid %d ended while its server (pid %d) served, which then closed its port while"
                         " pid %d still ran: it reacted to a failure", pid, server.pid, alive[0])
                return None
            if time.monotonic() - t0 > SWEEP_WINDOW_S:
                log.info("process: pid %d ended while its server (pid %d) served on and pid %d ran on: a failure",
                         pid, server.pid, alive[0])
                return None
            await anyio.sleep(SWEEP_SAMPLE_S)

    async def _server_ends(self, fact: ExitFact, server: _Ancestor, what: str) -> ExitFact:
        """After its branch went down: the server must stop serving within :data:`SWEEP_STOP_S`
        and end in order within :data:`SERVER_END_S` (else the fact stays a failure)."""
        t0 = time.monotonic()
        serving = True
        with anyio.move_on_after(SERVER_END_S):
            while _pid_running(server.pid):
                if serving and time.monotonic() - t0 > SWEEP_STOP_S:
                    serving = await anyio.to_thread.run_sync(_serves, server)
                    if serving:
                        log.info("process: pid %d: its server (pid %d) %s and served on: a failure", fact.pid,
                                 server.pid, what)
                        return fact
                await anyio.sleep(0.1)
            ended = await self._parent_exit(server.pid, server.started_ns)
            took = time.monotonic() - t0
            if ended is not None and ended.kind is ExitKind.ORDERLY:
                return replace(fact, tree_stopped=True, orderly_reason=(
                    f"its server (pid {server.pid}) {what} and stopped in order ({ended.status()}) within {took:.1f} s"))
            if ended is None and fact.kind is ExitKind.UNKNOWN:
                return replace(fact, tree_stopped=True, orderly_reason=(
                    f"its server (pid {server.pid}) {what} and went down within {took:.1f} s: the server stopped as a whole"))
            log.info("process: pid %d: its server (pid %d) %s, then ended %s: a failure", fact.pid, server.pid, what,
                     ended.status() if ended is not None else "with its status unknown")
            return fact
        log.info("process: pid %d: its server (pid %d) %s and had not ended after %.0f s: a failure", fact.pid,
                 server.pid, what, SERVER_END_S)
        return fact

    def _branch_deaths(self, members: list[_Member]) -> list[ExitFact]:
        """How the branch's processes ended, where the kernel's exit event or a zombie says
        (a thread: /proc reads); those with neither are left out."""
        found = []
        for m in members:
            started_ns = int(m.create_time_s * 1e9)
            if self._kernel is not None:
                event = self._kernel.get(m.pid, started_ns)
                if event is not None:
                    found.append(ExitFact.of(m.pid, event.exit_code, event.signal, source=ExitSource.KERNEL,
                                             ended_time_unix_nano=event.time_unix_nano, ended_source="kernel"))
                    continue
            status = zombie_exit_status(m.pid)
            if status is not None:
                found.append(ExitFact.of(m.pid, *status, source=ExitSource.ZOMBIE))
        return found

    async def _whole_tree_down(self, watched: _Watched, fact: ExitFact, t0: float) -> ExitFact:
        """Status unknown: the parent and every watched sibling gone within :data:`TREE_SETTLE_S`."""
        parent = watched.parent_pid
        siblings = [w for w in self._watched.values() if w is not watched and w.parent_pid == parent]
        with anyio.move_on_after(max(0.0, TREE_SETTLE_S - (time.monotonic() - t0))):
            while _pid_running(parent) or any(_alive(w.target) for w in siblings):
                await anyio.sleep(0.1)
            took = time.monotonic() - t0
            reason = (f"its parent pid {parent}" + (f" and {len(siblings)} watched sibling(s)" if siblings else "")
                      + f" went down with it within {took:.1f} s: the server stopped as a whole")
            return replace(fact, tree_stopped=True, orderly_reason=reason)
        return fact

    async def _parent_exit(self, pid: int, started_ns: int) -> ExitFact | None:
        """How the parent ended, when the kernel's exit event or its zombie says (else ``None``)."""
        kernel = self._kernel
        if kernel is not None:
            found = await anyio.to_thread.run_sync(kernel.get, pid, started_ns)
            if found is not None:
                return ExitFact.of(pid, found.exit_code, found.signal, source=ExitSource.KERNEL)
        status = await anyio.to_thread.run_sync(zombie_exit_status, pid)
        if status is not None:
            return ExitFact.of(pid, *status, source=ExitSource.ZOMBIE)
        return None


#: Signals of a crash: an exit by one of them is never read as part of an orderly stop.
CRASH_SIGNALS = frozenset(int(s) for s in (_signal.SIGSEGV, _signal.SIGBUS, _signal.SIGILL, _signal.SIGFPE,
                                            _signal.SIGABRT, _signal.SIGSYS, _signal.SIGTRAP))


def _server_index(ancestors: tuple[_Ancestor, ...]) -> int | None:
    """Index of the nearest ancestor that listened on a TCP port when the watch began or since (the
    server: vLLM's API server, SGLang's main process, torchrun's rendezvous), ``None`` if none."""
    return next((i for i, a in enumerate(ancestors) if a.listening), None)


def _serves(server: _Ancestor) -> bool:
    """The server still runs, is not being killed, and listens on a port it listened on then."""
    return _pid_running(server.pid) and not _kill_pending(server.pid) \
        and bool(server.listening & _listening_ports(server.pid))


def _kill_pending(pid: int) -> bool:
    """A SIGKILL is pending for ``pid`` (``/proc/PID/status`` ``SigPnd``/``ShdPnd``): it has been
    killed and dies as soon as it runs."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
                    return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def _look(members: list[_Member], server: _Ancestor) -> tuple[list[int], bool, int]:
    """One look at a dead process's branch, then at its server (in this order: a branch seen down
    and then the port seen open were both so at that second moment): ``(pids of the branch still
    running and not being killed, whether the server still serves, wall-clock ns just before the
    look at the port: a serving server served then or later)``."""
    alive = [m.pid for m in members
             if process_state(m.pid, create_time_s=m.create_time_s) in (ProcessState.RUNNING, ProcessState.STOPPED)
             and not _kill_pending(m.pid)]
    before_ns = time.time_ns()
    return alive, _serves(server), before_ns


def _killed_or_stopped(fact: ExitFact) -> bool:
    """Ended as a server's stop ends a process: in order, or by a signal that is not a crash nor
    the OOM killer (an exit code of its own is a reaction)."""
    return fact.kind is ExitKind.ORDERLY or (fact.kind is ExitKind.SIGNAL and fact.signal not in CRASH_SIGNALS)


def _may_be_part_of_a_stop(fact: ExitFact) -> bool:
    """An unknown status, a non-zero exit code, or a kill signal that is not a crash and not the
    OOM killer's (servers SIGKILL their ranks when they stop: SGLang's kill_process_tree)."""
    if fact.kind is ExitKind.UNKNOWN or fact.kind is ExitKind.CODE:
        return True
    return fact.kind is ExitKind.SIGNAL and fact.signal not in CRASH_SIGNALS


def _is_process(ancestor: _Ancestor, target: Target) -> bool:
    """``ancestor`` is the process ``target`` describes (same pid and, when known, creation time)."""
    if ancestor.pid != target.pid:
        return False
    return not target.create_time_s or abs(ancestor.started_ns / 1e9 - target.create_time_s) < 0.05


def _same_identity(a: Target, b: Target) -> bool:
    """Same process: same pid and, where both are known, the same creation time (pid reuse)."""
    if a.pid != b.pid:
        return False
    if a.create_time_s and b.create_time_s:
        return abs(a.create_time_s - b.create_time_s) < 0.05
    return True


def _target_of(pid: int) -> Target:
    """A bare pid as a :class:`Target`: its title and, above all, its creation time, read now.

    The creation time is what tells this process from a later one that reuses the pid: without it
    a pid reaped (by its owner) before the watcher opened its pidfd would be watched as the new
    process, and the exit would never be reported. A pid already gone gets neither (reported as
    exited at once).
    """
    try:
        proc = psutil.Process(pid)
        create_time_s = proc.create_time()  # a zombie has one too
    except (psutil.Error, OSError):
        return Target(pid=pid)
    title = ""
    try:
        cmdline = [part for part in proc.cmdline() if part]
        title = cmdline[0] if cmdline else proc.name()
    except (psutil.Error, OSError):  # a zombie has no cmdline left
        pass
    return Target(pid=pid, title=title, create_time_s=create_time_s)


#: Longest title a launched command's command line gives, characters.
_COMMAND_TITLE_MAX = 120


def launched_target(pid: int, argv: Sequence[Any]) -> Target:
    """A launched server as a :class:`Target`: its title is the one it set, else (its argv as
    launched, or nothing left to read: it already exited) its command line ``argv``, secrets
    redacted and clipped to :data:`_COMMAND_TITLE_MAX` characters (``python -m
    sglang.launch_server --port 30000``): an exit seen later names what was launched."""
    target = _target_of(pid)
    args = [os.fsdecode(a) for a in argv]
    if args and target.title in ("", args[0], os.path.basename(args[0])):  # no title of its own
        target = replace(target, title=_command_title(args))
    return target


def _command_title(argv: Sequence[str]) -> str:
    """A command line as a title: secrets redacted (:func:`agent.host.security.redact_cmdline`),
    control characters stripped, clipped to :data:`_COMMAND_TITLE_MAX` characters."""
    import shlex

    from agent.host.security import redact_cmdline, strip_control

    command = strip_control(shlex.join(redact_cmdline(argv)))
    if len(command) > _COMMAND_TITLE_MAX:
        command = command[: _COMMAND_TITLE_MAX - 3] + "..."
    return command


def _title_of(pid: int) -> str:
    """``pid``'s command line as a title while it is still readable (:func:`_command_title`:
    secrets redacted, control characters stripped, clipped: a watched server's parent wrote it),
    else its name (a zombie's), ``""`` when gone."""
    from agent.host.security import strip_control

    try:
        proc = psutil.Process(pid)
        cmdline = [part for part in proc.cmdline() if part]
        return _command_title(cmdline) if cmdline else strip_control(proc.name())
    except (psutil.Error, OSError):
        return ""


def _rss_of(targets: Sequence[Target]) -> int:
    """Resident memory of ``targets`` now, bytes (those gone or unreadable count 0)."""
    total = 0
    for t in targets:
        with contextlib.suppress(psutil.Error, OSError):
            total += psutil.Process(t.pid).memory_info().rss
    return total


def _ppid_of(pid: int) -> int:
    try:
        return psutil.Process(pid).ppid()
    except (psutil.Error, OSError):
        return 0


def _open_pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def _pidfd_exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited (zombie included)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _same_process(target: Target) -> bool:
    """The pid still belongs to the process ``target`` describes (a zombie does: not reaped yet)."""
    return process_state(target.pid, create_time_s=target.create_time_s) is not ProcessState.GONE


def _pid_running(pid: int) -> bool:
    """The pid exists and is not a zombie (whoever has it)."""
    return process_state(pid) not in (ProcessState.GONE, ProcessState.ZOMBIE)


def _alive(target: Target) -> bool:
    """Polling fallback: still the same process, and not a zombie."""
    return process_state(target.pid, create_time_s=target.create_time_s) not in (ProcessState.GONE, ProcessState.ZOMBIE)


def signal_name(signum: int | None) -> str:
    """``"SIGKILL"`` for 9, ``""`` for ``None`` or an unknown number."""
    if signum is None:
        return ""
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return ""


#: Seconds between exit checks of targets the agent did not start (pidfd waits are woken at once).
POLL_INTERVAL_S = 0.5


def create(config: ProcessConfig, ctx: BuildContext) -> ProcessWatcher:
    """Registry factory (:data:`agent.watchers.WATCHERS` ``process``): watches every target the
    runtime discovers (and the processes it launched, ``ctx.children``) for exit."""
    return ProcessWatcher(poll_interval_s=POLL_INTERVAL_S, children=ctx.children, sdk_dir=ctx.agent.sdk_socket_dir, config=config)
