"""Incident summaries for the CLI: a few human lines, or a JSON-ready dict.

Owns presentation of an :class:`~agent.incidents.IncidentRecord` right after it ran; imports
only :mod:`agent.incidents` and :mod:`agent.events`.
"""

from __future__ import annotations

from typing import Any

from agent.events import Action, ActionResult, Outcome
from agent.incidents import IncidentRecord

__all__ = ["HUNG_FRAME_ATTR", "incident_summary", "late_result_lines", "summary_lines"]

#: Span attribute of a ``pyspy.dump`` result holding the innermost frame of the active thread.
HUNG_FRAME_ATTR = "servewatch.pyspy.hung_frame"
#: Span attributes of a ``pyspy.dump`` result: labels of the idle (waiting for work) and stuck threads.
IDLE_THREADS_ATTR = "servewatch.pyspy.idle_threads"
STUCK_THREADS_ATTR = "servewatch.pyspy.stuck_threads"


def _title(record: IncidentRecord, pid: int | None) -> str:
    for t in record.targets:
        if t.pid == pid:
            return t.title
    return ""


def _result_dict(record: IncidentRecord, r: ActionResult) -> dict[str, Any]:
    d: dict[str, Any] = {
        "action": r.action,
        "pid": r.pid,
        "title": _title(record, r.pid),
        "outcome": r.outcome.value,
        "detail": r.detail,
        "duration_s": round(r.duration_s, 3),
        "artifacts": list(r.artifact_paths),
    }
    hung = r.attributes.get(HUNG_FRAME_ATTR)
    if hung:
        d["hung_frame"] = hung
    size = r.attributes.get("servewatch.coredump.size_bytes")
    if size is not None:
        d["coredump_size_bytes"] = size
    return d


def incident_summary(record: IncidentRecord) -> dict[str, Any]:
    """Machine-readable summary (``--json``): id, trigger, bundle, per-process outcomes."""
    o = record.opened
    return {
        "incident_id": o.incident_id,
        "trigger": o.trigger,
        "detail": o.detail,
        "trace_id": o.trace_id,
        "bundle_path": str(record.bundle_dir),
        "manifest_path": str(record.manifest_path),
        "duration_s": round(record.duration_s, 3),
        "processes": [{"pid": t.pid, "title": t.title} for t in record.targets],
        "actions": [_result_dict(record, r) for r in record.results],
        "inflight_requests": len(record.inflight),
        "outcomes": record.outcome_counts(),
        "state": record.state,
        "phases_pending": list(record.phases_pending),
        "interrupted_reason": record.interrupted_reason,
        "verdict": record.verdict.to_json() if record.verdict is not None else None,
    }


def _result_line(record: IncidentRecord, r: ActionResult) -> str:
    who = f"pid {r.pid} {_title(record, r.pid)}".rstrip() if r.pid is not None else ""
    line = f"  {r.action:<15} {who:<32} {r.outcome.value:<17} {r.duration_s:6.2f}s"
    hung = r.attributes.get(HUNG_FRAME_ATTR)
    idle = r.attributes.get(IDLE_THREADS_ATTR) or ()
    if hung:
        line += f"  hung frame: {hung}"
    elif r.outcome is Outcome.OK and r.action == Action.PYSPY_DUMP and idle:
        line += "  all idle (waiting for work): nothing is stuck"
    elif r.outcome is not Outcome.OK and r.detail:
        line += f"  {r.detail}"
    if idle and isinstance(idle, tuple):
        stuck = r.attributes.get(STUCK_THREADS_ATTR) or ()
        line += f"; stuck threads: {', '.join(map(str, stuck)) or 'none'}; idle: {', '.join(map(str, idle))}"
    return line


def late_result_lines(record: IncidentRecord, already: int) -> list[str]:
    """Lines for results that came after the summary (a profile): ``already`` results were shown."""
    lines = [f"Incident {record.opened.incident_id}: " + ("interrupted" if record.state == "interrupted" else "finished")]
    lines += [_result_line(record, r) for r in record.results[already:]]
    if record.state == "interrupted" and record.interrupted_reason:
        lines.append(f"  interrupted: {record.interrupted_reason}")
    return lines


def summary_lines(record: IncidentRecord) -> list[str]:
    """A short human summary: trigger, what ran, where the artifacts are, how to view them."""
    o = record.opened
    lines = [record.verdict.headline()] if record.verdict is not None else []  # the verdict comes first
    lines.append(f"Incident {o.incident_id} ({o.trigger}): {o.detail}")
    for r in record.results:
        lines.append(_result_line(record, r))
    if record.inflight:
        lines.append(f"  {len(record.inflight)} request(s) in flight, listed in requests.json")
    dumps = [r for r in record.results if r.action == Action.PYSPY_DUMP]
    ok = sum(1 for r in dumps if r.outcome is Outcome.OK)
    dead = sum(1 for r in dumps if r.outcome is Outcome.DEAD)
    lines.append(
        f"Wrote {ok} stack dump(s) to '{record.bundle_dir}/'. Processes: {len(record.targets)}"
        + (f" Dead: {dead}" if dead else "")
        + f" Errors: {len(dumps) - ok - dead}"
    )
    if record.state == "interrupted":
        lines.append(f"Interrupted: {record.interrupted_reason or 'the agent stopped mid-incident'}; what was captured is kept")
    elif record.phases_pending:
        lines.append(f"Still running: {', '.join(record.phases_pending)} (appended when it ends)")
    lines.append(f"View: servewatch timeline {o.incident_id} --data-dir {record.bundle_dir.parent.parent}")
    return lines
