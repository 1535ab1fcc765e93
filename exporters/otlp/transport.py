"""Sending encoded OTLP requests (traces or metrics): gRPC, HTTP/protobuf, or an OTLP/JSON lines file.

Owns the wire side of export: :class:`RequestSender` (send one ``ExportTraceServiceRequest`` or
``ExportMetricsServiceRequest``, return a :class:`SendResult`, never raise), its three
implementations, :class:`TlsFiles` (private CA, mTLS client pair) and the sorting of every
transport failure into :class:`Delivery` (``OK`` / ``RETRYABLE`` / ``TOO_LARGE`` / ``PERMANENT``)
and a :class:`Cause` (refused, protocol mismatch, TLS, auth...), done here and nowhere else. The lossless processor, the spool replay and ``servewatch export`` all send through
these, so a spooled batch goes out byte-for-byte as it was first encoded (same ids, same times).

Why not the SDK's OTLP exporters: they take ``ReadableSpan`` objects (a spooled batch is already a
protobuf request), retry internally up to their own timeout, and cannot be cut short at shutdown.
Here one call is one attempt; retries, backoff and deadlines belong to the caller.

Imports grpcio, httpx, opentelemetry-proto and :mod:`exporters.otlp.otlp_json`.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeGuard, TypeVar, Union, cast
from urllib.parse import urlsplit

# grpc-core logs handshake and connect failures straight to stderr; servewatch sorts every failure
# itself (Cause) and reports it once, so its lines are off unless the user asks for them.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from agent.model.kinds import StrEnum
from agent.model.lazy import LazyModule
from exporters.otlp.otlp_json import RotatingJsonLinesWriter, request_to_json

if TYPE_CHECKING:  # the metrics messages load with the first metrics request or response
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
        ExportMetricsServiceResponse,
    )

__all__ = [
    "METRICS_NOT_TAKEN_HINT",
    "PROTOCOLS",
    "Cause",
    "Delivery",
    "DisabledSender",
    "FileSender",
    "GrpcSender",
    "HttpSender",
    "RequestSender",
    "SendResult",
    "Signal",
    "TlsFiles",
    "http_traces_url",
    "item_count",
    "make_sender",
    "span_count",
]

#: Which OTLP signal a sender carries.
Signal = Literal["traces", "metrics"]
#: One encoded OTLP export request.
OtlpRequest = Union[ExportTraceServiceRequest, "ExportMetricsServiceRequest"]

#: Protobuf full name of a metrics export request (told apart without importing its module).
_METRICS_REQUEST = "opentelemetry.proto.collector.metrics.v1.ExportMetricsServiceRequest"
_METRICS_RESPONSE = "opentelemetry.proto.collector.metrics.v1.ExportMetricsServiceResponse"

_log = logging.getLogger(__name__)

# imported at first use (a gRPC or HTTP sender), so a CLI command writing span files or nothing
# starts fast; the generated *_pb2_grpc stubs import grpc too and are imported in GrpcSender
if TYPE_CHECKING:
    import grpc
    import httpx
else:
    grpc = LazyModule("grpc")
    httpx = LazyModule("httpx")

#: Protocol names, per ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/json`` is not supported for export).
PROTOCOLS = ("grpc", "http/protobuf")

# gRPC status codes the OTLP spec calls retryable ("Failures" table of the OTLP specification).
_GRPC_RETRYABLE_NAMES = frozenset(
    {
        "CANCELLED",
        "DEADLINE_EXCEEDED",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNAVAILABLE",
        "DATA_LOSS",
        "RESOURCE_EXHAUSTED",  # throttling; "larger than max" is TOO_LARGE instead
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
    #: the request is over the collector's size limit (gRPC RESOURCE_EXHAUSTED "larger than max",
    #: HTTP 413): split it and send the halves
    TOO_LARGE = "too_large"
    #: the collector refused the data; sending it again cannot help
    PERMANENT = "permanent"


class Cause(StrEnum):
    """Why a send failed, in an operator's terms (``servewatch export`` and warnings print it)."""

    NONE = "none"
    #: nothing listens there (connection refused, no route, DNS)
    REFUSED = "refused"
    #: the call ran out of time (collector hung, black-holed, or overloaded)
    TIMEOUT = "timeout"
    #: a gRPC client talking to an HTTP port or the reverse
    PROTOCOL_MISMATCH = "protocol_mismatch"
    #: TLS handshake failed: plaintext vs TLS, unknown CA, missing or refused client certificate
    TLS = "tls"
    #: the collector refused our credentials (gRPC UNAUTHENTICATED/PERMISSION_DENIED, HTTP 401/403)
    AUTH = "auth"
    #: nothing serves OTLP at that URL path (HTTP 404/405): a wrong or doubled ``/v1/traces``
    NOT_FOUND = "not_found"
    #: the collector could not take the request as sent (HTTP 400/415, gRPC INVALID_ARGUMENT)
    BAD_REQUEST = "bad_request"
    #: the collector (or a proxy before it) says it cannot serve now (gRPC UNAVAILABLE, HTTP
    #: 502/503/504) although the connection was made
    UNAVAILABLE = "unavailable"
    #: the collector asks us to slow down (HTTP 429, gRPC RESOURCE_EXHAUSTED)
    THROTTLED = "throttled"
    #: the request exceeded the collector's size limit
    TOO_LARGE = "too_large"
    #: the endpoint takes traces but not this signal (a traces-only receiver such as Jaeger or
    #: Tempo answering metrics with gRPC UNIMPLEMENTED or HTTP 404 at ``/v1/metrics``)
    SIGNAL_NOT_TAKEN = "signal_not_taken"
    #: the collector is up but refused or failed the request (other status codes)
    COLLECTOR = "collector"


#: One line per cause: what to check (a sender adds a more precise fix to a result when it knows one).
CAUSE_HINTS: dict[Cause, str] = {
    Cause.REFUSED: "connection refused: is the collector running and the endpoint/port right?",
    Cause.TIMEOUT: "no answer within the timeout: collector hung, overloaded or unreachable (firewall)",
    Cause.PROTOCOL_MISMATCH: "protocol mismatch: gRPC sent to an HTTP port or HTTP to a gRPC port "
    "(4317 is OTLP gRPC, 4318 OTLP HTTP; set --protocol / OTEL_EXPORTER_OTLP_PROTOCOL)",
    Cause.TLS: "TLS handshake failed or the peer hung up: check https:// vs http://, OTEL_EXPORTER_OTLP_CERTIFICATE (CA) "
    "and the client certificate/key for mTLS",
    Cause.AUTH: "the collector refused our credentials: check OTEL_EXPORTER_OTLP_HEADERS",
    Cause.NOT_FOUND: "no OTLP receiver at this URL path: OTLP/HTTP traces are served at /v1/traces",
    Cause.BAD_REQUEST: "the collector could not take the request: is this an OTLP endpoint of the protocol set "
    "(OTEL_EXPORTER_OTLP_PROTOCOL)?",
    Cause.UNAVAILABLE: "the collector answered but is unavailable (overloaded, restarting, or a proxy before it has no "
    "healthy collector); retrying",
    Cause.THROTTLED: "the collector asks us to slow down; retrying later",
    Cause.TOO_LARGE: "request larger than the collector accepts",
    Cause.SIGNAL_NOT_TAKEN: "",  # always said by the sender (:data:`METRICS_NOT_TAKEN_HINT`)
    Cause.COLLECTOR: "the collector refused the request",
}

#: The fix for metrics sent to an endpoint that takes only traces (Jaeger, Tempo): the trace
#: export works and must stay as it is.
METRICS_NOT_TAKEN_HINT = (
    "this endpoint takes traces but not metrics (a traces-only receiver such as Jaeger or Tempo); "
    "the span export is unaffected. Turn servewatch's metrics off with export.metrics = false "
    "(SERVEWATCH_EXPORT__METRICS=false), or send them to a metrics receiver with OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
)

#: Longest wait a collector's ``Retry-After`` / gRPC ``RetryInfo`` is honoured for, seconds (a
#: bigger value, or a date far ahead, is cut to this).
MAX_RETRY_AFTER_S = 600.0

@dataclass(frozen=True, slots=True)
class TlsFiles:
    """TLS material from ``OTEL_EXPORTER_OTLP_[SIGNAL_]CERTIFICATE`` / ``CLIENT_CERTIFICATE`` /
    ``CLIENT_KEY`` (PEM file paths). Empty: the system trust store, no client certificate."""

    #: PEM bundle of CAs trusted for the collector's certificate
    ca_file: str | None = None
    #: PEM client certificate chain (mTLS)
    client_cert_file: str | None = None
    #: PEM private key of the client certificate (mTLS)
    client_key_file: str | None = None

    @property
    def configured(self) -> bool:
        return bool(self.ca_file or self.client_cert_file or self.client_key_file)

    def _read(self, path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials (raises ``OSError`` when a file cannot be read)."""
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca_file),
            private_key=self._read(self.client_key_file),
            certificate_chain=self._read(self.client_cert_file),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """An ``ssl`` client context for HTTPS (raises ``OSError``/``ssl.SSLError`` on bad files)."""
        ctx = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else ssl.create_default_context()
        if self.client_cert_file:
            ctx.load_cert_chain(self.client_cert_file, self.client_key_file)
        return ctx


@dataclass(frozen=True, slots=True)
class SendResult:
    """One send attempt.

    Attributes:
        delivery: how it ended.
        detail: the status in a few words when not OK (``http 401 Unauthorized``, ``grpc
            UNAVAILABLE: ...``, ``http ConnectError: ...``).
        rejected_spans: items (spans or data points) the collector accepted the request for but
            dropped (OTLP partial success).
        cause: why it failed, in operator terms (:class:`Cause`).
        message: the collector's own words (an HTTP error body's ``google.rpc.Status`` message or
            text, a partial success's ``error_message``), one line, ``""`` when it gave none.
        hint: what to fix, when the sender knows better than :data:`CAUSE_HINTS` (a doubled
            ``/v1/traces``, no authorization header sent).
        retry_after_s: the wait the collector asked for (HTTP ``Retry-After``, gRPC
            ``RetryInfo``), seconds, at most :data:`MAX_RETRY_AFTER_S`; ``None`` when it asked none.
    """

    delivery: Delivery
    detail: str = ""
    rejected_spans: int = 0
    cause: Cause = Cause.NONE
    message: str = ""
    hint: str = ""
    retry_after_s: float | None = None

    def explain(self) -> str:
        """One line: what to fix, then the status and the collector's own words."""
        hint = self.hint or CAUSE_HINTS.get(self.cause, "")
        said = f"{self.detail}: {self.message}" if self.detail and self.message and self.message not in self.detail else (
            self.detail or self.message
        )
        if not hint:
            return said
        return f"{hint} ({said})" if said else hint

    @property
    def ok(self) -> bool:
        return self.delivery is Delivery.OK


_RequestT_contra = TypeVar("_RequestT_contra", contravariant=True)


class RequestSender(Protocol[_RequestT_contra]):
    """Sends one encoded request; thread-safe for one caller at a time plus :meth:`abort`.

    Generic in the request it takes: ``RequestSender[ExportTraceServiceRequest]`` for spans
    (:class:`FileSender` takes only those), ``RequestSender[ExportMetricsServiceRequest]`` for
    metrics; :class:`GrpcSender` and :class:`HttpSender` take either (:data:`OtlpRequest`).
    """

    #: where it sends, for logs and summaries
    target: str

    def send(self, request: _RequestT_contra, *, timeout_s: float) -> SendResult:
        """One attempt, bounded by ``timeout_s`` seconds. Never raises."""
        ...

    def abort(self) -> None:
        """Cut short a send in progress on another thread (best effort)."""
        ...

    def close(self) -> None: ...


def span_count(request: ExportTraceServiceRequest) -> int:
    """Number of spans in a request."""
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def _is_metrics(request: OtlpRequest) -> TypeGuard[ExportMetricsServiceRequest]:
    return bool(request.DESCRIPTOR.full_name == _METRICS_REQUEST)


def item_count(request: OtlpRequest) -> int:
    """Spans of a trace request, metrics of a metrics request."""
    if _is_metrics(request):
        return sum(len(sm.metrics) for rm in request.resource_metrics for sm in rm.scope_metrics)
    return span_count(cast(ExportTraceServiceRequest, request))


#: grpc-core's wording for the causes a status code alone does not tell apart, in the order tried
#: (every one retryable)
_GRPC_TEXT_CAUSES: tuple[tuple[tuple[str, ...], Cause], ...] = (
    (("ssl", "tls", "handshake", "certificate", "x509", "alpn"), Cause.TLS),
    # the peer accepted TCP and hung up at once: a TLS port spoken to in plaintext, or an mTLS
    # port refusing a client without certificate
    (("socket closed",), Cause.TLS),
    (("http2", "http/1", "http1", "preface", "frame", "bad gateway", "content-type",
      "unexpected http status", "received http2 header with status"), Cause.PROTOCOL_MISMATCH),
    (("connection refused", "failed to connect", "connect failed", "dns", "no route",
      "name resolution", "network is unreachable", "domain name not found"), Cause.REFUSED),
)


def _grpc_cause(code: grpc.StatusCode | None, details: str) -> tuple[Delivery, Cause]:
    """Sort a gRPC status into (delivery, cause). grpc-core's own wording is matched for the
    cases a status code alone does not tell apart (refused vs TLS vs HTTP port): an
    ``UNAVAILABLE`` is "connection refused" only when grpc-core says it could not connect."""
    text = details.lower()
    first = _grpc_definite_cause(code, text)
    if first is not None:
        return first
    for markers, cause in _GRPC_TEXT_CAUSES:
        if any(m in text for m in markers):
            return Delivery.RETRYABLE, cause
    return _grpc_code_cause(code)


def _grpc_definite_cause(code: grpc.StatusCode | None, text: str) -> tuple[Delivery, Cause] | None:
    """The causes that win over grpc-core's wording (``None``: none of them)."""
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and ("larger than" in text or "too large" in text or "message size" in text):
        return Delivery.TOO_LARGE, Cause.TOO_LARGE
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return Delivery.PERMANENT, Cause.AUTH
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return Delivery.PERMANENT, Cause.BAD_REQUEST
    if code is grpc.StatusCode.DEADLINE_EXCEEDED or "timed out" in text or "timeout" in text:
        return Delivery.RETRYABLE, Cause.TIMEOUT
    return None


def _grpc_code_cause(code: grpc.StatusCode | None) -> tuple[Delivery, Cause]:
    """The cause a status code alone says (grpc-core's wording said nothing)."""
    if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        # an HTTP server answering a gRPC call shows up as one of these
        return Delivery.PERMANENT if code is grpc.StatusCode.UNIMPLEMENTED else Delivery.RETRYABLE, Cause.PROTOCOL_MISMATCH
    if code is grpc.StatusCode.UNAVAILABLE:
        return Delivery.RETRYABLE, Cause.UNAVAILABLE
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Delivery.RETRYABLE, Cause.THROTTLED
    if code is not None and code.name in _GRPC_RETRYABLE_NAMES:
        return Delivery.RETRYABLE, Cause.COLLECTOR
    return Delivery.PERMANENT, Cause.COLLECTOR


#: gRPC trailing-metadata key of the rich status (a binary ``google.rpc.Status``).
_GRPC_STATUS_DETAILS = "grpc-status-details-bin"
#: ``Any`` type URL of ``google.rpc.RetryInfo`` (the OTLP spec's throttling signal for gRPC).
_RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"


def _grpc_retry_info(exc: grpc.RpcError) -> float | None:
    """The delay of a ``google.rpc.RetryInfo`` in the call's rich status, seconds (``None``
    when the server sent none or it does not parse)."""
    trailing = getattr(exc, "trailing_metadata", None)
    try:
        metadata = trailing() if callable(trailing) else None
    except Exception:  # noqa: BLE001 - a call object without metadata
        return None
    raw = next((v for k, v in (metadata or ()) if k == _GRPC_STATUS_DETAILS), None)
    if not isinstance(raw, bytes):
        return None
    from google.rpc import error_details_pb2, status_pb2

    try:
        status = status_pb2.Status.FromString(raw)
        for detail in status.details:
            if detail.type_url == _RETRY_INFO_TYPE:
                info = error_details_pb2.RetryInfo.FromString(detail.value)
                delay_s = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
                return min(MAX_RETRY_AFTER_S, max(0.0, delay_s))
    except Exception:  # noqa: BLE001 - a malformed rich status is no retry hint, not an error
        return None
    return None


def _retry_after(value: str | None) -> float | None:
    """HTTP ``Retry-After``: delta-seconds or an HTTP-date (RFC 9110 10.2.3), as seconds from
    now, at most :data:`MAX_RETRY_AFTER_S`; ``None`` when absent or malformed."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(MAX_RETRY_AFTER_S, float(value))
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return min(MAX_RETRY_AFTER_S, max(0.0, when.timestamp() - time.time()))


def _has_auth(headers: dict[str, str] | tuple[tuple[str, str], ...]) -> bool:
    keys = headers.keys() if isinstance(headers, dict) else (k for k, _ in headers)
    return any(k.lower() in ("authorization", "x-api-key", "api-key") or "token" in k.lower() for k in keys)


def _auth_hint(*, sent_auth: bool) -> str:
    """What to fix for a credentials refusal (401/403, UNAUTHENTICATED/PERMISSION_DENIED)."""
    if not sent_auth:
        return (
            "the collector refused our credentials: no authorization header is sent; set "
            "OTEL_EXPORTER_OTLP_HEADERS='authorization=Bearer <token>' (or the header its auth extension expects)"
        )
    return (
        "the collector refused our credentials: the authorization header from OTEL_EXPORTER_OTLP_HEADERS "
        "was not accepted; check the token and that it is for this collector"
    )


def _one_line(text: str, limit: int = 200) -> str:
    """The first line of a collector's message, bounded, without control characters."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return "".join(ch for ch in first if ch.isprintable())[:limit]


def _http_error_cause(exc: BaseException) -> Cause:
    text = f"{type(exc).__name__} {exc}".lower()
    if isinstance(exc, httpx.TimeoutException):
        return Cause.TIMEOUT
    if "ssl" in text or "certificate" in text or "tls" in text or "handshake" in text:
        return Cause.TLS
    if "disconnected without sending" in text:
        return Cause.TLS  # plaintext HTTP to a TLS port: the server hangs up on the bytes it cannot parse
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.LocalProtocolError)):
        return Cause.PROTOCOL_MISMATCH
    if isinstance(exc, httpx.ConnectError):
        return Cause.REFUSED
    return Cause.REFUSED


def _grpc_target(endpoint: str, insecure: bool | None, tls: TlsFiles | None = None) -> tuple[str, bool]:
    """(host:port, secure) from an OTLP gRPC endpoint ``[http|https://]host:port``.

    Per the OTLP exporter spec: ``https`` is secure, ``http`` is not; with no scheme,
    ``OTEL_EXPORTER_OTLP_INSECURE`` decides (``insecure``), and TLS files given (a private CA or
    a client pair) mean TLS; else plaintext, the usual in-cluster collector.
    """
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        host = parts.hostname or "localhost"
        port = parts.port or 4317
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{port}", parts.scheme == "https"
    if insecure is None:
        return endpoint.rstrip("/"), bool(tls is not None and tls.configured)
    return endpoint.rstrip("/"), insecure is False


class GrpcSender:
    """OTLP/gRPC ``TraceService/Export`` (or ``MetricsService/Export``) with one attempt per call.

    Args:
        endpoint: ``http://host:4317``, ``https://host:4317`` or ``host:4317``.
        headers: request metadata (keys lower-cased, as gRPC requires).
        insecure: for an endpoint without scheme, ``False`` forces TLS.
        compression: ``"gzip"`` or ``None``.
        tls: private CA / client certificate for a TLS endpoint.
        signal: ``traces`` or ``metrics``.

    Raises:
        OSError: a TLS file cannot be read.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        headers: dict[str, str] | None = None,
        insecure: bool | None = None,
        compression: str | None = None,
        tls: TlsFiles | None = None,
        signal: Signal = "traces",
    ) -> None:
        self.target, secure = _grpc_target(endpoint, insecure, tls)
        self.signal = signal
        comp = grpc.Compression.Gzip if compression == "gzip" else grpc.Compression.NoCompression
        if secure:
            creds = (tls or TlsFiles()).grpc_credentials()
            self._channel = grpc.secure_channel(self.target, creds, options=_GRPC_CHANNEL_OPTIONS, compression=comp)
        else:
            self._channel = grpc.insecure_channel(self.target, options=_GRPC_CHANNEL_OPTIONS, compression=comp)
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2_grpc import (
            MetricsServiceStub,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

        stub = MetricsServiceStub(self._channel) if signal == "metrics" else TraceServiceStub(self._channel)
        self._export = stub.Export
        self._metadata = tuple((k.lower(), v) for k, v in (headers or {}).items())
        self._lock = threading.Lock()
        self._aborted = False

    def send(self, request: OtlpRequest, *, timeout_s: float) -> SendResult:
        # A blocking call runs on the calling (export) thread; ``.future()`` would start grpc's
        # channel-spin thread for every call (about 2.5x the CPU per export, measured).
        try:
            response = self._export(request, timeout=max(0.001, timeout_s), metadata=self._metadata or None)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = (exc.details() if hasattr(exc, "details") else "") or ""
            if self._aborted:
                return SendResult(Delivery.RETRYABLE, "grpc call aborted", cause=Cause.TIMEOUT)
            delivery, cause = _grpc_cause(code, details)
            name = code.name if code else "UNKNOWN"
            hint = ""
            if self.signal == "metrics" and code is grpc.StatusCode.UNIMPLEMENTED and cause is Cause.PROTOCOL_MISMATCH:
                # a gRPC server that answered (the HTTP-port cases were told apart above) but
                # serves no MetricsService: "unknown service ...MetricsService"
                cause, hint = Cause.SIGNAL_NOT_TAKEN, METRICS_NOT_TAKEN_HINT
            if cause is Cause.AUTH:
                hint = _auth_hint(sent_auth=_has_auth(self._metadata))
            return SendResult(
                delivery, f"grpc {name}", cause=cause, message=_one_line(details), hint=hint,
                retry_after_s=_grpc_retry_info(exc) if delivery is Delivery.RETRYABLE else None,
            )
        except Exception as exc:  # noqa: BLE001 - a transport bug must not kill the export worker
            if self._aborted:  # the channel was closed under the call (ValueError from grpc)
                return SendResult(Delivery.RETRYABLE, "grpc call aborted", cause=Cause.TIMEOUT)
            _log.exception("gRPC export to %s failed", self.target)
            return SendResult(Delivery.RETRYABLE, f"grpc {type(exc).__name__}", cause=Cause.COLLECTOR)
        return _partial_success(response)

    def abort(self) -> None:
        """End the call in flight now (shutdown past its deadline): the channel is closed, which
        terminates its active calls; the sender is unusable afterwards."""
        with self._lock:
            self._aborted = True
        self._channel.close()

    def close(self) -> None:
        self._channel.close()


def _partial_success(response: ExportTraceServiceResponse | ExportMetricsServiceResponse) -> SendResult:
    if not response.HasField("partial_success"):
        return SendResult(Delivery.OK)
    if response.DESCRIPTOR.full_name == _METRICS_RESPONSE:
        metrics_ps = cast("ExportMetricsServiceResponse", response).partial_success
        rejected, message = metrics_ps.rejected_data_points, metrics_ps.error_message
    else:
        traces_ps = cast(ExportTraceServiceResponse, response).partial_success
        rejected, message = traces_ps.rejected_spans, traces_ps.error_message
    return SendResult(Delivery.OK, rejected_spans=rejected, message=_one_line(message) if rejected else "")


def _error_message(body: bytes, content_type: str) -> str:
    """The collector's own words in an OTLP/HTTP error body: a protobuf ``google.rpc.Status``
    (the OTLP/HTTP spec), its JSON form, or plain text; one bounded line (``""`` when none)."""
    if not body:
        return ""
    if "protobuf" in content_type:
        from google.rpc import status_pb2

        try:
            return _one_line(status_pb2.Status.FromString(body).message)
        except Exception:  # noqa: BLE001 - not a Status after all: read it as text below
            _log.debug("OTLP/HTTP error body is not a google.rpc.Status")
    if "json" in content_type:
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("message"), str):
            return _one_line(data["message"])
    return _one_line(body[:4096].decode("utf-8", "replace"))


def _path_hint(url: str, signal: Signal) -> str:
    """What to fix for a 404/405 from ``url``: a doubled ``/v1/<signal>`` (a base endpoint given
    with the path already), another path, or the right path on something that is not OTLP/HTTP."""
    path = urlsplit(url).path
    suffix = f"/v1/{signal}"
    env = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    if path.endswith(suffix + suffix):
        base = url[: len(url) - 2 * len(suffix)]
        return (
            f"wrong URL path: {suffix} is doubled in {url}: OTEL_EXPORTER_OTLP_ENDPOINT (and --otlp-endpoint) is the "
            f"base URL, servewatch appends {suffix}; set it to {base}, or give the full URL in {env}"
        )
    if not path.endswith(suffix):
        return (
            f"wrong URL path: {url} is not an OTLP/HTTP {signal} path ({suffix}); give the base URL (e.g. "
            f"http://collector:4318) in OTEL_EXPORTER_OTLP_ENDPOINT, or the full URL ending in {suffix} in {env}"
        )
    return f"nothing serves OTLP/HTTP at {url}: is this the collector's OTLP HTTP port (4318), with the otlp receiver's http protocol on?"


def http_traces_url(endpoint: str, *, signal_specific: bool = False, signal: Signal = "traces") -> str:
    """The OTLP/HTTP URL of a signal.

    Per the OTLP exporter spec, ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL to which
    ``/v1/traces`` (``/v1/metrics``) is appended, while ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    (``..._METRICS_ENDPOINT``) is used as-is.
    """
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    if signal_specific:
        return endpoint
    return endpoint.rstrip("/") + f"/v1/{signal}"


class HttpSender:
    """OTLP/HTTP protobuf POST with one attempt per call.

    Proxy environment variables are not used: the collector is expected on the local network
    (sidecar, node agent), and a proxy answering for it would hide an outage.

    Args:
        url: full signal URL (see :func:`http_traces_url`).
        headers: extra request headers.
        compression: ``"gzip"`` or ``None``.
        tls: private CA / client certificate for an ``https`` URL.
        signal: ``traces`` or ``metrics`` (which response type to parse).

    Raises:
        OSError / ssl.SSLError: a TLS file cannot be read or parsed.
    """

    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        compression: str | None = None,
        tls: TlsFiles | None = None,
        signal: Signal = "traces",
    ) -> None:
        self.target = url
        self.signal = signal
        self._gzip = compression == "gzip"
        base = {"Content-Type": "application/x-protobuf", "User-Agent": "servewatch"}
        if self._gzip:
            base["Content-Encoding"] = "gzip"
        base.update(headers or {})
        verify: ssl.SSLContext | bool = tls.ssl_context() if tls is not None and tls.configured else True
        self._client = httpx.Client(headers=base, trust_env=False, verify=verify)
        self._closed = False

    def send(self, request: OtlpRequest, *, timeout_s: float) -> SendResult:
        body = request.SerializeToString()
        if self._gzip:
            body = gzip.compress(body, compresslevel=6)
        try:
            response = self._client.post(self.target, content=body, timeout=max(0.001, timeout_s))
        except httpx.TimeoutException:
            return SendResult(Delivery.RETRYABLE, "http timeout", cause=Cause.TIMEOUT)
        except httpx.TransportError as exc:
            return SendResult(Delivery.RETRYABLE, f"http {type(exc).__name__}: {str(exc)[:200]}", cause=_http_error_cause(exc))
        except RuntimeError as exc:  # client closed by abort() on another thread
            return SendResult(Delivery.RETRYABLE, f"http aborted: {exc}", cause=Cause.TIMEOUT)
        status = response.status_code
        if status // 100 == 2:
            if response.content and "protobuf" in response.headers.get("content-type", ""):
                parsed: ExportTraceServiceResponse | ExportMetricsServiceResponse
                if self.signal == "metrics":
                    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
                        ExportMetricsServiceResponse,
                    )

                    parsed = ExportMetricsServiceResponse()
                else:
                    parsed = ExportTraceServiceResponse()
                try:
                    parsed.ParseFromString(response.content)
                except Exception:  # noqa: BLE001 - a garbled body from a 2xx is still a delivery
                    _log.debug("unparseable OTLP/HTTP response body from %s", self.target)
                    return SendResult(Delivery.OK)
                return _partial_success(parsed)
            return SendResult(Delivery.OK)
        return self._refusal(response)

    def _refusal(self, response: httpx.Response) -> SendResult:
        """Sort a non-2xx answer: delivery, cause, the collector's own message, the fix."""
        status = response.status_code
        reason = response.reason_phrase or ""
        detail = f"http {status}" + (f" {reason}" if reason else "")
        content_type = response.headers.get("content-type", "")
        if content_type.startswith("application/grpc"):
            return SendResult(Delivery.PERMANENT, detail, cause=Cause.PROTOCOL_MISMATCH)
        message = _error_message(response.content, content_type)
        if status == 413:
            return SendResult(Delivery.TOO_LARGE, detail, cause=Cause.TOO_LARGE, message=message)
        if status in (401, 403):
            hint = _auth_hint(sent_auth=_has_auth(dict(self._client.headers)))
            return SendResult(Delivery.PERMANENT, detail, cause=Cause.AUTH, message=message, hint=hint)
        if status in (404, 405) and self.signal == "metrics" and urlsplit(self.target).path.endswith("/v1/metrics"):
            # the metrics path is right: whatever answers there takes no metrics
            return SendResult(Delivery.PERMANENT, detail, cause=Cause.SIGNAL_NOT_TAKEN, message=message, hint=METRICS_NOT_TAKEN_HINT)
        if status in (404, 405):
            return SendResult(Delivery.PERMANENT, detail, cause=Cause.NOT_FOUND, message=message, hint=_path_hint(self.target, self.signal))
        if status in (400, 415):
            return SendResult(Delivery.PERMANENT, detail, cause=Cause.BAD_REQUEST, message=message)
        retry_after_s = _retry_after(response.headers.get("retry-after"))
        if status == 429:
            return SendResult(Delivery.RETRYABLE, detail, cause=Cause.THROTTLED, message=message, retry_after_s=retry_after_s)
        if status in _HTTP_RETRYABLE:
            return SendResult(Delivery.RETRYABLE, detail, cause=Cause.UNAVAILABLE, message=message, retry_after_s=retry_after_s)
        return SendResult(Delivery.PERMANENT, detail, cause=Cause.COLLECTOR, message=message)

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
        return self.send_line(request_to_json(request), span_count(request), timeout_s=timeout_s)

    def send_line(self, line: str, spans: int, *, timeout_s: float) -> SendResult:
        """Append a request already written as its OTLP/JSON line (what :meth:`send` writes for
        it; :func:`exporters.otlp.wire_json.spans_line`) holding ``spans`` spans."""
        try:
            self.writer.write_line(line, spans)
        except OSError as exc:
            return SendResult(Delivery.RETRYABLE, f"file {exc.strerror or type(exc).__name__}")
        return SendResult(Delivery.OK)

    def abort(self) -> None:
        return None

    def close(self) -> None:
        self.writer.close()


class DisabledSender:
    """Takes every request and sends nothing (``OTEL_SDK_DISABLED=true``: per the OTel spec the
    SDK is off for every signal, spans as well as metrics); nothing is written either."""

    target = "nowhere (OTEL_SDK_DISABLED=true)"

    def send(self, request: ExportTraceServiceRequest, *, timeout_s: float) -> SendResult:
        return SendResult(Delivery.OK)

    def abort(self) -> None:
        return None

    def close(self) -> None:
        return None


def make_sender(
    endpoint: str,
    protocol: str,
    *,
    headers: dict[str, str] | None = None,
    insecure: bool | None = None,
    compression: str | None = None,
    signal_specific: bool = False,
    tls: TlsFiles | None = None,
    signal: Signal = "traces",
) -> GrpcSender | HttpSender:
    """A network sender for ``protocol`` (``grpc`` or ``http/protobuf``) and ``signal``.

    Raises:
        ValueError: unknown protocol.
        OSError: a TLS file cannot be read.
    """
    if protocol == "grpc":
        return GrpcSender(endpoint, headers=headers, insecure=insecure, compression=compression, tls=tls, signal=signal)
    if protocol == "http/protobuf":
        url = http_traces_url(endpoint, signal_specific=signal_specific, signal=signal)
        return HttpSender(url, headers=headers, compression=compression, tls=tls, signal=signal)
    raise ValueError(f"unsupported OTLP protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")
