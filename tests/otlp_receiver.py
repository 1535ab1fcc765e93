"""A real OTLP receiver for tests: gRPC ``TraceService``/``MetricsService`` and HTTP ``/v1/traces``.

The gRPC side is opentelemetry-proto's generated service on a real ``grpc.server``; the HTTP side
is a ``ThreadingHTTPServer`` accepting protobuf (``application/x-protobuf``, optionally gzip) and
OTLP/JSON (``application/json``). Both listen on 127.0.0.1 ephemeral ports chosen at the first
start and kept across :meth:`OtlpReceiver.stop` / :meth:`OtlpReceiver.start`, so a client keeps
its endpoint while the "collector" goes away and comes back. Requests are collected thread-safely.

Like a collector's receivers it enforces a receive limit (``max_receive_bytes``, default 4 MiB,
the collector's gRPC default): gRPC answers ``RESOURCE_EXHAUSTED`` ("larger than max") and HTTP
413 above it. With ``tls`` it serves TLS on both ports (server certificate from
:mod:`tests.tls_certs`), and with ``require_client_cert`` mTLS: a client without a certificate
signed by the CA fails the handshake.

Use the ``otlp_receiver`` fixture (``tests/exporters/conftest.py``) or the class directly.
"""

from __future__ import annotations

import datetime
import gzip
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from typing_extensions import Self

from exporters.otlp.otlp_json import message_from_json, message_to_json
from tests.tls_certs import TlsMaterial

#: The collector's default gRPC receive limit (bytes); HTTP's is 20 MiB, we use the smaller here.
DEFAULT_MAX_RECEIVE_BYTES = 4 * 1024 * 1024

__all__ = ["OtlpReceiver", "ReceivedSpan", "attr_value", "attrs_dict", "otlp_receiver_fixture"]


def attr_value(value: AnyValue) -> object:
    """A protobuf ``AnyValue`` as a Python value (arrays as tuples)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(attr_value(v) for v in value.array_value.values)
    if kind is None:
        return None
    return getattr(value, kind)


def attrs_dict(attributes: object) -> dict[str, object]:
    """Repeated ``KeyValue`` as a dict."""
    return {kv.key: attr_value(kv.value) for kv in attributes}  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver got it."""

    protocol: str
    resource: dict[str, object]
    scope: str
    span: Span

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_span_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attributes(self) -> dict[str, object]:
        return attrs_dict(self.span.attributes)


@dataclass
class _Store:
    lock: threading.Lock = field(default_factory=threading.Lock)
    cond: threading.Condition = field(init=False)
    traces: list[tuple[str, trace_service_pb2.ExportTraceServiceRequest]] = field(default_factory=list)
    metrics: list[tuple[str, metrics_service_pb2.ExportMetricsServiceRequest]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    metrics_headers: list[dict[str, str]] = field(default_factory=list)
    span_total: int = 0

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.lock)

    def add_trace(self, protocol: str, request: trace_service_pb2.ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.cond:
            self.traces.append((protocol, request))
            self.headers.append(headers)
            self.span_total += n
            self.cond.notify_all()

    def add_metrics(self, protocol: str, request: metrics_service_pb2.ExportMetricsServiceRequest, headers: dict[str, str]) -> None:
        with self.cond:
            self.metrics.append((protocol, request))
            self.metrics_headers.append(headers)
            self.cond.notify_all()


def _rich_status(code: int, message: str, retry_delay_s: float | None) -> bytes:
    """A ``google.rpc.Status`` (with a ``RetryInfo`` detail when a delay is given), serialized."""
    status = status_pb2.Status(code=code, message=message)
    if retry_delay_s is not None:
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromTimedelta(datetime.timedelta(seconds=retry_delay_s))
        status.details.add().Pack(info)
    return status.SerializeToString()


def _span_total(request: trace_service_pb2.ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        receiver = self.receiver
        receiver.attempts += 1
        if receiver.grpc_error is not None:
            if receiver.retry_delay_s is not None:
                context.set_trailing_metadata(
                    (("grpc-status-details-bin", _rich_status(receiver.grpc_error.value[0], receiver.error_message, receiver.retry_delay_s)),)
                )
            context.abort(receiver.grpc_error, receiver.error_message)
        if receiver.reject_all is not None:  # OTLP partial success: every span of the request rejected
            response = trace_service_pb2.ExportTraceServiceResponse()
            response.partial_success.rejected_spans = _span_total(request)
            response.partial_success.error_message = receiver.reject_all
            return response
        receiver._store.add_trace("grpc", request, {k: v for k, v in context.invocation_metadata()})
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: grpc.ServicerContext) -> metrics_service_pb2.ExportMetricsServiceResponse:
        if self.receiver.grpc_error is not None:
            context.abort(self.receiver.grpc_error, "refused by test receiver")
        self.receiver._store.add_metrics("grpc", request, {k: v for k, v in context.invocation_metadata()})
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            return None

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def setup(self) -> None:
            if isinstance(self.request, ssl.SSLSocket):
                self.request.settimeout(10)
                self.request.do_handshake()  # failures end this connection only (handle_error is quiet)
                self.request.settimeout(None)
            super().setup()
            receiver._track(self.connection, add=True)

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                receiver._track(self.connection, add=False)

        def do_POST(self) -> None:
            if not receiver.running:  # a keep-alive connection outliving stop(): the collector is gone
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            length = int(self.headers.get("Content-Length", "0"))
            if length > receiver.max_receive_bytes:
                receiver.too_large += 1
                self.close_connection = True  # the body is not read: the connection cannot be reused
                self._reply(413, b"request entity too large", "text/plain")
                return
            body = self.rfile.read(length)
            if self.headers.get("Content-Encoding", "") == "gzip":
                body = gzip.decompress(body)
            receiver.attempts += 1
            if receiver.http_status is not None:
                # as the collector answers: a protobuf google.rpc.Status with its message
                body = status_pb2.Status(code=2, message=receiver.error_message).SerializeToString()
                self.send_response(receiver.http_status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                if receiver.retry_delay_s is not None:
                    self.send_header("Retry-After", str(int(receiver.retry_delay_s)))
                self.end_headers()
                self.wfile.write(body)
                return
            content_type = self.headers.get("Content-Type", "")
            is_json = content_type.startswith("application/json")
            path = self.path.split("?")[0]
            if path == "/v1/traces":
                req_type, resp = trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse()
            elif path == "/v1/metrics" and not receiver.traces_only:
                req_type, resp = metrics_service_pb2.ExportMetricsServiceRequest, metrics_service_pb2.ExportMetricsServiceResponse()
            else:
                self._reply(404, b"not found", "text/plain")
                return
            try:
                if is_json:
                    request = message_from_json(body, req_type)
                else:
                    request = req_type()
                    request.ParseFromString(body)
            except Exception as exc:  # noqa: BLE001 - a malformed body is a 400, as a collector answers
                self._reply(400, str(exc).encode(), "text/plain")
                return
            protocol = "http/json" if is_json else "http/protobuf"
            if path == "/v1/traces" and receiver.reject_all is not None:
                resp.partial_success.rejected_spans = _span_total(request)
                resp.partial_success.error_message = receiver.reject_all
            elif path == "/v1/traces":
                receiver._store.add_trace(protocol, request, dict(self.headers.items()))
            else:
                receiver._store.add_metrics(protocol, request, dict(self.headers.items()))
            if is_json:
                self._reply(200, message_to_json(resp).encode(), "application/json")
            else:
                self._reply(200, resp.SerializeToString(), "application/x-protobuf")

    return Handler


class _HttpServer(ThreadingHTTPServer):
    """Plain or TLS HTTP server; the TLS handshake runs on the connection's own thread."""

    daemon_threads = True
    ssl_context: ssl.SSLContext | None = None

    def get_request(self) -> tuple[socket.socket, object]:
        sock, addr = self.socket.accept()
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: object, client_address: object) -> None:
        return None  # a failed handshake or a client going away is the client's problem, not a test error


class OtlpReceiver:
    """gRPC + HTTP OTLP receiver on 127.0.0.1; startable, stoppable and restartable on the same ports.

    Attributes:
        grpc_error: when set, gRPC exports are answered with this status (and not stored).
        http_status: when set, HTTP exports are answered with this status (and not stored), the
            body a protobuf ``google.rpc.Status`` carrying :attr:`error_message`, as the
            collector answers.
        error_message: the message of those refusals.
        retry_delay_s: with a refusal, ask for this delay: HTTP ``Retry-After`` (whole seconds),
            gRPC ``google.rpc.RetryInfo`` in the rich status.
        reject_all: when set, trace exports are answered as OTLP partial success with every
            span rejected and this ``error_message`` (nothing stored).
        traces_only: serve traces only, as Jaeger and Tempo do: no gRPC ``MetricsService``
            (grpc answers ``UNIMPLEMENTED``, unknown service) and HTTP 404 at ``/v1/metrics``.
        attempts: export calls answered (refused ones included).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        tls: TlsMaterial | None = None,
        require_client_cert: bool = False,
        max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
        traces_only: bool = False,
    ) -> None:
        self.host = host
        self.traces_only = traces_only
        self.tls = tls
        self.require_client_cert = require_client_cert
        self.max_receive_bytes = max_receive_bytes
        #: HTTP requests refused with 413
        self.too_large = 0
        self.grpc_port = 0
        self.http_port = 0
        self.grpc_error: grpc.StatusCode | None = None
        self.http_status: int | None = None
        self.error_message = "refused by test receiver"
        self.retry_delay_s: float | None = None
        self.reject_all: str | None = None
        self.attempts = 0
        self._store = _Store()
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._conn_lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._grpc is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def grpc_endpoint(self) -> str:
        return f"{self.scheme}://{self.host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """Base URL; exporters append ``/v1/traces``."""
        return f"{self.scheme}://{self.host}:{self.http_port}"

    def endpoint(self, protocol: str) -> str:
        return self.grpc_endpoint if protocol == "grpc" else self.http_endpoint

    def start(self) -> Self:
        """Listen (again) on the same ports. Raises ``RuntimeError`` if a port was taken meanwhile."""
        if self.running:
            return self
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            options=(("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", self.max_receive_bytes)),
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        if not self.traces_only:
            metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self), server)
        if self.tls is not None:
            creds = grpc.ssl_server_credentials(
                [(self.tls.read("server_key"), self.tls.read("server_cert"))],
                root_certificates=self.tls.read("ca_cert") if self.require_client_cert else None,
                require_client_auth=self.require_client_cert,
            )
            port = server.add_secure_port(f"{self.host}:{self.grpc_port}", creds)
        else:
            port = server.add_insecure_port(f"{self.host}:{self.grpc_port}")
        if port == 0:
            raise RuntimeError(f"gRPC port {self.grpc_port} is not available")
        self.grpc_port = port
        server.start()
        self._grpc = server
        http = _HttpServer((self.host, self.http_port), _handler(self))
        if self.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(self.tls.server_cert, self.tls.server_key)
            if self.require_client_cert:
                ctx.verify_mode = ssl.CERT_REQUIRED
                ctx.load_verify_locations(self.tls.ca_cert)
            http.ssl_context = ctx
        self.http_port = http.server_address[1]
        self._http = http
        self._http_thread = threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.05}, name="otlp-http", daemon=True)
        self._http_thread.start()
        return self

    def stop(self) -> None:
        """Stop listening; connections are closed (clients see the collector go away). Safe twice."""
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
            with self._conn_lock:
                open_connections = list(self._connections)
            for conn in open_connections:  # keep-alive clients must see the server go away
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._http_thread is not None:
            self._http_thread.join(5)
            self._http_thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what arrived ---------------------------------------------------------------------

    @property
    def trace_requests(self) -> list[tuple[str, trace_service_pb2.ExportTraceServiceRequest]]:
        with self._store.lock:
            return list(self._store.traces)

    @property
    def metrics_requests(self) -> list[tuple[str, metrics_service_pb2.ExportMetricsServiceRequest]]:
        with self._store.lock:
            return list(self._store.metrics)

    @property
    def request_headers(self) -> list[dict[str, str]]:
        with self._store.lock:
            return list(self._store.headers)

    @property
    def metrics_headers(self) -> list[dict[str, str]]:
        """Headers (HTTP) or metadata (gRPC) of each metrics request."""
        with self._store.lock:
            return list(self._store.metrics_headers)

    @property
    def span_count(self) -> int:
        with self._store.lock:
            return self._store.span_total

    def spans(self) -> list[ReceivedSpan]:
        """Every span received, in arrival order."""
        return list(self._iter_spans())

    def _iter_spans(self) -> Iterator[ReceivedSpan]:
        for protocol, request in self.trace_requests:
            for rs in request.resource_spans:
                resource = attrs_dict(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        yield ReceivedSpan(protocol, resource, ss.scope.name, span)

    def wait_for_spans(self, count: int, timeout_s: float) -> bool:
        """Block until at least ``count`` spans arrived or ``timeout_s`` seconds passed."""
        deadline = time.monotonic() + timeout_s
        with self._store.cond:
            while self._store.span_total < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._store.cond.wait(remaining)
        return True

    def wait_for_metrics(self, timeout_s: float) -> bool:
        """Block until a metrics request arrived or ``timeout_s`` seconds passed."""
        deadline = time.monotonic() + timeout_s
        with self._store.cond:
            while not self._store.metrics:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._store.cond.wait(remaining)
        return True

    def clear(self) -> None:
        with self._store.cond:
            self._store.traces.clear()
            self._store.metrics.clear()
            self._store.headers.clear()
            self._store.metrics_headers.clear()
            self._store.span_total = 0


def otlp_receiver_fixture() -> Iterator[OtlpReceiver]:
    """Generator body for a pytest fixture: a started receiver, stopped at teardown."""
    receiver = OtlpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


def serve_over_stdio() -> int:
    """Run a receiver in its own process, driven by one-line commands on stdin (for benchmarks,
    so the receiver does not share the exporter's GIL).

    Prints ``<grpc_port> <http_port>`` once listening, then answers each command with one line:
    ``start``/``stop``/``clear`` -> ``ok``; ``count`` -> spans received; ``wait N SECONDS`` -> spans
    received once N arrived or the time passed; ``quit`` (or end of input) stops it.
    """
    import sys
    from pathlib import Path

    tls = None
    if len(sys.argv) > 2 and sys.argv[1] == "--tls":  # --tls DIR: serve TLS with the PEMs make_tls_material wrote there
        d = Path(sys.argv[2])
        tls = TlsMaterial(d / "ca.pem", d / "server.pem", d / "server-key.pem", d / "client.pem", d / "client-key.pem", d / "other-ca.pem")
    receiver = OtlpReceiver(tls=tls).start()
    print(f"{receiver.grpc_port} {receiver.http_port}", flush=True)
    try:
        for line in sys.stdin:
            command, *args = line.split()
            if command == "start":
                receiver.start()
            elif command == "stop":
                receiver.stop()
            elif command == "clear":
                receiver.clear()
            elif command == "wait":
                receiver.wait_for_spans(int(args[0]), timeout_s=float(args[1]))
                print(receiver.span_count, flush=True)
                continue
            elif command == "count":
                print(receiver.span_count, flush=True)
                continue
            elif command == "quit":
                break
            print("ok", flush=True)
    finally:
        receiver.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(serve_over_stdio())
