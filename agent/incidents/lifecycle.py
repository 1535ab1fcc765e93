"""A watched server's life as the incident manager reads it: stops, restarts, crash loops, the
ending of a stall, processes left alive.

Owns :class:`Lifecycle`, an admission policy (:class:`~agent.incidents.admission.TriggerPolicy`, asked
after the exit policy) with a task of its own on the bus. Its rules (issue 31, "the tree's
lifecycle"):

* **restart grace**: a health failure whose check is healthy again by the time it is judged
  (the server was stopped and started again, or came back on its own) opens no incident; a
  failure while a stopped server's new processes start waits for ``/health`` up to
  :data:`RESTART_GRACE_S` (an incident when it never comes back). A stop, the new processes
  found after it and the recovery are said (log lines and :class:`~agent.model.events.LifecycleNoted`);
* **a stall's ending**: a process of a stall incident (or of a start-up stall's) that ends after
  it (the operator's kill, the server's own watchdog or RPC timeout killing itself, an orderly
  stop) continues that incident: one line on it (``server ended after the stall: ...``), no
  second incident;
* **a health failure during a stall**: the health check of a server failing after its stall
  incident opened, while that stall is not over (no progress since), is the same hang seen
  from ``/health`` (SGLang's runs a one-token generation: it times out 20 s into a hung
  forward): one line on the stall incident (``health check failed during the stall: ...``), no
  second incident;
* **crash loop**: the same process (by title) exiting non-zero again within
  :data:`CRASH_LOOP_WINDOW_S` of its previous exit is counted on the first exit's incident, which
  is named a crash loop from the :data:`CRASH_LOOP_EXITS`-th exit on (with the exit status);
* **left alive**: processes of a server's tree still running after it ended (an engine and its
  workers under pid 1 after their API server or launcher died, or after the operator's stop)
  are named with the memory they hold, in the log, in the exit's outcome and on its incident.

Imports :mod:`agent.model.events`, :mod:`agent.incidents.admission` (its :class:`~agent.incidents.admission.Fold`),
:mod:`agent.host.startup` (its trigger's name), :mod:`agent.host.targets`, anyio and psutil (lazily); it
reads the incident manager through :class:`Manager` (never imports it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agent.host.startup import STARTUP_STALL
from agent.host.targets import Target
from agent.incidents.admission import ExitPolicy, Fold
from agent.model.bus import EventBus
from agent.model.events import (
    FrontendExited,
    HealthCheckFailed,
    HealthRecovered,
    LifecycleNoted,
    TargetExited,
    Trigger,
    TriggerEvent,
    WatchdogRearmed,
)

__all__ = [
    "CRASH_LOOP_EXITS",
    "CRASH_LOOP_WINDOW_S",
    "LEFT_ALIVE_SETTLE_S",
    "RESTART_GRACE_S",
    "STALL_ENDING_S",
    "Lifecycle",
    "Manager",
]

log = logging.getLogger("servewatch.lifecycle")

#: After an orderly stop: how long a health failure may wait for the server's new processes to
#: answer ``/health`` again before it is judged (a restart that never recovers is an incident), seconds.
RESTART_GRACE_S = 120.0
#: Exits of the same process (by title) that make a crash loop, counting the first.
CRASH_LOOP_EXITS = 3
#: Longest time between two exits of a crash loop, seconds.
CRASH_LOOP_WINDOW_S = 60.0
#: Longest time after a stall incident opened that an exit of its processes is that stall's
#: ending (a server's RPC timeout kills it minutes after the hang: vLLM's is 300 s), seconds.
STALL_ENDING_S = 900.0
#: After a process ended: how long its tree may take to go down before what still runs is
#: named as left alive, seconds.
LEFT_ALIVE_SETTLE_S = 5.0
#: Between two looks at the targets while a stopped server may be restarting, seconds.
FOLLOW_INTERVAL_S = 1.0
#: Most lines one incident's ``lifecycle`` holds (an endless crash loop only counts).
MAX_LINES = 32
#: The incidents of a hang, which a later exit of their processes ends and a later health failure
#: joins: the stall rule's and the start-up rule's (:mod:`agent.host.startup`: vLLM takes its engine
#: down once its own start-up wait is over).
HANG_TRIGGERS = frozenset({Trigger.STALL, STARTUP_STALL})


class Manager(Protocol):
    """The incident manager as the lifecycle reads it (:class:`agent.incidents.manager.IncidentManager`)."""

    @property
    def current(self) -> Any: ...

    @property
    def records(self) -> Sequence[Any]: ...

    @property
    def running(self) -> Mapping[str, Any]: ...

    @property
    def exits(self) -> ExitPolicy: ...

    def discover(self) -> list[Target]: ...

    def event_server(self, event: Any) -> int | None: ...

    async def rewrite(self, record: Any) -> None: ...


@dataclass(slots=True)
class _Loop:
    """Exits of one process title of one server counted on one incident."""

    record: Any
    count: int
    first_s: float
    last_s: float


def _rss_bytes(targets: Sequence[Target]) -> int:
    """Resident memory of ``targets`` now, bytes (those gone or unreadable count 0). Blocking."""
    import psutil

    total = 0
    for t in targets:
        try:
            total += psutil.Process(t.pid).memory_info().rss
        except (psutil.Error, OSError):
            continue
    return total


def _creation_clock_offset_s() -> float:
    """psutil's creation-time clock (boot time, whole seconds, plus the time since boot) minus
    the wall clock, seconds (a VM's wall clock drifts from it: -0.6 s measured; a restart forks
    its ranks within that). Blocking: reads /proc/stat once."""
    import psutil

    try:
        return psutil.boot_time() + time.clock_gettime(time.CLOCK_BOOTTIME) - time.time()
    except (psutil.Error, OSError, AttributeError):
        return 0.0


def _parent_of(pid: int) -> int:
    """``pid``'s parent now (0 when gone). Blocking."""
    import psutil

    try:
        return psutil.Process(pid).ppid()
    except (psutil.Error, OSError):
        return 0


def _gb(size_bytes: int) -> str:
    return f"{size_bytes / 1e9:.2f} GB" if size_bytes >= 1e7 else f"{size_bytes / 1e6:.1f} MB"


def _who(event: TargetExited) -> str:
    return f"pid {event.pid}" + (f" {event.title!r}" if event.title else "")


class Lifecycle:
    """The lifecycle rules (the module docstring), a :class:`~agent.incidents.admission.TriggerPolicy`.

    Args:
        manager: the incident manager it reads (its records, exit policy, discovery) and whose
            incidents it notes (:meth:`Manager.rewrite`); ``None``: the one :meth:`run` is
            given (until then every rule is silent).
        left_alive: the processes of a pid's tree still running after it ended (the process
            watcher's :meth:`~agent.watchers.process.ProcessWatcher.left_alive`; blocking);
            ``None``: not looked for.

    Attributes:
        noted: every :class:`~agent.model.events.LifecycleNoted` it published, oldest first.
    """

    def __init__(self, manager: Manager | None = None, *, left_alive: Callable[[int], list[Target]] | None = None) -> None:
        self._manager = manager
        self.left_alive = left_alive
        self.noted: list[LifecycleNoted] = []
        #: when the health check last turned healthy, ns since the epoch
        self.recovered_ns = 0
        self._rearmed_ns: dict[int | None, int] = {}
        #: crash loops by (server, title): two servers' engines of the same title are two loops
        self._loops: dict[tuple[int | None, str], _Loop] = {}
        #: processes left alive after their frontend died, and the incident that named them
        self._orphans: dict[int, Any] = {}
        self._ended: set[tuple[str, int]] = set()
        self._stopped: set[int] = set()
        self._stop_ns = 0
        self._following = False
        #: looks at what an exit left alive not finished yet (:meth:`wait_idle`)
        self._looking = 0
        self._bus: EventBus | None = None
        #: the work the rules asked for, taken by :meth:`run` (``None`` while it does not run: dropped)
        self._send: MemoryObjectSendStream[Callable[[], Awaitable[None]]] | None = None

    @property
    def manager(self) -> Manager:
        """The incident manager it reads.

        Raises:
            RuntimeError: none given yet (neither at construction nor by :meth:`run`).
        """
        if self._manager is None:
            raise RuntimeError("Lifecycle has no incident manager: pass one, or start run()")
        return self._manager

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the looks at what ended processes left alive (each takes
        :data:`LEFT_ALIVE_SETTLE_S` when something is); True when none is left (``launch`` waits
        so that its last lines name them)."""
        with anyio.move_on_after(timeout_s):
            while self._looking:
                await anyio.sleep(0.05)
        return not self._looking

    # -- the task -------------------------------------------------------------------------------

    async def run(self, bus: EventBus, manager: Manager | None = None, *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow health recoveries and progress from ``bus`` and do the work the rules asked
        for (notes, looks at what is left alive, following a restart) until cancelled.

        Args:
            bus: the agent's bus (read, and where :class:`~agent.model.events.LifecycleNoted` goes).
            manager: the incident manager, when not given at construction.
        """
        if manager is not None:
            self._manager = manager
        self._bus = bus
        send, receive = anyio.create_memory_object_stream[Callable[[], Awaitable[None]]](float("inf"))
        self._send = send
        async with anyio.create_task_group() as tg, send, bus.subscribe(HealthRecovered, WatchdogRearmed,
                                                                          name="lifecycle") as sub:
            tg.start_soon(self._work, tg, receive)
            task_status.started()
            async for event in sub:
                if isinstance(event, HealthRecovered):
                    self.recovered_ns = event.time_unix_nano
                    self.manager.exits.health_recovered_ns = event.time_unix_nano
                elif isinstance(event, WatchdogRearmed):
                    self._rearmed_ns[event.pid] = event.time_unix_nano

    async def _work(self, tg: TaskGroup, receive: MemoryObjectReceiveStream[Callable[[], Awaitable[None]]]) -> None:
        async with receive:
            async for job in receive:
                tg.start_soon(self._guarded, job)

    @staticmethod
    async def _guarded(job: Callable[[], Awaitable[None]]) -> None:
        try:
            await job()
        except Exception:  # a view of the server's life: never the agent's end
            log.exception("lifecycle work failed")

    def _submit(self, job: Callable[[], Awaitable[None]]) -> bool:
        """Hand ``job`` to :meth:`run`'s task; False when it does not run (the job is dropped)."""
        if self._send is None:
            return False
        try:
            self._send.send_nowait(job)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return False
        return True

    async def _say(self, phase: str, detail: str, *, pids: tuple[int, ...] = (), record: Any = None,
                   level: int = logging.WARNING) -> None:
        """Log ``detail``, note it on ``record`` (its manifest rewritten) and publish it."""
        log.log(level, "lifecycle: %s", detail)
        incident_id = trace_id = parent_span_id = ""
        if record is not None:
            incident_id, trace_id, parent_span_id = record.opened.incident_id, record.opened.trace_id, record.opened.span_id
            if len(record.lifecycle) < MAX_LINES:
                record.lifecycle.append(detail)
            await self.manager.rewrite(record)
        noted = LifecycleNoted(source="lifecycle", phase=phase, detail=detail, pids=pids, incident_id=incident_id,
                               trace_id=trace_id, parent_span_id=parent_span_id)
        self.noted.append(noted)
        if self._bus is not None:
            await self._bus.publish(noted)

    # -- TriggerPolicy --------------------------------------------------------------------------

    def settles(self, event: TriggerEvent) -> bool:
        return self._manager is not None and isinstance(event, HealthCheckFailed) and self._restarting()

    async def settle(self, event: TriggerEvent, manager: Any) -> None:
        """A health failure after an orderly stop: wait (up to :data:`RESTART_GRACE_S` after the
        stop) while the server's processes start again, until ``/health`` answers."""
        with anyio.move_on_after(max(0.0, RESTART_GRACE_S - (time.time_ns() - self._stop_ns) / 1e9)):
            while self.recovered_ns <= event.time_unix_nano:
                live = await anyio.to_thread.run_sync(self._discover)
                if not live:
                    return  # stopped, not starting: the exit policy's word (a stopped server's port)
                await anyio.sleep(FOLLOW_INTERVAL_S)

    def refuses(self, event: TriggerEvent) -> str | None:
        return None

    async def folds(self, event: TriggerEvent, manager: Any) -> Fold | None:
        if self._manager is None:
            return None
        if isinstance(event, HealthCheckFailed):
            return self._recovered(event) or self._health_during_stall(event)
        if not isinstance(event, TargetExited):
            return None
        if isinstance(event, FrontendExited):
            return self._frontend_fold(event)
        orphaned = self._orphans.get(event.pid)
        if orphaned is not None:
            self._note_orphan_end(orphaned, event)
            return Fold(orphaned.opened.incident_id)
        stall = self._stall_incident_of(event)
        if stall is not None:
            self._note_ending(stall, event)
            return Fold(stall.opened.incident_id)
        return self._crash_loop(event)

    def decided(self, event: TriggerEvent, outcome: str) -> None:
        if self._manager is None or not isinstance(event, TargetExited) or not outcome.startswith("incident ") \
                or not (event.title or isinstance(event, FrontendExited)):
            return
        incident_id = outcome.split()[1]
        record = self._record(incident_id)
        if record is None:
            return
        if isinstance(event, FrontendExited):
            for pid in event.left_alive:
                self._orphans[pid] = record
            return
        now = time.monotonic()
        self._loops[(getattr(record, "server", None), event.title)] = _Loop(record, 1, now, now)

    def handled(self, event: TriggerEvent) -> None:
        if self._manager is None or not isinstance(event, TargetExited):
            return
        outcome = self.manager.exits.exit_outcomes.get(event.pid, "")
        if isinstance(event, FrontendExited):
            if outcome.startswith("no incident"):  # stopped in order, its ranks left running: named
                self._submit(lambda: self._say("orphans", f"{event.describe()} ({outcome})", pids=event.left_alive))
            return
        orphaned = self._orphans.get(event.pid)
        if orphaned is not None:
            if outcome.startswith("no incident"):  # the operator's stop of what was left: the story's end
                self._note_orphan_end(orphaned, event)
            return
        if outcome.startswith("no incident"):
            stall = self._stall_incident_of(event)
            if stall is not None:
                self._note_ending(stall, event)  # e.g. the server killed itself after the hang
            else:
                self._stop_seen(event)
        if self.left_alive is not None:
            self._looking += 1
            if not self._submit(lambda: self._look_left_alive(event)):
                self._looking -= 1

    # -- the rules ------------------------------------------------------------------------------

    def _record(self, incident_id: str) -> Any:
        running = [*self.manager.running.values(), *([self.manager.current] if self.manager.current is not None else [])]
        return next((r for r in [*running, *reversed(self.manager.records)] if r.opened.incident_id == incident_id), None)

    def _frontend_fold(self, event: FrontendExited) -> Fold | None:
        """A frontend that died leaving ranks alive, after its server's own incident (a rank's
        crash it reacted to, a stall): that incident's story, named on it; else ``None`` (the
        incident of the processes left alive opens)."""
        server = self.manager.event_server(event)
        now = time.time_ns()
        followup_s = getattr(getattr(self.manager.exits, "config", None), "exit_followup_s", 60.0)
        running = [*self.manager.running.values(), *([self.manager.current] if self.manager.current is not None else [])]
        for record in [*running, *reversed(self.manager.records)]:
            if server is None or getattr(record, "server", None) != server:
                continue
            age_s = (now - record.opened.time_unix_nano) / 1e9
            if age_s > (STALL_ENDING_S if record.opened.trigger in HANG_TRIGGERS else max(followup_s, 1.0)):
                continue
            return self._fold_orphans(event, record)
        return None

    def _fold_orphans(self, event: FrontendExited, record: Any) -> Fold:
        incident_id = record.opened.incident_id
        for pid in event.left_alive:
            self._orphans[pid] = record
        self.manager.exits.exit_outcomes[event.pid] = f"no new incident: after incident {incident_id}"
        detail = f"{event.describe()}, after incident {incident_id}"
        self._submit(lambda: self._say("orphans", detail, pids=event.left_alive, record=record))
        return Fold(incident_id)

    def _note_orphan_end(self, record: Any, event: TargetExited) -> None:
        """A process left alive after its frontend died ended (the operator's stop, most often):
        the end of that incident's story, said on it; no incident of its own."""
        key = (record.opened.incident_id, event.pid)
        if key in self._ended:
            return
        self._ended.add(key)
        self._orphans.pop(event.pid, None)
        incident_id = record.opened.incident_id
        after_s = max(0.0, (event.time_unix_nano - record.opened.time_unix_nano) / 1e9)
        left = sum(1 for r in self._orphans.values() if r is record)
        detail = (f"left alive, then ended: {_who(event)} {event.exit.status_words()}, {after_s:.0f} s after incident"
                  f" {incident_id} opened" + (f" ({left} of its processes still alive)" if left else
                                               " (none of its processes left alive now)"))
        self.manager.exits.exit_outcomes[event.pid] = f"no new incident: the end of incident {incident_id}"
        self._submit(lambda: self._say("orphans_ended", detail, pids=(event.pid,), record=record,
                                       level=logging.WARNING if not left else logging.INFO))

    def _discover(self) -> list[Target]:
        try:
            return self.manager.discover()
        except Exception:  # discovery failing is no reason to stop judging
            log.exception("discovery for the server's lifecycle failed")
            return []

    def _restarting(self) -> bool:
        return bool(self._stop_ns) and (time.time_ns() - self._stop_ns) / 1e9 < RESTART_GRACE_S

    def _recovered(self, event: HealthCheckFailed) -> Fold | None:
        """Rule 1: a health failure whose check is healthy again opens no incident."""
        if self.recovered_ns <= event.time_unix_nano:
            return None
        after_s = (self.recovered_ns - event.time_unix_nano) / 1e9
        why = " after the server's stop and start" if self._restarting() else ""
        log.warning("health detected (%s), healthy again %.1f s later%s: no incident", event.describe(), after_s, why)
        return Fold(counted=False)

    def _health_during_stall(self, event: HealthCheckFailed) -> Fold | None:
        """Rule 2b: a health failure of a server whose stall incident opened before it and is not
        over joins that incident (said once on it; later failures are only logged)."""
        record = self._open_stall_before(event)
        if record is None:
            return None
        incident_id = record.opened.incident_id
        after_s = (event.time_unix_nano - record.opened.time_unix_nano) / 1e9
        detail = (f"health check failed during the stall: {event.describe()}, {after_s:.0f} s after incident"
                  f" {incident_id} opened; the same hang, no second incident")
        key = (incident_id, -1)
        if key in self._ended:
            log.info("lifecycle: %s", detail)
        else:
            self._ended.add(key)
            self._submit(lambda: self._say("health", detail, record=record))
        return Fold(incident_id)

    def _open_stall_before(self, event: HealthCheckFailed) -> Any:
        """The stall incident of ``event``'s server opened before it (within
        :data:`STALL_ENDING_S`) with no progress since, else ``None``."""
        server = self.manager.event_server(event)
        running = [*self.manager.running.values(), *([self.manager.current] if self.manager.current is not None else [])]
        for record in [*running, *reversed(self.manager.records)]:
            opened = record.opened
            if opened.trigger not in HANG_TRIGGERS or getattr(record, "server", None) != server:
                continue
            age_s = (event.time_unix_nano - opened.time_unix_nano) / 1e9
            if not 0.0 <= age_s <= STALL_ENDING_S:
                continue
            pids = {t.pid for t in record.targets}
            if any(self._rearmed_ns.get(pid, 0) > opened.time_unix_nano for pid in (*pids, None)):
                continue  # it stepped again: the stall was over before this failure
            return record
        return None

    def _stall_incident_of(self, event: TargetExited) -> Any:
        """The stall incident ``event``'s process was a target of, opened within
        :data:`STALL_ENDING_S` and whose stall is not over (no progress since), else ``None``."""
        if self.manager.exits.exit_outcomes.get(event.pid, "").endswith("after hard mode's signal"):
            return None  # hard mode's knock-on: already on the incident that signalled
        now = time.time_ns()
        running = [*self.manager.running.values(), *([self.manager.current] if self.manager.current is not None else [])]
        for record in [*running, *reversed(self.manager.records)]:
            opened = record.opened
            if opened.trigger not in HANG_TRIGGERS or (now - opened.time_unix_nano) / 1e9 > STALL_ENDING_S:
                continue
            pids = {t.pid for t in record.targets}
            if event.pid not in pids:
                continue
            if any(self._rearmed_ns.get(pid, 0) > opened.time_unix_nano for pid in (*pids, None)):
                continue  # it stepped again: the stall was over before this exit
            return record
        return None

    def _note_ending(self, record: Any, event: TargetExited) -> None:
        key = (record.opened.incident_id, event.pid)
        if key in self._ended:
            return
        self._ended.add(key)
        after_s = max(0.0, (event.time_unix_nano - record.opened.time_unix_nano) / 1e9)
        detail = (f"server ended after the stall: {_who(event)} {event.exit.status_words()}, {after_s:.0f} s after"
                  f" incident {record.opened.incident_id} opened")
        first = not any(line.startswith("server ended after the stall") for line in record.lifecycle)
        self.manager.exits.exit_outcomes[event.pid] = f"no new incident: the ending of stall incident {record.opened.incident_id}"
        self._submit(lambda: self._say("ending", detail, pids=(event.pid,), record=record,
                                       level=logging.WARNING if first else logging.INFO))

    def _crash_loop(self, event: TargetExited) -> Fold | None:
        """Rule 3: the same title's non-zero exit again, within the window of its last one."""
        key = (self.manager.event_server(event), event.title)
        loop = self._loops.get(key) if event.title else None
        now = time.monotonic()
        if loop is None or now - loop.last_s > CRASH_LOOP_WINDOW_S:
            return None
        loop.count += 1
        loop.last_s = now
        record = loop.record
        status = event.exit.status_words()
        incident_id = record.opened.incident_id
        self.manager.exits.exit_outcomes[event.pid] = f"no new incident: exit {loop.count} of incident {incident_id}"
        if loop.count >= CRASH_LOOP_EXITS:
            record.crash_loop_exits = loop.count
        if loop.count == CRASH_LOOP_EXITS:
            detail = (f"crash loop: {event.title!r} exited {loop.count} times in {now - loop.first_s:.0f} s ({status},"
                      f" last pid {event.pid}); its later exits are counted on incident {incident_id}")
        elif loop.count < CRASH_LOOP_EXITS:
            detail = f"{_who(event)} exited again ({status}): exit {loop.count} of incident {incident_id}"
        else:
            detail = ""
        if detail:
            self._submit(lambda: self._say("crash_loop", detail, pids=(event.pid,), record=record))
        else:  # counted, not said again (its manifest holds the count)
            log.info("lifecycle: %s exited again (%s): exit %d of crash loop incident %s", _who(event), status,
                     loop.count, incident_id)
            self._submit(lambda: self.manager.rewrite(record))
        return Fold(incident_id)

    def _stop_seen(self, event: TargetExited) -> None:
        """An orderly exit: the server may be stopping (and restarting): follow it."""
        self._stopped.add(event.pid)
        if not self._following:
            self._stop_ns = event.exit_time_unix_nano or event.time_unix_nano  # when it ended, else was seen
            self._following = True
            self._submit(self._follow_restart)

    async def _follow_restart(self) -> None:
        """Say the stop once its processes are gone (those that ran before it), the new
        processes found after it (once two looks agree), and the health check's recovery;
        bounded by :data:`RESTART_GRACE_S`."""
        since_ns = self._stop_ns
        # creation times are psutil's (boot time + ticks since boot): the stop's in that clock
        since_s = since_ns / 1e9 + await anyio.to_thread.run_sync(_creation_clock_offset_s)
        try:
            with anyio.move_on_after(RESTART_GRACE_S):
                await self._follow_until_recovered(since_ns, since_s)
        finally:
            self._following = False
            self._stopped.clear()

    async def _follow_until_recovered(self, since_ns: int, since_s: float) -> None:
        """:meth:`_follow_restart`'s looks, every :data:`FOLLOW_INTERVAL_S`, until the recovery is said."""
        gone = started = False
        seen: list[int] = []
        while True:
            live = await anyio.to_thread.run_sync(self._discover)
            new = [t for t in live if t.pid not in self._stopped and t.create_time_s > since_s]
            if not gone and len(new) == len(live):  # nothing that ran before the stop runs on
                gone = True
                await self._say("stopped", "server stopped: none of its watched processes runs any more"
                                f" ({len(self._stopped)} ended in order so far)", pids=tuple(sorted(self._stopped)))
            pids = [t.pid for t in new]
            if gone and not started and self._restart_seen(new, pids, seen, since_ns):
                started = True
                await self._say("started", "server started again: watching "
                                + ", ".join(f"pid {t.pid} {t.title!r}" for t in new),
                                pids=tuple(pids))
            seen = pids
            if started and self.recovered_ns > since_ns:
                await self._say("recovered", f"server healthy again {(self.recovered_ns - since_ns) / 1e9:.0f} s"
                                " after its stop")
                return
            await anyio.sleep(FOLLOW_INTERVAL_S)

    def _restart_seen(self, new: list[Target], pids: list[int], seen: list[int], since_ns: int) -> bool:
        """New processes run, and two looks agree on them or the health check recovered since the stop."""
        return bool(new) and (pids == seen or self.recovered_ns > since_ns)

    async def _look_left_alive(self, event: TargetExited) -> None:
        """Rule 4: what of ``event``'s tree still runs once it had time to go down."""
        try:
            await self._name_left_alive(event)
        finally:
            self._looking -= 1

    async def _name_left_alive(self, event: TargetExited) -> None:
        assert self.left_alive is not None
        left = await anyio.to_thread.run_sync(self.left_alive, event.pid)
        if not left:
            return
        await anyio.sleep(LEFT_ALIVE_SETTLE_S)
        left = await anyio.to_thread.run_sync(self.left_alive, event.pid)
        if not left:
            return
        held = await anyio.to_thread.run_sync(_rss_bytes, left)
        parents = sorted({await anyio.to_thread.run_sync(_parent_of, t.pid) for t in left[:1]})
        shown = ", ".join(f"pid {t.pid}" + (f" {t.title!r}" if t.title else "") for t in left[:6])
        detail = (f"{len(left)} process(es) of {_who(event)} still alive after it ended ({event.exit.status_words()})"
                  f"{' under pid ' + str(parents[0]) if parents and parents[0] else ''}, holding {_gb(held)}: {shown}"
                  + (", ..." if len(left) > 6 else ""))
        outcomes = self.manager.exits.exit_outcomes
        outcome = outcomes.get(event.pid, "")
        outcomes[event.pid] = f"{outcome}; {detail}" if outcome else detail
        record = None
        if outcome.startswith("incident "):
            incident_id = outcome.split()[1]
            record = next((r for r in reversed(self.manager.records) if r.opened.incident_id == incident_id), None)
        await self._say("orphans", detail, pids=tuple(t.pid for t in left), record=record)
