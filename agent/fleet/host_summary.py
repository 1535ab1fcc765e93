"""A host's compact evidence summary, made from what its own verdict judged, for the job verdict.

Owns :func:`host_evidence` (the judge's :class:`agent.verdict.rules.Evidence` of this host's server ->
:class:`agent.fleet.messages.Evidence`), :func:`fr_window` (the part of a Flight Recorder dump
the job verdict needs) and :func:`world_size_of`.

The summary is what the coordinator needs to judge the whole job and nothing bulky: per rank
the global rank, how it is (alive, or how it ended), the class of its stack and the frame it is
in, its step counters, and a window of its Flight Recorder: per process group the entries from
two before the first collective not completed, at most :data:`WINDOW_ENTRIES`, without stack
frames. The full stacks, recorder dumps and profiles stay in the bundle, which the summary names.
About 2 KB per rank; kept under the API's body limit by dropping the windows first (:func:`fit`).

Imports :mod:`agent.verdict.rules` (types) and :mod:`agent.fleet.messages`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agent.fleet.messages import Evidence, RankSummary
from agent.verdict.rules import Evidence as ServerEvidence
from agent.verdict.rules import RankEvidence

__all__ = ["WINDOW_ENTRIES", "fit", "fr_window", "host_evidence", "world_size_of"]

#: Most Flight Recorder entries kept per process group and rank.
WINDOW_ENTRIES = 6
#: Most process groups kept per rank.
WINDOW_GROUPS = 4
#: Entry fields kept (torch's analyzer reads these; stack frames are left in the bundle).
_ENTRY_FIELDS = (
    "record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name",
    "input_sizes", "output_sizes", "input_dtypes", "output_dtypes", "state", "is_p2p", "retired",
    "time_created_ns", "timeout_ms",
)


def _pg_completed(status: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    if isinstance(status, Mapping):
        for pg, st in status.items():
            if isinstance(st, Mapping):
                try:
                    out[str(pg)] = int(st.get("last_completed_collective", -1))
                except (TypeError, ValueError):
                    continue
    return out


def fr_window(trace: Mapping[str, Any], *, entries: int = WINDOW_ENTRIES) -> dict[str, Any]:
    """The part of one rank's Flight Recorder dump the job verdict reads.

    Per process group: collective entries from ``last_completed - 2`` on (at most ``entries``,
    the newest), fields :data:`_ENTRY_FIELDS`; plus ``version``, ``pg_config`` and ``pg_status``
    as they are.
    """
    completed = _pg_completed(trace.get("pg_status"))
    by_pg: dict[str, list[dict[str, Any]]] = {}
    for entry in trace.get("entries") or ():
        if not isinstance(entry, Mapping) or entry.get("is_p2p"):
            continue
        pg = str(entry.get("pg_id", (entry.get("process_group") or ["?"])[0]))
        seq = entry.get("collective_seq_id")
        if not isinstance(seq, int) or seq < completed.get(pg, -1) - 2:
            continue
        by_pg.setdefault(pg, []).append({k: entry[k] for k in _ENTRY_FIELDS if k in entry})
    kept: list[dict[str, Any]] = []
    for pg in sorted(by_pg, key=lambda p: (p != "0", p))[:WINDOW_GROUPS]:
        kept += by_pg[pg][-entries:]
    kept.sort(key=lambda e: (e.get("record_id", 0), e.get("collective_seq_id", 0)))
    return {"version": trace.get("version"), "pg_config": trace.get("pg_config") or {},
            "pg_status": trace.get("pg_status") or {}, "entries": kept}


def world_size_of(trace: Mapping[str, Any]) -> int | None:
    """The size of the largest process group in a dump's ``pg_config`` (the default group)."""
    config = trace.get("pg_config")
    if not isinstance(config, Mapping):
        return None
    sizes = []
    for value in config.values():
        ranks = value.get("ranks") if isinstance(value, Mapping) else None
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except ValueError:
                ranks = None
        if isinstance(ranks, list) and ranks:
            sizes.append(len(ranks))
    return max(sizes) if sizes else None


def _summary(e: RankEvidence) -> RankSummary:
    return RankSummary(
        rank=e.number, pid=e.pid, title=(e.title or "")[:255], label=(e.label or "")[:64], alive=e.alive,
        exited_first=e.exited_first, exit_signal=e.exit_signal, exit_code=e.exit_code, oom_killed=e.oom_killed,
        exit_time_ns=e.exit_time_ns, frame_class=e.frame_class.value, frame=(e.frame or "")[:512],
        p2p=e.p2p if e.p2p in ("recv", "send", "send/recv", "wait") else "",
        steps_before=e.steps_before, steps_after=e.steps_after, pending=e.pending,
        fr=fr_window(e.fr) if isinstance(e.fr, Mapping) else None,
    )


def host_evidence(
    *,
    job: str,
    host_name: str,
    agent_id: str,
    trace_id: str,
    incident_id: str,
    bundle_dir: str,
    judged: Sequence[ServerEvidence],
    verdict: Any = None,
) -> Evidence:
    """The compact evidence summary of one host's incident.

    Args:
        judged: what the host's verdict judged, per server (:attr:`agent.verdict.judge.VerdictJudge.last_evidence`):
            its ranks are summarised (processes without a rank stay the host's business).
        verdict: the host's own :class:`agent.verdict.rules.Verdict`, if any.

    Returns:
        The :class:`~agent.fleet.messages.Evidence`.
    """
    ranks: dict[int, RankSummary] = {}
    world: int | None = None
    for server in judged:
        world = world or server.world_size
        for e in server.ranks:
            if e.number not in ranks:
                ranks[e.number] = _summary(e)
            if world is None and isinstance(e.fr, Mapping):
                world = world_size_of(e.fr)
    summary = None
    if verdict is not None:
        summary = {k: v for k, v in verdict.to_json().items() if k in ("kind", "reason", "confidence", "culprit_ranks", "hung")}
    return Evidence.model_validate({
        "job": job, "host.name": host_name, "agent_id": agent_id, "trace_id": trace_id, "incident_id": incident_id,
        "bundle_dir": bundle_dir[:4096], "ranks": [ranks[r] for r in sorted(ranks)], "verdict": summary, "world_size": world,
    })


def fit(evidence: Evidence, max_bytes: int) -> bytes:
    """``evidence`` as JSON of at most ``max_bytes``: Flight Recorder windows are dropped (status
    kept) when too big, then frames are cut. Returns the encoded body."""
    body = evidence.model_dump_json(by_alias=True).encode()
    if len(body) <= max_bytes:
        return body
    slim = evidence.model_copy(update={"ranks": [
        r.model_copy(update={"fr": {k: v for k, v in (r.fr or {}).items() if k != "entries"} or None}) for r in evidence.ranks
    ]})
    body = slim.model_dump_json(by_alias=True).encode()
    if len(body) <= max_bytes:
        return body
    slim = slim.model_copy(update={"ranks": [r.model_copy(update={"frame": r.frame[:80], "fr": None}) for r in slim.ranks]})
    return slim.model_dump_json(by_alias=True).encode()
