"""Several watchers of one kind run as one registered watcher: one per server's URL (``--health-url``
or ``--metrics-url`` given several times).

Owns :class:`WatcherGroup` and :func:`url_label`. Imports anyio, the bus's ``Publisher`` and the
standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from agent.model.bus import Publisher

__all__ = ["WatcherGroup", "url_label"]


def url_label(kind: str, url: str) -> str:
    """The status row of one of several watchers of ``kind``: ``health 127.0.0.1:8001`` (its URL's
    host and port, the server it watches)."""
    try:
        where = urlsplit(url).netloc or url
    except ValueError:
        where = url
    return f"{kind} {where}"


class WatcherGroup:
    """Runs several watchers of one kind as one (each its own server's URL).

    Ready once every member is ready (each started with ``tg.start``); a member that crashes
    takes the group down, which the runtime's supervision restarts as any watcher.

    Args:
        name: the registered name (``health``, ``metrics``).
        watchers: the members, each with ``run(bus, *, task_status)``.

    Attributes:
        watchers: the members, in the order of their URLs.
    """

    def __init__(self, name: str, watchers: Sequence[Any]) -> None:
        self.name = name
        self.watchers = list(watchers)

    async def run(self, bus: Publisher, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Run every member until cancelled."""
        async with anyio.create_task_group() as tg:
            for watcher in self.watchers:
                await tg.start(watcher.run, bus)
            task_status.started()
