"""Telemetry set-up: resource, span pipeline and meter provider, from config and the standard env.

Owns (for the user settings :class:`~exporters.config.ExportConfig`) :func:`resolve_destination` (config > ``OTEL_*`` env >
embedded default) and :func:`build_telemetry`, which returns a :class:`Telemetry` holding the
``TracerProvider``, the :class:`~exporters.otlp.spans.SpanSink` the mirror emits to, the
``MeterProvider`` and :class:`~exporters.otlp.metrics.Metrics`, with a bounded :meth:`Telemetry.shutdown`
/ :meth:`Telemetry.aclose`.

Destinations:

* an OTLP endpoint (``--otlp-endpoint``, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
  ``OTEL_EXPORTER_OTLP_ENDPOINT``) over ``grpc`` or ``http/protobuf``
  (``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``), through the lossless processor with a spool at
  ``<data_dir>/<host>/spool/``;
* none configured: the embedded default, OTLP/JSON lines under ``<data_dir>/<host>/spans/`` (and
  metrics under ``.../metrics/``), the collector ``otlpjsonfile`` receiver's format.

Env facts (OTel SDK environment-variable and OTLP exporter specs): every ``OTEL_EXPORTER_OTLP_*``
setting has a per-signal ``OTEL_EXPORTER_OTLP_TRACES_*`` / ``_METRICS_*`` variant that wins over
it (endpoint, headers, protocol, timeout, compression, insecure, certificate, client key and
certificate); ``OTEL_EXPORTER_OTLP_[SIGNAL_]TIMEOUT`` is in MILLISECONDS (the spec; the Python
exporters read seconds, FIELD-NOTES) and a value that looks like a unit mistake (under 100 ms or
over 60 s) is logged once; headers are ``k=v`` pairs, comma separated, URL-encoded, keys
lower-cased (gRPC metadata must be); ``OTEL_SERVICE_NAME`` wins over ``service.name`` in
``OTEL_RESOURCE_ATTRIBUTES``. Span limits (``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT``,
``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``...) are read by the SDK's ``SpanLimits`` and applied to
the spans servewatch builds as well (:mod:`exporters.otlp.spans`); the batch processor's
``OTEL_BSP_*`` settings size the lossless processor's queue, batches and delay
(:func:`resolve_batching`).

Imports opentelemetry-sdk, pydantic, anyio and the other :mod:`exporters` modules.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote

from opentelemetry.sdk import environment_variables as _ev

from agent.errors import ExportConfigError
from agent.model.datadir import METRICS_SPOOL_DIR, DataDir
from exporters.config import ExportConfig, Protocol, scheme_problem

if TYPE_CHECKING:  # imported where used: `import exporters.otlp.provider` (config models) stays light
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from exporters.otlp.metrics import Metrics
    from exporters.otlp.processor import ExportStatistics, LosslessSpanProcessor
    from exporters.otlp.spans import ProcessorSink
    from exporters.otlp.spool import Spool
    from exporters.otlp.transport import GrpcSender, HttpSender, RequestSender, TlsFiles

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "DEFAULT_TIMEOUT_S",
    "Destination",
    "ExportConfig",
    "ExportConfigError",
    "Telemetry",
    "build_resource",
    "build_telemetry",
    "resolve_batching",
    "resolve_destination",
    "scheme_problem",
    "sdk_disabled",
]

#: service.name when neither config nor ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` set one.
DEFAULT_SERVICE_NAME = "servewatch"
#: Per-call export timeout when neither config nor ``OTEL_EXPORTER_OTLP_TIMEOUT`` sets one, in
#: seconds (short on purpose: a failed call spools, it does not hold the queue for the SDK's 10 s).
DEFAULT_TIMEOUT_S = 3.0

# The standard names, from the SDK's own constants (opentelemetry.sdk.environment_variables).
#: Base OTLP endpoint for all signals, e.g. ``http://collector:4317`` (OTel SDK env spec).
ENV_ENDPOINT = _ev.OTEL_EXPORTER_OTLP_ENDPOINT
#: OTLP endpoint for traces only; for HTTP it is the full URL (no ``/v1/traces`` appended).
ENV_TRACES_ENDPOINT = _ev.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
#: ``grpc`` | ``http/protobuf`` (default ``grpc`` here, as the Python exporter's).
ENV_PROTOCOL = _ev.OTEL_EXPORTER_OTLP_PROTOCOL
#: Traces-only protocol, wins over ``OTEL_EXPORTER_OTLP_PROTOCOL``.
ENV_TRACES_PROTOCOL = _ev.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
#: Per-call export timeout in MILLISECONDS (OTel spec; default 10000 there, 3000 here).
ENV_TIMEOUT = _ev.OTEL_EXPORTER_OTLP_TIMEOUT
#: Traces-only timeout, milliseconds.
ENV_TRACES_TIMEOUT = _ev.OTEL_EXPORTER_OTLP_TRACES_TIMEOUT
#: ``k=v,k2=v2`` request headers (URL-encoded values; keys lower-cased).
ENV_HEADERS = _ev.OTEL_EXPORTER_OTLP_HEADERS
#: ``gzip`` | ``none``.
ENV_COMPRESSION = _ev.OTEL_EXPORTER_OTLP_COMPRESSION
#: ``true`` for plaintext gRPC to an endpoint given without scheme.
ENV_INSECURE = _ev.OTEL_EXPORTER_OTLP_INSECURE
#: PEM file of the CA(s) that signed the collector's certificate (a private CA).
ENV_CERTIFICATE = _ev.OTEL_EXPORTER_OTLP_CERTIFICATE
#: PEM client certificate (mTLS).
ENV_CLIENT_CERTIFICATE = _ev.OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE
#: PEM client private key (mTLS).
ENV_CLIENT_KEY = _ev.OTEL_EXPORTER_OTLP_CLIENT_KEY
#: service.name (wins over OTEL_RESOURCE_ATTRIBUTES).
ENV_SERVICE_NAME = _ev.OTEL_SERVICE_NAME

#: Timeouts outside this range of milliseconds look like a unit mistake (seconds or microseconds
#: written where the spec wants milliseconds) and are logged once.
PLAUSIBLE_TIMEOUT_MS = (100.0, 60_000.0)

Signal = Literal["traces", "metrics"]



@dataclass(frozen=True)
class Destination:
    """Where spans go, after config and env are resolved.

    Attributes:
        endpoint: the OTLP endpoint, or ``None`` for the embedded file default.
        protocol: ``grpc`` or ``http/protobuf``.
        signal_specific: the endpoint came from ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (HTTP: use as-is).
        headers / insecure / compression / timeout_s / tls: resolved transport settings.
        signal: ``traces`` or ``metrics``.
    """

    endpoint: str | None
    protocol: Protocol
    signal_specific: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    insecure: bool | None = None
    compression: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    tls: TlsFiles = field(default_factory=lambda: _transport().TlsFiles())
    signal: Signal = "traces"

    def make_sender(self) -> GrpcSender | HttpSender:
        """A network sender to :attr:`endpoint` (:func:`exporters.otlp.transport.make_sender`).

        Raises:
            ValueError: no endpoint (the file default has no network sender), or an unknown protocol.
            OSError: a TLS file cannot be read.
        """
        if self.endpoint is None:
            raise ValueError("no OTLP endpoint: spans go to the embedded files")
        return _transport().make_sender(
            self.endpoint,
            self.protocol,
            headers=dict(self.headers),
            insecure=self.insecure,
            compression=self.compression,
            signal_specific=self.signal_specific,
            tls=self.tls,
            signal=self.signal,
        )

    def describe(self) -> str:
        return f"OTLP {self.protocol} {self.endpoint}" if self.endpoint else "OTLP/JSON files"

    def replay_command(self, folder: Path) -> str:
        """The ``servewatch export`` command line that sends ``folder``'s span files here (to the
        base endpoint: a base endpoint given with its ``/v1/<signal>`` path, which HTTP doubles, is
        given without it)."""
        endpoint = self.endpoint
        if endpoint is not None and "://" not in endpoint:  # a bare gRPC host:port: export takes a URL
            endpoint = ("http://" if self.insecure is not False else "https://") + endpoint
        suffix = f"/v1/{self.signal}"
        if endpoint is not None and self.protocol != "grpc" and not self.signal_specific and endpoint.rstrip("/").endswith(suffix):
            endpoint = endpoint.rstrip("/")[: -len(suffix)]
        return f"servewatch export --to {endpoint} --protocol {self.protocol} {folder}"


_log = logging.getLogger(__name__)
_warned_timeouts: set[tuple[str, str]] = set()


def _parse_headers(raw: str, name: str) -> dict[str, str]:
    """``k=v`` pairs, URL-decoded, keys lower-cased (gRPC metadata keys must be lower case).

    The SDK's ``parse_env_headers`` logs and skips a bad pair; a bad pair is a config error here.
    Its module (regular expressions compiled at import) loads only when a pair is given: a dump
    with no ``OTEL_EXPORTER_OTLP_*HEADERS`` never needs it.
    """
    headers: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ExportConfigError(f"{name}: expected 'key=value' pairs, got {item.strip()!r}")
        from opentelemetry.util.re import parse_env_headers

        headers.update(parse_env_headers(item, liberal=True))
    return headers


def _env(environ: Mapping[str, str], signal: Signal, suffix: str) -> tuple[str, str] | None:
    """(name, value) of ``OTEL_EXPORTER_OTLP_{SIGNAL}_{suffix}`` else ``OTEL_EXPORTER_OTLP_{suffix}``."""
    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}"):
        raw = environ.get(name, "").strip()
        if raw:
            return name, raw
    return None


def _env_timeout_s(environ: Mapping[str, str], signal: Signal) -> float | None:
    """The timeout env var, MILLISECONDS per spec, as seconds; a implausible value is logged once."""
    found = _env(environ, signal, "TIMEOUT")
    if found is None:
        return None
    name, raw = found
    try:
        value_ms = float(raw)
    except ValueError:
        raise ExportConfigError(f"{name}: expected milliseconds as a number, got {raw!r}") from None
    if value_ms <= 0:
        raise ExportConfigError(f"{name}: must be > 0 milliseconds, got {raw!r}")
    low, high = PLAUSIBLE_TIMEOUT_MS
    if not low <= value_ms <= high and (name, raw) not in _warned_timeouts:
        _warned_timeouts.add((name, raw))
        guess = "seconds" if value_ms < low else "microseconds"
        _log.warning(
            "%s=%s is %g ms (%g s): the OTel spec reads it in MILLISECONDS; was it written in %s?",
            name, raw, value_ms, value_ms / 1000, guess,
        )
    return value_ms / 1000.0


def _env_bool(environ: Mapping[str, str], signal: Signal, suffix: str) -> bool | None:
    found = _env(environ, signal, suffix)
    if found is None:
        return None
    name, raw = found
    if raw.lower() not in ("true", "false"):
        raise ExportConfigError(f"{name}: expected true or false, got {raw!r}")
    return raw.lower() == "true"


def _transport() -> Any:
    import exporters.otlp.transport

    return exporters.otlp.transport


def _tls_files(config: ExportConfig, environ: Mapping[str, str], signal: Signal) -> TlsFiles:
    values: dict[str, str | None] = {}
    for attr, suffix, key in (
        ("ca_file", "CERTIFICATE", "certificate"),
        ("client_cert_file", "CLIENT_CERTIFICATE", "client_certificate"),
        ("client_key_file", "CLIENT_KEY", "client_key"),
    ):
        value = getattr(config, key)
        name = f"export.{key}"
        if not value:
            found = _env(environ, signal, suffix)
            if found is not None:
                name, value = found
        if value and not Path(value).is_file():
            raise ExportConfigError(f"{name}: no such file {value!r} (a PEM file is expected)")
        values[attr] = value or None
    if bool(values["client_cert_file"]) != bool(values["client_key_file"]):
        raise ExportConfigError(
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and OTEL_EXPORTER_OTLP_CLIENT_KEY (mTLS) must be set together"
        )
    return _transport().TlsFiles(**values)


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


def _resolve_endpoint(config: ExportConfig, env: Mapping[str, str], signal: Signal) -> tuple[str | None, bool]:
    """The endpoint (checked; ``None``: none set) and whether the signal's own variable gave it."""
    specific_name = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    signal_specific = False
    endpoint = config.endpoint
    if not endpoint:
        endpoint = env.get(specific_name, "").strip() or None
        signal_specific = endpoint is not None
    if not endpoint:
        endpoint = env.get(ENV_ENDPOINT, "").strip() or None
    if endpoint:
        _check_endpoint(endpoint, "export.endpoint" if config.endpoint else (specific_name if signal_specific else ENV_ENDPOINT))
    return endpoint, signal_specific


def _resolve_protocol(config: ExportConfig, env: Mapping[str, str], signal: Signal) -> str:
    protocol: str | None = config.protocol
    protocol_key = "export.protocol"
    if protocol is None:
        found = _env(env, signal, "PROTOCOL")
        if found is not None:
            protocol_key, protocol = found
    protocol = protocol or "grpc"
    if protocol not in ("grpc", "http/protobuf"):
        raise ExportConfigError(f"{protocol_key}: unsupported OTLP protocol {protocol!r}; use grpc or http/protobuf")
    return protocol


def _resolve_compression(config: ExportConfig, env: Mapping[str, str], signal: Signal) -> str | None:
    """``gzip``, ``none`` or ``None`` (not set)."""
    compression: str | None = config.compression
    compression_key = "export.compression"
    if compression is None:
        found = _env(env, signal, "COMPRESSION")
        if found is not None:
            compression_key, compression = found[0], found[1].lower()
    if compression not in (None, "gzip", "none"):
        raise ExportConfigError(f"{compression_key}: expected gzip or none, got {compression!r}")
    return compression


def resolve_destination(
    config: ExportConfig, environ: Mapping[str, str] | None = None, *, signal: Signal = "traces"
) -> Destination:
    """Resolve where ``signal`` goes: config > ``OTEL_EXPORTER_OTLP_{SIGNAL}_*`` > ``OTEL_EXPORTER_OTLP_*``
    > defaults (no endpoint: the embedded file default).

    Raises:
        ExportConfigError: a bad setting (the message names the config key or env variable).
    """
    env = os.environ if environ is None else environ
    endpoint, signal_specific = _resolve_endpoint(config, env, signal)
    protocol = _resolve_protocol(config, env, signal)
    headers = _parse_headers(env.get(ENV_HEADERS, ""), ENV_HEADERS)
    specific_headers = f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS"
    headers.update(_parse_headers(env.get(specific_headers, ""), specific_headers))
    headers.update({k.lower(): v for k, v in config.headers.items()})
    insecure = config.insecure if config.insecure is not None else _env_bool(env, signal, "INSECURE")
    compression = _resolve_compression(config, env, signal)
    timeout_s = config.timeout_s or _env_timeout_s(env, signal) or DEFAULT_TIMEOUT_S
    return Destination(
        endpoint=endpoint,
        protocol=protocol,  # type: ignore[arg-type]
        signal_specific=signal_specific,
        headers=headers,
        insecure=insecure,
        compression=None if compression == "none" else compression,
        timeout_s=timeout_s,
        tls=_tls_files(config, env, signal) if endpoint else _transport().TlsFiles(),
        signal=signal,
    )


def resolve_batching(config: ExportConfig, environ: Mapping[str, str] | None = None) -> dict[str, float | int]:
    """The span processor's batching, config > ``OTEL_BSP_*`` (SDK env spec) > servewatch defaults.

    ``OTEL_BSP_MAX_QUEUE_SIZE`` (spans), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` (spans),
    ``OTEL_BSP_SCHEDULE_DELAY`` (milliseconds) and ``OTEL_BSP_EXPORT_TIMEOUT`` (milliseconds, a
    bound on one export call here; ``OTEL_EXPORTER_OTLP_*_TIMEOUT`` wins) are honoured when set;
    servewatch's own defaults (a 64k queue, 0.5 s delay) otherwise, as the SDK's 2048-span queue
    drops bursts.

    Returns:
        ``queue_spans``, ``batch_spans``, ``schedule_delay_s`` and ``export_timeout_s`` (or absent).

    Raises:
        ExportConfigError: a value that is not a positive number (names the variable).
    """
    env = os.environ if environ is None else environ
    explicit = config.model_fields_set
    out: dict[str, float | int] = {
        "queue_spans": config.queue_spans,
        "batch_spans": config.batch_spans,
        "schedule_delay_s": config.schedule_delay_s,
    }
    for key, name, scale in (
        ("queue_spans", _ev.OTEL_BSP_MAX_QUEUE_SIZE, None),
        ("batch_spans", _ev.OTEL_BSP_MAX_EXPORT_BATCH_SIZE, None),
        ("schedule_delay_s", _ev.OTEL_BSP_SCHEDULE_DELAY, 1000.0),
        ("export_timeout_s", _ev.OTEL_BSP_EXPORT_TIMEOUT, 1000.0),
    ):
        raw = env.get(name, "").strip()
        if not raw or key in explicit:
            continue
        try:
            value = float(raw)
        except ValueError:
            raise ExportConfigError(f"{name}: expected a number, got {raw!r}") from None
        if value <= 0:
            raise ExportConfigError(f"{name}: must be > 0, got {raw!r}")
        out[key] = value / scale if scale else int(value)
    out["batch_spans"] = min(out["batch_spans"], out["queue_spans"])
    return out


def _warn_bad_resource_pairs(env: Mapping[str, str]) -> None:
    pairs = [(item.strip(), item.partition("=")) for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")]
    bad = [item for item, (key, sep, _) in pairs if item and not (sep and key.strip())]
    if bad:  # the SDK's own warning is counted, not printed (agent.views.console.quiet_sdk_logs)
        _log.warning("OTEL_RESOURCE_ATTRIBUTES: %s not key=value: dropped (the other pairs are kept)",
                     ", ".join(repr(b) for b in bad) + (" is" if len(bad) == 1 else " are"))


def _env_resource_attributes(env: Mapping[str, str], service_name_key: str) -> dict[str, object]:
    """The resource attributes of ``env`` (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``),
    parsed as the SDK's detector does."""
    attributes: dict[str, object] = {}
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            attributes[unquote(key.strip())] = unquote(value.strip())
    if env.get(ENV_SERVICE_NAME, "").strip():
        attributes[service_name_key] = env[ENV_SERVICE_NAME].strip()
    return attributes


def build_resource(
    config: ExportConfig, *, host_name: str, service_instance_id: str, environ: Mapping[str, str] | None = None
) -> Resource:
    """The agent's resource: ``service.name``, ``service.instance.id``, ``host.name``, ``process.pid``.

    Precedence: config > env (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``) > ours.
    """
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.semconv._incubating.attributes.host_attributes import HOST_NAME
    from opentelemetry.semconv._incubating.attributes.process_attributes import PROCESS_PID
    from opentelemetry.semconv.attributes.service_attributes import (
        SERVICE_INSTANCE_ID,
        SERVICE_NAME,
    )
    env = os.environ if environ is None else environ
    _warn_bad_resource_pairs(env)
    attributes: dict[str, object] = {
        SERVICE_NAME: DEFAULT_SERVICE_NAME,
        SERVICE_INSTANCE_ID: service_instance_id,
        HOST_NAME: host_name,
        PROCESS_PID: os.getpid(),
    }
    if environ is None:
        attributes.update(OTELResourceDetector().detect().attributes)
    else:  # an explicit mapping (tests): parse it the same way, without touching os.environ
        attributes.update(_env_resource_attributes(env, SERVICE_NAME))
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
        sink: emit finished spans here (:class:`~exporters.mirror.mirror.SpanMirror` does).
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
    #: the metrics exporter (``SpoolingMetricExporter`` over OTLP; ``None`` when metrics are off)
    metric_exporter: object | None = None
    _closed: bool = False

    def metric_statistics(self) -> object | None:
        """:class:`~exporters.otlp.metrics_export.MetricExportStatistics` of the OTLP metrics
        exporter (``None`` for the file default or metrics off)."""
        stats = getattr(self.metric_exporter, "statistics", None)
        return stats() if callable(stats) else None

    def statistics(self) -> ExportStatistics:
        return self.processor.statistics()

    def durable_keys(self, keys: set[str], since_time_unix_nano: int = 0) -> set[str]:
        """Which of ``keys`` (write-ahead groups: the span id of an incident action's or root's
        span, 16 hex) are durable: in the spool (any folder of it, ``rejected/`` included) or
        recorded as delivered (:func:`exporters.otlp.spool.durable_keys`); for the embedded default,
        written in a span file changed since ``since_time_unix_nano`` (a hex span id search).
        Blocking (file names, and span files for the embedded default)."""
        if not keys:
            return set()
        if self.spool_dir is not None:
            from exporters.otlp.spool import durable_keys, spool_root_of

            return durable_keys(spool_root_of(self.spool_dir / "x") or self.spool_dir, keys)
        if self.spans_dir is None:
            return set()
        return _keys_in_span_files(self.spans_dir, keys, since_time_unix_nano)

    def delivery_status(self) -> tuple[str, str]:
        """``(state, reason)`` of span delivery for the status board (row ``export``):
        ``blind`` while the collector refuses or rejects spans (the reason says why and the fix),
        ``waiting`` while it is unreachable (spans spooled, retried), ``ready`` otherwise."""
        problem = self.processor.problem()
        if problem is None:
            stats = self.processor.statistics()
            waiting = f"; {stats.spool_spans} span(s) in the spool" if stats.spool_spans else ""
            return "ready", f"spans to {self.destination.describe()}: {stats.exported + stats.replayed} delivered{waiting}"
        return ("waiting" if problem.kind == "unreachable" else "blind"), problem.line

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
        import anyio

        return await anyio.to_thread.run_sync(self.shutdown, deadline_s, abandon_on_cancel=True)


def _keys_in_span_files(folder: Path, keys: set[str], since_time_unix_nano: int) -> set[str]:
    """Keys (span ids, hex) found as a span's ``"spanId"`` in the OTLP/JSON span files of
    ``folder`` modified since ``since_time_unix_nano`` (a second of slack)."""
    found: set[str] = set()
    needles = {key: f'"spanId":"{key}"'.encode("ascii") for key in keys}
    since_s = since_time_unix_nano / 1e9 - 1.0
    try:
        files = [p for p in folder.glob("*.jsonl") if p.stat().st_mtime >= since_s]
    except OSError:
        return found
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        found |= {key for key, needle in needles.items() if key not in found and needle in data}
        if found == keys:
            break
    return found


def sdk_disabled(environ: Mapping[str, str]) -> bool:
    """``OTEL_SDK_DISABLED`` is ``true`` (case-insensitive; any other value is false, per the OTel
    SDK environment-variable spec): no telemetry at all, spans as well as metrics."""
    return environ.get(_ev.OTEL_SDK_DISABLED, "").strip().lower() == "true"


def _span_sender(
    config: ExportConfig, destination: Destination, layout: DataDir, disabled: bool
) -> tuple[RequestSender[ExportTraceServiceRequest], Path | None, Spool | None]:
    """Where spans are sent: ``(sender, spans_dir, spool)`` (the embedded default's span files,
    or an OTLP sender with its spool, or nowhere when the SDK is disabled)."""
    from exporters.otlp.spool import Spool
    from exporters.otlp.transport import DisabledSender, FileSender

    if disabled:  # spans go nowhere, no file, no spool (metrics are off below)
        _log.info("OTEL_SDK_DISABLED=true: servewatch exports no spans and no metrics (bundles are still written)")
        return DisabledSender(), None, None
    if destination.endpoint is None:
        spans_dir = layout.spans
        return FileSender(spans_dir, max_file_bytes=config.file_max_bytes, max_files=config.file_max_files), spans_dir, None
    try:
        sender = destination.make_sender()
    except (ValueError, OSError) as exc:
        raise ExportConfigError(f"export.endpoint: {exc}") from exc
    return sender, None, Spool(layout.spool, max_bytes=config.spool_max_bytes)


def _meter_provider(
    config: ExportConfig,
    metrics_dest: Destination | None,
    resource: Resource,
    layout: DataDir,
    spool_dir: Path | None,
    file_metrics: bool,
) -> tuple[MeterProvider | None, MetricExporter | None]:
    """``(meter_provider, metric_exporter)``; ``(None, None)`` when metrics are off or would
    only go to files that are not wanted."""
    if metrics_dest is None or not (file_metrics or metrics_dest.endpoint is not None):
        return None, None
    from exporters.otlp.metrics import build_meter_provider

    metrics_sender = None
    if metrics_dest.endpoint is not None:
        try:
            metrics_sender = metrics_dest.make_sender()
        except (ValueError, OSError) as exc:
            raise ExportConfigError(f"metrics endpoint: {exc}") from exc
    return build_meter_provider(
        resource,
        sender=metrics_sender,
        timeout_s=metrics_dest.timeout_s,
        interval_s=config.metrics_interval_s,
        file_directory=layout.metrics,
        # inside the span spool's own folder (its pid-<pid>/ when another agent holds the root)
        spool_dir=layout.metrics_spool if spool_dir is None else spool_dir / METRICS_SPOOL_DIR,
    )


def build_telemetry(
    config: ExportConfig,
    *,
    data_dir: Path,
    service_instance_id: str | None = None,
    host_name: str | None = None,
    environ: Mapping[str, str] | None = None,
    file_metrics: bool = True,
    destination: Destination | None = None,
) -> Telemetry:
    """Build the pipeline: resource, lossless processor (+ spool), TracerProvider, metrics.

    Args:
        config: user config.
        data_dir: servewatch's data dir; files go under ``<data_dir>/<host>/{spans,spool,metrics}/``.
        service_instance_id: ``service.instance.id`` (default: a random UUID per run).
        host_name: ``host.name`` (default: ``socket.gethostname()``).
        environ: env to read instead of ``os.environ`` (tests).
        file_metrics: with no OTLP endpoint for metrics, still write servewatch's own metrics
            to ``<data_dir>/<host>/metrics/`` (default True). One-shot commands pass False: then
            no ``MeterProvider`` is built and the metrics SDK is not even imported unless a
            collector will receive the metrics (``telemetry.meter_provider`` is ``None``).
        destination: where the spans go, already resolved (the agent's
            ``settings.export_destination``: resolved once at load); ``None``: resolved here
            from ``config`` and ``environ``.

    Raises:
        ExportConfigError: a bad setting (the message names it).
        OSError: the data dir cannot be created.
    """
    from opentelemetry.sdk.trace import TracerProvider

    from exporters.otlp.metrics import Metrics
    from exporters.otlp.processor import LosslessSpanProcessor
    from exporters.otlp.spans import ProcessorSink
    host = host_name or socket.gethostname()
    disabled = sdk_disabled(os.environ if environ is None else environ)
    destination = destination if destination is not None else resolve_destination(config, environ)
    resource = build_resource(config, host_name=host, service_instance_id=service_instance_id or str(uuid.uuid4()), environ=environ)
    layout = DataDir(Path(data_dir), host)
    sender, spans_dir, spool = _span_sender(config, destination, layout, disabled)
    spool_dir = spool.directory if spool is not None else None
    batching = resolve_batching(config, environ)
    timeout_explicit = config.timeout_s is not None or _env(os.environ if environ is None else environ, "traces", "TIMEOUT")
    processor = LosslessSpanProcessor(
        sender,
        spool=spool,
        replay_command=destination.replay_command,
        max_queue_spans=int(batching["queue_spans"]),
        max_batch_spans=int(batching["batch_spans"]),
        max_batch_bytes=config.batch_bytes,
        schedule_delay_s=float(batching["schedule_delay_s"]),
        export_timeout_s=destination.timeout_s if timeout_explicit else float(batching.get("export_timeout_s", destination.timeout_s)),
        retry_initial_backoff_s=config.retry_initial_backoff_s,
        retry_max_backoff_s=config.retry_max_backoff_s,
        shutdown_timeout_s=config.shutdown_timeout_s,
    )
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    tracer_provider.add_span_processor(processor)
    metrics_dest = resolve_destination(config, environ, signal="metrics") if config.metrics and not disabled else None
    meter_provider, metric_exporter = _meter_provider(config, metrics_dest, resource, layout, spool_dir, file_metrics)
    metrics = Metrics(meter_provider)
    metrics.watch_export(processor.statistics)
    if metric_exporter is not None and hasattr(metric_exporter, "statistics"):
        metrics.watch_metric_export(metric_exporter.statistics)
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
        metric_exporter=metric_exporter,
    )
