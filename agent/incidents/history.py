"""The server's recent history, as the agent saw it: what the incident report shows before the evidence.

Owns :class:`HistoryPoint` and :class:`ProgressHistory`. The recorder subscribes to the bus and
keeps, bounded, what the watchers already published: forward-step readings per process
(``StepsAdvanced``: the SDK step counters), health checks turning bad or good, watchdog stalls
and target exits. When an incident opens, :meth:`ProgressHistory.snapshot` hands the incident
manager the last of them, oldest first, plus, from the stall that opened it, when progress
stopped; they go into ``manifest.json`` (``history``) for ``servewatch report``'s "Server
history". Nothing is read from the server here: only events that were published anyway.

Imports :mod:`agent.model.events` and :mod:`agent.model.bus` only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from agent.model.bus import EventBus
from agent.model.events import (
    Event,
    HealthCheckFailed,
    HealthRecovered,
    StepsAdvanced,
    TargetExited,
    WatchdogStalled,
    now_ns,
)

__all__ = ["HistoryPoint", "ProgressHistory", "points_of"]

#: Step readings kept per process (the report shows the last few before the stall).
STEPS_PER_SOURCE = 8
#: Other facts (health, stalls, exits) kept, newest last.
FACTS_KEPT = 32
#: Nothing older than this (seconds) goes into an incident's history.
WINDOW_S = 900.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryPoint:
    """One moment of the server's history.

    Attributes:
        time_unix_nano: when it happened (for ``progress_stopped``: when the last step was
            seen), ns since the epoch.
        kind: ``step`` (a step counter moved), ``progress_stopped`` (the last step before a
            stall), ``stall`` (the watchdog fired), ``health_failed`` / ``health_recovered``,
            ``exit`` (a target exited).
        pid: the process, when the fact is about one (``None``: the server as a whole).
        forward_ct: the step counter's value (``step``, ``progress_stopped``, ``stall``).
        detail: one line in words.
    """

    time_unix_nano: int
    kind: str
    pid: int | None = None
    forward_ct: int | None = None
    detail: str = ""


def points_of(event: Event) -> list[HistoryPoint]:
    """The history points one event makes (none for events that are no part of it).

    A ``WatchdogStalled`` makes two: when progress stopped (its time minus ``stalled_for_s``)
    and when the watchdog fired.
    """
    t = event.time_unix_nano
    if isinstance(event, StepsAdvanced):
        return [HistoryPoint(time_unix_nano=t, kind="step", pid=event.pid, forward_ct=event.forward_ct,
                             detail=f"+{event.delta} step(s){'; work pending' if event.busy else ''}")]
    if isinstance(event, WatchdogStalled):
        where = f"pid {event.pid}" if event.pid is not None else (event.series or "the server")
        stopped = t - int(event.stalled_for_s * 1e9)
        return [
            HistoryPoint(time_unix_nano=stopped, kind="progress_stopped", pid=event.pid, forward_ct=event.forward_ct,
                         detail=f"{where} made no forward step after this (forward_ct={event.forward_ct}), work pending"),
            HistoryPoint(time_unix_nano=t, kind="stall", pid=event.pid, forward_ct=event.forward_ct,
                         detail=f"{where} busy and no forward progress for {event.stalled_for_s:.1f} s"
                                f" (timeout {event.timeout_s:g} s)"),
        ]
    if isinstance(event, HealthCheckFailed):
        status = str(event.status_code) if event.status_code is not None else event.error_class
        return [HistoryPoint(time_unix_nano=t, kind="health_failed",
                             detail=f"health check failing ({status}) after {event.consecutive_failures} probe(s): {event.url}")]
    if isinstance(event, HealthRecovered):
        return [HistoryPoint(time_unix_nano=t, kind="health_recovered", detail=f"health check good again: {event.url}")]
    if isinstance(event, TargetExited):
        when = event.exit_time_unix_nano or t
        return [HistoryPoint(time_unix_nano=when, kind="exit", pid=event.pid,
                             detail=f"{event.title or 'a target'} exited ({event.exit.status()})")]
    return []


class ProgressHistory:
    """Keeps the recent history of the watched server from the bus (bounded, never blocks it).

    Args:
        steps_per_source: step readings kept per process.
        facts_kept: other facts kept (health, stalls, exits).
        window_s: what is older than this (seconds) is left out of a snapshot.
    """

    name = "history"

    def __init__(self, *, steps_per_source: int = STEPS_PER_SOURCE, facts_kept: int = FACTS_KEPT,
                 window_s: float = WINDOW_S) -> None:
        self._steps_per_source = steps_per_source
        self._steps: dict[int | None, deque[HistoryPoint]] = {}
        self._facts: deque[HistoryPoint] = deque(maxlen=facts_kept)
        self._window_ns = int(window_s * 1e9)

    def record(self, event: Event) -> None:
        """Keep what ``event`` says about the server's history."""
        for point in points_of(event):
            if point.kind == "step":
                ring = self._steps.get(point.pid)
                if ring is None:
                    ring = self._steps[point.pid] = deque(maxlen=self._steps_per_source)
                ring.append(point)
            else:
                self._facts.append(point)

    def snapshot(self, *, until_unix_nano: int | None = None, cause: Event | None = None) -> list[HistoryPoint]:
        """What happened up to ``until_unix_nano`` (default: now), oldest first.

        Args:
            until_unix_nano: the incident's open time; later facts are left out.
            cause: the event that opened the incident: its points are included even when the
                recorder has not seen it yet (subscribers receive events in their own time).
        """
        until = now_ns() if until_unix_nano is None else until_unix_nano
        since = until - self._window_ns
        points = [p for ring in self._steps.values() for p in ring]
        points += list(self._facts)
        if cause is not None:
            points += [p for p in points_of(cause) if p not in points]
        out: list[HistoryPoint] = []
        for p in points:
            if p.kind == "stall":
                out.append(_progress_stopped(p, points))
            if p.kind != "progress_stopped":
                out.append(p)
        return sorted((p for p in out if since <= p.time_unix_nano <= until), key=lambda p: p.time_unix_nano)

    async def run(self, bus: EventBus, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Record from the bus until cancelled."""
        async with bus.subscribe(StepsAdvanced, WatchdogStalled, HealthCheckFailed, HealthRecovered, TargetExited,
                                 name=self.name) as sub:
            task_status.started()
            async for event in sub:
                self.record(event)


#: How much later than the last step reading the stall's own start must be to mean an idle spell
#: came between (step counters are read every second; a busy server's last reading can trail
#: its exact last step by that much), ns.
STEP_READ_GAP_NS = 2 * 1_000_000_000


def _last_before(stall: HistoryPoint, points: Sequence[HistoryPoint], kind: str) -> HistoryPoint | None:
    """The latest point of ``kind`` of ``stall``'s process at or before ``stall``, or None."""
    found = [p for p in points if p.kind == kind and p.pid == stall.pid and p.time_unix_nano <= stall.time_unix_nano]
    return max(found, key=lambda p: p.time_unix_nano) if found else None


def _progress_stopped(stall: HistoryPoint, points: Sequence[HistoryPoint]) -> HistoryPoint:
    """When progress stopped with work pending before ``stall``: the last step reading of that
    process before it (exact) when one was seen, unless the stall's own start (its time minus how
    long it was stalled, from :func:`points_of`: when work was pending without progress) is
    later by more than :data:`STEP_READ_GAP_NS` (an idle spell came between); without step
    readings, that start."""
    estimate = _last_before(stall, points, "progress_stopped")
    last = _last_before(stall, points, "step")
    if last is not None and estimate is not None and estimate.time_unix_nano - last.time_unix_nano > STEP_READ_GAP_NS:
        # the last step came before an idle spell: progress stopped with work pending only when
        # work arrived again (the stall's own start), not at that step
        return HistoryPoint(time_unix_nano=estimate.time_unix_nano, kind="progress_stopped", pid=stall.pid,
                            forward_ct=last.forward_ct,
                            detail=f"pid {stall.pid}: work pending from here and no forward step (its last step,"
                                   f" forward_ct={last.forward_ct}, came {(estimate.time_unix_nano - last.time_unix_nano) / 1e9:.1f} s"
                                   " earlier, before an idle spell)")
    if last is not None:
        return HistoryPoint(time_unix_nano=last.time_unix_nano, kind="progress_stopped", pid=stall.pid,
                            forward_ct=last.forward_ct,
                            detail=f"pid {stall.pid} last seen stepping (forward_ct={last.forward_ct}; its counter is read"
                                   " every second): no forward step after this, work pending")
    if estimate is not None:
        return estimate
    return HistoryPoint(time_unix_nano=stall.time_unix_nano, kind="progress_stopped", pid=stall.pid,
                        forward_ct=stall.forward_ct, detail="progress stopped (time unknown)")
