"""The forward-step counter file: its public layout, a lock-free reader and the SDK's writer.

Owns the file layout, a public API: the SDK writes it (:class:`SharedCounter`, behind
:func:`agent.sdk.step`), the agent's step watcher (:mod:`agent.watchers.steps`), the verdict
judge and anyone else read it with :func:`read_counter` / :func:`parse_counter` and find the
files with :func:`counter_files`. Imports only the standard library (it runs inside the server).

Layout: ``SLOTS`` little-endian signed 64-bit words (:data:`SIZE_BYTES`, 64 bytes), in file
``servewatch-steps.<pid>`` (:data:`FILE_PREFIX` + pid) of the server user's private folder
``<shm_dir>/servewatch-<uid>/`` (:mod:`agent.sdk.folders`; ``shm_dir`` is
``$SERVEWATCH_SHM_DIR``, else ``/dev/shm`` when it exists, else the temp dir). The word
indexes are :data:`W_MAGIC` ... :data:`W_RANK`:

====  =======================  ==========================================================
word  name                     meaning
====  =======================  ==========================================================
0     magic                    ``MAGIC`` (file type and layout version)
1     pid                      the writer's pid
2     start_time_unix_nano     when the counter was created (wall clock, ns)
3     forward_ct               forward steps (scheduler batches) run so far
4     last_step_monotonic_ns   CLOCK_MONOTONIC of the last step, ns (0 before the first)
5     pending                  work items pending after the last step/``set_pending``; >0 = busy
6     profiling                1 while an SDK profiling session is active, else 0
7     rank_plus_one            torch.distributed's rank of the writer + 1 once known, 0 before
                               (it outlives the process's title: a zombie keeps 15 characters
                               of it in ``comm`` and no command line)
====  =======================  ==========================================================

The writer only stores whole aligned words (atomic on the platforms we run on); readers take a
snapshot without locks. ``CLOCK_MONOTONIC`` is system-wide, so the agent compares it with its
own ``time.monotonic_ns()``.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from agent.sdk._files import create_exclusive, hold_lock, remove_dead_files, remove_if_ours
from agent.sdk.folders import ENV_SHM_DIR, sdk_folders, sdk_path, shm_dir, writer_path

__all__ = [
    "ENV_SHM_DIR",
    "FILE_PREFIX",
    "MAGIC",
    "SIZE_BYTES",
    "SLOTS",
    "W_FORWARD_CT",
    "W_LAST_STEP",
    "W_MAGIC",
    "W_PENDING",
    "W_PID",
    "W_PROFILING",
    "W_RANK",
    "W_START",
    "CounterSnapshot",
    "SharedCounter",
    "counter_files",
    "counter_path",
    "parse_counter",
    "read_counter",
    "remove_dead_sdk_files",
    "shm_dir",
]

#: File name of a counter file without its pid: ``servewatch-steps.<pid>``.
FILE_PREFIX = "servewatch-steps."
#: Word 0 of a complete counter file: ``b"SWSTEP01"`` little-endian (file type and layout version).
MAGIC = 0x3130_5045_5453_5753
#: Number of 64-bit words.
SLOTS = 8
#: Size of a counter file, bytes.
SIZE_BYTES = SLOTS * 8
#: Word indexes (see the table above).
W_MAGIC, W_PID, W_START, W_FORWARD_CT, W_LAST_STEP, W_PENDING, W_PROFILING, W_RANK = range(SLOTS)
_FMT = f"<{SLOTS}q"


def counter_path(pid: int, directory: Path | None = None) -> Path:
    """Path of the counter file of process ``pid``: in the private folder of its user in
    ``directory`` (default :func:`shm_dir`; :func:`agent.sdk.folders.sdk_path`)."""
    return sdk_path(pid, f"{FILE_PREFIX}{pid}", directory)


def counter_files(directory: Path | None = None) -> dict[int, Path]:
    """Counter files in every user's private folder in ``directory`` (default :func:`shm_dir`)
    by the pid their name carries.

    Names only (directory listings): whether a file is complete, trusted and its process alive
    is for the reader to decide. ``{}`` when nothing can be listed.
    """
    found: dict[int, Path] = {}
    for _uid, folder in sdk_folders(directory):
        try:
            paths = list(folder.glob(f"{FILE_PREFIX}*"))
        except OSError:
            continue
        for path in paths:
            suffix = path.name[len(FILE_PREFIX):]
            if suffix.isdigit():
                found.setdefault(int(suffix), path)
    return found


@dataclass(frozen=True, slots=True)
class CounterSnapshot:
    """One lock-free reading of a counter file.

    Attributes:
        pid: writer pid.
        start_time_unix_nano: creation time of the counter (wall clock, ns).
        forward_ct: steps so far.
        last_step_monotonic_ns: CLOCK_MONOTONIC of the last step in ns, 0 before the first step.
        pending: pending work items (>0 means busy).
        profiling: an SDK profiling session is active.
        rank: the writer's torch.distributed rank, ``None`` until the SDK saw the process group
            initialised (and in files of writers older than this word).
    """

    pid: int
    start_time_unix_nano: int
    forward_ct: int
    last_step_monotonic_ns: int
    pending: int
    profiling: bool
    rank: int | None = None

    @property
    def busy(self) -> bool:
        return self.pending > 0

    @property
    def started(self) -> bool:
        """At least one step was taken (warm-up/compile is over)."""
        return self.forward_ct > 0


def read_counter(path: Path) -> CounterSnapshot | None:
    """Read a counter file without the writer's cooperation (a symlink is never followed).

    Returns:
        The snapshot, or ``None`` when the file is missing, a symlink, short or not a counter file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, SIZE_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_counter(raw)


def parse_counter(raw: bytes) -> CounterSnapshot | None:
    """Decode the first :data:`SIZE_BYTES` of a counter file; ``None`` when short or not a counter."""
    if len(raw) < SIZE_BYTES:
        return None
    words = struct.unpack(_FMT, raw[:SIZE_BYTES])
    if words[W_MAGIC] != MAGIC:
        return None
    return CounterSnapshot(
        pid=words[W_PID],
        start_time_unix_nano=words[W_START],
        forward_ct=words[W_FORWARD_CT],
        last_step_monotonic_ns=words[W_LAST_STEP],
        pending=words[W_PENDING],
        profiling=bool(words[W_PROFILING]),
        rank=words[W_RANK] - 1 if words[W_RANK] > 0 else None,
    )


_log = logging.getLogger("servewatch.sdk")
_swept: set[Path] = set()


def remove_dead_sdk_files(directory: Path | None = None) -> list[Path]:
    """Remove the step counters and control/worker sockets that processes of this uid left when
    they died without closing them, and their death notices once read (their counter gone and
    :data:`agent.sdk._files.NOTICE_KEEP_S` old): in this uid's private folders in ``directory`` (default
    :func:`shm_dir`; :func:`agent.sdk.folders.sdk_folders`) and loose in ``directory`` itself
    (where SDKs before the private folders wrote). Files of live processes (in any pid
    namespace), of other uids, and span rings are left alone. Never raises.

    Returns:
        The files removed.
    """
    base = directory or shm_dir()
    euid = os.geteuid()
    removed = remove_dead_files(base)
    for uid, folder in sdk_folders(base):
        if uid == euid:
            removed += remove_dead_files(folder)
    return removed


def _sweep_once(directory: Path) -> None:
    """At this process's first counter: remove the files dead processes of our uid left behind
    (:func:`agent.sdk._files.remove_dead_files`), once per folder."""
    if directory in _swept:
        return
    _swept.add(directory)
    removed = remove_dead_files(directory)
    if removed:
        _log.info("removed %d SDK file(s) of dead processes from %s", len(removed), directory)


class SharedCounter:
    """Writer side: owns the mapped file of this process.

    ``words`` is a ``memoryview`` of ``SLOTS`` int64 over the mapping; item assignment is a plain
    memory store (no syscall), which is what keeps :func:`agent.sdk.step` cheap.

    The file is created with ``O_EXCL | O_NOFOLLOW`` in this user's private folder (mode 0644
    inside a 0700 folder: the agent, root, reads it). When it cannot be created (no folder, no
    space) the counter lives in private memory instead (``published`` is ``False``): the
    server keeps running, unseen by the agent's step watchdog, and one warning is logged.
    """

    def __init__(self, path: Path | None = None, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.path = path or writer_path(f"{FILE_PREFIX}{self.pid}")
        #: whether the counter is visible to the agent (file created), else private memory
        self.published = True
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = create_exclusive(self.path, 0o644)
        except OSError as exc:
            self.published = False
            _log.warning("servewatch step counter not published at %s: %s", self.path, exc)
            self._mmap = mmap.mmap(-1, SIZE_BYTES)
        else:
            try:
                os.ftruncate(fd, SIZE_BYTES)
                self._mmap = mmap.mmap(fd, SIZE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                raise
            # kept open for the lock: while this process lives, no sweep removes its counter
            hold_lock(fd)
            self._fd: int | None = fd
            _sweep_once(self.path.parent)
        self.words = memoryview(self._mmap).cast("B").cast("q")
        self.words[W_PID] = self.pid
        self.words[W_START] = time.time_ns()
        self.words[W_MAGIC] = MAGIC  # last: readers ignore the file until it is complete

    def close(self, *, unlink: bool = True) -> None:
        """Release the mapping and (by default) remove the file; safe twice."""
        words, self.words = self.words, None  # type: ignore[assignment]
        if words is not None:
            words.release()
            self._mmap.close()
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)
        if unlink and self.published:
            self.published = False
            try:
                remove_if_ours(self.path)  # never someone else's file that replaced ours
            except OSError:
                pass
