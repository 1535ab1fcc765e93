"""The verdict on the real vLLM server (issue 21 items 1-4, issue 22's server boundaries).

- TP=2, TP0 hangs in its forward: TP1 waits in vLLM's own all-reduce (``parallel_state`` ->
  ``cpu_communicator`` -> ``shm_allreduce``), a collective wait: the culprit is rank 0, TP0's pid;
- TP=1, the Worker hangs: the Worker is named (rank 0); ``VLLM::EngineCore`` is evidence, no rank;
- an idle server's dump says idle, and no thread is "stuck" (``signal-callback``, tqdm's monitor,
  the worker's message queue are waits for work);
- two servers on one host, ``--match 'VLLM::*'``, both hung: the stall seen on one server's
  ``/metrics`` gives that server's verdict, naming none of the other's processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from tests.real.server import VllmServer

ROOT = Path(__file__).resolve().parents[2]


def _until(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s} s")
        time.sleep(0.5)


def _stack(pid: int) -> str:
    py_spy = Path(sys.executable).with_name("py-spy")
    out = subprocess.run([str(py_spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60, check=False)
    return out.stdout + out.stderr


def _request_in_background(server: VllmServer) -> threading.Thread:
    def go() -> None:
        try:
            server.complete("hello", max_tokens=4, timeout_s=180)
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _dump(server: VllmServer, data_dir: Path, *extra: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """``servewatch dump --root-pid <API server> --match 'VLLM::*' [extra]``: (verdict, manifest, stdout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli.entry", "dump", "--root-pid", str(server.pid), "--match", "VLLM::*",
         "--data-dir", str(data_dir), *extra],
        capture_output=True, text=True, timeout=180, check=False, cwd=ROOT, env=env,
    )
    manifests = sorted(data_dir.glob("*/*/manifest.json"))
    assert manifests, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    doc = json.loads(manifests[-1].read_text())
    assert doc.get("verdict"), out.stdout
    return doc["verdict"], doc, out.stdout


def test_tp2_hang_in_tp0_forward_names_rank_0_and_its_pid(vllm_tp2: VllmServer, tmp_path: Path) -> None:
    tp0, tp1 = vllm_tp2.workers()
    vllm_tp2.hang(ranks=(0,))
    t = _request_in_background(vllm_tp2)
    _until(lambda: "fault_point" in _stack(tp0.pid), 90, "TP0 hung in the forward")
    _until(lambda: "cpu_communicator" in _stack(tp1.pid), 90, "TP1 waiting in the all-reduce")
    v, _, stdout = _dump(vllm_tp2, tmp_path / "data")
    assert (v["culprit_ranks"], v["culprit_pids"], v["kind"]) == ([0], [tp0.pid], "behind"), v
    assert v["ranks"] == [0, 1] and v["confidence"] == "medium", v  # stacks of one instant, no Flight Recorder
    assert "rank 1 waits in one" in v["reason"] and "fault_point" in v["reason"], v["reason"]
    assert stdout.startswith(f"Verdict: culprit rank 0 (pid {tp0.pid}) -- behind:"), stdout[:400]
    vllm_tp2.clear_fault()
    t.join(timeout=120)


def test_tp1_hang_names_the_worker_and_the_engine_core_is_no_rank(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    (worker,) = vllm_tp1.workers()
    engine = vllm_tp1.engine_core()
    vllm_tp1.hang(ranks=None)
    t = _request_in_background(vllm_tp1)
    _until(lambda: "fault_point" in _stack(worker.pid), 90, "the Worker hung in the forward")
    # one snapshot cannot tell a hung forward from a busy one: the server's /metrics, read twice, can
    v, _, _ = _dump(vllm_tp1, tmp_path / "data", "--metrics-url", f"{vllm_tp1.url}/metrics", "--metrics-preset", "vllm")
    assert (v["culprit_ranks"], v["culprit_pids"], v["kind"], v["ranks"]) == ([0], [worker.pid], "compute", [0]), v
    engine_line = next(line for line in v["evidence"] if line.startswith(f"pid {engine.pid} "))
    assert "'VLLM::EngineCore'" in engine_line and "coordinator" in engine_line, v["evidence"]
    vllm_tp1.clear_fault()
    t.join(timeout=120)


def test_one_shot_dump_of_a_busy_server_blames_nobody_and_its_metrics_say_progressing(vllm_tp1: VllmServer,
                                                                                   tmp_path: Path) -> None:
    """New-user trial F7: requests flowing, every step in the Worker's forward (0.2 s each, so the
    snapshot finds it there): a one-shot dump has no progress source and names no culprit; with
    the server's /metrics it reads the counter twice and says progressing."""
    (worker,) = vllm_tp1.workers()
    vllm_tp1.slow(_STEP_S)
    with vllm_tp1.load(concurrency=2, max_tokens=200) as stats:
        steps = _metric(vllm_tp1, "vllm:iteration_tokens_total_count")
        _until(lambda: _metric(vllm_tp1, "vllm:iteration_tokens_total_count") > steps, 120, "a step seen on /metrics")
        _until(lambda: "fault_point" in _stack(worker.pid), 60, "the Worker in its forward")
        v, _, stdout = _dump(vllm_tp1, tmp_path / "data")
        assert (v["kind"], v["culprit_ranks"], v["culprit_pids"], v["hung"]) == ("compute", [], [], False), v
        assert "cannot tell a hang from work" in v["reason"] and "--metrics-url" in v["reason"], v["reason"]
        assert stdout.startswith("Verdict: no culprit rank -- all ranks in compute"), stdout[:400]
        v, _, _ = _dump(vllm_tp1, tmp_path / "data2", "--metrics-url", f"{vllm_tp1.url}/metrics", "--metrics-preset", "vllm")
        assert (v["kind"], v["culprit_ranks"], v["culprit_pids"], v["hung"]) == ("progressing", [], [], False), v
        assert "vllm:" in v["reason"] and "->" in v["reason"], v["reason"]
        vllm_tp1.clear_fault()
    assert stats["ok"] >= 1 and stats["failed"] == 0, stats


def test_a_sigstopped_worker_under_run_is_the_culprit_said_stopped(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    """New-user trial F6: a request running, the Worker SIGSTOPped, `run` sees the stall on
    /metrics: the verdict names the stopped rank (not a deadlock of everyone waiting for a
    message), and the summary line of its dump keeps "stopped"."""
    from agent.cli.summary import summary_lines

    (worker,) = vllm_tp1.workers()
    threads: list[threading.Thread] = []

    def stop_the_worker() -> None:
        threads.append(_long_request(vllm_tp1))
        steps = _metric(vllm_tp1, "vllm:iteration_tokens_total_count")
        _until(lambda: _metric(vllm_tp1, "vllm:iteration_tokens_total_count") > steps, 120, "a step seen on /metrics")
        vllm_tp1.sigstop(worker)  # SIGCONT by the fixture at the test's end

    record = anyio.run(_watch_stall, f"{vllm_tp1.url}/metrics", tmp_path / "data", stop_the_worker)
    v = record.verdict.to_json()
    assert (v["kind"], v["rule"], v["culprit_ranks"], v["culprit_pids"]) == ("suspended", "suspended", [0], [worker.pid]), v
    assert v["reason"].startswith(f"rank 0 (pid {worker.pid}) is stopped (SIGSTOP or a debugger; kill -CONT {worker.pid}"), v
    assert v["confidence"] == "high", v  # the kernel says it cannot run; /metrics says nothing moved
    (line,) = [x for x in summary_lines(record) if "pyspy.dump" in x and f"pid {worker.pid} " in x]
    assert f"stopped (state T: SIGSTOP or a debugger; `kill -CONT {worker.pid}` resumes it)" in line, line
    vllm_tp1.resume_all()
    vllm_tp1.clear_fault()
    for t in threads:
        t.join(timeout=300)


def test_an_idle_server_s_dump_says_idle_and_nothing_is_stuck(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    v, doc, stdout = _dump(vllm_tp1, tmp_path / "data")
    assert (v["kind"], v["hung"], v["culprit_ranks"], v["culprit_pids"]) == ("idle", False, [], []), (v["reason"], v["evidence"])
    assert v["reason"].startswith("all idle (waiting for work): nothing is stuck"), v["reason"]
    dumps = [a for a in doc["actions"] if a["action"] == "pyspy.dump"]
    assert len(dumps) == 2 and all(a["outcome"] == "ok" for a in dumps), [(a["pid"], a["outcome"], a["detail"]) for a in dumps]
    for a in dumps:  # every thread is a wait for work: signal-callback, tqdm's monitor, the message queue
        assert "all idle (waiting for work): nothing is stuck; stuck: none" in a["detail"], a["detail"]
    assert "hung frame" not in stdout


async def _watch_stall(metrics_url: str, data_dir: Path, make_it_stall: Any) -> Any:
    """The real agent, host-wide ``--match 'VLLM::*'``, stalls read from ``metrics_url``; once it
    runs, ``make_it_stall()`` (in a thread) makes that server progress then hang. Its first stall
    incident."""
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings
    from exporters.otlp.provider import build_telemetry

    settings = load_settings({
        "data_dir": data_dir, "host_name": "real", "target": {"match": ["VLLM::*"]},
        "metrics": {"url": metrics_url, "metrics_preset": "vllm"},
        "watchdog": {"timeout_s": 5.0, "poll_interval_s": 0.5}, "coredump": {"enabled": False},
    })
    records: list[Any] = []
    got = anyio.Event()

    def on_incident(record: Any) -> None:
        if record.opened.trigger == "stall":
            records.append(record)
            got.set()

    telemetry = build_telemetry(settings.export, data_dir=settings.data_dir, host_name=settings.host_name)
    agent = Agent(settings, telemetry=telemetry, on_incident=on_incident)
    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            await anyio.sleep(2.0)  # the first scrapes
            await anyio.to_thread.run_sync(make_it_stall)
            await got.wait()
            agent.stop()
            tg.cancel_scope.cancel()
    await telemetry.aclose(3.0)
    return records[0]


def _hung(server: VllmServer) -> None:
    (worker,) = server.workers()
    _until(lambda: "fault_point" in _stack(worker.pid), 120, "the Worker hung in the forward")


def _metric(server: VllmServer, name: str) -> float:
    """The sum of ``name``'s samples on the server's /metrics."""
    total = 0.0
    for line in server.metrics().splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


#: Seconds each forward of a server with a long request sleeps first (the fault plugin's slow
#: mode): 200 tokens then take >= 40 s, so the hang is always set inside the running request (a
#: tiny model on a quiet box otherwise finishes the 200 tokens in about a second).
_STEP_S = 0.2


def _long_request(server: VllmServer) -> threading.Thread:
    """A request generating 200 tokens (EOS ignored), in the background, seen running on /metrics:
    a hang then falls inside a running request (vLLM publishes its scheduler statistics after each
    step, so a forward hung in a request's first step never shows it running)."""
    outcome: list[object] = []

    def go() -> None:
        try:
            outcome.append(server.complete("hello", max_tokens=200, timeout_s=600, ignore_eos=True)["usage"])
        except httpx.HTTPError as exc:
            outcome.append(exc)

    def running() -> bool:
        if outcome:  # it ended before it was seen running: say how, not "not running"
            raise AssertionError(f"the long request to {server.url} ended before /metrics showed it running: {outcome[0]!r}")
        return _metric(server, "vllm:num_requests_running") >= 1

    server.slow(_STEP_S)  # every forward takes >= _STEP_S: the request is still running when we look
    t = threading.Thread(target=go, daemon=True)
    t.start()
    _until(running, 120, "the request running")
    return t


def _hang_mid_request(server: VllmServer) -> None:
    """Hang the Worker's next forward once the running request has made progress on /metrics."""
    steps = _metric(server, "vllm:iteration_tokens_total_count")
    _until(lambda: _metric(server, "vllm:iteration_tokens_total_count") > steps, 120, "a step seen on /metrics")
    server.hang(ranks=None)
    _hung(server)


def test_two_servers_each_stall_gets_its_own_server_s_verdict(real_vllm: Any, tmp_path: Path) -> None:
    """Both servers end up hung inside a running request; the agent watches one server's
    /metrics at a time (a stall there has no pid): the verdict is that server's, naming none of
    the other's processes."""
    a: VllmServer = real_vllm.dedicated(tp=1)
    b: VllmServer = real_vllm.dedicated(tp=1)
    threads: list[threading.Thread] = []

    def both_hang() -> None:
        for server in (a, b):
            threads.append(_long_request(server))
            _hang_mid_request(server)

    def a_progresses_then_hangs() -> None:
        a.slow(_STEP_S)  # a's request goes on: progress on a's /metrics, then a hangs again
        _hang_mid_request(a)

    for mine, other, make_it_stall in ((b, a, both_hang), (a, b, a_progresses_then_hangs)):
        record = anyio.run(_watch_stall, f"{mine.url}/metrics", tmp_path / f"data-{mine.port}", make_it_stall)
        v = record.verdict.to_json()
        (worker,) = mine.workers()
        assert (v["culprit_ranks"], v["culprit_pids"]) == ([0], [worker.pid]), v
        text = " ".join([v["reason"], *v["evidence"]])
        theirs = {p.pid for p in other.tree()}
        assert not any(str(p) in text.replace(",", " ").replace(";", " ").split() or f"pid {p}" in text
                       for p in theirs), (theirs, v)
    for server in (a, b):
        server.clear_fault()
    for t in threads:
        t.join(timeout=300)


def test_an_engine_core_hung_in_its_own_loop_is_the_culprit_by_pid_and_frame(vllm_tp1: VllmServer,
                                                                            tmp_path: Path) -> None:
    """Issue 32 item 1b: a request running, the EngineCore's own busy loop blocks before its next
    step (the fault plugin wraps ``EngineCore.step`` in the EngineCore process), its Worker idles
    waiting for work; `run` sees the stall on /metrics. The verdict names the engine core by its
    pid and frame, at high confidence (the stall and the stacks agree), not "no collective wait
    (rank 0 idle)"; hard mode would signal it (a target of the incident) and never the Worker."""
    from agent.verdict.rules import hard_signal_plan

    (worker,) = vllm_tp1.workers()
    engine = vllm_tp1.engine_core()
    threads: list[threading.Thread] = []

    def hang_the_engine_core() -> None:
        threads.append(_long_request(vllm_tp1))
        steps = _metric(vllm_tp1, "vllm:iteration_tokens_total_count")
        _until(lambda: _metric(vllm_tp1, "vllm:iteration_tokens_total_count") > steps, 120, "a step seen on /metrics")
        vllm_tp1.hang_engine()
        _until(lambda: "engine_fault_point" in _stack(engine.pid), 120, "the EngineCore hung before its step")

    started = time.monotonic()
    try:
        record = anyio.run(_watch_stall, f"{vllm_tp1.url}/metrics", tmp_path / "data", hang_the_engine_core)
    finally:
        vllm_tp1.clear_fault()
        for t in threads:
            t.join(timeout=300)
    v = record.verdict.to_json()
    print(f"\n{v['headline']}\nnext: {v['next']}\n(stall to verdict: {time.monotonic() - started:.1f} s in all)")
    assert (v["kind"], v["rule"], v["culprit_ranks"], v["culprit_pids"], v["hung"], v["confidence"]) == (
        "coordinator", "coordinator_stuck", [], [engine.pid], True, "high"), v
    assert v["ranks"] == [0], v
    assert v["reason"].startswith(f"the engine core pid {engine.pid} 'VLLM::EngineCore' is stuck in engine_fault_point ("), v
    assert "servewatch_realvllm_plugin.py:" in v["reason"], v["reason"]
    assert "while every rank idles (waiting for work): rank 0 in " in v["reason"], v["reason"]
    assert v["headline"].startswith(f"Verdict: culprit pid {engine.pid} 'VLLM::EngineCore' -- the engine core "), v
    worker_line = next(line for line in v["evidence"] if line.startswith(f"rank 0 pid {worker.pid}"))
    assert "idle" in worker_line, v["evidence"]
    assert v["next"].startswith(f"py-spy dump --native --pid {engine.pid} ("), v["next"]
    pids, _ = hard_signal_plan(record.verdict, target_pids=[t.pid for t in record.targets], stalled_pid=None)
    assert pids == [engine.pid], (pids, [t.pid for t in record.targets])
    assert vllm_tp1.serves(timeout_s=120), vllm_tp1.log_tail()  # released: the server answers again
