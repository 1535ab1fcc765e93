"""Import torch profiler Chrome traces (``.json`` / ``.json.gz``) as OTel spans, streaming.

Owns the incremental ``traceEvents`` reader, the keep/drop filter, nesting by time containment
and :func:`import_torch_trace`; also :func:`gputrace_attributes` for Metal ``.gputrace``
bundles. Imports the standard library, pydantic and :mod:`exporters.otlp.spans`; never torch (a trace
is a file) and never the agent's decision code.

Facts used (per FIELD-NOTES and torch 2.13 output): a trace is one JSON object with
``traceEvents`` (a list of events) and ``baseTimeNanoseconds``; an event's wall clock in ns is
``baseTimeNanoseconds + round(ts * 1000)`` with ``ts``/``dur`` in microseconds (floats);
``pid``/``tid`` may be strings; complete ranges have ``ph == "X"``; ``ProfilerStep#N`` and
``record_function`` ranges have category ``user_annotation`` (``gpu_user_annotation`` on GPU
streams).

Streaming: memory does not grow with the trace. The file is read in chunks of
``chunk_chars`` characters; complete events are cut out of the buffer and decoded in batches by
the stdlib C decoder: a batch is the buffer up to its last ``},``, with each flat ``args`` object
replaced by ``0`` by one C-speed ``re.sub`` (args are not imported, and skipping their objects
is most of the speed), parsed as ``json.loads('[' + text + ']')``. JSON being deterministic,
that only parses when the cut is a real event boundary; otherwise one event is decoded with
``JSONDecoder.raw_decode`` and the reader moves on. Only events that will become spans are
kept, in a per-thread reorder window of ``reorder_window`` events (ordered by start time, so a
thread's ranges nest correctly even when the file is slightly out of order) plus a stack of the
thread's open ranges. A span is emitted as soon as it leaves the window, with its parent chosen
by time containment on its own ``(pid, tid)``; the outermost ranges are children of the
``profile.session`` span. GPU rows (``kernel``, ``gpu_memcpy``...) carry ``gpu.device`` /
``gpu.stream`` from torch's ``pid``/``tid`` there; host rows carry ``process.pid``/``thread.id``.

Why not ``ijson``: ``bench/bench_trace_import.py`` walks real traces (torch 2.13 CPU-only, with
stacks, with shapes; a real vLLM 0.32 worker's trace) with this reader and with ijson's C backend
doing the same walk and the same import: this reader needs 1.8-3.4x fewer CPU-seconds per event
for the import, with less peak memory (issue 28: a library unless a bench shows a gain worth
owning the parser).

``baseTimeNanoseconds`` may come before or after ``traceEvents`` in a file: the head is checked
first (torch 2.13 writes it there); otherwise one cheap extra pass reads the tail (a plain file
is seeked; a gzip file is decompressed without parsing, keeping only the last 64 KiB).
"""

from __future__ import annotations

import gzip
import heapq
import io
import json
import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple, Protocol

from pydantic import BaseModel, Field

from agent.errors import TraceImportAborted
from exporters.otlp.spans import SpanSink, build_span, new_span_id

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

__all__ = [
    "ALWAYS_KEPT_CATEGORIES",
    "GPU_CATEGORIES",
    "IMPORT_DEADLINE_S",
    "ImportBudget",
    "ImportLedger",
    "ImportStatistics",
    "TorchTraceImportConfig",
    "TraceImportAborted",
    "find_base_time_ns",
    "gputrace_attributes",
    "import_gputrace",
    "import_mlx_steps",
    "import_profile_artifacts",
    "import_torch_trace",
    "is_torch_trace",
    "iter_json_array",
    "iter_trace_events",
]

#: Ranges kept whatever the filter says (``ProfilerStep#N`` and ``record_function`` ranges).
ALWAYS_KEPT_CATEGORIES = frozenset({"user_annotation", "gpu_user_annotation"})
#: Device-side categories: their ``pid`` is the GPU index and ``tid`` the stream (torch's layout).
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
_TAIL_BYTES = 64 * 1024
_BASE_RE = re.compile(r'"baseTimeNanoseconds"\s*:\s*(-?\d+)')
_WS_COMMA = re.compile(r"[\s,]*")
_WS = re.compile(r"\s*")
_decoder = json.JSONDecoder()
#: a flat ``args`` object whose strings hold no braces or escapes (torch's usual args); inside
#: a JSON string an unescaped ``"args":`` cannot occur, so this never matches within a string.
_ARGS = re.compile(r'"args":\s*\{[^{}"]*(?:"[^"\\{}]*"[^{}"]*)*\}')
_ARGS_STRIPPED = '"args":0'
#: Characters read per chunk by default. 64 Ki: measured on real torch 2.13 traces (CPU-only, with
#: stacks, with shapes) by bench/bench_trace_import.py, 64 Ki chunks read 10-15 % faster than 1 Mi
#: ones (each batch's copies stay in the CPU caches) and peak memory grows by ~1 MiB instead of
#: ~12 MiB; 16 Ki is no faster.
CHUNK_CHARS = 1 << 16
#: Longest single JSON value (one trace event, one top-level field) read before the file is
#: refused, characters. torch's biggest events (a range with its Python stack or input shapes)
#: are a few KiB; a writer's unterminated string would otherwise grow the buffer without bound.
MAX_VALUE_CHARS = 4 << 20
#: Most characters read from one file (decompressed for ``.json.gz``), and the largest file
#: opened (apparent size, and blocks allocated), 4 GiB: a 5-step profile of a real vLLM worker with
#: stacks is ~0.5 GiB.
MAX_READ_CHARS = 4 << 30
#: Wall-clock bound of one session's import (every file of it), seconds.
IMPORT_DEADLINE_S = 120.0
#: Most spans imported from one session, all its files together (a real 5-step profile of a TP=8
#: server keeps a few thousand; the per-file caps of :class:`TorchTraceImportConfig` apply too).
MAX_SESSION_SPANS = 25_000
#: Most artifact files (traces, MLX step files, Metal bundles) imported from one session.
MAX_SESSION_FILES = 64




class ImportBudget:
    """What one import may spend: characters read, wall-clock time, and a cancel flag another
    thread sets (the importer's ``close``). Checked at every chunk read, so an import stops within
    one chunk's work (64 Ki characters) of its deadline or of ``cancel()``.

    Args:
        deadline_s: wall-clock bound from now, seconds (``None``: no deadline).
        max_read_chars: characters read over all files of the import (decompressed).
        max_value_chars: longest single JSON value (an event), characters.
        max_spans: spans imported over all files of the import.
        max_files: artifact files imported.
        cancel: a :class:`threading.Event` shared with whoever may stop the import.

    Thread-safe for ``cancel()`` from another thread; the reading is single-threaded.
    """

    __slots__ = ("_cancel", "_deadline", "files", "max_files", "max_read_chars", "max_spans", "max_value_chars", "read_chars", "spans")

    def __init__(
        self,
        *,
        deadline_s: float | None = IMPORT_DEADLINE_S,
        max_read_chars: int = MAX_READ_CHARS,
        max_value_chars: int = MAX_VALUE_CHARS,
        max_spans: int = MAX_SESSION_SPANS,
        max_files: int = MAX_SESSION_FILES,
        cancel: threading.Event | None = None,
    ) -> None:
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self._cancel = cancel if cancel is not None else threading.Event()
        self.max_read_chars = max_read_chars
        self.max_value_chars = max_value_chars
        self.max_spans = max_spans
        self.max_files = max_files
        #: characters read so far
        self.read_chars = 0
        #: spans imported so far (over every file)
        self.spans = 0
        #: artifact files taken so far
        self.files = 0

    def cancel(self) -> None:
        """Stop the import at its next chunk (any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def check(self) -> None:
        """Raise :class:`TraceImportAborted` when cancelled or past the deadline."""
        if self._cancel.is_set():
            raise TraceImportAborted("import cancelled (the agent is stopping)")
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise TraceImportAborted("import deadline passed")

    def spend(self, chars: int) -> None:
        """Count ``chars`` read; raise :class:`TraceImportAborted` over the cap, past the
        deadline or when cancelled."""
        self.read_chars += chars
        if self.read_chars > self.max_read_chars:
            raise TraceImportAborted(f"over the {_size(self.max_read_chars)} read cap")
        self.check()


def _size(n: int) -> str:
    """``n`` bytes in words (``4.0 GiB``, ``512 B``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


#: A decode error this far (characters) or closer to the end of the buffer may be the value being
#: cut by the chunk ("tru|e", "1.|5", "\\u00|e9"): refill; farther, the JSON is malformed.
_TRUNCATION_MARGIN = 64

class TorchTraceImportConfig(BaseModel):
    """Which torch trace events become spans (wiring set in code, not a user setting: the
    mirror imports with these defaults)."""

    categories: tuple[str, ...] = Field(
        default=("cpu_op", "kernel", "gpu_memcpy", "gpu_memset"),
        description="Event categories imported as spans besides the always-kept user annotations.",
    )
    min_duration_us: float = Field(default=10.0, ge=0, description="Ops/kernels shorter than this (µs) are dropped.")
    max_spans: int = Field(default=5000, ge=0, description="Cap on op/kernel spans per trace (user annotations have their own).")
    max_annotation_spans: int = Field(
        default=20_000, ge=0,
        description="Cap on ProfilerStep#N / record_function spans per trace (a real 5-step profile has tens; the file is the server's).",
    )
    reorder_window: int = Field(default=4096, ge=1, description="Events per thread held to restore start-time order.")
    chunk_chars: int = Field(
        default=CHUNK_CHARS, ge=4096, description="Characters read from the trace per chunk (see CHUNK_CHARS)."
    )


class ImportStatistics(NamedTuple):
    """What one import read, kept and dropped."""

    #: trace events read (all phases)
    events: int
    #: spans emitted (always-kept plus filtered)
    kept: int
    #: of ``kept``: ProfilerStep#N / user annotations
    kept_annotations: int
    #: ProfilerStep#N ranges among them
    profiler_steps: int
    #: complete ranges dropped because their category is not imported
    dropped_category: int
    #: complete ranges dropped as shorter than ``min_duration_us``
    dropped_min_duration: int
    #: ranges dropped because ``max_spans`` (or ``max_annotation_spans``) was reached
    dropped_cap: int
    #: events that are not complete ranges (metadata, flows, instants, counters)
    dropped_phase: int
    #: kept ranges that arrived after their thread's reorder window (parented to the session)
    out_of_order: int
    #: distinct (pid, tid) threads with kept spans
    threads: int
    #: the trace's ``baseTimeNanoseconds`` (0 when absent)
    base_time_unix_nano: int
    #: earliest start / latest end of the kept spans, ns since the epoch (0 when none)
    first_start_unix_nano: int
    last_end_unix_nano: int
    #: items that are not events (not an object) or ranges whose times are not finite numbers
    #: in range: dropped, never a span (a hostile or broken file)
    dropped_invalid: int = 0

    @property
    def dropped(self) -> int:
        """All complete ranges dropped by filter or cap."""
        return self.dropped_category + self.dropped_min_duration + self.dropped_cap

    def span_attributes(self) -> dict[str, int]:
        """Counts for the ``profile.session`` span (``servewatch.trace_import.*``)."""
        return {
            "servewatch.trace_import.events": self.events,
            "servewatch.trace_import.kept": self.kept,
            "servewatch.trace_import.kept_annotations": self.kept_annotations,
            "servewatch.trace_import.profiler_steps": self.profiler_steps,
            "servewatch.trace_import.dropped": self.dropped,
            "servewatch.trace_import.dropped_category": self.dropped_category,
            "servewatch.trace_import.dropped_min_duration": self.dropped_min_duration,
            "servewatch.trace_import.dropped_cap": self.dropped_cap,
            "servewatch.trace_import.out_of_order": self.out_of_order,
            "servewatch.trace_import.dropped_invalid": self.dropped_invalid,
        }


def _text_id(value: Any) -> str:
    """pid/tid as a dict key (they may be ints or strings in a trace)."""
    return value if isinstance(value, str) else str(value)


# --- reading ---------------------------------------------------------------------------------


def _open_binary(path: Path, budget: ImportBudget | None = None) -> IO[bytes]:
    """Open a trace file for reading without following a symlink as its last component, and
    only if it is a regular file (never a FIFO or a device a target planted) no larger than the
    budget's read cap, by its apparent size and by the blocks it has allocated (a sparse 1 TiB
    file costs its writer 4 KiB: it is refused by its size, never read).

    Raises:
        OSError: missing, a symlink (``ELOOP``), or unreadable.
        ValueError: not a regular file, or over the cap (:class:`TraceImportAborted`).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        cap = budget.max_read_chars if budget is not None else MAX_READ_CHARS
        allocated = getattr(st, "st_blocks", 0) * 512
        if max(st.st_size, allocated) > cap:
            sparse = " (sparse)" if allocated < st.st_size // 2 else ""
            raise TraceImportAborted(
                f"{_size(st.st_size)} ({_size(allocated)} allocated{sparse}) is over the {_size(cap)} cap"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _OwnedGzip(gzip.GzipFile):
    """A :class:`gzip.GzipFile` over a file object it closes with itself."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__(fileobj=raw, mode="rb")
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def _open_text(path: Path, budget: ImportBudget | None = None) -> IO[str]:
    raw = _open_binary(path, budget)
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(_OwnedGzip(raw), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


def _maybe_truncated(exc: json.JSONDecodeError, buf: str) -> bool:
    """Whether a decode error may only mean the value goes on past the buffer's end (refill and
    retry) rather than malformed JSON (give up now)."""
    return exc.msg.startswith("Unterminated string") or exc.pos >= len(buf) - _TRUNCATION_MARGIN


class _Reader:
    """A sliding character buffer over a text stream (compacted at each refill), within a budget.

    One value being decoded may span chunks: a retry reads at least as much again as is pending
    (so decoding a long value costs linear, not quadratic, time) and a value longer than
    ``budget.max_value_chars`` is refused. Every read is charged to the budget (read cap,
    deadline, cancel). Malformed JSON fails at once, not at the end of the file.
    """

    def __init__(self, f: IO[str], chunk_chars: int, budget: ImportBudget | None = None) -> None:
        self.f = f
        self.chunk = chunk_chars
        self.budget = budget if budget is not None else ImportBudget(deadline_s=None)
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.offset = 0  # absolute position of buf[0] in the stream

    def fill(self, *, grow: bool = False) -> bool:
        """Read one more chunk (``grow``: at least as much as is pending); False at end of file.

        Raises:
            ValueError: the pending value is longer than the budget allows.
            TraceImportAborted: the budget's cap, deadline or cancel.
        """
        if self.eof:
            return False
        pending = len(self.buf) - self.pos
        if pending > self.budget.max_value_chars:
            raise ValueError(
                f"a JSON value longer than {_size(self.budget.max_value_chars)} at offset {self.offset + self.pos}"
                " (an unterminated string?)"
            )
        data = self.f.read(max(self.chunk, pending) if grow else self.chunk)
        if not data:
            self.eof = True
            return False
        self.budget.spend(len(data))
        self.buf = self.buf[self.pos :] + data
        self.offset += self.pos
        self.pos = 0
        return True

    def skip(self, pattern: re.Pattern[str]) -> None:
        while True:
            self.pos = pattern.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf) or not self.fill():
                return

    def peek(self) -> str:
        if self.pos >= len(self.buf) and not self.fill():
            raise ValueError("unexpected end of trace file")
        return self.buf[self.pos]

    def expect(self, char: str) -> None:
        self.skip(_WS)
        got = self.peek()
        if got != char:
            raise ValueError(f"not a Chrome trace: expected {char!r}, found {got!r}")
        self.pos += 1

    def _decode_one(self, buf: str, pos: int) -> tuple[Any, int] | None:
        """``raw_decode`` at ``pos``; ``None`` when the value may go on past the buffer.

        Raises:
            ValueError: malformed JSON, or nested deeper than the decoder allows (its recursion
                limit, ~1,000 levels: a 200,000-deep array is refused, never a RecursionError).
        """
        try:
            return _decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            if _maybe_truncated(exc, buf):
                return None
            raise ValueError(f"malformed JSON at offset {self.offset + exc.pos}: {exc.msg}") from None
        except RecursionError:
            raise ValueError(f"JSON nested too deeply at offset {self.offset + pos}") from None

    def value(self) -> Any:
        """Decode one JSON value at the cursor (refilling while it is incomplete)."""
        self.skip(_WS)
        while True:
            decoded = self._decode_one(self.buf, self.pos)
            if decoded is None:
                if not self.fill(grow=True):
                    raise ValueError("truncated or malformed trace file")
                continue
            obj, end = decoded
            if end >= len(self.buf) and self.fill():
                continue  # a number may continue in the next chunk
            self.pos = end
            return obj

    def events(self) -> Iterator[list[dict[str, Any]]]:
        """Batches of decoded ``traceEvents`` items; the cursor stops after the closing ``]``.

        A batch is the buffer up to its last ``},`` with every flat ``args`` object replaced by
        ``0`` (C-speed ``re.sub``; args are not imported) and decoded in one ``json.loads``.
        JSON being deterministic, that only parses when the cut is a real event boundary;
        otherwise one event is decoded whole by ``JSONDecoder.raw_decode`` and the reader moves
        on, so any valid trace is read correctly. A chunk ending mid-event never parses; the
        buffer is refilled instead (within the budget).
        """
        no_batch_before = 0  # absolute position: no batch cut before it (a "}," inside a value)
        sub = _ARGS.sub
        while True:
            self.skip(_WS_COMMA)
            if self.peek() == "]":
                self.pos += 1
                return
            buf, pos = self.buf, self.pos
            cut = buf.rfind("},", pos)
            if cut > pos and self.offset + cut >= no_batch_before:
                try:
                    batch = json.loads("[" + sub(_ARGS_STRIPPED, buf[pos : cut + 1]) + "]")
                except (json.JSONDecodeError, RecursionError):
                    no_batch_before = self.offset + cut + 1
                else:
                    self.pos = cut + 1
                    yield batch
                    continue
            decoded = self._decode_one(buf, pos)
            if decoded is None:
                if not self.fill(grow=True):
                    raise ValueError("truncated or malformed traceEvents")
                continue
            self.pos = decoded[1]
            yield [decoded[0]]


def iter_json_array(
    path: str | Path,
    array_key: str,
    *,
    chunk_chars: int = CHUNK_CHARS,
    on_field: Callable[[str, Any], None] | None = None,
    budget: ImportBudget | None = None,
) -> Iterator[list[Any]]:
    """Stream the items of the array ``array_key`` of a top-level JSON object as batches, in
    file order, within ``budget`` (memory stays a few times ``chunk_chars`` plus the longest
    item, whatever the file's size).

    Flat ``args`` objects come back as ``0`` (see :meth:`_Reader.events`); every other field is
    as in the file.

    Args:
        path: ``.json`` or ``.json.gz`` file (opened with :func:`_open_binary`'s checks).
        array_key: the top-level key whose array is streamed (``traceEvents``, ``steps``).
        chunk_chars: characters read per chunk.
        on_field: called with ``(key, value)`` for each other top-level field, when it is read
            (a field after the array is seen only after its last item).
        budget: read cap, longest value, deadline and cancel flag (default: no deadline).

    Raises:
        ValueError: the file is not a JSON object, is malformed, truncated, nested too deeply,
            or over the budget (:class:`TraceImportAborted`).
        OSError: the file cannot be read.
    """
    with _open_text(Path(path), budget) as f:
        r = _Reader(f, chunk_chars, budget)
        r.expect("{")
        while True:
            r.skip(_WS_COMMA)
            if r.peek() == "}":
                return
            key = r.value()
            if not isinstance(key, str):
                raise ValueError("not a JSON object: a top-level key is not a string")
            r.expect(":")
            if key == array_key:
                r.expect("[")
                yield from r.events()
            else:
                value = r.value()
                if on_field is not None:
                    on_field(key, value)


def iter_trace_events(
    path: str | Path,
    *,
    chunk_chars: int = CHUNK_CHARS,
    on_field: Callable[[str, Any], None] | None = None,
    budget: ImportBudget | None = None,
) -> Iterator[list[Any]]:
    """Stream the ``traceEvents`` of a Chrome trace as batches of events, in file order
    (:func:`iter_json_array`; an item is normally a dict, but the file decides: check it).

    Raises:
        ValueError: not a Chrome trace object, malformed, truncated or over the budget.
        OSError: the file cannot be read.
    """
    return iter_json_array(path, "traceEvents", chunk_chars=chunk_chars, on_field=on_field, budget=budget)


#: Largest plausible ``baseTimeNanoseconds`` (and span time): what fits OTLP's fixed64 as signed.
_MAX_TIME_NS = (1 << 63) - 1


def find_base_time_ns(path: str | Path, budget: ImportBudget | None = None) -> int | None:
    """``baseTimeNanoseconds`` of a trace without parsing it (head first, then the tail).

    Returns:
        The value in ns since the epoch, or ``None`` when the trace has none or one outside
        ``0..2**63-1``.

    Raises:
        OSError / ValueError: as :func:`iter_json_array` (the gzip tail scan is charged to the budget).
    """
    p = Path(path)
    with _open_text(p, budget) as f:
        head = f.read(_TAIL_BYTES)
    events_at = head.find('"traceEvents"')
    m = _BASE_RE.search(head)
    if m and (events_at < 0 or m.start() < events_at):
        return _base_time(m.group(1))
    if p.name.endswith(".gz"):
        tail = b""
        with _OwnedGzip(_open_binary(p, budget)) as g:
            while block := g.read(1 << 20):
                if budget is not None:
                    budget.spend(len(block))
                tail = (tail + block)[-_TAIL_BYTES:]
    else:
        with _open_binary(p, budget) as b:
            b.seek(max(0, os.fstat(b.fileno()).st_size - _TAIL_BYTES))
            tail = b.read()
    found = _BASE_RE.findall(tail.decode("utf-8", errors="replace"))
    return _base_time(found[-1]) if found else None


def _base_time(digits: str) -> int | None:
    if len(digits) > 20:
        return None
    value = int(digits)
    return value if 0 <= value <= _MAX_TIME_NS else None


# --- import ----------------------------------------------------------------------------------


class _Thread:
    __slots__ = ("heap", "last_start", "stack")

    def __init__(self) -> None:
        #: (start ns, -end ns, sequence, (name, category, pid, tid)) of ranges not emitted yet
        self.heap: list[tuple[int, int, int, tuple[str, str, int | None, int | None]]] = []
        self.stack: list[tuple[int, int]] = []  # (end_ns, span_id) of open kept ranges
        self.last_start = -(1 << 62)


def _as_int(value: Any) -> int | None:
    """A pid/tid/counter as an int: an int, or a short string of digits; else ``None``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if -_MAX_TIME_NS <= value <= _MAX_TIME_NS else None
    if isinstance(value, str) and len(value) <= 20 and value.isdigit():
        return int(value)
    return None


#: Longest span name (and category) taken from a trace, characters.
MAX_NAME_CHARS = 512


def _number(value: Any) -> float | int | None:
    """A JSON number a time can be made of (``None``/missing is 0; NaN, infinities, bools and
    non-numbers are ``None``)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _range_times(ev: dict[str, Any], base_ns: int) -> tuple[int, int] | None:
    """(start, end) in ns since the epoch of a complete range, or ``None`` when its ``ts``/``dur``
    are not finite numbers or fall outside ``0..2**63-1`` (a span OTLP could not carry)."""
    ts, dur = _number(ev.get("ts")), _number(ev.get("dur"))
    if ts is None or dur is None or dur < 0 or abs(ts) > 1e15 or dur > 1e15:
        return None
    start = base_ns + round(ts * 1000)
    end = start + round(dur * 1000)
    return (start, end) if 0 <= start <= end <= _MAX_TIME_NS else None


class _Emitter:
    """Turns one thread's ranges, in start order, into spans nested by time (a range inside
    another is its child; top-level ones are the session span's); a range that starts before
    the last one emitted (past the reorder window) goes under the session span, counted."""

    __slots__ = ("first_start", "last_end", "out_of_order", "parent_span_id", "resource", "sink", "trace_id")

    def __init__(self, sink: SpanSink, *, trace_id: int, parent_span_id: int) -> None:
        self.sink = sink
        self.resource = sink.resource
        self.trace_id = trace_id
        self.parent_span_id = parent_span_id
        self.out_of_order = 0
        self.first_start = 0
        self.last_end = 0

    def add(self, threads: dict[tuple[str, str], _Thread], ev: dict[str, Any], times: tuple[int, int], seq: int, window: int) -> None:
        """Queue one kept range on its ``(pid, tid)`` thread; emit what leaves its reorder window.

        Only what the span needs is held (its name and category cut at :data:`MAX_NAME_CHARS`,
        its pid and tid), never the event itself: an event padded with a megabyte of ``args``
        costs the window a few hundred bytes, whatever the file holds."""
        pid, tid = ev.get("pid", ""), ev.get("tid", "")
        key = (_text_id(pid)[:64], _text_id(tid)[:64])
        th = threads.get(key)
        if th is None:
            th = threads[key] = _Thread()
        held = (str(ev.get("name", ""))[:MAX_NAME_CHARS], str(ev.get("cat", ""))[:MAX_NAME_CHARS], _as_int(pid), _as_int(tid))
        heapq.heappush(th.heap, (times[0], -times[1], seq, held))
        if len(th.heap) > window:
            self.flush(th, window)

    def flush(self, th: _Thread, down_to: int) -> None:
        """Emit the thread's earliest ranges until ``down_to`` are left waiting."""
        heap = th.heap
        while len(heap) > down_to:
            start, neg_end, _, held = heapq.heappop(heap)
            self.emit(th, start, -neg_end, held)

    def emit(self, th: _Thread, start: int, end: int, held: tuple[str, str, int | None, int | None]) -> None:
        stack = th.stack
        if start < th.last_start:
            self.out_of_order += 1
            parent = self.parent_span_id
            push = False
        else:
            while stack and stack[-1][0] <= start:
                stack.pop()
            parent = stack[-1][1] if stack else self.parent_span_id
            push = True
            th.last_start = start
        sid = new_span_id()
        name, cat, pid, tid = held
        self.sink.emit(
            build_span(
                name,
                trace_id=self.trace_id,
                span_id=sid,
                parent_span_id=parent,
                start_time_unix_nano=start,
                end_time_unix_nano=end,
                attributes=_range_attributes(cat, pid, tid),
                resource=self.resource,
            )
        )
        if push:
            stack.append((end, sid))
        if self.first_start == 0 or start < self.first_start:
            self.first_start = start
        self.last_end = max(self.last_end, end)


def _range_attributes(cat: str, pid: int | None, tid: int | None) -> dict[str, Any]:
    """A range's span attributes: its category, and where it ran (a GPU's device and stream, or a
    process and thread)."""
    attrs: dict[str, Any] = {"torch.category": cat}
    if cat in GPU_CATEGORIES:
        if pid is not None:
            attrs["gpu.device"] = pid
        if tid is not None:
            attrs["gpu.stream"] = tid
    else:
        if pid is not None:
            attrs["process.pid"] = pid
        if tid is not None:
            attrs["thread.id"] = tid
    return attrs


def import_torch_trace(
    path: str | Path,
    sink: SpanSink,
    *,
    trace_id: int,
    parent_span_id: int,
    config: TorchTraceImportConfig | None = None,
    budget: ImportBudget | None = None,
) -> ImportStatistics:
    """Emit the ranges of one torch trace as spans under a ``profile.session`` span.

    The file is untrusted (the server wrote it): it is read within ``budget`` (size cap, longest
    value, deadline, cancel), items that are not events and ranges whose ``ts``/``dur`` are not
    finite numbers are dropped and counted (``dropped_invalid``), names are cut at
    :data:`MAX_NAME_CHARS`. Spans already emitted stay emitted when the import fails part way.

    Args:
        path: the trace (``.json`` / ``.json.gz``).
        sink: where finished spans go (spans use ``sink.resource``).
        trace_id / parent_span_id: the session span's ids; top-level ranges become its children.
        config: the keep/drop filter; defaults to :class:`TorchTraceImportConfig`.
        budget: what the import may spend (default: the caps, no deadline).

    Returns:
        Counts of what was read, kept and dropped (put them on the session span with
        :meth:`ImportStatistics.span_attributes`).

    Raises:
        ValueError: not a Chrome trace / malformed / truncated / over the budget
            (:class:`TraceImportAborted`). OSError: unreadable.
    """
    cfg = config or TorchTraceImportConfig()
    base_ns = find_base_time_ns(path, budget) or 0
    window = cfg.reorder_window
    out = _Emitter(sink, trace_id=trace_id, parent_span_id=parent_span_id)
    threads: dict[tuple[str, str], _Thread] = {}
    events = phase = kept = invalid = 0
    ranges_filter = _RangeFilter(cfg, budget)
    for batch in iter_trace_events(path, chunk_chars=cfg.chunk_chars, budget=budget):
        events += len(batch)
        objects = [ev for ev in batch if type(ev) is dict]
        ranges = [ev for ev in objects if ev.get("ph") == "X"]
        invalid += len(batch) - len(objects)
        phase += len(objects) - len(ranges)
        for ev in ranges:
            if not ranges_filter.admits(ev):
                continue
            times = _range_times(ev, base_ns)
            if times is None:
                invalid += 1
                continue
            kept += 1
            out.add(threads, ev, times, kept, window)
    for th in threads.values():
        out.flush(th, 0)
    if budget is not None:
        budget.spans += kept
    return ImportStatistics(
        events=events,
        kept=kept,
        kept_annotations=ranges_filter.ann,
        profiler_steps=ranges_filter.steps,
        dropped_category=ranges_filter.d_cat,
        dropped_min_duration=ranges_filter.d_min,
        dropped_cap=ranges_filter.d_cap,
        dropped_phase=phase,
        out_of_order=out.out_of_order,
        threads=len(threads),
        base_time_unix_nano=base_ns,
        first_start_unix_nano=out.first_start,
        last_end_unix_nano=out.last_end,
        dropped_invalid=invalid + ranges_filter.invalid,
    )


class _RangeFilter:
    """Which ranges of a torch trace are kept (the config's categories, duration and caps, the
    session's spans left in ``budget``), with the counts of what was dropped why."""

    def __init__(self, cfg: TorchTraceImportConfig, budget: ImportBudget | None) -> None:
        self.categories = frozenset(cfg.categories)
        self.min_dur = cfg.min_duration_us
        self.cap = cfg.max_spans
        self.ann_cap = cfg.max_annotation_spans
        self.room = budget.max_spans - budget.spans if budget is not None else 1 << 62  # the session's spans left
        self.ann = self.steps = self.d_cat = self.d_min = self.d_cap = self.ops = self.invalid = 0

    def admits(self, ev: dict[str, Any]) -> bool:
        cat = ev.get("cat")
        if type(cat) is not str:  # missing, or not a name (a list is not even hashable)
            self.d_cat += 1
            return False
        if cat in ALWAYS_KEPT_CATEGORIES:
            return self._annotation(ev)
        if cat not in self.categories:
            self.d_cat += 1
            return False
        return self._op(ev)

    def _annotation(self, ev: dict[str, Any]) -> bool:
        if self.ann >= self.ann_cap or self.ann + self.ops >= self.room:
            self.d_cap += 1
            return False
        self.ann += 1
        if str(ev.get("name", "")).startswith("ProfilerStep#"):
            self.steps += 1
        return True

    def _op(self, ev: dict[str, Any]) -> bool:
        dur = ev.get("dur") or 0
        if type(dur) is not float and type(dur) is not int:
            self.invalid += 1
            return False
        if dur < self.min_dur:
            self.d_min += 1
            return False
        if self.ops >= self.cap or self.ann + self.ops >= self.room:
            self.d_cap += 1
            return False
        self.ops += 1
        return True


#: Most entries (files and folders) walked in a Metal bundle to add up its size.
MAX_GPUTRACE_ENTRIES = 100_000


def gputrace_attributes(path: str | Path, budget: ImportBudget | None = None) -> dict[str, Any]:
    """Artifact attributes of a Metal ``.gputrace`` bundle (a folder) for its session span.

    The walk never follows a link and stops after :data:`MAX_GPUTRACE_ENTRIES` entries (a
    bundle the server wrote may hold anything); the size is then a lower bound.

    Returns:
        ``servewatch.artifact.path`` and ``servewatch.artifact.size_bytes`` (the bundle's total
        file size; 0 when it does not exist) and ``servewatch.artifact.kind`` = ``gputrace``.

    Raises:
        TraceImportAborted: the budget's deadline passed or it was cancelled, mid-walk.
    """
    p = Path(path)
    size = entries = 0
    if p.is_dir() and not p.is_symlink():
        for root, _dirs, files in os.walk(p):
            if budget is not None:
                budget.check()  # the session's deadline and cancel, at every folder
            entries += 1 + len(files)
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    size += st.st_size
            if entries >= MAX_GPUTRACE_ENTRIES:
                break
    elif p.is_file() and not p.is_symlink():
        size = p.stat().st_size
    return {
        "servewatch.artifact.path": str(p.resolve()),
        "servewatch.artifact.size_bytes": size,
        "servewatch.artifact.kind": "gputrace",
    }


#: File name endings of torch Chrome traces (torch's exporter, SGLang's and the SDK's names).
TORCH_TRACE_SUFFIXES = (".trace.json", ".trace.json.gz", ".pt.trace.json", ".pt.trace.json.gz")


def is_torch_trace(path: str | Path) -> bool:
    """Whether a session artifact is a torch Chrome trace (by its name)."""
    return str(path).endswith(TORCH_TRACE_SUFFIXES)


#: File name ending of the SDK's MLX per-step records (:mod:`agent.sdk.profiler`).
MLX_STEPS_SUFFIX = ".mlx-steps.json"
#: Most MLX step records imported from one file.
MAX_MLX_STEPS = 100_000


def import_mlx_steps(
    path: str | Path, sink: SpanSink, *, trace_id: int, parent_span_id: int, budget: ImportBudget | None = None
) -> dict[str, Any]:
    """Import the SDK's MLX per-step records (``*.mlx-steps.json``, the Linux fallback when no
    Metal capture is possible) as ``mlx.step`` child spans of ``parent_span_id``, streaming
    (memory does not grow with the file; reading stops after :data:`MAX_MLX_STEPS` records, or the
    budget's spans left for the session).

    Each record becomes one span with its own start/end times, ``servewatch.forward_ct`` and
    the MLX memory counters as ``mlx.memory.<name>_bytes``. Format per :mod:`agent.sdk.profiler`:
    ``{"session_id", "metal_trace_captured", "detail", "steps": [{...}, ...]}``.

    Returns:
        Attributes for the session span: ``servewatch.mlx.steps`` (imported), and
        ``servewatch.mlx.metal_trace_captured``.

    Raises:
        OSError / ValueError: unreadable, not the SDK's format, or over the budget.
    """
    fields: dict[str, Any] = {}
    imported = 0
    found = False
    limit = MAX_MLX_STEPS if budget is None else max(0, min(MAX_MLX_STEPS, budget.max_spans - budget.spans))

    def on_field(key: str, value: Any) -> None:
        if key == "metal_trace_captured":
            fields[key] = value

    for batch in iter_json_array(path, "steps", on_field=on_field, budget=budget):
        found = True
        for rec in batch:
            if imported >= limit:
                break
            span = _mlx_step_span(rec, sink, trace_id=trace_id, parent_span_id=parent_span_id)
            if span is not None:
                sink.emit(span)
                imported += 1
        if imported >= limit:
            break
    if budget is not None:
        budget.spans += imported
    if not found:
        raise ValueError("not an MLX steps file (no 'steps' list)")
    return {
        "servewatch.mlx.steps": imported,
        "servewatch.mlx.metal_trace_captured": fields.get("metal_trace_captured") is True,
    }


def _mlx_step_span(rec: Any, sink: SpanSink, *, trace_id: int, parent_span_id: int) -> ReadableSpan | None:
    """One MLX step record as an ``mlx.step`` span; ``None`` for a record that is not one."""
    if not isinstance(rec, dict):
        return None
    start = _as_int(rec.get("start_time_unix_nano"))
    end = _as_int(rec.get("end_time_unix_nano"))
    if start is None or end is None or start <= 0:
        return None
    attrs: dict[str, Any] = {}
    forward_ct = _as_int(rec.get("forward_ct"))
    if forward_ct is not None:
        attrs["servewatch.forward_ct"] = forward_ct
    for key, value in list(rec.items())[:64]:
        if key.endswith("_memory_bytes") and _as_int(value) is not None and not isinstance(value, str):
            attrs[f"mlx.memory.{key.removesuffix('_memory_bytes')[:MAX_NAME_CHARS]}_bytes"] = value
    return build_span(
        "mlx.step", trace_id=trace_id, parent_span_id=parent_span_id, start_time_unix_nano=start,
        end_time_unix_nano=max(start, end), attributes=attrs, resource=sink.resource,
    )


def import_gputrace(
    path: str | Path, sink: SpanSink, *, trace_id: int, parent_span_id: int, start_time_unix_nano: int, end_time_unix_nano: int,
    budget: ImportBudget | None = None,
) -> dict[str, Any]:
    """A Metal ``.gputrace`` capture as one ``metal.capture`` child span over the session's
    window, carrying the bundle's path, size and kind (the capture itself opens in Xcode).

    Returns:
        :func:`gputrace_attributes` (also put on the session span).
    """
    attrs = gputrace_attributes(path, budget)
    start = start_time_unix_nano or time.time_ns()
    sink.emit(
        build_span(
            "metal.capture", trace_id=trace_id, parent_span_id=parent_span_id, start_time_unix_nano=start,
            end_time_unix_nano=max(start, end_time_unix_nano), attributes=attrs, resource=sink.resource,
        )
    )
    return attrs


class ImportLedger(Protocol):
    """Remembers, across agent restarts, the trace files whose import failed or never finished,
    so they are never imported again (:class:`exporters.mirror.trace_imports.TraceImportLedger`)."""

    def skipped(self, path: Path) -> str | None:
        """Why ``path`` is not imported (one line), or ``None`` to import it."""
        ...

    def begin(self, path: Path) -> None:
        """``path``'s import starts now (a crash from here on leaves it marked)."""
        ...

    def end(self, path: Path, error: str | None) -> None:
        """``path``'s import ended: unmarked when ``error`` is ``None``, else marked with it."""
        ...


_log = logging.getLogger(__name__)


def import_profile_artifacts(
    paths: Iterable[str | Path],
    sink: SpanSink,
    *,
    trace_id: int,
    parent_span_id: int,
    config: TorchTraceImportConfig | None = None,
    start_time_unix_nano: int = 0,
    end_time_unix_nano: int = 0,
    budget: ImportBudget | None = None,
    ledger: ImportLedger | None = None,
) -> dict[str, Any]:
    """Import a ``profile.session``'s artifacts; return attributes for the session span.

    Torch traces become child spans (:func:`import_torch_trace`, counts summed over files);
    the SDK's MLX per-step records (``.mlx-steps.json``) become ``mlx.step`` child spans
    (:func:`import_mlx_steps`); a Metal ``.gputrace`` capture becomes a ``metal.capture`` child
    span over the session window (``start/end_time_unix_nano``) with its path and size
    (:func:`import_gputrace`). Every file is untrusted: all of them share ``budget`` (default: a
    fresh one with :data:`IMPORT_DEADLINE_S`): at most :data:`MAX_SESSION_FILES` files and
    :data:`MAX_SESSION_SPANS` spans for the session, whatever each file's own caps allow. A file
    that cannot be read, is malformed or runs past the budget is counted in
    ``servewatch.trace_import.errors`` with its error, never raised; with a ``ledger`` it is
    remembered, and a file the ledger names is skipped (counted in
    ``servewatch.trace_import.skipped``, logged as ``trace X skipped: <why>``), as is a file past
    the session's file cap. A cancelled budget imports no further file.

    Returns:
        Span attributes: the ``servewatch.trace_import.*`` counts, ``.files``, ``.errors``,
        ``.skipped`` and ``.error`` (the first error or skip), plus ``servewatch.artifact.*`` for
        a Metal bundle.
    """
    budget = budget if budget is not None else ImportBudget()
    totals: dict[str, Any] = {}
    files = errors = skipped = 0
    first_error = ""
    for p in paths:
        path = Path(p)
        kind = _artifact_kind(path)
        if kind is None:
            continue
        if budget.cancelled:
            break
        remembered = ledger if kind != "gputrace" else None  # a Metal bundle is not a file the ledger names
        why = _skip_reason(path, budget, remembered)
        if why is not None:
            skipped += 1
            _log.warning("trace %s skipped: %s", path, why)
            first_error = first_error or f"{path.name}: skipped: {why}"
            continue
        budget.files += 1
        if remembered is not None:
            remembered.begin(path)
        try:
            attributes = _import_artifact(kind, path, sink, trace_id=trace_id, parent_span_id=parent_span_id, config=config,
                                          window=(start_time_unix_nano, end_time_unix_nano), budget=budget)
        except Exception as exc:  # noqa: BLE001 - a file the server wrote: never the agent's failure
            # OSError (gzip's BadGzipFile), ValueError (malformed, over the budget), EOFError (a
            # truncated .gz), zlib.error (a corrupt one)...
            errors += 1
            error = f"{type(exc).__name__}: {exc}"[:300]
            first_error = first_error or f"{path.name}: {error}"
            if remembered is not None:
                remembered.end(path, error)
            continue
        _add_up(totals, attributes)
        if kind != "gputrace":
            files += 1
        if remembered is not None:
            remembered.end(path, None)
    totals["servewatch.trace_import.files"] = files
    totals["servewatch.trace_import.errors"] = errors
    totals["servewatch.trace_import.skipped"] = skipped
    if first_error:
        totals["servewatch.trace_import.error"] = first_error[:300]
    return totals


def _skip_reason(path: Path, budget: ImportBudget, ledger: ImportLedger | None) -> str | None:
    """Why ``path`` is not imported (the ledger names it, or the session's file cap is reached);
    ``None``: it is."""
    why = ledger.skipped(path) if ledger is not None else None
    if why is None and budget.files >= budget.max_files:
        why = f"over the {budget.max_files} files per session cap"
    return why


def _add_up(totals: dict[str, Any], attributes: dict[str, Any]) -> None:
    for key, value in attributes.items():  # counts add up over files; the rest is the last file's
        totals[key] = totals.get(key, 0) + value if key.startswith("servewatch.trace_import.") else value


def _artifact_kind(path: Path) -> str | None:
    """``gputrace``, ``mlx`` or ``torch`` by the file's name; ``None``: not imported."""
    name = str(path)
    if name.endswith(".gputrace"):
        return "gputrace"
    if name.endswith(MLX_STEPS_SUFFIX):
        return "mlx"
    return "torch" if is_torch_trace(path) else None


def _import_artifact(
    kind: str, path: Path, sink: SpanSink, *, trace_id: int, parent_span_id: int, config: TorchTraceImportConfig | None,
    window: tuple[int, int], budget: ImportBudget,
) -> dict[str, Any]:
    """One artifact of a session: its spans on ``sink``, its attributes for the session span."""
    if kind == "gputrace":
        return import_gputrace(path, sink, trace_id=trace_id, parent_span_id=parent_span_id, start_time_unix_nano=window[0],
                               end_time_unix_nano=window[1], budget=budget)
    if kind == "mlx":
        return import_mlx_steps(path, sink, trace_id=trace_id, parent_span_id=parent_span_id, budget=budget)
    stats = import_torch_trace(path, sink, trace_id=trace_id, parent_span_id=parent_span_id, config=config, budget=budget)
    return stats.span_attributes()
