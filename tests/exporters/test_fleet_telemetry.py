"""Telemetry against the collector set-ups fleets run: private-CA TLS and mTLS, auth headers on
both signals, the 4 MiB receive limit, millisecond timeouts, stranded spools, metric outages.

Every test talks to the real receiver (``tests/otlp_receiver.py``) over real sockets, with
certificates generated per session (``tests/tls_certs.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from exporters.otlp.batching import ATTR_TRUNCATED, split_request
from exporters.otlp.processor import LosslessSpanProcessor
from exporters.otlp.provider import (
    ExportConfig,
    ExportConfigError,
    build_telemetry,
    resolve_destination,
)
from exporters.otlp.spans import build_span, new_trace_id, span_id_hex
from exporters.otlp.spool import Spool
from exporters.otlp.transport import Cause, Delivery, TlsFiles, make_sender
from tests.otlp_receiver import OtlpReceiver
from tests.tls_certs import TlsMaterial, make_tls_material


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return make_tls_material(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_receiver(pki: TlsMaterial) -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver(tls=pki).start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture
def mtls_receiver(pki: TlsMaterial) -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver(tls=pki, require_client_cert=True).start()
    try:
        yield receiver
    finally:
        receiver.stop()


def _spans(telemetry, n: int, *, name: str = "probe", attrs: dict | None = None) -> set[str]:
    trace_id = new_trace_id()
    ids = set()
    for i in range(n):
        span = build_span(name, trace_id=trace_id, start_time_unix_nano=1_000 + i, end_time_unix_nano=2_000 + i,
                          attributes=attrs, resource=telemetry.sink.resource)
        telemetry.sink.emit(span)
        ids.add(span_id_hex(span.context.span_id))
    return ids


# --- TLS ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mtls", [False, True], ids=["server-auth", "mtls"])
def test_private_ca_and_mtls_collector_gets_spans_and_metrics_from_env(
    pki: TlsMaterial, tls_receiver: OtlpReceiver, mtls_receiver: OtlpReceiver, protocol: str, mtls: bool, tmp_path: Path
) -> None:
    receiver = mtls_receiver if mtls else tls_receiver
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint(protocol),
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki.ca_cert),
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20fleet-token",
    }
    if mtls:
        env["OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"] = str(pki.client_cert)
        env["OTEL_EXPORTER_OTLP_CLIENT_KEY"] = str(pki.client_key)
    telemetry = build_telemetry(ExportConfig(metrics_interval_s=0.2), data_dir=tmp_path, host_name="h", environ=env)
    try:
        ids = _spans(telemetry, 20)
        assert telemetry.processor.flush(20.0) is True
        assert receiver.wait_for_metrics(20.0)
    finally:
        telemetry.shutdown(3.0)
    assert {s.span_id for s in receiver.spans()} >= ids
    # the same Authorization header reaches both signals, lower-cased for gRPC metadata
    span_headers = {k.lower(): v for k, v in receiver.request_headers[0].items()}
    metric_headers = {k.lower(): v for k, v in receiver.metrics_headers[0].items()}
    assert span_headers["authorization"] == metric_headers["authorization"] == "Bearer fleet-token"
    stats = telemetry.metric_statistics()
    assert stats is not None and stats.exported > 0 and stats.lost == 0


def test_mtls_collector_refuses_a_client_without_certificate_and_says_tls(
    pki: TlsMaterial, mtls_receiver: OtlpReceiver, protocol: str
) -> None:
    sender = make_sender(mtls_receiver.endpoint(protocol), protocol, tls=TlsFiles(ca_file=str(pki.ca_cert)))
    try:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        result = sender.send(ExportTraceServiceRequest(), timeout_s=5.0)
    finally:
        sender.close()
    assert result.delivery is Delivery.RETRYABLE and result.cause is Cause.TLS
    assert "TLS" in result.explain()
    assert mtls_receiver.span_count == 0


def test_unknown_ca_fails_the_handshake_and_spools(pki: TlsMaterial, tls_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": tls_receiver.endpoint(protocol) + ("/v1/traces" if protocol != "grpc" else ""),
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(pki.other_ca_cert),
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki.ca_cert),  # the signal-specific one wins
    }
    telemetry = build_telemetry(ExportConfig(metrics=False), data_dir=tmp_path, host_name="h", environ=env)
    try:
        _spans(telemetry, 5)
        assert telemetry.processor.flush(2.0) is False
        assert "TLS" in telemetry.processor.last_error or "tls" in telemetry.processor.last_error.lower()
    finally:
        stats = telemetry.shutdown(2.0)
    assert stats.spool_spans == 5 and stats.lost == 0
    assert tls_receiver.span_count == 0


# --- configuration --------------------------------------------------------------------------


def test_every_setting_has_a_per_signal_variant_that_wins(pki: TlsMaterial) -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:4317",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://m:4318/v1/metrics",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": "X-Tenant=a,Authorization=t0",
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "Authorization=t1",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "4000",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "1500",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "none",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_INSECURE": "false",
        "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki.ca_cert),
        "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE": str(pki.other_ca_cert),
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE": str(pki.client_cert),
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY": str(pki.client_key),
    }
    traces = resolve_destination(ExportConfig(), env)
    metrics = resolve_destination(ExportConfig(), env, signal="metrics")
    assert (traces.endpoint, traces.protocol, traces.signal_specific) == ("http://all:4317", "grpc", False)
    assert (metrics.endpoint, metrics.protocol, metrics.signal_specific) == ("https://m:4318/v1/metrics", "http/protobuf", True)
    # header keys are lower-cased for both signals (gRPC metadata must be)
    assert dict(traces.headers) == {"x-tenant": "a", "authorization": "t0"}
    assert dict(metrics.headers) == {"x-tenant": "a", "authorization": "t1"}
    assert (traces.timeout_s, metrics.timeout_s) == (4.0, 1.5)
    assert (traces.compression, metrics.compression) == ("gzip", None)
    assert (traces.insecure, metrics.insecure) == (True, False)
    assert traces.tls == TlsFiles(str(pki.ca_cert))
    assert metrics.tls == TlsFiles(str(pki.other_ca_cert), str(pki.client_cert), str(pki.client_key))


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem"}, "OTEL_EXPORTER_OTLP_CERTIFICATE"),
        ({"OTEL_EXPORTER_OTLP_CLIENT_KEY": __file__}, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"),
        ({"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "yes"}, "OTEL_EXPORTER_OTLP_TRACES_INSECURE"),
        ({"OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "-1"}, "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT"),
    ],
)
def test_bad_tls_and_signal_settings_name_the_variable(env: dict, names: str) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", **env}
    with pytest.raises(ExportConfigError, match=names):
        resolve_destination(ExportConfig(), env, signal="metrics" if "METRICS" in names else "traces")


def test_timeout_that_looks_like_seconds_or_microseconds_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="exporters.otlp.provider")
    for _ in range(3):
        assert resolve_destination(ExportConfig(), {"OTEL_EXPORTER_OTLP_TIMEOUT": "10"}).timeout_s == pytest.approx(0.01)
    for _ in range(2):
        assert resolve_destination(ExportConfig(), {"OTEL_EXPORTER_OTLP_TIMEOUT": "90000000"}).timeout_s == 90000.0
    assert resolve_destination(ExportConfig(), {"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"}).timeout_s == 10.0
    warnings = [r.getMessage() for r in caplog.records if "MILLISECONDS" in r.getMessage()]
    assert len(warnings) == 2
    assert "written in seconds" in warnings[0] and "microseconds" in warnings[1]


def test_gzip_compression_reaches_an_http_collector(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.http_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
    }
    telemetry = build_telemetry(ExportConfig(metrics=False), data_dir=tmp_path, host_name="h", environ=env)
    try:
        ids = _spans(telemetry, 3)
        assert telemetry.processor.flush(10.0)
    finally:
        telemetry.shutdown(2.0)
    assert {s.span_id for s in otlp_receiver.spans()} == ids
    assert {k.lower(): v for k, v in otlp_receiver.request_headers[0].items()}["content-encoding"] == "gzip"


# --- size limits ----------------------------------------------------------------------------


def _big_spans(n: int, value_bytes: int) -> list:
    trace_id = new_trace_id()
    return [
        build_span("big", trace_id=trace_id, start_time_unix_nano=1, end_time_unix_nano=2,
                   attributes={"servewatch.stacks": "x" * value_bytes, "i": i})
        for i in range(n)
    ]


def test_batches_stay_under_the_4mib_limit_and_a_huge_span_is_trimmed(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    # 40 spans of 200 kB = 8 MB in one 512-span batch, plus one 6 MB span
    processor = LosslessSpanProcessor(make_sender(otlp_receiver.endpoint(protocol), protocol), spool=Spool(tmp_path / "spool", max_bytes=1 << 30))
    spans = _big_spans(40, 200_000) + _big_spans(1, 6_000_000)
    try:
        for span in spans:
            processor.on_end(span)
        assert processor.flush(30.0) is True
    finally:
        processor.shutdown(3.0)
    stats = processor.statistics()
    assert stats.exported == 41 and stats.lost == 0 and stats.trimmed == 1
    assert otlp_receiver.span_count == 41
    assert all(req.ByteSize() <= 3 * 1024 * 1024 for _, req in otlp_receiver.trace_requests)
    trimmed = [s for s in otlp_receiver.spans() if ATTR_TRUNCATED in s.attributes]
    assert len(trimmed) == 1 and trimmed[0].attributes[ATTR_TRUNCATED] == 1
    assert str(trimmed[0].attributes["servewatch.stacks"]).endswith("...[truncated]")


def test_collector_with_a_smaller_limit_gets_split_requests(protocol: str, tmp_path: Path) -> None:
    receiver = OtlpReceiver(max_receive_bytes=512 * 1024).start()
    try:
        processor = LosslessSpanProcessor(make_sender(receiver.endpoint(protocol), protocol), spool=Spool(tmp_path / "spool", max_bytes=1 << 30))
        try:
            for span in _big_spans(30, 100_000):  # 3 MB: under our limit, over the collector's
                processor.on_end(span)
            assert processor.flush(30.0) is True
        finally:
            processor.shutdown(3.0)
        assert receiver.span_count == 30
        assert processor.statistics().lost == 0
        assert len(receiver.trace_requests) >= 6
    finally:
        receiver.stop()


def test_a_stuck_oversize_spooled_batch_is_split_in_place_and_later_incidents_flow(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 30)
    big = encode_spans(_big_spans(27, 200_000))  # 5.4 MB in one spooled file, as older versions wrote
    spool.append(big, 27)
    later = encode_spans(_big_spans(3, 10))
    spool.append(later, 3)
    spool.close()
    processor = LosslessSpanProcessor(make_sender(otlp_receiver.endpoint(protocol), protocol), spool=Spool(tmp_path / "spool", max_bytes=1 << 30))
    try:
        assert processor.flush(30.0) is True
    finally:
        processor.shutdown(3.0)
    assert otlp_receiver.span_count == 30
    assert processor.statistics().replayed == 30
    assert not list((tmp_path / "spool").glob("*.binpb"))


def test_split_request_keeps_every_span_once_with_resource_and_scope() -> None:
    request = encode_spans(_big_spans(10, 50_000))
    pieces, trimmed = split_request(request, 120_000)
    assert trimmed == 0 and len(pieces) == 5
    ids = [s.span_id for piece, _ in pieces for rs in piece.resource_spans for ss in rs.scope_spans for s in ss.spans]
    original = [s.span_id for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert ids == original
    assert all(piece.ByteSize() <= 120_000 and piece.resource_spans[0].scope_spans[0].scope.name == "servewatch" for piece, _ in pieces)


# --- stranded spools ------------------------------------------------------------------------


def test_stranded_spool_of_a_dead_agent_is_replayed_by_the_next_one(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    root = tmp_path / "h" / "spool"
    main = Spool(root, max_bytes=1 << 30)  # a `run` agent holds the main folder
    try:
        # another process (a `dump` during the `run`) spools 7 spans in pid-<its pid>/ and dies
        code = (
            "import sys; from pathlib import Path\n"
            "from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans\n"
            "from exporters.otlp.spans import build_span, new_trace_id\n"
            "from exporters.otlp.spool import Spool\n"
            "s = Spool(Path(sys.argv[1]), max_bytes=1 << 30)\n"
            "t = new_trace_id()\n"
            "s.append(encode_spans([build_span('stranded', trace_id=t, start_time_unix_nano=1, end_time_unix_nano=2) for _ in range(7)]), 7)\n"
            "print(s.directory.name, flush=True)\n"
        )
        out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[2], check=True).stdout.strip()
        assert out.startswith("pid-") and (root / out).is_dir()
        processor = LosslessSpanProcessor(make_sender(otlp_receiver.endpoint(protocol), protocol), spool=main, adopt_interval_s=0.2)
        try:
            assert otlp_receiver.wait_for_spans(7, 30.0)
            assert processor.flush(10.0)
        finally:
            processor.shutdown(3.0)
        assert {s.name for s in otlp_receiver.spans()} == {"stranded"} and otlp_receiver.span_count == 7
        assert not (root / out).exists()
        assert main.statistics().adopted_spans == 7
    finally:
        main.close()


def test_a_live_agents_spool_folder_is_never_adopted(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    first = Spool(root, max_bytes=1 << 20)
    second = Spool(root, max_bytes=1 << 20)  # same process, second owner: pid-<pid>/, locked
    try:
        second.append(encode_spans(_big_spans(2, 10)), 2)
        assert second.directory.name == f"pid-{os.getpid()}"
        assert first.adopt_stranded() == 0
        assert len(second) == 1
    finally:
        second.close()
        first.close()
    third = Spool(root, max_bytes=1 << 20)  # both gone: the next owner of the main folder adopts
    try:
        assert third.directory == root and third.statistics().adopted_spans == 2
    finally:
        third.close()


def test_a_dead_agents_metrics_spool_is_replayed_by_the_next_one(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    """A second agent's metrics spool (``pid-<pid>/metrics``) outlives it: the running agent's
    span spool adopts the folder, and its metrics exporter sends those exports, counted."""
    import subprocess
    import sys

    from opentelemetry.sdk.resources import Resource

    from exporters.otlp.metrics import build_meter_provider

    root = tmp_path / "h" / "spool"
    main = Spool(root, max_bytes=1 << 30)  # a `run` agent holds the main folder
    otlp_receiver.stop()
    try:
        code = (
            "import os, sys; from pathlib import Path\n"
            "from opentelemetry.sdk.resources import Resource\n"
            "from exporters.otlp.metrics import build_meter_provider\n"
            "from exporters.otlp.spool import Spool\n"
            "from exporters.otlp.transport import make_sender\n"
            "s = Spool(Path(sys.argv[1]), max_bytes=1 << 30)\n"
            "provider, exporter = build_meter_provider(Resource.create({}), sender=make_sender(sys.argv[2], sys.argv[3], signal='metrics'),\n"
            "    timeout_s=0.5, interval_s=3600, spool_dir=s.directory / 'metrics')\n"
            "provider.get_meter('t').create_counter('stranded.points').add(3)\n"
            "provider.force_flush()\n"
            "print(s.directory.name, exporter.statistics().spooled, flush=True)\n"
            "os._exit(0)  # dies without a shutdown\n"
        )
        out = subprocess.run([sys.executable, "-c", code, str(root), otlp_receiver.endpoint(protocol), protocol], capture_output=True,
                             text=True, timeout=60, cwd=Path(__file__).resolve().parents[2], check=True).stdout.split()
        folder, stranded = out[0], int(out[1])
        assert folder.startswith("pid-") and stranded > 0
        main.adopt_stranded()  # the processor does this periodically
        assert not (root / folder).exists()
        otlp_receiver.start()
        provider, exporter = build_meter_provider(Resource.create({}), sender=make_sender(otlp_receiver.endpoint(protocol), protocol, signal="metrics"),
                                                  interval_s=3600, spool_dir=main.directory / "metrics")
        try:
            assert exporter.statistics().spool_points == stranded  # type: ignore[attr-defined]
            provider.get_meter("t").create_counter("fresh.points").add(1)  # an export: replay first
            assert provider.force_flush(10_000)
            after = exporter.statistics()  # type: ignore[attr-defined]
        finally:
            provider.shutdown()
        assert (after.replayed, after.lost, after.spool_points) == (stranded, 0, 0)
        names = {m.name for _, req in otlp_receiver.metrics_requests for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        assert "stranded.points" in names
        assert not [p for p in (main.directory / "metrics").iterdir() if p.name.startswith("adopted-")]
    finally:
        main.close()


# --- metrics during an outage ---------------------------------------------------------------


def test_metrics_during_an_outage_are_spooled_and_replayed(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint(protocol), "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
           "OTEL_EXPORTER_OTLP_TIMEOUT": "500"}
    otlp_receiver.stop()
    telemetry = build_telemetry(ExportConfig(metrics_interval_s=0.2), data_dir=tmp_path, host_name="h", environ=env)
    try:
        telemetry.metrics.incident_opened("manual")
        import time

        deadline = time.monotonic() + 30
        while (telemetry.metric_statistics().spooled == 0) and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.1)
        outage = telemetry.metric_statistics()
        assert outage.spooled > 0 and outage.lost == 0 and outage.spool_points > 0  # type: ignore[union-attr]
        otlp_receiver.start()
        deadline = time.monotonic() + 30
        while telemetry.metric_statistics().spool_points and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.1)
    finally:
        telemetry.shutdown(3.0)
    after = telemetry.metric_statistics()
    assert after.replayed >= outage.spooled and after.lost == 0 and after.spool_points == 0  # type: ignore[union-attr]
    names = {m.name for _, req in otlp_receiver.metrics_requests for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert "servewatch.incidents" in names and "servewatch.export.metric_points" in names


def test_standard_span_limits_apply_to_the_spans_servewatch_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from exporters.otlp.spans import link_to, reset_span_limits

    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "5")
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "1")
    reset_span_limits()
    try:
        span = build_span("limited", trace_id=new_trace_id(), start_time_unix_nano=1, end_time_unix_nano=2,
                          attributes={"a": "abcdefgh", "b": 1, "c": 2}, links=[link_to(1, 1), link_to(2, 2)])
        encoded = encode_spans([span]).resource_spans[0].scope_spans[0].spans[0]
    finally:
        monkeypatch.delenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT")
        monkeypatch.delenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT")
        monkeypatch.delenv("OTEL_SPAN_LINK_COUNT_LIMIT")
        reset_span_limits()
    assert len(span.attributes) == 2 and span.dropped_attributes == 1
    assert encoded.dropped_attributes_count == 1 and len(encoded.attributes) == 2
    assert span.attributes.get("a") in (None, "abcde")
    assert len(span.links) == 1


def test_batch_processor_env_sizes_the_lossless_processor() -> None:
    from exporters.otlp.provider import resolve_batching

    env = {"OTEL_BSP_MAX_QUEUE_SIZE": "4096", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "256", "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_BSP_EXPORT_TIMEOUT": "2000"}
    assert resolve_batching(ExportConfig(), env) == {"queue_spans": 4096, "batch_spans": 256, "schedule_delay_s": 0.1,
                                                      "export_timeout_s": 2.0}
    # explicit config wins; nothing set: servewatch's defaults (64k queue: the SDK's 2048 drops bursts)
    assert resolve_batching(ExportConfig(batch_spans=64), env)["batch_spans"] == 64
    assert resolve_batching(ExportConfig(), {}) == {"queue_spans": 65536, "batch_spans": 512, "schedule_delay_s": 2.0}
    with pytest.raises(ExportConfigError, match="OTEL_BSP_SCHEDULE_DELAY"):
        resolve_batching(ExportConfig(), {"OTEL_BSP_SCHEDULE_DELAY": "soon"})


def test_metrics_honour_the_collectors_retry_after(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    """servewatch's metrics exporter, told ``503 Retry-After: 30``, sends nothing more for those
    30 s (exports at its 0.2 s interval go to the spool meanwhile)."""
    import time

    otlp_receiver.http_status = 503
    otlp_receiver.retry_delay_s = 30
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    telemetry = build_telemetry(ExportConfig(metrics_interval_s=0.2), data_dir=tmp_path, host_name="h", environ=env)
    try:
        telemetry.metrics.incident_opened("manual")
        deadline = time.monotonic() + 30
        while otlp_receiver.attempts < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # ~7 more export intervals
        stats = telemetry.metric_statistics()
        assert otlp_receiver.attempts == 1
        assert stats.spooled > 0 and stats.lost == 0  # type: ignore[union-attr]
    finally:
        telemetry.shutdown(1.0)
