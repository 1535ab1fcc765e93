"""The cross-rank verdict of a distributed incident: which rank(s) caused it, why, how sure.

Owns the pure analysis that turns per-rank evidence (process state and exit, Flight Recorder
entries, the py-spy stack's class: compute / collective wait / idle, forward-step counters) into
one :class:`Verdict`. No I/O, no clock, no subprocess: the caller gathers the evidence
(:mod:`agent.runtime` from an incident's results) and passes it in.

Rules, first match wins:

0. ``single``: one process that is not a rank of a distributed job (no rank from
   torch.distributed, its title or ``RANK``; no Flight Recorder read; not in a collective):
   nothing to compare it with, so nobody is a culprit; the verdict says where it is:
   ``1 process (pid 42), not a distributed job: in inner_work (busy.py:6)`` (``medium``, from its stack),
   ``idle (waiting for work) in ...``, or how it exited (``high`` when its exit opened the
   incident); ``low`` without a stack.
1. ``dead``: a rank's process ended (the incident's trigger names it, or its exit status is
   known): ``dead: rank 2 exited with SIGSEGV``. The ranks that then failed in their
   collectives are its victims, not culprits. A rank ended by SIGTERM/SIGINT (or exit code
   143/130) was asked to stop from outside: never a dead culprit; when its exit is the trigger,
   ``dead`` at ``low`` confidence, ``terminated by a signal: rank 1 was terminated by SIGTERM``.
2. ``desync``: at some collective sequence id of a process group that every rank recorded,
   the ranks issued different ops / sizes / dtypes (compared with
   ``torch.distributed.flight_recorder``'s ``Op.match`` when torch is importable). The odd rank
   out is the culprit: the minority when there is a strict majority, else the rank whose entry
   breaks the group's own repeating pattern before that id, else every rank involved.
3. ``progressing``: every rank's step counter advanced during the incident: slow, not hung.
   Nobody is named a culprit; the rank not waiting in a collective is reported as a straggler.
4. ``behind``: the Flight Recorders disagree on the last collective enqueued in a group: the
   ranks behind never entered it while the others wait in it:
   ``behind: rank 1 never entered all_reduce #42 of pg 0; ranks 0,2,3 wait in it``.
5. stacks only: some ranks wait in a collective and the others do not: those others are
   behind (medium confidence); ``all ranks in compute: no collective wait`` when no rank waits,
   naming the rank(s) whose steps stopped while the others advanced, or the only rank (TP=1).
6. ``unknown`` otherwise.

Imports nothing from the agent at import time (plain data in, plain data out) but py-spy's
stuck-vs-idle rule, lazily, so the verdict and the py-spy summary never disagree; torch is
imported lazily and optionally for ``Op.match``.
"""

from __future__ import annotations

import contextlib
import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "VERDICT_ATTR_PREFIX",
    "FrameClass",
    "RankEvidence",
    "Verdict",
    "classify_stack",
    "decide",
    "warm_up",
]

#: Prefix of the verdict's attributes on the incident span.
VERDICT_ATTR_PREFIX = "servewatch.verdict."


class FrameClass(str, enum.Enum):
    """Where a rank's main thread is, per its py-spy stack."""

    COMPUTE = "compute"  # running its own code (a kernel launch, a model forward, a busy loop)
    COLLECTIVE = "collective"  # inside a torch.distributed collective (waiting for peers)
    IDLE = "idle"  # every thread waits for work (queue, selector, socket, event loop): nothing is stuck
    UNKNOWN = "unknown"  # no stack

    def __str__(self) -> str:
        return self.value


#: torch.distributed source folders; a frame there means the thread is inside a collective call.
_DIST_PATH = re.compile(r"torch/distributed/")
#: Native symbols of a collective wait (gloo, NCCL, c10d work waits).
_NATIVE_COLLECTIVE = re.compile(r"c10d::|gloo::|ncclKernel|ProcessGroup(Gloo|NCCL)|Work::wait", re.IGNORECASE)
#: The standard library's files (``time.sleep``'s caller, not ``threading``, is where a thread is).
_STDLIB_PATH = re.compile(r"/lib/python\d+\.\d+t?/(?!.*-packages/)")


def classify_stack(threads: Sequence[Any], *, is_idle: Callable[[Any], bool] | None = None) -> tuple[FrameClass, str]:
    """Class and innermost frame label of a process's stalled thread.

    The stuck-vs-idle rule is py-spy summary's (:func:`agent.stacks.thread_is_idle`): a
    thread is idle only when it waits for work (a queue, selector, socket, event loop, executor,
    ZeroMQ). py-spy's own ``active`` flag (on CPU or not) is not that: a forward pass stuck in a
    ``time.sleep`` loop, a lock or an ``Event.wait`` in the model's code is stuck, so ``COMPUTE``.
    The thread read is the one the summary's hung frame comes from: the main thread unless it is
    idle, else the first active one, else the first other thread that is not idle; ``IDLE`` only
    when every thread with frames is idle.

    Args:
        threads: py-spy threads (objects with ``frames`` (innermost first; each with ``name``,
            ``filename``, ``short_filename``, ``module``, ``label``, ``native``), ``active``,
            ``is_main``).
        is_idle: the idle rule (default: py-spy's :func:`~agent.stacks.thread_is_idle`).

    Returns:
        ``(class, "function (file:line)")``; ``(UNKNOWN, "")`` without frames.
    """
    if is_idle is None:
        from agent.stacks import thread_is_idle  # the summary's rule, one copy

        is_idle = thread_is_idle
    with_frames = [t for t in threads if getattr(t, "frames", ())]
    if not with_frames:
        return FrameClass.UNKNOWN, ""
    main = None
    for pick in (lambda t: getattr(t, "is_main", False), lambda t: getattr(t, "active", False), lambda t: True):
        main = next((t for t in with_frames if pick(t) and not is_idle(t)), None)
        if main is not None:
            break
    all_idle = main is None
    main = main or next((t for t in with_frames if getattr(t, "is_main", False)), with_frames[0])
    frames = main.frames
    label = next((getattr(f, "label", f.name) for f in frames if getattr(f, "module", None) is None), getattr(frames[0], "label", frames[0].name))
    for f in frames:  # a Python frame in torch.distributed names the collective best
        where = f"{getattr(f, 'filename', '')} {getattr(f, 'short_filename', '')}"
        if getattr(f, "module", None) is None and _DIST_PATH.search(where):
            return FrameClass.COLLECTIVE, getattr(f, "label", f.name)
    for f in frames:
        if getattr(f, "module", None) is not None and _NATIVE_COLLECTIVE.search(f.name or ""):
            return FrameClass.COLLECTIVE, getattr(f, "label", f.name)
    if all_idle:
        return FrameClass.IDLE, label
    mine = next((f for f in frames if getattr(f, "module", None) is None and not _is_plumbing(f)), None)
    return FrameClass.COMPUTE, (getattr(mine, "label", mine.name) if mine is not None else label)


def _is_plumbing(frame: Any) -> bool:
    """A Python frame of the standard library or a frozen module (``time.sleep``'s caller is the answer)."""
    filename = getattr(frame, "filename", "") or ""
    return filename.startswith("<frozen") or bool(_STDLIB_PATH.search(filename))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEvidence:
    """What is known about one rank.

    Attributes:
        rank: the rank (torch.distributed's, else the TP index of the title).
        pid: its process.
        alive: the process still exists (not gone, not a zombie) when the verdict is made.
        exited_first: its exit triggered the incident.
        exit_signal: signal name that ended it (``"SIGSEGV"``), when known.
        exit_code: its exit code, when known.
        frame_class / frame: its py-spy stack's class and innermost frame.
        steps_before / steps_after: its forward-step counter when the incident opened and when
            the evidence was complete (``None``: no counter).
        fr: its Flight Recorder dump (``entries``, ``pg_status``), or ``None``.
        ranked: the process is known as a rank of a distributed job (a rank from
            torch.distributed, its title or ``RANK``). ``False`` only for a process known by pid
            alone; with no other rank, no Flight Recorder and no collective wait it gets the
            ``single`` verdict.
    """

    rank: int
    pid: int | None = None
    alive: bool = True
    exited_first: bool = False
    exit_signal: str | None = None
    exit_code: int | None = None
    frame_class: FrameClass = FrameClass.UNKNOWN
    frame: str = ""
    steps_before: int | None = None
    steps_after: int | None = None
    fr: Mapping[str, Any] | None = None
    ranked: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """The incident's cross-rank verdict.

    Attributes:
        kind: ``dead``, ``desync``, ``behind``, ``compute``, ``progressing``, ``single`` (one
            process, not a distributed job) or ``unknown``.
        hung: whether the group is stuck (``progressing`` is not; ``single``: unless its step
            counter advanced).
        culprit_ranks / culprit_pids: the rank(s) named (empty when none can be).
        reason: one line, e.g. ``behind: rank 1 never entered all_reduce #42 of pg 0; rank 0 waits in it``.
        confidence: ``high``, ``medium`` or ``low``.
        evidence: short facts behind it (one per rank).
        stragglers: ranks slower than the rest while all progress (``progressing`` only).
        ranks: every rank considered.
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

    def headline(self) -> str:
        """The summary's first line: ``Verdict: culprit rank 1 (pid 42) -- behind: ... [high]``;
        ``Verdict: 1 process (pid 42), not a distributed job: in f (m.py:3) [confidence medium]``
        for a ``single`` verdict (no culprit wording: there is nothing to blame it against)."""
        if self.kind == "single":
            return f"Verdict: {self.reason} [confidence {self.confidence}]"
        if self.culprit_ranks:
            who = ", ".join(
                f"rank {r}" + (f" (pid {p})" if p else "") for r, p in zip(self.culprit_ranks, self._pids_padded())
            )
            return f"Verdict: culprit {who} -- {self.reason} [confidence {self.confidence}]"
        return f"Verdict: no culprit rank -- {self.reason} [confidence {self.confidence}]"

    def _pids_padded(self) -> list[int | None]:
        pids: list[int | None] = list(self.culprit_pids)
        return pids + [None] * (len(self.culprit_ranks) - len(pids))

    def attributes(self) -> dict[str, Any]:
        """``servewatch.verdict.*`` span attributes."""
        p = VERDICT_ATTR_PREFIX
        return {
            f"{p}kind": self.kind,
            f"{p}hung": self.hung,
            f"{p}culprit_ranks": tuple(self.culprit_ranks),
            f"{p}culprit_pids": tuple(self.culprit_pids),
            f"{p}reason": self.reason,
            f"{p}confidence": self.confidence,
            f"{p}stragglers": tuple(self.stragglers),
            f"{p}ranks": tuple(self.ranks),
        }

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the manifest's ``verdict``)."""
        return {
            "kind": self.kind,
            "hung": self.hung,
            "culprit_ranks": list(self.culprit_ranks),
            "culprit_pids": list(self.culprit_pids),
            "reason": self.reason,
            "confidence": self.confidence,
            "evidence": list(self.evidence),
            "stragglers": list(self.stragglers),
            "ranks": list(self.ranks),
            "headline": self.headline(),
        }


def _ranks_text(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(str(r) for r in rs)


def _ranks_wait(ranks: Iterable[int]) -> str:
    """``rank 1 waits`` / ``ranks 0,2 wait``: the subject and its verb agree."""
    rs = sorted(ranks)
    return f"{_ranks_text(rs)} {'waits' if len(rs) == 1 else 'wait'}"


def _verdict(kind: str, culprits: Iterable[int], reason: str, confidence: str, ev: Sequence[RankEvidence],
             *, hung: bool = True, stragglers: Iterable[int] = ()) -> Verdict:
    by_rank = {e.rank: e for e in ev}
    cr = tuple(sorted(set(culprits)))
    return Verdict(
        kind=kind,
        hung=hung,
        culprit_ranks=cr,
        culprit_pids=tuple(by_rank[r].pid or 0 for r in cr if r in by_rank),
        reason=reason,
        confidence=confidence,
        evidence=tuple(_evidence_line(e) for e in sorted(ev, key=lambda e: e.rank)),
        stragglers=tuple(sorted(set(stragglers))),
        ranks=tuple(sorted(by_rank)),
    )


def _stopped(e: RankEvidence) -> str | None:
    """``SIGTERM``/``SIGINT`` when the rank ended because it was asked to stop (the signal itself,
    or exit code 143/130 after catching it), else ``None``."""
    if e.alive:
        return None
    if e.exit_signal is not None:
        return e.exit_signal if e.exit_signal in ("SIGTERM", "SIGINT") else None
    return {143: "SIGTERM", 130: "SIGINT"}.get(e.exit_code) if e.exit_code is not None else None


def _evidence_line(e: RankEvidence) -> str:
    parts = [f"rank {e.rank}" + (f" pid {e.pid}" if e.pid else "")]
    if not e.alive:
        how = e.exit_signal or (f"exit code {e.exit_code}" if e.exit_code is not None else "exited")
        parts.append(f"gone ({how})")
    if e.frame_class is not FrameClass.UNKNOWN:
        parts.append(f"{e.frame_class.value}: {e.frame}" if e.frame else e.frame_class.value)
    if e.steps_before is not None and e.steps_after is not None:
        parts.append(f"steps {e.steps_before}->{e.steps_after}")
    fr = _FR.of(e)
    if fr is not None and fr.groups:
        for pg, st in sorted(fr.groups.items())[:2]:
            parts.append(f"pg {pg}: enqueued #{st[0]}, completed #{st[1]}")
    return "; ".join(parts)


# --- Flight Recorder views ---------------------------------------------------------------------


@dataclass(slots=True)
class _FR:
    """One rank's recorder: per process group, its entries by seq id and (enqueued, completed)."""

    entries: dict[str, dict[int, Mapping[str, Any]]] = field(default_factory=dict)
    groups: dict[str, tuple[int, int]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def of(e: RankEvidence) -> _FR | None:
        dump = e.fr
        if not isinstance(dump, Mapping):
            return None
        fr = _FR()
        for entry in dump.get("entries") or ():
            if not isinstance(entry, Mapping) or entry.get("is_p2p"):
                continue
            pg = str(entry.get("pg_id", (entry.get("process_group") or ["?"])[0]))
            seq = entry.get("collective_seq_id")
            if isinstance(seq, int) and seq > 0:
                fr.entries.setdefault(pg, {})[seq] = entry
                pgname = entry.get("process_group")
                if isinstance(pgname, (list, tuple)) and len(pgname) == 2:
                    fr.names[pg] = str(pgname[1] or pgname[0])
        status = dump.get("pg_status") or {}
        if isinstance(status, Mapping):
            for pg, st in status.items():
                if not isinstance(st, Mapping):
                    continue
                try:
                    enq = int(st.get("last_enqueued_collective", -1))
                    done = int(st.get("last_completed_collective", -1))
                except (TypeError, ValueError):
                    continue
                fr.groups[str(pg)] = (enq, done)
        for pg, by_seq in fr.entries.items():
            if pg not in fr.groups and by_seq:
                last = max(by_seq)
                fr.groups[pg] = (last, last if by_seq[last].get("state") == "completed" else last - 1)
        return fr


def _op_name(entry: Mapping[str, Any]) -> str:
    name = str(entry.get("profiling_name") or "?")
    return name.split(":", 1)[1] if ":" in name else name


def _signature(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    def norm(v: Any) -> Any:
        return tuple(norm(x) for x in v) if isinstance(v, (list, tuple)) else v

    return (_op_name(entry), norm(entry.get("input_sizes")), norm(entry.get("output_sizes")),
            norm(entry.get("input_dtypes")), norm(entry.get("output_dtypes")))


def _describe(entry: Mapping[str, Any]) -> str:
    return f"{_op_name(entry)} {list(entry.get('input_sizes') or [])}"


def _torch_match(a: Mapping[str, Any], b: Mapping[str, Any], ranks: set[int]) -> tuple[bool, str] | None:
    """torch's own comparison of two entries (``Op.match`` of ``torch.distributed.flight_recorder``).

    States are set equal first (a hang leaves them apart by design). Returns
    ``(mismatch, torch's description)``, or ``None`` when torch's analyzer is not importable or
    cannot read the entries.
    """
    try:
        from torch.distributed.flight_recorder.components.types import MatchState, Op
    except Exception:  # noqa: BLE001 - torch is optional on the agent side
        return None
    try:
        pg = "pg"
        memberships = {pg: set(ranks)}
        base = {"p2p_seq_id": 0, "input_dtypes": [], "output_dtypes": [], "time_created_ns": 0}
        ea, eb = {**base, **a, "state": "completed"}, {**base, **b, "state": "completed"}
        info = Op(ea, memberships, pg).match(Op(eb, memberships, pg))
    except Exception:  # noqa: BLE001 - an entry torch's analyzer does not know
        return None
    return info.state not in (MatchState.FULLY_MATCHED, MatchState.UNDECIDED), str(info)


def warm_up() -> None:
    """Import torch's Flight Recorder analyzer now (seconds, once) rather than during an incident."""
    import warnings

    # torch warns on stderr at import when numpy is absent (a plain `pip install torch`); not ours to show
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    # torch is optional on the agent side, and a broken install may raise more than ImportError
    with contextlib.suppress(Exception):
        import torch.distributed.flight_recorder.components.types  # noqa: F401


def _mismatch(a: Mapping[str, Any], b: Mapping[str, Any], ranks: set[int]) -> tuple[bool, str]:
    """Whether two ranks' entries at one sequence id disagree, and torch's words for it.

    Equal signatures (op, sizes, dtypes) match without asking torch; different ones are
    confirmed by torch's ``Op.match`` when importable (it knows which differences are legal,
    e.g. all_to_all sizes).
    """
    if _signature(a) == _signature(b):
        return False, ""
    by_torch = _torch_match(a, b, ranks)
    if by_torch is None:
        return True, ""
    mismatch, words = by_torch
    return mismatch or _signature(a)[0] != _signature(b)[0], words


def _expected(seq: int, agreed: Mapping[int, tuple[Any, ...]]) -> tuple[Any, ...] | None:
    """The signature the group's repeating pattern predicts at ``seq`` (from agreed ids before it)."""
    before = sorted(s for s in agreed if s < seq)
    for period in range(1, 9):
        window = [s for s in before if s >= seq - 3 * period]
        if len(window) < 2 * period or (seq - period) not in agreed:
            continue
        if all((s - period) not in agreed or agreed[s] == agreed[s - period] for s in window):
            return agreed[seq - period]
    return None


def _desync(frs: Mapping[int, _FR], ev: Sequence[RankEvidence]) -> Verdict | None:
    pgs = set.intersection(*(set(fr.entries) for fr in frs.values())) if frs else set()
    for pg in sorted(pgs):
        common = set.intersection(*(set(fr.entries[pg]) for fr in frs.values()))
        agreed: dict[int, tuple[Any, ...]] = {}
        for seq in sorted(common):
            by_rank = {r: fr.entries[pg][seq] for r, fr in frs.items()}
            ranks = set(by_rank)
            ref_rank = min(by_rank)
            checks = {r: _mismatch(by_rank[ref_rank], by_rank[r], ranks) for r in by_rank}
            odd = [r for r, (bad, _) in checks.items() if bad]
            if not odd:
                agreed[seq] = _signature(by_rank[ref_rank])
                continue
            groups: dict[tuple[Any, ...], list[int]] = {}
            for r, entry in by_rank.items():
                groups.setdefault(_signature(entry), []).append(r)
            ordered = sorted(groups.values(), key=len, reverse=True)
            culprits: list[int]
            confidence = "high"
            if len(ordered) > 1 and len(ordered[0]) > len(ordered[1]) and len(ordered[0]) * 2 > len(by_rank):
                culprits = [r for g in ordered[1:] for r in g]
            else:
                expected = _expected(seq, agreed)
                culprits = [r for r, e in by_rank.items() if expected is not None and _signature(e) != expected]
                if not culprits or len(culprits) == len(by_rank):
                    culprits, confidence = sorted(by_rank), "low"
            parts = "; ".join(
                f"{_ranks_text(g)}: {_describe(by_rank[g[0]])}" for g in sorted(groups.values(), key=lambda g: min(g))
            )
            name = frs[ref_rank].names.get(pg, "")
            pg_text = f"pg {pg}" + (f" ({name})" if name and name not in (pg, "default_pg") else "")
            reason = f"desync: ranks issued different ops/sizes at #{seq} of {pg_text} ({parts})"
            torch_words = next((w for r in odd if (w := checks[r][1])), "")
            found = _verdict("desync", culprits, reason, confidence, ev)
            if torch_words:  # torch's analyzer's own classification, e.g. SIZE_OR_SYNTAX_MISMATCH
                found = replace(found, evidence=(*found.evidence, f"torch flight_recorder: {torch_words}"))
            return found
    return None


def _behind(frs: Mapping[int, _FR], ev: Sequence[RankEvidence]) -> Verdict | None:
    pgs = set.intersection(*(set(fr.groups) for fr in frs.values())) if frs else set()
    classes = {e.rank: e.frame_class for e in ev}
    for pg in sorted(pgs, key=lambda p: (p != "0", p)):
        enq = {r: fr.groups[pg][0] for r, fr in frs.items()}
        top = max(enq.values())
        behind = sorted(r for r, s in enq.items() if s < top)
        if not behind:
            continue
        waiting = sorted(r for r, s in enq.items() if s == top)
        entry = next((frs[r].entries.get(pg, {}).get(top) for r in waiting if frs[r].entries.get(pg, {}).get(top)), None)
        op = _op_name(entry) if entry else "collective"
        name = next((frs[r].names.get(pg) for r in waiting if frs[r].names.get(pg)), "")
        pg_text = f"pg {pg}" + (f" ({name})" if name and name not in (pg, "default_pg") else "")
        gaps = {r: top - enq[r] for r in behind}
        how = "never entered" if all(g == 1 for g in gaps.values()) else "is behind at"
        reason = (
            f"behind: {_ranks_text(behind)} {how} {op} #{top} of {pg_text}; "
            f"{_ranks_wait(waiting)} in it"
        )
        consistent = all(classes.get(r) is not FrameClass.COLLECTIVE for r in behind) and all(
            classes.get(r) in (FrameClass.COLLECTIVE, FrameClass.UNKNOWN) for r in waiting
        )
        frames = "; ".join(f"rank {e.rank} in {e.frame}" for e in ev if e.rank in behind and e.frame)
        if frames:
            reason += f" ({frames})"
        return _verdict("behind", behind, reason, "high" if consistent else "medium", ev)
    return None


def _late_arrivals(frs: Mapping[int, _FR], window: int = 32) -> list[int]:
    """The rank that enters the group's collectives last, by far (recorder creation times).

    Over the last ``window`` sequence ids every rank recorded, each rank's lateness is the sum of
    how long after the first rank it entered; the latest rank is a straggler when its lateness
    is over twice everyone else's and at least 50 ms in all.
    """
    pgs = set.intersection(*(set(fr.entries) for fr in frs.values())) if frs else set()
    late: dict[int, int] = dict.fromkeys(frs, 0)
    for pg in pgs:
        common = sorted(set.intersection(*(set(fr.entries[pg]) for fr in frs.values())))[-window:]
        for seq in common:
            created = {r: fr.entries[pg][seq].get("time_created_ns") for r, fr in frs.items()}
            if not all(isinstance(t, int) for t in created.values()):
                continue
            first = min(created.values())  # type: ignore[type-var]
            for r, t in created.items():
                late[r] += t - first  # type: ignore[operator]
    if len(late) < 2:
        return []
    ordered = sorted(late.items(), key=lambda kv: kv[1], reverse=True)
    (top, top_ns), (_, next_ns) = ordered[0], ordered[1]
    return [top] if top_ns >= 50_000_000 and top_ns > 2 * next_ns else []


def decide(evidence: Sequence[RankEvidence]) -> Verdict:
    """The verdict for one incident (rules in the module docstring).

    Args:
        evidence: one entry per rank (any order; duplicate ranks keep the first).

    Returns:
        The :class:`Verdict`; ``kind="unknown"`` with no culprit when nothing is conclusive.
    """
    seen: dict[int, RankEvidence] = {}
    for e in evidence:
        seen.setdefault(e.rank, e)
    ev = [seen[r] for r in sorted(seen)]
    if not ev:
        return _verdict("unknown", (), "no rank to judge", "low", ev, hung=False)

    # 0. one process that is not a rank of a distributed job: nothing to blame it against
    if len(ev) == 1 and not ev[0].ranked and ev[0].fr is None and ev[0].frame_class is not FrameClass.COLLECTIVE:
        return _single(ev[0])

    # 1. a rank died (a rank stopped by SIGTERM/SIGINT was asked to stop from outside: no crash)
    first = [e for e in ev if e.exited_first and not _stopped(e)]
    dead = first or [e for e in ev if not e.alive and not _stopped(e)
                     and (e.exit_signal or (e.exit_code not in (None, 0)))]
    if dead:
        how = "; ".join(
            f"rank {e.rank} exited"
            + (f" with {e.exit_signal}" if e.exit_signal else f" with exit code {e.exit_code}" if e.exit_code is not None else "")
            for e in dead
        )
        others = [e for e in ev if e not in dead]
        waiting = [e.rank for e in others if e.frame_class is FrameClass.COLLECTIVE]
        gone = [e.rank for e in others if not e.alive]
        reason = f"dead: {how}"
        if waiting:
            reason += f"; {_ranks_wait(waiting)} in a collective"
        if gone:
            reason += f"; {_ranks_text(gone)} exited after it"
        return _verdict("dead", [e.rank for e in dead], reason, "high" if first else "medium", ev)
    stopped = [e for e in ev if not e.alive and _stopped(e)]
    if any(e.exited_first for e in stopped):
        how = "; ".join(f"rank {e.rank} was terminated by {_stopped(e)}" for e in stopped)
        return _verdict("dead", [e.rank for e in stopped if e.exited_first],
                        f"terminated by a signal: {how} (asked to stop from outside, not a crash)", "low", ev)

    frs = {e.rank: fr for e in ev if e.alive and (fr := _FR.of(e)) is not None and (fr.entries or fr.groups)}
    complete_fr = len(frs) == len(ev) and len(ev) > 1

    # 2. the ranks issued different collectives
    if complete_fr:
        found = _desync(frs, ev)
        if found is not None:
            return found

    # 3. slow but progressing
    stepped = [e for e in ev if e.steps_before is not None and e.steps_after is not None]
    if stepped and len(stepped) == len(ev) and all(e.steps_after > e.steps_before for e in stepped):  # type: ignore[operator]
        stragglers = _late_arrivals(frs) if complete_fr else []
        if not stragglers:  # no recorder: the stacks of this instant
            waiting = [e.rank for e in ev if e.frame_class is FrameClass.COLLECTIVE]
            stragglers = [e.rank for e in ev if e.frame_class is not FrameClass.COLLECTIVE] if waiting else []
        rate = ", ".join(f"rank {e.rank} +{e.steps_after - e.steps_before}" for e in stepped)  # type: ignore[operator]
        reason = f"progressing: every rank advanced ({rate}); not hung"
        if stragglers and len(stragglers) < len(ev):
            reason += f"; slowest: {_ranks_text(stragglers)} (enters collectives last; the others wait for it)"
        else:
            stragglers = []
        return _verdict("progressing", (), reason, "high", ev, hung=False, stragglers=stragglers)

    # 4. a rank never entered the collective the others wait in
    if complete_fr:
        found = _behind(frs, ev)
        if found is not None:
            return found

    # 5. stacks only
    known = [e for e in ev if e.frame_class is not FrameClass.UNKNOWN]
    waiting = [e.rank for e in known if e.frame_class is FrameClass.COLLECTIVE]
    outside = [e for e in known if e.frame_class is not FrameClass.COLLECTIVE]
    if waiting and outside:
        frames = "; ".join(f"rank {e.rank} in {e.frame_class.value}: {e.frame}" for e in outside)
        reason = f"behind: {_ranks_text(e.rank for e in outside)} not in a collective ({frames}); {_ranks_wait(waiting)} in one"
        return _verdict("behind", [e.rank for e in outside], reason, "medium", ev)
    if known and not waiting:
        compute = [e.rank for e in known if e.frame_class is FrameClass.COMPUTE]
        if len(compute) == len(known) and len(known) == len(ev):
            stalled = [e.rank for e in ev if e.steps_before is not None and e.steps_after == e.steps_before]
            if len(ev) == 1:  # the only rank is stuck in its own code: it is the culprit
                stalled = [ev[0].rank]
            elif len(stalled) == len(ev):
                stalled = []  # every rank stopped in compute: nothing tells one apart
            reason = "all ranks in compute: no collective wait"
            if stalled:
                frames = "; ".join(f"rank {e.rank} in {e.frame}" for e in ev if e.rank in stalled and e.frame)
                reason += f"; {_ranks_text(stalled)} stuck" + (f" ({frames})" if frames else "")
            return _verdict("compute", stalled, reason, "medium", ev)
        return _verdict("unknown", (), f"no collective wait ({', '.join(f'rank {e.rank} {e.frame_class.value}' for e in known)})", "low", ev)
    if complete_fr and waiting and len(waiting) == len(ev):
        return _verdict("unknown", (), "every rank entered the same collective and waits in it (communication layer?)", "low", ev)
    return _verdict("unknown", (), f"no conclusive evidence ({_what_was_read(ev, frs, complete_fr, known)})", "low", ev,
                    hung=True)


def _single(e: RankEvidence) -> Verdict:
    """Rule 0: where one non-distributed process is, or how it ended; never a culprit (hard
    mode then signals the stalled target itself)."""
    confidence = "medium"
    advanced = e.steps_before is not None and e.steps_after is not None and e.steps_after > e.steps_before
    hung = not advanced  # as for ranks: only steps seen advancing say "not hung" (hard mode reads it)
    if not e.alive:
        stopped = _stopped(e)
        if stopped:
            where, confidence = f"terminated by {stopped} (asked to stop from outside, not a crash)", "low"
        else:
            how = e.exit_signal or (f"exit code {e.exit_code}" if e.exit_code is not None else "")
            where = "exited" + (f" with {how}" if how else "")
            confidence = "high" if e.exited_first else "medium"
        hung = True
    elif e.frame_class is FrameClass.IDLE:
        where = f"idle (waiting for work) in {e.frame}" if e.frame else "idle (waiting for work)"
    elif e.frame_class is FrameClass.COMPUTE:
        where = f"in {e.frame}" if e.frame else "in its own code"
    else:
        where, confidence = "no stack", "low"
    if advanced and e.alive:
        where += f" (steps {e.steps_before}->{e.steps_after}: progressing)"
    evidence = [f"pid {e.pid}" if e.pid else "1 process"]
    if e.frame_class is not FrameClass.UNKNOWN:
        evidence.append(f"{e.frame_class.value}: {e.frame}" if e.frame else e.frame_class.value)
    if e.steps_before is not None and e.steps_after is not None:
        evidence.append(f"steps {e.steps_before}->{e.steps_after}")
    return Verdict(
        kind="single",
        hung=hung,
        culprit_ranks=(),
        culprit_pids=(),
        reason=f"1 process{f' (pid {e.pid})' if e.pid else ''}, not a distributed job: {where}",
        confidence=confidence,
        evidence=("; ".join(evidence),),
    )


def _what_was_read(ev: Sequence[RankEvidence], frs: Mapping[int, _FR], complete_fr: bool,
                   known: Sequence[RankEvidence]) -> str:
    """What the inconclusive verdict had: ``no Flight Recorder`` only when no rank's record was read."""
    if not any(isinstance(e.fr, Mapping) for e in ev):
        fr_text = "no Flight Recorder"
    elif not frs:
        fr_text = "Flight Recorder empty"
    elif not complete_fr:
        fr_text = f"Flight Recorder of {_ranks_text(sorted(frs))} only"
    else:
        fr_text = "the Flight Recorders show no rank behind and no mismatch"
    if not known:
        return f"{fr_text} and no stacks"
    return f"{fr_text}; stacks: " + ", ".join(f"rank {e.rank} {e.frame_class.value}" for e in known)
