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
    # the request spans are the ones exported, each in its own trace (a batch mixes requests)
    request_spans = [s for s in exporter.get_finished_spans() if s.name == "chat tiny"]
    assert sorted(_ids(s) for s in request_spans) == sorted(links)
    assert fwd.context.trace_id not in {s.context.trace_id for s in request_spans}


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


def test_forward_span_is_current_inside_and_records_errors(exporter: InMemorySpanExporter) -> None:
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
