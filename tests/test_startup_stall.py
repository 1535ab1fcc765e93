"""Start-up hangs (issue 32 item 5; SGLang #3547, vLLM #17167): ranks found starting that take no
first step within ``startup.budget_s`` are a ``startup_stall`` incident whose verdict names the
rank outside the collective; a health or metrics port nothing listens on while ranks start is said
as the server starting, not as a wrong address.

The whole shape runs on real processes: a real gloo job titled ``sglang::scheduler_TP0/1`` whose
rank 1 never returns from CUDA-graph capture in SGLang's ``DecodeCudaGraphRunner.capture()`` (the
stand-in keeps the real module path, tests/programs/standins/) while rank 0 waits in the captured
all-reduce, the HTTP port not listening, the real agent and py-spy. The rule's own cases run on real
titled processes (tests/programs/titled_target.py) with their real creation times.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from agent.host.startup import SETTLE_S, StartupConfig, StartupRule, StartupStalled
from agent.host.targets import Target, target_of
from agent.model.events import HealthProbed, Outcome, StepsAdvanced
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from agent.watchers.config import HealthConfig
from agent.watchers.health import HealthWatcher
from agent.watchers.status import WatcherState
from agent.watchers.steps import PrometheusStepSource
from exporters.otlp.provider import build_telemetry
from tests.programs.fault_matrix import (
    ROOT,
    STANDINS,
    STARTUP_BUDGET_S,
    _free_port,
    shape_startup_hang,
    start_ranks,
    stop_ranks,
    wait_ready,
)

PROGRAMS = Path(__file__).parent / "programs"


def _ranks(spawn, titles: list[str]) -> list[Target]:
    """Real processes titled ``titles`` (idle, as ranks that load weights wait), once each is ready."""
    procs = [spawn([sys.executable, str(PROGRAMS / "titled_target.py"), title, "--idle", "--max-lifetime-s", "60"],
                   stdout=subprocess.PIPE) for title in titles]
    targets = []
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
        target = target_of(proc.pid)
        assert target is not None
        targets.append(target)
    return targets


@pytest.mark.slow
@pytest.mark.parametrize(("framework", "title", "frame"), [
    ("sglang", "sglang::scheduler", "DecodeCudaGraphRunner._kernel_never_finishes"),  # SGLang #3547
    ("vllm", "VLLM::Worker", "GPUModelRunner._kernel_never_finishes"),  # vLLM #17167
])
async def test_a_rank_hung_in_cuda_graph_capture_is_a_startup_stall_naming_it(tmp_path: Path, framework: str, title: str,
                                                                                frame: str) -> None:
    """Before: 'connection refused ... wrong host or port' for as long as the hang lasted, and no
    incident (the stall rule's clock starts at the first step; the health check waits 30 min)."""
    result = await shape_startup_hang(tmp_path, framework=framework)
    opened, v = result.record.opened, result.verdict
    assert opened.trigger == "startup_stall"
    rank0, rank1 = sorted(result.record.targets, key=lambda t: t.title)[:2]
    assert (rank0.title, rank1.title) == (f"{title}_TP0", f"{title}_TP1")
    assert opened.detail.startswith("no first step ") and f"(start-up budget {STARTUP_BUDGET_S:g} s)" in opened.detail
    assert f"pid {rank0.pid} '{title}_TP0'" in opened.detail and f"pid {rank1.pid}" in opened.detail
    assert (v["kind"], v["culprit_ranks"], v["culprit_pids"], v["confidence"]) == ("behind", [1], [rank1.pid], "high")
    assert f"rank 1 in {frame}" in v["reason"] and "all_reduce" in v["reason"], v["reason"]
    health = [line for line in result.statuses if line.startswith("health:")]
    assert not [line for line in health if "wrong host or port" in line], health
    starting = [line for line in health if "server starting: nothing listens at" in line]
    assert starting and all(f"pid {rank0.pid} '{title}_TP0'" in line for line in starting), health
    assert starting[-1].startswith("health: waiting ") and "took no first step within the start-up budget" in starting[-1]
    assert result.correct, result.problems()
    assert str(rank1.pid) in re.findall(r"\d+", v["next"]), v["next"]  # what to do next names the culprit's pid


@pytest.mark.slow
async def test_without_http_the_ranks_sdk_says_what_their_first_step_would(tmp_path: Path) -> None:
    """No health or metrics URL: ranks using the SDK (control socket up, no step counter before
    their first step) are judged all the same."""
    result = await shape_startup_hang(tmp_path, http=False)
    v = result.verdict
    assert result.record.opened.trigger == "startup_stall" and not [s for s in result.statuses if s.startswith("health")]
    assert (v["kind"], v["culprit_ranks"], v["confidence"]) == ("behind", [1], "high"), result.problems()


@pytest.mark.slow
async def test_the_waiting_ranks_collective_timeout_after_a_startup_stall_is_its_ending(tmp_path: Path) -> None:
    """Rank 0 gives up waiting in the captured all-reduce (its gloo timeout, as vLLM gives up on
    its engine at VLLM_ENGINE_READY_TIMEOUT_S) and exits 1 after the start-up stall incident opened:
    that incident's ending, on it, not a second (exit) incident. The incident's profile is skipped:
    no step can come."""
    env = {"PYTHONPATH": f"{STANDINS}{os.pathsep}{ROOT}"}
    procs = start_ranks(2, tmp_path, fault="graph_capture", fault_rank=1, title="sglang::scheduler", env=env,
                        extra=["--timeout-s", "20"])
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        settings = load_settings({
            "data_dir": tmp_path / "data", "host_name": "startup", "coredump": {"enabled": False},
            "target": {"pids": [p.pid for p in procs]}, "incident": {"cooldown_s": 300.0},
            "health": {"url": f"http://127.0.0.1:{_free_port()}/health", "interval_s": 0.5},
            "startup": {"budget_s": STARTUP_BUDGET_S}, "profiler": {"on_incident_steps": 5, "max_duration_s": 60},
        })
        telemetry = build_telemetry(settings.export, data_dir=settings.data_dir, host_name=settings.host_name)
        agent = Agent(settings, telemetry=telemetry, children=procs)
        records = agent.incidents.records
        with anyio.fail_after(100):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                while procs[0].pid not in agent.incidents.exits_handled or not records:
                    await anyio.sleep(0.2)
                with anyio.move_on_after(10):  # the line on the incident, or a second incident
                    while not records[0].lifecycle and len(records) < 2:
                        await anyio.sleep(0.2)
                agent.stop()
                tg.cancel_scope.cancel()
        await telemetry.aclose(3.0)
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)
    assert [r.opened.trigger for r in records] == ["startup_stall"]
    record = records[0]
    assert record.opened.trigger == "startup_stall" and record.verdict.culprit_pids == (procs[1].pid,)
    assert record.lifecycle[0].startswith(f"server ended after the stall: pid {procs[0].pid} 'sglang::scheduler_TP0'"
                                          f" exit code 1, "), record.lifecycle
    assert record.lifecycle[0].endswith(f"after incident {record.opened.incident_id} opened"), record.lifecycle
    # the incident's profile waits for no step that cannot come
    prof = next(r for r in record.results if r.action == "profile.session")
    assert prof.outcome is Outcome.SKIPPED and prof.detail == "no steps: server stuck in start-up"
    assert agent.incidents.exit_outcomes[procs[0].pid] == (
        f"no new incident: the ending of stall incident {record.opened.incident_id}")


def test_ranks_without_a_first_step_past_the_budget_are_one_stall_once(spawn) -> None:
    ranks = _ranks(spawn, ["sglang::scheduler_TP0", "sglang::scheduler_TP1", "sglang::detokenizer"])
    rule = StartupRule(StartupConfig(budget_s=30.0), discover=lambda: list(ranks), forward_ct=lambda pid: None,
                       http_watched=True)
    born = min(t.create_time_s for t in ranks)
    assert rule.look(now_s=born + 1.0) is None  # within the budget: starting, said so
    assert rule.starting() == (f"its ranks took no first step yet (pid {ranks[0].pid} 'sglang::scheduler_TP0',"
                               f" pid {ranks[1].pid} 'sglang::scheduler_TP1'; start-up budget 30 s)")
    stalled = rule.look(now_s=born + 31.0)
    assert isinstance(stalled, StartupStalled) and stalled.trigger == "startup_stall"
    assert stalled.pids == (ranks[0].pid, ranks[1].pid) and stalled.subject_pid == ranks[0].pid  # not the detokenizer
    assert stalled.budget_s == 30.0 and 30.0 <= stalled.waited_s < 32.0
    assert rule.look(now_s=born + 40.0) is None  # once per set of ranks
    # only HTTP could have said it started: a wrong address is said as possible too
    assert rule.starting() == (f"its ranks took no first step within the start-up budget of 30 s (pid {ranks[0].pid}"
                               f" 'sglang::scheduler_TP0', pid {ranks[1].pid} 'sglang::scheduler_TP1'),"
                               " or this is the wrong host or port")


def test_a_rank_one_look_missed_is_still_starting_when_seen_again_past_the_budget(spawn) -> None:
    """CI, real vLLM start-up hang: health read "waiting: ... took no first step within the start-up
    budget (pid N 'VLLM::Worker')", then "blind: ... or the server is down" while the worker still
    hung in its weight load. One look's discovery missed the worker; the next, past the budget,
    took it for a rank first seen old (its start-up then ends only by HTTP: not starting)."""
    ranks = _ranks(spawn, ["VLLM::Worker"])
    found = [list(ranks)]
    rule = StartupRule(StartupConfig(budget_s=30.0), discover=lambda: list(found[0]), forward_ct=lambda pid: None,
                       http_watched=True)
    born = ranks[0].create_time_s
    rule.look(now_s=born + 1.0)
    assert rule.starting() is not None
    found[0] = []  # one look under load misses it
    rule.look(now_s=born + 20.0)
    found[0] = list(ranks)
    rule.look(now_s=born + 40.0)
    assert rule.starting() == (f"its ranks took no first step within the start-up budget of 30 s (pid {ranks[0].pid}"
                               " 'VLLM::Worker'), or this is the wrong host or port")


def test_an_idle_watch_looks_again_only_while_a_rank_starts_or_after_a_new_process(spawn, monkeypatch) -> None:
    from agent.host import procinfo

    ranks = _ranks(spawn, ["sglang::scheduler_TP0", "sglang::scheduler_TP1"])
    looks: list[int] = []
    failing = [False]

    def discover() -> list[Target]:
        if failing[0]:
            raise OSError("proc unreadable")
        looks.append(1)
        return list(ranks)

    rule = StartupRule(StartupConfig(budget_s=30.0), discover=discover, forward_ct=lambda pid: None, http_watched=True)
    counter = [1000]
    monkeypatch.setattr(procinfo, "last_pid", lambda: counter[0])
    assert rule.needs_look()  # never looked
    born = max(t.create_time_s for t in ranks)
    rule.look(now_s=born + 1.0)
    assert rule.starting() is not None and rule.needs_look()  # starting: its budget runs, look again
    rule.note(StepsAdvanced(pid=None, forward_ct=1, delta=1, busy=True))
    rule.look(now_s=born + 2.0)
    assert rule.starting() is None and len(looks) == 2
    assert not rule.needs_look()  # start-up over and no process created since: the same answer
    counter[0] += 1  # the kernel handed out a pid: a new rank may be there
    assert rule.needs_look()
    failing[0] = True  # a look whose discovery raised: looked at again, never skipped for good
    with pytest.raises(OSError):
        rule.look(now_s=born + 3.0)
    assert rule.needs_look()
    failing[0] = False
    rule.look(now_s=born + 4.0)
    assert not rule.needs_look() and len(looks) == 3
    assert not StartupRule(StartupConfig(budget_s=0.0), discover=list).needs_look()  # off


def test_an_http_answer_or_a_step_after_the_ranks_started_ends_their_startup(spawn) -> None:
    ranks = _ranks(spawn, ["VLLM::Worker_TP0", "VLLM::Worker_TP1"])
    born = max(t.create_time_s for t in ranks)
    for event in (HealthProbed(url="http://127.0.0.1:1/health", ok=False, status_code=503, latency_s=0.1),
                  StepsAdvanced(pid=None, forward_ct=1, delta=1, busy=True)):
        rule = StartupRule(StartupConfig(budget_s=5.0), discover=lambda: list(ranks), forward_ct=lambda pid: None,
                           http_watched=True)
        rule.note(event)
        assert rule.look(now_s=born + 60.0) is None and rule.starting() is None
    # an answer from before the ranks started (an earlier server's) does not end theirs
    rule = StartupRule(StartupConfig(budget_s=5.0), discover=lambda: list(ranks), forward_ct=lambda pid: None,
                       http_watched=True)
    rule.note(HealthProbed(url="http://127.0.0.1:1/health", ok=True, status_code=200, latency_s=0.1,
                           time_unix_nano=int((born - 100.0) * 1e9)))
    rule.look(now_s=born + 1.0)
    assert isinstance(rule.look(now_s=born + 1.0 + SETTLE_S), StartupStalled)


def test_ranks_found_old_behind_a_port_nothing_listens_on_are_a_wrong_address_not_a_startup(spawn) -> None:
    """The agent started next to a server that serves, its health URL on the wrong port: the ranks
    were found older than the budget and nothing but HTTP could say they started. Not judged: the
    health check keeps saying "wrong host or port" (``starting()`` is None). With the SDK's word
    (no step yet), the same ranks are judged."""
    ranks = _ranks(spawn, ["sglang::scheduler_TP0", "sglang::scheduler_TP1"])
    born = min(t.create_time_s for t in ranks)
    rule = StartupRule(StartupConfig(budget_s=5.0), discover=lambda: list(ranks), forward_ct=lambda pid: None,
                       http_watched=True)
    assert rule.look(now_s=born + 60.0) is None and rule.look(now_s=born + 60.0 + SETTLE_S) is None
    assert rule.starting() is None
    sdk = StartupRule(StartupConfig(budget_s=5.0), discover=lambda: list(ranks), forward_ct=lambda pid: 0,
                      http_watched=True)
    assert sdk.look(now_s=born + 60.0) is None  # settling
    stalled = sdk.look(now_s=born + 60.0 + SETTLE_S)
    assert isinstance(stalled, StartupStalled) and stalled.pids == tuple(t.pid for t in ranks)
    assert sdk.starting() == (f"its ranks took no first step within the start-up budget of 5 s (pid {ranks[0].pid}"
                              f" 'sglang::scheduler_TP0', pid {ranks[1].pid} 'sglang::scheduler_TP1')")


def test_nothing_is_judged_where_nothing_could_say_the_startup_ended(spawn) -> None:
    """No HTTP watched and no step counter: a healthy server would look stuck forever. A rank's
    own counter: its first step ends its start-up."""
    ranks = _ranks(spawn, ["sglang::scheduler_TP0"])
    born = ranks[0].create_time_s
    blind = StartupRule(StartupConfig(budget_s=5.0), discover=lambda: list(ranks), forward_ct=lambda pid: None)
    assert blind.look(now_s=born + 1.0) is None and blind.look(now_s=born + 100.0) is None and blind.starting() is None
    steps = {ranks[0].pid: 0}
    counted = StartupRule(StartupConfig(budget_s=5.0), discover=lambda: list(ranks), forward_ct=steps.get)
    counted.look(now_s=born + 1.0)
    steps[ranks[0].pid] = 1
    assert counted.look(now_s=born + 100.0) is None
    off = StartupRule(StartupConfig(budget_s=0.0), discover=lambda: list(ranks), forward_ct=lambda pid: 0)
    assert off.look(now_s=born + 1e6) is None


def test_a_young_server_process_given_by_pid_with_no_rank_yet_is_said_as_starting(spawn) -> None:
    """vLLM and SGLang import for seconds before they start ranks: the server's own process, given
    by pid (``--root-pid``, the launched command) and younger than the budget, is a server starting
    while no rank is found; past the budget, or once a rank is found, or for a pid not given, it is not."""
    (server,) = _ranks(spawn, ["python vllm serve"])
    found: list[Target] = []
    rule = StartupRule(StartupConfig(budget_s=60.0), discover=lambda: list(found), http_watched=True,
                       server_pids=lambda: [server.pid])
    assert rule.needs_look()
    rule.look()
    line = rule.starting()
    assert line is not None and re.fullmatch(
        rf"it started less than the start-up budget ago and has no rank yet \(pid {server.pid} 'python vllm serve'; "
        r"start-up budget 60 s\)", line), line
    assert rule.needs_look()  # its ranks are looked for while it starts
    found += _ranks(spawn, ["VLLM::Worker"])
    rule.look()
    assert rule.starting() is not None and "its ranks took no first step yet (pid" in rule.starting()  # type: ignore[operator]
    old = StartupRule(StartupConfig(budget_s=60.0), discover=list, http_watched=True, server_pids=lambda: [server.pid])
    old.look(now_s=server.create_time_s + 61.0)
    assert old.starting() is None  # past the budget: not starting any more
    stranger = StartupRule(StartupConfig(budget_s=60.0), discover=list, http_watched=True)
    stranger.look()
    assert stranger.starting() is None  # no server process given: nothing says a server starts


async def test_a_refused_health_or_metrics_port_while_ranks_start_is_said_as_starting() -> None:
    """Real probes of a port nothing listens on: starting while ranks start, else a wrong address."""
    url = f"http://127.0.0.1:{_free_port()}"
    line = "its ranks took no first step yet (pid 7 'sglang::scheduler_TP0'; start-up budget 600 s)"
    for starting, state, words in ((lambda: line, WatcherState.WAITING, f"server starting: nothing listens at {url}/health yet; {line}"),
                                   (lambda: None, WatcherState.BLIND, "wrong host or port")):
        watcher = HealthWatcher(HealthConfig(url=f"{url}/health"), starting=starting)
        async with httpx.AsyncClient(trust_env=False) as client:
            probed = await watcher.probe(client)
        got_state, reason = watcher._status_of(probed)
        assert got_state == state and words in reason, reason
        source = PrometheusStepSource(f"{url}/metrics")
        source.starting = starting
        assert await source.read_series() is None
        assert source.status()[0] == ("waiting" if state == WatcherState.WAITING else "blind")
        assert (words.replace("/health", "/metrics")) in source.status()[1]
        await source.aclose()


def test_the_startup_budget_reaches_the_rule_and_the_watchers(tmp_path: Path) -> None:
    settings = load_settings({"data_dir": tmp_path, "startup": {"budget_s": 42.0},
                              "health": {"url": "http://127.0.0.1:1/health"}, "metrics": {"url": "http://127.0.0.1:1/metrics"}})
    agent = Agent(settings)
    assert agent.startup.config.budget_s == 42.0 and agent.startup.http_watched
    assert agent.startup.interval_s == 42.0 / 20  # a look each twentieth of the budget (a discovery each)
    assert agent.watchers["health"].starting == agent.startup.starting
    assert agent.watchers["metrics"].source.starting == agent.startup.starting
    default = Agent(load_settings({"data_dir": tmp_path})).startup
    assert default.config.budget_s == 480.0 and default.interval_s == 5.0 and not default.http_watched


def test_the_only_rank_stuck_in_its_own_code_at_a_startup_stall_is_named_at_high_confidence() -> None:
    """A start-up stall is no progress (no first step within the budget): one rank (vLLM at TP=1)
    in its own code, its weight load, is the culprit at high confidence; a one-shot dump of the
    same stack cannot tell a hang from work."""
    from agent.host.startup import STARTUP_STALL
    from agent.verdict import rules

    assert rules.STARTUP_STALL == STARTUP_STALL  # the rules keep the trigger's name without importing the rule
    worker = rules.RankEvidence(rank=0, pid=41, title="VLLM::Worker", frame_class=rules.FrameClass.COMPUTE,
                                frame="load_weights (vllm/model_executor/models/llama.py:600)")
    v = rules.decide([worker], trigger=STARTUP_STALL)
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.confidence, v.hung) == ("compute", (0,), (41,), "high", True)
    assert v.reason == ("all ranks in compute: no collective wait; rank 0 stuck "
                        "(rank 0 in load_weights (vllm/model_executor/models/llama.py:600))")
    manual = rules.decide([worker], trigger="manual")
    assert (manual.culprit_ranks, manual.confidence, manual.hung) == ((), "low", False)
