"""The names events, bundles and spans carry: :class:`Outcome` (how an action ended),
:class:`Trigger` (why an incident opened), :class:`Action` (what ran; also the span name),
:class:`ComponentStatus`, :class:`IncidentState` (a manifest's ``state``), the :class:`StrEnum` they
are, and :func:`now_ns`.

Split from :mod:`agent.model.events` (which re-exports every name here) so that reading a bundle
(``servewatch timeline``, ``report``, ``status``) names them without building the event
dataclasses. Imports the standard library only.
"""

from __future__ import annotations

import enum
import sys
import time

__all__ = ["Action", "ComponentStatus", "IncidentState", "Outcome", "StrEnum", "Trigger", "now_ns"]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """str-valued enum (stdlib ``enum.StrEnum`` from 3.11)."""

        def __str__(self) -> str:
            return str(self.value)


def now_ns() -> int:
    """Wall-clock time in ns since the Unix epoch (``time.time_ns()``)."""
    return time.time_ns()


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
    REQUEST_STALL = "request_stall"  # one request in flight far past the server's recent completions


class Action(StrEnum):
    """What ran for an incident: ``ActionResult.action``, the action's span name and the manifest's
    ``actions[].action``. Values are the strings bundles already hold."""

    PYSPY_DUMP = "pyspy.dump"  # Python/native stacks of one process (agent.actors.pyspy)
    FLIGHTREC_DUMP = "flightrec.dump"  # one rank's collective Flight Recorder (agent.actors.flightrec)
    CUDA_COREDUMP = "cuda.coredump"  # a CUDA GPU coredump (agent.actors.coredump)
    PROFILE_SESSION = "profile.session"  # a step-bounded profile (agent.actors.profiler)
    HARD_SIGNAL = "hard.signal"  # hard mode signalled a rank (agent.incidents.manager)
    PEER_CAPTURE = "peer.capture"  # a job peer asked to capture (agent.fleet.peers)
    PEER_RESOLVE = "peer.resolve"  # resolving the job's peers failed (agent.fleet.peers)
    DETECTION_FOLDED = "fleet.detection_folded"  # a local detection folded into a job incident
    FANOUT = "fleet.fanout"  # the coordinator asked the job's hosts that did not detect (agent.fleet.coordinator)
    REPORT = "fleet.report"  # this host reported its detection to the job's coordinator


class IncidentState(StrEnum):
    """``state`` of an incident (``manifest.json``): ``open`` while its phases run, then ``closed``;
    ``interrupted`` when the agent stopped mid-incident (recovered bundles read ``closed`` with
    ``interrupted``). :mod:`agent.host.manifest` re-exports it."""

    OPEN = "open"
    CLOSED = "closed"
    INTERRUPTED = "interrupted"


class ComponentStatus(StrEnum):
    """Component health, after the OTel collector's componentstatus."""

    STARTING = "starting"
    OK = "ok"
    RECOVERABLE_ERROR = "recoverable_error"
    PERMANENT_ERROR = "permanent_error"
    STOPPING = "stopping"
    STOPPED = "stopped"
