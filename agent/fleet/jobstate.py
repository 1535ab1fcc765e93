"""The state of one job incident on one agent, and of the job's members as this agent knows them.

Owns :class:`JobIncident` (trace, key, who coordinates, what this agent did in it; on the
coordinator also who reported, who was asked, whose evidence arrived) and :class:`Announced`
(the coordinator that presented itself). Plain data plus small bookkeeping; the protocol is in
:mod:`agent.fleet.job` and its parts. Imports anyio, :mod:`agent.model.events` and the fleet's message and peer types.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from agent.fleet.messages import Evidence, MemberInfo
from agent.fleet.peers import Peer
from agent.model.events import ActionCompleted, ActionResult, Outcome

__all__ = ["MAX_CONFLICTS", "Announced", "JobIncident", "PeerOutcome"]

#: Identity conflicts one job incident remembers (the first ones; the rest are counted).
MAX_CONFLICTS = 16


@dataclass(frozen=True, slots=True)
class Announced:
    """The host that presented itself as the job's coordinator (it holds global rank 0).

    Attributes:
        peer: its API address (the address its announce came from, its API port).
        host_name / ranks: as it said.
        time_s: monotonic time of its last announce.
    """

    peer: Peer
    host_name: str
    ranks: tuple[int, ...]
    time_s: float


@dataclass(frozen=True, slots=True)
class PeerOutcome:
    """What asking one host gave (direct, or through a relay)."""

    address: str
    outcome: Outcome
    detail: str = ""
    host_name: str = ""
    ranks: tuple[int, ...] = ()
    via: str = ""


@dataclass
class JobIncident:
    """The job incident this agent takes part in (one at a time, remembered for the window).

    Attributes:
        trace_id / root_span_id: the job's trace and root span (hex); ``""`` while placing.
        key: what the trace was derived from (:class:`agent.fleet.identity.JobKey` as text).
        started: monotonic time this agent learnt of it (the dedup window runs from here).
        detected_time_unix_nano: the earliest detection known here.
        placed: set once the trace is decided (joins that arrive while it is decided wait).
        local_incident_id: this agent's incident in it (``None`` until it opened).
        opened: set once that incident opened.
        coordinating: this agent coordinates the job incident.
        joined: this agent's incident opened because the coordinator asked.
        coordinator: where to send evidence (``None`` while unknown, or when coordinating).
        move_to: a join from the coordinator named another trace while ours was being placed.
        extras: more action events for our incident (folded detections), collected at its end.
        done: set when this agent's part of the protocol (report or fan-out) ended.
        results: that part's action results (bounded before they become spans).
        relay: peers this agent was asked to relay the join to.
    """

    trace_id: str = ""
    root_span_id: str = ""
    key: str = ""
    started: float = field(default_factory=time.monotonic)
    detected_time_unix_nano: int = 0
    placed: anyio.Event = field(default_factory=anyio.Event)
    local_incident_id: str | None = None
    opened: anyio.Event = field(default_factory=anyio.Event)
    coordinating: bool = False
    joined: bool = False
    #: this host detected the hang itself (not told by a report or a join)
    detected_here: bool = False
    coordinator: Peer | None = None
    coordinator_host: str = ""
    #: this agent coordinates because no candidate before it answered (maybe partitioned)
    cut_off: bool = False
    #: coordinator candidates (URLs) before this agent that did not answer in time: non-empty
    #: while it coordinates only because of that (provisional: it backs down when one of them,
    #: or a host that follows one of them, says it coordinates the same trace)
    ahead: list[str] = field(default_factory=list)
    #: this agent coordinated provisionally, then backed down to ``coordinator``
    backed_down: bool = False
    #: this agent reached no other host: its view is partial, never a verdict; its evidence goes
    #: to ``coordinator`` later, marked partial
    partial: bool = False
    #: root attributes of this agent's own incident in the job (its partial view), set before it closes
    view: dict[str, Any] = field(default_factory=dict)
    #: set while this agent's own report is on its way (None: it never reported)
    reporting: anyio.Event | None = None
    move_to: tuple[str, str] | None = None
    extras: list[ActionCompleted] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    results: list[ActionResult] = field(default_factory=list)
    relay: list[str] = field(default_factory=list)
    relayed: list[PeerOutcome] = field(default_factory=list)
    # -- the coordinator's view -----------------------------------------------------------------
    #: hosts that reported a detection: address -> host name
    reported: dict[str, str] = field(default_factory=dict)
    #: monotonic time of the last report (0: none)
    last_report_s: float = 0.0
    #: hosts asked: address -> outcome (direct asks, and what relays said of theirs)
    asked: dict[str, PeerOutcome] = field(default_factory=dict)
    #: members as listed when the fan-out ran (addresses)
    members: list[str] = field(default_factory=list)
    #: evidence summaries by host name
    evidence: dict[str, Evidence] = field(default_factory=dict)
    evidence_changed: anyio.Event = field(default_factory=anyio.Event)
    verdict_started: bool = False
    verdict: Any = None
    #: what each member said of itself (announce answers, join answers, reports): address -> info
    member_info: dict[str, MemberInfo] = field(default_factory=dict)
    #: host name -> the sender identity that proved it first (``address:port``), and back
    proven: dict[str, str] = field(default_factory=dict)
    proven_by: dict[str, str] = field(default_factory=dict)
    #: host names proven by the verified answer of the listed member asked at that identity
    asked_proven: set[str] = field(default_factory=set)
    #: who sent what was taken: host name -> identity of its evidence; reporter address -> identity
    evidence_by: dict[str, str] = field(default_factory=dict)
    #: host name -> the :class:`~agent.fleet.api.Sender` of the evidence this coordinator took
    #: (told where the coordinator is should this one back down)
    evidence_senders: dict[str, Any] = field(default_factory=dict)
    #: the evidence this agent last sent its coordinator (sent again when told it moved)
    sent_evidence: Evidence | None = None
    #: having backed down: the hosts told to send their evidence to the coordinator instead
    moved_hosts: list[str] = field(default_factory=list)
    #: hosts a provisional coordinator that backed down to us told to send us their evidence:
    #: the verdict waits for them as for every member (bounded by ``evidence_timeout_s``)
    awaited_hosts: set[str] = field(default_factory=set)
    reported_by: dict[str, str] = field(default_factory=dict)
    #: what was refused because it claimed an identity another sender proved (one line each)
    conflicts: list[str] = field(default_factory=list)
    conflicts_total: int = 0
    #: hosts that coordinated provisionally (their first choice did not answer) and backed down to us
    backed_down_hosts: list[str] = field(default_factory=list)
    #: hosts whose evidence came marked partial (they reached no other host for a while)
    partial_evidence: list[str] = field(default_factory=list)
    #: hosts whose evidence came after the job verdict (kept, not judged)
    late_evidence: list[str] = field(default_factory=list)
    #: each host's clock minus the coordinator's, seconds, from its last signed report or
    #: evidence (:attr:`agent.fleet.api.Sender.clock_offset_s`): its spans' times are off by that
    clock_offsets_s: dict[str, float] = field(default_factory=dict)

    def prove(self, host: str, identity: str, what: str = "a message", *, asked: bool = False) -> str:
        """Bind ``host`` (a host name) to ``identity`` (who proved it: ``address:port``), first
        proof wins, both ways (one identity is one host). Returns ``""`` when ``what`` from
        ``identity`` may speak for ``host``, else the conflict, one line (also remembered).

        ``asked``: ``what`` is the verified answer of the listed member asked at ``identity`` (the
        agent listening there): it proves ``host`` even when another identity claimed it first
        (that claim is the conflict: what it sent for ``host`` is dropped, and it never speaks for
        any host again), unless another asked member proved ``host`` already or ``host`` is this
        agent's own."""
        known, owner = self.proven.get(host), self.proven_by.get(identity)
        if known in (None, identity) and owner in (None, host):
            self.proven[host], self.proven_by[identity] = identity, host
            if asked:
                self.asked_proven.add(host)
            return ""
        if asked and known != "this agent" and host not in self.asked_proven and owner not in self.asked_proven:
            self._overrule(host, identity, what, known, owner)
            return ""
        why = f"{host} is proven at {known}" if known not in (None, identity) else f"{identity} is {owner}"
        if known == "this agent":  # two agents named alike (on one machine: the same default host name)
            why += " (every agent of a job needs its own host name: SERVEWATCH_HOST_NAME)"
        return self.conflict(f"{what} for host {host} from {identity} refused: {why}")

    def _overrule(self, host: str, identity: str, what: str, known: str | None, owner: str | None) -> None:
        """``host`` is ``identity``'s (an asked member's answer): the earlier claims (``known``
        spoke for ``host``; ``identity`` was said to be ``owner``) become the conflict."""
        stale = {known} if known not in (None, identity) else set()
        if owner not in (None, host) and self.proven.get(owner) == identity:
            del self.proven[owner]  # someone else at this address spoke for another host: forgotten
            self._drop(owner, {identity})
            stale.add(identity)
        self._drop(host, stale)
        self.proven[host], self.proven_by[identity] = identity, host
        self.asked_proven.add(host)
        claimed = f"{host} was claimed by {known}" if known not in (None, identity) else f"{identity} was said to be {owner}"
        self.conflict(f"{claimed}, refused: {what} from {identity} (the member asked there) proves {host} at {identity}")

    def _drop(self, host: str, identities: set[str]) -> None:
        """Forget what ``identities`` sent for ``host`` (its evidence, their reports)."""
        if self.evidence_by.get(host) in identities:
            self.evidence.pop(host, None)
            self.evidence_by.pop(host, None)
        for address in [a for a, who in self.reported_by.items() if who in identities and self.reported.get(a) == host]:
            self.reported.pop(address, None)
            self.reported_by.pop(address, None)
            self.member_info.pop(address, None)

    def conflict(self, line: str) -> str:
        """Remember ``line`` (bounded, :data:`MAX_CONFLICTS`); returns it."""
        self.conflicts_total += 1
        if len(self.conflicts) < MAX_CONFLICTS:
            self.conflicts.append(line)
        return line

    def in_window(self, window_s: float) -> bool:
        return time.monotonic() - max(self.started, self.last_report_s) < window_s

    def traceparent_ids(self) -> tuple[str, str]:
        return self.trace_id, self.root_span_id

    def add_evidence(self, evidence: Evidence, identity: str = "") -> None:
        """Take ``evidence`` (sent by ``identity``) for its host; what it says of its sender
        (partial, backed down) is remembered (bounded: one entry per host)."""
        self.evidence[evidence.host_name] = evidence
        for flag, hosts in ((evidence.partial, self.partial_evidence), (evidence.backed_down, self.backed_down_hosts)):
            if flag and evidence.host_name not in hosts:
                hosts.append(evidence.host_name)
        self.evidence_by[evidence.host_name] = identity
        if evidence.backed_down and len(self.awaited_hosts) < 1024:
            self.awaited_hosts.update(evidence.moved_hosts[:1024 - len(self.awaited_hosts)])
        for r in evidence.relayed:
            self.asked.setdefault(r.address, PeerOutcome(r.address, Outcome(r.outcome), r.detail, r.host_name,
                                                        tuple(r.ranks), via=evidence.host_name))
        self.evidence_changed.set()
        self.evidence_changed = anyio.Event()

    def failed_addresses(self) -> set[str]:
        return {a for a, o in self.asked.items() if o.outcome is not Outcome.OK}

    def waits_for(self) -> bool:
        """Whether evidence is still due: fewer hosts' than :meth:`expected_hosts`, or a host
        told to come here (``awaited_hosts``) not in yet."""
        return len(self.evidence) < self.expected_hosts() or any(h not in self.evidence for h in self.awaited_hosts)

    def expected_hosts(self) -> int:
        """How many hosts' evidence the verdict waits for: every member and reporter, less those
        that could not be asked, plus the hosts told to come here (``awaited_hosts``) not among them."""
        counted = (set(self.members) | set(self.reported)) - self.failed_addresses()
        named = {self.reported[u] for u in counted if u in self.reported}
        named |= {self.member_info[u].host_name for u in counted if u in self.member_info}
        return max(1, len(counted) + len(self.awaited_hosts - named))

    def summary(self) -> dict[str, Any]:
        return {"trace_id": self.trace_id, "root_span_id": self.root_span_id, "key": self.key,
                "local_incident_id": self.local_incident_id, "coordinating": self.coordinating,
                "coordinator": self.coordinator.url if self.coordinator else None,
                "reported": len(self.reported), "asked": len(self.asked), "evidence": len(self.evidence),
                "conflicts": self.conflicts_total, "conflict": self.conflicts[0] if self.conflicts else None,
                "partial": self.partial, "backed_down": self.backed_down,
                "partial_evidence": sorted(self.partial_evidence), "late_evidence": sorted(self.late_evidence),
                "backed_down_hosts": sorted(self.backed_down_hosts)}
