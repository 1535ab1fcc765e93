"""A server's own span export (exporters.otlp.sdk_export) agrees with the agent: same OTEL_* resolution,
same protocol default (grpc), TLS; a server following the README example reaches the collector."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.sdk import tracing
from exporters.otlp.sdk_export import tracer_provider_from_env
from tests.otlp_receiver import OtlpReceiver, otlp_receiver_fixture
from tests.tls_certs import make_tls_material


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    yield from otlp_receiver_fixture()


@pytest.fixture(autouse=True)
def _forget_service_name() -> Iterator[None]:
    """tracer_provider_from_env declares the service name to the SDK: never past its test."""
    from agent.sdk import provider

    yield
    provider.set_service_name("")


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


def test_server_exported_spans_carry_the_same_identity_as_the_spans_the_agent_ships(otlp_receiver: OtlpReceiver) -> None:
    # one process, one resource: the server's own export states host.name, process.pid and
    # process.user.id exactly as the agent's shipper does for the same process
    from exporters.otlp.shipper import _server_resource

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.grpc_endpoint, "SERVEWATCH_HOST_NAME": "gpu-node-7"}
    provider = tracer_provider_from_env("srv", environ=env)
    assert provider is not None
    tracing.set_tracer_provider(provider)
    try:
        _serve_two_requests()
        # what the ring declares when this provider is installed, as the agent ships it
        shipped = _server_resource({"resource": dict(provider.resource.attributes)}, os.getpid(), "gpu-node-7", os.geteuid())
    finally:
        tracing.set_tracer_provider(None)
        provider.shutdown()
    assert otlp_receiver.wait_for_spans(2, 10.0)
    [resource] = {tuple(sorted(s.resource.items())) for s in otlp_receiver.spans()}
    exported = dict(resource)
    assert exported["host.name"] == "gpu-node-7"
    assert exported["process.pid"] == os.getpid()
    assert exported["process.user.id"] == os.geteuid()
    assert exported["service.name"] == "srv"
    assert exported == dict(shipped.attributes)


def test_a_server_without_endpoint_still_names_its_service_for_the_spans_the_agent_ships(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the README's standalone server (and the demo): no OTEL endpoint, an agent ships its spans;
    # they arrived as service.name=unknown_service
    from agent.sdk import channel, provider
    from agent.sdk import ring as _ring
    from exporters.otlp.shipper import _server_resource

    monkeypatch.setenv("SERVEWATCH_SHM_DIR", str(tmp_path))
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    channel.close()
    channel._state = 0
    try:
        assert tracer_provider_from_env("my-llm-server", environ={}) is None
        assert channel.ring() is not None
        reader = _ring.RingReader(os.getpid(), trusted_uids={os.geteuid()})
        try:
            declared = reader.metadata
        finally:
            reader.close()
    finally:
        channel.close()
        channel._state = 0
        provider.set_service_name("")
    assert declared["resource"]["service.name"] == "my-llm-server"
    assert _server_resource(declared, os.getpid(), "h", os.geteuid()).attributes["service.name"] == "my-llm-server"


def test_a_server_spools_under_the_host_name_its_spans_carry_where_the_agent_replays_them(tmp_path: Path) -> None:
    """With ``SERVEWATCH_HOST_NAME`` set (the agent's host.name, as a pod sets it), a server's
    spool went to ``<data dir>/<socket.gethostname()>/spool`` while its spans said the other name:
    the agent (which replays ``<data dir>/<its host.name>/spool``) never found it."""
    import socket

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "SERVEWATCH_HOST_NAME": "gpu-node-7",
           "SERVEWATCH_DATA_DIR": str(tmp_path)}
    provider = tracer_provider_from_env("srv", environ=env)
    assert provider is not None
    try:
        assert provider.resource.attributes["host.name"] == "gpu-node-7"
        assert sorted(p.relative_to(tmp_path).parts[:2] for p in tmp_path.rglob("*") if p.is_dir() and len(p.relative_to(tmp_path).parts) == 2) == [("gpu-node-7", "spool")]
        assert not (tmp_path / socket.gethostname()).exists()
    finally:
        provider.shutdown()
