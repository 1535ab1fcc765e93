"""The watchers' settings models, one per registered watcher with settings (a table each, named
by the watcher's registration line in :mod:`agent.watchers`): light, so that the settings load
without importing a watcher.

Owns :class:`HealthConfig` (``[health]``, with :func:`check_http_url`), :class:`StepsConfig`,
:class:`MetricsConfig` (``[metrics]``) and :class:`ProcessConfig` (``[process]``). Both URL tables take several servers' URLs (``url`` as a
list, a repeated ``--health-url``/``--metrics-url``, or ``urls``): one watcher each, each URL tied
to its server by its port. The stall rule's own settings (``[watchdog]``) are the
agent's: :class:`agent.host.stall.WatchdogConfig`. Imports pydantic and the standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["MAX_HEALTH_BODY_BYTES", "HealthConfig", "MetricsConfig", "ProcessConfig", "RequestStallConfig", "StepsConfig",
           "check_http_url", "split_url_list"]

#: Most bytes of a health answer read (the status code is what counts); the rest is not read.
MAX_HEALTH_BODY_BYTES = 64 * 1024


class _ServerUrls(BaseModel):
    """The ``url``/``urls`` pair of a per-server probe table (health, /metrics): a list given as
    ``url`` (a repeated option, a TOML array) is split by :func:`split_url_list`, each URL checked
    by :func:`check_http_url`. The tables declare the two fields themselves (their descriptions)."""

    url: str | None = None
    urls: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _url_list(cls, data: Any) -> Any:
        return split_url_list(data)

    @field_validator("url", check_fields=False)
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return check_http_url(value)

    @field_validator("urls", check_fields=False)
    @classmethod
    def _http_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(u for u in (check_http_url(v) for v in value) if u)

    @property
    def all_urls(self) -> tuple[str, ...]:
        """``url`` and ``urls``, in order, each once."""
        return tuple(dict.fromkeys(u for u in (self.url, *self.urls) if u))


class HealthConfig(_ServerUrls):
    """User settings of the health watcher.

    Attributes:
        url: the health URL, e.g. ``http://127.0.0.1:30000/health`` (SGLang's default port).
            Default ``None``: no health watcher runs. A list (TOML array, ``--health-url`` given
            several times) is several servers': the first is ``url``, the others ``urls``.
        urls: more health URLs, one per server (each probed by its own watcher; a failure opens
            that server's incident, the server found by the URL's port). Default none.
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

    #: agent-wide values set in this table (:class:`~agent.host.registry.AgentValues`)
    provides: ClassVar[Mapping[str, str]] = {"server_urls": "all_urls"}
    #: the first example turns the watcher on (its defaults leave it off)
    model_config = ConfigDict(json_schema_extra={"examples": [{"url": "http://127.0.0.1:30000/health"}]})

    url: str | None = None
    urls: tuple[str, ...] = ()
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0)
    unhealthy_after: int = Field(default=3, ge=1)
    healthy_after: int = Field(default=2, ge=1)
    wait_for_ready: bool = True
    startup_timeout_s: float | None = Field(default=1800.0, gt=0)
    max_body_bytes: int = Field(default=MAX_HEALTH_BODY_BYTES, ge=0)
    refused_grace_s: float = Field(default=0.0, ge=0)


def split_url_list(data: Any) -> Any:
    """A table's ``url`` given as a list (a TOML array, a repeated ``--health-url``): the first is
    ``url``, the rest ``urls`` (replacing any given there: the list is the whole set); other
    input as it is."""
    if isinstance(data, dict) and isinstance(data.get("url"), (list, tuple)):
        given = [u for u in data["url"] if u]
        return {**data, "url": given[0] if given else None, "urls": tuple(given[1:])}
    return data


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
        open_requests: a request the server accepted and has not answered (read from the
            kernel's state of the connections to the URL's port, when it is local) is work
            pending even while the busy gauge says 0: vLLM and SGLang publish their gauges only
            after an engine step, so a hang in the first forward after an idle spell is a stall
            only this way. Default ``True``.
        open_request_quiet_s: a connection to the server quiet both ways for this long and still
            open holds a request (a streaming response); keep it above the server's HTTP
            keep-alive timeout (uvicorn's default: 5 s). Default 10.0.
    """

    metrics_preset: Literal["sglang", "vllm"] | None = "sglang"
    counter: str | None = None
    busy_gauge: str | None = None
    scrape_timeout_s: float = Field(default=5.0, gt=0)
    open_requests: bool = True
    open_request_quiet_s: float = Field(default=10.0, gt=0)


class MetricsConfig(StepsConfig, _ServerUrls):
    """Prometheus ``/metrics`` scrape used as the forward-progress source when the SDK is absent.

    Adds ``url`` to :class:`StepsConfig` (presets, overrides, timeout); ``url`` as a list (or
    ``urls``) is several servers' ``/metrics``, one watchdog each (same preset), a stall opening
    that server's incident (the server found by the URL's port).
    """

    #: agent-wide values set in this table (:class:`~agent.host.registry.AgentValues`)
    provides: ClassVar[Mapping[str, str]] = {"server_urls": "all_urls"}
    #: the first example turns the watchdog on (its defaults leave it off)
    model_config = ConfigDict(json_schema_extra={"examples": [{"url": "http://127.0.0.1:30000/metrics"}]})

    url: str | None = Field(None, description="the server's /metrics URL; unset = no scrape")
    urls: tuple[str, ...] = Field((), description="more servers' /metrics URLs, one watchdog each")
    refused_grace_s: float = Field(
        0.0, ge=0, description="seconds after start in which 'connection refused' means the server is starting (launch sets it)"
    )


class RequestStallConfig(BaseModel):
    """User settings of the request-stall watcher (the ``[request_stall]`` table): one request in
    flight far longer than the server's recent completions while the server completes others
    (a structured-output grammar compiling forever on the engine's grammar thread, vLLM #54003),
    read from the SDK's in-flight requests (the control socket's ``inflight``) of each target
    that serves one.

    Attributes:
        enabled: watch each SDK target's in-flight requests. Default ``True``.
        p99_multiple: a request is stuck once in flight longer than this many times the
            99th-percentile duration of the server's recent completions (its last 512), a
            multiple (no unit). Default 10.
        min_s: never before this many seconds in flight, whatever the p99 (a server whose
            requests all finish in 50 ms has long ones too). Default 60 s.
        min_completions: recent completions needed before their p99 is trusted. Default 20.
        interval_s: seconds between two readings of a target's in-flight requests. Default 5.
        call_timeout_s: bound of one reading (the control-socket call), seconds. Default 2.
    """

    enabled: bool = True
    p99_multiple: float = Field(default=10.0, gt=1)
    min_s: float = Field(default=60.0, gt=0)
    min_completions: int = Field(default=20, ge=1)
    interval_s: float = Field(default=5.0, gt=0)
    call_timeout_s: float = Field(default=2.0, gt=0)


class ProcessConfig(BaseModel):
    """User settings of the process watcher (the ``[process]`` table).

    Attributes:
        container_exit_records: where container runtimes keep a container's exit record, as path
            templates (``{id}``: the container's 64-hex id), read when nothing else told how a
            container's init (pid 1 of its pid namespace) ended: an agent in a pod, without the
            kernel's exit events. Default: CRI-O's and Podman's conmon files
            (``/var/lib/containers/storage/overlay-containers/{id}/userdata/exit``,
            ``/run/libpod/persist/{id}/exit``, ``/var/run/crio/exits/{id}``,
            ``/run/libpod/exits/{id}``) and Docker's ``/var/lib/docker/containers/{id}/config.v2.json``
            (:data:`agent.host.containerexits.DEFAULT_RECORDS`); a DaemonSet that mounts them
            elsewhere names them there (``/host/var/run/crio/exits/{id}``). Empty: none read.
    """

    container_exit_records: tuple[str, ...] = (
        "/var/lib/containers/storage/overlay-containers/{id}/userdata/exit",
        "/run/libpod/persist/{id}/exit",
        "/var/run/crio/exits/{id}",
        "/run/libpod/exits/{id}",
        "/var/lib/docker/containers/{id}/config.v2.json",
    )

    @field_validator("container_exit_records")
    @classmethod
    def _templates(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for template in value:
            if not template.startswith("/") or "{id}" not in template:
                raise ValueError(f"{template!r}: an absolute path with {{id}} (the container's id) in it")
        return value
