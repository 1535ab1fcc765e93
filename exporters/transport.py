"""Sending encoded OTLP trace requests: gRPC, HTTP/protobuf, or an OTLP/JSON lines file.

Owns the wire side of export: :class:`RequestSender` (send one ``ExportTraceServiceRequest``,
return a :class:`SendResult`, never raise), its three implementations and the sorting of every
transport failure into :class:`Delivery` (``OK`` / ``RETRYABLE`` / ``PERMANENT``), done here and
nowhere else. The lossless processor, the spool replay and ``servewatch export`` all send through
these, so a spooled batch goes out byte-for-byte as it was first encoded (same ids, same times).

Why not the SDK's OTLP exporters: they take ``ReadableSpan`` objects (a spooled batch is already a
protobuf request), retry internally up to their own timeout, and cannot be cut short at shutdown.
Here one call is one attempt; retries, backoff and deadlines belong to the caller.

Imports grpcio, httpx, opentelemetry-proto and :mod:`exporters.otlp_json`.
"""

from __future__ import annotations

import gzip
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import grpc
import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

from agent.events import StrEnum
from exporters.otlp_json import RotatingJsonLinesWriter, request_to_json

__all__ = [
    "Delivery",
    "SendResult",
    "RequestSender",
    "GrpcSender",
    "HttpSender",
    "FileSender",
    "make_sender",
    "http_traces_url",
    "span_count",
    "PROTOCOLS",
]

_log = logging.getLogger(__name__)

#: Protocol names, per ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/json`` is not supported for export).
PROTOCOLS = ("grpc", "http/protobuf")

# gRPC status codes the OTLP spec calls retryable ("Failures" table of the OTLP specification).
_GRPC_RETRYABLE = frozenset(
    {
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
# HTTP status codes the OTLP/HTTP spec calls retryable.
_HTTP_RETRYABLE = frozenset({429, 502, 503, 504})

# Reconnect quickly once a collector comes back (grpc's default backoff grows to 120 s).
_GRPC_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # a private subchannel: one sender's reconnect backoff never delays another's
    ("grpc.use_local_subchannel_pool", 1),
)


class Delivery(StrEnum):
    """How one send attempt ended."""

    OK = "ok"
    #: worth retrying later (collector down, overloaded, timed out)
    RETRYABLE = "retryable"
    #: the collector refused the data; sending it again cannot help
    PERMANENT = "permanent"


@dataclass(frozen=True, slots=True)
class SendResult:
    """One send attempt.

    Attributes:
        delivery: how it ended.
        detail: one line (status code, error class) when not OK.
        rejected_spans: spans the collector accepted the request but dropped (OTLP partial success).
    """

    delivery: Delivery
    detail: str = ""
    rejected_spans: int = 0

    @property
    def ok(self) -> bool:
        return self.delivery is Delivery.OK


class RequestSender(Protocol):
    """Sends one encoded request; thread-safe for one caller at a time plus :meth:`abort`."""

    #: where it sends, for logs and summaries
    target: str

    def send(self, request: ExportTraceServiceRequest, *, timeout_s: float) -> SendResult:
        """One attempt, bounded by ``timeout_s`` seconds. Never raises."""
        ...

    def abort(self) -> None:
        """Cut short a send in progress on another thread (best effort)."""
        ...

    def close(self) -> None: ...


def span_count(request: ExportTraceServiceRequest) -> int:
    """Number of spans in a request."""
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def _grpc_target(endpoint: str, insecure: bool | None) -> tuple[str, bool]:
    """(host:port, secure) from an OTLP gRPC endpoint ``[http|https://]host:port``.

    ``https`` is secure, ``http`` is not; with no scheme, ``insecure`` decides (default: insecure,
    the usual in-cluster collector).
    """
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        host = parts.hostname or "localhost"
        port = parts.port or 4317
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{port}", parts.scheme == "https"
    return endpoint.rstrip("/"), insecure is False


class GrpcSender:
    """OTLP/gRPC ``TraceService/Export`` with one attempt per call.

    Args:
        endpoint: ``http://host:4317``, ``https://host:4317`` or ``host:4317``.
        headers: request metadata (keys lower-cased, as gRPC requires).
        insecure: for an endpoint without scheme, ``False`` forces TLS.
        compression: ``"gzip"`` or ``None``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        headers: dict[str, str] | None = None,
        insecure: bool | None = None,
        compression: str | None = None,
    ) -> None:
        self.target, secure = _grpc_target(endpoint, insecure)
        comp = grpc.Compression.Gzip if compression == "gzip" else grpc.Compression.NoCompression
        if secure:
            self._channel = grpc.secure_channel(
                self.target, grpc.ssl_channel_credentials(), options=_GRPC_CHANNEL_OPTIONS, compression=comp
            )
        else:
            self._channel = grpc.insecure_channel(self.target, options=_GRPC_CHANNEL_OPTIONS, compression=comp)
        self._stub = TraceServiceStub(self._channel)
        self._metadata = tuple((k.lower(), v) for k, v in (headers or {}).items())
        self._lock = threading.Lock()
        self._inflight: grpc.Future | None = None

    def send(self, request: ExportTraceServiceRequest, *, timeout_s: float) -> SendResult:
        try:
            future = self._stub.Export.future(request, timeout=max(0.001, timeout_s), metadata=self._metadata or None)
            with self._lock:
                self._inflight = future
            response: ExportTraceServiceResponse = future.result()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            delivery = Delivery.RETRYABLE if code in _GRPC_RETRYABLE else Delivery.PERMANENT
            return SendResult(delivery, f"grpc {code.name if code else 'UNKNOWN'}")
        except grpc.FutureCancelledError:
            return SendResult(Delivery.RETRYABLE, "grpc call aborted")
        except Exception as exc:  # boundary: a transport bug must not kill the export worker
            _log.exception("gRPC export to %s failed", self.target)
            return SendResult(Delivery.RETRYABLE, f"grpc {type(exc).__name__}")
        finally:
            with self._lock:
                self._inflight = None
        rejected = response.partial_success.rejected_spans if response.HasField("partial_success") else 0
        return SendResult(Delivery.OK, response.partial_success.error_message if rejected else "", rejected)

    def abort(self) -> None:
        with self._lock:
            future = self._inflight
        if future is not None:
            future.cancel()

    def close(self) -> None:
        self._channel.close()


def http_traces_url(endpoint: str, *, signal_specific: bool = False) -> str:
    """The OTLP/HTTP traces URL.

    Per the OTLP exporter spec, ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL to which
    ``/v1/traces`` is appended, while ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is used as-is.
    """
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    if signal_specific:
        return endpoint
    return endpoint.rstrip("/") + "/v1/traces"


class HttpSender:
    """OTLP/HTTP protobuf POST with one attempt per call.

    Proxy environment variables are not used: the collector is expected on the local network
    (sidecar, node agent), and a proxy answering for it would hide an outage.

    Args:
        url: full traces URL (see :func:`http_traces_url`).
        headers: extra request headers.
        compression: ``"gzip"`` or ``None``.
    """

    def __init__(self, url: str, *, headers: dict[str, str] | None = None, compression: str | None = None) -> None:
        self.target = url
        self._gzip = compression == "gzip"
        base = {"Content-Type": "application/x-protobuf", "User-Agent": "servewatch"}
        if self._gzip:
            base["Content-Encoding"] = "gzip"
        base.update(headers or {})
        self._client = httpx.Client(headers=base, trust_env=False)
        self._closed = False

    def send(self, request: ExportTraceServiceRequest, *, timeout_s: float) -> SendResult:
        body = request.SerializeToString()
        if self._gzip:
            body = gzip.compress(body)
        try:
            response = self._client.post(self.target, content=body, timeout=max(0.001, timeout_s))
        except httpx.TimeoutException:
            return SendResult(Delivery.RETRYABLE, "http timeout")
        except httpx.TransportError as exc:
            return SendResult(Delivery.RETRYABLE, f"http {type(exc).__name__}")
        except RuntimeError as exc:  # client closed by abort() on another thread
            return SendResult(Delivery.RETRYABLE, f"http aborted: {exc}")
        if response.status_code // 100 == 2:
            rejected = 0
            detail = ""
            if response.content and "protobuf" in response.headers.get("content-type", ""):
                parsed = ExportTraceServiceResponse()
                try:
                    parsed.ParseFromString(response.content)
                    rejected = parsed.partial_success.rejected_spans
                    detail = parsed.partial_success.error_message
                except Exception:  # boundary: a garbled body from a 2xx is still a delivery
                    _log.debug("unparseable OTLP/HTTP response body from %s", self.target)
            return SendResult(Delivery.OK, detail, rejected)
        delivery = Delivery.RETRYABLE if response.status_code in _HTTP_RETRYABLE else Delivery.PERMANENT
        return SendResult(delivery, f"http {response.status_code}")

    def abort(self) -> None:
        # httpx cannot cancel a request from another thread; the per-call timeout bounds it.
        return None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()


class FileSender:
    """The embedded default: append each request as one OTLP/JSON line to rotating files.

    Args:
        directory: where ``spans-*.jsonl`` files go.
        max_file_bytes: rotate to a new file past this size.
        max_files: keep at most this many files; the oldest are deleted and counted.
    """

    def __init__(self, directory: Path, *, max_file_bytes: int, max_files: int, prefix: str = "spans") -> None:
        self.writer = RotatingJsonLinesWriter(directory, prefix=prefix, max_file_bytes=max_file_bytes, max_files=max_files)
        self.target = str(directory)

    def send(self, request: ExportTraceServiceRequest, *, timeout_s: float) -> SendResult:
        try:
            self.writer.write_line(request_to_json(request), span_count(request))
        except OSError as exc:
            return SendResult(Delivery.RETRYABLE, f"file {exc.strerror or type(exc).__name__}")
        return SendResult(Delivery.OK)

    def abort(self) -> None:
        return None

    def close(self) -> None:
        self.writer.close()


def make_sender(
    endpoint: str,
    protocol: str,
    *,
    headers: dict[str, str] | None = None,
    insecure: bool | None = None,
    compression: str | None = None,
    signal_specific: bool = False,
) -> GrpcSender | HttpSender:
    """A network sender for ``protocol`` (``grpc`` or ``http/protobuf``).

    Raises:
        ValueError: unknown protocol.
    """
    if protocol == "grpc":
        return GrpcSender(endpoint, headers=headers, insecure=insecure, compression=compression)
    if protocol == "http/protobuf":
        return HttpSender(http_traces_url(endpoint, signal_specific=signal_specific), headers=headers, compression=compression)
    raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")
