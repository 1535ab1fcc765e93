"""agent.sdk.profiler: step-bounded torch/MLX sessions driven by a real model's step() calls."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import sdk
from agent.sdk import profiler, tracing
from agent.sdk.counter import counter_path, read_counter
from agent.sdk.profiler import ProfilerBusyError, ProfileRequest
from tests.sdk._helpers import TinyModel, drain, load_trace, profiler_steps, torch


@pytest.fixture
def model() -> Iterator[TinyModel]:
    m = TinyModel()
    yield m
    drain(m)


def _req(tmp_path: Path, **kw) -> ProfileRequest:
    kw.setdefault("activities", ("CPU",))
    return ProfileRequest(output_dir=str(tmp_path), **kw)


def test_captures_exactly_num_steps_and_stops_itself(model: TinyModel, tmp_path: Path) -> None:
    sid = profiler.request_profile(_req(tmp_path, num_steps=3))
    assert profiler.status()["state"] == "pending"
    first = model.forward_step()  # starts the profiler after this step
    assert profiler.status()["state"] == "running"
    assert read_counter(counter_path(__import__("os").getpid())).profiling
    for _ in range(6):  # more steps than asked: the session must end by itself after 3
        model.forward_step()
    info = profiler.session(sid)
    assert info["state"] == "completed" and info["stop_reason"] == "num_steps"
    assert info["steps_captured"] == 3
    assert info["forward_ct_at_start"] == first
    assert info["activities_used"] == ["CPU"]
    assert len(info["files"]) == 1 and info["files"][0].endswith(".trace.json.gz")
    assert profiler_steps(load_trace(info["files"][0])) == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    assert profiler.status()["state"] == "idle"
    assert not read_counter(counter_path(__import__("os").getpid())).profiling
    assert not tracing.profiling_active()


def test_start_step_waits_for_forward_ct(model: TinyModel, tmp_path: Path) -> None:
    start = sdk.forward_ct() + 3
    sid = profiler.request_profile(_req(tmp_path, num_steps=2, start_step=start))
    model.forward_step()
    model.forward_step()
    assert profiler.status()["state"] == "pending"
    for _ in range(4):
        model.forward_step()
    info = profiler.session(sid)
    assert info["state"] == "completed"
    assert info["forward_ct_at_start"] == start
    assert len(profiler_steps(load_trace(info["files"][0]))) == 2


def test_double_stop_is_idempotent(model: TinyModel, tmp_path: Path) -> None:
    sid = profiler.request_profile(_req(tmp_path, num_steps=100))
    model.forward_step()
    model.forward_step()
    assert profiler.request_stop() == "stopping"
    assert profiler.request_stop() == "stopping"  # still waiting for the model thread
    model.forward_step()  # the stop is applied here, on the model thread
    assert profiler.request_stop() == "already_stopped"
    info = profiler.session(sid)
    assert info["state"] == "stopped" and info["stop_reason"] == "requested"
    assert info["steps_captured"] == 2
    assert len(profiler_steps(load_trace(info["files"][0]))) == 2


def test_stop_before_start_cancels_without_starting_a_profiler(model: TinyModel, tmp_path: Path) -> None:
    assert profiler.request_stop() == "already_stopped"
    sid = profiler.request_profile(_req(tmp_path, num_steps=2, start_step=sdk.forward_ct() + 1000))
    model.forward_step()
    assert profiler.request_stop() == "stopped"
    info = profiler.session(sid)
    assert info["state"] == "cancelled" and info["steps_captured"] == 0 and info["files"] == []
    assert not torch.autograd.profiler._is_profiler_enabled
    assert list(tmp_path.iterdir()) == []


def test_start_while_running_is_refused(model: TinyModel, tmp_path: Path) -> None:
    sid = profiler.request_profile(_req(tmp_path, num_steps=5))
    model.forward_step()
    with pytest.raises(ProfilerBusyError, match=sid):
        profiler.request_profile(_req(tmp_path, num_steps=1))


class ModelThread:
    """A model loop on its own thread that steps when told (deterministic, always joined)."""

    def __init__(self) -> None:
        self.model = TinyModel()
        self.todo: queue.Queue[int | None] = queue.Queue()
        self.done: queue.Queue[int] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            n = self.todo.get(timeout=60)
            if n is None:
                return
            for _ in range(n):
                self.model.forward_step()
            self.done.put(n)

    def steps(self, n: int) -> None:
        self.todo.put(n)
        assert self.done.get(timeout=60) == n

    def close(self) -> None:
        self.todo.put(None)
        self.thread.join(timeout=60)


def test_request_from_other_thread_runs_on_model_thread_only(tmp_path: Path) -> None:
    mt = ModelThread()
    try:
        sid = profiler.request_profile(_req(tmp_path, num_steps=3))  # from the test thread
        mt.steps(1)
        assert profiler.session(sid)["state"] == "running"
        # A step() on a thread that did not start the profiler can neither step nor stop it.
        sdk.step()
        assert profiler.session(sid)["steps_captured"] == 0
        assert profiler.request_stop() == "stopping"
        sdk.step()
        assert profiler.session(sid)["state"] == "stopping"
        mt.steps(1)  # the owner applies the stop
        info = profiler.session(sid)
        assert info["state"] == "stopped" and info["steps_captured"] == 1
        assert len(profiler_steps(load_trace(info["files"][0]))) == 1
        # the same through wait(): the model thread steps while the test thread waits
        sid2 = profiler.request_profile(_req(tmp_path, num_steps=4))
        mt.steps(6)
        info = profiler.wait(sid2, timeout_s=30)
        assert info["state"] == "completed" and info["steps_captured"] == 4
        assert len(profiler_steps(load_trace(info["files"][0]))) == 4
    finally:
        if profiler.status()["state"] != "idle":
            profiler.request_stop()
            mt.steps(1)
        mt.close()


def test_idle_server_expires_with_zero_steps(tmp_path: Path) -> None:
    sid = profiler.request_profile(_req(tmp_path, num_steps=3, max_duration_s=0.2))
    info = profiler.wait(sid, timeout_s=10)  # nobody steps: an idle server
    assert info["state"] == "expired" and info["stop_reason"] == "deadline"
    assert info["steps_captured"] == 0 and info["files"] == [] and info["start_time_unix_nano"] == 0
    assert not torch.autograd.profiler._is_profiler_enabled
    assert profiler.status()["state"] == "idle"


def test_running_session_past_deadline_stops_at_next_step(model: TinyModel, tmp_path: Path) -> None:
    sid = profiler.request_profile(_req(tmp_path, num_steps=1000, max_duration_s=0.3))
    model.forward_step()
    model.forward_step()
    time.sleep(0.4)
    assert profiler.status()["state"] == "stopping"
    model.forward_step()
    info = profiler.session(sid)
    assert info["state"] == "expired" and info["steps_captured"] == 2
    assert len(profiler_steps(load_trace(info["files"][0]))) == 2


def test_back_to_back_sessions_write_distinct_files(model: TinyModel, tmp_path: Path) -> None:
    results = []
    for n in (1, 2):
        sid = profiler.request_profile(_req(tmp_path, num_steps=n))
        for _ in range(n + 1):
            model.forward_step()
        results.append(profiler.session(sid))
    assert [r["state"] for r in results] == ["completed", "completed"]
    files = [r["files"][0] for r in results]
    assert files[0] != files[1] and results[0]["session_id"] != results[1]["session_id"]
    assert [len(profiler_steps(load_trace(f))) for f in files] == [1, 2]


def test_maybe_record_function_is_shared_noop_when_idle_and_real_range_when_profiling(
    model: TinyModel, tmp_path: Path
) -> None:
    assert tracing.maybe_record_function("a") is tracing.maybe_record_function("b")
    sid = profiler.request_profile(_req(tmp_path, num_steps=1))
    model.forward_step()
    with tracing.maybe_record_function("servewatch.test.range"):
        model.net(model.x)
    model.forward_step()
    names = {e.get("name") for e in load_trace(profiler.session(sid)["files"][0])["traceEvents"]}
    assert "servewatch.test.range" in names


def test_bad_requests_are_rejected() -> None:
    for kw in ({"num_steps": 0}, {"num_steps": 1, "activities": ("TPU",)}, {"num_steps": 1, "max_duration_s": 0},
               {"num_steps": 1, "backend": "jax"}, {"num_steps": 1, "prefix": "a/b"}):
        with pytest.raises(ValueError):
            ProfileRequest(**kw)
    with pytest.raises(ValueError, match="unknown"):
        ProfileRequest.from_dict({"num_steps": 1, "prompt": "x"})
    req = ProfileRequest.from_dict({"num_steps": 2, "activities": "cpu,gpu", "start_step": 5})
    assert req.activities == ("CPU", "GPU") and req.start_step == 5


def test_mlx_on_linux_says_no_metal_and_records_step_memory(tmp_path: Path) -> None:
    mx = pytest.importorskip("mlx.core")
    if mx.metal.is_available():
        pytest.skip("this test covers hosts without Metal")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracer_provider(provider)
    try:
        sid = profiler.request_profile(ProfileRequest(num_steps=3, backend="mlx", output_dir=str(tmp_path)))
        a = mx.ones((256, 256))
        for _ in range(4):
            mx.eval(a @ a)
            sdk.step()
        info = profiler.session(sid)
    finally:
        tracing.set_tracer_provider(None)
        provider.shutdown()
    assert info["state"] == "completed" and info["steps_captured"] == 3
    assert info["metal_trace_captured"] is False
    assert "mx.metal.is_available() is False" in info["detail"]
    assert not any(f.endswith(".gputrace") for f in info["files"])
    body = json.loads(Path(info["files"][0]).read_text())
    assert body["metal_trace_captured"] is False and len(body["steps"]) == 3
    assert all(s["peak_memory_bytes"] >= 256 * 256 * 4 for s in body["steps"])
    spans = [s for s in exporter.get_finished_spans() if s.name == "mlx.step"]
    assert len(spans) == 3
    assert spans[0].attributes["mlx.memory.peak_bytes"] >= 256 * 256 * 4
    assert {"mlx.memory.active_bytes", "mlx.memory.cache_bytes"} <= set(spans[0].attributes)


def test_mlx_session_is_imported_as_steps_under_profile_session(tmp_path: Path) -> None:
    """The Linux fallback's per-step records reach the trace as ``mlx.step`` children of
    ``profile.session``, as torch traces do (``servewatch profile`` and incidents)."""
    mx = pytest.importorskip("mlx.core")
    if mx.metal.is_available():
        pytest.skip("this test covers hosts without Metal")
    from agent.model.events import ActionResult, Outcome
    from exporters.mirror.mirror import mirror_profile_session
    from exporters.otlp.spans import InMemorySink

    sid = profiler.request_profile(ProfileRequest(num_steps=2, backend="mlx", output_dir=str(tmp_path)))
    a = mx.ones((128, 128))
    for _ in range(3):
        mx.eval(a @ a)
        sdk.step()
    info = profiler.session(sid)
    assert info["state"] == "completed"
    result = ActionResult(action="profile.session", outcome=Outcome.OK, artifact_paths=tuple(info["files"]),
                          start_time_unix_nano=1, end_time_unix_nano=2)
    sink = InMemorySink()
    mirror_profile_session(sink, result)
    (session_span,) = sink.named("profile.session")
    steps = sink.named("mlx.step")
    assert len(steps) == 2 and all(s.parent.span_id == session_span.context.span_id for s in steps)
    assert all(s.attributes["mlx.memory.peak_bytes"] >= 128 * 128 * 4 for s in steps)
    assert session_span.attributes["servewatch.mlx.steps"] == 2
