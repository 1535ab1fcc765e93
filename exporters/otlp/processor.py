"""The lossless, bounded span processor.

Owns :class:`LosslessSpanProcessor`, the public face, and re-exports :class:`ExportStatistics` and
:class:`DeliveryProblem` (defined in :mod:`exporters.otlp.accounting`). The processor composes small
parts, the Collector's way (queue -> retry -> spool -> send), and runs their one worker thread
(:class:`~exporters.otlp.worker.ExportWorker`, its loop):

* :class:`~exporters.otlp.span_queue.SpanQueue`: the bounded in-memory queue, the tickets of
  :meth:`~LosslessSpanProcessor.submit`, batches taken, the batch-due timing;
* :class:`~exporters.otlp.batch_sender.BatchSender`: a fresh batch encoded, sized, sent or spooled;
* :class:`~exporters.otlp.retry.SpoolRetry`: spooling, keeping refused requests, the backoff and
  the replay of the spool's head, the adoption of stranded spool folders;
* :class:`~exporters.otlp.delivery.RequestSlot` and :func:`~exporters.otlp.delivery.classify`: one
  OTLP request in flight (bounded, abandoned at the shutdown deadline) and what its answer means;
* :class:`~exporters.otlp.accounting.ExportCounters` and
  :class:`~exporters.otlp.accounting.ProblemNotes`: the counters and the :class:`DeliveryProblem`.

What it guarantees, where the SDK's ``BatchSpanProcessor`` does not (per FIELD-NOTES: its 2048
queue drops the OLDEST spans with one warning and no count, ``force_flush`` ignores its timeout and
reports success on failure, and shutdown with the collector down blocks ~30 s delivering nothing):

* ``on_end`` never blocks and never raises: one ``deque.append``. The queue holds
  ``max_queue_spans`` (64k by default, a burst of every TP rank dumping plus thousands of request
  spans); past that, new spans are dropped and *counted* (``dropped``), never silently.
* One worker thread encodes batches and sends each with ONE attempt bounded by
  ``export_timeout_s``. A batch that fails goes to the :class:`~exporters.otlp.spool.Spool`. While the
  spool holds anything, fresh batches queue behind it (disk order = span order) and the head is
  replayed after a jittered exponential backoff, oldest first, removed only once delivered: every
  span arrives exactly once, with its original ids and times.
* ``force_flush`` and ``shutdown`` are bounded by OUR deadline. Shutdown replays the spool (the
  written-ahead spans of the last actions wait there) and then sends the queue, oldest first, until
  a send fails or the deadline nears. At the deadline whatever is not
  delivered is written to the spool (a local write) and the worker is abandoned; the next run
  replays the spool. The one case that can duplicate: a network send still in flight when the
  deadline passes that completes afterwards (gRPC calls are cancelled, so only HTTP can).
* A batch the collector refuses permanently (gRPC INVALID_ARGUMENT, HTTP 400...) is kept under
  ``spool/rejected/`` and counted, never retried in a loop.
* Batches are sized in bytes as well as spans (``max_batch_bytes``, default 3 MiB, under the
  collector's 4 MiB gRPC limit). A request refused as too large (``RESOURCE_EXHAUSTED`` "larger
  than max", HTTP 413) is split in halves and retried, on disk too (a spooled batch is split in
  place and never blocks the spool); a span too large on its own is trimmed (long attribute
  values truncated, counted in ``trimmed`` and on the span).
* Write-ahead: :meth:`persist` puts spans that must survive the process (the spans of finished
  incident actions) in the spool BEFORE any export is attempted; they leave the disk only once
  the collector acknowledged them, so a SIGKILL at any moment loses none of them.
* Stranded spool folders of processes that are gone are adopted every ``adopt_interval_s``.
* :meth:`submit` queues spans and returns a ticket; once :meth:`settled` reaches it, those spans
  are exported, spooled or counted dropped. The span shipper keeps the ring records of spans
  until then, so a SIGKILLed agent loses none of them (the next agent re-reads the ring).

Imports opentelemetry-sdk, :mod:`agent.model.backoff`, the parts above
(:mod:`exporters.otlp.accounting`, :mod:`exporters.otlp.span_queue`, :mod:`exporters.otlp.batch_sender`,
:mod:`exporters.otlp.delivery`, :mod:`exporters.otlp.retry`, :mod:`exporters.otlp.worker`),
:mod:`exporters.otlp.batching`, :mod:`exporters.otlp.encode`, :mod:`exporters.otlp.transport` and
:mod:`exporters.otlp.spool`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from opentelemetry.context import Context
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from agent.model.backoff import Backoff
from exporters.otlp.accounting import (
    DeliveryProblem,
    ExportCounters,
    ExportStatistics,
    ProblemNotes,
)
from exporters.otlp.batch_sender import BatchSender
from exporters.otlp.batching import split_request
from exporters.otlp.delivery import RequestSlot
from exporters.otlp.encode import EncodedSpan
from exporters.otlp.encode import encode_spans_fast as encode_spans
from exporters.otlp.retry import SpoolRetry
from exporters.otlp.span_queue import SpanQueue
from exporters.otlp.spool import Spool
from exporters.otlp.transport import RequestSender
from exporters.otlp.worker import ExportWorker

__all__ = ["DeliveryProblem", "ExportStatistics", "LosslessSpanProcessor"]

_log = logging.getLogger(__name__)

#: How long shutdown waits for an aborted send to return before spooling its batch itself, in seconds.
_ABORT_GRACE_S = 0.2


class LosslessSpanProcessor(SpanProcessor):
    """OTel ``SpanProcessor`` that never blocks the caller and never loses a span silently.

    Args:
        sender: where batches go (gRPC, HTTP or file; see :mod:`exporters.otlp.transport`).
        spool: where failed batches wait; ``None`` (the embedded file default: same disk) drops
            and counts a failed batch instead.
        max_queue_spans: in-memory queue capacity, in spans.
        max_batch_spans: spans per export request.
        max_batch_bytes: encoded bytes per export request (bigger batches are split).
        schedule_delay_s: longest a span waits in the queue before a partial batch is sent, seconds.
        export_timeout_s: bound on one send attempt, seconds (also capped by the shutdown deadline).
        retry_initial_backoff_s / retry_max_backoff_s: replay backoff after a failure, doubling,
            +-20% jitter, seconds (:class:`~agent.model.backoff.Backoff`); a collector's
            ``Retry-After`` / ``RetryInfo`` makes the wait at least that long.
        shutdown_timeout_s: default deadline of :meth:`shutdown`, seconds.
        adopt_interval_s: how often stranded spool folders are looked for, seconds.
        replay_command: the ``servewatch export ...`` command line that sends a folder of span
            files to this destination (said with a refusal, for the spans kept under ``rejected/``).

    Raises:
        ValueError: ``max_queue_spans`` or ``max_batch_spans`` below 1.
    """

    def __init__(
        self,
        sender: RequestSender[ExportTraceServiceRequest],
        *,
        spool: Spool | None = None,
        max_queue_spans: int = 65536,
        max_batch_spans: int = 512,
        max_batch_bytes: int = 3 * 1024 * 1024,
        schedule_delay_s: float = 0.5,
        export_timeout_s: float = 3.0,
        retry_initial_backoff_s: float = 0.25,
        retry_max_backoff_s: float = 5.0,
        shutdown_timeout_s: float = 3.0,
        adopt_interval_s: float = 30.0,
        name: str = "servewatch-export",
        replay_command: Callable[[Path], str] | None = None,
    ) -> None:
        if max_queue_spans < 1 or max_batch_spans < 1:
            raise ValueError("max_queue_spans and max_batch_spans must be >= 1")
        self.sender = sender
        self.spool = spool
        #: whether spans are best submitted as their OTLP/JSON text
        #: (:class:`exporters.otlp.wire_json.TextSpan`): the span files without a spool write a
        #: batch of them as its line, with no protobuf request in between
        self.takes_text = spool is None and callable(getattr(sender, "send_line", None))
        self._max_bytes = max(1024, max_batch_bytes)
        self._shutdown_timeout_s = shutdown_timeout_s
        self._counters = ExportCounters()  # its condition guards the queue's tickets too
        self._notes = ProblemNotes(sender, spool, replay_command)
        self._queue = SpanQueue(self._counters, max_spans=max_queue_spans, batch_spans=max_batch_spans,
                                delay_s=schedule_delay_s)
        self._slot = RequestSlot(sender, export_timeout_s)
        backoff = Backoff(retry_initial_backoff_s, max(retry_initial_backoff_s, retry_max_backoff_s))
        self._retry = SpoolRetry(spool, self._slot, self._queue, self._counters, self._notes, backoff=backoff,
                                 max_bytes=self._max_bytes, adopt_interval_s=adopt_interval_s)
        batches = BatchSender(self._slot, self._retry, self._queue, self._counters, self._notes, self._max_bytes,
                              lines=self.takes_text)
        self._worker = ExportWorker(self._queue, batches, self._retry, self._slot)
        self._thread = threading.Thread(target=self._worker.run, name=name, daemon=True)
        self._thread.start()

    # --- the caller's side (any thread) ---------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        """Queue a finished span. O(1), never blocks, never raises."""
        self._queue.enqueue(span)

    def submit(self, spans: Sequence[ReadableSpan | EncodedSpan]) -> int | None:
        """Queue ``spans`` like :meth:`on_end` and say when they are safe: a ticket.

        Once :meth:`settled` reaches the ticket, each of these spans was exported, written to
        the spool, or counted in ``dropped`` (queue full, spool write failed): never in memory
        only. A caller that keeps its own copy until then (the span shipper keeps the ring
        records) loses nothing when this process is killed. Never blocks.

        Returns:
            The ticket (a count of spans ever queued), or ``None`` when the processor is shut
            down (the spans are counted dropped; the caller should keep its copy).
        """
        return self._queue.submit(spans)

    def room(self) -> int:
        """Spans the memory queue can take now (``max_queue_spans`` minus those queued)."""
        return self._queue.room()

    def settled(self) -> int:
        """Spans ever queued that are settled: exported, spooled, or counted dropped (compare
        with a :meth:`submit` ticket)."""
        return self._queue.settled()

    def wait_settled(self, ticket: int, timeout_s: float) -> bool:
        """Send what is queued up to ``ticket`` now (no schedule delay) and wait until it is
        settled, at most ``timeout_s`` seconds. Returns whether it is."""
        return self._queue.wait_settled(ticket, timeout_s)

    def persist(self, spans: Sequence[ReadableSpan | EncodedSpan], *, key: str = "") -> bool:
        """Write-ahead: put ``spans`` on disk now, before any export is attempted.

        With a spool, the spans are encoded and written to it (atomic, fsync'd) before this
        returns; the worker then sends them like any spooled batch and deletes them once the
        collector acknowledged them. Without a spool (the embedded file default) they are written
        to the span file before this returns. If the write fails they go through the memory
        queue instead (:meth:`on_end`). Never raises; call it from any thread.

        Args:
            spans: one group (an incident action's span and its children, or an incident root).
            key: the group's key (its main span's id, 16 hex digits): kept in the spool file's
                name and, once delivered, in the delivered-keys ledger, so a later agent can tell
                whether the group is durable (:func:`exporters.otlp.spool.durable_keys`).

        Returns:
            Whether the spans are durable now (on disk); ``False``: only in memory (or dropped).
        """
        batch = list(spans)
        if not batch:
            return True
        if self._queue.closed and self.spool is None:
            self._counters.add(dropped=len(batch))
            return False
        try:
            request = encode_spans(batch)
        except Exception:  # noqa: BLE001 - a malformed span; the worker sorts the batch out span by span
            for span in batch:
                self._queue.enqueue(span)
            return False
        try:
            if self.spool is None:
                result = self._slot.send_now(request)
                if not result.ok:
                    raise OSError(result.detail)
                self._counters.add(exported=len(batch), written_ahead=len(batch))
                return True
            pieces, trimmed = split_request(request, self._max_bytes)
            for piece, count in pieces:
                evicted = self.spool.append(piece, count, key=key)
                if evicted:
                    _log.warning("spool full: %d oldest spans evicted", evicted)
            self._counters.add(written_ahead=len(batch), trimmed=trimmed)
        except OSError as exc:
            _log.error("write-ahead of %d spans failed (%s); queued in memory instead", len(batch), exc)
            for span in batch:
                self._queue.enqueue(span)
            return False
        self._queue.wakeup.set()
        return True

    def statistics(self) -> ExportStatistics:
        """A consistent snapshot of the counters."""
        spool = self.spool.statistics() if self.spool is not None else None
        with self._counters.cv:
            return self._counters.snapshot_locked(len(self._queue), spool)

    @property
    def last_error(self) -> str:
        """One line on the last failed send and what to check (``""`` when none)."""
        return self._notes.last_explained or self._notes.last_detail

    def problem(self) -> DeliveryProblem | None:
        """Why spans are not reaching the collector now, or ``None`` while they are (or nothing
        was sent yet). A refusal stands until a later request is accepted whole."""
        return self._notes.problem

    def flush(self, timeout_s: float) -> bool:
        """Deliver every span queued so far, and the spool, within ``timeout_s`` seconds.

        Waits until the spans queued before the call are settled (delivered, spooled or counted
        as dropped) and the spool has been replayed, or until the deadline: with the collector
        down it takes the whole ``timeout_s`` (the spans are safe in the spool meanwhile).

        Returns:
            ``True`` only when all of them reached the collector and the spool is empty;
            ``False`` when any are spooled or the deadline passed (nothing is lost either way).
        """
        if self._queue.closed:
            return self._retry.empty()
        return self._queue.flush(timeout_s, self._retry.empty)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """SDK entry point; see :meth:`flush` (here the timeout is honoured)."""
        return self.flush(timeout_millis / 1000)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop: deliver what fits before the deadline, spool the rest, release the sender.

        Bounded by ``timeout_s`` (default ``shutdown_timeout_s``) plus a short local write of
        what is left. Safe to call twice.
        """
        if self._queue.closed:
            return
        budget_s = self._shutdown_timeout_s if timeout_s is None else timeout_s
        self._slot.deadline = time.monotonic() + max(0.0, budget_s)
        self._queue.closed = True
        self._slot.stopping = True
        self._queue.wakeup.set()
        self._thread.join(max(0.0, self._slot.deadline - time.monotonic()))
        if self._thread.is_alive():
            self.sender.abort()
            self._thread.join(_ABORT_GRACE_S)
        if self._thread.is_alive():
            inflight = self._slot.abandon()
            _log.warning("export worker did not finish by the shutdown deadline; spooling what is left")
            if inflight is not None and not inflight.replay:
                if inflight.request is None:  # a span-files line, without a spool: counted dropped
                    self._queue.settle(inflight.spans, dropped=inflight.spans)
                else:
                    self._retry.to_spool(inflight.request, inflight.spans)
        self._worker.spool_queue()
        self.sender.close()
        if self.spool is not None:
            self.spool.close()
