"""What the running agent says on its status board (``servewatch status``, ``/v1/status``) about
itself: the rows no watcher owns, kept current from the bus.

Owns :class:`RunStatus`: the board fed from the watchers' and actors' status events
(:meth:`RunStatus.record`), the rows the runtime decides (``process``, ``steps``, a crashed
watcher: :meth:`RunStatus.set`), span delivery (``export``: :meth:`RunStatus.watch_delivery`), the
SDK span shipper (``spans``: :meth:`RunStatus.ship_spans`, which also heartbeats the span rings),
the incidents' state (:meth:`RunStatus.show_incidents`), the actors' startup checks
(:meth:`RunStatus.check_actors`), and which changes reach the CLI's printer (:meth:`RunStatus.changed`). Imports anyio, :mod:`agent.model.bus`, :mod:`agent.model.events` and the
status board (:mod:`agent.watchers.status`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import anyio

from agent.model.bus import EventBus, Subscription
from agent.model.events import ComponentStatus, ComponentStatusChanged, WatcherStatusChanged
from agent.model.ticks import until_tick
from agent.watchers.status import StatusBoard, WatcherState, WatcherStatus

__all__ = ["DELIVERY_STATUS_INTERVAL_S", "SPANS_HEARTBEAT_INTERVAL_S", "SPANS_STATUS_INTERVAL_S", "RunStatus"]

log = logging.getLogger("servewatch.runtime")

#: Seconds between the event loop's heartbeats to the span rings (the drain thread also beats at
#: every poll; a server falls back after 2 s without one).
SPANS_HEARTBEAT_INTERVAL_S = 1.0
#: Least seconds between two updates of the span shipping COUNTS in the status file (checked at
#: every heartbeat; a change of state, e.g. a ring refused, is written at once). Under load the
#: counts change every second: each rewrite of the status file is agent CPU (soak, issue 15).
SPANS_STATUS_INTERVAL_S = 5.0
#: Seconds between checks of span delivery (the ``export`` row of the status board: a refusal
#: shows there within this long; the console line is said by the processor at once).
DELIVERY_STATUS_INTERVAL_S = 1.0


def _spans_row(shipper: Any) -> tuple[WatcherState, str]:
    """The ``spans`` row: the shipper's counts (both sides' drops), a refused ring, or waiting."""
    stats, refused = shipper.statistics(), shipper.refused()
    if stats.rings or stats.shipped or stats.dropped or stats.fallback_spans:
        return WatcherState.READY, stats.line()
    if refused:
        pid, why = next(iter(refused.items()))
        return WatcherState.BLIND, f"span ring of pid {pid} not shipped: {why}"
    return WatcherState.WAITING, "no SDK span ring in the targets yet (servers export their own spans)"


class RunStatus:
    """The running agent's status board and the rows it decides itself.

    Args:
        bus: where the runtime's own status events go (and the board's come from).
        board: the status board (the ``status`` exporter's).
        actors: the names of the actors, whose startup checks are rows too.
        on_status: called with each status change the CLI prints (``None``: nobody prints).
    """

    def __init__(self, bus: EventBus, board: StatusBoard, actors: Collection[str] = (),
                 on_status: Callable[[WatcherStatus], None] | None = None) -> None:
        self.bus = bus
        self.board = board
        self.actors = actors
        self.on_status = on_status
        self._spans_printed: tuple[Any, str] | None = None

    async def set(self, name: str, state: WatcherState, reason: str) -> None:
        """Publish a status the runtime itself decides (steps, process, a crashed watcher)."""
        await self.bus.publish(WatcherStatusChanged(source="runtime", watcher=name, state=state.value, reason=reason))

    def changed(self, status: WatcherStatus) -> None:
        """A row changed (the board's ``on_change``): hand it to ``on_status``, but the export row
        (said by the span processor when it happened, once per cause) never, and the spans row
        only when more than its shipped count moved."""
        if status.name == "export":
            return
        if status.name == "spans":
            key = (status.state, re.sub(r"\d+ shipped", "", status.reason))
            if key == self._spans_printed:
                return
            self._spans_printed = key
        if self.on_status is not None:
            try:
                self.on_status(status)
            except Exception:  # a printing callback must never take the agent down
                log.exception("status callback failed")

    async def show_incidents(self, state: dict[str, Any]) -> None:
        """The incidents' state (open, stalled, suppressed) into the status file, off the loop."""
        self.board.set_incidents(state)
        await anyio.to_thread.run_sync(self.board.write)

    def _take(self, event: Any) -> bool:
        """One status event onto the board; whether a row changed."""
        if isinstance(event, WatcherStatusChanged):
            try:
                state = WatcherState(event.state)
            except ValueError:
                return False
            before = self.board.get(event.watcher)
            # the spans line changes with every count (up to once a second): logged when its state
            # changes, not at each new count; the export row: the span processor says a refusal itself
            counts_only = event.watcher == "spans" and before is not None and before.state is state is WatcherState.READY
            said = event.watcher == "export"
            return self.board.set(event.watcher, state, event.reason, write=False, log_change=not (counts_only or said))
        if isinstance(event, ComponentStatusChanged) and event.component in self.actors:
            ok = event.status is ComponentStatus.OK  # an actor's startup check (py-spy's binary)
            return self.board.set(
                event.component, WatcherState.READY if ok else WatcherState.BLIND,
                f"ready: {event.detail}" if ok and event.detail else (event.detail or event.status.value), write=False,
            )
        return False

    async def check_actors(self, actors: Mapping[str, Any], blind: Callable[[str, str], str | None] | None = None) -> None:
        """Each actor's startup check (``check()``, when it has one: py-spy's binary) becomes its
        component status, and a status row; the agent keeps running either way.

        Args:
            blind: ``blind(name, detail)`` says why an actor whose check passed cannot act on the
                targets found (py-spy on another user's ranks without root), or ``None``: its row
                is then BLIND with that reason from the start, never "ready".
        """
        for name, actor in actors.items():
            check = getattr(actor, "check", None)
            if check is None:
                continue
            status, detail = await anyio.to_thread.run_sync(check)  # stats a binary: off the loop
            why = blind(name, detail) if blind is not None and status is ComponentStatus.OK else None
            if why is not None:
                status, detail = ComponentStatus.RECOVERABLE_ERROR, why
                await self.bus.publish(ComponentStatusChanged(source="runtime", component=name, status=status, detail=detail))
                continue
            await self.bus.publish(ComponentStatusChanged(source="runtime", component=name, status=status, detail=detail))
            if status is not ComponentStatus.OK:
                log.warning("%s unavailable: %s", name, detail)

    async def record(self, sub: Subscription) -> None:
        """Keep the board current from the watchers' status events (and the actors' checks)."""
        async for event in sub:
            if self._take(event):
                await anyio.to_thread.run_sync(self.board.write)  # the status file, off the loop

    async def watch_delivery(self, telemetry: Any) -> None:
        """Keep the ``export`` row current: ``blind`` while the collector refuses or rejects spans
        (with its words and the fix), ``waiting`` while it is unreachable, ``ready`` otherwise; a
        new state at once, new counts at most every :data:`SPANS_STATUS_INTERVAL_S`."""
        delivery_status = getattr(telemetry, "delivery_status", None)
        if delivery_status is None:
            return
        shown: tuple[str, str] | None = None
        next_counts = 0.0
        while True:
            state, reason = delivery_status()
            now = anyio.current_time()
            if (state, reason) != shown and (shown is None or state != shown[0] or state != "ready" or now >= next_counts):
                shown = (state, reason)
                next_counts = now + SPANS_STATUS_INTERVAL_S
                await self.set("export", WatcherState(state), reason)
            await anyio.sleep(until_tick(DELIVERY_STATUS_INTERVAL_S, anyio.current_time()))

    async def ship_spans(self, shipper: Any, telemetry: Any) -> None:
        """Drain the span rings on the shipper's low-priority thread (it and the export worker run
        at nice +10: the served process comes first); heartbeat (every
        :data:`SPANS_HEARTBEAT_INTERVAL_S`, so a starved drain thread never makes servers fall
        back) and the ``spans`` row from here: a new state at once, new counts at most every
        :data:`SPANS_STATUS_INTERVAL_S`."""
        from exporters.otlp.shipper import lower_thread_priority

        interval = shipper.poll_interval_s
        shipper.start(interval)
        worker = getattr(telemetry.processor, "_thread", None) if telemetry is not None else None
        if worker is not None and worker.native_id is not None:
            lower_thread_priority(native_id=worker.native_id)
        next_status = 0.0
        shown: tuple[WatcherState, str] | None = None
        while True:
            shipper.heartbeat_all()
            now = anyio.current_time()
            status = _spans_row(shipper)
            if status != shown and (shown is None or status[0] is not shown[0] or now >= next_status):
                shown = status
                next_status = now + SPANS_STATUS_INTERVAL_S
                await self.set("spans", *status)
            await anyio.sleep(max(interval, SPANS_HEARTBEAT_INTERVAL_S))
