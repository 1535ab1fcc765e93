"""The periodic loops' shared tick (agent.model.ticks): loops whose periods divide one another
wake in the same event-loop iteration."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from agent.model.ticks import until_tick


def test_the_wait_ends_on_the_next_multiple_of_the_period() -> None:
    assert until_tick(0.25, 100.0) == 0.25  # on a tick: a whole period, never 0
    assert until_tick(0.25, 100.1) == pytest.approx(0.15)
    assert until_tick(2.0, 101.5) == pytest.approx(0.5)
    assert until_tick(1.0, 7.999) == pytest.approx(0.001)
    with pytest.raises(ValueError, match="period_s"):
        until_tick(0.0, 1.0)


async def test_loops_on_the_shared_tick_wake_together() -> None:
    """Four loops (periods 0.05, 0.05, 0.1 and 0.2 s) started at different moments, each
    sleeping until its tick, wake together: the slower loops' wakes fall (median) within 4 ms
    of one of the fast loop's (with ``sleep(period)`` each would keep its own phase, 9-21 ms
    off the fast loop's), so the event loop runs each tick's timers in one pass."""
    loop = asyncio.get_running_loop()
    woken: list[list[float]] = [[], [], [], []]

    async def ticking(delay_s: float, period_s: float, times: list[float]) -> None:
        await anyio.sleep(delay_s)
        while True:
            await anyio.sleep(until_tick(period_s, anyio.current_time()))
            times.append(loop.time())

    async with anyio.create_task_group() as tg:
        for delay_s, period_s, times in zip((0.0, 0.013, 0.029, 0.041), (0.05, 0.05, 0.1, 0.2), woken, strict=True):
            tg.start_soon(ticking, delay_s, period_s, times)
        await anyio.sleep(1.2)
        tg.cancel_scope.cancel()
    fast = woken[0]
    for times in woken[1:]:
        assert times
        # the median, not every wake: on a loaded host the OS may preempt the loop between two
        # callbacks of one iteration, which delays one reading, not the phase of the loop
        gaps = sorted(min(abs(t - f) for f in fast) for t in times)
        assert gaps[len(gaps) // 2] < 0.004, [round(t % 0.05, 4) for t in times]
    assert len(woken[3]) >= 4 and len(woken[2]) >= 9
