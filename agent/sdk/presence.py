"""An agent says which servers it watches, so a server's first spans wait for it in the ring.

Owns the watch declaration, a small public file layout shared by the agent (writer) and the SDK
(reader): ``<shm dir>/servewatch-agent.<agent pid>`` holding one JSON object ``{"pid": <agent
pid>, "targets": [<server pid>, ...]}``, rewritten atomically (temp file + rename) when the
agent's targets change and touched (mtime) at each of its heartbeats; removed when the agent
stops.

Why: a server creates its span ring at its first span; until the agent attaches (its next ring
poll) the ring has no heartbeat, and without this declaration the first request's spans would
take the server's own fallback path (a no-op unless it installed the OTel SDK: lost). A server
declared watched by a live agent instead holds those spans in the ring for a bounded time
(:data:`HOLD_S`, the ring's capacity) until the agent attaches and ships them
(:mod:`agent.sdk.channel`).

Trust: a declaration counts only when it is a regular file (never through a symlink) owned by
root or by the server's own user, fresh (touched within :data:`STALE_S`) and written by a live
process; a file planted by another user cannot make a server hold its spans.

Imports the standard library, :mod:`agent.sdk.counter` (the shm folder) and the SDK's own file
helpers only.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from agent.sdk._files import create_exclusive
from agent.sdk.counter import shm_dir

__all__ = ["HOLD_S", "PREFIX", "STALE_S", "declaration_path", "remove_declaration", "touch_declaration", "watched", "write_declaration"]

#: File name prefix of a declaration (``servewatch-agent.<agent pid>``).
PREFIX = "servewatch-agent."
#: A declaration not touched for this long belongs to an agent that is gone, seconds.
STALE_S = 10.0
#: How long a new ring holds its spans for a declared agent that has not attached yet, seconds
#: (the agent polls rings every 0.5 s by default; ``SERVEWATCH_SPAN_HOLD_S`` overrides it).
HOLD_S = 10.0
#: Largest declaration read, bytes (pids of one agent's targets).
_MAX_BYTES = 256 * 1024


def declaration_path(agent_pid: int, directory: Path | None = None) -> Path:
    """Path of agent ``agent_pid``'s declaration (default folder: the SDK's shm folder)."""
    return (directory or shm_dir()) / f"{PREFIX}{agent_pid}"


def write_declaration(targets: Iterable[int], directory: Path | None = None) -> Path:
    """Declare (atomically) that this process, an agent, watches ``targets`` (pids).

    Raises:
        OSError: the folder cannot be written.
    """
    path = declaration_path(os.getpid(), directory)
    data = json.dumps({"pid": os.getpid(), "targets": sorted(set(targets))}, separators=(",", ":")).encode()
    temp = path.with_name(f".{path.name}.tmp")
    fd = create_exclusive(temp, 0o644)  # never a file someone planted at that name
    try:
        os.write(fd, data)
        os.fchmod(fd, 0o644)  # readable by the servers of every user (a umask must not hide it)
    finally:
        os.close(fd)
    os.replace(temp, path)
    return path


def touch_declaration(directory: Path | None = None) -> None:
    """Keep this agent's declaration fresh (its mtime); never raises."""
    try:
        os.utime(declaration_path(os.getpid(), directory), follow_symlinks=False)
    except OSError:
        pass


def remove_declaration(directory: Path | None = None) -> None:
    """Withdraw this agent's declaration (it stops); never raises."""
    try:
        os.unlink(declaration_path(os.getpid(), directory))
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def watched(pid: int, directory: Path | None = None, *, now_s: float | None = None) -> bool:
    """Whether a live agent declares it watches ``pid`` (see the module docstring for which
    declarations count). Lists the folder and reads the few declarations there: call it
    rarely (the channel caches it). Never raises."""
    folder = directory or shm_dir()
    now = time.time() if now_s is None else now_s
    try:
        names = [n for n in os.listdir(folder) if n.startswith(PREFIX) and n[len(PREFIX):].isdigit()]
    except OSError:
        return False
    trusted = {0, os.geteuid()}
    for name in names:
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in trusted or now - st.st_mtime > STALE_S:
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                raw = os.read(fd, _MAX_BYTES)
            finally:
                os.close(fd)
            data = json.loads(raw)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("pid") != int(name[len(PREFIX):]) or not _alive(int(data["pid"])):
            continue
        targets = data.get("targets")
        if isinstance(targets, list) and pid in targets:
            return True
    return False
