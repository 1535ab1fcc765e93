"""Request and forward spans leave the server through a local channel; the agent ships them.

Owns the channel policy (:func:`start_span`), :class:`ChannelSpan` (a recording
``opentelemetry.trace.Span`` that, when it ends, becomes one compact JSON record in the span
ring of :mod:`agent.sdk.ring`) and :func:`statistics`. Imports the standard library and
opentelemetry-api; never the OTel SDK, protobuf, or the network: with an agent attached the
served process only records; the agent encodes and exports (its lossless processor, spool,
TLS) under the server's resource.

Policy, per span at its start:

* an agent is attached (it polled the ring within ``SERVEWATCH_SPAN_STALE_S``, default 2 s): a
  :class:`ChannelSpan`; on end it is appended to the ring, or dropped and counted when the ring
  is full (``dropped_full``). Never blocks.
* no agent attached yet, but a live agent declares it watches this process
  (:mod:`agent.sdk.presence`) and the ring is younger than ``SERVEWATCH_SPAN_HOLD_S`` (default
  10 s): a :class:`ChannelSpan` too; the ring holds it (bounded by its capacity, a full ring is
  counted) until the agent attaches at its next ring poll, so the first request's spans are not
  lost. Should no agent attach, they are counted ``dropped_no_agent`` at exit (never silent).
* no agent: ``SERVEWATCH_SPAN_FALLBACK=otel`` (default) uses the opentelemetry-api tracer (the
  server's own SDK and exporter if it installed one, else a no-op), counted ``fallback_spans``;
  ``drop`` drops the span and counts it (``dropped_no_agent``). Either way bounded.
* ``SERVEWATCH_SPAN_CHANNEL=0`` turns the channel off: always the OTel path, no ring file.

The ring is created at the first span (``<shm_dir>/servewatch-<uid>/servewatch-spans.<pid>``, 0600,
``O_EXCL | O_NOFOLLOW``), sized ``SERVEWATCH_SPAN_RING_BYTES`` (default 2 MiB), and removed at
exit. Its metadata holds the server's resource attributes: those of the tracer provider given to
:func:`agent.sdk.tracing.set_tracer_provider` when it has a resource, else ``OTEL_SERVICE_NAME``
and ``OTEL_RESOURCE_ATTRIBUTES``, with the name :func:`agent.sdk.provider.set_service_name`
declared as ``service.name`` when neither names one.

Record (a JSON array): ``[name, kind, trace_id, span_id, parent_span_id (0: root), start_ns,
end_ns, attributes, status_code, status_description, events, links]`` with ids as integers,
``events`` as ``[[name, time_ns, attributes], ...]`` and ``links`` as ``[[trace_id, span_id,
attributes], ...]``.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from agent.sdk import presence as _presence
from agent.sdk import ring as _ring

__all__ = [
    "ENV_CHANNEL",
    "ENV_FALLBACK",
    "ENV_HOLD_S",
    "ENV_RING_BYTES",
    "ENV_STALE_S",
    "ChannelSpan",
    "close",
    "ring",
    "start_span",
    "statistics",
]

#: ``0`` / ``false`` / ``off`` disables the channel (spans always take the OTel API path).
ENV_CHANNEL = "SERVEWATCH_SPAN_CHANNEL"
#: ``otel`` (default) or ``drop``: what happens to a span while no agent is attached.
ENV_FALLBACK = "SERVEWATCH_SPAN_FALLBACK"
#: Ring size in bytes (default 2 MiB).
ENV_RING_BYTES = "SERVEWATCH_SPAN_RING_BYTES"
#: An agent that has not polled for this many seconds is gone (default 2).
ENV_STALE_S = "SERVEWATCH_SPAN_STALE_S"
#: A new ring holds its spans this many seconds for an agent that declares it watches this
#: process but has not attached yet (default 10; 0: never hold).
ENV_HOLD_S = "SERVEWATCH_SPAN_HOLD_S"

#: Longest ``exception.stacktrace`` kept on a span event, UTF-8 bytes: Tempo keeps the first
#: 2,048 bytes of a string attribute, so a longer trace would lose its last line (the error).
MAX_STACKTRACE_BYTES = 2048


def bounded_stacktrace(exception: BaseException, limit_bytes: int = MAX_STACKTRACE_BYTES) -> str:
    """``exception``'s traceback in Python's format, at most ``limit_bytes`` UTF-8 bytes.

    What makes it useful is kept whole: the ``Traceback`` header, the innermost frames and the
    error line(s) at the end (``RuntimeError: boom``); outer frames that do not fit are replaced
    by one ``  ... N frame(s) omitted ...`` line. An error line longer than the limit is cut at
    its end, so the exception's type always stays within the limit.
    """
    tail = "".join(traceback.format_exception_only(type(exception), exception))
    frames = traceback.format_tb(exception.__traceback__) if exception.__traceback__ is not None else []
    full = "".join(traceback.format_exception(type(exception), exception, exception.__traceback__))
    if len(full.encode()) <= limit_bytes:
        return full
    head = "Traceback (most recent call last):\n" if frames else ""
    marker = f"  ... {len(frames)} frame(s) omitted ...\n"  # the longest the marker can be
    budget = limit_bytes - len(head.encode()) - len(tail.encode()) - len(marker.encode())
    if budget < 0:  # the error line alone is (nearly) over the limit: its start (the type) is what counts
        return tail.encode()[:limit_bytes].decode("utf-8", "ignore")
    kept: list[str] = []
    for frame in reversed(frames):
        size = len(frame.encode())
        if size > budget:
            break
        budget -= size
        kept.append(frame)
    omitted = len(frames) - len(kept)
    if omitted:
        kept.append(f"  ... {omitted} frame(s) omitted ...\n")
    return head + "".join(reversed(kept)) + tail


_lock = threading.Lock()
_writer: _ring.RingWriter | None = None
_state = 0  # 0: not tried, 1: ring open, -1: off or failed
_fallback_drop = False
_stale_ns = 2_000_000_000
_hold_ns = int(_presence.HOLD_S * 1e9)
#: monotonic ns when this process's ring was opened (0: not yet)
_opened_ns = 0
#: (monotonic ns of the last look, whether an agent declared it watches us)
_declared: tuple[int, bool] = (0, False)
#: Least time between two looks at the agents' declarations, ns.
_DECLARED_TTL_NS = 500_000_000
_rng = random.Random()
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_encode = json.JSONEncoder(separators=(",", ":"), default=str, check_circular=False).encode
_monotonic_ns = time.monotonic_ns
# local counters (the ring holds the same ones for the agent to read)
_dropped_no_agent = 0
_fallback_spans = 0


def _resource_attributes() -> dict[str, Any]:
    from agent.sdk.provider import service_name, tracer_provider

    provider = tracer_provider()
    resource = getattr(provider, "resource", None)
    attrs = getattr(resource, "attributes", None)
    if attrs:
        return {str(k): v for k, v in dict(attrs).items() if isinstance(v, (str, bool, int, float))}
    out: dict[str, Any] = {}
    raw = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if raw:
        from urllib.parse import unquote

        for item in raw.split(","):
            key, sep, value = item.partition("=")
            if sep and key.strip():
                out[key.strip()] = unquote(value.strip())
    name = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if name:
        out["service.name"] = name
    elif "service.name" not in out and service_name():
        out["service.name"] = service_name()
    return out


def _open() -> _ring.RingWriter | None:
    global _writer, _state, _fallback_drop, _stale_ns, _hold_ns, _opened_ns
    with _lock:
        if _state:
            return _writer
        _state = -1
        _fallback_drop = os.environ.get(ENV_FALLBACK, "otel").strip().lower() == "drop"
        if os.environ.get(ENV_CHANNEL, "1").strip().lower() in ("0", "false", "off", "no"):
            return None
        try:
            _stale_ns = int(float(os.environ.get(ENV_STALE_S, "2")) * 1e9)
            capacity = int(os.environ.get(ENV_RING_BYTES, str(_ring.DEFAULT_CAPACITY)))
        except ValueError:
            capacity = _ring.DEFAULT_CAPACITY
        try:
            _hold_ns = max(0, int(float(os.environ.get(ENV_HOLD_S, str(_presence.HOLD_S))) * 1e9))
        except ValueError:
            _hold_ns = int(_presence.HOLD_S * 1e9)
        try:
            _writer = _ring.RingWriter(capacity, metadata={"resource": _resource_attributes(), "pid": os.getpid()})
        except OSError:
            _writer = None
            return None
        _state = 1
        _opened_ns = _monotonic_ns()
        atexit.register(close)
        return _writer


def _holding() -> bool:
    """The ring is new and a live agent declares it watches this process, though it has not
    attached yet: spans wait for it in the ring (the declarations are read at most every
    0.5 s, and only in this window)."""
    global _declared
    now = _monotonic_ns()
    if not _opened_ns or now - _opened_ns >= _hold_ns:
        return False
    checked, watched = _declared
    if now - checked >= _DECLARED_TTL_NS:
        watched = _presence.watched(os.getpid())
        _declared = (now, watched)
    return watched


def ring() -> _ring.RingWriter | None:
    """This process's span ring (created on first use), or ``None`` when off or unavailable."""
    return _writer if _state else _open()


def statistics() -> dict[str, int]:
    """Server-side counters: ``written``, ``dropped_full``, ``dropped_no_agent``,
    ``dropped_too_large``, ``fallback_spans``, ``unread_bytes``, ``capacity`` (zeros while no
    ring), and ``attached`` (1 while an agent polls the ring)."""
    writer = _writer
    if writer is None:
        return {"written": 0, "dropped_full": 0, "dropped_no_agent": _dropped_no_agent, "dropped_too_large": 0,
                "fallback_spans": _fallback_spans, "unread_bytes": 0, "capacity": 0, "attached": 0}
    out = writer.statistics().to_dict()
    out["attached"] = int(writer.attached(_stale_ns))
    return out


def close() -> None:
    """Remove this process's ring (also run at exit); later spans take the fallback path.

    Records still in the ring while no agent is attached (one was killed before it shipped
    them, or recorded in the seconds before its heartbeat went stale) go with the ring: they are
    counted ``dropped_no_agent`` and logged (``servewatch.sdk`` logger), never lost silently.
    With an agent attached they are left to it (it holds the file open and drains it)."""
    global _writer, _state, _dropped_no_agent
    with _lock:
        writer, _writer = _writer, None
        _state = -1
    if writer is not None:
        left = 0 if writer.attached(_stale_ns) else writer.unread_records()
        if left:
            _dropped_no_agent += left
            writer.count(_ring.W_DROPPED_NO_AGENT, left)
            import logging

            logging.getLogger("servewatch.sdk").warning(
                "%d span(s) left unshipped in the span ring at exit: no servewatch agent attached (counted dropped_no_agent)", left
            )
        writer.close()


def _after_fork_in_child() -> None:
    # The child must not write its parent's ring: it opens its own at its first span. Its id
    # generator is reseeded (from os.urandom): a copy of the parent's state would give the child's
    # spans the very trace and span ids the parent goes on to use.
    global _writer, _state, _lock, _opened_ns, _declared
    _writer, _state, _lock, _opened_ns, _declared = None, 0, threading.Lock(), 0, (0, False)
    _rng.seed()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _noop_tracing() -> bool:
    """Whether the fallback tracer records nothing: no provider given to the SDK and no global
    one installed (opentelemetry-api's proxy or no-op provider)."""
    from agent.sdk.provider import tracer_provider

    provider = tracer_provider() or trace.get_tracer_provider()
    return isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def start_span(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    start_time: int | None = None,
    tracer: Any = None,
    context: Any = None,
    parent_ids: Callable[[], tuple[int, int]] | None = None,
) -> trace.Span:
    """Start a span per the channel policy (module docstring).

    Args:
        tracer: the OTel API tracer for the fallback path (default: the SDK's tracer).
        context: parent OTel ``Context`` (e.g. extracted from an incoming W3C ``traceparent``);
            ``None``: the current context.
        parent_ids: returns ``(trace_id, span_id)`` of the parent span as integers, used
            instead of ``context`` (the forward-step path: no ``Context`` is built for the
            channel); called only when the span will record (never under a no-op tracer).

    Returns:
        A :class:`ChannelSpan` while an agent is attached; else the fallback tracer's span, or
        ``trace.INVALID_SPAN`` (non-recording) when the fallback is ``drop``.
    """
    global _dropped_no_agent, _fallback_spans
    writer = _writer if _state else _open()
    if writer is not None:
        hb = writer.words[_ring.W_HEARTBEAT]
        if hb and _monotonic_ns() - hb < _stale_ns:
            return ChannelSpan(writer, name, kind, attributes, start_time, context, parent_ids and parent_ids())
        if not hb and _holding():  # an agent is coming for this new ring: the span waits in it
            return ChannelSpan(writer, name, kind, attributes, start_time, context, parent_ids and parent_ids())
        if _fallback_drop:
            _dropped_no_agent += 1
            writer.count(_ring.W_DROPPED_NO_AGENT)
            return trace.INVALID_SPAN
        _fallback_spans += 1
        writer.count(_ring.W_FALLBACK)
    elif _fallback_drop:
        _dropped_no_agent += 1
        return trace.INVALID_SPAN
    if tracer is None:
        from agent.sdk.provider import get_tracer

        tracer = get_tracer()
    if parent_ids is not None and not _noop_tracing():
        trace_id, span_id = parent_ids()
        parent = SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)
        context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    return tracer.start_span(name, context=context, kind=kind, attributes=attributes, start_time=start_time)


def _export_late(span: ChannelSpan, end_ns: int) -> bool:
    """Give a ChannelSpan that ended after its agent left to the server's own OTel SDK pipeline
    (the provider :func:`agent.sdk.tracing.set_tracer_provider` installed, else the global one),
    with its ids, times, attributes, events, links and status. ``False`` when no SDK pipeline is
    installed (the OTel API's no-op): the record then goes to the ring as before."""
    from agent.sdk.provider import tracer_provider

    provider = tracer_provider() or trace.get_tracer_provider()
    processor = getattr(provider, "_active_span_processor", None)
    if processor is None:
        return False
    try:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        flags = TraceFlags(TraceFlags.SAMPLED)
        links = [
            trace.Link(SpanContext(t, s_, is_remote=False, trace_flags=flags), attributes=dict(a or {}))
            for t, s_, a in (span._links or ())
        ]
        events = [Event(name, dict(attrs or {}), timestamp=ts) for name, ts, attrs in (span._events or ())]
        readable = ReadableSpan(
            name=span._name,
            context=SpanContext(span._trace_id, span._span_id, is_remote=False, trace_flags=flags),
            parent=SpanContext(span._trace_id, span._parent_id, is_remote=False, trace_flags=flags) if span._parent_id else None,
            resource=getattr(provider, "resource", None),
            attributes=dict(span._attrs),
            events=events,
            links=links,
            kind=span._kind,
            status=Status(StatusCode(span._status), span._desc or None),
            start_time=span._start,
            end_time=max(span._start, end_ns),
            instrumentation_scope=InstrumentationScope(_SCOPE_NAME, "0.1.0"),
        )
        processor.on_end(readable)
    except Exception:  # noqa: BLE001 - boundary: never raise from end(); the ring path follows
        return False
    return True


#: Instrumentation scope of spans handed to the server's own pipeline (the SDK tracer's name).
_SCOPE_NAME = "servewatch.sdk"


class ChannelSpan(trace.Span):
    """A recording span that the agent exports: on :meth:`end` it is one ring record.

    Its parent is the given parent ids, else the span of the given context (an incoming
    ``traceparent``), else the current span when that is valid (same trace), else it starts a trace.
    Thread-safe for the usual use (one thread ends it). Never raises from :meth:`end`.
    """

    __slots__ = (
        "_attrs",
        "_ctx",
        "_desc",
        "_ended",
        "_events",
        "_kind",
        "_links",
        "_name",
        "_parent_id",
        "_span_id",
        "_start",
        "_status",
        "_trace_id",
        "_writer",
    )

    def __init__(
        self,
        writer: _ring.RingWriter,
        name: str,
        kind: SpanKind,
        attributes: Mapping[str, Any] | None,
        start_time: int | None,
        context: Any = None,
        parent_ids: tuple[int, int] | None = None,
    ) -> None:
        self._writer = writer
        self._name = name
        self._kind = kind
        if parent_ids is not None:
            self._trace_id, self._parent_id = parent_ids
        elif (parent := trace.get_current_span(context).get_span_context()).is_valid:
            self._trace_id = parent.trace_id
            self._parent_id = parent.span_id
        else:
            self._trace_id = _rng.getrandbits(128) or 1
            self._parent_id = 0
        self._span_id = _rng.getrandbits(64) or 1
        self._start = start_time if start_time is not None else time.time_ns()
        self._attrs: dict[str, Any] = dict(attributes) if attributes else {}
        self._events: list[Any] | None = None
        self._links: list[Any] | None = None
        self._status = 0
        self._desc = ""
        self._ended = False
        self._ctx: SpanContext | None = None

    # --- opentelemetry.trace.Span ---------------------------------------------------------

    def get_span_context(self) -> SpanContext:
        ctx = self._ctx
        if ctx is None:
            ctx = self._ctx = SpanContext(self._trace_id, self._span_id, is_remote=False, trace_flags=_SAMPLED)
        return ctx

    def is_recording(self) -> bool:
        return not self._ended

    def set_attribute(self, key: str, value: Any) -> None:
        if not self._ended:
            self._attrs[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if not self._ended:
            self._attrs.update(attributes)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        if self._ended:
            return
        if self._events is None:
            self._events = []
        self._events.append([name, timestamp if timestamp is not None else time.time_ns(), dict(attributes or {})])

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._ended or not context.is_valid:
            return
        if self._links is None:
            self._links = []
        self._links.append([context.trace_id, context.span_id, dict(attributes or {})])

    def add_link_ids(self, trace_id: int, span_id: int, attributes: Mapping[str, Any] | None = None) -> None:
        """:meth:`add_link` without building a ``SpanContext`` (the forward-step hot path)."""
        if self._ended or not trace_id or not span_id:
            return
        if self._links is None:
            self._links = []
        self._links.append([trace_id, span_id, attributes or {}])

    def update_name(self, name: str) -> None:
        if not self._ended:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._ended:
            return
        if isinstance(status, Status):
            code, desc = status.status_code, status.description or ""
        else:
            code, desc = status, description or ""
        if self._status == StatusCode.OK.value:
            return  # OK is final (OTel API spec)
        self._status = code.value
        self._desc = desc if code is StatusCode.ERROR else ""

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        attrs: dict[str, Any] = {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": bounded_stacktrace(exception),
            "exception.escaped": str(escaped),
        }
        if attributes:
            attrs.update(attributes)
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        global _fallback_spans
        if self._ended:
            return
        self._ended = True
        end_ns = end_time if end_time is not None else time.time_ns()
        hb = self._writer.words[_ring.W_HEARTBEAT]
        # The agent left while this span was open (its last drain is over): the ring has no
        # reader any more, so hand the finished span, ids unchanged (an incident may link to it),
        # to the server's own export instead.
        agent_gone = (not hb and not _holding()) or (hb and _monotonic_ns() - hb >= _stale_ns)
        if agent_gone and not _fallback_drop and _export_late(self, end_ns):
            _fallback_spans += 1
            self._writer.count(_ring.W_FALLBACK)
            return
        record = [
            self._name,
            self._kind.value,
            self._trace_id,
            self._span_id,
            self._parent_id,
            self._start,
            end_ns,
            self._attrs,
            self._status,
            self._desc,
            self._events or (),
            self._links or (),
        ]
        try:
            payload = _encode(record).encode()
        except (TypeError, ValueError):  # boundary: an unencodable attribute must not reach the caller
            payload = _encode(record[:7] + [{}, self._status, self._desc, (), ()]).encode()
        self._writer.write(payload)

    def __repr__(self) -> str:
        return f"ChannelSpan({self._name!r}, trace_id={self._trace_id:032x}, span_id={self._span_id:016x})"

