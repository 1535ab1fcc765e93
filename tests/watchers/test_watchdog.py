"""The stall watchdog against a real stepping subprocess whose /health keeps answering 200."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import httpx
import pydantic
import pytest

from agent.model.bus import RecordingBus
from agent.model.events import WatchdogRearmed, WatchdogStalled
from agent.watchers.steps import PrometheusStepSource, ShmStepSource, StepReading, StepSource
from agent.watchers.watchdog import SERIES_FORGET_READINGS, Watchdog, WatchdogConfig
from tests.programs import fake_server
from tests.programs.fake_server import FakeServer
from tests.watchers import server_env, wait_until

TIMEOUT_S = 0.5
CONFIG = WatchdogConfig(timeout_s=TIMEOUT_S, poll_interval_s=0.1)


async def _control(server: FakeServer, **settings: object) -> None:
    await anyio.to_thread.run_sync(lambda: server.control(**settings))


async def _health_status(server: FakeServer) -> int:
    async with httpx.AsyncClient(trust_env=False) as client:
        return (await client.get(server.health_url, timeout=5)).status_code


async def test_stall_fires_once_when_frozen_with_work_pending_and_health_is_200(spawn, tmp_path: Path) -> None:
    server = fake_server.start(spawn, "--freeze-after-steps", "20", env=server_env(tmp_path))
    source = ShmStepSource(server.pid, directory=tmp_path)
    bus = RecordingBus()
    watchdog = Watchdog(source, CONFIG)
    async with anyio.create_task_group() as tg:
        await tg.start(watchdog.run, bus)
        await wait_until(lambda: bus.of_type(WatchdogStalled))
        fired_at_ns = time.monotonic_ns()
        assert await _health_status(server) == 200  # the health check alone would never see it
        await anyio.sleep(4 * TIMEOUT_S)  # still frozen: no second report
        tg.cancel_scope.cancel()

    reading = source.read_now()
    assert reading is not None and reading.last_progress_monotonic_ns is not None
    (stall,) = bus.of_type(WatchdogStalled)
    assert stall.pid == server.pid
    assert stall.forward_ct == reading.forward_ct >= 20
    assert stall.timeout_s == TIMEOUT_S
    assert stall.counter_source == "shm"
    assert stall.source == "watchdog"
    assert stall.stalled_for_s >= TIMEOUT_S
    # never early: measured against the exact last-step time
    assert fired_at_ns - reading.last_progress_monotonic_ns >= TIMEOUT_S * 1e9
    assert watchdog.stalled and watchdog.stalls == 1
    assert bus.of_type(WatchdogRearmed) == []


async def test_stall_rearms_after_progress_and_fires_again(spawn, tmp_path: Path) -> None:
    server = fake_server.start(spawn, env=server_env(tmp_path))
    source = ShmStepSource(server.pid, directory=tmp_path)
    bus = RecordingBus()
    watchdog = Watchdog(source, CONFIG)
    async with anyio.create_task_group() as tg:
        await tg.start(watchdog.run, bus)
        await wait_until(lambda: (r := source.read_now()) is not None and r.forward_ct > 0)
        await _control(server, mode="freeze")
        await wait_until(lambda: len(bus.of_type(WatchdogStalled)) == 1)
        await _control(server, mode="run")
        await wait_until(lambda: bus.of_type(WatchdogRearmed))
        assert not watchdog.stalled
        await _control(server, mode="freeze")
        await wait_until(lambda: len(bus.of_type(WatchdogStalled)) == 2)
        tg.cancel_scope.cancel()

    first, rearmed, second = [e for e in bus.events if isinstance(e, (WatchdogStalled, WatchdogRearmed))]
    assert isinstance(first, WatchdogStalled) and isinstance(second, WatchdogStalled)
    assert isinstance(rearmed, WatchdogRearmed)
    assert first.forward_ct < rearmed.forward_ct <= second.forward_ct
    assert rearmed.pid == server.pid
    assert watchdog.stalls == 2


async def test_no_stall_during_warmup_before_the_first_step(spawn, tmp_path: Path) -> None:
    server = fake_server.start(spawn, "--warmup-s", "60", env=server_env(tmp_path))
    source = ShmStepSource(server.pid, directory=tmp_path)
    bus = RecordingBus()
    async with anyio.create_task_group() as tg:
        await tg.start(Watchdog(source, CONFIG).run, bus)
        await wait_until(lambda: source.read_now() is not None)
        await anyio.sleep(5 * TIMEOUT_S)
        reading = source.read_now()
        tg.cancel_scope.cancel()
    assert reading is not None and reading.busy and reading.forward_ct == 0  # pending, no step
    assert bus.of_type(WatchdogStalled) == []


async def test_idle_server_never_stalls_and_the_clock_restarts_when_work_arrives(spawn, tmp_path: Path) -> None:
    server = fake_server.start(spawn, env=server_env(tmp_path))
    source = ShmStepSource(server.pid, directory=tmp_path)
    bus = RecordingBus()
    async with anyio.create_task_group() as tg:
        await tg.start(Watchdog(source, CONFIG).run, bus)
        await wait_until(lambda: (r := source.read_now()) is not None and r.forward_ct > 0)
        await _control(server, mode="idle")
        await wait_until(lambda: (r := source.read_now()) is not None and not r.busy)
        await anyio.sleep(5 * TIMEOUT_S)  # idle for many timeouts since the last step
        assert bus.of_type(WatchdogStalled) == []
        last = source.read_now()
        # work arrives and the very next forward hangs: a stall, timed from when it got busy
        busy_from_ns = time.monotonic_ns()
        await _control(server, mode="freeze")
        await wait_until(lambda: bus.of_type(WatchdogStalled))
        fired_at_ns = time.monotonic_ns()
        tg.cancel_scope.cancel()
    assert last is not None
    (stall,) = bus.of_type(WatchdogStalled)
    assert stall.forward_ct == last.forward_ct  # no step since the idle spell
    assert fired_at_ns - busy_from_ns >= TIMEOUT_S * 1e9  # not fired off the pre-idle step time
    # and its length counts from when work was pending, not from the step before the idle spell
    assert stall.stalled_for_s <= (fired_at_ns - busy_from_ns) / 1e9, stall


async def test_stall_and_rearm_with_the_prometheus_source(spawn, tmp_path: Path) -> None:
    server = fake_server.start(spawn, env=server_env(tmp_path))
    source: StepSource = PrometheusStepSource(server.metrics_url, preset="sglang", timeout_s=2.0)
    bus = RecordingBus()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(Watchdog(source, CONFIG).run, bus)
            await wait_until(lambda: ShmStepSource(server.pid, directory=tmp_path).read_now() is not None)
            await _control(server, mode="freeze")
            await wait_until(lambda: bus.of_type(WatchdogStalled))
            await _control(server, mode="run")
            await wait_until(lambda: bus.of_type(WatchdogRearmed))
            tg.cancel_scope.cancel()
    finally:
        await source.aclose()
    (stall,) = bus.of_type(WatchdogStalled)
    assert stall.pid is None
    assert stall.counter_source == "prometheus"
    assert stall.stalled_for_s >= TIMEOUT_S
    assert stall.forward_ct > 0


async def test_a_profile_of_the_server_by_url_pauses_its_prometheus_stall_rule_then_a_fresh_clock(
    spawn, tmp_path: Path
) -> None:
    """``servewatch profile --url`` (vLLM writes its trace for ~20 s and takes no step meanwhile)
    is recorded for the server's port: the stall rule over that server's ``/metrics`` is paused
    while the window lasts, and the stall still there after it fires one full timeout after the
    window ended, not at once."""
    from urllib.parse import urlsplit

    from agent.host.ownactions import OwnActionLog

    server = fake_server.start(spawn, env=server_env(tmp_path))
    source: StepSource = PrometheusStepSource(server.metrics_url, preset="sglang", timeout_s=2.0)
    (tmp_path / "data" / "h").mkdir(parents=True)
    profiler = OwnActionLog(tmp_path / "data", "h")  # as the `servewatch profile` process writes it
    watchdog = Watchdog(source, CONFIG, own_actions=OwnActionLog(tmp_path / "data", "h"))
    bus = RecordingBus()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(watchdog.run, bus)
            await wait_until(lambda: ShmStepSource(server.pid, directory=tmp_path).read_now() is not None)
            port = urlsplit(server.metrics_url).port
            with profiler.window("profile", port=port, bound_s=60, detail="5 step(s), vllm"):
                await _control(server, mode="freeze")  # the server writes its trace: no step
                await anyio.sleep(6 * TIMEOUT_S)
                assert not bus.of_type(WatchdogStalled)
                assert watchdog.paused_by is not None and watchdog.pauses == 1
            ended_ns = time.monotonic_ns()
            await wait_until(lambda: bus.of_type(WatchdogStalled))
            fired_ns = time.monotonic_ns()
            tg.cancel_scope.cancel()
    finally:
        await source.aclose()
    assert fired_ns - ended_ns >= TIMEOUT_S * 1e9
    paused = [e for e in bus.events if getattr(e, "watcher", "") == f"stall prometheus port {port}"]
    assert [e.state for e in paused] == ["waiting", "ready"]
    assert paused[0].reason.startswith(f"stall rule paused for prometheus port {port}: servewatch profile running (pid ")


def test_watchdog_config_defaults_and_signal_validation() -> None:
    config = WatchdogConfig()
    assert (config.timeout_s, config.hard, config.signal) == (300.0, False, "SIGABRT")
    assert config.signal_number == signal.SIGABRT
    assert WatchdogConfig(signal="kill").signal == "SIGKILL"
    assert WatchdogConfig(signal="sigterm").signal_number == signal.SIGTERM
    with pytest.raises(pydantic.ValidationError, match="signal"):
        WatchdogConfig(signal="SIGNOPE")
    with pytest.raises(pydantic.ValidationError, match="timeout_s"):
        WatchdogConfig(timeout_s=0)


class _ChurningSource:
    """Prometheus-like source double: one steady series that never progresses after its first
    step (idle until ``busy`` is set), and a new idle label set at every reading (labels that
    come and go)."""

    name = "prometheus"
    exact = False
    pid = None

    def __init__(self) -> None:
        self.reads = 0
        self.tracked: list[int] = []
        self.watchdog: Watchdog | None = None
        self.started_ns = time.monotonic_ns()
        self.busy = False

    async def read_series(self) -> list[StepReading]:
        self.reads += 1
        if self.watchdog is not None:
            self.tracked.append(self.watchdog.tracked_series)
        now = time.monotonic_ns()
        return [
            StepReading(forward_ct=5, busy=self.busy, last_progress_monotonic_ns=self.started_ns, pid=None,
                        read_monotonic_ns=now, series='engine="steady"'),
            StepReading(forward_ct=1, busy=False, last_progress_monotonic_ns=now, pid=None,
                        read_monotonic_ns=now, series=f'engine="r{self.reads}"'),
        ]

    async def read(self) -> StepReading | None:
        raise AssertionError("the watchdog reads per series")


async def test_watchdog_forgets_series_that_went_away_and_still_fires_for_the_steady_one() -> None:
    source = _ChurningSource()
    watchdog = Watchdog(source, WatchdogConfig(timeout_s=TIMEOUT_S, poll_interval_s=0.001))  # type: ignore[arg-type]
    source.watchdog = watchdog
    bus = RecordingBus()
    async with anyio.create_task_group() as tg:
        await tg.start(watchdog.run, bus)
        await wait_until(lambda: source.reads >= 3 * SERIES_FORGET_READINGS)
        assert not bus.of_type(WatchdogStalled)
        source.busy = True  # work arrives and the steady series makes no step: a stall of it
        await wait_until(lambda: bus.of_type(WatchdogStalled))
        tg.cancel_scope.cancel()
    assert max(source.tracked) == SERIES_FORGET_READINGS + 1
    (stall,) = bus.of_type(WatchdogStalled)
    assert stall.series == 'engine="steady"'


class _HungBeforeTheAgentStarted:
    """SDK-counter-like source double: its last step was 50 s before the watchdog's first reading,
    and work has been pending since (an agent started long after the hang)."""

    name = "shm"
    exact = True
    pid = 4242

    def __init__(self) -> None:
        self.last_step_ns = time.monotonic_ns() - 50 * 10**9

    async def read(self) -> StepReading | None:
        return StepReading(forward_ct=7, busy=True, last_progress_monotonic_ns=self.last_step_ns, pid=self.pid,
                           read_monotonic_ns=time.monotonic_ns())


async def test_an_agent_started_after_the_hang_says_how_long_since_the_last_step() -> None:
    """Before: "no forward progress for 0.5 s" (the rule's own clock, started at the first
    reading); the counter's exact last-step time says 50 s."""
    source = _HungBeforeTheAgentStarted()
    bus = RecordingBus()
    async with anyio.create_task_group() as tg:
        await tg.start(Watchdog(source, CONFIG).run, bus)  # type: ignore[arg-type]
        await wait_until(lambda: bus.of_type(WatchdogStalled))
        tg.cancel_scope.cancel()
    (stall,) = bus.of_type(WatchdogStalled)
    assert 50.0 <= stall.stalled_for_s < 80.0, stall.stalled_for_s
    assert f"no forward progress for {stall.stalled_for_s:.1f}s" in stall.describe(), stall.describe()
