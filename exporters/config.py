"""The settings models of the OTel side every agent has (tables of the agent's own settings,
:class:`agent.runtime.settings.AgentSettings`): light, so that the settings load without importing
the export pipeline.

Owns :class:`ExportConfig` (``[export]``, the telemetry pipeline's, :mod:`exporters.otlp.provider`,
with the endpoint rule :func:`scheme_problem`) and :class:`SpansConfig` (``[spans]``, the SDK span
shipper's, :mod:`exporters.otlp.shipper`). Imports pydantic only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["ExportConfig", "Protocol", "SpansConfig", "scheme_problem"]

#: OTLP transport protocols.
Protocol = Literal["grpc", "http/protobuf"]


def scheme_problem(endpoint: str) -> str | None:
    """The one rule for an OTLP endpoint given to servewatch itself (``--otlp-endpoint``,
    ``export --to``, ``export.endpoint`` / ``SERVEWATCH_EXPORT__ENDPOINT``): it says its scheme,
    ``http://`` (plaintext) or ``https://`` (TLS). The standard ``OTEL_EXPORTER_OTLP_*ENDPOINT``
    variables keep the OTLP spec's bare gRPC ``host:port`` (plaintext unless
    ``OTEL_EXPORTER_OTLP_INSECURE=false`` or TLS files are set), for every command alike.

    Returns:
        ``None`` when it has a scheme, else the one-line problem (with both fixes spelled out).
    """
    if "://" in endpoint:
        return None
    return f"the endpoint needs a scheme, e.g. http://{endpoint} (plaintext) or https://{endpoint} (TLS)"


class ExportConfig(BaseModel):
    """User config of the telemetry export. Unset (``None``) fields fall back to the ``OTEL_*``
    env, then to the defaults documented here.

    Attributes:
        endpoint: OTLP endpoint (``http://host:4317`` for gRPC, ``http://host:4318`` for HTTP); ``None``:
            ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``; neither: write
            OTLP/JSON lines files under the data dir (the embedded default).
        protocol: ``grpc`` or ``http/protobuf``; ``None``: ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``, else grpc.
        headers: extra request headers / gRPC metadata, merged over ``OTEL_EXPORTER_OTLP_HEADERS``.
        insecure: plaintext gRPC for an endpoint without scheme; ``None``: env, else plaintext (TLS when a
            certificate is configured).
        certificate: PEM file of the CA(s) trusted for the collector; ``None``: ``OTEL_EXPORTER_OTLP_[SIGNAL_]CERTIFICATE``.
        client_certificate: PEM client certificate for mTLS; ``None``: ``OTEL_EXPORTER_OTLP_[SIGNAL_]CLIENT_CERTIFICATE``.
        client_key: PEM client key for mTLS; ``None``: ``OTEL_EXPORTER_OTLP_[SIGNAL_]CLIENT_KEY``.
        compression: ``gzip`` or ``none``; ``None``: env, else none.
        timeout_s: bound on one export call, seconds; ``None``: ``OTEL_EXPORTER_OTLP_[SIGNAL_]TIMEOUT``
            (milliseconds there), else 3 s.
        service_name: service.name; ``None``: ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``, else servewatch.
        resource_attributes: extra resource attributes, over ``OTEL_RESOURCE_ATTRIBUTES``.
        queue_spans: in-memory span queue, spans (a burst bigger than this is dropped and counted).
        batch_spans: spans per export request.
        batch_bytes: bytes per export request (encoded); under the collector's 4 MiB gRPC receive limit. A
            request refused as too large anyway is split and retried.
        schedule_delay_s: longest a span waits before a partial batch is sent, seconds (OTel's default is 5; every
            request costs the agent a fixed amount of CPU, so fewer, fuller ones: bench/bench_soak.py).
        shutdown_timeout_s: shutdown deadline; what is not delivered by then is spooled, seconds.
        spool_max_bytes: spool cap, bytes (oldest batches evicted and counted past it).
        retry_initial_backoff_s: first replay backoff after a failed export, seconds (doubles up to the max).
        retry_max_backoff_s: longest replay backoff, seconds.
        file_max_bytes: embedded default: rotate span files at this size, bytes.
        file_max_files: embedded default: keep at most this many span files per run (0: all).
        metrics: export servewatch's own metrics.
        metrics_interval_s: metrics export interval, seconds.
    """

    model_config = ConfigDict(extra="forbid")

    @field_validator("endpoint")
    @classmethod
    def _endpoint_has_a_scheme(cls, value: str | None) -> str | None:
        if value and (problem := scheme_problem(value.strip())):
            raise ValueError(problem)
        return value

    endpoint: str | None = None
    protocol: Protocol | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    insecure: bool | None = None
    certificate: str | None = None
    client_certificate: str | None = None
    client_key: str | None = None
    compression: Literal["gzip", "none"] | None = None
    timeout_s: float | None = Field(default=None, gt=0)
    service_name: str | None = None
    resource_attributes: dict[str, str] = Field(default_factory=dict)
    queue_spans: int = Field(default=65536, ge=1)
    batch_spans: int = Field(default=512, ge=1)
    batch_bytes: int = Field(default=3 * 1024 * 1024, ge=64 * 1024)
    schedule_delay_s: float = Field(default=2.0, gt=0)
    shutdown_timeout_s: float = Field(default=3.0, ge=0)
    spool_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    retry_initial_backoff_s: float = Field(default=0.25, gt=0)
    retry_max_backoff_s: float = Field(default=5.0, gt=0)
    file_max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    file_max_files: int = Field(default=32, ge=0)
    metrics: bool = True
    metrics_interval_s: float = Field(default=10.0, gt=0)


class SpansConfig(BaseModel):
    """Request and forward spans recorded by servers running the SDK, shipped by the agent
    (:mod:`exporters.otlp.shipper`; the SDK side is :mod:`agent.sdk.channel`)."""

    ship: bool = Field(True, description="drain the targets' span rings and export their spans (else servers export themselves)")
    poll_interval_s: float = Field(0.5, gt=0, le=1.0, description="seconds between ring polls (the SDK falls back after 2 s without one)")
    directory: Path | None = Field(None, description="folder of span rings (default: the SDK's shm folder)")
    max_ring_bytes: int = Field(
        64 * 1024 * 1024, ge=4096, le=64 * 1024 * 1024,
        description="largest span ring the agent attaches, bytes (a bigger one is refused, said in the spans status)",
    )
