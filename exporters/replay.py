"""Replay span files (spool ``.binpb`` or embedded-default OTLP/JSON lines) to a collector.

Owns :func:`replay` and :class:`ReplayResult`, behind ``servewatch export --to ENDPOINT [PATHS]``.
Each line is sent as the same ``ExportTraceServiceRequest`` it was written as, so spans keep their
trace/span ids and times. Files are sent in name order (spool and rotated file names sort in write
order). One deadline per request, jittered exponential backoff between attempts; when the
collector stays unreachable the rest is counted failed without waiting on each request.

Idempotent across re-runs: with a ledger, every request the collector acknowledged is recorded
(per endpoint, file and request index; files are append-only or immutable) and a re-run to the
same endpoint skips it, so running ``servewatch export`` twice never sends a span twice. The
ledger belongs to the data, not to the caller's folder: :func:`ledger_path` finds it from each
span file (``<data_dir>/export-ledger.json`` of the data dir the file is in), so a re-run from
another folder, or naming the spool instead of the whole data dir, still skips what was sent.
A failure is explained in operator terms (refused, protocol mismatch, TLS, auth: see
:class:`exporters.transport.Cause`).

Imports :mod:`agent.fsutil`, :mod:`exporters.otlp_json` and :mod:`exporters.transport`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from agent.fsutil import atomic_write_text
from exporters.backoff import Backoff
from exporters.otlp_json import TornLines, iter_span_files, read_span_file
from exporters.transport import (
    Delivery,
    RequestSender,
    SendResult,
    TlsFiles,
    make_sender,
    span_count,
)

__all__ = ["LEDGER_NAME", "ReplayResult", "ledger_path", "replay"]

_log = logging.getLogger(__name__)

#: file name of the export ledger, in the data dir it belongs to
LEDGER_NAME = "export-ledger.json"
#: the folders under ``<data_dir>/<host>/`` that hold span files (embedded default, spool)
_SPAN_FOLDERS = ("spans", "spool")


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
            return folder.parent.parent / LEDGER_NAME
    return file.parent / LEDGER_NAME


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


class _Ledger:
    """What an endpoint acknowledged: ``{endpoint|path|inode: requests acknowledged}`` in a JSON
    file written atomically. Files are append-only (span lines) or immutable (spool batches), so
    "the first N requests of this file" stays true."""

    def __init__(self, path: Path | None, endpoint: str) -> None:
        self.path = path
        self.endpoint = endpoint
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
        if self.path is None or not self._dirty:
            return
        try:
            atomic_write_text(self.path, json.dumps(self.data, sort_keys=True))
            self._dirty = 0
        except OSError as exc:
            _log.warning("could not write export ledger %s: %s", self.path, exc)


def _spool_in_use(path: Path, cache: dict[Path, bool]) -> bool:
    """Whether ``path`` lies in a spool folder whose ``.lock`` a live process holds."""
    folder = path.parent.parent if path.parent.name == "rejected" else path.parent
    if folder not in cache:
        lock = folder / ".lock"
        held = False
        if lock.exists():
            try:
                fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                fd = -1
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                except BlockingIOError:
                    held = True
                finally:
                    os.close(fd)
        cache[folder] = held
    return cache[folder]


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

    Files of a spool that a running agent holds (its ``.lock``) are skipped and counted in
    ``locked_files``: that agent replays them itself.

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
    if sender is None:
        sender = make_sender(endpoint, protocol, headers=headers, insecure=insecure, tls=tls,
                             compression=compression, signal_specific=signal_specific)
    books: dict[Path | None, _Ledger] = {}

    def book_for(file: Path) -> _Ledger:
        where = ledger(file) if callable(ledger) else ledger
        if where not in books:
            books[where] = _Ledger(where, f"{protocol} {endpoint}")
        return books[where]

    already = 0
    sent = failed = files = bad = removed = locked = 0
    detail = ""
    lock_cache: dict[Path, bool] = {}
    torn = TornLines()
    unreachable = False
    try:
        for path in iter_span_files(paths):
            if path.name.startswith("metrics-"):
                continue
            if not path.exists():
                raise FileNotFoundError(errno.ENOENT, "no such file or folder", str(path))
            if _spool_in_use(path, lock_cache):
                locked += 1
                continue
            files += 1
            file_failed = keep = False
            corrupt_before = torn.corrupt
            try:
                requests = list(read_span_file(path, torn))
            except ValueError as exc:
                bad += 1
                detail = str(exc)
                _log.warning("skipping %s: %s", path, exc)
                continue
            if torn.corrupt > corrupt_before:
                if not requests:  # not one line reads: not a span file at all
                    bad += 1
                    torn.corrupt = corrupt_before
                    detail = f"{path}: not an OTLP/JSON span file"
                    _log.warning("skipping %s: no line is an OTLP/JSON trace request", path)
                    continue
                keep = True  # what the corrupt lines held cannot be sent: the file is kept, never removed
            book = book_for(path)
            key = book.key(path)
            done = book.acked(key)
            for index, request in enumerate(requests):
                spans = span_count(request)
                if index < done:
                    already += spans
                    continue
                if spans == 0:
                    continue
                if unreachable:
                    failed += spans
                    file_failed = True
                    continue
                result = _send_with_retry(sender, request, timeout_s=timeout_s, attempts=attempts)
                if result.ok:
                    sent += spans - result.rejected_spans
                    failed += result.rejected_spans
                    if not file_failed:
                        book.record(key, index + 1)
                else:
                    failed += spans
                    file_failed = True
                    detail = f"{path.name}: {result.explain()}"
                    unreachable = result.delivery is Delivery.RETRYABLE
            # a delivered spool batch is removed always: left there, the next agent would adopt
            # and send it again
            if (remove_sent or path.suffix == ".binpb") and not file_failed and not keep:
                Path(path).unlink(missing_ok=True)
                book.forget(key)
                removed += 1
    finally:
        for book in books.values():
            book.save()
        if own_sender:
            sender.close()
    if torn.count:
        _log.warning("skipped %d torn last line(s) of interrupted writes", torn.count)
    if torn.corrupt:
        _log.warning("skipped %d corrupt line(s), the rest of their files was sent; first: %s", torn.corrupt, torn.first_corrupt)
    return ReplayResult(sent=sent, failed=failed, files=files, bad_files=bad, removed=removed, detail=detail,
                        locked_files=locked, already_sent=already, torn_lines=torn.count,
                        corrupt_lines=torn.corrupt, first_corrupt=torn.first_corrupt)
