"""A job incident's identity, derived from facts every host of the job agrees on.

Owns :class:`JobKey`, :func:`time_bucket_key` (what names the trace), :func:`stuck_collective`
(what the job verdict records of the ranks' Flight Recorders) and :func:`job_trace` (key ->
trace id and the job's root span id).

Why derived, not chosen: in a lockstep hang every host's watchdog fires within milliseconds, and
a trace id chosen at random on each host gives N traces that must then be merged by messages
(a race that lost 1 in 3 runs). Why from the detection time only: it costs nothing, so the
capture never waits for a name. Reading the ranks' Flight Recorders first (the stuck collective,
the same on every host) took 1.35-4.97 s on a loaded host against a 2 s bound and gave the key
in 6 of 73 reads, while the capture waited.

* ``time``: the detection time floored to ``bucket_s``. Hosts that detect in the same bucket
  agree with no message; a host whose detection fell into the next bucket is corrected by the
  coordinator's answer (:mod:`agent.fleet.job`), which moves its incident, recorded.
* ``fr``: the stuck collective: process group ``0`` (the default group, which holds every rank)
  and the Flight Recorder sequence id of the first collective not completed by all ranks. A
  symmetric collective completes on one rank only once every rank entered it, so in a hang each
  rank's ``last_completed_collective`` is the same number K-1 (the culprit never entered K, the
  others wait in K): ``min(last completed over the ranks) + 1`` is K (measured on a real gloo
  job: ranks waiting in all_reduce #8 and the culprit that never entered it all report
  ``last_completed_collective`` 7). The coordinator derives it from every host's evidence, after
  the capture; an older agent may still name a report's key by it (parsed, never derived here).

The trace id is ``sha256("servewatch/job/<job>/<kind>/<value>")[:16 bytes]`` and the job's root
span id ``sha256("servewatch/job-root/<trace id>")[:8 bytes]``: every host's incident span hangs
under that one root, which the coordinator emits with the job verdict (one root by
construction). Imports the standard library only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_PG", "JobKey", "job_trace", "repeat_trace", "stuck_collective", "time_bucket_key"]

#: Process group whose sequence ids every rank shares (torch's default group, ``pg_status`` key).
DEFAULT_PG = "0"


@dataclass(frozen=True, slots=True)
class JobKey:
    """What a job incident is named by.

    Attributes:
        kind: ``fr`` (stuck collective) or ``time`` (detection time bucket).
        value: ``"<pg>:<seq>"`` for ``fr``; the bucket's start in seconds since the epoch for ``time``.
    """

    kind: str
    value: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"

    @classmethod
    def parse(cls, text: str) -> JobKey:
        """``"fr:0:8"`` / ``"time:1796138300"`` back into a key.

        Raises:
            ValueError: not of that shape.
        """
        kind, sep, value = text.partition(":")
        if not sep or kind not in ("fr", "time") or not value or len(value) > 64:
            raise ValueError(f"bad job key {text[:80]!r}")
        return cls(kind, value)


def stuck_collective(traces: Iterable[Mapping[str, Any]], pg: str = DEFAULT_PG) -> JobKey | None:
    """The first collective of ``pg`` not completed by all of the given ranks.

    Args:
        traces: Flight Recorder dumps (``_dump_fr_trace_json``: ``pg_status`` maps a group to
            ``last_completed_collective``, a string or an int), one per rank; the windows of
            the job's evidence (:func:`agent.fleet.host_summary.fr_window`) keep ``pg_status``.
        pg: the process group (torch's default group ``0``).

    Returns:
        ``JobKey("fr", "<pg>:<K>")`` with K = min(last completed) + 1, or ``None`` when no dump
        has that group's status (no recorder, an empty one, another torch).
    """
    completed: list[int] = []
    for trace in traces:
        status = trace.get("pg_status") if isinstance(trace, Mapping) else None
        entry = status.get(pg) if isinstance(status, Mapping) else None
        if not isinstance(entry, Mapping):
            continue
        try:
            completed.append(int(entry["last_completed_collective"]))
        except (KeyError, TypeError, ValueError):
            continue
    if not completed:
        return None
    return JobKey("fr", f"{pg}:{min(completed) + 1}")


def time_bucket_key(time_unix_nano: int, bucket_s: float) -> JobKey:
    """The detection time bucket (``bucket_s`` wide, aligned on the epoch)."""
    width_ns = max(1, int(bucket_s * 1e9))
    start_s = (time_unix_nano // width_ns) * width_ns // 1_000_000_000
    return JobKey("time", str(start_s))


def _digest(text: str, size: int) -> str:
    digest = hashlib.sha256(text.encode()).digest()[:size]
    if not any(digest):  # all-zero ids are invalid in W3C trace context
        digest = b"\x01" + digest[1:]
    return digest.hex()


def job_trace(job: str, key: JobKey) -> tuple[str, str]:
    """``(trace id, root span id)`` hex of the job incident named by ``key``.

    Returns:
        32 and 16 lowercase hex digits; the same on every host for the same job and key.
    """
    trace_id = _digest(f"servewatch/job/{job}/{key.kind}/{key.value}", 16)
    return trace_id, root_span_of(trace_id)


def root_span_of(trace_id: str) -> str:
    """The job root span id of ``trace_id`` (16 hex digits)."""
    return _digest(f"servewatch/job-root/{trace_id}", 8)


def repeat_trace(trace_id: str, n: int) -> tuple[str, str]:
    """A fresh ``(trace id, root span id)`` for the ``n``-th job incident whose key repeated an
    earlier one's (a restarted job hanging at the same collective): the coordinator hands it out
    so that two incidents never share a trace."""
    fresh = _digest(f"servewatch/job-again/{trace_id}/{n}", 16)
    return fresh, root_span_of(fresh)
