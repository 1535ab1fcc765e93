"""OTLP/JSON encoding (hex ids, string int64, integer enums), the lines reader, file rotation."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource

from exporters.otlp.otlp_json import (
    RotatingJsonLinesWriter,
    read_otlp_json_lines,
    request_from_json,
    request_to_json,
)
from exporters.otlp.spans import build_span, link_to, new_span_id, new_trace_id
from tests.otlp_receiver import OtlpReceiver


def _request(n: int = 2):
    trace_id = new_trace_id()
    root = new_span_id()
    spans = [
        build_span(
            "pyspy.dump",
            trace_id=trace_id,
            parent_span_id=root,
            start_time_unix_nano=1_700_000_000_123_456_789 + i,
            end_time_unix_nano=1_700_000_001_000_000_000 + i,
            attributes={"process.pid": 4242 + i, "servewatch.frames": ("a", "b")},
            links=[link_to(new_trace_id(), new_span_id())],
            error="timed out",
            resource=Resource.create({"service.name": "servewatch"}),
        )
        for i in range(n)
    ]
    return spans, encode_spans(spans)


def test_ids_are_hex_and_int64_are_strings_per_otlp_json() -> None:
    spans, request = _request()
    tree = json.loads(request_to_json(request))
    span = tree["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == format(spans[0].context.trace_id, "032x")
    assert span["spanId"] == format(spans[0].context.span_id, "016x")
    assert span["parentSpanId"] == format(spans[0].parent.span_id, "016x")
    assert len(span["links"][0]["traceId"]) == 32 and int(span["links"][0]["traceId"], 16)
    assert span["startTimeUnixNano"] == "1700000000123456789"  # int64 as a decimal string
    assert span["kind"] == 1  # SPAN_KIND_INTERNAL as an integer, not a name
    assert span["status"]["code"] == 2  # STATUS_CODE_ERROR
    pid = next(a for a in span["attributes"] if a["key"] == "process.pid")
    assert pid["value"] == {"intValue": "4242"}


def test_json_round_trip_keeps_every_field() -> None:
    _, request = _request(3)
    assert request_from_json(request_to_json(request)) == request


def test_base64_ids_are_rejected_not_misread() -> None:
    _, request = _request(1)
    tree = json.loads(request_to_json(request))
    span = tree["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"] = base64.b64encode(bytes.fromhex(span["traceId"])).decode()
    with pytest.raises(ValueError, match="traceId"):
        request_from_json(json.dumps(tree))


def test_reader_yields_lines_in_order_and_skips_a_truncated_tail(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    lines = [request_to_json(_request(i + 1)[1]) for i in range(3)]
    path.write_text("\n".join(lines) + "\n" + lines[0][: len(lines[0]) // 2], encoding="utf-8")
    got = list(read_otlp_json_lines(path))
    assert [sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans) for r in got] == [1, 2, 3]


def test_reader_names_file_and_line_of_garbage(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(request_to_json(_request(1)[1]) + "\n{not json\n" + request_to_json(_request(1)[1]) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(read_otlp_json_lines(path))


def test_writer_rotates_by_size_and_evicts_oldest_counting_spans(tmp_path: Path) -> None:
    line = request_to_json(_request(2)[1])
    writer = RotatingJsonLinesWriter(tmp_path, prefix="spans", max_file_bytes=len(line) * 2 + 2, max_files=2)
    for _ in range(7):
        writer.write_line(line, 2)
    writer.close()
    files = sorted(tmp_path.glob("spans-*.jsonl"))
    assert len(files) == 2
    assert writer.evicted_files == 2  # 7 lines at 2 per file = 4 files, 2 kept
    assert writer.evicted_spans == 8
    kept = sum(len(list(read_otlp_json_lines(f))) for f in files)
    assert kept == 3


def test_a_line_is_accepted_by_an_otlp_http_json_endpoint(otlp_receiver: OtlpReceiver) -> None:
    spans, request = _request(2)
    response = httpx.post(
        otlp_receiver.http_endpoint + "/v1/traces",
        content=request_to_json(request),
        headers={"Content-Type": "application/json"},
        timeout=10.0,
    )
    assert response.status_code == 200
    got = otlp_receiver.spans()
    assert [s.protocol for s in got] == ["http/json", "http/json"]
    assert {s.span_id for s in got} == {format(s.context.span_id, "016x") for s in spans}


def _reference_json(message) -> str:
    """``json_format``'s mapping with the ids rewritten: what message_to_json wrote before it
    mapped OTLP's fields itself."""
    from google.protobuf import json_format

    from exporters.otlp.otlp_json import _ids_to_hex

    tree = json_format.MessageToDict(message, use_integers_for_enums=True)
    _ids_to_hex(tree)
    return json.dumps(tree, separators=(",", ":"))


def test_own_mapping_writes_what_json_format_writes() -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import (
        AnyValue,
        ArrayValue,
        KeyValue,
        KeyValueList,
    )

    from exporters.otlp.otlp_json import _to_text, message_to_json

    _, request = _request(3)
    span = request.resource_spans[0].scope_spans[0].spans[0]
    values = [
        AnyValue(string_value="s"), AnyValue(bool_value=False), AnyValue(int_value=-(2**63)),
        AnyValue(int_value=0), AnyValue(double_value=float("nan")), AnyValue(double_value=float("inf")),
        AnyValue(double_value=float("-inf")), AnyValue(double_value=1e-310), AnyValue(double_value=0.1),
        AnyValue(bytes_value=b"\x00\xff"), AnyValue(bytes_value=b""), AnyValue(string_value=""),
        AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue()])),
        AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="traceId", value=AnyValue(bytes_value=b"\x01"))])),
        AnyValue(),
    ]
    span.attributes.extend(KeyValue(key=f"k{i}", value=v) for i, v in enumerate(values))
    span.status.code = 2
    span.kind = 3
    span.flags = 0x301
    span.trace_state = "a=b"
    span.dropped_attributes_count = 7
    event = span.events.add(name="e", time_unix_nano=2**64 - 1)
    event.attributes.add(key="x", value=AnyValue(double_value=-0.0))
    request.resource_spans[0].resource.dropped_attributes_count = 1
    request.resource_spans[0].schema_url = "https://x"
    request.resource_spans[0].scope_spans[0].scope.name = "scope"
    request.resource_spans[0].scope_spans[0].scope.version = "1"
    request.resource_spans.add()  # an empty one
    _to_text(request)  # mapped by its own rules, not handed to json_format
    assert message_to_json(request) == _reference_json(request)

    metrics = ExportMetricsServiceRequest()
    metric = metrics.resource_metrics.add().scope_metrics.add().metrics.add(name="m", unit="1")
    point = metric.histogram.data_points.add(count=3, sum=1.5, start_time_unix_nano=1, time_unix_nano=2)
    point.bucket_counts.extend([1, 2, 0])
    point.explicit_bounds.extend([0.5, float("inf")])
    point.exemplars.add(as_double=0.25, span_id=b"\x01" * 8, trace_id=b"\x02" * 16)
    metric.metadata.add(key="k", value=AnyValue(int_value=5))
    _to_text(metrics)
    assert message_to_json(metrics) == _reference_json(metrics)


def test_messages_it_does_not_map_go_to_json_format() -> None:
    from google.protobuf.struct_pb2 import Struct
    from google.protobuf.timestamp_pb2 import Timestamp

    from exporters.otlp.otlp_json import message_to_json

    ts = Timestamp(seconds=5, nanos=1)
    assert message_to_json(ts) == _reference_json(ts)
    st = Struct()
    st.update({"a": 1.5, "b": [True, None, "x"]})
    assert message_to_json(st) == _reference_json(st)


#: one attribute's values on successive spans: equal as Python values, not as OTLP values
SAME_VALUES = (True, 1, 1.0, "1", False, 0)


def test_shipped_spans_text_is_json_formats_and_keeps_each_spans_values() -> None:
    """The files exporter's text of shipped spans (ring records of the SDK's request and forward
    spans, encoded by the agent's wire encoder) is ``json_format``'s, byte for byte; the attribute
    texts it remembers never give one span another's value (the same keys with new values, a
    value over the remembered length, escapes and non-ASCII, an int and a bool of equal value)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from exporters.otlp.encode import encode_spans_fast
    from exporters.otlp.wire import encode_record

    resource = Resource({"service.name": "llm", "process.pid": 7, "host.name": "node-a"})
    trace = 0x4BF92F3577B34DA6A3CE929D0E0E4736

    def request_record(i: int, model: str) -> bytes:
        attrs = {"gen_ai.operation.name": "chat", "gen_ai.response.id": f"req-{i}", "gen_ai.request.model": model,
                 "gen_ai.request.max_tokens": 16, "gen_ai.usage.input_tokens": i, "flag": i % 2 == 1, "n": i % 2,
                 "ratio": i / 3, "": "empty key", "v": SAME_VALUES[i]}
        return json.dumps([f"chat {model}", 1, trace + i, 100 + i, 0, 1_700_000_000_000_000_000 + i,
                           1_700_000_000_500_000_000 + i, attrs, 2 if i == 2 else 0, "boom" if i == 2 else "",
                           [["token", 1_700_000_000_100_000_000, {"k": "v"}]], []]).encode()

    def forward_record(i: int) -> bytes:
        return json.dumps(["forward", 0, trace + i, 500 + i, 100 + i, 1_700_000_000_200_000_000, 1_700_000_000_300_000_000,
                           {"servewatch.forward.batch_size": 1, "servewatch.forward_ct": i}, 0, "", [],
                           [[trace + i, 100 + i, {"gen_ai.response.id": f"req-{i}"}]]]).encode()

    models = ["tiny", "tiny", "ünï \"quoted\"\n\u2028", "x" * 65, "x" * 65 + "y", "tiny"]
    payloads = [p for i, m in enumerate(models) for p in (request_record(i, m), forward_record(i))]
    request = encode_spans_fast([encode_record(p, resource) for p in payloads])
    text = request_to_json(request)
    assert text == _reference_json(request)
    assert text.isascii()
    got = request_from_json(text)
    assert got == request
    spans = got.resource_spans[0].scope_spans[0].spans
    assert len(spans) == 2 * len(models)
    for i, model in enumerate(models):
        attrs = {kv.key: kv.value for kv in spans[2 * i].attributes}
        assert attrs["gen_ai.request.model"].string_value == model
        assert attrs["gen_ai.response.id"].string_value == f"req-{i}"
        assert attrs["gen_ai.usage.input_tokens"].int_value == i
        assert attrs["flag"].WhichOneof("value") == "bool_value" and attrs["flag"].bool_value is (i % 2 == 1)
        assert attrs["n"].WhichOneof("value") == "int_value" and attrs["n"].int_value == i % 2
        which = {bool: "bool_value", int: "int_value", float: "double_value", str: "string_value"}[type(SAME_VALUES[i])]
        assert attrs["v"].WhichOneof("value") == which and getattr(attrs["v"], which) == SAME_VALUES[i]
        forward = {kv.key: kv.value.int_value for kv in spans[2 * i + 1].attributes}
        assert forward == {"servewatch.forward.batch_size": 1, "servewatch.forward_ct": i}
        assert spans[2 * i + 1].links[0].span_id == (100 + i).to_bytes(8, "big")
    again = request_to_json(ExportTraceServiceRequest.FromString(request.SerializeToString()))
    assert again == text  # the remembered texts give the same line the second time
