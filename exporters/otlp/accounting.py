"""The span processor's accounting: what became of every span, and why delivery stalls.

Owns :class:`ExportStatistics` and :class:`DeliveryProblem` (re-exported by
:mod:`exporters.otlp.processor`, their public home), :class:`ExportCounters` (the counters behind
``statistics()``, guarded by one condition the span queue shares) and :class:`ProblemNotes` (the
current :class:`DeliveryProblem`, the last failure's detail, and the log lines said once per cause).

Imports the standard library and :mod:`exporters.otlp.spool` / :mod:`exporters.otlp.transport` (types).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from exporters.otlp.spool import Spool, SpoolStatistics
    from exporters.otlp.transport import RequestSender, SendResult

__all__ = ["DeliveryProblem", "ExportCounters", "ExportStatistics", "ProblemNotes"]

#: the processor's logger: its log lines keep their logger name
_log = logging.getLogger("exporters.otlp.processor")


class ExportStatistics(NamedTuple):
    """Span counters of a :class:`~exporters.otlp.processor.LosslessSpanProcessor` since it started.

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


class ExportCounters:
    """The span counters of one processor, in spans (``failures``: send attempts).

    ``cv`` guards them; the span queue guards its tickets with the same condition, so a span
    settles and is counted in one step, and :meth:`snapshot_locked` is consistent with the queue.
    """

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.exported = 0
        self.spooled = 0
        self.replayed = 0
        self.dropped = 0
        self.rejected = 0
        self.partial = 0
        self.failures = 0
        self.trimmed = 0
        self.written_ahead = 0

    def add(self, *, dropped: int = 0, replayed: int = 0, partial: int = 0, rejected: int = 0,
            failures: int = 0, trimmed: int = 0, exported: int = 0, written_ahead: int = 0) -> None:
        """Add to the counters, under ``cv``."""
        with self.cv:
            self.add_locked(dropped=dropped, replayed=replayed, partial=partial, rejected=rejected, failures=failures,
                            trimmed=trimmed, exported=exported, written_ahead=written_ahead)

    def add_locked(self, *, dropped: int = 0, replayed: int = 0, partial: int = 0, rejected: int = 0, failures: int = 0,
                   trimmed: int = 0, exported: int = 0, written_ahead: int = 0, spooled: int = 0) -> None:
        """Add to the counters; the caller holds ``cv``."""
        self.exported += exported
        self.spooled += spooled
        self.replayed += replayed
        self.dropped += dropped
        self.rejected += rejected
        self.partial += partial
        self.failures += failures
        self.trimmed += trimmed
        self.written_ahead += written_ahead

    def snapshot_locked(self, queued: int, spool: SpoolStatistics | None) -> ExportStatistics:
        """The counters as :class:`ExportStatistics`, with ``queued`` spans in memory and the
        spool's own counts (``None``: no spool); the caller holds ``cv``."""
        return ExportStatistics(
            queued=queued,
            exported=self.exported,
            spooled=self.spooled,
            replayed=self.replayed,
            dropped=self.dropped,
            evicted=spool.evicted_spans if spool else 0,
            rejected=self.rejected + (spool.rejected_spans if spool else 0),
            partially_rejected=self.partial,
            spool_spans=spool.spans if spool else 0,
            export_failures=self.failures,
            trimmed=self.trimmed,
            written_ahead=self.written_ahead,
        )


class ProblemNotes:
    """What the processor says about failed deliveries: the current :class:`DeliveryProblem`,
    the last failure's detail, and each cause's log line, said once.

    Args:
        sender: the sender of the requests (its ``target`` names the collector in each line).
        spool: where refused spans are kept (``None``: nowhere, they are counted lost).
        replay_command: the command line that sends a folder of span files to this destination.
    """

    def __init__(self, sender: RequestSender[ExportTraceServiceRequest], spool: Spool | None,
                 replay_command: Callable[[Path], str] | None) -> None:
        self._sender = sender
        self._spool = spool
        self._replay_command = replay_command
        self.problem: DeliveryProblem | None = None
        #: the last failed or refused send's ``SendResult.detail`` / ``explain()`` (``""``: none)
        self.last_detail = ""
        self.last_explained = ""
        self._said: set[tuple[str, str, str]] = set()

    def note(self, kind: str, line: str, *, key: tuple[str, str, str], level: int) -> None:
        """Keep ``line`` as the current problem and say it once per ``key`` (at once, on the
        worker thread: the command line shows it as ``servewatch: error: ...``)."""
        if self.problem is None or self.problem.kind != kind or self.problem.line != line:
            self.problem = DeliveryProblem(kind, line, time.time_ns())
        if key not in self._said:
            self._said.add(key)
            _log.log(level, "%s", line)

    def accepted(self, result: SendResult | None, spans: int) -> None:
        """A request of ``spans`` spans was accepted: a partial rejection is noted, else the
        problem (if any) is over."""
        if result is not None and result.rejected_spans:
            # some (not all) spans of the request rejected: which ones, OTLP does not say, so they
            # cannot be kept apart from those accepted (re-sending the request would duplicate them)
            line = (
                f"collector {self._sender.target} rejected {result.rejected_spans} of {spans} span(s) of a request "
                f"(OTLP partial success: {result.message or 'no reason given'}); it does not say which, so they are "
                "counted (servewatch.export.spans, outcome rejected), not kept"
            )
            self.note("rejected", line, key=("partial", self._sender.target, result.message), level=logging.WARNING)
            return
        if self.problem is not None:
            _log.info("collector %s accepts spans again", self._sender.target)
            self.problem = None

    def refused(self, spans: int, result: SendResult) -> None:
        """A request of ``spans`` spans refused permanently."""
        # said once per cause: the count is this request's; later ones are counted (the one-shot
        # commands' last line and `servewatch status` give the total)
        line = (f"collector {self._sender.target} refused a request of {spans} span(s) (the same cause again is counted, "
                f"not said): {result.explain()}; {self._kept_note()}")
        self.note("refused", line, key=("refused", result.detail, result.message), level=logging.ERROR)

    def all_rejected(self, spans: int, result: SendResult) -> None:
        """Every span of a request of ``spans`` spans rejected (OTLP partial success)."""
        line = (
            f"collector {self._sender.target} rejected all {spans} span(s) of a request (OTLP partial success: "
            f"{result.message or 'no reason given'}); {self._kept_note()}"
        )
        self.note("rejected", line, key=("all_rejected", self._sender.target, result.message), level=logging.ERROR)

    def too_large(self, result: SendResult, request: ExportTraceServiceRequest) -> None:
        """``request`` refused as too large (it is split next)."""
        if result.detail != self.last_detail:
            _log.info("collector %s refused a %d-byte request as too large (%s); splitting it",
                      self._sender.target, request.ByteSize(), result.detail)
        self.last_detail = result.detail

    def failed(self, result: SendResult) -> None:
        """A send failed (retryable): said when its detail changes; the problem is ``unreachable``
        unless a refusal or rejection stands."""
        if result.detail != self.last_detail:
            _log.warning("export to %s failed (%s); spooling and retrying", self._sender.target, result.explain())
        self.last_detail = result.detail
        self.last_explained = result.explain()
        if self.problem is None or self.problem.kind == "unreachable":
            line = f"collector {self._sender.target} not reachable: {result.explain()}; spans wait in the spool and are retried"
            if self.problem is None or self.problem.line != line:
                self.problem = DeliveryProblem("unreachable", line, time.time_ns())

    def _kept_note(self) -> str:
        """Where refused spans are kept and the command that sends them once the cause is fixed."""
        if self._spool is None:
            return "counted as lost (no spool with the embedded file default)"
        rejected = self._spool.directory / "rejected"
        command = self._replay_command(rejected) if self._replay_command is not None else f"servewatch export {rejected}"
        return f"kept under {rejected}; send them once fixed with: {command}"
