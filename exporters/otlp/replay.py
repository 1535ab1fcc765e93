"""Replay span files (spool ``.binpb`` or embedded-default OTLP/JSON lines) to a collector.

Owns :func:`replay` and :class:`ReplayResult`, behind ``servewatch export --to ENDPOINT [PATHS]``.
Spans keep their trace/span ids and times: the requests as written (one per line, one per spool
batch) are merged into batches by size, as the live path batches (``export.batch_spans`` spans,
``export.batch_bytes`` bytes). Files are sent in name order (spool and rotated file names sort in
write order). One deadline per request, jittered exponential backoff between attempts (at least
the collector's ``Retry-After`` / ``RetryInfo``); when the collector stays unreachable the rest is
counted failed without waiting on each request.

Idempotent across re-runs: with a ledger, every request the collector acknowledged is recorded
(per endpoint, file and request index; files are append-only or immutable) and a re-run to the
same endpoint skips it, so running ``servewatch export`` twice never sends a span twice. The
ledger belongs to the data, not to the caller's folder: :func:`ledger_path` finds it from each
span file (``<data_dir>/export-ledger.json`` of the data dir the file is in), so a re-run from
another folder, or naming the spool instead of the whole data dir, still skips what was sent.
A failure is explained in operator terms (refused, protocol mismatch, TLS, auth: see
:class:`exporters.otlp.transport.Cause`).

Imports :mod:`agent.host.fsutil`, :mod:`exporters.otlp.otlp_json` and :mod:`exporters.otlp.transport`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agent.host.fsutil import atomic_write_text
from agent.model.backoff import Backoff
from agent.model.datadir import EXPORT_LEDGER_FILE, SPANS_DIR, SPOOL_DIR, DataDir
from exporters.otlp.batching import halve_request
from exporters.otlp.otlp_json import TornLines, iter_span_files, read_span_file
from exporters.otlp.spool import DeliveredKeys, spool_root_of
from exporters.otlp.transport import (
    Cause,
    Delivery,
    RequestSender,
    SendResult,
    TlsFiles,
    make_sender,
    span_count,
)

__all__ = ["LEDGER_NAME", "ReplayResult", "ledger_path", "replay"]

_log = logging.getLogger(__name__)

#: file name of the export ledger, in the data dir it belongs to (agent.model.datadir's)
LEDGER_NAME = EXPORT_LEDGER_FILE
#: the folders under ``<data_dir>/<host>/`` that hold span files (embedded default, spool)
_SPAN_FOLDERS = (SPANS_DIR, SPOOL_DIR)
#: Unreadable span files named one warning line each; the rest are summed up in one line at the end.
_SAY_BAD_FILES = 3


def ledger_path(span_file: str | os.PathLike[str]) -> Path:
    """The export ledger a span file's acknowledgements are recorded in, whatever the cwd.

    A file under ``<data_dir>/<host>/spans/`` or ``<data_dir>/<host>/spool/`` (at any depth:
    ``spool/rejected/``) belongs to ``<data_dir>/export-ledger.json``; any other file (a copied
    span file) to ``export-ledger.json`` in its own folder. The same file maps to the same ledger
    however it was named (the data dir, the spool folder, the file itself, a relative path).

    Args:
        span_file: path of one span file (need not exist).

    Returns:
        The absolute ledger path (the file may not exist yet).
    """
    file = Path(os.path.abspath(span_file))
    try:
        file = file.parent.resolve() / file.name
    except OSError:
        pass
    for folder in file.parents:
        if folder.name in _SPAN_FOLDERS and len(folder.parents) >= 3:  # never the root folder
            return DataDir(folder.parent.parent, folder.parent.name).export_ledger
    return DataDir.ledger_beside(file.parent)


class ReplayResult(NamedTuple):
    """What :func:`replay` did."""

    #: spans the collector accepted
    sent: int
    #: spans not delivered (collector unreachable or refusing, or unreadable lines' spans unknown)
    failed: int
    #: files read
    files: int
    #: files skipped because a line in them is not an OTLP/JSON trace request
    bad_files: int = 0
    #: files deleted after every span in them was delivered (``remove_sent=True``)
    removed: int = 0
    #: last failure, one line (``""`` when none)
    detail: str = ""
    #: spool files skipped because a running agent owns that spool (it replays them itself;
    #: sending them here too would deliver them twice)
    locked_files: int = 0
    #: spans skipped because the ledger says this endpoint already acknowledged them
    already_sent: int = 0
    #: torn last lines skipped (a writer killed mid-line or a full disk; only that line is lost)
    torn_lines: int = 0
    #: corrupt lines skipped inside span files (their spans cannot be sent; the rest of the file is)
    corrupt_lines: int = 0
    #: ``file:line: why`` of the first corrupt line (``""`` when none)
    first_corrupt: str = ""
    #: export requests sent (batches; a retry of one counts once)
    requests: int = 0


class _Ledger:
    """What an endpoint acknowledged: ``{endpoint|path|inode: requests acknowledged}`` in a JSON
    file written atomically. Files are append-only (span lines) or immutable (spool batches), so
    "the first N requests of this file" stays true."""

    def __init__(self, path: Path | None, endpoint: str, *, read_only: bool = False) -> None:
        self.path = path
        self.endpoint = endpoint
        #: a dry run reads what was acknowledged and writes nothing
        self.read_only = read_only
        self.data: dict[str, int] = {}
        self._dirty = 0
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text())
                if isinstance(loaded, dict):
                    self.data = {str(k): int(v) for k, v in loaded.items()}
            except (OSError, ValueError) as exc:
                _log.warning("export ledger %s unreadable (%s); starting a new one", path, exc)

    def key(self, file: Path) -> str:
        st = file.stat()
        return f"{self.endpoint}|{file.resolve()}|{st.st_ino}"

    def acked(self, key: str) -> int:
        return self.data.get(key, 0)

    def record(self, key: str, count: int) -> None:
        self.data[key] = count
        self._dirty += 1
        if self._dirty >= 32:
            self.save()

    def forget(self, key: str) -> None:
        if self.data.pop(key, None) is not None:
            self._dirty += 1

    def save(self) -> None:
        if self.path is None or not self._dirty or self.read_only:
            return
        try:
            atomic_write_text(self.path, json.dumps(self.data, sort_keys=True))
            self._dirty = 0
        except OSError as exc:
            _log.warning("could not write export ledger %s: %s", self.path, exc)


class _SpoolLocks:
    """The ``.lock`` of every spool folder a replay sends from, held until it ends: an agent
    starting meanwhile takes a spool folder of its own and never sends these files too. A
    folder whose lock a live process holds (a running agent) is skipped: it sends its files
    itself."""

    def __init__(self) -> None:
        self._held: dict[Path, int | None] = {}

    @staticmethod
    def folder_of(path: Path) -> Path:
        return path.parent.parent if path.parent.name == "rejected" else path.parent

    def available(self, path: Path) -> bool:
        """Whether ``path`` may be sent: not in a spool folder, or in one we now hold."""
        folder = self.folder_of(path)
        if folder not in self._held:
            lock = folder / ".lock"
            fd: int | None = -1  # -1: no lock file, not a spool folder of an agent
            if lock.exists():
                try:
                    fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    fd = -1
                else:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)
                        fd = None  # a live process holds it
            self._held[folder] = fd
        return self._held[folder] is not None

    def release(self) -> None:
        for fd in self._held.values():
            if fd is not None and fd >= 0:
                os.close(fd)
        self._held.clear()


@dataclass
class _File:
    """One span file being replayed."""

    path: Path
    book: _Ledger
    key: str
    #: requests queued for sending (not yet answered)
    queued: int = 0
    #: every request of the file was read (queued, skipped or counted failed)
    read: bool = False
    failed: bool = False
    #: corrupt lines: what they held cannot be sent; the file is never removed
    keep: bool = False
    #: the write-ahead group a spool batch holds (its name), recorded as delivered before removal
    group: str = ""


@dataclass
class _Item:
    """One request of a file, waiting in the current batch."""

    file: _File
    index: int
    request: ExportTraceServiceRequest
    spans: int


def _merge(items: list[_Item]) -> ExportTraceServiceRequest:
    if len(items) == 1:
        return items[0].request
    merged = ExportTraceServiceRequest()
    for item in items:
        merged.resource_spans.extend(item.request.resource_spans)
    return merged


def _send_with_retry(sender: RequestSender, request: object, *, timeout_s: float, attempts: int) -> SendResult:
    """Up to ``attempts`` tries of one request within ``timeout_s`` seconds; between tries the
    backoff (at least the collector's ``Retry-After`` / ``RetryInfo``). A wait that would pass
    the deadline ends the tries: the last result comes back."""
    backoff = Backoff(0.2, 5.0)
    result = SendResult(Delivery.RETRYABLE, "not sent")
    deadline = time.monotonic() + timeout_s
    for attempt in range(attempts):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        result = sender.send(request, timeout_s=remaining)
        if result.delivery is not Delivery.RETRYABLE or attempt == attempts - 1:
            return result
        pause = backoff.next_delay_s(result.retry_after_s)
        if time.monotonic() + pause >= deadline:
            break
        time.sleep(pause)
    return result


def _read_requests(path: Path, torn: TornLines, run: _Replay) -> list[ExportTraceServiceRequest] | None:
    """The trace requests of one span file; ``None`` (counted bad, said once) when it cannot be
    read or not one of its lines is an OTLP/JSON trace request."""
    corrupt_before = torn.corrupt
    try:
        requests = list(read_span_file(path, torn))
    except ValueError as exc:
        run.bad += 1
        run.detail = str(exc)
        if run.bad <= _SAY_BAD_FILES:  # the rest in one line at the end (100,000 torn files: not 100,000 lines)
            _log.warning("skipping %s: %s", path, exc)
        return None
    if torn.corrupt > corrupt_before and not requests:  # not one line reads: not a span file at all
        run.bad += 1
        torn.corrupt = corrupt_before
        run.detail = f"{path}: not an OTLP/JSON span file"
        if run.bad <= _SAY_BAD_FILES:
            _log.warning("skipping %s: no line is an OTLP/JSON trace request", path)
        return None
    return requests


def replay(
    paths: Iterable[str | os.PathLike[str]],
    *,
    endpoint: str,
    protocol: str = "grpc",
    timeout_s: float = 10.0,
    headers: dict[str, str] | None = None,
    insecure: bool | None = None,
    attempts: int = 3,
    remove_sent: bool = False,
    sender: RequestSender | None = None,
    tls: TlsFiles | None = None,
    compression: str | None = None,
    signal_specific: bool = False,
    ledger: Path | Callable[[Path], Path | None] | None = None,
    batch_spans: int = 512,
    batch_bytes: int = 3 * 1024 * 1024,
    dry_run: bool = False,
) -> ReplayResult:
    """Send every span in ``paths`` (span files, or folders of them) to an OTLP collector.

    Args:
        paths: span files (``.jsonl``/``.json`` OTLP/JSON lines, ``.binpb`` spool batches), or
            folders searched recursively (``metrics-*`` files and ``.tmp`` leftovers are skipped).
        endpoint: collector endpoint (``http://host:4317`` for gRPC, ``http://host:4318`` for HTTP,
            to which ``/v1/traces`` is appended).
        protocol: ``grpc`` or ``http/protobuf``.
        timeout_s: bound on each request, retries included, seconds.
        headers: request headers / gRPC metadata.
        insecure: plaintext for an endpoint without scheme.
        attempts: tries per request on retryable failures.
        remove_sent: delete a file once all its spans were delivered (spool ``.binpb`` batches
            are always deleted once delivered, or the next agent would send them again).

        sender: use this sender instead of building one (tests).
        tls / compression / signal_specific: transport settings (see :func:`make_sender`).
        ledger: JSON file recording what this endpoint acknowledged; requests found there are
            skipped (``already_sent``) and new acknowledgements are added. A callable maps each
            span file to its ledger (:func:`ledger_path`: the ledger of the data dir the file is
            in; ``None`` from it: no ledger for that file). ``None``: no ledger.
        batch_spans / batch_bytes: requests of consecutive files are merged into batches of at
            most this many spans and encoded bytes (``export.batch_spans`` / ``batch_bytes``, as
            the live path); a batch the collector refuses as too large is sent request by request.
        dry_run: read and batch everything as a replay would, and send nothing: no sender is
            made (nothing is connected to), the ledger is read but not written, no file is removed
            or recorded as delivered. ``sent`` and ``requests`` then count what would be sent
            (as if the collector accepted all of it), ``failed`` is 0.

    Files of a spool that a running agent holds (its ``.lock``) are skipped and counted in
    ``locked_files``: that agent replays them itself. The spool folders sent from are locked
    for the whole replay (an agent starting meanwhile takes a folder of its own). A spool batch
    holding a write-ahead group (its name carries the group's key) is recorded in the spool's
    delivered-keys ledger before it is removed, so the next agent knows those spans went out.

    Returns:
        Counts of spans sent and failed, files read. Never raises for collector failures.

    Raises:
        ValueError: unknown protocol, or an endpoint without ``http://`` / ``https://``.
        FileNotFoundError: a path that does not exist.
        OSError: a TLS file cannot be read.
    """
    if "://" not in endpoint:
        raise ValueError(
            f"endpoint {endpoint!r} has no scheme: write http://{endpoint} (plaintext) or https://{endpoint} (TLS)"
        )
    own_sender = sender is None
    if sender is None or dry_run:  # a dry run sends to nothing, whatever sender it was given
        sender = _DrySender() if dry_run else make_sender(
            endpoint, protocol, headers=headers, insecure=insecure, tls=tls, compression=compression,
            signal_specific=signal_specific)
    run = _Replay(sender, timeout_s=timeout_s, attempts=attempts, remove_sent=remove_sent,
                  batch_spans=max(1, batch_spans), batch_bytes=max(1024, batch_bytes), dry_run=dry_run)
    books: dict[Path | None, _Ledger] = {}

    def book_for(file: Path) -> _Ledger:
        where = ledger(file) if callable(ledger) else ledger
        if where not in books:
            books[where] = _Ledger(where, f"{protocol} {endpoint}", read_only=dry_run)
        return books[where]

    locks = _SpoolLocks()
    torn = TornLines()
    try:
        for path in iter_span_files(paths):
            if path.name.startswith("metrics-"):
                continue
            if not path.exists():
                raise FileNotFoundError(errno.ENOENT, "no such file or folder", str(path))
            if not locks.available(path):
                run.locked += 1
                continue
            run.files += 1
            corrupt_before = torn.corrupt
            requests = _read_requests(path, torn, run)
            if requests is None:
                continue
            book = book_for(path)
            file = _File(path, book, book.key(path), group=_group_of(path))
            # what corrupt lines held cannot be sent: the file is kept, never removed
            file.keep = torn.corrupt > corrupt_before
            run.add_file(file, requests)
        run.flush()
    finally:
        locks.release()
        for book in books.values():
            book.save()
        if own_sender:
            sender.close()
    if run.bad > _SAY_BAD_FILES:
        _log.warning("skipped %d unreadable span file(s) in all (the first %d named above)", run.bad, _SAY_BAD_FILES)
    if torn.count:
        _log.warning("skipped %d torn last line(s) of interrupted writes", torn.count)
    if torn.corrupt:
        _log.warning("skipped %d corrupt line(s), the rest of their files was sent; first: %s", torn.corrupt, torn.first_corrupt)
    return ReplayResult(sent=run.sent, failed=run.failed, files=run.files, bad_files=run.bad, removed=run.removed,
                        detail=run.detail, locked_files=run.locked, already_sent=run.already, torn_lines=torn.count,
                        corrupt_lines=torn.corrupt, first_corrupt=torn.first_corrupt, requests=run.requests)


class _DrySender:
    """A dry run's sender (a :class:`~exporters.otlp.transport.RequestSender`): every request
    accepted, nothing sent, no connection made."""

    target = "nothing (dry run)"

    def send(self, request: object, *, timeout_s: float) -> SendResult:
        return SendResult(Delivery.OK)

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def _group_of(path: Path) -> str:
    """The write-ahead group key in a spool batch's name (``""`` for other files)."""
    if path.suffix != ".binpb":
        return ""
    stem = path.name.removesuffix(".binpb")
    parts = stem.split("-")
    return parts[2] if len(parts) == 3 and len(parts[2]) == 16 else ""


class _Replay:
    """The sending side of :func:`replay`: requests of consecutive files merged into batches of
    at most ``batch_spans`` spans and ``batch_bytes`` bytes (as the live path batches), each
    acknowledged batch recorded in the files' ledgers, a file removed once all of it went."""

    def __init__(self, sender: RequestSender, *, timeout_s: float, attempts: int, remove_sent: bool,
                 batch_spans: int, batch_bytes: int, dry_run: bool = False) -> None:
        self.sender = sender
        self.dry_run = dry_run
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.remove_sent = remove_sent
        self.batch_spans = batch_spans
        self.batch_bytes = batch_bytes
        self.pending: list[_Item] = []
        self.pending_spans = 0
        self.pending_bytes = 0
        self.sent = self.failed = self.files = self.bad = self.removed = self.locked = self.already = self.requests = 0
        self.detail = ""
        self.unreachable = False
        self._delivered: dict[Path, set[str]] = {}

    def _delivered_keys(self, path: Path) -> tuple[Path | None, set[str]]:
        root = spool_root_of(path)
        if root is None:
            return None, set()
        if root not in self._delivered:
            self._delivered[root] = DeliveredKeys(root).load()
        return root, self._delivered[root]

    def add_file(self, file: _File, requests: list[ExportTraceServiceRequest]) -> None:
        done = file.book.acked(file.key)
        if file.group and file.group in self._delivered_keys(file.path)[1]:
            # delivered already: a sender killed after recording it, before removing the file
            self.already += sum(span_count(r) for r in requests)
            file.read = True
            self._finish(file)
            return
        for index, request in enumerate(requests):
            spans = span_count(request)
            if index < done:
                self.already += spans
                continue
            if self.unreachable or file.failed:
                self.failed += spans
                file.failed = True
                continue
            size = request.ByteSize()
            if self.pending and (self.pending_spans + spans > self.batch_spans or self.pending_bytes + size > self.batch_bytes):
                self.flush()
                if self.unreachable or file.failed:
                    self.failed += spans
                    file.failed = True
                    continue
            self.pending.append(_Item(file, index, request, spans))
            self.pending_spans += spans
            self.pending_bytes += size
            file.queued += 1
        file.read = True
        if not file.queued:
            self._finish(file)

    def flush(self) -> None:
        items, self.pending = self.pending, []
        self.pending_spans = self.pending_bytes = 0
        if not items:
            return
        spans = sum(i.spans for i in items)
        if spans == 0:
            result = SendResult(Delivery.OK)
        else:
            result = self._send(_merge(items), spans)
        if result.delivery is Delivery.TOO_LARGE and len(items) > 1:
            for item in items:  # the collector's limit is below ours: each request on its own
                self.pending = [item]
                self.pending_spans, self.pending_bytes = item.spans, 0
                self.flush()
            return
        if result.ok and result.rejected_spans < spans:
            self.sent += spans - result.rejected_spans
            self.failed += result.rejected_spans
            for item in items:
                if not item.file.failed:
                    item.file.book.record(item.file.key, item.index + 1)
        else:
            self.failed += spans
            self.detail = f"{items[0].file.path.name}: {result.explain()}"
            self.unreachable = result.delivery is Delivery.RETRYABLE
            for item in items:
                item.file.failed = True
        for item in items:
            item.file.queued -= 1
            if item.file.read and not item.file.queued:
                self._finish(item.file)

    def _send(self, request: ExportTraceServiceRequest, spans: int) -> SendResult:
        self.requests += 1
        result = _send_with_retry(self.sender, request, timeout_s=self.timeout_s, attempts=self.attempts)
        if result.delivery is Delivery.TOO_LARGE and spans > 0:
            # one request alone over the collector's limit: halves (a span alone: trimmed)
            pieces, _ = halve_request(request)
            if len(pieces) > 1 or pieces[0][0] is not request:
                outcomes = [self._send(piece, n) for piece, n in pieces]
                bad = next((o for o in outcomes if not o.ok), None)
                return bad or SendResult(Delivery.OK, rejected_spans=sum(o.rejected_spans for o in outcomes))
        if result.ok and result.rejected_spans >= spans > 0:
            # every span rejected (OTLP partial success): not delivered; the file stays
            return SendResult(Delivery.PERMANENT, "every span rejected (OTLP partial success)", message=result.message,
                              cause=Cause.COLLECTOR)
        return result

    def _finish(self, file: _File) -> None:
        """All of ``file`` was answered: remove it when asked (a spool batch always), after
        recording its write-ahead group as delivered."""
        if self.dry_run or file.failed or file.keep or not (self.remove_sent or file.path.suffix == ".binpb"):
            return
        if file.group:
            root, delivered = self._delivered_keys(file.path)
            if root is not None and file.group not in delivered:
                try:
                    DeliveredKeys(root).add([file.group])
                except OSError as exc:  # kept: the next sender sends it again (once more), never loses it
                    _log.warning("could not record %s as delivered (%s); kept", file.path, exc)
                    return
                delivered.add(file.group)
        # a delivered spool batch is removed always: left there, the next agent would adopt and send it again
        Path(file.path).unlink(missing_ok=True)
        file.book.forget(file.key)
        self.removed += 1
