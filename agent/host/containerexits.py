"""How a container's init ended, read from its container runtime's own exit record.

Owns: :class:`ContainerInit` and :func:`container_init_of` (a watched process that is its
container's init, read once while it lives), :class:`RuntimeExit` and :func:`runtime_exit` (the
record read after its death), :data:`DEFAULT_RECORDS` (where the runtimes keep it). The process
watcher (:mod:`agent.watchers.process`) tries this last, after every other source said nothing.
Imports the stdlib and :mod:`agent.sdk._files` (its bounded, no-symlink read).

Why: an agent in a pod gets no kernel exit events (not the host's network namespace) and the
container's init is reaped by its runtime's shim the moment it dies, so its zombie is gone too.
The runtime still writes down how it ended. Only for a container's **init** (pid 1 of its pid
namespace: ``/proc/PID/status`` ``NSpid`` ends in ``1``) is the container's exit code the
process's own; any other process of the container is never given it.

Which container: ``/proc/PID/cgroup`` names it by its 64-hex id, in a systemd unit
(``crio-ID.scope``, ``libpod-ID.scope``, ``docker-ID.scope``, ``cri-containerd-ID.scope``) or a
cgroupfs folder (``/docker/ID``, ``/kubepods/burstable/podUID/ID``: the runtime not said).

The records, as the runtimes' sources write them (read 2026-12):

* **conmon** (CRI-O, Podman; ``src/conmon.c``): after reaping the container's init it writes
  ``"%d"`` of ``get_exit_status`` (``WEXITSTATUS``, or ``128 + WTERMSIG`` for a signal death;
  ``-1`` when conmon's own timeout killed it), no newline, with ``g_file_set_contents`` (a
  temporary file renamed into place), first to ``--persist-dir``/``exit``, then to
  ``--exit-dir``/ID. An OOM kill (the cgroup's ``oom_kill`` event) also creates an empty ``oom``
  beside ``exit`` in the persist dir. CRI-O: exit dir ``/var/run/crio/exits`` (its
  ``container_exits_dir``; CRI-O deletes each file once it handled it), persist dir the
  container's storage folder ``/var/lib/containers/storage/overlay-containers/ID/userdata`` (kept
  until the container is removed); Podman (root): ``/run/libpod/exits/ID`` and
  ``/run/libpod/persist/ID/exit``. Both take the file's ctime as the finish time.
* **Docker** (moby ``daemon/container``): ``/var/lib/docker/containers/ID/config.v2.json``
  (mode 0600, atomically replaced), its ``State``: ``Running``, ``Restarting``, ``ExitCode``
  (containerd's reaper: ``128 + signal`` for a signal death), ``OOMKilled``, ``StartedAt``,
  ``FinishedAt`` (RFC 3339, the exit time containerd reported).
* **containerd** (``cri-containerd-ID``, and Kubernetes' other CRI runtime): no file record;
  the exit lives in containerd's memory and its metadata database only. Nothing is read, and
  nothing is waited for.

A code ``128 + N`` (N a signal number) is read as killed by signal N: the runtimes write a
signal death so and cannot tell it from a process that itself exited with that code.

Trust: a record is used only when it is a regular file owned by root, opened without following
a symlink, read up to a bound (:func:`agent.sdk._files.read_regular`), and written after the
process started (a previous run of the same container is never this one's record).
"""

from __future__ import annotations

import calendar
import json
import os
import re
import signal as _signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.host.procinfo import ns_pid
from agent.sdk._files import read_regular

__all__ = [
    "DEFAULT_RECORDS",
    "ENGINES_WITHOUT_RECORD",
    "ContainerInit",
    "RuntimeExit",
    "container_init_of",
    "record_paths",
    "records_visible",
    "runtime_exit",
]

#: Where the runtimes keep a container's exit record (``{id}``: the container's id), in the
#: order read: conmon's persist dirs (CRI-O's, Podman's), conmon's exit dirs, Docker's state.
DEFAULT_RECORDS: tuple[str, ...] = (
    "/var/lib/containers/storage/overlay-containers/{id}/userdata/exit",
    "/run/libpod/persist/{id}/exit",
    "/var/run/crio/exits/{id}",
    "/run/libpod/exits/{id}",
    "/var/lib/docker/containers/{id}/config.v2.json",
)

#: Runtimes that keep no exit record on disk.
ENGINES_WITHOUT_RECORD = frozenset({"containerd"})

#: Most bytes read of one record (Docker's config.v2.json holds the container's whole config).
MAX_RECORD_BYTES = 1 << 20

_DOCKER_FILE = "config.v2.json"
_ENGINE_OF_PREFIX = {"crio": "cri-o", "libpod": "podman", "docker": "docker", "cri-containerd": "containerd"}
_CGROUP_PART = re.compile(r"(?:(crio|libpod|docker|cri-containerd)-)?([0-9a-f]{64})(?:\.scope)?")
_MAX_SIGNAL = int(getattr(_signal, "SIGRTMAX", 64))


@dataclass(frozen=True, slots=True)
class ContainerInit:
    """A process that is its container's init (pid 1 of its pid namespace), read while it lived.

    Attributes:
        pid: the process (as the agent sees it).
        container_id: the container's id (64 hex digits), from its cgroup.
        engine: ``cri-o``, ``podman``, ``docker``, ``containerd``, or ``""`` (a cgroupfs path
            that does not say).
        cgroup: the cgroup path that named it.
        started_unix_nano: when the process started, ns since the epoch (``/proc/PID/stat``'s
            start, on the boot-time clock, taken to the wall clock when read; good to a tick).
    """

    pid: int
    container_id: str
    engine: str
    cgroup: str
    started_unix_nano: int


@dataclass(frozen=True, slots=True)
class RuntimeExit:
    """A container's exit as its runtime recorded it.

    Attributes:
        exit_code / signal: the status (a ``128 + N`` code read as signal N).
        oom: the runtime recorded an OOM kill (``oom_evidence`` says where).
        time_unix_nano: when it ended, ns since the epoch (conmon: the record's ctime, as CRI-O
            and Podman read it; Docker: ``FinishedAt``).
        path: the record read.
    """

    exit_code: int | None
    signal: int | None
    oom: bool
    time_unix_nano: int
    path: str
    oom_evidence: str = ""


def _container_in(cgroup_text: str) -> tuple[str, str, str] | None:
    """``(id, engine, cgroup path)`` of the deepest container named in ``/proc/PID/cgroup``'s text
    (the v2 line first), ``None`` when none is."""
    lines = cgroup_text.splitlines()
    lines.sort(key=lambda line: not line.startswith("0::"))
    for line in lines:
        path = line.split(":", 2)[-1]
        parts = path.split("/")
        for at in range(len(parts) - 1, -1, -1):
            match = _CGROUP_PART.fullmatch(parts[at])
            if match is None:
                continue
            prefix = match.group(1) or (parts[at - 1] if at and parts[at - 1] == "docker" else "")
            return match.group(2), _ENGINE_OF_PREFIX.get(prefix, ""), path
    return None


def _started_unix_nano(stat_text: str) -> int:
    """A process's start from its ``/proc/PID/stat`` text (field 22, clock ticks since boot),
    to the clock tick: psutil's ``create_time`` adds the boot time in whole seconds (``btime``),
    up to 1 s early, too coarse to tell a record older than the process."""
    fields = stat_text.rsplit(")", 1)[-1].split()
    try:
        ticks = int(fields[19])
    except (IndexError, ValueError):
        return 0
    since_boot_ns = ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return time.time_ns() - (time.clock_gettime_ns(time.CLOCK_BOOTTIME) - since_boot_ns)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(65536)
    except OSError:
        return None


def container_init_of(pid: int, proc: str = "/proc") -> ContainerInit | None:
    """``pid`` as its container's init, read now (three small ``/proc`` reads); ``None`` when it
    is in no container the agent can name, is not pid 1 of its pid namespace (another process
    of the container: the container's exit code is not its own), or is gone. Blocking."""
    if pid == 1 or ns_pid(pid) != 1:  # the host's own init, or not its namespace's pid 1
        return None
    cgroup = _read_text(f"{proc}/{pid}/cgroup")
    found = _container_in(cgroup) if cgroup is not None else None
    if found is None:
        return None
    stat_text = _read_text(f"{proc}/{pid}/stat")
    started = _started_unix_nano(stat_text) if stat_text is not None else 0
    if not started:
        return None
    container_id, engine, path = found
    return ContainerInit(pid=pid, container_id=container_id, engine=engine, cgroup=path, started_unix_nano=started)


def _templates_for(init: ContainerInit, records: Sequence[str]) -> list[str]:
    if init.engine in ENGINES_WITHOUT_RECORD:
        return []
    if init.engine == "docker":
        return [t for t in records if Path(t).name == _DOCKER_FILE]
    if init.engine:
        return [t for t in records if Path(t).name != _DOCKER_FILE]
    return list(records)


def record_paths(init: ContainerInit, records: Sequence[str] = DEFAULT_RECORDS) -> list[Path]:
    """The records that may hold ``init``'s container's exit, in order: for a runtime named by the
    cgroup only its own kind (conmon's for CRI-O and Podman, ``config.v2.json`` for Docker),
    every one when the cgroup does not say, none for containerd."""
    return [Path(t.replace("{id}", init.container_id)) for t in _templates_for(init, records)]


def records_visible(init: ContainerInit, records: Sequence[str] = DEFAULT_RECORDS) -> bool:
    """Whether a folder that would hold ``init``'s record is there to read (the part of a template
    before ``{id}``: a runtime's folder, mounted into the agent's pod): else no record can come,
    and none is waited for. Blocking (a few ``stat``)."""
    return any(os.path.isdir(t.split("{id}", 1)[0] or "/") for t in _templates_for(init, records))


def _fresh(st: os.stat_result, started_ns: int) -> bool:
    """Written after the process started (a previous run's record is older)."""
    return st.st_mtime_ns >= started_ns and st.st_ctime_ns >= started_ns


def _status_of(code: int) -> tuple[int | None, int | None] | None:
    if code < 0:
        return None  # conmon's -1: its own timeout killed the container, status not kept
    if 128 < code <= 128 + _MAX_SIGNAL:
        return None, code - 128
    return code, None


def _conmon_exit(path: Path, init: ContainerInit) -> RuntimeExit | None:
    got = read_regular(path, 32, ())
    if got is None or not _fresh(got[1], init.started_unix_nano):
        return None
    raw, st = got
    try:
        status = _status_of(int(raw.decode("ascii").strip()))
    except (UnicodeDecodeError, ValueError):
        return None
    if status is None:
        return None
    oom_file = path.parent / "oom"
    oom = path.name == "exit" and read_regular(oom_file, 0, ()) is not None
    return RuntimeExit(*status, oom=oom, time_unix_nano=st.st_ctime_ns, path=str(path),
                       oom_evidence=f"runtime record {oom_file}" if oom else "")


_RFC3339 = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")


def _rfc3339_ns(text: object) -> int:
    """Go's ``time.Time`` JSON (RFC 3339, up to ns) as ns since the epoch; 0 for none or Go's zero time."""
    match = _RFC3339.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        return 0
    y, mo, d, h, mi, s = (int(x) for x in match.groups()[:6])
    if y <= 1:
        return 0
    offset = 0 if match.group(8) == "Z" else (1 if match.group(8)[0] == "+" else -1) * (
        int(match.group(8)[1:3]) * 3600 + int(match.group(8)[4:6]) * 60)
    seconds = calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)) - offset
    return seconds * 1_000_000_000 + int((match.group(7) or "0").ljust(9, "0"))


def _docker_exit(path: Path, init: ContainerInit) -> RuntimeExit | None:
    got = read_regular(path, MAX_RECORD_BYTES, ())
    if got is None or not _fresh(got[1], init.started_unix_nano):
        return None
    try:
        state = json.loads(got[0]).get("State")
    except (ValueError, AttributeError):
        return None
    if not isinstance(state, dict) or (state.get("Running") and not state.get("Restarting")):
        return None  # still running (a restarting container keeps Running with its last exit)
    finished = _rfc3339_ns(state.get("FinishedAt"))
    code = state.get("ExitCode")
    if finished < init.started_unix_nano or not isinstance(code, int) or isinstance(code, bool):
        return None  # an earlier run's exit, or none
    status = _status_of(code)
    if status is None:
        return None
    oom = state.get("OOMKilled") is True
    return RuntimeExit(*status, oom=oom, time_unix_nano=finished, path=str(path),
                       oom_evidence=f"runtime record {path}: OOMKilled" if oom else "")


def runtime_exit(init: ContainerInit, records: Sequence[str] = DEFAULT_RECORDS) -> RuntimeExit | None:
    """How ``init``'s container ended, from the first trusted record among ``records`` (path
    templates, ``{id}`` the container's id: :data:`DEFAULT_RECORDS`, or the same under a mount
    such as ``/host``); ``None`` when none is there (yet), trusted and fresh. Blocking (a few
    small reads)."""
    for path in record_paths(init, records):
        found = _docker_exit(path, init) if path.name == _DOCKER_FILE else _conmon_exit(path, init)
        if found is not None:
            return found
    return None
