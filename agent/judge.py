"""Gathers an incident's per-rank evidence and asks :mod:`agent.verdict` for the verdict.

Owns the I/O around the pure verdict: forward-step counters read when the incident opens and
again once the evidence is in, process states, the exit status of the rank whose exit triggered
the incident, the py-spy dumps and Flight Recorder dumps the incident's actions wrote (read back
from their artifacts, so the verdict is a function of the bundle plus those readings).

Used by :mod:`agent.incidents` through the two calls of :class:`VerdictJudge`; imports
:mod:`agent.verdict`, :mod:`agent.events`, :mod:`agent.targets`, the SDK's public counter reader
(:mod:`agent.sdk.counter`), the stack model (:mod:`agent.stacks`) and :func:`agent.ranks.rank_from_title`;
never an actor, a watcher or an exporter.
"""

from __future__ import annotations

import json
import logging
import signal as signal_mod
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

from agent.events import Action, ActionResult, Event, Outcome, TargetExited
from agent.ranks import rank_from_title
from agent.sdk.counter import counter_path, read_counter
from agent.stacks import parse_dump
from agent.targets import ProcessState, Target, process_state, server_of
from agent.verdict import FrameClass, RankEvidence, Verdict, classify_stack, decide, warm_up

__all__ = ["VerdictJudge", "job_groups", "pick_incident_verdict", "read_steps", "signal_name", "warm_up_analyzer"]

log = logging.getLogger("servewatch.judge")

#: Largest artifact read back for the verdict, bytes.
_MAX_ARTIFACT_BYTES = 64 * 1024 * 1024


def signal_name(number: int | None) -> str | None:
    """``11`` -> ``"SIGSEGV"``; ``None`` stays ``None``."""
    if number is None:
        return None
    try:
        return signal_mod.Signals(number).name
    except ValueError:
        return f"signal {number}"


_warm_up_lock = threading.Lock()
_warm_up_thread: threading.Thread | None = None


def warm_up_analyzer() -> threading.Thread:
    """Start importing torch's Flight Recorder analyzer (:func:`agent.verdict.warm_up`) on a
    daemon thread, once per process; later calls return the same thread (alive or finished).
    Never raises: torch is optional and a failed import only leaves ``Op.match`` out of a verdict."""
    global _warm_up_thread
    with _warm_up_lock:
        if _warm_up_thread is None:
            _warm_up_thread = threading.Thread(target=warm_up, name="servewatch-fr-analyzer", daemon=True)
            _warm_up_thread.start()
        return _warm_up_thread


def read_steps(pids: Sequence[int], socket_dir: Path | None = None) -> dict[int, int]:
    """Forward-step counters of ``pids`` that have an SDK counter file (tmpfs reads)."""
    out: dict[int, int] = {}
    for pid in pids:
        snap = read_counter(counter_path(pid, socket_dir))
        if snap is not None and snap.pid == pid:
            out[pid] = snap.forward_ct
    return out


def _read_json(path: str) -> Any:
    p = Path(path)
    try:
        if p.stat().st_size > _MAX_ARTIFACT_BYTES:
            return None
        return json.loads(p.read_bytes())
    except (OSError, ValueError):
        return None


class VerdictJudge:
    """The two calls :class:`agent.incidents.IncidentManager` makes around an incident.

    Args:
        shm_dir: folder of the SDK's counter files (default: the SDK's).
    """

    def __init__(self, *, shm_dir: Path | None = None, warm_up: bool = True) -> None:
        """Args:
        shm_dir: folder of the SDK counter files (default: the SDK's).
        warm_up: start loading torch's analyzer when a multi-target incident opens (a watching
            agent); a one-shot ``dump`` sets it off: it ends in a second, and ``Op.match`` is
            only asked when two ranks' signatures differ (then it is imported on the spot).
        """
        self.shm_dir = shm_dir
        self.warm_up = warm_up

    def opened(self, targets: Sequence[Target]) -> dict[int, int]:
        """Step counters when the incident opens (microseconds; called on the event loop).

        With more than one target, also starts importing torch's Flight Recorder analyzer
        (:func:`agent.verdict.warm_up`, seconds, once per process) on a daemon thread, so it is
        loaded while the incident's evidence is gathered rather than in :meth:`decide`. A single
        process never needs it (no cross-rank comparison), and an agent that only watches never
        imports torch (about 200 MB of RSS and a larger heap for the garbage collector to walk).
        """
        if self.warm_up and len(targets) > 1:
            warm_up_analyzer()
        return read_steps([t.pid for t in targets], self.shm_dir)

    async def decide(
        self, targets: Sequence[Target], results: Sequence[ActionResult], cause: Event | None, steps_before: dict[int, int]
    ) -> Verdict | None:
        """The verdict, or ``None`` for a single process with no distributed evidence."""
        return await anyio.to_thread.run_sync(self._decide, list(targets), list(results), cause, steps_before)

    def _decide(
        self, targets: list[Target], results: list[ActionResult], cause: Event | None, steps_before: dict[int, int]
    ) -> Verdict | None:
        steps_after = read_steps([t.pid for t in targets], self.shm_dir)
        exited_pid = cause.pid if isinstance(cause, TargetExited) else None
        everyone: list[tuple[Target, bool]] = [(t, t.pid == exited_pid) for t in targets]
        if isinstance(cause, TargetExited) and all(t.pid != cause.pid for t in targets):
            everyone.insert(0, (Target(pid=cause.pid, title=cause.title), True))
        groups = job_groups([t for t, _ in everyone])
        verdicts: list[tuple[list[int], Verdict]] = []
        for pids in groups:
            members = [(t, exited) for t, exited in everyone if t.pid in pids]
            verdict = self._decide_group(members, results, cause, steps_before, steps_after)
            if verdict is not None:
                verdicts.append((pids, verdict))
        if not verdicts:
            return None
        trigger = getattr(cause, "pid", None)
        return pick_incident_verdict(verdicts, trigger if isinstance(trigger, int) else None, len(groups))

    def _decide_group(
        self,
        everyone: list[tuple[Target, bool]],
        results: list[ActionResult],
        cause: Event | None,
        steps_before: dict[int, int],
        steps_after: dict[int, int],
    ) -> Verdict | None:
        """The verdict of one job (one process tree's ranks); ``None``: a lone process with
        neither a stack nor a Flight Recorder result. A lone process known by pid alone (no rank
        from torch.distributed, its title or ``RANK``) is judged as one process, not as rank 0
        of a job (:func:`agent.verdict.decide`, rule 0)."""
        pids = {t.pid for t, _ in everyone}
        dumps = {r.pid: r for r in results if r.action == Action.PYSPY_DUMP and r.pid in pids}
        frs = {r.pid: r for r in results if r.action == Action.FLIGHTREC_DUMP and r.pid in pids}
        if len(everyone) < 2 and not frs and not dumps:
            return None  # nothing read of it
        ranks: dict[int, int] = {}
        for target, _ in everyone:
            fr = frs.get(target.pid)
            rank = fr.attributes.get("servewatch.flightrec.rank") if fr is not None else None
            if not isinstance(rank, int):
                rank = rank_from_title(target.title)
            if isinstance(rank, int) and rank not in ranks.values():
                ranks[target.pid] = rank
        ranked = set(ranks)  # the others are numbered here, not ranks the job gave them
        free = (r for r in range(10**6) if r not in ranks.values())
        for target, _ in everyone:
            if target.pid not in ranks:
                ranks[target.pid] = next(free)

        evidence: list[RankEvidence] = []
        for target, exited in everyone:
            frame_class, frame = FrameClass.UNKNOWN, ""
            dump = dumps.get(target.pid)
            if dump is not None and dump.outcome is Outcome.OK:
                path = next((p for p in dump.artifact_paths if p.endswith(".json")), None)
                if path is not None:
                    try:
                        frame_class, frame = classify_stack(parse_dump(Path(path).read_bytes()))
                    except (OSError, ValueError) as exc:
                        log.warning("cannot read %s for the verdict: %s", path, exc)
            fr_dump = None
            fr = frs.get(target.pid)
            if fr is not None and fr.outcome is Outcome.OK and fr.artifact_paths:
                doc = _read_json(fr.artifact_paths[0])
                if isinstance(doc, dict) and isinstance(doc.get("trace"), dict):
                    fr_dump = doc["trace"]
            if exited:
                alive = False
            else:
                state = process_state(target.pid, create_time_s=target.create_time_s)
                alive = state not in (ProcessState.GONE, ProcessState.ZOMBIE)
            evidence.append(
                RankEvidence(
                    rank=ranks[target.pid],
                    pid=target.pid,
                    alive=alive,
                    exited_first=exited,
                    exit_signal=signal_name(cause.signal) if exited and isinstance(cause, TargetExited) else None,
                    exit_code=cause.exit_code if exited and isinstance(cause, TargetExited) else None,
                    frame_class=frame_class,
                    frame=frame,
                    steps_before=steps_before.get(target.pid),
                    steps_after=steps_after.get(target.pid),
                    fr=fr_dump,
                    ranked=target.pid in ranked,
                )
            )
        return decide(evidence)


def job_groups(targets: Sequence[Target]) -> list[list[int]]:
    """The targets' pids grouped into jobs: ranks of one server, never of two.

    A host-wide ``--match`` can pick the ranks of two servers; numbering them as one job mixes
    pids of both and blames one server's rank for another's stall. Ranks are grouped by the
    process they hang off (:func:`agent.targets.server_of`: a server's workers are its children, each server
    its own tree); a target whose tree is unreadable (gone and reaped) joins the one job when
    there is only one, else stands alone.

    Returns:
        Lists of pids (dump order within a job), jobs ordered by their first pid.
    """
    pids = {t.pid for t in targets}
    by_server: dict[int, list[int]] = {}
    orphans: list[int] = []
    for target in targets:
        server = server_of(target.pid, pids)
        if server is None:
            orphans.append(target.pid)
        else:
            by_server.setdefault(server, []).append(target.pid)
    groups = list(by_server.values())
    if len(groups) == 1:
        groups[0] = orphans + groups[0]
    else:
        groups += [[pid] for pid in orphans]
    return sorted(groups, key=min) if groups else []


#: Which job's verdict is the incident's when no trigger pid picks it: a hung one with a
#: culprit first, strongest kind first.
_KIND_ORDER = ("dead", "desync", "behind", "compute", "single", "unknown", "progressing")


def pick_incident_verdict(verdicts: Sequence[tuple[Sequence[int], Verdict]], trigger_pid: int | None, jobs: int) -> Verdict:
    """The incident's verdict among its jobs' verdicts.

    The job of the process whose exit or stall opened the incident, when known; else the job
    that stalled (hung, with a culprit, strongest kind). With more than one job the reason says
    which one was judged.
    """
    chosen = next(((pids, v) for pids, v in verdicts if trigger_pid is not None and trigger_pid in pids), None)
    if chosen is None:
        def rank(item: tuple[Sequence[int], Verdict]) -> tuple[int, int, int]:
            v = item[1]
            kind = _KIND_ORDER.index(v.kind) if v.kind in _KIND_ORDER else len(_KIND_ORDER)
            return (not v.hung, not v.culprit_ranks, kind)

        chosen = min(verdicts, key=rank)
    pids, verdict = chosen
    if jobs < 2:
        return verdict
    note = f"job of pids {','.join(map(str, sorted(pids)))} (1 of {jobs} process trees matched)"
    return replace(verdict, evidence=(*verdict.evidence, note))
