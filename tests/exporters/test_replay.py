"""``servewatch export``: replaying embedded-default and spool files to a collector, ids kept."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from exporters.otlp.provider import ExportConfig, build_telemetry
from exporters.otlp.replay import replay
from exporters.otlp.spans import build_span, new_trace_id, span_id_hex
from tests.otlp_receiver import OtlpReceiver


def _write_embedded(data_dir: Path, n: int) -> dict[str, tuple[int, int]]:
    """Run the embedded default (no endpoint) and emit n spans; returns {span hex: (start, end)}."""
    telemetry = build_telemetry(ExportConfig(metrics=True, batch_spans=64), data_dir=data_dir, host_name="h", environ={})
    produced = {}
    trace_id = new_trace_id()
    for i in range(n):
        span = build_span("req", trace_id=trace_id, start_time_unix_nano=5_000 + i, end_time_unix_nano=9_000 + i, resource=telemetry.sink.resource)
        telemetry.sink.emit(span)
        produced[span_id_hex(span.context.span_id)] = (span.start_time, span.end_time)
    assert telemetry.processor.flush(10.0) is True
    telemetry.shutdown(3.0)
    return produced


def test_replay_embedded_files_delivers_every_span_once_with_ids(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    produced = _write_embedded(tmp_path, 300)
    bundle = tmp_path / "h" / "inc-1"  # an incident bundle beside the span files: not OTLP
    bundle.mkdir()
    (bundle / "manifest.json").write_text('{"incident_id": "inc-1", "actions": []}')
    (bundle / "requests.json").write_text("[]")
    # the whole data dir: span files are sent; metrics files and bundles skipped
    result = replay([tmp_path], endpoint=otlp_receiver.endpoint(protocol), protocol=protocol, timeout_s=10.0)
    assert (result.sent, result.failed, result.files, result.bad_files) == (300, 0, 1, 0)
    received = Counter(s.span_id for s in otlp_receiver.spans())
    assert set(received) == set(produced) and max(received.values()) == 1
    times = {s.span_id: (s.span.start_time_unix_nano, s.span.end_time_unix_nano) for s in otlp_receiver.spans()}
    assert times == produced


def test_replay_spool_left_by_an_outage_and_remove_sent(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    otlp_receiver.stop()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.grpc_endpoint}
    telemetry = build_telemetry(ExportConfig(metrics=False, batch_spans=100), data_dir=tmp_path, host_name="h", environ=env)
    trace_id = new_trace_id()
    ids = set()
    for i in range(250):
        span = build_span("req", trace_id=trace_id, start_time_unix_nano=1 + i, end_time_unix_nano=2 + i)
        telemetry.sink.emit(span)
        ids.add(span_id_hex(span.context.span_id))
    stats = telemetry.shutdown(2.0)
    assert stats.spool_spans == 250
    assert telemetry.spool_dir is not None
    otlp_receiver.start()
    result = replay([telemetry.spool_dir], endpoint=otlp_receiver.grpc_endpoint, protocol="grpc", remove_sent=True)
    assert (result.sent, result.failed, result.removed) == (250, 0, result.files)
    assert {s.span_id for s in otlp_receiver.spans()} == ids
    assert list(telemetry.spool_dir.glob("*.binpb")) == []


def test_replay_to_an_unreachable_collector_counts_failures_and_keeps_files(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    _write_embedded(tmp_path, 200)
    otlp_receiver.stop()
    result = replay([tmp_path], endpoint=otlp_receiver.grpc_endpoint, protocol="grpc", timeout_s=1.0, attempts=2, remove_sent=True)
    assert (result.sent, result.failed, result.removed) == (0, 200, 0)
    assert "UNAVAILABLE" in result.detail
    assert len(list((tmp_path / "h" / "spans").glob("spans-*.jsonl"))) == 1


def test_replay_missing_path_and_bad_protocol_raise(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        replay([tmp_path / "nope.jsonl"], endpoint="http://127.0.0.1:1", protocol="grpc")
    with pytest.raises(ValueError, match="protocol"):
        replay([tmp_path], endpoint="http://127.0.0.1:1", protocol="http/json")


def test_spool_of_a_running_agent_is_skipped_not_sent_twice(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    otlp_receiver.stop()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.grpc_endpoint}
    config = ExportConfig(metrics=False, batch_spans=10, retry_initial_backoff_s=0.05, retry_max_backoff_s=0.2)
    telemetry = build_telemetry(config, data_dir=tmp_path, host_name="h", environ=env)
    try:
        for i in range(30):
            telemetry.sink.emit(build_span("req", trace_id=new_trace_id(), start_time_unix_nano=1 + i, end_time_unix_nano=2 + i))
        assert telemetry.processor.flush(0.5) is False
        deadline = time.monotonic() + 30.0  # hang guard: wait for the worker to spool all 30
        while telemetry.statistics().spooled < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert telemetry.statistics().spool_spans == 30
        result = replay([tmp_path], endpoint=otlp_receiver.grpc_endpoint, protocol="grpc")  # live agent owns its spool
        assert (result.sent, result.files) == (0, 0) and result.locked_files >= 1
        otlp_receiver.start()
        assert telemetry.processor.flush(15.0) is True  # the agent replays it itself
    finally:
        telemetry.shutdown(3.0)
    assert len(Counter(s.span_id for s in otlp_receiver.spans())) == otlp_receiver.span_count == 30


def test_replay_honours_the_collectors_retry_after(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    """``servewatch export`` to a collector answering 429 + ``Retry-After: 30``: the next try
    would pass the request's deadline, so it is not made (3 quick tries without the header)."""
    _write_embedded(tmp_path, 5)
    otlp_receiver.http_status = 429
    otlp_receiver.retry_delay_s = 30
    result = replay([tmp_path], endpoint=otlp_receiver.http_endpoint, protocol="http/protobuf", timeout_s=3.0, attempts=3)
    assert result.failed == 5 and otlp_receiver.attempts == 1
    assert "slow down" in result.detail
