"""A watcher of a new kind of trouble, added to servewatch by this module and one registration line
(:func:`register`), as a newcomer adds one: nothing in ``agent/`` or ``exporters/`` names it.

``disk_space`` watches the free space of a folder (``os.statvfs``, the real file system) and
publishes :class:`DiskSpaceLow`, a :class:`~agent.model.events.TriggerEvent` of its own (trigger
``disk_low``), when it falls under ``min_free_bytes``; the incident manager opens incidents for it
as for any trigger (cooldown by trigger, every registered actor, bundle and spans). Its settings
are its own table, ``[disk_space]`` (``SERVEWATCH_DISK_SPACE__*``); its factory returns a
:class:`agent.watchers.Watcher` (mypy checks it). Used by tests/test_extension_points.py.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import anyio
from anyio import TASK_STATUS_IGNORED
from pydantic import BaseModel, Field

from agent.model.events import TriggerEvent
from agent.watchers import WATCHERS, Watcher

TRIGGER = "disk_low"


class DiskSpaceConfig(BaseModel):
    """Settings of the ``disk_space`` watcher (table ``[disk_space]``)."""

    folder: Path | None = Field(None, description="the folder whose file system is watched; unset: no watcher")
    min_free_bytes: int = Field(1024**3, ge=0, description="free space under this is trouble, bytes")
    interval_s: float = Field(1.0, gt=0, description="seconds between two looks")


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskSpaceLow(TriggerEvent):
    """The watched folder's file system has less free space than the floor."""

    TRIGGER: ClassVar[str] = TRIGGER
    folder: str
    free_bytes: int
    min_free_bytes: int

    def describe(self) -> str:
        return f"{self.folder}: {self.free_bytes} bytes free, under {self.min_free_bytes}"


class DiskSpaceWatcher:
    """Looks at the free space every ``interval_s``; publishes :class:`DiskSpaceLow` on each look
    under the floor (the incident manager's cooldown keeps it to one incident per window)."""

    name = "disk_space"

    def __init__(self, config: DiskSpaceConfig) -> None:
        self.config = config

    async def run(self, bus: Any, *, task_status: Any = TASK_STATUS_IGNORED) -> None:
        folder = self.config.folder
        assert folder is not None
        task_status.started()
        while True:
            free = (await anyio.to_thread.run_sync(shutil.disk_usage, folder)).free
            if free < self.config.min_free_bytes:
                await bus.publish(DiskSpaceLow(source=self.name, folder=str(folder), free_bytes=free,
                                               min_free_bytes=self.config.min_free_bytes))
            await anyio.sleep(self.config.interval_s)


def create(config: DiskSpaceConfig, ctx: Any) -> Watcher | None:
    return DiskSpaceWatcher(config) if config.folder is not None else None


def register() -> None:
    """The registration line."""
    WATCHERS.register("disk_space", config="tests.plugin_disk:DiskSpaceConfig", factory="tests.plugin_disk:create")


if __name__ == "__main__":  # servewatch with the watcher registered: argv as the CLI's
    register()
    from agent.cli.app import main

    sys.argv = ["servewatch", *sys.argv[1:]]
    main()
