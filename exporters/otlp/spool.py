"""The local spool: batches the collector did not take, kept on disk until it does.

Owns :class:`Spool`. One failed batch is one file ``<seq:016d>-<spans>.binpb`` holding one
binary protobuf ``ExportTraceServiceRequest``: exactly the bytes that failed to go out, cheap to
write at a shutdown deadline (~1 us per span, where OTLP/JSON costs ~60 us to write and ~130 us
to parse per span here). ``servewatch export`` reads these as well as OTLP/JSON lines.
File-name order is write order; replay takes the head, and only removes it once it is delivered,
so every span leaves exactly once with its original ids and times. The spool is capped in bytes:
the OLDEST files are evicted first and their spans counted. Batches the collector refused
permanently go to ``rejected/`` (kept, counted, never retried automatically; capped at
``max_bytes`` of its own counted in blocks allocated on disk, ``st_blocks * 512``, and at
``max_rejected_files`` files: a 6-byte batch takes a 4 KiB block, so 100,000 of them held
406 MB while a byte cap counted 600 KB). Past either cap the oldest rejected files are deleted,
their spans counted (``evicted_spans``, ``rejected_evicted_spans``) and said in one warning line
(at most once a minute): ``spool rejected/ over its cap (10000 files, 268435456 bytes on disk):
deleted the 90000 oldest rejected batch file(s) (90000 spans, 368640000 bytes on disk)``. The cap
holds at open too, for what an earlier run left there.

A spool directory is owned by one process at a time (``flock`` on ``.lock``); a second agent on
the same data dir gets ``<directory>/pid-<pid>/`` instead. Such a folder left behind by a process
that is gone (a ``dump`` that ran during a ``run``, a crashed agent, a server's SDK shipper) is
*stranded*: :meth:`Spool.adopt_stranded` (at open, and periodically from the processor) takes the
lock of every ``pid-*`` sibling nobody holds, moves its batches to our tail and removes it.

Files are written with :func:`agent.host.fsutil.atomic_write_bytes` (temp + fsync + rename, 0600,
never through a symlink), so a batch on disk is complete or absent whatever kills the writer:
the processor's write-ahead of finished actions' spans relies on it. A batch refused as too large
is split in place (:meth:`Spool.split`): its pieces ``<seq>.<part>-<spans>.binpb`` keep its place.

The same class is servewatch's metrics spool (``suffix=".metrics.binpb"``, capped in files too:
:class:`exporters.otlp.metrics_export.SpoolingMetricExporter`, under the span spool's folder as
``metrics/``); a stranded folder's ``metrics/`` files move over as ``adopted-pid-<pid>-<name>`` and
join the metrics spool's tail at its next :meth:`Spool.adopt_stranded` (each export).

Imports :mod:`agent.host.fsutil`, :mod:`exporters.otlp.otlp_json` and opentelemetry-proto only.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

from google.protobuf.message import Message
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agent.host.fsutil import (
    atomic_write_bytes,
    ensure_private_dir,
    open_append_nofollow,
    remove_stale_temps,
)
from agent.model.datadir import METRICS_SPOOL_DIR, SPOOL_DIR
from exporters.otlp.otlp_json import read_span_file

__all__ = ["REJECTED_MAX_FILES", "DeliveredKeys", "Spool", "SpoolEntry", "SpoolStatistics", "disk_bytes", "durable_keys", "spool_root_of"]

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
    #: piece number after a split (0: never split)
    part: int = 0
    #: the write-ahead group it holds (the span id of its main span, 16 hex digits; ``""`` for an
    #: ordinary batch): :func:`durable_keys` reads it from the name
    key: str = ""


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
    #: spans taken over from stranded spool folders of processes that are gone
    adopted_spans: int = 0
    #: files in ``rejected/`` now (``-1``: not looked at yet)
    rejected_files: int = -1
    #: bytes ``rejected/``'s files take on disk now (allocated blocks; ``-1``: not looked at yet)
    rejected_disk_bytes: int = -1
    #: rejected files deleted past ``rejected/``'s caps since open (their spans are in both
    #: ``evicted_spans`` and ``rejected_evicted_spans``)
    rejected_evicted_files: int = 0
    #: spans of those files
    rejected_evicted_spans: int = 0


#: Suffix of a spooled batch.
SUFFIX = ".binpb"
#: Most files kept in ``rejected/`` by default (each takes at least one block on disk), files.
REJECTED_MAX_FILES = 10_000
#: Least time between two warnings that rejected files were deleted past the caps, seconds.
_SAY_EVICTED_EVERY_S = 60.0


def disk_bytes(st: os.stat_result) -> int:
    """Bytes a file takes on disk, from its ``stat``: its allocated blocks (``st_blocks * 512``),
    at least its size (a sparse file counts what it says it holds)."""
    return max(st.st_size, getattr(st, "st_blocks", 0) * 512)


def _is_key(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def _parse_name(path: Path, suffix: str = SUFFIX) -> tuple[int, int, int, str] | None:
    """(seq, spans, part, key) from ``<seq>[.<part>]-<spans>[-<key>]<suffix>``; ``None`` for other
    names (a span spool's ``.binpb`` is never a metrics spool's ``.metrics.binpb``)."""
    if not path.name.endswith(suffix) or path.name.startswith("."):
        return None
    stem = path.name.removesuffix(suffix)
    if "." in stem.partition("-")[2]:  # another kind's suffix: <seq>-<n>.metrics.binpb
        return None
    head, _, rest = stem.partition("-")
    spans, _, key = rest.partition("-")
    seq, _, part = head.partition(".")
    if not (seq.isdigit() and spans.isdigit() and (part.isdigit() or not part) and (not key or _is_key(key))):
        return None
    return int(seq), int(spans), int(part or 0), key


def _entry_name(seq: int, spans: int, part: int = 0, key: str = "", suffix: str = SUFFIX) -> str:
    tail = f"-{key}" if key else ""
    return f"{seq:016d}.{part:06d}-{spans}{tail}{suffix}" if part else f"{seq:016d}-{spans}{tail}{suffix}"


#: Name prefix of a stranded folder's sub-spool file moved here (``adopted-pid-<pid>-<name>``).
ADOPTED_PREFIX = "adopted-"

#: File of the delivered-keys ledger, in the spool's root folder.
DELIVERED_KEYS_NAME = "delivered-keys"
#: A delivered key older than this is dropped when the ledger is compacted, seconds (30 days: a
#: bundle is checked at the next agent start after its incident).
DELIVERED_KEYS_MAX_AGE_S = 30 * 24 * 3600.0
#: The ledger is compacted at spool open once it is bigger than this, bytes.
DELIVERED_KEYS_COMPACT_BYTES = 1 << 20


class DeliveredKeys:
    """The keys of written-ahead span groups the collector acknowledged (``<spool root>/delivered-keys``).

    A group written ahead (an incident action's spans, an incident root) is durable while its
    spool file exists (the key is in the name) and, after it was delivered, because its key is
    here: the key is appended and fsynced *before* the file is removed, so a kill between the
    two leaves both, and the next sender skips the file instead of sending it twice. Lines are
    ``<key> <unix seconds>``; appends are ``O_APPEND`` (agents and ``servewatch export`` share it).

    Args:
        root: the spool's root folder (``<data_dir>/<host>/spool``).
    """

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / DELIVERED_KEYS_NAME

    def add(self, keys: list[str] | tuple[str, ...]) -> None:
        """Record ``keys`` as delivered, on disk (fsynced) before this returns.

        Raises:
            OSError: the write failed (the caller keeps the file: a duplicate later, never a loss).
        """
        if not keys:
            return
        stamp = int(time.time())
        data = "".join(f"{key} {stamp}\n" for key in keys).encode("ascii")
        fd = open_append_nofollow(self.path)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self) -> set[str]:
        """Every key recorded (an unreadable ledger reads as empty, logged)."""
        try:
            with open(self.path, "rb") as fh:
                text = fh.read().decode("ascii", "replace")
        except FileNotFoundError:
            return set()
        except OSError as exc:
            _log.warning("delivered-keys ledger %s unreadable: %s", self.path, exc)
            return set()
        return {line.split(" ", 1)[0] for line in text.splitlines() if _is_key(line.split(" ", 1)[0])}

    def compact(self, *, max_age_s: float = DELIVERED_KEYS_MAX_AGE_S) -> None:
        """Drop keys older than ``max_age_s`` when the ledger is over
        :data:`DELIVERED_KEYS_COMPACT_BYTES` (atomic rewrite). Never raises."""
        try:
            if self.path.stat().st_size <= DELIVERED_KEYS_COMPACT_BYTES:
                return
        except FileNotFoundError:  # nothing delivered yet
            return
        except OSError as exc:
            _log.warning("could not compact %s: %s", self.path, exc)
            return
        try:
            cutoff = time.time() - max_age_s
            kept = []
            for line in self.path.read_text(encoding="ascii", errors="replace").splitlines():
                key, _, stamp = line.partition(" ")
                if _is_key(key) and stamp.isdigit() and int(stamp) >= cutoff:
                    kept.append(line + "\n")
            atomic_write_bytes(self.path, "".join(kept).encode("ascii"))
        except OSError as exc:
            _log.warning("could not compact %s: %s", self.path, exc)


def spool_root_of(path: Path) -> Path | None:
    """The spool root folder a spool file lies in (``.../<host>/spool``, also for files under
    ``pid-*/`` and ``rejected/``), or ``None`` when it is not in a spool."""
    for folder in Path(path).parents:
        if folder.name == SPOOL_DIR:
            return folder
    return None


def durable_keys(root: Path, keys: set[str]) -> set[str]:
    """Which of ``keys`` (write-ahead group keys) are durable under the spool ``root``: in a
    spool file (the root, a ``pid-*`` folder of another agent, or a ``rejected/`` folder) or
    recorded as delivered. Reads file names only (and the delivered-keys ledger)."""
    if not keys:
        return set()
    found: set[str] = set()
    folders = [root, root / "rejected"]
    try:
        folders += [p for p in root.glob("pid-*") if p.is_dir() and not p.is_symlink()]
        folders += [p / "rejected" for p in list(folders[2:])]
    except OSError:
        pass
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            parsed = _parse_name(folder / name)
            if parsed is not None and parsed[3] in keys:
                found.add(parsed[3])
    if found != keys:
        found |= keys & DeliveredKeys(root).load()
    return found


def _try_lock(folder: Path) -> int | None:
    """An flock'ed fd on ``folder/.lock`` when no live process holds it, else ``None``."""
    try:
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class Spool:
    """Size-capped FIFO of failed export batches on disk, the one persistent queue of traces and
    metrics (:class:`exporters.otlp.metrics_export.SpoolingMetricExporter`). Thread-safe.

    Args:
        directory: the spool folder (created); batches left there by an earlier run are recovered
            and replayed first.
        max_bytes: cap on the bytes the spool holds; the oldest batches are evicted to stay under it.
        suffix: the batches' file suffix (``.binpb``: trace requests; ``.metrics.binpb``: metrics).
        max_entries: cap on the batches it holds too (``None``: bytes only), the oldest evicted.
        max_rejected_files: cap on the files ``rejected/`` holds; its bytes are capped at
            ``max_bytes`` counted in blocks allocated on disk. Past either, the oldest go.

    A batch counts ``spans`` (the items in it: spans, or a metrics batch's data points).

    Raises:
        ValueError: ``max_bytes`` or ``max_rejected_files`` is not positive.
        OSError: the folder cannot be created or is locked by another process.
    """

    def __init__(self, directory: Path, *, max_bytes: int, suffix: str = SUFFIX, max_entries: int | None = None,
                 max_rejected_files: int = REJECTED_MAX_FILES) -> None:
        self._lock_fd: int | None = None
        if max_bytes <= 0:
            raise ValueError(f"spool max_bytes must be > 0, got {max_bytes}")
        if max_rejected_files <= 0:
            raise ValueError(f"spool max_rejected_files must be > 0, got {max_rejected_files}")
        self.max_bytes = max_bytes
        self.max_rejected_files = max_rejected_files
        self.suffix = suffix
        self.max_entries = max_entries
        self.directory = self._claim(Path(directory))
        self._lock = threading.Lock()
        self._entries: deque[SpoolEntry] = deque()
        self._size_bytes = 0
        self._spans = 0
        self._written = 0
        self._delivered = 0
        self._evicted = 0
        self._rejected = 0
        self._rejected_entries: deque[SpoolEntry] | None = None  # loaded at open when the folder exists, else on first use
        self._rejected_bytes = 0  # on disk (allocated blocks)
        self._rejected_evicted = (0, 0)  # (files, spans) deleted past rejected/'s caps since open
        self._unsaid = (0, 0, 0)  # (files, spans, bytes on disk) deleted and not said yet
        self._said_at = -_SAY_EVICTED_EVERY_S
        self._adopted = 0
        self._next_part = 1
        remove_stale_temps(self.directory, recursive=False)
        found = []
        for path in self.directory.glob("*" + self.suffix):
            parsed = _parse_name(path, self.suffix)
            if parsed is not None:
                found.append(SpoolEntry(parsed[0], path, parsed[1], path.stat().st_size, parsed[2], parsed[3]))
        for entry in sorted(found, key=lambda e: (e.seq, e.part)):
            self._entries.append(entry)
            self._size_bytes += entry.size_bytes
            self._spans += entry.spans
            self._next_part = max(self._next_part, entry.part + 1)
        self._recovered = self._spans
        self._next_seq = max((e.seq for e in self._entries), default=0) + 1
        #: keys of delivered write-ahead groups (shared by every spool folder of this root)
        self.ledger = DeliveredKeys(self._root)
        self._delivered_keys: set[str] | None = None
        if self.directory == self._root:
            self.ledger.compact()
        self.adopt_stranded()
        if (self.directory / "rejected").is_dir():  # an earlier run's rejected files are capped now, not at the next refusal
            remove_stale_temps(self.directory / "rejected", recursive=False)
            with self._lock:
                self._load_rejected()
                self._trim_rejected()
            self._say_evicted()

    def _claim(self, directory: Path) -> Path:
        ensure_private_dir(directory)
        self._root = directory
        for candidate in (directory, directory / f"pid-{os.getpid()}"):
            ensure_private_dir(candidate)
            fd = _try_lock(candidate)
            if fd is None:
                continue
            self._lock_fd = fd
            return candidate
        raise OSError(f"spool {directory} is locked by another process")

    def adopt_stranded(self) -> int:
        """Take over the batches of ``pid-*`` spool folders whose owner is gone.

        A folder whose ``.lock`` no live process holds is stranded: its batches (and its
        ``rejected/`` and ``metrics/`` files, as ``adopted-<folder>-<name>``) move to this
        spool's tail with new sequence numbers, and the folder is removed. Folders of live
        processes are left alone. Files named ``adopted-pid-*`` in this spool's own folder (the
        metrics spool under a span spool that adopted) join its tail here too.

        Returns:
            Spans adopted.
        """
        adopted = self._take_adopted()
        try:
            candidates = sorted(p for p in self._root.glob("pid-*") if p.is_dir() and not p.is_symlink() and p != self.directory)
        except OSError:
            return 0
        for folder in candidates:
            fd = _try_lock(folder)
            if fd is None:
                continue
            try:
                adopted += self._adopt_folder(folder)
            except OSError as exc:
                _log.warning("could not adopt stranded spool %s: %s", folder, exc)
            finally:
                try:
                    (folder / ".lock").unlink()
                except OSError:
                    pass
                os.close(fd)
                try:
                    folder.rmdir()
                except OSError:
                    pass
        if adopted:
            _log.info("adopted %d spans from stranded spool folders under %s", adopted, self._root)
        return adopted

    def _adopt_folder(self, folder: Path) -> int:
        found = []
        for path in folder.glob("*" + self.suffix):
            parsed = _parse_name(path, self.suffix)
            if parsed is not None:
                found.append((parsed[0], parsed[2], path, parsed[1], parsed[3]))
        spans_total = self._take(found)
        for sub in ("rejected", METRICS_SPOOL_DIR):
            src = folder / sub
            if src.is_dir() and not src.is_symlink():
                dest = ensure_private_dir(self.directory / sub)
                for path in sorted(src.iterdir()):
                    if path.name.startswith("."):  # the sub-spool's lock, a killed writer's temp file
                        path.unlink(missing_ok=True)
                    elif path.is_file() and not path.is_symlink():
                        os.replace(path, dest / f"{ADOPTED_PREFIX}{folder.name}-{path.name}")
                try:
                    src.rmdir()
                except OSError:
                    pass
        for leftover in folder.iterdir():
            if leftover.name.endswith(".swtmp") or leftover.name.endswith(".tmp"):
                leftover.unlink(missing_ok=True)
        return spans_total

    def _take_adopted(self) -> int:
        """Batches another spool moved into this folder from a stranded one
        (``adopted-pid-<pid>-<name>``: the metrics spool of a dead agent's span spool folder),
        renumbered to this spool's tail. Returns their spans."""
        found = []
        try:
            paths = list(self.directory.glob(ADOPTED_PREFIX + "pid-*" + self.suffix))
        except OSError:
            return 0
        for path in paths:
            _, _, name = path.name.removeprefix(ADOPTED_PREFIX + "pid-").partition("-")
            parsed = _parse_name(path.with_name(name), self.suffix)
            if parsed is not None:
                found.append((parsed[0], parsed[2], path, parsed[1], parsed[3]))
        return self._take(found)

    def _take(self, found: list[tuple[int, int, Path, int, str]]) -> int:
        """Move ``(seq, part, path, spans, key)`` batches of another folder to this spool's tail,
        in their order, with new sequence numbers. Returns their spans."""
        spans_total = 0
        for _, _, path, spans, key in sorted(found, key=lambda t: (t[0], t[1])):
            with self._lock:
                seq = self._next_seq
                self._next_seq += 1
                target = self.directory / _entry_name(seq, spans, key=key, suffix=self.suffix)
                os.replace(path, target)
                size = target.stat().st_size
                self._entries.append(SpoolEntry(seq, target, spans, size, key=key))
                self._size_bytes += size
                self._spans += spans
                self._adopted += spans
            spans_total += spans
        return spans_total

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pending_spans(self) -> int:
        """Spans waiting for replay."""
        return self._spans

    def append(self, request: Message, spans: int, *, key: str = "") -> int:
        """Write one batch at the tail, evicting the oldest batches past ``max_bytes``.

        Args:
            request: the encoded batch.
            spans: spans in it.
            key: the write-ahead group it holds (16 hex digits), kept in the file name and,
                once delivered, in the delivered-keys ledger (:func:`durable_keys`).

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
            path = self.directory / _entry_name(seq, spans, key=key, suffix=self.suffix)
            atomic_write_bytes(path, data)  # complete or absent, whatever kills us
            self._entries.append(SpoolEntry(seq, path, spans, len(data), key=key))
            self._size_bytes += len(data)
            self._spans += spans
            self._written += spans
            evicted = 0
            while len(self._entries) > 1 and (
                self._size_bytes > self.max_bytes or (self.max_entries is not None and len(self._entries) > self.max_entries)
            ):
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

    def read(self, entry: SpoolEntry) -> bytes | None:
        """A spooled batch's bytes (one binary protobuf message); ``None`` when its file is gone
        or unreadable (the caller drops it)."""
        try:
            return entry.path.read_bytes()
        except OSError as exc:
            _log.warning("unreadable spool file %s (%s)", entry.path, exc)
            return None

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

    def split(self, entry: SpoolEntry, pieces: list[tuple[ExportTraceServiceRequest, int]]) -> list[SpoolEntry]:
        """Replace ``entry`` by ``pieces`` (the same spans in smaller requests), in its place.

        The pieces are written before the original is removed: a kill in between leaves both,
        which can duplicate those spans once, never lose them.

        Returns:
            The new entries (empty when ``entry`` was no longer in the spool).

        Raises:
            OSError: a piece could not be written (the original stays).
        """
        written: list[SpoolEntry] = []
        try:
            for request, spans in pieces:
                with self._lock:
                    part = self._next_part
                    self._next_part += 1
                data = request.SerializeToString()
                path = self.directory / _entry_name(entry.seq, spans, part, entry.key, suffix=self.suffix)
                atomic_write_bytes(path, data)
                written.append(SpoolEntry(entry.seq, path, spans, len(data), part, entry.key))
        except OSError:
            for piece in written:
                self._unlink(piece.path)
            raise
        with self._lock:
            try:
                index = self._entries.index(entry)
            except ValueError:
                for piece in written:
                    self._unlink(piece.path)
                return []
            del self._entries[index]
            self._forget(entry)
            for offset, piece in enumerate(written):
                self._entries.insert(index + offset, piece)
                self._size_bytes += piece.size_bytes
                self._spans += piece.spans
        self._unlink(entry.path)
        return written

    def remove(self, entry: SpoolEntry) -> bool:
        """Drop a delivered batch. Returns ``False`` when it was already evicted.

        A write-ahead group's key goes to the delivered-keys ledger first (fsynced): a kill
        between the two leaves the file, and :meth:`delivered` says it needs no second send.

        Raises:
            OSError: the ledger could not be written (the batch stays; sent again later).
        """
        if entry.key and not self.delivered(entry):
            self.ledger.add([entry.key])
            assert self._delivered_keys is not None
            self._delivered_keys.add(entry.key)
        with self._lock:
            if not self._entries or self._entries[0] != entry:
                if entry not in self._entries:
                    return False
                self._entries.remove(entry)
            else:
                self._entries.popleft()
            self._forget(entry)
            self._delivered += entry.spans
        self._unlink(entry.path)
        return True

    def delivered(self, entry: SpoolEntry) -> bool:
        """Whether ``entry`` holds a write-ahead group already delivered (its key is in the
        ledger: a sender killed between recording it and removing the file). The ledger is read
        once, at the first keyed entry (another sender cannot deliver this spool's files: it
        holds the spool's lock)."""
        if not entry.key:
            return False
        if self._delivered_keys is None:
            self._delivered_keys = self.ledger.load()
        return entry.key in self._delivered_keys

    def durable_keys(self, keys: set[str]) -> set[str]:
        """Which of ``keys`` are durable under this spool's root (:func:`durable_keys`)."""
        return durable_keys(self._root, keys)

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
            size = disk_bytes(os.lstat(target))
        except FileNotFoundError:
            return
        self._keep_rejected(SpoolEntry(entry.seq, target, entry.spans, size, key=entry.key))

    def add_rejected(self, request: ExportTraceServiceRequest, spans: int, *, key: str = "") -> None:
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
        path = self._rejected_dir() / _entry_name(seq, spans, key=key, suffix=self.suffix)
        atomic_write_bytes(path, data)
        try:
            size = disk_bytes(os.lstat(path))
        except OSError:
            size = len(data)
        self._keep_rejected(SpoolEntry(seq, path, spans, size, key=key))

    def _rejected_dir(self) -> Path:
        return ensure_private_dir(self.directory / "rejected")

    def _keep_rejected(self, entry: SpoolEntry) -> None:
        """``rejected/`` has its own budget (a wrong endpoint path refuses everything): ``max_bytes``
        on disk (allocated blocks) and ``max_rejected_files`` files; past either the oldest
        rejected files are deleted, counted and said (:meth:`_say_evicted`)."""
        with self._lock:
            self._load_rejected(skip=entry.path)
            assert self._rejected_entries is not None
            self._rejected_entries.append(entry)
            self._rejected_bytes += entry.size_bytes
            self._trim_rejected()
        self._say_evicted()

    def _load_rejected(self, skip: Path | None = None) -> None:
        """Index ``rejected/`` once (under the lock): every regular file there but temp files, oldest first
        (modification time, then name), each counted by its blocks on disk; a batch's spans from
        its name (``adopted-<folder>-<name>`` too), 0 for a file of any other name."""
        if self._rejected_entries is not None:
            return
        self._rejected_entries = deque()
        self._rejected_bytes = 0
        folder = self.directory / "rejected"
        found: list[tuple[int, str, SpoolEntry]] = []
        try:
            with os.scandir(folder) as it:
                for item in it:
                    one = self._rejected_entry(Path(item.path), item, skip)
                    if one is not None:
                        found.append(one)
        except OSError:
            return
        for _, _, entry in sorted(found, key=lambda t: (t[0], t[1])):
            self._rejected_entries.append(entry)
            self._rejected_bytes += entry.size_bytes

    def _rejected_entry(self, path: Path, item: os.DirEntry[str], skip: Path | None) -> tuple[int, str, SpoolEntry] | None:
        if path == skip or path.name.startswith("."):  # a write in progress (temp + rename)
            return None
        try:
            st = item.stat(follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        name = path.name
        if name.startswith(ADOPTED_PREFIX + "pid-"):
            name = name.removeprefix(ADOPTED_PREFIX + "pid-").partition("-")[2]
        parsed = _parse_name(path.with_name(name), self.suffix) if name else None
        seq, spans, part, key = parsed if parsed is not None else (0, 0, 0, "")
        return st.st_mtime_ns, path.name, SpoolEntry(seq, path, spans, disk_bytes(st), part, key)

    def _trim_rejected(self) -> None:
        """Delete the oldest rejected files past the caps (under the lock); counted for
        :meth:`statistics` and :meth:`_say_evicted`."""
        entries = self._rejected_entries
        files = spans = size = 0
        while entries and (self._rejected_bytes > self.max_bytes or len(entries) > self.max_rejected_files):
            old = entries.popleft()
            self._rejected_bytes -= old.size_bytes
            self._unlink(old.path)
            files, spans, size = files + 1, spans + old.spans, size + old.size_bytes
        if files:
            self._evicted += spans
            done_files, done_spans = self._rejected_evicted
            self._rejected_evicted = (done_files + files, done_spans + spans)
            unsaid = self._unsaid
            self._unsaid = (unsaid[0] + files, unsaid[1] + spans, unsaid[2] + size)

    def _say_evicted(self) -> None:
        """One warning line with the counts of rejected files deleted since it was last said, at
        most every :data:`_SAY_EVICTED_EVERY_S` seconds (the counts wait for the next line)."""
        now = time.monotonic()
        with self._lock:
            files, spans, size = self._unsaid
            if not files or now - self._said_at < _SAY_EVICTED_EVERY_S:
                return
            self._unsaid, self._said_at = (0, 0, 0), now
            kept = len(self._rejected_entries or ())
        _log.warning(
            "spool %s/rejected over its cap (%d files, %d bytes on disk): deleted the %d oldest rejected batch file(s) "
            "(%d spans, %d bytes on disk); %d kept (counted in the spool's evicted spans)",
            self.directory, self.max_rejected_files, self.max_bytes, files, spans, size, kept,
        )

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
                adopted_spans=self._adopted,
                rejected_files=len(self._rejected_entries) if self._rejected_entries is not None else -1,
                rejected_disk_bytes=self._rejected_bytes if self._rejected_entries is not None else -1,
                rejected_evicted_files=self._rejected_evicted[0],
                rejected_evicted_spans=self._rejected_evicted[1],
            )

    def close(self) -> None:
        """Release the directory lock; files stay for the next run. Safe twice."""
        fd = self._lock_fd
        if fd is not None:
            self._lock_fd = None
            os.close(fd)
