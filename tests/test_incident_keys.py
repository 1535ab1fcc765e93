"""The server is the incident's unit: the key is ``(server, trigger)`` (cooldown, dedup and
suppression per server), two servers' faults are two incidents run at once, one server's run one
after the other, and each incident's targets are its own server's (the runtime's ``discover_for``
gets the server). Real :class:`~agent.incidents.manager.IncidentManager` on a recording bus; the phases are
timed fakes (the documented :data:`~agent.incidents.manager.Phase` boundary)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import psutil

from agent.host.targets import Target
from agent.incidents.manager import IncidentConfig, IncidentManager
from agent.model.bus import RecordingBus
from agent.model.events import (
    ActionResult,
    HealthCheckFailed,
    IncidentOpened,
    Outcome,
    StacksDumped,
    TargetExited,
    TriggerEvent,
    WatchdogStalled,
    now_ns,
)

#: two servers on one host, identical titles: server 1000's ranks 101, 102; server 2000's 201, 202
SERVERS = {101: 1000, 102: 1000, 201: 2000, 202: 2000}
PORTS = {"http://127.0.0.1:8001/health": 1000, "http://127.0.0.1:8002/health": 2000}


def _all() -> list[Target]:
    return [Target(pid=p, title=f"demo::scheduler_TP{i % 2}") for i, p in enumerate(SERVERS)]


def _server_of(event: TriggerEvent) -> int | None:
    if event.subject_pid is not None:
        return SERVERS.get(event.subject_pid)
    return PORTS.get(event.url) if isinstance(event, HealthCheckFailed) else None


def _discover_for(pid: int | None, server: int | None) -> list[Target]:
    return [t for t in _all() if server is None or SERVERS[t.pid] == server]


class Spans:
    """When each incident's fake dump phase ran (monotonic seconds), by incident id."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s
        self.ran: dict[str, tuple[float, float]] = {}

    async def phase(self, opened: IncidentOpened, targets: Sequence[Target], bundle: Path, report: object) -> list[ActionResult]:
        start, t0 = anyio.current_time(), now_ns()
        await anyio.sleep(self.sleep_s)
        self.ran[opened.incident_id] = (start, anyio.current_time())
        return [ActionResult(action="pyspy.dump", outcome=Outcome.OK, pid=t.pid, start_time_unix_nano=t0,
                             end_time_unix_nano=now_ns()) for t in targets]


def _manager(tmp_path: Path, bus: RecordingBus, spans: Spans, **kw: object) -> IncidentManager:
    return IncidentManager(
        bus=bus, config=IncidentConfig(cooldown_s=300), data_dir=tmp_path, host_name="h1", discover=_all,
        discover_for=_discover_for, server_of=_server_of, phases=[("pyspy.dump", spans.phase, StacksDumped)], **kw,
    )


def _stall(pid: int) -> WatchdogStalled:
    return WatchdogStalled(pid=pid, forward_ct=7, stalled_for_s=3.0, timeout_s=3.0)


async def _until(check, timeout_s: float = 10.0) -> None:
    with anyio.fail_after(timeout_s):
        while not check():
            await anyio.sleep(0.01)


async def test_cooldown_and_dedup_are_per_server_and_trigger(tmp_path: Path) -> None:
    bus, spans = RecordingBus(), Spans(0.05)
    mgr = _manager(tmp_path, bus, spans)
    async with anyio.create_task_group() as tg:
        await tg.start(mgr.run)
        for pid in (101, 102):  # server 1000's ranks stall together: one incident
            await bus.publish(_stall(pid))
        await _until(lambda: len(mgr.records) == 1 and mgr.suppressed == 1)
        await bus.publish(_stall(201))  # server 2000 hangs later: its own incident, not "cooling down"
        await _until(lambda: len(mgr.records) == 2)
        await bus.publish(_stall(102))  # server 1000 again within its window: suppressed
        await bus.publish(HealthCheckFailed(url="http://127.0.0.1:8002/health", status_code=503, latency_s=0.1,
                                            error_class="timeout", consecutive_failures=3))  # server 2000's URL
        await bus.publish(HealthCheckFailed(url="http://127.0.0.1:8001/health", status_code=503, latency_s=0.1,
                                            error_class="timeout", consecutive_failures=3))  # server 1000's URL
        await _until(lambda: len(mgr.records) == 4 and mgr.suppressed == 2)
        tg.cancel_scope.cancel()
    by_key = {(r.server, r.opened.trigger): r for r in mgr.records}
    assert sorted(by_key, key=str) == sorted([(1000, "stall"), (2000, "stall"), (2000, "health"), (1000, "health")], key=str)
    # each incident's targets are its own server's processes only
    for (server, _), record in by_key.items():
        assert {t.pid for t in record.targets} == {p for p, s in SERVERS.items() if s == server}
    assert by_key[(2000, "stall")].targets[0].pid == 201  # the stalled rank first


async def test_cooldown_claims_are_per_server_and_host_wide_without_one(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, RecordingBus(), Spans(0.0))
    assert mgr.claim_cooldown("manual") == (0.0, "")
    mgr.cooldown_opened("manual", "inc-1")
    left_s, last = mgr.claim_cooldown("manual")
    assert 299 < left_s <= 300 and last == "inc-1"
    assert mgr.claim_cooldown("manual", server=1000) == (0.0, "")  # another key
    assert mgr.claim_cooldown("stall", server=1000) == (0.0, "")
    assert mgr.claim_cooldown("stall", server=2000) == (0.0, "")
    assert mgr.claim_cooldown("stall", server=1000)[0] > 0
    assert mgr.suppressed == 2


async def test_two_servers_faults_run_at_once_and_one_servers_one_after_the_other(tmp_path: Path) -> None:
    bus, spans = RecordingBus(), Spans(1.0)
    mgr = _manager(tmp_path, bus, spans)
    seen_running: list[int] = []
    async with anyio.create_task_group() as tg:
        await tg.start(mgr.run)

        async def watch() -> None:
            while True:
                seen_running.append(len(mgr.running))
                await anyio.sleep(0.02)

        tg.start_soon(watch)
        await bus.publish(_stall(101))
        await _until(lambda: len(mgr.running) == 1)
        first = mgr.current
        await bus.publish(_stall(201))  # server 2000: runs beside server 1000's, never queued behind it
        await bus.publish(TargetExited(pid=102, exit_code=1, title="demo::scheduler_TP1"))  # server 1000: waits
        await _until(lambda: len(mgr.running) == 2)
        assert mgr.current is not None and mgr.current is not first and mgr.current.server == 2000
        assert {r["server"] for r in mgr.state()["running"]} == {1000, 2000}
        await _until(lambda: len(mgr.records) == 3)
        assert await mgr.wait_idle(5.0)
        assert mgr.current is None and not mgr.running
        await _until(lambda: not mgr._queues)  # each server's worker ends with its last trigger
        tg.cancel_scope.cancel()
    assert max(seen_running) == 2
    (a_stall, a_exit), (b_stall,) = (
        [r for r in mgr.records if r.server == 1000], [r for r in mgr.records if r.server == 2000])
    if a_stall.opened.trigger == "exit":
        a_stall, a_exit = a_exit, a_stall
    ran = spans.ran
    a0, a1 = ran[a_stall.opened.incident_id]
    b0, b1 = ran[b_stall.opened.incident_id]
    e0, _ = ran[a_exit.opened.incident_id]
    assert b0 < a1 and a0 < b1  # the two servers' overlapped
    assert e0 >= a1  # one server's incidents: the exit's after the stall's
    assert a_exit.opened.trigger == "exit" and {t.pid for t in a_exit.targets} == {101, 102}


async def test_without_a_server_resolver_every_trigger_is_host_wide(tmp_path: Path) -> None:
    bus, spans = RecordingBus(), Spans(0.0)
    mgr = IncidentManager(bus=bus, config=IncidentConfig(cooldown_s=300), data_dir=tmp_path, host_name="h1",
                          discover=_all, phases=[("pyspy.dump", spans.phase, StacksDumped)])
    async with anyio.create_task_group() as tg:
        await tg.start(mgr.run)
        for pid in (101, 201):
            await bus.publish(_stall(pid))
        await _until(lambda: len(mgr.records) == 1 and mgr.suppressed == 1)
        tg.cancel_scope.cancel()
    [record] = mgr.records
    assert record.server is None and len(record.targets) == 4


def test_status_says_every_servers_open_incident() -> None:
    from agent.watchers.status import StatusSnapshot

    running = [{"id": "inc-a", "trigger": "stall", "detail": "rank 1", "opened_time_unix_nano": 1, "server": 1000},
               {"id": "inc-c", "trigger": "stall", "detail": "rank 0", "opened_time_unix_nano": 2, "server": 2000}]
    snap = StatusSnapshot(host_name="h1", agent_pid=1, started_time_unix_nano=0, updated_time_unix_nano=0,
                          incidents={"open": running[1], "running": running, "written": 0})
    assert snap.incident_lines(now_unix_nano=3) == [
        "incident: OPEN inc-a of server pid 1000 (stall: rank 1)",
        "incident: OPEN inc-c of server pid 2000 (stall: rank 0)",
    ]
    # one running (or a status file written before servers were told apart): as before
    old = StatusSnapshot(host_name="h1", agent_pid=1, started_time_unix_nano=0, updated_time_unix_nano=0,
                         incidents={"open": running[0], "written": 0})
    assert old.incident_lines(now_unix_nano=3) == ["incident: OPEN inc-a (stall: rank 1)"]


def test_a_servers_processes_and_its_root_are_one_server_and_another_tree_is_another(spawn, python) -> None:
    """Real process trees (tests/programs/server_tree.py, identical titles): each rank's server is
    its tree's root, the root is its own server (a launched server's exit), and an incident of
    one server takes that server's live targets only."""
    import uuid

    from agent.host.config import TargetConfig
    from agent.incidents.evidence import TargetFinder
    from tests.test_targeting import start_tree

    tag = uuid.uuid4().hex[:8]
    a, b = start_tree(spawn, python, tag), start_tree(spawn, python, tag)
    finder = TargetFinder(TargetConfig(match=[f"sglang::scheduler*_{tag}"]), stall_timeout_s=5.0)
    live = finder.discover()
    ranks = {tree["main"]: {tree["scheduler_TP0"], tree["scheduler_TP1"]} for tree in (a, b)}
    assert {t.pid for t in live} == ranks[a["main"]] | ranks[b["main"]]
    for main, pids in ranks.items():
        assert {finder.server_of_pid(pid) for pid in pids} == {main}
        assert finder.server_of_pid(main) == main
        assert {t.pid for t in finder.incident_targets(live, subject=min(pids), server=main)} == pids
        assert {t.pid for t in finder.incident_targets(live, subject=main, server=main)} == pids
    assert {t.pid for t in finder.incident_targets(live)} == ranks[a["main"]] | ranks[b["main"]]  # host-wide
    said = finder.describe_servers(live)
    assert said.startswith("2 servers: ") and f"pid {a['main']} (sglang::scheduler_TP0_{tag}, _TP1_{tag})" in said, said


def test_a_port_nothing_listens_on_any_more_is_still_its_last_servers(tmp_path: Path) -> None:
    """A crashed or stopping server's /health is refused: nothing listens on its port. Its health
    failure is still keyed to that server (the one last seen there), never host-wide where
    another server's health cooldown would hide it. Real processes: a frontend listening on a
    real port with a titled rank under it, SIGKILLed."""
    import signal
    import subprocess
    import sys
    import uuid

    from agent.host.config import TargetConfig
    from agent.incidents.evidence import TargetFinder

    tag = uuid.uuid4().hex[:8]
    frontend = subprocess.Popen([sys.executable, "-c", f"""
import socket, subprocess, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
subprocess.Popen([sys.executable, "-c", "import setproctitle, time; setproctitle.setproctitle('pk::scheduler_TP0_{tag}'); time.sleep(60)"])
print(s.getsockname()[1], flush=True); time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert frontend.stdout is not None
        port = int(frontend.stdout.readline())
        finder = TargetFinder(TargetConfig(match=[f"pk::scheduler_TP0_{tag}"]), stall_timeout_s=5.0)
        deadline = time.monotonic() + 10
        while not (live := finder.discover()) and time.monotonic() < deadline:
            time.sleep(0.05)
        (rank,) = live
        assert finder.server_of_port(port) == frontend.pid == finder.server_of_pid(rank.pid)
        frontend.send_signal(signal.SIGKILL)
        frontend.wait(timeout=10)
        assert finder.server_of_port(port) == frontend.pid  # refused now: still that server's
        assert finder.server_of_port(1) is None  # a port no server was ever seen on: host-wide
    finally:
        frontend.kill()
        frontend.wait(timeout=10)
        if frontend.stdout is not None:
            frontend.stdout.close()
        for proc in psutil.process_iter(["cmdline"]):
            if any(f"_{tag}" in part for part in (proc.info["cmdline"] or [])):
                proc.kill()
