"""Building finished spans after the fact, with exact ids and times.

Owns :class:`SpanSink` and :func:`build_span`. servewatch *mirrors* what happened: an incident
root span is only complete when the incident closes, an action span when the action ends, and an
imported torch range already has its times. So spans are built here as finished
``ReadableSpan`` objects (ids chosen by :mod:`agent.incidents.manager` or here, times from the events)
and handed to a span processor, instead of being timed live by a ``Tracer``.

Imports opentelemetry-api/sdk only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from agent.model.ids import new_span_id, new_trace_id, span_id_hex, trace_id_hex

__all__ = [
    "SCOPE",
    "CollectingSink",
    "DurableChunkSink",
    "InMemorySink",
    "ProcessorSink",
    "SpanSink",
    "build_span",
    "emit_durable",
    "link_to",
    "new_span_id",
    "new_trace_id",
    "reset_span_limits",
    "span_id_hex",
    "span_limits",
    "trace_id_hex",
]

#: Instrumentation scope of every span servewatch emits.
SCOPE = InstrumentationScope("servewatch", "0.1.0")

_limits: SpanLimits | None = None


def span_limits() -> SpanLimits:
    """The span limits servewatch applies to the spans it builds, read once from the standard
    env by the SDK's own ``SpanLimits`` (``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT``,
    ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`` / ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT``,
    ``OTEL_SPAN_LINK_COUNT_LIMIT``, ``OTEL_LINK_ATTRIBUTE_COUNT_LIMIT``...)."""
    global _limits
    if _limits is None:
        _limits = SpanLimits()
    return _limits


def reset_span_limits() -> None:
    """Read the span-limit env again on next use (tests)."""
    global _limits
    _limits = None


def _context(trace_id: int, span_id: int) -> SpanContext:
    return SpanContext(trace_id=trace_id, span_id=span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def link_to(trace_id: int | str, span_id: int | str, attributes: Mapping[str, object] | None = None) -> Link:
    """A span link to another span (ids as ints or hex strings)."""
    tid = int(trace_id, 16) if isinstance(trace_id, str) else trace_id
    sid = int(span_id, 16) if isinstance(span_id, str) else span_id
    return Link(_context(tid, sid), attributes=dict(attributes or {}))  # type: ignore[arg-type]


def build_span(
    name: str,
    *,
    trace_id: int,
    span_id: int | None = None,
    parent_span_id: int | None = None,
    start_time_unix_nano: int,
    end_time_unix_nano: int,
    attributes: Mapping[str, object] | None = None,
    links: Sequence[Link] = (),
    error: str | None = None,
    ok: bool = False,
    kind: SpanKind = SpanKind.INTERNAL,
    resource: Resource | None = None,
) -> ReadableSpan:
    """Build one finished span.

    Args:
        name: span name (``incident``, ``pyspy.dump``, ``ProfilerStep#3``...).
        trace_id / span_id / parent_span_id: ids as ints; ``span_id`` is generated when ``None``;
            no parent makes a root span.
        start_time_unix_nano / end_time_unix_nano: wall clock, ns since the epoch.
        attributes: OTel attribute values (str, bool, int, float or homogeneous sequences).
        links: span links (see :func:`link_to`).
        error: when set, status ERROR with this description; else ``ok`` gives status OK, and
            otherwise the status stays UNSET.
        resource: the resource to report under (the exporter's provider resource).

    The standard span limits apply (:func:`span_limits`): attributes past the count limit are
    dropped and counted (OTLP ``dropped_attributes_count``), string values cut at the length
    limit, links past the link limit dropped.
    """
    if error is not None:
        status = Status(StatusCode.ERROR, error)
    elif ok:
        status = Status(StatusCode.OK)
    else:
        status = Status(StatusCode.UNSET)
    limits = span_limits()
    bounded = BoundedAttributes(
        maxlen=limits.max_span_attributes, attributes=attributes or {}, immutable=False,  # type: ignore[arg-type]
        max_value_len=limits.max_span_attribute_length,
    )
    kept_links = tuple(links)
    if limits.max_links is not None and len(kept_links) > limits.max_links:
        kept_links = kept_links[: limits.max_links]
    return ReadableSpan(
        name=name,
        context=_context(trace_id, span_id if span_id is not None else new_span_id()),
        parent=_context(trace_id, parent_span_id) if parent_span_id is not None else None,
        resource=resource if resource is not None else Resource.get_empty(),
        attributes=bounded,
        links=kept_links,
        kind=kind,
        status=status,
        start_time=start_time_unix_nano,
        end_time=max(start_time_unix_nano, end_time_unix_nano),
        instrumentation_scope=SCOPE,
    )


class SpanSink(Protocol):
    """Where finished spans go. ``emit`` never blocks on the network and never raises.

    A sink may also offer ``emit_durable(spans, key=...) -> bool``: the spans are on disk when it
    returns ``True`` (write-ahead); use :func:`emit_durable` to call it with a fallback to ``emit``.
    """

    resource: Resource

    def emit(self, span: ReadableSpan) -> None: ...


def emit_durable(sink: SpanSink, spans: Sequence[ReadableSpan], *, key: str = "") -> bool:
    """Hand ``spans`` (one finished action and its children, or an incident root) to ``sink``
    write-ahead when it can (``sink.emit_durable``), else one by one with ``emit``.

    Args:
        key: the group's key (its main span's id, 16 hex digits), recorded with it on disk.

    Returns:
        Whether the spans are durable now (on disk); ``False`` for a sink that cannot say.
    """
    durable = getattr(sink, "emit_durable", None)
    if durable is not None:
        return bool(durable(spans, key=key))
    for span in spans:
        sink.emit(span)
    return False


class CollectingSink:
    """Buffers spans (e.g. a profile's imported ranges) so they can be written ahead together
    with their parent span."""

    def __init__(self, resource: Resource) -> None:
        self.resource = resource
        self.spans: list[ReadableSpan] = []

    def emit(self, span: ReadableSpan) -> None:
        self.spans.append(span)


class DurableChunkSink:
    """Hands spans on to ``sink`` write-ahead (:func:`emit_durable`) in groups of ``chunk``, so a
    long run of spans (a profile's imported ranges) leaves memory as it comes instead of being
    held, and encoded, all at once. Call :meth:`flush` at the end.

    Args:
        sink: where the groups go.
        chunk: spans per group.
    """

    def __init__(self, sink: SpanSink, *, chunk: int = 2000) -> None:
        self.sink = sink
        self.resource = sink.resource
        self.chunk = chunk
        self._pending: list[ReadableSpan] = []
        #: spans handed on so far
        self.emitted = 0

    def emit(self, span: ReadableSpan) -> None:
        self._pending.append(span)
        if len(self._pending) >= self.chunk:
            self.flush()

    def flush(self) -> None:
        """Hand on what is pending (one group keyed by its first span's id)."""
        if not self._pending:
            return
        group, self._pending = self._pending, []
        emit_durable(self.sink, group, key=span_id_hex(group[0].context.span_id))
        self.emitted += len(group)


class ProcessorSink:
    """A :class:`SpanSink` feeding an OTel ``SpanProcessor`` (batch, lossless, ...)."""

    def __init__(self, processor: SpanProcessor, resource: Resource | None = None) -> None:
        self.processor = processor
        self.resource = resource if resource is not None else Resource.get_empty()

    def emit(self, span: ReadableSpan) -> None:
        self.processor.on_end(span)

    def emit_durable(self, spans: Sequence[ReadableSpan], *, key: str = "") -> bool:
        """On disk before this returns (the processor's ``persist``), when the processor can.
        Returns whether they are (``False``: a processor without write-ahead)."""
        persist = getattr(self.processor, "persist", None)
        if persist is not None:
            return bool(persist(spans, key=key))
        for span in spans:
            self.processor.on_end(span)
        return False


class InMemorySink:
    """Test double: keeps every emitted span, thread-safe."""

    def __init__(self, resource: Resource | None = None) -> None:
        self.resource = resource if resource is not None else Resource.get_empty()
        self._spans: list[ReadableSpan] = []
        self._lock = threading.Lock()

    def emit(self, span: ReadableSpan) -> None:
        with self._lock:
            self._spans.append(span)

    @property
    def spans(self) -> list[ReadableSpan]:
        with self._lock:
            return list(self._spans)

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name == name]

    def extend(self, spans: Iterable[ReadableSpan]) -> None:
        for span in spans:
            self.emit(span)
