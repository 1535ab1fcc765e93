"""OTLP/JSON encoding and the JSON-lines span files (the collector's file format).

Owns the OTLP/JSON mapping of ``ExportTraceServiceRequest`` / ``ExportMetricsServiceRequest``,
:func:`read_otlp_json_lines` and :class:`RotatingJsonLinesWriter`.

Per the OTLP/JSON rules in the OTLP specification: keys are lowerCamelCase, enum values are
integers, 64-bit integers (timestamps, ``intValue``) are decimal strings, and ``traceId`` /
``spanId`` / ``parentSpanId`` are lowercase HEX, not base64. protobuf's ``json_format`` gets
everything right except the ids, which it would base64 — so ids are rewritten both ways here.
Writing maps OTLP's fields itself, straight to text: the same text as ``json.dumps`` of
``json_format``'s tree, with the field rules worked out once per field, attribute lists written
without a ``ListFields`` per value and remembered, and no dict tree (11.5 us of CPU per demo
request or forward span, against 20 us for a dict tree of our own and ``json.dumps``, and ~3x that
through ``json_format``); other messages go to ``json_format``.
One request per line is what the collector's ``otlpjsonfile`` receiver reads.

Imports protobuf and opentelemetry-proto only (and :mod:`agent.host.fsutil`, when a writer opens a file).
"""

from __future__ import annotations

import base64
import binascii
import json
import json.encoder
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

__all__ = [
    "ID_KEYS",
    "SPAN_FILE_SUFFIXES",
    "RotatingJsonLinesWriter",
    "TornLines",
    "iter_span_files",
    "message_from_json",
    "message_to_json",
    "read_otlp_json_lines",
    "read_span_file",
    "request_from_json",
    "request_to_json",
]

M = TypeVar("M", bound=Message)

#: a str as ``json.dumps`` writes it by default (quoted, escaped, ASCII only: the C encoder)
_json_string: Callable[[str], str] = json.encoder.encode_basestring_ascii

#: JSON keys whose bytes value is an id (hex in OTLP/JSON).
ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId"})


def _ids_to_hex(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ID_KEYS and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            elif isinstance(value, (dict, list)):
                _ids_to_hex(value)
    elif isinstance(node, list):
        for item in node:
            if isinstance(item, (dict, list)):
                _ids_to_hex(item)


def _ids_to_base64(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ID_KEYS and isinstance(value, str):
                try:
                    raw = bytes.fromhex(value)
                except ValueError as exc:
                    raise ValueError(f"{key} {value!r} is not hex (OTLP/JSON ids are hex)") from exc
                node[key] = base64.b64encode(raw).decode("ascii")
            elif isinstance(value, (dict, list)):
                _ids_to_base64(value)
    elif isinstance(node, list):
        for item in node:
            if isinstance(item, (dict, list)):
                _ids_to_base64(item)


class _Unsupported(Exception):
    """A field :func:`_to_text` does not map itself (``json_format`` does it)."""


# How :func:`_to_text` writes a field's value (``json_format``'s rules with integer enums, for the
# field types OTLP uses; anything else is left to ``json_format``). ``_KEYVALUES``: a repeated
# ``KeyValue`` field (every attribute list of OTLP), written by :func:`_keyvalues`.
_MESSAGE, _STRING, _BOOL, _INT, _BYTES, _ID, _INT64, _DOUBLE, _KEYVALUES = range(9)
#: field descriptor -> (``"jsonKey":``, how, repeated)
_FIELD_PLANS: dict[Any, tuple[str, int, bool]] = {}
_INFINITY, _NEG_INFINITY, _NAN = '"Infinity"', '"-Infinity"', '"NaN"'
#: the message type whose repeated fields :func:`_keyvalues` writes
_KEYVALUE = "opentelemetry.proto.common.v1.KeyValue"
#: whether this opentelemetry-proto's ``KeyValue`` has ``key_strindex`` (1.5+): checked per value
_KV_STRINDEX = "key_strindex" in KeyValue.DESCRIPTOR.fields_by_name
#: :func:`_keyvalues` writes a ``KeyValue`` of these fields only (else :func:`_to_text`, field by field)
_KV_FAST = set(KeyValue.DESCRIPTOR.fields_by_name) <= {"key", "value", "key_strindex"}
#: the ``AnyValue`` oneof members :func:`_keyvalues` writes itself, and how
_SCALAR_VALUES = {"string_value": _STRING, "bool_value": _BOOL, "int_value": _INT64}
_SCALAR_KEYS = {"string_value": '{"stringValue":', "bool_value": '{"boolValue":', "int_value": '{"intValue":'}


def _message_how(field: Any) -> int:
    if field.message_type.full_name.startswith("google.protobuf."):  # well-known types, wrappers
        raise _Unsupported(field.full_name)
    return _KEYVALUES if field.is_repeated and _KV_FAST and field.message_type.full_name == _KEYVALUE else _MESSAGE


def _plan(field: Any) -> tuple[str, int, bool]:
    fd = FieldDescriptor
    if field.is_extension or (field.message_type is not None and field.message_type.GetOptions().map_entry):
        raise _Unsupported(field.full_name)
    name, cpp, repeated = field.json_name, field.cpp_type, field.is_repeated
    if cpp == fd.CPPTYPE_MESSAGE:
        how = _message_how(field)
    elif cpp == fd.CPPTYPE_STRING and field.type == fd.TYPE_BYTES:
        how = _ID if name in ID_KEYS and not repeated else _BYTES
    elif cpp in (fd.CPPTYPE_INT64, fd.CPPTYPE_UINT64):
        how = _INT64
    elif cpp == fd.CPPTYPE_DOUBLE:
        how = _DOUBLE
    elif cpp in (fd.CPPTYPE_INT32, fd.CPPTYPE_UINT32, fd.CPPTYPE_ENUM):
        how = _INT
    elif cpp == fd.CPPTYPE_BOOL:
        how = _BOOL
    elif cpp == fd.CPPTYPE_STRING and name not in ID_KEYS:
        how = _STRING
    else:  # 32-bit floats (shortest repr), a string field named like an id
        raise _Unsupported(field.full_name)
    plan = _FIELD_PLANS[field] = (_json_string(name) + ":", how, repeated)
    return plan


def _double(value: float) -> str:
    """A double as ``json.dumps`` writes it (``repr``), the non-finite ones as OTLP/JSON's strings."""
    if math.isinf(value):
        return _INFINITY if value > 0 else _NEG_INFINITY
    return _NAN if math.isnan(value) else float.__repr__(value)


def _to_text(message: Message) -> str:
    """``json.dumps(json_format.MessageToDict(message, use_integers_for_enums=True),
    separators=(",", ":"))`` with the ids in hex, for OTLP's messages, written straight to text
    (no dict tree, no second pass): each field's mapping is worked out once per field, not per
    value, and attribute lists are written by :func:`_keyvalues`. Raises :class:`_Unsupported` on
    a field it does not map (then ``json_format`` does)."""
    parts = []
    plans = _FIELD_PLANS
    for field, value in message.ListFields():
        plan = plans.get(field)
        key, how, repeated = plan if plan is not None else _plan(field)
        if how == _KEYVALUES:
            parts.append(key + "[" + ",".join(_keyvalues(value)) + "]")
        elif repeated:
            write = _WRITE[how]
            parts.append(key + "[" + ",".join([write(v) for v in value]) + "]")
        else:
            parts.append(key + _WRITE[how](value))
    return "{" + ",".join(parts) + "}"


#: ``KeyValue`` texts of scalar attributes seen recently, by ``(key, value's oneof member, value)``:
#: the keys, model names, operation names and small counts of request and forward spans repeat
_KV_TEXTS: dict[tuple[str, str, Any], str] = {}
_KV_TEXTS_MAX = 8192


def _keyvalues(values: Any) -> list[str]:
    """A repeated ``KeyValue`` field's items as :func:`_to_text` writes each (the same text),
    without a ``ListFields`` call per ``KeyValue`` and ``AnyValue``: string, bool and int values
    are written here (and remembered, :data:`_KV_TEXTS`), anything else by :func:`_to_text`."""
    out = []
    cache = _KV_TEXTS
    for kv in values:
        value = kv.value
        which = value.WhichOneof("value")
        how = _SCALAR_VALUES.get(which) if which is not None else None
        if how is None or (_KV_STRINDEX and kv.key_strindex):  # doubles, arrays, bytes, string-table refs, unset
            out.append(_to_text(kv))
            continue
        raw = getattr(value, which)
        ck = (kv.key, which, raw)
        text = cache.get(ck)
        if text is None:
            key = ck[0]
            text = ('{"key":' + _json_string(key) + "," if key else "{") + '"value":' + _SCALAR_KEYS[which] + _WRITE[how](raw) + "}}"
            if how != _STRING or len(raw) <= 64:
                if len(cache) >= _KV_TEXTS_MAX:
                    cache.clear()
                cache[ck] = text
        out.append(text)
    return out


def _base64(value: bytes) -> str:
    return '"' + base64.b64encode(value).decode("ascii") + '"'


def _hex(value: bytes) -> str:
    return '"' + value.hex() + '"'


def _int64(value: int) -> str:
    return '"' + int.__repr__(value) + '"'


def _bool(value: bool) -> str:
    return "true" if value else "false"


#: how each value of a field is written, by its plan's ``how`` (but attribute lists)
_WRITE: dict[int, Callable[[Any], str]] = {
    _MESSAGE: _to_text, _STRING: _json_string, _BOOL: _bool, _INT: int.__repr__, _BYTES: _base64, _ID: _hex,
    _INT64: _int64, _DOUBLE: _double,
}


def message_to_json(message: Message) -> str:
    """One OTLP message as a single OTLP/JSON line (no trailing newline): the text of
    ``json.dumps(tree, separators=(",", ":"))``, ASCII only."""
    if not message.DESCRIPTOR.full_name.startswith("google.protobuf."):
        try:
            return _to_text(message)
        except _Unsupported:
            pass
    tree = json_format.MessageToDict(message, use_integers_for_enums=True)
    _ids_to_hex(tree)
    return json.dumps(tree, separators=(",", ":"))


def message_from_json(line: str | bytes, message_type: type[M]) -> M:
    """Parse one OTLP/JSON line into ``message_type`` (unknown fields ignored, as the spec asks).

    Raises:
        ValueError: not JSON, not OTLP, or an id that is not hex.
    """
    try:
        tree = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    _ids_to_base64(tree)
    message = message_type()
    try:
        json_format.ParseDict(tree, message, ignore_unknown_fields=True)
    except (json_format.ParseError, binascii.Error) as exc:
        raise ValueError(f"not an OTLP/JSON {message_type.__name__}: {exc}") from exc
    return message


def request_to_json(request: ExportTraceServiceRequest) -> str:
    """An ``ExportTraceServiceRequest`` as one OTLP/JSON line."""
    return message_to_json(request)


def request_from_json(line: str | bytes) -> ExportTraceServiceRequest:
    """Inverse of :func:`request_to_json`. Raises ``ValueError`` on malformed input."""
    return message_from_json(line, ExportTraceServiceRequest)


class TornLines:
    """Counts the lines a reader skipped: torn last lines (a writer interrupted mid-line: disk
    full, kill) and corrupt lines elsewhere (a damaged file: bit rot, a concurrent foreign write)."""

    __slots__ = ("corrupt", "count", "first_corrupt")

    def __init__(self) -> None:
        #: torn (unterminated, undecodable) last lines skipped
        self.count = 0
        #: undecodable lines before the last one, skipped
        self.corrupt = 0
        #: ``file:line: why`` of the first corrupt line (``""`` when none)
        self.first_corrupt = ""


def read_otlp_json_lines(
    path: str | os.PathLike[str], torn: TornLines | None = None, *, contains: bytes | None = None
) -> Iterator[ExportTraceServiceRequest]:
    """Yield each trace request of an OTLP/JSON lines file, in file order.

    Blank lines are skipped; a truncated last line (a writer killed mid-line, a full disk) is
    skipped too and counted in ``torn``: it costs that line only. With ``torn`` given, a corrupt
    line elsewhere is skipped and counted too (``torn.corrupt``): the rest of the file is read.

    Args:
        path: the file.
        torn: counts the truncated last line and the corrupt ones; ``None``: a corrupt line raises.
        contains: when given, lines without these bytes are skipped unparsed (a hex trace id:
            reading one trace out of a large file; a torn last line is still counted).

    Raises:
        ValueError: without ``torn``, a line that is not an OTLP/JSON trace request (other than a
            truncated last one).
    """
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")
    last = len(lines) - 1
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        if contains is not None and contains not in line:
            if number == last and torn is not None and not _is_json(line):
                torn.count += 1
            continue
        try:
            request = request_from_json(line)
        except ValueError as exc:
            if number == last:  # no trailing newline: an interrupted write
                if torn is not None:
                    torn.count += 1
                return
            if torn is None:
                raise ValueError(f"{path}:{number + 1}: {exc}") from exc
            torn.corrupt += 1
            torn.first_corrupt = torn.first_corrupt or f"{path}:{number + 1}: {exc}"
            continue
        yield request


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


#: File kinds :func:`read_span_file` reads: OTLP/JSON lines, and one binary protobuf request
#: (``.binpb``, what the spool writes: ~50x cheaper to write and parse than JSON).
SPAN_FILE_SUFFIXES = (".jsonl", ".json", ".binpb")


def read_span_file(
    path: str | os.PathLike[str], torn: TornLines | None = None, *, contains: bytes | None = None
) -> Iterator[ExportTraceServiceRequest]:
    """Yield the trace requests in a span file: ``.binpb`` holds one binary protobuf
    ``ExportTraceServiceRequest``; anything else is read as OTLP/JSON lines.

    Args:
        path: the file.
        torn: counts a truncated last OTLP/JSON line.
        contains: OTLP/JSON lines only: skip lines without these bytes unparsed (see
            :func:`read_otlp_json_lines`); a ``.binpb`` file is always read whole.

    Raises:
        ValueError: the content is not what the suffix says.
    """
    if str(path).endswith(".binpb"):
        request = ExportTraceServiceRequest()
        with open(path, "rb") as fh:
            data = fh.read()
        try:
            request.ParseFromString(data)
        except Exception as exc:  # protobuf's DecodeError; its base class differs by backend
            raise ValueError(f"{path}: not a protobuf ExportTraceServiceRequest: {exc}") from exc
        yield request
        return
    yield from read_otlp_json_lines(path, torn, contains=contains)


#: What a folder walk picks up: span files only. Bundles beside them hold ``manifest.json``,
#: ``requests.json`` and stack dumps, which are not OTLP; metrics files are not spans.
_WALK_SUFFIXES = (".jsonl", ".binpb")


def iter_span_files(paths: Iterable[str | os.PathLike[str]]) -> Iterator[Path]:
    """Expand files and folders into span files, sorted by name within a folder (spool and
    rotated file names sort in write order). Files named explicitly are taken as they are; in a
    folder only ``*.jsonl`` and ``*.binpb`` count, ``metrics-*`` excluded."""
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = [
                p
                for p in path.rglob("*")
                if p.suffix in _WALK_SUFFIXES
                and not p.name.startswith("metrics-")
                and not p.name.endswith(".metrics.binpb")  # the metrics spool (exporters.otlp.metrics_export)
                and not p.name.startswith(".")  # temp files of atomic writes
                and p.is_file()
            ]
            yield from sorted(found, key=lambda p: (str(p.parent), p.name))
        else:
            yield path


class RotatingJsonLinesWriter:
    """Appends OTLP/JSON lines to ``<directory>/<prefix>-<start>-<pid>-<seq>.jsonl``, rotating by size.

    Args:
        directory: created when missing.
        prefix: file name prefix (``spans``, ``metrics``).
        max_file_bytes: start a new file when the next line would pass this size.
        max_files: keep at most this many of *this writer's* files; older ones are deleted and
            counted in :attr:`evicted_files` / :attr:`evicted_spans` (0 keeps everything).
    """

    def __init__(self, directory: Path, *, prefix: str, max_file_bytes: int, max_files: int) -> None:
        self.directory = Path(directory)
        self.prefix = prefix
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self._lock = threading.Lock()
        self._stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self._seq = 0
        self._fh: Any = None
        self._size_bytes = 0
        self._files: list[tuple[Path, int]] = []  # (path, items) oldest first
        #: files deleted because of ``max_files``
        self.evicted_files = 0
        #: items (spans) in those files
        self.evicted_spans = 0
        #: lines written
        self.lines_written = 0

    @property
    def current_path(self) -> Path | None:
        return self._files[-1][0] if self._files else None

    def _open_next(self) -> None:
        # the writer's only: reading span files (timeline, report, export) needs no agent.host.fsutil
        from agent.host.fsutil import ensure_private_dir, open_append_nofollow

        if self._fh is not None:
            self._fh.close()
        ensure_private_dir(self.directory)
        self._seq += 1
        path = self.directory / f"{self.prefix}-{self._stamp}-{os.getpid()}-{self._seq:06d}.jsonl"
        # 0600, never through a symlink someone planted where the file will be
        self._fh = os.fdopen(open_append_nofollow(path), "ab")
        self._size_bytes = self._fh.tell()
        self._files.append((path, 0))
        while self.max_files and len(self._files) > self.max_files:
            old, items = self._files.pop(0)
            try:
                old.unlink()
            except FileNotFoundError:
                pass
            self.evicted_files += 1
            self.evicted_spans += items

    def write_line(self, line: str, items: int = 0) -> Path:
        """Append one line (newline added) and flush it to the OS.

        Args:
            line: one OTLP/JSON document without newline.
            items: spans (or data points) in it, for eviction counts.

        Returns:
            The file written.

        Raises:
            OSError: the write failed (disk full, permissions).
        """
        data = line.encode("utf-8") + b"\n"
        with self._lock:
            if self._fh is None or (self._size_bytes and self._size_bytes + len(data) > self.max_file_bytes):
                self._open_next()
            self._fh.write(data)
            self._fh.flush()
            self._size_bytes += len(data)
            path, count = self._files[-1]
            self._files[-1] = (path, count + items)
            self.lines_written += 1
            return path

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
