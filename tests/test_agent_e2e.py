"""The whole agent against a real server: stall with /health 200 -> py-spy -> bundle -> OTLP trace."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from agent.incidents.manager import IncidentRecord
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from tests.otlp_receiver import OtlpReceiver, otlp_receiver_fixture
from tests.programs import fake_server


@pytest.fixture
def otlp_receiver():
    yield from otlp_receiver_fixture()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
async def test_frozen_counter_with_health_200_opens_a_stall_incident_as_one_trace(
    tmp_path: Path, spawn, otlp_receiver: OtlpReceiver, protocol: str
) -> None:
    server = fake_server.start(spawn, "--title", "sglang::scheduler_TP0", "--freeze-after-steps", "20")
    settings = load_settings(
        {
            "data_dir": tmp_path,
            "host_name": "node-a",
            "target": {"pids": [server.pid]},
            "health": {"url": server.health_url, "interval_s": 0.2, "timeout_s": 1.0},
            "watchdog": {"timeout_s": 1.0, "poll_interval_s": 0.2},
            "coredump": {"folder": tmp_path / "crash"},
            "export": {"endpoint": otlp_receiver.endpoint(protocol), "protocol": protocol, "metrics": False},
        }
    )
    records: list[IncidentRecord] = []
    agent = Agent(settings, on_incident=records.append)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            while not records:
                await anyio.sleep(0.05)
            agent.stop()

    [record] = records
    assert record.opened.trigger == "stall"  # /health kept answering 200 all along
    assert record.opened.pids == (server.pid,)
    assert "no forward progress" in record.opened.detail
    dump = next(r for r in record.results if r.action == "pyspy.dump")
    assert dump.outcome.value == "ok", dump.detail
    assert "stuck_in_forward" in dump.attributes["servewatch.pyspy.hung_frame"]
    manifest = json.loads((tmp_path / "node-a" / record.opened.incident_id / "manifest.json").read_text())
    assert manifest["trigger"] == "stall"
    assert any(Path(p).name == f"pyspy-{server.pid}.json" for p in manifest["actions"][0]["artifact_paths"])

    # the trace arrived at the receiver: root `incident`, children per action, same trace
    assert otlp_receiver.wait_for_spans(len(record.results) + 1, timeout_s=10)
    spans = [s for s in otlp_receiver.spans() if s.trace_id == record.opened.trace_id]
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    [root] = by_name["incident"]
    assert root.parent_span_id == ""
    assert root.span_id == record.opened.span_id
    assert root.attributes["servewatch.incident.id"] == record.opened.incident_id
    assert root.attributes["servewatch.incident.trigger"] == "stall"
    assert root.attributes["host.name"] == "node-a"
    [pyspy_span] = by_name["pyspy.dump"]
    assert pyspy_span.parent_span_id == root.span_id
    assert pyspy_span.attributes["process.pid"] == server.pid
    assert "stuck_in_forward" in pyspy_span.attributes["servewatch.pyspy.hung_frame"]
    [core_span] = by_name["cuda.coredump"]
    assert core_span.parent_span_id == root.span_id
    assert core_span.attributes["servewatch.outcome"] == "not_armed"


async def test_idle_server_and_warm_up_never_open_an_incident(tmp_path: Path, spawn) -> None:
    idle = fake_server.start(spawn, "--mode", "idle")
    warming = fake_server.start(spawn, "--warmup-s", "30")
    settings = load_settings(
        {
            "data_dir": tmp_path,
            "target": {"pids": [idle.pid, warming.pid]},
            "health": {"url": idle.health_url, "interval_s": 0.2},
            "watchdog": {"timeout_s": 0.5, "poll_interval_s": 0.1},
        }
    )
    agent = Agent(settings)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            await anyio.sleep(2.5)  # five watchdog timeouts
            agent.stop()
    assert agent.incidents.records == []


async def test_manual_incident_profiles_the_next_steps_and_links_requests_in_flight(tmp_path: Path, spawn, python: str) -> None:
    import os
    import select
    import subprocess

    from agent.runtime.agent import dump_once
    from tests.conftest import PROGRAMS_DIR

    shm = tmp_path / "shm"
    env = dict(os.environ, SERVEWATCH_SHM_DIR=str(shm))
    proc = spawn([python, str(PROGRAMS_DIR / "profiled_model.py"), "--request-steps", "50", "--max-runtime-s", "90"],
                 stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and proc.stdout.readline().startswith(b"READY")
    from agent.sdk import counter_path, read_counter

    with anyio.fail_after(30):  # READY comes before the loop admits its first requests
        while (snap := read_counter(counter_path(proc.pid, shm))) is None or snap.forward_ct < 1:
            await anyio.sleep(0.02)
    settings = load_settings(
        {
            "data_dir": tmp_path / "data",
            "host_name": "node-b",
            "target": {"pids": [proc.pid]},
            "coredump": {"enabled": False},
            "profiler": {"on_incident_steps": 2, "activities": ["CPU"], "socket_dir": shm},
        }
    )
    with anyio.fail_after(90):
        record = await dump_once(settings)

    actions = {r.action: r for r in record.results}
    # stacks first, then the collective Flight Recorder (this model has no process group), then the profile
    assert list(actions) == ["pyspy.dump", "flightrec.dump", "profile.session"]
    assert actions["flightrec.dump"].outcome.value == "not_enabled", actions["flightrec.dump"].detail
    prof = actions["profile.session"]
    assert prof.outcome.value == "ok", prof.detail
    assert prof.attributes["servewatch.profile.steps_captured"] == 2
    assert all(Path(p).is_relative_to(record.bundle_dir) for p in prof.artifact_paths)

    # requests in flight at open time: links on the incident, listed in requests.json (no prompt text)
    assert len(record.inflight) == 2
    assert record.opened.links == tuple((r.trace_id, r.span_id) for r in record.inflight)
    listed = json.loads((record.bundle_dir / "requests.json").read_text())["requests"]
    assert {r["request_id"] for r in listed} == {r.request_id for r in record.inflight}
    assert all(r["prompt_tokens"] == 8 and r["age_s"] > 0 for r in listed)

    # one trace: incident root, profile.session under it, ProfilerStep ranges under the session
    lines = [json.loads(line) for f in (tmp_path / "data").glob("*/spans/*.jsonl") for line in f.read_text().splitlines()]
    spans = [s for req in lines for rs in req["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]
             if s["traceId"] == record.opened.trace_id]
    by_id = {s["spanId"]: s for s in spans}
    [root] = [s for s in spans if s["name"] == "incident"]
    # each link goes to the request's in-flight span (its part up to the incident, sent at open in
    # the request's own trace: the request's own span arrives only if it ever ends)
    everything = {s["spanId"]: s for req in lines for rs in req["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]}
    requests = {r.span_id: r.trace_id for r in record.inflight}
    linked = {}
    for link in root["links"]:
        target = everything[link["spanId"]]
        attrs = {a["key"]: a["value"] for a in target["attributes"]}
        assert target["traceId"] == link["traceId"] and target["name"] == "chat tiny-mlp (in flight)"
        assert attrs["servewatch.request.in_flight"] == {"boolValue": True}
        linked[attrs["servewatch.request.span_id"]["stringValue"]] = link["traceId"]
    assert linked == requests
    [session] = [s for s in spans if s["name"] == "profile.session"]
    assert session["parentSpanId"] == root["spanId"]
    steps = [s for s in spans if s["name"].startswith("ProfilerStep#")]
    assert len(steps) == 2 and all(by_id[s["parentSpanId"]]["name"] == "profile.session" for s in steps)
