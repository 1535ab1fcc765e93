"""A detecting host's side of a job incident: report, follow the coordinator, or coordinate; send evidence.

Owns :class:`Member`: the coordinator candidates in order (the announced host of global rank 0,
then the members lowest first), the report to them (``POST /v1/job/report``: the first one's
timeouts retried, :data:`~agent.fleet.fleetstate.REPORT_TRIES`; a redirect followed once), following
a verified answer's trace, coordinating when no candidate before this host answers (provisional,
or cut off), this host's evidence sent to the coordinator (``POST /v1/job/evidence``, retried while
it cannot be reached, until ``dedup_window_s``), and ``POST /v1/job/moved`` (the coordinator it
followed backed down: its evidence goes to the one named). The fan-out, back-down and cut-off are
:mod:`agent.fleet.coordinator`'s; the job verdict :mod:`agent.fleet.intake`'s.

Imports anyio, :mod:`agent.fleet.fleetstate`, :mod:`agent.fleet.senders`,
:mod:`agent.fleet.coordinator`, :mod:`agent.fleet.intake`, :mod:`agent.fleet.host_summary` and
the fleet's peer, message, job state and traceparent modules.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import anyio

from agent.fleet.api import Sender
from agent.fleet.coordinator import Coordinator
from agent.fleet.fleetstate import MAX_COORDINATOR_TRIES, REPORT_TRIES, FleetState, with_
from agent.fleet.host_summary import fit, host_evidence
from agent.fleet.intake import EvidenceIntake
from agent.fleet.jobstate import JobIncident
from agent.fleet.messages import Evidence, Moved, RelayedPeer, Report
from agent.fleet.peers import Peer, PeerReply, PeerResolver, call_peer, parse_peer
from agent.fleet.senders import Senders
from agent.fleet.traceparent import TraceParent
from agent.model.events import Action, ActionResult, IncidentOpened, Outcome, frozen_attrs

__all__ = ["EVIDENCE_RETRY_MAX_S", "Member"]

log = logging.getLogger("servewatch.fleet")

#: Longest wait between two tries of a host's evidence to a coordinator it cannot reach, seconds.
EVIDENCE_RETRY_MAX_S = 8.0


class Member:
    """A detecting host's reports, its following of the coordinator and its evidence, on ``state``."""

    def __init__(self, state: FleetState, senders: Senders, coordinator: Coordinator, intake: EvidenceIntake) -> None:
        self.state = state
        self.senders = senders
        self.coordinator = coordinator
        self.intake = intake

    # -- who coordinates ----------------------------------------------------------------------

    async def coordinator_order(self) -> tuple[list[Peer], Peer]:
        """Candidates for coordinator, first first: the announced host of global rank 0, then the
        job's members, lowest first (this agent among them); and this agent's own entry."""
        state = self.state
        assert state.resolver is not None
        members, _ = await state.resolver.resolve_all()
        state.members_seen = len(members)
        me = await state.self_address(members)
        if me not in members:
            members = [*members, me]
        order = PeerResolver.candidates(members)
        if 0 in state.local_ranks and state.announce_complete:
            return [me], me  # every live member knows this host holds global rank 0
        a = state.announced
        if a is not None and a.peer != me and time.monotonic() - a.time_s < 3 * state.config.announce_interval_s:
            order = [a.peer, *(p for p in order if p != a.peer)]
        return order, me

    async def head(self, skip: Sequence[str]) -> tuple[Peer, Peer]:
        """The first coordinator candidate not in ``skip`` (URLs), and this agent's own entry."""
        order, me = await self.coordinator_order()
        return next((p for p in order if p.url not in skip), me), me

    # -- report, or coordinate ----------------------------------------------------------------

    async def start_job(self, job: JobIncident, opened: IncidentOpened) -> None:
        """The protocol of this host's job incident ``opened``: report, or coordinate (fan-out);
        sets ``job.done``. An error is logged, never raised."""
        try:
            if job.coordinating:
                await self.coordinator.fanout(job)
                if job.coordinating and job.ahead:
                    await self.coordinator.recheck(job)  # provisional (a reporter could not reach those before us)
                return
            if job.coordinator is not None:
                return  # the coordinator's join reached us first: it knows we are in (no report needed)
            order, me = await self.coordinator_order()
            unreachable: list[str] = []
            silent: list[str] = []  # of those, the ones that may be alive and coordinating (no answer at all, or busy)
            job.reporting = anyio.Event()
            try:
                if await self._report_in_order(job, opened, order, me, unreachable, silent):
                    return
            finally:
                job.reporting.set()
            if not job.coordinating:
                # provisional: the candidates before us did not answer in time; we back down when
                # one of them (or a host that follows one) says it coordinates this trace
                job.ahead = list(dict.fromkeys(unreachable))
            job.coordinating = True
            job.cut_off = bool(unreachable)
            log.info("coordinating job incident %s (trace %s)%s", opened.incident_id, job.trace_id,
                     f"; unreachable: {', '.join(unreachable)}" if unreachable else "")
            await self.coordinator.fanout(job)
            await self._after_own_fanout(job, order, unreachable, silent)
        except Exception:  # boundary: the protocol never takes the agent down
            log.exception("job protocol of incident %s failed", opened.incident_id)
        finally:
            job.done.set()

    async def _report_in_order(self, job: JobIncident, opened: IncidentOpened, order: Sequence[Peer], me: Peer,
                               unreachable: list[str], silent: list[str]) -> bool:
        """Report to the candidates before us in ``order``: True when we are done (one coordinates,
        or the coordinator asked us meanwhile), False when we coordinate."""
        resolver = self.state.resolver
        for i, candidate in enumerate(order):
            if job.coordinator is not None and not unreachable:
                return True  # asked by the coordinator while we were about to report
            if job.coordinating or candidate == me or (resolver is not None and resolver.is_self(candidate)):
                return False
            if await self._report(job, opened, candidate, me, unreachable, silent, tries=REPORT_TRIES if i == 0 else 1):
                return True
            if len(unreachable) >= MAX_COORDINATOR_TRIES:  # a partitioned host coordinates its own view
                return False
        return False

    async def _after_own_fanout(self, job: JobIncident, order: Sequence[Peer], unreachable: list[str], silent: list[str]) -> None:
        state = self.state
        if silent and job.coordinating and not job.reported and not any(o.outcome is Outcome.OK for o in job.asked.values()):
            # no other host answered, and a candidate before us may be alive behind a
            # partition: our view is partial (candidates that all refused us, or the
            # connection, are no coordinators: then we are the job's, and judge it)
            first = next((p for p in order if p.url == silent[0]), None)  # else a redirect's target
            self.coordinator.cut_off(job, first or parse_peer(silent[0], default_port=state.port, scheme=state.scheme), unreachable)
        elif job.coordinating and job.ahead:
            await self.coordinator.recheck(job)  # before any evidence comes here: a back-down now redirects it all

    async def _report(self, job: JobIncident, opened: IncidentOpened, candidate: Peer, me: Peer, unreachable: list[str],
                      silent: list[str] | None = None, *, tries: int = 1) -> bool:
        """Report our detection to ``candidate``. True when it coordinates (or named who does and
        that one answered); False: try the next one (its URL added to ``unreachable``, and to
        ``silent`` when it may still be a live coordinator: :func:`may_coordinate`). ``tries``:
        reports sent to ``candidate`` while its answer times out (it may have taken the report and
        coordinate: a report is idempotent there), each bounded by ``peer_timeout_s``."""
        state = self.state
        body = Report.model_validate({
            "job": state.config.job, "host.name": state.host_name, "agent_id": state.agent_id, "api_port": state.port,
            "scheme": state.scheme, "incident_id": opened.incident_id, "trace_id": job.trace_id, "key": job.key,
            "detected_time_unix_nano": job.detected_time_unix_nano or opened.time_unix_nano, "trigger": opened.trigger,
            "ranks": list(state.local_ranks), "world_size": state.world_size, "unreachable": unreachable, "address": me.url,
        }).model_dump(by_alias=True)
        for _hop in range(2):  # one redirect at most
            reply = await self._send_report(candidate, body, tries)
            doc = reply.doc or {}
            if reply.result.outcome is not Outcome.OK:
                unreachable.append(candidate.url)
                if silent is not None and may_coordinate(reply.result):
                    silent.append(candidate.url)
                job.results.append(reply.result)
                return False
            if not reply.verified:
                state.unverified_answers += 1
                log.warning("%s answered our report without proof of the job's token: ignored", candidate)
                unreachable.append(candidate.url)
                job.results.append(with_(reply.result, outcome=Outcome.REFUSED, detail=f"{candidate}: answer not verified (ignored)"))
                return False
            if doc.get("status") == "redirect":
                target = state.redirect_target(doc)
                if target is None or target == me:
                    return False
                candidate = target
                continue
            job.coordinator, job.coordinator_host = candidate, str(doc.get("host.name") or candidate)
            if job.coordinating:  # a report reached us meanwhile and we took it: one coordinator, theirs
                job.coordinating, job.backed_down = False, True
                log.warning("job %s: %s coordinates trace %s: backing down (reports sent to us are redirected there)",
                            state.config.job, job.coordinator_host, job.trace_id)
                self.coordinator.tell_moved(job)
            job.results.append(reply.result)
            await self._follow(job, doc)
            return True
        return False

    async def _send_report(self, candidate: Peer, body: dict[str, Any], tries: int) -> PeerReply:
        """``body`` sent to ``candidate`` up to ``tries`` times while it times out; the reply says the tries when more than one."""
        state = self.state
        for attempt in range(1, max(1, tries) + 1):
            state.reports_sent += 1
            reply = await call_peer(candidate, "/v1/job/report", body, credentials=state.as_listed(),
                                    timeout_s=state.config.peer_timeout_s, action=Action.REPORT, attempts=3)
            if reply.result.outcome is not Outcome.TIMED_OUT or attempt == tries:
                break  # timed out: sent again (connect_timeout too: a sender starved of CPU sees its own connect time out)
            log.warning("job %s: our report to %s got no answer within %.1f s (try %d of %d): sent again",
                        state.config.job, candidate, state.config.peer_timeout_s, attempt, tries)
        if attempt > 1:
            reply = PeerReply(with_(reply.result, attributes=frozen_attrs({**reply.result.attributes, "servewatch.report.tries": attempt})),
                              reply.doc, reply.verified)
        return reply

    async def _follow(self, job: JobIncident, doc: dict[str, Any]) -> None:
        """A verified coordinator's answer names the job's trace: move ours there if it differs."""
        try:
            tp = TraceParent.parse(str(doc.get("traceparent", "")))
        except ValueError:
            return
        if tp.trace_id == job.trace_id:
            return
        job.trace_id, job.root_span_id = tp.trace_id, tp.parent_id
        if job.local_incident_id is not None:
            await self.state.move(job.local_incident_id, tp.trace_id, tp.parent_id)

    # -- evidence -----------------------------------------------------------------------------

    async def share_evidence(self, job: JobIncident, incident_id: str, bundle_dir: str, judged: list[Any], verdict: Any) -> None:
        """This host's evidence of ``incident_id`` (its bundle at ``bundle_dir``): judged here as
        coordinator, else sent to the coordinator. An error is logged, never raised."""
        try:
            evidence = await anyio.to_thread.run_sync(self._evidence, job, incident_id, bundle_dir, judged, verdict)
            if job.coordinating:
                job.add_evidence(evidence)
                if not job.verdict_started:
                    job.verdict_started = True
                    await self.intake.job_verdict(job, bundle_dir)
                if job.coordinating:
                    return
            if job.coordinator is None:
                return  # nobody to tell (a follow-up, or the coordinator never answered)
            await self.send_evidence(job, evidence)
        except Exception:  # boundary
            log.exception("sharing the evidence of incident %s failed", incident_id)

    async def send_evidence(self, job: JobIncident, evidence: Evidence) -> None:
        """Send our evidence to the job's coordinator (``job.coordinator``; a redirect to the one it
        follows is taken once), marked partial or backed down as this host is. A coordinator that
        does not answer, or answers busy (HTTP 503: a provisional one not settled yet), is tried
        again (backoff up to :data:`EVIDENCE_RETRY_MAX_S` seconds) until ``dedup_window_s`` from
        the job incident's start: a partitioned host's evidence arrives when the partition heals.
        Any other refusal is final (logged)."""
        state = self.state
        assert job.coordinator is not None
        job.sent_evidence = evidence
        evidence = evidence.model_copy(update={"partial": job.partial, "backed_down": job.backed_down,
                                               "moved_hosts": job.moved_hosts if job.backed_down else []})
        body = json.loads(fit(evidence, state.api_config.max_body_bytes - 1024))
        target, hops, delay_s = job.coordinator, 0, 1.0
        deadline = job.started + state.config.dedup_window_s
        while True:
            reply = await call_peer(target, "/v1/job/evidence", body, credentials=state.as_listed(),
                                    timeout_s=state.config.peer_timeout_s, action="fleet.evidence", attempts=4)
            redirected = self._evidence_redirect(reply, target) if hops == 0 else None
            if redirected is not None:
                target, hops = redirected, 1
                continue
            if reply.result.outcome is Outcome.OK:
                if job.partial:
                    log.warning("job %s: our partial evidence reached %s", state.config.job, job.coordinator_host or target)
                return
            if (reply.result.outcome is Outcome.REFUSED and not reply.result.retryable) or time.monotonic() + delay_s > deadline:
                log.warning("sending our evidence to the coordinator failed: %s", reply.result.detail)
                return
            log.info("job %s: the coordinator %s did not take our evidence (%s): again in %.0f s", state.config.job,
                     job.coordinator_host or target, reply.result.detail, delay_s)
            await anyio.sleep(delay_s)
            delay_s = min(EVIDENCE_RETRY_MAX_S, delay_s * 2)

    def _evidence_redirect(self, reply: PeerReply, target: Peer) -> Peer | None:
        """Where a verified redirect answering our evidence sends it (``None``: no redirect, or back to ``target``)."""
        doc = reply.doc or {}
        if not (reply.result.outcome is Outcome.OK and reply.verified and doc.get("status") == "redirect"):
            return None
        redirected = self.state.redirect_target(doc)
        return redirected if redirected is not None and redirected != target else None

    def _evidence(self, job: JobIncident, incident_id: str, bundle_dir: str, judged: list[Any], verdict: Any) -> Evidence:
        state = self.state
        evidence = host_evidence(job=state.config.job or "-", host_name=state.host_name, agent_id=state.agent_id, trace_id=job.trace_id,
                                 incident_id=incident_id, bundle_dir=bundle_dir, judged=judged, verdict=verdict)
        if evidence.world_size is not None:
            state.world_size = evidence.world_size
        relayed = [RelayedPeer.model_validate({"address": o.address, "outcome": str(o.outcome) if str(o.outcome) in
                                               ("ok", "refused", "timed_out", "failed") else "failed", "detail": o.detail,
                                               "host.name": o.host_name, "ranks": list(o.ranks)}) for o in job.relayed]
        return evidence.model_copy(update={"relayed": relayed}) if relayed else evidence

    async def on_moved(self, message: Moved, sender: Sender) -> tuple[int, dict[str, Any]]:
        """``POST /v1/job/moved``: the coordinator we sent our evidence to backed down
        (:meth:`Coordinator.tell_moved`): follow the one it names and send our evidence there
        again. Taken only from that coordinator, for this host's job incident (409 otherwise;
        400: the coordinator named is no peer address)."""
        state = self.state
        job = state.job
        if job is None or not state.in_window(job) or message.trace_id != job.trace_id:
            return 409, {"error": "not the job incident of this agent", "host.name": state.host_name,
                         **(state.trace_doc(job) if job is not None else {})}
        if job.coordinating or job.coordinator is None or not await self.senders.at(job.coordinator, sender):
            return 409, {"error": "only the coordinator this agent follows says where it moved", "host.name": state.host_name,
                         **state.trace_doc(job)}
        target = state.redirect_target({"coordinator": message.coordinator})
        if target is None:
            return 400, {"error": "coordinator is not a peer address", "host.name": state.host_name}
        job.coordinator, job.coordinator_host = target, message.coordinator_host or target.url
        log.warning("job %s: %s backed down as coordinator: our evidence goes to %s", state.config.job, message.host_name,
                    job.coordinator_host)
        if job.sent_evidence is not None:
            state.spawn(self.send_evidence, job, job.sent_evidence)
        return 200, {"status": "following", "host.name": state.host_name, **state.trace_doc(job)}


def may_coordinate(result: ActionResult) -> bool:
    """Whether a coordinator candidate whose report failed with ``result`` may still be alive and
    coordinating: no answer in time, no route (a partition looks like this), or a busy answer
    (HTTP 408/429/5xx). A refused connection or TLS handshake, a refusal (another job, another
    token), an answer without the job's proof or not HTTP at all: no agent of the job there."""
    if result.outcome is Outcome.TIMED_OUT:
        return True
    if result.outcome is Outcome.REFUSED:
        return result.retryable
    attrs = result.attributes
    return attrs.get("servewatch.peer.error") == "unreachable" and not attrs.get("servewatch.peer.refused")
