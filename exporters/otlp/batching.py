"""Size-aware OTLP trace requests: split a request by bytes, trim a span too large on its own.

Owns :func:`split_request`, :func:`halve_request` and :func:`trim_span`. A collector refuses a
gRPC message over its receive limit (4 MiB by default, ``RESOURCE_EXHAUSTED``) and an HTTP body
over its limit (413); these keep every request under a byte budget without re-encoding spans:
they work on the encoded protobuf, so a spooled batch is split with its ids and times intact.

Imports opentelemetry-proto only.
"""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

__all__ = ["ATTR_TRUNCATED", "TRUNCATION_MARK", "halve_request", "split_request", "trim_span"]

#: Span attribute set on a span trimmed to fit: how many attribute values were truncated or dropped.
ATTR_TRUNCATED = "servewatch.export.truncated_attributes"
#: Appended to a truncated string value.
TRUNCATION_MARK = "...[truncated]"
# protobuf framing of one repeated element (tag + length varint), bytes, generous
_FRAME = 8


def _spans_of(request: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def split_request(
    request: ExportTraceServiceRequest, max_bytes: int
) -> tuple[list[tuple[ExportTraceServiceRequest, int]], int]:
    """Cut ``request`` into requests of at most ``max_bytes`` encoded bytes each.

    Spans keep their resource and scope; order is kept. A span that alone does not fit is
    trimmed (:func:`trim_span`) and goes in a request of its own.

    Returns:
        ([(request, spans), ...], spans trimmed). A request already under the budget comes back
        as the only piece (the same object).
    """
    total = _spans_of(request)
    if request.ByteSize() <= max_bytes:
        return [(request, total)], 0
    pieces: list[tuple[ExportTraceServiceRequest, int]] = []
    trimmed = 0
    current: ExportTraceServiceRequest | None = None
    size = count = 0
    for rs in request.resource_spans:
        rs_overhead = rs.resource.ByteSize() + len(rs.schema_url) + 2 * _FRAME
        for ss in rs.scope_spans:
            ss_overhead = ss.scope.ByteSize() + len(ss.schema_url) + 2 * _FRAME
            cur_ss = None
            for span in ss.spans:
                span_bytes = span.ByteSize() + _FRAME
                budget = max_bytes - rs_overhead - ss_overhead
                if span_bytes > budget:
                    span = Span.FromString(span.SerializeToString())
                    trim_span(span, budget - _FRAME)
                    span_bytes = span.ByteSize() + _FRAME
                    trimmed += 1
                if current is not None and size + span_bytes > max_bytes:
                    pieces.append((current, count))
                    current, size, count, cur_ss = None, 0, 0, None
                if current is None:
                    current = ExportTraceServiceRequest()
                    size = 0
                if cur_ss is None:
                    cur_rs = current.resource_spans.add()
                    cur_rs.resource.CopyFrom(rs.resource)
                    cur_rs.schema_url = rs.schema_url
                    cur_ss = cur_rs.scope_spans.add()
                    cur_ss.scope.CopyFrom(ss.scope)
                    cur_ss.schema_url = ss.schema_url
                    size += rs_overhead + ss_overhead
                cur_ss.spans.append(span)
                size += span_bytes
                count += 1
    if current is not None and count:
        pieces.append((current, count))
    return pieces, trimmed


def halve_request(request: ExportTraceServiceRequest) -> tuple[list[tuple[ExportTraceServiceRequest, int]], int]:
    """Split ``request`` into pieces of about half its size (for a collector whose limit is
    below ours). A one-span request is trimmed to half its size instead.

    Returns:
        As :func:`split_request`.
    """
    size = request.ByteSize()
    spans = _spans_of(request)
    if spans <= 1:
        copy = ExportTraceServiceRequest.FromString(request.SerializeToString())
        for rs in copy.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    trim_span(span, max(1024, span.ByteSize() // 2))
        return [(copy, spans)], spans
    return split_request(request, max(1024, size // 2 + 1))


def _truncate_strings(span: Span, target: int) -> int:
    """Truncate the span's longest string attribute values until it is ``target`` bytes or
    less (or none is long); how many were truncated."""
    truncated = 0
    while span.ByteSize() > target:
        longest = None
        for kv in span.attributes:
            if (
                kv.value.WhichOneof("value") == "string_value"
                and len(kv.value.string_value) > 64
                and (longest is None or len(kv.value.string_value) > len(longest.value.string_value))
            ):
                longest = kv
        if longest is None:
            break
        excess = span.ByteSize() - target
        value = longest.value.string_value
        keep = max(32, len(value.encode()) - excess - len(TRUNCATION_MARK) - 16)
        longest.value.string_value = value.encode()[:keep].decode("utf-8", "ignore") + TRUNCATION_MARK
        truncated += 1
        if len(longest.value.string_value) >= len(value):
            break
    return truncated


def trim_span(span: Span, max_bytes: int) -> int:
    """Shrink one encoded span to about ``max_bytes``: the longest string attribute values are
    truncated first (marked with ``...[truncated]``), then events and links are dropped, then
    whole attributes. The count is recorded on the span as ``servewatch.export.truncated_attributes``
    and in the OTLP ``dropped_*_count`` fields.

    Returns:
        Attribute values truncated or dropped.
    """
    target = max(256, max_bytes - 64)
    # 1. truncate long string values, longest first, until it fits
    truncated = _truncate_strings(span, target)
    # 2. events, then links
    if span.ByteSize() > target and len(span.events):
        span.dropped_events_count += len(span.events)
        del span.events[:]
    if span.ByteSize() > target and len(span.links):
        span.dropped_links_count += len(span.links)
        del span.links[:]
    # 3. whole attributes, largest first
    while span.ByteSize() > target and len(span.attributes):
        largest = max(range(len(span.attributes)), key=lambda i: span.attributes[i].ByteSize())
        del span.attributes[largest]
        span.dropped_attributes_count += 1
        truncated += 1
    # 4. a name that is itself huge
    if span.ByteSize() > target and len(span.name) > 256:
        span.name = span.name[:256]
    span.attributes.append(KeyValue(key=ATTR_TRUNCATED))
    span.attributes[-1].value.int_value = truncated
    return truncated
