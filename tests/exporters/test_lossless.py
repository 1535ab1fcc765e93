"""Lossless, bounded export against a real OTLP receiver that goes away and comes back."""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan

from agent.model.events import (
    ActionResult,
    IncidentClosed,
    IncidentOpened,
    Outcome,
    StacksDumped,
    now_ns,
)
from exporters.mirror.mirror import SpanMirror
from exporters.otlp.processor import LosslessSpanProcessor
from exporters.otlp.spans import (
    ProcessorSink,
    build_span,
    new_span_id,
    new_trace_id,
    span_id_hex,
    trace_id_hex,
)
from exporters.otlp.spool import Spool
from exporters.otlp.transport import make_sender
from tests.otlp_receiver import OtlpReceiver

#: Generous hang guard for "shutdown is bounded" (the bench measures the real figure).
HANG_GUARD_S = 10.0


def _processor(receiver_endpoint: str, protocol: str, spool_dir: Path, **kwargs) -> LosslessSpanProcessor:
    kwargs.setdefault("retry_initial_backoff_s", 0.05)
    kwargs.setdefault("retry_max_backoff_s", 0.5)
    kwargs.setdefault("schedule_delay_s", 0.05)
    return LosslessSpanProcessor(make_sender(receiver_endpoint, protocol), spool=Spool(spool_dir, max_bytes=10**9), **kwargs)


def _request_spans(processor: LosslessSpanProcessor, n: int, resource: Resource) -> dict[tuple[str, str], tuple[int, int]]:
    """Emit n request spans; returns {(trace hex, span hex): (start ns, end ns)}."""
    produced = {}
    base = now_ns()
    for i in range(n):
        span = build_span(
            "gen_ai.request",
            trace_id=new_trace_id(),
            start_time_unix_nano=base + i * 1000,
            end_time_unix_nano=base + i * 1000 + 777,
            attributes={"gen_ai.request.id": f"req-{i}"},
            resource=resource,
        )
        processor.on_end(span)
        produced[(trace_id_hex(span.context.trace_id), span_id_hex(span.context.span_id))] = (span.start_time, span.end_time)
    return produced


def _incident(sink: ProcessorSink) -> tuple[str, str]:
    mirror = SpanMirror(sink, host_name="node-7")
    trace_hex, root_hex = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    t0 = now_ns()
    mirror.handle(IncidentOpened(incident_id="inc-1", trigger="stall", pids=(11, 12), trace_id=trace_hex, span_id=root_hex, time_unix_nano=t0))
    for pid in (11, 12):
        result = ActionResult(action="pyspy.dump", outcome=Outcome.OK, pid=pid, start_time_unix_nano=t0 + 10, end_time_unix_nano=t0 + 20)
        mirror.handle(StacksDumped(incident_id="inc-1", result=result))
    mirror.handle(IncidentClosed(incident_id="inc-1", trigger="stall", bundle_dir="/b", manifest_path="/b/manifest.json", time_unix_nano=t0 + 30))
    return trace_hex, root_hex


def _settle(processor: LosslessSpanProcessor, spooled: int, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until ``spooled`` spans went to the spool (hang guard, not a speed check):
    the worker's failed batches (``spooled``) and the spans written ahead to it by the caller
    (an incident's, ``written_ahead``), which the worker's count does not hold."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = processor.statistics()
        if stats.spooled + stats.written_ahead >= spooled:
            return
        time.sleep(0.01)


def _received(receiver: OtlpReceiver) -> Counter[tuple[str, str]]:
    return Counter((s.trace_id, s.span_id) for s in receiver.spans())


def test_receiver_down_mid_run_every_span_arrives_exactly_once_with_original_ids(
    otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path
) -> None:
    resource = Resource.create({"service.name": "servewatch"})
    processor = _processor(otlp_receiver.endpoint(protocol), protocol, tmp_path / "spool")
    sink = ProcessorSink(processor, resource)
    try:
        produced = _request_spans(processor, 300, resource)
        assert processor.flush(10.0) is True
        assert otlp_receiver.span_count == 300

        otlp_receiver.stop()
        produced |= _request_spans(processor, 10_000, resource)
        trace_hex, root_hex = _incident(sink)
        assert processor.flush(0.5) is False  # spooled, not delivered, and it says so
        _settle(processor, 10_003)
        stats = processor.statistics()
        assert stats.spool_spans == 10_003 and stats.dropped == 0

        otlp_receiver.start()
        assert otlp_receiver.wait_for_spans(10_303, timeout_s=60.0)
        assert processor.flush(10.0) is True
    finally:
        processor.shutdown(5.0)

    received = _received(otlp_receiver)
    assert max(received.values()) == 1, "a span arrived twice"
    assert len(received) == 10_303
    assert set(produced) <= set(received)
    times = {(s.trace_id, s.span_id): (s.span.start_time_unix_nano, s.span.end_time_unix_nano) for s in otlp_receiver.spans()}
    assert all(times[key] == produced[key] for key in produced)
    incident = [s for s in otlp_receiver.spans() if s.trace_id == trace_hex]
    assert sorted(s.name for s in incident) == ["incident", "pyspy.dump", "pyspy.dump"]
    assert {s.parent_span_id for s in incident if s.name == "pyspy.dump"} == {root_hex}
    stats = processor.statistics()
    assert (stats.exported + stats.replayed, stats.dropped, stats.evicted, stats.spool_spans) == (10_303, 0, 0, 0)
    assert stats.replayed >= 10_003


def test_shutdown_while_receiver_down_is_bounded_spools_and_next_run_delivers(
    otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path
) -> None:
    resource = Resource.create({"service.name": "servewatch"})
    otlp_receiver.stop()
    processor = _processor(otlp_receiver.endpoint(protocol), protocol, tmp_path / "spool", export_timeout_s=30.0)
    produced = _request_spans(processor, 5_000, resource)
    started = time.monotonic()
    processor.shutdown(2.0)
    took_s = time.monotonic() - started
    assert took_s < HANG_GUARD_S
    stats = processor.statistics()
    assert (stats.spooled, stats.spool_spans, stats.dropped, stats.exported) == (5_000, 5_000, 0, 0)
    assert sum(int(p.name.split("-")[1].split(".")[0]) for p in (tmp_path / "spool").glob("*.binpb")) == 5_000

    otlp_receiver.start()
    second = _processor(otlp_receiver.endpoint(protocol), protocol, tmp_path / "spool")
    try:
        assert otlp_receiver.wait_for_spans(5_000, timeout_s=60.0)
        assert second.flush(10.0) is True
    finally:
        second.shutdown(5.0)
    received = _received(otlp_receiver)
    assert set(received) == set(produced) and max(received.values()) == 1
    assert second.statistics().replayed == 5_000


def test_shutdown_delivers_spans_written_ahead_just_before_it(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    """The last actions of an incident are written ahead to the spool right before the agent stops:
    with the collector up, shutdown replays the spool before it ends, it does not leave them for a
    next run that may never come."""
    resource = Resource.create({"service.name": "servewatch"})
    processor = _processor(otlp_receiver.endpoint(protocol), protocol, tmp_path / "spool")
    base = now_ns()
    spans = [
        build_span("peer.capture", trace_id=new_trace_id(), start_time_unix_nano=base + i, end_time_unix_nano=base + i + 1,
                   attributes={"servewatch.peer.address": f"peer-{i}"}, resource=resource)
        for i in range(30)
    ]
    for span in spans:  # one spool file each, like one finished action each
        processor.persist([span])
    processor.shutdown(HANG_GUARD_S)
    stats = processor.statistics()
    assert (stats.spool_spans, stats.dropped) == (0, 0), stats
    received = _received(otlp_receiver)
    assert set(received) == {(trace_id_hex(s.context.trace_id), span_id_hex(s.context.span_id)) for s in spans}
    assert max(received.values()) == 1
    assert not list((tmp_path / "spool").glob("*.binpb"))


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A TCP port that completes the handshake (kernel backlog) and never answers: a hung collector."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_hung_collector_cannot_hold_shutdown_past_the_deadline(blackhole: str, protocol: str, tmp_path: Path) -> None:
    resource = Resource.create({"service.name": "servewatch"})
    processor = _processor(blackhole, protocol, tmp_path / "spool", export_timeout_s=60.0, schedule_delay_s=0.01)
    _request_spans(processor, 2_000, resource)
    assert processor.flush(0.3) is False  # the SDK would say True here; ours honours the timeout
    started = time.monotonic()
    processor.shutdown(1.0)
    assert time.monotonic() - started < HANG_GUARD_S
    stats = processor.statistics()
    assert stats.exported == 0 and stats.dropped == 0
    assert stats.spool_spans == 2_000  # the batch stuck in flight was spooled too


def test_queue_overflow_is_counted_never_silent(blackhole: str, tmp_path: Path) -> None:
    resource = Resource.create({"service.name": "servewatch"})
    processor = _processor(blackhole, "grpc", tmp_path / "spool", max_queue_spans=100, max_batch_spans=10, export_timeout_s=60.0)
    _request_spans(processor, 1_000, resource)
    processor.shutdown(0.5)
    stats = processor.statistics()
    assert stats.dropped >= 1_000 - 100 - 10
    assert stats.dropped + stats.spooled + stats.exported == 1_000
    assert stats.lost == stats.dropped


def test_permanent_refusal_is_kept_aside_and_not_retried(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    otlp_receiver.grpc_error = grpc.StatusCode.INVALID_ARGUMENT
    processor = _processor(otlp_receiver.grpc_endpoint, "grpc", tmp_path / "spool")
    try:
        _request_spans(processor, 20, Resource.create({}))
        assert processor.flush(10.0) is True  # settled: nothing waits for a retry
        otlp_receiver.grpc_error = None
        _request_spans(processor, 5, Resource.create({}))
        assert processor.flush(10.0) is True
    finally:
        processor.shutdown(2.0)
    stats = processor.statistics()
    assert (stats.rejected, stats.exported, stats.spool_spans) == (20, 5, 0)
    assert otlp_receiver.span_count == 5
    rejected = list((tmp_path / "spool" / "rejected").glob("*.binpb"))
    assert len(rejected) == 1 and rejected[0].name.endswith("-20.binpb")


def test_on_end_after_shutdown_is_counted(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    processor = _processor(otlp_receiver.grpc_endpoint, "grpc", tmp_path / "spool")
    processor.shutdown(1.0)
    processor.shutdown(1.0)  # safe twice
    _request_spans(processor, 3, Resource.create({}))
    assert processor.statistics().dropped == 3


def test_full_spool_evicts_the_oldest_batches_and_counts_them(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    resource = Resource.create({"service.name": "servewatch"})
    otlp_receiver.stop()
    probe = build_span("gen_ai.request", trace_id=new_trace_id(), start_time_unix_nano=1, end_time_unix_nano=2, attributes={"gen_ai.request.id": "req-0000"}, resource=resource)
    batch_bytes = len(encode_spans([probe] * 100).SerializeToString())
    processor = LosslessSpanProcessor(
        make_sender(otlp_receiver.grpc_endpoint, "grpc"),
        spool=Spool(tmp_path / "spool", max_bytes=batch_bytes * 3 + batch_bytes // 2),
        max_batch_spans=100,
        schedule_delay_s=5.0,  # only full batches of 100 before the flush: exact counts
        retry_initial_backoff_s=0.05,
        retry_max_backoff_s=0.2,
    )
    try:
        produced = list(_request_spans(processor, 1_000, resource))
        assert processor.flush(0.5) is False
        _settle(processor, 1_000)
        stats = processor.statistics()
        assert stats.spool_spans == 300 and stats.evicted == 700 and stats.lost == 700
        otlp_receiver.start()
        assert otlp_receiver.wait_for_spans(300, timeout_s=30.0)
        assert processor.flush(10.0) is True
    finally:
        processor.shutdown(2.0)
    received = _received(otlp_receiver)
    assert set(received) == set(produced[-300:])  # the newest survive, in full, once
    assert max(received.values()) == 1


def test_unencodable_span_is_dropped_alone_and_counted(otlp_receiver: OtlpReceiver, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    processor = _processor(otlp_receiver.grpc_endpoint, "grpc", tmp_path / "spool")
    try:
        good = _request_spans(processor, 5, Resource.create({}))
        processor.on_end(ReadableSpan(name="bad", context=None))  # no ids: the OTLP encoder raises
        good |= _request_spans(processor, 5, Resource.create({}))
        assert processor.flush(10.0) is True
    finally:
        processor.shutdown(2.0)
    stats = processor.statistics()
    assert (stats.exported, stats.dropped) == (10, 1)
    assert set(_received(otlp_receiver)) == set(good)
    assert "'bad'" in caplog.text


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_collectors_retry_delay_is_honoured(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    """A collector answering 503 + ``Retry-After: 30`` (gRPC UNAVAILABLE + ``RetryInfo`` 30 s) is
    not asked again within those 30 s, where the processor's own backoff (0.05 s doubling) would
    have retried five times; the spans wait in the spool meanwhile."""
    if protocol == "grpc":
        otlp_receiver.grpc_error = grpc.StatusCode.UNAVAILABLE
    else:
        otlp_receiver.http_status = 503
    otlp_receiver.retry_delay_s = 30
    processor = _processor(otlp_receiver.endpoint(protocol), protocol, tmp_path / "spool")
    try:
        _request_spans(processor, 10, Resource.create({}))
        _settle(processor, 10)
        deadline = time.monotonic() + 10
        while otlp_receiver.attempts < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.5)  # long enough for 5 retries of the processor's own backoff
        assert otlp_receiver.attempts == 1
        assert processor.statistics().spool_spans == 10
        assert processor.problem() is not None and processor.problem().kind == "unreachable"
    finally:
        processor.shutdown(0.5)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_request_with_every_span_rejected_is_kept_said_once_and_replayable(
    otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """OTLP partial success rejecting every span: the request is kept under ``rejected/`` (not
    counted as delivered), said once with the collector's message, and replays whole once the
    cause is fixed."""
    otlp_receiver.reject_all = "spans of service x are not allowed"
    caplog.set_level(logging.WARNING, logger="exporters.otlp.processor")
    processor = _processor(otlp_receiver.endpoint(protocol), protocol, tmp_path / "spool", max_batch_spans=5)
    try:
        produced = _request_spans(processor, 20, Resource.create({}))
        assert processor.flush(10.0) is True
    finally:
        processor.shutdown(2.0)
    stats = processor.statistics()
    assert (stats.rejected, stats.exported, stats.partially_rejected) == (20, 0, 0)
    problem = processor.problem()
    assert problem is not None and problem.kind == "rejected" and "spans of service x are not allowed" in problem.line
    said = [r for r in caplog.records if "rejected all" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert otlp_receiver.span_count == 0
    otlp_receiver.reject_all = None  # the cause fixed: the kept spans replay whole
    from exporters.otlp.replay import replay

    result = replay([tmp_path / "spool" / "rejected"], endpoint=otlp_receiver.endpoint(protocol), protocol=protocol)
    assert result.sent == 20 and result.failed == 0
    assert set(_received(otlp_receiver)) == set(produced)
