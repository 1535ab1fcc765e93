"""Telemetry set-up: resource, span pipeline and meter provider, from config and the standard env.

Owns :class:`ExportConfig` (user config), :func:`resolve_destination` (config > ``OTEL_*`` env >
embedded default) and :func:`build_telemetry`, which returns a :class:`Telemetry` holding the
``TracerProvider``, the :class:`~exporters.spans.SpanSink` the mirror emits to, the
``MeterProvider`` and :class:`~exporters.metrics.Metrics`, with a bounded :meth:`Telemetry.shutdown`
/ :meth:`Telemetry.aclose`.

Destinations:

* an OTLP endpoint (``--otlp-endpoint``, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
  ``OTEL_EXPORTER_OTLP_ENDPOINT``) over ``grpc`` or ``http/protobuf``
  (``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``), through the lossless processor with a spool at
  ``<data_dir>/<host>/spool/``;
* none configured: the embedded default, OTLP/JSON lines under ``<data_dir>/<host>/spans/`` (and
  metrics under ``.../metrics/``), the collector ``otlpjsonfile`` receiver's format.

Env facts (OTel SDK environment-variable spec, Python SDK 1.45): ``OTEL_EXPORTER_OTLP_TIMEOUT`` is
read in SECONDS by the Python exporters; headers are ``k=v`` pairs, comma separated, URL-encoded;
``OTEL_SERVICE_NAME`` wins over ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``.

Imports opentelemetry-sdk, pydantic, anyio and the other :mod:`exporters` modules.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import unquote

import anyio
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.semconv._incubating.attributes.host_attributes import HOST_NAME
from opentelemetry.semconv._incubating.attributes.process_attributes import PROCESS_PID
from opentelemetry.semconv.attributes.service_attributes import SERVICE_INSTANCE_ID, SERVICE_NAME
from pydantic import BaseModel, ConfigDict, Field

from exporters.metrics import Metrics, build_meter_provider
from exporters.processor import ExportStatistics, LosslessSpanProcessor
from exporters.spans import ProcessorSink
from exporters.spool import Spool
from exporters.transport import FileSender, make_sender

__all__ = [
    "ExportConfig",
    "ExportConfigError",
    "Destination",
    "Telemetry",
    "build_telemetry",
    "build_resource",
    "resolve_destination",
    "DEFAULT_SERVICE_NAME",
    "DEFAULT_TIMEOUT_S",
]

#: service.name when neither config nor ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` set one.
DEFAULT_SERVICE_NAME = "servewatch"
#: Per-call export timeout when neither config nor ``OTEL_EXPORTER_OTLP_TIMEOUT`` sets one, in
#: seconds (short on purpose: a failed call spools, it does not hold the queue for the SDK's 10 s).
DEFAULT_TIMEOUT_S = 3.0

#: Base OTLP endpoint for all signals, e.g. ``http://collector:4317`` (OTel SDK env spec).
ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
#: OTLP endpoint for traces only; for HTTP it is the full URL (no ``/v1/traces`` appended).
ENV_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
#: ``grpc`` | ``http/protobuf`` (default ``grpc`` here, as the Python exporter's).
ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
#: Traces-only protocol, wins over ``OTEL_EXPORTER_OTLP_PROTOCOL``.
ENV_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
#: Per-call export timeout in SECONDS (the Python exporters' unit).
ENV_TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"
#: Traces-only timeout, seconds.
ENV_TRACES_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
#: ``k=v,k2=v2`` request headers (URL-encoded values).
ENV_HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
#: ``gzip`` | ``none``.
ENV_COMPRESSION = "OTEL_EXPORTER_OTLP_COMPRESSION"
#: ``true`` for plaintext gRPC to an endpoint given without scheme.
ENV_INSECURE = "OTEL_EXPORTER_OTLP_INSECURE"
#: service.name (wins over OTEL_RESOURCE_ATTRIBUTES).
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"

Protocol = Literal["grpc", "http/protobuf"]


class ExportConfigError(ValueError):
    """A telemetry setting is invalid; the message names the setting (config key or env var)."""


class ExportConfig(BaseModel):
    """User config of the telemetry export. Unset (``None``) fields fall back to the ``OTEL_*``
    env, then to the defaults documented here."""

    model_config = ConfigDict(extra="forbid")

    #: OTLP endpoint (``http://host:4317`` for gRPC, ``http://host:4318`` for HTTP); ``None``:
    #: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``; neither: write
    #: OTLP/JSON lines files under the data dir (the embedded default).
    endpoint: str | None = None
    #: ``grpc`` or ``http/protobuf``; ``None``: ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``, else grpc.
    protocol: Protocol | None = None
    #: extra request headers / gRPC metadata, merged over ``OTEL_EXPORTER_OTLP_HEADERS``.
    headers: dict[str, str] = Field(default_factory=dict)
    #: plaintext gRPC for an endpoint without scheme; ``None``: env, else plaintext.
    insecure: bool | None = None
    #: ``gzip`` or ``none``; ``None``: env, else none.
    compression: Literal["gzip", "none"] | None = None
    #: bound on one export call, seconds; ``None``: ``OTEL_EXPORTER_OTLP_TIMEOUT``, else 3 s.
    timeout_s: float | None = Field(default=None, gt=0)
    #: service.name; ``None``: ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``, else servewatch.
    service_name: str | None = None
    #: extra resource attributes, over ``OTEL_RESOURCE_ATTRIBUTES``.
    resource_attributes: dict[str, str] = Field(default_factory=dict)
    #: in-memory span queue, spans (a burst bigger than this is dropped and counted).
    queue_spans: int = Field(default=65536, ge=1)
    #: spans per export request.
    batch_spans: int = Field(default=512, ge=1)
    #: longest a span waits before a partial batch is sent, seconds.
    schedule_delay_s: float = Field(default=0.5, gt=0)
    #: shutdown deadline; what is not delivered by then is spooled, seconds.
    shutdown_timeout_s: float = Field(default=3.0, ge=0)
    #: spool cap, bytes (oldest batches evicted and counted past it).
    spool_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    #: first replay backoff after a failed export, seconds (doubles up to the max).
    retry_initial_backoff_s: float = Field(default=0.25, gt=0)
    #: longest replay backoff, seconds.
    retry_max_backoff_s: float = Field(default=5.0, gt=0)
    #: embedded default: rotate span files at this size, bytes.
    file_max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    #: embedded default: keep at most this many span files per run (0: all).
    file_max_files: int = Field(default=32, ge=0)
    #: export servewatch's own metrics.
    metrics: bool = True
    #: metrics export interval, seconds.
    metrics_interval_s: float = Field(default=10.0, gt=0)


@dataclass(frozen=True)
class Destination:
    """Where spans go, after config and env are resolved.

    Attributes:
        endpoint: the OTLP endpoint, or ``None`` for the embedded file default.
        protocol: ``grpc`` or ``http/protobuf``.
        signal_specific: the endpoint came from ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (HTTP: use as-is).
        headers / insecure / compression / timeout_s: resolved transport settings.
    """

    endpoint: str | None
    protocol: Protocol
    signal_specific: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    insecure: bool | None = None
    compression: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def describe(self) -> str:
        return f"OTLP {self.protocol} {self.endpoint}" if self.endpoint else "OTLP/JSON files"


def _parse_headers(raw: str, name: str) -> dict[str, str]:
    headers: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ExportConfigError(f"{name}: expected 'key=value' pairs, got {item.strip()!r}")
        headers[unquote(key.strip())] = unquote(value.strip())
    return headers


def _env_float(environ: Mapping[str, str], *names: str) -> float | None:
    for name in names:
        raw = environ.get(name, "").strip()
        if raw:
            try:
                value = float(raw)
            except ValueError:
                raise ExportConfigError(f"{name}: expected seconds as a number, got {raw!r}") from None
            if value <= 0:
                raise ExportConfigError(f"{name}: must be > 0 seconds, got {raw!r}")
            return value
    return None


def _check_endpoint(endpoint: str, key: str) -> None:
    """An endpoint must be ``http(s)://host[:port][/path]`` (or ``host:port`` for gRPC).

    Raises:
        ExportConfigError: naming ``key``.
    """
    from urllib.parse import urlsplit

    candidate = endpoint if "://" in endpoint else f"http://{endpoint}"
    try:
        parts = urlsplit(candidate)
        parts.port  # noqa: B018 - raises ValueError when out of range or not a number
    except ValueError as exc:
        raise ExportConfigError(f"{key}: invalid OTLP endpoint {endpoint!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ExportConfigError(f"{key}: invalid OTLP endpoint {endpoint!r}; expected http(s)://host:port")


def resolve_destination(config: ExportConfig, environ: Mapping[str, str] | None = None) -> Destination:
    """Resolve the span destination: config > ``OTEL_*`` env > embedded default.

    Raises:
        ExportConfigError: a bad env value (the message names the variable).
    """
    env = os.environ if environ is None else environ
    signal_specific = False
    endpoint = config.endpoint
    if not endpoint:
        endpoint = env.get(ENV_TRACES_ENDPOINT, "").strip() or None
        signal_specific = endpoint is not None
    if not endpoint:
        endpoint = env.get(ENV_ENDPOINT, "").strip() or None
    if endpoint:
        _check_endpoint(endpoint, "export.endpoint" if config.endpoint else (ENV_TRACES_ENDPOINT if signal_specific else ENV_ENDPOINT))
    protocol: str | None = config.protocol
    protocol_key = "export.protocol"
    if protocol is None:
        for name in (ENV_TRACES_PROTOCOL, ENV_PROTOCOL):
            raw = env.get(name, "").strip()
            if raw:
                protocol, protocol_key = raw, name
                break
    protocol = protocol or "grpc"
    if protocol not in ("grpc", "http/protobuf"):
        raise ExportConfigError(f"{protocol_key}: unsupported OTLP protocol {protocol!r}; use grpc or http/protobuf")
    headers = _parse_headers(env.get(ENV_HEADERS, ""), ENV_HEADERS)
    headers.update(config.headers)
    insecure = config.insecure
    if insecure is None and env.get(ENV_INSECURE, "").strip():
        insecure = env[ENV_INSECURE].strip().lower() == "true"
    compression = config.compression or env.get(ENV_COMPRESSION, "").strip().lower() or None
    if compression not in (None, "gzip", "none"):
        raise ExportConfigError(f"{ENV_COMPRESSION}: expected gzip or none, got {compression!r}")
    timeout_s = config.timeout_s or _env_float(env, ENV_TRACES_TIMEOUT, ENV_TIMEOUT) or DEFAULT_TIMEOUT_S
    return Destination(
        endpoint=endpoint,
        protocol=protocol,  # type: ignore[arg-type]
        signal_specific=signal_specific,
        headers=headers,
        insecure=insecure,
        compression=None if compression == "none" else compression,
        timeout_s=timeout_s,
    )


def build_resource(
    config: ExportConfig, *, host_name: str, service_instance_id: str, environ: Mapping[str, str] | None = None
) -> Resource:
    """The agent's resource: ``service.name``, ``service.instance.id``, ``host.name``, ``process.pid``.

    Precedence: config > env (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``) > ours.
    """
    env = os.environ if environ is None else environ
    attributes: dict[str, object] = {
        SERVICE_NAME: DEFAULT_SERVICE_NAME,
        SERVICE_INSTANCE_ID: service_instance_id,
        HOST_NAME: host_name,
        PROCESS_PID: os.getpid(),
    }
    if environ is None:
        attributes.update(OTELResourceDetector().detect().attributes)
    else:  # an explicit mapping (tests): parse it the same way, without touching os.environ
        raw = env.get("OTEL_RESOURCE_ATTRIBUTES", "")
        for item in raw.split(","):
            key, sep, value = item.partition("=")
            if sep and key.strip():
                attributes[unquote(key.strip())] = unquote(value.strip())
        if env.get(ENV_SERVICE_NAME, "").strip():
            attributes[SERVICE_NAME] = env[ENV_SERVICE_NAME].strip()
    attributes.update(config.resource_attributes)
    if config.service_name:
        attributes[SERVICE_NAME] = config.service_name
    return Resource.create(attributes)  # type: ignore[arg-type]


@dataclass
class Telemetry:
    """The agent's telemetry pipeline. Build with :func:`build_telemetry`.

    Attributes:
        resource: the agent's resource.
        destination: where spans go.
        processor: the lossless span processor (``statistics()``, ``flush()``).
        sink: emit finished spans here (:class:`~exporters.mirror.SpanMirror` does).
        tracer_provider: for live spans (not installed globally; call
            ``opentelemetry.trace.set_tracer_provider`` if wanted).
        meter_provider: ``None`` when metrics are off.
        metrics: the instruments (a no-op recorder when metrics are off).
        spans_dir: embedded default's span files (``None`` when exporting over OTLP).
        spool_dir: the spool (``None`` for the embedded default).
    """

    resource: Resource
    destination: Destination
    processor: LosslessSpanProcessor
    sink: ProcessorSink
    tracer_provider: TracerProvider
    meter_provider: MeterProvider | None
    metrics: Metrics
    spans_dir: Path | None
    spool_dir: Path | None
    shutdown_timeout_s: float = 3.0
    _closed: bool = False

    def statistics(self) -> ExportStatistics:
        return self.processor.statistics()

    def shutdown(self, timeout_s: float | None = None) -> ExportStatistics:
        """Flush what fits in ``timeout_s`` seconds (default: config), spool the rest, stop.

        Bounded: spans take at most the deadline (plus a local spool write); metrics get what is
        left of it, at least 0.5 s, on a helper thread that is abandoned past that. Safe twice.

        Returns:
            Final span counters.
        """
        if self._closed:
            return self.processor.statistics()
        self._closed = True
        budget_s = self.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget_s
        self.processor.shutdown(budget_s)
        self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            provider = self.meter_provider
            remaining_s = max(0.5, deadline - time.monotonic())
            worker = threading.Thread(
                target=provider.shutdown, kwargs={"timeout_millis": remaining_s * 1000}, name="servewatch-metrics-shutdown", daemon=True
            )
            worker.start()
            worker.join(remaining_s)
        return self.processor.statistics()

    async def aclose(self, deadline_s: float | None = None) -> ExportStatistics:
        """:meth:`shutdown` on a worker thread, so the event loop keeps running. Bounded likewise."""
        return await anyio.to_thread.run_sync(self.shutdown, deadline_s, abandon_on_cancel=True)


def build_telemetry(
    config: ExportConfig,
    *,
    data_dir: Path,
    service_instance_id: str | None = None,
    host_name: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Telemetry:
    """Build the pipeline: resource, lossless processor (+ spool), TracerProvider, metrics.

    Args:
        config: user config.
        data_dir: servewatch's data dir; files go under ``<data_dir>/<host>/{spans,spool,metrics}/``.
        service_instance_id: ``service.instance.id`` (default: a random UUID per run).
        host_name: ``host.name`` (default: ``socket.gethostname()``).
        environ: env to read instead of ``os.environ`` (tests).

    Raises:
        ExportConfigError: a bad setting (the message names it).
        OSError: the data dir cannot be created.
    """
    host = host_name or socket.gethostname()
    destination = resolve_destination(config, environ)
    resource = build_resource(config, host_name=host, service_instance_id=service_instance_id or str(uuid.uuid4()), environ=environ)
    base = Path(data_dir) / host
    spans_dir: Path | None = None
    spool_dir: Path | None = None
    spool: Spool | None = None
    if destination.endpoint is None:
        spans_dir = base / "spans"
        sender = FileSender(spans_dir, max_file_bytes=config.file_max_bytes, max_files=config.file_max_files)
    else:
        try:
            sender = make_sender(
                destination.endpoint,
                destination.protocol,
                headers=dict(destination.headers),
                insecure=destination.insecure,
                compression=destination.compression,
                signal_specific=destination.signal_specific,
            )
        except ValueError as exc:
            raise ExportConfigError(f"export.endpoint: {exc}") from exc
        spool = Spool(base / "spool", max_bytes=config.spool_max_bytes)
        spool_dir = spool.directory
    processor = LosslessSpanProcessor(
        sender,
        spool=spool,
        max_queue_spans=config.queue_spans,
        max_batch_spans=config.batch_spans,
        schedule_delay_s=config.schedule_delay_s,
        export_timeout_s=destination.timeout_s,
        retry_initial_backoff_s=config.retry_initial_backoff_s,
        retry_max_backoff_s=config.retry_max_backoff_s,
        shutdown_timeout_s=config.shutdown_timeout_s,
    )
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    tracer_provider.add_span_processor(processor)
    meter_provider: MeterProvider | None = None
    if config.metrics:
        metrics_endpoint = destination.endpoint
        if metrics_endpoint is not None and destination.signal_specific:
            metrics_endpoint = (os.environ if environ is None else environ).get(ENV_ENDPOINT) or None
        meter_provider = build_meter_provider(
            resource,
            endpoint=metrics_endpoint,
            protocol=destination.protocol,
            headers=dict(destination.headers),
            insecure=destination.insecure,
            timeout_s=destination.timeout_s,
            interval_s=config.metrics_interval_s,
            file_directory=base / "metrics",
        )
    metrics = Metrics(meter_provider)
    metrics.watch_export(processor.statistics)
    return Telemetry(
        resource=resource,
        destination=destination,
        processor=processor,
        sink=ProcessorSink(processor, resource),
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        metrics=metrics,
        spans_dir=spans_dir,
        spool_dir=spool_dir,
        shutdown_timeout_s=config.shutdown_timeout_s,
    )
