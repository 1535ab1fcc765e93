"""agent.incidents.history: the server's recent history kept from the bus, as incidents record it."""

from __future__ import annotations

import anyio

from agent.incidents.history import HistoryPoint, ProgressHistory, points_of
from agent.model.bus import EventBus
from agent.model.events import HealthCheckFailed, StepsAdvanced, TargetExited, WatchdogStalled

S = 1_000_000_000  # ns per second
T0 = 1_800_000_000 * S


def _step(t_s: float, pid: int, ct: int) -> StepsAdvanced:
    return StepsAdvanced(time_unix_nano=T0 + int(t_s * S), source="steps", pid=pid, forward_ct=ct, delta=1, busy=True)


def _stall(t_s: float, pid: int | None, ct: int, stalled_for_s: float = 3.0) -> WatchdogStalled:
    return WatchdogStalled(time_unix_nano=T0 + int(t_s * S), source="watchdog", pid=pid, forward_ct=ct,
                           stalled_for_s=stalled_for_s, timeout_s=3.0)


def test_the_last_step_before_a_stall_is_when_progress_stopped() -> None:
    h = ProgressHistory(steps_per_source=4)
    for i in range(10):
        h.record(_step(i * 0.5, 42, i + 1))
        h.record(_step(i * 0.5, 43, i + 1))
    cause = _stall(8.0, 42, 10)
    got = h.snapshot(until_unix_nano=T0 + 9 * S, cause=cause)
    assert [p.kind for p in got if p.pid == 42] == ["step", "step", "step", "step", "progress_stopped", "stall"]
    steps = [p for p in got if p.kind == "step" and p.pid == 42]
    assert [p.forward_ct for p in steps] == [7, 8, 9, 10]  # bounded per process: the last ones
    stopped = next(p for p in got if p.kind == "progress_stopped")
    assert stopped.time_unix_nano == T0 + int(4.5 * S) and stopped.forward_ct == 10  # the last reading, exact
    assert [p.time_unix_nano for p in got] == sorted(p.time_unix_nano for p in got)
    assert len([p for p in got if p.pid == 43]) == 4  # the other rank's steps too


def test_after_an_idle_spell_progress_stopped_is_when_work_was_pending_without_progress() -> None:
    """The rank's last step at 4.5 s, idle until work arrived at 14.5 s, the stall at 17.5 s:
    "progress stopped with work pending" is 14.5 s, not the step 10 s before the hang began."""
    h = ProgressHistory()
    for i in range(10):
        h.record(_step(i * 0.5, 42, i + 1))
    cause = _stall(17.5, 42, 10, stalled_for_s=3.0)
    got = h.snapshot(until_unix_nano=T0 + 18 * S, cause=cause)
    stopped = next(p for p in got if p.kind == "progress_stopped")
    assert (stopped.time_unix_nano, stopped.forward_ct) == (T0 + int(14.5 * S), 10)
    assert stopped.detail == ("pid 42: work pending from here and no forward step (its last step, forward_ct=10,"
                              " came 10.0 s earlier, before an idle spell)")
    assert [p.kind for p in got][-2:] == ["progress_stopped", "stall"]


def test_without_step_readings_progress_stopped_comes_from_the_stall_itself() -> None:
    h = ProgressHistory()
    got = h.snapshot(until_unix_nano=T0 + 10 * S, cause=_stall(10.0, None, 77, stalled_for_s=4.0))
    assert [(p.kind, p.time_unix_nano) for p in got] == [("progress_stopped", T0 + 6 * S), ("stall", T0 + 10 * S)]
    assert "forward_ct=77" in got[0].detail and "4.0 s" in got[1].detail


def test_facts_after_the_open_and_outside_the_window_are_left_out() -> None:
    h = ProgressHistory(window_s=60)
    h.record(_step(0.0, 1, 1))
    h.record(_step(100.0, 1, 2))
    h.record(HealthCheckFailed(time_unix_nano=T0 + 101 * S, url="u", status_code=503, latency_s=0.1, error_class="5xx",
                               consecutive_failures=3))
    h.record(_step(200.0, 1, 3))
    got = h.snapshot(until_unix_nano=T0 + 150 * S)
    assert [(p.kind, p.forward_ct) for p in got] == [("step", 2), ("health_failed", None)]
    assert "503" in got[1].detail


def test_an_exit_is_placed_at_its_exit_time() -> None:
    (p,) = points_of(TargetExited(time_unix_nano=T0 + 5 * S, pid=9, exit_code=None, signal=9, title="r1"))
    assert isinstance(p, HistoryPoint) and p.kind == "exit" and p.pid == 9 and "killed by SIGKILL" in p.detail


async def test_it_records_from_the_bus() -> None:
    bus = EventBus()
    h = ProgressHistory()
    async with anyio.create_task_group() as tg:
        await tg.start(h.run, bus)
        bus.publish_nowait(_step(1.0, 5, 1))
        await bus.publish(_stall(4.0, 5, 1))
        with anyio.fail_after(5):
            while len(h.snapshot(until_unix_nano=T0 + 5 * S)) < 3:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert [p.kind for p in h.snapshot(until_unix_nano=T0 + 5 * S)] == ["step", "progress_stopped", "stall"]
