"""OTLP/JSON encoding (hex ids, string int64, integer enums), the lines reader, file rotation."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource

from exporters.otlp_json import (
    RotatingJsonLinesWriter,
    read_otlp_json_lines,
    request_from_json,
    request_to_json,
)
from exporters.spans import build_span, link_to, new_span_id, new_trace_id
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
