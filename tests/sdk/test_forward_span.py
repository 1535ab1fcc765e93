"""agent.sdk.forward_span: one span per batched forward step, linked to the requests it served."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agent import sdk
from agent.sdk import profiler, tracing
from agent.sdk.profiler import ProfileRequest
from tests.sdk._helpers import TinyModel, drain, load_trace


def _ids(span: object) -> tuple[str, str]:
    ctx = span.context  # type: ignore[attr-defined]
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def test_forward_span_links_each_request_of_the_batch(exporter: InMemorySpanExporter) -> None:
    with tracing.request_span("req-a", model="tiny") as a, tracing.request_span("req-b", model="tiny") as b:
        expected_ct = sdk.forward_ct() + 1
        with sdk.forward_span([a, b]) as span:
            assert span.is_recording()
        counted = sdk.step(pending=0)
    assert counted == expected_ct
    spans = {s.name: s for s in exporter.get_finished_spans()}
    fwd = spans["forward"]
    assert fwd.kind is SpanKind.INTERNAL
    assert dict(fwd.attributes) == {"servewatch.forward.batch_size": 2, "servewatch.forward_ct": expected_ct}
    links = [(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in fwd.links]
    assert links == [(a.trace_id, a.span_id), (b.trace_id, b.span_id)]
    assert [dict(link.attributes) for link in fwd.links] == [
        {"gen_ai.response.id": "req-a"},
        {"gen_ai.response.id": "req-b"},
    ]
    # the request spans are the ones exported, each in its own trace (a batch mixes requests);
    # the step is no trace of its own: a child of the batch's first request, in its trace
    request_spans = [s for s in exporter.get_finished_spans() if s.name == "chat tiny"]
    assert sorted(_ids(s) for s in request_spans) == sorted(links)
    assert _ids(fwd)[0] == a.trace_id and fwd.parent is not None and f"{fwd.parent.span_id:016x}" == a.span_id


def test_forward_span_accepts_hex_id_pairs_and_extra_attributes(exporter: InMemorySpanExporter) -> None:
    pair = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    with sdk.forward_span([pair], name="decode", attributes={"servewatch.forward.mode": "decode"}):
        pass
    (span,) = exporter.get_finished_spans()
    assert span.name == "decode"
    assert span.attributes["servewatch.forward.mode"] == "decode"
    assert span.attributes["servewatch.forward.batch_size"] == 1
    (link,) = span.links
    assert (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") == pair
    assert dict(link.attributes) == {}


def test_forward_span_links_requests_whose_spans_did_not_record(exporter: InMemorySpanExporter) -> None:
    tracing.set_tracer_provider(None)  # requests traced with the no-op tracer: SDK-made ids
    with tracing.request_span("req-noop") as req:
        tracing.set_tracer_provider(exporter_provider := TracerProvider())
        exporter_provider.add_span_processor(SimpleSpanProcessor(exporter))
        with sdk.forward_span([req]):
            pass
    exporter_provider.shutdown()
    (span,) = exporter.get_finished_spans()
    (link,) = span.links
    assert (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") == (req.trace_id, req.span_id)
    assert dict(link.attributes) == {"gen_ai.response.id": "req-noop"}


def test_forward_span_is_current_inside_and_records_errors(exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_orphan_steps", 0)  # the first request-less step is traced
    with pytest.raises(RuntimeError, match="boom"), sdk.forward_span([]) as span:
        assert trace.get_current_span() is span
        with tracing.get_tracer().start_as_current_span("kernel"):
            pass
        raise RuntimeError("boom")
    assert trace.get_current_span() is not span
    spans = {s.name: s for s in exporter.get_finished_spans()}
    fwd = spans["forward"]
    assert fwd.status.status_code is StatusCode.ERROR
    assert fwd.attributes["servewatch.forward.batch_size"] == 0
    assert spans["kernel"].parent.span_id == fwd.context.span_id
    assert [e.name for e in fwd.events] == ["exception"]


class _NoLinks:
    """A request whose link must never be built (fails the test if it is)."""

    @property
    def trace_id(self) -> str:
        raise AssertionError("link built under a no-op tracer")

    span_id = trace_id


def test_forward_span_builds_no_links_under_the_noop_tracer() -> None:
    tracing.set_tracer_provider(None)
    with sdk.forward_span([_NoLinks(), _NoLinks()]) as span:  # type: ignore[list-item]
        assert not span.is_recording()


def test_forward_span_is_a_torch_range_while_profiling(tmp_path: Path) -> None:
    model = TinyModel()
    try:
        sid = profiler.request_profile(ProfileRequest(num_steps=1, activities=("CPU",), output_dir=str(tmp_path)))
        model.forward_step()
        with sdk.forward_span([], name="forward_under_profile"):
            model.net(model.x)
        model.forward_step()
    finally:
        drain(model)
    names = {e.get("name") for e in load_trace(profiler.session(sid)["files"][0])["traceEvents"]}
    assert "forward_under_profile" in names


STEPS_PER_S = 20
WINDOW_S = 60


def _serve(seconds: int, *, request_steps: tuple[int, ...] = (3, 7, 12, 30), concurrency: int = 4, idle_every: int = 9) -> int:
    """A continuous-batching loop of ``seconds`` x 20 forward steps (the steps are not slept: how
    a step joins a trace depends on the steps and requests only, never on the clock). Requests of
    mixed lengths join as others finish; every ``idle_every``-th step serves no request (a warm-up
    or padding step). Returns how many requests were served."""
    import contextlib
    import itertools

    ids = itertools.count(1)
    lengths = itertools.cycle(request_steps)
    active: list[list] = []  # [stack, handle, steps left]
    served = 0
    for step in range(seconds * STEPS_PER_S):
        while len(active) < concurrency:
            stack = contextlib.ExitStack()
            handle = stack.enter_context(tracing.request_span(f"req-{next(ids)}", model="tiny"))
            active.append([stack, handle, next(lengths)])
            served += 1
        with sdk.forward_span([] if step % idle_every == 0 else [entry[1] for entry in active]):
            pass
        if step % idle_every == 0:
            continue
        for entry in active:
            entry[2] -= 1
        for entry in [e for e in active if e[2] <= 0]:
            active.remove(entry)
            entry[0].close()
    for entry in active:
        entry[0].close()
    return served


def test_steps_of_a_20_steps_per_s_server_over_60_s_make_no_more_traces_than_requests(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every step was a trace of its own (13 traces for 4 requests): Jaeger's 100,000-trace store
    # evicted incidents within ~1.5 h at 20 steps/s. Now: one trace per request, plus one in
    # SERVEWATCH_FORWARD_SAMPLE_EVERY (default 1000) of the steps that serve no request.
    monkeypatch.setattr(tracing, "_orphan_steps", 0)
    monkeypatch.setattr(tracing, "_orphan_steps_unsampled", 0)
    monkeypatch.setattr(tracing, "_sample_every", None)
    monkeypatch.delenv(tracing.ENV_FORWARD_SAMPLE_EVERY, raising=False)
    steps = STEPS_PER_S * WINDOW_S
    served = _serve(WINDOW_S)
    spans = exporter.get_finished_spans()
    requests = [s for s in spans if s.name == "chat tiny"]
    forwards = [s for s in spans if s.name == "forward"]
    idle = len(range(0, steps, 9))
    assert len(requests) == served
    request_traces = {s.context.trace_id for s in requests}
    assert len(request_traces) == served  # each request its own trace
    # every step that served a request is in the trace of one of them, a child of its request
    busy = [s for s in forwards if s.attributes["servewatch.forward.batch_size"] > 0]
    assert len(busy) == steps - idle
    by_id = {s.context.span_id: s for s in requests}
    assert all(s.parent is not None and by_id[s.parent.span_id].context.trace_id == s.context.trace_id for s in busy)
    # the request-less steps: the first traced, then one in 1000
    orphans = [s for s in forwards if s.attributes["servewatch.forward.batch_size"] == 0]
    assert len(orphans) == -(-idle // tracing.FORWARD_SAMPLE_EVERY) == 1
    assert tracing.forward_statistics() == {"orphan_steps": idle, "orphan_steps_unsampled": idle - 1}
    traces = {s.context.trace_id for s in spans}
    assert len(traces) == served + len(orphans) <= served + -(-idle // tracing.FORWARD_SAMPLE_EVERY)


def test_a_step_under_the_servers_own_batch_span_stays_in_that_trace(exporter: InMemorySpanExporter) -> None:
    with (
        tracing.request_span("req-x", model="tiny") as req,
        tracing.get_tracer().start_as_current_span("batch") as batch,
        sdk.forward_span([req]),
    ):
        pass
    fwd = next(s for s in exporter.get_finished_spans() if s.name == "forward")
    assert fwd.context.trace_id == batch.get_span_context().trace_id
    assert fwd.parent is not None and fwd.parent.span_id == batch.get_span_context().span_id
