"""One stuck request while the server serves others: a request in flight far longer than the
server's recent completions while the server still completes requests (vLLM #54003: a
structured-output grammar compiling forever on the engine's grammar thread, the other requests
completing; no stall, no health failure).

Owns :class:`RequestStallWatchers` (per SDK target, registered as ``request_stall``),
:class:`RequestStallWatcher` and :func:`stuck_requests` (the rule). Reads each target's in-flight
requests and recent completions from its SDK control socket (``inflight``: the request spans the
server opened with ``agent.sdk.request_span``, the thread holding each, the 99th-percentile
duration of its last 512 completions) every ``interval_s``, and publishes one
:class:`~agent.model.events.RequestStalled` per stuck request. May import :mod:`agent.model.events`,
:mod:`agent.model.bus`, :mod:`agent.host.sdkclient`, :mod:`agent.sdk.control` (the socket's path), anyio and
the standard library.

The rule: a request is stuck when it has been in flight longer than
``max(min_s, p99_multiple * p99_s)`` (``p99_s`` over at least ``min_completions`` recent
completions) and the server completed a request after it began (it progresses: this is one
request, not a stalled server, which the watchdog's rule covers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from agent.model.bus import Publisher
from agent.model.events import RequestStalled
from agent.watchers.config import RequestStallConfig

if TYPE_CHECKING:
    from agent.host.registry import BuildContext
    from agent.host.targets import Target

__all__ = ["RequestStallWatcher", "RequestStallWatchers", "create", "stuck_requests"]

log = logging.getLogger("servewatch.requests")


def _threshold_s(completions: Mapping[str, Any], config: RequestStallConfig) -> tuple[float, float, int] | None:
    """``(threshold_s, p99_s, recent)`` from the SDK's ``completions``, or ``None`` while too few
    completions were seen to trust their p99 (or the reply is malformed)."""
    p99, recent = completions.get("p99_s"), completions.get("recent")
    if not isinstance(p99, (int, float)) or not isinstance(recent, int) or recent < config.min_completions:
        return None
    return max(config.min_s, config.p99_multiple * float(p99)), float(p99), recent


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def stuck_requests(pid: int, reply: Mapping[str, Any], now_unix_nano: int, config: RequestStallConfig) -> list[RequestStalled]:
    """The stuck requests of one ``inflight`` reply read at ``now_unix_nano`` (wall clock, ns):
    each in flight longer than the threshold while a completion ended after it began.

    Args:
        pid: the target that answered.
        reply: the control socket's answer (``requests``, ``completions``); untrusted.
        now_unix_nano: when it was read.
        config: the rule's settings.
    """
    completions = reply.get("completions")
    requests = reply.get("requests")
    if not isinstance(completions, Mapping) or not isinstance(requests, list):
        return []
    bound = _threshold_s(completions, config)
    last_end = _int(completions.get("last_end_unix_nano"))
    if bound is None or last_end <= 0:
        return []
    threshold_s, p99_s, recent = bound
    out = []
    for r in requests:
        start = _int(r.get("start_time_unix_nano")) if isinstance(r, Mapping) else 0
        if start <= 0 or last_end <= start or (now_unix_nano - start) / 1e9 <= threshold_s:
            continue
        out.append(RequestStalled(
            source="request_stall", pid=pid, request_id=str(r.get("request_id", ""))[:256],
            trace_id=str(r.get("trace_id") or "")[:32], span_id=str(r.get("span_id") or "")[:16],
            age_s=(now_unix_nano - start) / 1e9, threshold_s=threshold_s, p99_s=p99_s, recent=recent,
            completed_ago_s=max(0.0, (now_unix_nano - last_end) / 1e9),
            thread_id=_int(r.get("thread_id")), native_thread_id=_int(r.get("native_thread_id"))))
    return out


class RequestStallWatcher:
    """Reads one target's in-flight requests every ``config.interval_s`` and publishes a
    :class:`~agent.model.events.RequestStalled` once per stuck request (again only after it left and
    came back: a request id is told once while in flight).

    Args:
        pid: the target (it serves the SDK's control socket at ``path``).
        path: its control socket.
        config: the rule's settings.
    """

    name = "request_stall"

    def __init__(self, pid: int, path: Path, config: RequestStallConfig) -> None:
        self.pid = pid
        self.path = path
        self.config = config
        #: stuck requests told so far (request ids still in flight)
        self.told: set[str] = set()

    async def read(self) -> Mapping[str, Any] | None:
        """One ``inflight`` reply, or ``None`` (no socket, no answer, an error: said at debug level)."""
        from agent.host.sdkclient import sdk_call

        if not await anyio.Path(self.path).exists():
            return None
        try:
            return await sdk_call(self.path, {"cmd": "inflight"}, timeout_s=self.config.call_timeout_s, pid=self.pid)
        except Exception as exc:  # noqa: BLE001 - a target that misbehaves costs this reading only
            log.debug("in-flight requests of pid %d unreadable: %s: %s", self.pid, type(exc).__name__, exc)
            return None

    async def check(self, bus: Publisher) -> list[RequestStalled]:
        """One reading, judged; the stuck requests published now."""
        reply = await self.read()
        if reply is None:
            return []
        stuck = stuck_requests(self.pid, reply, time.time_ns(), self.config)
        present = {str(r.get("request_id", "")) for r in reply.get("requests") or () if isinstance(r, Mapping)}
        self.told &= present
        fresh = [s for s in stuck if s.request_id not in self.told]
        for event in fresh:
            self.told.add(event.request_id)
            log.warning("%s", event.describe())
            await bus.publish(event)
        return fresh

    async def run(self, bus: Publisher, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Read until cancelled. Ready at once."""
        task_status.started()
        while True:
            await self.check(bus)
            await anyio.sleep(self.config.interval_s)


class RequestStallWatchers:
    """Per-target request-stall watchers (:class:`~agent.watchers.TargetWatchers`): one for each
    target with the SDK's step counter (it reads the control socket while there is one).

    Args:
        config: the ``[request_stall]`` settings.
        socket_dir: the sockets' folder; default the SDK's.
    """

    status_name = "requests"

    def __init__(self, config: RequestStallConfig, socket_dir: Path | None = None) -> None:
        self.config = config
        self.socket_dir = socket_dir

    def watchers_for(self, target: Target) -> Sequence[RequestStallWatcher] | None:
        """The watcher of ``target``, or ``None`` when disabled or it has no SDK step counter (yet)."""
        from agent.sdk.control import control_path
        from agent.watchers.steps import ShmStepSource

        if not self.config.enabled:
            return None
        # only with the SDK's step counter, as the step watchers: a target's own watchers start
        # once, together (one started alone would keep the step watchdog from ever starting);
        # its control socket may come later (read while it exists)
        if ShmStepSource(target.pid).read_now() is None:
            return None
        return [RequestStallWatcher(target.pid, control_path(target.pid, self.socket_dir), self.config)]


def create(config: RequestStallConfig, ctx: BuildContext) -> RequestStallWatchers:
    """Registry factory (:data:`agent.watchers.WATCHERS` ``request_stall``)."""
    return RequestStallWatchers(config)
