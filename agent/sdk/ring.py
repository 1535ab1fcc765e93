"""The span ring: a bounded shared-memory channel from a server process to its agent.

Owns the file layout, a public API of both sides: :class:`RingWriter` (the server's side, a
memory mapping, behind :mod:`agent.sdk.channel`) and
:class:`RingReader` (the agent's side, ``pread``/``pwrite`` only, so a target that truncates its
file cannot crash the agent with SIGBUS). Imports only the standard library: it runs inside the
server, and the agent reads the same layout without importing OpenTelemetry.

File ``servewatch-spans.<pid>`` in the server user's private folder ``<shm_dir>/servewatch-<uid>/``
(:mod:`agent.sdk.folders`, as for the step counter), created by the server with
``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600, so only the server's uid (and root) can open it.

====================  ====================================================================
bytes                 content
====================  ====================================================================
0 .. 127              ``HEADER_WORDS`` little-endian int64 words (table below)
128 .. 128+META-1     metadata: UTF-8 JSON object (the server's resource attributes), NUL padded
128+META ..           the ring: ``capacity`` bytes of records
====================  ====================================================================

=====  ===================  ======  ==============================================================
word   name                 writer  meaning
=====  ===================  ======  ==============================================================
0      magic                server  ``MAGIC`` (written last: readers ignore an incomplete file)
1      version              server  ``VERSION``
2      pid                  server  the server's pid
3      capacity             server  ring bytes (multiple of 8)
4      write_pos            server  bytes ever written (monotonic; offset = pos % capacity)
5      read_pos             agent   bytes ever released (committed once their spans are durable)
6      written              server  records written
7      dropped_full         server  spans dropped because the ring was full (agent too slow)
8      dropped_no_agent     server  spans dropped because no agent was attached (fallback "drop")
9      heartbeat_ns         agent   CLOCK_MONOTONIC of the agent's last poll; 0 = detached
10     agent_pid            agent   the consuming agent's pid
11     start_time_ns        server  creation time (wall clock)
12     dropped_too_large    server  spans larger than half the ring, dropped
13     fallback_spans       server  spans sent to the server's own OTel path (no agent attached)
14     meta_len             server  bytes of metadata JSON
15     reserved
=====  ===================  ======  ==============================================================

A record is an 8-byte header (``<II``: payload length, CRC-32 of the payload) followed by the
payload, padded to 8 bytes. A header whose length is ``WRAP`` means "continue at offset 0". The
writer never overwrites unread bytes: when the record does not fit it counts a drop and returns
(never blocks). The writer publishes ``write_pos`` after the bytes; the CRC lets the reader
reject a record it saw torn (counted ``corrupt``), so a bad record never becomes a bad span.

At-least-once: the agent reads with :meth:`RingReader.take` (its own cursor, ``read_pos``
unchanged) and moves ``read_pos`` with :meth:`RingReader.commit` only once the spans built from
those records are exported, spooled or counted. Until then the writer treats them as unread (it
never overwrites them), so an agent killed in between leaves them to the next agent, which
starts reading at ``read_pos``: a span exported just before the kill may be shipped twice, none
is lost. Records written in the ~``SERVEWATCH_SPAN_STALE_S`` after an agent died (its heartbeat
still fresh) wait in the ring the same way.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import RingError
from agent.sdk.folders import sdk_path, writer_path

__all__ = [
    "DEFAULT_CAPACITY",
    "HEADER_BYTES",
    "MAGIC",
    "META_BYTES",
    "VERSION",
    "RingBatch",
    "RingError",
    "RingReader",
    "RingStatistics",
    "RingWriter",
    "ring_path",
]

MAGIC = 0x3130_4E50_5357_5753  # b"SWSWPN01" little-endian
VERSION = 1
HEADER_WORDS = 16
HEADER_BYTES = HEADER_WORDS * 8
META_BYTES = 4096
#: Default ring size, bytes (a few thousand spans; the agent drains it several times a second).
DEFAULT_CAPACITY = 2 * 1024 * 1024
MIN_CAPACITY = 4096
#: Largest ring, bytes: the writer clamps to it, the agent refuses a bigger file (a ring claiming
#: hundreds of MiB is another user's way to make the agent allocate them).
MAX_CAPACITY = 64 * 1024 * 1024
WRAP = 0xFFFF_FFFF
(
    W_MAGIC,
    W_VERSION,
    W_PID,
    W_CAPACITY,
    W_WRITE,
    W_READ,
    W_WRITTEN,
    W_DROPPED_FULL,
    W_DROPPED_NO_AGENT,
    W_HEARTBEAT,
    W_AGENT_PID,
    W_START,
    W_DROPPED_TOO_LARGE,
    W_FALLBACK,
    W_META_LEN,
    _W_RESERVED,
) = range(HEADER_WORDS)
_HEADER = struct.Struct(f"<{HEADER_WORDS}q")
_REC = struct.Struct("<II")
_WORD = struct.Struct("<q")


def ring_path(pid: int, directory: Path | None = None) -> Path:
    """Path of the span ring of process ``pid`` (in its user's private folder, :func:`agent.sdk.folders.sdk_path`)."""
    return sdk_path(pid, f"servewatch-spans.{pid}", directory)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True, slots=True)
class RingStatistics:
    """Counters in a ring header (one snapshot)."""

    written: int
    dropped_full: int
    dropped_no_agent: int
    dropped_too_large: int
    fallback_spans: int
    unread_bytes: int
    capacity: int

    @property
    def dropped(self) -> int:
        """Spans the server dropped (full ring, too large, or no agent with fallback ``drop``)."""
        return self.dropped_full + self.dropped_no_agent + self.dropped_too_large

    def to_dict(self) -> dict[str, int]:
        return {
            "written": self.written,
            "dropped_full": self.dropped_full,
            "dropped_no_agent": self.dropped_no_agent,
            "dropped_too_large": self.dropped_too_large,
            "fallback_spans": self.fallback_spans,
            "unread_bytes": self.unread_bytes,
            "capacity": self.capacity,
        }


def _stats_from_words(words: Any) -> RingStatistics:
    cap = int(words[W_CAPACITY])
    return RingStatistics(
        written=int(words[W_WRITTEN]),
        dropped_full=int(words[W_DROPPED_FULL]),
        dropped_no_agent=int(words[W_DROPPED_NO_AGENT]),
        dropped_too_large=int(words[W_DROPPED_TOO_LARGE]),
        fallback_spans=int(words[W_FALLBACK]),
        unread_bytes=max(0, int(words[W_WRITE]) - int(words[W_READ])),
        capacity=cap,
    )


@dataclass(frozen=True, slots=True)
class RingBatch:
    """Records taken from a ring and not yet released (:meth:`RingReader.take`)."""

    #: the valid records' payloads, oldest first (torn ones are counted ``corrupt``, left out)
    payloads: list[bytes]
    #: ring position just past them: :meth:`RingReader.commit` of it releases their space
    end: int


class RingWriter:
    """The server's side: creates the ring file and appends records without ever blocking.

    Args:
        capacity: ring bytes (rounded up to 8; clamped to [4 KiB, 64 MiB]).
        metadata: JSON-ready mapping stored in the metadata area (truncated keys are dropped
            until it fits ``META_BYTES``).
        path: file path (default :func:`ring_path` of this pid).

    Raises:
        OSError: the file cannot be created (exists and is not ours, no space...).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *, metadata: Mapping[str, Any] | None = None, path: Path | None = None) -> None:
        self.pid = os.getpid()
        self.path = path or writer_path(f"servewatch-spans.{self.pid}")
        cap = _pad8(min(MAX_CAPACITY, max(MIN_CAPACITY, int(capacity))))
        meta = json.dumps(dict(metadata or {}), separators=(",", ":"), default=str).encode()
        if len(meta) > META_BYTES:
            meta = b"{}"
        size = HEADER_BYTES + META_BYTES + cap
        fd = _create_exclusive(self.path)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_quiet(self.path)
            raise
        os.close(fd)
        self._buf = memoryview(self._mmap)
        self.words = self._buf[:HEADER_BYTES].cast("q")
        self._data = self._buf[HEADER_BYTES + META_BYTES :]
        self.capacity = cap
        self._buf[HEADER_BYTES : HEADER_BYTES + len(meta)] = meta
        w = self.words
        w[W_VERSION] = VERSION
        w[W_PID] = self.pid
        w[W_CAPACITY] = cap
        w[W_START] = time.time_ns()
        w[W_META_LEN] = len(meta)
        w[W_MAGIC] = MAGIC  # last
        self._lock = threading.Lock()
        self._closed = False

    def attached(self, stale_ns: int) -> bool:
        """Whether an agent polled within ``stale_ns`` nanoseconds (a heartbeat is fresh)."""
        hb = self.words[W_HEARTBEAT]
        return hb != 0 and time.monotonic_ns() - hb < stale_ns

    def write(self, payload: bytes) -> bool:
        """Append one record; ``False`` (and a counted drop) when it does not fit. Never blocks
        on the agent: the only lock is this process's own, held for a memory copy."""
        n = len(payload)
        rec = 8 + _pad8(n)
        cap = self.capacity
        w = self.words
        if rec > cap // 2:
            with self._lock:
                w[W_DROPPED_TOO_LARGE] += 1
            return False
        crc = zlib.crc32(payload)
        with self._lock:
            if self._closed:
                return False
            pos = w[W_WRITE]
            used = pos - w[W_READ]
            off = pos % cap
            tail = cap - off
            need = rec if rec <= tail else tail + rec
            if used < 0 or used + need > cap:
                w[W_DROPPED_FULL] += 1
                return False
            data = self._data
            if rec > tail:
                _REC.pack_into(data, off, WRAP, 0)
                pos += tail
                off = 0
            _REC.pack_into(data, off, n, crc)
            data[off + 8 : off + 8 + n] = payload
            w[W_WRITTEN] += 1
            w[W_WRITE] = pos + rec  # publish after the bytes
        return True

    def unread_records(self) -> int:
        """Records written and not yet released by an agent (taken, maybe, but not committed)."""
        cap = self.capacity
        with self._lock:
            if self._closed:
                return 0
            w = self.words
            pos, end = w[W_READ], w[W_WRITE]
            if pos > end or end - pos > cap:
                return 0
            data = self._data
            n = 0
            while end - pos >= 8:
                off = pos % cap
                length = _REC.unpack_from(data, off)[0]
                if length == WRAP:
                    pos += cap - off
                    continue
                pos += 8 + _pad8(length)
                n += 1
            return n

    def count(self, word: int, n: int = 1) -> None:
        """Add ``n`` to a server-side counter word (``W_DROPPED_NO_AGENT``, ``W_FALLBACK``)."""
        with self._lock:
            if not self._closed:
                self.words[word] += n

    def statistics(self) -> RingStatistics:
        with self._lock:
            if self._closed:
                return RingStatistics(0, 0, 0, 0, 0, 0, self.capacity)
            return _stats_from_words(self.words)

    def close(self, *, unlink: bool = True) -> None:
        """Unmap and (by default) remove the file; safe twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.words.release()
            self._data.release()
            self._buf.release()
            self._mmap.close()
        if unlink:
            _unlink_quiet(self.path)


def _create_exclusive(path: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        # A previous process with our pid left it (pid reuse), or someone planted a name. Only
        # a file we own is removed (sticky /dev/shm refuses the rest), then created afresh.
        st = os.lstat(path)
        if st.st_uid != os.geteuid():
            raise RingError(f"{path} exists and belongs to uid {st.st_uid}") from None
        os.unlink(path)
        return os.open(path, flags, 0o600)


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _overruns(rec: int, off: int, i: int, span: int, cap: int) -> bool:
    """Whether a record of ``rec`` bytes at ring offset ``off`` (``i`` into a ``span``) cannot be one."""
    return rec > cap - off or i + rec > span or rec > cap // 2


class RingReader:
    """The agent's side of one server's ring. Reads with ``pread`` and writes only ``read_pos``,
    the heartbeat and its pid with ``pwrite``; every size and position read from the file is
    checked, so a misbehaving writer costs counted ``corrupt`` records, never a crash.

    Args:
        pid: the server's pid (the header must say the same).
        trusted_uids: file owners accepted (the target's uid and root); ``None`` accepts the
            target uid check being done by the caller (tests).
        directory: the base folder of the SDK's files (default :func:`agent.sdk.folders.shm_dir`).
        max_capacity: largest ring accepted, bytes (default and at most :data:`MAX_CAPACITY`).

    Raises:
        RingError: no such ring, not a regular file, a symlink, an untrusted owner, group/other
            access, larger than ``max_capacity``, or not a valid ring of ``pid``.
    """

    def __init__(
        self,
        pid: int,
        *,
        trusted_uids: set[int] | frozenset[int] | None = None,
        directory: Path | None = None,
        max_capacity: int = MAX_CAPACITY,
    ) -> None:
        self.pid = pid
        self.path = ring_path(pid, directory)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags)
        except (FileNotFoundError, NotADirectoryError):  # NotADirectory: its user's folder name was taken
            raise RingError(f"no span ring at {self.path}") from None
        except OSError as exc:  # ELOOP: a symlink; EACCES: not ours
            raise RingError(f"cannot open {self.path}: {exc.strerror or exc}") from None
        try:
            st, words = self._check(fd, pid, trusted_uids, max_capacity)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._fd_lock = threading.Lock()
        self.capacity = words[W_CAPACITY]
        self.uid = st.st_uid
        self.corrupt = 0
        self._cursor: int | None = None  # end of the last take (None: start at read_pos)
        self.metadata = self._metadata(min(max(0, words[W_META_LEN]), META_BYTES))

    def _check(
        self, fd: int, pid: int, trusted_uids: set[int] | frozenset[int] | None, max_capacity: int,
    ) -> tuple[os.stat_result, tuple[int, ...]]:
        """The opened file's stat and header words, once both say it is ``pid``'s ring as
        :class:`RingReader` requires (else :class:`RingError`)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RingError(f"{self.path} is not a regular file")
        if trusted_uids is not None and st.st_uid not in trusted_uids:
            raise RingError(f"{self.path} belongs to uid {st.st_uid}, not the target's")
        if st.st_mode & 0o077:
            raise RingError(f"{self.path} is accessible to group/others (mode {stat.S_IMODE(st.st_mode):o})")
        if st.st_nlink != 1:
            raise RingError(f"{self.path} has {st.st_nlink} links")
        words = self._header(fd)
        if words is None or words[W_MAGIC] != MAGIC or words[W_VERSION] != VERSION:
            raise RingError(f"{self.path} is not a span ring (yet)")
        if words[W_PID] != pid:
            raise RingError(f"{self.path} says pid {words[W_PID]}, not {pid}")
        cap = words[W_CAPACITY]
        limit = min(max_capacity, MAX_CAPACITY)
        if cap > limit:
            raise RingError(f"{self.path} claims a {cap / 2**20:.0f} MiB ring, more than the agent accepts ({limit / 2**20:.0f} MiB)")
        if cap < MIN_CAPACITY or cap % 8 or st.st_size != HEADER_BYTES + META_BYTES + cap:
            raise RingError(f"{self.path} has a bad size")
        return st, words

    @staticmethod
    def _header(fd: int) -> tuple[int, ...] | None:
        raw = os.pread(fd, HEADER_BYTES, 0)
        return _HEADER.unpack(raw) if len(raw) == HEADER_BYTES else None

    def _metadata(self, length: int) -> dict[str, Any]:
        try:
            meta = json.loads(os.pread(self.fd, length, HEADER_BYTES).decode())
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def heartbeat(self, *, detach: bool = False) -> None:
        """Tell the server an agent is attached (or, ``detach``, that it left). Safe from another
        thread than the reader's: never writes through a descriptor :meth:`close` released."""
        with self._fd_lock:
            if self.fd < 0:
                return
            os.pwrite(self.fd, _WORD.pack(os.getpid()), W_AGENT_PID * 8)
            os.pwrite(self.fd, _WORD.pack(0 if detach else time.monotonic_ns()), W_HEARTBEAT * 8)

    def claimed_by_other(self, stale_ns: int) -> int:
        """The pid of another live agent consuming this ring, else 0."""
        words = self._header(self.fd)
        if words is None:
            return 0
        other, hb = words[W_AGENT_PID], words[W_HEARTBEAT]
        if other in (0, os.getpid()) or hb == 0 or time.monotonic_ns() - hb >= stale_ns:
            return 0
        try:
            os.kill(other, 0)
        except ProcessLookupError:
            return 0
        except PermissionError:
            pass
        return other

    def statistics(self) -> RingStatistics | None:
        words = self._header(self.fd)
        return None if words is None else _stats_from_words(words)

    def read(self, max_records: int = 4096, max_bytes: int = 8 * 1024 * 1024) -> list[bytes]:
        """Take up to ``max_records`` records (their payloads) and release their space at once
        (:meth:`take` then :meth:`commit`; a reader that must not lose them takes and commits
        later)."""
        batch = self.take(max_records, max_bytes)
        self.commit(batch.end)
        return batch.payloads

    def take(self, max_records: int = 4096, max_bytes: int = 8 * 1024 * 1024) -> RingBatch:
        """Read up to ``max_records`` records (or ``max_bytes`` of payload) past this reader's
        cursor WITHOUT releasing their space: the server cannot overwrite them until
        :meth:`commit` moves ``read_pos`` past them. A reader that dies before committing leaves
        them to the next one (which re-reads from ``read_pos``: at-least-once). The first take
        starts at ``read_pos``; each next one where the previous ended.

        Memory is bounded whatever the file claims: one take reads at most ``max_bytes`` (plus
        one record header) of the ring, or one record when the first one is larger (at most half
        the ring, itself at most ``max_capacity``); the rest waits for the next take.

        Returns:
            The valid payloads and the ring position just past them (``end``, to commit).
        """
        words = self._header(self.fd)
        if words is None:
            self.corrupt += 1
            return RingBatch([], self._cursor if self._cursor is not None else 0)
        cap = self.capacity
        w, committed = words[W_WRITE], words[W_READ]
        cursor = self._cursor
        # start where the last take ended, unless read_pos moved past it (or we are new)
        r = committed if cursor is None or not committed <= cursor <= w else cursor
        if w == r:
            self._cursor = r
            return RingBatch([], r)
        if r > w or w - r > cap:  # a writer that lies about its positions: skip all of it
            self.corrupt += 1
            self._cursor = w
            return RingBatch([], w)
        span = w - r
        chunk = self._read_at(r, min(span, max(8, max_bytes) + 8))
        if chunk is None:
            self.corrupt += 1
            self._cursor = w
            return RingBatch([], w)
        out, i = self._records(chunk, r, span, max_records, max_bytes)
        end = r + min(i, span)
        self._cursor = end
        return RingBatch(out, end)

    def _records(self, chunk: bytes, r: int, span: int, max_records: int, max_bytes: int) -> tuple[list[bytes], int]:
        """The valid payloads in ``chunk`` (read at ring position ``r``, ``span`` bytes written
        past it) and how far into the span they go (``span``: the rest is skipped as corrupt)."""
        cap = self.capacity
        out: list[bytes] = []
        i = 0
        taken = 0
        while i < span and len(out) < max_records and taken < max_bytes:
            off = (r + i) % cap
            if span - i < 8 or cap - off < 8:
                self.corrupt += 1
                i = span
                break
            if len(chunk) - i < 8:
                break  # past this take's window: the next take goes on here
            length, crc = _REC.unpack_from(chunk, i)
            if length == WRAP:
                i += cap - off
                continue
            rec = 8 + _pad8(length)
            if _overruns(rec, off, i, span, cap):
                self.corrupt += 1
                i = span
                break
            if i + rec > len(chunk):
                if out or i:
                    break  # the next take reads it
                record = self._read_at(r + i, rec)  # one record larger than the window
                if record is None:
                    self.corrupt += 1
                    i = span
                    break
                chunk, i = record, 0
            payload = chunk[i + 8 : i + 8 + length]
            i += rec
            if zlib.crc32(payload) != crc:
                self.corrupt += 1
                continue
            out.append(payload)
            taken += length
        return out, i

    def _read_at(self, pos: int, n: int) -> bytes | None:
        """``n`` bytes of the ring from position ``pos`` (two preads across the end); ``None``
        when the file is shorter than its header says."""
        cap = self.capacity
        off = pos % cap
        base = HEADER_BYTES + META_BYTES
        if off + n <= cap:
            data = os.pread(self.fd, n, base + off)
        else:
            first = os.pread(self.fd, cap - off, base + off)
            data = first + os.pread(self.fd, n - len(first), base)
        return data if len(data) == n else None

    def commit(self, pos: int) -> None:
        """Release the ring space before position ``pos`` (an ``end`` of :meth:`take`) to the
        server; a position at or behind ``read_pos`` is ignored (commits only move forward)."""
        words = self._header(self.fd)
        if words is not None and pos > words[W_READ]:
            os.pwrite(self.fd, _WORD.pack(pos), W_READ * 8)

    @property
    def cursor(self) -> int | None:
        """Ring position where the next :meth:`take` starts (``None``: at ``read_pos``)."""
        return self._cursor

    def rewind(self, pos: int | None = None) -> None:
        """Move the cursor back to ``pos`` (a :attr:`cursor` or ``end`` seen before; ``None``:
        to ``read_pos``): the next :meth:`take` reads those records again."""
        self._cursor = pos

    def close(self, *, detach: bool = True) -> None:
        """Tell the server this agent left (it falls back at once) and close the file; safe twice."""
        with self._fd_lock:
            fd, self.fd = self.fd, -1
            if fd < 0:
                return
            if detach:
                try:
                    os.pwrite(fd, _WORD.pack(0), W_HEARTBEAT * 8)
                except OSError:
                    pass
            os.close(fd)
