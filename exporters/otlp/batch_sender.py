"""The span processor's fresh batches: encoded, sized, sent, or spooled behind the spool.

Owns :class:`BatchSender`: a batch taken from the queue is encoded (a malformed span dropped and
counted alone), split to the request size limit, sent through the send part
(:mod:`exporters.otlp.delivery`), split in halves when refused as too large, and on failure handed
to the spool part (:mod:`exporters.otlp.retry`). A batch of shipped spans for the span files
without a spool is written as its line from the spans' own text (:func:`exporters.otlp.wire_json.spans_line`).

Imports opentelemetry-proto, :mod:`exporters.otlp.batching`, :mod:`exporters.otlp.encode`,
:mod:`exporters.otlp.wire_json`, :mod:`exporters.otlp.delivery` and :mod:`exporters.otlp.retry` / :mod:`exporters.otlp.accounting` (types).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from exporters.otlp.batching import halve_request, split_request
from exporters.otlp.delivery import Outcome, RequestSlot, classify
from exporters.otlp.encode import encode_spans_fast as encode_spans
from exporters.otlp.wire_json import spans_line

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

    from exporters.otlp.accounting import ExportCounters, ProblemNotes
    from exporters.otlp.encode import EncodedSpan
    from exporters.otlp.retry import SpoolRetry
    from exporters.otlp.span_queue import SpanQueue
    from exporters.otlp.transport import SendResult

__all__ = ["BatchSender"]

#: the processor's logger: its log lines keep their logger name
_log = logging.getLogger("exporters.otlp.processor")

#: Halvings of one refused-as-too-large request before it is kept under rejected/ instead.
MAX_SPLIT_DEPTH = 24


class BatchSender:
    """Fresh batches from the queue: encoded (a malformed span dropped alone), split to
    ``max_bytes`` bytes per request, sent, or spooled while the spool holds anything, the
    collector is backed off, or shutdown is near its deadline.

    Args:
        slot: the send part.
        retry: the spool part (spooling, keeping refused requests, the backoff).
        queue: the span queue (its spans are settled here).
        counters / notes: the accounting.
        max_bytes: encoded bytes per request.
    """

    def __init__(self, slot: RequestSlot, retry: SpoolRetry, queue: SpanQueue, counters: ExportCounters,
                 notes: ProblemNotes, max_bytes: int, *, lines: bool = False) -> None:
        self._slot = slot
        self._retry = retry
        self._queue = queue
        self._counters = counters
        self._notes = notes
        self._max_bytes = max_bytes
        #: whether a batch of shipped spans' texts (:class:`exporters.otlp.wire_json.TextSpan`) is
        #: written as its line directly (the processor's ``takes_text``: the span files, no spool)
        self._lines = lines

    def ship(self, batch: list[ReadableSpan | EncodedSpan]) -> None:
        """Send one fresh batch, or spool it when the spool is busy or we are backing off."""
        if not batch:
            return
        if self._lines:
            line = spans_line(batch, self._max_bytes)
            if line is not None:  # shipped spans' own text: no protobuf request in between
                self._ship_line(line, batch)
                return
        request, _count = self.encode(batch)
        if request is None:
            return
        pieces, trimmed = split_request(request, self._max_bytes)
        if trimmed:
            self._counters.add(trimmed=trimmed)
        for piece, n in pieces:
            self._ship_request(piece, n)

    def spool(self, batch: list[ReadableSpan | EncodedSpan]) -> None:
        """Write one batch to the spool unsent (after the worker ended or was abandoned)."""
        request, count = self.encode(batch) if batch else (None, 0)
        if request is not None:
            self._retry.to_spool(request, count)

    def encode(self, batch: list[ReadableSpan | EncodedSpan]) -> tuple[ExportTraceServiceRequest | None, int]:
        """Encode a batch; a span the OTLP encoder raises on (malformed: no context...) is dropped
        and counted alone, the rest go on. Returns (request or None, spans in it)."""
        try:
            return encode_spans(batch), len(batch)
        except Exception:  # noqa: BLE001 - find the bad spans instead of losing the batch
            good = []
            for span in batch:
                try:
                    encode_spans([span])
                except Exception:  # noqa: BLE001 - the same boundary, span by span
                    _log.warning("span %r cannot be OTLP-encoded; dropped", span.name)
                    continue
                good.append(span)
            self._queue.settle(len(batch) - len(good), dropped=len(batch) - len(good))
            return (encode_spans(good), len(good)) if good else (None, 0)

    def _ship_line(self, line: str, batch: list[ReadableSpan | EncodedSpan]) -> None:
        """Write a batch as its line; an answer other than delivered is handled as
        :meth:`_ship_request` handles it, with the batch's request (the span files answer
        delivered or failed, and without a spool a failed batch is counted dropped)."""
        count = len(batch)
        result = self._slot.send_line(line, count)
        if result is None:
            return
        if classify(result, count) is Outcome.DELIVERED:
            self._retry.succeeded(result, count)
            self._counters.add(partial=result.rejected_spans)
            self._queue.settle(count, exported=count - result.rejected_spans)
            return
        request, _ = self.encode(batch)
        if request is not None:
            self._answer(request, count, result, 0)

    def _ship_request(self, request: ExportTraceServiceRequest, count: int, depth: int = 0) -> None:
        if self._retry.holds_back():
            self._retry.to_spool(request, count)
            return
        result = self._slot.send(request, count, replay=False)
        if result is None:
            return
        self._answer(request, count, result, depth)

    def _answer(self, request: ExportTraceServiceRequest, count: int, result: SendResult, depth: int) -> None:
        """Settle a sent request by its answer: delivered, split and sent again, kept, or spooled."""
        outcome = classify(result, count)
        if outcome is Outcome.TOO_LARGE and depth < MAX_SPLIT_DEPTH:
            self._notes.too_large(result, request)
            pieces, trimmed = halve_request(request)
            self._counters.add(trimmed=trimmed)
            for piece, n in pieces:
                self._ship_request(piece, n, depth + 1)
        elif outcome is Outcome.ALL_REJECTED:
            # every span of a fresh request rejected (OTLP partial success): kept like a refusal
            self._notes.all_rejected(count, result)
            self._retry.keep_rejected(request, count)
        elif outcome is Outcome.DELIVERED:
            self._retry.succeeded(result, count)
            self._counters.add(partial=result.rejected_spans)
            self._queue.settle(count, exported=count - result.rejected_spans)
        elif outcome is Outcome.REFUSED:
            self._refused(request, count, result)
        else:  # failed, or too large after MAX_SPLIT_DEPTH halvings
            self._retry.failed(result)
            self._retry.to_spool(request, count)

    def _refused(self, request: ExportTraceServiceRequest, spans: int, result: SendResult) -> None:
        self._counters.add(failures=1)
        self._notes.last_detail = result.detail
        self._notes.last_explained = result.explain()
        self._notes.refused(spans, result)  # every refusal counted, each cause said once
        self._retry.keep_rejected(request, spans)
