"""Import torch profiler Chrome traces (``.json`` / ``.json.gz``) as OTel spans, streaming.

Owns the incremental ``traceEvents`` reader, the keep/drop filter, nesting by time containment
and :func:`import_torch_trace`; also :func:`gputrace_attributes` for Metal ``.gputrace``
bundles. Imports the standard library, pydantic and :mod:`exporters.spans`; never torch (a trace
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
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

from pydantic import BaseModel, Field

from exporters.spans import SpanSink, build_span, new_span_id

__all__ = [
    "ALWAYS_KEPT_CATEGORIES",
    "GPU_CATEGORIES",
    "ImportStatistics",
    "TorchTraceImportConfig",
    "find_base_time_ns",
    "gputrace_attributes",
    "import_gputrace",
    "import_mlx_steps",
    "import_profile_artifacts",
    "import_torch_trace",
    "is_torch_trace",
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

class TorchTraceImportConfig(BaseModel):
    """Which torch trace events become spans (wiring set in code, not a user setting: the
    mirror imports with these defaults)."""

    categories: tuple[str, ...] = Field(
        default=("cpu_op", "kernel", "gpu_memcpy", "gpu_memset"),
        description="Event categories imported as spans besides the always-kept user annotations.",
    )
    min_duration_us: float = Field(default=10.0, ge=0, description="Ops/kernels shorter than this (µs) are dropped.")
    max_spans: int = Field(default=5000, ge=0, description="Cap on op/kernel spans per trace (user annotations are not capped).")
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
    #: ranges dropped because ``max_spans`` was reached
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
        }


def _text_id(value: Any) -> str:
    """pid/tid as a dict key (they may be ints or strings in a trace)."""
    return value if isinstance(value, str) else str(value)


# --- reading ---------------------------------------------------------------------------------


def _open_binary(path: Path) -> IO[bytes]:
    """Open a trace file for reading without following a symlink as its last component, and
    only if it is a regular file (never a FIFO or a device a target planted).

    Raises:
        OSError: missing, a symlink (``ELOOP``), or unreadable.
        ValueError: not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
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


def _open_text(path: Path) -> IO[str]:
    raw = _open_binary(path)
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(_OwnedGzip(raw), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


class _Reader:
    """A sliding character buffer over a text stream (compacted at each refill)."""

    def __init__(self, f: IO[str], chunk_chars: int) -> None:
        self.f = f
        self.chunk = chunk_chars
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.offset = 0  # absolute position of buf[0] in the stream

    def fill(self) -> bool:
        """Read one more chunk; False at end of file."""
        if self.eof:
            return False
        data = self.f.read(self.chunk)
        if not data:
            self.eof = True
            return False
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

    def value(self) -> Any:
        """Decode one JSON value at the cursor (refilling while it is incomplete)."""
        self.skip(_WS)
        while True:
            try:
                obj, end = _decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError:
                if not self.fill():
                    raise ValueError("truncated or malformed trace file") from None
                continue
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
        buffer is refilled instead.
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
                except json.JSONDecodeError:
                    no_batch_before = self.offset + cut + 1
                else:
                    self.pos = cut + 1
                    yield batch
                    continue
            try:
                obj, end = _decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if not self.fill():
                    raise ValueError("truncated or malformed traceEvents") from None
                continue
            self.pos = end
            yield [obj]


def iter_trace_events(
    path: str | Path, *, chunk_chars: int = CHUNK_CHARS, on_field: Callable[[str, Any], None] | None = None
) -> Iterator[list[dict[str, Any]]]:
    """Stream the ``traceEvents`` of a Chrome trace as batches of event dicts, in file order.

    Flat ``args`` objects come back as ``0`` (see :meth:`_Reader.events`); every other field is
    as in the file.

    Args:
        path: ``.json`` or ``.json.gz`` file.
        chunk_chars: characters read per chunk (memory use is a few times this).
        on_field: called with ``(key, value)`` for each other top-level field, when it is read
            (a field after ``traceEvents`` is seen only after the last event).

    Raises:
        ValueError: the file is not a Chrome trace object or is truncated.
        OSError: the file cannot be read.
    """
    with _open_text(Path(path)) as f:
        r = _Reader(f, chunk_chars)
        r.expect("{")
        while True:
            r.skip(_WS_COMMA)
            if r.peek() == "}":
                return
            key = r.value()
            if not isinstance(key, str):
                raise ValueError("not a Chrome trace: top-level key is not a string")
            r.expect(":")
            if key == "traceEvents":
                r.expect("[")
                yield from r.events()
            else:
                value = r.value()
                if on_field is not None:
                    on_field(key, value)


def find_base_time_ns(path: str | Path) -> int | None:
    """``baseTimeNanoseconds`` of a trace without parsing it (head first, then the tail).

    Returns:
        The value in ns since the epoch, or ``None`` when the trace has none.
    """
    p = Path(path)
    with _open_text(p) as f:
        head = f.read(_TAIL_BYTES)
    events_at = head.find('"traceEvents"')
    m = _BASE_RE.search(head)
    if m and (events_at < 0 or m.start() < events_at):
        return int(m.group(1))
    if p.name.endswith(".gz"):
        tail = b""
        with _OwnedGzip(_open_binary(p)) as g:
            while block := g.read(1 << 20):
                tail = (tail + block)[-_TAIL_BYTES:]
    else:
        with _open_binary(p) as b:
            b.seek(max(0, os.fstat(b.fileno()).st_size - _TAIL_BYTES))
            tail = b.read()
    found = _BASE_RE.findall(tail.decode("utf-8", errors="replace"))
    return int(found[-1]) if found else None


# --- import ----------------------------------------------------------------------------------


class _Thread:
    __slots__ = ("heap", "last_start", "stack")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, int, dict[str, Any]]] = []
        self.stack: list[tuple[int, int]] = []  # (end_ns, span_id) of open kept ranges
        self.last_start = -(1 << 62)


def _as_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


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

    def flush(self, th: _Thread, down_to: int) -> None:
        """Emit the thread's earliest ranges until ``down_to`` are left waiting."""
        heap = th.heap
        while len(heap) > down_to:
            start, neg_end, _, ev = heapq.heappop(heap)
            self.emit(th, start, -neg_end, ev)

    def emit(self, th: _Thread, start: int, end: int, ev: dict[str, Any]) -> None:
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
        cat = str(ev.get("cat", ""))
        self.sink.emit(
            build_span(
                str(ev.get("name", "")),
                trace_id=self.trace_id,
                span_id=sid,
                parent_span_id=parent,
                start_time_unix_nano=start,
                end_time_unix_nano=end,
                attributes=_range_attributes(cat, _as_int(ev.get("pid")), _as_int(ev.get("tid"))),
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
) -> ImportStatistics:
    """Emit the ranges of one torch trace as spans under a ``profile.session`` span.

    Args:
        path: the trace (``.json`` / ``.json.gz``).
        sink: where finished spans go (spans use ``sink.resource``).
        trace_id / parent_span_id: the session span's ids; top-level ranges become its children.
        config: the keep/drop filter; defaults to :class:`TorchTraceImportConfig`.

    Returns:
        Counts of what was read, kept and dropped (put them on the session span with
        :meth:`ImportStatistics.span_attributes`).

    Raises:
        ValueError: not a Chrome trace / truncated. OSError: unreadable.
    """
    cfg = config or TorchTraceImportConfig()
    base_ns = find_base_time_ns(path) or 0
    categories = frozenset(cfg.categories)
    min_dur = cfg.min_duration_us
    cap = cfg.max_spans
    window = cfg.reorder_window
    out = _Emitter(sink, trace_id=trace_id, parent_span_id=parent_span_id)
    threads: dict[tuple[str, str], _Thread] = {}
    seq = events = phase = ann = steps = d_cat = d_min = d_cap = ops = kept = 0
    always = ALWAYS_KEPT_CATEGORIES
    for batch in iter_trace_events(path, chunk_chars=cfg.chunk_chars):
        events += len(batch)
        for ev in batch:
            if ev.get("ph") != "X":
                phase += 1
                continue
            cat = ev.get("cat")
            if cat in always:
                ann += 1
                if str(ev.get("name", "")).startswith("ProfilerStep#"):
                    steps += 1
            elif cat not in categories:
                d_cat += 1
                continue
            elif (ev.get("dur") or 0) < min_dur:
                d_min += 1
                continue
            elif ops >= cap:
                d_cap += 1
                continue
            else:
                ops += 1
            start = base_ns + round((ev.get("ts") or 0) * 1000)
            end = start + round((ev.get("dur") or 0) * 1000)
            key = (_text_id(ev.get("pid", "")), _text_id(ev.get("tid", "")))
            th = threads.get(key)
            if th is None:
                th = threads[key] = _Thread()
            seq += 1
            kept += 1
            heapq.heappush(th.heap, (start, -end, seq, ev))
            if len(th.heap) > window:
                out.flush(th, window)
    for th in threads.values():
        out.flush(th, 0)
    return ImportStatistics(
        events=events,
        kept=kept,
        kept_annotations=ann,
        profiler_steps=steps,
        dropped_category=d_cat,
        dropped_min_duration=d_min,
        dropped_cap=d_cap,
        dropped_phase=phase,
        out_of_order=out.out_of_order,
        threads=len(threads),
        base_time_unix_nano=base_ns,
        first_start_unix_nano=out.first_start,
        last_end_unix_nano=out.last_end,
    )


def gputrace_attributes(path: str | Path) -> dict[str, Any]:
    """Artifact attributes of a Metal ``.gputrace`` bundle (a folder) for its session span.

    Returns:
        ``servewatch.artifact.path`` and ``servewatch.artifact.size_bytes`` (the bundle's total
        file size; 0 when it does not exist) and ``servewatch.artifact.kind`` = ``gputrace``.
    """
    p = Path(path)
    size = 0
    if p.is_dir():
        for root, _dirs, files in os.walk(p):
            for name in files:
                try:
                    size += os.path.getsize(os.path.join(root, name))
                except OSError:
                    continue
    elif p.is_file():
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
    path: str | Path, sink: SpanSink, *, trace_id: int, parent_span_id: int
) -> dict[str, Any]:
    """Import the SDK's MLX per-step records (``*.mlx-steps.json``, the Linux fallback when no
    Metal capture is possible) as ``mlx.step`` child spans of ``parent_span_id``.

    Each record becomes one span with its own start/end times, ``servewatch.forward_ct`` and
    the MLX memory counters as ``mlx.memory.<name>_bytes``.

    Returns:
        Attributes for the session span: ``servewatch.mlx.steps`` (imported), and
        ``servewatch.mlx.metal_trace_captured``.

    Raises:
        OSError / ValueError: unreadable or not the SDK's format.
    """
    body = json.loads(Path(path).read_text())
    if not isinstance(body, dict) or not isinstance(body.get("steps"), list):
        raise ValueError("not an MLX steps file (no 'steps' list)")
    imported = 0
    for rec in body["steps"][:MAX_MLX_STEPS]:
        if not isinstance(rec, dict):
            continue
        start = _as_int(rec.get("start_time_unix_nano"))
        end = _as_int(rec.get("end_time_unix_nano"))
        if start is None or end is None or start <= 0:
            continue
        attrs: dict[str, Any] = {}
        forward_ct = _as_int(rec.get("forward_ct"))
        if forward_ct is not None:
            attrs["servewatch.forward_ct"] = forward_ct
        for key, value in rec.items():
            if key.endswith("_memory_bytes") and isinstance(value, int) and not isinstance(value, bool):
                attrs[f"mlx.memory.{key.removesuffix('_memory_bytes')}_bytes"] = value
        sink.emit(
            build_span(
                "mlx.step", trace_id=trace_id, parent_span_id=parent_span_id, start_time_unix_nano=start,
                end_time_unix_nano=max(start, end), attributes=attrs, resource=sink.resource,
            )
        )
        imported += 1
    return {
        "servewatch.mlx.steps": imported,
        "servewatch.mlx.metal_trace_captured": bool(body.get("metal_trace_captured", False)),
    }


def import_gputrace(
    path: str | Path, sink: SpanSink, *, trace_id: int, parent_span_id: int, start_time_unix_nano: int, end_time_unix_nano: int
) -> dict[str, Any]:
    """A Metal ``.gputrace`` capture as one ``metal.capture`` child span over the session's
    window, carrying the bundle's path, size and kind (the capture itself opens in Xcode).

    Returns:
        :func:`gputrace_attributes` (also put on the session span).
    """
    attrs = gputrace_attributes(path)
    start = start_time_unix_nano or time.time_ns()
    sink.emit(
        build_span(
            "metal.capture", trace_id=trace_id, parent_span_id=parent_span_id, start_time_unix_nano=start,
            end_time_unix_nano=max(start, end_time_unix_nano), attributes=attrs, resource=sink.resource,
        )
    )
    return attrs


def import_profile_artifacts(
    paths: Iterable[str | Path],
    sink: SpanSink,
    *,
    trace_id: int,
    parent_span_id: int,
    config: TorchTraceImportConfig | None = None,
    start_time_unix_nano: int = 0,
    end_time_unix_nano: int = 0,
) -> dict[str, Any]:
    """Import a ``profile.session``'s artifacts; return attributes for the session span.

    Torch traces become child spans (:func:`import_torch_trace`, counts summed over files);
    the SDK's MLX per-step records (``.mlx-steps.json``) become ``mlx.step`` child spans
    (:func:`import_mlx_steps`); a Metal ``.gputrace`` capture becomes a ``metal.capture`` child
    span over the session window (``start/end_time_unix_nano``) with its path and size
    (:func:`import_gputrace`). A file that cannot be read is counted in
    ``servewatch.trace_import.errors`` with its error, never raised.

    Returns:
        Span attributes: the ``servewatch.trace_import.*`` counts, ``.files``, ``.errors`` and
        ``.error`` (the first error), plus ``servewatch.artifact.*`` for a Metal bundle.
    """
    totals: dict[str, Any] = {}
    files = errors = 0
    first_error = ""
    for p in paths:
        path = Path(p)
        if str(path).endswith(".gputrace"):
            totals.update(import_gputrace(path, sink, trace_id=trace_id, parent_span_id=parent_span_id,
                                          start_time_unix_nano=start_time_unix_nano, end_time_unix_nano=end_time_unix_nano))
            continue
        if str(path).endswith(MLX_STEPS_SUFFIX):
            try:
                totals.update(import_mlx_steps(path, sink, trace_id=trace_id, parent_span_id=parent_span_id))
            except (OSError, ValueError) as exc:
                errors += 1
                first_error = first_error or f"{path.name}: {type(exc).__name__}: {exc}"
                continue
            files += 1
            continue
        if not is_torch_trace(path):
            continue
        try:
            stats = import_torch_trace(path, sink, trace_id=trace_id, parent_span_id=parent_span_id, config=config)
        except (OSError, ValueError, EOFError) as exc:  # gzip's EOFError: a truncated .gz
            errors += 1
            first_error = first_error or f"{path.name}: {type(exc).__name__}: {exc}"
            continue
        files += 1
        for key, value in stats.span_attributes().items():
            totals[key] = totals.get(key, 0) + value
    totals["servewatch.trace_import.files"] = files
    totals["servewatch.trace_import.errors"] = errors
    if first_error:
        totals["servewatch.trace_import.error"] = first_error[:300]
    return totals
