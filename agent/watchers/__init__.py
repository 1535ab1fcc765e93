"""Watchers: observe the target and publish events on the bus. They never act.

Each watcher is started with ``await tg.start(watcher.run, bus)`` so "ready" means ready, and
runs supervised by the runtime (a crash is a blind status, then a restart with backoff). A
watcher says what it can see by publishing ``WatcherStatusChanged`` (ready / waiting / blind
with a reason; :mod:`agent.watchers.status`) before it is ready and on every change.
"""

from __future__ import annotations

from typing import Protocol

from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from agent.bus import Publisher

__all__ = ["Watcher"]


class Watcher(Protocol):
    """Something that watches and publishes (health, steps, watchdog, process)."""

    name: str

    async def run(self, bus: Publisher, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; call ``task_status.started()`` once ready."""
        ...
