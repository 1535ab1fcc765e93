"""Importing a profile's trace files off the span pipeline: one bounded worker, a deadline, and a
ledger of files that failed, kept across restarts.

Owns :class:`TraceImporter` and :class:`TraceImportLedger`. A trace file is written by the watched
server (its uid owns the session folder), so it is untrusted input: it may be huge, sparse,
unterminated or deeply nested. :mod:`exporters.mirror.torch_trace` reads it within an
:class:`~exporters.mirror.torch_trace.ImportBudget` (read cap, longest value, deadline, cancel); this
module keeps that work away from everything else:

* **Off the span pipeline.** The span mirror emits a ``profile.session`` span at once and hands
  the import to :class:`TraceImporter`, one daemon thread with a bounded queue
  (:data:`MAX_PENDING` sessions; over that a session's import is refused and said). Incident
  roots, actions and later incidents never wait for an import.
* **Its own deadline.** Each session's import gets :data:`~exporters.mirror.torch_trace.IMPORT_DEADLINE_S`
  of wall clock for all its files.
* **Stops within the shutdown grace.** :meth:`TraceImporter.close` cancels the running import
  (checked at every 64 Ki-character chunk) and waits at most ``grace_s``; a thread stuck in a read
  (a hung mount) is a daemon thread and is left behind, never waited for.
* **A file that failed once is skipped.** :class:`TraceImportLedger` marks a file in the agent's
  own data dir before its import starts and unmarks it when the import ends well: a failure, a
  deadline, a cancel or the agent dying mid-import leave the mark, and every later import (the
  next agent re-sending an interrupted incident's spans included) logs
  ``trace X skipped: <why>`` instead of reading it again.

Imports the standard library, :mod:`agent.host.fsutil` and :mod:`exporters.mirror.torch_trace`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from agent.host.fsutil import atomic_write_text, ensure_private_dir
from agent.model.datadir import TRACE_IMPORTS_DIR
from exporters.mirror.torch_trace import IMPORT_DEADLINE_S, ImportBudget

__all__ = ["LEDGER_DIR_NAME", "MAX_PENDING", "ImporterStatistics", "TraceImportLedger", "TraceImporter"]

_log = logging.getLogger(__name__)

#: Folder of the ledger under the agent's data dir (agent.model.datadir's: ``DataDir.trace_imports``).
LEDGER_DIR_NAME = TRACE_IMPORTS_DIR
#: Sessions waiting for the import worker before a new one is refused.
MAX_PENDING = 8
#: Most marks kept by the ledger (the oldest go first).
MAX_MARKS = 10_000
#: Why a file whose import began and never ended is skipped.
UNFINISHED = "an earlier import of it never finished (the agent stopped or died during it)"


class TraceImportLedger:
    """Marks of trace files not to import again, one small JSON file each under ``folder``
    (0700, root's when the agent is root; never in the session folder the server can write).

    A file is named by ``(st_dev, st_ino)`` and its path: rewriting it in place does not clear
    its mark, and the server cannot rename or re-link a file it handed over (the agent took it:
    root's now, one link; :class:`agent.host.fsutil.SessionFolder`). Thread-safe. Never raises: a ledger that cannot write only loses
    its memory (logged once).

    Args:
        folder: where the marks live (created on first use).
        max_marks: most marks kept; the oldest are removed past it.
    """

    def __init__(self, folder: str | os.PathLike[str], *, max_marks: int = MAX_MARKS) -> None:
        self.folder = Path(folder)
        self.max_marks = max_marks
        self._lock = threading.Lock()
        self._warned = False
        self._writes = 0

    def _key(self, path: Path) -> str:
        try:
            st = os.lstat(path)
            ident = f"{st.st_dev}:{st.st_ino}:{path}"
        except OSError:
            ident = f"-:-:{path}"
        return hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:32] + ".json"

    def skipped(self, path: Path) -> str | None:
        """Why ``path`` is not imported (one line), or ``None``."""
        try:
            with open(self.folder / self._key(path), encoding="utf-8") as fh:
                doc = json.loads(fh.read(4096))
        except (OSError, ValueError):
            return None
        reason = doc.get("reason") if isinstance(doc, dict) else None
        return str(reason) if reason else UNFINISHED

    def begin(self, path: Path) -> None:
        """Mark ``path`` before its import starts (a crash from here on leaves the mark)."""
        self._write(path, UNFINISHED)

    def end(self, path: Path, error: str | None) -> None:
        """The import of ``path`` ended: unmark it (``error`` is ``None``) or keep its reason."""
        if error is None:
            try:
                os.unlink(self.folder / self._key(path))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._warn(exc)
            return
        self._write(path, f"an earlier import failed: {error}")

    def _write(self, path: Path, reason: str) -> None:
        doc = {"path": str(path), "reason": reason, "time_unix_nano": time.time_ns()}
        with self._lock:
            try:
                ensure_private_dir(self.folder)
                atomic_write_text(self.folder / self._key(path), json.dumps(doc), durable=False)
            except OSError as exc:
                self._warn(exc)
                return
            self._writes += 1
            if self._writes % 256 == 1:
                self._prune()

    def _prune(self) -> None:
        try:
            entries = [e for e in os.scandir(self.folder) if e.name.endswith(".json")]
            if len(entries) <= self.max_marks:
                return
            entries.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
            for entry in entries[: len(entries) - self.max_marks]:
                os.unlink(entry.path)
        except OSError as exc:
            self._warn(exc)

    def _warn(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            _log.warning("trace import ledger %s unusable (%s): a failed trace may be imported again", self.folder, exc)


class ImporterStatistics(NamedTuple):
    """What the import worker did."""

    #: sessions imported (whatever their files' outcome)
    imported: int
    #: sessions refused because :data:`MAX_PENDING` were waiting, or the importer was closed
    refused: int
    #: sessions whose import was cut by :meth:`TraceImporter.close`
    cancelled: int
    #: sessions waiting now
    pending: int


#: One session's import: called in the worker thread with its budget.
ImportJob = Callable[[ImportBudget], None]


class TraceImporter:
    """One daemon worker thread importing profile sessions' traces, in order, each within its
    own :class:`~exporters.mirror.torch_trace.ImportBudget`.

    Args:
        deadline_s: wall-clock bound of one session's import, seconds.
        max_pending: sessions waiting before :meth:`submit` refuses.
        ledger: marks of files not to import again (shared by every job; passed to them by
            the caller).
    """

    def __init__(
        self, *, deadline_s: float = IMPORT_DEADLINE_S, max_pending: int = MAX_PENDING, ledger: TraceImportLedger | None = None
    ) -> None:
        self.deadline_s = deadline_s
        self.ledger = ledger
        self._queue: queue.Queue[ImportJob | None] = queue.Queue(maxsize=max_pending)
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._imported = self._refused = self._cancelled = 0

    def statistics(self) -> ImporterStatistics:
        return ImporterStatistics(self._imported, self._refused, self._cancelled, self._queue.qsize())

    def submit(self, job: ImportJob) -> bool:
        """Queue one session's import; never blocks.

        Returns:
            ``False`` when refused (:data:`MAX_PENDING` waiting, or closed): the caller says so.
        """
        with self._lock:
            if self._closed:
                self._refused += 1
                return False
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self._refused += 1
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="servewatch-trace-import", daemon=True)
                self._thread.start()
        return True

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            budget = ImportBudget(deadline_s=self.deadline_s, cancel=self._cancel)
            try:
                job(budget)
            except Exception:  # noqa: BLE001 - an import never takes the worker down
                _log.exception("trace import failed")
            if budget.cancelled:
                self._cancelled += 1
            else:
                self._imported += 1

    def close(self, grace_s: float = 2.0) -> bool:
        """Refuse new sessions, cancel the running import and those waiting (each still reports
        what it got, marked cancelled), and wait at most ``grace_s`` seconds. Safe twice.

        Returns:
            Whether the worker finished within the grace (``False``: left behind, a daemon thread).
        """
        with self._lock:
            self._closed = True
            thread = self._thread
        self._cancel.set()
        if thread is None:
            return True
        deadline = time.monotonic() + grace_s
        while True:  # the sentinel after every queued job (each ends at once, cancelled)
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            _log.warning("trace import still running after the %g s shutdown grace: left behind", grace_s)
            return False
        return True
