"""The verdict of an incident: which rank(s) or process(es) caused it, why, and how sure.

Owns the evidence model (:class:`RankEvidence` per process, :class:`Evidence` for one server),
the :class:`Verdict`, and the ordered table of named rules (:data:`RULES`) that turns one into
the other. Each rule is a small function with a documented *when*, *concludes* and
*confidence*; the first rule that applies decides. The table is the documentation:
:func:`rules_markdown` renders it into ``docs/verdict-rules.md`` (a test keeps the file equal to
it), with the communication layers a stack is read against
(:data:`agent.model.stacks.COMMUNICATION_LAYERS`).

Confidence is honest: ``high`` only when the evidence agrees (a Flight Recorder finding no
stack or step counter contradicts; a crash whose status is known and which came first), ``medium``
from one source (stacks of one instant), ``low`` when a status is unknown or the evidence is
thin. Hard mode acts only on a high-confidence culprit (:func:`hard_signal_plan`).

A process that is not a rank (a coordinator such as ``VLLM::EngineCore`` or SGLang's data-parallel
controller, a frontend, a plain program) is evidence, never given a rank number; a coordinator
stuck in its own code while every rank idles is itself the culprit (``coordinator``), by its pid;
so is a frontend (API server, tokenizer, detokenizer) in its own code when the server's health
check fails while its ranks idle or progress (``frontend``).

No I/O, no clock, no subprocess: the caller (:mod:`agent.verdict.judge`) gathers the evidence of one
server and passes it in. Imports the stack model (:mod:`agent.model.stacks`) and the Flight Recorder
view (:mod:`agent.verdict.flightrec`); torch only lazily and optionally (torch's analyzer).
"""

from __future__ import annotations

import enum
import re
import signal as signal_mod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from agent.model.events import ExitFact, ExitKind, Trigger
from agent.model.stacks import comm_layer
from agent.verdict.flightrec import (
    RankRecorder,
    find_behind,
    find_cycle,
    find_desync,
    late_arrivals,
    pending_p2p,
)
from agent.verdict.flightrec import warm_up as _warm_up_analyzer

__all__ = [
    "NEXT_STEPS",
    "RULES",
    "VERDICT_ATTR_PREFIX",
    "Evidence",
    "FrameClass",
    "NextStep",
    "RankEvidence",
    "Role",
    "Rule",
    "StackClass",
    "Verdict",
    "classify_stack",
    "classify_wait",
    "decide",
    "exit_kind",
    "fact_of",
    "hard_signal_plan",
    "next_step",
    "next_step_of",
    "rules_markdown",
    "warm_up",
]

#: Prefix of the verdict's attributes on the incident span.
VERDICT_ATTR_PREFIX = "servewatch.verdict."


class FrameClass(str, enum.Enum):
    """Where a process's main thread is, per its py-spy stack."""

    COMPUTE = "compute"  # running its own code (a kernel launch, a model forward, a busy loop)
    COLLECTIVE = "collective"  # inside a collective of torch.distributed or a framework's layer (waiting for peers)
    RENDEZVOUS = "rendezvous"  # forming the job: init_process_group, the TCPStore
    IDLE = "idle"  # every thread waits for a message (queue, selector, socket, ZeroMQ, a message queue)
    UNKNOWN = "unknown"  # no stack

    def __str__(self) -> str:
        return self.value


class Role(str, enum.Enum):
    """What a process is to its server."""

    RANK = "rank"  # a rank of the server's torch.distributed world (a worker, a scheduler)
    COORDINATOR = "coordinator"  # drives the ranks: VLLM::EngineCore, DPCoordinator, SGLang's DP controller
    FRONTEND = "frontend"  # API server, tokenizer, detokenizer
    PROCESS = "process"  # known by pid alone

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEvidence:
    """What is known about one process of a server.

    Attributes:
        rank: its rank in the server's world (torch.distributed's, else from its title), ``None``
            for a process that is not a rank (never a made-up number).
        pid: its process.
        role: rank, coordinator, frontend or plain process.
        title: its process title (``VLLM::Worker_TP0``), for naming a process without a rank.
        label: its parallel coordinates (``DP1_TP0``), ``""`` when none.
        alive: the process still exists (not gone, not a zombie) when the verdict is made.
        exited_first: its exit opened the incident.
        exit_signal / exit_code: how it ended, when known (``"SIGSEGV"``; ``1``).
        oom_killed: the kernel's OOM killer ended it.
        exit_time_ns: when it ended (wall clock, ns), when known: deaths are ordered by it.
        exit_detail: how its end was learnt, in words (``memory.events oom_kill``), or ``""``.
        exit_fact: the process watcher's whole :class:`~agent.model.events.ExitFact` (kind, status, time,
            source), when known: it wins over the fields above.
        frame_class / frame: its py-spy stack's class and the frame it is in.
        p2p: the point-to-point operation its stack waits in (``recv``, ``send``, ``send/recv``,
            ``wait``; a ``p2p`` communication layer: ``torch.distributed.recv``, vLLM's and SGLang's
            ``GroupCoordinator.recv_tensor_dict``...), ``""`` when it waits in none (its
            ``frame_class`` is then ``collective`` too: a wait for a peer).
        stack_note: what happened reading its stack, when not plain (``stack too deep for py-spy``).
        steps_before / steps_after: its forward-step counter when the incident opened and when the
            evidence was complete (``None``: no counter).
        pending: work items it had pending when the incident opened (SDK counter), ``None`` unknown.
        fr: its Flight Recorder dump (``entries``, ``pg_status``), or ``None``.
        waits_on: for a coordinator blocked on its workers: their pids.
        rank_source: how ``rank`` was found when not from torch.distributed's Flight Recorder or
            the title: ``"sdk"`` (the SDK's step counter: torch.distributed's rank, recorded by
            the process), ``"environ"`` (``RANK`` in its environment), or an inference in words (a culprit whose rank is inferred is named
            at medium confidence at most); ``""`` otherwise.
        stopped: it is stopped (``/proc`` state ``T`` or ``t``: SIGSTOP or a debugger), seen so
            when the incident opened and again once the evidence was in (py-spy's own brief
            ptrace stop while it reads a stack is not seen twice).
        uninterruptible: one of its threads is in uninterruptible sleep (``/proc`` state ``D``: a
            read from a hung network filesystem or device), the same thread seen so when the
            incident opened and again once the evidence was in (a brief disk read is not seen twice).
        wchan: the kernel function that thread waits in (``/proc/PID/task/TID/wchan``), ``""``
            when unknown or not in ``D``.
        event_loop: a frontend whose stuck thread runs an asyncio event loop (a run-loop frame below
            its stuck frame): while it runs, the loop answers no request (``/health``, ``/metrics``).
    """

    rank: int | None = None
    pid: int | None = None
    role: Role = Role.RANK
    title: str = ""
    label: str = ""
    alive: bool = True
    exited_first: bool = False
    exit_signal: str | None = None
    exit_code: int | None = None
    oom_killed: bool = False
    exit_time_ns: int | None = None
    exit_detail: str = ""
    exit_fact: ExitFact | None = None
    frame_class: FrameClass = FrameClass.UNKNOWN
    frame: str = ""
    p2p: str = ""
    stack_note: str = ""
    steps_before: int | None = None
    steps_after: int | None = None
    pending: int | None = None
    fr: Mapping[str, Any] | None = None
    waits_on: tuple[int, ...] = ()
    rank_source: str = ""
    stopped: bool = False
    uninterruptible: bool = False
    wchan: str = ""
    event_loop: bool = False

    @property
    def is_rank(self) -> bool:
        return self.rank is not None and self.role is Role.RANK

    @property
    def number(self) -> int:
        """Its rank, ``-1`` for a process that is no rank (for sorting and typing; never shown)."""
        return self.rank if self.rank is not None else -1

    @property
    def name(self) -> str:
        """``rank 2`` for a rank, else ``pid 42 'VLLM::EngineCore'``."""
        if self.is_rank:
            return f"rank {self.rank}"
        return f"pid {self.pid}" + (f" {self.title!r}" if self.title else "")

    @property
    def stalled(self) -> bool | None:
        """Its step counter did not advance (``None``: no counter)."""
        if self.steps_before is None or self.steps_after is None:
            return None
        return self.steps_after == self.steps_before

    @property
    def advanced(self) -> bool:
        return self.stalled is False


def _signum(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return int(signal_mod.Signals[name])
    except KeyError:
        m = re.match(r"signal (\d+)$", name)
        return int(m.group(1)) if m else 0


def fact_of(e: RankEvidence) -> ExitFact | None:
    """``e``'s :class:`~agent.model.events.ExitFact` (the watcher's, else one derived from its fields);
    ``None`` while it is alive."""
    if e.alive:
        return None
    if e.exit_fact is not None:
        return e.exit_fact
    return ExitFact.of(e.pid or 0, e.exit_code, _signum(e.exit_signal), oom=e.oom_killed,
                       ended_time_unix_nano=e.exit_time_ns or 0)


def exit_kind(e: RankEvidence) -> ExitKind | None:
    """How ``e`` ended (:class:`agent.model.events.ExitKind`: the OOM killer wins; a stop signal or exit
    code 0/143/130 is orderly; another signal ``signal``; another code ``code``; else unknown),
    ``None`` while it is alive."""
    fact = fact_of(e)
    return fact.kind if fact is not None else None


def _exit_time(e: RankEvidence) -> int | None:
    fact = fact_of(e)
    return (fact.ended_time_unix_nano or None) if fact is not None else None


def _how_exited(e: RankEvidence) -> str:
    """``exited with SIGSEGV`` / ``was killed by the OOM killer`` / ``exited (exit status unknown)``."""
    fact = fact_of(e)
    if fact is None:
        return "is alive"
    if fact.oom:
        return "was killed by the OOM killer"
    if fact.signal is not None:
        return f"exited with {fact.signal_name}"
    if fact.exit_code is not None:
        return f"exited with exit code {fact.exit_code}"
    return "exited (exit status unknown)"


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """Everything known about one server's incident: the input of every rule.

    Build it with :meth:`of`; the views (``ranks``, ``others``, ``recorders``) are computed once.

    Attributes:
        processes: every process considered, ranks first (by rank), then the others (by pid).
        ranks: the ranks (one per rank number; the first seen wins).
        others: coordinators, frontends and processes without a rank.
        recorders: the live ranks' non-empty Flight Recorders, by rank.
        trigger: what opened the incident (``stall``, ``exit``, ``health``, ``manual``, ``""``).
        work_pending: whether work was pending (a stall means busy; the SDK's pending count; the
            server's running/waiting requests); ``None`` when nothing tells.
        world_size: the world size the ranks were started with, when known (rendezvous).
        server_progress: the server's own progress counter (its ``/metrics``, read when the
            incident opened and again once the evidence was in) advanced (``True``), stood still
            (``False``), or was not read (``None``).
        server_progress_detail: that reading in words (``vllm:iteration_tokens_total_count
            120->131 in 2.0 s at http://...``); with ``server_progress`` ``None``, why the given
            counter gave no reading (``no reading of http://...: connection refused ...``), or
            ``""`` when none was given.
        no_targets: no target process was found for the incident: its only process is the one
            whose exit opened it, watched as the server (a launched command, a ``--root-pid``),
            not matched as a rank.
        health_url: the health endpoint whose failure opened the incident (``trigger`` ``health``),
            ``""`` otherwise: the next step of a verdict that blames no rank asks it again.
        orphaned_pids: the incident opened on the exit of the server's frontend (not a target) and
            these processes of the server were still alive then
            (:class:`~agent.model.events.FrontendExited`'s ``left_alive``); ``()`` otherwise.
        orphaned_bytes: their resident memory then, bytes (0: unknown).
        orphaned_under: their parent then (1, or a subreaper; 0: unknown).
        preempted: requests the engine preempted with no progress over ``preempted_in_s``
            seconds, per the stall that opened the incident (``WatchdogStalled.preempted``:
            vLLM's ``vllm:num_preemptions_total``); 0 when none or not counted.
        preempted_in_s: the seconds ``preempted`` was counted over.
        stuck_request: the request whose stall opened the incident (``RequestStalled``), in words
            (id, pid, age, the bound it passed); ``""`` otherwise.
        stuck_request_pid: the process serving it (0: none).
        stuck_thread: the thread holding it, in words (name, tid, busy or idle, innermost frame),
            from its process's py-spy dump; ``""`` when not found there.
        stuck_thread_busy: py-spy found that thread busy (not idle in a wait).
    """

    processes: tuple[RankEvidence, ...]
    ranks: tuple[RankEvidence, ...] = ()
    others: tuple[RankEvidence, ...] = ()
    recorders: Mapping[int, RankRecorder] = field(default_factory=dict)
    trigger: str = ""
    work_pending: bool | None = None
    world_size: int | None = None
    server_progress: bool | None = None
    server_progress_detail: str = ""
    no_targets: bool = False
    health_url: str = ""
    orphaned_pids: tuple[int, ...] = ()
    orphaned_bytes: int = 0
    orphaned_under: int = 0
    preempted: int = 0
    preempted_in_s: float = 0.0
    stuck_request: str = ""
    stuck_request_pid: int = 0
    stuck_thread: str = ""
    stuck_thread_busy: bool = False

    @staticmethod
    def of(items: Iterable[RankEvidence], *, trigger: str = "", work_pending: bool | None = None,
           world_size: int | None = None, server_progress: bool | None = None,
           server_progress_detail: str = "", no_targets: bool = False, health_url: str = "",
           orphaned_pids: Iterable[int] = (), orphaned_bytes: int = 0, orphaned_under: int = 0,
           preempted: int = 0, preempted_in_s: float = 0.0, stuck_request: str = "", stuck_request_pid: int = 0,
           stuck_thread: str = "", stuck_thread_busy: bool = False) -> Evidence:
        """The evidence of one server from its processes (any order; a rank seen twice keeps the first)."""
        seen: dict[int, RankEvidence] = {}
        others: list[RankEvidence] = []
        for e in items:
            if e.is_rank:
                seen.setdefault(e.rank, e)  # type: ignore[arg-type]
            else:
                others.append(e)
        ranks = tuple(seen[r] for r in sorted(seen))
        others_t = tuple(sorted(others, key=lambda e: e.pid or 0))
        recorders: dict[int, RankRecorder] = {}
        for e in ranks:
            fr = RankRecorder.of(e.fr) if e.alive else None
            if fr is not None and not fr.empty:
                recorders[e.number] = fr
        if work_pending is None and trigger == Trigger.STALL:
            work_pending = True  # the watchdog fires only while busy
        counted = [e.pending for e in (*ranks, *others_t) if e.pending is not None]
        if work_pending is None and counted:
            work_pending = any(counted)
        return Evidence(processes=ranks + others_t, ranks=ranks, others=others_t, recorders=recorders,
                        trigger=trigger, work_pending=work_pending, world_size=world_size,
                        server_progress=server_progress, server_progress_detail=server_progress_detail,
                        no_targets=no_targets, health_url=health_url, orphaned_pids=tuple(orphaned_pids),
                        orphaned_bytes=orphaned_bytes, orphaned_under=orphaned_under,
                        preempted=preempted, preempted_in_s=preempted_in_s, stuck_request=stuck_request,
                        stuck_request_pid=stuck_request_pid, stuck_thread=stuck_thread,
                        stuck_thread_busy=stuck_thread_busy)

    @property
    def progress_known(self) -> bool:
        """Something tells a hang from work: a stall trigger (the watchdog saw no progress while
        busy; a start-up stall: no first step within the start-up budget), a rank's step counter
        read twice, or the server's own progress counter read twice. One snapshot of stacks alone
        cannot: a busy forward and a hung one look the same."""
        return (self.trigger in (Trigger.STALL, STARTUP_STALL) or self.server_progress is not None
                or any(e.stalled is not None for e in self.ranks))

    @property
    def no_progress(self) -> bool:
        """Progress is known to have stopped: a stall trigger (or a start-up stall), the server's
        counter stood still, or every rank's counter stood still."""
        return (self.trigger in (Trigger.STALL, STARTUP_STALL) or self.server_progress is False
                or bool(self.ranks) and all(e.stalled for e in self.ranks))

    @property
    def complete_fr(self) -> bool:
        """Every rank's recorder was read (and there are two ranks or more to compare)."""
        return len(self.recorders) == len(self.ranks) and len(self.ranks) > 1

    def rank(self, r: int) -> RankEvidence | None:
        return next((e for e in self.ranks if e.rank == r), None)

    def dead(self, *kinds: ExitKind) -> list[RankEvidence]:
        """Gone processes whose end is one of ``kinds``, first death first (:func:`_death_order`)."""
        return sorted((e for e in self.processes if exit_kind(e) in kinds), key=_death_order)


def _death_order(e: RankEvidence) -> tuple[int, int, int]:
    """Known time first (earliest first), then the exit that opened the incident, then rank/pid."""
    t = _exit_time(e)
    return (0 if t is not None else 1, t or 0, 0 if e.exited_first else 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """The incident's verdict.

    Attributes:
        kind: what was concluded: ``dead``, ``cascade``, ``stopped``, ``suspended``,
            ``uninterruptible`` (a process in state D), ``desync``,
            ``progressing``, ``rendezvous``, ``cycle``, ``behind``, ``coordinator`` (a coordinator stuck in its
            own code while every rank idles), ``frontend`` (an API server, tokenizer or detokenizer
            that keeps a failing server from answering while its ranks idle or progress), ``deadlock``,
            ``idle``, ``compute``, ``single`` (one process, not a distributed job), ``livelock`` (the
            engine preempts and resumes requests and completes none: vLLM #25538), ``request`` (one
            request stuck while the server completes others: vLLM #54003), ``orphaned`` (the server's frontend died,
            its processes live on) or ``unknown`` (see :data:`RULES`).
        hung: whether the server is known to be stuck (``progressing``, ``idle`` and ``stopped``
            are not, nor ``compute`` when nothing tells a hang from work).
        culprit_ranks: the rank(s) named (empty when none can be).
        culprit_pids: the culprit ranks' pids (rank order), then any culprit process without a
            rank; a rank that never started has no pid.
        reason: one line, e.g. ``behind: rank 1 never entered all_reduce #42 of pg 0; rank 0 waits in it``.
        confidence: ``high``, ``medium`` or ``low``.
        evidence: short facts behind it (one per process).
        stragglers: ranks slower than the rest while all progress (``progressing`` only).
        ranks: every rank considered.
        rule: the name of the rule that concluded (:data:`RULES`).
        culprit_names: each culprit in words (``rank 1 (pid 42)``), for the headline.
        culprit_roles: each culprit's role (:class:`Role`: ``rank``, ``coordinator``, ``frontend``,
            ``process``), in the order of ``culprit_pids``.
        next_step: what to run or check next, one line, concrete to this verdict's facts (its
            pids, its exit, its frame): :data:`NEXT_STEPS` (filled in by :func:`judge`).
    """

    kind: str
    hung: bool
    culprit_ranks: tuple[int, ...]
    culprit_pids: tuple[int, ...]
    reason: str
    confidence: str
    evidence: tuple[str, ...] = ()
    stragglers: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    rule: str = ""
    culprit_names: tuple[str, ...] = ()
    next_step: str = ""
    culprit_roles: tuple[str, ...] = ()

    def headline(self) -> str:
        """The summary's first line: ``Verdict: culprit rank 1 (pid 42) -- behind: ... [confidence high]``;
        ``Verdict: 1 process (pid 42), not a distributed job: in f (m.py:3) [confidence medium]``
        for a ``single`` verdict (no culprit wording: there is nothing to blame it against)."""
        if self.kind in ("single", "orphaned"):  # the reason names the processes itself
            return f"Verdict: {self.reason} [confidence {self.confidence}]"
        if self.culprit_names:
            return f"Verdict: culprit {', '.join(self.culprit_names)} -- {self.reason} [confidence {self.confidence}]"
        return f"Verdict: no culprit rank -- {self.reason} [confidence {self.confidence}]"

    def attributes(self) -> dict[str, Any]:
        """``servewatch.verdict.*`` span attributes."""
        p = VERDICT_ATTR_PREFIX
        return {
            f"{p}kind": self.kind,
            f"{p}hung": self.hung,
            f"{p}culprit_ranks": tuple(self.culprit_ranks),
            f"{p}culprit_pids": tuple(self.culprit_pids),
            f"{p}culprit_roles": tuple(self.culprit_roles),
            f"{p}reason": self.reason,
            f"{p}confidence": self.confidence,
            f"{p}stragglers": tuple(self.stragglers),
            f"{p}ranks": tuple(self.ranks),
            f"{p}rule": self.rule,
            f"{p}next": self.next_step,
        }

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the manifest's ``verdict``)."""
        return {
            "kind": self.kind,
            "hung": self.hung,
            "culprit_ranks": list(self.culprit_ranks),
            "culprit_pids": list(self.culprit_pids),
            "culprit_roles": list(self.culprit_roles),
            "reason": self.reason,
            "confidence": self.confidence,
            "evidence": list(self.evidence),
            "stragglers": list(self.stragglers),
            "ranks": list(self.ranks),
            "rule": self.rule,
            "headline": self.headline(),
            "next": self.next_step,
        }


# --- wording --------------------------------------------------------------------------------------


def _ranks_text(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(str(r) for r in rs)


def _ranks_wait(ranks: Iterable[int]) -> str:
    """``rank 1 waits`` / ``ranks 0,2 wait``: the subject and its verb agree."""
    rs = sorted(ranks)
    return f"{_ranks_text(rs)} {'waits' if len(rs) == 1 else 'wait'}"


def _names(es: Sequence[RankEvidence]) -> str:
    """``rank 1`` / ``ranks 0,2`` / ``rank 0, pid 42 'VLLM::EngineCore'``."""
    ranks = [e.rank for e in es if e.is_rank]
    parts = [_ranks_text(ranks)] if ranks else []  # type: ignore[arg-type]
    parts += [e.name for e in es if not e.is_rank]
    return ", ".join(parts)


def _culprit_name(e: RankEvidence) -> str:
    if e.is_rank:
        return f"rank {e.rank}" + (f" (pid {e.pid})" if e.pid else " (no process)")
    return e.name


#: The rank sources read from the process itself (``RankEvidence.rank_source``; any other is an
#: inference, in words) and how an evidence line says them.
_RANK_SOURCE_WORDS = {"": "", "sdk": "rank from its SDK step counter", "environ": "rank from its environment (RANK)"}


def _evidence_line(e: RankEvidence) -> str:
    parts = [*_who_words(e), *_state_words(e), *_stack_words(e)]
    fr = RankRecorder.of(e.fr)
    if fr is not None and fr.groups:
        for pg, st in sorted(fr.groups.items())[:2]:
            parts.append(f"pg {pg}: enqueued #{st[0]}, completed #{st[1]}")
    return "; ".join(parts)


def _who_words(e: RankEvidence) -> list[str]:
    """An evidence line's first parts: the process (a rank's pid, its label), how its rank was read, its role."""
    parts = [e.name + (f" pid {e.pid}" if e.pid and e.is_rank else "")]
    if e.label:
        parts[0] += f" [{e.label}]"
    if e.is_rank and e.rank_source:
        parts.append(_RANK_SOURCE_WORDS.get(e.rank_source, e.rank_source))
    if e.role not in (Role.RANK, Role.PROCESS):
        parts.append(e.role.value)
    return parts


def _state_words(e: RankEvidence) -> list[str]:
    """An evidence line's parts on the process's state: stopped, in D, gone."""
    parts = []
    if e.stopped and e.alive:
        parts.append("stopped (state T: SIGSTOP or a debugger)")
    if e.uninterruptible and e.alive:
        parts.append(f"uninterruptible sleep (D) in {_wchan_words(e)}")
    fact = fact_of(e)
    if fact is not None:
        parts.append(f"gone ({fact.describe()})")
    return parts


def _stack_words(e: RankEvidence) -> list[str]:
    """An evidence line's parts on the process's stack and steps."""
    parts = []
    if e.p2p and e.frame_class is FrameClass.COLLECTIVE:
        parts.append(f"p2p {e.p2p}: {e.frame}" if e.frame else f"p2p {e.p2p}")
    elif e.frame_class is not FrameClass.UNKNOWN:
        parts.append(f"{e.frame_class.value}: {e.frame}" if e.frame else e.frame_class.value)
    if e.stack_note:
        parts.append(e.stack_note)
    if e.steps_before is not None and e.steps_after is not None:
        parts.append(f"steps {e.steps_before}->{e.steps_after}")
    return parts


def _wchan_words(e: RankEvidence) -> str:
    return e.wchan or "an unknown kernel function"


def _verdict(ev: Evidence, kind: str, culprits: Sequence[RankEvidence], reason: str, confidence: str, *,
             hung: bool = True, stragglers: Iterable[int] = (), extra: Sequence[str] = ()) -> Verdict:
    ranked = sorted((c for c in culprits if c.is_rank), key=lambda c: c.rank)  # type: ignore[arg-type, return-value]
    rest = [c for c in culprits if not c.is_rank]
    return Verdict(
        kind=kind,
        hung=hung,
        culprit_ranks=tuple(c.rank for c in ranked),  # type: ignore[misc]
        culprit_pids=tuple(c.pid for c in (*ranked, *rest) if c.pid),
        reason=reason,
        confidence=_read_confidence(confidence, ranked),
        evidence=tuple(_evidence_line(e) for e in ev.processes) + tuple(extra),
        stragglers=tuple(sorted(set(stragglers))),
        ranks=tuple(e.rank for e in ev.ranks),  # type: ignore[misc]
        culprit_names=tuple(_culprit_name(c) for c in (*ranked, *rest)),
        culprit_roles=tuple(c.role.value for c in (*ranked, *rest) if c.pid),
    )


def _read_confidence(confidence: str, ranked: Sequence[RankEvidence]) -> str:
    """``confidence``, but ``medium`` for ``high`` when a culprit's rank was inferred, not read
    (:attr:`RankEvidence.rank_source`)."""
    if confidence == "high" and any(c.rank_source not in _RANK_SOURCE_WORDS for c in ranked):
        return "medium"
    return confidence


def _missing_rank(r: int) -> RankEvidence:
    """A rank of the world with no process seen (it never started, or was not matched)."""
    return RankEvidence(rank=r, alive=False)


# --- confidence ----------------------------------------------------------------------------------


def _contradicted(culprits: Sequence[RankEvidence], waiting: Sequence[RankEvidence]) -> bool:
    """A stack or a step counter says otherwise: a culprit waits in a collective or advanced, or
    a rank said to wait runs its own code."""
    if any(c.frame_class is FrameClass.COLLECTIVE or c.advanced for c in culprits):
        return True
    return any(w.frame_class in (FrameClass.COMPUTE, FrameClass.IDLE) for w in waiting)


def _recorder_confidence(culprits: Sequence[RankEvidence], waiting: Sequence[RankEvidence]) -> str:
    """A Flight Recorder finding: ``high`` unless a stack or step counter contradicts it."""
    return "medium" if _contradicted(culprits, waiting) else "high"


# --- the rules -----------------------------------------------------------------------------------

#: The start-up rule's trigger (:data:`agent.host.startup.STARTUP_STALL`, not imported: the rules
#: import no component; a test keeps the two equal): ranks took no first step within the budget.
STARTUP_STALL = "startup_stall"


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule of the verdict.

    Attributes:
        name: ``lower_snake_case``, recorded as the verdict's ``rule``.
        kind: the verdict kind it concludes.
        when: when it applies (one sentence).
        concludes: what it names and says.
        confidence: at what confidence, and why.
        check: the rule itself: the verdict, or ``None`` when it does not apply.
    """

    name: str
    kind: str
    when: str
    concludes: str
    confidence: str
    check: Callable[[Evidence], Verdict | None]


#: The rules in order; the first whose ``check`` returns a verdict decides.
RULES: list[Rule] = []


def _rule(name: str, *, kind: str, when: str, concludes: str, confidence: str) -> Callable[
        [Callable[[Evidence], Verdict | None]], Callable[[Evidence], Verdict | None]]:
    """Register a rule at the end of :data:`RULES` (definition order is rule order)."""

    def register(check: Callable[[Evidence], Verdict | None]) -> Callable[[Evidence], Verdict | None]:
        RULES.append(Rule(name=name, kind=kind, when=when, concludes=concludes, confidence=confidence, check=check))
        return check

    return register


@_rule("no_process", kind="unknown", when="no process to judge", concludes="nobody", confidence="low")
def _no_process(ev: Evidence) -> Verdict | None:
    if ev.processes:
        return None
    return _verdict(ev, "unknown", (), "no rank to judge", "low", hung=False)


def _held(size: int) -> str:
    """``0.40 GB`` / ``12.3 MB`` (as :meth:`agent.model.events.FrontendExited.describe` says it)."""
    return f"{size / 1e9:.2f} GB" if size >= 1e7 else f"{size / 1e6:.1f} MB"


@_rule("frontend_exited", kind="orphaned",
       when="the incident opened on the exit of the server's frontend (its launcher or API server, not a target) "
            "while processes of the server live on (reparented to pid 1 or a subreaper), still alive when judged",
       concludes="the processes left alive, by pid and title, with the memory they hold: `server's frontend pid 41 "
                 "'python -m sglang.launch_server' exited (signal 9 (SIGKILL)); 2 processes of it still alive under "
                 "pid 1 holding 0.40 GB: pid 42 'sglang::scheduler_TP0', pid 43 'sglang::scheduler_TP1'`; they are "
                 "the culprits: a restart beside them can run out of memory",
       confidence="high: the frontend is gone and they were seen alive when judged")
def _orphaned(ev: Evidence) -> Verdict | None:
    if not ev.orphaned_pids:
        return None
    left = [e for e in ev.processes if e.pid in ev.orphaned_pids and e.alive]
    if not left:
        return None  # they ended since: the other rules judge how
    return _verdict(ev, "orphaned", left, _orphaned_reason(ev, left), "high", hung=False)


def _orphaned_reason(ev: Evidence, left: Sequence[RankEvidence]) -> str:
    """The ``orphaned`` verdict's reason: the frontend's exit and the processes ``left`` alive."""
    frontend = next((e for e in ev.processes if e.exited_first and e.pid not in ev.orphaned_pids), None)
    fact = fact_of(frontend) if frontend is not None else None
    who = f"frontend {frontend.name}" if frontend is not None else "frontend"
    status = fact.status_words() if fact is not None else "exit status unknown"
    n = len(left)
    under = f" under pid {ev.orphaned_under}" if ev.orphaned_under else ""
    held = f" holding {_held(ev.orphaned_bytes)}" if ev.orphaned_bytes else ""
    names = ", ".join(f"pid {e.pid}" + (f" {e.title!r}" if e.title else "") for e in left)
    return (f"server's {who} exited ({status}); {n} process{'es' if n > 1 else ''} of it still alive"
            f"{under}{held}: {names}")


@_rule("server_exited", kind="dead",
       when="the incident's only process is the server whose exit opened it (a launched command, a --root-pid), "
            "and no target process (no rank) was ever found: it ended with an error or an unknown status",
       concludes="the server, named by its title or command line: `the server (pid 42 'python -m "
                 "sglang.launch_server') exited with exit code 1 before any rank started`",
       confidence="high for a known exit status (reaped by servewatch, the kernel's record); low when unknown")
def _server_exited(ev: Evidence) -> Verdict | None:
    if not ev.no_targets or len(ev.processes) != 1:
        return None
    e = ev.processes[0]
    kind = exit_kind(e)
    if e.is_rank or not e.exited_first or kind is None or kind is ExitKind.ORDERLY:
        return None
    reason = f"the server ({e.name}) {_how_exited(e)} before any rank started"
    return _verdict(ev, "dead", [e], reason, "low" if kind is ExitKind.UNKNOWN else "high")


#: Preemptions with no progress that make a livelock certain (one or two may be a request that
#: was preempted once as memory ran short, before the stall).
LIVELOCK_SURE_PREEMPTIONS = 3


@_rule("livelock", kind="livelock",
       when="no progress (a stall: busy, no work completed, no token out, no step with output; or the server's "
            "counter stood still across a `dump --metrics-url`) while the engine kept preempting and resuming "
            "requests (vLLM's `vllm:num_preemptions_total` rose while `vllm:kv_cache_usage_perc` moved), every "
            "process alive and running",
       concludes="a livelock of the engine's scheduler, named with the count: `livelock: requests preempted 41 "
                 "times in 30 s with no output token` (vLLM #25538); the engine core (a coordinator) is named "
                 "when it is among the processes; a moving gauge is never progress",
       confidence=f"high with {LIVELOCK_SURE_PREEMPTIONS} preemptions or more; medium with fewer")
def _livelock(ev: Evidence) -> Verdict | None:
    if not ev.no_progress or ev.preempted <= 0:
        return None
    if any(not e.alive or e.stopped or e.uninterruptible for e in ev.processes):
        return None  # a death, a stop or a D-state thread explains a stall better (their rules)
    engines = [e for e in ev.others if e.role is Role.COORDINATOR]
    times = "once" if ev.preempted == 1 else f"{ev.preempted} times"
    reason = (f"livelock: requests preempted {times} in {ev.preempted_in_s:.0f} s with no output token; the "
              "scheduler preempts and resumes (its KV-cache usage moves) and completes no work")
    confidence = "high" if ev.preempted >= LIVELOCK_SURE_PREEMPTIONS else "medium"
    return _verdict(ev, "livelock", engines, reason, confidence)


@_rule("request_stall", kind="request",
       when="one request has been in flight far longer than the server's recent completions (a multiple of their "
            "p99, bounded below: `[request_stall]`) while the server completes others (per the SDK's in-flight "
            "requests), and the process serving it is alive",
       concludes="that request is stuck, named with its id and the thread holding it (its name, tid and frame, from "
                 "the py-spy dump): `request r-7 (pid 42) in flight 95 s, over 60 s (...) is stuck; held by thread "
                 "'grammar-compile' (tid 43, busy) in compile_grammar (engine.py:40)` (vLLM #54003); the server is "
                 "not hung",
       confidence="high when the holding thread is found busy in the dump; medium when found idle or not found")
def _request_stall(ev: Evidence) -> Verdict | None:
    if ev.trigger != Trigger.REQUEST_STALL or not ev.stuck_request:
        return None
    serving = [e for e in ev.processes if e.pid == ev.stuck_request_pid]
    if any(not e.alive for e in serving):
        return None  # its process died: the death rules say so
    held = f"; held by {ev.stuck_thread}" if ev.stuck_thread else "; its thread was not found in the stack dump"
    reason = f"{ev.stuck_request} is stuck while the server completes others{held}"
    confidence = "high" if ev.stuck_thread and ev.stuck_thread_busy else "medium"
    culprits = serving or [RankEvidence(pid=ev.stuck_request_pid, role=Role.PROCESS)]
    return _verdict(ev, "request", culprits, reason, confidence, hung=False)


@_rule("single", kind="single",
       when="one process that is not a rank (no rank from torch.distributed, its title or RANK; no Flight "
            "Recorder; not in a collective)",
       concludes="where it is (`1 process (pid 42), not a distributed job: in inner_work (busy.py:6)`), idle, "
                 "or how it exited; never a culprit: there is nothing to blame it against",
       confidence="medium from its stack; high for the exit that opened the incident; low without a stack or for a stop")
def _single_process(ev: Evidence) -> Verdict | None:
    if len(ev.processes) != 1:
        return None
    e = ev.processes[0]
    if e.is_rank or e.fr is not None or e.frame_class is FrameClass.COLLECTIVE:
        return None
    return _single(e)


def _single_where(e: RankEvidence) -> tuple[str, str]:
    fact = fact_of(e)
    if fact is not None:
        if fact.stop_signal:
            return f"terminated by {fact.stop_signal} (asked to stop from outside, not a crash)", "low"
        confidence = "high" if e.exited_first and fact.kind is not ExitKind.UNKNOWN else "medium"
        return _how_exited(e), confidence
    if e.frame_class is FrameClass.IDLE:
        return (f"idle (waiting for work) in {e.frame}" if e.frame else "idle (waiting for work)"), "medium"
    if e.frame_class in (FrameClass.COMPUTE, FrameClass.RENDEZVOUS):
        return (f"in {e.frame}" if e.frame else "in its own code"), "medium"
    return "no stack", "low"


def _single(e: RankEvidence) -> Verdict:
    """Where one non-distributed process is, or how it ended; never a culprit."""
    where, confidence = _single_where(e)
    advanced = e.advanced
    if advanced and e.alive:
        where += f" (steps {e.steps_before}->{e.steps_after}: progressing)"
    if e.stack_note:
        where += f"; {e.stack_note}"
    if e.uninterruptible and e.alive:
        where += f"; a thread in uninterruptible sleep (D) in {_wchan_words(e)}"
    evidence = [f"pid {e.pid}" if e.pid else "1 process"]
    if e.frame_class is not FrameClass.UNKNOWN:
        evidence.append(f"{e.frame_class.value}: {e.frame}" if e.frame else e.frame_class.value)
    if e.steps_before is not None and e.steps_after is not None:
        evidence.append(f"steps {e.steps_before}->{e.steps_after}")
    return Verdict(
        kind="single",
        hung=not (advanced and e.alive),  # only steps seen advancing say "not hung" (hard mode reads it)
        culprit_ranks=(),
        culprit_pids=(),
        reason=f"1 process{f' (pid {e.pid})' if e.pid else ''}, not a distributed job: {where}",
        confidence=confidence,
        evidence=("; ".join(evidence),),
    )


def _dead_reason(first: RankEvidence, ev: Evidence) -> str:
    others = [e for e in ev.ranks if e is not first]
    waiting = [e.rank for e in others if e.alive and e.frame_class is FrameClass.COLLECTIVE]
    after = [e for e in others if not e.alive and exit_kind(e) is not ExitKind.ORDERLY]
    reason = f"dead: {first.name} {_how_exited(first)}"
    if waiting:
        reason += f"; {_ranks_wait(waiting)} in a collective"  # type: ignore[arg-type]
    if after:
        reason += f"; {_names(after)} exited after it"
    return reason


@_rule("crash", kind="dead",
       when="a process died of a fatal signal (SIGSEGV, SIGABRT, SIGKILL...) or the OOM killer",
       concludes="the first such death (by exit time, else the exit that opened the incident) is the culprit; "
                 "ranks that failed in their collectives after it are its victims",
       confidence="high when it is the only crash or its exit time is known and first; medium when several "
                  "crashes cannot be ordered")
def _crash(ev: Evidence) -> Verdict | None:
    crashed = ev.dead(ExitKind.SIGNAL, ExitKind.OOM)
    if not crashed:
        return None
    first = crashed[0]
    ordered = len(crashed) == 1 or _exit_time(first) is not None or (first.exited_first and not any(
        c.exited_first for c in crashed[1:]))
    if not ordered:
        reason = "dead: " + "; ".join(f"{c.name} {_how_exited(c)}" for c in crashed) + " (order unknown)"
        return _verdict(ev, "dead", crashed, reason, "medium")
    return _verdict(ev, "dead", [first], _dead_reason(first, ev), "high")


def _outside_collective(e: RankEvidence) -> bool:
    """A live rank running its own code (not waiting for peers): its stack says compute and, when
    counted, its steps stopped."""
    return e.alive and e.frame_class is FrameClass.COMPUTE and not e.advanced


@_rule("cascade", kind="cascade",
       when="ranks exited with an error (a collective timeout: exit code, no fatal signal) while a live rank runs "
            "its own code outside the collective",
       concludes="the live rank outside the collective is the culprit; the exits are consequences of its hang",
       confidence="high when its stack, its stopped step counter and its Flight Recorder (nothing in flight) "
                  "agree and an exit status says error; medium otherwise")
def _cascade(ev: Evidence) -> Verdict | None:
    gone = ev.dead(ExitKind.CODE, ExitKind.UNKNOWN)
    if not gone:
        return None
    hung = [e for e in ev.ranks if _outside_collective(e)]
    if not hung:
        return None
    sources = [all(e.stalled for e in hung), any(exit_kind(e) is ExitKind.CODE for e in gone)]
    sources.append(all(_nothing_in_flight(ev.recorders.get(e.number)) for e in hung))
    frames = "; ".join(f"{e.name} in {e.frame}" for e in hung if e.frame)
    codes = sorted({fact.status() for e in gone if (fact := fact_of(e)) is not None})
    reason = (f"collective timeout cascade: {_names(hung)} alive outside the collective"
              + (f" ({frames})" if frames else "")
              + f"; {_names(gone)} exited after it ({'; '.join(codes)}): consequences, not causes")
    return _verdict(ev, "cascade", hung, reason, "high" if all(sources) else "medium")


def _nothing_in_flight(fr: RankRecorder | None) -> bool:
    """The rank's recorder shows every collective it enqueued completed (it is not in one)."""
    return fr is not None and all(enq <= done for enq, done in fr.groups.values())


@_rule("exited", kind="dead",
       when="a rank exited with an error or an unknown status, and no live rank explains it",
       concludes="the first exit (by exit time, else the one that opened the incident) is the culprit",
       confidence="high for a known error exit that came first; low when its exit status is unknown (never a "
                  "crash at high confidence)")
def _exited(ev: Evidence) -> Verdict | None:
    gone = ev.dead(ExitKind.CODE, ExitKind.UNKNOWN)
    gone = [e for e in gone if e.exited_first or exit_kind(e) is ExitKind.CODE]
    if not gone:
        return None
    first = gone[0]
    confidence = "low" if exit_kind(first) is ExitKind.UNKNOWN else "high"
    if confidence == "high" and _exit_time(first) is None and not first.exited_first:
        confidence = "medium"
    return _verdict(ev, "dead", [first], _dead_reason(first, ev), confidence)


@_rule("stopped", kind="stopped",
       when="the exit that opened the incident was orderly (exit code 0, SIGTERM/SIGINT or 143/130)",
       concludes="nobody: it was asked to stop (`terminated by a signal: rank 1 was terminated by SIGTERM`)",
       confidence="high: the exit status says so")
def _stopped(ev: Evidence) -> Verdict | None:
    stopped = [e for e in ev.processes if e.exited_first and exit_kind(e) is ExitKind.ORDERLY]
    if not stopped:
        return None
    parts = []
    for e in stopped:
        stop = fact_of(e).stop_signal  # type: ignore[union-attr]
        parts.append(f"{e.name} was terminated by {stop}" if stop else f"{e.name} exited with exit code 0")
    signal_words = any("terminated" in p for p in parts)
    head = "terminated by a signal" if signal_words else "orderly exit"
    reason = f"{head}: {'; '.join(parts)} (asked to stop from outside, not a crash)" if signal_words else \
        f"{head}: {'; '.join(parts)} (not a crash)"
    return _verdict(ev, "stopped", (), reason, "high", hung=False)


@_rule("suspended", kind="suspended",
       when="a live process of the server is stopped (`/proc` state T or t: SIGSTOP or a debugger), seen so when the "
            "incident opened and again once the evidence was in (py-spy's own brief ptrace stop is never seen twice)",
       concludes="the stopped process is the culprit: it cannot run, and the others wait for it (`rank 0 (pid 42) is "
                 "stopped (SIGSTOP or a debugger; kill -CONT 42 resumes it)`); hard mode never signals it",
       confidence="high for the one stopped rank while progress is known to have stopped (a stall, counters standing "
                  "still); medium otherwise (several stopped, a process that is no rank, or no progress reading)")
def _suspended(ev: Evidence) -> Verdict | None:
    stopped = [e for e in ev.processes if e.alive and e.stopped]
    if not stopped:
        return None
    parts = [f"{_culprit_name(e)} is stopped (SIGSTOP or a debugger; kill -CONT {e.pid} resumes it)" for e in stopped]
    waiting = [e for e in ev.processes if _waits_for_others(e)]
    reason = "; ".join(parts) + _waiting_words(waiting)
    return _verdict(ev, "suspended", stopped, reason, "high" if _one_rank_sure(stopped, ev) else "medium")


def _waits_for_others(e: RankEvidence) -> bool:
    """A live process, not stopped, that waits in a collective or for work."""
    return e.alive and not e.stopped and e.frame_class in (FrameClass.COLLECTIVE, FrameClass.IDLE)


def _waiting_words(waiting: Sequence[RankEvidence]) -> str:
    """``; waiting for it: rank 0 in f (m.py:3); ...``; ``""`` when nobody waits."""
    if not waiting:
        return ""
    return "; waiting for it: " + "; ".join(f"{e.name} in {e.frame}" if e.frame else e.name for e in waiting)


def _one_rank_sure(culprits: Sequence[RankEvidence], ev: Evidence) -> bool:
    """One culprit, a rank, while progress is known to have stopped."""
    return len(culprits) == 1 and culprits[0].is_rank and ev.no_progress


@_rule("uninterruptible", kind="uninterruptible",
       when="a live process of the server has a thread in uninterruptible sleep (`/proc` state D: a read from a hung "
            "network filesystem or a device), the same thread seen so when the incident opened and again once the "
            "evidence was in (a brief disk read is never seen twice), its steps not advancing, while the others wait "
            "in a collective or for work, or progress is known to have stopped",
       concludes="the process in D is the culprit, with the kernel function it waits in and its frame: `rank 1 (pid 42) "
                 "is in uninterruptible sleep (D) in rpc_wait_bit_killable at load_weights (model.py:7): the kernel is "
                 "waiting on a filesystem or device; waiting for it: rank 0 in barrier (distributed_c10d.py:4881)`; "
                 "py-spy reads it with --nonblocking (a blocking dump hangs on it)",
       confidence="high for the one rank in D while progress is known to have stopped (a stall, counters standing "
                  "still); medium otherwise (several in D, a process that is no rank, or no progress reading)")
def _uninterruptible(ev: Evidence) -> Verdict | None:
    sleeping = [e for e in ev.processes if e.alive and e.uninterruptible and not e.advanced]
    if not sleeping:
        return None
    culprits = {e.pid for e in sleeping}
    waiting = [e for e in ev.processes if e.pid not in culprits and _waits_for_others(e)]
    if not waiting and not ev.no_progress:
        return None  # nobody waits for it and nothing says progress stopped: a slow read, not a hang
    parts = [f"{_culprit_name(e)} is in uninterruptible sleep (D) in {_wchan_words(e)}" + (f" at {e.frame}" if e.frame else "")
             for e in sleeping]
    reason = "; ".join(parts) + ": the kernel is waiting on a filesystem or device" + _waiting_words(waiting)
    return _verdict(ev, "uninterruptible", sleeping, reason, "high" if _one_rank_sure(sleeping, ev) else "medium")


@_rule("desync", kind="desync",
       when="every rank's Flight Recorder was read and, at one sequence id of a group, the ranks issued different "
            "ops/sizes/dtypes (torch's `Op.match`)",
       concludes="the odd rank out: the minority, else the rank breaking the group's repeating pattern",
       confidence="high when a majority or the pattern settles it; low when every rank involved is named")
def _desync(ev: Evidence) -> Verdict | None:
    if not ev.complete_fr:
        return None
    found = find_desync(ev.recorders)
    if found is None:
        return None
    reason = f"desync: ranks issued different ops/sizes at #{found.seq} of {found.pg_text} ({found.parts})"
    extra = [f"torch flight_recorder: {found.torch_words}"] if found.torch_words else []
    culprits = [e for e in ev.ranks if e.rank in found.culprits]
    return _verdict(ev, "desync", culprits, reason, "high" if found.settled else "low", extra=extra)


# --- frontends: the API server, the tokenizer, the detokenizer (issue 32 item 1) -----------------


def _frontend_words(e: RankEvidence) -> str:
    """``the detokenizer`` (``sglang::detokenizer``), ``the tokenizer``, else ``the API server``
    (vLLM's ``APIServer_<i>``, an untitled HTTP frontend: ``vllm serve``, SGLang's main process)."""
    name = e.title.partition("::")[2].split("_")[0].lower() if "::" in e.title else ""
    if name == "detokenizer":
        return "the detokenizer"
    return "the tokenizer" if name == "tokenizer" else "the API server"


def _stuck_frontends(ev: Evidence) -> list[RankEvidence]:
    """Live frontends running their own code (not idle, not stopped, not in D: rules above say those)."""
    return [e for e in ev.others if e.role is Role.FRONTEND and e.alive and e.frame_class is FrameClass.COMPUTE
            and not e.stopped and not e.uninterruptible]


def _ranks_progress(ev: Evidence) -> str | None:
    """How the ranks are known to progress, in words (every rank's steps, else the server's own
    counter); ``None`` when not known to (no reading, a stall, a rank's counter standing still)."""
    if ev.trigger == Trigger.STALL or any(e.stalled for e in ev.ranks):
        return None
    if ev.ranks and all(e.advanced for e in ev.ranks):
        return "steps " + ", ".join(f"rank {e.rank} +{e.steps_after - e.steps_before}" for e in ev.ranks)  # type: ignore[operator]
    return ev.server_progress_detail or "the server's progress counter advanced" if ev.server_progress else None


@_rule("frontend_spins", kind="frontend",
       when="the server's health check failed while its ranks progress (every rank's step counter, else the "
            "server's own progress counter on its /metrics, advanced during the incident) and a frontend (the "
            "detokenizer, the tokenizer, the API server) runs its own code",
       concludes="that frontend is the culprit, named with its role and frame: `the detokenizer pid 43 "
                 "'sglang::detokenizer' spins in decode (sglang/srt/managers/detokenizer_manager.py:210) while the "
                 "ranks progress (sglang:generation_tokens_total 120->480 in 0.8 s at http://...): /health fails`: "
                 "tokens are generated, the answers never leave (SGLang #26482, #34740); never the progressing ranks",
       confidence="high for one frontend in its own code (the failed health check, the ranks' counters and its stack "
                  "agree; a detokenizer or tokenizer in its own code is named before an API server seen busy "
                  "beside it); medium for several")
def _frontend_spins(ev: Evidence) -> Verdict | None:
    if ev.trigger != Trigger.HEALTH:
        return None
    progress = _ranks_progress(ev)
    stuck = _stuck_frontends(ev)
    if progress is None or not stuck:
        return None
    # the detokenizer or tokenizer in its own code, not the API server handling a request meanwhile
    stuck = [e for e in stuck if _frontend_words(e) != "the API server"] or stuck
    parts = [f"{_frontend_words(e)} {e.name} spins in {e.frame or 'its own code'}" for e in stuck]
    health = ev.health_url or "/health"
    reason = "; ".join(parts) + f" while the ranks progress ({progress}): {health} fails"
    return _verdict(ev, "frontend", stuck, reason, "high" if len(stuck) == 1 else "medium")


def _blocked_words(e: RankEvidence) -> str:
    """``the API server's event loop is blocked in f (m.py:3) (pid 41 'vllm serve')`` / ``the
    tokenizer pid 44 '...' is stuck in f (m.py:3)`` (an event loop only when its stack shows one)."""
    where = e.frame or "its own code"
    if e.event_loop:
        return f"{_frontend_words(e)}'s event loop is blocked in {where} ({e.name})"
    return f"{_frontend_words(e)} {e.name} is stuck in {where}"


@_rule("frontend_blocked", kind="frontend",
       when="the server's health check failed, or it stalled (requests open, no progress), while every rank and "
            "coordinator whose stack was read waits for work (idle: none in a collective or its own code, none "
            "progressing) and a frontend (the API server, the tokenizer, the detokenizer) runs its own code",
       concludes="that frontend is the culprit: `the API server's event loop is blocked in apply_hf_chat_template "
                 "(vllm/entrypoints/chat_utils.py:40) (pid 41 'vllm serve'): http://.../health fails while the "
                 "engine core and every rank idle (waiting for work)`: a synchronous call inside an async handler "
                 "answers no request, /health and /metrics included (vLLM PR #38157); at a stall: `the detokenizer "
                 "pid 43 'sglang::detokenizer' is stuck in decode (...): requests wait with no progress while every "
                 "rank idles (waiting for work)`: the ranks finished their work, its answers never leave (SGLang #26482)",
       confidence="high for one frontend, every rank and coordinator read idle and no progress seen, whose stuck "
                  "thread runs its event loop (a health failure) or at a stall; medium otherwise (several frontends, "
                  "no event loop on its stack)")
def _frontend_blocked(ev: Evidence) -> Verdict | None:
    if ev.trigger not in (Trigger.HEALTH, Trigger.STALL):
        return None
    backend = [e for e in ev.processes if e.role in (Role.RANK, Role.COORDINATOR) and e.alive]
    read = [e for e in backend if e.frame_class is not FrameClass.UNKNOWN]
    if not read or any(e.frame_class is not FrameClass.IDLE or e.advanced for e in read):
        return None
    stuck = _stuck_frontends(ev)
    if not stuck:
        return None
    reason = "; ".join(_blocked_words(e) for e in stuck) + _idle_backend_words(ev, read)
    sure = _frontend_blocked_sure(ev, stuck, all_read=len(read) == len(backend))
    return _verdict(ev, "frontend", stuck, reason, "high" if sure else "medium")


def _frontend_blocked_sure(ev: Evidence, stuck: Sequence[RankEvidence], *, all_read: bool) -> bool:
    """One frontend, its event loop blocked (or a stall), every rank and coordinator read, no progress seen."""
    return (len(stuck) == 1 and (stuck[0].event_loop or ev.trigger == Trigger.STALL) and all_read
            and ev.server_progress is not True)


def _idle_backend_words(ev: Evidence, read: Sequence[RankEvidence]) -> str:
    """The ``frontend_blocked`` reason's tail: what fails (requests at a stall, else the health
    check) while the ranks and coordinators ``read`` idle."""
    who = "the engine core and every rank" if any(e.role is Role.COORDINATOR for e in read) else "every rank"
    if not any(e.is_rank for e in read):
        who = "the engine core"
    if ev.trigger == Trigger.STALL:
        verb = "idle" if " and " in who else "idles"
        return f": requests wait with no progress while {who} {verb} (waiting for work)"
    return f": {ev.health_url or '/health'} fails while {who} idle (waiting for work)"


@_rule("progressing", kind="progressing",
       when="every rank's step counter advanced during the incident, or (no rank's counter stood still and no "
            "stall opened it) the server's own progress counter on its /metrics advanced",
       concludes="not hung, nobody to blame; the rank entering collectives last is reported as the straggler",
       confidence="high: the ranks' counters moved; medium for the server's counter alone (one counter for the "
                  "whole server)")
def _progressing(ev: Evidence) -> Verdict | None:
    if not ev.ranks or not all(e.advanced for e in ev.ranks):
        return _server_progressing(ev)
    stragglers = late_arrivals(ev.recorders) if ev.complete_fr else []
    if not stragglers:  # no recorder: the stacks of this instant
        waiting = [e.number for e in ev.ranks if e.frame_class is FrameClass.COLLECTIVE]
        stragglers = [e.number for e in ev.ranks if e.frame_class is not FrameClass.COLLECTIVE] if waiting else []
    rate = ", ".join(f"rank {e.rank} +{e.steps_after - e.steps_before}" for e in ev.ranks)  # type: ignore[operator]
    reason = f"progressing: every rank advanced ({rate}); not hung"
    if stragglers and len(stragglers) < len(ev.ranks):
        reason += f"; slowest: {_ranks_text(stragglers)} (enters collectives last; the others wait for it)"
    else:
        stragglers = []
    return _verdict(ev, "progressing", (), reason, "high", hung=False, stragglers=stragglers)


def _server_progressing(ev: Evidence) -> Verdict | None:
    """The server's own counter advanced while the evidence was gathered, and nothing says a rank
    stopped (no stall trigger, no rank's counter standing still)."""
    if ev.server_progress is not True or ev.trigger == Trigger.STALL or any(e.stalled for e in ev.ranks):
        return None
    reason = f"progressing: the server's progress counter advanced ({ev.server_progress_detail}); not hung"
    return _verdict(ev, "progressing", (), reason, "medium", hung=False)


@_rule("rendezvous", kind="rendezvous",
       when="ranks wait in the job's rendezvous (`init_process_group`, the TCPStore) before their first step",
       concludes="the ranks that never arrived: the world's ranks with no process, and live ranks elsewhere",
       confidence="medium: stacks and the world size; low when the world size is unknown and nobody is missing")
def _rendezvous(ev: Evidence) -> Verdict | None:
    waiting = [e for e in ev.ranks if e.alive and e.frame_class is FrameClass.RENDEZVOUS]
    if not waiting or any(e.steps_after for e in ev.ranks):
        return None
    elsewhere, missing = _not_arrived(ev, waiting)
    never = sorted([*elsewhere, *missing], key=lambda e: e.rank)  # type: ignore[arg-type, return-value]
    where = "the rendezvous (init_process_group)"
    world = f"world size {ev.world_size}" if ev.world_size else "world size unknown"
    if not never:
        reason = f"rendezvous: {_ranks_wait(e.rank for e in waiting)} in {where} ({world}); no rank is known missing"  # type: ignore[misc]
        return _verdict(ev, "rendezvous", (), reason, "low")
    reason = (f"rendezvous: {_ranks_text(e.rank for e in never)} never arrived "  # type: ignore[misc]
              f"({_absent_words(missing, elsewhere)}); {_ranks_wait(e.rank for e in waiting)} in {where} ({world})")  # type: ignore[misc]
    return _verdict(ev, "rendezvous", never, reason, "medium")


def _not_arrived(ev: Evidence, waiting: Sequence[RankEvidence]) -> tuple[list[RankEvidence], list[RankEvidence]]:
    """The ranks that never reached the rendezvous: those elsewhere (gone, or their stack read
    elsewhere) and the world's ranks with no process seen."""
    elsewhere = [e for e in ev.ranks if e not in waiting and (not e.alive or e.frame_class is not FrameClass.UNKNOWN)]
    present = {e.rank for e in ev.ranks}
    missing = [_missing_rank(r) for r in range(ev.world_size or 0) if r not in present]
    return elsewhere, missing


def _absent_words(missing: Sequence[RankEvidence], elsewhere: Sequence[RankEvidence]) -> str:
    """Why ranks never arrived at the rendezvous: ``rank 3 never started; rank 2 (pid 9) is
    elsewhere (compute: f (m.py:3))`` (or how it exited)."""
    parts = [f"{_ranks_text(e.rank for e in missing)} never started" if missing else ""]  # type: ignore[misc]
    parts += [f"{e.name} is elsewhere ({e.frame_class.value}: {e.frame})" if e.alive else f"{e.name} {_how_exited(e)}"
              for e in elsewhere]
    return "; ".join(p for p in parts if p)


@_rule("cycle", kind="cycle",
       when="every rank's Flight Recorder was read and ranks wait in collectives of different process groups, each "
            "for a rank waiting in another group (torch's analyzer gives each collective's missing ranks)",
       concludes="the cycle, named: every rank in it (`rank 0 waits in all_reduce #4 of pg 1 for rank 1; ...`)",
       confidence="high when the stacks agree (each rank of the cycle waits in a collective); medium otherwise")
def _cycle(ev: Evidence) -> Verdict | None:
    if not ev.complete_fr:
        return None
    found = find_cycle(ev.recorders)
    if found is None:
        return None
    members = [e for e in ev.ranks if e.rank in found.ranks]
    agree = all(e.frame_class in (FrameClass.COLLECTIVE, FrameClass.UNKNOWN) for e in members) and not any(
        e.advanced for e in members)
    source = "torch flight_recorder missing ranks" if found.by_torch else "Flight Recorder pg_status"
    reason = f"cycle: ordering deadlock across process groups: {found.describe()}"
    return _verdict(ev, "cycle", members, reason, "high" if agree else "medium", extra=[f"cycle from {source}"])


@_rule("behind", kind="behind",
       when="every rank's Flight Recorder was read and, in one group, some ranks never entered the collective "
            "the others wait in",
       concludes="the ranks behind (`behind: rank 1 never entered all_reduce #42 of pg 0; ranks 0,2,3 wait in it`)",
       confidence="high unless a stack or step counter contradicts it (the rank behind waits in a collective or "
                  "advanced, a waiting rank runs its own code): then medium")
def _behind(ev: Evidence) -> Verdict | None:
    if not ev.complete_fr:
        return None
    found = find_behind(ev.recorders)
    if found is None:
        return None
    behind = [e for e in ev.ranks if e.rank in found.behind]
    waiting = [e for e in ev.ranks if e.rank in found.waiting]
    how = "never entered" if found.never_entered else "is behind at"
    reason = (f"behind: {_ranks_text(found.behind)} {how} {found.op} #{found.seq} of {found.pg_text}; "
              f"{_ranks_wait(found.waiting)} in it")
    frames = "; ".join(f"rank {e.rank} in {e.frame}" for e in behind if e.frame)
    if frames:
        reason += f" ({frames})"
    return _verdict(ev, "behind", behind, reason, _recorder_confidence(behind, waiting))


def _p2p_waits(e: RankEvidence) -> str:
    """``rank 0 waits in recv``; ``rank 0 waits in recv from rank 1`` when its Flight Recorder
    names the peer (NCCL's ``nccl:recv 0<-1``; gloo records no P2P op)."""
    found = pending_p2p(e.fr) if e.p2p in ("recv", "send") else None
    if found is None or found[0] != e.p2p:
        return f"{e.name} waits in {e.p2p}"
    return f"{e.name} waits in {e.p2p} {'from' if e.p2p == 'recv' else 'to'} rank {found[1]}"


def _p2p_tail(ops: set[str], two: bool) -> str:
    other = "the other" if two else "a peer"
    if ops == {"recv"}:
        return f"each waits for {other} to send first"
    if ops == {"send"}:
        return f"each waits for {other} to receive first"
    return "no rank's send meets its peer's receive (mismatched peers or order)"


@_rule("p2p_deadlock", kind="deadlock",
       when="every rank of the server has a stack and waits in a point-to-point layer (torch.distributed `send`/"
            "`recv`/`isend`/`irecv` and their `Work.wait`, `batch_isend_irecv`, vLLM's or SGLang's pipeline-parallel "
            "`GroupCoordinator.send_tensor_dict`/`recv_tensor_dict`/`send_object`/`recv_object`), no rank's steps "
            "advanced and no rank of the world is unseen",
       concludes="a P2P ordering deadlock between those ranks, each named with where it waits: `P2P ordering "
                 "deadlock: rank 0 waits in recv, rank 1 waits in recv: each waits for the other to send first` "
                 "(both stages posted their recv first, PyTorch #172668), with the peer when its Flight Recorder "
                 "names it (NCCL's `nccl:recv 0<-1`: `rank 0 waits in recv from rank 1`); none is more to blame",
       confidence="high when every rank waits in the same direction (all recv, or all send), progress is known to "
                  "have stopped (a stall, counters standing still) and no Flight Recorder shows a collective in "
                  "flight; medium otherwise (mixed directions, no progress reading)")
def _p2p_deadlock(ev: Evidence) -> Verdict | None:
    if not _every_rank_in_p2p(ev):
        return None
    if any(e.advanced for e in ev.ranks):
        return None
    ops = {e.p2p for e in ev.ranks}
    reason = (f"P2P ordering deadlock: {', '.join(_p2p_waits(e) for e in ev.ranks)}: "
              f"{_p2p_tail(ops, len(ev.ranks) == 2)}")
    quiet = all(_nothing_in_flight(fr) for fr in ev.recorders.values())
    sure = ops in ({"recv"}, {"send"}) and ev.no_progress and quiet
    return _verdict(ev, "deadlock", list(ev.ranks), reason, "high" if sure else "medium")


def _every_rank_in_p2p(ev: Evidence) -> bool:
    """Two ranks or more, none of the world unseen, each alive and waiting in a P2P op."""
    if len(ev.ranks) < 2 or (ev.world_size is not None and len(ev.ranks) < ev.world_size):
        return False
    return all(e.alive and e.frame_class is FrameClass.COLLECTIVE and e.p2p for e in ev.ranks)


@_rule("stacks_behind", kind="behind",
       when="no Flight Recorder decides; some ranks wait in a collective (torch.distributed or a serving "
            "framework's communication layer: a P2P send/recv, DeepEP's dispatch/combine, pynccl, a custom "
            "all-reduce) and others do not",
       concludes="the ranks outside the collective (`behind: rank 1 not in a collective (...); rank 0 waits in one`)",
       confidence="medium: the stacks of one instant")
def _stacks_behind(ev: Evidence) -> Verdict | None:
    known = [e for e in ev.ranks if e.alive and e.frame_class is not FrameClass.UNKNOWN]
    waiting = [e.rank for e in known if e.frame_class is FrameClass.COLLECTIVE]
    outside = [e for e in known if e.frame_class in (FrameClass.COMPUTE, FrameClass.RENDEZVOUS)]
    if not waiting or not outside:
        return None
    frames = "; ".join(f"rank {e.rank} in {e.frame_class.value}: {e.frame}" for e in outside)
    p2p = [e.p2p for e in known if e.frame_class is FrameClass.COLLECTIVE]
    # a pipeline stage waiting in recv for the stage that hangs: the wait is named
    where = f"a P2P {'/'.join(sorted(set(p2p)))} for it" if all(p2p) else "one"
    reason = (f"behind: {_ranks_text(e.rank for e in outside)} not in a collective ({frames}); "  # type: ignore[misc]
              f"{_ranks_wait(waiting)} in {where}")  # type: ignore[arg-type]
    return _verdict(ev, "behind", outside, reason, "medium")


@_rule("stacks_behind_by_pid", kind="behind",
       when="no process is known as a rank (its title, environment, SDK counter and Flight Recorder name none: "
            "vLLM on Ray titles every worker `ray::RayWorkerWrapper`); processes of one title wait in a collective "
            "and others of that title do not",
       concludes="the processes outside the collective, by pid (`behind: pid 42 'ray::RayWorkerWrapper' not in a "
                 "collective (...); pids 41, 43 wait in one`)",
       confidence="low: the stacks of one instant, and which processes are one job is read off their shared title")
def _stacks_behind_by_pid(ev: Evidence) -> Verdict | None:
    if ev.ranks:
        return None
    known = [e for e in ev.others if e.role is Role.PROCESS and e.alive and e.frame_class is not FrameClass.UNKNOWN]
    waiting = [e for e in known if e.frame_class is FrameClass.COLLECTIVE]
    titles = {e.title for e in waiting if e.title}
    outside = [e for e in known if e.frame_class in (FrameClass.COMPUTE, FrameClass.RENDEZVOUS) and e.title in titles]
    if not waiting or not outside:
        return None
    return _verdict(ev, "behind", outside, _behind_by_pid_reason(outside, waiting), "low")


def _behind_by_pid_reason(outside: Sequence[RankEvidence], waiting: Sequence[RankEvidence]) -> str:
    """The ``stacks_behind_by_pid`` reason: the processes ``outside`` the collective the others wait in."""
    frames = "; ".join((f"pid {e.pid} " if len(outside) > 1 else "") + f"in {e.frame_class.value}: {e.frame}"
                       for e in outside)
    p2p = [e.p2p for e in waiting]
    where = f"a P2P {'/'.join(sorted(set(p2p)))} for it" if all(p2p) else "one"
    pids = ", ".join(str(e.pid) for e in waiting)
    return (f"behind: {', '.join(e.name for e in outside)} not in a collective ({frames}); "
            f"pid{'s' if len(waiting) > 1 else ''} {pids} {'wait' if len(waiting) > 1 else 'waits'} in {where} "
            "(no process's rank could be read: named by pid)")


@_rule("coordinator_waits", kind="behind",
       when="no rank's stack was read, and a coordinator (VLLM::EngineCore, a DP controller) is blocked waiting on "
            "its workers",
       concludes="the workers it waits on",
       confidence="low: one process's stack points at others")
def _coordinator_waits(ev: Evidence) -> Verdict | None:
    if any(e.frame_class is not FrameClass.UNKNOWN for e in ev.ranks):
        return None
    waiters = [e for e in ev.others if e.waits_on]
    if not waiters:
        return None
    pids = {p for w in waiters for p in w.waits_on}
    named = [e for e in ev.processes if e.pid in pids] or [RankEvidence(pid=p, role=Role.PROCESS) for p in sorted(pids)]
    frames = "; ".join(f"{w.name} in {w.frame}" for w in waiters)
    reason = f"behind: {_names(waiters)} waits on {_names(named)} ({frames})"
    return _verdict(ev, "behind", named, reason, "low")


def _stuck_coordinators(ev: Evidence) -> list[RankEvidence]:
    """Live coordinators running their own code: not idle, not waiting on their workers, their
    own step counter (when counted) not advancing."""
    return [e for e in ev.others if e.role is Role.COORDINATOR and e.alive and e.frame_class is FrameClass.COMPUTE
            and not e.waits_on and not e.advanced]


def _coordinator_words(e: RankEvidence) -> str:
    """``the engine core`` for vLLM's EngineCore, else ``the coordinator``."""
    return "the engine core" if "enginecore" in e.title.lower().replace("_", "") else "the coordinator"


@_rule("coordinator_stuck", kind="coordinator",
       when="every rank waits for work (idle, none in a collective or its own code) while a coordinator "
            "(VLLM::EngineCore, a DP controller) runs its own code (not idle, not waiting on its workers), and "
            "work is pending (a stall while busy, pending requests)",
       concludes="the coordinator is the culprit, named with its frame: `the engine core pid 42 'VLLM::EngineCore' "
                 "is stuck in step (vllm/v1/engine/core.py:300) while every rank idles (waiting for work)`",
       confidence="high for one coordinator when no progress agrees with its stack (a stall, its own step counter or "
                  "the server's standing still); medium from stacks and pending work alone")
def _coordinator_stuck(ev: Evidence) -> Verdict | None:
    if not ev.ranks or ev.work_pending is not True:
        return None
    if any(not e.alive or e.frame_class is not FrameClass.IDLE or e.advanced for e in ev.ranks):
        return None
    stuck = _stuck_coordinators(ev)
    if not stuck:
        return None
    parts = [f"{_coordinator_words(e)} {e.name} is stuck in " + (e.frame or "its own code") for e in stuck]
    where = "; ".join(f"rank {e.rank} in {e.frame}" if e.frame else f"rank {e.rank}" for e in ev.ranks)
    reason = "; ".join(parts) + f" while every rank idles (waiting for work): {where}"
    return _verdict(ev, "coordinator", stuck, reason, "high" if _coordinator_sure(ev, stuck) else "medium")


def _coordinator_sure(ev: Evidence, stuck: Sequence[RankEvidence]) -> bool:
    """One coordinator stuck, and no progress agrees with its stack (a stall, its own step counter
    or the server's standing still)."""
    agree = ev.trigger == Trigger.STALL or ev.server_progress is False or stuck[0].stalled is True
    return len(stuck) == 1 and agree and ev.server_progress is not True


def _waiting_processes(ev: Evidence) -> list[RankEvidence]:
    return [e for e in ev.processes if e.alive and e.frame_class is not FrameClass.UNKNOWN]


@_rule("ipc_wait_alone", kind="unknown",
       when="the one process with a stack is a rank that waits for a message (ZeroMQ, a pipe, a queue) while work "
            "is pending, and no other process of its server was captured",
       concludes="nobody: the process that should send the message (a tokenizer, detokenizer, API server?) is not "
                 "watched; said with where the rank waits",
       confidence="low: one side of an exchange; its other side was never seen")
def _ipc_wait_alone(ev: Evidence) -> Verdict | None:
    known = _waiting_processes(ev)
    if len(known) != 1 or not ev.ranks or ev.work_pending is not True or known[0].frame_class is not FrameClass.IDLE:
        return None
    e = known[0]
    reason = (f"{_culprit_name(e)} waits for a message while work is pending (in {e.frame}) and no other process of"
              " its server was captured: the one that should send it (a tokenizer, detokenizer or API server?)"
              " is not watched")
    return _verdict(ev, "unknown", (), reason, "low")


@_rule("ipc_deadlock", kind="deadlock",
       when="every process with a stack waits for a message (ZeroMQ, a pipe, a queue, a message queue) while "
            "work is pending (a stall while busy, pending requests)",
       concludes="a deadlock between those processes, named with where each waits; none is more to blame",
       confidence="medium: stacks and the pending work agree, but which message was lost is not known")
def _ipc_deadlock(ev: Evidence) -> Verdict | None:
    known = _waiting_processes(ev)
    if not known or ev.work_pending is not True or any(e.frame_class is not FrameClass.IDLE for e in known):
        return None
    if len(known) < 2:  # one side of an exchange is no deadlock (:func:`_ipc_wait_alone`)
        return None
    where = "; ".join(f"{e.name} in {e.frame}" for e in known)
    between = " and ".join(_culprit_name(e) for e in known)
    reason = f"deadlock between {between}: each waits for a message while work is pending ({where})"
    return _verdict(ev, "deadlock", known, reason, "medium")


@_rule("idle", kind="idle",
       when="every process with a stack waits for work, and no work is known to be pending",
       concludes="nobody: the server is idle (`all idle (waiting for work): nothing is stuck`)",
       confidence="high when no work was pending; low when nothing tells whether work was pending")
def _idle(ev: Evidence) -> Verdict | None:
    known = _waiting_processes(ev)
    if not known or any(e.frame_class is not FrameClass.IDLE for e in known) or ev.work_pending:
        return None
    note = "" if ev.work_pending is False else " (no reading of pending work)"
    reason = f"all idle (waiting for work): nothing is stuck{note}"
    return _verdict(ev, "idle", (), reason, "high" if ev.work_pending is False else "low", hung=False)


#: The compute verdict's words when nothing tells a hang from work (:attr:`Evidence.progress_known`).
NO_PROGRESS_SOURCE = ("one snapshot without a progress source cannot tell a hang from work (give `dump` the "
                      "server's /metrics with --metrics-url, or watch it with `servewatch run`)")


@_rule("compute", kind="compute",
       when="no rank waits in a collective and every rank runs its own code",
       concludes="the rank(s) whose steps stopped while the others advanced, or the only rank (TP=1); nobody when "
                 "all stopped alike (`all ranks in compute: no collective wait`), and nobody when nothing tells a "
                 "hang from work (a one-shot dump with no step counter, no /metrics reading and no stall trigger: "
                 "`...; one snapshot without a progress source cannot tell a hang from work`, not hung)",
       confidence="high for the only rank when its stopped step counter (or a start-up stall: no first step within "
                  "the start-up budget) agrees with its stack; medium otherwise; "
                  "low without a progress source")
def _compute(ev: Evidence) -> Verdict | None:
    known = [e for e in ev.ranks if e.frame_class is not FrameClass.UNKNOWN]
    if not known or len(known) != len(ev.ranks) or any(e.frame_class is not FrameClass.COMPUTE for e in known):
        return None
    if not ev.progress_known:  # busy and hung look the same in one snapshot: blame nobody
        return _compute_unknown(ev)
    stalled, confidence = _compute_culprits(ev)
    reason = "all ranks in compute: no collective wait"
    if stalled:
        frames = "; ".join(f"rank {e.rank} in {e.frame}" for e in stalled if e.frame)
        reason += f"; {_ranks_text(e.rank for e in stalled)} stuck" + (f" ({frames})" if frames else "")  # type: ignore[misc]
    return _verdict(ev, "compute", stalled, reason, confidence)


def _compute_unknown(ev: Evidence) -> Verdict:
    """The ``compute`` verdict when nothing tells a hang from work: nobody, not hung."""
    frames = "; ".join(f"rank {e.rank} in {e.frame}" for e in ev.ranks if e.frame)
    # the user gave a /metrics that could not be read: say that, never advise giving one
    unread = (f"one snapshot cannot tell a hang from work ({ev.server_progress_detail})"
              if ev.server_progress_detail else NO_PROGRESS_SOURCE)
    reason = ("all ranks in compute: no collective wait" + (f" ({frames})" if frames else "") + f"; {unread}")
    return _verdict(ev, "compute", (), reason, "low", hung=False)


def _compute_culprits(ev: Evidence) -> tuple[list[RankEvidence], str]:
    """The ``compute`` verdict's culprits and confidence: the ranks whose steps stopped while others
    advanced, or the only rank."""
    stalled = [e for e in ev.ranks if e.stalled]
    confidence = "medium"
    if len(ev.ranks) == 1:  # the only rank is stuck in its own code: it is the culprit
        # its step counter stood still, or it took no first step within the start-up budget
        agree = bool(stalled) or ev.trigger == STARTUP_STALL
        confidence = "high" if agree and ev.server_progress is not True else "medium"
        stalled = list(ev.ranks)
    elif len(stalled) == len(ev.ranks):
        stalled = []  # every rank stopped in compute: nothing tells one apart
    return stalled, confidence


@_rule("inconclusive", kind="unknown", when="no rule above applies",
       concludes="nobody; says what was read (`no conclusive evidence (no Flight Recorder and no stacks)`)",
       confidence="low")
def _inconclusive(ev: Evidence) -> Verdict:
    known = [e for e in ev.ranks if e.frame_class is not FrameClass.UNKNOWN]
    if known and not any(e.frame_class is FrameClass.COLLECTIVE for e in known):
        words = ", ".join(f"rank {e.rank} {e.frame_class.value}" for e in known)
        return _verdict(ev, "unknown", (), f"no collective wait ({words})", "low")
    if ev.complete_fr and known and all(e.frame_class is FrameClass.COLLECTIVE for e in ev.ranks):
        return _verdict(ev, "unknown", (), "every rank entered the same collective and waits in it "
                        "(communication layer?)", "low")
    reason = f"no conclusive evidence ({_what_was_read(ev, known)})"
    if not known:  # why no stack was read, when it was said (py-spy denied: run as root)
        notes = dict.fromkeys(e.stack_note for e in ev.processes if e.stack_note)
        reason += "".join(f"; {note}" for note in notes)
    return _verdict(ev, "unknown", (), reason, "low")


def _what_was_read(ev: Evidence, known: Sequence[RankEvidence]) -> str:
    """What the inconclusive verdict had: ``no Flight Recorder`` only when no rank's record was read."""
    if not any(isinstance(e.fr, Mapping) for e in ev.ranks):
        fr_text = "no Flight Recorder"
    elif not ev.recorders:
        fr_text = "Flight Recorder empty"
    elif not ev.complete_fr:
        fr_text = f"Flight Recorder of {_ranks_text(sorted(ev.recorders))} only"
    else:
        fr_text = "the Flight Recorders show no rank behind and no mismatch"
    if not known:
        stacked = [e for e in ev.processes if e.frame_class is not FrameClass.UNKNOWN]
        if not ev.ranks and stacked:  # stacks were read, of processes that are no job's ranks
            return f"{fr_text}; {len(ev.processes)} processes, none a rank of a distributed job"
        return f"{fr_text} and no stacks"
    return f"{fr_text}; stacks: " + ", ".join(f"rank {e.rank} {e.frame_class.value}" for e in known)


# --- the next step ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NextStep:
    """The ``next:`` line of one verdict kind: what to run or check next.

    Attributes:
        kind: the verdict kind (a :class:`Rule`'s ``kind``).
        doc: the line in general, with placeholders (``py-spy dump --native --pid <culprit pid>``),
            for the docs' tables (README's kind table, ``docs/verdict-rules.md``).
        build: the line for one verdict, from its own fields (pids, ranks, reason, evidence lines)
            and, when given, the :class:`Evidence` it was made from (exit facts, the health URL);
            one line, never empty.
    """

    kind: str
    doc: str
    build: Callable[[Verdict, Evidence | None], str]


#: The next step of each verdict kind (every kind of :data:`RULES` has one; a test keeps it so).
NEXT_STEPS: dict[str, NextStep] = {}


def _next(kind: str, doc: str) -> Callable[[Callable[[Verdict, Evidence | None], str]],
                                           Callable[[Verdict, Evidence | None], str]]:
    """Register the next step of ``kind`` in :data:`NEXT_STEPS`."""

    def register(build: Callable[[Verdict, Evidence | None], str]) -> Callable[[Verdict, Evidence | None], str]:
        NEXT_STEPS[kind] = NextStep(kind=kind, doc=doc, build=build)
        return build

    return register


_PID_WORDS = re.compile(r"\bpid (\d+)")
_RANK_PID_WORDS = re.compile(r"^rank (\d+) pid (\d+)")
#: A title's parallel coordinates (``_TP0``, ``_DP1_TP0``): dropped to match every rank by title.
_COORDINATES = re.compile(r"(?:[_-]?(?:DP|TP|PP|EP|CP)\d+)+$")
#: How :func:`_how_exited` words a death, read back from a verdict's reason (an older bundle).
_EXIT_WORDS = re.compile(r"was killed by the OOM killer|exited with exit code (-?\d+)|exited with (SIG\w+|signal \d+)"
                         r"|exit status unknown")


def _sudo(v: Verdict) -> str:
    """``sudo `` when py-spy was denied reading a stack (the verdict's words say so), else ``""``."""
    return "sudo " if any("py-spy was denied" in line for line in (v.reason, *v.evidence)) else ""


def _live_pids(v: Verdict, ev: Evidence | None) -> list[int]:
    """Every live process of the verdict, ranks first: the evidence's, else read off its lines."""
    if ev is not None:
        return [e.pid for e in ev.processes if e.pid and e.alive]
    found = [int(m.group(1)) for line in v.evidence if "gone (" not in line and (m := _PID_WORDS.search(line))]
    if not found and v.kind == "single" and (m := _PID_WORDS.search(v.reason)):
        found = [int(m.group(1))]
    return list(dict.fromkeys(found))


def _pid_of_rank(v: Verdict, ev: Evidence | None, rank: int) -> int | None:
    if ev is not None:
        e = ev.rank(rank)
        return e.pid if e is not None else None
    for line in v.evidence:
        m = _RANK_PID_WORDS.match(line)
        if m and int(m.group(1)) == rank:
            return int(m.group(2))
    return None


def _title_glob(titles: Iterable[str]) -> str:
    """One ``--match`` glob for every title (``sglang::scheduler_TP0`` -> ``sglang::scheduler*``), ``""``
    when they do not share one."""
    globs = {(_COORDINATES.sub("", t) or t) + "*" for t in titles if t}
    return next(iter(globs)) if len(globs) == 1 else ""


def _fresh_stacks(v: Verdict, ev: Evidence | None) -> str:
    """``servewatch dump --pid 41 --pid 42``: fresh stacks of every live process (by their shared
    title glob when no pid is known or more than four; ``servewatch status`` when neither is)."""
    pids = _live_pids(v, ev)
    glob = _title_glob(e.title for e in ev.processes if e.alive) if ev is not None else ""
    if glob and (not pids or len(pids) > 4):
        return f"{_sudo(v)}servewatch dump --match '{glob}'"
    if not pids:
        return "servewatch status (which processes it watches), then servewatch dump --match '<rank titles>'"
    return f"{_sudo(v)}servewatch dump " + " ".join(f"--pid {p}" for p in pids)


def _native(v: Verdict, ev: Evidence | None, why: str) -> str:
    """``py-spy dump --native --pid 42 (why)`` for the first culprit (a culprit rank's pid read off
    the evidence lines when the verdict lists none); its launcher's log when the evidence shows it
    has no process; ``""`` when nothing names one."""
    pid = v.culprit_pids[0] if v.culprit_pids else (
        _pid_of_rank(v, ev, v.culprit_ranks[0]) if v.culprit_ranks else None)
    if pid:
        return f"{_sudo(v)}py-spy dump --native --pid {pid} ({why})"
    if v.culprit_ranks and ev is not None:
        return f"rank {v.culprit_ranks[0]} has no process: its launcher's log says why it never started"
    return ""


def _culprit_exit(v: Verdict, ev: Evidence | None) -> tuple[str, str]:
    """How the first culprit ended: ``("oom", "")``, ``("signal", "SIGSEGV")``, ``("code", "1")`` or
    ``("unknown", "")``; from its exit fact, else from the reason's words."""
    e = next((p for p in ev.processes if v.culprit_pids and p.pid == v.culprit_pids[0]), None) if ev else None
    fact = fact_of(e) if e is not None else None
    if fact is not None:
        if fact.oom:
            return "oom", ""
        if fact.signal is not None:
            return "signal", fact.signal_name
        return ("code", str(fact.exit_code)) if fact.exit_code is not None else ("unknown", "")
    m = _EXIT_WORDS.search(v.reason)
    if m is None or m.group(0) == "exit status unknown":
        return "unknown", ""
    if m.group(1) is not None:
        return "code", m.group(1)
    return ("signal", m.group(2)) if m.group(2) is not None else ("oom", "")


def _death_step(pid: int | None, how: str, detail: str) -> str:
    who = f"pid {pid}" if pid else "it"
    if how == "oom" or (how == "signal" and detail == "SIGKILL"):
        return f"dmesg -T | grep -i -e oom -e killed (the kernel's record of who killed {who})"
    if how == "signal":
        return (f"coredumpctl info {pid} (the native backtrace of its {detail}; a CUDA coredump is in the bundle "
                "when armed)" if pid else f"its core file: the native backtrace of its {detail}")
    if how == "code":
        where = f"{who}'s log (stderr, or journalctl _PID={pid})" if pid else "its log (stderr)"
        return f"the last lines of {where}: the error before exit code {detail}"
    return f"dmesg -T | grep -i -e oom -e killed (its exit status is unknown: did the kernel kill {who}?)"


def _health_step(ev: Evidence | None) -> str:
    return f"curl -sS -m 10 -i {ev.health_url}" if ev is not None and ev.health_url else ""


@_next("dead", "by how it ended: `dmesg -T | grep -i -e oom -e killed` (OOM, SIGKILL); `coredumpctl info <pid>` "
       "(a crash signal); its log's last lines (an exit code)")
def _next_dead(v: Verdict, ev: Evidence | None) -> str:
    how, detail = _culprit_exit(v, ev)
    if v.rule == "server_exited" and how == "code":  # before any rank: its own words say why
        return (f"the end of the server's own output (its stderr; under servewatch launch, just above): the error "
                f"before exit code {detail}")
    return _death_step(v.culprit_pids[0] if v.culprit_pids else None, how, detail)


@_next("orphaned", "`kill <pids>` (they hold the server's memory: a restart beside them can run out of memory), "
       "then restart the server")
def _next_orphaned(v: Verdict, ev: Evidence | None) -> str:
    pids = list(v.culprit_pids) or _live_pids(v, ev)
    if not pids:
        return "servewatch status (which of the server's processes are still alive), then restart the server"
    return (f"kill {' '.join(map(str, pids))} (they hold the server's memory: a restart beside them can run out of "
            "memory), then restart the server")


@_next("cascade", "`py-spy dump --native --pid <culprit pid>`: the kernel, lock or loop the live rank sits in")
def _next_cascade(v: Verdict, ev: Evidence | None) -> str:
    return _native(v, ev, "the kernel, lock or loop it sits in; the exits followed it") or _fresh_stacks(v, ev)


_STOP_WORDS = re.compile(r"terminated by (SIG\w+)")


@_next("stopped", "nothing to fix if the stop was planned; else who sent the signal: `journalctl -S -15min`")
def _next_stopped(v: Verdict, ev: Evidence | None) -> str:
    m = _STOP_WORDS.search(v.reason)
    if m is None:
        return "nothing to fix: it exited in order (exit code 0); start it again if it should still run"
    return (f"nothing to fix if the stop was planned; else who sent {m.group(1)}: journalctl -S -15min "
            "(or the orchestrator's events)")


@_next("suspended", "`grep TracerPid /proc/<pid>/status` (a debugger?), else `kill -CONT <pid>`")
def _next_suspended(v: Verdict, ev: Evidence | None) -> str:
    pids = list(v.culprit_pids) or _live_pids(v, ev)[:1]
    if not pids:
        return "kill -CONT <pid> of the stopped process"
    return f"grep TracerPid /proc/{pids[0]}/status (a debugger attached?), else kill -CONT {' '.join(map(str, pids))}"


@_next("uninterruptible", "`cat /proc/<pid>/stack` (where in the kernel it waits, as root), then the filesystem "
       "behind its open files: `ls -l /proc/<pid>/fd`, `df -h` on those paths (NFS: `dmesg -T | grep -i nfs`)")
def _next_uninterruptible(v: Verdict, ev: Evidence | None) -> str:
    pids = list(v.culprit_pids) or _live_pids(v, ev)[:1]
    pid = str(pids[0]) if pids else "<pid>"
    return (f"cat /proc/{pid}/stack (where in the kernel it waits, as root), then ls -l /proc/{pid}/fd and df -h on "
            "those paths: which filesystem or device hangs (NFS: dmesg -T | grep -i nfs)")


_AT_SEQ = re.compile(r"at #(\d+) of (.+?) \(")


@_next("desync", "compare the odd rank's Flight Recorder entry with a peer's at that sequence id "
       "(`flightrec-rank<r>-<pid>.json` in the bundle): which call site issued it")
def _next_desync(v: Verdict, ev: Evidence | None) -> str:
    m = _AT_SEQ.search(v.reason)
    where = f"entry #{m.group(1)} of {m.group(2)}" if m else "the mismatched entry"
    odd = v.culprit_ranks[0] if v.culprit_ranks else None
    peer = next((r for r in v.ranks if r not in v.culprit_ranks), None)

    def file(r: int | None) -> str:
        pid = _pid_of_rank(v, ev, r) if r is not None else None
        return f"flightrec-rank{'*' if r is None else r}-{pid or '*'}.json"

    if odd is None:
        return f"compare {where} across the ranks' flightrec-rank*.json (the bundle): which rank's differs"
    return f"compare {where} in {file(odd)} and {file(peer)} (the bundle): which code issued rank {odd}'s op"


@_next("progressing", "not hung: `py-spy top --pid <slowest rank's pid>`; with none slower, nothing to fix "
       "(raise `--watchdog-timeout` if slow steps are normal)")
def _next_progressing(v: Verdict, ev: Evidence | None) -> str:
    health = _health_step(ev)
    if health:
        return f"{health} (the ranks progress: does the frontend answer?)"
    slow = next((p for r in v.stragglers if (p := _pid_of_rank(v, ev, r))), None)
    if slow:
        return f"{_sudo(v)}py-spy top --pid {slow} (rank {v.stragglers[0]} is slowest: where its time goes)"
    return "nothing to fix (slow, not hung); raise --watchdog-timeout if such slow steps are normal"


@_next("rendezvous", "`py-spy dump --pid <pid>` of a rank elsewhere; for a rank that never started, its "
       "launcher's log and MASTER_ADDR:MASTER_PORT")
def _next_rendezvous(v: Verdict, ev: Evidence | None) -> str:
    if v.culprit_pids:
        return f"{_sudo(v)}py-spy dump --pid {v.culprit_pids[0]} (it is not in the rendezvous: where is it?)"
    if v.culprit_ranks:
        return (f"{_ranks_text(v.culprit_ranks)} never started: its launcher's log, and whether its host reaches "
                "MASTER_ADDR:MASTER_PORT")
    return f"{_fresh_stacks(v, ev)} in a minute: do they still wait in init_process_group?"


@_next("cycle", "`py-spy dump --pid <pid>` of two ranks of the cycle: each one's call site; every rank must "
       "enter the groups in one order")
def _next_cycle(v: Verdict, ev: Evidence | None) -> str:
    pids = list(v.culprit_pids[:2])
    if len(pids) < 2:
        return f"{_fresh_stacks(v, ev)}: each rank's call site; every rank must enter the groups in one order"
    return (f"{_sudo(v)}py-spy dump --pid {pids[0]}; py-spy dump --pid {pids[1]} (each call site: every rank must "
            "enter the groups in one order)")


@_next("behind", "`py-spy dump --native --pid <culprit pid>`: what the rank does instead of the collective")
def _next_behind(v: Verdict, ev: Evidence | None) -> str:
    return _native(v, ev, "what it does instead of the collective") or _fresh_stacks(v, ev)


@_next("livelock", "`py-spy dump --pid <engine core pid>` (its preempt/resume loop), then lower the engine's concurrency "
       "or give it more KV cache (`--max-num-seqs`, `--gpu-memory-utilization`)")
def _next_livelock(v: Verdict, ev: Evidence | None) -> str:
    fix = ("lower the engine's concurrency or give it more KV cache (vLLM: --max-num-seqs, --gpu-memory-utilization)"
           " and watch vllm:num_preemptions_total stay flat while vllm:generation_tokens_total rises")
    pids = list(v.culprit_pids)
    return f"{_sudo(v)}py-spy dump --pid {pids[0]} (its scheduler's preempt/resume loop); then {fix}" if pids else fix


@_next("request", "`py-spy dump --native --pid <pid>`: what the thread holding the request runs (a structured-output "
       "grammar compile: cancel the request and bound the compile)")
def _next_request(v: Verdict, ev: Evidence | None) -> str:
    pids = list(v.culprit_pids) or _live_pids(v, ev)
    if not pids:
        return _fresh_stacks(v, ev)
    return (f"{_sudo(v)}py-spy dump --native --pid {pids[0]}: what the thread holding the request runs"
            " (a structured-output grammar compile: cancel the request and bound the compile); the server is not hung")


@_next("coordinator", "`py-spy dump --native --pid <coordinator pid>`: what its own loop is stuck in (its workers "
       "wait for work)")
def _next_coordinator(v: Verdict, ev: Evidence | None) -> str:
    culprit = next((e for e in ev.processes if e.pid in v.culprit_pids), None) if ev is not None else None
    if culprit is not None:
        who = _coordinator_words(culprit) + "'s"
    else:  # rebuilt from a manifest without its evidence: the reason's own words
        who = "the engine core's" if "the engine core " in v.reason else "the coordinator's"
    return _native(v, ev, f"what {who} own loop is stuck in; its workers wait for work") or _fresh_stacks(v, ev)


@_next("frontend", "`py-spy dump --pid <frontend pid>`: the synchronous call its event loop runs (vLLM PR #38157 "
       "moves chat-template rendering off it); a spinning or stuck detokenizer: `py-spy top --pid <pid>` (where it "
       "spins)")
def _next_frontend(v: Verdict, ev: Evidence | None) -> str:
    pid = v.culprit_pids[0] if v.culprit_pids else None
    if pid is None:
        return _fresh_stacks(v, ev)
    if " spins in " in v.reason:
        return f"{_sudo(v)}py-spy top --pid {pid} (where it spins while the ranks generate; its answers never leave)"
    if "'s event loop is blocked in " not in v.reason:
        return f"{_sudo(v)}py-spy top --pid {pid} (where it is stuck while the ranks idle; its answers never leave)"
    return (f"{_sudo(v)}py-spy dump --pid {pid} (the synchronous call that holds its event loop: run it off the loop, "
            "as vLLM PR #38157 does for chat templates)")


@_next("deadlock", "`py-spy dump --locals --pid <pid>` of each: the queue or socket it waits on; a P2P deadlock: "
       "`py-spy dump --pid <pid>` of two ranks: each one's send/recv call site")
def _next_deadlock(v: Verdict, ev: Evidence | None) -> str:
    pids = list(v.culprit_pids) or _live_pids(v, ev)
    if not pids:
        return _fresh_stacks(v, ev)
    if v.rule == "p2p_deadlock" or v.reason.startswith("P2P "):  # the call sites tell the order, no locals needed
        then = f"; py-spy dump --pid {pids[1]}" if len(pids) > 1 else ""
        return (f"{_sudo(v)}py-spy dump --pid {pids[0]}{then} (each one's send/recv call site: one stage must "
                "send before it receives)")
    then = f"; then pid {', '.join(map(str, pids[1:3]))}" if len(pids) > 1 else ""
    return f"{_sudo(v)}py-spy dump --locals --pid {pids[0]} (the queue or socket it waits on{then})"


@_next("idle", "nothing is stuck: `curl -sS -m 10 -i <health url>` when /health failed; else the frontend "
       "and the client")
def _next_idle(v: Verdict, ev: Evidence | None) -> str:
    health = _health_step(ev)
    if health:
        return f"{health} (the ranks wait for work: does the frontend answer?)"
    return "nothing is stuck; if clients still wait, the frontend and the client (no work reached the ranks)"


_URL = re.compile(r"https?://\S+")


@_next("compute", "`py-spy dump --native --pid <culprit pid>`; every rank alike: `nvidia-smi`; no progress "
       "source: `servewatch dump --metrics-url <server>/metrics`")
def _next_compute(v: Verdict, ev: Evidence | None) -> str:
    if not v.hung:  # nothing told a hang from work
        m = _URL.search(v.reason)
        if m:
            return f"curl -sS -m 10 {m.group(0).rstrip(',;:)')} (why the progress counter gave no reading)"
        dump = _fresh_stacks(v, ev)
        if dump.startswith(("servewatch dump", "sudo servewatch dump")):
            return f"{dump} --metrics-url http://HOST:PORT/metrics (tells a hang from work)"
        return dump
    if v.culprit_pids or v.culprit_ranks:
        return _native(v, ev, "the kernel, lock or loop it sits in") or _fresh_stacks(v, ev)
    first = _live_pids(v, ev)[:1]
    then = f", then {_sudo(v)}py-spy dump --native --pid {first[0]}" if first else ""
    return f"nvidia-smi (every rank stuck alike in compute: a GPU hang, an Xid?){then}"


_SINGLE_PID = re.compile(r"^1 process \(pid (\d+)\)")


@_next("single", "`py-spy dump --native --pid <pid>` (where it is); an exit: as for `dead`")
def _next_single(v: Verdict, ev: Evidence | None) -> str:
    m = _SINGLE_PID.match(v.reason)
    pid = int(m.group(1)) if m else None
    how, detail = _culprit_exit(replace(v, culprit_pids=(pid,) if pid else ()), ev)
    if "terminated by" in v.reason:
        return "nothing to fix if the stop was planned; else who sent it: journalctl -S -15min"
    if how != "unknown" or "exited" in v.reason:
        return _death_step(pid, how, detail)
    if "idle (waiting for work)" in v.reason or ": progressing)" in v.reason:
        return _health_step(ev) or "nothing is stuck; if clients still wait, the frontend and the client"
    if pid is None:
        return _fresh_stacks(v, ev)
    return f"{_sudo(v)}py-spy dump --native --pid {pid} (where it is, native frames included)"


@_next("unknown", "`servewatch dump --pid <pid> ...` for fresh stacks (`sudo` when py-spy was denied); no "
       "process: `servewatch status`; one rank waiting for a message no watched process sends: "
       "`servewatch dump --root-pid <its parent>`")
def _next_unknown(v: Verdict, ev: Evidence | None) -> str:
    if v.rule == "no_process" or (ev is not None and not ev.processes):
        return "servewatch status (which processes it watches: check --match, --pid, --root-pid)"
    if v.rule == "ipc_wait_alone" and (pids := _live_pids(v, ev)):
        return (f"{_sudo(v)}servewatch dump --root-pid $(ps -o ppid= -p {pids[0]}) (every process of its server:"
                " which one should have sent the message)")
    if "communication layer?" in v.reason:
        first = _live_pids(v, ev)[:1]
        if first:
            return f"{_sudo(v)}py-spy dump --native --pid {first[0]} (where inside the collective: NCCL, a custom all-reduce?)"
    why = "as root: py-spy was denied" if _sudo(v) else "fresh stacks"
    return f"{_fresh_stacks(v, ev)} ({why})"


def next_step(verdict: Verdict, ev: Evidence | None = None) -> str:
    """The verdict's ``next:`` line (:data:`NEXT_STEPS`): one command or check, with its real pids.

    Args:
        verdict: the verdict (its ``rule`` set, as :func:`judge` sets it).
        ev: the evidence it was made from; ``None`` for a verdict read back from a manifest (its
            pids and exit then come from its own lines). Evidence without pids (a job's, whose
            ranks are on several hosts) gives lines by title (``--match``), never by pid.

    Returns:
        One line; ``""`` only for a kind this servewatch does not know (a newer agent's).
    """
    step = NEXT_STEPS.get(verdict.kind)
    return step.build(verdict, ev) if step is not None else ""


def next_step_of(data: Mapping[str, Any]) -> str:
    """The ``next:`` line of a verdict as a manifest holds it (:meth:`Verdict.to_json`): its own
    ``next``, else (a bundle written before it existed) built from its kind, culprits, reason and
    evidence lines; ``""`` for an unknown kind or a malformed dict. Never raises."""
    given = data.get("next")
    if isinstance(given, str) and given:
        return given
    try:
        return next_step(_verdict_of(data))
    except (TypeError, ValueError):
        return ""


def _verdict_of(data: Mapping[str, Any]) -> Verdict:
    """A verdict as a manifest holds it (:meth:`Verdict.to_json`), back; raises TypeError or
    ValueError for a malformed one."""
    return Verdict(kind=str(data.get("kind") or "unknown"), hung=bool(data.get("hung", True)),
                   culprit_ranks=tuple(int(r) for r in data.get("culprit_ranks") or ()),
                   culprit_pids=tuple(int(p) for p in data.get("culprit_pids") or ()),
                   reason=str(data.get("reason") or ""), confidence=str(data.get("confidence") or ""),
                   evidence=tuple(str(e) for e in data.get("evidence") or ()),
                   stragglers=tuple(int(r) for r in data.get("stragglers") or ()),
                   ranks=tuple(int(r) for r in data.get("ranks") or ()), rule=str(data.get("rule") or ""))


# --- entry points --------------------------------------------------------------------------------


def judge(ev: Evidence) -> Verdict:
    """The verdict of one server's evidence: the first rule of :data:`RULES` that applies."""
    for rule in RULES:
        found = rule.check(ev)
        if found is not None:
            found = replace(found, rule=rule.name)
            return replace(found, next_step=next_step(found, ev))
    raise AssertionError("the last rule always applies")  # pragma: no cover


def decide(evidence: Sequence[RankEvidence] | Evidence, *, trigger: str = "", work_pending: bool | None = None,
           world_size: int | None = None) -> Verdict:
    """The verdict for one server's incident (rules in :data:`RULES`).

    Args:
        evidence: one entry per process (any order; a rank seen twice keeps the first), or an
            already built :class:`Evidence` (then the keywords are ignored).
        trigger / work_pending / world_size: see :class:`Evidence`.

    Returns:
        The :class:`Verdict`; ``kind="unknown"`` with no culprit when nothing is conclusive.
    """
    ev = evidence if isinstance(evidence, Evidence) else Evidence.of(
        evidence, trigger=trigger, work_pending=work_pending, world_size=world_size)
    return judge(ev)


def warm_up() -> None:
    """Import torch's Flight Recorder analyzer now (seconds, once) rather than during an incident."""
    _warm_up_analyzer()


# --- stacks ----------------------------------------------------------------------------------------


def _label(frame: Any) -> str:
    return str(getattr(frame, "label", getattr(frame, "name", "")))


def _pick_thread(with_frames: Sequence[Any], is_idle: Callable[[Any], bool]) -> tuple[Any, bool]:
    """The thread the stall is read from (main unless idle, else the first active, else any not
    idle) and whether every thread is idle."""
    for pick in (lambda t: getattr(t, "is_main", False), lambda t: getattr(t, "active", False), lambda t: True):
        chosen = next((t for t in with_frames if pick(t) and not is_idle(t)), None)
        if chosen is not None:
            return chosen, False
    return next((t for t in with_frames if getattr(t, "is_main", False)), with_frames[0]), True


def _p2p_op(frame: Any) -> str:
    """``recv``, ``send``, ``send/recv`` (``batch_isend_irecv``, SGLang's ``send_recv_tensor_dict``)
    or ``wait``, from the function a P2P layer's frame is in (``recv``, ``GroupCoordinator.recv_tensor_dict``,
    ``c10d::ProcessGroupGloo::RecvWork::wait``)."""
    name = str(getattr(frame, "name", "") or "").lower()
    if "send" in name and "recv" in name:
        return "send/recv"
    return "recv" if "recv" in name else "send" if "send" in name else "wait"


class StackClass(NamedTuple):
    """What a process's stalled thread does, per its stack (:func:`classify_wait`)."""

    #: compute, collective, rendezvous, idle or unknown
    frame_class: FrameClass
    #: ``function (file:line)`` of the frame that says so, ``""`` without frames
    frame: str
    #: the point-to-point operation it waits in (``recv``, ``send``, ``send/recv``, ``wait``), ``""`` for none
    p2p: str = ""


def _layer_class(frames: Sequence[Any]) -> StackClass | None:
    """The communication layer the thread is in (:data:`agent.model.stacks.COMMUNICATION_LAYERS`).

    A rendezvous anywhere on the stack wins (``init_process_group`` calls into the collectives'
    own code while the job forms); else the innermost collective or point-to-point layer, a Python
    frame naming it best, else a native one (a point-to-point wait is a ``collective`` class: the
    rank waits for a peer; ``p2p`` names its operation).
    """
    layers = [(f, comm_layer(f)) for f in frames]
    rendezvous = _rendezvous_frame(layers)
    if rendezvous is not None:
        return StackClass(FrameClass.RENDEZVOUS, _label(rendezvous))
    for python in (True, False):
        for f, layer in layers:
            if layer is not None and layer.kind in ("collective", "p2p") and bool(getattr(f, "native", False)) != python:
                return StackClass(FrameClass.COLLECTIVE, _label(f), _p2p_op(f) if layer.kind == "p2p" else "")
    return None


def _rendezvous_frame(layers: Sequence[tuple[Any, Any]]) -> Any:
    """The first frame in a rendezvous layer, a Python one before a native one; None when none is."""
    rendezvous = next((f for f, layer in layers if layer is not None and layer.kind == "rendezvous"
                       and not getattr(f, "native", False)), None)
    if rendezvous is None:
        rendezvous = next((f for f, layer in layers if layer is not None and layer.kind == "rendezvous"), None)
    return rendezvous


_STDLIB_PATH = re.compile(r"/lib/python\d+\.\d+t?/(?!.*-packages/)")


def _is_plumbing(frame: Any) -> bool:
    """A Python frame of the standard library or a frozen module (``time.sleep``'s caller is the answer)."""
    filename = getattr(frame, "filename", "") or ""
    return filename.startswith("<frozen") or bool(_STDLIB_PATH.search(filename))


def classify_stack(threads: Sequence[Any], *, is_idle: Callable[[Any], bool] | None = None) -> tuple[FrameClass, str]:
    """Class and frame label of a process's stalled thread (:func:`classify_wait` without its P2P operation)."""
    found = classify_wait(threads, is_idle=is_idle)
    return found.frame_class, found.frame


def classify_wait(threads: Sequence[Any], *, is_idle: Callable[[Any], bool] | None = None) -> StackClass:
    """Class, frame label and P2P operation of a process's stalled thread.

    The stuck-vs-idle rule is py-spy summary's (:func:`agent.model.stacks.thread_is_idle`): a thread is
    idle only when it waits for work (a queue, selector, socket, event loop, executor, ZeroMQ, a
    framework's message queue) or is a parked helper thread. The thread read is the one the
    summary's hung frame comes from: the main thread unless it is idle, else the first active
    one, else the first other thread that is not idle; ``IDLE`` only when every thread with frames
    is idle. Its frames are read against the communication layers
    (:data:`agent.model.stacks.COMMUNICATION_LAYERS`): a rendezvous (``RENDEZVOUS``), a collective of
    torch.distributed, vLLM, SGLang, NCCL, pynccl, a custom all-reduce, DeepEP or NVSHMEM
    (``COLLECTIVE``), a point-to-point send or receive (``COLLECTIVE`` with its operation in
    ``p2p``); else ``COMPUTE`` at its innermost frame of its own code.

    Args:
        threads: py-spy threads (objects with ``frames`` (innermost first; each with ``name``,
            ``filename``, ``short_filename``, ``module``, ``label``, ``native``), ``active``,
            ``is_main``).
        is_idle: the idle rule (default: py-spy's :func:`~agent.model.stacks.thread_is_idle`).

    Returns:
        ``(class, "function (file:line)", p2p)``; ``(UNKNOWN, "", "")`` without frames.
    """
    if is_idle is None:
        from agent.model.stacks import thread_is_idle  # the summary's rule, one copy

        is_idle = thread_is_idle
    with_frames = [t for t in threads if getattr(t, "frames", ())]
    if not with_frames:
        return StackClass(FrameClass.UNKNOWN, "")
    thread, all_idle = _pick_thread(with_frames, is_idle)
    frames = thread.frames
    label = next((_label(f) for f in frames if getattr(f, "module", None) is None), _label(frames[0]))
    if all_idle:
        return StackClass(FrameClass.IDLE, label)
    found = _layer_class(frames)
    if found is not None:
        return found
    mine = next((f for f in frames if getattr(f, "module", None) is None and not _is_plumbing(f)), None)
    return StackClass(FrameClass.COMPUTE, _label(mine) if mine is not None else label)


# --- hard mode -------------------------------------------------------------------------------------


def hard_signal_plan(verdict: Verdict | None, *, target_pids: Sequence[int], stalled_pid: int | None,
                     policy: str = "culprit") -> tuple[list[int], str]:
    """Whom hard mode signals after an incident, and why (``([], why)``: nobody).

    ``policy="all"`` (the operator's explicit choice): every target. Otherwise only a culprit
    named at high confidence by a hung verdict; one process that is no distributed job and
    stalled (a ``single`` verdict, or no verdict for the only target) is itself the one to
    restart. Never "every target" for want of a culprit, and never a culprit that is no target of
    the incident (a process not identified, whose pidfd was never taken), a rank or a coordinator alike.
    """
    if policy == "all":
        return list(target_pids), "every rank (hard_targets=all)"
    lone = len(target_pids) == 1 and stalled_pid is not None and target_pids[0] == stalled_pid
    if verdict is None:
        return ([stalled_pid], "the only target, stalled") if lone and stalled_pid else (
            [], "no verdict: hard mode acts only on a high-confidence culprit")
    if not verdict.hung:
        return [], f"not hung ({verdict.kind}): nothing to restart"
    if verdict.kind == "suspended":  # an operator's SIGSTOP or a debugger: resume it, do not kill it
        return [], f"the culprit is stopped, not hung: {verdict.reason}"
    if verdict.kind == "single":
        return ([stalled_pid], f"the only target, stalled: {verdict.reason}") if lone and stalled_pid else (
            [], "one process, not a distributed job, and not the stalled target")
    return _culprit_plan(verdict, target_pids)


def _culprit_plan(verdict: Verdict, target_pids: Sequence[int]) -> tuple[list[int], str]:
    """:func:`hard_signal_plan` for a hung verdict that names culprits: those of the targets, at high confidence."""
    pids = [p for p in verdict.culprit_pids if p]
    if not pids:
        return [], "no culprit named: hard mode acts only on a high-confidence culprit"
    known = set(target_pids)
    outside = [p for p in pids if p not in known]  # never identified as a target: no pidfd, never signalled
    pids = [p for p in pids if p in known]
    if not pids:
        return [], f"culprit pid {', '.join(map(str, outside))} is no target of this incident: never signalled"
    if verdict.confidence == "high":
        return pids, f"culprit per verdict: {verdict.reason}"
    return [], f"verdict confidence {verdict.confidence}: hard mode acts only on a high-confidence culprit"


# --- documentation ---------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rules_markdown() -> str:
    """``docs/verdict-rules.md``: the rule table and the communication-layer table, generated
    from :data:`RULES` and :data:`agent.model.stacks.COMMUNICATION_LAYERS` (a test keeps the file equal)."""
    from agent.model.stacks import COMMUNICATION_LAYERS

    lines = [
        "# The verdict's rules",
        "",
        "Generated from `agent/verdict/rules.py` (`RULES`) and `agent/model/stacks.py` (`COMMUNICATION_LAYERS`) by",
        "`python -m agent.verdict.rules > docs/verdict-rules.md`; `tests/test_verdict.py` checks this file is current.",
        "",
        "The verdict judges one server at a time (processes grouped by process tree, torch.distributed",
        "world and parallel coordinates: `agent/verdict/judge.py`). The rules are tried in this order; the first",
        "that applies decides. A verdict records its rule (`servewatch.verdict.rule`, `verdict.rule` in",
        "`manifest.json`). Hard mode (`--hard`) signals only a culprit named at **high** confidence.",
        "",
        "A rank's number comes from torch.distributed (its Flight Recorder read) or a title that names it",
        "alone (`scheduler_TP1`), else `RANK` in its environment (torch.distributed's env:// variables, read",
        "while it lived, no other variable read; one several processes share was inherited and names none:",
        "vLLM on Ray titles every worker `ray::RayWorkerWrapper`), else the SDK's step counter",
        "(torch.distributed's rank, recorded by the process: it outlives the title of a zombie, whose `comm`",
        "keeps 15 characters), else its title among its server's (`Worker_PP1_TP0` at TP=2 is rank 2).",
        "Failing those, a dead rank's number may be inferred —",
        "the world size is known and it is the one rank no other process holds — and the evidence says",
        "so; a culprit whose rank is inferred is named at **medium** confidence at most.",
        "",
        "| # | rule | kind | applies when | concludes | confidence |",
        "|---|------|------|--------------|-----------|------------|",
    ]
    for i, r in enumerate(RULES, 1):
        lines.append(f"| {i} | `{r.name}` | `{r.kind}` | {_cell(r.when)} | {_cell(r.concludes)} | {_cell(r.confidence)} |")
    lines += [
        "",
        "## The next step",
        "",
        "Every verdict ends with one `next:` line: the command or check to run next, with the verdict's own",
        "pids (`py-spy dump --native --pid 42 (what it does instead of the collective)`). It is printed under",
        "the verdict by `run`/`dump`, `timeline` and the report, and recorded as `servewatch.verdict.next` on",
        "the `incident` span and `verdict.next` in `manifest.json` (a bundle written before it existed gets",
        "it rebuilt from the verdict's kind, culprits and lines). By kind, in general:",
        "",
        "| kind | next |",
        "|------|------|",
    ]
    for kind in dict.fromkeys(r.kind for r in RULES):
        lines.append(f"| `{kind}` | {_cell(NEXT_STEPS[kind].doc)} |")
    lines += [
        "",
        "## Communication layers",
        "",
        "A rank's stack is read against these layers, first match wins: a rank inside a `collective` layer",
        "waits for its peers, inside a `p2p` layer for one peer's send or receive (a wait too: all ranks in",
        "`p2p` is the `p2p_deadlock` rule, one rank outside while the others wait is `stacks_behind`);",
        "`rendezvous` means the job is still forming; a `message_queue` is a wait for",
        "work (idle, unless work is pending: then the `ipc_deadlock` rule). Whether a thread waits for",
        "work is read off its innermost Python frame outside `threading` and outside spin helpers (vLLM's",
        "`vllm/distributed/utils.py` `sched_yield`, which the message queue's spin loop calls: an idle",
        "vLLM worker shows it innermost right after a request); the helper's caller decides.",
        "",
        "| layer | kind | Python file | native symbol | source |",
        "|-------|------|-------------|---------------|--------|",
    ]
    for layer in COMMUNICATION_LAYERS:
        py = f"`{layer.python}`" + (f" function `{layer.function}`" if layer.function else "") if layer.python else ""
        native = f"`{layer.native}`" if layer.native else ""
        lines.append(f"| {layer.name} | `{layer.kind}` | {_cell(py)} | {_cell(native)} | {_cell(layer.source)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - `python -m agent.verdict.rules > docs/verdict-rules.md`
    print(rules_markdown(), end="")
