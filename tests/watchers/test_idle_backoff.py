"""The ``/metrics`` watchdog reads an idle server less often (issue 38: the idle agent's CPU) and
keeps the stall promise: the first busy scrape after a longer wait is dated by the open requests
(the kernel's receive time), so the clock starts when the work arrived, not when it was seen."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import anyio
import pytest

from agent.model.bus import RecordingBus
from agent.model.events import WatchdogStalled
from agent.watchers import watchdog as watchdog_module
from agent.watchers.steps import PrometheusStepSource, StepReading
from agent.watchers.watchdog import (
    Watchdog,
    WatchdogConfig,
    idle_poll_max_s,
    open_request_idle_reuse_s,
)
from tests.watchers import wait_until
from tests.watchers.scripted_http import ScriptedHTTP, metrics_text, scripted_http

# a client in another process (the agent's own connections are never requests): one GET the
# server reads and does not answer, held open
_CLIENT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"GET /hang HTTP/1.1\\r\\nhost: x\\r\\n\\r\\n")
print("sent", flush=True)
time.sleep(60)
"""


class _Scripted:
    """A source double that backs off (``idle_backoff``): busy while :attr:`busy`; records the
    waits the watchdog chose and what it asked."""

    name = "prometheus"
    exact = False
    pid = None
    idle_backoff = True

    def __init__(self) -> None:
        self.busy = False
        self.watchdog: Watchdog | None = None
        #: (the watchdog's wait before this reading in ns, after_idle_gap, busy)
        self.reads: list[tuple[int, bool, bool]] = []
        self.start_ns = time.monotonic_ns()

    async def read_series(self, *, after_idle_gap: bool = False) -> list[StepReading]:
        assert self.watchdog is not None
        self.reads.append((self.watchdog.next_wait_ns, after_idle_gap, self.busy))
        now = time.monotonic_ns()
        ct = len(self.reads) if self.busy else 1  # busy: a step at every reading
        return [StepReading(forward_ct=ct, busy=self.busy, last_progress_monotonic_ns=now if self.busy else self.start_ns,
                            pid=None, read_monotonic_ns=now)]

    async def read(self) -> StepReading | None:
        raise AssertionError("the watchdog reads per series")


def test_the_idle_ceiling_is_5_s_at_most_a_twentieth_of_the_timeout_never_below_the_poll() -> None:
    assert idle_poll_max_s(WatchdogConfig()) == 5.0  # 300 s timeout
    assert idle_poll_max_s(WatchdogConfig(timeout_s=60.0)) == 3.0
    assert idle_poll_max_s(WatchdogConfig(timeout_s=10.0, poll_interval_s=1.0)) == 1.0  # no backing off


def test_a_reading_of_no_open_request_stands_15_s_at_most_a_quarter_of_the_timeout() -> None:
    assert open_request_idle_reuse_s(WatchdogConfig()) == 15.0  # 300 s timeout
    assert open_request_idle_reuse_s(WatchdogConfig(timeout_s=20.0)) == 5.0


async def test_an_idle_scrape_backs_off_doubling_to_the_ceiling_and_a_busy_one_returns_to_the_poll() -> None:
    poll_ns = 10_000_000
    config = WatchdogConfig(timeout_s=2.0, poll_interval_s=0.01)  # ceiling 0.1 s
    source = _Scripted()
    watchdog = Watchdog(source, config)  # type: ignore[arg-type]
    source.watchdog = watchdog
    bus = RecordingBus()
    async with anyio.create_task_group() as tg:
        await tg.start(watchdog.run, bus)
        await wait_until(lambda: len(source.reads) >= 7)
        source.busy = True
        busy_from = len(source.reads)
        await wait_until(lambda: len(source.reads) >= busy_from + 3)
        source.busy = False
        idle_from = len(source.reads)
        await wait_until(lambda: len(source.reads) >= idle_from + 3)
        tg.cancel_scope.cancel()
    waits = [w for w, _, _ in source.reads]
    assert waits[:7] == [poll_ns, 2 * poll_ns, 4 * poll_ns, 8 * poll_ns, 100_000_000, 100_000_000, 100_000_000]
    # the reading after a longer wait asks the source to date a busy answer
    assert [gap for _, gap, _ in source.reads[:7]] == [False, True, True, True, True, True, True]
    # work seen: the next readings come at the poll interval again, and none asks for dating
    after = source.reads[busy_from + 1: busy_from + 3]
    assert after == [(poll_ns, False, True), (poll_ns, False, True)]
    # idle again: backing off anew from the poll interval
    assert [w for w, _, _ in source.reads[idle_from + 1: idle_from + 3]] == [2 * poll_ns, 4 * poll_ns]
    assert bus.of_type(WatchdogStalled) == []


def _idle_metrics() -> bytes:
    return metrics_text(series={"": (10.0, 0.0)})


def _busy_metrics() -> bytes:
    return metrics_text(series={"": (10.0, 1.0)})


def _serve(srv: ScriptedHTTP, body: list[bytes], release: threading.Event) -> None:
    srv.route("/metrics", lambda _req: (200, {}, body[0]))

    def hang(_req: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        release.wait(60)  # the server read the request and does not answer
        return 200, {}, b""

    srv.route("/hang", hang)


@pytest.fixture
def client_port() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _send_request(port: int, procs: list[subprocess.Popen[str]]) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _CLIENT, str(port)], stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == "sent\n"


async def test_a_busy_scrape_after_an_idle_gap_is_dated_from_the_open_request(client_port: list[subprocess.Popen[str]]) -> None:
    """The gauges say busy at the first scrape after the gap; the request the server holds open
    was received 1 s before it: that reading's clock starts then (a scrape at the poll interval
    dates nothing, as before)."""
    body = [_idle_metrics()]
    release = threading.Event()
    with scripted_http() as srv:
        _serve(srv, body, release)
        port = int(srv.base.rsplit(":", 1)[1])
        source = PrometheusStepSource(srv.base + "/metrics", preset="sglang", timeout_s=5.0, open_requests=True,
                                      open_request_idle_reuse_s=60.0)
        try:
            first = await source.read_series()
            sent_after_ns = time.monotonic_ns()
            await anyio.to_thread.run_sync(_send_request, port, client_port)
            sent_before_ns = time.monotonic_ns()
            await anyio.sleep(1.0)
            body[0] = _busy_metrics()
            plain = await source.read_series()
            dated = await source.read_series(after_idle_gap=True)
        finally:
            release.set()
            await source.aclose()
    assert first is not None and [r.busy for r in first] == [False]
    assert plain is not None and [(r.busy, r.busy_since_ns) for r in plain] == [(True, None)]
    assert dated is not None and [r.busy for r in dated] == [True]
    since = dated[0].busy_since_ns
    assert since is not None
    # the kernel's receive time (ms resolution), not the scrape's, a second later
    assert sent_after_ns - 50_000_000 <= since <= sent_before_ns + 50_000_000, (since, sent_after_ns, sent_before_ns)
    assert dated[0].read_monotonic_ns - since >= 900_000_000


async def test_a_hang_after_an_idle_spell_is_a_stall_one_timeout_after_the_request_arrived(
    client_port: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog backed off to 1 s between scrapes (half of its 2 s timeout here, to make the
    gap large); a request arrives right after a scrape and the server hangs on it: the stall
    counts from when the kernel received the request, not from the scrape that saw it a second
    later, and it fires no earlier than one timeout after that."""
    monkeypatch.setattr(watchdog_module, "IDLE_POLL_TIMEOUT_SHARE", 0.5)
    timeout_s = 2.0
    body = [_idle_metrics()]
    release = threading.Event()
    bus = RecordingBus()
    with scripted_http() as srv:
        _serve(srv, body, release)
        port = int(srv.base.rsplit(":", 1)[1])
        source = PrometheusStepSource(srv.base + "/metrics", preset="sglang", timeout_s=5.0, open_requests=True,
                                      open_request_idle_reuse_s=timeout_s / 4)
        watchdog = Watchdog(source, WatchdogConfig(timeout_s=timeout_s, poll_interval_s=0.05))
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(watchdog.run, bus)
                await wait_until(lambda: watchdog.next_wait_ns == 1_000_000_000)  # backed off to the ceiling
                scrapes = srv.count("/metrics")
                await wait_until(lambda: srv.count("/metrics") > scrapes, every_s=0.002)  # just scraped
                sending_ns = time.time_ns()
                await anyio.to_thread.run_sync(_send_request, port, client_port)
                sent_ns = time.time_ns()  # the request went out in between (a Python start)
                body[0] = _busy_metrics()  # the server counts it running, and takes no step
                await wait_until(lambda: bus.of_type(WatchdogStalled))
                fired_ns = time.time_ns()
                tg.cancel_scope.cancel()
        finally:
            release.set()
            await source.aclose()
    (stall,) = bus.of_type(WatchdogStalled)
    since_ns = stall.time_unix_nano - int(stall.stalled_for_s * 1e9)
    assert fired_ns - since_ns >= timeout_s * 1e9  # never early
    # the clock started at the request (the kernel's ms), not at the scrape ~1 s after the last
    assert sending_ns - 50_000_000 <= since_ns <= sent_ns + 50_000_000, ((since_ns - sending_ns) / 1e9, (sent_ns - sending_ns) / 1e9)
    assert stall.stalled_for_s >= timeout_s
