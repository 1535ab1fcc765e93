"""SpanMirror: incident and action events become one trace (root ``incident``, one child per action)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio
from opentelemetry.trace import StatusCode

from agent.model.bus import EventBus
from agent.model.events import (
    ActionResult,
    CoredumpTriggered,
    IncidentClosed,
    IncidentOpened,
    Outcome,
    ProfileStopped,
    StacksDumped,
    frozen_attrs,
    now_ns,
)
from exporters.mirror.mirror import MIRRORED_EVENTS, SpanMirror
from exporters.otlp.provider import ExportConfig, build_telemetry
from exporters.otlp.spans import InMemorySink, new_span_id, new_trace_id, span_id_hex, trace_id_hex
from tests.otlp_receiver import OtlpReceiver

T0 = 1_700_000_000_000_000_000


def _events(trace_hex: str, root_hex: str) -> list:
    opened = IncidentOpened(
        incident_id="inc-42",
        trigger="stall",
        detail="no forward step for 30 s",
        pids=(101, 102),
        bundle_dir="/data/h/inc-42",
        trace_id=trace_hex,
        span_id=root_hex,
        time_unix_nano=T0,
    )
    dump_ok = ActionResult(
        action="pyspy.dump",
        outcome=Outcome.OK,
        pid=101,
        start_time_unix_nano=T0 + 1_000_000,
        end_time_unix_nano=T0 + 400_000_000,
        artifact_paths=("/data/h/inc-42/pyspy-101.json",),
        attributes=frozen_attrs({"servewatch.pyspy.threads": 3, "servewatch.pyspy.top_frames": ("forward (model.py:88)",)}),
    )
    dump_denied = ActionResult(
        action="pyspy.dump",
        outcome=Outcome.PERMISSION_DENIED,
        pid=102,
        detail="needs CAP_SYS_PTRACE",
        start_time_unix_nano=T0 + 1_000_000,
        end_time_unix_nano=T0 + 5_000_000,
    )
    core = ActionResult(action="cuda.coredump", outcome=Outcome.NOT_ARMED, pid=101, start_time_unix_nano=T0 + 401_000_000, end_time_unix_nano=T0 + 402_000_000)
    profile = ActionResult(action="profile.session", outcome=Outcome.OK, start_time_unix_nano=T0 + 403_000_000, end_time_unix_nano=T0 + 900_000_000)
    return [
        opened,
        StacksDumped(incident_id="inc-42", result=dump_ok),
        StacksDumped(incident_id="inc-42", result=dump_denied),
        CoredumpTriggered(incident_id="inc-42", result=core),
        ProfileStopped(incident_id="inc-42", result=profile),
        IncidentClosed(
            incident_id="inc-42",
            trigger="stall",
            bundle_dir="/data/h/inc-42",
            manifest_path="/data/h/inc-42/manifest.json",
            outcomes=(("pyspy.dump", "ok"), ("pyspy.dump", "permission_denied")),
            time_unix_nano=T0 + 1_000_000_000,
        ),
    ]


def test_incident_becomes_root_with_one_child_per_action() -> None:
    sink = InMemorySink()
    mirror = SpanMirror(sink, host_name="gpu-node-3")
    trace_id, root_id = new_trace_id(), new_span_id()
    for event in _events(trace_id_hex(trace_id), span_id_hex(root_id)):
        mirror.handle(event)
    spans = sink.spans
    assert [s.name for s in spans] == ["pyspy.dump", "pyspy.dump", "cuda.coredump", "profile.session", "incident"]
    assert {s.context.trace_id for s in spans} == {trace_id}
    root = sink.named("incident")[0]
    assert root.parent is None and root.context.span_id == root_id
    assert (root.start_time, root.end_time) == (T0, T0 + 1_000_000_000)
    assert root.attributes["servewatch.incident.id"] == "inc-42"
    assert root.attributes["servewatch.incident.trigger"] == "stall"
    assert root.attributes["host.name"] == "gpu-node-3"
    assert root.attributes["servewatch.target.pids"] == (101, 102)
    # the permission refusal only: a coredump not armed (no GPU) is a fact, as the terminal's Errors: says
    assert root.attributes["servewatch.incident.failed_actions"] == 1
    assert root.attributes["servewatch.incident.actions"] == 4
    assert root.status.status_code is StatusCode.UNSET  # no verdict: nothing says the server is dead
    children = [s for s in spans if s.name != "incident"]
    assert all(s.parent is not None and s.parent.span_id == root_id for s in children)
    ok_dump, denied = sink.named("pyspy.dump")
    assert (ok_dump.start_time, ok_dump.end_time) == (T0 + 1_000_000, T0 + 400_000_000)
    assert ok_dump.status.status_code is StatusCode.OK
    assert ok_dump.attributes["process.pid"] == 101
    assert ok_dump.attributes["servewatch.pyspy.threads"] == 3
    assert ok_dump.attributes["servewatch.artifact.paths"] == ("/data/h/inc-42/pyspy-101.json",)
    assert denied.status.status_code is StatusCode.ERROR and denied.status.description == "needs CAP_SYS_PTRACE"
    assert denied.attributes["servewatch.outcome"] == "permission_denied"
    assert mirror.open_incidents == ()


@dataclass(frozen=True, slots=True, kw_only=True)
class IncidentOpenedWithLinks(IncidentOpened):
    """What ``IncidentOpened`` looks like once it carries in-flight request links (read via getattr)."""

    links: tuple[tuple[str, str], ...] = ()


def test_links_attribute_becomes_span_links_on_the_root() -> None:
    sink = InMemorySink()
    mirror = SpanMirror(sink, host_name="h")
    req_trace, req_span = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    mirror.handle(
        IncidentOpenedWithLinks(
            incident_id="inc-9",
            trigger="stall",
            trace_id=trace_id_hex(new_trace_id()),
            span_id=span_id_hex(new_span_id()),
            links=((req_trace, req_span), ("zz", "not-hex")),
            time_unix_nano=T0,
        )
    )
    mirror.handle(IncidentClosed(incident_id="inc-9", trigger="stall", bundle_dir="", manifest_path="", time_unix_nano=T0 + 5))
    root = sink.named("incident")[0]
    assert [(trace_id_hex(link.context.trace_id), span_id_hex(link.context.span_id)) for link in root.links] == [(req_trace, req_span)]
    assert dict(root.links[0].attributes) == {"servewatch.link.reason": "request_in_flight"}


def test_action_for_unknown_incident_is_still_mirrored_and_counted() -> None:
    sink = InMemorySink()
    mirror = SpanMirror(sink, host_name="h")
    result = ActionResult(action="pyspy.dump", outcome=Outcome.OK, start_time_unix_nano=T0, end_time_unix_nano=T0 + 1)
    mirror.handle(StacksDumped(incident_id="never-opened", result=result))
    assert mirror.orphans == 1 and sink.spans[0].attributes["servewatch.incident.id"] == "never-opened"


async def test_run_consumes_a_bus_subscription_and_closes_open_incidents_at_the_end() -> None:
    sink = InMemorySink()
    mirror = SpanMirror(sink, host_name="h")
    bus = EventBus()
    events = _events(trace_id_hex(new_trace_id()), span_id_hex(new_span_id()))
    second_open = IncidentOpened(incident_id="inc-43", trigger="health", trace_id="", span_id="", time_unix_nano=now_ns())
    with anyio.fail_after(10):
        async with bus.subscribe(*MIRRORED_EVENTS, name="mirror") as sub, anyio.create_task_group() as tg:
            tg.start_soon(mirror.run, sub)
            for event in [*events, second_open]:
                await bus.publish(event)
            await bus.aclose()
    names = [s.name for s in sink.spans]
    assert names.count("incident") == 2
    unclosed = next(s for s in sink.named("incident") if s.attributes["servewatch.incident.id"] == "inc-43")
    assert unclosed.attributes["servewatch.incident.unclosed"] == "agent stopped"


def test_incident_trace_arrives_at_a_real_receiver(otlp_receiver: OtlpReceiver, protocol: str, tmp_path: Path) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint(protocol), "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
    telemetry = build_telemetry(ExportConfig(metrics=False), data_dir=tmp_path, host_name="gpu-node-3", environ=env)
    mirror = SpanMirror(telemetry.sink, host_name="gpu-node-3", export_statistics=telemetry.processor.statistics)
    trace_hex, root_hex = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    try:
        for event in _events(trace_hex, root_hex):
            mirror.handle(event)
        assert telemetry.processor.flush(10.0) is True
    finally:
        telemetry.shutdown(3.0)
    spans = [s for s in otlp_receiver.spans() if s.trace_id == trace_hex]
    assert sorted(s.name for s in spans) == ["cuda.coredump", "incident", "profile.session", "pyspy.dump", "pyspy.dump"]
    root = next(s for s in spans if s.name == "incident")
    assert root.span_id == root_hex and root.parent_span_id == ""
    assert {s.parent_span_id for s in spans if s.name != "incident"} == {root_hex}
    attrs = root.attributes
    assert attrs["servewatch.incident.id"] == "inc-42"
    assert attrs["servewatch.incident.trigger"] == "stall"
    assert attrs["host.name"] == "gpu-node-3"
    assert attrs["servewatch.target.pids"] == (101, 102)
    assert attrs["servewatch.export.spans_lost"] == 0
    assert (root.span.start_time_unix_nano, root.span.end_time_unix_nano) == (T0, T0 + 1_000_000_000)
    denied = next(s for s in spans if s.name == "pyspy.dump" and s.attributes["process.pid"] == 102)
    assert denied.span.status.code == 2 and denied.attributes["servewatch.outcome"] == "permission_denied"
    assert spans[0].resource["host.name"] == "gpu-node-3"


def test_not_armed_and_skipped_are_not_error_spans_but_failures_are() -> None:
    from exporters.mirror.mirror import action_span

    sink = InMemorySink()
    statuses = {}
    for outcome in (Outcome.NOT_ARMED, Outcome.SKIPPED, Outcome.TIMED_OUT, Outcome.OK):
        result = ActionResult(action="cuda.coredump", outcome=outcome, detail="why", start_time_unix_nano=T0, end_time_unix_nano=T0 + 5)
        span = action_span(sink, result, trace_id=new_trace_id(), parent_span_id=new_span_id(), default_time_unix_nano=T0)
        statuses[outcome] = span.status.status_code
        assert span.attributes["servewatch.outcome"] == outcome.value
    assert statuses == {Outcome.NOT_ARMED: StatusCode.UNSET, Outcome.SKIPPED: StatusCode.UNSET,
                        Outcome.TIMED_OUT: StatusCode.ERROR, Outcome.OK: StatusCode.OK}


def _closed_with_verdict(kind: str, hung: bool) -> list:
    trace_hex, root_hex = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    opened = IncidentOpened(incident_id="inc-v", trigger="exit", trace_id=trace_hex, span_id=root_hex, time_unix_nano=T0)
    core = ActionResult(action="cuda.coredump", outcome=Outcome.NOT_ARMED, pid=7, start_time_unix_nano=T0, end_time_unix_nano=T0 + 1)
    verdict = frozen_attrs({"servewatch.verdict.kind": kind, "servewatch.verdict.hung": hung,
                            "servewatch.verdict.reason": f"{kind} reason"})
    closed = IncidentClosed(incident_id="inc-v", trigger="exit", bundle_dir="", manifest_path="", time_unix_nano=T0 + 9,
                            attributes=verdict)
    return [opened, CoredumpTriggered(incident_id="inc-v", result=core),
            CoredumpTriggered(incident_id="inc-v", result=core), closed]


def test_root_is_an_error_when_the_verdict_says_dead_or_hung_and_not_armed_is_no_failure() -> None:
    statuses = {}
    for kind, hung in (("dead", False), ("cascade", False), ("behind", True), ("progressing", False), ("idle", False)):
        sink = InMemorySink()
        mirror = SpanMirror(sink, host_name="h")
        for event in _closed_with_verdict(kind, hung):
            mirror.handle(event)
        [root] = sink.named("incident")
        # a host without a GPU: two coredumps not armed, no failure (the terminal says Errors: 0)
        assert root.attributes["servewatch.incident.failed_actions"] == 0
        assert root.attributes["servewatch.incident.actions"] == 2
        statuses[kind] = (root.status.status_code, root.status.description)
    assert statuses == {
        "dead": (StatusCode.ERROR, "dead: dead reason"),
        "cascade": (StatusCode.ERROR, "cascade: cascade reason"),
        "behind": (StatusCode.ERROR, "behind: behind reason"),
        "progressing": (StatusCode.UNSET, None),
        "idle": (StatusCode.UNSET, None),
    }


def test_requests_in_flight_get_a_span_in_their_own_trace_at_open_linked_from_the_root_with_why() -> None:
    from agent.model.events import InflightSpan

    sink = InMemorySink()
    mirror = SpanMirror(sink, host_name="h")
    inc_trace, inc_root = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    root_req = InflightSpan(pid=41, request_id="req-1", trace_id=trace_id_hex(new_trace_id()), span_id=span_id_hex(new_span_id()),
                            start_time_unix_nano=T0 - 3_000_000_000, name="chat tiny", operation="chat", model="tiny",
                            input_tokens=8, output_tokens=2, age_s=3.0)
    caller = span_id_hex(new_span_id())  # this request sits under the caller's HTTP span
    child_req = InflightSpan(pid=41, request_id="req-2", trace_id=trace_id_hex(new_trace_id()), span_id=span_id_hex(new_span_id()),
                             parent_span_id=caller, start_time_unix_nano=T0 - 1_000_000_000, name="chat tiny", age_s=1.0)
    opened = IncidentOpened(incident_id="inc-7", trigger="stall", trace_id=inc_trace, span_id=inc_root, time_unix_nano=T0,
                            links=((root_req.trace_id, root_req.span_id), (child_req.trace_id, child_req.span_id)),
                            inflight=(root_req, child_req))
    mirror.handle(opened)
    # at once, before the incident closes (the server may be SIGKILLed next)
    first, second = sink.named("chat tiny (in flight)")
    assert [trace_id_hex(s.context.trace_id) for s in (first, second)] == [root_req.trace_id, child_req.trace_id]
    assert first.parent is None and second.parent is not None and span_id_hex(second.parent.span_id) == caller
    assert (first.start_time, first.end_time) == (T0 - 3_000_000_000, T0)
    assert dict(first.attributes) == {
        "servewatch.request.in_flight": True, "servewatch.request.span_id": root_req.span_id,
        "servewatch.incident.id": "inc-7", "gen_ai.response.id": "req-1", "process.pid": 41,
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny",
        "gen_ai.usage.input_tokens": 8, "gen_ai.usage.output_tokens": 2,
    }
    [back] = first.links
    assert (trace_id_hex(back.context.trace_id), span_id_hex(back.context.span_id)) == (inc_trace, inc_root)
    assert dict(back.attributes) == {"servewatch.link.reason": "incident", "servewatch.incident.id": "inc-7"}
    assert first.context.span_id != int(root_req.span_id, 16)  # never the request's own span id (it may still end)

    mirror.handle(IncidentClosed(incident_id="inc-7", trigger="stall", bundle_dir="", manifest_path="", time_unix_nano=T0 + 9))
    [root] = sink.named("incident")
    assert [(trace_id_hex(lk.context.trace_id), lk.context.span_id) for lk in root.links] == [
        (root_req.trace_id, first.context.span_id), (child_req.trace_id, second.context.span_id)]
    assert dict(root.links[0].attributes) == {
        "servewatch.link.reason": "request_in_flight", "gen_ai.response.id": "req-1", "process.pid": 41,
        "servewatch.request.age_s": 3.0, "servewatch.request.span_id": root_req.span_id,
    }
