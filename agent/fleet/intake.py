"""The coordinator's evidence intake and the job verdict.

Owns :class:`EvidenceIntake`: ``POST /v1/job/evidence`` (taken from the identity that proved the
host name, redirected when this host follows a coordinator, answered 503 while a provisional
coordinator is not settled, kept but not judged after the verdict: ``late_evidence``), the wait
for every member's evidence (bounded by ``evidence_timeout_s``), the judgement
(:func:`agent.fleet.jobverdict.judge_job`, with the members that sent none and why), the bundle's
``job-verdict.json``, the job root span's attributes
(:class:`~agent.model.events.JobIncidentClosed`) and the judged job incidents remembered for late
reports and evidence (:attr:`FleetState.judged`).

Imports anyio, :mod:`agent.fleet.fleetstate`, :mod:`agent.fleet.senders`,
:mod:`agent.fleet.coordinator` (a provisional coordinator's recheck before its verdict),
:mod:`agent.fleet.jobverdict`, :mod:`agent.fleet.identity` and the fleet's job state and message types.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import anyio

from agent.fleet.api import Sender
from agent.fleet.coordinator import Coordinator
from agent.fleet.fleetstate import FleetState
from agent.fleet.identity import JobKey, stuck_collective
from agent.fleet.jobstate import JobIncident
from agent.fleet.jobverdict import CLOCK_OFFSET_SAID_S, JobVerdict, MissingHost, judge_job
from agent.fleet.messages import Evidence, MemberInfo
from agent.fleet.senders import Senders
from agent.host.fsutil import atomic_write_text
from agent.model.events import JobIncidentClosed, Outcome, frozen_attrs, now_ns
from agent.model.manifest_view import JOB_VERDICT_NAME

__all__ = ["CLOCK_OFFSETS_ATTR", "JOB_VERDICT_FILE", "STUCK_COLLECTIVE_ATTR", "EvidenceIntake", "job_stuck_collective"]

log = logging.getLogger("servewatch.fleet")

#: The coordinator's job verdict, in its bundle (read back by ``timeline`` and ``report``).
JOB_VERDICT_FILE = JOB_VERDICT_NAME
#: Trace ids of closed job incidents remembered (a repeated key gets a fresh trace).
MAX_PAST_TRACES = 1024
#: Most hosts whose evidence one job incident holds.
MAX_EVIDENCE_HOSTS = 100_000
#: Judged job incidents remembered for late reports and evidence.
MAX_JUDGED = 16
#: Root-span attribute of a job incident: its stuck collective, ``"<pg>:<seq>"`` (the Flight
#: Recorder sequence id of the first collective of process group ``pg`` not completed by all ranks).
STUCK_COLLECTIVE_ATTR = "servewatch.job.stuck_collective"
#: Root-span attribute of a job incident: the hosts whose clock is off the coordinator's by more
#: than :data:`CLOCK_OFFSET_SAID_S`, as ``"<host>=<offset s, signed>"`` (their spans' times are
#: off by that much in the trace).
CLOCK_OFFSETS_ATTR = "servewatch.job.clock_offsets_s"


class EvidenceIntake:
    """Evidence taken as coordinator, and the job verdict made from it, on ``state``."""

    def __init__(self, state: FleetState, senders: Senders, coordinator: Coordinator) -> None:
        self.state = state
        self.senders = senders
        self.coordinator = coordinator

    def on_evidence(self, evidence: Evidence, sender: Sender) -> tuple[int, dict[str, Any]]:
        """``POST /v1/job/evidence`` from ``sender`` (its identity as :class:`~agent.fleet.senders.Senders` settled it):
        ``(HTTP status, answer)``: 200 received / late / redirect, 409 not ours or a conflict, 413, 503 retry."""
        state = self.state
        job = state.job
        judged = state.judged.get(evidence.trace_id)
        target = judged if judged is not None else job
        if target is not None and evidence.trace_id == target.trace_id:
            conflict = self.senders.claim(target, evidence.host_name, sender, "evidence")
            if conflict:  # a token holder speaking for another host: never judged, said
                return 409, {"error": conflict, "host.name": state.host_name, **state.trace_doc(target)}
        if judged is not None and (judged is not job or judged.verdict is not None):  # after the verdict: kept, said, not re-judged
            return self._late_evidence(judged, evidence)
        refused = self._evidence_not_taken(job, evidence)
        if refused is not None:
            return refused
        assert job is not None
        if len(job.evidence) >= MAX_EVIDENCE_HOSTS and evidence.host_name not in job.evidence:
            return 413, {"error": "too many hosts"}
        state.evidence_received += 1
        job.add_evidence(evidence, job.proven.get(evidence.host_name, ""))
        job.evidence_senders[evidence.host_name] = sender
        if sender.clock_offset_s is not None and len(job.clock_offsets_s) < MAX_EVIDENCE_HOSTS:
            job.clock_offsets_s[evidence.host_name] = sender.clock_offset_s
        return 200, {"status": "received", "host.name": state.host_name, **state.trace_doc(job)}

    def _late_evidence(self, judged: JobIncident, evidence: Evidence) -> tuple[int, dict[str, Any]]:
        state = self.state
        state.evidence_received += 1
        judged.add_evidence(evidence, judged.proven.get(evidence.host_name, ""))
        if evidence.host_name not in judged.late_evidence:
            judged.late_evidence.append(evidence.host_name)
        log.warning("job %s: evidence of %s came after the job verdict (kept, not judged)%s", state.config.job,
                    evidence.host_name, "; marked partial: it reached no other host for a while" if evidence.partial else "")
        return 200, {"status": "late", "host.name": state.host_name, **state.trace_doc(judged)}

    def _evidence_not_taken(self, job: JobIncident | None, evidence: Evidence) -> tuple[int, dict[str, Any]] | None:
        """The answer to evidence this agent does not judge now (a redirect, retry later, or not ours); ``None``: taken."""
        state = self.state
        if (job is not None and not job.coordinating and job.coordinator is not None and evidence.trace_id == job.trace_id
                and state.in_window(job)):
            # we backed down (or never coordinated): the coordinator we follow takes it
            return 200, {"status": "redirect", "coordinator": job.coordinator.url, "host.name": state.host_name, **state.trace_doc(job)}
        if job is not None and job.coordinating and job.ahead and not job.done.is_set() and evidence.trace_id == job.trace_id:
            # provisional, not settled yet (we may back down): the sender tries again shortly
            return 503, {"error": "this agent coordinates provisionally and is asking the coordinator before it; retry",
                         "status": "retry", "retry_after_s": 1, "host.name": state.host_name, **state.trace_doc(job)}
        if job is None or not job.coordinating or evidence.trace_id != job.trace_id:
            return 409, {"error": "not the job incident this agent coordinates", "host.name": state.host_name,
                         **(state.trace_doc(job) if job is not None else {})}
        return None

    async def job_verdict(self, job: JobIncident, bundle_dir: str) -> None:
        """Wait for every member's evidence (bounded by ``evidence_timeout_s`` from the job
        incident's start), judge the job, write ``job-verdict.json`` into ``bundle_dir`` (a write
        error is logged), emit its root span. Nothing when this host backed down meanwhile."""
        state = self.state
        deadline = job.started + state.config.evidence_timeout_s
        while job.coordinating and job.waits_for() and time.monotonic() < deadline:
            changed = job.evidence_changed
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                await changed.wait()
        if job.coordinating and job.ahead:
            await self.coordinator.recheck(job)
        if not job.coordinating:
            return  # backed down: our evidence goes to the coordinator (the caller sends it)
        verdict = await anyio.to_thread.run_sync(self._judge, job)
        job.verdict = verdict
        state.verdicts += 1
        stuck = job_stuck_collective(job)
        election = (f"{state.host_name} coordinates: {', '.join(state.proven_name(job, u) for u in job.ahead)} did not answer in time"
                    if job.ahead else "")
        doc = self._verdict_doc(job, verdict, stuck, election)
        try:
            await anyio.to_thread.run_sync(atomic_write_text, Path(bundle_dir) / JOB_VERDICT_FILE, json.dumps(doc, indent=1))
        except OSError as exc:
            log.warning("cannot write %s: %s", Path(bundle_dir) / JOB_VERDICT_FILE, exc)
        log.warning("job %s: %s", state.config.job, verdict.headline())
        attrs = self._verdict_attrs(job, verdict, stuck, election, bundle_dir)
        # one root by construction: a host cut off from every other host never gets here (its
        # view is partial: its own incident says so, its evidence goes to the coordinator later)
        await state.agent.bus.publish(JobIncidentClosed(
            source="fleet", job=state.config.job or "", trace_id=job.trace_id, span_id=job.root_span_id,
            start_time_unix_nano=job.detected_time_unix_nano or now_ns(), incident_id=job.local_incident_id or "",
            attributes=frozen_attrs(attrs),
        ))
        self._remember_judged(job)

    def _verdict_doc(self, job: JobIncident, verdict: JobVerdict, stuck: JobKey | None, election: str) -> dict[str, Any]:
        """The content of ``job-verdict.json``."""
        return {"job": self.state.config.job, "trace_id": job.trace_id, "root_span_id": job.root_span_id, "key": job.key,
                "election": election, "backed_down": sorted(job.backed_down_hosts), "partial_evidence": sorted(job.partial_evidence),
                "stuck_collective": str(stuck.value) if stuck is not None else None, "coordinator": self.state.host_name,
                "hosts_expected": job.expected_hosts(), "hosts_with_evidence": len(job.evidence),
                "reported": sorted(job.reported.values()),
                "clock_offsets_s": dict(sorted(job.clock_offsets_s.items())),
                "verdict": verdict.to_json(), "bundles": {h: e.bundle_dir for h, e in sorted(job.evidence.items())}}

    def _verdict_attrs(self, job: JobIncident, verdict: JobVerdict, stuck: JobKey | None, election: str,
                       bundle_dir: str) -> dict[str, Any]:
        """The job root span's attributes (a skew of host clocks is logged as they are built)."""
        attrs: dict[str, Any] = {**verdict.attributes(), "servewatch.job.trace_key": job.key,
                                 **({STUCK_COLLECTIVE_ATTR: stuck.value} if stuck is not None else {}),
                                 "servewatch.job.hosts": job.expected_hosts(), "servewatch.job.hosts_with_evidence": len(job.evidence),
                                 "servewatch.job.reported": len(job.reported), "servewatch.job.verdict_path": str(Path(bundle_dir) / JOB_VERDICT_FILE)}
        if election:
            attrs["servewatch.job.election"] = election
        skewed = {h: o for h, o in sorted(job.clock_offsets_s.items()) if abs(o) > CLOCK_OFFSET_SAID_S}
        if skewed:  # each host's spans carry its own clock: said where the trace is read
            attrs[CLOCK_OFFSETS_ATTR] = tuple(f"{h}={o:+.1f}" for h, o in skewed.items())
            log.warning("job %s: host clocks off this one's by more than %g s: %s (their spans in trace %s are off by as much)",
                        self.state.config.job, CLOCK_OFFSET_SAID_S, ", ".join(f"{h} {o:+.1f} s" for h, o in skewed.items()), job.trace_id)
        if job.backed_down_hosts:
            attrs["servewatch.job.backed_down"] = tuple(sorted(job.backed_down_hosts))
        if job.partial_evidence:
            attrs["servewatch.job.partial_evidence"] = tuple(sorted(job.partial_evidence))
        return attrs

    def _remember_judged(self, job: JobIncident) -> None:
        state = self.state
        state.past_traces[job.trace_id] = state.past_traces.get(job.trace_id, 0) + 1
        while len(state.past_traces) > MAX_PAST_TRACES:
            state.past_traces.popitem(last=False)
        state.judged[job.trace_id] = job
        while len(state.judged) > MAX_JUDGED:
            state.judged.popitem(last=False)

    def _judge(self, job: JobIncident) -> JobVerdict:
        state = self.state
        missing: list[MissingHost] = []
        have = set(job.evidence)
        known = dict(state.members)
        a = state.announced
        if a is not None:  # the coordinator that announced itself said who it is
            known.setdefault(a.peer.url, MemberInfo.model_validate({"job": state.config.job or "-", "host.name": a.host_name,
                                                                     "ranks": list(a.ranks)}))
        for address, outcome in sorted(job.asked.items()):
            info = job.member_info.get(address) or known.get(address)
            # named as it proved itself; a host that never did is its address, said so (never a name)
            host = outcome.host_name or (info.host_name if info else "") or f"{address} (host name not proven)"
            if host in have:
                continue
            ranks = outcome.ranks or (tuple(info.ranks) if info else ())
            missing.append(MissingHost(host, tuple(sorted(ranks)), _missing_why(outcome.outcome)))
        for address, host in job.reported.items():
            if host not in have and address not in job.asked:
                missing.append(MissingHost(host, tuple(sorted(job.member_info[address].ranks)) if address in job.member_info else (),
                                           "no evidence (reported a detection, then nothing)"))
        return judge_job(list(job.evidence.values()), missing_hosts=missing, world_size=state.world_size, conflicts=job.conflicts,
                         clock_offsets_s=job.clock_offsets_s)


def job_stuck_collective(job: JobIncident) -> JobKey | None:
    """The job's stuck collective (``"<pg>:<seq>"``) from every host's ranks' Flight Recorder
    windows in their evidence: read after capture, never before it (``None`` without one)."""
    return stuck_collective([r.fr for e in job.evidence.values() for r in e.ranks if isinstance(r.fr, dict)])


_MISSING_WHY = {Outcome.OK: "no evidence (its agent answered the join, then nothing)",
                Outcome.TIMED_OUT: "agent unreachable (timed out: host down or partitioned)",
                Outcome.REFUSED: "agent refused"}


def _missing_why(outcome: Outcome) -> str:
    """Why a member the coordinator asked has no evidence, by its join's outcome."""
    return _MISSING_WHY.get(outcome, "agent unreachable (connection failed)")
