"""The span processor's spool part: write-ahead, retry and replay of spooled requests.

Owns :class:`SpoolRetry`: failed requests written to the :class:`~exporters.otlp.spool.Spool`,
refused ones kept under ``rejected/``, the spool's head replayed after a jittered exponential
backoff (oldest first, removed only once delivered, split in place when too large), whether a
fresh batch must queue behind the spool, and the periodic adoption of stranded spool folders.

Imports opentelemetry-proto, :mod:`agent.model.backoff`, :mod:`exporters.otlp.batching`,
:mod:`exporters.otlp.delivery` and :mod:`exporters.otlp.spool` / :mod:`exporters.otlp.transport` (types).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from exporters.otlp.batching import halve_request, split_request
from exporters.otlp.delivery import Outcome, RequestSlot, classify

if TYPE_CHECKING:
    from agent.model.backoff import Backoff
    from exporters.otlp.accounting import ExportCounters, ProblemNotes
    from exporters.otlp.span_queue import SpanQueue
    from exporters.otlp.spool import Spool, SpoolEntry
    from exporters.otlp.transport import SendResult

__all__ = ["SpoolRetry"]

#: the processor's logger: its log lines keep their logger name
_log = logging.getLogger("exporters.otlp.processor")


class SpoolRetry:
    """The spool and the retry schedule of one processor (worker thread only).

    Args:
        spool: where failed requests wait; ``None`` (the embedded file default) drops and counts
            them instead.
        slot: the send part.
        queue: the span queue (spooled or dropped spans are settled there).
        counters / notes: the accounting.
        backoff: the replay backoff after a failure.
        max_bytes: encoded bytes per request (a bigger spooled request is split in place).
        adopt_interval_s: how often stranded spool folders are looked for, seconds.
    """

    def __init__(self, spool: Spool | None, slot: RequestSlot, queue: SpanQueue, counters: ExportCounters,
                 notes: ProblemNotes, *, backoff: Backoff, max_bytes: int, adopt_interval_s: float) -> None:
        self.spool = spool
        self._slot = slot
        self._queue = queue
        self._counters = counters
        self._notes = notes
        self._backoff = backoff
        self._max_bytes = max_bytes
        self._adopt_interval_s = adopt_interval_s
        self._adopt_at = time.monotonic() + adopt_interval_s
        #: no replay before this, monotonic seconds (0: none pending)
        self.retry_at = 0.0

    def pending(self) -> bool:
        """The spool holds requests (fresh batches queue behind them)."""
        return self.spool is not None and bool(len(self.spool))

    def empty(self) -> bool:
        """No spool, or nothing in it."""
        return self.spool is None or len(self.spool) == 0

    def adopt_if_due(self, now: float) -> None:
        """Adopt stranded spool folders every ``adopt_interval_s`` (``now``: monotonic seconds)."""
        if self.spool is not None and now >= self._adopt_at:
            self._adopt_at = now + self._adopt_interval_s
            self.spool.adopt_stranded()

    def holds_back(self) -> bool:
        """A fresh request goes to the spool, not the collector: the spool holds requests (disk
        order = span order), we are backing off, or shutdown is near its deadline."""
        spool = self.spool
        return spool is not None and bool(len(spool) or time.monotonic() < self.retry_at or self._slot.spool_only())

    def to_spool(self, request: ExportTraceServiceRequest, spans: int) -> None:
        """Write a request of ``spans`` taken spans to the spool and settle them (dropped, and
        counted so, without a spool or when the write fails)."""
        if self.spool is None:
            self._queue.settle(spans, dropped=spans)
            return
        try:
            self.spool.append(request, spans)
        except OSError as exc:
            _log.error("spool write failed (%s); %d spans lost", exc, spans)
            self._queue.settle(spans, dropped=spans)
            return
        self._queue.settle(spans, spooled=spans)

    def keep_rejected(self, request: ExportTraceServiceRequest, spans: int) -> None:
        """Keep a refused request under ``rejected/`` (counted lost without a spool) and settle it."""
        if self.spool is not None:
            try:
                self.spool.add_rejected(request, spans)
            except OSError:
                self._queue.settle(spans, dropped=spans)
                return
            self._queue.settle(spans)
        else:
            self._counters.add(rejected=spans)
            self._queue.settle(spans)

    def replay_head(self) -> None:
        """Send the spool's oldest request once; delivered, it is removed (a spool is required)."""
        spool = self.spool
        assert spool is not None
        entry = spool.head()
        if entry is None:
            return
        if spool.delivered(entry):
            # its key is in the delivered-keys ledger: a sender was killed between recording the
            # collector's acknowledgement and removing the file; sending it again would duplicate it
            self._remove_delivered(entry)
            return
        request = spool.load(entry)
        if request is None:
            return
        if entry.size_bytes > self._max_bytes and entry.spans > 1:
            # written by an older version or under a bigger limit: never let it block the head
            self._split_entry(entry, split_request(request, self._max_bytes))
            return
        result = self._slot.send(request, entry.spans, replay=True)
        if result is not None:
            self._replayed(entry, request, result)

    def _replayed(self, entry: SpoolEntry, request: ExportTraceServiceRequest, result: SendResult) -> None:
        """Act on the answer to the replay of ``entry``."""
        assert self.spool is not None
        outcome = classify(result, entry.spans)
        if outcome is Outcome.TOO_LARGE:
            self._notes.too_large(result, request)
            if entry.spans <= 1 and entry.size_bytes <= 2048:
                self.spool.reject(entry)
                return
            self._split_entry(entry, halve_request(request))
        elif outcome is Outcome.ALL_REJECTED:
            self._notes.all_rejected(entry.spans, result)
            self.spool.reject(entry)  # kept whole under rejected/: replayable once the cause is fixed
        elif outcome is Outcome.DELIVERED:
            self.succeeded(result, entry.spans)
            self._remove_delivered(entry)
            self._counters.add(replayed=entry.spans - result.rejected_spans, partial=result.rejected_spans)
        elif outcome is Outcome.REFUSED:
            self._notes.last_detail = result.detail
            self._notes.refused(entry.spans, result)
            self.spool.reject(entry)
        else:
            self.failed(result)

    def _remove_delivered(self, entry: SpoolEntry) -> None:
        assert self.spool is not None
        try:
            self.spool.remove(entry)
        except OSError as exc:  # the delivered-keys ledger: the file stays, sent again later (once more)
            _log.error("could not record delivered spool batch %s (%s); it will be sent again", entry.path.name, exc)
            self.retry_at = time.monotonic() + self._backoff.next_delay_s()

    def _split_entry(self, entry: SpoolEntry, split: tuple[list[tuple[ExportTraceServiceRequest, int]], int]) -> None:
        pieces, trimmed = split
        assert self.spool is not None
        try:
            self.spool.split(entry, pieces)
        except OSError as exc:
            _log.error("could not split spooled batch %s (%s); moved to rejected/", entry.path.name, exc)
            self.spool.reject(entry)
            return
        self._counters.add(trimmed=trimmed)

    def succeeded(self, result: SendResult | None = None, spans: int = 0) -> None:
        """A request of ``spans`` spans was accepted: the backoff starts over."""
        self._backoff.reset()
        self.retry_at = 0.0
        self._notes.accepted(result, spans)

    def failed(self, result: SendResult) -> None:
        """A send failed (retryable): counted, said, and the next replay backed off (at least the
        collector's ``Retry-After`` / ``RetryInfo`` when it sent one)."""
        self._counters.add(failures=1)
        self._notes.failed(result)
        # the collector's Retry-After / RetryInfo, when it sent one, is the least wait
        self.retry_at = time.monotonic() + self._backoff.next_delay_s(result.retry_after_s)
