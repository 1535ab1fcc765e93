"""servewatch's metric exporters: :class:`SpoolingMetricExporter` (OTLP, survives an outage) and
:class:`OtlpJsonMetricExporter` (the embedded default, OTLP/JSON lines).

Owns the network side of servewatch's own metrics. It sends through the same senders as spans
(:mod:`exporters.otlp.transport`: TLS/mTLS, gzip, lower-cased gRPC metadata, one attempt per call), so
``OTEL_EXPORTER_OTLP_HEADERS='Authorization=...'`` works for metrics exactly as for traces. An
export the collector does not take (down, timing out) is written to ``<data_dir>/<host>/spool/metrics/``
as one ``ExportMetricsServiceRequest`` file (atomic, 0600; the spans' :class:`~exporters.otlp.spool.Spool`,
the one persistent queue) and replayed oldest first before the next export; past ``max_files`` the
oldest is deleted and its data points counted as lost. A
request refused permanently is counted as lost. :meth:`statistics` reports all of it, and
:class:`~exporters.otlp.metrics.Metrics` exports those counts as ``servewatch.export.metric_points``.

Imports opentelemetry-sdk/proto, :mod:`exporters.otlp.otlp_json`, :mod:`exporters.otlp.spool` and :mod:`exporters.otlp.transport`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from exporters.otlp.otlp_json import RotatingJsonLinesWriter, message_to_json
from exporters.otlp.spool import Spool, SpoolEntry
from exporters.otlp.transport import Delivery, RequestSender, SendResult

__all__ = ["MetricExportStatistics", "OtlpJsonMetricExporter", "SpoolingMetricExporter", "data_point_count"]

_log = logging.getLogger(__name__)

SUFFIX = ".metrics.binpb"


class OtlpJsonMetricExporter(MetricExporter):
    """Writes each metrics export as one OTLP/JSON ``ExportMetricsServiceRequest`` line.

    Args:
        directory: where ``metrics-*.jsonl`` go (rotated by size like the span files).
        max_file_bytes / max_files: rotation and retention, see
            :class:`~exporters.otlp.otlp_json.RotatingJsonLinesWriter`.
    """

    def __init__(self, directory: Path, *, max_file_bytes: int = 16 * 1024 * 1024, max_files: int = 8) -> None:
        super().__init__()
        self.writer = RotatingJsonLinesWriter(directory, prefix="metrics", max_file_bytes=max_file_bytes, max_files=max_files)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        try:
            self.writer.write_line(message_to_json(encode_metrics(metrics_data)))
        except OSError as exc:
            _log.warning("metrics file write failed: %s", exc)
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.writer.close()


class MetricExportStatistics(NamedTuple):
    """Data-point counters of a :class:`SpoolingMetricExporter` since it started."""

    #: data points delivered on the first attempt
    exported: int
    #: data points written to the metrics spool (collector unreachable)
    spooled: int
    #: spooled data points delivered later
    replayed: int
    #: data points that will never be delivered: spool full (oldest dropped), refused
    #: permanently, or the spool write failed
    lost: int
    #: data points waiting in the metrics spool now
    spool_points: int
    #: failed send attempts
    export_failures: int


def data_point_count(request: ExportMetricsServiceRequest) -> int:
    """Data points in a metrics request (every point type)."""
    total = 0
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                if kind is not None:
                    total += len(getattr(metric, kind).data_points)
    return total


class SpoolingMetricExporter(MetricExporter):
    """A ``MetricExporter`` over a :class:`~exporters.otlp.transport.RequestSender` with a disk spool
    (the same :class:`~exporters.otlp.spool.Spool` as spans: one file per failed export, locked by its
    process, replayed oldest first).

    Args:
        sender: a metrics sender (``make_sender(..., signal="metrics")``).
        spool_dir: where undelivered exports wait (created 0700).
        timeout_s: bound on one export call (replays included), seconds.
        max_files: spool cap in files (one per failed export; at the default 10 s interval 360
            files is an hour of outage); past it the oldest is deleted and counted lost.
        max_bytes: spool cap in bytes, likewise.
    """

    def __init__(self, sender: RequestSender[ExportMetricsServiceRequest], spool_dir: Path, *, timeout_s: float = 3.0,
                 max_files: int = 360, max_bytes: int = 64 * 1024 * 1024) -> None:
        super().__init__()
        self.sender = sender
        self.spool = Spool(spool_dir, max_bytes=max_bytes, suffix=SUFFIX, max_entries=max(1, max_files))
        self.spool_dir = self.spool.directory
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._exported = self._spooled = self._replayed = self._lost = self._failures = 0
        self._last_detail = ""
        self._said: set[str] = set()
        self._retry_at = 0.0

    # --- MetricExporter -------------------------------------------------------------------

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        try:
            request = encode_metrics(metrics_data)
        except Exception:  # noqa: BLE001 - an encoder bug must not break the reader thread
            _log.exception("metrics could not be encoded")
            return MetricExportResult.FAILURE
        points = data_point_count(request)
        deadline = time.monotonic() + min(self._timeout_s, timeout_millis / 1000)
        with self._lock:
            if time.monotonic() < self._retry_at:  # the collector asked us to wait (Retry-After, RetryInfo)
                self._spool(request, points)
                return MetricExportResult.FAILURE
            if not self._replay(deadline):
                self._spool(request, points)
                return MetricExportResult.FAILURE
            result = self.sender.send(request, timeout_s=max(0.01, deadline - time.monotonic()))
            if result.ok:
                self._exported += points - result.rejected_spans
                self._lost += result.rejected_spans
                return MetricExportResult.SUCCESS
            self._failures += 1
            if result.delivery is Delivery.RETRYABLE:
                self._note(result.explain())
                self._wait_as_asked(result)
                self._spool(request, points)
            else:
                self._refused(result, points)
            return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.sender.close()
        self.spool.close()

    # --- ours -----------------------------------------------------------------------------

    def statistics(self) -> MetricExportStatistics:
        with self._lock:
            return MetricExportStatistics(
                exported=self._exported,
                spooled=self._spooled,
                replayed=self._replayed,
                lost=self._lost,
                spool_points=self.spool.pending_spans,
                export_failures=self._failures,
            )

    @property
    def last_error(self) -> str:
        return self._last_detail

    def _note(self, detail: str) -> None:
        if detail != self._last_detail:
            _log.warning("metrics export to %s failed (%s); spooling", self.sender.target, detail)
        self._last_detail = detail

    def _wait_as_asked(self, result: SendResult) -> None:
        """Send nothing before the wait the collector asked for (HTTP ``Retry-After``, gRPC
        ``RetryInfo``): exports meanwhile go to the spool."""
        if result.retry_after_s:
            self._retry_at = time.monotonic() + result.retry_after_s

    def _refused(self, result: SendResult, points: int) -> None:
        """A permanent refusal: the data points are lost (counted); each cause said once."""
        self._lost += points
        line = result.explain()
        if line not in self._said:
            self._said.add(line)
            _log.error("collector %s refused servewatch's metrics (%d data point(s) lost, counted): %s", self.sender.target, points, line)
        self._last_detail = line

    def _replay(self, deadline: float) -> bool:
        """Send spooled exports oldest first, those of a dead agent's spool folder (moved here by
        the span spool that adopted it) included. ``False`` when one failed (the rest stay)."""
        self.spool.adopt_stranded()
        while (entry := self.spool.head()) is not None:
            request = ExportMetricsServiceRequest()
            try:
                data = self.spool.read(entry)
                if data is None:
                    raise ValueError("gone")
                request.ParseFromString(data)
            except (ValueError, DecodeError):
                _log.warning("unreadable metrics spool file %s; dropped", entry.path)
                self._drop(entry, lost=True)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            result = self.sender.send(request, timeout_s=remaining)
            if result.ok:
                self._replayed += entry.spans - result.rejected_spans
                self._lost += result.rejected_spans
                self._drop(entry, lost=False)
            elif result.delivery is Delivery.RETRYABLE:
                self._failures += 1
                self._note(result.explain())
                self._wait_as_asked(result)
                return False
            else:
                self._failures += 1
                self._refused(result, 0)
                self._drop(entry, lost=True)
        return True

    def _drop(self, entry: SpoolEntry, *, lost: bool) -> None:
        if self.spool.remove(entry) and lost:
            self._lost += entry.spans

    def _spool(self, request: ExportMetricsServiceRequest, points: int) -> None:
        try:
            evicted = self.spool.append(request, points)
        except OSError as exc:
            _log.error("metrics spool write failed (%s); %d data points lost", exc, points)
            self._lost += points
            return
        self._spooled += points
        self._lost += evicted  # past the cap: the oldest (or this one, alone too big) counted lost
