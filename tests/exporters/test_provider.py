"""Telemetry set-up: OTEL_* env resolution, resource attributes, OTLP and the embedded file default."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from exporters.otlp.metrics import Metrics
from exporters.otlp.otlp_json import read_otlp_json_lines, read_span_file
from exporters.otlp.provider import (
    DEFAULT_TIMEOUT_S,
    ExportConfig,
    ExportConfigError,
    build_telemetry,
    resolve_destination,
    sdk_disabled,
)
from exporters.otlp.spans import build_span, new_trace_id, span_id_hex
from tests.otlp_receiver import OtlpReceiver, attrs_dict


@pytest.mark.parametrize(
    ("config", "env", "expected"),
    [
        ({}, {}, (None, "grpc", False, DEFAULT_TIMEOUT_S)),
        ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ("http://c:4317", "grpc", False, DEFAULT_TIMEOUT_S)),
        (
            {},
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/v1/traces", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
            ("http://t:4318/v1/traces", "http/protobuf", True, DEFAULT_TIMEOUT_S),
        ),
        ({"endpoint": "http://cli:4317"}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317"}, ("http://cli:4317", "grpc", False, DEFAULT_TIMEOUT_S)),
        ({"protocol": "grpc"}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, (None, "grpc", False, DEFAULT_TIMEOUT_S)),
        ({}, {"OTEL_EXPORTER_OTLP_TIMEOUT": "7000"}, (None, "grpc", False, 7.0)),  # milliseconds, per the OTel spec
        ({}, {"OTEL_EXPORTER_OTLP_TIMEOUT": "7000", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2500"}, (None, "grpc", False, 2.5)),
        ({"timeout_s": 1.5}, {"OTEL_EXPORTER_OTLP_TIMEOUT": "7000"}, (None, "grpc", False, 1.5)),
    ],
)
def test_destination_precedence_config_then_env_then_default(config: dict, env: dict, expected: tuple) -> None:
    dest = resolve_destination(ExportConfig(**config), env)
    assert (dest.endpoint, dest.protocol, dest.signal_specific, dest.timeout_s) == expected


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, "OTEL_EXPORTER_OTLP_TIMEOUT"),
        ({"OTEL_EXPORTER_OTLP_HEADERS": "novalue"}, "OTEL_EXPORTER_OTLP_HEADERS"),
    ],
)
def test_bad_env_value_is_an_error_naming_the_variable(env: dict, names: str) -> None:
    with pytest.raises(ExportConfigError, match=names):
        resolve_destination(ExportConfig(), env)


def test_headers_from_env_and_config_merge() -> None:
    dest = resolve_destination(ExportConfig(headers={"x-b": "2"}), {"OTEL_EXPORTER_OTLP_HEADERS": "x-a=1%202,x-b=9"})
    assert dict(dest.headers) == {"x-a": "1 2", "x-b": "2"}


def test_export_config_rejects_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValueError, match="queue_spans"):
        ExportConfig(queue_spans=0)
    with pytest.raises(ValueError, match="endpont"):
        ExportConfig(endpont="x")  # type: ignore[call-arg]


def _emit(telemetry, n: int = 3) -> set[str]:
    trace_id = new_trace_id()
    ids = set()
    for i in range(n):
        span = build_span("probe", trace_id=trace_id, start_time_unix_nano=1_000 + i, end_time_unix_nano=2_000 + i, resource=telemetry.sink.resource)
        telemetry.sink.emit(span)
        ids.add(span_id_hex(span.context.span_id))
    return ids


def test_spans_reach_the_receiver_with_the_agent_resource(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint(protocol),
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=gpu-fleet",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=staging,k8s.pod.name=sgl-0",
    }
    telemetry = build_telemetry(
        ExportConfig(metrics=False), data_dir=tmp_path, service_instance_id="agent-1", host_name="gpu-node-3", environ=env
    )
    try:
        ids = _emit(telemetry)
        # a live span through the TracerProvider takes the same path
        with telemetry.tracer_provider.get_tracer("t").start_as_current_span("live"):
            pass
        assert telemetry.processor.flush(10.0) is True
    finally:
        telemetry.shutdown(3.0)
    spans = otlp_receiver.spans()
    assert {s.span_id for s in spans if s.name == "probe"} == ids
    assert {s.name for s in spans} == {"probe", "live"}
    resource = spans[0].resource
    assert resource["service.name"] == "servewatch"
    assert resource["service.instance.id"] == "agent-1"
    assert resource["host.name"] == "gpu-node-3"
    assert resource["process.pid"] == os.getpid()
    assert resource["deployment.environment.name"] == "staging" and resource["k8s.pod.name"] == "sgl-0"
    assert spans[0].protocol == protocol
    headers = {k.lower(): v for k, v in otlp_receiver.request_headers[0].items()}
    assert headers["x-tenant"] == "gpu-fleet"
    assert telemetry.spool_dir is not None and telemetry.spans_dir is None


def test_service_name_precedence(tmp_path: Path) -> None:
    def name(config: ExportConfig, env: dict) -> str:
        telemetry = build_telemetry(config, data_dir=tmp_path, host_name="h", environ=env)
        telemetry.shutdown(1.0)
        return str(telemetry.resource.attributes["service.name"])

    assert name(ExportConfig(metrics=False), {}) == "servewatch"
    assert name(ExportConfig(metrics=False), {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs"}) == "from-attrs"
    assert name(ExportConfig(metrics=False), {"OTEL_SERVICE_NAME": "from-env", "OTEL_RESOURCE_ATTRIBUTES": "service.name=x"}) == "from-env"
    assert name(ExportConfig(metrics=False, service_name="from-cli"), {"OTEL_SERVICE_NAME": "from-env"}) == "from-cli"


def test_embedded_default_writes_otlp_json_lines_with_hex_ids(tmp_path: Path) -> None:
    telemetry = build_telemetry(ExportConfig(metrics=False), data_dir=tmp_path, host_name="gpu-node-3", environ={})
    try:
        ids = _emit(telemetry, 5)
        assert telemetry.processor.flush(10.0) is True
    finally:
        telemetry.shutdown(3.0)
    assert telemetry.spans_dir == tmp_path / "gpu-node-3" / "spans"
    files = list(telemetry.spans_dir.glob("spans-*.jsonl"))
    assert len(files) == 1
    raw_ids = set()
    for line in files[0].read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                raw_ids.update(s["spanId"] for s in ss["spans"])
    assert raw_ids == ids  # hex in the file itself, not base64
    round_tripped = {s.span_id.hex() for r in read_otlp_json_lines(files[0]) for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert round_tripped == ids


def test_metrics_arrive_over_otlp_with_export_counters(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.grpc_endpoint}
    telemetry = build_telemetry(ExportConfig(metrics_interval_s=60.0), data_dir=tmp_path, host_name="h", environ=env)
    try:
        _emit(telemetry, 4)
        telemetry.metrics.incident_opened("stall")
        telemetry.metrics.action_done("pyspy.dump", "ok")
        telemetry.metrics.detection_latency(2.0, trigger="stall")
        assert telemetry.processor.flush(10.0) is True
    finally:
        telemetry.shutdown(3.0)  # the final collection is exported at shutdown
    assert otlp_receiver.wait_for_metrics(timeout_s=10.0)
    points: dict[tuple[str, tuple], float] = {}
    for _, request in otlp_receiver.metrics_requests:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    data = metric.sum if metric.HasField("sum") else metric.histogram if metric.HasField("histogram") else metric.gauge
                    for point in data.data_points:
                        key = (metric.name, tuple(sorted(attrs_dict(point.attributes).items())))
                        value = getattr(point, "as_int", None) or getattr(point, "count", None) or 0
                        points[key] = value
    assert points[("servewatch.export.spans", (("servewatch.export.outcome", "exported"),))] == 4
    assert points[("servewatch.export.spans", (("servewatch.export.outcome", "dropped"),))] == 0
    assert points[("servewatch.incidents", (("servewatch.incident.trigger", "stall"),))] == 1
    assert points[("servewatch.actions", (("servewatch.action", "pyspy.dump"), ("servewatch.outcome", "ok")))] == 1
    assert points[("servewatch.detection.latency", (("servewatch.incident.trigger", "stall"),))] == 1


def test_embedded_default_writes_metrics_file(tmp_path: Path) -> None:
    telemetry = build_telemetry(ExportConfig(metrics_interval_s=60.0), data_dir=tmp_path, host_name="h", environ={})
    telemetry.metrics.incident_opened("health")
    telemetry.shutdown(3.0)
    lines = [json.loads(line) for f in (tmp_path / "h" / "metrics").glob("metrics-*.jsonl") for line in f.read_text().splitlines()]
    names = {m["name"] for line in lines for rm in line["resourceMetrics"] for sm in rm["scopeMetrics"] for m in sm["metrics"]}
    assert {"servewatch.incidents", "servewatch.export.spans"} <= names


def test_noop_metrics_never_raise() -> None:
    metrics = Metrics(None)
    metrics.incident_opened("stall")
    metrics.action_done("pyspy.dump", "timed_out")
    metrics.detection_latency(1.0)


async def test_aclose_with_collector_down_returns_promptly_and_spools(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    otlp_receiver.stop()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.grpc_endpoint}
    telemetry = build_telemetry(ExportConfig(metrics_interval_s=60.0, shutdown_timeout_s=1.0), data_dir=tmp_path, host_name="h", environ=env)
    ids = _emit(telemetry, 50)
    started = time.monotonic()
    stats = await telemetry.aclose()
    assert time.monotonic() - started < 10.0  # hang guard only; bench/bench_export.py measures it
    assert (stats.spooled, stats.spool_spans, stats.dropped) == (50, 50, 0)
    assert telemetry.spool_dir == tmp_path / "h" / "spool"
    spooled = {s.span_id.hex() for f in telemetry.spool_dir.glob("*.binpb") for r in read_span_file(f) for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert spooled == ids
    assert (await telemetry.aclose()) == stats  # safe twice


@pytest.mark.parametrize("to_collector", [True, False], ids=["otlp", "embedded-files"])
def test_otel_sdk_disabled_turns_off_spans_as_well_as_metrics(otlp_receiver: OtlpReceiver, tmp_path: Path, to_collector: bool) -> None:
    # the OTel spec: OTEL_SDK_DISABLED=true disables the SDK for every signal (metrics were off, spans went on)
    env = {"OTEL_SDK_DISABLED": "TRUE"}
    if to_collector:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_receiver.grpc_endpoint
    telemetry = build_telemetry(ExportConfig(metrics_interval_s=60.0), data_dir=tmp_path, host_name="h", environ=env)
    try:
        _emit(telemetry, 4)
        with telemetry.tracer_provider.get_tracer("t").start_as_current_span("live"):
            pass
        telemetry.metrics.incident_opened("stall")
        assert telemetry.processor.flush(10.0) is True
    finally:
        telemetry.shutdown(3.0)  # what is sent is sent by now (the senders are synchronous)
    assert telemetry.meter_provider is None and telemetry.spool_dir is None and telemetry.spans_dir is None
    assert otlp_receiver.spans() == [] and otlp_receiver.metrics_requests == []
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no span file, no spool, no metrics file
    assert sdk_disabled({"OTEL_SDK_DISABLED": "true"}) and not sdk_disabled({"OTEL_SDK_DISABLED": "1"}) and not sdk_disabled({})


def test_an_invalid_otel_resource_attributes_pair_is_said_and_the_others_kept(monkeypatch: pytest.MonkeyPatch,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The SDK's detector warns on its own logger, which the CLI counts without printing: the
    agent says it in one line (issue: small lies, an invalid pair dropped without a word)."""
    from exporters.otlp.provider import build_resource

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=staging,oops,=nokey,k8s.pod.name=sgl-0")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    with caplog.at_level(logging.WARNING, logger="exporters.otlp.provider"):
        resource = build_resource(ExportConfig(metrics=False), host_name="h", service_instance_id="i")
    said = [r.getMessage() for r in caplog.records if r.name == "exporters.otlp.provider"]
    assert said == ["OTEL_RESOURCE_ATTRIBUTES: 'oops', '=nokey' are not key=value: dropped (the other pairs are kept)"], said
    assert resource.attributes["deployment.environment.name"] == "staging"
    assert resource.attributes["k8s.pod.name"] == "sgl-0"
    caplog.clear()
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "a=1,b=2")
    with caplog.at_level(logging.WARNING, logger="exporters.otlp.provider"):
        build_resource(ExportConfig(metrics=False), host_name="h", service_instance_id="i")
    assert not [r for r in caplog.records if r.name == "exporters.otlp.provider"]
