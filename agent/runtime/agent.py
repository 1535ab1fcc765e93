"""Agent: builds watchers, actors, incidents and exporters from the settings and runs them.

Owns wiring and lifecycle only; it decides nothing. :meth:`Agent.build` is the one wiring path (``run``,
``dump``, ``launch``, ``profile``): every watcher, actor and exporter comes from its registry
(:mod:`agent.host.registry`), imported only when built, with its own settings table and the agent-wide values;
the incident's phases are the registered actors, in registration order. Its own parts: the status board, the
telemetry (``[export]``) and a running agent's span shipper (``[spans]``). Which processes an incident is about
is :class:`agent.incidents.evidence.TargetFinder`'s; which triggers open one, the incident manager's policies
(and, with the API on, the :class:`agent.fleet.Fleet`'s contributions, passed to the manager when it is built);
whether a target is stalled, the bus's (:class:`agent.host.stall.StallBoard`). One anyio task group; watchers
are started with ``tg.start`` so "ready" means ready, restarted after a crash and targets re-discovered
(:mod:`agent.runtime.supervision`); shutdown is bounded and flushes telemetry. Imports the registries, the bus,
incidents, the stall board, discovery, the status rows, the data dir's agent presence
(:mod:`agent.host.agentfiles`); a component only for ``profile``; only the CLI and tests import it.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from agent.actors import ACTORS, Actor
from agent.host.agentfiles import on_data_dir
from agent.host.housekeeping import remove_dead_sdk_files, remove_stale_temps, trim_memory
from agent.host.memory import limit_arenas
from agent.host.ownactions import OwnActionLog
from agent.host.registry import BuildContext
from agent.host.sdkclient import read_step_counter
from agent.host.stall import StallBoard
from agent.host.startup import StartupRule
from agent.host.targets import Target
from agent.incidents.evidence import TargetFinder
from agent.incidents.history import ProgressHistory
from agent.incidents.lifecycle import Lifecycle
from agent.incidents.manager import (
    IncidentManager,
    IncidentRecord,
    InflightRequest,
    recover_interrupted,
)
from agent.model.bus import EventBus
from agent.model.events import ActionResult, ComponentStatusChanged, Trigger, WatcherStatusChanged
from agent.runtime.runstatus import RunStatus
from agent.runtime.supervision import TargetWatch, restartable, supervise
from agent.verdict.judge import VerdictJudge
from agent.watchers import WATCHERS, TargetWatchers
from agent.watchers.status import StatusBoard, WatcherStatus
from agent.watchers.watchdog import progress_source
from exporters import EXPORTERS, Exporter
from exporters.mirror.feed import mirror_events, subscribe_mirrors

if TYPE_CHECKING:
    from agent.runtime.settings import AgentSettings as Settings
    from exporters.otlp.provider import Telemetry
    from exporters.otlp.shipper import SpanShipper

__all__ = ["Agent", "AgentStatistics", "dump_once"]

log = logging.getLogger("servewatch.runtime")

#: Seconds between returning the agent's freed heap memory to the OS (:func:`agent.host.memory.trim`).
TRIM_INTERVAL_S = 60.0
#: Upper bound on flushing telemetry at shutdown, seconds.
SHUTDOWN_DEADLINE_S = 3.0
#: Events buffered for the span mirror and the metrics recorder (incident and action events
#: wait for room, never dropped; nothing high-rate is subscribed).
MIRROR_BUFFER = 4096


class AgentStatistics(dict[str, Any]):
    """Counters of a finished run (``incidents``, ``suppressed``, bus statistics...)."""


class Agent:
    """The servewatch agent.

    Args:
        settings: merged user settings.
        telemetry: span export to use (the caller then owns it); default: the agent builds one
            from ``settings.export`` and ``OTEL_*`` when it starts.
        children: processes this agent launched (``servewatch launch``): their exit status is
            read from the ``Popen`` so nothing steals it.
        on_incident: called with each finished incident record (CLI summaries, the demo).
        on_status: called with each watcher status change (the CLI prints it).
        on_summary: called when an incident's summary evidence is in (before deferred phases).
        on_phase: called with what an incident starts doing now (``servewatch dump``'s progress line).

    Attributes:
        bus: the event bus.
        status: what every watcher can see (``servewatch status``, ``/v1/status``, the status file).
        incidents: the incident manager (``incidents.records`` after a run).
        stalls: the stalls not over, from the watchdogs' word on the bus.
        targets: discovery and what it remembers (an incident's dead ranks).
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
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self._stop_reason = "agent stopping"
        self.bus = EventBus()
        self.telemetry, self._own_telemetry = telemetry, telemetry is None
        self.children, self.stalls = list(children), StallBoard()  # own_actions: what servewatch does to servers
        self.own_actions = OwnActionLog(settings.data_dir, settings.host_name)
        self.startup = StartupRule(settings.startup, discover=lambda: self.discover(), http_watched=bool(settings.agent_values().server_urls), server_pids=lambda: [p for p in (settings.target.root_pid, *(c.pid for c in self.children)) if p])
        self.context = BuildContext(agent=settings.agent_values(), children=self.children, stalled=self.stalls.stalled,
                                    starting=self.startup.starting)
        self.status = StatusBoard(host_name=settings.host_name, path=settings.layout.status_file,
                                  on_change=self._status_changed if on_status is not None else None, warn_blind=on_status is None)
        #: built components by name (registration order); exporters of the ``start`` stage are
        #: added when the agent runs or dumps
        self.watchers: dict[str, Any] = WATCHERS.build(settings, self.context)
        self.actors: dict[str, Actor] = ACTORS.build(settings, self.context)
        self.exporters: dict[str, Exporter] = EXPORTERS.build(settings, self.context)
        self.run_status = RunStatus(self.bus, self.status, actors=list(self.actors), on_status=on_status)
        #: the server's recent history from the bus (step readings, stalls, health, exits)
        self.history = ProgressHistory()
        self.lifecycle = Lifecycle(left_alive=getattr(self.watchers.get("process"), "left_alive", None))  # a policy
        #: the API and job coordinator (:class:`agent.fleet.Fleet`) when ``api.enabled``: inert until :meth:`run` starts it
        self.fleet: Any = self._build_fleet() if settings.api.enabled else None
        self.incidents = self._build_incidents(on_incident, on_summary, on_phase)
        self.targets = TargetFinder(settings.target, self.children, stall_timeout_s=settings.watchdog.timeout_s,
                                    last_incident_unix_nano=self._last_incident_unix_nano)
        self.incidents.judge.read_progress(progress_source(settings.metrics), Trigger.HEALTH)  # a health verdict reads /metrics twice
        self.target_watch = TargetWatch(
            discover=lambda: self.discover(), finder=self.targets, watchers=self.watchers, process_watcher=self.process_watcher,
            bus=self.bus, status=self.run_status, incidents=self.incidents, shipper=lambda: self.shipper,
            scraped="metrics" in self.watchers, stop=self.stop)
        #: watcher restarts after a crash, by name
        self.restarts: dict[str, int] = {}
        self._ready = anyio.Event()
        self._stop = anyio.Event()
        #: ships the targets' SDK request/forward spans (``[spans]``), built when a running agent starts
        self.shipper: SpanShipper | None = None
        #: the telemetry's counts after a one-shot command closed it (:meth:`dump`, :meth:`profile`)
        self.export_statistics: Any = None

    def _build_incidents(self, on_incident: Callable[[IncidentRecord], None] | None, on_summary: Callable[[IncidentRecord], None] | None,
                         on_phase: Callable[[str], None] | None) -> IncidentManager:
        wd, fleet = self.settings.watchdog, self.fleet  # the fleet's contributions: inert until it runs
        return IncidentManager(
            bus=self.bus, config=self.settings.incident, data_dir=self.settings.data_dir,
            host_name=self.settings.host_name, discover=self.discover, discover_for=self.incident_targets,
            actors=list(self.actors.values()), inflight=self._inflight, on_incident=on_incident, policies=[self.lifecycle],
            hard_signal=wd.signal_number if wd.hard else None, hard_targets=wd.hard_targets, on_summary=on_summary,
            judge=VerdictJudge(endpoint_urls=self.context.agent.server_urls, own_actions=self.own_actions),
            stalls=self.stalls, history=self.history, companions=() if fleet is None else (fleet.companion,),
            server_of=lambda event: self.targets.server_of_event(event, metrics_urls=self.settings.metrics.all_urls),
            server_dumps=lambda *window: self.targets.server_dump_lines(*window),
            admit=None if fleet is None else fleet.admit, place=None if fleet is None else fleet.place, on_phase=on_phase,
            server_tree=lambda trigger, targets: self.targets.server_tree(trigger, targets, urls=self.context.agent.server_urls))

    def _build_fleet(self) -> Any:
        from agent.fleet import Fleet  # the coordinator (h11, peers) loads only when the API is on

        return Fleet(self, self.settings.api, self.settings.fleet)

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
        on_phase: Callable[[str], None] | None = None,
    ) -> Agent:
        """Build an agent from ``settings``: every registered watcher, actor and exporter whose
        factory returns one (the registries' order), the incident manager over the actors (the
        arguments are :class:`Agent`'s).

        Raises:
            ImportError: a registered factory's module is missing (a packaging error).
        """
        return cls(settings, telemetry=telemetry, children=children, on_incident=on_incident,
                   on_status=on_status, on_summary=on_summary, on_phase=on_phase)

    @property
    def process_watcher(self) -> Any:
        """The ``process`` watcher (exit of every target; ``launch`` hands it its child)."""
        return self.watchers["process"]

    @property
    def watched_step_pids(self) -> frozenset[int]:
        """Pids whose SDK step counter is being watched for stalls."""
        return frozenset(pid for pid, _ in self.target_watch.step_scopes)

    # -- what the incidents read ----------------------------------------------------------------

    def discover(self) -> list[Target]:
        """Current targets per ``settings.target`` (plus launched children). Blocking."""
        return self.targets.discover()

    def incident_targets(self, subject: int | None = None, server: int | None = None) -> list[Target]:
        """Targets of an incident: the live ones (``server``'s only, its tree root pid; ``None``:
        all), plus the dead ranks that are its evidence (of ``subject``'s job, the pid whose stall or
        exit opens it: :meth:`agent.incidents.evidence.TargetFinder.incident_targets`). Blocking."""
        return self.targets.incident_targets(self.discover(), subject, server)

    def _last_incident_unix_nano(self) -> int | None:
        records = self.incidents.records
        return records[-1].opened.time_unix_nano if records else None

    async def _inflight(self, targets: Sequence[Target]) -> list[InflightRequest]:
        from agent.host.sdkclient import read_inflight

        return await read_inflight(targets, socket_dir=self.context.agent.sdk_socket_dir)

    # -- exporters and telemetry ----------------------------------------------------------------

    def _start_exporters(self, *, one_shot: bool = False) -> Telemetry:
        """Build and return the telemetry (``[export]``, unless the caller brought it; a one-shot's metrics go only to
        a collector), a running agent's span shipper (``[spans]``), then the ``start`` stage's exporters (they attach to it)."""
        from exporters.otlp.provider import build_telemetry

        s = self.settings
        if self.telemetry is None:
            self.telemetry = build_telemetry(s.export, data_dir=s.data_dir, host_name=s.host_name, file_metrics=not one_shot,
                                             destination=s.export_destination)
        if not one_shot and s.spans.ship and self.shipper is None:
            from exporters.otlp.shipper import create_shipper

            self.shipper = create_shipper(s.spans, self.telemetry, host_name=s.host_name)
        ctx = replace(self.context, stage="start", one_shot=one_shot, telemetry=self.telemetry)
        for entry in EXPORTERS:
            if entry.name not in self.exporters and (component := entry.build(s, ctx)) is not None:
                self.exporters[entry.name] = component
        return self.telemetry

    async def _close_telemetry(self, deadline_s: float | None = SHUTDOWN_DEADLINE_S) -> None:
        """Flush and shut down our own telemetry within ``deadline_s`` seconds (``None``: its own
        ``export.shutdown_timeout_s``); the counts end up in :attr:`export_statistics` (a caller's
        own telemetry is left open)."""
        if self._own_telemetry and self.telemetry is not None:
            bound_s = (deadline_s if deadline_s is not None else getattr(self.telemetry, "shutdown_timeout_s", 3.0)) + 1
            with anyio.CancelScope(shield=True), anyio.move_on_after(bound_s):
                self.export_statistics = await self.telemetry.aclose(deadline_s)

    # -- one-shot commands (same build path as run) -----------------------------------------

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
        await anyio.to_thread.run_sync(remove_stale_temps, self.settings.data_dir)
        await anyio.to_thread.run_sync(partial(self._start_exporters, one_shot=True))  # span files, spool: off the loop
        progress = None
        if self.incidents.judge is not None:  # one-shot: no torch import racing the dump's own CPU
            self.incidents.judge.warm_up = False
            # one snapshot cannot tell a hang from work: the server's /metrics read twice can
            progress = self.incidents.judge.read_progress(progress_source(self.settings.metrics))
        feeds = subscribe_mirrors(self.bus, self.exporters, max_buffer=MIRROR_BUFFER)
        try:
            async with anyio.create_task_group() as tg:
                for exporter, sub in feeds:
                    tg.start_soon(mirror_events, exporter, sub)
                await self.run_status.check_actors(self.actors)
                record = await self._dump_incident(tg, handle_signals)
                await self.bus.aclose()  # the exporters drain what is buffered, then end
        finally:
            for _, sub in feeds:
                sub.close()
            if progress is not None:
                await progress.aclose()
            await self._close_telemetry(None)
        return record

    async def _dump_incident(self, tg: TaskGroup, handle_signals: bool) -> IncidentRecord:
        targets = await anyio.to_thread.run_sync(self.discover)  # a /proc scan
        # no watchdog has watched: one reading of each counter says whether a target is stalled
        await anyio.to_thread.run_sync(self.stalls.read_now, targets, read_step_counter, self.settings.watchdog.timeout_s)
        signal_scope = anyio.CancelScope()
        with anyio.CancelScope() as incident_scope:
            if handle_signals:
                tg.start_soon(_interrupt_on_signal, self, incident_scope, signal_scope)
            await self.incidents.open_incident(Trigger.MANUAL, detail=f"servewatch dump of {len(targets)} process(es)")
        signal_scope.cancel("dump done")
        if not self.incidents.records:
            raise RuntimeError("servewatch dump was interrupted before its incident opened")
        return self.incidents.records[-1]

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
            progress: called with one line on what the session waits for now (the CLI's progress line).

        Returns:
            The session's result (outcome, trace files) and the hex trace id of its spans;
            ``None`` when the session wrote no trace file and spans go to the embedded files:
            then nothing is exported and no folder is created (a failed profile leaves nothing
            behind). With a collector configured a failed session is exported too (its
            ``profile.session`` span says why), through the spool in the data dir as any export.
        """
        from agent.actors.profiler import profile_once
        from exporters.mirror.mirror import mirror_profile_session
        result = await profile_once(
            self.settings.profiler, pid=pid, steps=steps, start_step=start_step, activities=activities,
            out_dir=out_dir, timeout_s=timeout_s, progress=progress, own_actions=self.own_actions,
        )
        if not result.artifact_paths and self.settings.export_destination.endpoint is None:
            return result, None
        if before_export is not None:
            await anyio.to_thread.run_sync(before_export)  # the data dir: file system
        telemetry = self._start_exporters(one_shot=True)
        try:
            trace_id = await anyio.to_thread.run_sync(mirror_profile_session, telemetry.sink, result)
        finally:
            await self._close_telemetry(None)
        return result, trace_id

    # -- lifecycle ----------------------------------------------------------------------------

    def _status_changed(self, status: WatcherStatus) -> None:
        self.run_status.changed(status)

    def stop(self, reason: str = "agent stopping") -> None:
        """Ask :meth:`run` to finish (bounded shutdown follows).

        An incident running now finishes its current phase (up to
        ``incident.interrupt_grace_s``), skips the rest and is written ``interrupted``.
        """
        self._stop_reason = reason
        self._stop.set()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> AgentStatistics:
        """Run until :meth:`stop` (or cancellation); then shut down within a few seconds."""
        limit_arenas()  # before the export, shipper and worker threads start: a flat RSS over days
        await anyio.to_thread.run_sync(remove_stale_temps, self.settings.data_dir)
        telemetry = await anyio.to_thread.run_sync(self._start_exporters)  # span files, spool: off the loop
        from exporters.otlp.metrics import RECORDED_EVENTS

        feeds = subscribe_mirrors(self.bus, self.exporters, max_buffer=MIRROR_BUFFER)
        metrics_sub = self.bus.subscribe(*RECORDED_EVENTS, name="metrics", max_buffer=MIRROR_BUFFER)
        status_sub = self.bus.subscribe(WatcherStatusChanged, ComponentStatusChanged, name="status", max_buffer=MIRROR_BUFFER)
        telemetry.metrics.watch_bus(lambda: self.bus.statistics().dropped)
        watch_status = getattr(telemetry.metrics, "watch_status", None)
        if watch_status is not None:
            watch_status(self.status.states)
        try:
            async with on_data_dir(self.settings.data_dir, self.settings.host_name), anyio.create_task_group() as outer:
                for exporter, sub in feeds:
                    outer.start_soon(mirror_events, exporter, sub)
                outer.start_soon(telemetry.metrics.record_events, metrics_sub)
                outer.start_soon(self.run_status.record, status_sub)
                self._warm_up_actors(outer)
                try:
                    async with anyio.create_task_group() as tg:
                        await self._start(tg, telemetry)
                        task_status.started()
                        await self._stop.wait()
                        await self._finish_incident()
                        tg.cancel_scope.cancel("agent stopping")
                finally:
                    await self.bus.aclose()  # the exporters drain what the bus still holds, then end
        finally:
            for sub in (*(sub for _, sub in feeds), metrics_sub, status_sub):
                sub.close()
            await self._close_shipper()
            await self._close_telemetry()
        return AgentStatistics(
            incidents=len(self.incidents.records), suppressed=self.incidents.suppressed,
            bus=self.bus.statistics()._asdict(),
            spans=self.shipper.statistics().to_dict() if self.shipper is not None else None,
        )

    def _warm_up_actors(self, tg: TaskGroup) -> None:
        """Each actor's slow imports (``warm_up()``, when it has one) paid now, off the loop, not mid-incident."""
        for actor in self.actors.values():
            warm_up = getattr(actor, "warm_up", None)
            if warm_up is not None:
                tg.start_soon(partial(anyio.to_thread.run_sync, warm_up, abandon_on_cancel=True))

    async def _start(self, tg: TaskGroup, telemetry: Any) -> None:
        """Start the running agent's tasks in ``tg``, each ready before the next."""
        s = self.settings
        try:
            # what a killed agent left: bundles to close, spans that never became durable
            await recover_interrupted(self.bus, s.data_dir, s.host_name, durable=getattr(telemetry, "durable_keys", None))
        except Exception:  # a bad old bundle must not stop the agent
            log.exception("closing interrupted incidents failed")
        # SDK files (counters, sockets) that processes of our uid left when they died
        await anyio.to_thread.run_sync(remove_dead_sdk_files, self.context.agent.sdk_socket_dir)
        await tg.start(self.history.run, self.bus)  # before the watchers publish
        await tg.start(self.stalls.run, self.bus)
        await tg.start(self.lifecycle.run, self.bus, self.incidents)
        await tg.start(self.startup.run, self.bus)
        await tg.start(partial(self.incidents.run, on_state=self.run_status.show_incidents))
        if self.fleet is not None:
            await tg.start(self.fleet.run)
        await self._start_watchers(tg)
        if self.shipper is not None:
            tg.start_soon(self.run_status.ship_spans, self.shipper, telemetry)
        tg.start_soon(self.run_status.watch_delivery, telemetry)
        tg.start_soon(trim_memory, TRIM_INTERVAL_S)
        self._ready.set()

    async def _finish_incident(self) -> None:
        """Stopping during an incident: its current phase finishes (bounded), the rest is skipped."""
        if self.incidents.interrupt(self._stop_reason):
            grace_s = self.settings.incident.interrupt_grace_s
            log.warning("%s during an incident: finishing its current phase (up to %g s)", self._stop_reason, grace_s)
            await self.incidents.wait_idle(grace_s)

    async def _close_shipper(self) -> None:
        """Last drain of the span rings, then servers fall back to their own path (bounded)."""
        if self.shipper is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_DEADLINE_S):
                await anyio.to_thread.run_sync(self.shipper.close, abandon_on_cancel=True)

    async def supervised(
        self, name: str, make: Callable[[], Any], *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the watcher ``make()`` returns, restarted after a crash (:func:`agent.runtime.supervision.supervise`)."""
        await supervise(name, make, self.bus, restarts=self.restarts, task_status=task_status)

    async def _start_watchers(self, tg: TaskGroup) -> None:
        await self.target_watch.announce()
        for name, watcher in self.watchers.items():
            if isinstance(watcher, TargetWatchers):
                continue  # started per target by discovery
            rebuild = partial(WATCHERS.get(name).build, self.settings, self.context)
            await tg.start(self.supervised, name, restartable(watcher, rebuild))
        await tg.start(self.target_watch.run, tg)
        # after the first discovery: an actor that cannot act on the targets found is BLIND, never "ready"
        await self.run_status.check_actors(self.actors, blind=self.target_watch.actor_blind)


async def dump_once(settings: Settings, *, telemetry: Telemetry | None = None, handle_signals: bool = False) -> IncidentRecord:
    """One manual incident now: ``Agent.build(settings, telemetry=telemetry).dump(...)`` (:meth:`Agent.dump`)."""
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
