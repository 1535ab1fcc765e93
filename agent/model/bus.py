"""EventBus: typed publish/subscribe on anyio memory object streams.

Owns: delivery of :mod:`agent.model.events` to subscribers. Imports only :mod:`agent.model.events` and anyio.

Delivery rules:

* Every subscriber has its own bounded buffer and sees the events it subscribed to in publish
  order.
* High-rate events (``type(event).HIGH_RATE``: steps, request spans, health probes) are sent with
  ``send_nowait``; when a subscriber's buffer is full the event is dropped *for that subscriber*
  and counted (reason ``queue_full``). A slow subscriber therefore never blocks a watcher.
* All other events (incidents, actions, status) are never dropped: :meth:`EventBus.publish`
  waits for room in each subscriber's buffer.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agent.model.events import Event

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["BusStatistics", "EventBus", "Publisher", "RecordingBus", "Subscription"]

E = TypeVar("E", bound=Event)

#: Default per-subscriber buffer, in events.
DEFAULT_BUFFER = 1024


class BusStatistics(NamedTuple):
    """Counters of an :class:`EventBus` since it was created."""

    #: events passed to publish()/publish_nowait()
    published: int
    #: event copies put into subscriber buffers
    delivered: int
    #: high-rate event copies dropped because a subscriber's buffer was full ("queue_full")
    dropped: int
    #: subscriptions currently open
    subscribers: int
    #: events waiting in all subscriber buffers right now
    buffer_used: int


class Publisher(Protocol):
    """What a watcher is given: it can only publish."""

    async def publish(self, event: Event) -> None: ...

    def publish_nowait(self, event: Event) -> int: ...


class Subscription:
    """One subscriber's view of the bus: an async iterator of events, in publish order.

    Use as an async context manager (or call :meth:`aclose`) so the bus stops delivering to it.
    """

    def __init__(self, bus: EventBus, types: tuple[type[Event], ...], max_buffer: float, name: str) -> None:
        self._bus = bus
        self.types = types
        self.name = name
        send, receive = anyio.create_memory_object_stream[Event](max_buffer)
        self._send: MemoryObjectSendStream[Event] = send
        self._receive: MemoryObjectReceiveStream[Event] = receive
        #: high-rate events this subscriber lost because its buffer was full
        self.dropped = 0

    def wants(self, event: Event) -> bool:
        return not self.types or isinstance(event, self.types)

    @property
    def pending(self) -> int:
        """Events buffered and not yet received."""
        return self._receive.statistics().current_buffer_used

    async def receive(self) -> Event:
        """Next event; raises ``anyio.EndOfStream`` once the bus is closed and drained."""
        return await self._receive.receive()

    def receive_nowait(self) -> Event:
        """Next buffered event; raises ``anyio.WouldBlock`` when none is buffered."""
        return self._receive.receive_nowait()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while True:
            try:
                yield await self._receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return

    def close(self) -> None:
        """Unsubscribe and drop what is buffered; safe to call twice (also under cancellation)."""
        self._bus._remove(self)
        self._send.close()
        self._receive.close()

    async def aclose(self) -> None:
        """Unsubscribe; safe to call twice."""
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class EventBus:
    """Typed publish/subscribe. See the module docstring for the delivery rules."""

    def __init__(self) -> None:
        self._subscriptions: list[Subscription] = []
        self._published = 0
        self._delivered = 0
        self._dropped = 0
        self._closed = False

    def subscribe(self, *types: type[Event], max_buffer: float = DEFAULT_BUFFER, name: str = "") -> Subscription:
        """Open a subscription to events of ``types`` (all events when none is given).

        Args:
            types: event classes; subclasses match too.
            max_buffer: events buffered for this subscriber (``math.inf`` for unbounded).
            name: label for statistics and logs.

        Raises:
            RuntimeError: the bus is closed.
        """
        if self._closed:
            raise RuntimeError("bus is closed")
        if max_buffer != math.inf and max_buffer < 1:
            raise ValueError(f"max_buffer must be >= 1, got {max_buffer}")
        sub = Subscription(self, types, max_buffer, name)
        self._subscriptions.append(sub)
        return sub

    def _remove(self, sub: Subscription) -> None:
        try:
            self._subscriptions.remove(sub)
        except ValueError:
            pass

    def publish_nowait(self, event: Event) -> int:
        """Deliver a high-rate event without waiting.

        Returns:
            How many subscribers dropped it (buffer full).

        Raises:
            TypeError: ``event`` is not high-rate (those must use :meth:`publish`).
        """
        if not type(event).HIGH_RATE:
            raise TypeError(f"{type(event).__name__} must never be dropped; use 'await bus.publish()'")
        self._published += 1
        dropped = 0
        for sub in tuple(self._subscriptions):
            if not sub.wants(event):
                continue
            try:
                sub._send.send_nowait(event)
            except anyio.WouldBlock:
                sub.dropped += 1
                dropped += 1
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._remove(sub)
            else:
                self._delivered += 1
        self._dropped += dropped
        return dropped

    async def publish(self, event: Event) -> None:
        """Deliver ``event`` to every subscriber that wants it.

        High-rate events never wait (dropped and counted on a full buffer); all others wait for
        buffer room, so they are never dropped.
        """
        if type(event).HIGH_RATE:
            self.publish_nowait(event)
            await anyio.lowlevel.checkpoint()
            return
        self._published += 1
        for sub in tuple(self._subscriptions):
            if not sub.wants(event):
                continue
            try:
                await sub._send.send(event)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._remove(sub)
            else:
                self._delivered += 1

    def statistics(self) -> BusStatistics:
        return BusStatistics(
            published=self._published,
            delivered=self._delivered,
            dropped=self._dropped,
            subscribers=len(self._subscriptions),
            buffer_used=sum(s.pending for s in self._subscriptions),
        )

    async def aclose(self) -> None:
        """Close the bus: subscribers drain what is buffered, then their iteration ends."""
        self._closed = True
        for sub in tuple(self._subscriptions):
            sub._send.close()


class RecordingBus(EventBus):
    """Test double: an :class:`EventBus` that also keeps every published event in ``events``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []

    def publish_nowait(self, event: Event) -> int:
        self.events.append(event)
        return super().publish_nowait(event)

    async def publish(self, event: Event) -> None:
        if not type(event).HIGH_RATE:
            self.events.append(event)
        await super().publish(event)

    def of_type(self, cls: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, cls)]
