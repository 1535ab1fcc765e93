"""Incident summaries for the CLI: a few human lines, or a JSON-ready dict.

Owns presentation of an incident right after it ran. What it shows is read from the incident's
:class:`~agent.host.manifest.Manifest` (:meth:`~agent.incidents.manager.IncidentRecord.to_manifest`), the
model ``manifest.json`` holds and ``servewatch timeline`` reads back, so the summary, the bundle
and the timeline say the same thing (titles and argv redacted alike). Imports only
:mod:`agent.incidents.manager` (the record), :mod:`agent.host.manifest` and :mod:`agent.model.events`.
"""

from __future__ import annotations

from typing import Any

from agent.host.manifest import IncidentState, Manifest, ManifestAction, stack_errors
from agent.incidents.manager import IncidentRecord
from agent.model.events import Action, ExitFact, Outcome

__all__ = ["HUNG_FRAME_ATTR", "exit_lines", "incident_summary", "late_result_lines", "summary_lines"]

#: Span attribute of a ``pyspy.dump`` result holding the innermost frame of the active thread.
HUNG_FRAME_ATTR = "servewatch.pyspy.hung_frame"
#: Span attribute of a ``cuda.coredump`` result not armed because the host has no CUDA driver.
NO_GPU_ATTR = "servewatch.coredump.no_gpu"
#: Span attributes of a ``pyspy.dump`` result: labels of the idle (waiting for work) and stuck threads.
IDLE_THREADS_ATTR = "servewatch.pyspy.idle_threads"
STUCK_THREADS_ATTR = "servewatch.pyspy.stuck_threads"
#: Span attribute of a ``pyspy.dump`` result: the target was stopped (state T) and read --nonblocking.
TARGET_STOPPED_ATTR = "servewatch.pyspy.target_stopped"


def _title(m: Manifest, pid: int | None) -> str:
    for t in m.targets:
        if t.pid == pid:
            return t.title
    return ""


def _result_dict(m: Manifest, a: ManifestAction) -> dict[str, Any]:
    d: dict[str, Any] = {
        "action": str(a.action),
        "pid": a.pid,
        "title": _title(m, a.pid),
        "outcome": str(a.outcome),
        "detail": a.detail,
        "duration_s": round(a.elapsed_s, 3),
        "artifacts": list(a.artifact_paths),
    }
    hung = a.attributes.get(HUNG_FRAME_ATTR)
    if hung:
        d["hung_frame"] = hung
    size = a.attributes.get("servewatch.coredump.size_bytes")
    if size is not None:
        d["coredump_size_bytes"] = size
    return d


def _outcome_counts(m: Manifest) -> dict[str, int]:
    counts: dict[str, int] = {}
    for a in m.actions:
        counts[str(a.outcome)] = counts.get(str(a.outcome), 0) + 1
    return counts


def incident_summary(record: IncidentRecord) -> dict[str, Any]:
    """Machine-readable summary (``--json``): id, trigger, bundle, per-process outcomes.

    Returns:
        ``incident_id``, ``trigger``, ``detail``, ``trace_id``, ``bundle_path``,
        ``manifest_path``, ``duration_s`` (seconds, 3 decimals), ``processes`` (pid, title),
        ``actions`` (action, pid, title, outcome, detail, duration_s, artifacts, and
        ``hung_frame`` / ``coredump_size_bytes`` when recorded), ``inflight_requests`` (count),
        ``outcomes`` (outcome -> count), ``state``, ``phases_pending``, ``interrupted_reason``
        and ``verdict`` (or ``None``).
    """
    m = record.to_manifest()
    return {
        "incident_id": m.incident_id,
        "trigger": str(m.trigger),
        "detail": m.detail,
        "trace_id": m.trace_id,
        "bundle_path": str(record.bundle_dir),
        "manifest_path": str(record.manifest_path),
        "duration_s": round(m.elapsed_s, 3),
        "processes": [{"pid": t.pid, "title": t.title} for t in m.targets],
        "actions": [_result_dict(m, a) for a in m.actions],
        "inflight_requests": m.inflight_requests or 0,
        "outcomes": _outcome_counts(m),
        "state": m.state.value,
        "phases_pending": [str(p) for p in m.phases_pending],
        "interrupted_reason": m.interrupted_reason,
        "verdict": m.verdict.model_dump(mode="json", exclude={"duration_s"}) if m.verdict is not None else None,
    }


def _result_line(m: Manifest, a: ManifestAction) -> str:
    who = f"pid {a.pid} {_title(m, a.pid)}".rstrip() if a.pid is not None else ""
    line = f"  {a.action!s:<15} {who:<32} {a.outcome!s:<17} {a.elapsed_s:6.2f}s"
    hung = a.attributes.get(HUNG_FRAME_ATTR)
    idle = a.attributes.get(IDLE_THREADS_ATTR) or []
    if a.attributes.get(TARGET_STOPPED_ATTR) and a.pid is not None:  # why it does not run: first
        line += f"  stopped (state T: SIGSTOP or a debugger; `kill -CONT {a.pid}` resumes it);"
    if hung:
        line += f"  hung frame: {hung}"
    elif a.outcome == Outcome.OK and a.action == Action.PYSPY_DUMP and idle:
        line += "  all idle (waiting for work): nothing is stuck"
    elif a.outcome != Outcome.OK and a.detail:
        line += f"  {a.detail}"
    if idle and isinstance(idle, list):
        line += _threads_text(a, idle)
    return line


def _threads_text(a: ManifestAction, idle: list[Any]) -> str:
    """``; stuck threads: ...; idle: ...`` of a stack dump; the idle threads by name (py-spy lists
    threads in no fixed order, so two dumps of the same process read alike)."""
    stuck = a.attributes.get(STUCK_THREADS_ATTR) or []
    stuck_text = ", ".join(map(str, stuck)) if isinstance(stuck, list) else str(stuck)
    return f"; stuck threads: {stuck_text or 'none'}; idle: {', '.join(sorted(map(str, idle)))}"


def late_result_lines(record: IncidentRecord, already: int) -> list[str]:
    """Lines for results that came after the summary (a profile): ``already`` results were shown."""
    m = record.to_manifest()
    interrupted = m.state is IncidentState.INTERRUPTED
    lines = [f"Incident {m.incident_id}: " + ("interrupted" if interrupted else "finished")]
    lines += [_result_line(m, a) for a in m.actions[already:]]
    if interrupted and m.interrupted_reason:
        lines.append(f"  interrupted: {m.interrupted_reason}")
    return lines


#: outcomes of a target that exited before or while it was dumped (a dead rank, not an error)
GONE_OUTCOMES = (Outcome.DEAD, Outcome.NO_SUCH_PROCESS, Outcome.ZOMBIE)


def stack_dump_errors(record: IncidentRecord) -> int:
    """Targets whose stacks could not be captured for an error: the ``Errors: N`` of the summary
    and what makes ``servewatch dump`` exit 1.

    A ``pyspy.dump`` that ended ``ok``, ``dead`` / ``no_such_process`` / ``zombie`` (the target
    exited: that is evidence, not an error) or ``skipped`` (py-spy switched off) is no error;
    every other outcome (timed out, permission denied, not Python, py-spy missing or failed) is
    one.

    Returns:
        The number of such targets (0 when every rank's stacks are in, or explained).
    """
    return stack_errors(record.to_manifest().actions)  # the one rule timeline and report print too



def summary_lines(record: IncidentRecord) -> list[str]:
    """A short human summary: the verdict and its ``next:`` line (what to run or check next), the
    trigger, what ran, where the artifacts are, how to view them."""
    m = record.to_manifest()
    lines = _verdict_lines(m, record)
    lines.append(f"Incident {m.incident_id} ({m.trigger!s}): {m.detail}")
    lines += _action_lines(m)
    lines.append(_wrote_line(m, record))
    if m.state is IncidentState.INTERRUPTED:
        lines.append(f"Interrupted: {m.interrupted_reason or 'the agent stopped mid-incident'}; what was captured is kept")
    elif m.phases_pending:
        lines.append(f"Still running: {', '.join(map(str, m.phases_pending))} (appended when it ends)")
    lines.append(f"View: servewatch timeline {m.incident_id} --data-dir {record.bundle_dir.parent.parent}")
    return lines


def _verdict_lines(m: Manifest, record: IncidentRecord) -> list[str]:
    """The verdict, its ``next:`` line, and the server's own dump lines among its evidence."""
    if m.verdict is None:
        return []
    lines = [m.verdict.headline]  # the verdict comes first
    if m.verdict.next:  # then what to do about it
        lines.append(f"next: {m.verdict.next}")
    # the server's own watchdog fired too (its py-spy runs): said, not hidden in the bundle
    lines += [line for line in m.verdict.evidence if line in record.server_dump_lines]
    return lines


def _action_lines(m: Manifest) -> list[str]:
    """One line per action (a host without GPU: one line for its coredumps), then the requests in flight."""
    no_gpu = [a for a in m.actions if a.action == Action.CUDA_COREDUMP and a.attributes.get(NO_GPU_ATTR)]
    lines = [_result_line(m, a) for a in m.actions if a not in no_gpu]
    if no_gpu:  # a CPU-only host: one quiet line, not an arming hint per rank (nothing to fix)
        lines.append(f"  cuda.coredump   none: no GPU/CUDA driver on this host ({len(no_gpu)} process(es))")
    if m.inflight_requests:
        lines.append(f"  {m.inflight_requests} request(s) in flight, listed in requests.json")
    return lines


def _wrote_line(m: Manifest, record: IncidentRecord) -> str:
    """``Wrote N stack dump(s) to ...``: the stack dumps by outcome."""
    dumps = [a for a in m.actions if a.action == Action.PYSPY_DUMP]
    ok = sum(1 for a in dumps if a.outcome == Outcome.OK)
    dead = sum(1 for a in dumps if a.outcome in GONE_OUTCOMES)
    skipped = sum(1 for a in dumps if a.outcome == Outcome.SKIPPED)  # switched off by configuration: no error
    return (
        f"Wrote {ok} stack dump(s) to '{record.bundle_dir}/'. Processes: {len(m.targets)}"
        + (f" Dead: {dead}" if dead else "")
        + (f" Skipped: {skipped}" if skipped else "")
        + f" Errors: {stack_dump_errors(record)}"
    )


#: How an exit status was learnt, in words (``ExitFact.source``).
_SOURCE_WORDS = {
    "owner": "reaped by servewatch",
    "waitid": "read with waitid",
    "kernel": "the kernel's exit event",
    "zombie": "/proc while a zombie",
    "sdk": "its SDK's death notice",
    "runtime": "its container runtime's exit record",
    "none": "no source could tell",
}


def exit_lines(exits: list[tuple[Any, ExitFact]], outcomes: dict[int, str]) -> list[str]:
    """What ``run``/``launch`` saw of its targets' exits, printed when they stop: one line each,
    ``pid 42 'sglang::scheduler_TP0': exit code 0 (stopped in order) [the kernel's exit event]
    -> no incident: exited in order (exit code 0)``.

    Args:
        exits: ``(target, fact)`` in the order seen (:attr:`ProcessWatcher.exits`).
        outcomes: pid -> what the exit led to (:attr:`IncidentManager.exit_outcomes`).
    """
    lines = []
    for target, fact in exits:
        title = f" {target.title!r}" if getattr(target, "title", "") else ""
        led = outcomes.get(fact.pid, "")
        lines.append(f"pid {fact.pid}{title}: {fact.describe()} [{_SOURCE_WORDS.get(fact.source.value, fact.source.value)}]"
                     + (f" -> {led}" if led else ""))
    return lines
