"""A server's life as the incident manager judges it (issue 31, "the tree's lifecycle"), on the
real exit facts of real processes where a process is involved: a health failure healthy again
after a stop and start opens no incident; an exit after a stall is that stall's ending, not a
second incident; a crash loop is one incident that counts its exits; a launcher's exit 0 after
its rank failed is no orderly stop; what a dead launcher leaves running is named with its memory."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import psutil
import pytest

from agent.host.targets import Target
from agent.incidents import lifecycle as lifecycle_module
from agent.incidents.lifecycle import CRASH_LOOP_EXITS, Lifecycle
from agent.incidents.manager import IncidentConfig, IncidentManager
from agent.model.bus import RecordingBus
from agent.model.events import (
    ExitFact,
    HealthCheckFailed,
    HealthRecovered,
    LifecycleNoted,
    StacksDumped,
    TargetExited,
    WatchdogRearmed,
    WatchdogStalled,
)
from agent.watchers.process import ProcessWatcher
from exporters.mirror.mirror import LIFECYCLE_SPAN, SpanMirror
from exporters.otlp.spans import InMemorySink
from tests.test_incidents import Timeline


def _manager(tmp_path: Path, bus: RecordingBus, discover, *, left_alive=None) -> tuple[IncidentManager, Lifecycle]:
    lifecycle = Lifecycle(left_alive=left_alive)
    tl = Timeline()
    mgr = IncidentManager(bus=bus, config=IncidentConfig(cooldown_s=300), data_dir=tmp_path, host_name="h1",
                          discover=discover, phases=[("pyspy.dump", tl.phase("pyspy.dump"), StacksDumped)],
                          policies=[lifecycle])
    return mgr, lifecycle


def _ranks(*pids: int) -> list[Target]:
    return [Target(pid=p, title=f"demo::scheduler_TP{i}", create_time_s=time.time()) for i, p in enumerate(pids)]


async def _wait(cond, timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.05)


def _manifest(record) -> dict:
    return json.loads(record.manifest_path.read_text())


async def test_a_health_failure_healthy_again_after_a_stop_and_start_opens_no_incident(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The quick stop + restart: the old ranks stop in order, /health is refused, the new ranks
    (new pids) come up and /health is 200 again. Before: the refused check waited 30 s for a
    server that was running again, then opened a health incident dumping the new healthy ranks."""
    caplog.set_level(logging.INFO)
    bus = RecordingBus()
    live: list[Target] = _ranks(101, 102)
    mgr, lifecycle = _manager(tmp_path, bus, lambda: list(live))
    async with anyio.create_task_group() as tg:
        await tg.start(lifecycle.run, bus, mgr)
        await tg.start(mgr.run)
        for pid in (101, 102):  # the operator's stop: SIGTERM, exit 143
            await bus.publish(TargetExited(pid=pid, exit_code=143, title="demo::scheduler_TP0"))
        await _wait(lambda: {101, 102} <= mgr.exits_handled, 10)
        live[:] = []
        await anyio.sleep(1.5)  # the old tree is gone
        live[:] = _ranks(201, 202)  # the new tree, up before the refused probes turned the check unhealthy
        failed = HealthCheckFailed(url="http://127.0.0.1:8000/health", status_code=None, latency_s=0.0,
                                   error_class="refused", consecutive_failures=2)
        await bus.publish(failed)
        await anyio.sleep(1.5)
        await bus.publish(HealthRecovered(url=failed.url, consecutive_successes=2))
        await _wait(lambda: "healthy again" in caplog.text and any(n.phase == "recovered" for n in lifecycle.noted), 15)
        await anyio.sleep(0.5)
        tg.cancel_scope.cancel()
    assert mgr.records == [], [r.opened.detail for r in mgr.records]
    assert "healthy again" in caplog.text and "no incident" in caplog.text, caplog.text
    phases = [n.phase for n in bus.of_type(LifecycleNoted)]
    assert phases == ["stopped", "started", "recovered"], phases
    started = next(n for n in lifecycle.noted if n.phase == "started")
    assert started.pids == (201, 202) and "pid 201 'demo::scheduler_TP0'" in started.detail, started


async def test_a_restart_that_never_answers_health_again_is_still_an_incident(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle_module, "RESTART_GRACE_S", 3.0)
    bus = RecordingBus()
    live: list[Target] = _ranks(101)
    mgr, lifecycle = _manager(tmp_path, bus, lambda: list(live))
    async with anyio.create_task_group() as tg:
        await tg.start(lifecycle.run, bus, mgr)
        await tg.start(mgr.run)
        await bus.publish(TargetExited(pid=101, exit_code=143, title="demo::scheduler_TP0"))
        await _wait(lambda: 101 in mgr.exits_handled, 10)
        live[:] = _ranks(201)  # started again, and /health answers 503 on and on
        await bus.publish(HealthCheckFailed(url="http://x/health", status_code=503, latency_s=0.1,
                                            error_class="5xx", consecutive_failures=3))
        await _wait(lambda: bool(mgr.records), 20)
        tg.cancel_scope.cancel()
    assert [r.opened.trigger for r in mgr.records] == ["health"]
    assert [n.phase for n in lifecycle.noted] == ["stopped", "started"]


@pytest.mark.parametrize(("how", "words"), [({"signal": 9}, "signal 9 (SIGKILL)"), ({"exit_code": 143}, "exit code 143")],
                         ids=["killed", "stopped"])
async def test_an_exit_after_a_stall_is_that_stalls_ending_not_a_second_incident(tmp_path: Path, how: dict,
                                                                                 words: str) -> None:
    """The operator's kill -9 of the hung rank (or the server stopping itself after its own RPC
    timeout, SIGTERM): the stall incident's story goes on, in its manifest. Before: the kill
    opened a second incident, a trace of its own; the SIGTERM left the stall without an ending."""
    bus = RecordingBus()
    mgr, lifecycle = _manager(tmp_path, bus, lambda: _ranks(101, 102))
    async with anyio.create_task_group() as tg:
        await tg.start(lifecycle.run, bus, mgr)
        await tg.start(mgr.run)
        await bus.publish(WatchdogStalled(pid=102, forward_ct=7, stalled_for_s=5.0, timeout_s=5.0))
        await _wait(lambda: len(mgr.records) == 1, 10)
        await bus.publish(TargetExited(pid=102, title="demo::scheduler_TP1", **how))
        await _wait(lambda: 102 in mgr.exits_handled and any(n.phase == "ending" for n in lifecycle.noted), 10)
        await _wait(lambda: bool(_manifest(mgr.records[0])["lifecycle"]), 5)
        tg.cancel_scope.cancel()
    assert [r.opened.trigger for r in mgr.records] == ["stall"]
    stall = mgr.records[0]
    lines = _manifest(stall)["lifecycle"]
    assert len(lines) == 1 and lines[0].startswith("server ended after the stall: pid 102 'demo::scheduler_TP1' "), lines
    assert words in lines[0] and stall.opened.incident_id in lines[0], lines
    assert mgr.exit_outcomes[102] == f"no new incident: the ending of stall incident {stall.opened.incident_id}"
    # the same trace: the ending is a span under the stall incident's root
    sink = InMemorySink()
    mirror = SpanMirror(sink, host_name="h1")
    for event in bus.events:
        mirror.handle(event)
    (ending,) = [span for span in sink.spans if span.name == LIFECYCLE_SPAN]
    root = next(span for span in sink.spans if span.name == "incident")
    assert ending.context.trace_id == root.context.trace_id and ending.parent.span_id == root.context.span_id
    assert ending.attributes["servewatch.follows.incident"] == stall.opened.incident_id
    assert ending.attributes["servewatch.lifecycle.phase"] == "ending"


@pytest.mark.parametrize("stepped_again", [False, True], ids=["still-stalled", "stepped-again"])
async def test_a_health_failure_during_a_stall_joins_the_stall_incident(tmp_path: Path, stepped_again: bool) -> None:
    """SGLang's /health runs a one-token generation: 20 s into a hung forward it answers 503, after
    the stall incident opened. That failure is the same hang: a line on the stall incident, no
    health incident. Once the server stepped again, a later failure is a new story: its incident."""
    bus = RecordingBus()
    mgr, lifecycle = _manager(tmp_path, bus, lambda: _ranks(101, 102))
    async with anyio.create_task_group() as tg:
        await tg.start(lifecycle.run, bus, mgr)
        await tg.start(mgr.run)
        await bus.publish(WatchdogStalled(pid=102, forward_ct=7, stalled_for_s=5.0, timeout_s=5.0))
        await _wait(lambda: len(mgr.records) == 1, 10)
        if stepped_again:
            await bus.publish(WatchdogRearmed(pid=102, forward_ct=8))
            await anyio.sleep(0.3)
        failed = HealthCheckFailed(url="http://127.0.0.1:30000/health", status_code=503, latency_s=20.0,
                                   error_class="5xx", consecutive_failures=2)
        await bus.publish(failed)
        if stepped_again:
            await _wait(lambda: len(mgr.records) == 2, 10)
        else:
            await _wait(lambda: bool(_manifest(mgr.records[0])["lifecycle"]), 10)
            # a later failure of the same hang: counted, said once
            await bus.publish(HealthCheckFailed(url=failed.url, status_code=503, latency_s=20.0, error_class="5xx",
                                                consecutive_failures=3))
            await _wait(lambda: mgr.suppressed == 2, 10)
        tg.cancel_scope.cancel()
    stall = mgr.records[0]
    if stepped_again:
        assert [r.opened.trigger for r in mgr.records] == ["stall", "health"]
        assert _manifest(stall)["lifecycle"] == []
        return
    assert [r.opened.trigger for r in mgr.records] == ["stall"]
    (line,) = _manifest(stall)["lifecycle"]
    assert line.startswith("health check failed during the stall: http://127.0.0.1:30000/health failed 2 probes in a row (HTTP 503)"), line
    assert f"after incident {stall.opened.incident_id} opened; the same hang, no second incident" in line, line


CRASH = "import time; time.sleep(0.3); raise SystemExit(1)"


async def test_a_crash_loop_is_one_incident_that_counts_its_exits_and_names_the_status(
        tmp_path: Path, spawn, python: str) -> None:
    """A supervisor restarting an engine that exits 1 at once: 4 real exits of the same command.
    Before: one incident for the first, the rest "suppressed by cooldown", the loop never named."""
    bus = RecordingBus()
    watch_bus = RecordingBus()
    watcher = ProcessWatcher(poll_interval_s=0.1)
    mgr, lifecycle = _manager(tmp_path, bus, list)
    runs = 4
    async with anyio.create_task_group() as tg:
        await tg.start(lifecycle.run, bus, mgr)
        await tg.start(mgr.run)
        await tg.start(watcher.run, watch_bus)
        for n in range(runs):
            proc = spawn([python, "-c", CRASH])
            watcher.watch(Target(pid=proc.pid, title="engine_core", create_time_s=psutil.Process(proc.pid).create_time()),
                          returncode=proc.poll)
            await _wait(lambda n=n: len(watch_bus.of_type(TargetExited)) > n, 30)
            await bus.publish(watch_bus.of_type(TargetExited)[n])
            await _wait(lambda n=n: len(mgr.exits_handled) > n, 30)
        await _wait(lambda: sum(n.phase == "crash_loop" for n in lifecycle.noted) == CRASH_LOOP_EXITS - 1, 10)
        await anyio.sleep(0.3)
        tg.cancel_scope.cancel()
    assert [r.opened.trigger for r in mgr.records] == ["exit"], [r.opened.detail for r in mgr.records]
    record = mgr.records[0]
    doc = _manifest(record)
    assert record.crash_loop_exits == runs and doc["crash_loop_exits"] == runs, doc
    loop = [line for line in doc["lifecycle"] if line.startswith("crash loop:")]
    assert len(loop) == 1 and "'engine_core' exited 3 times" in loop[0] and "(exit code 1," in loop[0], doc["lifecycle"]
    later = [e.pid for e in watch_bus.of_type(TargetExited)][1:]
    assert all(mgr.exit_outcomes[pid].startswith("no new incident: exit ") for pid in later), mgr.exit_outcomes


LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(1)"])
print(rank.pid, flush=True)
time.sleep(3.0)  # the rank is a zombie meanwhile (its status readable)
rank.wait()
"""


async def test_a_launchers_exit_0_after_its_rank_failed_is_no_orderly_stop(tmp_path: Path, spawn, python: str) -> None:
    """torchrun's shape after a rank crashed before the agent looked: the surviving rank exits 1
    (it gave up), the launcher then exits 0. Before: "stopped with its whole server (exit code 1;
    its server (pid N) stopped in order (exit code 0))", no incident at all."""
    launcher = spawn([python, "-c", LAUNCHER], stdout=subprocess.PIPE)
    assert launcher.stdout is not None
    rank = int(launcher.stdout.readline())
    watch_bus = RecordingBus()
    watcher = ProcessWatcher([rank], poll_interval_s=0.1)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run, watch_bus)
        await _wait(lambda: bool(watch_bus.of_type(TargetExited)), 30)
        tg.cancel_scope.cancel()
    assert launcher.wait(timeout=30) == 0
    (event,) = watch_bus.of_type(TargetExited)
    fact: ExitFact = event.exit
    assert (fact.exit_code, fact.tree_stopped) == (1, False), fact
    mgr, _ = _manager(tmp_path, RecordingBus(), list)
    assert mgr.classify(event)[:2] == ("exit", rank)


ORPHANING = """
import subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', 'import time; x = bytes(range(256)) * (1 << 18); time.sleep(60)']);"
    " print(w.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
print(engine.pid, engine.stdout.readline().decode().strip(), flush=True)
time.sleep(60)
"""


async def test_processes_left_alive_after_their_launcher_died_are_named_with_their_memory(
        tmp_path: Path, spawn, python: str) -> None:
    """The API server SIGKILLed, its engine and worker living on under pid 1 (vLLM #55510).
    Before: the launcher's exit said nothing of them."""
    launcher = spawn([python, "-c", ORPHANING], stdout=subprocess.PIPE)
    assert launcher.stdout is not None
    engine, worker = map(int, launcher.stdout.readline().split())
    watch_bus, bus = RecordingBus(), RecordingBus()
    watcher = ProcessWatcher([launcher.pid, engine], poll_interval_s=0.1)
    mgr, lifecycle = _manager(tmp_path, bus, list, left_alive=watcher.left_alive)
    async with anyio.create_task_group() as tg:
        await tg.start(lifecycle.run, bus, mgr)
        await tg.start(mgr.run)
        await tg.start(watcher.run, watch_bus)
        await anyio.sleep(1.0)  # each watch read its lineage
        launcher.send_signal(signal.SIGKILL)
        await _wait(lambda: bool(watch_bus.of_type(TargetExited)), 30)
        await bus.publish(watch_bus.of_type(TargetExited)[0])
        await _wait(lambda: any(n.phase == "orphans" for n in lifecycle.noted), 30)
        tg.cancel_scope.cancel()
    noted = next(n for n in lifecycle.noted if n.phase == "orphans")
    assert set(noted.pids) == {engine, worker}, noted
    assert noted.detail.startswith(f"2 process(es) of pid {launcher.pid} ") and "signal 9 (SIGKILL)" in noted.detail
    held_mb = float(noted.detail.split("holding ")[1].split()[0]) * (1000 if " GB:" in noted.detail else 1)
    assert held_mb >= 64, noted.detail  # the worker's 64 MiB at least
    assert "still alive after it ended" in mgr.exit_outcomes[launcher.pid], mgr.exit_outcomes
    assert psutil.Process(engine).ppid() != launcher.pid


@pytest.mark.slow
async def test_the_operators_kill_of_a_hung_demo_rank_is_the_stall_incidents_ending(tmp_path: Path) -> None:
    """The real demo server (gloo TP=2): TP1 hangs, the stall incident opens, then the on-call
    kills TP1 with kill -9 (TP0 follows through the broken collective). Before: a second
    incident (exit, SIGKILL) in a trace of its own. Now: one incident, the kill its ending."""
    from agent.demo import TORCH_MISSING_MESSAGE, torch_available
    from agent.demo.client import DemoServer
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings
    from tests.demo.hang import hang_a_watched_rank

    if not torch_available():
        pytest.skip(TORCH_MISSING_MESSAGE)
    with anyio.fail_after(110):
        async with DemoServer(tp=2) as server:
            _, tp1 = server.scheduler_pids
            settings = load_settings({
                "data_dir": tmp_path, "host_name": "node-a",
                "target": {"root_pid": server.pid, "match": ["demo::scheduler*"]},
                "watchdog": {"timeout_s": 2.0, "poll_interval_s": 0.2},
                "pyspy": {"enabled": False},
            })
            agent = Agent(settings)
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                await hang_a_watched_rank(agent, server, tg, tp_rank=1)
                while not agent.incidents.records:
                    await anyio.sleep(0.1)
                os.kill(tp1, signal.SIGKILL)  # the on-call gives up on the hung rank
                while tp1 not in agent.incidents.exits_handled or agent.incidents.current is not None:
                    await anyio.sleep(0.1)
                while not any(n.phase == "ending" for n in agent.lifecycle.noted):
                    await anyio.sleep(0.1)
                agent.stop()
                tg.cancel_scope.cancel("the kill is judged")
    [record] = agent.incidents.records  # no second (exit) incident
    assert record.opened.trigger == "stall"
    [manifest] = list((tmp_path / "node-a").glob("*/manifest.json"))
    lines = json.loads(manifest.read_text())["lifecycle"]
    assert any(line.startswith(f"server ended after the stall: pid {tp1} ") and "signal 9 (SIGKILL)" in line
               for line in lines), lines
    assert agent.incidents.exit_outcomes[tp1].endswith(f"the ending of stall incident {record.opened.incident_id}")


ORPHAN_SERVER = Path(__file__).resolve().parent / "pagerday" / "orphan_server.py"


async def test_ranks_left_alive_after_their_frontend_was_killed_are_one_incident_under_a_host_wide_match(
        tmp_path: Path, spawn, python: str) -> None:
    """``run --match '<p>::scheduler*'`` (no --root-pid) watches only the ranks; their frontend
    (not a target) is SIGKILLed and they live on under pid 1 (vLLM #55510). Before: nothing said,
    no incident; the operator's later SIGTERM of the ranks read as an orderly stop. Now: one exit
    incident about that server naming its frontend's death and the ranks still alive, its bundle
    holding both; their SIGTERM is the end of that incident's story, not a second incident."""
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings

    prefix = f"orph{os.getpid()}"
    ready = tmp_path / "ready.json"
    frontend = spawn([python, str(ORPHAN_SERVER), "--title-prefix", prefix, "--ready-file", str(ready),
                      "--max-lifetime-s", "120"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        await anyio.sleep(0.1)
    doc = json.loads(ready.read_text())
    ranks = doc["ranks"]
    assert doc["frontend"] == frontend.pid
    settings = load_settings({
        "data_dir": tmp_path / "data", "host_name": "node-a",
        "target": {"match": [f"{prefix}::scheduler*"]},
        "pyspy": {"enabled": False},
    })
    agent = Agent(settings)
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            watcher = agent.process_watcher
            while not set(ranks) <= set(watcher.pids):
                await anyio.sleep(0.1)
            await anyio.sleep(1.5)  # each watch read its lineage
            frontend.send_signal(signal.SIGKILL)
            frontend.wait(timeout=10)
            with anyio.move_on_after(30):
                while not agent.incidents.records:
                    await anyio.sleep(0.1)
            assert agent.incidents.records, "the frontend's death left its ranks alive and opened no incident"
            assert all(psutil.pid_exists(pid) for pid in ranks)
            for pid in ranks:  # the operator cleans up
                os.kill(pid, signal.SIGTERM)
            while not set(ranks) <= agent.incidents.exits_handled:
                await anyio.sleep(0.1)
            while sum(n.phase == "orphans_ended" for n in agent.lifecycle.noted) < len(ranks):
                await anyio.sleep(0.1)
            await anyio.sleep(0.5)
            agent.stop()
            tg.cancel_scope.cancel("judged")
    [record] = agent.incidents.records  # the ranks' SIGTERM opened none
    assert record.opened.trigger == "exit"
    detail = record.opened.detail
    assert detail.startswith(f"the server's frontend pid {frontend.pid} "), detail
    assert "signal 9 (SIGKILL)" in detail or "exit status unknown" in detail, detail
    assert "2 process(es) of it still alive" in detail and " holding " in detail, detail
    assert all(str(pid) in detail for pid in ranks), detail
    [manifest] = list((tmp_path / "data" / "node-a").glob("*/manifest.json"))
    doc = json.loads(manifest.read_text())
    assert set(ranks) <= {t["pid"] for t in doc["targets"]}, doc["targets"]
    verdict = doc["verdict"]  # the survivors named, with their memory; not "1 process ..., not a distributed job"
    assert (verdict["kind"], verdict["rule"], verdict["confidence"]) == ("orphaned", "frontend_exited", "high"), verdict
    assert sorted(verdict["culprit_pids"]) == sorted(ranks), verdict
    assert verdict["reason"].startswith(f"server's frontend pid {frontend.pid} "), verdict
    assert "2 processes of it still alive" in verdict["reason"] and " holding " in verdict["reason"], verdict
    assert all(f"pid {pid} '{prefix}::scheduler" in verdict["reason"] for pid in ranks), verdict
    assert verdict["next"].startswith("kill ") and all(str(pid) in verdict["next"].split(" (")[0] for pid in ranks), verdict
    assert "restart the server" in verdict["next"], verdict
    ended = [line for line in doc["lifecycle"] if line.startswith("left alive, then ended: ")]
    assert len(ended) == 2 and all("SIGTERM" in line or "exit code 143" in line for line in ended), doc["lifecycle"]
    assert all(agent.incidents.exit_outcomes[pid] == f"no new incident: the end of incident {record.opened.incident_id}"
               for pid in ranks), agent.incidents.exit_outcomes


async def test_two_servers_engines_of_the_same_title_crashing_within_the_window_are_two_incidents(
        tmp_path: Path) -> None:
    """Two servers with identical titles (one host-wide --match), each engine exiting 1 within a
    minute of the other's. Before: the second server's crash was counted as "exit 2" of the first
    server's incident (crash loops were keyed by title alone). Now: keyed by (server, title)."""
    bus = RecordingBus()
    server_of = {101: 1000, 102: 1000, 201: 2000}
    mgr = IncidentManager(bus=bus, config=IncidentConfig(cooldown_s=300), data_dir=tmp_path, host_name="h1",
                          discover=list, policies=[lifecycle := Lifecycle()],
                          server_of=lambda event: server_of.get(event.subject_pid))
    async with anyio.create_task_group() as tg:
        await tg.start(lifecycle.run, bus, mgr)
        await tg.start(mgr.run)
        for pid in (101, 201, 102):
            await bus.publish(TargetExited(pid=pid, exit_code=1, title="engine_core"))
            await _wait(lambda pid=pid: pid in mgr.exits_handled, 10)
        tg.cancel_scope.cancel()
    assert [(r.opened.trigger, r.server) for r in mgr.records] == [("exit", 1000), ("exit", 2000)], mgr.exit_outcomes
    first, second = mgr.records
    assert mgr.exit_outcomes[201] == f"incident {second.opened.incident_id}", mgr.exit_outcomes
    assert mgr.exit_outcomes[102] == f"no new incident: exit 2 of incident {first.opened.incident_id}", mgr.exit_outcomes


def test_a_dead_frontends_title_is_its_command_line_with_secrets_redacted_and_no_control_characters() -> None:
    """The parent of watched ranks wrote its own command line: the FrontendExited title (log,
    manifest, spans) never carries its --api-key nor a terminal escape."""
    from agent.watchers.process import _title_of

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--api-key", "sk-live-0123456789abcdef",
                             "\x1b[2Jcleared"])
    try:
        deadline = time.monotonic() + 10
        while "--api-key" not in (title := _title_of(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "--api-key" in title and "sk-live-0123456789abcdef" not in title, title
        assert "\x1b" not in title and "cleared" in title, title
    finally:
        proc.kill()
        proc.wait(timeout=10)
