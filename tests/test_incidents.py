"""IncidentManager: trigger -> ordered phases -> bundle, cooldown, hard mode, in-flight requests."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from agent.cli.summary import summary_lines
from agent.host.targets import Target
from agent.incidents.manager import IncidentConfig, IncidentManager, InflightRequest
from agent.model.bus import RecordingBus
from agent.model.events import (
    ActionResult,
    CoredumpTriggered,
    HealthCheckFailed,
    IncidentClosed,
    IncidentOpened,
    Outcome,
    StacksDumped,
    TargetExited,
    WatchdogStalled,
    now_ns,
)


def _targets(*pids: int) -> list[Target]:
    return [Target(pid=p, title=f"demo::scheduler_TP{i}") for i, p in enumerate(pids)]


class Timeline:
    """Records when each fake phase started and ended, to check ordering."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, int]] = []

    def phase(self, name: str, *, sleep_s: float = 0.0, outcome: Outcome = Outcome.OK):
        async def run(opened: IncidentOpened, targets: Sequence[Target], bundle: Path, report: object) -> list[ActionResult]:
            results = []

            async def one(t: Target) -> None:
                start = now_ns()
                self.marks.append((f"{name}:start:{t.pid}", start))
                await anyio.sleep(sleep_s)
                (bundle / f"{name}-{t.pid}.txt").write_text(name)
                end = now_ns()
                self.marks.append((f"{name}:end:{t.pid}", end))
                results.append(
                    ActionResult(action=name, outcome=outcome, pid=t.pid, start_time_unix_nano=start,
                                 end_time_unix_nano=end, artifact_paths=(str(bundle / f"{name}-{t.pid}.txt"),))
                )

            async with anyio.create_task_group() as tg:
                for t in targets:
                    tg.start_soon(one, t)
            return sorted(results, key=lambda r: r.pid or 0)

        return run


def _manager(tmp_path: Path, bus: RecordingBus, tl: Timeline, **kw) -> IncidentManager:
    return IncidentManager(
        bus=bus,
        config=kw.pop("config", IncidentConfig(cooldown_s=60)),
        data_dir=tmp_path,
        host_name="h1",
        discover=kw.pop("discover", lambda: _targets(101, 102)),
        phases=kw.pop(
            "phases",
            [("pyspy.dump", tl.phase("pyspy.dump", sleep_s=0.05), StacksDumped),
             ("cuda.coredump", tl.phase("cuda.coredump"), CoredumpTriggered)],
        ),
        **kw,
    )


async def test_phases_run_in_order_and_bundle_is_written(tmp_path: Path) -> None:
    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl)
    record = await mgr.open_incident("stall", detail="frozen", pid=102)

    # the culprit is acted on first; every coredump starts after the last dump ended
    assert [t.pid for t in record.targets] == [102, 101]
    last_dump_end = max(t for m, t in tl.marks if m.startswith("pyspy.dump:end"))
    first_core_start = min(t for m, t in tl.marks if m.startswith("cuda.coredump:start"))
    assert first_core_start >= last_dump_end

    manifest = json.loads((tmp_path / "h1" / record.opened.incident_id / "manifest.json").read_text())
    assert manifest["trigger"] == "stall"
    assert manifest["detail"] == "frozen"
    assert manifest["host.name"] == "h1"
    assert [a["action"] for a in manifest["actions"]] == ["pyspy.dump", "pyspy.dump", "cuda.coredump", "cuda.coredump"]
    assert all(a["outcome"] == "ok" and Path(a["artifact_paths"][0]).is_file() for a in manifest["actions"])
    assert manifest["closed_time_unix_nano"] >= manifest["opened_time_unix_nano"]
    assert len(manifest["trace_id"]) == 32 and len(manifest["span_id"]) == 16

    kinds = [type(e).__name__ for e in bus.events]
    assert kinds == ["IncidentOpened", "StacksDumped", "StacksDumped", "CoredumpTriggered", "CoredumpTriggered", "IncidentClosed"]
    closed = bus.of_type(IncidentClosed)[0]
    assert closed.outcomes == (("pyspy.dump", "ok"),) * 2 + (("cuda.coredump", "ok"),) * 2


async def test_cooldown_opens_one_incident_per_trigger_kind(tmp_path: Path) -> None:
    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl)
    async with anyio.create_task_group() as tg:
        await tg.start(mgr.run)
        for pid in (101, 102, 101):  # every TP rank stalls at once, then a repeat
            await bus.publish(WatchdogStalled(pid=pid, forward_ct=7, stalled_for_s=3.0, timeout_s=3.0))
        for _ in range(3):  # a flapping health check
            await bus.publish(HealthCheckFailed(url="http://x/health", status_code=503, latency_s=0.1,
                                                error_class="5xx", consecutive_failures=3))
        with anyio.fail_after(10):
            while len(mgr.records) < 2 or mgr.suppressed < 4:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert sorted(r.opened.trigger for r in mgr.records) == ["health", "stall"]
    assert mgr.suppressed == 4


async def test_exit_code_zero_is_not_an_incident_but_a_signal_is(tmp_path: Path) -> None:
    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl)
    assert mgr.classify(TargetExited(pid=5, exit_code=0)) is None
    trigger, pid, detail = mgr.classify(TargetExited(pid=5, signal=9, title="sglang::scheduler_TP0"))
    assert (trigger, pid) == ("exit", 5) and "signal 9" in detail
    mgr.expect_exit(5)  # asked to stop (launch forwarded the operator's SIGTERM)
    assert mgr.classify(TargetExited(pid=5, signal=15)) is None
    record = await mgr.open_incident("exit", pid=101, cause=TargetExited(pid=101, exit_code=1))
    # the dead process stays in the incident, first (its actions report it dead: often the cause)
    assert [t.pid for t in record.targets] == [101, 102]


async def test_failing_and_hanging_phases_become_outcomes(tmp_path: Path) -> None:
    bus, tl = RecordingBus(), Timeline()

    async def broken(opened, targets, bundle, report):
        raise RuntimeError("actor bug")

    mgr = _manager(
        tmp_path, bus, tl,
        config=IncidentConfig(cooldown_s=60, phase_timeout_s=0.2),
        phases=[("pyspy.dump", broken, StacksDumped),
                ("cuda.coredump", tl.phase("cuda.coredump", sleep_s=30), CoredumpTriggered)],
    )
    with anyio.fail_after(10):
        record = await mgr.open_incident("manual")
    assert [(r.action, r.outcome, r.pid) for r in record.results] == [
        ("pyspy.dump", Outcome.FAILED, None),
        ("cuda.coredump", Outcome.TIMED_OUT, 101), ("cuda.coredump", Outcome.TIMED_OUT, 102)]
    assert "RuntimeError: actor bug" in record.results[0].detail
    assert record.manifest_path.is_file()


async def test_phase_time_limit_keeps_finished_results_and_times_out_only_the_rest(tmp_path: Path) -> None:
    """A real actor over real act_all: pid 101's action finishes, 102's hangs past the phase limit."""
    from agent.actors import act_all
    from agent.model.events import ActionResult, now_ns

    class HalfHung:
        name = "half"

        async def act(self, trigger: IncidentOpened, target: Target, *, timeout_s: float, artifact_dir: Path) -> ActionResult:
            if target.pid == 102:
                await anyio.sleep(60)
            t = now_ns()
            return ActionResult(action="pyspy.dump", outcome=Outcome.OK, pid=target.pid, detail="dumped",
                                start_time_unix_nano=t, end_time_unix_nano=t)

    async def phase(opened, targets, bundle, report):
        return await act_all(HalfHung(), opened, targets, timeout_s=60, artifact_dir=bundle, report=report)

    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl, config=IncidentConfig(cooldown_s=60, phase_timeout_s=0.5),
                   phases=[("pyspy.dump", phase, StacksDumped)])
    with anyio.fail_after(20):
        record = await mgr.open_incident("manual")
    assert [(r.pid, r.outcome) for r in record.results] == [(101, Outcome.OK), (102, Outcome.TIMED_OUT)]
    assert record.results[0].detail == "dumped"
    assert "unfinished when the pyspy.dump phase reached its 0.5 s limit" in record.results[1].detail
    manifest = json.loads(record.manifest_path.read_text())
    assert [(a["pid"], a["outcome"]) for a in manifest["actions"]] == [(101, "ok"), (102, "timed_out")]
    assert [(e.result.pid, e.result.outcome) for e in bus.of_type(StacksDumped)] == [
        (101, Outcome.OK), (102, Outcome.TIMED_OUT)]


async def test_inflight_requests_become_links_and_requests_json_without_prompts(tmp_path: Path) -> None:
    bus, tl = RecordingBus(), Timeline()

    async def inflight(targets):
        return [InflightRequest(pid=101, request_id="req-1", trace_id="a" * 32, span_id="b" * 16, age_s=2.5,
                                prompt_tokens=12, generated_tokens=3, prompt="secret prompt")]

    mgr = _manager(tmp_path, bus, tl, inflight=inflight)
    record = await mgr.open_incident("stall")
    assert bus.of_type(IncidentOpened)[0].links == (("a" * 32, "b" * 16),)
    data = json.loads((record.bundle_dir / "requests.json").read_text())
    assert data["requests"] == [{"pid": 101, "request_id": "req-1", "trace_id": "a" * 32, "span_id": "b" * 16,
                                 "age_s": 2.5, "prompt_tokens": 12, "generated_tokens": 3}]
    assert "secret" not in (record.bundle_dir / "requests.json").read_text()


async def test_hard_mode_signals_the_stalled_target_after_the_evidence(tmp_path: Path, spawn, python) -> None:
    proc: subprocess.Popen = spawn([python, "-c", "import time; time.sleep(60)"])
    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl, discover=lambda: [Target(pid=proc.pid, title="t")],
                   hard_signal=int(signal.SIGTERM))
    record = await mgr.open_incident("stall", pid=proc.pid)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert record.hard_signal_sent == {proc.pid: "SIGTERM"}
    # the signal came after every phase finished
    assert all(r.outcome is Outcome.OK for r in record.results)
    assert json.loads(record.manifest_path.read_text())["hard_signal_sent"] == {str(proc.pid): "SIGTERM"}


async def test_soft_mode_leaves_the_target_alone(tmp_path: Path, spawn, python) -> None:
    proc = spawn([python, "-c", "import time; time.sleep(60)"])
    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl, discover=lambda: [Target(pid=proc.pid, title="t")])
    await mgr.open_incident("stall", pid=proc.pid)
    assert proc.poll() is None


@pytest.mark.parametrize("trigger", ["stall", "health", "exit", "manual"])
async def test_incident_ids_name_the_trigger_and_are_unique(tmp_path: Path, trigger: str) -> None:
    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl, discover=list)
    a = await mgr.open_incident(trigger)
    b = await mgr.open_incident(trigger)
    assert a.opened.incident_id != b.opened.incident_id
    assert f"-{trigger}-" in a.opened.incident_id
    assert a.results == []  # no targets: nothing to act on, but the bundle still exists
    assert a.manifest_path.is_file()


async def test_unwritable_data_dir_never_crashes_the_incident(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    bus, tl = RecordingBus(), Timeline()
    mgr = IncidentManager(bus=bus, config=IncidentConfig(), data_dir=blocker, host_name="h1",
                          discover=lambda: _targets(101),
                          phases=[("pyspy.dump", tl.phase("pyspy.dump"), StacksDumped)])
    record = await mgr.open_incident("stall")
    # the phase could not write its artifact: an outcome, and the incident still closes
    assert [(r.action, r.outcome) for r in record.results] == [("pyspy.dump", Outcome.FAILED)]
    assert not record.manifest_path.exists()
    assert type(bus.events[-1]).__name__ == "IncidentClosed"


class _FixedJudge:
    """A judge (the VerdictJudge protocol) whose verdict names ``culprit`` (hung) or nobody (progressing)."""

    def __init__(self, culprit_pid: int | None, *, hung: bool = True) -> None:
        self.culprit_pid, self.hung = culprit_pid, hung

    def opened(self, targets, trigger=""):
        return {}

    async def decide(self, targets, results, cause, steps_before):
        from agent.verdict.rules import Verdict

        named = (self.culprit_pid,) if self.culprit_pid else ()
        return Verdict(kind="behind" if named else "progressing", hung=self.hung, culprit_ranks=(1,) if named else (),
                       culprit_pids=named, reason="test", confidence="high")


@pytest.mark.parametrize(("policy", "named", "hung", "signalled"), [
    ("culprit", True, True, {"culprit"}),    # the verdict's culprit, not the rank that tripped first
    ("all", True, True, {"first", "culprit"}),
    ("culprit", False, True, set()),         # no culprit named: nobody (never "the stalled target" of a job)
    ("culprit", False, False, set()),        # progressing: nothing to restart
])
async def test_hard_mode_signals_per_policy_and_verdict(tmp_path: Path, spawn, python, policy: str, named: bool,
                                                        hung: bool, signalled: set[str]) -> None:
    first: subprocess.Popen = spawn([python, "-c", "import time; time.sleep(60)"])
    culprit: subprocess.Popen = spawn([python, "-c", "import time; time.sleep(60)"])
    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl, discover=lambda: [Target(pid=first.pid, title="TP0"), Target(pid=culprit.pid, title="TP1")],
                   hard_signal=int(signal.SIGTERM), hard_targets=policy,
                   judge=_FixedJudge(culprit.pid if named else None, hung=hung))
    record = await mgr.open_incident("stall", pid=first.pid)  # TP0's watchdog tripped first
    names = {first.pid: "first", culprit.pid: "culprit"}
    assert {names[p] for p in record.hard_signal_sent} == signalled
    spans = [r for r in record.results if r.action == "hard.signal"]
    assert {names[r.pid] for r in spans} == signalled and all(r.outcome is Outcome.OK for r in spans)
    assert [type(e).__name__ for e in bus.events].count("HardSignalSent") == len(signalled)
    for proc, name in ((first, "first"), (culprit, "culprit")):
        if name in signalled:
            assert proc.wait(timeout=10) == -signal.SIGTERM
        else:
            assert proc.poll() is None
    manifest = json.loads(record.manifest_path.read_text())
    assert manifest["verdict"]["reason"] == "test"


async def test_the_verdict_says_the_servers_own_watchdog_fired_in_the_incidents_window_and_again_at_close(tmp_path: Path) -> None:
    """``server_dumps`` is asked with the incident's open time, now and its targets' pids, once the
    verdict is made and again when it closes: its lines join the verdict's evidence, a later run's
    line replacing the earlier set (never twice)."""
    asked: list[tuple[int, int, list[int]]] = []

    def server_dumps(opened_ns: int, until_ns: int, pids: Sequence[int]) -> list[str]:
        asked.append((opened_ns, until_ns, list(pids)))
        lines = [("SGLang's own watchdog fired: pid 101 'sglang::scheduler' ran '/bin/sh -c py-spy dump --native --pid 101'"
                  " (pid 7), seen at 00:00:01.000 UTC")]
        return lines if len(asked) == 1 else [lines[0] + ", 2 runs"]

    mgr = _manager(tmp_path, RecordingBus(), Timeline(), judge=_FixedJudge(101), server_dumps=server_dumps)
    record = await mgr.open_incident("stall", pid=101)
    opened = record.opened.time_unix_nano
    assert [(a[0], a[2]) for a in asked] == [(opened, [101, 102])] * 2 and opened <= asked[0][1] <= asked[1][1]
    evidence = json.loads(record.manifest_path.read_text())["verdict"]["evidence"]
    assert evidence == [("SGLang's own watchdog fired: pid 101 'sglang::scheduler' ran '/bin/sh -c py-spy dump --native"
                         " --pid 101' (pid 7), seen at 00:00:01.000 UTC, 2 runs")], evidence

    assert summary_lines(record)[1:2] == evidence  # said right after the verdict's headline


def _proc_status(pid: int) -> str:
    """State and signal dispositions of a process from /proc (for failure messages)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        return f"gone ({type(exc).__name__})"
    return ", ".join(line for line in lines if line.startswith(("State", "SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd")))


# a server rank that shuts down cleanly on SIGTERM the way servers do: it exits with 128 + 15
CATCH_SIGTERM = ("import signal, sys, time\n"
                 "signal.signal(signal.SIGTERM, lambda n, f: sys.exit(128 + n))\n"
                 "print('ready', flush=True)\n"
                 "time.sleep(60)\n")
SEGFAULT = "import ctypes; ctypes.string_at(0)"


async def test_sigterm_and_sigint_exits_are_orderly_stops_sigkill_and_crashes_are_incidents(
        tmp_path: Path, spawn, python, caplog: pytest.LogCaptureFixture) -> None:
    import os
    import select

    from agent.watchers.process import ProcessWatcher

    def started(code: str) -> subprocess.Popen:
        proc = spawn([python, "-c", code], stdout=subprocess.PIPE)
        assert proc.stdout is not None  # signalled only once up (a SIGINT at startup is a traceback, exit 1)
        assert select.select([proc.stdout], [], [], 60)[0] and proc.stdout.readline() == b"ready\n"
        return proc

    caught = started(CATCH_SIGTERM)
    # SIGINT back to its default in the children: a suite run from a background job (nohup, `&`
    # in a script) inherits SIGINT ignored, and then the "interrupted" child would just sleep on
    termed, interrupted, killed = (
        started("import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); print('ready', flush=True); time.sleep(60)")
        for _ in range(3)
    )
    crashed = spawn([python, "-c", SEGFAULT])
    procs = [caught, termed, interrupted, killed, crashed]
    watch_bus = RecordingBus()
    watcher = ProcessWatcher(children=procs, poll_interval_s=0.2)
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run, watch_bus)
        for proc, sig in ((caught, signal.SIGTERM), (termed, signal.SIGTERM), (interrupted, signal.SIGINT),
                          (killed, signal.SIGKILL)):
            os.kill(proc.pid, sig)
        with anyio.move_on_after(60):
            while len(watch_bus.of_type(TargetExited)) < len(procs):
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    reported = {e.pid for e in watch_bus.of_type(TargetExited)}
    # a miss says which process, and whether it had exited at all (state, signals it ignored)
    missing = {p.pid: (p.poll(), _proc_status(p.pid)) for p in procs if p.pid not in reported}
    assert not missing, f"exits not reported within 60 s (pid: returncode, /proc status): {missing}"
    exits = {e.pid: e for e in watch_bus.of_type(TargetExited)}
    assert (exits[caught.pid].exit_code, exits[caught.pid].signal) == (143, None)
    assert exits[termed.pid].signal == signal.SIGTERM and exits[interrupted.pid].signal == signal.SIGINT
    assert exits[killed.pid].signal == signal.SIGKILL and exits[crashed.pid].signal == signal.SIGSEGV

    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl, discover=list)
    caplog.set_level("INFO", logger="servewatch.incidents")
    async with anyio.create_task_group() as tg:
        await tg.start(mgr.run)
        for proc in (caught, termed, interrupted, killed):  # the stops first: handled before the kill
            await bus.publish(exits[proc.pid])
        with anyio.fail_after(30):
            while not mgr.records:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert [r.opened.trigger for r in mgr.records] == ["exit"]
    assert f"pid {killed.pid} " in mgr.records[0].opened.detail and "SIGKILL" in mgr.records[0].opened.detail
    assert mgr.suppressed == 0  # the stops were no incidents, not incidents held back by the cooldown
    stops = [r.getMessage() for r in caplog.records if "stopped by" in r.getMessage()]
    assert len(stops) == 3, stops
    assert f"pid {caught.pid} " in stops[0] and "stopped by SIGTERM (exit code 143): no incident" in stops[0]
    assert "stopped by SIGTERM (signal 15 (SIGTERM))" in stops[1] and "stopped by SIGINT" in stops[2]
    assert mgr.classify(exits[crashed.pid])[:2] == ("exit", crashed.pid)

    # the on-call who wants every SIGTERM exit investigated turns the setting on
    strict = _manager(tmp_path, RecordingBus(), tl, config=IncidentConfig(cooldown_s=60, signal_stop_is_incident=True))
    for proc in (caught, termed, interrupted):
        assert strict.classify(exits[proc.pid])[:2] == ("exit", proc.pid)


async def test_an_incident_written_closed_stays_closed_and_recorded_once_when_cancelled_while_publishing_its_end(
        tmp_path: Path) -> None:
    # the agent stops (its task group cancelled) while IncidentClosed waits for room on a full
    # subscriber: the incident was already written closed with all its evidence
    bus, tl = RecordingBus(), Timeline()
    finished: list[object] = []
    mgr = _manager(tmp_path, bus, tl, on_incident=finished.append)
    stuck = bus.subscribe(IncidentClosed, name="stuck", max_buffer=1)  # never read
    try:
        await bus.publish(IncidentClosed(incident_id="earlier", trigger="stall", bundle_dir="/b",
                                         manifest_path="/b/manifest.json"))  # its buffer is full now
        async with anyio.create_task_group() as tg:
            tg.start_soon(mgr.open_incident, "stall")
            with anyio.fail_after(30):
                while not mgr.records:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    finally:
        stuck.close()
    [record] = mgr.records
    assert record.state == "closed"
    manifest = json.loads(record.manifest_path.read_text())
    assert (manifest["state"], manifest.get("interrupted_reason", "")) == ("closed", "")
    assert [r["action"] for r in manifest["actions"]].count("pyspy.dump") == 2
    assert not record.root_published and manifest["root_published"] is False  # the end never went out
    assert finished == [record]


async def test_an_incident_stopped_before_it_captured_anything_leaves_no_empty_folder(tmp_path: Path) -> None:
    """Ctrl-C while the incident is still finding its trace (the demo's race): its bundle folder
    was made and nothing went in; it is removed, not left as a nameless incident."""
    bus, tl = RecordingBus(), Timeline()
    placing = anyio.Event()

    async def place(trigger: str, targets: Sequence[Target], time_unix_nano: int, parent: tuple[str, str] | None):
        placing.set()
        await anyio.sleep_forever()

    mgr = _manager(tmp_path, bus, tl, place=place)
    async with anyio.create_task_group() as tg:
        tg.start_soon(mgr.open_incident, "stall")
        with anyio.fail_after(10):
            await placing.wait()
        assert len(list((tmp_path / "h1").iterdir())) == 1  # made, empty
        tg.cancel_scope.cancel("operator's Ctrl-C")
    assert list((tmp_path / "h1").iterdir()) == []
    assert bus.of_type(IncidentOpened) == []


async def test_a_placement_cut_at_its_bound_is_said_in_a_log_line_and_on_the_incident_and_the_capture_runs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Naming the job's trace must never be a silent gate: cut at its bound, the incident opens
    in its own trace, says so (one log line, a root attribute) and captures every target."""
    from agent.incidents.manager import PLACEMENT_ATTRIBUTE

    bus, tl = RecordingBus(), Timeline()
    async def place(trigger: str, targets: Sequence[Target], time_unix_nano: int, parent: tuple[str, str] | None):
        await anyio.sleep(30)  # a peer or a recorder that never answers

    mgr = _manager(tmp_path, bus, tl, config=IncidentConfig(cooldown_s=60, phase_timeout_s=0.5), place=place)
    with caplog.at_level("WARNING", logger="servewatch.incidents"), anyio.fail_after(20):
        record = await mgr.open_incident("stall", detail="frozen", pid=102)
    [opened] = bus.of_type(IncidentOpened)
    assert dict(opened.attributes)[PLACEMENT_ATTRIBUTE] == "cut after 0.5 s: opened in its own trace"
    assert opened.parent_span_id == "" and len(opened.trace_id) == 32
    assert [r.action for r in record.results].count("pyspy.dump") == 2  # the capture ran
    assert any("took over 0.5 s: it opens in its own trace" in r.getMessage() for r in caplog.records)


async def test_two_manifest_writes_of_one_record_land_in_the_order_their_snapshots_were_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lifecycle line noted while the incident's own last write is in its thread (CI: an
    orphan's end 0 s after the open, under load). Before: the two writes ran in two threads at
    once, the older snapshot's rename landed last and the manifest lost the newer line."""
    import time as _time

    from agent.incidents import manager as incidents

    bus, tl = RecordingBus(), Timeline()
    mgr = _manager(tmp_path, bus, tl)
    record = await mgr.open_incident("stall", detail="frozen", pid=102)
    real_write = incidents._write_json
    calls: list[int] = []

    def slow_first_write(path: Path, data, durable: bool = True) -> bool:
        calls.append(len(calls))
        if len(calls) == 1:
            _time.sleep(0.6)  # the first snapshot's write is slow (a busy disk's fsync)
        return real_write(path, data, durable)

    monkeypatch.setattr(incidents, "_write_json", slow_first_write)
    record.lifecycle.append("left alive, then ended: pid 1 (1 of its processes still alive)")
    async with anyio.create_task_group() as tg:
        tg.start_soon(mgr.rewrite, record)
        with anyio.fail_after(5):
            while not calls:  # the first snapshot is taken and its write under way
                await anyio.sleep(0.01)
        record.lifecycle.append("left alive, then ended: pid 2 (none of its processes left alive now)")
        tg.start_soon(mgr.rewrite, record)
    manifest = json.loads((tmp_path / "h1" / record.opened.incident_id / "manifest.json").read_text())
    assert manifest["lifecycle"] == record.lifecycle, manifest["lifecycle"]
    assert len(calls) == 2


def test_a_dump_line_names_its_idle_threads_in_one_order() -> None:
    """py-spy lists a process's threads in no fixed order: two dumps of the same process read
    alike (the order differed between two demo runs and a terminal test compared them)."""
    from types import SimpleNamespace

    from agent.cli.summary import STUCK_THREADS_ATTR, _threads_text

    one = SimpleNamespace(attributes={STUCK_THREADS_ATTR: ["MainThread"]})
    texts = {_threads_text(one, idle) for idle in (["servewatch-control", "QueueFeederThread"], ["QueueFeederThread", "servewatch-control"])}  # type: ignore[arg-type]
    assert texts == {"; stuck threads: MainThread; idle: QueueFeederThread, servewatch-control"}
