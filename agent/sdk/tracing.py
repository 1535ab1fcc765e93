"""Named ranges and per-request spans inside the server process.

Owns :func:`maybe_record_function`, :func:`request_span` and the in-flight request registry
(:func:`inflight`) that the control socket's ``inflight`` command returns. Imports the standard
library and, lazily, opentelemetry-api and torch; never the agent side.

``maybe_record_function(name, enabled=True)`` records a real ``torch.profiler.record_function``
range whenever ANY torch profiler is active in the process: an SDK session (our flag, flipped by
:mod:`agent.sdk.profiler` on the model thread), SGLang's ``/start_profile``, or a user's own
``torch.profiler.profile()``. The process-wide test is torch's own flag
``torch.autograd.profiler._is_profiler_enabled`` (set by every torch profiler's start and cleared
at its stop, torch 2.13), read only when torch was already imported by the process: a process
that never imported torch cannot be profiling. ``enabled=False`` is a per-call gate (SGLang
uses one to leave warm-up requests out of a profile). While nothing profiles it returns one
shared no-op context manager (two global reads, no allocation).

``forward_span(requests)`` traces one batched forward step as an INTERNAL span with one span link
per request it served (SGLang's ``forward_ct`` and the batch size as attributes), so a request's
trace can be followed to every step that computed its tokens and back. A step is never a trace of
its own: it is a child of the current span when the server made one (its own batch span), else of
the batch's first request's span, in that request's trace. A step that serves no request and has
no current span has no trace to join: one in :data:`FORWARD_SAMPLE_EVERY` of those is traced
(``SERVEWATCH_FORWARD_SAMPLE_EVERY``, default 1000: at 20 steps/s, one trace per 50 s), the
others are counted (:func:`forward_statistics`). While the tracer is a no-op no link object is built.

``request_span(...)`` opens an OTel span (gen_ai semantic conventions, current names:
``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.model``, ``gen_ai.request.max_tokens``,
``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``, ``gen_ai.response.id``) through
the SDK's span channel (:mod:`agent.sdk.channel`: while an agent is attached the span is only
recorded here and the agent encodes and exports it; else the opentelemetry-api tracer provider
or a counted drop), records a torch range of the same name while
profiling, and registers the request in the in-flight registry until it ends. Prompt or output
text is never recorded.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from agent.sdk.provider import get_tracer, set_service_name, set_tracer_provider

__all__ = [
    "InflightRequest",
    "RequestHandle",
    "completions",
    "forward_span",
    "forward_statistics",
    "get_tracer",
    "inflight",
    "maybe_record_function",
    "profiling_active",
    "request_span",
    "set_service_name",
    "set_tracer_provider",
    "torch_profiler_active",
]

#: True while an SDK torch profiling session is recording (set on the model thread only).
_profiling = False



class _NoopRange:
    """A reusable context manager that does nothing (shared by every inactive call)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NOOP = _NoopRange()


def profiling_active() -> bool:
    """Whether an SDK torch profiling session is recording right now."""
    return _profiling


def _set_profiling(active: bool) -> None:
    """Flip the flag (called by :mod:`agent.sdk.profiler` on the model thread)."""
    global _profiling
    _profiling = active


#: ``torch.autograd.profiler`` once the process imported it (its module global
#: ``_is_profiler_enabled`` is the process-wide "a torch profiler is recording" flag).
_torch_autograd_profiler: Any = None


def _torch_profiler_module() -> Any:
    """``torch.autograd.profiler`` if the process has imported it, else ``None`` (never imports)."""
    global _torch_autograd_profiler
    module = sys.modules.get("torch.autograd.profiler")
    if module is not None and hasattr(module, "_is_profiler_enabled"):
        _torch_autograd_profiler = module
    return module


def torch_profiler_active() -> bool:
    """Whether any torch profiler (ours, SGLang's, the user's) is recording in this process."""
    module = _torch_autograd_profiler or _torch_profiler_module()
    return bool(module is not None and getattr(module, "_is_profiler_enabled", False))


def maybe_record_function(name: str, enabled: bool = True) -> Any:
    """A named range that is free when nobody profiles.

    Args:
        name: the range name as it should appear in the torch trace (category
            ``user_annotation``).
        enabled: per-call gate (e.g. ``False`` for warm-up requests, as SGLang does); when
            ``False`` the range is never recorded.

    Returns:
        A context manager: a fresh ``torch.profiler.record_function(name)`` while any torch
        profiler in this process records (an SDK session, SGLang's ``/start_profile``, a user's
        ``torch.profiler.profile()``) and ``enabled``; else the shared no-op one.
    """
    if not enabled:
        return _NOOP
    if not _profiling:
        module = _torch_autograd_profiler
        if module is None:
            module = _torch_profiler_module()
            if module is None:
                return _NOOP
        if not module._is_profiler_enabled:
            return _NOOP
    from torch.profiler import record_function

    return record_function(name)


# --- in-flight registry ----------------------------------------------------------------------


@dataclass(slots=True)
class InflightRequest:
    """One request being served, as the control socket reports it.

    Attributes:
        request_id: the server's request id (``gen_ai.response.id``).
        trace_id / span_id: hex ids of the request span (32 / 16 digits). When no OTel SDK is
            installed in the server the span is non-recording and these ids are generated by
            the SDK instead (``recording`` False), so the agent can still link to the request.
        start_time_unix_nano: when the request span started (wall clock, ns).
        model: ``gen_ai.request.model`` or ``""``.
        operation: ``gen_ai.operation.name`` (``chat``, ``text_completion``...).
        input_tokens / output_tokens: token counts known so far.
        max_tokens: ``gen_ai.request.max_tokens`` or ``None``.
        recording: whether the OTel span is exported by an SDK in the server.
        parent_span_id: hex id of the request span's parent (16 digits; ``""``: a trace root),
            so an agent can show the request's part up to an incident where the request sits.
        thread_id / native_thread_id: the thread that holds the request now
            (``threading.get_ident()`` / the kernel's tid): the one that opened its span, or the
            one inside :meth:`RequestHandle.held_here` (a grammar compile on the engine's grammar
            thread, vLLM #54003), so an agent can name the thread a stuck request sits on.
    """

    request_id: str
    trace_id: str
    span_id: str
    start_time_unix_nano: int
    model: str = ""
    operation: str = "chat"
    input_tokens: int | None = None
    output_tokens: int | None = None
    max_tokens: int | None = None
    recording: bool = False
    parent_span_id: str = ""
    thread_id: int = field(default=0, repr=False)
    native_thread_id: int = field(default=0, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the control socket's ``inflight`` items)."""
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "start_time_unix_nano": self.start_time_unix_nano,
            "model": self.model,
            "operation": self.operation,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "max_tokens": self.max_tokens,
            "recording": self.recording,
            "parent_span_id": self.parent_span_id,
            "thread_id": self.thread_id,
            "native_thread_id": self.native_thread_id,
        }


_registry: dict[int, InflightRequest] = {}
_registry_lock = threading.Lock()
_rng = random.Random()
#: Most recent completions whose durations :func:`completions` keeps.
RECENT_COMPLETIONS = 512
_recent: deque[float] = deque(maxlen=RECENT_COMPLETIONS)
_completed = {"count": 0, "last_end_unix_nano": 0}


def _completed_one(duration_s: float, end_unix_nano: int) -> None:
    with _registry_lock:
        _recent.append(duration_s)
        _completed["count"] += 1
        _completed["last_end_unix_nano"] = end_unix_nano


def completions() -> dict[str, Any]:
    """The requests this process completed (their :func:`request_span` ended), JSON-ready:
    ``count`` (since start), ``recent`` (how many of the last :data:`RECENT_COMPLETIONS` the
    percentile is over), ``p99_s`` (their 99th-percentile duration, seconds; ``None`` with none)
    and ``last_end_unix_nano`` (when the last one ended, wall clock; 0: none yet)."""
    with _registry_lock:
        durations = sorted(_recent)
        out: dict[str, Any] = dict(_completed)
    out["recent"] = len(durations)
    out["p99_s"] = durations[min(len(durations) - 1, int(0.99 * len(durations)))] if durations else None
    return out


def inflight() -> list[dict[str, Any]]:
    """Snapshot of the requests in flight, oldest first (JSON-ready dicts)."""
    with _registry_lock:
        items = sorted(_registry.values(), key=lambda r: r.start_time_unix_nano)
        return [r.to_dict() for r in items]


def _after_fork_in_child() -> None:
    global _registry_lock, _profiling
    _registry.clear()
    _recent.clear()
    _completed.update(count=0, last_end_unix_nano=0)
    _registry_lock = threading.Lock()
    _profiling = False
    _rng.seed()  # from os.urandom: the child's ids are its own, never a copy of the parent's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class RequestHandle:
    """What ``with request_span(...) as req`` yields: update token counts as they become known."""

    __slots__ = ("_entry", "_span")

    def __init__(self, entry: InflightRequest, span: Any) -> None:
        self._entry = entry
        self._span = span

    @property
    def request_id(self) -> str:
        """The server's request id (``gen_ai.response.id``)."""
        return self._entry.request_id

    @property
    def trace_id(self) -> str:
        """Hex trace id of the request span."""
        return self._entry.trace_id

    @property
    def span_id(self) -> str:
        """Hex span id of the request span."""
        return self._entry.span_id

    def set_input_tokens(self, n: int) -> None:
        """Record ``gen_ai.usage.input_tokens`` (prompt tokens)."""
        self._entry.input_tokens = int(n)
        self._span.set_attribute("gen_ai.usage.input_tokens", int(n))

    def set_output_tokens(self, n: int) -> None:
        """Record ``gen_ai.usage.output_tokens`` (generated tokens so far)."""
        self._entry.output_tokens = int(n)
        self._span.set_attribute("gen_ai.usage.output_tokens", int(n))

    @contextmanager
    def held_here(self) -> Iterator[None]:
        """Within the block the calling thread holds this request (its work moved there: a
        structured-output grammar compiled on the engine's grammar thread, vLLM #54003); the
        ``inflight`` listing names it, and the thread that held it before once the block ends."""
        entry = self._entry
        before = entry.thread_id, entry.native_thread_id
        entry.thread_id, entry.native_thread_id = threading.get_ident(), threading.get_native_id()
        try:
            yield
        finally:
            entry.thread_id, entry.native_thread_id = before


#: Span kind of a request span. The GenAI semantic conventions' inference span is CLIENT from a
#: caller and "MAY be INTERNAL on spans representing calls to models running in the same
#: process": in the server the model runs in-process, so INTERNAL, under the server's HTTP SERVER
#: span when one exists (pass its context or the incoming ``traceparent`` as ``parent``).
REQUEST_SPAN_KIND_NAME = "INTERNAL"


def _parent_context(parent: Any) -> Any:
    """An OTel ``Context`` from ``parent``: a ``Context`` as is, a W3C ``traceparent`` header
    value, or a carrier mapping of incoming headers (``traceparent``/``tracestate``)."""
    if parent is None:
        return None
    if isinstance(parent, (str, bytes)):
        carrier: Mapping[str, str] = {"traceparent": parent.decode() if isinstance(parent, bytes) else parent}
    elif isinstance(parent, Mapping):
        carrier = {str(k).lower(): (v.decode() if isinstance(v, bytes) else str(v)) for k, v in parent.items()}
    else:
        return parent  # a Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def _request_attributes(
    request_id: str, *, model: str, operation: str, provider: str, max_tokens: int | None, input_tokens: int | None,
    attributes: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The request span's attributes (:func:`request_span`'s arguments)."""
    attrs: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.response.id": request_id}
    if provider:
        attrs["gen_ai.provider.name"] = provider
    if model:
        attrs["gen_ai.request.model"] = model
    if max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = int(max_tokens)
    if input_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = int(input_tokens)
    if attributes:
        attrs.update(attributes)
    return attrs


def _otel_span_ids(span: Any) -> tuple[bool, int, int, int]:
    """``(recording, trace id, span id, parent span id or 0)`` of an OTel API span; random
    ids for one that does not record."""
    ctx = span.get_span_context()
    recording = bool(ctx.is_valid)
    trace_id = ctx.trace_id if recording else _rng.getrandbits(128) or 1
    span_id = ctx.span_id if recording else _rng.getrandbits(64) or 1
    parent_ctx = getattr(span, "parent", None) if recording else None  # the OTel SDK's span
    parent_id = parent_ctx.span_id if parent_ctx is not None and getattr(parent_ctx, "is_valid", False) else 0
    return recording, trace_id, span_id, parent_id


@contextmanager
def request_span(
    request_id: str,
    *,
    model: str = "",
    operation: str = "chat",
    provider: str = "",
    max_tokens: int | None = None,
    input_tokens: int | None = None,
    attributes: Mapping[str, Any] | None = None,
    parent: Any = None,
) -> Iterator[RequestHandle]:
    """Trace one inference request as an OTel span named ``"{operation} {model}"``.

    The span kind is INTERNAL (:data:`REQUEST_SPAN_KIND_NAME`, per the GenAI conventions for a
    model running in the same process) and carries only counts and ids, never prompt or output
    text. ``parent`` joins the caller's trace: pass the incoming request's headers (a mapping
    with ``traceparent``), the ``traceparent`` value itself, or an OTel ``Context``. While
    an SDK profiling session records, the request is also a torch range named
    ``request:{request_id}`` (entered and exited on the calling thread). The request is listed
    by :func:`inflight` until the block exits; an exception marks the span as an error and
    propagates.

    Args:
        request_id: the server's request id, recorded as ``gen_ai.response.id``.
        model: ``gen_ai.request.model``.
        operation: ``gen_ai.operation.name`` (``chat``, ``text_completion``, ``embeddings``).
        provider: ``gen_ai.provider.name`` (e.g. ``sglang``, ``vllm``, or the model's vendor).
        max_tokens: ``gen_ai.request.max_tokens``.
        input_tokens: ``gen_ai.usage.input_tokens`` when already known.
        attributes: extra span attributes (must not hold request payloads).
        parent: the caller's trace context: incoming headers (mapping), a W3C ``traceparent``
            string, or an OTel ``Context``; ``None``: the current context. A malformed
            ``traceparent`` is ignored (a new trace starts), as the W3C spec requires.

    Yields:
        A :class:`RequestHandle` to report token counts.
    """
    from opentelemetry import trace

    from agent.sdk import channel

    attrs = _request_attributes(request_id, model=model, operation=operation, provider=provider, max_tokens=max_tokens,
                                input_tokens=input_tokens, attributes=attributes)
    name = f"{operation} {model}" if model else operation
    start_ns = time.time_ns()
    # Not made the current span: requests interleave on one thread (async servers, or several
    # requests per batch), and context attach/detach must nest.
    # With an agent attached this is a ChannelSpan: recorded here, encoded and exported by the
    # agent (agent.sdk.channel); else the OTel API path or a counted drop.
    span = channel.start_span(
        name, kind=trace.SpanKind.INTERNAL, attributes=attrs, start_time=start_ns, context=_parent_context(parent)
    )
    if type(span) is channel.ChannelSpan:  # the agent's path: its ids, without building a SpanContext
        recording, trace_id, span_id, parent_id = True, span._trace_id, span._span_id, span._parent_id
    else:
        recording, trace_id, span_id, parent_id = _otel_span_ids(span)
    entry = InflightRequest(
        request_id=request_id,
        trace_id=f"{trace_id:032x}",
        span_id=f"{span_id:016x}",
        start_time_unix_nano=start_ns,
        model=model,
        operation=operation,
        input_tokens=None if input_tokens is None else int(input_tokens),
        max_tokens=None if max_tokens is None else int(max_tokens),
        recording=recording,
        parent_span_id=f"{parent_id:016x}" if parent_id else "",
        thread_id=threading.get_ident(),
        native_thread_id=threading.get_native_id(),
    )
    key = id(entry)
    with _registry_lock:
        _registry[key] = entry
    torch_range = None
    if _profiling:
        from torch.profiler import record_function

        torch_range = record_function(f"request:{request_id}")
        torch_range.__enter__()
    try:
        yield RequestHandle(entry, span)
    except BaseException as exc:
        span.record_exception(exc, attributes={"exception.stacktrace": channel.bounded_stacktrace(exc)})
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        if torch_range is not None:
            torch_range.__exit__(None, None, None)
        with _registry_lock:
            _registry.pop(key, None)
        end_ns = time.time_ns()
        _completed_one((end_ns - start_ns) / 1e9, end_ns)
        span.end()


#: Span attribute: requests computed together in one forward step (count).
ATTR_FORWARD_BATCH_SIZE = "servewatch.forward.batch_size"
#: Span attribute: the process's forward step number this span is (SGLang's ``forward_ct``, 1-based).
ATTR_FORWARD_CT = "servewatch.forward_ct"


def _link_context(request: RequestHandle | tuple[str, str]) -> tuple[Any, dict[str, Any]]:
    """The span context and link attributes of one served request."""
    from opentelemetry.trace import SpanContext, TraceFlags

    if isinstance(request, RequestHandle):
        ctx = request._span.get_span_context()
        if ctx.is_valid:
            return ctx, {"gen_ai.response.id": request.request_id}
        trace_hex, span_hex, attrs = request.trace_id, request.span_id, {"gen_ai.response.id": request.request_id}
    else:
        trace_hex, span_hex = request
        attrs = {}
    ctx = SpanContext(
        trace_id=int(trace_hex, 16), span_id=int(span_hex, 16), is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)
    )
    return ctx, attrs


#: Environment variable: trace one in this many forward steps that serve no request and have no
#: current span (``1``: every one; they are each a trace of their own).
ENV_FORWARD_SAMPLE_EVERY = "SERVEWATCH_FORWARD_SAMPLE_EVERY"
#: Default of :data:`ENV_FORWARD_SAMPLE_EVERY`.
FORWARD_SAMPLE_EVERY = 1000
#: Request-less forward steps seen (traced or not), and how many were not traced.
_orphan_steps = 0
_orphan_steps_unsampled = 0
_sample_every: int | None = None


def _orphan_sampled() -> bool:
    """Whether this request-less, parentless forward step is traced: the first, then one in
    :data:`FORWARD_SAMPLE_EVERY` (read from the environment once)."""
    global _orphan_steps, _orphan_steps_unsampled, _sample_every
    every = _sample_every
    if every is None:
        try:
            every = max(1, int(os.environ.get(ENV_FORWARD_SAMPLE_EVERY, str(FORWARD_SAMPLE_EVERY))))
        except ValueError:
            every = FORWARD_SAMPLE_EVERY
        _sample_every = every
    sampled = _orphan_steps % every == 0
    _orphan_steps += 1
    if not sampled:
        _orphan_steps_unsampled += 1
    return sampled


def forward_statistics() -> dict[str, int]:
    """Forward steps that served no request and had no current span: ``orphan_steps`` (all) and
    ``orphan_steps_unsampled`` (not traced, per ``SERVEWATCH_FORWARD_SAMPLE_EVERY``)."""
    return {"orphan_steps": _orphan_steps, "orphan_steps_unsampled": _orphan_steps_unsampled}


def _link_ids(request: RequestHandle | tuple[str, str]) -> tuple[int, int, dict[str, Any]]:
    """Trace id, span id and link attributes of one served request, as integers."""
    if isinstance(request, RequestHandle):
        span = request._span
        if hasattr(span, "_span_id") and hasattr(span, "_trace_id"):  # a ChannelSpan
            return span._trace_id, span._span_id, {"gen_ai.response.id": request.request_id}
        return int(request.trace_id, 16), int(request.span_id, 16), {"gen_ai.response.id": request.request_id}
    trace_hex, span_hex = request
    return int(trace_hex, 16), int(span_hex, 16), {}


@contextmanager
def forward_span(
    requests: Iterable[RequestHandle | tuple[str, str]],
    *,
    name: str = "forward",
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Any]:
    """Trace ONE batched forward step as an OTel span linked to every request it served.

    The span kind is INTERNAL and it is the current span inside the block (spans started there
    are its children). It joins a trace, never starts one: its parent is the current span when
    one is valid (the server's own batch span), else the first request of ``requests``, in that
    request's trace (so N requests make N traces, however many steps serve them). With neither,
    only one such step in ``SERVEWATCH_FORWARD_SAMPLE_EVERY`` (default 1000) is traced, as a
    root; the others are non-recording spans, counted by :func:`forward_statistics`. Attributes: ``servewatch.forward.batch_size`` (requests in the batch) and
    ``servewatch.forward_ct`` (the step number this forward will have once the caller counts it
    with :func:`agent.sdk.step`, i.e. :func:`agent.sdk.forward_ct` + 1 at entry). It does not
    count the step itself. While an SDK profiling session records, the block is also a torch
    range named ``name``. An exception marks the span as an error and propagates.

    When the tracer is a no-op (no OTel SDK installed in the server) the span is non-recording
    and no link is built: the cost is one ``start_span`` call and a context attach.

    The OTel SDK keeps at most ``OTEL_SPAN_LINK_COUNT_LIMIT`` links per span (128 by default);
    larger batches lose the rest, counted by the SDK as dropped links.

    Args:
        requests: the batch: :class:`RequestHandle` objects from :func:`request_span`, or
            ``(trace_id_hex, span_id_hex)`` pairs (32 and 16 hex digits).
        name: span name (and torch range name).
        attributes: extra span attributes (must not hold request payloads).

    Yields:
        The span (an ``opentelemetry.trace.Span``; non-recording under a no-op tracer).

    Raises:
        ValueError: a ``(trace_id_hex, span_id_hex)`` pair is not hex (recording spans only).
    """
    from opentelemetry import trace

    from agent.sdk import channel
    from agent.sdk.steps import forward_ct

    batch = requests if isinstance(requests, (list, tuple)) else list(requests)
    parent_ids = None
    traced = True
    if not trace.get_current_span().get_span_context().is_valid:  # else: a child of the server's span
        if batch:
            first = batch[0]

            def parent_ids() -> tuple[int, int]:  # in the first request's trace (only built when recording)
                parent_trace, parent_span, _ = _link_ids(first)
                return parent_trace, parent_span
        else:
            traced = _orphan_sampled()
    attrs: dict[str, Any] = {ATTR_FORWARD_BATCH_SIZE: len(batch), ATTR_FORWARD_CT: forward_ct() + 1}
    if attributes:
        attrs.update(attributes)
    span = (
        channel.start_span(name, kind=trace.SpanKind.INTERNAL, attributes=attrs, parent_ids=parent_ids)
        if traced else trace.INVALID_SPAN
    )
    if type(span) is channel.ChannelSpan:
        for request in batch:
            span.add_link_ids(*_link_ids(request))
    elif span.is_recording():
        for request in batch:
            ctx, link_attrs = _link_context(request)
            span.add_link(ctx, link_attrs)
    torch_range = maybe_record_function(name)
    try:
        with (
            trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False),
            torch_range,
        ):
            yield span
    except BaseException as exc:
        span.record_exception(exc, attributes={"exception.stacktrace": channel.bounded_stacktrace(exc)})
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()
