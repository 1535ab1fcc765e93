"""Feeding bus events to the exporters (the span mirror, a plugin's journal, a test's recorder).

Owns :func:`subscribe_mirrors` (one bounded subscription per exporter) and :func:`mirror_events`:
an :class:`exporters.Exporter` (``events``, the event types it mirrors, and ``handle(event)``)
gets each of them in bus order, off the event loop unless it says ``handles_on_loop = True``;
what is still buffered when the feed is cancelled is handed over anyway, then its
``close_open(reason=...)`` runs (when it has one: the mirror gives incidents left open their root
span), so nothing already captured is lost from the trace. Imports anyio and
:mod:`agent.model.bus`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from agent.model.bus import EventBus, Subscription
from exporters import Exporter

__all__ = ["mirror_events", "subscribe_mirrors"]


def subscribe_mirrors(bus: EventBus, exporters: Mapping[str, Exporter], *, max_buffer: int) -> list[tuple[Exporter, Subscription]]:
    """A bounded bus subscription, named after it, for every exporter with event types to mirror."""
    return [
        (exporter, bus.subscribe(*exporter.events, name=name, max_buffer=max_buffer))
        for name, exporter in exporters.items()
        if exporter.events
    ]


def _drain(sub: Subscription) -> list[Any]:
    pending = []
    while True:
        try:
            pending.append(sub.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return pending


async def mirror_events(exporter: Exporter, sub: Subscription) -> None:
    """Feed bus events to ``exporter`` until the bus closes and drains (see the module docstring)."""
    # handle() is file and CPU work (the span mirror writes spans write-ahead and imports a
    # profile's torch trace): kept off the event loop, one event at a time. An exporter whose
    # handle() touches loop-bound state says so with ``handles_on_loop = True``.
    off_loop = not getattr(exporter, "handles_on_loop", False)
    try:
        async for event in sub:
            if off_loop:
                await anyio.to_thread.run_sync(exporter.handle, event)
            else:
                exporter.handle(event)
    finally:
        pending = _drain(sub)

        def flush() -> None:
            for event in pending:
                exporter.handle(event)
            close_open = getattr(exporter, "close_open", None)
            if close_open is not None:
                close_open(reason="agent stopped")

        if off_loop:
            with anyio.CancelScope(shield=True):  # bounded: the sink's writes of what was captured
                await anyio.to_thread.run_sync(flush)
        else:
            flush()
        sub.close()
