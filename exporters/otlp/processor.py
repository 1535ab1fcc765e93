"""The lossless, bounded span processor.

Owns :class:`LosslessSpanProcessor` and :class:`ExportStatistics`.

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

Imports opentelemetry-sdk, :mod:`exporters.otlp.transport`, :mod:`exporters.otlp.spool`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from opentelemetry.context import Context
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from agent.model.backoff import Backoff
from exporters.otlp.batching import halve_request, split_request
from exporters.otlp.encode import EncodedSpan
from exporters.otlp.encode import encode_spans_fast as encode_spans
from exporters.otlp.spool import Spool, SpoolEntry
from exporters.otlp.transport import Delivery, RequestSender, SendResult

__all__ = ["DeliveryProblem", "ExportStatistics", "LosslessSpanProcessor"]

_log = logging.getLogger(__name__)

#: Below this much time left before the shutdown deadline, stop sending and spool the rest, in seconds.
_SPOOL_ONLY_MARGIN_S = 0.1
#: How long shutdown waits for an aborted send to return before spooling its batch itself, in seconds.
_ABORT_GRACE_S = 0.2
#: Halvings of one refused-as-too-large request before it is kept under rejected/ instead.
_MAX_SPLIT_DEPTH = 24


class ExportStatistics(NamedTuple):
    """Span counters of a :class:`LosslessSpanProcessor` since it started.

    Every span handed to ``on_end`` ends in exactly one of: ``queued`` (still in memory),
    ``exported``, ``spool_spans`` (on disk, waiting), ``replayed``, ``dropped``, ``evicted``,
    ``rejected``, or ``partially_rejected``.
    """

    #: spans in the in-memory queue now
    queued: int
    #: spans delivered on their first attempt
    exported: int
    #: spans written to the spool (failed export, outage, or shutdown deadline)
    spooled: int
    #: spooled spans delivered later
    replayed: int
    #: spans lost before reaching the spool: queue full, after shutdown, or the spool write failed
    dropped: int
    #: spooled spans deleted unsent because the spool reached its size cap (oldest first)
    evicted: int
    #: spans in batches the collector refused permanently (kept under ``spool/rejected/``)
    rejected: int
    #: spans the collector accepted but reported as rejected (OTLP partial success)
    partially_rejected: int
    #: spans on disk in the spool waiting for replay now
    spool_spans: int
    #: send attempts that failed
    export_failures: int
    #: spans trimmed to fit the request size limit (attribute values truncated)
    trimmed: int = 0
    #: spans written ahead to the spool by :meth:`LosslessSpanProcessor.persist` (delivered ones
    #: are counted in ``replayed``)
    written_ahead: int = 0

    @property
    def lost(self) -> int:
        """Spans that will never be delivered automatically."""
        return self.dropped + self.evicted + self.rejected + self.partially_rejected


class DeliveryProblem(NamedTuple):
    """Why spans are not reaching the collector now (:meth:`LosslessSpanProcessor.problem`)."""

    #: ``refused``: the collector refused them (401/403/404/400, gRPC UNAUTHENTICATED...): kept
    #: under ``rejected/``, nothing retries them; ``rejected``: it accepted requests but rejected
    #: spans in them (OTLP partial success); ``unreachable``: sends fail and are retried, the
    #: spans wait in the spool
    kind: str
    #: one line: what happened, the collector's own words, and the fix
    line: str
    #: when this problem was first seen (ns since the epoch)
    since_time_unix_nano: int


class _Inflight(NamedTuple):
    replay: bool
    request: ExportTraceServiceRequest
    spans: int


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
        self._max_queue = max_queue_spans
        self._batch = max_batch_spans
        self._max_bytes = max(1024, max_batch_bytes)
        self._adopt_interval_s = adopt_interval_s
        self._adopt_at = time.monotonic() + adopt_interval_s
        self._trimmed = 0
        self._written_ahead = 0
        self._send_lock = threading.Lock()  # one send at a time (worker, or persist without spool)
        self._delay_s = schedule_delay_s
        self._timeout_s = export_timeout_s
        self._backoff = Backoff(retry_initial_backoff_s, max(retry_initial_backoff_s, retry_max_backoff_s))
        self._shutdown_timeout_s = shutdown_timeout_s

        self._queue: deque[ReadableSpan | EncodedSpan] = deque()
        self._wakeup = threading.Event()
        self._cv = threading.Condition()  # guards _taken/_settled/_flush_target and the counters
        self._state = threading.Lock()  # guards _inflight/_abandoned
        self._taken = 0
        self._settled = 0
        self._flush_target = 0
        self._exported = 0
        self._spooled = 0
        self._replayed = 0
        self._dropped = 0
        self._rejected = 0
        self._partial = 0
        self._failures = 0
        self._retry_at = 0.0
        self._closed = False
        self._stopping = False
        self._abandoned = False
        self._deadline = 0.0
        self._inflight: _Inflight | None = None
        self._last_detail = ""
        self._last_explained = ""
        self._replay_command = replay_command
        self._problem: DeliveryProblem | None = None
        self._said: set[tuple[str, str, str]] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- the caller's side (any thread) ---------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        """Queue a finished span. O(1), never blocks, never raises."""
        self._enqueue(span)

    def _enqueue(self, span: ReadableSpan | EncodedSpan) -> None:
        queue = self._queue
        if self._closed or len(queue) >= self._max_queue:
            with self._cv:
                self._dropped += 1
            return
        queue.append(span)
        if len(queue) >= self._batch and not self._wakeup.is_set():
            self._wakeup.set()

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
        batch = list(spans)
        queue = self._queue
        with self._cv:
            if self._closed:
                self._dropped += len(batch)
                return None
            room = max(0, self._max_queue - len(queue))
            if len(batch) > room:
                self._dropped += len(batch) - room
                batch = batch[:room]
            queue.extend(batch)
            ticket = self._taken + len(queue)
        if len(queue) >= self._batch and not self._wakeup.is_set():
            self._wakeup.set()
        return ticket

    def room(self) -> int:
        """Spans the memory queue can take now (``max_queue_spans`` minus those queued)."""
        return max(0, self._max_queue - len(self._queue))

    def settled(self) -> int:
        """Spans ever queued that are settled: exported, spooled, or counted dropped (compare
        with a :meth:`submit` ticket)."""
        with self._cv:
            return self._settled

    def wait_settled(self, ticket: int, timeout_s: float) -> bool:
        """Send what is queued up to ``ticket`` now (no schedule delay) and wait until it is
        settled, at most ``timeout_s`` seconds. Returns whether it is."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cv:
            self._flush_target = max(self._flush_target, ticket)
            self._wakeup.set()
            while self._settled < ticket:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

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
        if self._closed and self.spool is None:
            with self._cv:
                self._dropped += len(batch)
            return False
        try:
            request = encode_spans(batch)
        except Exception:  # noqa: BLE001 - a malformed span; the worker sorts the batch out span by span
            for span in batch:
                self._enqueue(span)
            return False
        try:
            if self.spool is None:
                with self._send_lock:
                    result = self.sender.send(request, timeout_s=self._timeout_s)
                if not result.ok:
                    raise OSError(result.detail)
                with self._cv:
                    self._exported += len(batch)
                    self._written_ahead += len(batch)
                return True
            pieces, trimmed = split_request(request, self._max_bytes)
            for piece, count in pieces:
                evicted = self.spool.append(piece, count, key=key)
                if evicted:
                    _log.warning("spool full: %d oldest spans evicted", evicted)
            with self._cv:
                self._written_ahead += len(batch)
                self._trimmed += trimmed
        except OSError as exc:
            _log.error("write-ahead of %d spans failed (%s); queued in memory instead", len(batch), exc)
            for span in batch:
                self._enqueue(span)
            return False
        self._wakeup.set()
        return True

    def statistics(self) -> ExportStatistics:
        """A consistent snapshot of the counters."""
        spool = self.spool.statistics() if self.spool is not None else None
        with self._cv:
            return ExportStatistics(
                queued=len(self._queue),
                exported=self._exported,
                spooled=self._spooled,
                replayed=self._replayed,
                dropped=self._dropped,
                evicted=spool.evicted_spans if spool else 0,
                rejected=self._rejected + (spool.rejected_spans if spool else 0),
                partially_rejected=self._partial,
                spool_spans=spool.spans if spool else 0,
                export_failures=self._failures,
                trimmed=self._trimmed,
                written_ahead=self._written_ahead,
            )

    @property
    def last_error(self) -> str:
        """One line on the last failed send and what to check (``""`` when none)."""
        return self._last_explained or self._last_detail

    def problem(self) -> DeliveryProblem | None:
        """Why spans are not reaching the collector now, or ``None`` while they are (or nothing
        was sent yet). A refusal stands until a later request is accepted whole."""
        return self._problem

    def _note_problem(self, kind: str, line: str, *, key: tuple[str, str, str], level: int) -> None:
        """Keep ``line`` as the current problem and say it once per ``key`` (at once, on the
        worker thread: the command line shows it as ``servewatch: error: ...``)."""
        if self._problem is None or self._problem.kind != kind or self._problem.line != line:
            self._problem = DeliveryProblem(kind, line, time.time_ns())
        if key not in self._said:
            self._said.add(key)
            _log.log(level, "%s", line)

    def _kept_note(self) -> str:
        """Where refused spans are kept and the command that sends them once the cause is fixed."""
        if self.spool is None:
            return "counted as lost (no spool with the embedded file default)"
        rejected = self.spool.directory / "rejected"
        command = self._replay_command(rejected) if self._replay_command is not None else f"servewatch export {rejected}"
        return f"kept under {rejected}; send them once fixed with: {command}"

    def flush(self, timeout_s: float) -> bool:
        """Deliver every span queued so far, and the spool, within ``timeout_s`` seconds.

        Waits until the spans queued before the call are settled (delivered, spooled or counted
        as dropped) and the spool has been replayed, or until the deadline: with the collector
        down it takes the whole ``timeout_s`` (the spans are safe in the spool meanwhile).

        Returns:
            ``True`` only when all of them reached the collector and the spool is empty;
            ``False`` when any are spooled or the deadline passed (nothing is lost either way).
        """
        if self._closed:
            return self._spool_empty()
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cv:
            target = self._taken + len(self._queue)
            self._flush_target = max(self._flush_target, target)
            self._wakeup.set()
            while True:
                settled = self._settled >= target
                if settled and self._spool_empty():
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(min(remaining, 0.05) if settled else remaining)
        return self._spool_empty()

    def _spool_empty(self) -> bool:
        return self.spool is None or len(self.spool) == 0

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """SDK entry point; see :meth:`flush` (here the timeout is honoured)."""
        return self.flush(timeout_millis / 1000)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop: deliver what fits before the deadline, spool the rest, release the sender.

        Bounded by ``timeout_s`` (default ``shutdown_timeout_s``) plus a short local write of
        what is left. Safe to call twice.
        """
        if self._closed:
            return
        budget_s = self._shutdown_timeout_s if timeout_s is None else timeout_s
        self._deadline = time.monotonic() + max(0.0, budget_s)
        self._closed = True
        self._stopping = True
        self._wakeup.set()
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if self._thread.is_alive():
            self.sender.abort()
            self._thread.join(_ABORT_GRACE_S)
        if self._thread.is_alive():
            with self._state:
                self._abandoned = True
                inflight = self._inflight
            _log.warning("export worker did not finish by the shutdown deadline; spooling what is left")
            if inflight is not None and not inflight.replay:
                self._to_spool(inflight.request, inflight.spans)
        self._spool_queue()
        self.sender.close()
        if self.spool is not None:
            self.spool.close()

    # --- the worker thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._loop()
                self._drain_on_stop()
                return
            except Exception:  # noqa: BLE001 - log, keep the worker alive (shutdown still spools the queue)
                _log.exception("export worker error; continuing")
                if self._stopping:
                    return
                time.sleep(0.05)

    def _flush_pending(self) -> bool:
        return self._flush_target > self._settled

    def _loop(self) -> None:
        last_send = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            spool = self.spool
            if spool is not None and now >= self._adopt_at:
                self._adopt_at = now + self._adopt_interval_s
                spool.adopt_stranded()
            if spool is not None and len(spool):
                last_send = self._turn_behind_spool(now, last_send)
                continue
            if self._batch_due(now, last_send):
                last_send = now
                self._ship(self._take())
                continue
            self._wait(self._delay_s - (now - last_send) if self._queue else self._delay_s)

    def _batch_due(self, now: float, last_send: float) -> bool:
        """A batch is full, flushed, or has waited the schedule delay since the last send."""
        queue = self._queue
        return len(queue) >= self._batch or bool(queue and (self._flush_pending() or now - last_send >= self._delay_s))

    def _turn_behind_spool(self, now: float, last_send: float) -> float:
        """One turn of the loop while the spool holds requests; the time of the last send."""
        queue = self._queue
        if now >= self._retry_at:
            self._replay_head()
            if len(queue) >= self._batch or (queue and self._flush_pending()):
                self._ship(self._take())
            return last_send
        # Outage: keep new spans behind the spool, moving full batches to disk.
        if self._batch_due(now, last_send):
            self._ship(self._take())
            return now
        self._wait(min(self._retry_at - now, self._delay_s))
        return last_send

    def _wait(self, timeout_s: float) -> None:
        self._wakeup.clear()
        queue = self._queue
        if self._stopping or len(queue) >= self._batch or (queue and self._flush_pending()):
            return
        self._wakeup.wait(max(0.001, timeout_s))

    def _take(self) -> list[ReadableSpan | EncodedSpan]:
        queue = self._queue
        batch: list[ReadableSpan | EncodedSpan] = []
        with self._cv:
            for _ in range(min(self._batch, len(queue))):
                batch.append(queue.popleft())
            self._taken += len(batch)
        return batch

    def _settle(self, spans: int, *, exported: int = 0, spooled: int = 0, dropped: int = 0) -> None:
        with self._cv:
            self._settled += spans
            self._exported += exported
            self._spooled += spooled
            self._dropped += dropped
            self._cv.notify_all()

    def _ship(self, batch: list[ReadableSpan | EncodedSpan]) -> None:
        """Send one fresh batch, or spool it when the spool is busy or we are backing off."""
        if not batch:
            return
        request, _count = self._encode(batch)
        if request is None:
            return
        pieces, trimmed = split_request(request, self._max_bytes)
        if trimmed:
            with self._cv:
                self._trimmed += trimmed
        for piece, n in pieces:
            self._ship_request(piece, n)

    def _ship_request(self, request: ExportTraceServiceRequest, count: int, depth: int = 0) -> None:
        spool = self.spool
        if spool is not None and (len(spool) or time.monotonic() < self._retry_at or self._spool_only()):
            self._to_spool(request, count)
            return
        result = self._send(request, count, replay=False)
        if result is None:
            return
        if result.delivery is Delivery.TOO_LARGE and depth < _MAX_SPLIT_DEPTH:
            self._note_too_large(result, request)
            pieces, trimmed = halve_request(request)
            with self._cv:
                self._trimmed += trimmed
            for piece, n in pieces:
                self._ship_request(piece, n, depth + 1)
            return
        if result.ok and result.rejected_spans >= count:
            self._all_rejected(request, count, result)
        elif result.ok:
            self._succeeded(result, count)
            with self._cv:
                self._partial += result.rejected_spans
            self._settle(count, exported=count - result.rejected_spans)
        elif result.delivery is Delivery.PERMANENT:
            self._reject(request, count, result)
        else:
            self._failed(result)
            self._to_spool(request, count)

    def _encode(self, batch: list[ReadableSpan | EncodedSpan]) -> tuple[ExportTraceServiceRequest | None, int]:
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
            self._settle(len(batch) - len(good), dropped=len(batch) - len(good))
            return (encode_spans(good), len(good)) if good else (None, 0)

    def _replay_head(self) -> None:
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
        result = self._send(request, entry.spans, replay=True)
        if result is None:
            return
        if result.delivery is Delivery.TOO_LARGE:
            self._note_too_large(result, request)
            if entry.spans <= 1 and entry.size_bytes <= 2048:
                spool.reject(entry)
                return
            self._split_entry(entry, halve_request(request))
            return
        if result.ok and result.rejected_spans >= entry.spans:
            self._say_rejected(entry.spans, result)
            spool.reject(entry)  # kept whole under rejected/: replayable once the cause is fixed
        elif result.ok:
            self._succeeded(result, entry.spans)
            self._remove_delivered(entry)
            with self._cv:
                self._replayed += entry.spans - result.rejected_spans
                self._partial += result.rejected_spans
        elif result.delivery is Delivery.PERMANENT:
            self._last_detail = result.detail
            self._say_refused(entry.spans, result)
            spool.reject(entry)
        else:
            self._failed(result)

    def _remove_delivered(self, entry: SpoolEntry) -> None:
        assert self.spool is not None
        try:
            self.spool.remove(entry)
        except OSError as exc:  # the delivered-keys ledger: the file stays, sent again later (once more)
            _log.error("could not record delivered spool batch %s (%s); it will be sent again", entry.path.name, exc)
            self._retry_at = time.monotonic() + self._backoff.next_delay_s()

    def _split_entry(self, entry: SpoolEntry, split: tuple[list[tuple[ExportTraceServiceRequest, int]], int]) -> None:
        pieces, trimmed = split
        assert self.spool is not None
        try:
            self.spool.split(entry, pieces)
        except OSError as exc:
            _log.error("could not split spooled batch %s (%s); moved to rejected/", entry.path.name, exc)
            self.spool.reject(entry)
            return
        with self._cv:
            self._trimmed += trimmed

    def _note_too_large(self, result: SendResult, request: ExportTraceServiceRequest) -> None:
        if result.detail != self._last_detail:
            _log.info("collector %s refused a %d-byte request as too large (%s); splitting it",
                      self.sender.target, request.ByteSize(), result.detail)
        self._last_detail = result.detail

    def _send(self, request: ExportTraceServiceRequest, spans: int, *, replay: bool) -> SendResult | None:
        """One attempt. ``None``: shutdown abandoned the worker while it was sending."""
        with self._state:
            if self._abandoned:
                return SendResult(Delivery.RETRYABLE, "shutdown deadline passed")
            self._inflight = _Inflight(replay, request, spans)
        timeout_s = self._timeout_s
        if self._stopping:
            timeout_s = min(timeout_s, max(0.01, self._deadline - time.monotonic() - _SPOOL_ONLY_MARGIN_S))
        try:
            with self._send_lock:
                result: SendResult | None = self.sender.send(request, timeout_s=timeout_s)
        finally:
            with self._state:
                self._inflight = None
                abandoned = self._abandoned
        # Past the deadline shutdown() took this batch over (spooled it); touching it again
        # here could only duplicate it.
        return None if abandoned else result

    def _succeeded(self, result: SendResult | None = None, spans: int = 0) -> None:
        self._backoff.reset()
        self._retry_at = 0.0
        if result is not None and result.rejected_spans:
            # some (not all) spans of the request rejected: which ones, OTLP does not say, so they
            # cannot be kept apart from those accepted (re-sending the request would duplicate them)
            line = (
                f"collector {self.sender.target} rejected {result.rejected_spans} of {spans} span(s) of a request "
                f"(OTLP partial success: {result.message or 'no reason given'}); it does not say which, so they are "
                "counted (servewatch.export.spans, outcome rejected), not kept"
            )
            self._note_problem("rejected", line, key=("partial", self.sender.target, result.message), level=logging.WARNING)
            return
        if self._problem is not None:
            _log.info("collector %s accepts spans again", self.sender.target)
            self._problem = None

    def _say_refused(self, spans: int, result: SendResult) -> None:
        # said once per cause: the count is this request's; later ones are counted (the one-shot
        # commands' last line and `servewatch status` give the total)
        line = (f"collector {self.sender.target} refused a request of {spans} span(s) (the same cause again is counted, "
                f"not said): {result.explain()}; {self._kept_note()}")
        self._note_problem("refused", line, key=("refused", result.detail, result.message), level=logging.ERROR)

    def _say_rejected(self, spans: int, result: SendResult) -> None:
        line = (
            f"collector {self.sender.target} rejected all {spans} span(s) of a request (OTLP partial success: "
            f"{result.message or 'no reason given'}); {self._kept_note()}"
        )
        self._note_problem("rejected", line, key=("all_rejected", self.sender.target, result.message), level=logging.ERROR)

    def _all_rejected(self, request: ExportTraceServiceRequest, spans: int, result: SendResult) -> None:
        """Every span of a fresh request rejected (OTLP partial success): kept like a refusal."""
        self._say_rejected(spans, result)
        self._keep_rejected(request, spans)

    def _failed(self, result: SendResult) -> None:
        with self._cv:
            self._failures += 1
        if result.detail != self._last_detail:
            _log.warning("export to %s failed (%s); spooling and retrying", self.sender.target, result.explain())
        self._last_detail = result.detail
        self._last_explained = result.explain()
        if self._problem is None or self._problem.kind == "unreachable":
            line = f"collector {self.sender.target} not reachable: {result.explain()}; spans wait in the spool and are retried"
            if self._problem is None or self._problem.line != line:
                self._problem = DeliveryProblem("unreachable", line, time.time_ns())
        # the collector's Retry-After / RetryInfo, when it sent one, is the least wait
        self._retry_at = time.monotonic() + self._backoff.next_delay_s(result.retry_after_s)

    def _reject(self, request: ExportTraceServiceRequest, spans: int, result: SendResult) -> None:
        with self._cv:
            self._failures += 1
        self._last_detail = result.detail
        self._last_explained = result.explain()
        self._say_refused(spans, result)  # every refusal counted, each cause said once
        self._keep_rejected(request, spans)

    def _keep_rejected(self, request: ExportTraceServiceRequest, spans: int) -> None:
        if self.spool is not None:
            try:
                self.spool.add_rejected(request, spans)
            except OSError:
                self._settle(spans, dropped=spans)
                return
            self._settle(spans)
        else:
            with self._cv:
                self._rejected += spans
            self._settle(spans)

    def _to_spool(self, request: ExportTraceServiceRequest, spans: int) -> None:
        if self.spool is None:
            self._settle(spans, dropped=spans)
            return
        try:
            self.spool.append(request, spans)
        except OSError as exc:
            _log.error("spool write failed (%s); %d spans lost", exc, spans)
            self._settle(spans, dropped=spans)
            return
        self._settle(spans, spooled=spans)

    def _spool_only(self) -> bool:
        return self._stopping and self._deadline - time.monotonic() < _SPOOL_ONLY_MARGIN_S

    def _drain_on_stop(self) -> None:
        """Stopping: deliver the spool first (it holds the written-ahead spans of the last actions,
        older than anything queued), then the queue, while the deadline allows. A failed replay
        (the collector is down) ends the replay: the rest stays spooled for the next run."""
        spool = self.spool
        while spool is not None and len(spool) and not self._spool_only() and time.monotonic() >= self._retry_at:
            with self._state:
                if self._abandoned:
                    return
            self._replay_head()
        while self._queue:
            with self._state:
                if self._abandoned:
                    return
            self._ship(self._take())

    def _spool_queue(self) -> None:
        """After the worker ended or was abandoned: everything still queued goes to the spool."""
        while self._queue:
            batch = self._take()
            request, count = self._encode(batch) if batch else (None, 0)
            if request is not None:
                self._to_spool(request, count)
