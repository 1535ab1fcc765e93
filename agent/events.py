"""Event types that cross the bus, and the outcome vocabulary actors report in.

Owns: every event dataclass (past-tense facts), :class:`Outcome`, :class:`ActionResult`,
:class:`ComponentStatus`, and the names written into bundles and spans: :class:`Trigger` (why an
incident opened) and :class:`Action` (what ran; also the span name). Imports nothing from the rest of the agent, so watchers, actors,
incidents and exporters can all depend on it.

Every event is ``@dataclass(frozen=True, slots=True, kw_only=True)`` with ``time_unix_nano``
(wall clock, ns since the Unix epoch) and ``source`` (the component that published it).
Fields are immutable (tuples, frozensets, enums, mappings wrapped read-only). Big payloads
live in files: an event carries the path and ``size_bytes``.

Events whose class sets ``HIGH_RATE = True`` (steps, request spans, health probes) may be
dropped by the bus when a subscriber is slow; all others are delivered to every subscriber.
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

__all__ = [
    "Action",
    "ActionCompleted",
    "ActionResult",
    "AttributeValue",
    "ComponentStatus",
    "ComponentStatusChanged",
    "CoredumpTriggered",
    "Event",
    "FlightRecorderDumped",
    "HardSignalSent",
    "HealthCheckFailed",
    "HealthProbed",
    "HealthRecovered",
    "IncidentClosed",
    "IncidentOpened",
    "IncidentRetraced",
    "Outcome",
    "ProfileStarted",
    "ProfileStopped",
    "RequestSpanRecorded",
    "StacksDumped",
    "StepsAdvanced",
    "StrEnum",
    "TargetExited",
    "Trigger",
    "WatchdogRearmed",
    "WatchdogStalled",
    "WatcherStatusChanged",
    "frozen_attrs",
    "now_ns",
]

#: A value an OTel span attribute may hold.
AttributeValue = str | bool | int | float | tuple[str, ...] | tuple[int, ...] | tuple[float, ...]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """str-valued enum (stdlib ``enum.StrEnum`` from 3.11)."""

        def __str__(self) -> str:
            return str(self.value)


_EMPTY: Mapping[str, AttributeValue] = MappingProxyType({})


def now_ns() -> int:
    """Wall-clock time in ns since the Unix epoch (``time.time_ns()``)."""
    return time.time_ns()


def frozen_attrs(attrs: Mapping[str, AttributeValue] | None = None, /, **more: AttributeValue) -> Mapping[str, AttributeValue]:
    """Return a read-only copy of span attributes (lists become tuples)."""
    merged: dict[str, AttributeValue] = {}
    for source in (attrs or {}, more):
        for key, value in source.items():
            merged[key] = tuple(value) if isinstance(value, list) else value
    return MappingProxyType(merged)


class Outcome(StrEnum):
    """How an action ended. Outcomes cross the bus; exceptions do not."""

    OK = "ok"
    TIMED_OUT = "timed_out"
    PERMISSION_DENIED = "permission_denied"
    NO_SUCH_PROCESS = "no_such_process"
    ZOMBIE = "zombie"
    DEAD = "dead"  # the target exited or is a zombie (exit status in the attributes when known)
    NOT_PYTHON = "not_python"
    UNSUPPORTED = "unsupported"
    MISSING_TOOL = "missing_tool"
    NOT_ARMED = "not_armed"
    REFUSED = "refused"
    ALREADY_STOPPED = "already_stopped"
    SKIPPED = "skipped"
    NOT_ENABLED = "not_enabled"  # the target runs without the feature (Flight Recorder buffer 0)
    NO_SOURCE = "no_source"  # nothing to read the evidence from (no socket, server or pipe)
    FAILED = "failed"


class Trigger(StrEnum):
    """Why an incident opened (``IncidentOpened.trigger``, manifest ``trigger``, span attribute
    ``servewatch.incident.trigger``). Values are the strings bundles already hold; a bundle with
    another value (``unknown``, from a future agent) still loads as a plain string."""

    HEALTH = "health"  # the health check turned unhealthy
    STALL = "stall"  # busy with no forward progress (watchdog)
    EXIT = "exit"  # a target process ended
    MANUAL = "manual"  # `servewatch dump`, or asked over the agent API
    PEER = "peer"  # a peer of the same job asked us to capture (joins its trace)


class Action(StrEnum):
    """What ran for an incident: ``ActionResult.action``, the action's span name and the manifest's
    ``actions[].action``. Values are the strings bundles already hold."""

    PYSPY_DUMP = "pyspy.dump"  # Python/native stacks of one process (agent.actors.pyspy)
    FLIGHTREC_DUMP = "flightrec.dump"  # one rank's collective Flight Recorder (agent.actors.flightrec)
    CUDA_COREDUMP = "cuda.coredump"  # a CUDA GPU coredump (agent.actors.coredump)
    PROFILE_SESSION = "profile.session"  # a step-bounded profile (agent.actors.profiler)
    HARD_SIGNAL = "hard.signal"  # hard mode signalled a rank (agent.incidents)
    PEER_CAPTURE = "peer.capture"  # a job peer asked to capture (agent.fleet.peers)
    PEER_RESOLVE = "peer.resolve"  # resolving the job's peers failed (agent.fleet.peers)
    DETECTION_FOLDED = "fleet.detection_folded"  # a local detection folded into a job incident


class ComponentStatus(StrEnum):
    """Component health, after the OTel collector's componentstatus."""

    STARTING = "starting"
    OK = "ok"
    RECOVERABLE_ERROR = "recoverable_error"
    PERMANENT_ERROR = "permanent_error"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionResult:
    """What one action did to one target.

    Attributes:
        action: span name of the action (an :class:`Action`; a plain string from an old bundle).
        outcome: how it ended.
        pid: the target pid, or ``None`` for actions not bound to one process.
        retryable: ``False`` when trying again cannot help (the collector's "permanent").
        detail: one human line (why it failed, or what it found).
        start_time_unix_nano / end_time_unix_nano: wall-clock bounds, ns since the epoch.
        artifact_paths: files written (absolute paths).
        attributes: bounded span attributes summarising the result.
    """

    action: str
    outcome: Outcome
    pid: int | None = None
    retryable: bool = False
    detail: str = ""
    start_time_unix_nano: int = 0
    end_time_unix_nano: int = 0
    artifact_paths: tuple[str, ...] = ()
    attributes: Mapping[str, AttributeValue] = field(default_factory=lambda: _EMPTY)

    @property
    def duration_s(self) -> float:
        """Wall-clock duration in seconds."""
        return max(0, self.end_time_unix_nano - self.start_time_unix_nano) / 1e9

    def to_manifest(self) -> dict[str, object]:
        """JSON-ready dict for ``manifest.json``."""
        return {
            "action": self.action,
            "pid": self.pid,
            "outcome": self.outcome.value,
            "retryable": self.retryable,
            "detail": self.detail,
            "start_time_unix_nano": self.start_time_unix_nano,
            "end_time_unix_nano": self.end_time_unix_nano,
            "duration_s": round(self.duration_s, 6),
            "artifact_paths": list(self.artifact_paths),
            "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in self.attributes.items()},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of all events."""

    HIGH_RATE: ClassVar[bool] = False

    time_unix_nano: int = field(default_factory=now_ns)
    source: str = ""


# --- watchers -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthProbed(Event):
    """One health probe finished (high rate; may be dropped).

    ``error_class`` is ``""`` on success, else ``refused``, ``timeout``, ``5xx``, ``4xx`` or
    ``error``.
    """

    HIGH_RATE: ClassVar[bool] = True
    url: str
    ok: bool
    status_code: int | None
    latency_s: float
    error_class: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthCheckFailed(Event):
    """The health check turned unhealthy after ``consecutive_failures`` failed probes."""

    url: str
    status_code: int | None
    latency_s: float
    error_class: str
    consecutive_failures: int


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthRecovered(Event):
    """The health check is healthy again after ``consecutive_successes`` good probes."""

    url: str
    consecutive_successes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StepsAdvanced(Event):
    """A forward-step counter moved (high rate; may be dropped).

    Attributes:
        pid: process owning the counter (``None`` for a server-wide Prometheus counter).
        forward_ct: counter value now (SGLang's word for scheduler batches run).
        delta: increase since the last reading.
        busy: whether work was pending at the last reading.
    """

    HIGH_RATE: ClassVar[bool] = True
    pid: int | None
    forward_ct: int
    delta: int
    busy: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchdogStalled(Event):
    """Busy with no forward progress for ``stalled_for_s`` >= ``timeout_s`` seconds."""

    pid: int | None
    forward_ct: int
    stalled_for_s: float
    timeout_s: float
    counter_source: str = ""
    #: the Prometheus label set that stalled (``engine="1"``); ``""`` for a whole counter
    series: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchdogRearmed(Event):
    """Progress resumed after a stall; the watchdog can fire again."""

    pid: int | None
    forward_ct: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetExited(Event):
    """A watched process ended. ``exit_code`` or ``signal`` is set when known."""

    pid: int
    exit_code: int | None = None
    signal: int | None = None
    title: str = ""


# --- incidents and actions ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class IncidentOpened(Event):
    """An incident started: one trace, root span ``incident``.

    Attributes:
        incident_id: unique id, also the bundle folder name.
        trigger: why it opened (a :class:`Trigger`).
        detail: one line on why.
        pids: target pids at open time.
        bundle_dir: ``<data_dir>/<host>/<incident_id>``.
        trace_id / span_id: the root span's ids (hex), so actions can be parented.
        parent_span_id: hex id of the span this incident's root hangs under when it joined a
            trace begun elsewhere (a peer's incident, W3C ``traceparent``); ``""``: a trace root.
        links: requests in flight at open time, as (trace_id, span_id) hex pairs.
    """

    incident_id: str
    trigger: str
    detail: str = ""
    pids: tuple[int, ...] = ()
    bundle_dir: str = ""
    trace_id: str = ""
    span_id: str = ""
    parent_span_id: str = ""
    #: (trace_id, span_id) hex pairs of the requests in flight when it opened (span links)
    links: tuple[tuple[str, str], ...] = ()
    #: more root-span attributes (e.g. ``servewatch.target.ranks``)
    attributes: Mapping[str, AttributeValue] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionCompleted(Event):
    """An actor finished one action for an incident."""

    incident_id: str
    result: ActionResult


@dataclass(frozen=True, slots=True, kw_only=True)
class StacksDumped(ActionCompleted):
    """py-spy dumped (or failed to dump) one process."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CoredumpTriggered(ActionCompleted):
    """A CUDA coredump was triggered (or refused / not armed) for one process."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightRecorderDumped(ActionCompleted):
    """One rank's collective Flight Recorder was read (or could not be: not enabled, no source...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HardSignalSent(ActionCompleted):
    """Hard mode signalled a target (the verdict's culprit, or every rank) after an incident."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileStarted(Event):
    """A profiling session started."""

    session_id: str
    backend: str
    num_steps: int | None = None
    incident_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileStopped(ActionCompleted):
    """A profiling session ended; ``result.artifact_paths`` are its trace files."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IncidentClosed(Event):
    """All actions of an incident finished and its bundle is written."""

    incident_id: str
    trigger: str
    bundle_dir: str
    manifest_path: str
    outcomes: tuple[tuple[str, str], ...] = ()  # (action, outcome) in order
    #: ``closed``, or ``interrupted`` (the agent stopped mid-incident; what was captured is kept)
    state: str = "closed"
    #: extra attributes of the incident's root span (the cross-rank verdict, ``servewatch.verdict.*``)
    attributes: Mapping[str, AttributeValue] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True, slots=True, kw_only=True)
class IncidentRetraced(Event):
    """An open incident moved into another trace (two peers of a job opened the same stall at
    once; the later one joins the earlier one's trace). Spans emitted from now on use the new ids.

    Attributes:
        incident_id: the incident that moved.
        trace_id / parent_span_id: the trace it joined and the span its root now hangs under (hex).
        previous_trace_id: the trace it had (hex).
    """

    incident_id: str
    trace_id: str
    parent_span_id: str
    previous_trace_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentStatusChanged(Event):
    """A component's health changed (e.g. py-spy missing -> PERMANENT_ERROR)."""

    component: str
    status: ComponentStatus
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class WatcherStatusChanged(Event):
    """A watcher's view changed: ``state`` is ``ready``, ``waiting`` or ``blind``
    (:class:`agent.watchers.status.WatcherState` values), ``reason`` one human line.

    Published only on a change, never dropped; the runtime keeps the current statuses on its
    :class:`~agent.watchers.status.StatusBoard` (logged, status file, OTel gauge).
    """

    watcher: str
    state: str
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestSpanRecorded(Event):
    """A request span finished in the target (high rate; may be dropped)."""

    HIGH_RATE: ClassVar[bool] = True
    trace_id: str
    span_id: str
    request_id: str
