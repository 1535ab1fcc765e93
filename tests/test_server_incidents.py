"""The server is the unit, on two real demo servers with identical titles under one host-wide agent
(``--match`` without ``--root-pid``): server A's TP1 hangs, then server C's TP0 a few seconds later;
two stall incidents, each bundle holds only its own server's processes, each verdict names its own
server's hung rank, and C's hang is never "suppressed by cooldown" behind A's."""

from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path

import anyio
import pytest

from agent.demo import TORCH_MISSING_MESSAGE, torch_available
from agent.demo.client import DemoServer, agenerate, ainject_hang
from agent.incidents.manager import IncidentRecord
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from tests.demo.hang import hung_request

pytestmark = [pytest.mark.skipif(not torch_available(), reason=TORCH_MISSING_MESSAGE), pytest.mark.slow]

#: seconds between the two hangs (the report's 20 s, shortened: cooldown is 300 s either way)
GAP_S = 8.0


async def _until(check, timeout_s: float, what: str) -> None:
    with anyio.move_on_after(timeout_s):
        while not check():
            await anyio.sleep(0.1)
        return
    raise AssertionError(f"not within {timeout_s} s: {what}")


async def test_two_servers_hung_apart_under_one_host_wide_agent_are_two_incidents_each_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="servewatch")
    prefix = f"twin{uuid.uuid4().hex[:6]}"  # both servers' titles identical; no other test's server matches
    servers = [DemoServer(tp=2, title_prefix=prefix, ready_timeout_s=240) for _ in range(2)]
    records: list[IncidentRecord] = []
    try:
        with anyio.fail_after(240):
            async with anyio.create_task_group() as starting:
                for server in servers:
                    starting.start_soon(server.astart)
        a, c = servers
        settings = load_settings({
            "data_dir": tmp_path, "host_name": "node-a",
            "target": {"match": [f"{prefix}::scheduler*"]},
            "watchdog": {"timeout_s": 3.0, "poll_interval_s": 0.2},
            "incident": {"cooldown_s": 300},
            "coredump": {"enabled": False},
        })
        agent = Agent(settings, on_incident=records.append)
        with anyio.fail_after(150):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                for server in servers:  # the step clocks start at the first step
                    await agenerate(server.base_url, "warm-up", 2)
                everyone = {*a.scheduler_pids, *c.scheduler_pids}
                await _until(lambda: everyone <= set(agent.watched_step_pids), 30, "every rank's counter watched")
                # one status line says which servers a host-wide --match watches
                row = agent.status.get("process")
                assert row is not None and "watching 4 target processes; 2 servers: " in row.reason, row
                for server in servers:
                    port = server.base_url.rsplit(":", 1)[1]
                    assert f"pid {server.pid} ({prefix}::scheduler_TP0, _TP1; :{port})" in row.reason, row.reason

                await ainject_hang(a.base_url, tp_rank=1)
                tg.start_soon(hung_request, a.base_url)
                await _until(lambda: bool(agent.incidents.running) or bool(records), 30, "server A's stall incident")
                await anyio.sleep(GAP_S)
                await ainject_hang(c.base_url, tp_rank=0)
                tg.start_soon(hung_request, c.base_url)
                await _until(lambda: len(records) >= 2, 60, "server C's stall incident")
                assert await agent.incidents.wait_idle(30)
                agent.stop()
                tg.cancel_scope.cancel("both incidents written")
    finally:
        with anyio.CancelScope(shield=True):
            for server in servers:
                await anyio.to_thread.run_sync(server.stop)

    assert [r.opened.trigger for r in records] == ["stall", "stall"], [r.opened.detail for r in records]
    by_server = {r.server: r for r in records}
    assert set(by_server) == {a.pid, c.pid}  # each keyed by its own server's tree root
    assert all(r.opened.attributes["servewatch.server.pid"] == r.server for r in records)  # its root span says so
    hung = {a.pid: a.scheduler_pids[1], c.pid: c.scheduler_pids[0]}
    for server, ranks in ((a, a.scheduler_pids), (c, c.scheduler_pids)):
        record = by_server[server.pid]
        doc = json.loads(record.manifest_path.read_text())
        assert {t["pid"] for t in doc["targets"]} == set(ranks), (server.pid, doc["targets"])
        dumped = {x["pid"] for x in doc["actions"] if x.get("pid") is not None}
        assert dumped <= set(ranks), (server.pid, dumped)
        assert doc["verdict"]["culprit_pids"] == [hung[server.pid]], doc["verdict"]
        # its history (the timeline before it opened) is its own server's processes' story
        assert {h["pid"] for h in doc["history"]} <= {*ranks, None}, doc["history"]
    # a suppressed stall is one of the same server's ranks, under that server's own incident
    for said in (r.getMessage() for r in caplog.records if "suppressed by cooldown" in r.getMessage()):
        [pid] = [int(m) for m in re.findall(r"pid (\d+)\)\)", said)]
        [record] = [r for r in records if r.opened.incident_id in said]
        assert pid in {t.pid for t in record.targets}, (said, record.server)
