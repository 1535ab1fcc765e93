"""A server's own span export (exporters.sdk_export) agrees with the agent: same OTEL_* resolution,
same protocol default (grpc), TLS; a server following the README example reaches the collector."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.sdk import tracing
from exporters.sdk_export import tracer_provider_from_env
from tests.otlp_receiver import OtlpReceiver, otlp_receiver_fixture
from tests.tls_certs import make_tls_material


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    yield from otlp_receiver_fixture()


def _serve_two_requests() -> tuple[str, str]:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with (
        tracing.request_span("r-1", model="tiny", provider="servewatch-demo", parent=parent) as a,
        tracing.forward_span([a]),
    ):
        pass
    return a.trace_id, a.span_id


def test_server_spans_reach_the_agents_grpc_collector_with_only_the_endpoint_set(otlp_receiver: OtlpReceiver) -> None:
    # the agent's default protocol is grpc; the server's must be too (was http/protobuf: mismatch)
    provider = tracer_provider_from_env("srv", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.grpc_endpoint})
    assert provider is not None
    tracing.set_tracer_provider(provider)
    try:
        trace_id, span_id = _serve_two_requests()
    finally:
        tracing.set_tracer_provider(None)
        provider.shutdown()
    assert otlp_receiver.wait_for_spans(2, 10.0)
    spans = {s.name: s for s in otlp_receiver.spans()}
    assert set(spans) == {"chat tiny", "forward"} and spans["chat tiny"].protocol == "grpc"
    request = spans["chat tiny"]
    assert request.trace_id == trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and request.span_id == span_id
    assert request.attributes["gen_ai.provider.name"] == "servewatch-demo"
    assert request.span.kind == 1  # SPAN_KIND_INTERNAL
    assert request.resource["service.name"] == "srv"


def test_server_export_uses_tls_from_env_and_none_without_endpoint(tmp_path: Path) -> None:
    assert tracer_provider_from_env("srv", environ={}) is None
    pki = make_tls_material(tmp_path / "pki")
    receiver = OtlpReceiver(tls=pki, require_client_cert=True).start()
    try:
        env = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.http_endpoint + "/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki.ca_cert),
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(pki.client_cert),
            "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(pki.client_key),
        }
        provider = tracer_provider_from_env("srv", environ=env)
        assert provider is not None
        tracing.set_tracer_provider(provider)
        try:
            _serve_two_requests()
        finally:
            tracing.set_tracer_provider(None)
            provider.shutdown()
        assert receiver.wait_for_spans(2, 10.0)
        assert {s.protocol for s in receiver.spans()} == {"http/protobuf"}
    finally:
        receiver.stop()
