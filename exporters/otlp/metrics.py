"""servewatch's own metrics, as OpenTelemetry metrics.

Owns :class:`Metrics` (the instruments and a tiny recording API) and :func:`build_meter_provider`,
which exports through :class:`~exporters.otlp.metrics_export.OtlpJsonMetricExporter` (the embedded
default: OTLP/JSON lines of ``ExportMetricsServiceRequest``) or a spooling OTLP exporter.

Instruments (units per the OTel metric conventions):

* ``servewatch.export.spans`` (counter, ``{span}``), attribute ``servewatch.export.outcome`` =
  ``exported | spooled | replayed | dropped | evicted | rejected`` — read from the span
  processor's :class:`~exporters.otlp.processor.ExportStatistics`, so a drop is never silent.
* ``servewatch.export.queue.size`` / ``servewatch.export.spool.size`` (gauges, ``{span}``).
* ``servewatch.export.metric_points`` (counter, ``{data_point}``): the agent's own metric points by
  outcome ``exported | spooled | replayed | lost`` (an outage never loses metrics silently).
* ``servewatch.bus.events.dropped`` (counter, ``{event}``): high-rate events the bus dropped.
* ``servewatch.incidents`` (counter, ``{incident}``), attribute ``servewatch.incident.trigger``.
* ``servewatch.actions`` (counter, ``{action}``), attributes ``servewatch.action``,
  ``servewatch.outcome`` (dump outcomes and the rest).
* ``servewatch.detection.latency`` (histogram, ``s``): trigger condition start to incident open.
* ``servewatch.watcher.status`` (gauge, ``1``), attributes ``servewatch.watcher`` and
  ``servewatch.watcher.state`` (``ready | waiting | blind``): 1 for each watcher's current
  state, 0 for the others (alert on ``state="blind" == 1``).

Imports the OpenTelemetry metrics API and :mod:`agent.model.events`; the metrics SDK and :mod:`exporters.otlp.metrics_export` only when
:func:`build_meter_provider` runs (a ``Metrics(None)`` recorder, as ``servewatch dump`` without a
collector uses, imports neither).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Observation

from agent.model.events import ActionCompleted, Event, IncidentOpened, WatchdogStalled

if TYPE_CHECKING:  # the metrics SDK loads in build_meter_provider: Metrics(None) stays light
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.resources import Resource

    from exporters.otlp.processor import ExportStatistics
    from exporters.otlp.transport import RequestSender

__all__ = ["DETECTION_LATENCY_BUCKETS_S", "RECORDED_EVENTS", "Metrics", "build_meter_provider"]

#: The bus events :meth:`Metrics.record_events` counts.
RECORDED_EVENTS: tuple[type[Event], ...] = (IncidentOpened, ActionCompleted, WatchdogStalled)

_log = logging.getLogger(__name__)

#: Histogram bucket bounds for detection latency, in seconds (watchdog timeouts run 1 s to 10 min).
DETECTION_LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def build_meter_provider(
    resource: Resource,
    *,
    sender: RequestSender[ExportMetricsServiceRequest] | None = None,
    timeout_s: float = 3.0,
    interval_s: float = 10.0,
    file_directory: Path | None = None,
    spool_dir: Path | None = None,
) -> tuple[MeterProvider, MetricExporter]:
    """A ``MeterProvider`` exporting every ``interval_s`` seconds over OTLP (``sender``, a metrics
    sender from :func:`exporters.otlp.transport.make_sender`) with a spool under ``spool_dir``, or to
    OTLP/JSON lines under ``file_directory``. Not installed as the global provider.

    Returns:
        (provider, exporter): the exporter's ``statistics()`` counts spooled and lost points
        (:class:`~exporters.otlp.metrics_export.SpoolingMetricExporter`).
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

    from exporters.otlp.metrics_export import OtlpJsonMetricExporter

    exporter: MetricExporter
    if sender is None:
        if file_directory is None:
            raise ValueError("either an OTLP sender or a file directory is needed")
        exporter = OtlpJsonMetricExporter(file_directory)
    else:
        from exporters.otlp.metrics_export import SpoolingMetricExporter

        if spool_dir is None:
            raise ValueError("an OTLP metrics sender needs a spool directory")
        exporter = SpoolingMetricExporter(sender, spool_dir, timeout_s=timeout_s)
    reader = PeriodicExportingMetricReader(
        exporter, export_interval_millis=interval_s * 1000, export_timeout_millis=timeout_s * 1000 * 2
    )
    view = View(
        instrument_name="servewatch.detection.latency",
        aggregation=ExplicitBucketHistogramAggregation(boundaries=DETECTION_LATENCY_BUCKETS_S),
    )
    return MeterProvider(resource=resource, metric_readers=[reader], views=[view], shutdown_on_exit=False), exporter


class Metrics:
    """servewatch's instruments. All methods are cheap, thread-safe and never raise.

    Args:
        meter_provider: where the instruments live; ``None`` makes a no-op recorder (tests, or
            telemetry disabled).
    """

    def __init__(self, meter_provider: MeterProvider | None) -> None:
        self.meter_provider = meter_provider
        self._export_sources: list[Callable[[], ExportStatistics]] = []
        self._metric_sources: list[Callable[[], Any]] = []
        self._bus_sources: list[Callable[[], int]] = []
        self._status_sources: list[Callable[[], Iterable[tuple[str, str]]]] = []
        self._lock = threading.Lock()
        if meter_provider is None:
            self._incidents = self._actions = self._latency = None
            return
        meter = meter_provider.get_meter("servewatch", "0.1.0")
        self._incidents = meter.create_counter("servewatch.incidents", unit="{incident}", description="Incidents opened, by trigger.")
        self._actions = meter.create_counter("servewatch.actions", unit="{action}", description="Actions finished, by action and outcome.")
        self._latency = meter.create_histogram(
            "servewatch.detection.latency", unit="s", description="From the trigger condition starting to the incident opening."
        )
        meter.create_observable_counter(
            "servewatch.export.spans", [self._observe_spans], unit="{span}", description="Spans by export outcome."
        )
        meter.create_observable_gauge(
            "servewatch.export.queue.size", [self._observe_queue], unit="{span}", description="Spans waiting in memory."
        )
        meter.create_observable_gauge(
            "servewatch.export.spool.size", [self._observe_spool], unit="{span}", description="Spans waiting in the spool."
        )
        meter.create_observable_counter(
            "servewatch.export.metric_points",
            [self._observe_metric_points],
            unit="{data_point}",
            description="servewatch's own metric data points by export outcome (exported, spooled, replayed, lost).",
        )
        meter.create_observable_counter(
            "servewatch.bus.events.dropped",
            [self._observe_bus],
            unit="{event}",
            description="High-rate events dropped by the bus because a subscriber was slow (reason queue_full).",
        )
        meter.create_observable_gauge(
            "servewatch.watcher.status",
            [self._observe_status],
            unit="1",
            description="1 for each watcher's current state (ready, waiting, blind), 0 for the others.",
        )

    # --- recording ------------------------------------------------------------------------

    def incident_opened(self, trigger: str) -> None:
        """Count one incident (``trigger``: ``health``, ``stall``, ``exit``, ``manual``)."""
        if self._incidents is not None:
            self._incidents.add(1, {"servewatch.incident.trigger": trigger})

    def action_done(self, action: str, outcome: str) -> None:
        """Count one finished action (``pyspy.dump``, ``ok``/``timed_out``/...)."""
        if self._actions is not None:
            self._actions.add(1, {"servewatch.action": action, "servewatch.outcome": str(outcome)})

    def detection_latency(self, seconds: float, *, trigger: str = "") -> None:
        """Record how long a trigger took to be detected, in seconds."""
        if self._latency is not None:
            self._latency.record(max(0.0, seconds), {"servewatch.incident.trigger": trigger} if trigger else None)

    async def record_events(self, events: AsyncIterable[Event]) -> None:
        """Count from bus events (a subscription to :data:`RECORDED_EVENTS`) until they end:
        incidents by trigger, action outcomes, and each stall's detection latency (how late it
        was reported after it became one: last progress + timeout)."""
        async for event in events:
            if isinstance(event, IncidentOpened):
                self.incident_opened(event.trigger)
            elif isinstance(event, ActionCompleted):
                self.action_done(event.result.action, event.result.outcome.value)
            elif isinstance(event, WatchdogStalled):
                self.detection_latency(event.stalled_for_s - event.timeout_s, trigger=event.trigger)

    def watch_export(self, statistics: Callable[[], ExportStatistics]) -> None:
        """Report a span processor's counters (e.g. ``processor.statistics``)."""
        with self._lock:
            self._export_sources.append(statistics)

    def watch_metric_export(self, statistics: Callable[[], Any]) -> None:
        """Report a metric exporter's counters (``SpoolingMetricExporter.statistics``)."""
        with self._lock:
            self._metric_sources.append(statistics)

    def _observe_metric_points(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            sources = list(self._metric_sources)
        stats = []
        for source in sources:
            try:
                stats.append(source())
            except Exception:  # noqa: BLE001 - a callback must not break the metrics export
                _log.exception("metric export statistics callback failed")
        for outcome in ("exported", "spooled", "replayed", "lost"):
            yield Observation(sum(getattr(s, outcome) for s in stats), {"servewatch.export.outcome": outcome})

    def watch_bus(self, dropped_events: Callable[[], int]) -> None:
        """Report a bus's dropped-event count (e.g. ``lambda: bus.statistics().dropped``)."""
        with self._lock:
            self._bus_sources.append(dropped_events)

    def watch_status(self, states: Callable[[], Iterable[tuple[str, str]]]) -> None:
        """Report watcher states (e.g. ``StatusBoard.states``: ``(name, state)`` pairs)."""
        with self._lock:
            self._status_sources.append(states)

    # --- callbacks (run on the metric reader's thread) ------------------------------------

    def _observe_status(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            sources = list(self._status_sources)
        for source in sources:
            try:
                pairs = list(source())
            except Exception:  # noqa: BLE001 - a callback must not break the metrics export
                _log.exception("watcher status callback failed")
                continue
            for name, state in pairs:
                for candidate in ("ready", "waiting", "blind"):
                    yield Observation(
                        1 if str(state) == candidate else 0,
                        {"servewatch.watcher": name, "servewatch.watcher.state": candidate},
                    )

    def _stats(self) -> list[ExportStatistics]:
        with self._lock:
            sources = list(self._export_sources)
        out = []
        for source in sources:
            try:
                out.append(source())
            except Exception:  # noqa: BLE001 - a callback must not break the metrics export
                _log.exception("export statistics callback failed")
        return out

    def _observe_spans(self, options: CallbackOptions) -> Iterable[Observation]:
        stats = self._stats()
        for outcome in ("exported", "spooled", "replayed", "dropped", "evicted", "rejected"):
            total = sum(getattr(s, outcome) for s in stats)
            if outcome == "rejected":
                total += sum(s.partially_rejected for s in stats)
            yield Observation(total, {"servewatch.export.outcome": outcome})

    def _observe_queue(self, options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(sum(s.queued for s in self._stats()))

    def _observe_spool(self, options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(sum(s.spool_spans for s in self._stats()))

    def _observe_bus(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            sources = list(self._bus_sources)
        total = 0
        for source in sources:
            try:
                total += int(source())
            except Exception:  # noqa: BLE001 - a callback must not break the metrics export
                _log.exception("bus statistics callback failed")
        yield Observation(total)
