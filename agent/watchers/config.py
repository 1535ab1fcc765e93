"""The watchers' settings models, one per registered watcher with settings (a table each, named
by the watcher's registration line in :mod:`agent.watchers`): light, so that the settings load
without importing a watcher.

Owns :class:`HealthConfig` (``[health]``, with :func:`check_http_url`), :class:`StepsConfig` and
:class:`MetricsConfig` (``[metrics]``). The stall rule's own settings (``[watchdog]``) are the
agent's: :class:`agent.stall.WatchdogConfig`. Imports pydantic and the standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator

__all__ = ["MAX_HEALTH_BODY_BYTES", "HealthConfig", "MetricsConfig", "StepsConfig", "check_http_url"]

#: Most bytes of a health answer read (the status code is what counts); the rest is not read.
MAX_HEALTH_BODY_BYTES = 64 * 1024


class HealthConfig(BaseModel):
    """User settings of the health watcher.

    Attributes:
        url: the health URL, e.g. ``http://127.0.0.1:30000/health`` (SGLang's default port).
            Default ``None``: no health watcher runs.
        interval_s: seconds between probe starts (fixed rate). Default 5.0.
        timeout_s: per-probe timeout in seconds, for the whole request. Default 5.0. SGLang's
            ``/health`` and ``/health_generate`` run a one-token generation and may wait up to
            20 s (``SGLANG_HEALTH_CHECK_TIMEOUT``) before answering 503; raise it to ~21 s to
            see SGLang's own verdict instead of our timeout.
        unhealthy_after: consecutive failed probes before ``HealthCheckFailed``. Default 3.
        healthy_after: consecutive good probes before ``HealthRecovered``. Default 2.
        wait_for_ready: do not count failures until the first good probe. SGLang answers 503
            while it loads the model, which can take minutes. Default ``True``.
        startup_timeout_s: with ``wait_for_ready``, failures count anyway once no probe has
            succeeded for this long since the watcher started, so a server stuck in start-up
            (weights loading, NCCL init) still opens a health incident. ``None`` waits forever.
            Default 1800 s.
        max_body_bytes: most bytes of an answer read; a server that streams without end costs
            at most this much memory per probe. Default 64 KiB.
        refused_grace_s: for this long after the watcher starts, and before the first good
            answer, "connection refused" means the server is still starting (status waiting)
            rather than a wrong address (blind). 0 (default) for ``run``; ``launch`` sets it,
            since it starts the server itself.
    """

    #: agent-wide values set in this table (:class:`~agent.registry.AgentValues`)
    provides: ClassVar[Mapping[str, str]] = {"server_urls": "url"}

    url: str | None = None
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0)
    unhealthy_after: int = Field(default=3, ge=1)
    healthy_after: int = Field(default=2, ge=1)
    wait_for_ready: bool = True
    startup_timeout_s: float | None = Field(default=1800.0, gt=0)
    max_body_bytes: int = Field(default=MAX_HEALTH_BODY_BYTES, ge=0)
    refused_grace_s: float = Field(default=0.0, ge=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return check_http_url(value)


def check_http_url(value: str | None) -> str | None:
    """Validate a probe URL (health, /metrics): ``http(s)://host[:port]/...``; ``None`` passes.

    Raises:
        ValueError: no http/https scheme or no host (``127.0.0.1:30000/metrics`` is refused at
            start rather than failing every probe later).
    """
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s):// URL, got {value!r}")
    return value


class StepsConfig(BaseModel):
    """User settings of the Prometheus step-counter source (the ``[metrics]`` table; read every
    ``watchdog.poll_interval_s``).

    Attributes:
        metrics_preset: ``"sglang"`` (default) or ``"vllm"``, for the Prometheus source.
        counter: override of the preset's progress counter name.
        busy_gauge: override of the preset's busy gauge name.
        scrape_timeout_s: per-scrape timeout of ``/metrics`` in seconds. Default 5.0.
    """

    metrics_preset: Literal["sglang", "vllm"] | None = "sglang"
    counter: str | None = None
    busy_gauge: str | None = None
    scrape_timeout_s: float = Field(default=5.0, gt=0)


class MetricsConfig(StepsConfig):
    """Prometheus ``/metrics`` scrape used as the forward-progress source when the SDK is absent.

    Adds ``url`` to :class:`StepsConfig` (presets, overrides, timeout).
    """

    #: agent-wide values set in this table (:class:`~agent.registry.AgentValues`)
    provides: ClassVar[Mapping[str, str]] = {"server_urls": "url"}

    url: str | None = Field(None, description="the server's /metrics URL; unset = no scrape")
    refused_grace_s: float = Field(
        0.0, ge=0, description="seconds after start in which 'connection refused' means the server is starting (launch sets it)"
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return check_http_url(value)
