"""Watchers: observe the target and publish events on the bus. They never act.

Each watcher is started with ``await tg.start(watcher.run, bus)`` so "ready" means ready, and
runs supervised by the runtime (a crash is a blind status, then a restart with backoff). A
watcher says what it can see by publishing ``WatcherStatusChanged`` (ready / waiting / blind
with a reason; :mod:`agent.watchers.status`) before it is ready and on every change.

Owns the :class:`Watcher` protocol, :class:`TargetWatchers` (watchers started per target
process) and :data:`WATCHERS`, the watcher registry (:mod:`agent.host.registry`): one line per watcher
below. A factory returns a :class:`Watcher` (started once, restarted fresh after a crash unless it
sets ``reusable = True``) or a :class:`TargetWatchers` (asked for each target discovered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from agent.host.registry import Registry

if TYPE_CHECKING:  # annotations only: reading a status file (agent.watchers.status) needs no event loop
    from anyio.abc import TaskStatus

    from agent.host.targets import Target
    from agent.model.bus import Publisher

__all__ = ["WATCHERS", "TargetWatchers", "Watcher"]

#: The watcher registry: name -> (settings model, factory), started in this order; a factory
#: builds a :class:`Watcher` or a :class:`TargetWatchers` (both defined below: the annotation is a string).
WATCHERS: Registry[Watcher | TargetWatchers] = Registry("watcher")
WATCHERS.register("health", config="agent.watchers.config:HealthConfig", factory="agent.watchers.health:create")
WATCHERS.register("metrics", config="agent.watchers.config:MetricsConfig", factory="agent.watchers.watchdog:create_prometheus")
WATCHERS.register("process", config="agent.watchers.config:ProcessConfig", factory="agent.watchers.process:create")
WATCHERS.register("steps", factory="agent.watchers.watchdog:create_sdk")
WATCHERS.register("request_stall", config="agent.watchers.config:RequestStallConfig",
                  factory="agent.watchers.requests:create")


class Watcher(Protocol):
    """Something that watches and publishes (health, steps, watchdog, process)."""

    name: str

    async def run(self, bus: Publisher, *, task_status: TaskStatus[None] = ...) -> None:
        """Run until cancelled; call ``task_status.started()`` once ready."""
        ...


@runtime_checkable
class TargetWatchers(Protocol):
    """Watchers started for each target process discovered (an SDK step counter), cancelled
    when it exits. ``status_name`` is the status row the runtime keeps for them."""

    status_name: str

    def watchers_for(self, target: Target) -> list[Watcher] | None:
        """The watchers of ``target``, or ``None`` when it has nothing to watch (yet)."""
        ...
