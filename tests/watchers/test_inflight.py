"""Open requests read from the kernel's TCP state (agent.watchers.inflight) and the busy flag they
give the Prometheus source: a request accepted and not answered is work pending even while the
server's gauges (published only after an engine step) say 0 (issue 31 item 3)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from agent.watchers import inflight
from agent.watchers.inflight import OpenRequests, is_open_request, local_port_of, open_requests_on
from agent.watchers.steps import PrometheusStepSource

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sock_diag is Linux's")

_CLIENT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
if sys.argv[2] == "send":
    s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nhost: x\\r\\ncontent-length: 0\\r\\n\\r\\n")
print("sent", flush=True)
time.sleep(30)
"""


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(10)
    try:
        yield srv
    finally:
        srv.close()


def _client(port: int, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _CLIENT, str(port), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "sent\n"
    return proc


def _until(port: int, want: OpenRequests, quiet_s: float = 10.0) -> OpenRequests | None:
    deadline = time.monotonic() + 5
    seen = open_requests_on(port, quiet_s=quiet_s)
    while seen != want and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = open_requests_on(port, quiet_s=quiet_s)
    return seen


def test_a_request_read_and_not_answered_is_open_until_answered(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    client = _client(port, "send")
    try:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            assert _until(port, OpenRequests(open=1, connections=1)) == OpenRequests(open=1, connections=1)
            time.sleep(0.05)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")  # answered: an idle keep-alive now
            assert _until(port, OpenRequests(open=0, connections=1)) == OpenRequests(open=0, connections=1)
            # held quiet both ways longer than a keep-alive: a response not finished (streaming)
            time.sleep(0.3)
            assert open_requests_on(port, quiet_s=0.2) == OpenRequests(open=1, connections=1)
    finally:
        client.kill()
        client.wait()
        assert client.stdout is not None
        client.stdout.close()


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_an_ipv4_client_of_a_server_on_the_ipv6_any_address_is_read() -> None:
    """A server on ``[::]`` (dual stack) holds its IPv4 clients as IPv6 sockets: only the IPv6
    table is asked then, and the request is still found."""
    srv = socket.socket(socket.AF_INET6)
    try:
        srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        srv.bind(("::", 0))
    except OSError:
        srv.close()
        pytest.skip("no dual-stack IPv6 here")
    srv.listen(8)
    srv.settimeout(10)
    port = srv.getsockname()[1]
    client = _client(port, "send")
    try:
        conn, _ = srv.accept()
        with conn:
            conn.recv(4096)
            assert _until(port, OpenRequests(open=1, connections=1)) == OpenRequests(open=1, connections=1)
    finally:
        client.kill()
        client.wait()
        assert client.stdout is not None
        client.stdout.close()
        srv.close()


def test_a_reader_finds_a_request_on_a_connection_opened_after_a_reading_of_none(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    reader = inflight.OpenRequestsReader(port)
    assert reader.read() == OpenRequests(open=0, connections=0)
    client = _client(port, "send")
    try:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            deadline = time.monotonic() + 5
            while (seen := reader.read()) != OpenRequests(open=1, connections=1) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert seen == OpenRequests(open=1, connections=1)
            assert seen.open_since_ns is not None and seen.open_since_ns <= time.monotonic_ns()
    finally:
        client.kill()
        client.wait()
        assert client.stdout is not None
        client.stdout.close()


def test_a_reader_asks_the_kernel_again_only_when_a_connection_may_have_come(monkeypatch: pytest.MonkeyPatch) -> None:
    """No connection at the last reading and no TCP connection accepted on the host since: the
    last reading stands (at most REUSE_MAX_S); any connection there, or one accepted since: asked."""
    opens = [100]
    answers = [OpenRequests(open=0, connections=0)]
    asked: list[int] = []

    def fake(port: int, *, quiet_s: float = 10.0) -> OpenRequests:
        asked.append(port)
        return answers[0]

    monkeypatch.setattr(inflight, "open_requests_on", fake)
    monkeypatch.setattr(inflight, "_passive_opens", lambda: opens[0])
    reader = inflight.OpenRequestsReader(8000)
    for _ in range(3):
        assert reader.read() == OpenRequests(open=0, connections=0)
    assert len(asked) == 1 and reader.reused == 2
    opens[0] += 1  # a connection accepted somewhere on the host
    answers[0] = OpenRequests(open=0, connections=1)
    assert reader.read() == OpenRequests(open=0, connections=1)
    assert reader.read() == OpenRequests(open=0, connections=1)  # a connection there: asked every time
    assert len(asked) == 3
    answers[0] = OpenRequests(open=0, connections=0)
    reader.read()
    monkeypatch.setattr(inflight, "_passive_opens", lambda: None)  # not readable: asked every time
    reader.read()
    assert len(asked) == 5
    monkeypatch.setattr(inflight, "_passive_opens", lambda: opens[0])
    reader.read()
    reader.read()
    assert len(asked) == 6
    monkeypatch.setattr(inflight, "REUSE_MAX_S", 0.0)
    reader.read()
    assert len(asked) == 7


def test_a_reading_of_no_open_request_stands_while_idle_and_one_of_an_open_request_never(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [OpenRequests(open=0, connections=2)]
    asked: list[int] = []

    def fake(port: int, *, quiet_s: float = 10.0) -> OpenRequests:
        asked.append(port)
        return answers[0]

    monkeypatch.setattr(inflight, "open_requests_on", fake)
    monkeypatch.setattr(inflight, "_passive_opens", lambda: None)
    reader = inflight.OpenRequestsReader(8000, idle_reuse_s=3600.0)
    assert reader.recent() is None  # nothing read yet
    for _ in range(3):
        assert reader.read() == OpenRequests(open=0, connections=2)
    assert reader.recent() == OpenRequests(open=0, connections=2)
    assert len(asked) == 1
    reader.idle_reuse_s = 0.0
    assert reader.recent() is None
    answers[0] = OpenRequests(open=1, connections=2, open_since_ns=5)
    assert reader.read() == OpenRequests(open=1, connections=2)
    reader.idle_reuse_s = 3600.0
    assert reader.recent() is None  # a reading of an open request never stands
    assert reader.read().open_since_ns == 5  # type: ignore[union-attr]
    assert len(asked) == 3


def test_the_hosts_accepted_connections_are_read_from_proc() -> None:
    from agent.watchers.inflight import _passive_opens

    assert isinstance(_passive_opens(), int)


def test_the_agents_own_connections_are_not_requests(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    mine = socket.create_connection(("127.0.0.1", port))
    try:
        conn, _ = listener.accept()
        with conn:
            mine.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            time.sleep(0.1)
            assert open_requests_on(port) == OpenRequests(open=0, connections=0)
    finally:
        mine.close()


def test_an_answered_connection_info_and_a_fresh_one_are_no_request() -> None:
    assert not is_open_request(b"")  # no tcp_info: not known, not a request
    assert open_requests_on(1) == OpenRequests(open=0, connections=0)


def test_only_a_local_url_has_a_port_to_read() -> None:
    assert local_port_of("http://127.0.0.1:8000/metrics") == 8000
    assert local_port_of("http://localhost/metrics") == 80
    assert local_port_of("http://[::1]:30000/metrics") == 30000
    assert local_port_of("http://192.0.2.7:8000/metrics") is None  # TEST-NET: not this machine


_VLLM_IDLE = b"""# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
"""


@pytest.mark.parametrize("watch", [True, False])
async def test_an_open_request_makes_an_idle_looking_server_busy(monkeypatch: pytest.MonkeyPatch, watch: bool) -> None:
    """vLLM's gauges stay 0 through a hung first forward; the open connection says busy."""
    from tests.watchers.scripted_http import scripted_http

    asked: list[int] = []

    def fake(port: int, *, quiet_s: float = 10.0) -> OpenRequests:
        asked.append(port)
        return OpenRequests(open=1, connections=1)

    monkeypatch.setattr(inflight, "open_requests_on", fake)
    with scripted_http() as srv:
        srv.route("/metrics", lambda _req: (200, {}, _VLLM_IDLE))
        source = PrometheusStepSource(srv.base + "/metrics", preset="vllm", timeout_s=5.0, open_requests=watch)
        try:
            readings = await source.read_series()
            total = await source.read()
        finally:
            await source.aclose()
    assert readings is not None and total is not None
    assert [r.busy for r in readings] == [watch] and total.busy is watch
    assert asked == ([int(srv.base.rsplit(":", 1)[1])] * 2 if watch else [])
    assert ("requests open on port" in source.status()[1]) is watch


async def test_a_request_found_open_dates_the_busy_reading_from_when_it_was_received(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request found at a later reading (the idle readings stand a while) starts the stall
    clock when the kernel received it, not when the agent looked."""
    from agent.host.stall import StallClock
    from tests.watchers.scripted_http import scripted_http

    since = time.monotonic_ns() - 3_000_000_000
    monkeypatch.setattr(inflight, "open_requests_on",
                        lambda port, *, quiet_s=10.0: OpenRequests(open=1, connections=1, open_since_ns=since))
    with scripted_http() as srv:
        srv.route("/metrics", lambda _req: (200, {}, _VLLM_IDLE))
        source = PrometheusStepSource(srv.base + "/metrics", preset="vllm", timeout_s=5.0, open_requests=True,
                                      open_request_idle_reuse_s=2.0)
        try:
            readings = await source.read_series()
        finally:
            await source.aclose()
    assert readings is not None and [r.busy_since_ns for r in readings] == [since]
    clock = StallClock(60.0)
    deadline = clock.deadline_ns(busy=True, last_progress_ns=since - 10**9, read_ns=readings[0].read_monotonic_ns,
                                 busy_since_ns=readings[0].busy_since_ns)
    assert deadline == since + 60 * 10**9
    # a gauge that says busy starts the clock at the reading, as before
    assert StallClock(60.0).deadline_ns(busy=True, last_progress_ns=0, read_ns=since + 5, busy_since_ns=None) == since + 5 + 60 * 10**9


def test_a_dump_for_a_port_holds_only_that_ports_connections_filtered_by_the_kernel(listener: socket.socket) -> None:
    """The kernel keeps the dump to the port's connections (its side and the peer's): the host's
    other connections are neither copied nor parsed (a busy host has thousands)."""
    port = listener.getsockname()[1]
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(8)
    other_port = other.getsockname()[1]
    with other, socket.create_connection(("127.0.0.1", port)) as c1, socket.create_connection(("127.0.0.1", other_port)) as c2:
        s1, _ = listener.accept()
        s2, _ = other.accept()
        client, other_client = c1.getsockname()[1], c2.getsockname()[1]
        with s1, s2:
            everything = inflight._dump(socket.AF_INET)
            mine = inflight._dump(socket.AF_INET, port=port)
            listening = inflight._dump(socket.AF_INET, inflight._TCP_LISTEN, port)
    ends = {(client, port), (port, client)}
    assert {(sport, dport) for sport, dport, _, _ in mine} == ends
    assert all(info for _, _, _, info in mine)  # tcp_info still comes with each
    assert {(sport, dport) for sport, dport, _, _ in everything} >= ends | {(other_client, other_port)}
    assert [sport for sport, _, _, _ in listening] == [port]
