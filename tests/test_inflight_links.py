"""Correlated crash timelines end to end: the demo server hangs with a request in flight; the
incident lists that request (record, ``requests.json``) and its root span links, saying why, to the
request's in-flight span (its part up to the incident, in its own trace, sent at incident time: a
hung server SIGKILLed never ends its requests); the server's forward-step spans link to the
requests they served."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from agent.demo import TORCH_MISSING_MESSAGE, torch_available
from agent.demo.client import DemoServer, agenerate, ainject_hang
from agent.incidents.manager import IncidentRecord
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, attrs_dict, otlp_receiver_fixture

pytestmark = pytest.mark.skipif(not torch_available(), reason=TORCH_MISSING_MESSAGE)

HUNG_PROMPT = "this request meets the hang"
WARMUP_TOKENS = 4


@pytest.fixture
def otlp_receiver():
    yield from otlp_receiver_fixture()


async def _request_in_flight(base_url: str) -> None:
    try:
        await agenerate(base_url, HUNG_PROMPT, 4, timeout_s=120.0)
    except httpx.HTTPError:
        pass  # the server is stopped under it at the end of the test


def _server_env(otlp_receiver: OtlpReceiver, server_tracing: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if server_tracing:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_receiver.http_endpoint
        env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
        env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # ms: spans leave while the test runs
    return env


def _link_ids(span: ReceivedSpan) -> list[tuple[str, str]]:
    return [(link.trace_id.hex(), link.span_id.hex()) for link in span.span.links]


@pytest.mark.parametrize("server_tracing", [False, True], ids=["noop-tracer", "otlp-tracer"])
async def test_stall_incident_links_to_the_hung_request_in_flight(
    tmp_path: Path, otlp_receiver: OtlpReceiver, server_tracing: bool
) -> None:
    records: list[IncidentRecord] = []
    with anyio.fail_after(100):
        async with DemoServer(tp=1, env=_server_env(otlp_receiver, server_tracing)) as server:
            [tp0] = server.scheduler_pids
            settings = load_settings(
                {
                    "data_dir": tmp_path,
                    "host_name": "node-a",
                    "target": {"pids": [tp0]},
                    "health": {"url": f"{server.base_url}/health", "interval_s": 0.5, "timeout_s": 2.0},
                    "watchdog": {"timeout_s": 1.5, "poll_interval_s": 0.2},
                    "coredump": {"folder": tmp_path / "crash"},
                    "export": {"endpoint": otlp_receiver.grpc_endpoint, "protocol": "grpc", "metrics": False},
                }
            )
            agent = Agent(settings, on_incident=records.append)
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                warm = await agenerate(server.base_url, "warm-up", WARMUP_TOKENS)
                while tp0 not in agent.watched_step_pids:
                    await anyio.sleep(0.05)
                await ainject_hang(server.base_url, tp_rank=0)
                tg.start_soon(_request_in_flight, server.base_url)
                while not records:
                    await anyio.sleep(0.05)
                agent.stop()
                tg.cancel_scope.cancel("incident captured")

    [record] = records
    assert record.opened.trigger == "stall"
    # exactly the hung request was in flight in TP0, with its counts (never the warm-up, which ended)
    [req] = record.inflight
    assert req.pid == tp0
    assert len(req.request_id) == 32 and req.request_id != warm["meta_info"]["id"]
    assert req.age_s > 0
    assert req.prompt_tokens == len(HUNG_PROMPT.encode())
    assert req.generated_tokens == 0  # it hung in its first forward
    assert len(req.trace_id) == 32 and int(req.trace_id, 16) != 0
    assert len(req.span_id) == 16 and int(req.span_id, 16) != 0
    assert record.opened.links == ((req.trace_id, req.span_id),)

    # the bundle lists it, without the prompt
    bundle = tmp_path / "node-a" / record.opened.incident_id
    text = (bundle / "requests.json").read_text()
    doc = json.loads(text)
    assert doc["incident_id"] == record.opened.incident_id
    assert doc["requests"] == [
        {
            "pid": tp0,
            "request_id": req.request_id,
            "trace_id": req.trace_id,
            "span_id": req.span_id,
            "age_s": round(req.age_s, 6),
            "prompt_tokens": len(HUNG_PROMPT.encode()),
            "generated_tokens": 0,
        }
    ]
    assert HUNG_PROMPT not in text

    # the incident's root span, as the collector got it, links to the hung request's span
    def incident_root() -> ReceivedSpan | None:
        return next(
            (s for s in otlp_receiver.spans() if s.name == "incident" and s.trace_id == record.opened.trace_id), None
        )

    with anyio.fail_after(15):
        while (root := incident_root()) is None:
            await anyio.sleep(0.05)
    assert root.span_id == record.opened.span_id
    # it links to the request's in-flight span (sent at open, in the request's own trace), saying why
    [(link_trace, link_span)] = _link_ids(root)
    assert link_trace == req.trace_id and link_span != req.span_id
    why = attrs_dict(root.span.links[0].attributes)
    assert why["servewatch.link.reason"] == "request_in_flight" and why["servewatch.request.span_id"] == req.span_id
    assert why["gen_ai.response.id"] == req.request_id and why["process.pid"] == tp0
    with anyio.fail_after(15):
        while (snapshot := next((s for s in otlp_receiver.spans() if s.span_id == link_span), None)) is None:
            await anyio.sleep(0.05)
    assert snapshot.trace_id == req.trace_id and snapshot.name == "text_completion demo-tinylm (in flight)"
    assert snapshot.attributes["servewatch.request.in_flight"] is True
    assert snapshot.attributes["gen_ai.usage.output_tokens"] == 0

    if not server_tracing:
        # no OTEL_* in the server (the README's standalone demo): the agent shipped the warm-up's
        # spans under the demo's name (they arrived as service.name=unknown_service)
        def warm_spans() -> list[ReceivedSpan]:
            return [s for s in otlp_receiver.spans() if s.attributes.get("gen_ai.response.id") == warm["meta_info"]["id"]]

        with anyio.fail_after(15):
            while not warm_spans():
                await anyio.sleep(0.05)
        [shipped] = warm_spans()
        assert shipped.resource["service.name"] == "servewatch-demo"
        assert (shipped.resource["process.pid"], shipped.resource["host.name"]) == (tp0, "node-a")

    if server_tracing:
        # The demo server's own spans. The warm-up request: one forward span per token, each
        # linked to it. The hung request ended (as an error) when the server was stopped, so the
        # incident's link points at a span the collector has, as does its hung forward's link.
        def server_spans() -> list[ReceivedSpan]:
            return [s for s in otlp_receiver.spans() if s.scope == "servewatch.sdk"]

        with anyio.fail_after(15):
            while len(server_spans()) < WARMUP_TOKENS + 3:  # 2 requests, WARMUP_TOKENS + 1 forwards
                await anyio.sleep(0.05)
        spans = server_spans()
        assert all(s.resource["service.name"] == "servewatch-demo" for s in spans)
        requests = {s.attributes["gen_ai.response.id"]: s for s in spans if s.name == "text_completion demo-tinylm"}
        assert set(requests) == {warm["meta_info"]["id"], req.request_id}
        warm_span, hung_span = requests[warm["meta_info"]["id"]], requests[req.request_id]
        assert warm_span.attributes["gen_ai.usage.input_tokens"] == len(b"warm-up")
        assert warm_span.attributes["gen_ai.usage.output_tokens"] == WARMUP_TOKENS
        assert warm_span.span.status.code == Status.STATUS_CODE_UNSET
        assert (hung_span.trace_id, hung_span.span_id) == (req.trace_id, req.span_id)
        assert hung_span.attributes["gen_ai.usage.output_tokens"] == 0
        assert hung_span.span.status.code == Status.STATUS_CODE_ERROR

        forwards = sorted((s for s in spans if s.name == "forward"), key=lambda s: s.attributes["servewatch.forward_ct"])
        assert [s.attributes["servewatch.forward_ct"] for s in forwards] == list(range(1, WARMUP_TOKENS + 2))
        assert all(s.attributes["servewatch.forward.batch_size"] == 1 for s in forwards)
        for fwd in forwards[:-1]:
            assert _link_ids(fwd) == [(warm_span.trace_id, warm_span.span_id)]
            assert fwd.span.status.code == Status.STATUS_CODE_UNSET
        hung_forward = forwards[-1]
        assert _link_ids(hung_forward) == [(req.trace_id, req.span_id)]
        # no step is a trace of its own: each is a child of the request it served, in its trace
        # (2 requests, WARMUP_TOKENS + 1 steps: 2 traces, was WARMUP_TOKENS + 3)
        for fwd in forwards:
            [(trace_hex, span_hex)] = _link_ids(fwd)
            assert (fwd.trace_id, fwd.parent_span_id) == (trace_hex, span_hex)
        assert {s.trace_id for s in spans} == {warm_span.trace_id, hung_span.trace_id}
        assert hung_forward.span.status.code == Status.STATUS_CODE_ERROR


async def test_hung_server_sigkilled_its_requests_in_flight_reach_the_backend_in_their_own_traces_linked_from_the_incident(
    tmp_path: Path, otlp_receiver: OtlpReceiver, spawn, python: str
) -> None:
    # A request's span is written when it ends: a hung server that is SIGKILLed never ends its
    # requests, so the incident's links pointed at spans no backend ever got. The agent now sends,
    # at incident time, each in-flight request's part up to the incident, in the request's trace.
    import select
    import signal
    import subprocess

    from tests.conftest import PROGRAMS_DIR

    proc = spawn([python, str(PROGRAMS_DIR / "profiled_model.py"), "--hang-after-steps", "40", "--request-steps", "7",
                  "--concurrency", "2", "--step-sleep-s", "0.02", "--max-runtime-s", "90"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and proc.stdout.readline().startswith(b"READY")
    settings = load_settings(
        {
            "data_dir": tmp_path,
            "host_name": "node-k",
            "target": {"pids": [proc.pid]},
            "watchdog": {"timeout_s": 1.0, "poll_interval_s": 0.2},
            "coredump": {"enabled": False},
            "export": {"endpoint": otlp_receiver.grpc_endpoint, "protocol": "grpc", "metrics": False},
        }
    )
    records: list[IncidentRecord] = []
    agent = Agent(settings, on_incident=records.append)
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            while not records:
                await anyio.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)  # the hung server never recovers: its requests never end
            await anyio.to_thread.run_sync(proc.wait, 30)
            agent.stop()

    record = records[0]
    assert record.opened.trigger == "stall"
    inflight = record.inflight  # what the SDK reported (requests.json)
    assert len(inflight) == 2 and {r.pid for r in inflight} == {proc.pid}  # --concurrency 2

    def received() -> dict[str, ReceivedSpan]:
        return {s.span_id: s for s in otlp_receiver.spans()}

    def incident_root() -> ReceivedSpan | None:
        return next((s for s in received().values() if s.name == "incident" and s.trace_id == record.opened.trace_id), None)

    with anyio.fail_after(20):
        while (root := incident_root()) is None:
            await anyio.sleep(0.05)
        # and what it links to (sent at open, write-ahead, before the root)
        while not all(link.span_id.hex() in received() for link in root.span.links):
            await anyio.sleep(0.05)
    spans = received()
    # requests that ended before the hang were shipped by the agent, each its own trace
    done = [s for s in spans.values() if s.name == "chat tiny-mlp"]
    assert done and all(s.attributes["gen_ai.usage.output_tokens"] == 7 for s in done)
    links = {link.span_id.hex(): link for link in root.span.links}
    assert len(links) == 2
    for ref in inflight:
        # the request's own span never arrived (SIGKILLed mid-request) ...
        assert ref.span_id not in spans
        # ... its part up to the incident did, in its own trace, marked in flight
        [snap] = [s for s in spans.values() if s.trace_id == ref.trace_id]
        assert snap.name == "chat tiny-mlp (in flight)"
        assert snap.parent_span_id == ""  # the request was a trace root: so is its in-flight span
        assert snap.attributes["servewatch.request.in_flight"] is True
        assert snap.attributes["servewatch.request.span_id"] == ref.span_id
        assert snap.attributes["gen_ai.response.id"] == ref.request_id
        assert snap.attributes["process.pid"] == proc.pid
        assert snap.attributes["gen_ai.usage.input_tokens"] == 8
        assert 0 <= snap.attributes["gen_ai.usage.output_tokens"] < 7
        age_ns = snap.span.end_time_unix_nano - snap.span.start_time_unix_nano
        assert age_ns / 1e9 >= ref.age_s - 1e-6 > 0  # from the request's start (its age read before the open)
        assert snap.span.end_time_unix_nano == record.opened.time_unix_nano
        [back] = snap.span.links
        assert (back.trace_id.hex(), back.span_id.hex()) == (record.opened.trace_id, record.opened.span_id)
        # ... and the incident links to it, saying why
        link = links[snap.span_id]
        assert link.trace_id.hex() == ref.trace_id
        why = attrs_dict(link.attributes)
        assert why["servewatch.link.reason"] == "request_in_flight"
        assert why["gen_ai.response.id"] == ref.request_id and why["process.pid"] == proc.pid
        assert why["servewatch.request.span_id"] == ref.span_id
        assert why["servewatch.request.age_s"] > 0
