"""The incident manifest: ``manifest.json`` of a bundle, as one versioned pydantic model.

Owns :class:`Manifest` (and its parts :class:`ManifestTarget`, :class:`ManifestAction`,
:class:`ManifestVerdict`), the schema version :data:`MANIFEST_SCHEMA`, :func:`load_manifest`,
:func:`parse_manifest` and :class:`ManifestError`. :mod:`agent.incidents.manager` writes it (at open and
after each phase); :mod:`agent.cli.summary` reads it, and so does :mod:`agent.views.bundle`
(``servewatch timeline`` / ``report``) through :mod:`agent.model.manifest_view`, which reads a manifest
as the agent writes it without building this model and hands it every other one.

Versions: ``schema`` is ``servewatch.incident/<N>``; a reader accepts every version in
:data:`KNOWN_SCHEMAS` and refuses any other with :class:`ManifestError`. Within a version, fields
are only ever added with a default, so older manifests of the same version still read (a
``servewatch.incident/1`` manifest from before ``state`` existed reads ``state: closed``).

On disk the JSON keys are the historic ones (``schema``, ``host.name``); in Python the fields are
``schema_version`` and ``host_name``. Every number's name carries its unit.

Imports pydantic, :mod:`agent.model.kinds`, :mod:`agent.model.manifest_view` (the constants, and the light
reader ``timeline`` and ``report`` use: it hands this model every manifest it does not read
itself) and :mod:`agent.errors` only (no component).

Raises :class:`agent.errors.ManifestError` (also a ``ValueError``; the tree is in
:mod:`agent.errors`) for a manifest that is not JSON, not a manifest, or of an unknown version.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
)

from agent.errors import ManifestError
from agent.model.kinds import Action, IncidentState, Outcome, Trigger
from agent.model.manifest_view import (
    KNOWN_SCHEMAS,
    MANIFEST_NAME,
    SCHEMA_V1,
    STACK_NOT_ERRORS,
    stack_errors,
)

if TYPE_CHECKING:  # the event dataclasses load only where a result is rebuilt (to_result)
    from agent.model.events import ActionResult

__all__ = [
    "KNOWN_SCHEMAS",
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA",
    "SCHEMA_V1",
    "SPANS_DURABLE_NAME",
    "STACK_NOT_ERRORS",
    "ActionName",
    "IncidentState",
    "Manifest",
    "ManifestAction",
    "ManifestError",
    "ManifestHistoryPoint",
    "ManifestTarget",
    "ManifestVerdict",
    "OutcomeName",
    "TriggerName",
    "load_manifest",
    "parse_manifest",
    "stack_errors",
]

#: Marker file in a bundle, written by the span mirror once every span of the incident (root and
#: actions) is durable (in the spool, written ahead and fsynced, or acknowledged by the collector,
#: or in the embedded span files). A bundle without it, whose agent is gone, is checked at the next
#: agent start and its missing spans re-sent from the manifest.
SPANS_DURABLE_NAME = "spans.durable"
#: The version this servewatch writes. (:data:`KNOWN_SCHEMAS`, :data:`MANIFEST_NAME`,
#: :data:`SCHEMA_V1` and :func:`stack_errors` live in :mod:`agent.model.manifest_view`,
#: :class:`IncidentState` in :mod:`agent.model.kinds`: the light reader needs them without pydantic.)
MANIFEST_SCHEMA = SCHEMA_V1


#: A trigger name: a :class:`~agent.model.events.Trigger` member when it is one, else the plain string
#: (a name from a newer agent still reads).
TriggerName = Annotated[Trigger | str, Field(union_mode="left_to_right")]
#: An action name: an :class:`~agent.model.events.Action` member when it is one, else the plain string.
ActionName = Annotated[Action | str, Field(union_mode="left_to_right")]
#: An outcome: an :class:`~agent.model.events.Outcome` member when it is one, else the plain string.
OutcomeName = Annotated[Outcome | str, Field(union_mode="left_to_right")]


class _Part(BaseModel):
    # unknown keys are ignored: a reader of version N reads what it knows of it
    model_config = ConfigDict(extra="ignore", frozen=True)


class ManifestTarget(_Part):
    """One target process (``targets[]``); secrets in its argv are redacted before it is written.

    Attributes:
        pid: process id.
        title: process title (``setproctitle``), ``""`` when unknown.
        create_time_s: process start, seconds since the epoch (``None`` when unknown).
        cmdline: argv, redacted.
    """

    pid: int
    title: str = ""
    create_time_s: float | None = None
    cmdline: tuple[str, ...] = ()


class ManifestAction(_Part):
    """One action of the incident (``actions[]``): one :class:`agent.model.events.ActionResult`.

    Attributes:
        action: span name of the action (an :class:`~agent.model.events.Action`; a plain string for a
            name this servewatch does not know).
        pid: the target, ``None`` for actions not bound to one process.
        outcome: how it ended (an :class:`~agent.model.events.Outcome`; a plain string for one this
            servewatch does not know).
        retryable: ``False`` when trying again cannot help.
        detail: one human line.
        start_time_unix_nano / end_time_unix_nano: wall-clock bounds, ns since the epoch
            (``0`` when unknown).
        duration_s: wall-clock duration, seconds (``None`` when not recorded: see
            :attr:`elapsed_s`).
        artifact_paths: files written, as recorded (absolute paths where the bundle was written).
        attributes: the span attributes (JSON values; tuples are written as lists).
        span_id: 16 hex digits of the action's span (``""`` in bundles from before it was
            recorded): a later agent re-sends exactly that span when it was never made durable.
    """

    action: ActionName
    pid: int | None = None
    outcome: OutcomeName
    retryable: bool = False
    detail: str = ""
    start_time_unix_nano: int = 0
    end_time_unix_nano: int = 0
    duration_s: float | None = None
    artifact_paths: tuple[str, ...] = ()
    attributes: dict[str, JsonValue] = Field(default_factory=dict)
    span_id: str = ""

    @classmethod
    def from_result(cls, result: ActionResult) -> ManifestAction:
        """The manifest entry of one action's result (attribute tuples become lists)."""
        return cls(
            action=result.action,
            pid=result.pid,
            outcome=result.outcome,
            retryable=result.retryable,
            detail=result.detail,
            start_time_unix_nano=result.start_time_unix_nano,
            end_time_unix_nano=result.end_time_unix_nano,
            duration_s=round(result.duration_s, 6),
            artifact_paths=tuple(result.artifact_paths),
            attributes={k: list(v) if isinstance(v, tuple) else v for k, v in result.attributes.items()},
            span_id=result.span_id,
        )

    def to_result(self) -> ActionResult:
        """The action's result again (lists become tuples, an unknown outcome ``failed``), to
        re-send its span with the same id."""
        try:
            outcome = Outcome(str(self.outcome))
        except ValueError:
            outcome = Outcome.FAILED
        attributes: dict[str, Any] = {}
        for key, value in self.attributes.items():
            if isinstance(value, list):
                if all(isinstance(v, (str, bool, int, float)) for v in value):
                    attributes[key] = tuple(value)
            elif isinstance(value, (str, bool, int, float)):
                attributes[key] = value
        from agent.model.events import ActionResult

        return ActionResult(
            action=str(self.action), outcome=outcome, pid=self.pid, retryable=self.retryable, detail=self.detail,
            start_time_unix_nano=self.start_time_unix_nano, end_time_unix_nano=self.end_time_unix_nano,
            artifact_paths=tuple(self.artifact_paths), attributes=attributes, span_id=self.span_id,
        )

    @property
    def elapsed_s(self) -> float:
        """``duration_s`` when recorded, else end minus start (never negative), seconds."""
        if self.duration_s is not None:
            return self.duration_s
        return max(0, self.end_time_unix_nano - self.start_time_unix_nano) / 1e9


class ManifestVerdict(_Part):
    """The cross-rank verdict (``verdict``), per :meth:`agent.verdict.rules.Verdict.to_json`.

    Attributes:
        kind: what was concluded (``dead``, ``cascade``, ``stopped``, ``desync``, ``progressing``,
            ``rendezvous``, ``cycle``, ``behind``, ``deadlock``, ``idle``, ``compute``, ``single``,
            ``unknown``: ``docs/verdict-rules.md``).
        hung: whether the group is stuck.
        culprit_ranks / culprit_pids: the rank(s) named and their pids (empty when none).
        culprit_roles: each culprit pid's role (``rank``, ``coordinator``, ``frontend``,
            ``process``), in ``culprit_pids``' order; empty in a manifest written before it existed.
        reason: one line.
        confidence: ``high``, ``medium`` or ``low``.
        evidence: short facts behind it, one per rank.
        stragglers: ranks slower than the rest while all progress.
        ranks: every rank considered.
        headline: the summary's first line (``Verdict: culprit rank 1 (pid 42) -- ...``).
        rule: the rule that concluded (``docs/verdict-rules.md``), ``""`` before it was recorded.
        next: the ``next:`` line, what to run or check next (``py-spy dump --native --pid 42 (...)``);
            ``""`` in a manifest written before it existed (readers rebuild it:
            :func:`agent.verdict.rules.next_step_of`).
        duration_s: seconds spent making it after the evidence was in.
    """

    kind: str = "unknown"
    hung: bool = True
    culprit_ranks: tuple[int, ...] = ()
    culprit_pids: tuple[int, ...] = ()
    culprit_roles: tuple[str, ...] = ()
    reason: str = ""
    confidence: str = ""
    evidence: tuple[str, ...] = ()
    stragglers: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    headline: str = ""
    rule: str = ""
    next: str = ""
    duration_s: float = 0.0


class ManifestHistoryPoint(_Part):
    """One moment of the server's history before the incident (``history``), per
    :class:`agent.incidents.history.HistoryPoint`.

    Attributes:
        time_unix_nano: when, ns since the epoch.
        kind: ``step``, ``progress_stopped``, ``stall``, ``health_failed``, ``health_recovered``,
            ``exit`` (another string from a newer agent still reads).
        pid: the process (``None``: the server as a whole).
        forward_ct: the step counter's value, when the point is about steps.
        detail: one line in words.
    """

    time_unix_nano: int
    kind: str
    pid: int | None = None
    forward_ct: int | None = None
    detail: str = ""


class Manifest(_Part):
    """``manifest.json``: what an incident did, written at open and rewritten after each phase.

    Attributes:
        schema_version: ``schema`` on disk; one of :data:`KNOWN_SCHEMAS`.
        incident_id: ``<UTC stamp>-<trigger>-<hex>``, also the bundle folder's name.
        trigger: why it opened (a :class:`~agent.model.events.Trigger`; a plain string for a name this
            servewatch does not know).
        detail: one line on why it opened.
        host_name: ``host.name`` on disk.
        trace_id / span_id / parent_span_id: hex ids of the incident's root span (``""`` unknown).
        opened_time_unix_nano / closed_time_unix_nano: ns since the epoch (closed ``0`` while open).
        duration_s: closed minus opened, seconds (``None`` when not recorded: see :attr:`elapsed_s`).
        targets: the target processes.
        actions: one entry per action, in the order they finished.
        inflight_requests: requests in flight at open (``None`` when not recorded).
        hard_signal_sent: hard mode: pid (a string, JSON keys are) -> signal name or ``failed: ...``.
        exits_after_hard_signal: pid -> how it exited, for exits hard mode's signal caused.
        after_hard_signal: health failures hard mode's signal caused, one line each
            (``health: ... failed 3 probes in a row (503): killed by servewatch --hard, incident X``).
        state: ``open``, ``closed`` or ``interrupted``.
        phases_done / phases_pending: phases (action names) finished / still to run.
        interrupted_reason: why it was cut short, in words.
        interrupted: the incident was cut short: set with ``state: interrupted``, and kept when the
            next agent start closed a bundle left open or interrupted.
        root_published: the root span's event (IncidentClosed) was published on the bus; the
            span itself is durable once the bundle holds :data:`SPANS_DURABLE_NAME`.
        spans_tracked: the actions carry their span ids and the bundle gets
            :data:`SPANS_DURABLE_NAME` once all its spans are durable (written by this version
            on; older bundles are recovered by ``root_published`` alone).
        agent_pid: the agent process that wrote it (``None`` when not recorded).
        updated_time_unix_nano: when it was last written (``None`` when not recorded).
        recovered_time_unix_nano: when a later agent closed it (``None`` unless it did).
        verdict: the cross-rank verdict, when a judge made one.
        history: the server's recent history as the agent saw it before the incident opened
            (step readings, when progress stopped, the watchdog firing, health, exits), oldest
            first; empty when none was recorded (``dump``, an older agent).
        lifecycle: what became of the server after it opened, one line each, oldest first (its
            ending after a stall, more exits of a crash loop, processes left alive), per
            :class:`agent.incidents.lifecycle.Lifecycle`; empty when nothing was noted.
        crash_loop_exits: how many non-zero exits of the same process this incident counts (a
            crash loop: one incident for them all); ``0``: not a crash loop.
    """

    schema_version: str = Field(
        validation_alias=AliasChoices("schema", "schema_version"), serialization_alias="schema"
    )
    incident_id: str = Field(min_length=1)
    trigger: TriggerName
    detail: str = ""
    host_name: str = Field(
        "", validation_alias=AliasChoices("host.name", "host_name"), serialization_alias="host.name"
    )
    trace_id: str = ""
    span_id: str = ""
    parent_span_id: str = ""
    opened_time_unix_nano: int
    closed_time_unix_nano: int = 0
    duration_s: float | None = None
    targets: tuple[ManifestTarget, ...] = ()
    actions: tuple[ManifestAction, ...] = ()
    inflight_requests: int | None = None
    hard_signal_sent: dict[str, str] = Field(default_factory=dict)
    exits_after_hard_signal: dict[str, str] = Field(default_factory=dict)
    after_hard_signal: tuple[str, ...] = ()
    state: IncidentState = IncidentState.CLOSED
    phases_done: tuple[ActionName, ...] = ()
    phases_pending: tuple[ActionName, ...] = ()
    interrupted_reason: str = ""
    interrupted: bool = False
    root_published: bool = False
    spans_tracked: bool = False
    agent_pid: int | None = None
    updated_time_unix_nano: int | None = None
    recovered_time_unix_nano: int | None = None
    verdict: ManifestVerdict | None = None
    history: tuple[ManifestHistoryPoint, ...] = ()
    lifecycle: tuple[str, ...] = ()
    crash_loop_exits: int = 0

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, value: str) -> str:
        if value not in KNOWN_SCHEMAS:
            known = ", ".join(sorted(KNOWN_SCHEMAS))
            raise ValueError(f"schema {value!r} is an unknown manifest version (this servewatch reads {known})")
        return value

    @property
    def elapsed_s(self) -> float:
        """``duration_s`` when recorded, else closed minus opened (never negative), seconds."""
        if self.duration_s is not None:
            return self.duration_s
        return max(0, self.closed_time_unix_nano - self.opened_time_unix_nano) / 1e9

    def to_json_dict(self) -> dict[str, Any]:
        """The manifest as written: JSON-ready, with the on-disk keys (``schema``, ``host.name``)."""
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        """The manifest as written to ``manifest.json`` (indented; non-ASCII escaped, so a title
        with bytes that are not UTF-8 survives as ``\\udcXX``)."""
        return json.dumps(self.to_json_dict(), indent=2)


#: pydantic's words for Python types, as the JSON a user reads calls them
_JSON_WORDS = (("a valid tuple", "an array"), ("a valid list", "an array"), ("a valid dictionary", "an object"))


def _problem(exc: ValidationError) -> str:
    """One line for a validation error: the version problem if there is one, else the first
    problem, with the number of others."""
    errors = exc.errors(include_url=False)
    first = next((e for e in errors if e["loc"][:1] in (("schema",), ("schema_version",))), errors[0])
    where = ".".join(str(part) for part in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    for python, in_json in _JSON_WORDS:
        message = message.replace(python, in_json)
    if first["loc"][:1] in (("schema",), ("schema_version",)) and first["type"] == "value_error":
        return message
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"not a servewatch incident manifest: {where}: {message[:1].lower()}{message[1:]}{more}"


def parse_manifest(data: str | bytes | dict[str, Any], *, source: str = "") -> Manifest:
    """Validate a manifest given as JSON text or an already-decoded object.

    JSON text is decoded with :mod:`json` (which keeps lone ``\\udcXX`` escapes that pydantic's
    own JSON parser refuses), then validated by :class:`Manifest`.

    Args:
        data: the manifest's JSON text (UTF-8 bytes or str), or the decoded object.
        source: where it came from, to start the error message (a path); ``""`` for none.

    Returns:
        The manifest.

    Raises:
        ManifestError: one line: not JSON, not a JSON object, an unknown ``schema`` version, or
            a field missing or of the wrong type.
    """
    prefix = f"{source}: " if source else ""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{prefix}not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"{prefix}not a JSON object")
    if not any(key in data for key in ("schema", "schema_version")):
        raise ManifestError(f"{prefix}no 'schema': not a servewatch incident manifest")
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(prefix + _problem(exc)) from None


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``manifest.json`` (or a bundle folder holding one).

    Args:
        path: the manifest file, or its bundle folder.

    Returns:
        The manifest.

    Raises:
        FileNotFoundError: no such file.
        OSError: it cannot be read.
        ManifestError: one line naming the file: not JSON, not a manifest, or an unknown version.
    """
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    return parse_manifest(p.read_bytes(), source=str(p))
