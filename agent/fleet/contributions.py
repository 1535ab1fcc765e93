"""The fleet's three contributions to the incident manager, once the fleet serves.

Owns :class:`Contributions`: admission (a local detection inside a job incident's window is
folded: a ``fleet.detection_folded`` span), placement (an incident's trace named before it opens,
from the job and the detection time bucket: :mod:`agent.fleet.identity`) and the companion that
runs beside an incident's phases (it starts this host's part of the job protocol,
:class:`~agent.fleet.member.Member` or a relay of the fan-out, and collects its action events,
then shares this host's evidence). :class:`~agent.fleet.job.Fleet` keeps them inert while it does
not serve.

Imports anyio, :mod:`agent.fleet.fleetstate`, :mod:`agent.fleet.coordinator`,
:mod:`agent.fleet.member`, :mod:`agent.fleet.identity` and :mod:`agent.model.events`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from agent.fleet.coordinator import Coordinator
from agent.fleet.fleetstate import MAX_COORDINATOR_TRIES, REPORT_TRIES, FleetState
from agent.fleet.identity import job_trace, time_bucket_key
from agent.fleet.jobstate import JobIncident
from agent.fleet.member import Member
from agent.model.events import (
    TRACE_DETAIL_ATTR,
    Action,
    ActionCompleted,
    ActionResult,
    IncidentOpened,
    Outcome,
    Trigger,
    frozen_attrs,
    now_ns,
)

__all__ = ["FOLDED_SPAN", "Contributions", "nothing"]

log = logging.getLogger("servewatch.fleet")

#: Span (action) name recording a local detection folded into the job incident.
FOLDED_SPAN = Action.DETECTION_FOLDED

#: How to collect a companion's action events (:data:`agent.incidents.manager.Companion`).
Collect = Callable[[], Awaitable[list[ActionCompleted]]]


class Contributions:
    """Admission, placement and the companion of a job's incidents, on ``state``."""

    def __init__(self, state: FleetState, member: Member, coordinator: Coordinator) -> None:
        self.state = state
        self.member = member
        self.coordinator = coordinator

    def admit(self, trigger: str, detail: str) -> bool:
        """A local detection: folded (``False``) when a job incident is in its window, else it claims one (``True``)."""
        state = self.state
        job = state.job
        running = job is not None and job.local_incident_id is not None and job.local_incident_id in state.agent.incidents.running
        # a hang's symptoms (stall, failed health) on this host are the job incident's; a process
        # that exits after the job incident closed is a new fact and gets its own incident
        if state.in_window(job) and (running or trigger != Trigger.EXIT or not job.placed.is_set()):  # type: ignore[union-attr]
            assert job is not None
            state.folded += 1
            log.info("%s detection folded into job incident (trace %s)", trigger, job.trace_id or "being placed")
            if running:
                t = now_ns()
                job.extras.append(ActionCompleted(
                    source="fleet", incident_id=job.local_incident_id or "",
                    result=ActionResult(action=FOLDED_SPAN, outcome=Outcome.SKIPPED, detail=f"local {trigger} detection: {detail}",
                                        start_time_unix_nano=t, end_time_unix_nano=t,
                                        attributes=frozen_attrs({"servewatch.incident.trigger": trigger})),
                ))
            return False
        if not state.in_window(job):
            state.job = JobIncident(detected_time_unix_nano=now_ns())  # claimed: placed before it opens
        return True

    def _detail(self) -> dict[str, Any]:
        """Root attributes of this host's incidents in a job too large for every action span in
        the job's trace: they go to a trace of the host's own, linked (:data:`TRACE_DETAIL_ATTR`)."""
        state = self.state
        hosts = max(len(state.resolver.static) if state.resolver is not None else 0, state.members_seen)
        return {TRACE_DETAIL_ATTR: "linked"} if hosts > state.config.trace_detail_max_hosts else {}

    def place(self, detected_ns: int, parent: tuple[str, str] | None) -> tuple[str, str, dict[str, Any]] | None:
        """The trace of an incident about to open here (:data:`agent.incidents.manager.Placement`);
        ``detected_ns``: the trigger event's time (the time bucket's, without a Flight Recorder);
        ``parent``: the trace it was opened in (a join), kept."""
        if parent is not None:
            return (*parent, self._detail())
        placed = self._placed(detected_ns)
        return (*placed, self._detail()) if placed is not None else None

    def _placed(self, detected_ns: int) -> tuple[str, str] | None:
        state = self.state
        job = state.job
        if state.in_window(job) and job is not None and job.placed.is_set():
            if job.move_to is not None:
                return job.move_to
            return job.trace_id, job.root_span_id  # a follow-up (an exit after our part closed)
        if job is None or not state.in_window(job):
            job = state.job = JobIncident(detected_time_unix_nano=detected_ns)  # a manual incident
        job.detected_time_unix_nano = detected_ns
        # from what costs nothing at detection: the capture never waits for the trace's name
        key = time_bucket_key(detected_ns, state.config.time_bucket_s)
        trace_id, root = job_trace(state.config.job or "", key)
        if not job.placed.is_set():
            job.trace_id, job.root_span_id, job.key = trace_id, root, str(key)
            job.detected_here = True
            job.placed.set()
        return job.move_to or (job.trace_id, job.root_span_id)

    def companion(self, opened: IncidentOpened) -> Collect:
        """Called by the incident manager right after ``opened`` was published; returns how to collect its action events."""
        state = self.state
        for predicate, event, box in list(state.opened_waiters):
            if predicate(opened):
                box.append(opened)
                event.set()
        job = state.job
        if job is None or not job.placed.is_set() or job.local_incident_id is not None:
            return nothing  # not a job incident, or a follow-up in its trace (no new report or fan-out)
        if opened.trace_id not in (job.trace_id, (job.move_to or ("",))[0]):
            return nothing  # another trace (a user's own traceparent)
        job.local_incident_id = opened.incident_id
        job.opened.set()
        if job.move_to is not None and job.move_to[0] != opened.trace_id:
            state.spawn(state.move, opened.incident_id, *job.move_to)
        if job.move_to is not None:
            job.trace_id, job.root_span_id = job.move_to
            job.move_to = None
        if job.joined:
            if job.relay:
                state.spawn(self.coordinator.relay, job)
            else:
                job.done.set()
        else:
            state.spawn(self.member.start_job, job, opened)
        return self._collector(job, opened)

    def _collector(self, job: JobIncident, opened: IncidentOpened) -> Collect:
        state = self.state

        async def collect() -> list[ActionCompleted]:
            cfg = state.config
            # reports (the first candidate's timeouts retried), then the fan-out: bounded
            with anyio.move_on_after(cfg.peer_timeout_s * (2 * REPORT_TRIES + 2 * MAX_COORDINATOR_TRIES + 3) + cfg.report_window_s + 5):
                await job.done.wait()
            events = [ActionCompleted(source="fleet", incident_id=opened.incident_id, result=r) for r in job.results]
            events += job.extras
            job.extras = []
            record = state.agent.incidents.running.get(opened.incident_id)
            if record is not None:
                record.attributes.update(job.view)  # a cut-off host's partial view: on its own incident
                judge = getattr(state.agent.incidents, "judge", None)
                judged = list(judge.last_evidence) if judge is not None and record.verdict is not None else []
                state.spawn(self.member.share_evidence, job, record.opened.incident_id, str(record.bundle_dir), judged, record.verdict)
            return events

        return collect


async def nothing() -> list[ActionCompleted]:
    """No action events (a companion that is not a job incident's)."""
    return []

