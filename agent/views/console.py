"""What the command line says about telemetry: quiet SDK loggers, and the spooled-spans summary.

Owns :func:`quiet_sdk_logs` (the OpenTelemetry SDK's own log lines, e.g. "Failed to export
batch" or header-parsing warnings, never reach the console: they are counted, and shown only at
``--verbose``; servewatch reports export trouble itself, once, in its own words) and
:func:`spooled_summary` (the line a one-shot command prints when spans are waiting in the
spool, with the command that replays them).

Imports the standard library and :mod:`exporters.otlp.processor` (types).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exporters.otlp.processor import ExportStatistics
    from exporters.otlp.provider import Telemetry

__all__ = ["SdkLogCounter", "quiet_sdk_logs", "spooled_summary", "undelivered_summary"]

#: Loggers of the OTel SDK and its exporters.
SDK_LOGGERS = ("opentelemetry",)


class SdkLogCounter(logging.Handler):
    """Counts SDK log records (and keeps the last one) instead of printing them."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.count = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        try:
            self.last = record.getMessage()[:300]
        except Exception:  # noqa: BLE001 - a bad format string must not break logging
            self.last = str(record.msg)[:300]


_counter: SdkLogCounter | None = None


def quiet_sdk_logs(*, verbose: bool = False) -> SdkLogCounter:
    """Keep the OTel SDK's log lines off the console (counted; passed through when ``verbose``).

    Returns:
        The counter (the same one on every call).
    """
    global _counter
    if _counter is None:
        _counter = SdkLogCounter()
    for name in SDK_LOGGERS:
        logger = logging.getLogger(name)
        if _counter not in logger.handlers:
            logger.addHandler(_counter)
        logger.propagate = verbose
    return _counter


def spooled_summary(telemetry: Telemetry, stats: ExportStatistics) -> str | None:
    """One line when spans are waiting in the spool after a one-shot command, else ``None``.

    Example: ``12 span(s) spooled under '/var/lib/servewatch/h1/spool' (collector
    http://otel:4317 not reachable: connection refused ...). Replay them with: servewatch
    export --to http://otel:4317 --protocol grpc /var/lib/servewatch/h1/spool``
    """
    waiting = stats.spool_spans
    if not waiting or telemetry.spool_dir is None:
        return None
    dest = telemetry.destination
    why = telemetry.processor.last_error or "not acknowledged before the shutdown deadline"
    return (
        f"{waiting} span(s) spooled under '{telemetry.spool_dir}' (collector {dest.endpoint}: {why}). "
        f"The next servewatch agent on this data dir sends them; or replay them now with: "
        f"{dest.replay_command(telemetry.spool_dir)}"
    )


def undelivered_summary(telemetry: Telemetry, stats: ExportStatistics) -> str | None:
    """One line when a one-shot command's spans were refused or lost (never to be delivered by
    the next agent), else ``None``: how many and why, in short (the collector's refusal itself
    was said in full when it happened). The command then exits 1.

    Example: ``12 span(s) not delivered to OTLP http/protobuf http://otel:4318: 12 refused or
    rejected by the collector (said above), kept under '/var/lib/servewatch/h1/spool/rejected'``
    """
    if not stats.lost:
        return None
    parts = []
    refused = stats.rejected + stats.partially_rejected
    if refused:
        kept = f", kept under '{telemetry.spool_dir / 'rejected'}'" if telemetry.spool_dir is not None and stats.rejected else ""
        parts.append(f"{refused} refused or rejected by the collector (said above){kept}")
    if stats.dropped:
        parts.append(f"{stats.dropped} dropped (memory queue full, or the spool could not be written)")
    if stats.evicted:
        parts.append(f"{stats.evicted} evicted from the full spool (export.spool_max_bytes)")
    return f"{stats.lost} span(s) not delivered to {telemetry.destination.describe()}: {'; '.join(parts)}"
