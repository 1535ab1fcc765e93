"""An incident can join a trace begun elsewhere (W3C traceparent), move into another trace while it
runs, and carry companion results (peer fan-out) into its manifest and spans."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from agent.host.targets import Target
from agent.incidents.manager import IncidentConfig, IncidentManager
from agent.model.bus import RecordingBus
from agent.model.events import (
    ActionCompleted,
    ActionResult,
    IncidentClosed,
    IncidentOpened,
    Outcome,
    StacksDumped,
    WatchdogStalled,
    now_ns,
)
from exporters.mirror.mirror import SpanMirror
from exporters.otlp.spans import InMemorySink, new_span_id, new_trace_id, span_id_hex, trace_id_hex


async def _dump(opened: IncidentOpened, targets: Sequence[Target], bundle: Path, report: object) -> list[ActionResult]:
    t = now_ns()
    await anyio.sleep(0.05)
    return [ActionResult(action="pyspy.dump", outcome=Outcome.OK, pid=x.pid, start_time_unix_nano=t, end_time_unix_nano=now_ns())
            for x in targets]


def _manager(tmp_path: Path, bus: RecordingBus, **kw: Any) -> IncidentManager:
    return IncidentManager(
        bus=bus, config=IncidentConfig(cooldown_s=60), data_dir=tmp_path, host_name="node-b",
        discover=lambda: [Target(pid=4242, title="demo::scheduler_TP0")],
        phases=[("pyspy.dump", _dump, StacksDumped)], **kw,
    )


async def _mirrored(bus: RecordingBus, sink: InMemorySink) -> None:
    mirror = SpanMirror(sink, host_name="node-b")
    for event in bus.events:
        mirror.handle(event)


async def test_incident_with_a_traceparent_joins_that_trace_under_that_span(tmp_path: Path) -> None:
    bus = RecordingBus()
    manager = _manager(tmp_path, bus)
    trace, parent = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    record = await manager.open_incident("peer", detail="asked by node-a", parent=(trace, parent))

    assert record.opened.trace_id == trace
    assert record.opened.parent_span_id == parent
    manifest = json.loads(record.manifest_path.read_text())
    assert manifest["trace_id"] == trace and manifest["parent_span_id"] == parent
    sink = InMemorySink()
    await _mirrored(bus, sink)
    [root] = sink.named("incident")
    assert f"{root.context.trace_id:032x}" == trace
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent
    [dump] = sink.named("pyspy.dump")
    assert dump.context.trace_id == root.context.trace_id and dump.parent.span_id == root.context.span_id


async def test_incident_without_traceparent_is_a_trace_root(tmp_path: Path) -> None:
    bus = RecordingBus()
    record = await _manager(tmp_path, bus).open_incident("manual")
    assert record.opened.parent_span_id == ""
    sink = InMemorySink()
    await _mirrored(bus, sink)
    [root] = sink.named("incident")
    assert root.parent is None


async def test_retrace_moves_a_running_incident_into_the_other_trace(tmp_path: Path) -> None:
    bus = RecordingBus()
    trace, parent = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    moved: list[bool] = []

    async def companion_run(opened: IncidentOpened) -> None:
        moved.append(await manager.retrace(opened.incident_id, trace, parent))

    async with anyio.create_task_group() as tg:
        manager = _manager(tmp_path, bus, companions=[lambda opened: (tg.start_soon(companion_run, opened), _nothing)[1]])
        record = await manager.open_incident("stall")
    assert moved == [True]
    first_trace = bus.of_type(IncidentOpened)[0].trace_id
    assert first_trace != trace
    manifest = json.loads(record.manifest_path.read_text())
    assert (manifest["trace_id"], manifest["parent_span_id"]) == (trace, parent)
    sink = InMemorySink()
    await _mirrored(bus, sink)
    [root] = sink.named("incident")
    assert f"{root.context.trace_id:032x}" == trace and f"{root.parent.span_id:016x}" == parent
    assert root.attributes["servewatch.incident.retraced_from"] == first_trace
    assert {f"{s.context.trace_id:032x}" for s in sink.spans} == {trace}
    assert await manager.retrace(record.opened.incident_id, trace, parent) is False  # closed now


async def _nothing() -> list[ActionCompleted]:
    return []


async def test_companion_results_reach_manifest_and_bus_before_close(tmp_path: Path) -> None:
    bus = RecordingBus()

    def companion(opened: IncidentOpened):
        async def collect() -> list[ActionCompleted]:
            t = now_ns()
            return [ActionCompleted(source="peers", incident_id=opened.incident_id,
                                    result=ActionResult(action="peer.capture", outcome=Outcome.TIMED_OUT,
                                                        detail="node-c slow", start_time_unix_nano=t, end_time_unix_nano=t))]
        return collect

    manager = _manager(tmp_path, bus, companions=[companion])
    record = await manager.open_incident("manual")
    assert [r.action for r in record.results] == ["pyspy.dump", "peer.capture"]
    manifest = json.loads(record.manifest_path.read_text())
    assert manifest["actions"][1]["outcome"] == "timed_out"
    kinds = [type(e).__name__ for e in bus.events if isinstance(e, (ActionCompleted, IncidentClosed))]
    assert kinds == ["StacksDumped", "ActionCompleted", "IncidentClosed"]


async def test_admit_hook_folds_a_detection(tmp_path: Path) -> None:
    bus = RecordingBus()
    seen: list[str] = []
    manager = _manager(tmp_path, bus, admit=lambda trigger, detail: seen.append(trigger) is not None)  # always False
    async with anyio.create_task_group() as tg:
        await tg.start(manager.run)
        await bus.publish(WatchdogStalled(pid=4242, forward_ct=3, stalled_for_s=2.0, timeout_s=1.0))
        with anyio.fail_after(10):
            while not seen:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert seen == ["stall"] and manager.records == [] and manager.suppressed == 1
