"""The job's verdict, made on the coordinator from every host's evidence summary.

Owns :class:`MissingHost`, :class:`JobVerdict`, :class:`JobEvidence` (everything the job rules
read, built once from the hosts' summaries), the ordered table of named job rules
(:data:`JOB_RULES`, each a :class:`JobRule`) and :func:`judge_job`, which tries them in order: the
first that applies decides. A host judges only its own ranks: the host without the culprit can
only say "every rank waits in a collective". The coordinator has every host's summary (:class:`agent.fleet.messages.Evidence`), so it judges the
whole job at once:

1. every host's ranks become one evidence list by global rank and go through the same rules as
   a host's own verdict (:func:`agent.verdict.rules.decide`): a dead rank, a desync, a rank behind, a
   rank stuck in compute while the others wait;
2. torch's own Flight Recorder analyzer (``torch.distributed.flight_recorder``'s ``build_db``, on
   the recorder windows the hosts sent) confirms it or names what the rules could not: "Not all
   ranks joining collective #8: missing ranks {2}";
3. captured ranks are checked against the world size (the default process group's size): ranks
   nobody captured are named with their host when the coordinator knows it ("host node-2 (ranks
   4,5): agent unreachable"); when every captured rank waits in the same collective, the culprit
   is among the ranks nobody could capture; likewise when the ranks the rules name wait in a
   collective themselves (a broadcast's root waiting for the ranks it cannot reach);
4. the culprit ranks are named with their hosts.

Deaths are ordered on one clock, the coordinator's: a host whose clock is off by more than
:data:`CLOCK_OFFSET_SAID_S` (measured from its signed evidence,
:attr:`agent.fleet.api.Sender.clock_offset_s`) has its ranks' exit times moved by its offset
before the rules order them, and an evidence line says so; smaller offsets are within the
measurement's error (whole-second signature times) and left alone.

Pure apart from torch's analyzer (imported lazily and optionally by :mod:`agent.verdict.flightrec`).
No I/O. Imports :mod:`agent.verdict.rules`, :mod:`agent.verdict.flightrec` and :mod:`agent.fleet.messages`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.fleet.messages import Evidence, RankSummary
from agent.model.events import Trigger
from agent.verdict.flightrec import RankRecorder, torch_missing_ranks
from agent.verdict.rules import (
    NEXT_STEPS,
    FrameClass,
    RankEvidence,
    Role,
    Verdict,
    decide,
    next_step,
)
from agent.verdict.rules import Evidence as ServerEvidence

__all__ = ["CLOCK_OFFSET_SAID_S", "JOB_KINDS", "JOB_NEXT_STEPS", "JOB_RULES", "JOB_VERDICT_ATTR_PREFIX", "MISSING", "JobEvidence",
           "JobRule", "JobVerdict", "MissingHost", "job_next_step", "judge_job", "torch_findings"]

log = logging.getLogger("servewatch.fleet.verdict")

#: Prefix of the job verdict's attributes on the job's root span.
JOB_VERDICT_ATTR_PREFIX = "servewatch.job.verdict."

#: A host's clock offset (seconds, signed) is applied to its exit times, said on the job's root span
#: and in the log above this (signature times are whole seconds: about 1 s of error below it).
CLOCK_OFFSET_SAID_S = 2.0

#: The job verdict's own kind: the culprit is among the ranks nobody captured.
MISSING = "missing"
#: The next step of the job verdict's own kinds, in general (the docs' tables); a host's kind has
#: its :data:`agent.verdict.rules.NEXT_STEPS` line, said on the culprit's host (:func:`job_next_step`).
JOB_NEXT_STEPS: dict[str, str] = {
    MISSING: "on the host without evidence: `servewatch status` (why its agent sent nothing), then "
             "`servewatch dump --match '<rank titles>'` there",
}
#: Every kind a job verdict can have: a host verdict's (:data:`agent.verdict.rules.NEXT_STEPS`) and its own.
JOB_KINDS: frozenset[str] = frozenset(NEXT_STEPS) | frozenset(JOB_NEXT_STEPS)


@dataclass(frozen=True, slots=True)
class MissingHost:
    """A host of the job whose evidence the coordinator does not have.

    Attributes:
        host: its host name when known, else its API address.
        ranks: its global ranks when known (from its last answer to the coordinator).
        why: ``agent unreachable``, ``timed out``, ``refused``, ``no evidence``.
    """

    host: str
    ranks: tuple[int, ...] = ()
    why: str = "agent unreachable"

    def __str__(self) -> str:
        ranks = f" (rank{'s' if len(self.ranks) != 1 else ''} {','.join(map(str, self.ranks))})" if self.ranks else ""
        return f"host {self.host}{ranks}: {self.why}"


@dataclass(frozen=True, slots=True)
class JobVerdict:
    """The job-level verdict.

    Attributes:
        kind: the rule's kind (:class:`agent.verdict.rules.Verdict`), or ``missing`` (the culprit is
            among ranks nobody could capture).
        culprit_ranks / culprit_hosts: global ranks named, and each one's host (same order).
        reason / confidence: as for a host's verdict.
        hosts: hosts whose evidence was judged.
        missing_hosts: hosts without evidence, with their ranks.
        world_size / captured_ranks / missing_ranks: the world-size check.
        torch_analysis: what torch's Flight Recorder analyzer said (one line per finding).
        evidence: the rule's evidence lines.
        conflicts: what was refused or set aside because a sender claimed another host's
            identity or ranks (one line each).
        next_step: what to run or check next, on which host (:func:`job_next_step`).
    """

    kind: str
    hung: bool
    culprit_ranks: tuple[int, ...]
    culprit_hosts: tuple[str, ...]
    reason: str
    confidence: str
    hosts: tuple[str, ...] = ()
    missing_hosts: tuple[MissingHost, ...] = ()
    world_size: int | None = None
    captured_ranks: tuple[int, ...] = ()
    missing_ranks: tuple[int, ...] = ()
    torch_analysis: tuple[str, ...] = ()
    evidence: tuple[str, ...] = field(default_factory=tuple)
    conflicts: tuple[str, ...] = ()
    next_step: str = ""

    def headline(self) -> str:
        """``Job verdict: culprit rank 2 on node-b -- behind: ... [confidence high]``."""
        if self.culprit_ranks:
            who = ", ".join(f"rank {r} on {h}" for r, h in zip(self.culprit_ranks, self.culprit_hosts))
            return f"Job verdict: culprit {who} -- {self.reason} [confidence {self.confidence}]"
        return f"Job verdict: no culprit rank -- {self.reason} [confidence {self.confidence}]"

    def attributes(self) -> dict[str, Any]:
        """``servewatch.job.verdict.*`` span attributes (bounded lists)."""
        p = JOB_VERDICT_ATTR_PREFIX
        attrs: dict[str, Any] = {
            f"{p}kind": self.kind,
            f"{p}hung": self.hung,
            f"{p}culprit_ranks": tuple(self.culprit_ranks),
            f"{p}culprit_hosts": tuple(self.culprit_hosts),
            f"{p}reason": self.reason[:2000],
            f"{p}confidence": self.confidence,
            f"{p}hosts": len(self.hosts),
            f"{p}missing_hosts": tuple(str(m) for m in self.missing_hosts[:32]),
            f"{p}captured_ranks": len(self.captured_ranks),
            f"{p}missing_ranks": tuple(self.missing_ranks[:256]),
            f"{p}headline": self.headline()[:2000],
            f"{p}next": self.next_step[:2000],
        }
        if self.world_size is not None:
            attrs[f"{p}world_size"] = self.world_size
        if self.torch_analysis:
            attrs[f"{p}torch_analysis"] = tuple(line[:500] for line in self.torch_analysis[:8])
        if self.conflicts:
            attrs[f"{p}conflicts"] = tuple(line[:500] for line in self.conflicts[:16])
        return attrs

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "hung": self.hung, "culprit_ranks": list(self.culprit_ranks),
            "culprit_hosts": list(self.culprit_hosts), "reason": self.reason, "confidence": self.confidence,
            "hosts": list(self.hosts), "missing_hosts": [{"host": m.host, "ranks": list(m.ranks), "why": m.why} for m in self.missing_hosts],
            "world_size": self.world_size, "captured_ranks": list(self.captured_ranks), "missing_ranks": list(self.missing_ranks),
            "torch_analysis": list(self.torch_analysis), "evidence": list(self.evidence), "headline": self.headline(),
            "conflicts": list(self.conflicts), "next": self.next_step,
        }


def job_next_step(kind: str, base: Verdict | None, server: ServerEvidence, *, culprits: Sequence[int],
                  culprit_hosts: Sequence[str], hosts: Sequence[str], missing_hosts: Sequence[MissingHost]) -> str:
    """The job verdict's ``next:`` line: for :data:`MISSING`, the first host without evidence and why;
    otherwise the host verdict's next step (:func:`agent.verdict.rules.next_step`, with the job's kind
    and culprits and their pids) said on the first culprit's host, or on each host (by title,
    since pids are per host) when nobody is named.

    Returns:
        One line (``on node-b: py-spy dump --native --pid 42 (...)``).
    """
    if kind == MISSING:
        return _missing_next_step(culprits, missing_hosts)
    pids = {e.rank: e.pid for e in server.ranks if e.rank is not None}
    verdict = base or Verdict(kind=kind, hung=True, culprit_ranks=(), culprit_pids=(), reason="", confidence="low")
    verdict = replace(verdict, kind=kind, culprit_ranks=tuple(culprits),
                      culprit_pids=tuple(p for r in culprits if (p := pids.get(r))))
    if culprits:
        return f"on {culprit_hosts[0]}: {next_step(verdict, server)}"
    # nobody named: said on every host, so by title (a pid is one host's)
    where = f"on each host ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})" if hosts else "on each host"
    return f"{where}: {next_step(verdict, _by_title(server))}"


def _missing_next_step(culprits: Sequence[int], missing_hosts: Sequence[MissingHost]) -> str:
    """:func:`job_next_step` for :data:`MISSING`: on the first host without evidence holding a
    culprit (else the first one), why it sent nothing."""
    first = next((m for m in missing_hosts if set(m.ranks) & set(culprits)), missing_hosts[0] if missing_hosts else None)
    if first is None:
        return (f"find the host of {_ranks(culprits)} (not captured): servewatch status there, then "
                "servewatch dump --match '<rank titles>'")
    ranks = f"{_ranks(first.ranks)}: " if first.ranks else ""
    return (f"on {first.host} ({ranks}{first.why}): servewatch status (why its agent sent nothing), then "
            "servewatch dump --match '<rank titles>' there")


def _by_title(server: ServerEvidence) -> ServerEvidence:
    """``server`` with every pid dropped (a next step said on every host names processes by title)."""
    anonymous = [replace(e, pid=None) for e in server.processes]
    return replace(server, processes=tuple(anonymous), ranks=tuple(e for e in anonymous if e.is_rank),
                   others=tuple(e for e in anonymous if not e.is_rank))


def _rank_evidence(r: RankSummary) -> RankEvidence:
    return RankEvidence(
        rank=r.rank, pid=r.pid, role=Role.RANK, title=r.title, label=r.label, alive=r.alive, exited_first=r.exited_first,
        exit_signal=r.exit_signal, exit_code=r.exit_code, oom_killed=r.oom_killed, exit_time_ns=r.exit_time_ns,
        frame_class=FrameClass(r.frame_class), frame=r.frame, p2p=r.p2p, steps_before=r.steps_before, steps_after=r.steps_after,
        pending=r.pending, fr=r.fr,
    )


def _ranks(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def torch_findings(recorders: Mapping[int, RankRecorder]) -> tuple[set[int], list[str]]:
    """torch's Flight Recorder analyzer (``build_db``, via :func:`agent.verdict.flightrec.torch_missing_ranks`)
    on the hosts' recorder windows: the ranks it finds missing from a collective, and one line per
    finding; empty without torch or with fewer than two recorders."""
    if len(recorders) < 2:
        return set(), []
    found = torch_missing_ranks(recorders) or []
    missing = {r for _, _, _, gone in found for r in gone}
    lines = [f"torch flight_recorder: not all ranks joined #{seq} of pg {pg}: missing ranks {sorted(gone)}"
             for pg, seq, _, gone in found]
    return missing, lines


def _in_collective(e: RankEvidence) -> bool:
    """The rank is inside a collective: its stack says so, or its recorder shows one enqueued and
    not completed in the default group."""
    if e.frame_class is FrameClass.COLLECTIVE:
        return True
    st = (e.fr or {}).get("pg_status") if isinstance(e.fr, Mapping) else None
    try:
        return bool(st) and int(st["0"]["last_enqueued_collective"]) > int(st["0"]["last_completed_collective"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return False


def _recorder_seqs(e: RankEvidence) -> tuple[int, int] | None:
    """The default group's last enqueued and last completed collective (sequence numbers) in the
    rank's recorder; ``None`` without a recorder that says both."""
    st = (e.fr or {}).get("pg_status") if isinstance(e.fr, Mapping) else None
    if not isinstance(st, Mapping) or "0" not in st:
        return None
    try:
        return int(st["0"]["last_enqueued_collective"]), int(st["0"]["last_completed_collective"])
    except (KeyError, TypeError, ValueError):
        return None


def _collective_name(ev: Sequence[RankEvidence], seq: int) -> str:
    """The name of the default group's collective ``seq`` (``all_reduce``) in the ranks' recorder
    entries (the last rank's that has it), else ``collective``."""
    name = "collective"
    for e in ev:
        for entry in (e.fr or {}).get("entries") or ():
            if isinstance(entry, Mapping) and entry.get("collective_seq_id") == seq:
                name = str(entry.get("profiling_name") or "collective").split(":")[-1]
    return name


def _all_wait_same(ev: Sequence[RankEvidence]) -> str:
    """``"all_reduce #8 of pg 0"`` when every captured rank's recorder shows it enqueued, not
    completed, the same collective (or, without recorders, every stack waits in a collective)."""
    seqs: set[int] = set()
    for e in ev:
        pair = _recorder_seqs(e)
        if pair is None:
            seqs = set()
            break
        enq, done = pair
        if enq <= done:
            return ""
        seqs.add(enq)
    if len(seqs) == 1:
        seq = next(iter(seqs))
        return f"{_collective_name(ev, seq)} #{seq} of pg 0"
    if ev and all(e.frame_class is FrameClass.COLLECTIVE for e in ev):
        return "a collective"
    return ""


def _by_rank(evidence: Sequence[Evidence]) -> tuple[dict[int, RankSummary], dict[int, str], list[str]]:
    """Each rank's summary and host (the first host's that sent it), and a line per rank that
    another host claimed too."""
    host_of: dict[int, str] = {}
    summaries: dict[int, RankSummary] = {}
    said: list[str] = []
    for ev in evidence:
        for summary in ev.ranks:
            if summary.rank not in summaries:
                summaries[summary.rank] = summary
                host_of[summary.rank] = ev.host_name
            elif host_of[summary.rank] != ev.host_name:
                said.append(f"rank {summary.rank} claimed by {host_of[summary.rank]} and {ev.host_name}:"
                            f" {host_of[summary.rank]}'s kept")
    return summaries, host_of, said


def _on_one_clock(summaries: dict[int, RankSummary], host_of: Mapping[int, str],
                  clock_offsets_s: Mapping[str, float]) -> list[str]:
    """Move each rank's exit time (ns, its host's clock) to the coordinator's clock, in place, for
    hosts off by more than :data:`CLOCK_OFFSET_SAID_S`; one line per host moved."""
    moved: dict[str, float] = {}
    for r, s in summaries.items():
        host = host_of.get(r, "")
        offset_s = clock_offsets_s.get(host)
        if s.exit_time_ns and offset_s is not None and abs(offset_s) > CLOCK_OFFSET_SAID_S:
            summaries[r] = s.model_copy(update={"exit_time_ns": s.exit_time_ns - int(offset_s * 1e9)})
            moved[host] = offset_s
    return [f"exit times of {host} put on the coordinator's clock (its clock {offset_s:+.1f} s)" for host, offset_s in sorted(moved.items())]


def _missing(missing_hosts: Sequence[MissingHost], world_size: int | None, captured: Sequence[int],
             host_of: dict[int, str]) -> tuple[tuple[int, ...], list[MissingHost]]:
    """The ranks nobody captured (the world size's, else the missing hosts' known ranks) and the
    hosts without evidence: the one host without a known rank list gets the ranks no host is known
    for. Each missing rank's host goes into ``host_of`` (in place; captured ranks keep theirs)."""
    known_missing = {r for m in missing_hosts for r in m.ranks}
    missing_ranks = tuple(sorted(set(range(world_size)) - set(captured))) if world_size else tuple(sorted(known_missing - set(captured)))
    missing_list = list(missing_hosts)
    unknown = sorted(set(missing_ranks) - known_missing)
    unnamed = [m for m in missing_list if not m.ranks]
    if unknown and len(unnamed) == 1:  # one host without a known rank list: the ranks nobody captured are its
        idx = missing_list.index(unnamed[0])
        missing_list[idx] = MissingHost(unnamed[0].host, tuple(unknown), unnamed[0].why)
        for r in unknown:
            host_of[r] = unnamed[0].host
    for m in missing_list:
        for r in m.ranks:
            host_of.setdefault(r, m.host)
    return missing_ranks, missing_list


@dataclass(frozen=True, slots=True)
class JobEvidence:
    """Everything the job rules (:data:`JOB_RULES`) read, built once from the hosts' summaries
    (:meth:`of`).

    Attributes:
        ranks: every captured rank's evidence, by global rank (exit times on the coordinator's clock).
        server: those ranks as one server's evidence (trigger: a stall), what the host rules judge.
        base: the host rules' verdict on ``server`` (:func:`agent.verdict.rules.decide`); ``None``
            without a captured rank.
        hosts: the hosts whose evidence was judged, sorted.
        host_of: each global rank's host: a captured rank's from the first host that sent it, a
            missing rank's from the missing host it belongs to.
        world_size: the job's world size, when known.
        captured_ranks / missing_ranks: the world-size check (global ranks, sorted).
        missing_hosts: the hosts without evidence (the one without a known rank list given the
            ranks nobody captured).
        flagged: the ranks torch's Flight Recorder analyzer finds missing from a collective, sorted.
        torch_analysis: its lines (:func:`torch_findings`).
        waiting_in: the collective every captured rank waits in (``all_reduce #8 of pg 0``,
            ``a collective``), else ``""``.
        conflicts: identity conflicts: the coordinator's, then each rank two hosts claimed.
        clock_lines: one line per host whose exit times were moved to the coordinator's clock.
    """

    ranks: tuple[RankEvidence, ...]
    server: ServerEvidence
    base: Verdict | None
    hosts: tuple[str, ...]
    host_of: Mapping[int, str]
    world_size: int | None
    captured_ranks: tuple[int, ...]
    missing_ranks: tuple[int, ...]
    missing_hosts: tuple[MissingHost, ...]
    flagged: tuple[int, ...]
    torch_analysis: tuple[str, ...]
    waiting_in: str
    conflicts: tuple[str, ...]
    clock_lines: tuple[str, ...]

    @staticmethod
    def of(evidence: Sequence[Evidence], *, missing_hosts: Sequence[MissingHost] = (), world_size: int | None = None,
           conflicts: Sequence[str] = (), clock_offsets_s: Mapping[str, float] | None = None) -> JobEvidence:
        """The job's evidence (arguments as :func:`judge_job`'s)."""
        summaries, host_of, said = _by_rank(evidence)
        clock_lines = _on_one_clock(summaries, host_of, clock_offsets_s or {})
        world_size = world_size or next((ev.world_size for ev in evidence if ev.world_size), None)
        ranks = tuple(_rank_evidence(summaries[r]) for r in sorted(summaries))
        captured = tuple(sorted(summaries))
        missing_ranks, missing_list = _missing(missing_hosts, world_size, captured, host_of)
        server = ServerEvidence.of(ranks, trigger=Trigger.STALL, world_size=world_size)
        flagged, torch_lines = torch_findings(server.recorders)
        return JobEvidence(
            ranks=ranks, server=server, base=decide(server) if ranks else None,
            hosts=tuple(sorted(ev.host_name for ev in evidence)), host_of=host_of, world_size=world_size,
            captured_ranks=captured, missing_ranks=missing_ranks, missing_hosts=tuple(missing_list),
            flagged=tuple(sorted(flagged)), torch_analysis=tuple(torch_lines), waiting_in=_all_wait_same(ranks),
            conflicts=(*conflicts, *said), clock_lines=tuple(clock_lines),
        )

    @property
    def base_culprits(self) -> tuple[int, ...]:
        """The ranks the host rules name (none without their verdict)."""
        return self.base.culprit_ranks if self.base is not None else ()


def _reason_tail(ev: JobEvidence) -> str:
    """What every job verdict's reason ends with: the hosts without evidence (else the ranks
    nobody captured) and the first identity conflict."""
    tail = ""
    missing = ev.missing_hosts
    if missing:
        tail += "; " + "; ".join(str(m) for m in missing[:8]) + (f"; {len(missing) - 8} more hosts" if len(missing) > 8 else "")
    elif ev.missing_ranks:
        tail += f"; {_ranks(ev.missing_ranks)} of world size {ev.world_size} not captured"
    if ev.conflicts:
        tail += f"; {len(ev.conflicts)} identity conflict{'s' if len(ev.conflicts) != 1 else ''}: {ev.conflicts[0]}"
    return tail


def _job_verdict(ev: JobEvidence, *, kind: str, culprits: Sequence[int], reason: str, confidence: str) -> JobVerdict:
    """The job verdict a rule concludes: ``reason`` with :func:`_reason_tail`, the culprits' hosts,
    the host rules' hung flag and evidence lines (hung without them), and the next step."""
    culprit_hosts = tuple(ev.host_of.get(r, "?") for r in culprits)
    base = ev.base
    return JobVerdict(
        kind=kind, hung=base.hung if base is not None else True, culprit_ranks=tuple(culprits),
        culprit_hosts=culprit_hosts, reason=reason + _reason_tail(ev), confidence=confidence, hosts=ev.hosts,
        missing_hosts=ev.missing_hosts, world_size=ev.world_size, captured_ranks=ev.captured_ranks,
        missing_ranks=ev.missing_ranks, torch_analysis=ev.torch_analysis,
        evidence=(*(base.evidence if base is not None else ()), *ev.clock_lines), conflicts=ev.conflicts[:16],
        next_step=job_next_step(kind, base, ev.server, culprits=culprits, culprit_hosts=culprit_hosts, hosts=ev.hosts,
                                missing_hosts=ev.missing_hosts),
    )


@dataclass(frozen=True, slots=True)
class JobRule:
    """One rule of the job verdict (as :class:`agent.verdict.rules.Rule` is one of a host's).

    Attributes:
        name: ``lower_snake_case``.
        kind: the verdict kind it concludes.
        when: when it applies (one sentence).
        concludes: what it names and says.
        confidence: at what confidence, and why.
        check: the rule itself: the job verdict, or ``None`` when it does not apply.
    """

    name: str
    kind: str
    when: str
    concludes: str
    confidence: str
    check: Callable[[JobEvidence], JobVerdict | None]


#: The job rules in order; the first whose ``check`` returns a verdict decides (the last always does).
JOB_RULES: list[JobRule] = []

#: :attr:`JobRule.kind` of the rule that keeps the host rules' verdict.
_HOST_RULES_KIND = "the host rules' kind"


def _job_rule(name: str, *, kind: str, when: str, concludes: str, confidence: str) -> Callable[
        [Callable[[JobEvidence], JobVerdict | None]], Callable[[JobEvidence], JobVerdict | None]]:
    """Register a rule at the end of :data:`JOB_RULES` (definition order is rule order)."""

    def register(check: Callable[[JobEvidence], JobVerdict | None]) -> Callable[[JobEvidence], JobVerdict | None]:
        JOB_RULES.append(JobRule(name=name, kind=kind, when=when, concludes=concludes, confidence=confidence, check=check))
        return check

    return register


@_job_rule("culprits_wait_for_missing", kind=MISSING,
           when="ranks are missing and every rank the host rules name waits in a collective itself",
           concludes="the ranks nobody captured: what the named ranks wait for is past them",
           confidence="medium")
def _culprits_wait_for_missing(ev: JobEvidence) -> JobVerdict | None:
    culprits = ev.base_culprits
    if ev.base is None or not ev.missing_ranks or not culprits:
        return None
    by_rank = {e.rank: e for e in ev.ranks}
    if not all(r in by_rank and _in_collective(by_rank[r]) for r in culprits):
        return None
    reason = (f"missing: {_ranks(ev.missing_ranks)} not captured; the captured ranks all wait in collectives"
              f" ({ev.base.reason}); the culprit is among the ranks not captured")
    return _job_verdict(ev, kind=MISSING, culprits=ev.missing_ranks, reason=reason, confidence="medium")


@_job_rule("all_wait_for_missing", kind=MISSING,
           when="ranks are missing, the host rules name nobody, and every captured rank waits in the same "
                "collective (or no rank was captured)",
           concludes="the ranks nobody captured",
           confidence="medium when the captured ranks wait, low when none was captured")
def _all_wait_for_missing(ev: JobEvidence) -> JobVerdict | None:
    if ev.base_culprits or not ev.missing_ranks or not (ev.waiting_in or not ev.ranks):
        return None
    where = f"every captured rank waits in {ev.waiting_in}" if ev.waiting_in else "no rank was captured"
    reason = f"missing: {_ranks(ev.missing_ranks)} not captured ({where}); the culprit is among them"
    return _job_verdict(ev, kind=MISSING, culprits=ev.missing_ranks, reason=reason,
                        confidence="medium" if ev.waiting_in else "low")


@_job_rule("torch_behind", kind="behind",
           when="the host rules name nobody and torch's Flight Recorder analyzer finds ranks missing from a collective",
           concludes="those ranks: they never joined the collective the others wait in",
           confidence="medium")
def _torch_behind(ev: JobEvidence) -> JobVerdict | None:
    if ev.base_culprits or not ev.flagged:
        return None
    reason = (f"behind: {_ranks(ev.flagged)} never joined the collective the others wait in"
              " (torch's Flight Recorder analyzer)")
    return _job_verdict(ev, kind="behind", culprits=ev.flagged, reason=reason, confidence="medium")


@_job_rule("host_rules", kind=_HOST_RULES_KIND,
           when="a rank was captured (the host rules judged the job's ranks as one server's)",
           concludes="the host rules' culprits and reason", confidence="the host rules'")
def _host_rules(ev: JobEvidence) -> JobVerdict | None:
    base = ev.base
    if base is None:
        return None
    return _job_verdict(ev, kind=base.kind, culprits=base.culprit_ranks, reason=base.reason, confidence=base.confidence)


@_job_rule("no_evidence", kind="unknown", when="always (no rank was captured)", concludes="nobody",
           confidence="low")
def _no_evidence(ev: JobEvidence) -> JobVerdict | None:
    return _job_verdict(ev, kind="unknown", culprits=(), reason="no evidence from any host", confidence="low")


def judge_job(
    evidence: Sequence[Evidence],
    *,
    missing_hosts: Sequence[MissingHost] = (),
    world_size: int | None = None,
    conflicts: Sequence[str] = (),
    clock_offsets_s: Mapping[str, float] | None = None,
) -> JobVerdict:
    """The job's verdict from every host's summary (rules in the module docstring and
    :data:`JOB_RULES`: the first that applies decides).

    Args:
        evidence: one summary per host that sent one.
        missing_hosts: hosts the coordinator asked (or knows) that sent none.
        world_size: the job's world size when the coordinator knows it otherwise (else the
            hosts' recorders say it).
        conflicts: identity conflicts the coordinator refused (one line each); a rank two hosts
            claim is one more (the first host's summary of it is kept). Said in the reason.
        clock_offsets_s: each host's clock minus the coordinator's, seconds (by host name): exit
            times are ordered on the coordinator's clock (module docstring).

    Returns:
        The :class:`JobVerdict`.
    """
    ev = JobEvidence.of(evidence, missing_hosts=missing_hosts, world_size=world_size, conflicts=conflicts,
                        clock_offsets_s=clock_offsets_s)
    for rule in JOB_RULES:
        verdict = rule.check(ev)
        if verdict is not None:
            return verdict
    raise AssertionError("the last job rule always applies")  # pragma: no cover
