"""Agent: builds watchers, actors, incidents and exporters from :class:`Settings` and runs them.

Owns wiring and lifecycle only: one anyio task group; watchers are started with ``tg.start``
so "ready" means ready; targets are re-discovered periodically so a server that starts after
the agent (or restarts) is picked up; shutdown is bounded and flushes telemetry.

Imports every component; nothing imports this module except the CLI and tests.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from agent.actors.coredump import CoredumpActor
from agent.actors.pyspy import PySpyActor
from agent.bus import EventBus, Subscription
from agent.config import Settings
from agent.events import (
    ActionCompleted,
    ActionResult,
    ComponentStatus,
    ComponentStatusChanged,
    CoredumpTriggered,
    IncidentOpened,
    ProfileStopped,
    StacksDumped,
    WatchdogStalled,
)
from agent.fsutil import remove_stale_temps
from agent.incidents import IncidentManager, IncidentRecord, InflightRequest, Phase
from agent.targets import NO_TARGET_WARNING, Target, discover, spread_warning
from agent.watchers.health import HealthWatcher
from agent.watchers.process import ProcessWatcher
from agent.watchers.steps import PrometheusStepSource, ShmStepSource, StepsWatcher
from agent.watchers.watchdog import Watchdog
from exporters.metrics import Metrics
from exporters.mirror import PROFILE_SPAN, SpanMirror
from exporters.provider import Telemetry, build_telemetry

__all__ = ["Agent", "AgentStatistics"]

log = logging.getLogger("servewatch.runtime")

#: Seconds between target re-discovery scans.
REDISCOVER_INTERVAL_S = 2.0
#: Upper bound on flushing telemetry at shutdown, seconds.
SHUTDOWN_DEADLINE_S = 3.0


class AgentStatistics(dict[str, Any]):
    """Counters of a finished run (``incidents``, ``suppressed``, bus statistics...)."""


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
    ) -> None:
        self.settings = settings
        self.bus = EventBus()
        self.telemetry = telemetry
        self._own_telemetry = telemetry is None
        self.children = list(children)
        self.pyspy = PySpyActor(settings.pyspy)
        self.coredump = (
            CoredumpActor(settings.coredump, trusted_uids=settings.target.uids) if settings.coredump.enabled else None
        )
        self.profiler = None
        if settings.profiler.on_incident_steps > 0:
            from agent.actors.profiler import ProfilerActor

            self.profiler = ProfilerActor(settings.profiler)
        phases: list[tuple[str, Phase, type]] = [("pyspy.dump", self._dump_phase, StacksDumped)]
        if self.coredump is not None:
            phases.append(("cuda.coredump", self._coredump_phase, CoredumpTriggered))
        if self.profiler is not None:
            phases.append(("profile.session", self._profile_phase, ProfileStopped))
        wd = settings.watchdog
        self.incidents = IncidentManager(
            bus=self.bus,
            config=settings.incident,
            data_dir=settings.data_dir,
            host_name=settings.host_name,
            discover=self.discover,
            phases=phases,
            inflight=self._inflight,
            on_incident=on_incident,
            hard_signal=wd.signal_number if wd.hard else None,
        )
        self.process_watcher = ProcessWatcher(poll_interval_s=0.5, children=self.children)
        self._watchdog_pids: set[int] = set()
        self._told_no_target = False
        self._warned_spread = False
        self._ready = anyio.Event()
        self._stop = anyio.Event()

    # -- discovery ----------------------------------------------------------------------------

    def discover(self) -> list[Target]:
        """Current targets per ``settings.target`` (plus launched children)."""
        t = self.settings.target
        root_pids = list(filter(None, [t.root_pid])) + [c.pid for c in self.children]
        found = discover(root_pids=root_pids, title_globs=t.match, pids=t.pids, uids=t.uids)
        if not self._warned_spread:
            warning = spread_warning(found, title_globs=t.match, root_pids=root_pids)
            if warning is not None:
                self._warned_spread = True  # once per agent: the operator has been told
                log.warning("%s", warning)
        return found

    # -- phases (actors behind the incident manager) -----------------------------------------

    async def _dump_phase(self, opened: IncidentOpened, targets: Sequence[Target], bundle: Path) -> list[ActionResult]:
        return await self.pyspy.dump_all(opened, list(targets), artifact_dir=bundle)

    async def _coredump_phase(
        self, opened: IncidentOpened, targets: Sequence[Target], bundle: Path
    ) -> list[ActionResult]:
        assert self.coredump is not None
        return await self.coredump.trigger_all(opened, list(targets), artifact_dir=bundle)

    async def _profile_phase(
        self, opened: IncidentOpened, targets: Sequence[Target], bundle: Path
    ) -> list[ActionResult]:
        assert self.profiler is not None
        return await self.profiler.profile_incident(opened, list(targets), artifact_dir=bundle)

    async def _inflight(self, targets: Sequence[Target]) -> list[InflightRequest]:
        from agent.actors.profiler import read_inflight

        return await read_inflight(targets, socket_dir=self.settings.profiler.socket_dir)

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def watched_step_pids(self) -> frozenset[int]:
        """Pids whose SDK step counter is being watched for stalls."""
        return frozenset(self._watchdog_pids)

    def stop(self) -> None:
        """Ask :meth:`run` to finish (bounded shutdown follows)."""
        self._stop.set()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> AgentStatistics:
        """Run until :meth:`stop` (or cancellation); then shut down within a few seconds."""
        s = self.settings
        await anyio.to_thread.run_sync(_remove_stale_temps, s.data_dir)
        if self.telemetry is None:
            self.telemetry = build_telemetry(s.export, data_dir=s.data_dir, host_name=s.host_name)
        mirror = SpanMirror(self.telemetry.sink, host_name=s.host_name,
                            export_statistics=self.telemetry.processor.statistics)
        mirror_sub = self.bus.subscribe(name="mirror", max_buffer=float("inf"))
        metrics_sub = self.bus.subscribe(
            IncidentOpened, ActionCompleted, WatchdogStalled, name="metrics", max_buffer=float("inf")
        )
        self.telemetry.metrics.watch_bus(lambda: self.bus.statistics().dropped)
        try:
            async with anyio.create_task_group() as outer:
                outer.start_soon(mirror_events, mirror, mirror_sub)
                outer.start_soon(self._record_metrics, self.telemetry.metrics, metrics_sub)
                try:
                    async with anyio.create_task_group() as tg:
                        await tg.start(self.incidents.run)
                        await self._start_watchers(tg)
                        self._ready.set()
                        task_status.started()
                        await self._stop.wait()
                        tg.cancel_scope.cancel("agent stopping")
                finally:
                    # the mirror drains what the bus still holds, then ends
                    await self.bus.aclose()
        finally:
            mirror_sub.close()
            metrics_sub.close()
            if self._own_telemetry and self.telemetry is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_DEADLINE_S + 1):
                    await self.telemetry.aclose(SHUTDOWN_DEADLINE_S)
        stats = AgentStatistics(
            incidents=len(self.incidents.records),
            suppressed=self.incidents.suppressed,
            bus=self.bus.statistics()._asdict(),
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
                metrics.detection_latency(event.stalled_for_s - event.timeout_s, trigger="stall")

    async def _start_watchers(self, tg: TaskGroup) -> None:
        s = self.settings
        t = s.target
        if not (t.pids or t.match or t.root_pid or self.children):
            log.warning("%s", NO_TARGET_WARNING)  # a health/metrics-only watch: incidents dump nothing
        status, detail = self.pyspy.check()
        await self.bus.publish(ComponentStatusChanged(source="runtime", component="pyspy", status=status, detail=detail))
        if status is not ComponentStatus.OK:
            log.warning("py-spy unavailable: %s", detail)
        if s.health.url:
            await tg.start(HealthWatcher(s.health).run, self.bus)
        if s.metrics.url:
            source = PrometheusStepSource(
                s.metrics.url,
                preset=s.metrics.metrics_preset,
                counter=s.metrics.counter,
                busy_gauge=s.metrics.busy_gauge,
                timeout_s=s.metrics.scrape_timeout_s,
            )
            await tg.start(Watchdog(source, s.watchdog).run, self.bus)
        await tg.start(self.process_watcher.run, self.bus)
        await tg.start(self._supervise, tg)

    async def _supervise(self, tg: TaskGroup, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Re-discover targets; watch new ones for exit and, with an SDK counter, for stalls."""
        started = False
        while True:
            try:
                targets = await anyio.to_thread.run_sync(self.discover)
            except Exception:  # discovery must never take the agent down
                log.exception("target discovery failed")
                targets = []
            for target in targets:
                self.process_watcher.watch(target)
                if target.pid in self._watchdog_pids:
                    continue
                source = ShmStepSource(target.pid)
                if source.read_now() is None:
                    continue  # no SDK counter (yet): the Prometheus watchdog, if any, covers it
                self._watchdog_pids.add(target.pid)
                await tg.start(Watchdog(source, self.settings.watchdog).run, self.bus)
                await tg.start(StepsWatcher(ShmStepSource(target.pid), interval_s=1.0).run, self.bus)
                log.info("watching forward steps of pid %d (%s)", target.pid, target.title)
            t = self.settings.target
            if (t.pids or t.match or t.root_pid or self.children) and not targets and not self._told_no_target:
                self._told_no_target = True
                log.warning(
                    "no target process found yet (pids %s, root pid %s, titles %s); still looking every %g s",
                    t.pids or "-", t.root_pid or "-", t.match or "-", REDISCOVER_INTERVAL_S,
                )
            elif targets and self._told_no_target:
                self._told_no_target = False
                log.warning("found %d target process(es): %s", len(targets), ", ".join(str(x.pid) for x in targets))
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(REDISCOVER_INTERVAL_S)


def _remove_stale_temps(data_dir: Path) -> None:
    """Remove the temp files of writers killed mid-write (a previous agent's) under the data dir."""
    removed = remove_stale_temps(data_dir)
    if removed:
        log.warning("removed %d leftover temp file(s) of an interrupted write under %s", removed, data_dir)


async def mirror_events(mirror: SpanMirror, sub: Subscription) -> None:
    """Feed bus events to the span mirror until the bus closes and drains.

    Also when cancelled: what is still buffered is mirrored synchronously, and incidents left
    open get their root span, so nothing already captured is lost from the trace.
    """
    try:
        async for event in sub:
            if isinstance(event, ActionCompleted) and event.result.action == PROFILE_SPAN:
                # importing a torch trace is CPU and file work: keep it off the event loop
                await anyio.to_thread.run_sync(mirror.handle, event)
            else:
                mirror.handle(event)
    finally:
        while True:
            try:
                mirror.handle(sub.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        mirror.close_open(reason="agent stopped")
        sub.close()


async def dump_once(settings: Settings, *, telemetry: Telemetry | None = None) -> IncidentRecord:
    """One manual incident now (``servewatch dump``): dump the targets, write bundle and spans.

    Telemetry is flushed and shut down within :data:`SHUTDOWN_DEADLINE_S` afterwards (unless
    ``telemetry`` was passed in, which the caller then owns).
    """
    agent = Agent(settings, telemetry=telemetry)
    await anyio.to_thread.run_sync(_remove_stale_temps, settings.data_dir)
    own = telemetry is None
    tel = telemetry or build_telemetry(settings.export, data_dir=settings.data_dir, host_name=settings.host_name)
    mirror = SpanMirror(tel.sink, host_name=settings.host_name, export_statistics=tel.processor.statistics)
    mirror_sub = agent.bus.subscribe(name="mirror", max_buffer=float("inf"))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(mirror_events, mirror, mirror_sub)
            status, detail = agent.pyspy.check()
            if status is not ComponentStatus.OK:
                log.warning("py-spy unavailable: %s", detail)
            targets = agent.discover()
            record = await agent.incidents.open_incident(
                "manual", detail=f"servewatch dump of {len(targets)} process(es)"
            )
            await agent.bus.aclose()  # the mirror drains what is buffered, then ends
    finally:
        mirror_sub.close()
        if own:
            with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_DEADLINE_S + 1):
                await tel.aclose(SHUTDOWN_DEADLINE_S)
    return record
