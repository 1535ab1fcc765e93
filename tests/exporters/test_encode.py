"""exporters.otlp.encode: the fast encoder gives the same bytes as the SDK's encode_spans."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.sdk import tracing
from exporters.otlp.encode import encode_spans_fast
from exporters.otlp.spans import build_span, link_to, new_trace_id


def test_fast_encoder_is_byte_identical_for_every_span_servewatch_emits() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "srv"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer_provider(provider)
    try:
        for i in range(20):
            parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" if i % 2 else None
            with tracing.request_span(f"r{i}", model="m", provider="p", max_tokens=8, parent=parent) as req:
                req.set_output_tokens(i)
                with tracing.forward_span([req, ("0" * 31 + "1", "0" * 15 + "2")]):
                    pass
        try:
            with tracing.request_span("boom"):
                raise ValueError("x")
        except ValueError:
            pass
    finally:
        tracing.set_tracer_provider(None)
        provider.shutdown()
    built = [
        build_span("incident", trace_id=new_trace_id(), start_time_unix_nano=1, end_time_unix_nano=2, error="bad",
                   attributes={"s": "v", "b": True, "i": 3, "f": 1.5, "t": ("a", "b"), "ints": (1, 2), "bytes": b"\x01"},
                   links=[link_to(1, 2, {"k": "v"})]),
        build_span("ok", trace_id=new_trace_id(), start_time_unix_nano=1, end_time_unix_nano=2, ok=True),
    ]
    spans = [*exporter.get_finished_spans(), *built]
    for _ in range(2):  # the second pass hits the key/value cache
        assert encode_spans_fast(spans).SerializeToString() == encode_spans(spans).SerializeToString()
