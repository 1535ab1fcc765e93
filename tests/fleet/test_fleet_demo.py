"""Three agents on loopback, each a real ``servewatch run`` process with its own data dir, host
name and API port, watching its own real demo inference server (torch model, scheduler process,
SDK step counter). A hang on one server makes one trace at a real OTLP receiver with all three
hosts' evidence under the job's root span; a peer that is down is recorded and named in the job
verdict, and the others still capture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agent.demo import TORCH_MISSING_MESSAGE, torch_available
from agent.fleet.job import REPORT_TRIES
from tests.fleet._fleet import TOKEN, free_ports, token_file
from tests.otlp_receiver import otlp_receiver_fixture

pytestmark = [pytest.mark.skipif(not torch_available(), reason=TORCH_MISSING_MESSAGE), pytest.mark.slow]

HOSTS = ("node-a", "node-b", "node-c")
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def otlp_receiver():
    yield from otlp_receiver_fixture()


async def _get(client: httpx.AsyncClient, url: str) -> Any:
    try:
        r = await client.get(url, headers=AUTH)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


@pytest.mark.timeout(360)
async def test_a_hang_on_one_host_is_one_trace_with_every_hosts_evidence(tmp_path: Path, spawn, otlp_receiver) -> None:
    from agent.demo.client import DemoServer, agenerate, ainject_hang

    ports = free_ports(4)
    api_ports, dead_port = ports[:3], ports[3]
    peers = [arg for p in ports for arg in ("--peer", f"127.0.0.1:{p}")]  # the same list on every host
    token = token_file(tmp_path)
    servers: list[DemoServer] = [DemoServer(tp=1, ready_timeout_s=240) for _ in HOSTS]
    try:
        async with anyio.create_task_group() as tg:  # start the three servers at once (torch import)
            for server in servers:
                tg.start_soon(server.astart)
        logs = []
        for host, server, port in zip(HOSTS, servers, api_ports):
            log_path = tmp_path / f"{host}.log"
            logs.append(log_path)
            # the agent keeps its own copy of the descriptor
            with await anyio.to_thread.run_sync(log_path.open, "wb") as log:
                spawn(
                    [sys.executable, "-m", "agent.cli.app", "run", "--verbose",
                     "--pid", str(server.scheduler_pids[0]), "--health-url", f"{server.base_url}/health",
                     "--watchdog-timeout", "2", "--api-listen", f"127.0.0.1:{port}", "--api-token-file", str(token),
                     "--job", "demo-405b", *peers, "--allow-insecure-peers", "--otlp-endpoint", otlp_receiver.http_endpoint, "--otlp-protocol", "http/protobuf",
                     "--data-dir", str(tmp_path / host)],
                    env={**os.environ, "SERVEWATCH_HOST_NAME": host, "SERVEWATCH_EXPORT__METRICS": "false",
                         "SERVEWATCH_EXPORT__SCHEDULE_DELAY_S": "0.2", "SERVEWATCH_FLEET__PEER_TIMEOUT_S": "3"},
                    stdout=log, stderr=subprocess.STDOUT,
                )
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            for server in servers:  # every scheduler steps once: the watchdog clock starts
                await agenerate(server.base_url, "warm up", 4)
            with anyio.fail_after(120):  # every agent up, watching its scheduler's step counter
                for port in api_ports:
                    while True:
                        status = await _get(client, f"http://127.0.0.1:{port}/v1/status")
                        if status and any(t["step_counter_watched"] for t in status["targets"]):
                            break
                        await anyio.sleep(0.5)  # under the API's default rate limit (5/s)
            await ainject_hang(servers[0].base_url, tp_rank=0)
            async with anyio.create_task_group() as tg:
                async def in_flight() -> None:
                    try:
                        await agenerate(servers[0].base_url, "meets the hang", 4, timeout_s=120)
                    except httpx.HTTPError:
                        pass

                tg.start_soon(in_flight)
                manifests: dict[str, dict[str, Any]] = {}
                with anyio.fail_after(150):
                    while len(manifests) < 3:
                        for host, port in zip(HOSTS, api_ports):
                            listing = await _get(client, f"http://127.0.0.1:{port}/v1/incidents")
                            for item in (listing or {}).get("incidents", []):
                                if item.get("closed_time_unix_nano"):
                                    manifests[host] = await _get(client, f"http://127.0.0.1:{port}/v1/incidents/{item['incident_id']}")
                        await anyio.sleep(0.3)
                tg.cancel_scope.cancel()
            # no second incident anywhere: the three hosts' detections are one job incident
            for port in api_ports:
                assert len((await _get(client, f"http://127.0.0.1:{port}/v1/incidents"))["incidents"]) == 1
    finally:
        for server in servers:
            await anyio.to_thread.run_sync(server.stop)

    from agent.fleet.identity import root_span_of

    a, b, c = (manifests[h] for h in HOSTS)
    trace = a["trace_id"]
    root_id = root_span_of(trace)  # the job's root span: derived from the trace id on every host
    assert a["trigger"] == "stall" and a["parent_span_id"] == root_id
    assert b["trigger"] == c["trigger"] == "peer"
    assert b["trace_id"] == c["trace_id"] == trace
    assert b["parent_span_id"] == c["parent_span_id"] == root_id
    # every server holds a "rank 0" here (three TP=1 servers presented as one job): one of them
    # coordinates, the one node-a reported to
    [coord] = [m for m in (a, b, c) if any(x["action"] == "fleet.fanout" for x in m["actions"])]
    peers_seen = {x["attributes"]["servewatch.peer.address"]: x for x in coord["actions"] if x["action"] == "peer.capture"}
    assert peers_seen[f"http://127.0.0.1:{dead_port}"]["outcome"] == "failed"
    assert peers_seen[f"http://127.0.0.1:{dead_port}"]["attributes"]["servewatch.peer.error"] == "unreachable"
    assert all(v["outcome"] == "ok" for k, v in peers_seen.items() if not k.endswith(f":{dead_port}"))
    if coord is not a:  # node-a detected and reported to the coordinator, which did not ask it again
        # its report answered (CI, loaded: a first try past peer_timeout_s was sent again, as built)
        reports = [x["outcome"] for x in a["actions"] if x["action"] == "fleet.report"]
        assert reports[-1:] == ["ok"] and len(reports) <= REPORT_TRIES, reports
        assert f"http://127.0.0.1:{api_ports[0]}" not in peers_seen
    for m, server in zip((a, b, c), servers):
        # each host's scheduler
        [dump] = [x for x in m["actions"] if x["action"] == "pyspy.dump" and x["pid"] == server.scheduler_pids[0]]
        assert dump["outcome"] == "ok", dump

    # one trace at the collector, one incident root per host with its ranks, each host's stacks under it
    with anyio.fail_after(30):
        while True:
            # this job incident's spans (the servers' exits at teardown add follow-up incidents to the trace)
            ids = {m["incident_id"] for m in (a, b, c)}
            spans = [s for s in otlp_receiver.spans() if s.trace_id == trace and s.attributes.get("servewatch.incident.id") in ids]
            names = [(s.resource.get("host.name"), s.name) for s in spans]
            if all((h, n) in names for h in HOSTS for n in ("incident", "pyspy.dump")) and any(n == "job.incident" for _, n in names):
                break
            await anyio.sleep(0.2)
    [job_root] = [s for s in spans if s.parent_span_id == ""]
    assert job_root.name == "job.incident" and job_root.span_id == root_id and job_root.resource["host.name"] == coord["host.name"]
    assert job_root.attributes["servewatch.job.verdict.hosts"] == 3
    assert any(f"127.0.0.1:{dead_port}" in m for m in job_root.attributes["servewatch.job.verdict.missing_hosts"])
    roots = {s.resource["host.name"]: s for s in spans if s.name == "incident"}
    assert all(r.parent_span_id == root_id for r in roots.values())
    for host, root in roots.items():
        assert root.attributes["host.name"] == host
        assert root.attributes["servewatch.target.ranks"] == ("TP0",)
    assert all(s.parent_span_id == roots[s.resource["host.name"]].span_id for s in spans if s.name == "pyspy.dump")
    scheduler_of = {host: server.scheduler_pids[0] for host, server in zip(HOSTS, servers)}
    dumps = {s.resource["host.name"]: s for s in spans
             if s.name == "pyspy.dump" and s.attributes.get("process.pid") == scheduler_of[s.resource["host.name"]]}
    assert set(dumps) == set(HOSTS), sorted(dumps)
    assert "_injected_hang_in_forward" in dumps["node-a"].attributes["servewatch.pyspy.hung_frame"]
    assert "_injected_hang_in_forward" not in json.dumps(dumps["node-b"].attributes)
    outcomes = sorted(s.attributes["servewatch.outcome"] for s in spans if s.name == "peer.capture")
    assert outcomes == sorted(v["outcome"] for v in peers_seen.values())
