"""Watcher status (ready / waiting / blind) against real HTTP servers: every blind case is
reported at the first probe or scrape that shows it, bodies are read with a cap, the status
board and its file, and per-series progress of labelled Prometheus counters."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import anyio
import pytest

from agent.model.bus import RecordingBus
from agent.model.events import WatchdogStalled, WatcherStatusChanged
from agent.watchers.health import HealthConfig, HealthWatcher
from agent.watchers.status import (
    STATUS_SCHEMA,
    StatusBoard,
    StatusSnapshot,
    WatcherState,
    WatcherStatus,
    read_status_file,
    status_path,
)
from agent.watchers.steps import PrometheusStepSource
from agent.watchers.watchdog import Watchdog, WatchdogConfig
from tests.watchers import wait_until
from tests.watchers.scripted_http import endless, metrics_text, scripted_http


def _statuses(bus: RecordingBus, name: str) -> list[WatcherStatusChanged]:
    return [e for e in bus.of_type(WatcherStatusChanged) if e.watcher == name]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the model ---------------------------------------------------------------------------------


def test_status_board_logs_changes_once_and_writes_an_atomic_status_file(tmp_path: Path) -> None:
    seen: list[WatcherStatus] = []
    path = status_path(tmp_path, "h1")
    board = StatusBoard(host_name="h1", path=path, on_change=seen.append)
    assert board.set("health", WatcherState.WAITING, "waiting for first 200 from http://x/health")
    assert not board.set("health", WatcherState.WAITING, "waiting for first 200 from http://x/health")
    assert board.set("metrics", WatcherState.BLIND, "401 Unauthorized from http://x/metrics")
    assert [s.line() for s in seen] == [
        "health: waiting for first 200 from http://x/health",
        "metrics: BLIND — 401 Unauthorized from http://x/metrics",
    ]
    snap = read_status_file(path)
    assert snap.host_name == "h1" and snap.get("metrics").state is WatcherState.BLIND
    assert [w.name for w in snap.blind] == ["metrics"]
    raw = json.loads(path.read_text())
    assert raw["schema"] == STATUS_SCHEMA and raw["watchers"][0]["state"] == "waiting"
    assert StatusSnapshot.from_json(raw) == snap
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".swtmp")]
    with pytest.raises(ValueError):
        StatusSnapshot.from_json({"schema": "other"})


# --- health -------------------------------------------------------------------------------------


async def _health_statuses(url: str, until: int = 1, **cfg: object) -> tuple[list[WatcherStatusChanged], HealthWatcher]:
    bus = RecordingBus()
    watcher = HealthWatcher(HealthConfig(url=url, interval_s=0.1, timeout_s=2.0, **cfg))
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run, bus)
        await wait_until(lambda: watcher.probes >= until and len(_statuses(bus, "health")) >= 2)
        tg.cancel_scope.cancel()
    return _statuses(bus, "health"), watcher


async def test_health_refused_is_blind_at_the_first_probe_not_a_silent_wait() -> None:
    url = f"http://127.0.0.1:{_free_port()}/health"
    statuses, watcher = await _health_statuses(url)
    assert statuses[0].state == "waiting" and "waiting for first 200" in statuses[0].reason
    assert statuses[1].state == "blind" and "connection refused" in statuses[1].reason
    assert watcher.probes == 1  # reported by the very first probe


@pytest.mark.parametrize(("code", "words"), [(401, "401 Unauthorized"), (403, "403 Forbidden"), (404, "404 Not Found")])
async def test_health_401_403_404_are_blind(code: int, words: str) -> None:
    with scripted_http() as srv:
        srv.route("/health", (code, {}, b""))
        statuses, _ = await _health_statuses(srv.base + "/health")
    assert statuses[1].state == "blind" and words in statuses[1].reason
    assert srv.count("/health") == 1


async def test_health_503_while_loading_is_waiting_then_200_is_ready() -> None:
    with scripted_http() as srv:
        answers = iter([503, 503])
        srv.route("/health", lambda _r: (next(answers, 200), {}, b""))
        bus = RecordingBus()
        watcher = HealthWatcher(HealthConfig(url=srv.base + "/health", interval_s=0.05, timeout_s=2.0))
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run, bus)
            await wait_until(lambda: any(s.state == "ready" for s in _statuses(bus, "health")))
            tg.cancel_scope.cancel()
    states = [(s.state, s.reason) for s in _statuses(bus, "health")]
    assert states[1][0] == "waiting" and "503 Service Unavailable" in states[1][1] and "up to 1800 s" in states[1][1]
    assert states[-1] == ("ready", f"200 OK from {srv.base}/health")
    assert len(states) == 3  # the second 503 changed nothing: no repeated log line


async def test_an_endless_health_answer_costs_bounded_memory() -> None:
    with scripted_http() as srv:
        srv.route("/health", (200, {}, endless()))
        bus = RecordingBus()
        watcher = HealthWatcher(HealthConfig(url=srv.base + "/health", interval_s=0.1, timeout_s=5.0))
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run, bus)
            await wait_until(lambda: watcher.probes >= 3)
            tg.cancel_scope.cancel()
        sent = srv.bytes_sent.get("/health", 0)
    assert watcher.ready and watcher.healthy
    # 64 KiB read per probe; what the server pushed beyond it sat in socket buffers
    assert sent < 3 * 16 * 1024 * 1024, sent


# --- metrics ------------------------------------------------------------------------------------


async def _metrics_blind(srv_base: str, **source_kwargs: object) -> tuple[list[WatcherStatusChanged], PrometheusStepSource]:
    bus = RecordingBus()
    source = PrometheusStepSource(srv_base + "/metrics", timeout_s=5.0, **source_kwargs)  # type: ignore[arg-type]
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(Watchdog(source, WatchdogConfig(timeout_s=5.0, poll_interval_s=0.2)).run, bus)
            await wait_until(lambda: len(_statuses(bus, "metrics")) >= 2)
            tg.cancel_scope.cancel()
    finally:
        await source.aclose()
    return _statuses(bus, "metrics"), source


@pytest.mark.parametrize(("code", "words"), [(401, "401 Unauthorized"), (403, "403 Forbidden"), (404, "404 Not Found")])
async def test_metrics_401_403_404_are_blind_at_the_first_scrape(code: int, words: str) -> None:
    with scripted_http() as srv:
        srv.route("/metrics", (code, {}, b"denied"))
        statuses, _ = await _metrics_blind(srv.base)
        assert srv.count("/metrics") == 1
    assert statuses[0].state == "waiting"
    assert statuses[1].state == "blind" and words in statuses[1].reason


async def test_metrics_refused_is_blind() -> None:
    statuses, _ = await _metrics_blind(f"http://127.0.0.1:{_free_port()}")
    assert statuses[1].state == "blind" and "connection refused" in statuses[1].reason


async def test_wrong_preset_names_the_expected_metrics_and_similar_ones_that_exist() -> None:
    with scripted_http() as srv:
        # a vLLM server watched with the (default) sglang preset
        srv.route("/metrics", (200, {}, metrics_text("vllm:generation_tokens_total", "vllm:num_requests_running")))
        statuses, _ = await _metrics_blind(srv.base, preset="sglang")
    blind = statuses[1]
    assert blind.state == "blind"
    assert (
        "sglang:cuda_graph_passes_total (or sglang:realtime_tokens_total, sglang:generation_tokens_total)"
        " and sglang:num_running_reqs absent"
    ) in blind.reason
    assert "similar names there: vllm:generation_tokens_total" in blind.reason
    assert "preset sglang" in blind.reason


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"counter_value": "NaN"}, "counter sglang:generation_tokens_total is NaN"),
        ({"counter_value": "+Inf"}, "counter sglang:generation_tokens_total is +Inf"),
        ({"gauge_value": "+Inf"}, "gauge sglang:num_running_reqs + sglang:num_queue_reqs is +Inf"),
        ({"counter_value": "1e300"}, "counter sglang:generation_tokens_total overflows"),
    ],
)
async def test_nan_inf_and_overflowing_values_are_blind_never_a_crash(kwargs: dict[str, str], words: str) -> None:
    with scripted_http() as srv:
        srv.route("/metrics", (200, {}, metrics_text(**kwargs)))
        statuses, source = await _metrics_blind(srv.base)
    assert statuses[1].state == "blind" and words in statuses[1].reason
    assert source.failed_scrapes >= 1


async def test_an_endless_metrics_answer_is_blind_and_costs_bounded_memory() -> None:
    with scripted_http() as srv:
        srv.route("/metrics", (200, {}, endless()))
        statuses, _ = await _metrics_blind(srv.base)
        sent = srv.bytes_sent.get("/metrics", 0)
    assert statuses[1].state == "blind" and "larger than 8 MiB" in statuses[1].reason
    assert sent < 64 * 1024 * 1024, sent


async def test_good_metrics_are_waiting_until_progress_then_ready() -> None:
    with scripted_http() as srv:
        values = iter([0.0, 0.0, 5.0])
        srv.route("/metrics", lambda _r: (200, {}, metrics_text(series={"": (next(values, 9.0), 0.0)})))
        bus = RecordingBus()
        source = PrometheusStepSource(srv.base + "/metrics")
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(Watchdog(source, WatchdogConfig(timeout_s=5.0, poll_interval_s=0.05)).run, bus)
                await wait_until(lambda: any(s.state == "ready" for s in _statuses(bus, "metrics")))
                tg.cancel_scope.cancel()
        finally:
            await source.aclose()
    states = [s.state for s in _statuses(bus, "metrics")]
    assert states == ["waiting", "waiting", "ready"]
    assert "no forward progress yet" in _statuses(bus, "metrics")[1].reason


# --- per-series progress ---------------------------------------------------------------------------


async def test_one_stuck_vllm_engine_is_a_stall_of_that_engine() -> None:
    """engine 0 progresses, engine 1 is busy and frozen: the sum grows, yet engine 1 stalled."""
    with scripted_http() as srv:
        state = {"n": 0}

        def answer(_r: object) -> tuple[int, dict[str, str], bytes]:
            state["n"] += 1
            series = {'engine="0"': (100.0 + state["n"], 1.0), 'engine="1"': (50.0, 2.0)}
            return 200, {}, metrics_text("vllm:generation_tokens_total", "vllm:num_requests_running", series)

        srv.route("/metrics", answer)
        bus = RecordingBus()
        source = PrometheusStepSource(srv.base + "/metrics", preset="vllm")
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(Watchdog(source, WatchdogConfig(timeout_s=0.5, poll_interval_s=0.05)).run, bus)
                await wait_until(lambda: bus.of_type(WatchdogStalled))
                tg.cancel_scope.cancel()
        finally:
            await source.aclose()
    (stall,) = bus.of_type(WatchdogStalled)
    assert stall.series == 'engine="1"'
    assert stall.forward_ct == 50 and stall.stalled_for_s >= 0.5


async def test_a_counter_going_backwards_is_a_restart_not_progress() -> None:
    with scripted_http() as srv:
        values = iter([100.0, 120.0, 3.0])
        srv.route("/metrics", lambda _r: (200, {}, metrics_text(series={"": (next(values, 3.0), 1.0)})))
        bus = RecordingBus()
        source = PrometheusStepSource(srv.base + "/metrics")
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(Watchdog(source, WatchdogConfig(timeout_s=0.3, poll_interval_s=0.05)).run, bus)
                await wait_until(lambda: srv.count("/metrics") >= 20)
                tg.cancel_scope.cancel()
        finally:
            await source.aclose()
    # after the restart the counter sits at 3 while busy: warm-up of the new process, no stall
    assert bus.of_type(WatchdogStalled) == []
    assert source.restarts == 1
    assert any("went backwards" in s.reason and s.state == "waiting" for s in _statuses(bus, "metrics"))


def test_parse_keeps_label_sets_apart() -> None:
    source = PrometheusStepSource("http://127.0.0.1:1/metrics", preset="vllm")
    parsed = source.parse_series(
        metrics_text("vllm:generation_tokens_total", "vllm:num_requests_running",
                     {'engine="0"': (5.0, 1.0), 'engine="1"': (7.0, 0.0)}).decode()
    )
    assert parsed is not None
    counters, gauges = parsed
    assert counters == {(("engine", "0"),): 5.0, (("engine", "1"),): 7.0}
    assert gauges[(("engine", "1"),)] == 0.0
    assert not math.isnan(sum(counters.values()))


def test_watcher_status_is_an_otel_gauge_per_watcher_and_state(tmp_path: Path) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from exporters.otlp.metrics import Metrics

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    try:
        board = StatusBoard(host_name="h1")
        board.set("metrics", WatcherState.BLIND, "401 Unauthorized")
        board.set("health", WatcherState.READY, "200 OK")
        metrics = Metrics(provider)
        metrics.watch_status(board.states)
        data = reader.get_metrics_data()
        points = {
            (p.attributes["servewatch.watcher"], p.attributes["servewatch.watcher.state"]): p.value
            for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
            if m.name == "servewatch.watcher.status" for p in m.data.data_points
        }
    finally:
        provider.shutdown()
    assert points[("metrics", "blind")] == 1 and points[("metrics", "ready")] == 0
    assert points[("health", "ready")] == 1 and points[("health", "blind")] == 0


def test_a_stall_incident_names_the_series() -> None:
    from agent.incidents.manager import IncidentConfig, IncidentManager
    from agent.model.events import WatchdogStalled

    manager = IncidentManager(bus=RecordingBus(), config=IncidentConfig(), data_dir=Path("."), host_name="h", discover=list)
    trigger, _, detail = manager.classify(
        WatchdogStalled(pid=None, forward_ct=50, stalled_for_s=6.0, timeout_s=5.0, series='engine="1"')
    )
    assert trigger == "stall" and 'series {engine="1"}' in detail


@pytest.mark.parametrize("module_name", ["agent.watchers.status", "agent.model.progress"])
def test_all_lists_exactly_the_public_names(module_name: str) -> None:
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    public = {
        n for n, v in vars(module).items()
        if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v) or n.isupper())
        and getattr(v, "__module__", module_name) == module_name
    }
    assert public <= set(module.__all__)
    assert all(hasattr(module, n) for n in module.__all__)


async def test_refused_while_a_launched_server_starts_is_waiting_not_blind() -> None:
    # `launch` starts the server itself: nothing listening yet is start-up, not a wrong address
    url = f"http://127.0.0.1:{_free_port()}/health"
    statuses, watcher = await _health_statuses(url, until=3, refused_grace_s=60.0)
    assert watcher.probes >= 3
    assert [s.state for s in statuses] == ["waiting", "waiting"]
    assert "server starting: nothing listens at" in statuses[1].reason and "up to 60 s" in statuses[1].reason
    # the same grace on /metrics; without it, the first refused scrape is blind
    port = _free_port()
    starting = PrometheusStepSource(f"http://127.0.0.1:{port}/metrics", timeout_s=2.0, refused_grace_s=60.0)
    plain = PrometheusStepSource(f"http://127.0.0.1:{port}/metrics", timeout_s=2.0)
    try:
        assert await starting.read_series() is None and await plain.read_series() is None
        state, reason = starting.status()
        assert state == "waiting" and "server starting" in reason
        assert plain.status()[0] == "blind" and "connection refused" in plain.status()[1]
    finally:
        await starting.aclose()
        await plain.aclose()


def test_metrics_url_without_scheme_is_refused_at_start(tmp_path) -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "agent.cli.app", "run", "--metrics-url", "127.0.0.1:30000/metrics", "--data-dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "servewatch: invalid value for --metrics-url: expected an http(s):// URL, got '127.0.0.1:30000/metrics'; see 'servewatch run --help'"
    ]
