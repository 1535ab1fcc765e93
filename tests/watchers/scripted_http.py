"""A real HTTP server on 127.0.0.1 (ephemeral port, in a thread) whose answers a test scripts.

Each route is a function ``handler(request) -> (status, headers, body)`` where ``body`` is bytes
or an iterator of byte chunks (streamed chunked, without end if the iterator never ends). The
server counts requests and the bytes it managed to send per route, so a test can prove that a
client stopped reading (bounded memory) without timing anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = tuple[int, dict[str, str], "bytes | Iterable[bytes]"]


class ScriptedHTTP:
    def __init__(self) -> None:
        self.routes: dict[str, Callable[[BaseHTTPRequestHandler], Answer]] = {}
        self.requests: dict[str, int] = {}
        self.bytes_sent: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                with owner.lock:
                    owner.requests[path] = owner.requests.get(path, 0) + 1
                    route = owner.routes.get(path)
                if route is None:
                    code, headers, body = 404, {}, b""
                else:
                    code, headers, body = route(self)
                try:
                    self.send_response(code)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    if isinstance(body, bytes):
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        owner._sent(path, len(body))
                        return
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for chunk in body:
                        if owner.stop.is_set():
                            break
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        owner._sent(path, len(chunk))
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    self.close_connection = True  # the client stopped reading and closed

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def _sent(self, path: str, n: int) -> None:
        with self.lock:
            self.bytes_sent[path] = self.bytes_sent.get(path, 0) + n

    def route(self, path: str, answer: Callable[[BaseHTTPRequestHandler], Answer] | Answer) -> None:
        fn = answer if callable(answer) else (lambda _req, a=answer: a)
        with self.lock:
            self.routes[path] = fn  # type: ignore[assignment]

    def count(self, path: str) -> int:
        with self.lock:
            return self.requests.get(path, 0)


def endless(chunk_bytes: int = 64 * 1024) -> Iterator[bytes]:
    """A body that never ends."""
    chunk = b"x" * chunk_bytes
    while True:
        yield chunk


@contextmanager
def scripted_http() -> Iterator[ScriptedHTTP]:
    srv = ScriptedHTTP()
    srv.thread.start()
    try:
        yield srv
    finally:
        srv.stop.set()
        srv.httpd.shutdown()
        srv.httpd.server_close()
        srv.thread.join(timeout=10)


def metrics_text(counter: str = "sglang:generation_tokens_total", gauge: str = "sglang:num_running_reqs",
                 series: dict[str, tuple[float, float]] | None = None, *, counter_value: str | None = None,
                 gauge_value: str | None = None) -> bytes:
    """A Prometheus exposition with one counter and one gauge.

    ``series`` maps a label string (``engine="0"``) to ``(counter, gauge)``; default one
    unlabelled series ``(10, 1)``. ``counter_value``/``gauge_value`` override the text of the
    value (``NaN``, ``+Inf``).
    """
    series = series or {"": (10.0, 1.0)}
    base_c = counter.removesuffix("_total")
    lines = [f"# TYPE {base_c} counter"]
    for labels, (c, _g) in series.items():
        lab = "{" + labels + "}" if labels else ""
        lines.append(f"{counter}{lab} {counter_value if counter_value is not None else repr(float(c))}")
    lines.append(f"# TYPE {gauge} gauge")
    for labels, (_c, g) in series.items():
        lab = "{" + labels + "}" if labels else ""
        lines.append(f"{gauge}{lab} {gauge_value if gauge_value is not None else repr(float(g))}")
    return ("\n".join(lines) + "\n").encode()
