"""Agent: builds watchers, actors, incidents and exporters from :class:`Settings` and runs them.

Owns wiring and lifecycle only. :meth:`Agent.build` is the one wiring path (``run``, ``dump``,
``launch``, ``profile``): every watcher, actor and exporter comes from its registry
(:mod:`agent.registry`; :data:`agent.watchers.WATCHERS`, :data:`agent.actors.ACTORS`,
:data:`exporters.EXPORTERS`), imported only when built. The incident's phases are the registered
actors, in registration order. One anyio task group; watchers are started with ``tg.start`` so
"ready" means ready; targets are re-discovered periodically so a server that starts after the
agent (or restarts) is picked up; shutdown is bounded and flushes telemetry.

Imports the registries, the bus, incidents and targets, never a component module by name;
nothing imports this module except the CLI and tests.
"""

from __future__ import annotations

import logging
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from agent import pidfds
from agent.actors import ACTORS, Actor
from agent.bus import EventBus, Subscription
from agent.config import AgentSettings as Settings
from agent.events import (
    ActionCompleted,
    ActionResult,
    ComponentStatus,
    ComponentStatusChanged,
    IncidentOpened,
    Trigger,
    WatchdogStalled,
    WatcherStatusChanged,
)
from agent.fsutil import remove_stale_temps
from agent.history import ProgressHistory
from agent.incidents import (
    IncidentManager,
    IncidentRecord,
    InflightRequest,
    recover_interrupted,
)
from agent.judge import VerdictJudge
from agent.memory import limit_arenas, trim
from agent.procinfo import DEAD_MEMORY_S, Death, death_of, exit_noted_at, pid_alive
from agent.registry import BuildContext
from agent.targets import (
    NO_TARGET_WARNING,
    ProcessState,
    Target,
    discover,
    parent_pid,
    process_state,
    server_of,
    server_uids,
    spread_warning,
    target_of,
    zombie_descendants,
)
from agent.watchers import WATCHERS, TargetWatchers, Watcher
from agent.watchers.status import StatusBoard, WatcherState, WatcherStatus
from exporters import EXPORTERS

if TYPE_CHECKING:
    from exporters.metrics import Metrics
    from exporters.provider import Telemetry

__all__ = ["Agent", "AgentStatistics"]

log = logging.getLogger("servewatch.runtime")

#: Seconds between target re-discovery scans.
REDISCOVER_INTERVAL_S = 2.0
#: Once the same targets were found for :data:`REDISCOVER_STABLE_AFTER_S`, full scans (every
#: process's parent, host-wide) run this often; in between, every :data:`REDISCOVER_INTERVAL_S`,
#: only the known targets are checked (a signal 0 each), and one that is gone brings a full scan
#: at once and the short interval back.
REDISCOVER_STABLE_INTERVAL_S = 10.0
REDISCOVER_STABLE_AFTER_S = 30.0
#: Targets remembered after they were last seen alive (to report a rank that died as dead).
MAX_REMEMBERED_TARGETS = 4096
#: A dead rank is evidence of an incident when it died at most ``2 * watchdog.timeout_s`` plus
#: this many seconds before it (its siblings hang from its death, and the watchdog fires one
#: timeout later), or, for a crash (not exit 0 / SIGTERM / SIGINT), since the previous incident.
DEAD_RANK_MARGIN_S = 60.0
#: Seconds between the event loop's heartbeats to the span rings (the drain thread also beats at
#: every poll; a server falls back after 2 s without one).
SPANS_HEARTBEAT_INTERVAL_S = 1.0
#: Seconds between checks that a target whose SDK step counter is watched still runs.
TARGET_ALIVE_INTERVAL_S = 2.0
#: Least seconds between two updates of the span shipping COUNTS in the status file (checked at
#: every heartbeat; a change of state, e.g. a ring refused, is written at once). Under load the
#: counts change every second: each rewrite of the status file is agent CPU (soak, issue 15).
SPANS_STATUS_INTERVAL_S = 5.0
#: Seconds between checks of span delivery (the ``export`` row of the status board: a refusal
#: shows there within this long; the console line is said by the processor at once).
DELIVERY_STATUS_INTERVAL_S = 1.0
#: Seconds between returning the agent's freed heap memory to the OS (:func:`agent.memory.trim`).
TRIM_INTERVAL_S = 60.0
#: Upper bound on flushing telemetry at shutdown, seconds.
SHUTDOWN_DEADLINE_S = 3.0
#: A crashed watcher is restarted after this many seconds, doubling up to the maximum.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 60.0
#: Events buffered for the span mirror and the metrics recorder (incident and action events
#: wait for room, never dropped; nothing high-rate is subscribed).
MIRROR_BUFFER = 4096


class AgentStatistics(dict[str, Any]):
    """Counters of a finished run (``incidents``, ``suppressed``, bus statistics...)."""


def _sdk_folder_refusals(targets: Sequence[Target]) -> list[str]:
    """Why the SDK folder name of a target's user was not trusted (another user took it), one
    line each (:func:`agent.sdk.folders.refusals`). Blocking: ``lstat`` calls."""
    from agent.sdk.folders import refusals

    return refusals(sorted({t.uid for t in targets if t.uid is not None}))


class Agent:
    """The servewatch agent.

    Args:
        settings: merged user settings.
        telemetry: span export to use; default built from ``settings.export`` and ``OTEL_*``.
        children: processes this agent launched (``servewatch launch``): their exit status is
            read from the ``Popen`` so nothing steals it.
        on_incident: called with each finished incident record (CLI summaries, the demo).
        extra_targets: called at each discovery to add targets (the demo, launch).

    Attributes:
        bus: the event bus.
        incidents: the incident manager (``incidents.records`` after a run).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        telemetry: Telemetry | None = None,
        children: Sequence[subprocess.Popen[Any]] = (),
        on_incident: Callable[[IncidentRecord], None] | None = None,
        on_status: Callable[[WatcherStatus], None] | None = None,
        on_summary: Callable[[IncidentRecord], None] | None = None,
    ) -> None:
        self.settings = settings
        self._stop_reason = "agent stopping"
        self.on_status = on_status
        self.bus = EventBus()
        self.telemetry = telemetry
        self._own_telemetry = telemetry is None
        self.children = list(children)
        self.context = BuildContext(
            agent=settings.agent_values(), children=self.children, stalled=self._stalled,
            on_status_change=self._status_changed if on_status is not None else None,
        )
        #: built components by name (registration order); exporters of the ``start`` stage are
        #: added when the agent runs or dumps
        self.watchers: dict[str, Any] = WATCHERS.build(settings, self.context)
        self.actors: dict[str, Actor] = ACTORS.build(settings, self.context)
        self.exporters: dict[str, Any] = EXPORTERS.build(settings, self.context)
        #: what every watcher can see (``servewatch status``, ``/v1/status``): the ``status`` exporter
        status = self.exporters.get("status")
        self.status: StatusBoard = status if isinstance(status, StatusBoard) else StatusBoard(host_name=settings.host_name)
        wd = settings.watchdog
        #: the server's recent history from the bus (step readings, stalls, health, exits)
        self.history = ProgressHistory()
        self.incidents = IncidentManager(
            bus=self.bus,
            config=settings.incident,
            data_dir=settings.data_dir,
            host_name=settings.host_name,
            discover=self.incident_targets,
            discover_for=self.incident_targets,
            actors=list(self.actors.values()),
            inflight=self._inflight,
            on_incident=on_incident,
            hard_signal=wd.signal_number if wd.hard else None,
            on_summary=on_summary,
            hard_targets=wd.hard_targets,
            judge=VerdictJudge(endpoint_urls=(settings.metrics.url or "", settings.health.url or "")),
            history=self.history,
        )
        #: per-target step watchers, keyed by (pid, create time): cancelled when it exits
        self._step_scopes: dict[tuple[int, float], anyio.CancelScope] = {}
        #: watcher restarts after a crash, by name
        self.restarts: dict[str, int] = {}
        self._told_no_target = False
        #: the ``--root-pid`` process as identified at start (its exit ends the watch)
        self._root: Target | None = None
        self._warned_spread = False
        #: processes discovery left out for their uid, ``{pid: why}`` (the last round)
        self.refused_targets: dict[int, str] = {}
        self._refused_told: dict[int, str] = {}
        self._seen: dict[int, tuple[Target, float]] = {}
        #: each remembered target's job: the process it hung off when first seen (its server)
        self._job_of: dict[int, int | None] = {}
        self._ready = anyio.Event()
        self._stop = anyio.Event()
        #: the API and job coordinator (:class:`agent.fleet.Fleet`) once running, when ``api.enabled``
        self.fleet: Any = None
        #: ships the targets' SDK request/forward spans (the ``span_shipper`` exporter), set by run()
        self.shipper: Any = None
        self._spans_printed: tuple[Any, str] | None = None
        #: the telemetry's counts after a one-shot command closed it (:meth:`dump`, :meth:`profile`)
        self.export_statistics: Any = None

    @classmethod
    def build(
        cls,
        settings: Settings,
        *,
        telemetry: Telemetry | None = None,
        children: Sequence[subprocess.Popen[Any]] = (),
        on_incident: Callable[[IncidentRecord], None] | None = None,
        on_status: Callable[[WatcherStatus], None] | None = None,
        on_summary: Callable[[IncidentRecord], None] | None = None,
    ) -> Agent:
        """Build an agent from ``settings``: every registered watcher, actor and exporter whose
        factory returns one (the registries' order), the incident manager over the actors.

        Args:
            settings: merged user settings.
            telemetry: span export to use (the caller then owns it); default: the ``otlp``
                exporter builds one from ``settings.export`` and ``OTEL_*`` when the agent starts.
            children: processes this agent launched (``servewatch launch``): their exit status is
                read from the ``Popen`` so nothing steals it.
            on_incident: called with each finished incident record (CLI summaries, the demo).
            on_status: called with each watcher status change.
            on_summary: called when an incident's summary evidence is in (before deferred phases).

        Raises:
            ImportError: a registered factory's module is missing (a packaging error).
        """
        return cls(settings, telemetry=telemetry, children=children, on_incident=on_incident,
                   on_status=on_status, on_summary=on_summary)

    @property
    def process_watcher(self) -> Any:
        """The ``process`` watcher (exit of every target; ``launch`` hands it its child)."""
        return self.watchers["process"]

    def _subscribe_exporters(self) -> list[tuple[Any, Subscription]]:
        """A bounded bus subscription for every started exporter that mirrors events (it has
        ``events``, the event types, and ``handle(event)``; e.g. the span ``mirror``)."""
        return [
            (exporter, self.bus.subscribe(*exporter.events, name=name, max_buffer=MIRROR_BUFFER))
            for name, exporter in self.exporters.items()
            if getattr(exporter, "events", None) and callable(getattr(exporter, "handle", None))
        ]

    def _start_exporters(self, *, one_shot: bool = False) -> None:
        """Build the exporters of the ``start`` stage, ``otlp`` first (the others attach to it)."""
        ctx = replace(self.context, stage="start", one_shot=one_shot, telemetry=self.telemetry)
        for entry in EXPORTERS:
            if entry.name in self.exporters:
                continue
            component = entry.build(self.settings, ctx)
            if component is None:
                continue
            self.exporters[entry.name] = component
            if entry.name == "otlp":
                self.telemetry = component
                ctx = replace(ctx, telemetry=component)

    # -- discovery ----------------------------------------------------------------------------

    def discover(self) -> list[Target]:
        """Current targets per ``settings.target`` (plus launched children)."""
        t = self.settings.target
        root_pids = list(filter(None, [t.root_pid])) + [c.pid for c in self.children]
        refused: dict[int, str] = {}
        found = discover(root_pids=root_pids, title_globs=t.match, pids=t.pids, uids=t.uids, any_uid=t.any_uid, refused=refused)
        for pid, why in refused.items():
            if self._refused_told.get(pid) != why:
                log.warning("not a target: %s", why)  # once per process: discovery says whom it refused and why
        self.refused_targets = refused
        self._refused_told = {pid: refused[pid] for pid in refused}
        for target in found:  # identified: signals to them go through these pidfds, never to a reused pid
            pidfds.hold(target)
        self._remember(found)
        if not self._warned_spread:
            warning = spread_warning(found, title_globs=t.match, root_pids=root_pids)
            if warning is not None:
                self._warned_spread = True  # once per agent: the operator has been told
                log.warning("%s", warning)
        return found

    def _remember(self, found: Sequence[Target]) -> None:
        """Keep the targets seen alive (bounded), so one that dies is still reported in incidents,
        with its job (:func:`~agent.targets.server_of`, read once, when it is first seen)."""
        now = time.monotonic()
        pids = [t.pid for t in found]
        for target in found:
            known = self._seen.get(target.pid)
            if known is None or known[0].create_time_s != target.create_time_s:
                self._job_of[target.pid] = server_of(target.pid, pids)
            self._seen[target.pid] = (target, now)
        if len(self._seen) > MAX_REMEMBERED_TARGETS:
            for pid, _ in sorted(self._seen.items(), key=lambda item: item[1][1])[: len(self._seen) - MAX_REMEMBERED_TARGETS]:
                del self._seen[pid]
                self._job_of.pop(pid, None)

    def _incident_jobs(self, live: Sequence[Target], subject: int | None) -> set[int] | None:
        """The jobs (servers) whose dead ranks belong to an incident: the subject's (the stalled
        or exited pid), else every job with a live target; ``None`` (no filter) when neither is
        known (every target is gone)."""
        job = self._job_of.get(subject) if subject is not None else None
        if job is not None:
            return {job}
        pids = [t.pid for t in live]
        jobs = {job for t in live if (job := self._job_of.get(t.pid) or server_of(t.pid, pids)) is not None}
        return jobs or None

    def _previous_incident_mono(self) -> float:
        """When this agent's last incident opened, on :func:`time.monotonic`'s clock (-inf: none)."""
        records = self.incidents.records
        if not records:
            return float("-inf")
        age_s = (time.time_ns() - records[-1].opened.time_unix_nano) / 1e9
        return time.monotonic() - max(0.0, age_s)

    def _dead_rank_counts(self, target: Target, death: Death, seen: float, now: float) -> bool:
        """Whether a dead target of the incident's job died recently enough to be its evidence
        (see :data:`DEAD_RANK_MARGIN_S`): an orderly exit (0, SIGTERM, SIGINT, 143, 130) only
        within the window, a crash also when it came after the previous incident."""
        died = exit_noted_at(target.pid, target.create_time_s) or seen  # else: after it was last seen alive
        if died >= now - (2 * self.settings.watchdog.timeout_s + DEAD_RANK_MARGIN_S):
            return True
        orderly = death.signal in (signal.SIGTERM, signal.SIGINT) or (
            death.signal is None and death.exit_code in (0, 128 + signal.SIGTERM, 128 + signal.SIGINT)
        )
        return not orderly and died >= self._previous_incident_mono()

    def incident_targets(self, subject: int | None = None) -> list[Target]:
        """Targets of an incident: the live ones, plus the dead ranks that are its evidence.

        A target seen alive within :data:`~agent.procinfo.DEAD_MEMORY_S` that died since (or a
        zombie of the watched trees) is in the incident, reported as dead with its exit status,
        when it is of the incident's job (:meth:`_incident_jobs`: the tree of ``subject``, the
        pid whose stall or exit opened it, else of the live targets) and died recently enough
        (:meth:`_dead_rank_counts`). A host-wide ``--match`` thus never adds other servers' dead
        processes, nor a rank that stopped in order long ago.

        Args:
            subject: the pid whose stall or exit opens the incident (``None``: health, manual).
        """
        live = self.discover()
        pids = {t.pid for t in live}
        now = time.monotonic()
        horizon = now - DEAD_MEMORY_S
        jobs = self._incident_jobs(live, subject)
        dead: list[Target] = []
        for pid, (target, seen) in list(self._seen.items()):
            if pid in pids or seen < horizon:
                continue
            if pid != subject and jobs is not None and self._job_of.get(pid) not in jobs:
                continue  # another server's process
            death = death_of(target)
            if death is not None and (pid == subject or self._dead_rank_counts(target, death, seen, now)):
                dead.append(target)
        t = self.settings.target
        roots = list(filter(None, [t.root_pid])) + [c.pid for c in self.children]
        if not roots and t.match:
            # host-wide --match: a dead rank is a zombie beside its live siblings, under their parent
            roots = sorted({ppid for ppid in (parent_pid(x.pid) for x in live) if ppid and ppid > 1})
            if jobs is not None:
                roots = [r for r in roots if r in jobs]
        known = pids | set(self._seen)  # a zombie seen alive was judged above
        dead += [  # never seen alive by this agent (`servewatch dump`): zombies of the watched trees
            z for z in zombie_descendants(roots, t.match)
            if z.pid not in known and (t.any_uid or z.uid in server_uids(uids=t.uids, root_pids=roots, pids=t.pids))
        ]
        return sorted([*live, *dead], key=lambda t: t.pid)

    # -- hooks the components get (BuildContext) -------------------------------------------

    def _stalled(self, targets: Sequence[Target]) -> bool:
        """A target's SDK counter says busy with no step for the watchdog timeout (any trigger)."""
        from agent.watchers.steps import ShmStepSource

        timeout_ns = int(self.settings.watchdog.timeout_s * 1e9)
        now = time.monotonic_ns()
        for target in targets:
            reading = ShmStepSource(target.pid).read_now()
            if reading is None or not reading.busy or reading.last_progress_monotonic_ns is None:
                continue
            if now - reading.last_progress_monotonic_ns >= timeout_ns:
                return True
        return False

    async def _inflight(self, targets: Sequence[Target]) -> list[InflightRequest]:
        from agent.sdkclient import read_inflight

        return await read_inflight(targets, socket_dir=self.context.agent.sdk_socket_dir)

    # -- one-shot commands (same build path as run) -----------------------------------------

    async def _close_telemetry(self, deadline_s: float | None = SHUTDOWN_DEADLINE_S) -> None:
        """Flush and shut down our own telemetry within ``deadline_s`` seconds (``None``:
        ``export.shutdown_timeout_s``); the counts end up in :attr:`export_statistics` (a
        caller's own telemetry is left open)."""
        if self._own_telemetry and self.telemetry is not None:
            bound_s = (deadline_s if deadline_s is not None else self.settings.export.shutdown_timeout_s) + 1
            with anyio.CancelScope(shield=True), anyio.move_on_after(bound_s):
                self.export_statistics = await self.telemetry.aclose(deadline_s)

    async def dump(self, *, handle_signals: bool = False) -> IncidentRecord:
        """One manual incident now (``servewatch dump``): every registered actor's phase over the
        targets, bundle and spans written through the registered exporters.

        Telemetry is flushed and shut down within ``export.shutdown_timeout_s`` afterwards (unless
        the agent was given ``telemetry``, which the caller then owns); its counts are left in
        :attr:`export_statistics`.

        Args:
            handle_signals: SIGTERM/SIGINT (main thread only) finish the current phase within
                ``incident.interrupt_grace_s``, then cut the incident short: the record comes
                back ``interrupted`` with what was captured, like ``servewatch run``.

        Raises:
            RuntimeError: interrupted before the incident opened.
        """
        await anyio.to_thread.run_sync(_remove_stale_temps, self.settings.data_dir)
        # the span files, spool and their folders: file system work, off the loop
        await anyio.to_thread.run_sync(partial(self._start_exporters, one_shot=True))
        if self.incidents.judge is not None:  # one-shot: no torch import racing the dump's own CPU
            self.incidents.judge.warm_up = False
        feeds = self._subscribe_exporters()
        try:
            async with anyio.create_task_group() as tg:
                for exporter, sub in feeds:
                    tg.start_soon(mirror_events, exporter, sub)
                await self._check_actors()
                targets = await anyio.to_thread.run_sync(self.discover)  # a /proc scan
                signal_scope = anyio.CancelScope()
                with anyio.CancelScope() as incident_scope:
                    if handle_signals:
                        tg.start_soon(_interrupt_on_signal, self, incident_scope, signal_scope)
                    await self.incidents.open_incident(
                        Trigger.MANUAL, detail=f"servewatch dump of {len(targets)} process(es)"
                    )
                signal_scope.cancel("dump done")
                if not self.incidents.records:
                    raise RuntimeError("servewatch dump was interrupted before its incident opened")
                record = self.incidents.records[-1]
                await self.bus.aclose()  # the exporters drain what is buffered, then end
        finally:
            for _, sub in feeds:
                sub.close()
            await self._close_telemetry(None)
        return record

    async def profile(
        self,
        *,
        pid: int | None,
        steps: int,
        start_step: int | None = None,
        activities: Sequence[str] | None = None,
        out_dir: Path,
        timeout_s: float | None = None,
        before_export: Callable[[], None] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> tuple[ActionResult, str | None]:
        """One profiling session now (``servewatch profile``) per ``settings.profiler``, mirrored
        as a ``profile.session`` trace through the registered exporters (then flushed and shut
        down, as :meth:`dump`).

        Args:
            pid: the target serving the SDK control socket (backend ``sdk``; ``None``: the only one).
            steps: forward steps to capture (``num_steps``).
            start_step: start once ``forward_ct`` reaches this step.
            activities: ``CPU``, ``GPU``, ``MEM``... (default: the settings').
            out_dir: where the trace files go.
            timeout_s: wall-clock bound of the session, seconds (default: ``profiler.max_duration_s``).
            before_export: called (in a worker thread) before the exporters start, only when
                something is exported: the CLI creates and checks the data dir there.
            progress: called with one line on what the session waits for now (the CLI's
                progress line).

        Returns:
            The session's result (outcome, trace files) and the hex trace id of its spans;
            ``None`` when the session wrote no trace file and spans go to the embedded files:
            then nothing is exported and no folder is created (a failed profile leaves nothing
            behind). With a collector configured a failed session is exported too (its
            ``profile.session`` span says why), through the spool in the data dir as any export.
        """
        from agent.actors.profiler import profile_once
        from exporters.mirror import mirror_profile_session
        from exporters.provider import resolve_destination

        result = await profile_once(
            self.settings.profiler, pid=pid, steps=steps, start_step=start_step, activities=activities,
            out_dir=out_dir, timeout_s=timeout_s, progress=progress,
        )
        if not result.artifact_paths and resolve_destination(self.settings.export).endpoint is None:
            return result, None
        if before_export is not None:
            await anyio.to_thread.run_sync(before_export)  # the data dir: file system
        self._start_exporters(one_shot=True)
        assert self.telemetry is not None, "the otlp exporter is registered"
        try:
            trace_id = await anyio.to_thread.run_sync(mirror_profile_session, self.telemetry.sink, result)
        finally:
            await self._close_telemetry(None)
        return result, trace_id

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def watched_step_pids(self) -> frozenset[int]:
        """Pids whose SDK step counter is being watched for stalls."""
        return frozenset(pid for pid, _ in self._step_scopes)

    def _status_changed(self, status: WatcherStatus) -> None:
        if status.name == "export":
            return  # said by the span processor when it happened (once per cause), not twice
        if status.name == "spans":
            # the shipped count moves every few seconds: print when anything else changes
            key = (status.state, re.sub(r"\d+ shipped", "", status.reason))
            if key == self._spans_printed:
                return
            self._spans_printed = key
        if self.on_status is not None:
            try:
                self.on_status(status)
            except Exception:  # a printing callback must never take the agent down
                log.exception("status callback failed")

    def stop(self, reason: str = "agent stopping") -> None:
        """Ask :meth:`run` to finish (bounded shutdown follows).

        An incident running now finishes its current phase (up to
        ``incident.interrupt_grace_s``), skips the rest and is written ``interrupted``.
        """
        self._stop_reason = reason
        self._stop.set()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def _show_incidents(self, state: dict[str, Any]) -> None:
        """The incidents' state (open, stalled, suppressed) into the status file, off the loop."""
        self.status.set_incidents(state)
        await anyio.to_thread.run_sync(self.status.write)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> AgentStatistics:
        """Run until :meth:`stop` (or cancellation); then shut down within a few seconds."""
        s = self.settings
        limit_arenas()  # before the export, shipper and worker threads start: a flat RSS over days
        await anyio.to_thread.run_sync(_remove_stale_temps, s.data_dir)
        await anyio.to_thread.run_sync(self._start_exporters)  # span files, spool: off the loop
        assert self.telemetry is not None, "the otlp exporter is registered"
        feeds = self._subscribe_exporters()
        metrics_sub = self.bus.subscribe(
            IncidentOpened, ActionCompleted, WatchdogStalled, name="metrics", max_buffer=MIRROR_BUFFER
        )
        status_sub = self.bus.subscribe(WatcherStatusChanged, ComponentStatusChanged, name="status", max_buffer=MIRROR_BUFFER)
        self.telemetry.metrics.watch_bus(lambda: self.bus.statistics().dropped)
        watch_status = getattr(self.telemetry.metrics, "watch_status", None)
        if watch_status is not None:
            watch_status(self.status.states)
        self.shipper = self.exporters.get("span_shipper")
        try:
            async with anyio.create_task_group() as outer:
                for exporter, sub in feeds:
                    outer.start_soon(mirror_events, exporter, sub)
                outer.start_soon(self._record_metrics, self.telemetry.metrics, metrics_sub)
                outer.start_soon(self._record_status, status_sub)
                for actor in self.actors.values():
                    warm_up = getattr(actor, "warm_up", None)
                    if warm_up is not None:  # slow imports paid now, off the loop, not mid-incident
                        outer.start_soon(partial(anyio.to_thread.run_sync, warm_up, abandon_on_cancel=True))
                try:
                    async with anyio.create_task_group() as tg:
                        try:
                            # what a killed agent left: bundles to close, spans that never became durable
                            durable = getattr(self.telemetry, "durable_keys", None)
                            await recover_interrupted(self.bus, s.data_dir, s.host_name, durable=durable)
                        except Exception:  # a bad old bundle must not stop the agent
                            log.exception("closing interrupted incidents failed")
                        # SDK files (counters, sockets) that processes of our uid left when they died
                        await anyio.to_thread.run_sync(_remove_dead_sdk_files, s.profiler.socket_dir)
                        self.incidents.on_state = self._show_incidents
                        await tg.start(self.history.run, self.bus)  # before the watchers publish
                        await tg.start(self.incidents.run)
                        if s.api.enabled:
                            from agent.actors.flightrec import FlightRecorderActor
                            from agent.fleet import Fleet

                            # the stuck collective names a job incident's trace: read with the Flight Recorder actor
                            fr = self.actors.get("flightrec")
                            self.fleet = Fleet(self, s.api, s.fleet, fr_reader=fr if isinstance(fr, FlightRecorderActor) else None)
                            await tg.start(self.fleet.run)
                        await self._start_watchers(tg)
                        if self.shipper is not None:
                            tg.start_soon(self._ship_spans, self.shipper)
                        tg.start_soon(self._watch_delivery, self.telemetry)
                        tg.start_soon(_trim_memory, TRIM_INTERVAL_S)
                        self._ready.set()
                        task_status.started()
                        await self._stop.wait()
                        if self.incidents.interrupt(self._stop_reason):
                            grace_s = s.incident.interrupt_grace_s
                            log.warning("%s during an incident: finishing its current phase (up to %g s)",
                                        self._stop_reason, grace_s)
                            await self.incidents.wait_idle(grace_s)
                        tg.cancel_scope.cancel("agent stopping")
                finally:
                    # the exporters drain what the bus still holds, then end
                    await self.bus.aclose()
        finally:
            for _, sub in feeds:
                sub.close()
            metrics_sub.close()
            status_sub.close()
            if self.shipper is not None:  # last drain, then servers fall back to their own path
                with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_DEADLINE_S):
                    await anyio.to_thread.run_sync(self.shipper.close, abandon_on_cancel=True)
            await self._close_telemetry()
        stats = AgentStatistics(
            incidents=len(self.incidents.records),
            suppressed=self.incidents.suppressed,
            bus=self.bus.statistics()._asdict(),
            spans=self.shipper.statistics().to_dict() if self.shipper is not None else None,
        )
        return stats

    @staticmethod
    async def _record_metrics(metrics: Metrics, sub: Subscription) -> None:
        """Internal metrics from bus events: incidents by trigger, action outcomes, detection latency."""
        async for event in sub:
            if isinstance(event, IncidentOpened):
                metrics.incident_opened(event.trigger)
            elif isinstance(event, ActionCompleted):
                metrics.action_done(event.result.action, event.result.outcome.value)
            elif isinstance(event, WatchdogStalled):
                # how late the stall was reported after it became one (last progress + timeout)
                metrics.detection_latency(event.stalled_for_s - event.timeout_s, trigger=Trigger.STALL)

    async def _record_status(self, sub: Subscription) -> None:
        """Keep :attr:`status` current from the watchers' status events (and py-spy's)."""
        async for event in sub:
            if isinstance(event, WatcherStatusChanged):
                try:
                    state = WatcherState(event.state)
                except ValueError:
                    continue
                before = self.status.get(event.watcher)
                # the spans line changes with every count (up to once a second): logged when
                # its state changes, not at each new count
                counts_only = event.watcher == "spans" and before is not None and before.state is state is WatcherState.READY
                # the export row: the span processor says a refusal itself, once, at once
                said = event.watcher == "export"
                changed = self.status.set(event.watcher, state, event.reason, write=False, log_change=not (counts_only or said))
            elif isinstance(event, ComponentStatusChanged) and event.component in self.actors:
                ok = event.status is ComponentStatus.OK  # an actor's startup check (py-spy's binary)
                changed = self.status.set(
                    event.component,
                    WatcherState.READY if ok else WatcherState.BLIND,
                    f"ready: {event.detail}" if ok and event.detail else (event.detail or event.status.value),
                    write=False,
                )
            else:
                continue
            if changed:
                await anyio.to_thread.run_sync(self.status.write)  # the status file, off the loop

    async def _watch_delivery(self, telemetry: Telemetry) -> None:
        """Keep the ``export`` row of the status board current: ``blind`` while the collector
        refuses or rejects spans (with its words and the fix), ``waiting`` while it is
        unreachable, ``ready`` otherwise; a new state at once, new counts at most every
        :data:`SPANS_STATUS_INTERVAL_S`."""
        delivery_status = getattr(telemetry, "delivery_status", None)
        if delivery_status is None:
            return
        shown: tuple[str, str] | None = None
        next_counts = 0.0
        while True:
            state, reason = delivery_status()
            now = anyio.current_time()
            if (state, reason) != shown and (shown is None or state != shown[0] or state != "ready" or now >= next_counts):
                shown = (state, reason)
                next_counts = now + SPANS_STATUS_INTERVAL_S
                await self._set_status("export", WatcherState(state), reason)
            await anyio.sleep(DELIVERY_STATUS_INTERVAL_S)

    async def _set_status(self, name: str, state: WatcherState, reason: str) -> None:
        """Publish a status the runtime itself decides (steps, process, a crashed watcher)."""
        await self.bus.publish(WatcherStatusChanged(source="runtime", watcher=name, state=state.value, reason=reason))

    async def supervised(
        self,
        name: str,
        make: Callable[[], Any],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the watcher ``make()`` returns; when it raises, report ``name`` blind with the
        exception and start a fresh one after a jittered backoff (1 s doubling to 60 s; reset
        after a minute without a crash). Never raises except cancellation.

        Ready when the first watcher is ready (or has failed once).
        """
        delay_s = RESTART_BACKOFF_S
        started = False
        while True:
            watcher = make()
            began = time.monotonic()
            try:
                async with anyio.create_task_group() as inner:
                    await inner.start(watcher.run, self.bus)
                    if not started:
                        started = True
                        task_status.started()
                return  # a watcher that returns is done
            except Exception as exc:  # the supervisor's boundary: a crash becomes a status
                if time.monotonic() - began > RESTART_BACKOFF_MAX_S:
                    delay_s = RESTART_BACKOFF_S
                while True:  # unwrap exception groups of one
                    group: tuple[BaseException, ...] = getattr(exc, "exceptions", ())
                    if len(group) != 1 or not isinstance(group[0], Exception):
                        break
                    exc = group[0]
                self.restarts[name] = self.restarts.get(name, 0) + 1
                log.error("watcher %s crashed; restarting in %.0f s", name, delay_s, exc_info=exc)
                await self._set_status(
                    name, WatcherState.BLIND,
                    f"watcher crashed: {type(exc).__name__}: {str(exc)[:200]}; restarting in {delay_s:.0f} s",
                )
            finally:
                source = getattr(watcher, "source", None)
                aclose = getattr(source, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                        await aclose()
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(delay_s * random.uniform(0.8, 1.2))
            delay_s = min(delay_s * 2, RESTART_BACKOFF_MAX_S)

    async def _ship_spans(self, shipper: Any) -> None:
        """Drain the span rings on the shipper's low-priority thread (it and the export worker run
        at nice +10: the served process comes first); heartbeat (every
        :data:`SPANS_HEARTBEAT_INTERVAL_S`, so a starved drain thread never makes servers fall
        back) and status from here."""
        from exporters.shipper import lower_thread_priority

        interval = shipper.poll_interval_s
        shipper.start(interval)
        worker = getattr(self.telemetry.processor, "_thread", None) if self.telemetry is not None else None
        if worker is not None and worker.native_id is not None:
            lower_thread_priority(native_id=worker.native_id)
        next_status = 0.0
        shown: tuple[WatcherState, str] | None = None
        while True:
            shipper.heartbeat_all()
            now = anyio.current_time()
            # `servewatch status` shows the counts (both sides' drops)
            stats, refused = shipper.statistics(), shipper.refused()
            if stats.rings or stats.shipped or stats.dropped or stats.fallback_spans:
                status = (WatcherState.READY, stats.line())
            elif refused:
                pid, why = next(iter(refused.items()))
                status = (WatcherState.BLIND, f"span ring of pid {pid} not shipped: {why}")
            else:
                status = (WatcherState.WAITING, "no SDK span ring in the targets yet (servers export their own spans)")
            # a new state at once; new counts at most every SPANS_STATUS_INTERVAL_S
            if status != shown and (shown is None or status[0] is not shown[0] or now >= next_status):
                shown = status
                next_status = now + SPANS_STATUS_INTERVAL_S
                await self._set_status("spans", *status)
            await anyio.sleep(max(interval, SPANS_HEARTBEAT_INTERVAL_S))

    async def _start_watchers(self, tg: TaskGroup) -> None:
        s = self.settings
        t = s.target
        if not (t.pids or t.match or t.root_pid or self.children):
            log.warning("%s", NO_TARGET_WARNING)  # a health/metrics-only watch: incidents dump nothing
        await self._check_actors()
        if self._has_targets():
            await self._set_status("process", WatcherState.WAITING, self._looking_for())
        for name, watcher in self.watchers.items():
            if isinstance(watcher, TargetWatchers):
                continue  # started per target by discovery
            await tg.start(self.supervised, name, self._maker(name, watcher))
        await tg.start(self._supervise, tg)

    def _maker(self, name: str, first: Watcher) -> Callable[[], Watcher]:
        """The built watcher first; after a crash a fresh one from the registry (the same one
        when it sets ``reusable = True``, e.g. ``process``, which holds what it watches)."""
        built = [first]

        def make() -> Watcher:
            if built:
                return built.pop()
            if getattr(first, "reusable", False):
                return first
            fresh = WATCHERS.get(name).build(self.settings, self.context)
            return fresh if fresh is not None else first

        return make

    async def _check_actors(self) -> None:
        """Each actor's startup check (``check()``, when it has one: py-spy's binary) becomes its
        component status, and a status row; the agent keeps running either way."""
        for name, actor in self.actors.items():
            check = getattr(actor, "check", None)
            if check is None:
                continue
            status, detail = await anyio.to_thread.run_sync(check)  # stats a binary: off the loop
            await self.bus.publish(ComponentStatusChanged(source="runtime", component=name, status=status, detail=detail))
            if status is not ComponentStatus.OK:
                log.warning("%s unavailable: %s", name, detail)

    def _has_targets(self) -> bool:
        t = self.settings.target
        return bool(t.pids or t.match or t.root_pid or self.children)

    def _looking_for(self) -> str:
        t = self.settings.target
        what = []
        if t.pids:
            what.append("pids " + ", ".join(map(str, t.pids)))
        if t.root_pid or self.children:
            what.append("descendants of " + ", ".join(str(p) for p in [t.root_pid, *(c.pid for c in self.children)] if p))
        if t.match:
            what.append("titles " + ", ".join(t.match))
        return f"waiting for a target process ({'; '.join(what)}); looking every {REDISCOVER_INTERVAL_S:g} s"

    async def _watch_target_steps(
        self, target: Target, watchers: Sequence[Watcher], *,
        task_status: TaskStatus[anyio.CancelScope] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run one target's own watchers (the ``steps`` watchdog and step watcher of its SDK
        counter) until it exits."""
        with anyio.CancelScope() as scope:
            try:
                async with anyio.create_task_group() as tg:
                    for watcher in watchers:
                        await tg.start(watcher.run, self.bus)
                    task_status.started(scope)
                    while process_state(target.pid, create_time_s=target.create_time_s or 0.0) not in (
                        ProcessState.GONE, ProcessState.ZOMBIE
                    ):
                        await anyio.sleep(TARGET_ALIVE_INTERVAL_S)
                    tg.cancel_scope.cancel("target exited")
            finally:
                self._step_scopes.pop((target.pid, target.create_time_s), None)

    async def _supervise(self, tg: TaskGroup, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Re-discover targets; watch new ones for exit and, with an SDK counter, for stalls.

        A failure of one round is logged and reported (``process`` blind) and the next round
        runs as usual: discovery never takes the agent down.
        """
        started = False
        found: frozenset[tuple[int, float]] = frozenset()
        same_since = time.monotonic()
        while True:
            try:
                targets = await self._discover_round(tg)
                now = time.monotonic()
                keys = frozenset((t.pid, t.create_time_s) for t in targets)
                if keys != found:
                    found, same_since = keys, now
            except Exception as exc:  # the boundary: a bug in one round must not stop the agent
                log.exception("target discovery round failed")
                await self._set_status(
                    "process", WatcherState.BLIND,
                    f"discovery failed: {type(exc).__name__}: {str(exc)[:200]}; retrying in {REDISCOVER_INTERVAL_S:g} s",
                )
            if not started:
                started = True
                task_status.started()
            if await self._root_is_done():
                return
            await anyio.sleep(REDISCOVER_INTERVAL_S)
            if found and time.monotonic() - same_since >= REDISCOVER_STABLE_AFTER_S:
                # a stable set: check the known targets cheaply until the next full scan
                next_scan = time.monotonic() + REDISCOVER_STABLE_INTERVAL_S - REDISCOVER_INTERVAL_S
                while time.monotonic() < next_scan and all(pid_alive(pid) for pid, _ in found):
                    await anyio.sleep(REDISCOVER_INTERVAL_S)

    async def _root_is_done(self) -> bool:
        """With ``--root-pid`` alone: once the root process is gone, every target's exit handled
        and no incident running, say so and stop the agent (nothing is left to watch; waiting
        for a pid that cannot come back would wait forever). ``launch`` stops on its own."""
        t = self.settings.target
        if not t.root_pid or t.pids or t.match or self.children:
            return False
        if self._root is None:
            self._root = await anyio.to_thread.run_sync(_identify, t.root_pid)
            return False
        root = self._root
        if process_state(root.pid, create_time_s=root.create_time_s) not in (ProcessState.GONE, ProcessState.ZOMBIE):
            return False
        watcher = self.process_watcher
        if watcher.pids or self.incidents.current is not None or any(
            pid not in self.incidents.exits_handled for pid in (f.pid for _, f in watcher.exits)
        ):
            return False
        fact = next((f for tgt, f in watcher.exits if tgt.pid == root.pid), None)
        how = fact.describe() if fact is not None else "exit status unknown"
        log.warning("root pid %d %s ended (%s): nothing left to watch, stopping", root.pid,
                    repr(root.title) if root.title else "", how)
        self.stop(f"root pid {root.pid} ended")
        return True

    async def _discover_round(self, tg: TaskGroup) -> list[Target]:
        """One discovery round (see :meth:`_supervise`); returns the targets found."""
        try:
            targets = await anyio.to_thread.run_sync(self.discover)
        except Exception:  # discovery must never take the agent down
            log.exception("target discovery failed")
            targets = []
        if self.shipper is not None:  # declared watched, their rings attached (now and at each poll)
            await anyio.to_thread.run_sync(self.shipper.watch, {t.pid: t.uid for t in targets})
        for target in targets:
            self.process_watcher.watch(target)
            key = (target.pid, target.create_time_s)
            if key in self._step_scopes:
                continue

            def watchers_for(target: Target = target) -> list[Watcher]:
                return [
                    w for per_target in self.watchers.values() if isinstance(per_target, TargetWatchers)
                    for w in (per_target.watchers_for(target) or ())
                ]

            watchers = await anyio.to_thread.run_sync(watchers_for)  # they read the shm counter
            if not watchers:
                continue  # no SDK counter (yet): the Prometheus watchdog, if any, covers it
            self._step_scopes[key] = await tg.start(self._watch_target_steps, target, watchers)
            log.info("watching forward steps of pid %d (%s)", target.pid, target.title)
        n = len(self._step_scopes)
        refused = await anyio.to_thread.run_sync(_sdk_folder_refusals, targets) if targets else []
        said = f"; counter refused: {'; '.join(refused)}" if refused else ""
        if n:
            await self._set_status("steps", WatcherState.READY, f"{n} rank{'s' if n != 1 else ''} via shm counter{said}")
        elif (targets and not self.settings.metrics.url) or self.status.get("steps") is not None or refused:
            await self._set_status(
                "steps", WatcherState.WAITING,
                "no SDK step counter in the targets now"
                + ("" if self.settings.metrics.url else "; stalls need agent.sdk.step() or --metrics-url") + said,
            )
        if self._has_targets():
            others = self.refused_targets
            said = ""
            if others:
                shown = "; ".join(list(others.values())[:3]) + ("; ..." if len(others) > 3 else "")
                said = f"; refused {len(others)} process{'es' if len(others) != 1 else ''} of another uid: {shown}"
            if targets:
                await self._set_status(
                    "process", WatcherState.READY,
                    f"watching {len(targets)} target process{'es' if len(targets) != 1 else ''}{said}",
                )
            else:
                await self._set_status("process", WatcherState.WAITING, self._looking_for() + said)
        t = self.settings.target
        if self._has_targets() and not targets and not self._told_no_target:
            self._told_no_target = True
            log.warning(
                "no target process found yet (pids %s, root pid %s, titles %s); still looking every %g s",
                t.pids or "-", t.root_pid or "-", t.match or "-", REDISCOVER_INTERVAL_S,
            )
        elif targets and self._told_no_target:
            self._told_no_target = False
            # good news, said by the process watcher's status line ("watching N target processes")
            log.info("found %d target process(es): %s", len(targets), ", ".join(str(x.pid) for x in targets))
        return targets


def _identify(pid: int) -> Target:
    """``pid`` as a :class:`Target` with its creation time (a bare pid when it is gone already)."""
    return target_of(pid) or Target(pid=pid)


def _remove_dead_sdk_files(directory: Path | None) -> None:
    """Housekeeping at start: the step counters and control sockets dead processes of the
    agent's uid left in the SDK folder (:func:`agent.sdk.counter.remove_dead_sdk_files`)."""
    from agent.sdk.counter import remove_dead_sdk_files

    removed = remove_dead_sdk_files(directory)
    if removed:
        log.info("removed %d SDK file(s) of dead processes: %s", len(removed), ", ".join(p.name for p in removed))


async def _trim_memory(interval_s: float) -> None:
    """Every ``interval_s``, give the heap memory the agent freed back to the OS (off the loop)."""
    while True:
        await anyio.sleep(interval_s)
        await anyio.to_thread.run_sync(trim)


def _remove_stale_temps(data_dir: Path) -> None:
    """Remove the temp files of writers killed mid-write (a previous agent's) under the data dir."""
    removed = remove_stale_temps(data_dir)
    if removed:
        log.warning("removed %d leftover temp file(s) of an interrupted write under %s", removed, data_dir)


async def mirror_events(exporter: Any, sub: Subscription) -> None:
    """Feed bus events to an exporter (``handle(event)``; the span mirror) until the bus closes
    and drains.

    Also when cancelled: what is still buffered is handed over synchronously, and then its
    ``close_open(reason=...)`` (when it has one: the mirror gives incidents left open their root
    span), so nothing already captured is lost from the trace.
    """
    # handle() is file and CPU work (the span mirror writes spans write-ahead and imports a
    # profile's torch trace): kept off the event loop, one event at a time. An exporter whose
    # handle() touches loop-bound state says so with ``handles_on_loop = True``.
    off_loop = not getattr(exporter, "handles_on_loop", False)
    try:
        async for event in sub:
            if off_loop:
                await anyio.to_thread.run_sync(exporter.handle, event)
            else:
                exporter.handle(event)
    finally:
        pending = []
        while True:
            try:
                pending.append(sub.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break

        def flush() -> None:
            for event in pending:
                exporter.handle(event)
            close_open = getattr(exporter, "close_open", None)
            if close_open is not None:
                close_open(reason="agent stopped")

        if off_loop:
            with anyio.CancelScope(shield=True):  # bounded: the sink's writes of what was captured
                await anyio.to_thread.run_sync(flush)
        else:
            flush()
        sub.close()


async def dump_once(
    settings: Settings, *, telemetry: Telemetry | None = None, handle_signals: bool = False
) -> IncidentRecord:
    """One manual incident now: ``await Agent.build(settings, telemetry=telemetry).dump(...)``
    (see :meth:`Agent.dump`)."""
    return await Agent.build(settings, telemetry=telemetry).dump(handle_signals=handle_signals)


async def _interrupt_on_signal(agent: Agent, incident_scope: anyio.CancelScope, own_scope: anyio.CancelScope) -> None:
    """SIGTERM/SIGINT during ``servewatch dump``: let the phase finish (bounded), then cut short."""
    with own_scope, anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            agent.incidents.interrupt(f"{name} received")
            log.warning("%s: finishing the current phase (up to %g s)", name, agent.settings.incident.interrupt_grace_s)
            if not await agent.incidents.wait_idle(agent.settings.incident.interrupt_grace_s):
                incident_scope.cancel(f"{name}: grace period over")
            return
