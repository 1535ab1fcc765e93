"""exporters.otlp.transport against a real OTLP receiver (gRPC and HTTP) that refuses: every refusal is
sorted into the right cause with the collector's own message and the fix, and a collector's
requested retry delay (HTTP ``Retry-After``, gRPC ``RetryInfo``) comes back in the result."""

from __future__ import annotations

import socket

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from exporters.otlp.encode import encode_spans_fast
from exporters.otlp.spans import build_span, new_trace_id
from exporters.otlp.transport import Cause, Delivery, make_sender
from tests.otlp_receiver import OtlpReceiver


def _request(n: int = 3) -> ExportTraceServiceRequest:
    trace_id = new_trace_id()
    return encode_spans_fast([build_span(f"s{i}", trace_id=trace_id, start_time_unix_nano=1, end_time_unix_nano=2) for i in range(n)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("with_token", [False, True])
def test_http_401_is_an_auth_refusal_that_says_which_header_to_set(otlp_receiver: OtlpReceiver, with_token: bool) -> None:
    otlp_receiver.http_status = 401
    otlp_receiver.error_message = "missing or invalid bearer token"
    headers = {"authorization": "Bearer wrong"} if with_token else {}
    sender = make_sender(otlp_receiver.http_endpoint, "http/protobuf", headers=headers)
    try:
        result = sender.send(_request(), timeout_s=10)
    finally:
        sender.close()
    assert (result.delivery, result.cause, result.detail) == (Delivery.PERMANENT, Cause.AUTH, "http 401 Unauthorized")
    assert result.message == "missing or invalid bearer token"  # the collector's own words
    line = result.explain()
    assert "refused our credentials" in line and "missing or invalid bearer token" in line
    if with_token:
        assert "was not accepted" in line
    else:
        assert "no authorization header is sent" in line and "OTEL_EXPORTER_OTLP_HEADERS='authorization=Bearer" in line


def test_http_404_of_a_doubled_path_is_not_a_protocol_mismatch(otlp_receiver: OtlpReceiver) -> None:
    # OTEL_EXPORTER_OTLP_ENDPOINT given with the path: servewatch appends /v1/traces once more
    sender = make_sender(otlp_receiver.http_endpoint + "/v1/traces", "http/protobuf")
    try:
        result = sender.send(_request(), timeout_s=10)
    finally:
        sender.close()
    assert (result.delivery, result.cause, result.detail) == (Delivery.PERMANENT, Cause.NOT_FOUND, "http 404 Not Found")
    line = result.explain()
    assert "protocol mismatch" not in line
    assert "/v1/traces is doubled" in line and f"set it to {otlp_receiver.http_endpoint}," in line
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in line


def test_http_404_of_another_path_names_the_otlp_path(otlp_receiver: OtlpReceiver) -> None:
    sender = make_sender(otlp_receiver.http_endpoint + "/api/traces", "http/protobuf", signal_specific=True)
    try:
        result = sender.send(_request(), timeout_s=10)
    finally:
        sender.close()
    assert result.cause is Cause.NOT_FOUND and "is not an OTLP/HTTP traces path (/v1/traces)" in result.explain()


def test_http_400_carries_the_collectors_message(otlp_receiver: OtlpReceiver) -> None:
    otlp_receiver.http_status = 400
    otlp_receiver.error_message = "proto: cannot parse invalid wire-format data"
    sender = make_sender(otlp_receiver.http_endpoint, "http/protobuf")
    try:
        result = sender.send(_request(), timeout_s=10)
    finally:
        sender.close()
    assert (result.delivery, result.cause) == (Delivery.PERMANENT, Cause.BAD_REQUEST)
    assert "http 400 Bad Request: proto: cannot parse invalid wire-format data" in result.explain()


@pytest.mark.parametrize("status", [429, 503])
def test_http_retry_after_is_returned_with_a_retryable_result(otlp_receiver: OtlpReceiver, status: int) -> None:
    otlp_receiver.http_status = status
    otlp_receiver.retry_delay_s = 7
    sender = make_sender(otlp_receiver.http_endpoint, "http/protobuf")
    try:
        result = sender.send(_request(), timeout_s=10)
    finally:
        sender.close()
    assert result.delivery is Delivery.RETRYABLE and result.retry_after_s == 7.0
    assert result.cause is (Cause.THROTTLED if status == 429 else Cause.UNAVAILABLE)


def test_grpc_unavailable_with_retry_info_is_not_connection_refused(otlp_receiver: OtlpReceiver) -> None:
    otlp_receiver.grpc_error = grpc.StatusCode.UNAVAILABLE
    otlp_receiver.error_message = "data refused due to high memory usage"
    otlp_receiver.retry_delay_s = 3.5
    sender = make_sender(otlp_receiver.grpc_endpoint, "grpc")
    try:
        result = sender.send(_request(), timeout_s=10)
    finally:
        sender.close()
    assert (result.delivery, result.cause) == (Delivery.RETRYABLE, Cause.UNAVAILABLE)
    assert result.retry_after_s == 3.5
    assert "connection refused" not in result.explain()
    assert "data refused due to high memory usage" in result.explain()


def test_grpc_to_a_closed_port_is_connection_refused() -> None:
    sender = make_sender(f"http://127.0.0.1:{_free_port()}", "grpc")
    try:
        result = sender.send(_request(), timeout_s=5)
    finally:
        sender.close()
    assert (result.delivery, result.cause) == (Delivery.RETRYABLE, Cause.REFUSED)
    assert "connection refused" in result.explain()


def test_grpc_unauthenticated_says_no_authorization_metadata_is_sent(otlp_receiver: OtlpReceiver) -> None:
    otlp_receiver.grpc_error = grpc.StatusCode.UNAUTHENTICATED
    sender = make_sender(otlp_receiver.grpc_endpoint, "grpc")
    try:
        result = sender.send(_request(), timeout_s=10)
    finally:
        sender.close()
    assert (result.delivery, result.cause) == (Delivery.PERMANENT, Cause.AUTH)
    assert "no authorization header is sent" in result.explain()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_traces_only_receiver_refusing_metrics_is_not_a_protocol_mismatch(protocol: str) -> None:
    # Jaeger and Tempo take OTLP traces only: metrics get gRPC UNIMPLEMENTED ("unknown service
    # ...MetricsService") or HTTP 404 at /v1/metrics, while the trace export on the same endpoint works
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    with OtlpReceiver(traces_only=True) as receiver:
        traces = make_sender(receiver.endpoint(protocol), protocol)
        metrics = make_sender(receiver.endpoint(protocol), protocol, signal="metrics")
        try:
            trace_result = traces.send(_request(), timeout_s=10)
            metrics_request = ExportMetricsServiceRequest()
            metrics_request.resource_metrics.add().scope_metrics.add().metrics.add(name="servewatch.incidents")
            result = metrics.send(metrics_request, timeout_s=10)
        finally:
            traces.close()
            metrics.close()
        assert trace_result.delivery is Delivery.OK and receiver.span_count == 3
    assert (result.delivery, result.cause) == (Delivery.PERMANENT, Cause.SIGNAL_NOT_TAKEN)
    assert result.detail == ("grpc UNIMPLEMENTED" if protocol == "grpc" else "http 404 Not Found")
    line = result.explain()
    assert "protocol mismatch" not in line and "OTEL_EXPORTER_OTLP_PROTOCOL" not in line
    assert line.startswith("this endpoint takes traces but not metrics")
    assert "export.metrics = false (SERVEWATCH_EXPORT__METRICS=false)" in line
