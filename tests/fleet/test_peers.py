"""A job of agents on loopback (separate data dirs, host names and ports), in one process, each
watching a real titled target: a detection anywhere is one trace with one root (the job's
``job.incident``, emitted by the coordinator with the job verdict), every host's ``incident``
under it; hosts that detect at the same moment need no message to agree on the trace; the
coordinator asks only the hosts that did not report; peer failures are named in the job verdict
and never delay local capture."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from agent.incidents.manager import IncidentRecord
from agent.model.events import WatchdogStalled
from agent.runtime.agent import Agent
from agent.views.bundle import load_incident
from agent.views.report import render_report_html
from agent.views.timeline import render_timeline_text
from tests.fleet._fleet import free_ports, running_agent, settings_for, token_file
from tests.otlp_receiver import OtlpReceiver, otlp_receiver_fixture

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
HOSTS = ("node-a", "node-b", "node-c")


@pytest.fixture
def otlp_receiver():
    yield from otlp_receiver_fixture()


def _targets(spawn, python: str, n: int) -> list[int]:
    pids = []
    procs = [spawn([python, str(PROGRAMS / "titled_target.py"), f"demo::scheduler_TP{i}"], stdout=subprocess.PIPE) for i in range(n)]
    for proc in procs:
        assert proc.stdout.readline().startswith(b"ready")
        pids.append(proc.pid)
    return pids


#: each host's API on its own loopback address (Linux routes all of 127/8 to lo): the job's
#: member list sorts by address, so node-a is the lowest host
ADDRESSES = ("127.0.0.11", "127.0.0.12", "127.0.0.13")


@asynccontextmanager
async def job_of_agents(
    tmp_path: Path, otlp: OtlpReceiver, pids: list[int], *, extra_peers: tuple[str, ...] = (), wait_coordinator: bool = True,
    addresses: tuple[str, ...] = ADDRESSES, **fleet: Any,
) -> AsyncIterator[list[tuple[Agent, list[IncidentRecord]]]]:
    ports = free_ports(len(pids))
    peers = [f"{a}:{p}" for a, p in zip(addresses, ports)] + list(extra_peers)  # the same list everywhere: each skips itself
    async with AsyncExitStack() as stack:
        agents = []
        for host, address, port, pid in zip(HOSTS, addresses, ports, pids):
            settings = settings_for(
                tmp_path, host, port, api={"host": address}, target={"pids": [pid]}, coredump={"enabled": False},
                export={"endpoint": otlp.http_endpoint, "protocol": "http/protobuf", "metrics": False, "schedule_delay_s": 0.1},
                fleet={"job": "llama-405b", "peers": peers, "peer_timeout_s": 3.0, "announce_interval_s": 0.5,
                       "evidence_timeout_s": 20.0, **fleet},
            )
            agents.append(await stack.enter_async_context(running_agent(settings)))
        if wait_coordinator:  # node-a holds rank 0 (TP0): once its announce reached the others, it coordinates
            await _until(lambda: all(ag.fleet.announced is not None for ag, _ in agents[1:]), timeout_s=30)
        yield agents


async def _until(cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.05)


def _requests(agents: list[tuple[Agent, list[IncidentRecord]]]) -> int:
    """Requests of the job's protocol received so far: reports, joins, evidence summaries (not the
    rank-0 host's periodic announce)."""
    return sum(ag.fleet.reports_received + ag.fleet.joins + ag.fleet.evidence_received for ag, _ in agents)


def _stalled(pid: int) -> WatchdogStalled:
    return WatchdogStalled(source="test", pid=pid, forward_ct=7, stalled_for_s=2.0, timeout_s=1.0)


def _one_trace_one_root(otlp: OtlpReceiver, trace: str, hosts: tuple[str, ...]) -> dict[str, Any]:
    spans = [s for s in otlp.spans() if s.trace_id == trace]
    roots = [s for s in spans if s.parent_span_id == ""]
    assert [s.name for s in roots] == ["job.incident"], [(s.name, s.resource.get("host.name")) for s in roots]
    [root] = roots
    incidents = {s.resource["host.name"]: s for s in spans if s.name == "incident"}
    assert set(incidents) == set(hosts)
    assert all(s.parent_span_id == root.span_id for s in incidents.values())
    ids = {s.span_id for s in spans}
    assert all(s.parent_span_id in ids for s in spans if s is not root)  # no span hangs under a missing parent
    return {"root": root, "incidents": incidents, "spans": spans}


async def test_a_detection_on_one_host_is_captured_by_every_host_in_one_trace_under_one_root(
    tmp_path: Path, spawn, python, otlp_receiver
) -> None:
    pids = _targets(spawn, python, 3)
    async with job_of_agents(tmp_path, otlp_receiver, pids) as agents:
        (a, recs_a), (b, recs_b), (_c, recs_c) = agents
        assert a.fleet.local_ranks == (0,) and b.fleet.announced.host_name == "node-a"
        before = _requests(agents)
        await b.bus.publish(_stalled(pids[1]))  # node-b detects; node-a (rank 0) coordinates
        await _until(lambda: bool(recs_a and recs_b and recs_c) and a.fleet.verdicts == 1, timeout_s=90)
        used = _requests(agents) - before
    [ra], [rb], [rc] = recs_a, recs_b, recs_c
    trace = rb.opened.trace_id
    assert ra.opened.trace_id == rc.opened.trace_id == trace
    assert (rb.opened.trigger, ra.opened.trigger, rc.opened.trigger) == ("stall", "peer", "peer")
    # one report (b -> a), one join (a -> c), two evidence summaries (b, c -> a): O(N), <= 2N
    assert used <= 2 * len(agents), used
    assert b.fleet.reports_sent == 1 and a.fleet.reports_received == 1 and a.fleet.peers_asked == 1, [(r.action, r.detail) for r in rb.results]
    [fanout] = [r for r in ra.results if r.action == "fleet.fanout"]
    assert fanout.attributes["servewatch.fanout.asked"] == 1 and fanout.attributes["servewatch.fanout.reported"] == 1
    assert json.loads(Path(fanout.artifact_paths[0]).read_text())["asked"][0]["outcome"] == "ok"
    verdict_doc = json.loads((ra.bundle_dir / "job-verdict.json").read_text())
    assert verdict_doc["hosts_with_evidence"] == 3 and verdict_doc["verdict"]["captured_ranks"] == [0, 1, 2]
    assert set(verdict_doc["bundles"]) == set(HOSTS)
    # read where the paged engineer reads it: `servewatch timeline` and `report` of the coordinator's bundle
    tl = load_incident(ra.bundle_dir)
    assert tl.job_verdict is not None and tl.job_verdict["headline"] == verdict_doc["verdict"]["headline"], tl.warnings
    assert tl.job_verdict["coordinator"] == "node-a" and tl.job_verdict["hosts_with_evidence"] == 3
    text = render_timeline_text(tl, width=200)
    title = "job verdict · coordinated by node-a · evidence from 3 of 3 hosts"
    assert text.index(title) < text.index(verdict_doc["verdict"]["headline"]) < text.index("Verdict:"), text
    closing = text[text.rindex("╭─ verdict · peer · "):]  # the panel the screen ends on: the job's verdict, then this host's
    assert closing.index(verdict_doc["verdict"]["headline"]) < closing.index("Verdict:"), text
    page = render_report_html(tl)
    assert f"<h2>{title}</h2>" in page and page.index('id="job-verdict"') < page.index('id="verdict"'), page[:3000]
    assert load_incident(rb.bundle_dir).job_verdict is None  # only the coordinator holds it

    assert otlp_receiver.wait_for_spans(3 * 2 + 2, timeout_s=20)
    with anyio.fail_after(20):
        while not any(s.name == "job.incident" for s in otlp_receiver.spans()):
            await anyio.sleep(0.1)
    shape = _one_trace_one_root(otlp_receiver, trace, HOSTS)
    root = shape["root"]
    assert root.resource["host.name"] == "node-a"
    assert root.attributes["servewatch.job.verdict.hosts"] == 3 and root.attributes["servewatch.job.verdict.captured_ranks"] == 3
    # what to do next, said on the job's root span as in job-verdict.json
    assert verdict_doc["verdict"]["next"] and root.attributes["servewatch.job.verdict.next"] == verdict_doc["verdict"]["next"]
    assert {h: s.attributes["servewatch.target.ranks"] for h, s in shape["incidents"].items()} == {
        "node-a": ("TP0",), "node-b": ("TP1",), "node-c": ("TP2",)}
    dumps = [s for s in shape["spans"] if s.name == "pyspy.dump"]
    assert sorted(s.resource["host.name"] for s in dumps) == list(HOSTS)


@pytest.mark.parametrize("announced", [True, False], ids=["rank0-announced", "lowest-host"])
async def test_hosts_detecting_in_the_same_millisecond_make_one_trace_with_no_join(
    tmp_path: Path, spawn, python, otlp_receiver, announced: bool
) -> None:
    pids = _targets(spawn, python, 3)
    fleet: dict[str, Any] = {"time_bucket_s": 3600.0}  # detections 1 ms apart never straddle a bucket here
    addresses = ADDRESSES
    if not announced:
        # node-a (rank 0) announces once, before the others listen, then only every 10 min: the
        # lowest host of the shared list coordinates, here node-c
        fleet["announce_interval_s"] = 600.0
        addresses = tuple(reversed(ADDRESSES))
    async with job_of_agents(tmp_path, otlp_receiver, pids, wait_coordinator=announced, addresses=addresses, **fleet) as agents:
        before = _requests(agents)
        async with anyio.create_task_group() as tg:
            for (agent, _), pid in zip(agents, pids):
                tg.start_soon(agent.bus.publish, _stalled(pid))
        await _until(lambda: all(recs for _, recs in agents) and sum(ag.fleet.verdicts for ag, _ in agents) == 1, timeout_s=90)
        await anyio.sleep(0.5)  # a late duplicate would open now
        used = _requests(agents) - before
        moved = sum(ag.fleet.moved for ag, _ in agents)
        joins = sum(ag.fleet.peers_asked for ag, _ in agents)
    records = [r for _, recs in agents for r in recs]
    assert len(records) == 3 and all(r.opened.trigger == "stall" for r in records)  # one incident per host
    traces = {r.opened.trace_id for r in records}
    assert len(traces) == 1 and moved == 0  # derived alike everywhere: nobody had to move
    assert joins == 0 and used <= 2 * len(agents), (joins, used)  # everyone reported; nobody needed asking
    [trace] = traces
    with anyio.fail_after(20):
        while not any(s.name == "job.incident" for s in otlp_receiver.spans()):
            await anyio.sleep(0.1)
    assert otlp_receiver.wait_for_spans(3 * 2 + 1, timeout_s=20)
    shape = _one_trace_one_root(otlp_receiver, trace, HOSTS)
    assert shape["root"].attributes["servewatch.job.reported"] == 2
    assert shape["root"].resource["host.name"] == ("node-a" if announced else "node-c")


async def test_peer_failures_are_named_in_the_job_verdict_and_never_delay_local_capture(
    tmp_path: Path, spawn, python, otlp_receiver
) -> None:
    pids = _targets(spawn, python, 2)
    [dead_port, slow_port, other_job_port] = free_ports(3)
    dead, slow, other_host = "127.0.0.21", "127.0.0.22", "127.0.0.23"  # above node-a's address: it coordinates

    async def silent(stream) -> None:  # accepts and never answers: a hung peer
        async with stream:
            await anyio.sleep(30)

    listener = await anyio.create_tcp_listener(local_host=slow, local_port=slow_port)
    other_tokens = tmp_path / "other"
    other_tokens.mkdir()
    other = settings_for(other_tokens, "node-x", other_job_port, api={"host": other_host})  # another token: refuses ours
    other = other.model_copy(update={"api": other.api.model_copy(update={"token_file": token_file(other_tokens, "different")})})
    async with listener, anyio.create_task_group() as tg, running_agent(other):
        tg.start_soon(listener.serve, silent)
        extra = (f"{dead}:{dead_port}", f"{slow}:{slow_port}", f"{other_host}:{other_job_port}")
        # node-a is the lowest live host: its announce never reaches the dead peers, so it
        # coordinates by the member order, not as rank 0's host
        async with job_of_agents(tmp_path, otlp_receiver, pids, extra_peers=extra, evidence_timeout_s=8.0,
                                 wait_coordinator=False) as agents:
            (a, recs_a), (b, recs_b) = agents
            await a.incidents.open_incident("manual")
            await _until(lambda: bool(recs_b) and a.fleet.verdicts == 1, timeout_s=60)
        tg.cancel_scope.cancel()
    [ra] = recs_a
    peers = {r.attributes["servewatch.peer.address"]: r for r in ra.results if r.action == "peer.capture"}
    assert len(peers) == 4  # a small job: one span per peer asked
    assert peers[f"http://{ADDRESSES[1]}:{b.fleet.port}"].outcome.value == "ok"
    gone = peers[f"http://{dead}:{dead_port}"]
    assert gone.outcome.value == "failed" and gone.attributes["servewatch.peer.error"] == "unreachable" and gone.retryable
    hung = peers[f"http://{slow}:{slow_port}"]
    assert hung.outcome.value == "timed_out" and hung.attributes["servewatch.peer.error"] == "timeout"
    refused = peers[f"http://{other_host}:{other_job_port}"]
    assert refused.outcome.value == "refused" and refused.attributes["http.response.status_code"] == 401
    # local capture did not wait for the slow peer: the dump started before that peer gave up
    [dump] = [r for r in ra.results if r.action == "pyspy.dump"]
    assert dump.outcome.value == "ok" and dump.start_time_unix_nano < hung.end_time_unix_nano
    # the job verdict names every host it could not hear from, and why
    verdict = json.loads((ra.bundle_dir / "job-verdict.json").read_text())["verdict"]
    missing = {m["host"]: m["why"] for m in verdict["missing_hosts"]}
    unproven = " (host name not proven)"  # never an address as a host's name
    assert missing == {
        f"http://{dead}:{dead_port}{unproven}": "agent unreachable (connection failed)",
        f"http://{slow}:{slow_port}{unproven}": "agent unreachable (timed out: host down or partitioned)",
        f"http://{other_host}:{other_job_port}{unproven}": "agent refused",
    }, missing
    assert set(verdict["hosts"]) == {"node-a", "node-b"}
    assert f"http://{slow}:{slow_port}" in verdict["reason"]


async def test_peers_from_a_dns_name(tmp_path: Path, spawn, python, otlp_receiver) -> None:
    [pid] = _targets(spawn, python, 1)
    [port_b] = free_ports(1)
    settings_b = settings_for(tmp_path, "node-b", port_b, target={"pids": [pid]}, coredump={"enabled": False},
                              fleet={"job": "j", "announce_interval_s": 600})
    async with running_agent(settings_b) as (_b, recs_b):
        [port_a] = free_ports(1)
        settings_a = settings_for(tmp_path, "node-a", port_a, fleet={"job": "j", "peers_dns": f"localhost:{port_b}",
                                                                     "announce_interval_s": 600})
        async with running_agent(settings_a) as (a, recs_a):
            await a.incidents.open_incident("manual")
            await _until(lambda: bool(recs_b))
    [ra], [rb] = recs_a, recs_b
    assert rb.opened.trace_id == ra.opened.trace_id
    asked = [r for r in ra.results if r.action in ("peer.capture", "fleet.report") and r.outcome.value == "ok"]
    assert [r.attributes["servewatch.peer.host.name"] for r in asked] == ["node-b"]


async def test_a_peer_that_does_not_speak_http_is_a_failed_capture_not_a_crash() -> None:
    from agent.fleet.peers import Peer, PeerCredentials, call_peer

    async def junk(stream) -> None:
        async with stream:
            await stream.receive()
            await stream.send(b"SSH-2.0-OpenSSH_9.6\r\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, junk)
        reply = await call_peer(Peer("127.0.0.1", port), "/v1/incidents", {}, credentials=PeerCredentials(), timeout_s=5)
        tg.cancel_scope.cancel()
    assert reply.doc is None and not reply.verified
    result = reply.result
    assert result.outcome.value == "failed" and result.attributes["servewatch.peer.error"] == "bad_response"
    assert result.action == "peer.capture" and result.retryable


async def test_a_detection_after_a_join_is_folded_but_a_later_crash_is_its_own_incident(tmp_path: Path, spawn, python) -> None:
    from agent.fleet.traceparent import TraceParent
    from agent.model.events import TargetExited
    from exporters.otlp.spans import new_span_id, new_trace_id, span_id_hex, trace_id_hex

    [pid] = _targets(spawn, python, 1)
    [port] = free_ports(1)
    settings = settings_for(tmp_path, "node-b", port, target={"pids": [pid]}, coredump={"enabled": False}, fleet={"job": "j"})
    trace, parent = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    async with running_agent(settings) as (agent, records):
        status, doc = await agent.fleet.post_incident(
            {"traceparent": TraceParent(trace, parent), "job": "j", "origin_host": "node-a", "incident_id": "inc-a",
             "origin_time_unix_nano": 1, "detail": None}, agent_id="someone-else",
        )
        assert (status, doc["status"], doc["trace_id"]) == (202, "opened", trace)
        await agent.bus.publish(_stalled(pid))
        await _until(lambda: bool(records) and agent.fleet.folded == 1 and agent.incidents.current is None)
        [joined] = records
        assert joined.opened.trace_id == trace and joined.opened.trigger == "peer"
        folded = [r for r in joined.results if r.action == "fleet.detection_folded"]
        assert all(r.outcome.value == "skipped" and "stall" in r.detail for r in folded)
        # a manual request in the window attaches, and names the trace
        status, doc = await agent.fleet.post_incident({"traceparent": None, "detail": None}, agent_id="someone-else")
        assert (status, doc["status"], doc["trace_id"]) == (200, "attached", trace)
        # the target dies later: a new fact, its own incident (same window, not folded)
        await agent.bus.publish(TargetExited(source="test", pid=pid, signal=9, title="demo::scheduler_TP0"))
        await _until(lambda: len(records) == 2)
    exit_incident = records[1]
    assert exit_incident.opened.trigger == "exit"
    assert agent.fleet.folded == 1
    # a follow-up of the job incident: in its trace, under the job's root span
    assert (exit_incident.opened.trace_id, exit_incident.opened.parent_span_id) == (trace, parent)
    assert not [r for r in exit_incident.results if r.action in ("peer.capture", "fleet.report", "fleet.fanout")]


async def test_above_the_tree_threshold_the_coordinator_asks_relays_and_each_host_is_asked_once(
    tmp_path: Path, spawn, python, otlp_receiver
) -> None:
    pids = _targets(spawn, python, 5)
    hosts = tuple(f"node-{c}" for c in "abcde")
    addresses = tuple(f"127.0.0.{31 + i}" for i in range(5))
    ports = free_ports(5)
    peers = [f"{a}:{p}" for a, p in zip(addresses, ports)]
    async with AsyncExitStack() as stack:
        agents = []
        for host, address, port, pid in zip(hosts, addresses, ports, pids):
            settings = settings_for(
                tmp_path, host, port, api={"host": address}, target={"pids": [pid]}, coredump={"enabled": False},
                export={"endpoint": otlp_receiver.http_endpoint, "protocol": "http/protobuf", "metrics": False, "schedule_delay_s": 0.1},
                fleet={"job": "big", "peers": peers, "tree_threshold": 2, "announce_interval_s": 600, "evidence_timeout_s": 20},
            )
            agents.append(await stack.enter_async_context(running_agent(settings)))
        a = agents[0][0]
        await a.incidents.open_incident("manual", detail="a hang seen only here")
        await _until(lambda: all(recs for _, recs in agents) and a.fleet.verdicts == 1, timeout_s=90)
        joins = [ag.fleet.joins for ag, _ in agents]
    records = [recs[0] for _, recs in agents]
    assert len({r.opened.trace_id for r in records}) == 1
    assert joins == [0, 1, 1, 1, 1]  # every other host asked exactly once: by the coordinator or by a relay
    [fanout] = [r for r in records[0].results if r.action == "fleet.fanout"]
    assert fanout.attributes["servewatch.fanout.relays"] == 2 and fanout.attributes["servewatch.fanout.asked"] == 2
    verdict = json.loads((records[0].bundle_dir / "job-verdict.json").read_text())
    assert verdict["hosts_with_evidence"] == 5 and sorted(verdict["bundles"]) == list(hosts)


async def test_manual_incidents_posted_to_every_agent_at_once_are_one_incident_per_host_in_one_trace(
    tmp_path: Path, spawn, python, otlp_receiver
) -> None:
    import httpx

    from tests.fleet._fleet import TOKEN

    pids = _targets(spawn, python, 3)
    async with job_of_agents(tmp_path, otlp_receiver, pids, wait_coordinator=False, announce_interval_s=600.0) as agents:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client, anyio.create_task_group() as tg:
            answers: list[httpx.Response] = []

            async def post(agent: Agent) -> None:
                address = agent.settings.api.host
                answers.append(await client.post(f"http://{address}:{agent.fleet.port}/v1/incidents", json={"detail": "on-call"},
                                                 headers={"authorization": f"Bearer {TOKEN}"}))

            for agent, _ in agents:
                tg.start_soon(post, agent)
        await _until(lambda: all(recs for _, recs in agents) and sum(ag.fleet.verdicts for ag, _ in agents) == 1, timeout_s=60)
        await anyio.sleep(0.5)
    records = [r for _, recs in agents for r in recs]
    assert len(records) == 3, [r.opened.trigger for r in records]  # not 3 manual + joins
    assert len({r.opened.trace_id for r in records}) == 1
    assert all(a.status_code in (200, 202) and a.json()["trace_id"] == records[0].opened.trace_id for a in answers), \
        [a.text for a in answers]


async def test_in_a_large_job_each_hosts_action_spans_go_to_a_linked_trace_of_its_own(
    tmp_path: Path, spawn, python, otlp_receiver
) -> None:
    pids = _targets(spawn, python, 3)
    # "large" above 2 hosts here (trace_detail_max_hosts): every host's detail is linked, not inline
    async with job_of_agents(tmp_path, otlp_receiver, pids, trace_detail_max_hosts=2) as agents:
        (a, _), (b, recs_b), _ = agents
        await b.bus.publish(_stalled(pids[1]))
        await _until(lambda: all(recs for _, recs in agents) and a.fleet.verdicts == 1, timeout_s=90)
    trace = recs_b[0].opened.trace_id
    with anyio.fail_after(30):
        while not (any(s.name == "job.incident" for s in otlp_receiver.spans())
                   and sum(1 for s in otlp_receiver.spans() if s.name == "incident.detail") == 3):
            await anyio.sleep(0.1)
    in_job = [s for s in otlp_receiver.spans() if s.trace_id == trace]
    assert sorted(s.name for s in in_job) == ["incident", "incident", "incident", "job.incident"]  # one summary span per host
    _one_trace_one_root(otlp_receiver, trace, HOSTS)
    for incident in (s for s in in_job if s.name == "incident"):
        detail_trace = incident.attributes["servewatch.trace.detail_trace_id"]
        [link] = [lk for lk in incident.span.links if lk.trace_id.hex() == detail_trace]
        detail = [s for s in otlp_receiver.spans() if s.trace_id == detail_trace]
        [root] = [s for s in detail if s.parent_span_id == ""]
        assert root.name == "incident.detail" and link.span_id.hex() == root.span_id
        assert root.span.links[0].span_id.hex() == incident.span_id  # and back
        assert any(s.name == "pyspy.dump" and s.parent_span_id == root.span_id for s in detail)
        assert incident.attributes["servewatch.incident.actions"] >= 1  # the summary: counts and outcomes


@pytest.mark.parametrize("slow", ["first-answer", "every-answer"])
async def test_a_report_answered_past_the_peer_timeout_leaves_one_coordinator_and_one_job_incident(
    tmp_path: Path, spawn, python, otlp_receiver, slow: str
) -> None:
    """node-a (rank 0) takes node-b's report at once but its answer comes 2.5 s later, past
    node-b's bound (``peer_timeout_s`` 1 s): the first answer only (a load spike), or every one.
    node-b must not coordinate beside node-a: it retries node-a; when every answer is late it
    coordinates for a while, learns from node-a's join answer that node-a coordinates, backs
    down and sends node-a its evidence. One ``job.incident`` in the trace, one job verdict, the
    election recorded on it."""
    pids = _targets(spawn, python, 3)
    async with job_of_agents(tmp_path, otlp_receiver, pids, peer_timeout_s=1.0) as agents:
        (a, recs_a), (b, recs_b), (c, recs_c) = agents
        on_report = a.fleet._on_report
        late: list[str] = []

        async def answer_late(message: Any, sender: Any) -> tuple[int, dict[str, Any]]:
            answer = await on_report(message, sender)  # taken at once: node-a coordinates
            if slow == "every-answer" or not late:
                late.append(message.host_name)
                await anyio.sleep(2.5)  # past node-b's bound
            return answer

        a.fleet._on_report = answer_late  # type: ignore[method-assign]
        await b.bus.publish(_stalled(pids[1]))  # node-b detects; node-a (rank 0) coordinates

        def settled() -> bool:
            job_b = b.fleet.job
            return (bool(recs_a and recs_b and recs_c) and a.fleet.verdicts >= 1 and job_b is not None and job_b.done.is_set()
                    and (not job_b.coordinating or b.fleet.verdicts >= 1))

        await _until(settled, timeout_s=90)
        verdicts = (a.fleet.verdicts, b.fleet.verdicts, c.fleet.verdicts)
        coordinator_b = b.fleet.job.coordinator_host if b.fleet.job is not None else None
    assert late and late[0] == "node-b"
    assert verdicts == (1, 0, 0) and coordinator_b == "node-a", (verdicts, coordinator_b)
    doc, shape = await _node_a_alone_judged(recs_a, recs_b, recs_c, otlp_receiver)
    assert doc["backed_down"] == (["node-b"] if slow == "every-answer" else []), doc["backed_down"]
    assert shape["root"].attributes["servewatch.job.hosts_with_evidence"] == 3


async def _node_a_alone_judged(recs_a, recs_b, recs_c, otlp_receiver) -> tuple[dict[str, Any], dict[str, Any]]:
    """One incident per host in one trace; node-a's job verdict from all three hosts' evidence;
    its ``job.incident`` the only one (and no ``job.verdict`` from another host). Returns the
    job verdict document and the trace's shape."""
    [ra], [rb], [rc] = recs_a, recs_b, recs_c
    trace = ra.opened.trace_id
    assert rb.opened.trace_id == rc.opened.trace_id == trace
    doc = json.loads((ra.bundle_dir / "job-verdict.json").read_text())
    assert doc["coordinator"] == "node-a" and doc["hosts_with_evidence"] == 3 and set(doc["bundles"]) == set(HOSTS)
    with anyio.fail_after(20):
        while not any(s.name == "job.incident" for s in otlp_receiver.spans()):
            await anyio.sleep(0.1)
    assert otlp_receiver.wait_for_spans(3 * 2 + 1, timeout_s=20)
    shape = _one_trace_one_root(otlp_receiver, trace, HOSTS)
    assert [s.resource["host.name"] for s in shape["spans"] if s.name in ("job.incident", "job.verdict")] == ["node-a"]
    return doc, shape


async def test_a_coordinator_whose_report_and_join_answers_all_come_late_is_still_the_only_one(
    tmp_path: Path, spawn, python, otlp_receiver
) -> None:
    """node-a (rank 0) takes every report and join at once but answers each 2.5 s later, past the
    others' bound (``peer_timeout_s`` 1 s). node-b and node-c detect together: node-b reports to
    node-a (3 tries, all late), then coordinates for a while; node-c, after its own 3 late
    tries, reports to node-b; node-b's join to node-a times out too. Before it judges anything,
    node-b asks node-a once more (a report marked provisional, which node-a answers at once):
    node-a coordinates, node-b backs down, and node-c's evidence sent to node-b is redirected to
    node-a. One ``job.incident``, node-a's, judged from all three hosts' evidence."""
    pids = _targets(spawn, python, 3)
    async with job_of_agents(tmp_path, otlp_receiver, pids, peer_timeout_s=1.0) as agents:
        (a, recs_a), (b, recs_b), (c, recs_c) = agents
        on_report, on_join = a.fleet._on_report, a.fleet.post_incident
        late: list[str] = []

        async def report_late(message: Any, sender: Any) -> tuple[int, dict[str, Any]]:
            answer = await on_report(message, sender)
            if not getattr(message, "provisional", False):
                late.append(f"report from {message.host_name}")
                await anyio.sleep(2.5)
            return answer

        async def join_late(request: Any, **kw: Any) -> tuple[int, dict[str, Any]]:
            answer = await on_join(request, **kw)
            late.append(f"join from {request.get('origin_host')}")
            await anyio.sleep(2.5)
            return answer

        a.fleet._on_report = report_late  # type: ignore[method-assign]
        a.fleet.post_incident = join_late  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.bus.publish, _stalled(pids[1]))
            tg.start_soon(c.bus.publish, _stalled(pids[2]))

        def settled() -> bool:
            jobs = [ag.fleet.job for ag, _ in agents[1:]]
            return (bool(recs_a and recs_b and recs_c) and a.fleet.verdicts >= 1 and all(j is not None and j.done.is_set() for j in jobs)
                    and all(not j.coordinating or ag.fleet.verdicts >= 1 for j, (ag, _) in zip(jobs, agents[1:])))  # type: ignore[union-attr]

        await _until(settled, timeout_s=120)
        verdicts = (a.fleet.verdicts, b.fleet.verdicts, c.fleet.verdicts)
    assert "report from node-b" in late and "join from node-b" in late, late
    assert verdicts == (1, 0, 0), verdicts
    doc, shape = await _node_a_alone_judged(recs_a, recs_b, recs_c, otlp_receiver)
    assert doc["backed_down"] == ["node-b"] and doc["election"] == "", doc
    assert shape["root"].attributes["servewatch.job.backed_down"] == ("node-b",)


async def test_evidence_a_provisional_coordinator_took_before_it_backed_down_reaches_the_job_verdict(
    tmp_path: Path, spawn, python, otlp_receiver
) -> None:
    """Issue 35: node-a (rank 0) takes node-b's report but answers every report, and every join,
    past node-b's bound; node-c refuses node-a's join (so it follows node-b). node-b coordinates
    provisionally, settles, and takes node-c's evidence (``received``); only then does node-a
    answer node-b's provisional report, before node-b's verdict: node-b backs down. Before, node-c's
    evidence stayed with node-b and node-a judged the job from two hosts of three. Now node-b tells
    node-c where the coordinator is (``/v1/job/moved``), node-c sends its evidence there again,
    and node-a's verdict (which waits for the hosts node-b named) has all three."""
    pids = _targets(spawn, python, 3)
    async with job_of_agents(tmp_path, otlp_receiver, pids, peer_timeout_s=1.0, evidence_timeout_s=40.0) as agents:
        (a, recs_a), (b, recs_b), (c, recs_c) = agents
        on_report, on_join, c_join = a.fleet._on_report, a.fleet.post_incident, c.fleet.post_incident

        def c_evidence_taken_by_b() -> bool:
            job = b.fleet.job
            return job is not None and job.done.is_set() and "node-c" in job.evidence

        async def report_late(message: Any, sender: Any) -> tuple[int, dict[str, Any]]:
            answer = await on_report(message, sender)
            if not (getattr(message, "provisional", False) and c_evidence_taken_by_b()):
                await anyio.sleep(2.5)  # past node-b's bound
            return answer

        async def join_late(request: Any, **kw: Any) -> tuple[int, dict[str, Any]]:
            answer = await on_join(request, **kw)
            await anyio.sleep(2.5)
            return answer

        async def c_refuses_node_a(request: Any, **kw: Any) -> tuple[int, dict[str, Any]]:
            if request.get("origin_host") == "node-a":
                return 409, {"error": "test: node-a's join refused", "host.name": "node-c"}
            return await c_join(request, **kw)

        a.fleet._on_report = report_late  # type: ignore[method-assign]
        a.fleet.post_incident = join_late  # type: ignore[method-assign]
        c.fleet.post_incident = c_refuses_node_a  # type: ignore[method-assign]
        await b.bus.publish(_stalled(pids[1]))  # node-b detects; node-a (rank 0) coordinates

        def settled() -> bool:
            job_b, job_c = b.fleet.job, c.fleet.job
            return (bool(recs_a and recs_b and recs_c) and a.fleet.verdicts >= 1 and job_b is not None and job_b.backed_down
                    and job_c is not None and job_c.done.is_set())

        await _until(settled, timeout_s=120)
        verdicts = (a.fleet.verdicts, b.fleet.verdicts, c.fleet.verdicts)
        coordinator_c = c.fleet.job.coordinator_host if c.fleet.job is not None else None
    assert verdicts == (1, 0, 0), verdicts
    assert coordinator_c == "node-a"
    doc, _shape = await _node_a_alone_judged(recs_a, recs_b, recs_c, otlp_receiver)
    assert doc["backed_down"] == ["node-b"] and doc["hosts_expected"] == 3, doc


async def test_a_host_whose_clock_is_30_s_ahead_is_said_with_its_offset_in_the_job_verdict_and_on_its_root(
    tmp_path: Path, spawn, python, otlp_receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35 item 6: under the signature window a skewed host's requests are accepted and its
    spans land off by its skew in the trace. Every signed request carries its sender's time: the
    coordinator records each host's clock offset from its evidence and says the skewed ones.
    node-c's clock runs 30 s ahead here (its signatures say so: the three agents share one
    process, hence one clock)."""
    import time

    from agent.fleet import peers as peers_module

    pids = _targets(spawn, python, 3)
    async with job_of_agents(tmp_path, otlp_receiver, pids) as agents:
        (a, recs_a), (b, _), (c, recs_c) = agents
        real_sign, skewed_port = peers_module.sign_request, c.fleet.port

        def sign(*args: Any, **kw: Any) -> str:
            if kw.get("sender_port") == skewed_port:
                kw["now_s"] = time.time() + 30
            return real_sign(*args, **kw)

        monkeypatch.setattr(peers_module, "sign_request", sign)
        await b.bus.publish(_stalled(pids[1]))
        await _until(lambda: bool(recs_a and recs_c) and a.fleet.verdicts == 1, timeout_s=90)
    [ra] = recs_a
    offsets = json.loads((ra.bundle_dir / "job-verdict.json").read_text())["clock_offsets_s"]
    assert set(offsets) == {"node-b", "node-c"}, offsets  # the coordinator's own evidence is not signed
    assert 28.5 <= offsets["node-c"] <= 30.5 and abs(offsets["node-b"]) <= 1.5, offsets
    with anyio.fail_after(20):
        while not any(s.name == "job.incident" for s in otlp_receiver.spans()):
            await anyio.sleep(0.1)
    [root] = [s for s in otlp_receiver.spans() if s.name == "job.incident"]
    [said] = root.attributes["servewatch.job.clock_offsets_s"]
    assert said.startswith("node-c=+") and 28.5 <= float(said.split("=")[1]) <= 30.5, said


async def test_a_peer_that_never_took_the_connection_is_told_from_one_that_answers_late() -> None:
    """A host whose agent takes no connection (its accept queue full, so the kernel drops the
    SYNs, as for a dead or partitioned host) never got the request: ``connect_timeout``; one that
    took the request and answers late may have acted on it: ``timeout``. Both are timeouts (a
    sender starved of CPU sees its own connect time out too: a report is sent again after either)."""
    import socket

    from agent.fleet.peers import Peer, PeerCredentials, call_peer

    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fillers = [socket.socket() for _ in range(2)]  # backlog 0 holds one; the next SYN is dropped
    try:
        for s in fillers:
            s.setblocking(False)
            s.connect_ex(full.getsockname())
        await anyio.sleep(0.2)
        never = await call_peer(Peer("127.0.0.1", full.getsockname()[1]), "/v1/job/report", {}, credentials=PeerCredentials(),
                                timeout_s=1)
    finally:
        for s in (*fillers, full):
            s.close()

    async def silent(stream) -> None:
        async with stream:
            await stream.receive()
            await anyio.sleep(30)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, silent)
        late = await call_peer(Peer("127.0.0.1", listener.extra(anyio.abc.SocketAttribute.local_port)), "/v1/job/report", {},
                               credentials=PeerCredentials(), timeout_s=1)
        tg.cancel_scope.cancel()
    assert never.result.outcome.value == late.result.outcome.value == "timed_out"
    assert never.result.attributes["servewatch.peer.error"] == "connect_timeout"
    assert "accepted no connection within 1 s" in never.result.detail
    assert late.result.attributes["servewatch.peer.error"] == "timeout" and "did not answer within 1 s" in late.result.detail


async def test_rank_0s_host_announces_again_only_to_the_members_that_missed_it(tmp_path: Path, spawn, python, otlp_receiver) -> None:
    """A member that is down when rank 0's host announces itself is asked again every 2 s; the
    members that acknowledged are not (at 1,000 hosts, one down host cost 999 announces every
    2 s), until the next full round (``announce_interval_s``)."""
    [down] = free_ports(1)
    async with job_of_agents(tmp_path, otlp_receiver, _targets(spawn, python, 3), extra_peers=(f"127.0.0.14:{down}",),
                             announce_interval_s=60.0) as agents:
        node_a = agents[0][0].fleet
        await anyio.sleep(5.0)  # two quick rounds at least
        assert not node_a.announce_complete
        assert [ag.fleet.announces_received for ag, _ in agents[1:]] == [1, 1]
        assert node_a._announce_missed == {f"http://127.0.0.14:{down}"}
