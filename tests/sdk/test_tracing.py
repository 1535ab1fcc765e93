"""agent.sdk.tracing: request spans (gen_ai names), the in-flight registry, torch ranges."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agent.sdk import profiler, tracing
from agent.sdk.profiler import ProfileRequest
from tests.sdk._helpers import TinyModel, drain, load_trace


def test_request_span_uses_current_gen_ai_names_and_lists_inflight(exporter: InMemorySpanExporter) -> None:
    assert tracing.inflight() == []
    with tracing.request_span("req-1", model="tiny", max_tokens=16, input_tokens=7) as req:
        req.set_output_tokens(3)
        listed = tracing.inflight()
        assert [r["request_id"] for r in listed] == ["req-1"]
        assert listed[0]["span_id"] == req.span_id and listed[0]["trace_id"] == req.trace_id
        assert listed[0]["input_tokens"] == 7 and listed[0]["output_tokens"] == 3
        assert listed[0]["recording"] is True
    assert tracing.inflight() == []
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat tiny" and span.kind is SpanKind.INTERNAL  # GenAI semconv: model in-process
    assert dict(span.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.response.id": "req-1",
        "gen_ai.request.model": "tiny",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 3,
    }
    assert f"{span.context.span_id:016x}" == listed[0]["span_id"]


def test_request_span_error_is_recorded_and_leaves_registry(exporter: InMemorySpanExporter) -> None:
    with pytest.raises(RuntimeError), tracing.request_span("req-err", model="tiny"):
        raise RuntimeError("boom")
    assert tracing.inflight() == []
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR


def test_request_span_without_otel_sdk_still_has_ids() -> None:
    with tracing.request_span("req-2") as req:
        (item,) = tracing.inflight()
    assert item["recording"] is False
    assert len(req.trace_id) == 32 and int(req.trace_id, 16) != 0
    assert len(req.span_id) == 16 and int(req.span_id, 16) != 0


def test_request_span_is_a_torch_range_while_profiling(tmp_path: Path, exporter: InMemorySpanExporter) -> None:
    model = TinyModel()
    try:
        sid = profiler.request_profile(ProfileRequest(num_steps=1, activities=("CPU",), output_dir=str(tmp_path)))
        model.forward_step()
        with tracing.request_span("req-prof", model="tiny"):
            model.net(model.x)
        model.forward_step()
    finally:
        drain(model)
    names = {e.get("name") for e in load_trace(profiler.session(sid)["files"][0])["traceEvents"]}
    assert "request:req-prof" in names


def test_sdk_import_stays_light_and_exports_what_it_lists() -> None:
    import subprocess
    import sys

    from agent import sdk

    assert all(hasattr(sdk, name) for name in sdk.__all__)
    code = (
        "import sys, agent.sdk, agent.sdk.profiler, agent.sdk.control, agent.sdk.tracing\n"
        "print(' '.join(sorted(m for m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(out.stdout.split())
    heavy = {"torch", "mlx", "anyio", "httpx", "pydantic", "opentelemetry.sdk", "opentelemetry", "agent.model.bus", "agent.model.events", "exporters"}
    assert not loaded & heavy, loaded & heavy


def _user_annotations(prof: object) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("servewatch.test.")]  # type: ignore[attr-defined]


def test_maybe_record_function_records_under_a_users_own_torch_profiler() -> None:
    import torch

    assert not tracing.profiling_active()  # no SDK session: only torch's process-wide flag is on
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert tracing.torch_profiler_active()
        with tracing.maybe_record_function("servewatch.test.user_profiler"):
            torch.ones(4).sum()
        with tracing.maybe_record_function("servewatch.test.warmup", enabled=False):
            torch.ones(4).sum()
    assert not tracing.torch_profiler_active()
    assert _user_annotations(prof) == ["servewatch.test.user_profiler"]
    # after the profiler stopped: the shared no-op again
    assert tracing.maybe_record_function("x") is tracing.maybe_record_function("y")


def test_maybe_record_function_records_under_the_legacy_autograd_profiler() -> None:
    import torch

    with (
        torch.autograd.profiler.profile() as prof,
        tracing.maybe_record_function("servewatch.test.autograd"),
    ):
        torch.ones(2).sum()
    assert "servewatch.test.autograd" in {e.name for e in prof.function_events}


def test_maybe_record_function_never_imports_torch(python: str) -> None:
    import subprocess

    code = (
        "import sys; from agent.sdk.tracing import maybe_record_function as m\n"
        "with m('a'): pass\n"
        "with m('b', enabled=False): pass\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_request_span_carries_the_provider_and_joins_an_incoming_traceparent(exporter: InMemorySpanExporter) -> None:
    trace_hex, parent_hex = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"Traceparent": f"00-{trace_hex}-{parent_hex}-01", "Content-Type": "application/json"}
    with tracing.request_span("req-p", model="tiny", provider="sglang", parent=headers) as req:
        assert req.trace_id == trace_hex
    with tracing.request_span("req-s", parent=f"00-{trace_hex}-{parent_hex}-01"):
        pass
    with tracing.request_span("req-bad", parent="00-not-a-traceparent"):  # ignored: a new trace
        pass
    spans = {s.attributes["gen_ai.response.id"]: s for s in exporter.get_finished_spans()}
    joined = spans["req-p"]
    assert joined.attributes["gen_ai.provider.name"] == "sglang"
    assert f"{joined.context.trace_id:032x}" == trace_hex and f"{joined.parent.span_id:016x}" == parent_hex
    assert joined.parent.is_remote and joined.kind is SpanKind.INTERNAL
    assert f"{spans['req-s'].parent.span_id:016x}" == parent_hex
    assert spans["req-bad"].parent is None and f"{spans['req-bad'].context.trace_id:032x}" != trace_hex
    assert "gen_ai.provider.name" not in spans["req-s"].attributes


def test_the_thread_holding_a_request_is_listed_and_completions_give_their_p99() -> None:
    """vLLM #54003's shape: a request's work moves to the grammar thread (``held_here``); the
    listing names that thread while it holds the request, the opening thread before and after.
    Each request that ends is a completion: its count, the p99 of the recent ones, the last end."""
    import threading

    before = tracing.completions()["count"]
    with tracing.request_span("req-held", model="tiny") as req:
        opener = tracing.inflight()[0]
        assert (opener["thread_id"], opener["native_thread_id"]) == (threading.get_ident(), threading.get_native_id())
        seen: dict[str, int] = {}

        def grammar() -> None:
            with req.held_here():
                listed = tracing.inflight()[0]
                seen.update(thread_id=listed["thread_id"], native=listed["native_thread_id"],
                            ident=threading.get_ident(), tid=threading.get_native_id())

        worker = threading.Thread(target=grammar, name="structured_output_grammar_0")
        worker.start()
        worker.join(timeout=10)
        assert (seen["thread_id"], seen["native"]) == (seen["ident"], seen["tid"]) != (threading.get_ident(), 0)
        assert tracing.inflight()[0]["thread_id"] == threading.get_ident()  # back to the opener
    done = tracing.completions()
    assert done["count"] == before + 1
    assert done["recent"] >= 1 and isinstance(done["p99_s"], float) and done["p99_s"] >= 0
    assert done["last_end_unix_nano"] > 0
