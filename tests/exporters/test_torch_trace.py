"""exporters.mirror.torch_trace: real torch traces (made here through agent.sdk.step()) become spans."""

from __future__ import annotations

import gzip
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from agent.sdk import profiler
from agent.sdk.profiler import ProfileRequest
from exporters.mirror.torch_trace import (
    ALWAYS_KEPT_CATEGORIES,
    ImportStatistics,
    TorchTraceImportConfig,
    find_base_time_ns,
    gputrace_attributes,
    import_profile_artifacts,
    import_torch_trace,
)
from exporters.otlp.spans import InMemorySink, new_span_id, new_trace_id
from tests.sdk._helpers import TinyModel, drain, load_trace

ALL_OPS = TorchTraceImportConfig(min_duration_us=0, max_spans=100_000)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real 3-step torch profile of a small model, driven by step()."""
    out = tmp_path_factory.mktemp("trace")
    model = TinyModel()
    try:
        sid = profiler.request_profile(ProfileRequest(num_steps=3, activities=("CPU",), output_dir=str(out)))
        from agent.sdk.tracing import maybe_record_function

        for _ in range(4):
            with maybe_record_function("decode_batch"):  # a real range only while profiling
                model.net(model.x)
            model.forward_step()
    finally:
        drain(model)
    info = profiler.session(sid)
    assert info["state"] == "completed"
    return info


def _import(path: str | Path, config: TorchTraceImportConfig = ALL_OPS) -> tuple[InMemorySink, ImportStatistics, int, int]:
    sink = InMemorySink()
    tid, root = new_trace_id(), new_span_id()
    stats = import_torch_trace(path, sink, trace_id=tid, parent_span_id=root, config=config)
    return sink, stats, tid, root


def test_real_trace_becomes_nested_spans_in_the_session_window(session: dict[str, Any]) -> None:
    path = session["files"][0]
    trace = load_trace(path)
    wanted = set(ALL_OPS.categories) | ALWAYS_KEPT_CATEGORIES
    complete = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    imported = [e for e in complete if e.get("cat") in wanted]
    sink, stats, tid, root = _import(path)
    spans = sink.spans
    assert len(spans) == stats.kept == len(imported)
    assert stats.dropped_category == len(complete) - len(imported)
    assert stats.events == len(trace["traceEvents"])
    assert stats.profiler_steps == 3
    steps = sorted(sink.spans, key=lambda s: s.start_time)
    step_spans = [s for s in steps if s.name.startswith("ProfilerStep#")]
    assert [s.name for s in step_spans] == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    by_id = {s.context.span_id: s for s in spans}
    assert all(s.context.trace_id == tid for s in spans)
    assert all(s.parent.span_id == root for s in step_spans)
    # every aten op hangs (directly or not) under a ProfilerStep range that contains it
    ops = [s for s in spans if s.name.startswith("aten::")]
    assert ops
    for op in ops:
        parent = by_id[op.parent.span_id]
        assert parent.start_time <= op.start_time <= parent.end_time
        top = op
        while top.parent.span_id != root:
            top = by_id[top.parent.span_id]
        assert top.name.startswith("ProfilerStep#")
    assert any(by_id[o.parent.span_id].name.startswith("aten::") for o in ops)  # real depth > 1
    # record_function ranges opened by maybe_record_function are kept and nest in steps
    ranges = [s for s in spans if s.name == "decode_batch"]
    assert len(ranges) == 3 and all(by_id[r.parent.span_id].name.startswith("ProfilerStep#") for r in ranges)
    # epoch times from baseTimeNanoseconds + ts: inside the session's wall-clock window
    lo, hi = session["requested_unix_nano"], session["end_time_unix_nano"]
    for s in step_spans:
        assert lo <= s.start_time <= s.end_time <= hi
    assert stats.base_time_unix_nano == trace["baseTimeNanoseconds"] == find_base_time_ns(path)
    assert ops[0].attributes["process.pid"] == os.getpid()


def test_filters_and_cap_count_what_they_drop(session: dict[str, Any]) -> None:
    path = session["files"][0]
    _, full, _, _ = _import(path)
    sink, stats, _, _ = _import(path, TorchTraceImportConfig(min_duration_us=1e12))
    assert stats.dropped_min_duration == full.kept - full.kept_annotations > 0
    assert {s.attributes["torch.category"] for s in sink.spans} == {"user_annotation"}
    assert stats.profiler_steps == 3 and stats.kept == full.kept_annotations
    sink, stats, _, _ = _import(path, TorchTraceImportConfig(min_duration_us=0, max_spans=2))
    assert stats.kept == full.kept_annotations + 2
    assert stats.dropped_cap == full.kept - full.kept_annotations - 2
    sink, stats, _, _ = _import(path, TorchTraceImportConfig(categories=("kernel",), min_duration_us=0))
    assert stats.dropped_category >= full.kept - full.kept_annotations
    attrs = stats.span_attributes()
    assert attrs["servewatch.trace_import.dropped"] == stats.dropped and attrs["servewatch.trace_import.kept"] == stats.kept


def _rewrite(trace: dict[str, Any], path: Path, *, base_last: bool, compact: bool) -> Path:
    doc = {k: v for k, v in trace.items() if k != "baseTimeNanoseconds"}
    if not base_last:
        doc = {"baseTimeNanoseconds": trace["baseTimeNanoseconds"], **doc}
    else:
        doc["baseTimeNanoseconds"] = trace["baseTimeNanoseconds"]
    text = json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc, indent=2)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def _shape(sink: InMemorySink) -> list[tuple[str, int, int, str]]:
    by_id = {s.context.span_id: s for s in sink.spans}
    return sorted(
        (s.name, s.start_time, s.end_time, by_id[s.parent.span_id].name if s.parent.span_id in by_id else "<session>")
        for s in sink.spans
    )


@pytest.mark.parametrize("name", ["late-base.json", "late-base.json.gz"])
def test_base_time_after_events_and_other_layouts_give_the_same_spans(
    session: dict[str, Any], tmp_path: Path, name: str
) -> None:
    trace = load_trace(session["files"][0])
    ref, ref_stats, _, _ = _import(session["files"][0])
    late = _rewrite(trace, tmp_path / name, base_last=True, compact=False)
    assert find_base_time_ns(late) == trace["baseTimeNanoseconds"]
    for path in (late, _rewrite(trace, tmp_path / ("compact-" + name), base_last=False, compact=True)):
        for chunk in (4096, 1 << 20):
            sink, stats, _, _ = _import(path, TorchTraceImportConfig(min_duration_us=0, max_spans=100_000, chunk_chars=chunk))
            assert _shape(sink) == _shape(ref)
            assert stats == ref_stats


def test_escapes_nested_args_and_out_of_order_events(tmp_path: Path) -> None:
    base = 1_700_000_000_000_000_000
    events = [
        # file order is not time order on this thread: the window restores it
        {"ph": "X", "cat": "cpu_op", "name": "child \"q\" {x}", "pid": 1, "tid": "t", "ts": 20.0, "dur": 30.0,
         "args": {"note": "}, {", "nested": {"a": [1, {"b": 2}]}}},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": "t", "ts": 10.0, "dur": 100.0, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "early", "pid": 1, "tid": "t", "ts": 5.0, "dur": 1.0},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": "t", "args": {"name": "x"}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 40.0, "dur": 15.0, "args": {"stream": 7}},
        {"ph": "s", "id": 1, "pid": 1, "tid": "t", "ts": 25, "cat": "ac2g", "name": "ac2g"},
    ]
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"traceEvents": events, "baseTimeNanoseconds": base}, indent=1))
    sink, stats, _, root = _import(path)
    assert (stats.events, stats.kept, stats.dropped_phase, stats.out_of_order) == (6, 4, 2, 0)
    spans = {s.name: s for s in sink.spans}
    child, step, kernel = spans['child "q" {x}'], spans["ProfilerStep#0"], spans["gemm"]
    assert child.parent.span_id == step.context.span_id and step.parent.span_id == root
    assert (child.start_time, child.end_time) == (base + 20_000, base + 50_000)
    assert kernel.attributes["gpu.device"] == 0 and kernel.attributes["gpu.stream"] == 7
    assert kernel.parent.span_id == root  # another (pid, tid): no cross-thread nesting
    # beyond the reorder window an early event can't be nested: counted, parented to the session
    sink, stats, _, root = _import(path, TorchTraceImportConfig(min_duration_us=0, reorder_window=1))
    assert stats.out_of_order == 1
    spans = {s.name: s for s in sink.spans}
    assert spans["early"].parent.span_id == root
    assert spans['child "q" {x}'].parent.span_id == spans["ProfilerStep#0"].context.span_id


def test_truncated_trace_is_an_error(session: dict[str, Any], tmp_path: Path) -> None:
    text = json.dumps(load_trace(session["files"][0]))
    bad = tmp_path / "cut.json"
    bad.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError):
        _import(bad)


def test_memory_stays_flat_while_the_trace_grows(tmp_path: Path) -> None:
    def write(path: Path, n: int) -> None:
        with open(path, "w") as f:
            f.write('{"baseTimeNanoseconds": 1700000000000000000, "traceEvents": [\n')
            for i in range(n):
                sep = "," if i < n - 1 else ""
                f.write(json.dumps({"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 7}", "pid": 1, "tid": 1,
                                    "ts": i * 10.0, "dur": 5.0, "args": {"External id": i, "Ev Idx": i}}) + sep + "\n")
            f.write("]}\n")

    peaks = []
    for n in (20_000, 80_000):
        path = tmp_path / f"t{n}.json"
        write(path, n)
        tracemalloc.start()
        try:
            _, stats, _, _ = _import(path, TorchTraceImportConfig(min_duration_us=0, max_spans=10, chunk_chars=64 * 1024))
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert stats.events == n and stats.dropped_cap == n - 10
        size = path.stat().st_size
        assert peaks[-1] < size / 3, (peaks[-1], size)
    assert peaks[1] < peaks[0] * 1.5  # 4x the events, about the same peak


def test_gputrace_bundle_is_an_artifact_with_its_size(tmp_path: Path) -> None:
    bundle = tmp_path / "cap.gputrace"
    (bundle / "store").mkdir(parents=True)
    (bundle / "store" / "a.bin").write_bytes(b"x" * 1000)
    (bundle / "index").write_bytes(b"y" * 24)
    attrs = gputrace_attributes(bundle)
    assert attrs["servewatch.artifact.size_bytes"] == 1024
    assert attrs["servewatch.artifact.path"] == str(bundle.resolve())
    assert attrs["servewatch.artifact.kind"] == "gputrace"


def test_session_artifacts_import_traces_attach_bundles_and_count_errors(session: dict[str, Any], tmp_path: Path) -> None:
    bundle = tmp_path / "cap.gputrace"
    bundle.mkdir()
    (bundle / "data").write_bytes(b"z" * 10)
    broken = tmp_path / "broken.trace.json.gz"
    broken.write_bytes(b"not gzip")
    steps = tmp_path / "x.mlx-steps.json"
    steps.write_text(json.dumps({"metal_trace_captured": False, "steps": [
        {"forward_ct": 7, "start_time_unix_nano": 1_000, "end_time_unix_nano": 2_000, "peak_memory_bytes": 4096},
        {"forward_ct": 8, "start_time_unix_nano": 2_000, "end_time_unix_nano": 3_500, "peak_memory_bytes": 8192},
    ]}))
    not_steps = tmp_path / "y.mlx-steps.json"
    not_steps.write_text("{}")
    sink = InMemorySink()
    root = new_span_id()
    attrs = import_profile_artifacts(
        [session["files"][0], str(bundle), str(broken), str(steps), str(not_steps)], sink, trace_id=new_trace_id(),
        parent_span_id=root, start_time_unix_nano=500, end_time_unix_nano=9_000,
    )
    assert attrs["servewatch.trace_import.files"] == 2 and attrs["servewatch.trace_import.errors"] == 2
    assert "broken.trace.json.gz" in attrs["servewatch.trace_import.error"]
    assert attrs["servewatch.trace_import.profiler_steps"] == 3
    mlx = sorted((s for s in sink.spans if s.name == "mlx.step"), key=lambda s: s.start_time)
    metal = [s for s in sink.spans if s.name == "metal.capture"]
    assert attrs["servewatch.trace_import.kept"] == len(sink.spans) - len(mlx) - len(metal) > 0
    assert attrs["servewatch.artifact.size_bytes"] == 10
    # MLX per-step records and the Metal capture are children of the session span too
    assert [(s.start_time, s.end_time, s.attributes["servewatch.forward_ct"], s.attributes["mlx.memory.peak_bytes"]) for s in mlx] == [
        (1_000, 2_000, 7, 4096), (2_000, 3_500, 8, 8192)]
    assert attrs["servewatch.mlx.steps"] == 2 and attrs["servewatch.mlx.metal_trace_captured"] is False
    (capture,) = metal
    assert (capture.start_time, capture.end_time) == (500, 9_000)
    assert capture.attributes["servewatch.artifact.kind"] == "gputrace" and capture.attributes["servewatch.artifact.size_bytes"] == 10
    assert all(s.parent is not None and s.parent.span_id == root for s in [*mlx, capture])


def test_mirror_puts_the_profile_inside_the_incident_trace(session: dict[str, Any]) -> None:
    from agent.model.events import (
        ActionResult,
        IncidentClosed,
        IncidentOpened,
        Outcome,
        ProfileStopped,
        frozen_attrs,
    )
    from exporters.mirror.mirror import SpanMirror
    from exporters.otlp.spans import span_id_hex, trace_id_hex

    sink = InMemorySink()
    mirror = SpanMirror(sink, host_name="h")
    tid, root = new_trace_id(), new_span_id()
    t0 = 1_700_000_000_000_000_000
    mirror.handle(IncidentOpened(incident_id="i", trigger="stall", trace_id=trace_id_hex(tid), span_id=span_id_hex(root), time_unix_nano=t0))
    result = ActionResult(
        action="profile.session", outcome=Outcome.OK, pid=1, artifact_paths=tuple(session["files"]),
        start_time_unix_nano=t0, end_time_unix_nano=t0 + 1, attributes=frozen_attrs({"servewatch.profile.steps_captured": 3}),
    )
    mirror.handle(ProfileStopped(incident_id="i", result=result))
    mirror.handle(IncidentClosed(incident_id="i", trigger="stall", bundle_dir="", manifest_path=""))
    [session_span] = sink.named("profile.session")
    assert session_span.parent.span_id == root
    assert session_span.attributes["servewatch.trace_import.profiler_steps"] == 3
    imported = [s for s in sink.spans if s.parent is not None and s.parent.span_id == session_span.context.span_id]
    assert sorted(s.name for s in imported if s.name.startswith("ProfilerStep#")) == [
        "ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    assert all(s.context.trace_id == tid for s in sink.spans)


# --- untrusted files (issue 34 item 1): bounded, linear, one-line reasons -----------------------


class _CountingSink:
    """Counts spans without keeping them (memory is measured on the import alone)."""

    def __init__(self) -> None:
        from opentelemetry.sdk.resources import Resource

        self.resource = Resource.get_empty()
        self.count = 0

    def emit(self, span: Any) -> None:
        self.count += 1


def _fails_with(path: Path, budget: Any = None) -> str:
    from exporters.mirror.torch_trace import ImportBudget

    budget = budget or ImportBudget(deadline_s=None)
    with pytest.raises(ValueError) as info:
        import_torch_trace(path, InMemorySink(), trace_id=1, parent_span_id=1, budget=budget)
    return f"{type(info.value).__name__}: {info.value} (read {budget.read_chars})"


def test_hostile_traces_fail_fast_without_reading_the_whole_file(tmp_path: Path) -> None:
    from exporters.mirror.torch_trace import MAX_VALUE_CHARS, ImportBudget

    unterminated = tmp_path / "u.trace.json"
    unterminated.write_text('{"traceEvents":[{"name":"' + "a" * (20 << 20))
    budget = ImportBudget(deadline_s=None)
    why = _fails_with(unterminated, budget)
    assert "a JSON value longer than 4.0 MiB at offset 16 (an unterminated string?)" in why
    # linear: the pending value is read in doubling steps up to the cap, never the whole 20 MB
    assert budget.read_chars <= 2 * MAX_VALUE_CHARS + (1 << 16)
    deep = tmp_path / "d.trace.json"
    deep.write_text('{"traceEvents":' + "[" * 200_000 + "]" * 200_000 + "}")
    assert "JSON nested too deeply at offset 16" in _fails_with(deep)
    nuls = tmp_path / "n.trace.json"
    with open(nuls, "w") as f:
        f.write('{"traceEvents":[{"name":"')
    os.truncate(nuls, 1 << 30)  # 1 GiB sparse: NULs are no JSON, said at once
    budget = ImportBudget(deadline_s=None)
    assert "malformed JSON at offset 25: Invalid control character" in _fails_with(nuls, budget)
    assert budget.read_chars <= 1 << 17
    # deeply nested top-level field and a gzip bomb over the read cap
    field = tmp_path / "f.trace.json"
    field.write_text('{"deviceProperties":' + "[" * 100_000 + "]" * 100_000 + ',"traceEvents":[]}')
    assert "nested too deeply" in _fails_with(field)
    bomb = tmp_path / "b.trace.json.gz"
    with gzip.open(bomb, "wt") as g:
        g.write('{"traceEvents":[' + " " * (8 << 20))
    assert "over the 1.0 MiB read cap" in _fails_with(bomb, ImportBudget(deadline_s=None, max_read_chars=1 << 20))
    # a deadline already past, and a cancel from another thread, stop at the next chunk
    assert "import deadline passed" in _fails_with(deep, ImportBudget(deadline_s=0.0))
    cancelled = ImportBudget(deadline_s=None)
    cancelled.cancel()
    assert "import cancelled (the agent is stopping)" in _fails_with(deep, cancelled)


def test_items_that_are_not_ranges_are_dropped_and_counted(tmp_path: Path) -> None:
    good = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 10.0, "dur": 20.0}
    rows = [
        good, [1, 2], 7, "x", None,
        {**good, "ts": "10"}, {**good, "dur": "20"}, {**good, "ts": 1e300}, {**good, "dur": -5},
        {**good, "cat": ["cpu_op"]}, {**good, "name": "n" * 10_000},
    ]
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": rows, "baseTimeNanoseconds": 1_700_000_000_000_000_000})
                    .replace("1e+300", "1e300"))
    sink, stats, _, _ = _import(path)
    assert stats.events == 11
    assert stats.kept == 2  # the good range, and the long name (cut)
    assert stats.dropped_invalid == 4 + 3  # not objects; ts/dur not numbers, ts out of range
    assert stats.dropped_min_duration == 1  # a negative duration is shorter than any minimum
    assert stats.dropped_category == 1  # a category that is not a name
    names = sorted(s.name for s in sink.spans)
    assert names == ["aten::mm", "n" * 512]
    nan = tmp_path / "nan.trace.json"
    nan.write_text('{"traceEvents":[{"ph":"X","cat":"cpu_op","name":"a","ts":NaN,"dur":Infinity}]}')
    assert _import(nan)[1].dropped_invalid == 1


def test_annotations_are_capped_too(tmp_path: Path) -> None:
    rows = [{"ph": "X", "cat": "user_annotation", "name": f"r{i}", "pid": 1, "tid": 1, "ts": i, "dur": 0.5}
            for i in range(50)]
    path = tmp_path / "a.trace.json"
    path.write_text(json.dumps({"traceEvents": rows}))
    _, stats, _, _ = _import(path, TorchTraceImportConfig(max_annotation_spans=20))
    assert (stats.kept, stats.kept_annotations, stats.dropped_cap) == (20, 20, 30)


def test_mlx_steps_are_streamed_not_read_whole(tmp_path: Path) -> None:
    from exporters.mirror.torch_trace import MAX_MLX_STEPS, import_mlx_steps

    path = tmp_path / "big.mlx-steps.json"
    with open(path, "w") as f:
        f.write('{"session_id":"s","metal_trace_captured":false,"detail":"","steps":[')
        f.write(",".join(
            json.dumps({"forward_ct": i, "start_time_unix_nano": 10 + i, "end_time_unix_nano": 11 + i,
                        "peak_memory_bytes": 4096, "note": "x" * 200})
            for i in range(MAX_MLX_STEPS + 20_000)))
        f.write("]}")
    size = path.stat().st_size
    assert size > 30 << 20
    sink = _CountingSink()
    tracemalloc.start()
    try:
        attrs = import_mlx_steps(path, sink, trace_id=1, parent_span_id=1)  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert attrs == {"servewatch.mlx.steps": MAX_MLX_STEPS, "servewatch.mlx.metal_trace_captured": False}
    assert sink.count == MAX_MLX_STEPS
    assert peak < size / 4  # read whole it is several times the file (json.loads of 30+ MB)


def test_profile_command_span_survives_hostile_files(tmp_path: Path) -> None:
    """``servewatch profile``'s inline import: a deep array and an unterminated string are errors
    on the session span, never a RecursionError that loses it."""
    from agent.model.events import ActionResult, Outcome
    from exporters.mirror.mirror import mirror_profile_session

    deep = tmp_path / "deep.pt.trace.json"
    deep.write_text('{"traceEvents":' + "[" * 200_000 + "]" * 200_000 + "}")
    cut = tmp_path / "cut.pt.trace.json"
    cut.write_text('{"traceEvents":[{"name":"' + "a" * (6 << 20))
    sink = InMemorySink()
    result = ActionResult(action="profile.session", outcome=Outcome.OK, artifact_paths=(str(deep), str(cut)))
    trace_id = mirror_profile_session(sink, result)
    [span] = sink.named("profile.session")
    assert span.context.trace_id == int(trace_id, 16)
    assert span.attributes["servewatch.trace_import.errors"] == 2
    assert "deep.pt.trace.json: ValueError: JSON nested too deeply" in span.attributes["servewatch.trace_import.error"]


def test_padded_events_cost_the_reorder_window_nothing(tmp_path: Path) -> None:
    """Kept events padded with 256 KiB each (a 5 MB .gz of 50 MB): the window holds what a span
    needs, not the events (before, every padded event sat in it until flushed)."""
    path = tmp_path / "pad.pt.trace.json.gz"
    pad = "p" * (256 << 10)
    with gzip.open(path, "wt") as g:
        g.write('{"traceEvents":[')
        g.write(",".join(json.dumps({"ph": "X", "cat": "user_annotation", "name": f"r{i}", "pid": 1, "tid": 1,
                                     "ts": i, "dur": 0.5, "pad": pad}) for i in range(200)))
        g.write("]}")
    sink = _CountingSink()
    tracemalloc.start()
    try:
        stats = import_torch_trace(path, sink, trace_id=1, parent_span_id=1)  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats.kept == sink.count == 200
    assert peak < 16 << 20, peak  # 50 MB of events went through; a few chunks and one event were held


def test_a_session_is_capped_over_all_its_files(tmp_path: Path) -> None:
    """Many files of one session share its caps: spans (not each file's own) and files."""
    from exporters.mirror.torch_trace import ImportBudget

    rows = [{"ph": "X", "cat": "user_annotation", "name": f"r{i}", "pid": 1, "tid": 1, "ts": i, "dur": 0.5}
            for i in range(4000)]
    paths = []
    for n in range(12):
        path = tmp_path / f"f{n:02}.pt.trace.json"
        path.write_text(json.dumps({"traceEvents": rows}))
        paths.append(str(path))
    sink = _CountingSink()
    budget = ImportBudget(deadline_s=None, max_spans=10_000, max_files=10)
    attrs = import_profile_artifacts(paths, sink, trace_id=1, parent_span_id=1, budget=budget)  # type: ignore[arg-type]
    assert sink.count == attrs["servewatch.trace_import.kept"] == 10_000  # not 12 x 4,000
    assert attrs["servewatch.trace_import.files"] == 10 and attrs["servewatch.trace_import.skipped"] == 2
    assert attrs["servewatch.trace_import.dropped_cap"] == 10 * 4000 - 10_000
    assert "f00.pt.trace.json" not in attrs.get("servewatch.trace_import.error", "")
    assert "over the 10 files per session cap" in attrs["servewatch.trace_import.error"]


def test_a_metal_bundle_walk_keeps_the_sessions_deadline(tmp_path: Path) -> None:
    from exporters.mirror.torch_trace import ImportBudget

    bundle = tmp_path / "cap.gputrace"
    for i in range(5):
        (bundle / f"d{i}").mkdir(parents=True)
        (bundle / f"d{i}" / "x").write_bytes(b"z")
    attrs = import_profile_artifacts([str(bundle)], InMemorySink(), trace_id=1, parent_span_id=1,
                                     budget=ImportBudget(deadline_s=0.0))
    assert attrs["servewatch.trace_import.errors"] == 1
    assert "import deadline passed" in attrs["servewatch.trace_import.error"]
