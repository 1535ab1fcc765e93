"""The health-check watcher: polls a URL and reports unhealthy/healthy transitions.

Owns: :class:`HealthConfig`, :class:`HealthWatcher`, :func:`classify_status` and
:func:`classify_error` (the one place httpx's failures become our error classes). May import
:mod:`agent.events`, :mod:`agent.bus` (``Publisher``), anyio, httpx and pydantic.

Every probe publishes ``HealthProbed`` (high-rate; may be dropped for a slow subscriber).
``HealthCheckFailed`` is published once when ``unhealthy_after`` consecutive probes have failed
(hysteresis: one slow or failed probe is never an incident), ``HealthRecovered`` once when
``healthy_after`` consecutive probes have succeeded after that. Probes run on a fixed-rate
schedule (``start + k * interval_s``): a slow probe does not shift the ones after it, and slots
missed while a probe overran are skipped, not bunched.
"""

from __future__ import annotations

import errno
import logging
import time
from urllib.parse import urlsplit

import anyio
import httpx
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from pydantic import BaseModel, Field, field_validator

from agent.bus import Publisher
from agent.events import HealthCheckFailed, HealthProbed, HealthRecovered

_log = logging.getLogger(__name__)

__all__ = [
    "HealthConfig",
    "HealthWatcher",
    "classify_status",
    "classify_error",
    "ERROR_REFUSED",
    "ERROR_TIMEOUT",
    "ERROR_5XX",
    "ERROR_4XX",
    "ERROR_OTHER",
]

#: Error classes carried by ``HealthProbed.error_class`` / ``HealthCheckFailed.error_class``.
ERROR_REFUSED = "refused"
ERROR_TIMEOUT = "timeout"
ERROR_5XX = "5xx"
ERROR_4XX = "4xx"
ERROR_OTHER = "error"


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
    """

    url: str | None = None
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0)
    unhealthy_after: int = Field(default=3, ge=1)
    healthy_after: int = Field(default=2, ge=1)
    wait_for_ready: bool = True
    startup_timeout_s: float | None = Field(default=1800.0, gt=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s):// URL, got {value!r}")
        return value


def classify_status(status_code: int) -> str:
    """Error class of an HTTP status: ``""`` for 2xx, ``5xx``, ``4xx``, else ``error``."""
    if 200 <= status_code < 300:
        return ""
    if 500 <= status_code < 600:
        return ERROR_5XX
    if 400 <= status_code < 500:
        return ERROR_4XX
    return ERROR_OTHER


def classify_error(exc: BaseException) -> str:
    """Error class of a failed request: ``refused``, ``timeout`` or ``error``.

    ``refused`` means nothing listens at the address (ECONNREFUSED anywhere in the cause
    chain of an ``httpx.ConnectError``); ``timeout`` is any httpx timeout.
    """
    if isinstance(exc, httpx.TimeoutException):
        return ERROR_TIMEOUT
    if isinstance(exc, httpx.ConnectError):
        seen: set[int] = set()
        cause: BaseException | None = exc
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == errno.ECONNREFUSED:
                return ERROR_REFUSED
            cause = cause.__cause__ or cause.__context__
        if "refused" in str(exc).lower():
            return ERROR_REFUSED
    return ERROR_OTHER


class HealthWatcher:
    """Polls :attr:`HealthConfig.url` and publishes health events (see the module docstring).

    Args:
        config: URL, schedule and thresholds.
        client: HTTP client to use (not closed here); default a private one created in
            :meth:`run` with ``trust_env=False`` (the health URL is node-local; never proxied).

    Attributes:
        healthy: current verdict (``True`` until ``unhealthy_after`` failures).
        ready: a good probe has been seen (failures count only after it when
            ``wait_for_ready``).
        consecutive_failures / consecutive_successes: the current runs of probe outcomes.
        probes: probes run so far.
    """

    name = "health"

    def __init__(self, config: HealthConfig, *, client: httpx.AsyncClient | None = None) -> None:
        if not config.url:
            raise ValueError("HealthWatcher needs HealthConfig.url")
        self.config = config
        self._client = client
        self.healthy = True
        self.ready = not self.config.wait_for_ready
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        self.probes = 0
        self._started_ns = time.monotonic_ns()
        self._told_waiting = False

    async def probe(self, client: httpx.AsyncClient) -> HealthProbed:
        """Run one probe, bounded by ``timeout_s`` in total; never raises for target faults."""
        url = self.config.url or ""
        timeout_s = self.config.timeout_s
        status_code: int | None = None
        error_class = ERROR_TIMEOUT  # if the cancel scope below fires
        start_ns = time.monotonic_ns()
        with anyio.move_on_after(timeout_s):
            try:
                response = await client.get(url, timeout=timeout_s)
            except httpx.HTTPError as exc:
                error_class = classify_error(exc)
            else:
                status_code = response.status_code
                error_class = classify_status(status_code)
        latency_s = (time.monotonic_ns() - start_ns) / 1e9
        self.probes += 1
        return HealthProbed(
            source=self.name,
            url=url,
            ok=error_class == "",
            status_code=status_code,
            latency_s=latency_s,
            error_class=error_class,
        )

    async def _record(self, bus: Publisher, probed: HealthProbed) -> None:
        """Publish the probe and apply the hysteresis."""
        bus.publish_nowait(probed)
        if probed.ok:
            self.ready = True
            self.consecutive_failures = 0
            self.consecutive_successes += 1
            if not self.healthy and self.consecutive_successes >= self.config.healthy_after:
                self.healthy = True
                await bus.publish(
                    HealthRecovered(
                        source=self.name, url=probed.url, consecutive_successes=self.consecutive_successes
                    )
                )
            return
        self.consecutive_successes = 0
        if not self.ready:
            limit_s = self.config.startup_timeout_s
            waited_s = (time.monotonic_ns() - self._started_ns) / 1e9
            if limit_s is None or waited_s < limit_s:
                if not self._told_waiting:
                    self._told_waiting = True
                    _log.info("health: %s not ready yet; failures count after its first good answer"
                              " or %s s", probed.url, limit_s)
                return
            self.ready = True  # stuck in start-up: count failures from now on
        self.consecutive_failures += 1
        if self.healthy and self.consecutive_failures >= self.config.unhealthy_after:
            self.healthy = False
            await bus.publish(
                HealthCheckFailed(
                    source=self.name,
                    url=probed.url,
                    status_code=probed.status_code,
                    latency_s=probed.latency_s,
                    error_class=probed.error_class,
                    consecutive_failures=self.consecutive_failures,
                )
            )

    async def run(self, bus: Publisher, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Probe until cancelled. Ready once the HTTP client exists (before the first probe)."""
        if self._client is not None:
            await self._loop(self._client, bus, task_status)
            return
        async with httpx.AsyncClient(trust_env=False) as client:
            await self._loop(client, bus, task_status)

    async def _loop(self, client: httpx.AsyncClient, bus: Publisher, task_status: TaskStatus[None]) -> None:
        interval_ns = int(self.config.interval_s * 1e9)
        task_status.started()
        next_ns = time.monotonic_ns()
        while True:
            await self._record(bus, await self.probe(client))
            now = time.monotonic_ns()
            next_ns += interval_ns
            if next_ns <= now:  # the probe overran: skip the missed slots, keep the phase
                next_ns += ((now - next_ns) // interval_ns + 1) * interval_ns
            await anyio.sleep((next_ns - now) / 1e9)
