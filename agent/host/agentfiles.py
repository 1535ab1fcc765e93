"""Which watching agents use one data dir: a presence file per running agent.

Owns ``<data_dir>/<host>/agents/<pid>.json`` (``{"pid", "create_time_s", "started_time_unix_nano"}``,
0600 in a 0700 folder): :func:`register` writes this agent's at start (removing those killed
agents left) and returns the live
agents that were there first (a second ``servewatch run`` on the same data dir says so with the
first's pid: both write the same status file and bundle folder), :func:`unregister` removes it
at a clean stop, and :func:`live_agents` lists the agents running now (``servewatch status``
says when there are several, and whose status it shows). A file whose process is gone, or whose
pid now belongs to a later process (its start time differs), is not an agent. Imports the
standard library, anyio, psutil, :mod:`agent.model.datadir` and :mod:`agent.host.fsutil`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import psutil

from agent.model.datadir import AGENTS_DIR, DataDir

__all__ = ["AGENTS_DIR", "agents_dir", "live_agents", "on_data_dir", "register", "unregister"]

log = logging.getLogger("servewatch.runtime")

# AGENTS_DIR: the folder of presence files, under ``<data_dir>/<host>/`` (agent.model.datadir's)

#: Most a presence file's recorded start time may differ from its process's, seconds (psutil's
#: ``create_time`` is rounded to the clock tick).
_START_SLACK_S = 1.0


def agents_dir(data_dir: str | os.PathLike[str], host_name: str) -> Path:
    """``<data_dir>/<host_name>/agents`` (:attr:`agent.model.datadir.DataDir.agents`)."""
    return DataDir(Path(data_dir), host_name).agents


def _create_time_s(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def live_agents(data_dir: str | os.PathLike[str], host_name: str, *, remove_stale: bool = False) -> list[int]:
    """Pids of the agents running on this data dir now, by start time (a file left by a killed
    agent, or of a reused pid, is skipped; with ``remove_stale``, removed). Never raises for a
    missing or unreadable folder."""
    found: list[tuple[float, int]] = []
    try:
        files = sorted(agents_dir(data_dir, host_name).glob("*.json"))
    except OSError:
        return []
    for path in files:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            pid, started = int(doc["pid"]), float(doc["create_time_s"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        now = _create_time_s(pid)
        if now is not None and abs(now - started) <= _START_SLACK_S:
            found.append((started, pid))
        elif remove_stale:  # a killed agent's: no agent
            path.unlink(missing_ok=True)
    return [pid for _, pid in sorted(found)]


def register(data_dir: str | os.PathLike[str], host_name: str) -> tuple[Path | None, list[int]]:
    """Write this agent's presence file.

    Returns:
        ``(its path, or None when it could not be written, logged; the pids of the other agents
        already running on this data dir)``.
    """
    from agent.host.fsutil import atomic_write_text, ensure_private_dir

    me = os.getpid()
    others = [pid for pid in live_agents(data_dir, host_name, remove_stale=True) if pid != me]
    folder = agents_dir(data_dir, host_name)
    path = folder / f"{me}.json"
    doc = {"pid": me, "create_time_s": _create_time_s(me), "started_time_unix_nano": time.time_ns()}
    try:
        ensure_private_dir(folder)
        atomic_write_text(path, json.dumps(doc), durable=False)
    except OSError as exc:
        log.warning("cannot write %s: %s", path, exc)
        return None, others
    return path, others


def unregister(path: Path | None) -> None:
    """Remove a presence file :func:`register` wrote (gone already: fine)."""
    if path is None:
        return
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)


@asynccontextmanager
async def on_data_dir(data_dir: str | os.PathLike[str], host_name: str) -> AsyncIterator[list[int]]:
    """A running agent's presence on its data dir (the runtime's ``run``): registered on entry,
    another agent already there said in one warning line (both would write one status file and
    bundle folder), removed on exit (shielded, off the loop). Yields the other agents' pids."""
    import anyio  # here: `servewatch status` reads presence files without an event loop

    path, others = await anyio.to_thread.run_sync(register, data_dir, host_name)
    if others:
        log.warning("another agent (pid %s) already uses data dir %s: both write its status and incidents"
                    " (`servewatch status` shows both); give this one its own --data-dir",
                    ", ".join(map(str, others)), data_dir)
    try:
        yield others
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(unregister, path)
