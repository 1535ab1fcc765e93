"""The span processor's in-memory queue: bounded, never blocking, with tickets.

Owns :class:`SpanQueue`: the spans waiting for the export worker, the tickets that say when the
spans of a :meth:`~SpanQueue.submit` are settled (exported, spooled or counted dropped), the
flush target, and the batch-due timing of the worker (full batch, flush asked, or the schedule
delay passed).

Imports the standard library, opentelemetry-sdk (types) and :mod:`exporters.otlp.accounting`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

    from exporters.otlp.accounting import ExportCounters
    from exporters.otlp.encode import EncodedSpan

__all__ = ["SpanQueue"]


class SpanQueue:
    """The bounded queue of finished spans, in spans; thread-safe, :meth:`enqueue` and
    :meth:`submit` never block.

    The tickets (``taken``, ``settled``, the flush target) are guarded by ``counters.cv``, the
    condition of the counters, so settling a span and counting what became of it is one step.

    Args:
        counters: the processor's counters (drops are counted there).
        max_spans: capacity; past it new spans are dropped and counted.
        batch_spans: spans per batch (:meth:`take`); a full batch wakes the worker.
        delay_s: longest a span waits before a partial batch is due, seconds.
    """

    def __init__(self, counters: ExportCounters, *, max_spans: int, batch_spans: int, delay_s: float) -> None:
        self._counters = counters
        self._cv = counters.cv
        self._spans: deque[ReadableSpan | EncodedSpan] = deque()
        self._max = max_spans
        self._batch = batch_spans
        self.delay_s = delay_s
        #: set when the worker has something to do now (a full batch, a flush, shutdown)
        self.wakeup = threading.Event()
        self._taken = 0
        self._settled = 0
        self._flush_target = 0
        #: shut down: new spans are dropped and counted
        self.closed = False

    def __len__(self) -> int:
        return len(self._spans)

    def enqueue(self, span: ReadableSpan | EncodedSpan) -> None:
        """Queue one span, or count it dropped (queue full or closed). O(1), never blocks."""
        queue = self._spans
        if self.closed or len(queue) >= self._max:
            with self._cv:
                self._counters.dropped += 1
            return
        queue.append(span)
        if len(queue) >= self._batch and not self.wakeup.is_set():
            self.wakeup.set()

    def submit(self, spans: Sequence[ReadableSpan | EncodedSpan]) -> int | None:
        """Queue what fits of ``spans`` (the rest counted dropped); the ticket that settles them,
        ``None`` when closed (all counted dropped)."""
        batch = list(spans)
        queue = self._spans
        with self._cv:
            if self.closed:
                self._counters.dropped += len(batch)
                return None
            room = max(0, self._max - len(queue))
            if len(batch) > room:
                self._counters.dropped += len(batch) - room
                batch = batch[:room]
            queue.extend(batch)
            ticket = self._taken + len(queue)
        if len(queue) >= self._batch and not self.wakeup.is_set():
            self.wakeup.set()
        return ticket

    def room(self) -> int:
        """Spans the queue can take now."""
        return max(0, self._max - len(self._spans))

    def settled(self) -> int:
        """Spans ever queued that are settled (compare with a :meth:`submit` ticket)."""
        with self._cv:
            return self._settled

    def wait_settled(self, ticket: int, timeout_s: float) -> bool:
        """Ask the worker to send up to ``ticket`` now and wait until it is settled, at most
        ``timeout_s`` seconds. Returns whether it is."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cv:
            self._flush_target = max(self._flush_target, ticket)
            self.wakeup.set()
            while self._settled < ticket:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

    def flush(self, timeout_s: float, spool_empty: Callable[[], bool]) -> bool:
        """Ask the worker to send everything queued now and wait, at most ``timeout_s`` seconds,
        until it is settled and ``spool_empty()`` (polled every 50 ms once settled). Returns
        whether both held before the deadline."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cv:
            target = self._taken + len(self._spans)
            self._flush_target = max(self._flush_target, target)
            self.wakeup.set()
            while True:
                settled = self._settled >= target
                if settled and spool_empty():
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(min(remaining, 0.05) if settled else remaining)
        return spool_empty()

    def settle(self, spans: int, *, exported: int = 0, spooled: int = 0, dropped: int = 0) -> None:
        """``spans`` taken spans are settled: count how, and wake the waiters."""
        with self._cv:
            self._settled += spans
            self._counters.add_locked(exported=exported, spooled=spooled, dropped=dropped)
            self._cv.notify_all()

    def take(self) -> list[ReadableSpan | EncodedSpan]:
        """The oldest batch (up to ``batch_spans`` spans), taken off the queue."""
        queue = self._spans
        batch: list[ReadableSpan | EncodedSpan] = []
        with self._cv:
            for _ in range(min(self._batch, len(queue))):
                batch.append(queue.popleft())
            self._taken += len(batch)
        return batch

    def ready(self) -> bool:
        """A full batch is queued, or a flush waits for queued spans."""
        queue = self._spans
        return len(queue) >= self._batch or bool(queue and self._flush_target > self._settled)

    def batch_due(self, now: float, last_send: float) -> bool:
        """A batch is full, flushed, or has waited the schedule delay since the last send
        (``now``, ``last_send``: monotonic seconds)."""
        queue = self._spans
        return len(queue) >= self._batch or bool(
            queue and (self._flush_target > self._settled or now - last_send >= self.delay_s))

    def wait(self, timeout_s: float, stopping: Callable[[], bool]) -> None:
        """The worker's idle wait: until woken or ``timeout_s`` seconds (at least 1 ms), not at
        all when ``stopping()`` (asked after the wakeup is cleared) or :meth:`ready`."""
        self.wakeup.clear()
        if stopping() or self.ready():
            return
        self.wakeup.wait(max(0.001, timeout_s))
