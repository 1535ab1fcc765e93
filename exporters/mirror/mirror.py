"""Mirror incident and action events from the bus as finished OTel spans.

Owns :class:`SpanMirror`. It decides nothing: an ``IncidentOpened`` is remembered, each
``ActionCompleted`` (``StacksDumped``, ``CoredumpTriggered``, ``ProfileStopped`` ...) becomes a
child span named after ``result.action`` with the action's own start/end times, and
``IncidentClosed`` emits the root span ``incident`` spanning open to close (in a large job, an
incident opened with ``servewatch.trace.detail=linked`` sends its action spans to a trace of
its own, rooted at ``incident.detail`` and linked both ways, and its ``incident`` span stays in the
job's trace as the host's summary); a job coordinator's
``JobIncidentClosed`` emits the job's root span ``job.incident`` (every host's ``incident`` hangs
under it, with the job verdict on it). Ids come from the
events (hex, chosen by :mod:`agent.incidents.manager` with :mod:`agent.model.ids`), so the
trace can be referenced before it is exported. Span links to in-flight requests are read from a
``links`` attribute of the open/close events when present (``((trace_id_hex, span_id_hex), ...)``).

Requests in flight (``IncidentOpened.inflight``): a request's span is written only when the request
ends, so for a server that is SIGKILLed or never recovers it never reaches the backend. When the
incident opens, the mirror emits (write-ahead) for each of them a span of the request's part up
to the incident, in the request's own trace: named ``"<request span name> (in flight)"``, a
sibling of the request's span (same parent; a trace root when the request is one), from the
request's start to the incident's, with ``servewatch.request.in_flight = true``, the request's
own span id (``servewatch.request.span_id``), its gen_ai attributes and token counts so far, and
a link back to the incident. The incident's root links to these spans (they always arrive), each
link saying why: ``servewatch.link.reason = request_in_flight``, ``gen_ai.response.id``,
``process.pid``, ``servewatch.request.age_s``. Should the request end after all, its own span
arrives beside its in-flight one. At most :data:`MAX_LINKS` requests per incident.

A ``profile.session`` result's torch traces are imported as child spans of its span
(:mod:`exporters.mirror.torch_trace`, streaming and capped), so the profile sits inside the incident. The
files are the server's, so untrusted: a running agent's mirror (built with a
:class:`~exporters.mirror.trace_imports.TraceImporter`) emits the session span at once with
``servewatch.trace_import.state = deferred`` and imports its files off the span pipeline: the
ranges follow in groups of 2,000 as they are read, and when the import ends (well, failed, past
its deadline or cancelled at shutdown) one ``profile.trace_import`` span with the counts, children
of the session span. No span
waits for an import. Without an importer (``servewatch profile``, a one-shot ``dump``) the
import runs inline, within the same budget, and its counts sit on the session span.

Every span of a finished action (with its imported children) and every incident root is handed
to the sink write-ahead (:func:`exporters.otlp.spans.emit_durable`), keyed by its span id (the action's
id comes from the incident layer and is in the manifest): with the agent's pipeline it is on disk
in the spool before the mirror returns, so a SIGKILL afterwards cannot lose it. Once the root of
an incident is durable and every action group before it was, the bundle gets
:data:`agent.host.manifest.SPANS_DURABLE_NAME`; a bundle without it (the agent was killed first) is
checked by the next agent, which re-sends from the manifest exactly the spans that are not
durable (:func:`agent.incidents.manager.recover_interrupted`).

Imports :mod:`agent.model.events`, :mod:`agent.model.bus` (types only), :mod:`exporters.otlp.spans`,
:mod:`exporters.mirror.torch_trace` and :mod:`exporters.mirror.trace_imports`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Link

from agent.host.fsutil import atomic_write_text
from agent.host.manifest import MANIFEST_NAME, SPANS_DURABLE_NAME
from agent.model.events import (
    TRACE_DETAIL_ATTR,
    Action,
    ActionCompleted,
    ActionResult,
    Event,
    IncidentClosed,
    IncidentOpened,
    IncidentRetraced,
    InflightSpan,
    JobIncidentClosed,
    LifecycleNoted,
    Outcome,
    now_ns,
)
from agent.model.ids import parse_span_id, parse_trace_id
from exporters.otlp.spans import (
    CollectingSink,
    DurableChunkSink,
    SpanSink,
    build_span,
    emit_durable,
    link_to,
    new_span_id,
    new_trace_id,
    span_id_hex,
    trace_id_hex,
)

if TYPE_CHECKING:
    from agent.host.registry import BuildContext
    from agent.model.bus import Subscription
    from exporters import Exporter
    from exporters.mirror.torch_trace import ImportBudget
    from exporters.mirror.trace_imports import TraceImporter
    from exporters.otlp.processor import ExportStatistics

__all__ = [
    "INCIDENT_SPAN",
    "JOB_INCIDENT_SPAN",
    "LIFECYCLE_SPAN",
    "MIRRORED_EVENTS",
    "PROFILE_SPAN",
    "TRACE_IMPORT_SPAN",
    "SpanMirror",
    "action_failed",
    "action_span",
    "create",
    "mirror_profile_session",
]

_log = logging.getLogger(__name__)

#: Name of the root span of an incident trace.
INCIDENT_SPAN = "incident"
#: Name of a job incident's root span (the job verdict), emitted by the job's coordinator.
JOB_INCIDENT_SPAN = "job.incident"
#: Name of a partial job verdict (a coordinator that reached no other host), under the job's root.
JOB_VERDICT_SPAN = "job.verdict"
#: Name of the root of an incident's linked detail trace (its action spans, in a large job).
DETAIL_SPAN = "incident.detail"
#: Event types to subscribe the mirror to.
MIRRORED_EVENTS: tuple[type[Event], ...] = (IncidentOpened, ActionCompleted, IncidentClosed, IncidentRetraced, JobIncidentClosed,
                                             LifecycleNoted)
#: Name of the span of what became of a server after an incident (a hang's ending, a crash
#: loop's exits, processes left alive): a child of that incident's root, in its trace.
LIFECYCLE_SPAN = "server.lifecycle"
#: Name of a profiling session's span (its torch trace is imported under it).
PROFILE_SPAN = Action.PROFILE_SESSION
#: Name of the span carrying a deferred import's counts, child of its ``profile.session`` span.
TRACE_IMPORT_SPAN = "profile.trace_import"
#: Seconds :meth:`SpanMirror.close_open` waits for a running trace import to stop.
IMPORT_GRACE_S = 2.0
#: Outcomes that are facts about the target, not failures: their spans keep status UNSET (an
#: unarmed coredump is the normal case without ``servewatch launch``; no red span in Jaeger).
NOT_ERRORS = frozenset({Outcome.NOT_ARMED, Outcome.SKIPPED, Outcome.ALREADY_STOPPED, Outcome.NOT_ENABLED, Outcome.NO_SOURCE})
#: Most span links put on one root span (in-flight requests can be thousands).
MAX_LINKS = 128
#: Verdict kinds that say the server is dead (``servewatch.verdict.kind``): the incident's root
#: span is an error for these, as for any verdict that says it is hung (``servewatch.verdict.hung``).
DEAD_VERDICTS = frozenset({"dead", "cascade", "orphaned"})


def action_failed(outcome: Outcome) -> bool:
    """Whether an action's outcome is a failure: its span is an error and it counts in
    ``servewatch.incident.failed_actions`` (a fact about the target, :data:`NOT_ERRORS`, is not)."""
    return outcome is not Outcome.OK and outcome not in NOT_ERRORS


def _root_error(attributes: Mapping[str, object]) -> str | None:
    """The incident root's error description: the verdict's reason when the verdict says the
    server is dead or hung (``None``: no verdict, or one that says it is not)."""
    kind = attributes.get("servewatch.verdict.kind")
    if kind in DEAD_VERDICTS or attributes.get("servewatch.verdict.hung") is True:
        return f"{kind}: {attributes.get('servewatch.verdict.reason') or 'no reason given'}"
    return None


@dataclass
class _OpenIncident:
    trace_id: int
    span_id: int
    opened: IncidentOpened
    actions: int = 0
    failed_actions: int = 0
    #: every group of spans emitted for it so far is durable (written ahead, on disk)
    durable: bool = True
    #: spans emitted for it (root excluded)
    spans: int = 0
    #: the span the root hangs under (a trace joined from a peer), or None for a trace root
    parent_span_id: int | None = None
    #: the trace this incident had before it joined a peer's (hex), if it moved
    retraced_from: str = ""
    #: (trace id, root span id) of the trace its action spans go to when linked (a large job), else None
    detail: tuple[int, int] | None = None


def _detail_ids(incident_id: str) -> tuple[int, int]:
    """The linked detail trace of an incident: ids derived from the incident id (stable across a retrace)."""
    digest = hashlib.sha256(f"servewatch/detail/{incident_id}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


#: Span link attribute: why a span links to another (``request_in_flight``: a request in flight
#: when the incident opened; ``incident``: the incident a request's in-flight span belongs to).
LINK_REASON_ATTR = "servewatch.link.reason"
#: Span name suffix of a request's in-flight span (its part up to the incident).
INFLIGHT_SUFFIX = " (in flight)"


def _inflight_span_id(incident_id: str, request_span_hex: str) -> int:
    """The in-flight span of a request in an incident: its id derived from both (stable when the
    incident's spans are sent again)."""
    digest = hashlib.sha256(f"servewatch/inflight/{incident_id}/{request_span_hex}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


def _links(event: Event) -> list[Link]:
    raw = getattr(event, "links", ()) or ()
    incident_id = getattr(event, "incident_id", "")
    refs = {(r.trace_id, r.span_id): r for r in getattr(event, "inflight", ()) or ()}
    links: list[Link] = []
    for item in raw:
        try:
            trace_hex, span_hex = item[0], item[1]
            ref = refs.get((trace_hex, span_hex))
            if ref is None:  # only the ids are known (a bundle re-sent by a later agent): the request's span
                links.append(link_to(trace_hex, span_hex, {LINK_REASON_ATTR: "request_in_flight"}))
                continue
            links.append(link_to(trace_hex, _inflight_span_id(incident_id, span_hex), {
                LINK_REASON_ATTR: "request_in_flight", "gen_ai.response.id": ref.request_id, "process.pid": ref.pid,
                "servewatch.request.age_s": round(ref.age_s, 3), "servewatch.request.span_id": ref.span_id,
            }))
        except (TypeError, ValueError, IndexError):
            _log.debug("ignoring malformed span link %r", item)
    return links


def _inflight_attributes(ref: InflightSpan, incident_id: str) -> dict[str, object]:
    attributes: dict[str, object] = {
        "servewatch.request.in_flight": True,
        "servewatch.request.span_id": ref.span_id,
        "servewatch.incident.id": incident_id,
        "gen_ai.response.id": ref.request_id,
        "process.pid": ref.pid,
    }
    if ref.operation:
        attributes["gen_ai.operation.name"] = ref.operation
    if ref.model:
        attributes["gen_ai.request.model"] = ref.model
    if ref.input_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = ref.input_tokens
    if ref.output_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = ref.output_tokens
    return attributes


class SpanMirror:
    """Turns incident/action events into spans on ``sink``.

    Args:
        sink: where finished spans go (``Telemetry.sink``); its ``resource`` is used.
        host_name: ``host.name`` put on the incident root span.
        export_statistics: optional ``processor.statistics``; when given, the root span carries
            ``servewatch.export.spans_lost`` (dropped + evicted + rejected so far), so a lossy
            pipeline shows up in the trace itself.
        importer: imports profile traces off the span pipeline (the running agent's); ``None``:
            inline, within the same budget.
    """

    #: the bus events it turns into spans (subscribe to these)
    events: tuple[type[Event], ...] = MIRRORED_EVENTS

    def __init__(
        self,
        sink: SpanSink,
        *,
        host_name: str,
        export_statistics: Callable[[], ExportStatistics] | None = None,
        importer: TraceImporter | None = None,
    ) -> None:
        self.sink = sink
        self.host_name = host_name
        self._export_statistics = export_statistics
        self.importer = importer
        self._open: dict[str, _OpenIncident] = {}
        #: spans emitted
        self.emitted = 0
        #: action events for an incident the mirror never saw open (mirrored in their own trace)
        self.orphans = 0

    @property
    def open_incidents(self) -> tuple[str, ...]:
        return tuple(self._open)

    def root_ids(self, incident_id: str) -> tuple[str, str] | None:
        """(trace_id hex, span_id hex) of an open incident's root span."""
        inc = self._open.get(incident_id)
        return (trace_id_hex(inc.trace_id), span_id_hex(inc.span_id)) if inc else None

    def handle(self, event: Event) -> None:
        """Mirror one event. Never raises (a bad event is logged and skipped)."""
        try:
            if isinstance(event, IncidentOpened):
                self._opened(event)
            elif isinstance(event, ActionCompleted):
                self._action(event)
            elif isinstance(event, IncidentClosed):
                self._closed(event)
            elif isinstance(event, IncidentRetraced):
                self._retraced(event)
            elif isinstance(event, JobIncidentClosed):
                self._job_closed(event)
            elif isinstance(event, LifecycleNoted):
                self._lifecycle(event)
        except Exception:  # noqa: BLE001 - the mirror must never take the agent down
            _log.exception("could not mirror %s", type(event).__name__)

    async def run(self, subscription: Subscription | Iterable[Event]) -> None:
        """Consume events until the subscription ends, then emit roots of incidents left open."""
        try:
            async for event in subscription:  # type: ignore[union-attr]
                self.handle(event)
        finally:
            self.close_open(reason="agent stopped")

    def close_open(self, *, reason: str, time_unix_nano: int | None = None) -> int:
        """Emit the root span of every incident still open (agent exiting mid-incident), after
        stopping the trace importer (a running import is cancelled and reports what it got,
        within :data:`IMPORT_GRACE_S`).

        Returns:
            How many roots were emitted.
        """
        if self.importer is not None:
            self.importer.close(IMPORT_GRACE_S)
        end = time_unix_nano or now_ns()
        count = 0
        for incident_id in list(self._open):
            inc = self._open.pop(incident_id)
            self._emit_root(inc, end_time_unix_nano=end, closed=None, unclosed_reason=reason)
            count += 1
        return count

    # --- per event ------------------------------------------------------------------------

    def _opened(self, event: IncidentOpened) -> None:
        trace_id = parse_trace_id(event.trace_id) or new_trace_id()
        span_id = parse_span_id(event.span_id) or new_span_id()
        parent = parse_span_id(event.parent_span_id) if event.trace_id else None
        detail = _detail_ids(event.incident_id) if event.attributes.get(TRACE_DETAIL_ATTR) == "linked" else None
        self._open[event.incident_id] = _OpenIncident(trace_id, span_id, event, parent_span_id=parent, detail=detail)
        if event.inflight:
            self._emit_inflight(event, trace_id, span_id)

    def _emit_inflight(self, event: IncidentOpened, incident_trace: int, incident_span: int) -> None:
        """Each request in flight: its part up to the incident, in its own trace, at once and
        write-ahead (the server may be SIGKILLed next; see the module docstring)."""
        spans: list[ReadableSpan] = []
        back = link_to(incident_trace, incident_span, {LINK_REASON_ATTR: "incident", "servewatch.incident.id": event.incident_id})
        for ref in event.inflight[:MAX_LINKS]:
            trace_id, request_span = parse_trace_id(ref.trace_id), parse_span_id(ref.span_id)
            if trace_id is None or request_span is None:
                continue
            start = ref.start_time_unix_nano or event.time_unix_nano
            spans.append(build_span(
                (ref.name or "request") + INFLIGHT_SUFFIX, trace_id=trace_id,
                span_id=_inflight_span_id(event.incident_id, ref.span_id),
                parent_span_id=parse_span_id(ref.parent_span_id) if ref.parent_span_id else None,
                start_time_unix_nano=min(start, event.time_unix_nano), end_time_unix_nano=event.time_unix_nano,
                attributes=_inflight_attributes(ref, event.incident_id), links=[back], resource=self.sink.resource,
            ))
        if spans:
            self._emit_all(spans, key=span_id_hex(spans[0].context.span_id))

    def _retraced(self, event: IncidentRetraced) -> None:
        inc = self._open.get(event.incident_id)
        trace_id = parse_trace_id(event.trace_id)
        if inc is None or trace_id is None:
            return
        inc.retraced_from = event.previous_trace_id or trace_id_hex(inc.trace_id)
        inc.trace_id = trace_id
        inc.parent_span_id = parse_span_id(event.parent_span_id)

    def _action(self, event: ActionCompleted) -> None:
        result = event.result
        inc = self._open.get(event.incident_id)
        if inc is None:
            self.orphans += 1
            trace_id, parent = new_trace_id(), None
        else:
            trace_id, parent = inc.detail if inc.detail is not None else (inc.trace_id, inc.span_id)
            inc.actions += 1
            if action_failed(result.outcome):
                inc.failed_actions += 1
        children = CollectingSink(self.sink.resource)
        deferred = self.importer is not None and result.action == PROFILE_SPAN and bool(result.artifact_paths)
        span = action_span(
            children,
            result,
            trace_id=trace_id,
            parent_span_id=parent,
            default_time_unix_nano=event.time_unix_nano,
            extra_attributes={"servewatch.incident.id": event.incident_id},
            import_artifacts=not deferred,
        )
        durable = self._emit_all([*children.spans, span], key=span_id_hex(span.context.span_id))
        if deferred:
            self._defer_import(result, trace_id=trace_id, session_span_id=span.context.span_id, incident_id=event.incident_id)
        if inc is not None:
            inc.durable = inc.durable and durable
            inc.spans += len(children.spans) + 1

    def _closed(self, event: IncidentClosed) -> None:
        inc = self._open.pop(event.incident_id, None)
        if not event.emit_root:
            # a later agent finishing an interrupted incident whose root is already durable: the
            # actions it re-sent were the only spans missing
            if inc is not None and inc.durable:
                self._mark_durable(event.bundle_dir, inc.spans)
            return
        if inc is None:
            # Never saw it open (mirror started late): still emit a root, from the close alone.
            opened = IncidentOpened(
                incident_id=event.incident_id, trigger=event.trigger, time_unix_nano=event.time_unix_nano, bundle_dir=event.bundle_dir
            )
            inc = _OpenIncident(new_trace_id(), new_span_id(), opened)
        self._emit_root(inc, end_time_unix_nano=event.time_unix_nano, closed=event, unclosed_reason="")

    def _defer_import(self, result: ActionResult, *, trace_id: int, session_span_id: int, incident_id: str) -> None:
        """Hand a profile session's files to the importer; its spans follow when it ends. A
        refused import (the importer's queue full or closed) is said by its span now."""
        assert self.importer is not None
        importer, sink = self.importer, self.sink
        start_ns = result.start_time_unix_nano or now_ns()
        window = (start_ns, result.end_time_unix_nano or start_ns)
        paths = tuple(result.artifact_paths)

        def run(budget: ImportBudget) -> None:
            from exporters.mirror.torch_trace import import_profile_artifacts

            began = now_ns()
            children = DurableChunkSink(sink)  # the ranges leave memory in groups as they are read
            attributes = import_profile_artifacts(
                paths, children, trace_id=trace_id, parent_span_id=session_span_id, start_time_unix_nano=window[0],
                end_time_unix_nano=window[1], budget=budget, ledger=importer.ledger,
            )
            children.flush()
            if budget.cancelled:
                attributes["servewatch.trace_import.cancelled"] = True
            self._emit_import([], attributes, trace_id=trace_id, parent=session_span_id, incident_id=incident_id,
                              start_time_unix_nano=began)

        if not importer.submit(run):
            self._emit_import([], {"servewatch.trace_import.error": "not imported: the trace importer is busy or stopped",
                                   "servewatch.trace_import.files": 0, "servewatch.trace_import.errors": len(paths)},
                              trace_id=trace_id, parent=session_span_id, incident_id=incident_id, start_time_unix_nano=now_ns())

    def _emit_import(
        self, spans: list[ReadableSpan], attributes: dict[str, object], *, trace_id: int, parent: int, incident_id: str,
        start_time_unix_nano: int,
    ) -> None:
        """The imported ranges and the ``profile.trace_import`` span with their counts (any thread)."""
        failed = bool(attributes.get("servewatch.trace_import.errors")) or bool(attributes.get("servewatch.trace_import.cancelled"))
        summary = build_span(
            TRACE_IMPORT_SPAN, trace_id=trace_id, parent_span_id=parent, start_time_unix_nano=start_time_unix_nano,
            end_time_unix_nano=max(start_time_unix_nano, now_ns()),
            attributes={**attributes, "servewatch.incident.id": incident_id},
            error=str(attributes.get("servewatch.trace_import.error") or "import cancelled") if failed else None,
            ok=not failed, resource=self.sink.resource,
        )
        emit_durable(self.sink, [*spans, summary], key=span_id_hex(summary.context.span_id))

    def _lifecycle(self, event: LifecycleNoted) -> None:
        """A ``server.lifecycle`` span under the incident it was noted on (none without one)."""
        trace_id, parent = parse_trace_id(event.trace_id), parse_span_id(event.parent_span_id)
        if trace_id is None or parent is None:
            return
        attributes: dict[str, object] = {
            "servewatch.lifecycle.phase": event.phase, "servewatch.detail": event.detail,
            "servewatch.incident.id": event.incident_id, "servewatch.follows.incident": event.incident_id,
        }
        if event.pids:
            attributes["process.pid"] = event.pids[0]
        span_id = new_span_id()
        self._emit_all([build_span(
            LIFECYCLE_SPAN, trace_id=trace_id, span_id=span_id, parent_span_id=parent,
            start_time_unix_nano=event.time_unix_nano, end_time_unix_nano=event.time_unix_nano, attributes=attributes,
            resource=self.sink.resource,
        )], key=span_id_hex(span_id))

    def _job_closed(self, event: JobIncidentClosed) -> None:
        trace_id, span_id = parse_trace_id(event.trace_id), parse_span_id(event.span_id)
        if trace_id is None or span_id is None:
            return
        attributes: dict[str, object] = {**event.attributes, "servewatch.job": event.job, "host.name": self.host_name}
        if event.incident_id:
            attributes["servewatch.incident.id"] = event.incident_id
        parent = parse_span_id(event.parent_span_id) if event.parent_span_id else None
        self._emit_all([build_span(
            JOB_INCIDENT_SPAN if parent is None else JOB_VERDICT_SPAN, trace_id=trace_id, span_id=span_id, parent_span_id=parent,
            start_time_unix_nano=min(event.start_time_unix_nano or event.time_unix_nano, event.time_unix_nano),
            end_time_unix_nano=event.time_unix_nano, attributes=attributes, resource=self.sink.resource,
        )], key=span_id_hex(span_id))

    def _emit_root(
        self, inc: _OpenIncident, *, end_time_unix_nano: int, closed: IncidentClosed | None, unclosed_reason: str
    ) -> None:
        opened = inc.opened
        attributes: dict[str, object] = {
            **opened.attributes,
            "servewatch.incident.id": opened.incident_id,
            "servewatch.incident.trigger": opened.trigger,
            "host.name": self.host_name,
            "servewatch.target.pids": tuple(int(p) for p in opened.pids),
            "servewatch.incident.actions": inc.actions,
            "servewatch.incident.failed_actions": inc.failed_actions,
        }
        if opened.detail:
            attributes["servewatch.incident.detail"] = opened.detail
        bundle_dir = closed.bundle_dir if closed is not None and closed.bundle_dir else opened.bundle_dir
        if bundle_dir:
            attributes["servewatch.bundle.dir"] = bundle_dir
        _add_closing(attributes, closed, unclosed_reason)
        if inc.retraced_from:
            attributes["servewatch.incident.retraced_from"] = inc.retraced_from
        self._add_spans_lost(attributes)
        links = _links(opened) + (_links(closed) if closed is not None else [])
        if len(links) > MAX_LINKS:
            attributes["servewatch.links.dropped"] = len(links) - MAX_LINKS
            links = links[:MAX_LINKS]
        if inc.detail is not None:
            attributes["servewatch.trace.detail_trace_id"] = trace_id_hex(inc.detail[0])
            links.insert(0, link_to(trace_id_hex(inc.detail[0]), span_id_hex(inc.detail[1])))
            self._emit_detail_root(inc, end_time_unix_nano, attributes)
        durable = self._emit_all([
            build_span(
                INCIDENT_SPAN,
                trace_id=inc.trace_id,
                span_id=inc.span_id,
                parent_span_id=inc.parent_span_id,
                start_time_unix_nano=opened.time_unix_nano,
                end_time_unix_nano=end_time_unix_nano,
                attributes=attributes,
                links=links,
                error=_root_error(attributes),
                resource=self.sink.resource,
            )
        ], key=span_id_hex(inc.span_id))
        if durable and inc.durable:
            self._mark_durable(bundle_dir, inc.spans + 1)

    def _add_spans_lost(self, attributes: dict[str, object]) -> None:
        if self._export_statistics is not None:
            try:
                attributes["servewatch.export.spans_lost"] = self._export_statistics().lost
            except Exception:  # noqa: BLE001 - statistics are a nicety
                _log.exception("export statistics unavailable")

    def _emit_detail_root(self, inc: _OpenIncident, end_time_unix_nano: int, attributes: dict[str, object]) -> None:
        """The root of a linked detail trace (``incident.detail``): the incident's action spans
        hang under it, and it links back to the incident span in the job's trace."""
        assert inc.detail is not None
        keep = ("servewatch.incident.id", "servewatch.incident.trigger", "host.name", "servewatch.bundle.dir",
                "servewatch.target.ranks", "servewatch.incident.actions", "servewatch.incident.failed_actions")
        self._emit_all([build_span(
            DETAIL_SPAN, trace_id=inc.detail[0], span_id=inc.detail[1], parent_span_id=None,
            start_time_unix_nano=inc.opened.time_unix_nano, end_time_unix_nano=end_time_unix_nano,
            attributes={k: attributes[k] for k in keep if k in attributes},
            links=[link_to(trace_id_hex(inc.trace_id), span_id_hex(inc.span_id))], resource=self.sink.resource,
        )], key=span_id_hex(inc.detail[1]))

    def _emit_all(self, spans: list[ReadableSpan], *, key: str = "") -> bool:
        durable = emit_durable(self.sink, spans, key=key)
        self.emitted += len(spans)
        return durable

    def _mark_durable(self, bundle_dir: str, spans: int) -> None:
        """Every span of the incident in ``bundle_dir`` is durable: say so in the bundle
        (:data:`agent.host.manifest.SPANS_DURABLE_NAME`), so a later agent never checks it again."""
        if not bundle_dir:
            return
        folder = Path(bundle_dir)
        if not (folder / MANIFEST_NAME).is_file():
            return  # not a bundle (a test, an incident without one)
        try:
            atomic_write_text(folder / SPANS_DURABLE_NAME, json.dumps({"spans": spans, "time_unix_nano": now_ns()}))
        except OSError as exc:  # the next agent checks the bundle and finds its spans durable
            _log.warning("could not mark the spans of %s durable: %s", folder, exc)


def _add_closing(attributes: dict[str, object], closed: IncidentClosed | None, unclosed_reason: str) -> None:
    """The incident span's attributes from its close (or why it was not closed)."""
    if closed is None:
        attributes["servewatch.incident.unclosed"] = unclosed_reason
        return
    if closed.manifest_path:
        attributes["servewatch.manifest.path"] = closed.manifest_path
    if closed.outcomes:
        attributes["servewatch.incident.outcomes"] = tuple(f"{a}={o}" for a, o in closed.outcomes)
    attributes["servewatch.incident.state"] = getattr(closed, "state", "closed") or "closed"
    attributes.update(closed.attributes)  # the verdict (servewatch.verdict.*)


def _result_attributes(result: ActionResult, extra_attributes: dict[str, object] | None) -> dict[str, object]:
    """An action span's own attributes (before any trace import)."""
    attributes: dict[str, object] = dict(result.attributes)
    attributes.update(extra_attributes or {})
    attributes["servewatch.outcome"] = str(result.outcome)
    attributes["servewatch.retryable"] = result.retryable
    if result.pid is not None:
        attributes["process.pid"] = result.pid
    if result.detail:
        attributes["servewatch.detail"] = result.detail
    if result.artifact_paths:
        attributes["servewatch.artifact.paths"] = tuple(result.artifact_paths)
    return attributes


def action_span(
    sink: SpanSink,
    result: ActionResult,
    *,
    trace_id: int,
    parent_span_id: int | None,
    default_time_unix_nano: int,
    extra_attributes: dict[str, object] | None = None,
    import_artifacts: bool = True,
) -> ReadableSpan:
    """The span of one action result, named ``result.action``; errors unless the outcome is ok.

    A ``profile.session`` result's torch traces (and Metal bundle) are imported first, as
    children of this span, and their counts become its attributes (within the default
    :class:`~exporters.mirror.torch_trace.ImportBudget`); with ``import_artifacts=False`` they are not
    (the caller imports them later) and the span says ``servewatch.trace_import.state = deferred``.
    """
    attributes = _result_attributes(result, extra_attributes)
    span_id = parse_span_id(result.span_id) or new_span_id()  # the incident layer's choice, in the manifest
    if result.action == PROFILE_SPAN and result.artifact_paths and not import_artifacts:
        attributes["servewatch.trace_import.state"] = "deferred"
    elif result.action == PROFILE_SPAN and result.artifact_paths:
        # profiles only: a dump does not import the trace reader
        from exporters.mirror.torch_trace import import_profile_artifacts

        start_ns = result.start_time_unix_nano or default_time_unix_nano
        attributes.update(
            import_profile_artifacts(
                result.artifact_paths, sink, trace_id=trace_id, parent_span_id=span_id,
                start_time_unix_nano=start_ns, end_time_unix_nano=result.end_time_unix_nano or start_ns,
            )
        )
    ok = result.outcome is Outcome.OK
    error = (result.detail or str(result.outcome)) if action_failed(result.outcome) else None
    start = result.start_time_unix_nano or default_time_unix_nano
    return build_span(
        result.action,
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id,
        start_time_unix_nano=start,
        end_time_unix_nano=result.end_time_unix_nano or start,
        attributes=attributes,
        error=error,
        ok=ok,
        resource=sink.resource,
    )


def mirror_profile_session(sink: SpanSink, result: ActionResult) -> str:
    """Emit an on-demand ``profile.session`` (``servewatch profile``) as its own trace.

    The session is the root span, with its torch trace ranges (and a Metal bundle's path and
    size) imported under it, as inside an incident.

    Returns:
        The trace id (32 hex digits).
    """
    trace_id = new_trace_id()
    children = CollectingSink(sink.resource)
    span = action_span(children, result, trace_id=trace_id, parent_span_id=None, default_time_unix_nano=now_ns())
    emit_durable(sink, [*children.spans, span])
    return trace_id_hex(trace_id)


def create(config: None, ctx: BuildContext) -> Exporter | None:
    """Registry factory (:data:`exporters.EXPORTERS` ``mirror``), at the ``start`` stage:
    incident and action events become spans on ``ctx.telemetry``; a running agent's mirror
    imports profile traces through a :class:`~exporters.mirror.trace_imports.TraceImporter` whose ledger
    lives in ``<data_dir>/trace-imports``."""
    if ctx.stage != "start" or ctx.telemetry is None:
        return None
    tel = ctx.telemetry
    importer = None
    if not ctx.one_shot:  # a running agent: profile traces are imported off the span pipeline
        from exporters.mirror.trace_imports import TraceImporter, TraceImportLedger

        importer = TraceImporter(ledger=TraceImportLedger(ctx.agent.layout.trace_imports))
    return SpanMirror(tel.sink, host_name=ctx.agent.host_name, export_statistics=tel.processor.statistics, importer=importer)
