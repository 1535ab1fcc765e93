"""What each watcher can see right now: ``ready``, ``waiting`` (with the reason) or ``blind``
(with the reason).

Owns :class:`WatcherState`, :class:`WatcherStatus` (one watcher's status, a plain frozen
dataclass), :class:`StatusSnapshot` (all of them plus the agent's identity: the content of the
status file and of issue 14's ``GET /v1/status``), :class:`StatusBoard` (keeps the current
statuses, logs every change, writes the status file atomically) and :func:`read_status_file`.
Imports only :mod:`agent.model.kinds` (:mod:`agent.model.events` where it publishes), :mod:`agent.host.fsutil` and the standard library, so the CLI, the
runtime, exporters and an HTTP API can all use it.

States, from the SRE's point of view:

* ``ready``: the watcher sees what it should (``health: 200 from http://…/health``).
* ``waiting``: nothing is wrong yet, but it cannot judge yet (``health: waiting for first 200
  from …``, ``metrics: no forward progress yet``). Waiting never opens an incident.
* ``blind``: it cannot see, and will not until someone fixes something (``metrics: BLIND — 401
  Unauthorized from …``). The reason says what is wrong and, where we know, what to do.

The status file is ``<data_dir>/<host>/status.json`` (:func:`status_path`), schema
``servewatch.status/1``::

    {"schema": "servewatch.status/1", "host.name": "h1", "agent_pid": 4242,
     "started_time_unix_nano": ..., "updated_time_unix_nano": ...,
     "watchers": [{"name": "health", "state": "waiting",
                   "reason": "waiting for first 200 from http://127.0.0.1:30000/health",
                   "since_time_unix_nano": ...}, ...]}
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.model.datadir import STATUS_FILE, DataDir
from agent.model.kinds import StrEnum, now_ns

__all__ = [
    "STATUS_FILE",
    "STATUS_SCHEMA",
    "StatusBoard",
    "StatusReporter",
    "StatusSnapshot",
    "WatcherState",
    "WatcherStatus",
    "read_status_file",
    "status_path",
]

log = logging.getLogger("servewatch.status")

#: Schema tag of the status file (and of ``/v1/status``).
STATUS_SCHEMA = "servewatch.status/1"
# STATUS_FILE: the status file's name inside ``<data_dir>/<host>/`` (agent.model.datadir's)


class WatcherState(StrEnum):
    """What a watcher can see (see the module docstring)."""

    READY = "ready"
    WAITING = "waiting"
    BLIND = "blind"


@dataclass(frozen=True, slots=True, kw_only=True)
class WatcherStatus:
    """One watcher's status.

    Attributes:
        name: the watcher (``health``, ``metrics``, ``steps``, ``process``, ``pyspy``, ...).
        state: ready / waiting / blind.
        reason: one human line: what it sees, what it waits for, or why it is blind.
        since_time_unix_nano: when it entered this state (wall clock, ns since the epoch).
    """

    name: str
    state: WatcherState
    reason: str = ""
    since_time_unix_nano: int = field(default_factory=now_ns)

    def line(self) -> str:
        """One line for people: ``health: waiting for first 200 from …``,
        ``metrics: BLIND — 401 Unauthorized from …``, ``steps: 2 ranks via shm counter``."""
        if self.state is WatcherState.BLIND:
            return f"{self.name}: BLIND — {self.reason}" if self.reason else f"{self.name}: BLIND"
        return f"{self.name}: {self.reason or self.state.value}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state.value,
            "reason": self.reason,
            "since_time_unix_nano": self.since_time_unix_nano,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WatcherStatus:
        """Parse one entry of the status file; raises ``ValueError`` when malformed."""
        try:
            return cls(
                name=str(data["name"]),
                state=WatcherState(str(data["state"])),
                reason=str(data.get("reason") or ""),
                since_time_unix_nano=int(data.get("since_time_unix_nano") or 0),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed watcher status {data!r}") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusSnapshot:
    """Every watcher's status at one moment, plus who reported it.

    Attributes:
        host_name: ``host.name`` of the agent.
        agent_pid: the agent's pid (``servewatch status`` says when it is gone).
        started_time_unix_nano / updated_time_unix_nano: agent start and last change.
        watchers: statuses in the order they were first reported.
        incidents: the agent's incidents as :meth:`agent.incidents.manager.IncidentManager.state` gives
            them (``open``, ``running``, ``last``, ``written``, ``suppressed``, ``stalled``); ``None`` before
            the agent reported any (or from an older agent).
    """

    host_name: str
    agent_pid: int
    started_time_unix_nano: int
    updated_time_unix_nano: int
    watchers: tuple[WatcherStatus, ...] = ()
    incidents: Mapping[str, Any] | None = None

    @property
    def blind(self) -> tuple[WatcherStatus, ...]:
        return tuple(w for w in self.watchers if w.state is WatcherState.BLIND)

    def get(self, name: str) -> WatcherStatus | None:
        for w in self.watchers:
            if w.name == name:
                return w
        return None

    @property
    def stalled(self) -> tuple[Mapping[str, Any], ...]:
        """The stalls not over (busy, no forward progress): ``incidents["stalled"]``."""
        raw = (self.incidents or {}).get("stalled")
        return tuple(x for x in raw if isinstance(x, Mapping)) if isinstance(raw, list) else ()

    def incident_lines(self, now_unix_nano: int | None = None, stalled_as_of_unix_nano: int | None = None) -> list[str]:
        """Lines for people on stalls and incidents, e.g. ``stalled: pid 42 busy, no forward
        progress for 37 s (timeout 20 s); stall suppressed by cooldown (incident X)``,
        ``incident: OPEN X (stall: ...)``, ``incidents: 1 written (last X, stall, 3 min ago);
        1 trigger suppressed by cooldown``; none before any stall or incident.

        ``now_unix_nano`` (default: now) dates the ``ago``s; ``stalled_as_of_unix_nano`` (default:
        the same) is when the stall durations are measured to: a stopped agent's last word, whose
        stalls nobody watched since."""
        inc = self.incidents or {}
        now = now_ns() if now_unix_nano is None else now_unix_nano
        stall_end = now if stalled_as_of_unix_nano is None else stalled_as_of_unix_nano
        lines = [_stall_line(st, stall_end) for st in self.stalled]
        lines.extend(_open_incident_lines(inc))
        tally = _incident_tally_line(inc, now)
        if tally is not None:
            lines.append(tally)
        return lines

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema": STATUS_SCHEMA,
            "host.name": self.host_name,
            "agent_pid": self.agent_pid,
            "started_time_unix_nano": self.started_time_unix_nano,
            "updated_time_unix_nano": self.updated_time_unix_nano,
            "watchers": [w.to_json() for w in self.watchers],
        }
        if self.incidents is not None:
            doc["incidents"] = dict(self.incidents)
        return doc

    @classmethod
    def from_json(cls, data: Any) -> StatusSnapshot:
        """Parse a status document; raises ``ValueError`` when it is not one."""
        if not isinstance(data, dict) or data.get("schema") != STATUS_SCHEMA:
            raise ValueError(f"not a {STATUS_SCHEMA} document")
        raw = data.get("watchers")
        if not isinstance(raw, list):
            raise ValueError("'watchers' must be a list")
        return cls(
            host_name=str(data.get("host.name") or ""),
            agent_pid=int(data.get("agent_pid") or 0),
            started_time_unix_nano=int(data.get("started_time_unix_nano") or 0),
            updated_time_unix_nano=int(data.get("updated_time_unix_nano") or 0),
            watchers=tuple(WatcherStatus.from_json(w) for w in raw),
            incidents=data["incidents"] if isinstance(data.get("incidents"), dict) else None,
        )


def _stall_line(st: Mapping[str, Any], stall_end: int) -> str:
    """``stalled: ...`` for one stall, its duration measured to ``stall_end``."""
    who = f"pid {st.get('pid')}" if st.get("pid") is not None else "server"
    if st.get("series"):
        who += f" {{{st['series']}}}"
    age_s = max(0.0, (stall_end - int(st.get("since_time_unix_nano") or stall_end)) / 1e9)
    line = f"stalled: {who} busy, no forward progress for {age_s:.0f} s (timeout {st.get('timeout_s', 0):g} s)"
    if st.get("suppressed"):
        line += f"; stall suppressed by cooldown (incident {st.get('incident') or '?'})"
    elif st.get("incident"):
        line += f"; incident {st['incident']}"
    return line


def _open_incident_lines(inc: Mapping[str, Any]) -> list[str]:
    """``incident: OPEN ...`` for every server's open incident."""
    opened = inc.get("open")
    running = [r for r in inc.get("running") or () if isinstance(r, Mapping)]
    if not running and isinstance(opened, Mapping):
        running = [opened]  # a status file of an agent before several servers' incidents ran at once
    lines = []
    for one in running:
        server = f" of server pid {one['server']}" if one.get("server") is not None and len(running) > 1 else ""
        lines.append(f"incident: OPEN {one.get('id')}{server} ({one.get('trigger')}: {one.get('detail')})")
    return lines


def _incident_tally_line(inc: Mapping[str, Any], now: int) -> str | None:
    """``incidents: N written ...`` (``None``: none written or suppressed)."""
    last, written, suppressed = inc.get("last"), int(inc.get("written") or 0), int(inc.get("suppressed") or 0)
    if not (written or suppressed):
        return None
    line = f"incidents: {written} written"
    if isinstance(last, Mapping):
        ago_s = max(0.0, (now - int(last.get("opened_time_unix_nano") or now)) / 1e9)
        ago = f"{ago_s:.0f} s" if ago_s < 120 else f"{ago_s / 60:.0f} min"
        line += f" (last {last.get('id')}, {last.get('trigger')}, {ago} ago)"
    if suppressed:
        line += f"; {suppressed} trigger{'s' if suppressed != 1 else ''} suppressed by cooldown"
    return line


def status_path(data_dir: str | os.PathLike[str], host_name: str) -> Path:
    """``<data_dir>/<host_name>/status.json`` (:attr:`agent.model.datadir.DataDir.status_file`)."""
    return DataDir(Path(data_dir), host_name).status_file


def read_status_file(path: str | os.PathLike[str]) -> StatusSnapshot:
    """Read a status file.

    Raises:
        FileNotFoundError: no agent wrote one there.
        ValueError: the file is not a status document.
        OSError: it cannot be read.
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    return StatusSnapshot.from_json(data)


class StatusBoard:
    """The current status of every watcher; thread-safe (metrics read it from their thread).

    Args:
        host_name: ``host.name`` written in the snapshot.
        path: the status file to keep up to date (atomic writes); ``None`` keeps it in memory.
        on_change: called with each status that changed (after logging and writing).
        warn_blind: log a change to blind at WARNING (else INFO, like every other change); false
            when the caller shows each change itself, so it is not shown twice.

    A status repeated with the same state and reason changes nothing (no log, no write).
    """

    def __init__(
        self,
        *,
        host_name: str = "",
        path: str | os.PathLike[str] | None = None,
        on_change: Callable[[WatcherStatus], None] | None = None,
        warn_blind: bool = True,
    ) -> None:
        self.host_name = host_name
        self.warn_blind = warn_blind
        self.path = Path(path) if path is not None else None
        self.on_change = on_change
        self.started_time_unix_nano = now_ns()
        self.updated_time_unix_nano = self.started_time_unix_nano
        self._statuses: dict[str, WatcherStatus] = {}
        self._lock = threading.Lock()
        #: status changes recorded so far
        self.changes = 0
        self._write_failed = False
        self._incidents: Mapping[str, Any] | None = None

    def set_incidents(self, state: Mapping[str, Any]) -> None:
        """Keep the agent's incident state (:attr:`StatusSnapshot.incidents`); the caller writes
        the file (:meth:`write`, off the event loop)."""
        with self._lock:
            self._incidents = state
            self.updated_time_unix_nano = now_ns()

    def set(
        self, name: str, state: WatcherState, reason: str = "", *, log_change: bool = True, write: bool = True
    ) -> bool:
        """Record ``name``'s status. Returns whether it changed (state or reason).

        ``write=False`` leaves writing the status file to the caller (:meth:`write`, from a
        worker thread when the caller runs on the event loop).
        """
        with self._lock:
            old = self._statuses.get(name)
            if old is not None and old.state is state and old.reason == reason:
                return False
            since = old.since_time_unix_nano if old is not None and old.state is state else now_ns()
            status = WatcherStatus(name=name, state=state, reason=reason, since_time_unix_nano=since)
            self._statuses[name] = status
            self.updated_time_unix_nano = now_ns()
            self.changes += 1
        if log_change:
            blind = state is WatcherState.BLIND and self.warn_blind
            log.log(logging.WARNING if blind else logging.INFO, "%s", status.line())
        if write:
            self.write()
        if self.on_change is not None:
            self.on_change(status)
        return True

    def update(self, status: WatcherStatus, *, log_change: bool = True) -> bool:
        """:meth:`set` from a :class:`WatcherStatus`."""
        return self.set(status.name, status.state, status.reason, log_change=log_change)

    def remove(self, name: str) -> None:
        """Forget a watcher (its target exited)."""
        with self._lock:
            if self._statuses.pop(name, None) is None:
                return
            self.updated_time_unix_nano = now_ns()
        self.write()

    def get(self, name: str) -> WatcherStatus | None:
        with self._lock:
            return self._statuses.get(name)

    def snapshot(self) -> StatusSnapshot:
        with self._lock:
            return StatusSnapshot(
                host_name=self.host_name,
                agent_pid=os.getpid(),
                started_time_unix_nano=self.started_time_unix_nano,
                updated_time_unix_nano=self.updated_time_unix_nano,
                watchers=tuple(self._statuses.values()),
                incidents=self._incidents,
            )

    def states(self) -> Iterable[tuple[str, WatcherState]]:
        """``(name, state)`` of every watcher (for the OTel gauge)."""
        with self._lock:
            return [(s.name, s.state) for s in self._statuses.values()]

    def write(self) -> None:
        """Write the status file now (atomic); a failure is logged once, never raised."""
        if self.path is None:
            return
        from agent.host.fsutil import atomic_write_text, ensure_private_dir

        try:
            ensure_private_dir(self.path.parent)
            # rewritten every few seconds (the span counts): atomic, but no fsync (a lost update
            # after a power cut is harmless; an fsync per update stalls the event loop on a busy disk)
            atomic_write_text(self.path, json.dumps(self.snapshot().to_json(), indent=2), durable=False)
        except OSError as exc:
            if not self._write_failed:
                self._write_failed = True
                log.error("cannot write status file %s: %s", self.path, exc)
        else:
            self._write_failed = False


class StatusReporter:
    """A watcher's side: publishes :class:`~agent.model.events.WatcherStatusChanged` when its status
    changes (same state and reason twice publishes once).

    Args:
        name: the watcher name shown to people (``health``, ``metrics``, ``steps``).
        state / reason: the initial status, reported by :meth:`initial` (before ``started()``).

    Attributes:
        current: the last status set (also before it was published).
    """

    def __init__(self, name: str, state: WatcherState, reason: str) -> None:
        self.name = name
        self.current = WatcherStatus(name=name, state=state, reason=reason)
        self._published: tuple[WatcherState, str] | None = None

    async def set(self, bus: Any, state: WatcherState, reason: str) -> bool:
        """Set and publish (``bus`` is a :class:`~agent.model.bus.Publisher`); returns whether it changed."""
        if self.current.state is not state or self.current.reason != reason:
            self.current = WatcherStatus(name=self.name, state=state, reason=reason)
        key = (state, reason)
        if self._published == key:
            return False
        self._published = key
        from agent.model.events import (
            WatcherStatusChanged,  # here: reading a status file builds no event
        )

        await bus.publish(WatcherStatusChanged(source=self.name, watcher=self.name, state=state.value, reason=reason))
        return True

    async def initial(self, bus: Any) -> None:
        """Publish the initial (or current) status."""
        await self.set(bus, self.current.state, self.current.reason)
