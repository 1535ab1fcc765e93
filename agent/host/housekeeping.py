"""What the agent tidies behind itself and others: temp files of writes a killed writer left,
the SDK files of processes that died (death notices too, once read), and the heap memory it freed.

Owns :func:`remove_stale_temps` (under the data dir, at start), :func:`remove_dead_sdk_files` (the
step counters and control sockets dead processes of the agent's uid left in the SDK folder, at
start) and :func:`trim_memory` (every so often, the freed heap back to the OS). Each says what it
removed in one log line. Imports anyio, :mod:`agent.host.fsutil`, :mod:`agent.host.memory` and (lazily) the
SDK's :mod:`agent.sdk.counter`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio

from agent.host import fsutil
from agent.host.memory import trim

__all__ = ["remove_dead_sdk_files", "remove_stale_temps", "trim_memory"]

log = logging.getLogger("servewatch.runtime")


def remove_stale_temps(data_dir: Path) -> None:
    """Remove the temp files of writers killed mid-write (a previous agent's) under the data dir. Blocking."""
    removed = fsutil.remove_stale_temps(data_dir)
    if removed:
        log.warning("removed %d leftover temp file(s) of an interrupted write under %s", removed, data_dir)


def remove_dead_sdk_files(directory: Path | None) -> None:
    """The step counters, control sockets and (once old) death notices dead processes of the
    agent's uid left in the SDK folder (:func:`agent.sdk.counter.remove_dead_sdk_files`). Blocking."""
    from agent.sdk.counter import remove_dead_sdk_files as remove

    removed = remove(directory)
    if removed:
        log.info("removed %d SDK file(s) of dead processes: %s", len(removed), ", ".join(p.name for p in removed))


async def trim_memory(interval_s: float) -> None:
    """Every ``interval_s``, give the heap memory the agent freed back to the OS (off the loop)."""
    while True:
        await anyio.sleep(interval_s)
        await anyio.to_thread.run_sync(trim)
