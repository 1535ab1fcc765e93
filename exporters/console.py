"""What the command line says about telemetry: quiet SDK loggers, and the spooled-spans summary.

Owns :func:`quiet_sdk_logs` (the OpenTelemetry SDK's own log lines, e.g. "Failed to export
batch" or header-parsing warnings, never reach the console: they are counted, and shown only at
``--verbose``; servewatch reports export trouble itself, once, in its own words) and
:func:`spooled_summary` (the line a one-shot command prints when spans are waiting in the
spool, with the command that replays them).

Imports the standard library and :mod:`exporters.processor` (types).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exporters.processor import ExportStatistics
    from exporters.provider import Telemetry

__all__ = ["SdkLogCounter", "quiet_sdk_logs", "spooled_summary"]

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
        f"servewatch export --to {_with_scheme(dest.endpoint, dest.insecure)} --protocol {dest.protocol} {telemetry.spool_dir}"
    )


def _with_scheme(endpoint: str | None, insecure: bool | None) -> str | None:
    """``export --to`` takes a URL: a bare gRPC ``host:port`` (accepted by the OTLP exporters)
    gets the scheme it was used with (``https`` unless insecure)."""
    if endpoint is None or "://" in endpoint:
        return endpoint
    return ("http://" if insecure is not False else "https://") + endpoint
