"""What the agents of a job send each other, validated (pydantic).

Owns the bodies of the job routes (:mod:`agent.fleet.api`):

* :class:`Announce` (``POST /v1/job/announce``): the host of global rank 0 tells every peer it
  coordinates the job; each answers with its host name and ranks (:class:`MemberInfo`).
* :class:`Report` (``POST /v1/job/report``): a host that detected the job's hang tells the
  coordinator (its trace, key, ranks); the answer (:class:`ReportAnswer`) names the job's trace.
* :class:`Evidence` (``POST /v1/job/evidence``): a host's compact evidence summary once its
  capture is done: per rank (global rank, process state, the stack's class and hung frame, step
  counters, a window of its Flight Recorder), its own verdict and where its bundle is.

Every field is bounded (lengths, list sizes), so a peer's body never grows the coordinator's
memory beyond the API's body limit. Field names on the wire follow the rest of the API
(``host.name``). Imports pydantic and the standard library only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "Announce",
    "Evidence",
    "MemberInfo",
    "Moved",
    "RankSummary",
    "RelayedPeer",
    "Report",
    "ValidationError",
    "first_error",
]

_HEX32 = r"^[0-9a-f]{32}$"
_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: Most ranks one host may report.
MAX_RANKS_PER_HOST = 1024


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class _FromHost(_Wire):
    job: str = Field(min_length=1, max_length=128)
    host_name: str = Field(alias="host.name", min_length=1, max_length=255)
    agent_id: str = Field("", max_length=64)


class MemberInfo(_FromHost):
    """A member's answer to an announce (and what the coordinator remembers of it)."""

    ranks: list[int] = Field(default_factory=list, max_length=MAX_RANKS_PER_HOST)
    world_size: int | None = Field(None, ge=1)


class Announce(_FromHost):
    """The coordinator (host of global rank 0) presents itself; peers answer with :class:`MemberInfo`."""

    api_port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    ranks: list[int] = Field(default_factory=list, max_length=MAX_RANKS_PER_HOST)
    #: its own entry in the job's member list (used when the receiver lists it too)
    address: str = Field("", max_length=300)


class Report(_FromHost):
    """A detection, sent to the coordinator.

    Attributes:
        api_port / scheme: where the reporter's API listens (joins and answers go there).
        incident_id: the reporter's incident.
        trace_id: the trace the reporter derived (:mod:`agent.fleet.identity`).
        key: the key it was derived from (``fr:0:8``, ``time:1796138300``).
        detected_time_unix_nano: when the reporter's incident opened.
        ranks: the reporter's global ranks.
        unreachable: coordinators (URLs) the reporter tried first and could not reach: the
            receiver then coordinates itself instead of redirecting.
        provisional: the reporter coordinates this job incident because the receiver did not
            answer in time, and asks before its verdict whether the receiver coordinates it: the
            receiver answers ``coordinating`` (then the reporter backs down) or
            ``not_coordinating``, and never starts a job incident for it.
    """

    api_port: int = Field(ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    incident_id: str = Field(pattern=_ID)
    trace_id: str = Field(pattern=_HEX32)
    key: str = Field(max_length=80)
    detected_time_unix_nano: int = Field(ge=0)
    trigger: str = Field("", max_length=32)
    ranks: list[int] = Field(default_factory=list, max_length=MAX_RANKS_PER_HOST)
    world_size: int | None = Field(None, ge=1)
    unreachable: list[str] = Field(default_factory=list, max_length=16)
    #: its own entry in the job's member list (used when the receiver lists it too)
    address: str = Field("", max_length=300)
    provisional: bool = False


class RankSummary(_Wire):
    """One rank's evidence, compact (what :class:`agent.verdict.rules.RankEvidence` holds, on the wire).

    Attributes:
        rank: the global rank.
        fr: a window of its Flight Recorder around the stuck collective (``version``,
            ``pg_config``, ``pg_status``, ``entries`` without stack frames), or ``None``.
    """

    rank: int = Field(ge=0)
    pid: int | None = Field(None, ge=1)
    title: str = Field("", max_length=255)
    label: str = Field("", max_length=64)
    alive: bool = True
    exited_first: bool = False
    exit_signal: str | None = Field(None, max_length=32)
    exit_code: int | None = None
    oom_killed: bool = False
    exit_time_ns: int | None = None
    frame_class: Literal["compute", "collective", "rendezvous", "idle", "unknown"] = "unknown"
    frame: str = Field("", max_length=512)
    #: the point-to-point op its stack waits in (:attr:`agent.verdict.rules.RankEvidence.p2p`); an older
    #: agent leaves it out (read as none) and ignores it
    p2p: Literal["", "recv", "send", "send/recv", "wait"] = ""
    steps_before: int | None = None
    steps_after: int | None = None
    pending: int | None = None
    fr: dict[str, Any] | None = None


class RelayedPeer(_Wire):
    """What a relay got from one peer it asked on the coordinator's behalf."""

    address: str = Field(max_length=300)
    outcome: Literal["ok", "refused", "timed_out", "failed"]
    detail: str = Field("", max_length=300)
    host_name: str = Field("", alias="host.name", max_length=255)
    ranks: list[int] = Field(default_factory=list, max_length=MAX_RANKS_PER_HOST)


class Evidence(_FromHost):
    """A host's compact evidence summary for the job verdict.

    Attributes:
        trace_id / incident_id: the job's trace and the host's incident in it.
        bundle_dir: the host's bundle (the bulky evidence stays there; the span links it).
        ranks: one summary per rank the host captured.
        verdict: the host's own verdict (``kind``, ``reason``, ``confidence``, ``culprit_ranks``), if any.
        world_size: the job's world size as the host's ranks know it (default group's size).
        relayed: when the host relayed the coordinator's join, what each peer it asked gave.
        partial: the host reached no other host of the job for a while (partitioned): sent late,
            what it saw alone (never a verdict of its own).
        backed_down: the host coordinated the job incident for a while (its first choice did not
            answer in time), then learnt that the receiver does and backed down.
        moved_hosts: with ``backed_down``: the hosts whose evidence it had taken and told to send
            it to the receiver (:class:`Moved`): the receiver's verdict waits for them too.
    """

    trace_id: str = Field(pattern=_HEX32)
    incident_id: str = Field(pattern=_ID)
    bundle_dir: str = Field("", max_length=4096)
    ranks: list[RankSummary] = Field(default_factory=list, max_length=MAX_RANKS_PER_HOST)
    verdict: dict[str, Any] | None = None
    world_size: int | None = Field(None, ge=1)
    relayed: list[RelayedPeer] = Field(default_factory=list, max_length=1024)
    partial: bool = False
    backed_down: bool = False
    moved_hosts: list[str] = Field(default_factory=list, max_length=1024)


def first_error(exc: ValidationError) -> str:
    """``field: what is wrong`` of a validation error's first problem (a 400's one line)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "body"
    return f"{where}: {err.get('msg', 'invalid')}"


class Moved(_FromHost):
    """A provisional coordinator backed down after it had taken this host's evidence: the job's
    coordinator is ``coordinator`` (its URL in the member list) and the evidence goes there
    again. Taken only from the coordinator the receiver sent its evidence to.

    Attributes:
        trace_id: the job's trace.
        coordinator: the coordinator's URL (``http://10.0.0.1:9464``), as the member list gives it.
        coordinator_host: its host name as it proved it (``""``: not proven).
    """

    trace_id: str = Field(pattern=_HEX32)
    coordinator: str = Field(min_length=1, max_length=300)
    coordinator_host: str = Field("", max_length=255)
