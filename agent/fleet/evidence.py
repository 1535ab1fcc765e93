"""A host's compact evidence summary, made from its incident's bundle, for the job verdict.

Owns :func:`host_evidence` (an incident record -> :class:`agent.fleet.messages.Evidence`),
:func:`fr_window` (the part of a Flight Recorder dump the job verdict needs) and
:func:`local_rank` (a target's global rank as this host knows it).

The summary is what the coordinator needs to judge the whole job and nothing bulky: per rank
the global rank, whether it lives, the class of its stack and the hung frame (read back from the
py-spy JSON the incident wrote, with the same rule as the host's own verdict), and a window of
its Flight Recorder: per process group the entries from two before the first collective not
completed, at most :data:`WINDOW_ENTRIES`, without stack frames. The full stacks, recorder dumps
and profiles stay in the bundle, which the summary names. Size: about 2 KB per rank, kept under
the API's body limit by dropping the windows first (:func:`fit`).

Imports :mod:`agent.events`, :mod:`agent.ranks`, :mod:`agent.stacks`, :mod:`agent.targets`,
:mod:`agent.verdict` and :mod:`agent.fleet.messages`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.events import Action, ActionResult, Outcome
from agent.fleet.messages import Evidence, RankSummary
from agent.ranks import rank_from_title, rank_label

__all__ = ["WINDOW_ENTRIES", "fit", "fr_window", "host_evidence", "local_rank", "world_size_of"]

log = logging.getLogger("servewatch.fleet.evidence")

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
#: Largest artifact read back, bytes.
_MAX_READ_BYTES = 64 * 1024 * 1024


def local_rank(title: str, environ: Mapping[str, str] | None = None) -> int | None:
    """A target's global rank: ``RANK`` from its environment, else the TP index of its title.

    A title whose every parallel index is 0 (``sglang::scheduler_DP0_TP0``) is rank 0; one with
    a non-zero DP/PP index and TP0 is not rank 0 (its TP index repeats across groups), so it
    gets ``None`` unless ``RANK`` says.
    """
    raw = (environ or {}).get("RANK", "")
    if raw.isdigit():
        return int(raw)
    tp = rank_from_title(title)
    if tp is None:
        return None
    others = [part for part in rank_label(title).split("_") if part and not part.startswith("TP")]
    if tp == 0 and any(int(part.lstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZ_") or 0) for part in others):
        return None
    return tp


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

    Per process group: entries from ``last_completed - 2`` on (at most ``entries``, the newest),
    collective entries only, fields :data:`_ENTRY_FIELDS`; plus ``version``, ``pg_config`` and
    ``pg_status`` as they are.
    """
    completed = _pg_completed(trace.get("pg_status"))
    by_pg: dict[str, list[dict[str, Any]]] = {}
    for entry in trace.get("entries") or ():
        if not isinstance(entry, Mapping) or entry.get("is_p2p"):
            continue
        pg = str(entry.get("pg_id", (entry.get("process_group") or ["?"])[0]))
        seq = entry.get("collective_seq_id")
        if not isinstance(seq, int):
            continue
        if seq < completed.get(pg, -1) - 2:
            continue
        by_pg.setdefault(pg, []).append({k: entry[k] for k in _ENTRY_FIELDS if k in entry})
    kept: list[dict[str, Any]] = []
    for pg in sorted(by_pg, key=lambda p: (p != "0", p))[:WINDOW_GROUPS]:
        kept += by_pg[pg][-entries:]
    kept.sort(key=lambda e: (e.get("record_id", 0), e.get("collective_seq_id", 0)))
    out: dict[str, Any] = {"version": trace.get("version"), "pg_config": trace.get("pg_config") or {},
                           "pg_status": trace.get("pg_status") or {}, "entries": kept}
    return out


def world_size_of(trace: Mapping[str, Any]) -> int | None:
    """The size of the default process group per a dump's ``pg_config`` (its largest group)."""
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
        if isinstance(ranks, list):
            sizes.append(len(ranks))
    return max(sizes) if sizes else None


def _read_json(path: str) -> Any:
    p = Path(path)
    try:
        if p.stat().st_size > _MAX_READ_BYTES:
            return None
        return json.loads(p.read_bytes())
    except (OSError, ValueError):
        return None


def _stack(result: ActionResult | None) -> tuple[str, str]:
    if result is None or result.outcome is not Outcome.OK:
        return "unknown", ""
    path = next((p for p in result.artifact_paths if p.endswith(".json")), None)
    if path is None:
        return "unknown", ""
    from agent.stacks import parse_dump
    from agent.verdict import classify_stack

    try:
        frame_class, frame = classify_stack(parse_dump(Path(path).read_bytes()))
    except (OSError, ValueError) as exc:
        log.debug("cannot read %s: %s", path, exc)
        return "unknown", ""
    return str(frame_class), frame[:512]


def host_evidence(
    *,
    job: str,
    host_name: str,
    agent_id: str,
    trace_id: str,
    incident_id: str,
    bundle_dir: str,
    targets: Sequence[Any],
    results: Sequence[ActionResult],
    verdict: Any = None,
    alive: Mapping[int, bool] | None = None,
    exited: Mapping[int, tuple[str | None, int | None]] | None = None,
    steps: Mapping[int, tuple[int | None, int | None]] | None = None,
) -> Evidence:
    """The compact evidence summary of one host's incident.

    Args:
        targets: the incident's targets (``pid``, ``title``).
        results: its action results (py-spy dumps and Flight Recorder reads are read back).
        verdict: the host's own :class:`agent.verdict.Verdict`, if any.
        alive: pid -> process still running (default: alive).
        exited: pid -> ``(signal name, exit code)`` of the rank whose exit opened the incident.
        steps: pid -> forward-step counter when the incident opened and when its evidence was in.

    Returns:
        The :class:`~agent.fleet.messages.Evidence` (never raises for unreadable artifacts).
    """
    dumps = {r.pid: r for r in results if r.action == Action.PYSPY_DUMP and r.pid is not None}
    frs = {r.pid: r for r in results if r.action == Action.FLIGHTREC_DUMP and r.pid is not None}
    ranks: list[RankSummary] = []
    world: int | None = None
    used: set[int] = set()
    for target in targets:
        fr_result = frs.get(target.pid)
        rank = fr_result.attributes.get("servewatch.flightrec.rank") if fr_result is not None else None
        if not isinstance(rank, int):
            rank = local_rank(target.title)
        window = None
        if fr_result is not None and fr_result.outcome is Outcome.OK and fr_result.artifact_paths:
            doc = _read_json(fr_result.artifact_paths[0])
            trace = doc.get("trace") if isinstance(doc, dict) else None
            if isinstance(trace, dict):
                window = fr_window(trace)
                world = world or world_size_of(trace)
        if not isinstance(rank, int) or rank in used:
            continue  # a process that is no rank of the job is this host's business only
        used.add(rank)
        frame_class, frame = _stack(dumps.get(target.pid))
        signal, code = (exited or {}).get(target.pid, (None, None))
        before, after = (steps or {}).get(target.pid, (None, None))
        ranks.append(RankSummary(
            rank=rank, pid=target.pid, title=(target.title or "")[:255], alive=(alive or {}).get(target.pid, True),
            exited_first=target.pid in (exited or {}), exit_signal=signal, exit_code=code,
            frame_class=frame_class, frame=frame, steps_before=before, steps_after=after, fr=window,
        ))
    summary = None
    if verdict is not None:
        summary = {k: v for k, v in verdict.to_json().items() if k in ("kind", "reason", "confidence", "culprit_ranks", "hung")}
    return Evidence.model_validate({
        "job": job, "host.name": host_name, "agent_id": agent_id, "trace_id": trace_id, "incident_id": incident_id,
        "bundle_dir": bundle_dir[:4096], "ranks": ranks, "verdict": summary, "world_size": world,
    })


def fit(evidence: Evidence, max_bytes: int) -> bytes:
    """``evidence`` as JSON of at most ``max_bytes``: Flight Recorder windows are dropped (status
    kept) when too big, then hung frames are cut. Returns the encoded body."""
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
