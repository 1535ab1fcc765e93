"""Ring records straight to OTLP wire bytes: the agent's encoder for shipped spans.

Owns :func:`encode_record` (its result is an :class:`exporters.otlp.encode.EncodedSpan`). A span record from a server's ring
(:mod:`agent.sdk.channel`'s 12-item JSON array) is validated and written as the protobuf bytes
of one ``opentelemetry.proto.trace.v1.Span`` (field numbers per ``trace.proto``,
``common.proto`` of opentelemetry-proto 1.x), with no ``ReadableSpan`` and no protobuf
objects in between. :func:`exporters.otlp.encode.encode_spans_fast` then groups these bytes under
their resource and scope with one C-level parse per group, so everything after it (size-aware
batches, spool, gRPC/HTTP/file senders) is unchanged.

Why: decoding a record into a ``ReadableSpan`` and encoding it through protobuf objects cost
~26 µs of agent CPU per span (8.9 decode + 17.2 encode, measured with the demo's request and
forward spans); shipped spans are most of what a watching agent does (the 1-hour soak's CPU
profile). ``bench/bench_ship.py`` measures the whole path; ``tests/exporters/test_wire.py``
checks that the bytes parse to the same message as ``decode_record`` + ``encode_spans_fast``
for every record shape, including hypothesis-generated ones, and that bad records raise the
same way.

Also owns the rules of a valid record (``MAX_*`` limits, ``_clean_attrs``), which
:func:`exporters.otlp.shipper.decode_record` applies too; untrusted input never becomes half a span.

Imports the standard library, opentelemetry-sdk's ``Resource``/``InstrumentationScope`` types,
:mod:`agent.model.events` (the action names servewatch reserves) and :mod:`exporters.otlp.encode`.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from agent.model.events import Action
from exporters.otlp.encode import EncodedSpan, _varint

__all__ = [
    "IDENTITY_KEYS",
    "MAX_ATTRIBUTES",
    "MAX_EVENTS",
    "MAX_LINKS",
    "MAX_NAME",
    "MAX_STRING",
    "RESERVED_SPAN_NAMES",
    "SDK_ATTRIBUTES",
    "SDK_SCOPE",
    "Reserved",
    "encode_record",
    "parse_record",
]

#: Instrumentation scope of shipped spans (the SDK's tracer name).
SDK_SCOPE = InstrumentationScope("servewatch.sdk", "0.1.0")
#: Limits applied to every shipped record (OTel SDK defaults where it has one).
MAX_ATTRIBUTES = 128
MAX_EVENTS = 128
MAX_LINKS = 128
MAX_STRING = 8192
MAX_NAME = 1024
_INT64 = (-(2**63), 2**63 - 1)
#: largest trace id and span id (named once: Python does not fold ``2**128 - 1`` at compile time)
_MAX_TRACE_ID = 2**128 - 1
_MAX_SPAN_ID = 2**64 - 1
#: valid ``kind`` (the OTel API's ``SpanKind`` values) and ``status`` (``StatusCode``) of a record
_KINDS = frozenset(range(5))
_STATUS = frozenset(range(3))
#: JSON types a kind or status may have (``true``/``1.0`` compare equal to 1, as in a dict lookup)
_SCALARS = (int, bool, float)
_json_decode = json.JSONDecoder().decode
_FIXED64 = struct.Struct("<Q").pack
_DOUBLE = struct.Struct("<d").pack
#: ``SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK`` (trace.proto ``SpanFlags``), as a fixed32: every
#: span and link the SDK records has a local (not remote) context.
_FLAGS_LOCAL = struct.pack("<I", 0x100)
#: the OTel API's ``SpanKind`` value -> trace.proto ``Span.SpanKind`` (INTERNAL is 1 there)
_PROTO_KIND = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}


class _Invalid(ValueError):
    pass


class Reserved(_Invalid):
    """A record that claims what only servewatch may say (its span names, ``servewatch.*``
    attributes, or an identity the agent sets itself): refused, never shipped."""


#: Span names servewatch's own spans carry (the incident and its actions): a server's ring may
#: not use them, so a span under such a name in a trace is always the agent's.
RESERVED_SPAN_NAMES = frozenset({"incident", *(a.value for a in Action)})
#: The ``servewatch.*`` attributes the SDK itself puts on the spans it records; every other
#: ``servewatch.*`` name is the agent's.
SDK_ATTRIBUTES = frozenset({"servewatch.forward_ct", "servewatch.forward.batch_size", "servewatch.profile.session_id"})
#: Resource keys the agent sets from what it knows first-hand about the writer (never from the
#: ring): a span attribute of the same name is refused too.
IDENTITY_KEYS = frozenset({"service.name", "host.name", "process.pid", "process.owner", "process.user.id", "process.real_user.id"})


#: attribute names :func:`check_reserved` found allowed (the same few on every span of a server)
_ALLOWED_KEYS: set[str] = set()
_ALLOWED_KEYS_MAX = 4096


def check_reserved(name: str, attrs: Any) -> None:
    """Refuse a span record that claims servewatch's names or an identity the agent sets.

    Raises:
        Reserved: ``name`` is one of :data:`RESERVED_SPAN_NAMES` (or ``servewatch.*``), or an
            attribute is ``servewatch.*`` (other than :data:`SDK_ATTRIBUTES`) or one of
            :data:`IDENTITY_KEYS`.
    """
    if name in RESERVED_SPAN_NAMES or name.startswith("servewatch"):
        raise Reserved(f"span name {name[:64]!r} is servewatch's")
    if type(attrs) is dict:
        allowed = _ALLOWED_KEYS
        for key in attrs:
            if key in allowed:
                continue
            if (key.startswith("servewatch") and key not in SDK_ATTRIBUTES) or key in IDENTITY_KEYS:
                raise Reserved(f"attribute {key[:64]!r} is servewatch's to set")
            if type(key) is str and len(key) <= 256:
                if len(allowed) >= _ALLOWED_KEYS_MAX:
                    allowed.clear()
                allowed.add(key)


def _clean_value(value: Any) -> Any:
    if isinstance(value, (bool, float)):
        return value
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise _Invalid("int attribute out of range")
        return value
    if isinstance(value, str):
        return value[:MAX_STRING]
    if isinstance(value, list):
        if len(value) > MAX_ATTRIBUTES:
            value = value[:MAX_ATTRIBUTES]
        # an OTel attribute value is a scalar or a flat homogeneous sequence: refuse nesting
        # before looking inside (a deeply nested array must not recurse)
        if any(isinstance(v, (list, dict)) for v in value):
            raise _Invalid("attribute sequence nested")
        items = [_clean_value(v) for v in value]
        if len({type(v) for v in items}) > 1:
            raise _Invalid("attribute sequence not homogeneous")
        return tuple(items)
    raise _Invalid(f"attribute value of type {type(value).__name__}")


def _plain_attrs(attrs: dict[str, Any]) -> bool:
    """Whether every value is a plain str/int/float/bool within the limits (nothing to clean)."""
    for key, value in attrs.items():
        t = type(value)
        if len(key) > 256 or (t is str and len(value) > MAX_STRING) or (t is int and not _INT64[0] <= value <= _INT64[1]):
            return False
        if t is not str and t is not int and t is not float and t is not bool:
            return False
    return True


def _clean_attrs(attrs: Any) -> dict[str, Any]:
    if type(attrs) is not dict:
        raise _Invalid("attributes are not an object")
    if len(attrs) <= MAX_ATTRIBUTES and _plain_attrs(attrs):  # fast path
        return attrs  # JSON object keys are always strings
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        if len(out) >= MAX_ATTRIBUTES:
            break
        if value is None:
            continue
        out[str(key)[:256]] = _clean_value(value)
    return out


def _int(value: Any, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _Invalid("bad integer field")
    return value


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


# Span
_S_TRACE_ID = _tag(1, 2) + b"\x10"  # always 16 bytes
_S_SPAN_ID = _tag(2, 2) + b"\x08"
_S_PARENT = _tag(4, 2) + b"\x08"
_S_NAME = _tag(5, 2)
_S_KIND = _tag(6, 0)
_S_START = _tag(7, 1)
_S_END = _tag(8, 1)
_S_ATTR = _tag(9, 2)
_S_EVENT = _tag(11, 2)
_S_LINK = _tag(13, 2)
_S_STATUS = _tag(15, 2)
_S_FLAGS = _tag(16, 5) + _FLAGS_LOCAL
# Span.Event
_E_TIME = _tag(1, 1)
_E_NAME = _tag(2, 2)
_E_ATTR = _tag(3, 2)
# Span.Link
_L_TRACE_ID = _tag(1, 2) + b"\x10"
_L_SPAN_ID = _tag(2, 2) + b"\x08"
_L_ATTR = _tag(4, 2)
_L_FLAGS = _tag(6, 5) + _FLAGS_LOCAL
# Status
_ST_MESSAGE = _tag(2, 2)
_ST_CODE = _tag(3, 0)
# KeyValue / AnyValue / ArrayValue
_KV_KEY = _tag(1, 2)
_KV_VALUE = _tag(2, 2)
_AV_STRING = _tag(1, 2)
_AV_BOOL = _tag(2, 0)
_AV_INT = _tag(3, 0)
_AV_DOUBLE = _tag(4, 1)
_AV_ARRAY = _tag(5, 2)
_ARR_VALUE = _tag(1, 2)

#: Encoded ``KeyValue`` fields (tag, length and message; by field tag) of values seen recently: the keys, model
#: names, operation names and small counts of request and forward spans repeat on every span.
_KV_CACHE: dict[tuple[bytes, str, type, Any], bytes] = {}
_KV_CACHE_MAX = 8192


def _field(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: tag, length, bytes."""
    return tag + _varint(len(body)) + body


def _any_value(value: Any) -> bytes:
    kind = type(value)
    if kind is str:
        return _field(_AV_STRING, value.encode())
    if kind is bool:
        return _AV_BOOL + (b"\x01" if value else b"\x00")
    if kind is int:
        return _AV_INT + _varint(value)
    if kind is float:
        return _AV_DOUBLE + _DOUBLE(value)
    if kind is tuple:  # a homogeneous sequence, as _clean_attrs leaves it
        return _field(_AV_ARRAY, b"".join(_field(_ARR_VALUE, _any_value(v)) for v in value))
    raise _Invalid(f"attribute value of type {kind.__name__}")


def _key(key: str) -> bytes:
    """``KeyValue.key`` (proto3: an empty string is not written, as protobuf itself does)."""
    return _field(_KV_KEY, key.encode()) if key else b""


def _kv(tag: bytes, key: str, value: Any) -> bytes:
    """One ``KeyValue`` as field ``tag``: tag, length, key, value."""
    return _field(tag, _key(key) + _field(_KV_VALUE, _any_value(value)))


def _attributes(tag: bytes, attrs: dict[str, Any]) -> bytes:
    """Every attribute as a repeated ``KeyValue`` field ``tag``, in the record's order."""
    if not attrs:
        return b""
    cache = _KV_CACHE
    parts = []
    for key, value in attrs.items():
        kind = type(value)
        if kind is float or kind is tuple or (kind is str and len(value) > 64):  # rarely repeated: not cached
            parts.append(_kv(tag, key, value))
            continue
        ck = (tag, key, kind, value)
        kv = cache.get(ck)
        if kv is None:
            kv = _kv(tag, key, value)
            if len(cache) >= _KV_CACHE_MAX:
                cache.clear()
            cache[ck] = kv
        parts.append(kv)
    return b"".join(parts)


def parse_record(payload: bytes) -> tuple[Any, ...]:
    """The 12 fields of one ring record, its top level checked: ``(name, kind, trace_id, span_id,
    parent_id, start, end, attrs, status, desc, events, links)``; ids and times are ints in their
    ranges, ``name``/``desc`` strings, ``kind``/``status`` known numbers, ``events``/``links``
    lists (their items and every attribute are checked by the caller, with ``_clean_attrs``).

    Raises:
        Reserved: a valid record that claims servewatch's names (:func:`check_reserved`).
        ValueError: not a valid span record.
    """
    try:
        rec = _json_decode(payload.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: arrays nested ~1000 deep
        raise _Invalid(f"bad JSON: {exc}") from None
    if type(rec) is not list or len(rec) != 12:
        raise _Invalid("a record is a 12-item array")
    name, kind, trace_id, span_id, parent_id, start, end, attrs, status, desc, events, links = rec
    if type(name) is not str or type(desc) is not str:
        raise _Invalid("name/description not strings")
    trace_id = _int(trace_id, 1, _MAX_TRACE_ID)
    span_id = _int(span_id, 1, _MAX_SPAN_ID)
    parent_id = _int(parent_id, 0, _MAX_SPAN_ID)
    start = _int(start, 0, _INT64[1])
    end = _int(end, 0, _INT64[1])
    if type(kind) not in _SCALARS or type(status) not in _SCALARS or kind not in _KINDS or status not in _STATUS:
        raise _Invalid("bad kind or status")
    if type(events) is not list or type(links) is not list:
        raise _Invalid("events/links not arrays")
    check_reserved(name, attrs)
    return name, kind, trace_id, span_id, parent_id, start, end, attrs, status, desc, events, links


def encode_record(payload: bytes, resource: Resource) -> EncodedSpan:
    """One ring record (:mod:`agent.sdk.channel` format) as an encoded OTLP span.

    Same rules and result as :func:`exporters.otlp.shipper.decode_record` followed by the OTLP
    encoder: names truncated to ``MAX_NAME`` characters, strings to ``MAX_STRING``, at most
    ``MAX_ATTRIBUTES``/``MAX_EVENTS``/``MAX_LINKS``; ``end`` is at least ``start``; the status
    message is kept only for ERROR.

    Raises:
        ValueError: not a valid span record (nothing is returned half-built).
    """
    name, kind, trace_id, span_id, parent_id, start, end, attrs, status, desc, events, links = parse_record(payload)
    try:
        data = _span_bytes(name[:MAX_NAME], int(kind), trace_id, span_id, parent_id, start, end, attrs,
                           int(status), desc, events, links)
    except UnicodeEncodeError:  # a lone surrogate (JSON allows "\\ud800"): not valid UTF-8 on the wire
        raise _Invalid("a string is not valid Unicode") from None
    return EncodedSpan(name[:MAX_NAME], data, resource, SDK_SCOPE)


def _event_bytes(ev: Any) -> bytes:
    """One ``[name, time, attributes]`` event as a span's event field."""
    if type(ev) is not list or len(ev) != 3 or type(ev[0]) is not str:
        raise _Invalid("bad event")
    ts = _int(ev[1], 0, _INT64[1])
    ev_name = ev[0][:MAX_NAME]
    body = (_E_TIME + _FIXED64(ts) if ts else b"") + (_field(_E_NAME, ev_name.encode()) if ev_name else b"")
    return _field(_S_EVENT, body + _attributes(_E_ATTR, _clean_attrs(ev[2])))


def _link_bytes(lk: Any) -> bytes:
    """One ``[trace id, span id, attributes]`` link as a span's link field."""
    if type(lk) is not list or len(lk) != 3:
        raise _Invalid("bad link")
    body = (
        _L_TRACE_ID + _int(lk[0], 1, _MAX_TRACE_ID).to_bytes(16, "big")
        + _L_SPAN_ID + _int(lk[1], 1, _MAX_SPAN_ID).to_bytes(8, "big")
        + _attributes(_L_ATTR, _clean_attrs(lk[2]))
        + _L_FLAGS
    )
    return _field(_S_LINK, body)


#: a span's kind field (tag and value) by the record's kind
_KIND_FIELDS = {kind: _S_KIND + _varint(proto) for kind, proto in _PROTO_KIND.items()}
#: a span's status field without a message (UNSET, OK; ERROR when its description is empty), by code
_PLAIN_STATUS_FIELDS = {code: _field(_S_STATUS, _ST_CODE + _varint(code) if code else b"") for code in range(3)}
#: encoded name fields of names seen recently (a server's span names are a handful)
_NAME_FIELDS: dict[str, bytes] = {}
_NAME_FIELDS_MAX = 1024


def _name_field(name: str) -> bytes:
    field = _NAME_FIELDS.get(name)
    if field is None:
        field = _field(_S_NAME, name.encode())
        if len(name) <= 256:
            if len(_NAME_FIELDS) >= _NAME_FIELDS_MAX:
                _NAME_FIELDS.clear()
            _NAME_FIELDS[name] = field
    return field


def _status_field(status: int, desc: str) -> bytes:
    message = desc[:MAX_STRING] if status == 2 else ""
    if not message:
        return _PLAIN_STATUS_FIELDS[status]
    return _field(_S_STATUS, _field(_ST_MESSAGE, message.encode()) + _ST_CODE + _varint(status))


def _span_bytes(name: str, kind: int, trace_id: int, span_id: int, parent_id: int, start: int, end: int, attrs: Any,
                status: int, desc: str, events: list[Any], links: list[Any]) -> bytes:
    parts = [_S_TRACE_ID, trace_id.to_bytes(16, "big"), _S_SPAN_ID, span_id.to_bytes(8, "big")]
    if parent_id:
        parts += (_S_PARENT, parent_id.to_bytes(8, "big"))
    if name:
        parts.append(_name_field(name))
    parts.append(_KIND_FIELDS[kind])
    if start:
        parts += (_S_START, _FIXED64(start))
    end = max(end, start)
    if end:
        parts += (_S_END, _FIXED64(end))
    if attrs:
        parts.append(_attributes(_S_ATTR, _clean_attrs(attrs)))
    elif type(attrs) is not dict:
        raise _Invalid("attributes are not an object")
    if events:
        parts += (_event_bytes(ev) for ev in events[:MAX_EVENTS])
    if links:
        parts += (_link_bytes(lk) for lk in links[:MAX_LINKS])
    parts.append(_status_field(status, desc))
    parts.append(_S_FLAGS)
    return b"".join(parts)
