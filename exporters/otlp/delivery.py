"""The span processor's send part: one OTLP request at a time, and what its answer means.

Owns :class:`RequestSlot` (one request in flight, bounded by the export timeout and the shutdown
deadline, taken over by shutdown when the worker is abandoned), :class:`Inflight`, and
:class:`Outcome` / :func:`classify` (a :class:`~exporters.otlp.transport.SendResult` as delivered,
all rejected, too large, refused or failed).

Imports opentelemetry-proto and :mod:`exporters.otlp.transport`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from exporters.otlp.transport import Delivery, RequestSender, SendResult

__all__ = ["Inflight", "Outcome", "RequestSlot", "classify"]

#: Below this much time left before the shutdown deadline, stop sending and spool the rest, in seconds.
SPOOL_ONLY_MARGIN_S = 0.1


class Outcome(Enum):
    """What one send's :class:`~exporters.otlp.transport.SendResult` means for its spans."""

    #: accepted (some spans may be reported rejected: OTLP partial success, counted)
    DELIVERED = "delivered"
    #: accepted, but every span reported rejected: kept like a refusal
    ALL_REJECTED = "all_rejected"
    #: over the collector's size limit: split in halves and sent again
    TOO_LARGE = "too_large"
    #: refused permanently: kept under ``rejected/``, never retried
    REFUSED = "refused"
    #: failed, worth retrying: spooled, replayed after a backoff
    FAILED = "failed"


def classify(result: SendResult, spans: int) -> Outcome:
    """The :class:`Outcome` of ``result``, the answer to a request of ``spans`` spans."""
    if result.ok:
        return Outcome.ALL_REJECTED if result.rejected_spans >= spans else Outcome.DELIVERED
    if result.delivery is Delivery.TOO_LARGE:
        return Outcome.TOO_LARGE
    if result.delivery is Delivery.PERMANENT:
        return Outcome.REFUSED
    return Outcome.FAILED


class Inflight(NamedTuple):
    """The request being sent: a spool replay or a fresh batch, and its spans."""

    replay: bool
    #: ``None``: a span-files line written from the spans' text (:meth:`RequestSlot.send_line`;
    #: only without a spool, so there is nothing to spool it to)
    request: ExportTraceServiceRequest | None
    spans: int


class RequestSlot:
    """One send at a time (the worker, or a write-ahead without a spool), each one attempt
    bounded by ``timeout_s`` seconds and, once stopping, by the shutdown ``deadline``
    (monotonic seconds).

    Args:
        sender: where requests go (see :mod:`exporters.otlp.transport`).
        timeout_s: bound on one send attempt, seconds.
    """

    def __init__(self, sender: RequestSender[ExportTraceServiceRequest], timeout_s: float) -> None:
        self.sender = sender
        self.timeout_s = timeout_s
        self._send_lock = threading.Lock()  # one send at a time (worker, or persist without spool)
        self._state = threading.Lock()  # guards _inflight/_abandoned
        self._inflight: Inflight | None = None
        self._abandoned = False
        #: shutdown began: sends are capped by ``deadline``
        self.stopping = False
        #: the shutdown deadline, monotonic seconds (set before ``stopping``)
        self.deadline = 0.0

    def send(self, request: ExportTraceServiceRequest, spans: int, *, replay: bool) -> SendResult | None:
        """One attempt. ``None``: shutdown abandoned the worker while it was sending."""
        return self._attempt(Inflight(replay, request, spans), lambda timeout_s: self.sender.send(request, timeout_s=timeout_s))

    def send_line(self, line: str, spans: int) -> SendResult | None:
        """One attempt to write a fresh request already written as its OTLP/JSON line (a sender
        with ``send_line``: the span files), as :meth:`send`."""
        send_line = self.sender.send_line  # type: ignore[attr-defined]
        return self._attempt(Inflight(False, None, spans), lambda timeout_s: send_line(line, spans, timeout_s=timeout_s))

    def _attempt(self, inflight: Inflight, send: Callable[[float], SendResult]) -> SendResult | None:
        with self._state:
            if self._abandoned:
                return SendResult(Delivery.RETRYABLE, "shutdown deadline passed")
            self._inflight = inflight
        timeout_s = self.timeout_s
        if self.stopping:
            timeout_s = min(timeout_s, max(0.01, self.deadline - time.monotonic() - SPOOL_ONLY_MARGIN_S))
        try:
            with self._send_lock:
                result: SendResult | None = send(timeout_s)
        finally:
            with self._state:
                self._inflight = None
                abandoned = self._abandoned
        # Past the deadline shutdown() took this batch over (spooled it); touching it again
        # here could only duplicate it.
        return None if abandoned else result

    def send_now(self, request: ExportTraceServiceRequest) -> SendResult:
        """One attempt outside the worker (a write-ahead without a spool), bounded by ``timeout_s``."""
        with self._send_lock:
            return self.sender.send(request, timeout_s=self.timeout_s)

    def spool_only(self) -> bool:
        """Stopping, and too close to the deadline to send: spool instead."""
        return self.stopping and self.deadline - time.monotonic() < SPOOL_ONLY_MARGIN_S

    def abandoned(self) -> bool:
        """Shutdown took over from the worker (:meth:`abandon`)."""
        with self._state:
            return self._abandoned

    def abandon(self) -> Inflight | None:
        """Shutdown gives up on the worker: what it is sending now (``None``: nothing)."""
        with self._state:
            self._abandoned = True
            return self._inflight
