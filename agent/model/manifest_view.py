"""``manifest.json`` read back for the read-only commands, without building the pydantic model.

Owns :func:`view_of_json`, :func:`view_of_data`, :func:`view_of_model` and :class:`ManifestView` (with :class:`TargetView`,
:class:`ActionView`, :class:`HistoryView`), :data:`MANIFEST_NAME`, :data:`STACK_NOT_ERRORS` and
:func:`stack_errors`. ``servewatch timeline`` and ``report`` read a bundle's manifest and must
start at once; building :class:`agent.host.manifest.Manifest` (six pydantic models, their schemas and
validators) cost them ~10 ms of a ~0.18 s start (docs/performance.md).

:class:`agent.host.manifest.Manifest` stays the one validator. A manifest is first checked here
against :data:`_MANIFEST`, a table of the model's fields (name, on-disk keys, type, default),
strictly: every value already of the exact type the model holds it as (an ``int`` that is no
``bool``, a ``float`` that is finite, a list of ``str``...), a known schema version, a known
``state``. A manifest that passes reads into the same values the model would hold. Anything else
-- not JSON, a field missing or mistyped, a value the model would coerce (``"42"`` for an int),
an unknown version -- is left to :func:`agent.host.manifest.parse_manifest` (the caller's, here
``None``), which accepts what it accepts and refuses the rest with its own one-line
:class:`~agent.errors.ManifestError`; :func:`view_of_model` reads its model into the same view
(:func:`agent.views.bundle.read_manifest` does both). ``tests/test_manifest_view.py`` checks the table against the
model's fields and the two paths against each other on mutated manifests.

Names (``trigger``, ``action``, ``outcome``, ``phases_done``) are plain strings in the view: the
model's :class:`~agent.model.kinds.StrEnum` members print and compare as those strings. ``state`` is an
:class:`~agent.model.kinds.IncidentState`. ``verdict`` is the JSON form of the model's verdict (what
``ManifestVerdict.model_dump(mode="json")`` gives), or ``None``.

Imports the standard library and :mod:`agent.model.kinds` only (:mod:`agent.host.manifest` imports this
module's constants). Raises nothing: what it cannot read is ``None``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from agent.model.kinds import Action, IncidentState

__all__ = [
    "JOB_VERDICT_NAME",
    "KNOWN_SCHEMAS",
    "MANIFEST_NAME",
    "SCHEMA_V1",
    "STACK_NOT_ERRORS",
    "ActionView",
    "HistoryView",
    "ManifestView",
    "TargetView",
    "stack_errors",
    "view_of_data",
    "view_of_json",
    "view_of_model",
]

#: File name of the manifest inside a bundle (``<data_dir>/<host>/<incident_id>/manifest.json``).
MANIFEST_NAME = "manifest.json"
#: File name of a job's verdict in the bundle of the host that coordinated it (written by
#: :mod:`agent.fleet.job`, read by the offline views): one JSON object, the job's verdict under
#: ``"verdict"`` (``headline``, ``culprit_ranks``, ``culprit_hosts``, ``evidence``, ``next`` ...)
#: beside ``coordinator``, ``hosts_expected``, ``hosts_with_evidence`` and each host's ``bundles``.
JOB_VERDICT_NAME = "job-verdict.json"

#: Version 1: the manifest as written since the first release (fields added with defaults since).
SCHEMA_V1 = "servewatch.incident/1"
#: Versions this servewatch reads (:class:`agent.host.manifest.Manifest` refuses any other, naming it).
KNOWN_SCHEMAS: frozenset[str] = frozenset({SCHEMA_V1})


class ManifestView(SimpleNamespace):
    """A manifest's fields as :class:`agent.host.manifest.Manifest` holds them (see there), read-only
    by convention; ``verdict`` is a JSON dict."""


class TargetView(SimpleNamespace):
    """One ``targets[]`` entry (:class:`agent.host.manifest.ManifestTarget`'s fields)."""


class ActionView(SimpleNamespace):
    """One ``actions[]`` entry (:class:`agent.host.manifest.ManifestAction`'s fields)."""


class HistoryView(SimpleNamespace):
    """One ``history[]`` point (:class:`agent.host.manifest.ManifestHistoryPoint`'s fields)."""


class _Refused(Exception):
    """Not read here: the model decides (it may coerce, or refuse with its own message)."""


_REQUIRED = object()


# --- value checks: each returns the value as the model holds it, or raises _Refused --------------


def _str(v: Any) -> str:
    if type(v) is not str:
        raise _Refused
    return v


def _int(v: Any) -> int:
    if type(v) is not int:
        raise _Refused
    return v


def _float(v: Any) -> float:
    # an int would be coerced by the model (and written back as 1.0): the model reads it
    if type(v) is not float or not math.isfinite(v):
        raise _Refused
    return v


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise _Refused
    return v


def _optional(check: Any) -> Any:
    def optional(v: Any) -> Any:
        return None if v is None else check(v)
    return optional


def _tuple_of(check: Any) -> Any:
    def tuple_of(v: Any) -> tuple[Any, ...]:
        if type(v) is not list:
            raise _Refused
        return tuple(check(x) for x in v)
    return tuple_of


def _str_map(v: Any) -> dict[str, str]:
    if type(v) is not dict or any(type(x) is not str for x in v.values()):
        raise _Refused
    return dict(v)


def _finite_json(v: Any) -> bool:
    if type(v) is float:
        return math.isfinite(v)
    if type(v) is list:
        return all(_finite_json(x) for x in v)
    if type(v) is dict:
        return all(_finite_json(x) for x in v.values())
    return True


def _json_map(v: Any) -> dict[str, Any]:
    # decoded JSON is a JSON value; a non-finite float (NaN, Infinity) is left to the model
    if type(v) is not dict or not _finite_json(v):
        raise _Refused
    return v


def _state(v: Any) -> IncidentState:
    if type(v) is not str:
        raise _Refused
    try:
        return IncidentState(v)
    except ValueError:
        raise _Refused from None


def _schema(v: Any) -> str:
    if type(v) is not str or v not in KNOWN_SCHEMAS:
        raise _Refused
    return v


def _non_empty_str(v: Any) -> str:
    if type(v) is not str or not v:
        raise _Refused
    return v


def _model(fields: tuple[tuple[str, tuple[str, ...], Any, Any], ...], cls: type) -> Any:
    def model(v: Any) -> Any:
        if type(v) is not dict:
            raise _Refused
        return cls(**_read(fields, v))
    return model


def _read(fields: tuple[tuple[str, tuple[str, ...], Any, Any], ...], data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, keys, check, default in fields:
        key = next((k for k in keys if k in data), None)
        if key is None:
            if default is _REQUIRED:
                raise _Refused
            out[name] = default() if callable(default) else default
        else:
            out[name] = check(data[key])
    return out


# --- the model's fields: (name, on-disk keys in the order the model looks for them, check, default)
# A default that is callable makes a fresh value (the model's default_factory).

_TARGET = (
    ("pid", ("pid",), _int, _REQUIRED),
    ("title", ("title",), _str, ""),
    ("create_time_s", ("create_time_s",), _optional(_float), None),
    ("cmdline", ("cmdline",), _tuple_of(_str), ()),
)

_ACTION = (
    ("action", ("action",), _str, _REQUIRED),
    ("pid", ("pid",), _optional(_int), None),
    ("outcome", ("outcome",), _str, _REQUIRED),
    ("retryable", ("retryable",), _bool, False),
    ("detail", ("detail",), _str, ""),
    ("start_time_unix_nano", ("start_time_unix_nano",), _int, 0),
    ("end_time_unix_nano", ("end_time_unix_nano",), _int, 0),
    ("duration_s", ("duration_s",), _optional(_float), None),
    ("artifact_paths", ("artifact_paths",), _tuple_of(_str), ()),
    ("attributes", ("attributes",), _json_map, dict),
    ("span_id", ("span_id",), _str, ""),
)

_VERDICT = (
    ("kind", ("kind",), _str, "unknown"),
    ("hung", ("hung",), _bool, True),
    ("culprit_ranks", ("culprit_ranks",), _tuple_of(_int), ()),
    ("culprit_pids", ("culprit_pids",), _tuple_of(_int), ()),
    ("culprit_roles", ("culprit_roles",), _tuple_of(_str), ()),
    ("reason", ("reason",), _str, ""),
    ("confidence", ("confidence",), _str, ""),
    ("evidence", ("evidence",), _tuple_of(_str), ()),
    ("stragglers", ("stragglers",), _tuple_of(_int), ()),
    ("ranks", ("ranks",), _tuple_of(_int), ()),
    ("headline", ("headline",), _str, ""),
    ("rule", ("rule",), _str, ""),
    ("next", ("next",), _str, ""),
    ("duration_s", ("duration_s",), _float, 0.0),
)

_HISTORY = (
    ("time_unix_nano", ("time_unix_nano",), _int, _REQUIRED),
    ("kind", ("kind",), _str, _REQUIRED),
    ("pid", ("pid",), _optional(_int), None),
    ("forward_ct", ("forward_ct",), _optional(_int), None),
    ("detail", ("detail",), _str, ""),
)


def _verdict_json(v: Any) -> dict[str, Any]:
    """The verdict as ``ManifestVerdict.model_dump(mode="json")`` gives it (tuples as lists)."""
    if type(v) is not dict:
        raise _Refused
    return {k: list(x) if type(x) is tuple else x for k, x in _read(_VERDICT, v).items()}


_MANIFEST = (
    ("schema_version", ("schema", "schema_version"), _schema, _REQUIRED),
    ("incident_id", ("incident_id",), _non_empty_str, _REQUIRED),
    ("trigger", ("trigger",), _str, _REQUIRED),
    ("detail", ("detail",), _str, ""),
    ("host_name", ("host.name", "host_name"), _str, ""),
    ("trace_id", ("trace_id",), _str, ""),
    ("span_id", ("span_id",), _str, ""),
    ("parent_span_id", ("parent_span_id",), _str, ""),
    ("opened_time_unix_nano", ("opened_time_unix_nano",), _int, _REQUIRED),
    ("closed_time_unix_nano", ("closed_time_unix_nano",), _int, 0),
    ("duration_s", ("duration_s",), _optional(_float), None),
    ("targets", ("targets",), _tuple_of(_model(_TARGET, TargetView)), ()),
    ("actions", ("actions",), _tuple_of(_model(_ACTION, ActionView)), ()),
    ("inflight_requests", ("inflight_requests",), _optional(_int), None),
    ("hard_signal_sent", ("hard_signal_sent",), _str_map, dict),
    ("exits_after_hard_signal", ("exits_after_hard_signal",), _str_map, dict),
    ("after_hard_signal", ("after_hard_signal",), _tuple_of(_str), ()),
    ("state", ("state",), _state, IncidentState.CLOSED),
    ("phases_done", ("phases_done",), _tuple_of(_str), ()),
    ("phases_pending", ("phases_pending",), _tuple_of(_str), ()),
    ("interrupted_reason", ("interrupted_reason",), _str, ""),
    ("interrupted", ("interrupted",), _bool, False),
    ("root_published", ("root_published",), _bool, False),
    ("spans_tracked", ("spans_tracked",), _bool, False),
    ("agent_pid", ("agent_pid",), _optional(_int), None),
    ("updated_time_unix_nano", ("updated_time_unix_nano",), _optional(_int), None),
    ("recovered_time_unix_nano", ("recovered_time_unix_nano",), _optional(_int), None),
    ("verdict", ("verdict",), _optional(_verdict_json), None),
    ("history", ("history",), _tuple_of(_model(_HISTORY, HistoryView)), ()),
    ("lifecycle", ("lifecycle",), _tuple_of(_str), ()),
    ("crash_loop_exits", ("crash_loop_exits",), _int, 0),
)


def view_of_data(data: Any) -> ManifestView | None:
    """The view of a decoded manifest when it is exactly as the model holds it, else ``None``
    (then :func:`agent.host.manifest.parse_manifest` decides)."""
    if type(data) is not dict:
        return None
    try:
        return ManifestView(**_read(_MANIFEST, data))
    except _Refused:
        return None


def view_of_model(m: Any) -> ManifestView:
    """The view of a validated :class:`agent.host.manifest.Manifest` (the same values it holds)."""
    def part(obj: Any, fields: tuple[tuple[str, tuple[str, ...], Any, Any], ...], cls: type) -> Any:
        return cls(**{name: _plain(getattr(obj, name)) for name, *_ in fields})

    values: dict[str, Any] = {}
    for name, *_ in _MANIFEST:
        value = getattr(m, name)
        if name == "targets":
            value = tuple(part(t, _TARGET, TargetView) for t in value)
        elif name == "actions":
            value = tuple(part(a, _ACTION, ActionView) for a in value)
        elif name == "history":
            value = tuple(part(h, _HISTORY, HistoryView) for h in value)
        elif name == "verdict":
            value = None if value is None else value.model_dump(mode="json")
        elif name != "state":
            value = _plain(value)
        values[name] = value
    return ManifestView(**values)


def _plain(value: Any) -> Any:
    """A name the model holds as a StrEnum member, as its plain string (tuples of them too)."""
    if isinstance(value, str) and type(value) is not str:
        return str(value)
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    if type(value) is dict:
        return dict(value)
    return value


def view_of_json(raw: str | bytes) -> ManifestView | None:
    """The view of ``manifest.json``'s text when it is JSON exactly as the model holds it, else
    ``None`` (then :func:`agent.host.manifest.parse_manifest` decides, and :func:`view_of_model` reads
    what it returns)."""
    try:
        return view_of_data(json.loads(raw))
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError): the model says so
        return None


#: ``pyspy.dump`` outcomes that are no error: captured, switched off by configuration, or the
#: target exited (a dead rank is evidence, often why the others hang).
STACK_NOT_ERRORS = frozenset({"ok", "skipped", "dead", "no_such_process", "zombie"})


def stack_errors(actions: Iterable[Any]) -> int:
    """The ``Errors: N`` every view of an incident prints (``dump``'s summary, ``timeline``, the
    HTML report; what makes ``servewatch dump`` exit 1): targets whose stacks could not be captured
    for an error (timed out, permission denied, not Python, py-spy missing or failed).

    Args:
        actions: objects with ``action`` and ``outcome`` (manifest actions, timeline rows).

    Returns:
        The count (0 when every process's stacks are in, or explained).
    """
    return sum(1 for a in actions if str(a.action) == Action.PYSPY_DUMP and str(a.outcome) not in STACK_NOT_ERRORS)
