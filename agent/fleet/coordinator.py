"""The coordinator's side of a job incident: the fan-out, backing down, and being cut off.

Owns :class:`Coordinator`: the fan-out to every member that did not report (bounded, through
relays above ``tree_threshold``: one ``fleet.fanout`` result, a few ``peer.capture`` ones, every
outcome in the bundle's ``fanout.json``), a joined host's relaying of it, what the join answers
prove (host names, a candidate ahead that coordinates), the provisional coordinator's recheck of
its first choice and its backing down (no verdict; the hosts whose evidence it took are told where
the coordinator is, ``POST /v1/job/moved``), and a cut-off host's partial view. Evidence intake and
the job verdict are :mod:`agent.fleet.intake`'s.

Imports anyio, :mod:`agent.fleet.fleetstate`, :mod:`agent.fleet.senders` and the fleet's fan-out,
peer, message, job state and traceparent modules.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import anyio

from agent.fleet.api import Sender
from agent.fleet.fanout import bounded, plan
from agent.fleet.fleetstate import REPORT_TRIES, FleetState, doc_ranks, is_ip_literal, with_
from agent.fleet.jobstate import JobIncident, PeerOutcome
from agent.fleet.messages import MemberInfo, Moved, Report
from agent.fleet.peers import Peer, PeerReply, call_peer, parse_peer
from agent.fleet.senders import Senders
from agent.fleet.traceparent import TraceParent
from agent.host.fsutil import atomic_write_text
from agent.model.events import Action, ActionResult, Outcome, frozen_attrs, now_ns

__all__ = ["FANOUT_FILE", "MAX_PEER_SPANS", "Coordinator"]

log = logging.getLogger("servewatch.fleet")

#: Most per-peer ``peer.capture`` spans one fan-out emits (the rest are in ``fanout.json``).
MAX_PEER_SPANS = 16
#: Every peer's outcome of a fan-out, in the coordinator's bundle.
FANOUT_FILE = "fanout.json"


class Coordinator:
    """The coordinator's fan-out, recheck, back-down and cut-off, on ``state``."""

    def __init__(self, state: FleetState, senders: Senders) -> None:
        self.state = state
        self.senders = senders

    async def fanout(self, job: JobIncident) -> None:
        """Ask every member that did not report to capture into the job's trace (bounded, maybe
        through relays); one ``fleet.fanout`` result (and a few ``peer.capture`` ones)."""
        state = self.state
        await self._quiet(job)  # a lockstep hang's reports arrive within a few ms of each other
        assert state.resolver is not None
        start = now_ns()
        members, problems = await state.resolver.resolve_all()
        state.members_seen = len(members)
        job.results.extend(problems)
        me = await state.self_address(members)
        job.members = [p.url for p in members if p != me and not state.resolver.is_self(p)] + [me.url]
        to_ask = [p for p in members if p != me and not state.resolver.is_self(p) and p.url not in job.reported]
        state.fanouts += 1
        state.peers_asked += len(to_ask)
        shape = plan(to_ask, threshold=state.config.tree_threshold)
        replies: list[tuple[Peer, PeerReply, int]] = []

        async def ask(item: tuple[Peer, list[Peer]]) -> None:
            peer, relay = item
            reply = await call_peer(peer, "/v1/incidents", self.join_body(job, me, relay), credentials=state.credentials,
                                    timeout_s=state.config.peer_timeout_s, attempts=2,
                                    headers={"traceparent": TraceParent(job.trace_id, job.root_span_id).header()})
            if reply.result.outcome is Outcome.OK and not reply.verified:  # an impostor at a member's address
                reply = PeerReply(with_(reply.result, outcome=Outcome.REFUSED, detail=f"{peer}: answer not verified (ignored)"),
                                  None, False)
                state.unverified_answers += 1
            replies.append((peer, reply, len(relay)))
            self._note_answer(job, peer, reply)

        await bounded(shape, ask, limit=state.config.fanout_concurrency)
        await anyio.to_thread.run_sync(lambda: self._fanout_results(job, replies, start, relays=sum(1 for _, r in shape if r)))

    async def _quiet(self, job: JobIncident) -> None:
        """Until no report came for ``report_grace_s`` (before the first one: ``first_report_wait_s``
        when this host detected the hang itself: the others did too, most likely), at most
        ``report_window_s``."""
        cfg = self.state.config
        start = time.monotonic()
        first = cfg.first_report_wait_s if job.detected_here else cfg.report_grace_s
        while True:
            since_last = max(job.last_report_s, start) + cfg.report_grace_s if job.last_report_s else start + first
            until = min(since_last, start + cfg.report_window_s)
            if until <= time.monotonic():
                return
            await anyio.sleep(until - time.monotonic())

    def join_body(self, job: JobIncident, me: Peer, relay: Sequence[Peer]) -> dict[str, Any]:
        """The body of the join (``POST /v1/incidents``) asking a member into ``job``'s trace; ``me``: the coordinator."""
        state = self.state
        return {"job": state.config.job, "origin_host": state.host_name, "incident_id": job.local_incident_id,
                "origin_time_unix_nano": job.detected_time_unix_nano, "detail": f"job incident {job.key}"[:500],
                "coordinator": me.url, "relay": [p.url for p in relay]}

    def _note_answer(self, job: JobIncident, peer: Peer, reply: PeerReply) -> None:
        state = self.state
        doc = reply.doc or {}
        host = str(doc.get("host.name") or "")
        ranks = doc_ranks(doc)
        job.asked[peer.url] = PeerOutcome(peer.url, reply.result.outcome, reply.result.detail, host, ranks)
        answered = reply.verified and reply.result.outcome is Outcome.OK
        if answered and job.ahead and doc.get("trace_id") == job.trace_id:
            self._back_down_if_ahead(job, peer, host, doc)
        if answered and host:
            if is_ip_literal(peer.host) and self.senders.claim(job, host, Sender(peer.host, peer.port), "a join's answer", asked=True):
                return  # an answer at one member's address naming another member's host: not believed
            job.member_info[peer.url] = MemberInfo.model_validate({"job": state.config.job or "-", "host.name": host, "ranks": list(ranks)})
        if reply.doc is not None and not reply.verified:
            state.unverified_answers += 1

    def _back_down_if_ahead(self, job: JobIncident, peer: Peer, host: str, doc: dict[str, Any]) -> None:
        """A verified join answer (same trace) from a candidate ahead of us, or naming one it follows: we back down."""
        state = self.state
        follows = doc.get("coordinator")
        if doc.get("coordinating") is True and peer.url in job.ahead:
            self.back_down(job, peer, host, f"{host or peer} answered our join: it coordinates this job incident")
        elif isinstance(follows, str) and follows in job.ahead:
            target = state.redirect_target(doc)
            if target is not None:
                self.back_down(job, target, state.proven_name(job, target.url, bare=True),
                               f"{host or peer} answered our join: it follows {state.proven_name(job, follows)}")

    async def recheck(self, job: JobIncident) -> None:
        """After a provisional coordinator's fan-out, and again before its verdict: ask its first
        choice (``job.ahead[0]``) whether it coordinates this trace after all (a report marked
        ``provisional``, tried :data:`REPORT_TRIES` times while it times out); a verified
        ``coordinating`` answer for the same trace makes this host back down."""
        state = self.state
        assert state.resolver is not None
        try:
            first = parse_peer(job.ahead[0], default_port=state.port, scheme=state.scheme)
        except ValueError:
            return
        members, _ = await state.resolver.resolve_all()
        me = await state.self_address(members)
        body = Report.model_validate({
            "job": state.config.job, "host.name": state.host_name, "agent_id": state.agent_id, "api_port": state.port,
            "scheme": state.scheme, "incident_id": job.local_incident_id or "unknown", "trace_id": job.trace_id, "key": job.key[:80],
            "detected_time_unix_nano": job.detected_time_unix_nano, "ranks": list(state.local_ranks), "world_size": state.world_size,
            "address": me.url, "provisional": True,
        }).model_dump(by_alias=True)
        for _ in range(REPORT_TRIES):
            state.reports_sent += 1
            reply = await call_peer(first, "/v1/job/report", body, credentials=state.as_listed(),
                                    timeout_s=state.config.peer_timeout_s, action=Action.REPORT, attempts=3)
            if reply.result.outcome is not Outcome.TIMED_OUT:
                break
        doc = reply.doc or {}
        if reply.result.outcome is Outcome.OK and reply.verified and doc.get("status") == "coordinating" and doc.get("trace_id") == job.trace_id:
            self.back_down(job, first, str(doc.get("host.name") or ""), f"{doc.get('host.name') or first} answered late: it coordinates")

    def back_down(self, job: JobIncident, coordinator: Peer, host: str, why: str) -> None:
        """A provisional coordinator (``job.ahead``) learnt that one before it coordinates the same
        trace: it stops coordinating, emits no job verdict and sends its evidence there."""
        if not job.coordinating or not job.ahead:
            return
        job.coordinating, job.backed_down, job.cut_off = False, True, False
        job.coordinator, job.coordinator_host = coordinator, host
        log.warning("job %s: backing down as coordinator of trace %s: %s; our evidence goes to %s", self.state.config.job,
                    job.trace_id, why, host or coordinator)
        job.evidence_changed.set()  # a verdict waiting for evidence stops waiting
        job.evidence_changed = anyio.Event()
        self.tell_moved(job)

    def tell_moved(self, job: JobIncident) -> None:
        """Having backed down, tell every host whose evidence we took (in the background) where
        the coordinator is (``POST /v1/job/moved``): each sends it there again. Without this
        their evidence, answered ``received`` here, never reached the job verdict."""
        state = self.state
        held = {h: s for h, s in job.evidence_senders.items() if h != state.host_name}
        job.evidence_senders.clear()
        job.moved_hosts = sorted(held)[:1024]  # said on our own evidence: the coordinator waits for them
        if held and job.coordinator is not None and state.tg is not None:
            state.spawn(self._send_moved, job, job.coordinator, held)

    async def _send_moved(self, job: JobIncident, coordinator: Peer, held: dict[str, Sender]) -> None:
        state = self.state
        resolver = state.resolver
        assert resolver is not None
        try:
            members, _ = await resolver.resolve_all()
            body = Moved.model_validate({
                "job": state.config.job, "host.name": state.host_name, "agent_id": state.agent_id, "trace_id": job.trace_id,
                "coordinator": coordinator.url, "coordinator_host": job.coordinator_host[:255],
            }).model_dump(by_alias=True)

            async def tell(item: tuple[str, Sender]) -> None:
                host, sender = item
                peer = None
                for member in members:
                    if not resolver.is_self(member) and await self.senders.at(member, sender):
                        peer = member
                        break
                if peer is None:
                    log.warning("job %s: cannot tell %s where the coordinator is (%s is no member we list): its evidence"
                                " taken here is not in the job verdict", state.config.job, host, sender.identity)
                    return
                reply = await call_peer(peer, "/v1/job/moved", body, credentials=state.as_listed(),
                                        timeout_s=state.config.peer_timeout_s, action="fleet.moved", attempts=3)
                if reply.result.outcome is not Outcome.OK:
                    log.warning("job %s: telling %s where the coordinator is failed (%s): its evidence taken here is not"
                                " in the job verdict", state.config.job, host, reply.result.detail)

            await bounded(list(held.items()), tell, limit=state.config.fanout_concurrency)
        except Exception:  # boundary
            log.exception("telling the hosts whose evidence we took where the coordinator is failed")

    def cut_off(self, job: JobIncident, first: Peer, unreachable: Sequence[str]) -> None:
        """This host reached no other host of the job: its view is partial. No job verdict from
        here (the reachable side makes the job's); its own incident says so (``job.view``) and its
        evidence goes to its first choice later, marked partial (retried, bounded)."""
        state = self.state
        job.coordinating, job.partial = False, True
        job.coordinator, job.coordinator_host = first, state.proven_name(job, first.url, bare=True)
        names = tuple(state.proven_name(job, u) for u in dict.fromkeys(unreachable))
        job.view = {"servewatch.job.partial": True, "servewatch.job.coordinator": state.proven_name(job, first.url),
                    "servewatch.job.unreachable": names,
                    "servewatch.job.partial_reason": f"reached no other host of job {state.config.job}: no job verdict from here;"
                                                     f" evidence sent later to {state.proven_name(job, first.url)}, marked partial"}
        log.warning("job %s: cut off (no other host answered: %s): no job verdict from this host; our evidence goes to %s later,"
                    " marked partial", state.config.job, ", ".join(names), names[0] if names else first)

    def _fanout_results(self, job: JobIncident, replies: list[tuple[Peer, PeerReply, int]], start: int, *, relays: int) -> None:
        results = [r.result for _, r, _ in replies]
        failed = [r for r in results if r.outcome is not Outcome.OK]
        path = ""
        if job.local_incident_id is not None:
            folder = self.state.layout.incident(job.local_incident_id)
            doc = {"trace_id": job.trace_id, "reported": job.reported, "asked": [r.to_manifest() for r in results]}
            try:
                atomic_write_text(folder / FANOUT_FILE, json.dumps(doc))
                path = str(folder / FANOUT_FILE)
            except OSError as exc:
                log.warning("cannot write %s: %s", folder / FANOUT_FILE, exc)
        attrs: dict[str, Any] = {"servewatch.fanout.asked": len(results), "servewatch.fanout.ok": len(results) - len(failed),
                                 "servewatch.fanout.failed": len(failed), "servewatch.fanout.relays": relays,
                                 "servewatch.fanout.reported": len(job.reported),
                                 "servewatch.fanout.failures": tuple(r.detail[:200] for r in failed[:MAX_PEER_SPANS])}
        outcome = Outcome.OK if not failed else Outcome.FAILED
        detail = (f"asked {len(results)} host(s) that did not report ({relays} relays): {len(results) - len(failed)} ok,"
                  f" {len(failed)} failed; {len(job.reported)} reported on their own")
        job.results.append(ActionResult(action=Action.FANOUT, outcome=outcome, detail=detail, start_time_unix_nano=start,
                                        end_time_unix_nano=now_ns(), artifact_paths=(path,) if path else (),
                                        attributes=frozen_attrs(attrs)))
        shown = results if len(results) <= MAX_PEER_SPANS else failed[:MAX_PEER_SPANS]
        job.results.extend(shown)
        log.info("job %s: asked %d host(s): %d ok, %d failed", self.state.config.job, len(results), len(results) - len(failed), len(failed))

    async def relay(self, job: JobIncident) -> None:
        """Ask the peers the coordinator handed us (members of our own peer list only); sets ``job.done``."""
        state = self.state
        try:
            assert state.resolver is not None
            members, _ = await state.resolver.resolve_all()
            known = {p.url: p for p in members}
            targets: list[Peer] = []
            for raw in job.relay:
                try:
                    peer = parse_peer(raw, default_port=state.port, scheme=state.scheme)
                except ValueError:
                    peer = None
                if peer is None or peer.url not in known:
                    job.relayed.append(PeerOutcome(raw[:300], Outcome.REFUSED, "not a member of this agent's peer list: not asked"))
                    continue
                targets.append(peer)
            coordinator = job.coordinator or Peer("127.0.0.1", state.port)

            async def ask(peer: Peer) -> None:
                body = self.join_body(job, coordinator, ())
                body["origin_host"] = job.coordinator_host or body["origin_host"]
                reply = await call_peer(peer, "/v1/incidents", body, credentials=state.credentials, timeout_s=state.config.peer_timeout_s,
                                        headers={"traceparent": TraceParent(job.trace_id, job.root_span_id).header()})
                doc = reply.doc or {}
                ranks = doc_ranks(doc)
                job.relayed.append(PeerOutcome(peer.url, reply.result.outcome, reply.result.detail[:300], str(doc.get("host.name") or ""), ranks))

            await bounded(targets, ask, limit=state.config.fanout_concurrency)
        except Exception:  # boundary
            log.exception("relaying the job's join failed")
        finally:
            job.done.set()
