"""Incident bundles read back: a bundle folder as one typed model, for timeline, report and replay.

Owns :class:`IncidentTimeline` (and its row types), :func:`load_incident`,
:func:`load_incident_arg`, :func:`find_bundle` and the :class:`BundleError` tree. The model is built
from the bundle alone -- ``manifest.json`` (read by :mod:`agent.model.manifest_view`; one not as the agent
writes it is validated by :class:`agent.host.manifest.Manifest`), the
optional ``requests.json``, the py-spy stacks and the other artifacts next to them, as written
by :mod:`agent.incidents.manager` and the actors -- so it works offline on a copied bundle. When span
files (OTLP/JSON lines, or the spool's binary protobuf) are found, the spans of the incident's
trace are added as enrichment, read by :mod:`exporters.otlp.otlp_json`'s reader; nothing
depends on them. Drawing the model is :mod:`agent.views.timeline`'s (terminal) and
:mod:`agent.views.report`'s (HTML).

Like everything in ``exporters/``, this module decides nothing: it mirrors what the bundle says.
Only files inside the bundle folder are opened (symlinks followed and checked). Prompt text is never
part of the model, even when ``requests.json`` holds it (the user opted in to *capture*, not to
display).

Imports the standard library, :mod:`agent.errors`, :mod:`agent.model.manifest_view` (the manifest read back;
:mod:`agent.host.manifest`, the model, only for a manifest not as the agent writes it), :mod:`agent.model.events`
(names), :mod:`agent.host.security` (path checks), :mod:`agent.model.stacks` (the py-spy dump model, its
parser and its hung-frame rule, so that a bundle is read back by the same rule the actor applied
when it wrote it), :mod:`agent.verdict.rules` (an older bundle's verdict gets its ``next:`` line,
:func:`~agent.verdict.rules.next_step_of`) and :mod:`exporters.otlp.otlp_json`.

Raises the :class:`agent.errors.BundleError` family (the tree is in :mod:`agent.errors`), one line
each: :class:`~agent.errors.BundleNotFoundError` (no such incident / directory / manifest),
:class:`~agent.errors.BundleCorruptError` (the manifest is not one this servewatch reads: not JSON,
a field missing or mistyped, an unknown version), :class:`~agent.errors.BundleError` (ambiguous id,
unreadable).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from agent.errors import BundleCorruptError, BundleError, BundleNotFoundError, ManifestError
from agent.host.security import access_denied, is_within
from agent.model.kinds import Action, IncidentState, Trigger
from agent.model.manifest_view import (
    JOB_VERDICT_NAME,
    MANIFEST_NAME,
    ManifestView,
    view_of_json,
    view_of_model,
)
from agent.model.stacks import Frame, ThreadStack, hung_location, parse_threads
from exporters.otlp.otlp_json import TornLines, iter_span_files, read_span_file

__all__ = [
    "MANIFEST_NAME",
    "REQUESTS_NAME",
    "ActionRow",
    "ArtifactRow",
    "BundleCorruptError",
    "BundleError",
    "BundleNotFoundError",
    "CoredumpRow",
    "Frame",
    "HistoryRow",
    "IncidentTimeline",
    "ProcessStacks",
    "ProfileRow",
    "RequestRow",
    "SpanRow",
    "TargetRow",
    "ThreadStack",
    "find_bundle",
    "format_size",
    "job_verdict_title",
    "load_incident",
    "load_incident_arg",
    "newer_manual_dumps",
    "read_job_verdict",
    "read_manifest",
    "timeline_to_dict",
    "verdict_headline",
]

#: Name of the in-flight requests file inside a bundle (per :mod:`agent.incidents.manager`).
REQUESTS_NAME = "requests.json"

# Span attribute keys written by the actors (agent/actors/*.py); all optional here.
_PYSPY_HUNG_FRAME = "servewatch.pyspy.hung_frame"
_PYSPY_THREAD_COUNT = "servewatch.pyspy.thread_count"
_COREDUMP_PATH = "servewatch.coredump.path"
_COREDUMP_SIZE = "servewatch.coredump.size_bytes"
_PROFILE_STEPS = "servewatch.profile.steps_captured"

_PYSPY_STACKS = ("servewatch.pyspy.stacks", "servewatch.pyspy.top_frames")


# --- model ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessStacks:
    """The stacks of one process and where it is stuck.

    Attributes:
        pid: the process.
        title: its process title from the manifest's targets (``""`` when not a target).
        threads: every thread in the py-spy JSON artifact (empty when there is none).
        hung_frame: where the process is stuck, ``"name (file:line)"``; from the pyspy span
            attribute when present, else read from the JSON artifact by the pyspy actor's rule (the
            main thread, else an active one; its innermost Python frame outside the standard
            library, else its innermost Python frame); ``None`` when neither exists.
        hung_frame_source: ``"attribute"``, ``"stacks"`` or ``""``.
        hung_thread_id: the thread holding the hung frame (``None`` when unknown).
        hung_frame_index: index of the hung frame in that thread's frames (``None`` when unknown).
        thread_count: threads dumped (the span attribute, else ``len(threads)``; ``None`` when
            there is neither).
        stacks_path: the py-spy JSON artifact read (``""`` when none was found).
        error: why the artifact could not be read (``""`` when fine or absent).
        summary: the bounded ``"thread: frame"`` lines of the pyspy span attribute (shown when
            the JSON artifact is gone).
    """

    pid: int
    title: str
    threads: tuple[ThreadStack, ...]
    hung_frame: str | None
    hung_frame_source: str
    hung_thread_id: int | None
    hung_frame_index: int | None
    thread_count: int | None
    stacks_path: str
    error: str = ""
    summary: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TargetRow:
    """One target process of the incident (manifest ``targets``)."""

    pid: int
    title: str
    create_time_s: float | None
    cmdline: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ActionRow:
    """One action of the incident, placed on the timeline.

    Attributes:
        action: span name (``pyspy.dump``, ``cuda.coredump``, ``profile.session``, ...).
        pid: target pid, ``None`` for actions not bound to one process.
        title: the target's title (``""`` when unknown).
        outcome: the outcome string (``ok``, ``timed_out``, ...), as in the manifest.
        retryable: whether trying again could help.
        detail: one human line.
        start_offset_s: start minus incident open, seconds (``None`` when the action has no time).
        duration_s: wall-clock duration, seconds.
        artifact_paths: files written, resolved against the bundle's current location.
        attributes: the span attributes, as recorded.
    """

    action: str
    pid: int | None
    title: str
    outcome: str
    retryable: bool
    detail: str
    start_offset_s: float | None
    duration_s: float
    artifact_paths: tuple[str, ...]
    attributes: Mapping[str, Any]

    @property
    def end_offset_s(self) -> float | None:
        """End minus incident open, seconds (``None`` when the action has no time)."""
        return None if self.start_offset_s is None else self.start_offset_s + self.duration_s


@dataclass(frozen=True, slots=True)
class CoredumpRow:
    """One ``cuda.coredump`` action summarised.

    Attributes:
        pid: target pid.
        outcome: its outcome.
        path: the core file (``""`` when none was written).
        size_bytes: size from the span attribute, else from the file; ``None`` when unknown.
    """

    pid: int | None
    outcome: str
    path: str
    size_bytes: int | None


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One ``profile.session`` action summarised.

    Attributes:
        pid: target pid.
        outcome: its outcome.
        duration_s: session duration, seconds.
        steps_captured: forward steps inside the profile (``None`` when not recorded).
        trace_paths: trace files written.
        trace_size_bytes: their total size in bytes (files that are present).
        attributes: every ``servewatch.profile.*`` attribute as recorded.
    """

    pid: int | None
    outcome: str
    duration_s: float
    steps_captured: int | None
    trace_paths: tuple[str, ...]
    trace_size_bytes: int
    attributes: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class RequestRow:
    """A request in flight when the incident opened (never its prompt text).

    Attributes:
        pid: the process serving it (``None`` when only known from a span link).
        request_id: the server's request id (``""`` when unknown).
        trace_id: hex trace id of the request span.
        span_id: hex span id of the request span.
        age_s: age when the incident opened, seconds (``None`` when unknown).
        prompt_tokens: prompt length in tokens (``None`` when unknown).
        generated_tokens: tokens generated so far (``None`` when unknown).
    """

    pid: int | None
    request_id: str
    trace_id: str
    span_id: str
    age_s: float | None
    prompt_tokens: int | None
    generated_tokens: int | None


@dataclass(frozen=True, slots=True)
class ArtifactRow:
    """A file the incident wrote.

    Attributes:
        path: where it is now (inside the bundle when the bundle was copied).
        recorded_path: the path as recorded in the manifest.
        action: the action that wrote it.
        pid: that action's pid.
        size_bytes: current size, ``None`` when the file is missing.
    """

    path: str
    recorded_path: str
    action: str
    pid: int | None
    size_bytes: int | None

    @property
    def exists(self) -> bool:
        """Whether the file was found."""
        return self.size_bytes is not None


@dataclass(frozen=True, slots=True)
class SpanRow:
    """A span of the incident's trace found in OTLP/JSON span files (enrichment only).

    Attributes:
        name: span name.
        span_id / parent_span_id: hex ids (``""`` for the root's parent).
        start_offset_s: start minus incident open, seconds.
        duration_s: duration, seconds.
        status_code: OTLP status code (0 unset, 1 ok, 2 error).
        attributes: flattened span attributes.
    """

    name: str
    span_id: str
    parent_span_id: str
    start_offset_s: float
    duration_s: float
    status_code: int
    attributes: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One moment of the server's history before the incident (manifest ``history``).

    Attributes:
        time_unix_nano: when, ns since the epoch.
        offset_s: ``time_unix_nano`` minus the incident's open, seconds (negative: before it).
        kind: ``step``, ``progress_stopped``, ``stall``, ``health_failed``, ``health_recovered``, ``exit``.
        pid: the process (``None``: the server as a whole).
        forward_ct: the step counter's value, when about steps.
        detail: one line in words.
    """

    time_unix_nano: int
    offset_s: float
    kind: str
    pid: int | None
    forward_ct: int | None
    detail: str


@dataclass(frozen=True, slots=True)
class IncidentTimeline:
    """One incident, read back from its bundle.

    Attributes:
        bundle_dir: the bundle folder read.
        incident_id / trigger / detail / host_name / trace_id / span_id: from the manifest.
        opened_time_unix_nano / closed_time_unix_nano: ns since the epoch.
        duration_s: incident duration, seconds.
        targets: target processes.
        actions: actions ordered by start time.
        stacks: one entry per process that has a py-spy action or a ``pyspy-<pid>.json``.
        coredumps / profiles: summaries of the ``cuda.coredump`` / ``profile.session`` actions.
        requests: in-flight requests (``requests.json``, else the incident span's links).
        inflight_count: in-flight requests per the manifest.
        hard_signal_sent: pid -> signal name (hard mode).
        artifacts: every artifact, with current paths and sizes.
        spans: spans of the incident trace found in span files (empty offline).
        span_files: the span files they came from.
        warnings: problems that did not stop the read (an unreadable stacks file, ...).
        state / phases_done / phases_pending / interrupted_reason: the incident's progress per
            the manifest (written at open and after each phase); an old manifest reads ``closed``.
    """

    bundle_dir: str
    incident_id: str
    trigger: str
    detail: str
    host_name: str
    trace_id: str
    span_id: str
    opened_time_unix_nano: int
    closed_time_unix_nano: int
    duration_s: float
    targets: tuple[TargetRow, ...]
    actions: tuple[ActionRow, ...]
    stacks: tuple[ProcessStacks, ...]
    coredumps: tuple[CoredumpRow, ...]
    profiles: tuple[ProfileRow, ...]
    requests: tuple[RequestRow, ...]
    inflight_count: int
    hard_signal_sent: Mapping[str, str]
    artifacts: tuple[ArtifactRow, ...]
    spans: tuple[SpanRow, ...] = ()
    span_files: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    #: ``open`` (still running: what is done so far), ``closed`` or ``interrupted``
    state: str = "closed"
    phases_done: tuple[str, ...] = ()
    phases_pending: tuple[str, ...] = ()
    interrupted_reason: str = ""
    #: the cross-rank verdict as the manifest holds it (``kind``, ``culprit_ranks``, ``reason``,
    #: ``confidence``, ``headline``, ``evidence``, ``next`` ...), or ``None``
    verdict: dict[str, Any] | None = None
    #: the server's history before the incident (the manifest's ``history``), oldest first
    history: tuple[HistoryRow, ...] = ()
    #: the job's verdict where this host coordinated a job incident (:func:`read_job_verdict`),
    #: or ``None``
    job_verdict: dict[str, Any] | None = None

    @property
    def extent_s(self) -> float:
        """Length of the drawn timeline, seconds: the incident or its last action, whichever ends later."""
        ends = [a.end_offset_s for a in self.actions if a.end_offset_s is not None]
        ends += [s.start_offset_s + s.duration_s for s in self.spans]
        return max([self.duration_s, *ends, 0.0])

    def title_of(self, pid: int | None) -> str:
        """The title of target ``pid`` (``""`` when unknown)."""
        for target in self.targets:
            if target.pid == pid:
                return target.title
        return ""


# --- finding a bundle -------------------------------------------------------------------------


def read_manifest(path: Path) -> ManifestView:
    """Read ``manifest.json``: the values :class:`agent.host.manifest.Manifest` holds
    (:mod:`agent.model.manifest_view`), without building that model for a manifest as the agent writes
    it; any other is validated by the model (:func:`agent.host.manifest.parse_manifest`).

    Raises:
        BundleNotFoundError: no such file.
        BundleCorruptError: not a manifest this servewatch reads (the reason in one line).
        BundleError: it cannot be read (permissions, I/O).
    """
    try:
        return _manifest(path)
    except FileNotFoundError as exc:
        raise BundleNotFoundError(f"{path}: no such file") from exc
    except PermissionError as exc:
        raise _unreadable(path) from exc
    except OSError as exc:
        raise BundleError(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from exc
    except ManifestError as exc:
        raise BundleCorruptError(str(exc)) from exc


def _manifest(path: Path) -> ManifestView:
    """:func:`read_manifest` in :func:`agent.host.manifest.load_manifest`'s terms (OSError, ManifestError)."""
    raw = path.read_bytes()
    view = view_of_json(raw)
    if view is None:  # not as the agent writes it: the model coerces it, or says what is wrong
        from agent.host.manifest import parse_manifest

        view = view_of_model(parse_manifest(raw, source=str(path)))
    return view


def _unreadable(path: str | os.PathLike[str], what: str | None = None) -> BundleError:
    """The one line for ``path`` (or ``what``, the thing looked for in it) this process may not
    read: the folder that stops it, its owner and what to do (the engineer who forgot ``sudo``)."""
    why = access_denied(path) or f"{path}: permission denied"
    return BundleError(f"cannot read {what or path}: {why}")


def _hidden_by(data_dir: Path) -> str | None:
    """Why bundles under ``data_dir`` may be hidden from this process: ``data_dir`` itself or one
    of its host folders it may not read (:func:`access_denied`'s line), else ``None``. Blocking."""
    why = access_denied(data_dir)
    if why is not None:
        return why
    try:
        folders = sorted(d for d in data_dir.iterdir() if d.is_dir())
    except OSError:
        return None
    return next((w for d in folders if (w := access_denied(d)) is not None), None)


def _bundles(data_dir: Path) -> list[Path]:
    """Bundle folders under ``data_dir`` (``<data_dir>/<host>/<id>/manifest.json``; a host folder
    ``<data_dir>/<host>`` works too)."""
    found = [*data_dir.glob(f"*/*/{MANIFEST_NAME}"), *data_dir.glob(f"*/{MANIFEST_NAME}")]
    return sorted({p.parent for p in found if p.is_file()})


def _opened_ns(bundle: Path) -> int:
    """When the incident opened (ns); for an unreadable manifest, the UTC time its id starts with
    (``20261201T190156Z-manual-...``), else the manifest's modification time. The id's time keeps
    an old bundle damaged (or copied) today from passing for the latest incident."""
    return _opened_and_manual(bundle)[0]


def _opened_and_manual(bundle: Path) -> tuple[int, bool]:
    """(:func:`_opened_ns`, whether it is a manual incident: ``servewatch dump`` or the HTTP API;
    for an unreadable manifest, whether its id says ``-manual-``)."""
    try:
        m = _manifest(bundle / MANIFEST_NAME)
    except (OSError, ManifestError):
        manual = f"-{Trigger.MANUAL}-" in bundle.name
        try:
            stamp = datetime.strptime(bundle.name[:16], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
        except ValueError:
            return (bundle / MANIFEST_NAME).stat().st_mtime_ns, manual
        return int(stamp.timestamp()) * 10**9, manual
    return m.opened_time_unix_nano, m.trigger == Trigger.MANUAL


def _latest(bundles: Sequence[Path]) -> tuple[Path, list[Path]]:
    """The bundle ``latest`` means, and the manual ones opened after it, oldest first.

    ``latest`` is the incident that would have paged someone: the newest one the agent opened
    by itself (stall, health, exit...). Manual dumps (``servewatch dump``, the Paged section's
    step 3) taken after it do not hide it; they are returned, to be named. With only manual
    incidents, the newest of them."""
    ordered = sorted(((*_opened_and_manual(b), b.name, b) for b in bundles), key=lambda x: (x[0], x[2]))
    paging = [i for i, (_, manual, _, _) in enumerate(ordered) if not manual]
    if not paging:
        return ordered[-1][3], []
    at = paging[-1]
    return ordered[at][3], [b for _, _, _, b in ordered[at + 1:]]


def newer_manual_dumps(data_dir: str | os.PathLike[str]) -> list[str]:
    """Ids of the manual dumps opened after the incident ``latest`` means under ``data_dir``
    (:func:`find_bundle`), oldest first; ``[]`` when none (or no bundle)."""
    root = Path(data_dir)
    bundles = _bundles(root) if root.is_dir() else []
    return [b.name for b in _latest(bundles)[1]] if bundles else []


def find_bundle(data_dir: str | os.PathLike[str], incident_id: str = "latest") -> Path:
    """Resolve an incident id to its bundle folder under a data dir.

    Args:
        data_dir: the agent's data dir; bundles are ``<data_dir>/<host>/<incident_id>/``.
        incident_id: an incident id, a unique prefix or suffix of one (``a1b2c3``), or
            ``"latest"``: the incident opened last by the agent itself (the one that paged you;
            manual dumps after it do not hide it), else the manual dump opened last.

    Returns:
        The bundle folder.

    Raises:
        BundleNotFoundError: no data dir, no bundle, or no bundle matching.
        BundleError: the id matches several bundles.
    """
    root = Path(data_dir)
    bundles = _bundles_under(root)
    if incident_id == "latest":
        return _latest(bundles)[0]
    exact = [b for b in bundles if b.name == incident_id]
    matches = exact or [b for b in bundles if b.name.startswith(incident_id) or b.name.endswith(incident_id)]
    if not matches:
        if (why := _hidden_by(root)) is not None:
            raise BundleError(f"no incident {incident_id!r} readable in {root}: {why}")
        raise BundleNotFoundError(f"{root}: no incident {incident_id!r} ({len(bundles)} bundles; try 'latest')")
    if len(matches) > 1:
        names = ", ".join(str(m.relative_to(root)) for m in matches[:5])
        raise BundleError(f"{root}: {incident_id!r} matches {len(matches)} incidents ({names}); give the full id")
    return matches[0]


def _bundles_under(root: Path) -> list[Path]:
    """The bundles under data dir ``root``; none, or no such folder: :class:`BundleNotFoundError`
    (:class:`BundleError` when this user may not read them)."""
    try:
        is_dir = root.is_dir()
    except PermissionError:
        is_dir = False
    if not is_dir:
        if access_denied(root) is not None:  # a folder above it is closed to this user
            raise _unreadable(root, f"the incidents in {root}")
        raise BundleNotFoundError(f"{root}: no such data directory")
    bundles = _bundles(root)
    if not bundles:
        if (why := _hidden_by(root)) is not None:  # root's 0700 data dir, read without sudo
            raise BundleError(f"cannot read the incidents in {root}: {why}")
        raise BundleNotFoundError(f"{root}: no incident bundles (expected <data_dir>/<host>/<id>/{MANIFEST_NAME})")
    return bundles


def _resolve(path: str | os.PathLike[str], incident_id: str | None) -> tuple[Path, Path | None]:
    """Return ``(bundle_dir, data_dir or None)`` for the forms :func:`load_incident` accepts."""
    p = Path(path)
    if incident_id is not None:
        return find_bundle(p, incident_id), p
    try:
        return _resolve_path(p)
    except PermissionError as exc:  # a folder on the way is closed to this user (no sudo)
        raise _unreadable(p) from exc
    except BundleNotFoundError:
        if access_denied(p) is not None:
            raise _unreadable(p) from None
        raise


def _resolve_path(p: Path) -> tuple[Path, Path | None]:
    """:func:`_resolve` for a path alone. Raises PermissionError for a folder closed on the way."""
    if p.is_file():
        return p.parent, None
    if (p / MANIFEST_NAME).is_file():
        return p, None
    if p.is_dir():
        return find_bundle(p, "latest"), p
    if p.name == MANIFEST_NAME or p.suffix == ".json":
        raise BundleNotFoundError(f"{p}: no such manifest")
    raise BundleNotFoundError(f"{p}: no such incident bundle or data directory")


# --- reading ----------------------------------------------------------------------------------


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _inside(path: Path, bundle_dir: Path) -> bool:
    """Whether ``path`` resolves (symlinks followed) into the bundle: the only files read."""
    return is_within(path, bundle_dir)


def _resolve_artifact(recorded: str, bundle_dir: Path, incident_id: str) -> Path:
    """Where a recorded artifact path is now: inside this bundle when it was copied.

    Only files inside the bundle are ever opened: a manifest (copied from elsewhere, or
    edited) naming ``/etc/shadow`` or a symlink out of the bundle yields a path that is shown
    but never read. An artifact not found inside the bundle is returned as recorded.
    """
    rec = Path(recorded)
    candidates: list[Path] = []
    if not rec.is_absolute():
        candidates.append(bundle_dir / rec)
    parts = rec.parts
    if incident_id in parts:  # <anything>/<incident_id>/<rel...> -> <bundle_dir>/<rel...>
        rel = parts[parts.index(incident_id) + 1:]
        if rel:
            candidates.append(bundle_dir.joinpath(*rel))
    candidates.append(bundle_dir / rec.name)
    for candidate in candidates:
        if candidate.is_file() and _inside(candidate, bundle_dir):
            return candidate
    if _inside(rec, bundle_dir) and rec.is_file():
        return rec
    return rec


def _size(path: Path, bundle_dir: Path | None = None) -> int | None:
    if bundle_dir is not None and not _inside(path, bundle_dir):
        return None  # outside the bundle: not looked at
    try:
        return path.stat().st_size
    except OSError:
        return None


def _frame_matches(frame: Frame, hung: str) -> bool:
    if hung in (frame.label, f"{frame.name} ({frame.filename}:{frame.line})"):
        return True
    return hung.split(" (", 1)[0] == frame.name and (frame.short_filename in hung or frame.filename in hung)


def _locate(threads: Sequence[ThreadStack], hung: str, preferred: ThreadStack | None) -> tuple[int | None, int | None]:
    ordered = ([preferred] if preferred is not None else []) + [t for t in threads if t is not preferred]
    for thread in ordered:
        for index, frame in enumerate(thread.frames):
            if _frame_matches(frame, hung):
                return thread.thread_id, index
    return None, None


def _stacks_for(
    pid: int, title: str, pyspy: ActionRow | None, bundle_dir: Path, warnings: list[str]
) -> ProcessStacks:
    attrs = pyspy.attributes if pyspy is not None else {}
    json_path = _stacks_path(pid, pyspy, bundle_dir, warnings)
    threads, error = _read_threads(pid, json_path, warnings)
    hung, source, hung_thread_id, hung_index = _hung_in(threads, attrs)
    count = _as_int(attrs.get(_PYSPY_THREAD_COUNT))
    return ProcessStacks(
        pid=pid,
        title=title,
        threads=threads,
        hung_frame=hung if isinstance(hung, str) else None,
        hung_frame_source=source,
        hung_thread_id=hung_thread_id,
        hung_frame_index=hung_index,
        thread_count=count if count is not None else (len(threads) if threads else None),
        stacks_path=str(json_path) if json_path is not None and json_path.is_file() else "",
        error=error,
        summary=_stacks_summary(attrs),
    )


def _stacks_path(pid: int, pyspy: ActionRow | None, bundle_dir: Path, warnings: list[str]) -> Path | None:
    """The py-spy JSON of ``pid``: the dump's artifact inside the bundle, else ``pyspy-<pid>.json`` there."""
    json_path: Path | None = None
    if pyspy is not None:
        json_path = next((Path(p) for p in pyspy.artifact_paths if p.endswith(".json")), None)
    if json_path is not None and not _inside(json_path, bundle_dir):
        warnings.append(f"stacks of pid {pid} not read: {json_path} is outside the bundle")
        json_path = None
    if json_path is None or not json_path.is_file():
        local = bundle_dir / f"pyspy-{pid}.json"
        json_path = local if local.is_file() and _inside(local, bundle_dir) else json_path
    return json_path


def _read_threads(pid: int, json_path: Path | None, warnings: list[str]) -> tuple[tuple[ThreadStack, ...], str]:
    """The threads in a py-spy JSON, and the error reading it (``""``: none)."""
    if json_path is None or not json_path.is_file():
        return (), ""
    try:
        # py-spy copies names byte for byte: invalid UTF-8 is escaped, never loses the stacks
        data = json.loads(json_path.read_bytes().decode("utf-8", "surrogateescape"))
        if isinstance(data, dict) and isinstance(data.get("threads"), list):
            data = data["threads"]
        return tuple(parse_threads(data, pid=pid)), ""
    except (OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        warnings.append(f"stacks of pid {pid} unreadable: {json_path}: {error}")
        return (), error


def _hung_in(threads: tuple[ThreadStack, ...], attrs: Mapping[str, Any]) -> tuple[Any, str, int | None, int | None]:
    """The hung frame (py-spy's attribute, else read from the stacks), its source, thread id and frame index."""
    location = hung_location(threads)
    preferred = location[0] if location is not None else None
    hung = attrs.get(_PYSPY_HUNG_FRAME)
    if isinstance(hung, str) and hung:
        hung_thread_id, hung_index = _locate(threads, hung, preferred)
        return hung, "attribute", hung_thread_id, hung_index
    if location is not None:
        hung_thread, hung_index = location
        return hung_thread.frames[hung_index].label, "stacks", hung_thread.thread_id, hung_index
    return None, "", None, None


def _stacks_summary(attrs: Mapping[str, Any]) -> tuple[str, ...]:
    """py-spy's own summary lines of the stacks (the first attribute of :data:`_PYSPY_STACKS` that has some)."""
    for key in _PYSPY_STACKS:
        lines = attrs.get(key)
        if isinstance(lines, list) and lines:
            return tuple(str(x) for x in lines)
    return ()


def read_job_verdict(bundle_dir: Path, warnings: list[str]) -> dict[str, Any] | None:
    """The job verdict in ``bundle_dir`` (``job-verdict.json``, :data:`JOB_VERDICT_NAME`: only the
    bundle of the host that coordinated the job incident has one), as the views show it: the
    verdict's own fields (``headline``, ``hung``, ``culprit_ranks``, ``culprit_hosts``, ``evidence``
    (at most 16 lines), ``next``, ``missing_hosts``) plus ``coordinator``, ``hosts_expected`` and
    ``hosts_with_evidence``. ``None`` when there is none; an unreadable or malformed file adds one
    line to ``warnings`` and is ``None``."""
    path = bundle_dir / JOB_VERDICT_NAME
    doc = _bundle_json(path, bundle_dir, warnings)
    if doc is None:
        return None
    verdict = doc.get("verdict") if isinstance(doc, dict) else None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("headline"), str):
        warnings.append(f"{path}: no job verdict with a headline in it")
        return None
    evidence = verdict.get("evidence")
    step = verdict.get("next")
    return {
        **verdict,
        "evidence": [str(line) for line in evidence[:16]] if isinstance(evidence, list) else [],
        "next": step if isinstance(step, str) else "",
        "hung": verdict.get("hung") is not False,
        "coordinator": str(doc.get("coordinator") or ""),
        "hosts_expected": _as_int(doc.get("hosts_expected")),
        "hosts_with_evidence": _as_int(doc.get("hosts_with_evidence")),
    }


def _bundle_json(path: Path, bundle_dir: Path, warnings: list[str]) -> Any:
    """The JSON at ``path`` inside ``bundle_dir``; ``None`` when there is none (or it points out
    of the bundle), or when it cannot be read or parsed (one line added to ``warnings``)."""
    if not path.is_file() or not _inside(path, bundle_dir):
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        warnings.append(f"{path}: unreadable ({type(exc).__name__})")
        return None


def _requests_from_file(bundle_dir: Path, warnings: list[str]) -> tuple[RequestRow, ...] | None:
    path = bundle_dir / REQUESTS_NAME
    data = _bundle_json(path, bundle_dir, warnings)
    if data is None:
        return None
    items = data.get("requests") if isinstance(data, dict) else data
    if not isinstance(items, list):
        warnings.append(f"{path}: no 'requests' list")
        return None
    rows = []
    for r in items:
        if not isinstance(r, dict):
            continue
        rows.append(
            RequestRow(
                pid=_as_int(r.get("pid")),
                request_id=str(r.get("request_id") or ""),
                trace_id=str(r.get("trace_id") or ""),
                span_id=str(r.get("span_id") or ""),
                age_s=_as_float(r.get("age_s")),
                prompt_tokens=_as_int(r.get("prompt_tokens")),
                generated_tokens=_as_int(r.get("generated_tokens")),
            )
        )
    return tuple(rows)


# --- spans (optional enrichment) ----------------------------------------------------------------


def _any_value(value: AnyValue) -> Any:
    """An OTLP attribute value as Python: str, bool, int, float, a list of those; ``None`` for
    bytes and key-value lists (not shown)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(value, kind)
    return None


def _attrs(raw: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in raw}


def _span_files(search: Iterable[Path]) -> Iterator[Path]:
    """Span files under each search path (:func:`exporters.otlp.otlp_json.iter_span_files`); files
    found in a folder stay inside it (no symlink out). Each file once."""
    seen: set[Path] = set()
    for root in search:
        if root.is_file():
            found = [root]
        elif root.is_dir():
            found = [p for p in iter_span_files([root]) if is_within(p, root)]
        else:
            continue
        for path in found:
            if path not in seen:
                seen.add(path)
                yield path


def _read_trace_spans(
    files: Iterable[Path], trace_id: str, torn: TornLines, warnings: list[str]
) -> tuple[list[Span], list[str]]:
    """Spans of ``trace_id`` (hex) from span files, read by :func:`exporters.otlp.otlp_json.read_span_file`.

    A span repeated (a replay) is kept once. A torn last line (a writer killed mid-line, a full
    disk) or a corrupt line is skipped and counted in ``torn``; a ``.binpb`` file that does not parse adds a warning and
    keeps the spans read before the bad line.

    Returns:
        ``(spans, files that held any of them)``.
    """
    spans: dict[bytes, Span] = {}
    used: list[str] = []
    try:
        wanted = bytes.fromhex(trace_id)
    except ValueError:
        return [], []
    needle = trace_id.encode("ascii")
    for path in files:
        hit = False
        try:
            # OTLP/JSON lines without the hex id cannot hold the trace: not parsed
            for request in read_span_file(path, torn, contains=needle):
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            if span.trace_id == wanted and span.span_id:
                                spans.setdefault(span.span_id, span)  # replays repeat spans
                                hit = True
        except OSError as exc:
            warnings.append(f"{path}: unreadable ({exc.strerror or type(exc).__name__})")
        except ValueError as exc:
            warnings.append(f"span file skipped from the bad part on: {exc}")
        if hit:
            used.append(str(path))
    return list(spans.values()), used


def _span_rows(raw: Sequence[Span], opened_ns: int) -> tuple[SpanRow, ...]:
    rows = []
    for span in raw:
        start = span.start_time_unix_nano or opened_ns
        end = span.end_time_unix_nano or start
        rows.append(
            SpanRow(
                name=span.name,
                span_id=span.span_id.hex(),
                parent_span_id=span.parent_span_id.hex(),
                start_offset_s=(start - opened_ns) / 1e9,
                duration_s=max(0, end - start) / 1e9,
                status_code=int(span.status.code),
                attributes=_attrs(span.attributes),
            )
        )
    rows.sort(key=lambda s: (s.start_offset_s, s.name))
    return tuple(rows)


def _requests_from_links(raw: Sequence[Span], root_span_id: str) -> tuple[RequestRow, ...]:
    rows = []
    for span in raw:
        if span.span_id.hex() != root_span_id:
            continue
        for link in span.links:
            attrs = _attrs(link.attributes)
            rid = next((str(v) for k, v in attrs.items() if k.endswith(("request.id", "request_id", "response.id"))), "")
            rows.append(
                RequestRow(
                    pid=_as_int(attrs.get("process.pid")),
                    request_id=rid,
                    trace_id=link.trace_id.hex(),
                    # a link to a request's in-flight span names the request's own span
                    span_id=str(attrs.get("servewatch.request.span_id") or link.span_id.hex()),
                    age_s=None,
                    prompt_tokens=None,
                    generated_tokens=None,
                )
            )
    return tuple(rows)


# --- load -------------------------------------------------------------------------------------


def _actions(
    m: ManifestView, bundle_dir: Path, titles: Mapping[int, str]
) -> tuple[tuple[ActionRow, ...], tuple[ArtifactRow, ...]]:
    """The manifest's actions placed on the timeline (ordered by start; timeless ones last), and
    every artifact they recorded, resolved against the bundle's current location."""
    opened_ns = m.opened_time_unix_nano
    actions: list[ActionRow] = []
    artifacts: list[ArtifactRow] = []
    for entry in m.actions:
        attrs = entry.attributes
        pid = entry.pid if entry.pid is not None else _as_int(attrs.get("process.pid"))
        start = entry.start_time_unix_nano
        end = entry.end_time_unix_nano or start
        name = str(entry.action)
        resolved = []
        for recorded in entry.artifact_paths:
            now = _resolve_artifact(recorded, bundle_dir, m.incident_id)
            resolved.append(str(now))
            artifacts.append(ArtifactRow(str(now), recorded, name, pid, _size(now, bundle_dir)))
        actions.append(
            ActionRow(
                action=name,
                pid=pid,
                title=titles.get(pid, "") if pid is not None else "",
                outcome=str(entry.outcome),
                retryable=entry.retryable,
                detail=entry.detail,
                start_offset_s=(start - opened_ns) / 1e9 if start else None,
                duration_s=entry.duration_s if entry.duration_s is not None else max(0, end - start) / 1e9,
                artifact_paths=tuple(resolved),
                attributes=dict(attrs),
            )
        )
    actions.sort(key=lambda r: (r.start_offset_s is None, r.start_offset_s or 0.0))
    return tuple(actions), tuple(artifacts)


def _all_stacks(
    actions: Sequence[ActionRow], targets: Sequence[TargetRow], bundle_dir: Path, warnings: list[str]
) -> tuple[ProcessStacks, ...]:
    """One entry per process with a ``pyspy.dump`` action or a ``pyspy-<pid>.json`` in the
    bundle, in target order (others after, by pid)."""
    titles = {t.pid: t.title for t in targets}
    pyspy_by_pid = {a.pid: a for a in actions if a.action == Action.PYSPY_DUMP and a.pid is not None}
    stack_pids = list(pyspy_by_pid)
    for found in sorted(bundle_dir.glob("pyspy-*.json")):
        pid = _as_int(found.stem.removeprefix("pyspy-"))
        if pid is not None and pid not in stack_pids:
            stack_pids.append(pid)
    order = {t.pid: i for i, t in enumerate(targets)}
    stack_pids.sort(key=lambda p: (order.get(p, len(order)), p))
    return tuple(_stacks_for(p, titles.get(p, ""), pyspy_by_pid.get(p), bundle_dir, warnings) for p in stack_pids)


def _coredumps(actions: Sequence[ActionRow], bundle_dir: Path, incident_id: str) -> tuple[CoredumpRow, ...]:
    """The ``cuda.coredump`` actions: core file (span attribute, else the first artifact) and size."""
    rows = []
    for a in actions:
        if a.action != Action.CUDA_COREDUMP:
            continue
        core = a.attributes.get(_COREDUMP_PATH)
        core_path = str(_resolve_artifact(core, bundle_dir, incident_id)) if isinstance(core, str) and core else ""
        if not core_path and a.artifact_paths:
            core_path = a.artifact_paths[0]
        size = _as_int(a.attributes.get(_COREDUMP_SIZE))
        if size is None and core_path:
            size = _size(Path(core_path))
        rows.append(CoredumpRow(a.pid, a.outcome, core_path, size))
    return tuple(rows)


def _profiles(actions: Sequence[ActionRow], bundle_dir: Path) -> tuple[ProfileRow, ...]:
    """The ``profile.session`` actions: steps captured, trace files and their total size."""
    rows = []
    for a in actions:
        if a.action != Action.PROFILE_SESSION:
            continue
        traces = tuple(a.artifact_paths)
        rows.append(
            ProfileRow(
                pid=a.pid,
                outcome=a.outcome,
                duration_s=a.duration_s,
                steps_captured=_as_int(a.attributes.get(_PROFILE_STEPS)),
                trace_paths=traces,
                trace_size_bytes=sum(_size(Path(p), bundle_dir) or 0 for p in traces),
                attributes={k: v for k, v in a.attributes.items() if k.startswith("servewatch.profile.")},
            )
        )
    return tuple(rows)


def _incident_spans(
    m: ManifestView, bundle_dir: Path, data_dir: Path | None,
    span_paths: Sequence[str | os.PathLike[str]] | None, warnings: list[str],
) -> tuple[list[Span], list[str]]:
    """The spans of the incident's trace (none without a trace id) and the files they came from;
    see :func:`load_incident` for where they are looked for."""
    trace_id = m.trace_id.lower()
    if not trace_id:
        return [], []
    if span_paths is None:
        search = [bundle_dir]
        if data_dir is None and m.host_name and bundle_dir.parent.name == m.host_name:
            data_dir = bundle_dir.parent.parent
        if data_dir is not None:
            search.append(data_dir)
    else:
        search = [Path(p) for p in span_paths]
    torn = TornLines()
    spans, used = _read_trace_spans(_span_files(search), trace_id, torn, warnings)
    if torn.count:
        warnings.append(f"{torn.count} torn line(s) in span files skipped (an interrupted write)")
    if torn.corrupt:
        warnings.append(f"{torn.corrupt} corrupt line(s) in span files skipped, the rest read (first: {torn.first_corrupt})")
    return spans, used


def load_incident(
    path: str | os.PathLike[str],
    incident_id: str | None = None,
    *,
    span_paths: Sequence[str | os.PathLike[str]] | None = None,
) -> IncidentTimeline:
    """Read an incident bundle into an :class:`IncidentTimeline`.

    Args:
        path: an incident folder, its ``manifest.json``, or a data dir (then ``incident_id``
            picks the bundle; a data dir alone means the latest one).
        incident_id: with a data dir: an id, a unique prefix/suffix of one, or ``"latest"``.
        span_paths: OTLP/JSON lines files or folders to enrich from. ``None`` searches the bundle
            folder and, when the data dir is known (given, or the bundle still sits in
            ``<data_dir>/<host.name>/``), the data dir. ``[]`` reads the bundle alone.

    Returns:
        The timeline; never holds prompt text.

    Raises:
        BundleNotFoundError: no such bundle.
        BundleCorruptError: the manifest is not a servewatch incident manifest.
        BundleError: the bundle cannot be read for another reason.
    """
    bundle_dir, data_dir = _resolve(path, incident_id)
    m = read_manifest(bundle_dir / MANIFEST_NAME)
    warnings: list[str] = []
    targets = tuple(
        TargetRow(pid=t.pid, title=t.title, create_time_s=t.create_time_s, cmdline=t.cmdline) for t in m.targets
    )
    actions, artifacts = _actions(m, bundle_dir, {t.pid: t.title for t in targets})
    raw_spans, used_files = _incident_spans(m, bundle_dir, data_dir, span_paths, warnings)
    requests = _requests_from_file(bundle_dir, warnings)
    if requests is None:
        requests = _requests_from_links(raw_spans, m.span_id.lower())
    opened_ns = m.opened_time_unix_nano
    state, closed_ns, duration_s = _state_and_close(m)
    job_verdict = read_job_verdict(bundle_dir, warnings)

    return IncidentTimeline(
        bundle_dir=str(bundle_dir),
        incident_id=m.incident_id,
        trigger=str(m.trigger),
        detail=m.detail,
        host_name=m.host_name,
        trace_id=m.trace_id.lower(),
        span_id=m.span_id.lower(),
        opened_time_unix_nano=opened_ns,
        closed_time_unix_nano=closed_ns,
        duration_s=duration_s,
        targets=targets,
        actions=actions,
        stacks=_all_stacks(actions, targets, bundle_dir, warnings),
        coredumps=_coredumps(actions, bundle_dir, m.incident_id),
        profiles=_profiles(actions, bundle_dir),
        requests=requests,
        inflight_count=m.inflight_requests if m.inflight_requests is not None else len(requests),
        hard_signal_sent=dict(m.hard_signal_sent),
        artifacts=artifacts,
        spans=_span_rows(raw_spans, opened_ns),
        span_files=tuple(used_files),
        warnings=tuple(warnings),
        state=state,
        phases_done=tuple(str(p) for p in m.phases_done),
        phases_pending=tuple(str(p) for p in m.phases_pending),
        interrupted_reason=m.interrupted_reason,
        verdict=_verdict_view(m.verdict) if m.verdict is not None else None,
        job_verdict=job_verdict,
        history=tuple(
            HistoryRow(time_unix_nano=p.time_unix_nano, offset_s=(p.time_unix_nano - opened_ns) / 1e9, kind=p.kind,
                       pid=p.pid, forward_ct=p.forward_ct, detail=p.detail)
            for p in m.history
        ),
    )


def _state_and_close(m: ManifestView) -> tuple[str, int, float]:
    """An incident's state (a closed one cut short: ``interrupted``), its close time (still open:
    its last update) and its duration in seconds."""
    opened_ns = m.opened_time_unix_nano
    state = m.state.value
    if m.state is IncidentState.CLOSED and m.interrupted:
        state = IncidentState.INTERRUPTED.value
    still_open = m.state is IncidentState.OPEN
    closed_ns = m.closed_time_unix_nano or (m.updated_time_unix_nano if still_open else None) or opened_ns
    duration_s = m.duration_s if not still_open else None
    return state, closed_ns, duration_s if duration_s is not None else max(0, closed_ns - opened_ns) / 1e9


def _verdict_view(verdict: dict[str, Any]) -> dict[str, Any]:
    """The manifest's verdict, its ``next`` line rebuilt when a bundle written before it existed has
    none (:func:`agent.verdict.rules.next_step_of`: from the verdict's kind, culprits and lines; ``""``
    for a kind this servewatch does not know)."""
    if not verdict.get("next"):
        # only for an older bundle: the read-only commands stay light
        from agent.verdict.rules import next_step_of

        verdict["next"] = next_step_of(verdict)
    return verdict


def load_incident_arg(
    arg: str | os.PathLike[str] | None, *, data_dir: str | os.PathLike[str]
) -> IncidentTimeline:
    """What ``servewatch timeline [INCIDENT|DIR]`` and ``servewatch report INCIDENT`` read.

    Args:
        arg: ``None`` (the latest incident under ``data_dir``); an existing path (a bundle
            folder, its ``manifest.json``, or another data dir: its latest incident); else an
            incident id, a unique prefix/suffix of one, or ``"latest"``, looked up in ``data_dir``.
        data_dir: the agent's data dir (``--data-dir``).

    Returns:
        The timeline, enriched from span files when found (see :func:`load_incident`).

    Raises:
        BundleError: one line saying which bundle and why (not found, ambiguous, corrupt).
    """
    if arg is None:
        return load_incident(data_dir, "latest")
    try:
        exists = Path(arg).exists()
    except PermissionError:
        exists = False
    if not exists and access_denied(arg) is not None:  # under root's 0700 data dir, without sudo
        raise _unreadable(arg)
    if exists:
        return load_incident(arg)
    return load_incident(data_dir, str(arg))


# --- words shared by the timeline and the report (no rich: the report draws no terminal) ----


def timeline_to_dict(tl: IncidentTimeline) -> dict[str, Any]:
    """The timeline as a JSON-ready dict (``servewatch timeline --json``).

    Field names carry units (``start_offset_s``, ``size_bytes``); ``schema`` is
    ``servewatch.timeline/1``. Derived values are added: ``end_offset_s`` per action, ``exists``
    per artifact, ``extent_s``.
    """
    out = asdict(tl)
    out = {"schema": "servewatch.timeline/1", **out, "extent_s": tl.extent_s}
    for row, action in zip(out["actions"], tl.actions):
        row["end_offset_s"] = action.end_offset_s
    for row, artifact in zip(out["artifacts"], tl.artifacts):
        row["exists"] = artifact.exists
    return json.loads(json.dumps(out, default=str))


def format_size(size_bytes: int | None) -> str:
    """``1.15 GiB`` style size; ``"missing"`` for ``None``."""
    if size_bytes is None:
        return "missing"
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size_bytes} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size_bytes} B"


def job_verdict_title(job: dict[str, Any]) -> str:
    """``job verdict · coordinated by node-a · evidence from 2 of 3 hosts`` (:func:`agent.views.bundle.read_job_verdict`'s view)."""
    have, expected = job.get("hosts_with_evidence"), job.get("hosts_expected")
    hosts = f" · evidence from {have} of {expected} hosts" if have is not None and expected is not None else ""
    return f"job verdict · coordinated by {job.get('coordinator') or 'this host'}{hosts}"


def verdict_headline(verdict: dict[str, Any]) -> str:
    """The verdict's one line (the manifest's ``headline``, else rebuilt from its fields)."""
    if isinstance(verdict.get("headline"), str) and verdict["headline"]:
        return str(verdict["headline"])
    ranks = verdict.get("culprit_ranks") or []
    who = f"culprit rank(s) {', '.join(str(r) for r in ranks)}" if ranks else "no culprit rank"
    return f"Verdict: {who} -- {verdict.get('reason', '?')} [confidence {verdict.get('confidence', '?')}]"
