"""The local spool: batches the collector did not take, kept on disk until it does.

Owns :class:`Spool`. One failed batch is one file ``<seq:016d>-<spans>.binpb`` holding one
binary protobuf ``ExportTraceServiceRequest``: exactly the bytes that failed to go out, cheap to
write at a shutdown deadline (~1 us per span, where OTLP/JSON costs ~60 us to write and ~130 us
to parse per span here). ``servewatch export`` reads these as well as OTLP/JSON lines.
File-name order is write order; replay takes the head, and only removes it once it is delivered,
so every span leaves exactly once with its original ids and times. The spool is capped in bytes:
the OLDEST files are evicted first and their spans counted. Batches the collector refused
permanently go to ``rejected/`` (kept, counted, never retried automatically; capped at
``max_bytes`` of its own, oldest evicted and counted).

A spool directory is owned by one process at a time (``flock`` on ``.lock``); a second agent on
the same data dir gets ``<directory>/pid-<pid>/`` instead.

Imports :mod:`exporters.otlp_json` and opentelemetry-proto only.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agent.fsutil import atomic_write_bytes, ensure_private_dir
from exporters.otlp_json import read_span_file

__all__ = ["Spool", "SpoolEntry", "SpoolStatistics"]

_log = logging.getLogger(__name__)


class SpoolEntry(NamedTuple):
    """One spooled batch."""

    #: write order, unique within the spool directory
    seq: int
    #: the file holding it
    path: Path
    #: spans in the batch
    spans: int
    #: file size
    size_bytes: int


class SpoolStatistics(NamedTuple):
    """Spool counters since it was opened (``files``/``spans``/``size_bytes`` are current)."""

    #: batch files waiting for replay now
    files: int
    #: spans waiting for replay now
    spans: int
    #: bytes on disk now
    size_bytes: int
    #: spans written to the spool since open
    written_spans: int
    #: spans removed after delivery since open
    delivered_spans: int
    #: spans deleted unsent because the spool hit ``max_bytes`` (oldest first)
    evicted_spans: int
    #: spans moved to ``rejected/`` (the collector refused them permanently)
    rejected_spans: int
    #: spans found on disk from an earlier run when opened
    recovered_spans: int


#: Suffix of a spooled batch.
SUFFIX = ".binpb"


def _parse_name(path: Path) -> tuple[int, int] | None:
    stem = path.name.removesuffix(SUFFIX)
    seq, _, spans = stem.partition("-")
    if not (seq.isdigit() and spans.isdigit()) or not path.name.endswith(SUFFIX):
        return None
    return int(seq), int(spans)


class Spool:
    """Size-capped FIFO of failed export batches on disk. Thread-safe.

    Args:
        directory: the spool folder (created); batches left there by an earlier run are recovered
            and replayed first.
        max_bytes: cap on the bytes the spool holds; the oldest batches are evicted to stay under it.
    """

    def __init__(self, directory: Path, *, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"spool max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.directory = self._claim(Path(directory))
        self._lock = threading.Lock()
        self._entries: deque[SpoolEntry] = deque()
        self._size_bytes = 0
        self._spans = 0
        self._written = 0
        self._delivered = 0
        self._evicted = 0
        self._rejected = 0
        self._rejected_entries: deque[SpoolEntry] | None = None  # loaded on first use
        self._rejected_bytes = 0
        found = []
        for path in self.directory.glob("*" + SUFFIX):
            parsed = _parse_name(path)
            if parsed is not None:
                found.append(SpoolEntry(parsed[0], path, parsed[1], path.stat().st_size))
        for entry in sorted(found):
            self._entries.append(entry)
            self._size_bytes += entry.size_bytes
            self._spans += entry.spans
        self._recovered = self._spans
        self._next_seq = (self._entries[-1].seq + 1) if self._entries else 1

    def _claim(self, directory: Path) -> Path:
        ensure_private_dir(directory)
        for candidate in (directory, directory / f"pid-{os.getpid()}"):
            ensure_private_dir(candidate)
            fd = os.open(candidate / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd = fd
            return candidate
        raise OSError(f"spool {directory} is locked by another process")

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pending_spans(self) -> int:
        """Spans waiting for replay."""
        return self._spans

    def append(self, request: ExportTraceServiceRequest, spans: int) -> int:
        """Write one batch at the tail, evicting the oldest batches past ``max_bytes``.

        Args:
            request: the encoded batch.
            spans: spans in it.

        Returns:
            Spans evicted to make room (the new batch itself when it alone exceeds the cap).

        Raises:
            OSError: the write failed; the batch is not in the spool.
        """
        data = request.SerializeToString()
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if len(data) > self.max_bytes:
                self._evicted += spans
                return spans
            path = self.directory / f"{seq:016d}-{spans}{SUFFIX}"
            atomic_write_bytes(path, data)  # temp + fsync + rename, 0600, no symlink followed
            self._entries.append(SpoolEntry(seq, path, spans, len(data)))
            self._size_bytes += len(data)
            self._spans += spans
            self._written += spans
            evicted = 0
            while self._size_bytes > self.max_bytes and len(self._entries) > 1:
                old = self._entries.popleft()
                self._forget(old)
                self._unlink(old.path)
                evicted += old.spans
            self._evicted += evicted
            return evicted

    def _forget(self, entry: SpoolEntry) -> None:
        self._size_bytes -= entry.size_bytes
        self._spans -= entry.spans

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    def head(self) -> SpoolEntry | None:
        """The oldest batch, or ``None`` when the spool is empty."""
        with self._lock:
            return self._entries[0] if self._entries else None

    def load(self, entry: SpoolEntry) -> ExportTraceServiceRequest | None:
        """Read a spooled batch back; ``None`` (and the file dropped from the spool, moved to
        ``rejected/``) when it is unreadable."""
        try:
            requests = list(read_span_file(entry.path))
        except (OSError, ValueError) as exc:
            _log.warning("unreadable spool file %s (%s); moved to rejected/", entry.path, exc)
            self.reject(entry)
            return None
        if len(requests) == 1:
            return requests[0]
        merged = ExportTraceServiceRequest()
        for request in requests:
            merged.resource_spans.extend(request.resource_spans)
        return merged

    def remove(self, entry: SpoolEntry) -> bool:
        """Drop a delivered batch. Returns ``False`` when it was already evicted."""
        with self._lock:
            if not self._entries or self._entries[0].seq != entry.seq:
                if entry not in self._entries:
                    return False
                self._entries.remove(entry)
            else:
                self._entries.popleft()
            self._forget(entry)
            self._delivered += entry.spans
        self._unlink(entry.path)
        return True

    def reject(self, entry: SpoolEntry) -> None:
        """Move a batch the collector refused permanently to ``rejected/``."""
        with self._lock:
            if entry not in self._entries:
                return
            self._entries.remove(entry)
            self._forget(entry)
            self._rejected += entry.spans
        target = self._rejected_dir() / entry.path.name
        try:
            os.replace(entry.path, target)
        except FileNotFoundError:
            return
        self._keep_rejected(SpoolEntry(entry.seq, target, entry.spans, entry.size_bytes))

    def add_rejected(self, request: ExportTraceServiceRequest, spans: int) -> None:
        """Keep a fresh batch the collector refused permanently in ``rejected/`` (never replayed
        automatically; ``servewatch export`` can send it once the cause is fixed).

        Raises:
            OSError: the write failed.
        """
        data = request.SerializeToString()
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._rejected += spans
        path = self._rejected_dir() / f"{seq:016d}-{spans}{SUFFIX}"
        atomic_write_bytes(path, data)
        self._keep_rejected(SpoolEntry(seq, path, spans, len(data)))

    def _rejected_dir(self) -> Path:
        return ensure_private_dir(self.directory / "rejected")

    def _keep_rejected(self, entry: SpoolEntry) -> None:
        """``rejected/`` has its own ``max_bytes`` budget (a wrong endpoint path refuses
        everything); past it the oldest rejected files are deleted and counted as evicted."""
        with self._lock:
            if self._rejected_entries is None:
                self._rejected_entries = deque()
                self._rejected_bytes = 0
                for path in sorted(self._rejected_dir().glob("*" + SUFFIX)):
                    parsed = _parse_name(path)
                    if parsed is not None and path != entry.path:
                        size = path.stat().st_size
                        self._rejected_entries.append(SpoolEntry(parsed[0], path, parsed[1], size))
                        self._rejected_bytes += size
            self._rejected_entries.append(entry)
            self._rejected_bytes += entry.size_bytes
            while self._rejected_bytes > self.max_bytes and self._rejected_entries:
                old = self._rejected_entries.popleft()
                self._rejected_bytes -= old.size_bytes
                self._evicted += old.spans
                self._unlink(old.path)

    def statistics(self) -> SpoolStatistics:
        with self._lock:
            return SpoolStatistics(
                files=len(self._entries),
                spans=self._spans,
                size_bytes=self._size_bytes,
                written_spans=self._written,
                delivered_spans=self._delivered,
                evicted_spans=self._evicted,
                rejected_spans=self._rejected,
                recovered_spans=self._recovered,
            )

    def close(self) -> None:
        """Release the directory lock; files stay for the next run. Safe twice."""
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            self._lock_fd = None
            os.close(fd)
