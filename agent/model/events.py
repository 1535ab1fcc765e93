"""Event types that cross the bus, and the outcome vocabulary actors report in.

Owns: every event dataclass (past-tense facts), :class:`Outcome`, :class:`ActionResult`,
:class:`ComponentStatus`, and the names written into bundles and spans: :class:`Trigger` (why an
incident opened) and :class:`Action` (what ran; also the span name), those five names and
:func:`now_ns` defined in :mod:`agent.model.kinds` (stdlib only) and re-exported here. Imports nothing
else from the rest of the agent, so watchers, actors, incidents and exporters can all depend on it.

Every event is ``@dataclass(frozen=True, slots=True, kw_only=True)`` with ``time_unix_nano``
(wall clock, ns since the Unix epoch) and ``source`` (the component that published it).
Fields are immutable (tuples, frozensets, enums, mappings wrapped read-only). Big payloads
live in files: an event carries the path and ``size_bytes``.

Events whose class sets ``HIGH_RATE = True`` (steps, request spans, health probes) may be
dropped by the bus when a subscriber is slow; all others are delivered to every subscriber.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

from agent.model.kinds import Action, ComponentStatus, Outcome, StrEnum, Trigger, now_ns

__all__ = [
    "TRACE_DETAIL_ATTR",
    "Action",
    "ActionCompleted",
    "ActionResult",
    "AttributeValue",
    "ComponentStatus",
    "ComponentStatusChanged",
    "CoredumpTriggered",
    "Event",
    "ExitFact",
    "ExitKind",
    "ExitSource",
    "FlightRecorderDumped",
    "FrontendExited",
    "HardSignalSent",
    "HealthCheckFailed",
    "HealthProbed",
    "HealthRecovered",
    "IncidentClosed",
    "IncidentOpened",
    "IncidentRetraced",
    "InflightSpan",
    "JobIncidentClosed",
    "LifecycleNoted",
    "Outcome",
    "ProfileStarted",
    "ProfileStopped",
    "RequestSpanRecorded",
    "RequestStalled",
    "StacksDumped",
    "StepsAdvanced",
    "StrEnum",
    "TargetExited",
    "Trigger",
    "TriggerEvent",
    "WatchdogRearmed",
    "WatchdogStalled",
    "WatcherStatusChanged",
    "frozen_attrs",
    "now_ns",
]

#: IncidentOpened attribute: ``linked`` sends the incident's action spans to a trace of its own,
#: linked from its root span (a large job's hosts, :mod:`agent.fleet.job`; read by the span mirror).
TRACE_DETAIL_ATTR = "servewatch.trace.detail"

#: A value an OTel span attribute may hold.
AttributeValue = str | bool | int | float | tuple[str, ...] | tuple[int, ...] | tuple[float, ...]

_EMPTY: Mapping[str, AttributeValue] = MappingProxyType({})


def frozen_attrs(attrs: Mapping[str, AttributeValue] | None = None, /, **more: AttributeValue) -> Mapping[str, AttributeValue]:
    """Return a read-only copy of span attributes (lists become tuples)."""
    merged: dict[str, AttributeValue] = {}
    for source in (attrs or {}, more):
        for key, value in source.items():
            merged[key] = tuple(value) if isinstance(value, list) else value
    return MappingProxyType(merged)


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
        span_id: 16 hex digits of the action's span, chosen by the incident layer when it records
            the result (so the manifest names the span and a later agent can re-send exactly that
            span); ``""`` until then (the mirror then picks one).
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
    span_id: str = ""

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


@dataclass(frozen=True, slots=True, kw_only=True)
class TriggerEvent(Event):
    """Base of the events that can open an incident: the incident manager subscribes to this
    base, so a watcher that opens incidents of a new kind publishes a subclass of its own (its
    module and one registration line, nothing else).

    A subclass names its trigger in ``TRIGGER`` (``lower_snake_case``: the incident's
    ``trigger``, part of its id, the ``servewatch.incident.trigger`` span attribute and the
    cooldown key: one incident per trigger per ``incident.cooldown_s``), and may say in one line
    what happened (:meth:`describe`) and which process it is about (:attr:`subject_pid`).
    """

    TRIGGER: ClassVar[str] = ""

    @property
    def trigger(self) -> str:
        """The trigger's name (``TRIGGER``)."""
        return self.TRIGGER

    @property
    def subject_pid(self) -> int | None:
        """The process whose trouble this is (acted on first; the dead ranks of its job are the
        incident's evidence), ``None`` for the server as a whole."""
        return None

    def describe(self) -> str:
        """One line on what happened (the incident's ``detail``)."""
        return f"{self.trigger} detected"


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
class HealthCheckFailed(TriggerEvent):
    """The health check turned unhealthy after ``consecutive_failures`` failed probes."""

    TRIGGER: ClassVar[str] = "health"
    url: str
    status_code: int | None
    latency_s: float
    error_class: str
    consecutive_failures: int

    def describe(self) -> str:
        code = f"HTTP {self.status_code}" if self.status_code else self.error_class
        return f"{self.url} failed {self.consecutive_failures} probes in a row ({code})"


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthRecovered(Event):
    """The health check is healthy again after ``consecutive_successes`` good probes."""

    url: str
    consecutive_successes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LifecycleNoted(Event):
    """Something happened in a watched server's life that is no fault of its own (published by
    :class:`agent.incidents.lifecycle.Lifecycle`, logged, never an incident by itself).

    Attributes:
        phase: ``stopped`` (its watched processes ended in order), ``started`` (new processes
            found after a stop), ``recovered`` (``/health`` answers again after a stop),
            ``ending`` (a process ended after a stall incident: that incident's ending),
            ``crash_loop`` (the same process exited non-zero again), ``orphans`` (processes of
            a server left alive after it ended).
        detail: one line in words.
        pids: the processes it is about (the new ones for ``started``).
        incident_id: the incident it was noted on (``""``: none).
        trace_id / parent_span_id: hex ids of that incident's trace and root span (``""``:
            none): the span mirror puts a ``server.lifecycle`` span there, so the story of a
            hang and its ending is one trace.
    """

    phase: str
    detail: str
    pids: tuple[int, ...] = ()
    incident_id: str = ""
    trace_id: str = ""
    parent_span_id: str = ""


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
class WatchdogStalled(TriggerEvent):
    """Busy with no forward progress for ``stalled_for_s`` >= ``timeout_s`` seconds."""

    TRIGGER: ClassVar[str] = "stall"
    pid: int | None
    forward_ct: int
    stalled_for_s: float
    timeout_s: float
    counter_source: str = ""
    #: the Prometheus label set that stalled (``engine="1"``); ``""`` for a whole counter
    series: str = ""
    #: the ``/metrics`` URL whose counter stalled (its port names the server); ``""``: an SDK counter
    url: str = ""
    #: requests the engine preempted meanwhile with no progress (vLLM's
    #: ``vllm:num_preemptions_total``; 0: none, or not counted): a livelock (vLLM #25538)
    preempted: int = 0
    #: seconds over which ``preempted`` was counted (since the last progress, or the first reading)
    preempted_in_s: float = 0.0

    @property
    def subject_pid(self) -> int | None:
        return self.pid

    def describe(self) -> str:
        churn = f", preempted {self.preempted} times in {self.preempted_in_s:.0f}s" if self.preempted else ""
        return (f"busy and no forward progress for {self.stalled_for_s:.1f}s (timeout {self.timeout_s:g}s,"
                f" forward_ct={self.forward_ct}{', pid ' + str(self.pid) if self.pid else ''}"
                f"{', series {' + self.series + '}' if self.series else ''}{churn})")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestStalled(TriggerEvent):
    """One request in flight far longer than the server's recent completions while the server
    completes others (vLLM #54003: its structured-output grammar compiles forever on the
    engine's grammar thread), per the SDK's in-flight requests of ``pid``.

    Attributes:
        pid: the process serving it.
        request_id: the server's request id (``gen_ai.response.id``).
        trace_id / span_id: its request span (hex; ``""``: none).
        age_s: seconds in flight when seen stuck.
        threshold_s: the bound it passed: ``max(min_s, p99_multiple * p99_s)``, seconds.
        p99_s: the 99th-percentile duration of the server's recent completions, seconds.
        recent: how many recent completions ``p99_s`` is over.
        completed_ago_s: seconds since the server's last completion (it progresses meanwhile).
        thread_id / native_thread_id: the thread holding it (``threading.get_ident()`` / the
            kernel's tid; 0: unknown).
    """

    TRIGGER: ClassVar[str] = "request_stall"
    pid: int
    request_id: str
    trace_id: str = ""
    span_id: str = ""
    age_s: float
    threshold_s: float
    p99_s: float
    recent: int = 0
    completed_ago_s: float = 0.0
    thread_id: int = 0
    native_thread_id: int = 0

    @property
    def subject_pid(self) -> int | None:
        return self.pid

    def describe(self) -> str:
        return (f"request {self.request_id} in flight for {self.age_s:.1f}s, over {self.threshold_s:.1f}s (p99 of"
                f" {self.recent} recent completions {self.p99_s:.2f}s) while pid {self.pid} completes others"
                f" (last {self.completed_ago_s:.1f}s ago)")


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchdogRearmed(Event):
    """Progress resumed after a stall; the watchdog can fire again."""

    pid: int | None
    forward_ct: int


class ExitKind(StrEnum):
    """How a process ended, as far as it could be learnt (:attr:`ExitFact.kind`).

    Only ``code``, ``signal`` and ``oom`` are failures; ``orderly`` is a stop someone asked for;
    ``unknown`` is never read as a crash (nor as an orderly stop).
    """

    ORDERLY = "orderly"  # exit code 0, or ended by SIGTERM/SIGINT (the signal itself or exit code 128+N)
    CODE = "code"  # a non-zero exit code that is not a caught stop signal
    SIGNAL = "signal"  # killed by a signal that is not a stop request (SIGSEGV, SIGABRT, kill -9, ...)
    OOM = "oom"  # killed by the kernel's OOM killer (SIGKILL, and the kernel or the cgroup says so)
    UNKNOWN = "unknown"  # the status could not be learnt (reaped by its parent before anyone read it)


class ExitSource(StrEnum):
    """How an exit status was learnt (:attr:`ExitFact.source`), most direct first."""

    OWNER = "owner"  # the process is ours: its Popen returncode (``servewatch launch``)
    WAITID = "waitid"  # waitid(WNOWAIT) on our child, or an orphan adopted as child subreaper
    KERNEL = "kernel"  # the kernel's own exit event (proc connector, whoever reaped the process)
    ZOMBIE = "zombie"  # /proc/PID/stat of the zombie, before its parent reaped it
    SDK = "sdk"  # the process's own SDK death notice (agent.sdk.exitnotice): in a pod, reaped at once
    RUNTIME = "runtime"  # its container runtime's exit record (conmon's exit file, Docker's State): a container's init
    NONE = "none"  # nothing: the status is unknown


#: Signals that ask a process to stop (an operator, systemd, a job scheduler), not crash it.
STOP_SIGNALS: Mapping[int, str] = MappingProxyType({int(_signal.SIGTERM): "SIGTERM", int(_signal.SIGINT): "SIGINT"})


def _signal_name(signum: int) -> str:
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ExitFact:
    """How one process ended, when, and how that was learnt: the one exit model the incident
    admission policy, the verdict and every printed line read.

    Attributes:
        pid: the process.
        kind: :class:`ExitKind` (from ``exit_code``/``signal``/``oom`` by :meth:`of`).
        exit_code: its exit code when it exited (``None``: killed by a signal, or unknown).
        signal: the signal that killed it (``None``: it exited, or unknown).
        oom: the kernel's OOM killer killed it (``oom_evidence`` says how that is known).
        source: how the status was learnt.
        ended_time_unix_nano: when it ended, ns since the epoch (0: unknown); ``ended_source``
            says how exact: ``kernel`` (the exit event's own clock), ``seen`` (when the agent
            saw it gone: an upper bound), ``last_ran`` (a zombie's last time on a CPU, from
            ``/proc/PID/sched``: an estimate, good for ordering deaths), ``sdk`` (when the process's
            own death notice was written: just before it died), ``runtime`` (its container
            runtime's record: conmon's exit file's time, Docker's ``FinishedAt``), ``""`` unknown.
        started_time_unix_nano: when the process started (its creation time), 0 when unknown.
        oom_evidence: where the OOM kill was read (``kernel log: ...``, ``cgroup ... oom_kill 0->1``).
        stop_signal: ``SIGTERM``/``SIGINT`` when a stop signal ended it (directly or as 128+N).
        tree_stopped: the status is unknown, but its whole process tree went down with it
            (the server stopped as a whole: ``orderly_reason`` says what was seen).
        orderly_reason: why it counts as an orderly stop, in words (``""`` when it does not).
    """

    pid: int
    kind: ExitKind = ExitKind.UNKNOWN
    exit_code: int | None = None
    signal: int | None = None
    oom: bool = False
    source: ExitSource = ExitSource.NONE
    ended_time_unix_nano: int = 0
    ended_source: str = ""
    started_time_unix_nano: int = 0
    oom_evidence: str = ""
    stop_signal: str = ""
    tree_stopped: bool = False
    orderly_reason: str = ""

    @classmethod
    def of(cls, pid: int, exit_code: int | None, signal: int | None, *, oom: bool = False,
           source: ExitSource | None = None, **more: object) -> ExitFact:
        """The fact for a status read from ``source``; ``kind`` follows from the status:
        ``oom`` wins, then a stop signal (15/2, or exit code 143/130) or exit code 0 is
        ``orderly``, another signal ``signal``, another code ``code``, neither ``unknown``."""
        stop = ""
        if signal is not None:
            stop = STOP_SIGNALS.get(signal, "")
        elif exit_code is not None and exit_code > 128:
            stop = STOP_SIGNALS.get(exit_code - 128, "")
        if oom:
            kind = ExitKind.OOM
        elif stop or (signal is None and exit_code == 0):
            kind = ExitKind.ORDERLY
        elif signal is not None:
            kind = ExitKind.SIGNAL
        elif exit_code is not None:
            kind = ExitKind.CODE
        else:
            kind = ExitKind.UNKNOWN
        if source is None:
            source = ExitSource.NONE if kind is ExitKind.UNKNOWN and not oom else ExitSource.OWNER
        reason = (f"stopped by {stop}" if stop else "exit code 0") if kind is ExitKind.ORDERLY else ""
        fields: dict[str, object] = {"orderly_reason": reason, **more}
        return cls(pid=pid, kind=kind, exit_code=exit_code, signal=signal, oom=oom, source=source,
                   stop_signal=stop, **fields)  # type: ignore[arg-type]

    @property
    def failed(self) -> bool:
        """A failure (non-zero code, a crash or kill signal, the OOM killer); never ``unknown``."""
        return self.kind in (ExitKind.CODE, ExitKind.SIGNAL, ExitKind.OOM)

    @property
    def signal_name(self) -> str:
        """``SIGSEGV``; ``""`` when no signal ended it."""
        return _signal_name(self.signal) if self.signal is not None else ""

    def status(self) -> str:
        """The status alone: ``exit code 1``, ``killed by SIGSEGV``, ``killed by the OOM killer``,
        ``exit status unknown``."""
        if self.oom:
            return "killed by the OOM killer"
        if self.signal is not None:
            return f"killed by {self.signal_name}"
        if self.exit_code is not None:
            return f"exit code {self.exit_code}"
        return "exit status unknown"

    def status_words(self) -> str:
        """The status as an incident's detail says it: ``exit code 3``, ``signal 9 (SIGKILL)``,
        ``killed by the OOM killer (signal 9 (SIGKILL); kernel log: ...)``, else :meth:`describe`."""
        if self.signal is not None:
            name = self.signal_name if not self.signal_name.startswith("signal ") else ""
            text = f"signal {self.signal}" + (f" ({name})" if name else "")
            if self.oom:
                return f"killed by the OOM killer ({text}; {self.oom_evidence})" if self.oom_evidence else f"killed by the OOM killer ({text})"
            return text
        if self.exit_code is not None:
            return f"exit code {self.exit_code}"
        return self.describe()

    def describe(self) -> str:
        """One line for logs and summaries: the status, whether that is a stop, and its source.

        ``killed by SIGSEGV``; ``exit code 0 (stopped in order)``; ``killed by the OOM killer
        (SIGKILL; kernel log: Killed process 42 (python))``; ``exit status unknown (reaped by its
        parent before it could be read; its whole process tree went down with it)``.
        """
        text = self.status()
        notes: list[str] = []
        if self.oom:
            notes.append(", ".join(x for x in (self.signal_name, self.oom_evidence) if x))
        elif self.kind is ExitKind.ORDERLY:
            notes.append("stopped in order")
        elif self.kind is ExitKind.UNKNOWN:
            notes.append("reaped by its parent before it could be read" if self.source is ExitSource.NONE else "")
            if self.tree_stopped:
                notes.append(self.orderly_reason or "its whole process tree went down with it")
        notes = [n for n in notes if n]
        return text + (f" ({'; '.join(notes)})" if notes else "")

    def attributes(self) -> dict[str, str | int | bool]:
        """Span attributes (OTel ``process.exit.code``; the rest ``servewatch.process.exit.*``)."""
        attrs: dict[str, str | int | bool] = {
            "servewatch.process.exit.kind": self.kind.value,
            "servewatch.process.exit.source": self.source.value,
        }
        if self.exit_code is not None:
            attrs["process.exit.code"] = self.exit_code
        if self.signal is not None:
            attrs["servewatch.process.exit_signal"] = self.signal
        if self.oom:
            attrs["servewatch.process.exit.oom"] = True
        if self.ended_time_unix_nano:
            attrs["servewatch.process.exit.time_unix_nano"] = self.ended_time_unix_nano
            attrs["servewatch.process.exit.time_source"] = self.ended_source
        return attrs

    def to_json(self) -> dict[str, object]:
        """JSON-ready dict (manifests, ``status.json``)."""
        return {
            "pid": self.pid, "kind": self.kind.value, "exit_code": self.exit_code, "signal": self.signal,
            "signal_name": self.signal_name, "oom": self.oom, "source": self.source.value,
            "ended_time_unix_nano": self.ended_time_unix_nano, "ended_source": self.ended_source,
            "started_time_unix_nano": self.started_time_unix_nano, "oom_evidence": self.oom_evidence,
            "tree_stopped": self.tree_stopped, "orderly_reason": self.orderly_reason, "status": self.describe(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetExited(TriggerEvent):
    """A watched process ended. ``exit_code`` or ``signal`` is set when known; ``fact`` is the
    whole :class:`ExitFact` (how, when, learnt how) when the process watcher published it."""

    TRIGGER: ClassVar[str] = "exit"
    pid: int
    exit_code: int | None = None
    signal: int | None = None
    title: str = ""
    fact: ExitFact | None = None

    @property
    def exit(self) -> ExitFact:
        """The :class:`ExitFact` (``fact``, else derived from ``exit_code``/``signal``)."""
        if self.fact is not None:
            return self.fact
        return ExitFact.of(self.pid, self.exit_code, self.signal,
                           source=None if self.exit_code is not None or self.signal is not None else ExitSource.NONE)

    @property
    def subject_pid(self) -> int | None:
        return self.pid

    def describe(self) -> str:
        return f"pid {self.pid} {self.title!r} exited ({self.exit.status_words()})"

    @property
    def oom_killed(self) -> bool:
        """The kernel's OOM killer killed it (``exit.oom``)."""
        return self.exit.oom

    @property
    def exit_time_unix_nano(self) -> int | None:
        """When it ended, ns since the epoch (``exit.ended_time_unix_nano``), ``None`` when unknown."""
        return self.exit.ended_time_unix_nano or None

    @property
    def exit_detail(self) -> str:
        """How it ended, in words, with where that was read (``exit.describe()``)."""
        return self.exit.describe()


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontendExited(TargetExited):
    """The process a watched server's ranks hang off (its frontend, launcher or API server: not
    itself a target) ended while some of them live on (reparented to pid 1 or a subreaper,
    holding memory: vLLM #55510's next start OOMs). ``pid`` and ``title`` are the frontend's;
    its exit status is unknown when the kernel and its zombie did not say (not the agent's child).

    Attributes:
        left_alive: the pids of the server still running once its tree had time to go down.
        left_alive_titles: their titles, in the same order.
        held_bytes: their resident memory then, bytes.
        reparented_to: their parent now (1, or a subreaper; 0 unknown).
    """

    left_alive: tuple[int, ...] = ()
    left_alive_titles: tuple[str, ...] = ()
    held_bytes: int = 0
    reparented_to: int = 0

    def describe(self) -> str:
        size = self.held_bytes
        held = f"{size / 1e9:.2f} GB" if size >= 1e7 else f"{size / 1e6:.1f} MB"
        shown = ", ".join(f"{pid}" + (f" {title!r}" if title else "")
                          for pid, title in list(zip(self.left_alive, self.left_alive_titles))[:6])
        more = ", ..." if len(self.left_alive) > 6 else ""
        under = f" under pid {self.reparented_to}" if self.reparented_to else ""
        return (f"the server's frontend pid {self.pid}" + (f" {self.title!r}" if self.title else "")
                + f" exited ({self.exit.status_words()}); {len(self.left_alive)} process(es) of it still alive{under},"
                f" holding {held}: pids {shown}{more}")


# --- incidents and actions ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class InflightSpan:
    """A request in flight in a target when an incident opened, as the SDK reported it: what the
    span mirror needs to show the request's part up to the incident in the request's own trace
    (the request's span is only written when the request ends: never, for a server SIGKILLed).

    Attributes:
        pid: the target serving it.
        request_id: the server's request id (``gen_ai.response.id``).
        trace_id / span_id: hex ids of the request's span (32 / 16 digits).
        parent_span_id: hex id of the request span's parent (``""``: the request is a trace root).
        start_time_unix_nano: when the request started (0: unknown).
        name: the request span's name (``"{operation} {model}"``).
        operation / model: ``gen_ai.operation.name`` / ``gen_ai.request.model`` (``""``: unknown).
        input_tokens / output_tokens: token counts known at the incident.
        age_s: the request's age when it was read, seconds.
    """

    pid: int
    request_id: str
    trace_id: str
    span_id: str
    parent_span_id: str = ""
    start_time_unix_nano: int = 0
    name: str = ""
    operation: str = ""
    model: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    age_s: float = 0.0


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
        inflight: those requests as the SDK reported them (the mirror emits each one's in-flight
            span in its trace and links the incident to it); empty when only ``links`` are known.
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
    #: the requests in flight, with what their in-flight spans show
    inflight: tuple[InflightSpan, ...] = ()
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
    #: ``False`` when the root span is already durable (a later agent finishing an interrupted
    #: incident): the mirror then closes the incident without emitting its root again
    emit_root: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class JobIncidentClosed(Event):
    """The coordinator of a job made the job's verdict: the job's root span ``job.incident``,
    under which every host's ``incident`` span hangs (:mod:`agent.fleet.job`).

    Attributes:
        job: the job's name.
        trace_id / span_id: the job's trace and root span (hex, derived by every host alike).
        start_time_unix_nano: the first detection of the job incident.
        incident_id: the coordinator's own incident in it.
        attributes: the job verdict (``servewatch.job.verdict.*``) and the job's counts.
    """

    job: str
    trace_id: str
    span_id: str
    start_time_unix_nano: int
    incident_id: str = ""
    #: ``""``: the job's root span (the fleet always emits it so: a host that reached no other
    #: host makes no verdict); else the root it hangs under (a ``job.verdict`` span)
    parent_span_id: str = ""
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
