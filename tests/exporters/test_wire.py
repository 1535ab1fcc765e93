"""exporters.otlp.wire: ring records straight to OTLP bytes, checked against the reference path
(``decode_record`` -> ``ReadableSpan`` -> the protobuf-object encoder) on real SDK records and on
thousands of generated ones, good and bad."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource

from exporters.otlp.encode import EncodedSpan, encode_spans_fast
from exporters.otlp.shipper import decode_record
from exporters.otlp.wire import MAX_ATTRIBUTES, MAX_NAME, MAX_STRING, SDK_SCOPE, encode_record

RESOURCE = Resource({"service.name": "tiny-llm", "host.name": "node-a", "process.pid": 4242})


def _reference(payloads: list[bytes], resource: Resource = RESOURCE) -> bytes:
    return encode_spans_fast([decode_record(p, resource) for p in payloads]).SerializeToString()


def _wire(payloads: list[bytes], resource: Resource = RESOURCE) -> bytes:
    return encode_spans_fast([encode_record(p, resource) for p in payloads]).SerializeToString()


def _record(**over: Any) -> list[Any]:
    rec: dict[str, Any] = {
        "name": "text_completion demo-tiny", "kind": 1, "trace_id": 0x4BF92F3577B34DA6A3CE929D0E0E4736,
        "span_id": 0x00F067AA0BA902B7, "parent": 0, "start": 1_700_000_000_000_000_000, "end": 1_700_000_000_250_000_000,
        "attrs": {"gen_ai.request.model": "demo-tiny", "gen_ai.usage.input_tokens": 12}, "status": 0, "desc": "",
        "events": [], "links": [],
    }
    rec.update(over)
    return list(rec.values())


def _payload(rec: list[Any]) -> bytes:
    return json.dumps(rec, separators=(",", ":")).encode()


def test_real_sdk_records_encode_to_the_same_bytes_as_the_reference_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Request and forward spans recorded by agent.sdk in this process (as the demo server records
    them: gen_ai.* attributes, forward spans linked to their requests, an error with an exception
    event) come out of the wire encoder as the very bytes the reference path gives."""
    monkeypatch.setenv("SERVEWATCH_SHM_DIR", str(tmp_path))
    from agent import sdk
    from agent.sdk import channel
    from agent.sdk import ring as _ring

    channel.close()
    channel._state = 0  # the channel (re)reads its settings at the next span: a ring in tmp_path
    writer = channel.ring()
    assert writer is not None
    try:
        for i in range(20):
            writer.words[_ring.W_HEARTBEAT] = time.monotonic_ns()  # an agent is attached: spans go to the ring
            with sdk.request_span(f"req-{i}", model="demo-tiny", operation="text_completion", max_tokens=16, input_tokens=12) as req:
                req.set_output_tokens(i)
                for _ in range(3):
                    with sdk.forward_span([req]):
                        pass
            if i % 5 == 0:
                try:
                    with sdk.request_span(f"bad-{i}", model="demo-tiny"):
                        raise RuntimeError("CUDA error: an illegal memory access was encountered")
                except RuntimeError:
                    pass
        reader = _ring.RingReader(os.getpid(), trusted_uids={os.geteuid()}, directory=tmp_path)
        payloads = reader.take(10_000).payloads
        reader.close(detach=False)
    finally:
        channel.close()
        channel._state = 0
    assert len(payloads) == 20 * 4 + 4
    assert any(b'"exception"' in p for p in payloads) and any(b"gen_ai.response.id" in p for p in payloads)
    assert _wire(payloads) == _reference(payloads)
    # and the reference path is the OTel exporter's own encoder (exporters.otlp.encode's own test)
    assert _reference(payloads) == encode_spans([decode_record(p, RESOURCE) for p in payloads]).SerializeToString()


def test_each_field_is_where_trace_proto_puts_it() -> None:
    """Read back with the protobuf library: ids as big-endian bytes, the API's kind mapped to
    trace.proto's (SERVER 1 -> SPAN_KIND_SERVER 2), the status message only with ERROR, the local
    context flag, an end before the start clamped to the start, truncation to the limits."""
    long_name = "n" * (MAX_NAME + 10)
    rec = _record(
        name=long_name, kind=1, parent=7, start=50, end=10, status=2, desc="x" * (MAX_STRING + 5),
        attrs={"s": "v" * (MAX_STRING + 1), "b": False, "i": -5, "f": 0.0, "l": [1, 2], "none": None, "k" * 300: 1},
        events=[["exception", 60, {"exception.type": "RuntimeError"}]],
        links=[[0xAB, 0xCD, {"gen_ai.response.id": "req-1"}]],
    )
    enc = encode_record(_payload(rec), RESOURCE)
    assert isinstance(enc, EncodedSpan) and enc.name == long_name[:MAX_NAME] and enc.instrumentation_scope is SDK_SCOPE
    span = Span.FromString(enc.data)
    assert span.trace_id == (0x4BF92F3577B34DA6A3CE929D0E0E4736).to_bytes(16, "big")
    assert span.parent_span_id == (7).to_bytes(8, "big")
    assert span.kind == Span.SPAN_KIND_SERVER
    assert (span.start_time_unix_nano, span.end_time_unix_nano) == (50, 50)
    assert span.status.code == 2 and len(span.status.message) == MAX_STRING
    assert span.flags == 0x100
    values = {kv.key: kv.value for kv in span.attributes}
    assert len(values["s"].string_value) == MAX_STRING
    assert values["b"].HasField("bool_value") and values["b"].bool_value is False
    assert values["i"].int_value == -5 and values["f"].HasField("double_value")
    assert [v.int_value for v in values["l"].array_value.values] == [1, 2]
    assert "none" not in values and "k" * 256 in values
    assert span.events[0].name == "exception" and span.events[0].time_unix_nano == 60
    assert span.links[0].span_id == (0xCD).to_bytes(8, "big") and span.links[0].flags == 0x100
    assert _wire([_payload(rec)]) == _reference([_payload(rec)])


def test_ok_and_unset_status_have_no_message() -> None:
    for status in (0, 1):
        span = Span.FromString(encode_record(_payload(_record(status=status, desc="ignored")), RESOURCE).data)
        assert span.status.code == status and span.status.message == ""


def _value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(10)
    if pick == 0:
        if rng.random() < 0.03:
            return "\ud800"  # a lone surrogate: valid JSON, not valid UTF-8
        return rng.choice(["", "é", "模型", "\U0001f600", "x" * rng.choice([1, 64, 65, MAX_STRING + 3])])
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        if rng.random() < 0.02:
            return rng.choice([2**63, -(2**63) - 1])  # out of int64: invalid
        return rng.choice([0, 1, -1, 127, 128, 2**63 - 1, -(2**63), rng.randrange(-(10**12), 10**12)])
    if pick == 3:
        return rng.choice([0.0, -0.0, 1.5, 1e300, -2.5e-7])
    if pick == 4 and depth == 0:
        kind = rng.choice([str, int, float, bool])
        items = [_value_of(rng, kind) for _ in range(rng.choice([0, 1, 3, MAX_ATTRIBUTES + 2]))]
        if rng.random() < 0.03:
            items.append("mixed" if kind is not str else 1)
        return items
    if pick == 5:
        return None
    if pick == 6 and rng.random() < 0.1:
        return rng.choice([{"nested": 1}, [[1]]])
    return f"v{rng.randrange(50)}"


def _value_of(rng: random.Random, kind: type) -> Any:
    while True:
        v = _value(rng, depth=1)
        if type(v) is kind:
            return v


def _attrs(rng: random.Random) -> Any:
    if rng.random() < 0.01:
        return rng.choice([[], "attrs", None])
    n = rng.choice([0, 1, 2, 5, 5, MAX_ATTRIBUTES + 3])
    out = {}
    for i in range(n):
        key = rng.choice([f"gen_ai.k{i}", "k" * 257 + str(i), f"\u00e9{i}", ""]) if rng.random() < 0.2 else f"gen_ai.attr{i}"
        out[key] = _value(rng)
    return out


def _random_record(rng: random.Random) -> Any:
    ids = [1, 2**64 - 1, 2**128 - 1, 0, 2**128, -1, "1", 1.0, True]
    bad = rng.random() < 0.15  # one field of a record out of its range or type
    rec = _record(
        name=rng.choice(["forward", "", "x" * (MAX_NAME + 1), "text_completion 模型"] + ([5] if bad else [])),
        kind=rng.choice([0, 1, 2, 3, 4, 5, -1, "1"] if bad else [0, 1, 2, 3, 4]),
        trace_id=rng.choice(ids) if bad and rng.random() < 0.3 else rng.getrandbits(128) or 1,
        span_id=rng.choice(ids) if bad and rng.random() < 0.3 else rng.getrandbits(64) or 1,
        parent=rng.choice([0, 0, rng.getrandbits(64), -1, 2**64] if bad else [0, 0, rng.getrandbits(63) + 1]),
        start=rng.choice([0, 1, 1_700_000_000_000_000_000, 2**63 - 1] + ([2**63, -1] if bad else [])),
        end=rng.choice([0, 5, 1_700_000_000_000_000_001, 2**63 - 1]),
        attrs=_attrs(rng),
        status=rng.choice([0, 1, 2, 2] + ([3] if bad else [])),
        desc=rng.choice(["", "boom", "é" * 10] + ([None] if bad else [])),
        events=[[rng.choice(["exception", ""] + ([3] if bad else [])), rng.choice([0, 10] + ([-1] if bad else [])), _attrs(rng)]
                for _ in range(rng.choice([0, 0, 1, 3]))],
        links=[[rng.getrandbits(128) or 1, rng.choice([rng.getrandbits(64) or 1, 0]), _attrs(rng)] for _ in range(rng.choice([0, 0, 1, 2]))],
    )
    if bad and rng.random() < 0.2:
        rec = rng.choice([rec[:11], [*rec, 1], {"name": "x"}, "x"])
    return rec


def test_generated_records_are_accepted_refused_and_encoded_exactly_as_the_reference_path() -> None:
    """4,000 generated records (every value type, the int64/id/limit edges, bad shapes and types,
    lone surrogates): the wire encoder refuses every record the reference path cannot turn into
    OTLP (a ``ValueError``) and encodes all others to the same bytes. One documented difference:
    a lone surrogate in a sequence attribute makes the whole record invalid here, where the OTel
    encoder logs an error and drops that attribute."""
    rng = random.Random(20261201)
    accepted = refused = surrogate_refused = 0
    for _ in range(4000):
        payload = _payload(_random_record(rng))
        try:
            expected: bytes | None = _reference([payload])
        except ValueError:  # decode_record refuses, or the protobuf encoder cannot encode it
            expected = None
        try:
            got: bytes | None = _wire([payload])
        except ValueError:
            got = None
        if expected is None:
            assert got is None, f"accepted a record the reference path refuses: {payload[:300]!r}"
            refused += 1
        elif got is None:
            assert b"\\ud800" in payload, f"refused a record the reference path accepts: {payload[:300]!r}"
            surrogate_refused += 1
        else:
            assert got == expected, payload[:300]
            data = encode_record(payload, RESOURCE).data
            assert Span.FromString(data).SerializeToString() == data, payload[:300]  # canonical bytes
            accepted += 1
    print(f"accepted {accepted}, refused {refused}, refused for a lone surrogate {surrogate_refused}")
    assert accepted > 1000 and refused > 300 and surrogate_refused > 0  # every side of the rule was exercised


def test_bytes_that_are_not_json_or_utf8_are_invalid() -> None:
    for payload in (b"", b"\xff\xfe", b"[1,2", b"null", b'"x"', json.dumps(_record())[:-1].encode()):
        with pytest.raises(ValueError):
            encode_record(payload, RESOURCE)


def test_a_batch_mixing_encoded_and_object_spans_keeps_groups_and_order() -> None:
    """The agent's own spans (``ReadableSpan``) and shipped ones (``EncodedSpan``) of two servers
    in one export request: grouped by resource and scope in first-seen order, each span once."""
    other = Resource({"service.name": "other-llm", "process.pid": 7})
    p = [_payload(_record(span_id=i + 1, name=f"s{i}")) for i in range(6)]
    mixed = [encode_record(p[0], RESOURCE), decode_record(p[1], other), encode_record(p[2], RESOURCE),
             decode_record(p[3], RESOURCE), encode_record(p[4], other), decode_record(p[5], RESOURCE)]
    request = encode_spans_fast(mixed)
    reference = encode_spans_fast([decode_record(x, r) for x, r in zip(p, [RESOURCE, other, RESOURCE, RESOURCE, other, RESOURCE])])
    assert request.SerializeToString() == reference.SerializeToString()
    names = [[s.name for s in rs.scope_spans[0].spans] for rs in request.resource_spans]
    assert names == [["s0", "s2", "s3", "s5"], ["s1", "s4"]]


@pytest.mark.parametrize("depth", [2, 60, 400, 5000])
def test_nested_arrays_and_unhashable_fields_are_invalid_on_both_paths(depth: int) -> None:
    """An OTel attribute value is flat: an array nested at any depth is refused before it is
    walked (no RecursionError, no protobuf decode error later), as is a kind or status that is not
    a number (a JSON array or object)."""
    nested = b'["n",1,1,2,0,10,20,{"a":' + b"[" * depth + b"1" + b"]" * depth + b'},0,"",[],[]]'
    for payload in (nested, b'["n",[],1,2,0,10,20,{},0,"",[],[]]', b'["n",1,1,2,0,10,20,{},{},"",[],[]]'):
        with pytest.raises(ValueError):
            encode_record(payload, RESOURCE)
        with pytest.raises(ValueError):
            decode_record(payload, RESOURCE)


def test_encoded_bytes_are_canonical() -> None:
    """The bytes are what protobuf itself writes for the same message (an empty key is not
    written, fields in number order), not only something that parses to it."""
    for rec in (_record(attrs={"": 0, "k": ""}), _record(parent=3, status=2, desc="boom",
                events=[["", 0, {"": ""}]], links=[[1, 2, {}]])):
        data = encode_record(_payload(rec), RESOURCE).data
        assert Span.FromString(data).SerializeToString() == data


def test_attribute_names_remembered_as_allowed_never_let_a_reserved_one_through() -> None:
    """The names :func:`check_reserved` remembers as allowed are only those it allowed: after
    many accepted spans, a record adding a ``servewatch.*`` attribute or an identity key beside
    the allowed ones is still refused, and an SDK attribute still passes."""
    from exporters.otlp.wire import Reserved

    for i in range(3):
        encode_record(_payload(_record(attrs={"gen_ai.request.model": "demo-tiny", "gen_ai.usage.input_tokens": i})), RESOURCE)
    for bad in ("servewatch.incident.id", "host.name", "service.name", "process.pid"):
        with pytest.raises(Reserved):
            encode_record(_payload(_record(attrs={"gen_ai.request.model": "demo-tiny", bad: 1})), RESOURCE)
    span = Span.FromString(encode_record(_payload(_record(attrs={"gen_ai.request.model": "m", "servewatch.forward_ct": 3})), RESOURCE).data)
    assert {kv.key: kv.value for kv in span.attributes}["servewatch.forward_ct"].int_value == 3
