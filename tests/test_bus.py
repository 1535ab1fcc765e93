"""EventBus delivery rules: high-rate events drop and count, the rest never drop; order; close."""

from __future__ import annotations

import math

import anyio
import pytest

from agent.model.bus import BusStatistics, EventBus, RecordingBus
from agent.model.events import (
    HealthCheckFailed,
    IncidentClosed,
    IncidentOpened,
    StepsAdvanced,
    WatchdogStalled,
)


def _step(n: int) -> StepsAdvanced:
    return StepsAdvanced(source="steps", pid=1, forward_ct=n, delta=1, busy=True)


def _incident(n: int) -> IncidentOpened:
    return IncidentOpened(source="incidents", incident_id=f"inc-{n}", trigger="stall")


async def test_full_subscriber_drops_and_counts_steps_without_blocking_the_publisher() -> None:
    bus = EventBus()
    slow = bus.subscribe(StepsAdvanced, max_buffer=4, name="slow")
    fast = bus.subscribe(StepsAdvanced, max_buffer=math.inf, name="fast")
    # Nobody reads "slow". Publishing 100 steps must complete without waiting on it.
    with anyio.fail_after(5):
        for n in range(50):
            bus.publish_nowait(_step(n))
        for n in range(50, 100):
            await bus.publish(_step(n))
    assert slow.dropped == 96
    assert fast.dropped == 0
    stats = bus.statistics()
    assert isinstance(stats, BusStatistics)
    assert stats == BusStatistics(published=100, delivered=104, dropped=96, subscribers=2, buffer_used=104)
    # the slow subscriber kept the oldest four; the fast one got everything, in order
    assert [slow.receive_nowait().forward_ct for _ in range(4)] == [0, 1, 2, 3]  # type: ignore[attr-defined]
    assert [fast.receive_nowait().forward_ct for _ in range(100)] == list(range(100))  # type: ignore[attr-defined]
    with pytest.raises(anyio.WouldBlock):
        slow.receive_nowait()
    await slow.aclose()
    await fast.aclose()


async def test_publish_nowait_reports_how_many_subscribers_dropped() -> None:
    bus = EventBus()
    subs = [bus.subscribe(max_buffer=1) for _ in range(3)]
    assert bus.publish_nowait(_step(0)) == 0
    assert bus.publish_nowait(_step(1)) == 3
    assert [s.dropped for s in subs] == [1, 1, 1]
    assert bus.statistics().dropped == 3
    for sub in subs:
        await sub.aclose()


async def test_incident_and_action_events_are_never_dropped_publish_waits() -> None:
    bus = EventBus()
    sub = bus.subscribe(IncidentOpened, IncidentClosed, max_buffer=1)
    await bus.publish(_incident(0))  # fills the buffer
    with anyio.move_on_after(0.2) as scope:
        await bus.publish(_incident(1))  # must wait for room, not drop
    assert scope.cancelled_caught
    assert sub.dropped == 0

    received: list[str] = []

    async def consume() -> None:
        async for event in sub:
            assert isinstance(event, (IncidentOpened, IncidentClosed))
            received.append(event.incident_id)
            await anyio.sleep(0.001)  # slower than the publisher
            if len(received) == 21:
                return

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for n in range(2, 22):
                await bus.publish(_incident(n))
    # the cancelled publish of inc-1 never got in; everything else arrived, in order, none dropped
    assert received == ["inc-0"] + [f"inc-{n}" for n in range(2, 22)]
    assert bus.statistics().dropped == 0
    await sub.aclose()


async def test_publish_nowait_refuses_events_that_must_not_drop() -> None:
    bus = EventBus()
    with pytest.raises(TypeError, match="never be dropped"):
        bus.publish_nowait(_incident(0))
    with pytest.raises(TypeError):
        bus.publish_nowait(WatchdogStalled(pid=1, forward_ct=3, stalled_for_s=1.0, timeout_s=1.0))


async def test_every_subscriber_sees_its_events_in_publish_order() -> None:
    bus = EventBus()
    everything = bus.subscribe(max_buffer=math.inf)
    incidents = bus.subscribe(IncidentOpened, max_buffer=math.inf)
    steps = bus.subscribe(StepsAdvanced, max_buffer=math.inf)
    sent = []
    for n in range(30):
        event = _step(n) if n % 3 else _incident(n)
        sent.append(event)
        await bus.publish(event)
    await bus.aclose()

    async def drain(sub) -> list:
        with anyio.fail_after(5):
            return [event async for event in sub]

    assert await drain(everything) == sent
    assert await drain(incidents) == [e for e in sent if isinstance(e, IncidentOpened)]
    assert await drain(steps) == [e for e in sent if isinstance(e, StepsAdvanced)]
    for sub in (everything, incidents, steps):
        await sub.aclose()


async def test_concurrent_subscribers_each_receive_everything_in_order() -> None:
    bus = EventBus()
    subs = [bus.subscribe(max_buffer=2, name=f"s{i}") for i in range(3)]
    got: dict[int, list[str]] = {i: [] for i in range(3)}

    async def consume(i: int) -> None:
        async for event in subs[i]:
            assert isinstance(event, IncidentOpened)
            got[i].append(event.incident_id)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(consume, i)
            for n in range(50):
                await bus.publish(_incident(n))
            await bus.aclose()
    expected = [f"inc-{n}" for n in range(50)]
    assert got == {0: expected, 1: expected, 2: expected}
    for sub in subs:
        await sub.aclose()


async def test_closing_drains_then_ends_and_unsubscribing_is_safe_twice() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    gone = bus.subscribe()
    assert bus.statistics().subscribers == 2
    await gone.aclose()
    await gone.aclose()
    assert bus.statistics().subscribers == 1
    event = _incident(1)
    await bus.publish(event)  # the closed subscription is skipped, nothing waits
    await bus.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        bus.subscribe()
    with anyio.fail_after(5):
        assert [e async for e in sub] == [event]
    with pytest.raises(anyio.EndOfStream):
        await sub.receive()
    await sub.aclose()
    with pytest.raises(ValueError, match="max_buffer"):
        EventBus().subscribe(max_buffer=0)


async def test_recording_bus_keeps_what_was_published() -> None:
    bus = RecordingBus()
    failed = HealthCheckFailed(url="u", status_code=503, latency_s=0.1, error_class="5xx", consecutive_failures=3)
    await bus.publish(failed)
    bus.publish_nowait(_step(1))
    await bus.publish(_step(2))
    assert bus.of_type(HealthCheckFailed) == [failed]
    assert [e.forward_ct for e in bus.of_type(StepsAdvanced)] == [1, 2]
    assert len(bus.events) == 3
