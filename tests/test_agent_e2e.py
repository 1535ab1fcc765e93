"""The whole agent against a real server: stall with /health 200 -> py-spy -> bundle -> OTLP trace."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from agent.config import load_settings
from agent.incidents import IncidentRecord
from agent.runtime import Agent
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
