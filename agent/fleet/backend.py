"""The API backend's protocol handlers: reports, joins and manual incidents.

Owns :class:`Backend`: ``POST /v1/job/report`` (taken as coordinator, redirected to the
coordinator this host follows, opening the job incident this host then coordinates, a late report
of one already judged, a provisional coordinator's question), ``POST /v1/incidents`` (a manual
incident, or a join of the job's trace: attached, opened, moved into the coordinator's trace, or
refused when it does not come from the coordinator) and the incidents opened for them. Every
handler answers ``(HTTP status, JSON document)``; the sender of a job message is as
:class:`~agent.fleet.senders.Senders` proved it. :class:`~agent.fleet.job.Fleet` is the API's
backend object (:class:`~agent.fleet.api.AgentApi`) and forwards here; announce, evidence and moved
are :mod:`agent.fleet.announce`'s, :mod:`agent.fleet.intake`'s and :mod:`agent.fleet.member`'s.

Imports anyio, :mod:`agent.fleet.fleetstate`, :mod:`agent.fleet.senders`,
:mod:`agent.fleet.coordinator`, :mod:`agent.fleet.member`, :mod:`agent.fleet.bundles`,
:mod:`agent.fleet.identity` and the fleet's API, message, peer, job state and traceparent modules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from agent.fleet.api import JoinRequest, Sender
from agent.fleet.bundles import incident_doc
from agent.fleet.coordinator import Coordinator
from agent.fleet.fleetstate import REPORT_TRIES, FleetState
from agent.fleet.identity import repeat_trace, root_span_of
from agent.fleet.jobstate import JobIncident
from agent.fleet.member import Member
from agent.fleet.messages import MemberInfo, Report
from agent.fleet.peers import Peer, parse_peer
from agent.fleet.senders import Senders
from agent.fleet.traceparent import TraceParent
from agent.model.events import IncidentOpened, Trigger, now_ns
from agent.model.ranks import rank_label

__all__ = ["Answer", "Backend"]

log = logging.getLogger("servewatch.fleet")

#: A handler's answer: the HTTP status and the JSON document.
Answer = tuple[int, dict[str, Any]]


class Backend:
    """Reports, joins and manual incidents taken over the API, on ``state``."""

    def __init__(self, state: FleetState, senders: Senders, coordinator: Coordinator, member: Member) -> None:
        self.state = state
        self.senders = senders
        self.coordinator = coordinator
        self.member = member

    # -- reports ------------------------------------------------------------------------------

    async def on_report(self, report: Report, sender: Sender) -> Answer:
        """``POST /v1/job/report`` from ``sender``: 200 ``coordinating`` (with the job's trace) or
        ``redirect`` (to the coordinator), 409 when ``sender`` claims a host another identity proved."""
        state = self.state
        state.reports_received += 1
        reporter = await self.senders.peer_of(report, sender)
        if report.provisional:
            return self._on_provisional(report, reporter, sender)
        job = state.job
        if state.in_window(job) and job is not None and not job.placed.is_set():
            with anyio.move_on_after(state.config.accept_timeout_s):
                await job.placed.wait()  # ours is being placed right now
        if state.in_window(job) and job is not None and job.placed.is_set():
            redirect = await self._take_report(job, report, reporter)
            if redirect is not None:
                return redirect
        else:
            opened = await self._report_opens(report, reporter)
            if isinstance(opened, tuple):
                return opened
            job = opened
        conflict = self.senders.claim(job, report.host_name, sender, "a report")
        if conflict:
            return 409, {"error": conflict, "host.name": state.host_name, **state.trace_doc(job)}
        job.reported[reporter.url] = report.host_name
        job.reported_by[reporter.url] = job.proven.get(report.host_name, "")
        job.last_report_s = time.monotonic()
        job.detected_time_unix_nano = min(job.detected_time_unix_nano or report.detected_time_unix_nano, report.detected_time_unix_nano)
        job.member_info[reporter.url] = MemberInfo.model_validate({"job": report.job, "host.name": report.host_name,
                                                                   "ranks": report.ranks, "world_size": report.world_size})
        state.world_size = state.world_size or report.world_size
        return 200, {"status": "coordinating", "host.name": state.host_name, "coordinator": "", **state.trace_doc(job)}

    async def _take_report(self, job: JobIncident, report: Report, reporter: Peer) -> Answer | None:
        """A report for our placed job incident: a redirect to the coordinator we follow, else ``None`` (we coordinate)."""
        state = self.state
        if not job.coordinating and job.reporting is not None:
            with anyio.move_on_after(state.config.peer_timeout_s * (REPORT_TRIES + 1)):
                await job.reporting.wait()  # our own report is on its way (tried again on timeouts): its answer says who coordinates
        if not job.coordinating and job.coordinator is not None:
            # one coordinator: even one the reporter could not reach (it tries once more, then
            # its evidence goes there later); never a second one here
            return 200, {"status": "redirect", "coordinator": job.coordinator.url, "host.name": state.host_name,
                         **state.trace_doc(job)}
        if not job.coordinating:
            job.ahead = [u for u in report.unreachable if u != reporter.url]
        job.coordinating = True
        return None

    async def _report_opens(self, report: Report, reporter: Peer) -> JobIncident | Answer:
        """A report with no job incident here yet: the job incident we open and coordinate, else the answer (a redirect,
        or a late report of a job incident already judged)."""
        state = self.state
        # coordinate only when first in this host's own order (the candidates before us
        # unreachable for the reporter), else say who is
        head, me = await self.member.head([*report.unreachable, reporter.url])
        if head != me and not (state.resolver is not None and state.resolver.is_self(head)):
            return 200, {"status": "redirect", "coordinator": head.url, "host.name": state.host_name, "trace_id": None}
        judged = state.judged.get(report.trace_id)
        if judged is not None and abs(report.detected_time_unix_nano - judged.detected_time_unix_nano) < state.config.dedup_window_s * 1e9:
            # a late report of the job incident already judged (its host detected it as the
            # others did, then took long): the same trace, no new incident
            judged.reported[reporter.url] = report.host_name
            return 200, {"status": "coordinating", "host.name": state.host_name, "coordinator": "", "late": True,
                         **state.trace_doc(judged)}
        trace_id, root = report.trace_id, root_span_of(report.trace_id)
        if trace_id in state.past_traces:  # a restarted job hanging at the same collective: a new trace
            trace_id, root = repeat_trace(trace_id, state.past_traces[trace_id])
        # provisional when the reporter could not reach the candidates before us (``ahead``)
        job = state.job = JobIncident(trace_id=trace_id, root_span_id=root, key=report.key, coordinating=True,
                                      detected_time_unix_nano=report.detected_time_unix_nano,
                                      ahead=[u for u in report.unreachable if u != reporter.url])
        job.placed.set()
        why = f"job {state.config.job}: {report.host_name} detected {report.trigger or 'a hang'} ({report.key})"
        state.spawn(self._open_joined, why[:500], TraceParent(trace_id, root))
        return job

    def _on_provisional(self, report: Report, reporter: Peer, sender: Sender) -> Answer:
        """A host coordinated ``report``'s trace because we did not answer it in time, and asks
        whether we coordinate it: ``coordinating`` (it backs down; recorded here) when we do (or
        judged it already), else ``not_coordinating``; never a new job incident."""
        state = self.state
        job = state.job
        target = state.judged.get(report.trace_id)
        if target is None and job is not None and state.in_window(job) and job.trace_id == report.trace_id and job.coordinating and not job.ahead:
            target = job
        if target is None:
            return 200, {"status": "not_coordinating", "host.name": state.host_name, "trace_id": report.trace_id}
        conflict = self.senders.claim(target, report.host_name, sender, "a report")
        if conflict:
            return 409, {"error": conflict, "host.name": state.host_name, **state.trace_doc(target)}
        target.reported.setdefault(reporter.url, report.host_name)
        if report.host_name not in target.backed_down_hosts:
            target.backed_down_hosts.append(report.host_name)
        log.warning("job %s: %s coordinated trace %s while we did not answer it in time: it backs down to us", state.config.job,
                    report.host_name, report.trace_id)
        return 200, {"status": "coordinating", "host.name": state.host_name, "coordinator": "", **state.trace_doc(target)}

    # -- joins and manual incidents -----------------------------------------------------------

    async def post_incident(self, request: JoinRequest, *, agent_id: str, sender: Sender | None = None) -> Answer:
        """``POST /v1/incidents``: a manual incident, or a join of the job's trace (or a user's).

        ``sender``: who sent it as far as it is proven (``None``: a caller in this process). A
        join that names another trace than this host's job incident moves it only when it comes
        from the job's coordinator (:meth:`_may_retrace`); else it is refused (409) and said."""
        state = self.state
        if agent_id and agent_id == state.agent_id:
            return 409, {"error": "self", "host.name": state.host_name}
        tp: TraceParent | None = request.get("traceparent")
        if tp is None:
            return await self._manual(request)
        job_name = request.get("job")
        if job_name is not None and job_name != state.config.job:
            return 409, {"error": f"job mismatch: this agent is in job {state.config.job!r}", "host.name": state.host_name}
        state.joins += 1
        job = state.job
        if state.in_window(job) and job is not None:
            return await self._join_ours(job, request, tp, sender)
        return await self._join_new(request, tp)

    async def _join_ours(self, job: JobIncident, request: JoinRequest, tp: TraceParent, sender: Sender | None) -> Answer:
        """A join while our job incident is in its window: attached, joined, moved into the coordinator's trace, or refused."""
        state = self.state
        if job.trace_id != tp.trace_id and not await self._may_retrace(job, request, sender):
            return self._refuse_retrace(job, tp, sender)
        if not job.placed.is_set() or (job.local_incident_id is None and job.trace_id != tp.trace_id and not job.joined):
            # ours is being placed or opened: the coordinator's trace wins, once it opened
            job.move_to = (tp.trace_id, tp.parent_id)
            with anyio.move_on_after(state.config.accept_timeout_s):
                await job.opened.wait()
            self._adopt_coordinator(job, request)
            return 202, self._answer("joined", job)
        if job.coordinating and job.ahead and job.trace_id == tp.trace_id and sender is not None:
            await self._back_down_if_join_ahead(job, request, sender)
        self._adopt_coordinator(job, request)
        if job.trace_id == tp.trace_id:
            return 200, self._answer("attached", job)
        # a request that passed authentication names another trace: the coordinator's wins
        job.trace_id, job.root_span_id = tp.trace_id, tp.parent_id
        if job.local_incident_id is not None and job.local_incident_id in state.agent.incidents.running:
            await state.move(job.local_incident_id, tp.trace_id, tp.parent_id)
            return 200, self._answer("moved", job)
        return 200, self._answer("attached", job)

    async def _back_down_if_join_ahead(self, job: JobIncident, request: JoinRequest, sender: Sender) -> None:
        claimed = self.state.redirect_target({"coordinator": request.get("coordinator")})
        if claimed is not None and claimed.url in job.ahead and await self.senders.at(claimed, sender):
            self.coordinator.back_down(job, claimed, request.get("origin_host") or "", "its join reached us: it coordinates this job incident")

    async def _join_new(self, request: JoinRequest, tp: TraceParent) -> Answer:
        """A join with no job incident here: ours opens in its trace."""
        state = self.state
        job = state.job = JobIncident(trace_id=tp.trace_id, root_span_id=tp.parent_id, joined=True, key="join",
                                      detected_time_unix_nano=request.get("origin_time_unix_nano") or now_ns())
        job.placed.set()
        job.relay = list(request.get("relay") or [])
        self._adopt_coordinator(job, request)
        origin = request.get("origin_host") or "?"
        detail = request.get("detail") or ""
        why = f"job {state.config.job or '-'}: {origin} opened {request.get('incident_id') or 'an incident'}" + (f" ({detail})" if detail else "")
        state.spawn(self._open_joined, why[:500], tp)
        with anyio.move_on_after(state.config.accept_timeout_s):
            await job.opened.wait()
        return 202, self._answer("opened" if job.local_incident_id else "accepted", job)

    async def _may_retrace(self, job: JobIncident, request: JoinRequest, sender: Sender | None) -> bool:
        """Only the job's coordinator moves this host's job incident into another trace: the
        coordinator this host knows (its report's answer), else a join naming its own sender as
        the coordinator; never a coordinating host's (its trace is the job's)."""
        state = self.state
        if sender is None:
            return True
        if job.coordinating:
            return False
        if job.coordinator is not None:
            return await self.senders.at(job.coordinator, sender)
        raw = request.get("coordinator")
        try:
            claimed = parse_peer(raw, default_port=state.port, scheme=state.scheme) if isinstance(raw, str) else None
        except ValueError:
            claimed = None
        return claimed is not None and await self.senders.at(claimed, sender)

    def _refuse_retrace(self, job: JobIncident, tp: TraceParent, sender: Sender | None) -> Answer:
        state = self.state
        who = sender.identity if sender is not None else "?"
        coordinator = "this agent" if job.coordinating else (job.coordinator.url if job.coordinator else "not known yet")
        line = job.conflict(f"a join from {who} naming trace {tp.trace_id} refused: this job incident's trace is"
                            f" {job.trace_id or '(being placed)'}, its coordinator {coordinator}")
        state.identity_conflicts += 1
        log.warning("job %s: %s", state.config.job, line)
        return 409, {"error": line, "status": "refused", "host.name": state.host_name, **state.trace_doc(job)}

    def _adopt_coordinator(self, job: JobIncident, request: JoinRequest) -> None:
        state = self.state
        raw = request.get("coordinator")
        if job.coordinating or job.coordinator is not None or not isinstance(raw, str):
            return
        try:
            job.coordinator = parse_peer(raw, default_port=state.port, scheme=state.scheme)
            job.coordinator_host = request.get("origin_host") or ""
        except ValueError:
            pass

    async def _manual(self, request: JoinRequest) -> Answer:
        state = self.state
        manager = state.agent.incidents
        job = state.job
        if state.config.job and state.in_window(job) and job is not None:
            with anyio.move_on_after(state.config.accept_timeout_s):
                await job.placed.wait()
            return 200, self._answer("attached", job)  # the job incident holds this host's evidence already
        current = manager.current
        if current is not None:
            return 409, {"error": "an incident is running", **incident_doc(state.host_name, current.opened), "status": "busy"}
        detail = request.get("detail") or "requested over the agent API"
        # a manual incident pauses every rank (py-spy): it shares the cooldown of every trigger
        left_s, last_id = manager.claim_cooldown(Trigger.MANUAL, detail)
        if left_s > 0:
            return 429, {"error": f"cooling down: incident {last_id or '(the last manual one)'} opened less than"
                         f" incident.cooldown_s ago; retry in {left_s:.0f} s", "status": "cooldown",
                         "incident_id": last_id, "retry_after_s": round(left_s, 1), "host.name": state.host_name}
        since = now_ns()
        opened = await self._open_and_wait(lambda o: o.time_unix_nano >= since, Trigger.MANUAL, detail, None)
        if opened is not None:
            manager.cooldown_opened(Trigger.MANUAL, opened.incident_id)
        return 202, {"status": "opened" if opened else "accepted", **incident_doc(state.host_name, opened)}

    async def _open_joined(self, detail: str, tp: TraceParent) -> None:
        try:
            await self.state.agent.incidents.open_incident(Trigger.PEER, detail=detail, parent=(tp.trace_id, tp.parent_id))
        except Exception:  # boundary: a failed incident is logged, the agent goes on
            log.exception("joined incident failed")

    async def _open_and_wait(
        self, predicate: Callable[[IncidentOpened], bool], trigger: str, detail: str, parent: tuple[str, str] | None
    ) -> IncidentOpened | None:
        state = self.state
        event, box = anyio.Event(), []  # type: ignore[var-annotated]
        waiter = (predicate, event, box)
        state.opened_waiters.append(waiter)
        try:
            async def run() -> None:
                try:
                    await state.agent.incidents.open_incident(trigger, detail=detail, parent=parent)
                except Exception:
                    log.exception("incident requested over the API failed")

            state.spawn(run)
            with anyio.move_on_after(state.config.accept_timeout_s):
                await event.wait()
        finally:
            state.opened_waiters.remove(waiter)
        return box[0] if box else None

    def _ranks(self) -> list[str]:
        current = self.state.agent.incidents.current
        targets = current.targets if current is not None else []
        return [label for label in (rank_label(t.title) for t in targets) if label]

    def _answer(self, status: str, job: JobIncident) -> dict[str, Any]:
        """A join's answer; ``coordinating``: this host coordinates the job incident (not
        provisionally); ``coordinator``: the one it follows (a provisional coordinator asking backs
        down when it is one it could not reach)."""
        state = self.state
        return {"status": status, "host.name": state.host_name, "job": state.config.job, "incident_id": job.local_incident_id,
                "ranks": list(state.local_ranks), "rank_labels": self._ranks(), "agent_id": state.agent_id,
                "coordinating": job.coordinating and not job.ahead, "coordinator": job.coordinator.url if job.coordinator else None,
                **state.trace_doc(job)}
