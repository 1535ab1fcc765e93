"""One tick for the agent's periodic loops: each waits until the next multiple of its period on
the event loop's clock (:func:`until_tick`), so loops whose periods divide one another (the
py-spy scan check every 0.25 s, the watchdogs' polls and the step watchers every second,
discovery and the targets' checks every 2 s) wake in the same event-loop iteration: one
``epoll_wait`` return and one pass over the tasks due, not one of each per loop.

A loop that sleeps until its tick never waits longer than its period (the first wait is
shorter), so no reading comes later than with a plain ``sleep(period)``.

Imports the standard library only.
"""

from __future__ import annotations

__all__ = ["until_tick"]


def until_tick(period_s: float, now_s: float) -> float:
    """Seconds from ``now_s`` to the next multiple of ``period_s`` (both on one clock: the event
    loop's, ``anyio.current_time()``), in ``(0, period_s]``.

    Raises:
        ValueError: ``period_s`` is not > 0.
    """
    if period_s <= 0:
        raise ValueError(f"period_s must be > 0, got {period_s}")
    left = period_s - (now_s % period_s)
    return left if left > 0 else period_s
