"""The health watcher against a real HTTP server on 127.0.0.1 (ephemeral port) run in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import pydantic
import pytest

from agent.model.bus import RecordingBus
from agent.model.events import HealthCheckFailed, HealthProbed, HealthRecovered
from agent.watchers.health import HealthConfig, HealthWatcher, classify_status
from tests.watchers import wait_until


class ScriptedServer:
    """Answers ``/health`` from a script of ``(status_code, delay_s)``; 200 when it runs out."""

    def __init__(self) -> None:
        self.script: list[tuple[int, float]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()  # cuts slow answers short at teardown
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                with owner.lock:
                    code, delay_s = owner.script.pop(0) if owner.script else (200, 0.0)
                if delay_s:
                    owner.release.wait(delay_s)
                try:
                    self.send_response(code)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the prober gave up (timeout) and closed the connection

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/health"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def then(self, *steps: tuple[int, float]) -> None:
        with self.lock:
            self.script.extend(steps)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    srv.thread.start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.httpd.shutdown()
        srv.httpd.server_close()
        srv.thread.join(timeout=10)


def _config(url: str, **overrides: Any) -> HealthConfig:
    settings: dict[str, Any] = {"url": url, "interval_s": 0.05, "timeout_s": 0.3, "unhealthy_after": 3, "healthy_after": 2}
    settings.update(overrides)
    return HealthConfig(**settings)


async def _run_until(watcher: HealthWatcher, bus: RecordingBus, probes: int) -> list[HealthProbed]:
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run, bus)
        await wait_until(lambda: len(bus.of_type(HealthProbed)) >= probes)
        tg.cancel_scope.cancel()
    return bus.of_type(HealthProbed)


async def test_n_consecutive_failures_publish_exactly_one_health_check_failed(server: ScriptedServer) -> None:
    server.then((200, 0.0), *[(503, 0.0)] * 7)
    bus = RecordingBus()
    watcher = HealthWatcher(_config(server.url))
    probes = await _run_until(watcher, bus, 8)

    assert [p.status_code for p in probes[:8]] == [200] + [503] * 7
    assert [p.error_class for p in probes[1:8]] == ["5xx"] * 7
    (failed,) = bus.of_type(HealthCheckFailed)
    assert failed.consecutive_failures == 3
    assert failed.status_code == 503 and failed.error_class == "5xx" and failed.url == server.url
    # published right after the third failed probe, not before
    order = [type(e).__name__ for e in bus.events if type(e).__name__ != "WatcherStatusChanged"]
    assert order[:5] == ["HealthProbed"] * 4 + ["HealthCheckFailed"]
    assert not watcher.healthy


async def test_a_single_slow_probe_is_never_an_incident(server: ScriptedServer) -> None:
    server.then((200, 0.0), (200, 5.0), (200, 0.0), (200, 0.0))
    bus = RecordingBus()
    probes = await _run_until(HealthWatcher(_config(server.url)), bus, 4)
    slow = probes[1]
    assert (slow.ok, slow.error_class, slow.status_code) == (False, "timeout", None)
    assert slow.latency_s < 5.0  # cut at the probe timeout, not the server's delay
    assert [p.ok for p in probes[2:4]] == [True, True]
    assert bus.of_type(HealthCheckFailed) == []


async def test_recovery_after_m_successes(server: ScriptedServer) -> None:
    server.then((200, 0.0), (500, 0.0), (500, 0.0), (500, 0.0), (200, 0.0), (200, 0.0), (200, 0.0))
    bus = RecordingBus()
    watcher = HealthWatcher(_config(server.url))
    await _run_until(watcher, bus, 7)
    kinds = [type(e).__name__ for e in bus.events if type(e).__name__ != "WatcherStatusChanged"]
    # probes: ok, fail, fail, fail -> Failed, ok, ok -> Recovered, ok
    assert kinds[:9] == [
        "HealthProbed",
        "HealthProbed",
        "HealthProbed",
        "HealthProbed",
        "HealthCheckFailed",
        "HealthProbed",
        "HealthProbed",
        "HealthRecovered",
        "HealthProbed",
    ]
    (recovered,) = bus.of_type(HealthRecovered)
    assert recovered.consecutive_successes == 2
    assert watcher.healthy


async def test_refused_timeout_4xx_and_5xx_are_classified(server: ScriptedServer) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{sock.getsockname()[1]}/health"
    bus = RecordingBus()
    refused = await _run_until(HealthWatcher(_config(closed_url, wait_for_ready=False)), bus, 3)
    assert {p.error_class for p in refused} == {"refused"}
    (failed,) = bus.of_type(HealthCheckFailed)
    assert failed.error_class == "refused" and failed.status_code is None

    server.then((404, 0.0), (503, 0.0), (200, 2.0))
    probes = await _run_until(HealthWatcher(_config(server.url)), RecordingBus(), 3)
    assert [(p.status_code, p.error_class) for p in probes[:3]] == [(404, "4xx"), (503, "5xx"), (None, "timeout")]
    assert [classify_status(c) for c in (200, 204, 301, 404, 503)] == ["", "", "error", "4xx", "5xx"]


async def test_failures_before_the_first_good_probe_do_not_count(server: ScriptedServer) -> None:
    # SGLang answers 503 while it loads the model.
    server.then(*[(503, 0.0)] * 5, (200, 0.0))
    bus = RecordingBus()
    watcher = HealthWatcher(_config(server.url))
    await _run_until(watcher, bus, 6)
    assert bus.of_type(HealthCheckFailed) == []
    assert watcher.ready and watcher.healthy


async def test_a_server_stuck_in_start_up_fails_after_the_startup_timeout(server: ScriptedServer) -> None:
    server.then(*[(503, 0.0)] * 40)
    bus = RecordingBus()
    watcher = HealthWatcher(_config(server.url, startup_timeout_s=0.3))
    probes = await _run_until(watcher, bus, 12)
    (failed,) = bus.of_type(HealthCheckFailed)
    assert failed.status_code == 503 and failed.consecutive_failures == 3
    # probes within the start-up window did not count
    assert len([p for p in probes if p.time_unix_nano <= failed.time_unix_nano]) > 3


def test_health_url_must_be_http() -> None:
    with pytest.raises(pydantic.ValidationError, match="http"):
        HealthConfig(url="ftp://x/health")
    with pytest.raises(pydantic.ValidationError, match="http"):
        HealthConfig(url="notaurl")
    assert HealthConfig(url="https://h:1/health").url == "https://h:1/health"


def test_health_config_defaults_and_validation() -> None:
    config = HealthConfig()
    assert (config.interval_s, config.timeout_s, config.unhealthy_after, config.healthy_after) == (5.0, 5.0, 3, 2)
    assert config.wait_for_ready
    with pytest.raises(pydantic.ValidationError, match="unhealthy_after"):
        HealthConfig(unhealthy_after=0)


def _keepalive_server_that_closes_the_second_request() -> tuple[socket.socket, threading.Thread]:
    """A real TCP server: the first connection answers one request with keep-alive, then reads
    the next request on it and closes without answering (a server closing an idle kept-alive
    connection just as the client reuses it, as uvicorn does at its 5 s keep-alive timeout);
    every later connection answers 200."""
    listener = socket.create_server(("127.0.0.1", 0))
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"

    def serve() -> None:
        first = True
        listener.settimeout(20)
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    conn.recv(65536)
                    conn.sendall(ok)
                    if first:
                        first = False
                        conn.recv(65536)  # the reused connection's request: closed unanswered
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


async def test_probe_retries_once_on_a_kept_alive_connection_the_server_closed() -> None:
    import httpx

    listener, thread = _keepalive_server_that_closes_the_second_request()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/health"
    watcher = HealthWatcher(HealthConfig(url=url, timeout_s=5.0))
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            first = await watcher.probe(client)
            second = await watcher.probe(client)  # reuses the connection the server then closes
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept(); close() alone does not
        listener.close()
        thread.join(timeout=5)
    assert first.ok and second.ok, (first, second, watcher._error_detail)
    assert second.status_code == 200
