"""The span processor's one worker thread: the loop that moves spans queue -> retry -> spool -> send.

Owns :class:`ExportWorker`: while the spool holds requests, fresh batches queue behind it and its
head is replayed once the backoff allows; otherwise a batch goes out when full, flushed or due
(the schedule delay). Stopping, it delivers the spool, then the queue, while the deadline allows;
after it ended or was abandoned, :meth:`ExportWorker.spool_queue` spools what is left.

Imports the standard library and the parts it drives (:mod:`exporters.otlp.span_queue`,
:mod:`exporters.otlp.batch_sender`, :mod:`exporters.otlp.retry`, :mod:`exporters.otlp.delivery`; types).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exporters.otlp.batch_sender import BatchSender
    from exporters.otlp.delivery import RequestSlot
    from exporters.otlp.retry import SpoolRetry
    from exporters.otlp.span_queue import SpanQueue

__all__ = ["ExportWorker"]

#: the processor's logger: its log lines keep their logger name
_log = logging.getLogger("exporters.otlp.processor")


class ExportWorker:
    """The body of the processor's worker thread (:meth:`run`); one per processor.

    Args:
        queue: the span queue (batches are taken from it).
        batches: sends or spools a fresh batch.
        retry: the spool part (replay of the head, the backoff).
        slot: the send part (``stopping``, the shutdown deadline, abandonment).
    """

    def __init__(self, queue: SpanQueue, batches: BatchSender, retry: SpoolRetry, slot: RequestSlot) -> None:
        self._queue = queue
        self._batches = batches
        self._retry = retry
        self._slot = slot

    def run(self) -> None:
        """The thread's body: the loop until shutdown, then the drain; an error is logged and the
        loop goes on (after 50 ms), unless stopping."""
        while True:
            try:
                self._loop()
                self._drain_on_stop()
                return
            except Exception:  # noqa: BLE001 - log, keep the worker alive (shutdown still spools the queue)
                _log.exception("export worker error; continuing")
                if self._slot.stopping:
                    return
                time.sleep(0.05)

    def _stopping(self) -> bool:
        return self._slot.stopping

    def _loop(self) -> None:
        queue, retry = self._queue, self._retry
        last_send = time.monotonic()
        while not self._slot.stopping:
            now = time.monotonic()
            retry.adopt_if_due(now)
            if retry.pending():
                last_send = self._turn_behind_spool(now, last_send)
                continue
            if queue.batch_due(now, last_send):
                last_send = now
                self._batches.ship(queue.take())
                continue
            queue.wait(queue.delay_s - (now - last_send) if queue else queue.delay_s, self._stopping)

    def _turn_behind_spool(self, now: float, last_send: float) -> float:
        """One turn of the loop while the spool holds requests; the time of the last send."""
        queue, retry = self._queue, self._retry
        if now >= retry.retry_at:
            retry.replay_head()
            if queue.ready():
                self._batches.ship(queue.take())
            return last_send
        # Outage: keep new spans behind the spool, moving full batches to disk.
        if queue.batch_due(now, last_send):
            self._batches.ship(queue.take())
            return now
        queue.wait(min(retry.retry_at - now, queue.delay_s), self._stopping)
        return last_send

    def _drain_on_stop(self) -> None:
        """Stopping: deliver the spool first (it holds the written-ahead spans of the last actions,
        older than anything queued), then the queue, while the deadline allows. A failed replay
        (the collector is down) ends the replay: the rest stays spooled for the next run."""
        retry, slot = self._retry, self._slot
        while retry.pending() and not slot.spool_only() and time.monotonic() >= retry.retry_at:
            if slot.abandoned():
                return
            retry.replay_head()
        while self._queue:
            if slot.abandoned():
                return
            self._batches.ship(self._queue.take())

    def spool_queue(self) -> None:
        """After the worker ended or was abandoned: everything still queued goes to the spool."""
        while self._queue:
            self._batches.spool(self._queue.take())
