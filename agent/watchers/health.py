"""The health-check watcher: polls a URL and reports unhealthy/healthy transitions.

Owns: :class:`HealthWatcher` (settings: :class:`~agent.watchers.config.HealthConfig`), :func:`classify_status` and
:func:`classify_error` (the one place httpx's failures become our error classes). May import
:mod:`agent.model.events`, :mod:`agent.model.bus` (``Publisher``), anyio, httpx and pydantic.

Every probe publishes ``HealthProbed`` (high-rate; may be dropped for a slow subscriber).
``HealthCheckFailed`` is published once when ``unhealthy_after`` consecutive probes have failed
(hysteresis: one slow or failed probe is never an incident), ``HealthRecovered`` once when
``healthy_after`` consecutive probes have succeeded after that. Probes run on a fixed-rate
schedule (``start + k * interval_s``): a slow probe does not shift the ones after it, and slots
missed while a probe overran are skipped, not bunched.
"""

from __future__ import annotations

import errno
import http
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from agent.model.bus import Publisher
from agent.model.events import HealthCheckFailed, HealthProbed, HealthRecovered
from agent.model.lazy import LazyModule
from agent.watchers.config import MAX_HEALTH_BODY_BYTES, HealthConfig, check_http_url
from agent.watchers.group import WatcherGroup, url_label
from agent.watchers.status import StatusReporter, WatcherState

if TYPE_CHECKING:
    import httpx
    from prometheus_client import parser as prometheus_parser

    from agent.host.registry import BuildContext
else:
    httpx = LazyModule("httpx")  # imported at first use: a fast CLI cold start
    prometheus_parser = LazyModule("prometheus_client.parser")  # at the first /metrics read

_log = logging.getLogger(__name__)

__all__ = [
    "ERROR_4XX",
    "ERROR_5XX",
    "ERROR_OTHER",
    "ERROR_REFUSED",
    "ERROR_TIMEOUT",
    "MAX_HEALTH_BODY_BYTES",
    "HealthConfig",
    "HealthWatcher",
    "check_http_url",
    "classify_error",
    "classify_status",
    "create",
    "http_status_text",
    "read_capped",
    "refused_status",
]

#: Error classes carried by ``HealthProbed.error_class`` / ``HealthCheckFailed.error_class``.
ERROR_REFUSED = "refused"
ERROR_TIMEOUT = "timeout"
ERROR_5XX = "5xx"
ERROR_4XX = "4xx"
ERROR_OTHER = "error"


def http_status_text(status_code: int) -> str:
    """``"401 Unauthorized"`` (the code alone when it has no standard phrase)."""
    try:
        return f"{status_code} {http.HTTPStatus(status_code).phrase}"
    except ValueError:
        return str(status_code)


async def read_capped(response: httpx.Response, limit_bytes: int) -> tuple[bytes, bool]:
    """Read at most ``limit_bytes`` of a streamed response body.

    Returns:
        ``(body, truncated)``: ``truncated`` is ``True`` when the server had more to send
        (the rest is never read; closing the response drops the connection).
    """
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        if size + len(chunk) > limit_bytes:
            chunks.append(chunk[: max(0, limit_bytes - size)])
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


def classify_status(status_code: int) -> str:
    """Error class of an HTTP status: ``""`` for 2xx, ``5xx``, ``4xx``, else ``error``."""
    if 200 <= status_code < 300:
        return ""
    if 500 <= status_code < 600:
        return ERROR_5XX
    if 400 <= status_code < 500:
        return ERROR_4XX
    return ERROR_OTHER


#: Seconds an idle probe connection is kept for reuse: below uvicorn's default keep-alive
#: timeout (5 s; vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, SGLang's ``--timeout-keep-alive``).
KEEPALIVE_EXPIRY_S = 2.0


def _closed_by_server(exc: httpx.HTTPError) -> bool:
    """The request died on a connection the server closed (kept-alive, closed as we sent): the
    server disconnected without an answer, or the read/write hit a reset. A fresh connection is
    worth one more try; a timeout, a refused connection or a bad answer are not."""
    return isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))


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
        status_name: its status row (``health``; one of several servers': ``health HOST:PORT``).
        served_url: the same server's ``/metrics`` (a watched URL of the same host and port), read
            while no good probe was seen: a server whose counters already count generated tokens
            has finished start-up (an agent started after the server hung: its 503 is no start-up,
            and its failures count at once; issue 32 item 1). ``None``: none.

    Attributes:
        healthy: current verdict (``True`` until ``unhealthy_after`` failures).
        ready: a good probe has been seen (failures count only after it when
            ``wait_for_ready``).
        consecutive_failures / consecutive_successes: the current runs of probe outcomes.
        probes: probes run so far.
    """

    name = "health"

    def __init__(self, config: HealthConfig, *, client: httpx.AsyncClient | None = None, status_name: str = "health",
                 starting: Callable[[], str | None] | None = None, served_url: str | None = None) -> None:
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
        self._error_detail = ""
        #: one line on the server's ranks still in start-up, ``None`` when none is (``None``: not known)
        self.starting = starting
        self.served_url = served_url
        self._served_next_ns = 0
        #: what this watcher can see (``health: waiting for first 200 from …``)
        self.status = StatusReporter(status_name, WatcherState.WAITING, f"waiting for first 200 from {config.url}")

    async def probe(self, client: httpx.AsyncClient) -> HealthProbed:
        """Run one probe, bounded by ``timeout_s`` in total; never raises for target faults."""
        url = self.config.url or ""
        timeout_s = self.config.timeout_s
        status_code: int | None = None
        error_class = ERROR_TIMEOUT  # if the cancel scope below fires
        start_ns = time.monotonic_ns()
        self._error_detail = ""
        with anyio.move_on_after(timeout_s):
            for attempt in (1, 2):
                try:
                    # streamed and capped: a server that answers without end costs bounded memory
                    async with client.stream("GET", url, timeout=timeout_s) as response:
                        status_code = response.status_code
                        error_class = classify_status(status_code)
                        await read_capped(response, self.config.max_body_bytes)
                except httpx.HTTPError as exc:
                    if status_code is None:
                        error_class = classify_error(exc)
                        self._error_detail = f"{type(exc).__name__}: {exc}"[:200]
                        if attempt == 1 and _closed_by_server(exc):
                            continue  # a kept-alive connection the server closed as we sent: once more
                break
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

    def _status_of(self, probed: HealthProbed) -> tuple[WatcherState, str]:
        """What this probe says about what the watcher can see."""
        url = probed.url
        if probed.ok:
            return WatcherState.READY, f"{http_status_text(probed.status_code or 200)} from {url}"
        code = probed.status_code
        if probed.error_class == ERROR_REFUSED:
            return self._refused_status(url)
        if code in (401, 403):
            return WatcherState.BLIND, f"{http_status_text(code)} from {url} (the health URL needs credentials we do not have)"
        if code == 404:
            return WatcherState.BLIND, f"{http_status_text(code)} from {url} (wrong path? SGLang and vLLM serve /health)"
        if probed.error_class == ERROR_OTHER and code is None:
            return WatcherState.BLIND, f"cannot reach {url}: {self._error_detail or 'request failed'}"
        what = (
            http_status_text(code) if code is not None
            else f"no answer within {self.config.timeout_s:g} s"
        )
        if not self.ready:
            limit = self.config.startup_timeout_s
            return WatcherState.WAITING, (
                f"server not ready: {what} from {url} (waiting for its first 200"
                + (f", up to {limit:g} s)" if limit is not None else ")")
            )
        if code is not None and 400 <= code < 500:
            return WatcherState.BLIND, f"{http_status_text(code)} from {url}"
        return WatcherState.READY, f"failing: {what} from {url}"

    def _refused_status(self, url: str) -> tuple[WatcherState, str]:
        """Connection refused: a server starting within the grace, else :func:`refused_status`."""
        waited_s = (time.monotonic_ns() - self._started_ns) / 1e9
        if not self.ready and waited_s < self.config.refused_grace_s:
            return WatcherState.WAITING, (
                f"server starting: nothing listens at {url} yet"
                f" (waiting up to {self.config.refused_grace_s:g} s for it to listen)"
            )
        return refused_status(url, self.starting)

    async def served(self, client: httpx.AsyncClient) -> str:
        """Whether the server already served before a good probe was seen, in words: its
        :attr:`served_url` counts generated tokens (``sglang:generation_tokens_total``,
        ``vllm:generation_tokens_total``: only a server past start-up generates); ``""`` when
        not, unreadable, or read less than :data:`SERVED_CHECK_EVERY_S` ago. Bounded by
        ``timeout_s``; never raises."""
        now = time.monotonic_ns()
        if not self.served_url or now < self._served_next_ns:
            return ""
        self._served_next_ns = now + int(SERVED_CHECK_EVERY_S * 1e9)
        text = ""
        with anyio.move_on_after(self.config.timeout_s):
            try:
                async with client.stream("GET", self.served_url, timeout=self.config.timeout_s) as response:
                    if response.status_code == 200:
                        text = (await read_capped(response, MAX_SERVED_BYTES))[0].decode("utf-8", "replace")
            except httpx.HTTPError:
                return ""
        counts = _generated_tokens(text)
        total = sum(counts.values())
        return f"{self.served_url} counts {total:g} generated tokens ({', '.join(sorted(counts))})" if total > 0 else ""

    async def _record(self, bus: Publisher, probed: HealthProbed, client: httpx.AsyncClient | None = None) -> None:
        """Publish the probe and apply the hysteresis (``client``: the one :meth:`served` reads with)."""
        bus.publish_nowait(probed)
        state, reason = self._status_of(probed)
        await self.status.set(bus, state, reason)
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
        served = await self.served(client) if client is not None and not self.ready else ""
        if served:  # it served before servewatch came: its failure is no start-up
            self.ready = True
            _log.warning("health: %s has answered no 200 since servewatch started, but %s: past start-up, its"
                         " failures count", probed.url, served)
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
        # idle connections are dropped before uvicorn's keep-alive timeout (5 s, vLLM's and
        # SGLang's default) closes them: a 5 s probe interval would otherwise race it
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(trust_env=False, limits=limits) as client:
            await self._loop(client, bus, task_status)

    async def _loop(self, client: httpx.AsyncClient, bus: Publisher, task_status: TaskStatus[None]) -> None:
        interval_ns = int(self.config.interval_s * 1e9)
        await self.status.initial(bus)
        task_status.started()
        next_ns = time.monotonic_ns()
        while True:
            await self._record(bus, await self.probe(client), client)
            now = time.monotonic_ns()
            next_ns += interval_ns
            if next_ns <= now:  # the probe overran: skip the missed slots, keep the phase
                next_ns += ((now - next_ns) // interval_ns + 1) * interval_ns
            await anyio.sleep((next_ns - now) / 1e9)


def refused_status(url: str, starting: Callable[[], str | None] | None) -> tuple[WatcherState, str]:
    """What "connection refused" at ``url`` says, past the refused grace: the server is starting
    (``WAITING``) while ``starting()`` names its ranks in start-up (:mod:`agent.host.startup`: SGLang
    and vLLM listen only once every rank is ready), else nothing listens there (``BLIND``: wrong
    host or port, or the server is down)."""
    line = starting() if starting is not None else None
    if line:
        return WatcherState.WAITING, f"server starting: nothing listens at {url} yet; {line}"
    return WatcherState.BLIND, f"connection refused at {url} (nothing listens there: wrong host or port, or the server is down)"


#: Least time between two reads of a not-yet-ready server's ``/metrics`` (:meth:`HealthWatcher.served`), seconds.
SERVED_CHECK_EVERY_S = 10.0
#: Most bytes of that ``/metrics`` read.
MAX_SERVED_BYTES = 4 * 1024 * 1024
#: The generated-token counters' sample names end so (SGLang's ``sglang:generation_tokens_total``,
#: vLLM's ``vllm:generation_tokens_total``).
_GENERATED_SUFFIX = ":generation_tokens_total"


def _generated_tokens(text: str) -> dict[str, float]:
    """The generated-token counters in a ``/metrics`` text (prometheus_client's parser, as the
    steps watcher reads it), summed over their label sets; empty when none or it does not parse."""
    counts: dict[str, float] = {}
    try:
        for family in prometheus_parser.text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith(_GENERATED_SUFFIX):
                    counts[sample.name] = counts.get(sample.name, 0.0) + float(sample.value)
    except ValueError:  # not the exposition format: no reading
        return {}
    return counts


def _served_url(url: str, server_urls: tuple[str, ...]) -> str | None:
    """The watched ``/metrics`` of the server behind health ``url`` (same scheme, host and port), or ``None``."""
    here = urlsplit(url)
    return next((u for u in server_urls if u != url and "metrics" in urlsplit(u).path
                 and (urlsplit(u).scheme, urlsplit(u).netloc) == (here.scheme, here.netloc)), None)


def create(config: HealthConfig, ctx: BuildContext) -> HealthWatcher | WatcherGroup | None:
    """Registry factory (:data:`agent.watchers.WATCHERS` ``health``): a watcher of ``config``
    (``[health]``); with several URLs (``urls``) one each, run as a :class:`WatcherGroup` (status
    rows ``health HOST:PORT``); ``None`` without a URL. Each reads its server's watched ``/metrics``
    (``metrics.url`` of the same host and port) while it waits for a first 200."""
    urls = config.all_urls
    known = ctx.agent.server_urls
    if len(urls) <= 1:
        return HealthWatcher(config.model_copy(update={"url": urls[0], "urls": ()}), starting=ctx.starting,
                             served_url=_served_url(urls[0], known)) if urls else None
    return WatcherGroup("health", [
        HealthWatcher(config.model_copy(update={"url": url, "urls": ()}), status_name=url_label("health", url),
                      starting=ctx.starting, served_url=_served_url(url, known))
        for url in urls
    ])
