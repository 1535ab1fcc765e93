"""A server's own span export, configured exactly like the agent's.

Owns :func:`tracer_provider_from_env`: an OTel SDK ``TracerProvider`` for an inference server
(the demo server, or a server following the README's SDK example) that exports its request and
forward spans to the SAME collector as the agent, with the same resolution of the standard
``OTEL_EXPORTER_OTLP_[TRACES_]*`` variables (endpoint, protocol with the agent's ``grpc`` default,
headers, TLS/mTLS, gzip, millisecond timeout) and the same lossless processor (byte-sized
batches, split on too-large, bounded shutdown). With ``SERVEWATCH_DATA_DIR`` set, batches the
collector does not take are spooled under ``<data_dir>/<host>/spool/pid-<pid>/`` and the agent
adopts and replays them once this process is gone; without it they are counted as dropped.

This is the fallback path: while an agent is attached to the server, ``agent.sdk`` hands spans
to the agent over the span channel and this provider exports nothing. Both paths report the
process under one identity: the resource carries ``host.name`` (``SERVEWATCH_HOST_NAME``, else
the host name, as the agent's ``host_name`` setting), ``process.pid`` and ``process.user.id``,
as the agent's shipper puts on the spans it ships; and the service name is declared to the SDK
(:func:`agent.sdk.provider.set_service_name`) even when no endpoint is set, so the spans an agent
ships from this server arrive under it, not as ``unknown_service``.

Imports opentelemetry-sdk, :mod:`agent.sdk.provider`, :mod:`agent.model.datadir` and :mod:`exporters.otlp.provider` / :mod:`exporters.otlp.processor`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from agent.model.datadir import DataDir
from agent.sdk.provider import set_service_name
from exporters.otlp.processor import LosslessSpanProcessor
from exporters.otlp.provider import (
    ExportConfig,
    resolve_batching,
    resolve_destination,
    sdk_disabled,
)
from exporters.otlp.spool import Spool

__all__ = ["tracer_provider_from_env"]

_log = logging.getLogger(__name__)


def tracer_provider_from_env(
    service_name: str = "inference-server",
    *,
    environ: Mapping[str, str] | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
) -> TracerProvider | None:
    """A ``TracerProvider`` exporting to ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, or ``None``
    when no endpoint is set or ``OTEL_SDK_DISABLED=true``.

    Args:
        service_name: ``service.name`` unless ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``
            set one.
        environ: env to read instead of ``os.environ`` (tests).
        resource_attributes: extra resource attributes.

    Raises:
        exporters.otlp.provider.ExportConfigError: a bad ``OTEL_*`` value (names the variable).
    """
    env = os.environ if environ is None else environ
    set_service_name(service_name)  # the span ring's service.name, endpoint or not
    if sdk_disabled(env):
        return None
    destination = resolve_destination(ExportConfig(), env, signal="traces")
    if destination.endpoint is None:
        return None
    sender = destination.make_sender()
    spool = None
    host_name = env.get("SERVEWATCH_HOST_NAME", "").strip() or socket.gethostname()  # the agent's own default
    data_dir = env.get("SERVEWATCH_DATA_DIR", "").strip()
    if data_dir:
        try:  # the spool of the host the spans name: the agent (same SERVEWATCH_HOST_NAME) replays it
            spool = Spool(DataDir(Path(data_dir), host_name).spool, max_bytes=64 * 1024 * 1024)
        except OSError as exc:
            _log.warning("no span spool under %s (%s); failed batches are dropped and counted", data_dir, exc)
    batching = resolve_batching(ExportConfig(), env)  # OTEL_BSP_* as the SDK's BatchSpanProcessor reads them
    processor = LosslessSpanProcessor(
        sender, spool=spool, export_timeout_s=destination.timeout_s, name="server-span-export",
        max_queue_spans=int(batching["queue_spans"]), max_batch_spans=int(batching["batch_spans"]),
        schedule_delay_s=float(batching["schedule_delay_s"]),
    )
    attrs: dict[str, Any] = {"service.name": service_name}
    attrs.update(resource_attributes or {})
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME over ours; the identity
    # (host, pid, uid) is this process's, as the agent's shipper states it, and wins
    identity = Resource({
        "host.name": host_name,
        "process.pid": os.getpid(),
        "process.user.id": os.geteuid(),
    })
    provider = TracerProvider(resource=Resource.create(attrs).merge(identity), shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return provider
