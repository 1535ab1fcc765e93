"""Ring records straight to OTLP/JSON text: the span files' path for shipped spans.

Owns :class:`TextSpan`, :func:`encode_record_text` and :func:`spans_line`. When the agent's spans go
to the OTLP/JSON span files (the embedded default: no endpoint, no spool), a shipped span's text is
written from the parsed ring record itself, instead of ring record -> protobuf bytes
(:func:`exporters.otlp.wire.encode_record`) -> one parse per batch -> the JSON text of the parsed
message (:func:`exporters.otlp.otlp_json.request_to_json`, a upb wrapper per value read). The line
is the same text, byte for byte: ``tests/exporters/test_wire_json.py`` compares both paths on real
SDK spans, on records with every attribute kind, events, links and statuses, and on generated
records (refused and invalid ones included).

A :class:`TextSpan` is an :class:`~exporters.otlp.encode.EncodedSpan` whose protobuf bytes are
built only when something asks for them (a batch mixed with other spans, a request too large for
one line): what needs bytes (spool, replay, gRPC/HTTP) gets the very bytes ``encode_record`` gives.

Imports the standard library, :mod:`exporters.otlp.wire`, :mod:`exporters.otlp.encode` and
:mod:`exporters.otlp.otlp_json` (the text of a resource and scope, once per resource).
"""

from __future__ import annotations

import json.encoder
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from exporters.otlp.encode import EncodedSpan, encode_spans_fast
from exporters.otlp.otlp_json import _double, message_to_json
from exporters.otlp.wire import (
    _INT64,
    _MAX_SPAN_ID,
    _MAX_TRACE_ID,
    MAX_EVENTS,
    MAX_LINKS,
    MAX_NAME,
    MAX_STRING,
    SDK_SCOPE,
    _clean_attrs,
    _int,
    _Invalid,
    encode_record,
    parse_record,
)

__all__ = ["TextSpan", "encode_record_text", "spans_line"]

#: a str as ``json.dumps`` (and :mod:`exporters.otlp.otlp_json`) writes it: quoted, escaped, ASCII
_json_string: Callable[[str], str] = json.encoder.encode_basestring_ascii


class TextSpan(EncodedSpan):
    """A shipped span as its OTLP/JSON text (one ``Span`` object, as
    :func:`exporters.otlp.otlp_json.request_to_json` writes it), its protobuf bytes built on first
    use from the record's fields (then the same bytes as :func:`exporters.otlp.wire.encode_record`).

    Attributes:
        text: the span's OTLP/JSON text.
    """

    __slots__ = ("_payload", "text")

    def __init__(self, name: str, text: str, payload: bytes, resource: Resource) -> None:
        # ``data`` stays unset until read (__getattr__ runs only for an unset slot); the record
        # is kept instead of its parsed fields (about the size of the bytes, not of dicts)
        self.name = name
        self.text = text
        self._payload = payload
        self.resource = resource
        self.instrumentation_scope = SDK_SCOPE

    def __getattr__(self, attr: str) -> Any:
        if attr != "data":
            raise AttributeError(attr)
        data = self.data = encode_record(self._payload, self.resource).data
        return data


#: ``KeyValue`` texts of scalar attributes seen recently, by ``(key, type, value)``
_KV_TEXTS: dict[tuple[str, type, Any], str] = {}
_KV_TEXTS_MAX = 8192


def _any_value(value: Any) -> str:
    """One ``AnyValue`` of a cleaned attribute value (str, bool, int, float, or a tuple of them)."""
    kind = type(value)
    if kind is str:
        return '{"stringValue":' + _json_string(value) + "}"
    if kind is bool:
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if kind is int:
        return '{"intValue":"' + int.__repr__(value) + '"}'
    if kind is float:
        return '{"doubleValue":' + _double(value) + "}"
    if kind is tuple:  # a homogeneous sequence, as _clean_attrs leaves it; empty: no "values"
        return '{"arrayValue":{"values":[' + ",".join([_any_value(v) for v in value]) + "]}}" if value else '{"arrayValue":{}}'
    raise _Invalid(f"attribute value of type {kind.__name__}")


def _kv(key: str, value: Any) -> str:
    # proto3: an empty key is not written, so it has no "key" either
    return ('{"key":' + _json_string(key) + ',"value":' if key else '{"value":') + _any_value(value) + "}"


def _attributes(attrs: dict[str, Any]) -> str:
    """An attribute list's items, comma-separated (``attrs`` cleaned and not empty)."""
    cache = _KV_TEXTS
    parts = []
    for key, value in attrs.items():
        kind = type(value)
        if kind is float or kind is tuple or (kind is str and len(value) > 64):  # rarely repeated: not kept
            parts.append(_kv(key, value))
            continue
        ck = (key, kind, value)
        text = cache.get(ck)
        if text is None:
            text = _kv(key, value)
            if len(cache) >= _KV_TEXTS_MAX:
                cache.clear()
            cache[ck] = text
        parts.append(text)
    return ",".join(parts)


def _event(ev: Any) -> str:
    """One ``[name, time, attributes]`` event (the checks of :func:`exporters.otlp.wire._event_bytes`)."""
    if type(ev) is not list or len(ev) != 3 or type(ev[0]) is not str:
        raise _Invalid("bad event")
    ts = _int(ev[1], 0, _INT64[1])
    ev_name = ev[0][:MAX_NAME]
    attrs = _clean_attrs(ev[2])
    parts = []
    if ts:
        parts.append('"timeUnixNano":"' + int.__repr__(ts) + '"')
    if ev_name:
        parts.append('"name":' + _json_string(ev_name))
    if attrs:
        parts.append('"attributes":[' + _attributes(attrs) + "]")
    return "{" + ",".join(parts) + "}"


def _link(lk: Any) -> str:
    """One ``[trace id, span id, attributes]`` link (the checks of :func:`exporters.otlp.wire._link_bytes`)."""
    if type(lk) is not list or len(lk) != 3:
        raise _Invalid("bad link")
    text = ('{"traceId":"' + _int(lk[0], 1, _MAX_TRACE_ID).to_bytes(16, "big").hex()
            + '","spanId":"' + _int(lk[1], 1, _MAX_SPAN_ID).to_bytes(8, "big").hex() + '",')
    attrs = _clean_attrs(lk[2])
    if attrs:
        text += '"attributes":[' + _attributes(attrs) + "],"
    return text + '"flags":256}'


#: a span's ``"kind":N,`` by the record's kind (the API's value; trace.proto's is one more)
_KIND_TEXTS = {kind: f'"kind":{kind + 1},' for kind in range(5)}
#: a span's status without a message (UNSET, OK; ERROR when its description is empty), by code
_PLAIN_STATUS_TEXTS = {0: '"status":{},', 1: '"status":{"code":1},', 2: '"status":{"code":2},'}
#: ``"name":...,`` texts of names seen recently (a server's span names are a handful)
_NAME_TEXTS: dict[str, str] = {}
_NAME_TEXTS_MAX = 1024


def _name_text(name: str) -> str:
    text = _NAME_TEXTS.get(name)
    if text is None:
        text = '"name":' + _json_string(name) + ","
        if len(name) <= 256:
            if len(_NAME_TEXTS) >= _NAME_TEXTS_MAX:
                _NAME_TEXTS.clear()
            _NAME_TEXTS[name] = text
    return text


def _span_text(name: str, kind: int, trace_id: int, span_id: int, parent_id: int, start: int, end: int, attrs: Any,
               status: int, desc: str, events: list[Any], links: list[Any]) -> str:
    """The OTLP/JSON text of the span :func:`exporters.otlp.wire._span_bytes` encodes (the same
    checks, raising the same way), fields in ``trace.proto``'s order as ``json_format`` writes them."""
    parts = ['{"traceId":"', trace_id.to_bytes(16, "big").hex(), '","spanId":"', span_id.to_bytes(8, "big").hex(), '",']
    if parent_id:
        parts += ('"parentSpanId":"', parent_id.to_bytes(8, "big").hex(), '",')
    if name:
        parts.append(_name_text(name))
    parts.append(_KIND_TEXTS[kind])
    if start:
        parts += ('"startTimeUnixNano":"', int.__repr__(start), '",')
    end = max(end, start)
    if end:
        parts += ('"endTimeUnixNano":"', int.__repr__(end), '",')
    if attrs:
        cleaned = _clean_attrs(attrs)
        if cleaned:  # every value null: none left, no field
            parts += ('"attributes":[', _attributes(cleaned), "],")
    elif type(attrs) is not dict:
        raise _Invalid("attributes are not an object")
    if events:
        parts += ('"events":[', ",".join([_event(ev) for ev in events[:MAX_EVENTS]]), "],")
    if links:
        parts += ('"links":[', ",".join([_link(lk) for lk in links[:MAX_LINKS]]), "],")
    message = desc[:MAX_STRING] if status == 2 else ""
    parts.append('"status":{"message":' + _json_string(message) + ',"code":2},' if message else _PLAIN_STATUS_TEXTS[status])
    parts.append('"flags":256}')
    return "".join(parts)


def encode_record_text(payload: bytes, resource: Resource) -> EncodedSpan:
    """One ring record as a :class:`TextSpan`: the same rules, the same refusals and errors, and
    (once asked for) the same bytes as :func:`exporters.otlp.wire.encode_record`.

    Raises:
        ValueError: not a valid span record (``Reserved`` for one that claims servewatch's names).
    """
    if b"\\u" in payload and (b"\\ud" in payload or b"\\uD" in payload):
        # a surrogate escape (a lone one is not valid UTF-8 on the wire): the bytes path decides
        return encode_record(payload, resource)
    name, kind, trace_id, span_id, parent_id, start, end, attrs, status, desc, events, links = parse_record(payload)
    name = name[:MAX_NAME]
    text = _span_text(name, int(kind), trace_id, span_id, parent_id, start, end, attrs, int(status), desc, events, links)
    return TextSpan(name, text, payload, resource)


#: ``(resource, scope) -> (resource, the ResourceSpans text before its spans, after them)``, by the
#: resource's identity (the shipper keeps one ``Resource`` per ring); the resource is kept so an id is
#: never reused while it is here
_FRAMES: dict[tuple[int, Any], tuple[Resource, str, str]] = {}
_FRAMES_MAX = 256
#: a span whose text marks where the spans go in a ResourceSpans' text
_MARK_NAME = "servewatch-mark-\u2603"


def _frame(resource: Resource, scope: InstrumentationScope | None) -> tuple[str, str] | None:
    """The text of one resource's ``ResourceSpans`` around its spans (one scope), as
    :func:`exporters.otlp.encode.encode_spans_fast` and :func:`~exporters.otlp.otlp_json.message_to_json`
    write it, worked out once per resource and scope (``None``: the resource's own text holds the
    marker span's, never in practice)."""
    key = (id(resource), scope)
    cached = _FRAMES.get(key)
    if cached is not None and cached[0] is resource:
        return cached[1], cached[2]
    marker = Span(name=_MARK_NAME)
    request = encode_spans_fast([EncodedSpan(_MARK_NAME, marker.SerializeToString(), resource, scope)])  # type: ignore[arg-type]
    rs: ResourceSpans = request.resource_spans[0]
    ss: ScopeSpans = rs.scope_spans[0]
    assert len(ss.spans) == 1
    text = message_to_json(rs)
    mark = message_to_json(marker)
    if text.count(mark) != 1:
        return None
    before, _, after = text.partition(mark)
    if len(_FRAMES) >= _FRAMES_MAX:
        _FRAMES.clear()
    _FRAMES[key] = (resource, before, after)
    return before, after


def spans_line(spans: Sequence[Any], max_bytes: int) -> str | None:
    """The OTLP/JSON line :func:`~exporters.otlp.otlp_json.request_to_json` writes for
    ``encode_spans_fast(spans)`` (grouped by resource in first-seen order), when every span is a
    :class:`TextSpan`, each resource's spans share one scope, and the line is at most ``max_bytes``
    bytes; else ``None`` (the caller takes the protobuf path).

    The line's length bounds the request's protobuf size from above (every OTLP field's JSON text
    is longer than its protobuf encoding), so a line within ``max_bytes`` is a request that
    :func:`exporters.otlp.batching.split_request` leaves whole: the same single line.
    """
    if not spans:
        return None
    #: resource (the first-seen of equal ones) -> (that resource, its spans' scope, their texts)
    groups: dict[Resource, tuple[Resource, Any, list[str]]] = {}
    # a Resource hashes by JSON-encoding its attributes: look each distinct object up once
    by_identity: dict[int, tuple[Resource, Any, list[str]]] = {}
    for span in spans:
        if type(span) is not TextSpan:
            return None
        resource = span.resource
        group = by_identity.get(id(resource))
        if group is None:
            group = groups.get(resource)
            if group is None:
                group = groups[resource] = (resource, span.instrumentation_scope, [])
            by_identity[id(resource)] = group
        if span.instrumentation_scope is not group[1] and span.instrumentation_scope != group[1]:
            return None  # two scopes under one resource: the protobuf path frames them
        group[2].append(span.text)
    parts = []
    for resource, scope, texts in groups.values():
        frame = _frame(resource, scope)
        if frame is None:
            return None
        parts.append(frame[0] + ",".join(texts) + frame[1])
    line = '{"resourceSpans":[' + ",".join(parts) + "]}"
    return line if len(line) <= max_bytes else None
