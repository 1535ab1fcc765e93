"""Flight Recorder actor on real gloo ranks: each source, each outcome, artifact and span attributes."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent.actors.flightrec import (
    ACTION,
    FlightRecorderActor,
    FlightRecorderConfig,
)
from agent.host.cudaenv import flight_recorder_env
from agent.host.targets import Target
from agent.model.events import IncidentOpened, Outcome
from agent.model.ranks import rank_from_title
from agent.sdk.flightrec import worker_path
from tests.programs.fault_matrix import start_ranks, stop_ranks, wait_ready

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"


@pytest.fixture
def ranks(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[Target]]:
    """Two real gloo ranks (``extra`` args from the test's ``ranks_args`` marker-free param)."""
    extra, fault = getattr(request, "param", ([], "none"))
    procs = start_ranks(2, tmp_path, fault=fault, fault_rank=1, extra=extra)
    try:
        wait_ready(procs)
        yield [Target(pid=p.pid, title=f"faultjob::scheduler_TP{i}") for i, p in enumerate(procs)]
    finally:
        stop_ranks(procs)


def _opened(tmp_path: Path) -> IncidentOpened:
    return IncidentOpened(incident_id="inc-1", trigger="manual", bundle_dir=str(tmp_path))


async def _wait_steps(targets: list[Target], n: int) -> None:
    from agent.sdk import read_counter
    from agent.sdk.counter import counter_path

    with anyio.fail_after(60):
        while not all((s := read_counter(counter_path(t.pid))) is not None and s.forward_ct >= n for t in targets):
            await anyio.sleep(0.1)


async def test_worker_server_answers_for_every_rank_even_one_stuck_in_a_collective(ranks: list[Target], tmp_path: Path) -> None:
    await _wait_steps(ranks, 2)
    actor = FlightRecorderActor(FlightRecorderConfig(timeout_s=5.0))
    results = await actor.collect_all(_opened(tmp_path), ranks, artifact_dir=tmp_path)
    assert [r.action for r in results] == [ACTION, ACTION]
    for rank, r in enumerate(results):
        assert r.outcome is Outcome.OK, r.detail
        assert r.attributes["servewatch.flightrec.source"] == "sdk_worker"
        assert r.attributes["servewatch.flightrec.rank"] == rank  # from torch.distributed, via the SDK's status
        assert r.attributes["servewatch.flightrec.entries"] >= 4
        doc = json.loads(Path(r.artifact_paths[0]).read_text())
        assert Path(r.artifact_paths[0]).name == f"flightrec-rank{rank}-{r.pid}.json"
        assert (Path(r.artifact_paths[0]).stat().st_mode & 0o777) == 0o600
        ops = {e["profiling_name"] for e in doc["trace"]["entries"]}
        assert ops == {"gloo:broadcast", "gloo:all_reduce"}


@pytest.mark.parametrize("ranks", [([], "hang")], indirect=True)
async def test_rank_waiting_in_a_collective_and_the_hung_one_both_answer(ranks: list[Target], tmp_path: Path) -> None:
    await _wait_steps(ranks, 3)  # the fault fires at step 4 and rank 0 then waits in all_reduce
    await anyio.sleep(1.0)
    results = await FlightRecorderActor(FlightRecorderConfig(timeout_s=5.0)).collect_all(_opened(tmp_path), ranks, artifact_dir=tmp_path)
    last = {r.attributes["servewatch.flightrec.rank"]: r.attributes["servewatch.flightrec.last_enqueued"] for r in results}
    assert all(r.outcome is Outcome.OK for r in results)
    assert last[0] == last[1] + 1  # rank 0 entered the all_reduce rank 1 never reached


async def test_control_socket_is_the_fallback_without_the_worker_server(ranks: list[Target], tmp_path: Path) -> None:
    await _wait_steps(ranks, 1)
    worker_path(ranks[0].pid).unlink()
    [r] = await FlightRecorderActor(FlightRecorderConfig(timeout_s=5.0)).collect_all(_opened(tmp_path), ranks[:1], artifact_dir=tmp_path)
    assert r.outcome is Outcome.OK, r.detail
    assert r.attributes["servewatch.flightrec.source"] == "sdk_control"
    doc = json.loads(Path(r.artifact_paths[0]).read_text())
    assert doc["trace"]["servewatch"]["rank"] == 0 and doc["trace"]["servewatch"]["world_size"] == 2


@pytest.mark.parametrize("ranks", [(["--no-sdk", "--debug-server"], "none")], indirect=True)
async def test_torch_debug_server_is_found_on_the_targets_tcp_ports(ranks: list[Target], tmp_path: Path) -> None:
    await anyio.sleep(1.0)
    [r] = await FlightRecorderActor(FlightRecorderConfig(timeout_s=5.0)).collect_all(_opened(tmp_path), ranks[1:], artifact_dir=tmp_path)
    assert r.outcome is Outcome.OK, r.detail
    assert r.attributes["servewatch.flightrec.source"] == "debug_server"
    assert r.attributes["servewatch.flightrec.rank"] == 1  # from the title: no SDK here
    assert r.detail.startswith(f"{r.attributes['servewatch.flightrec.entries']} entries via debug_server, port ")


@pytest.mark.parametrize("ranks", [(["--no-sdk"], "none")], indirect=True)
async def test_no_source_is_an_outcome_not_an_error(ranks: list[Target], tmp_path: Path) -> None:
    [r] = await FlightRecorderActor().collect_all(_opened(tmp_path), ranks[:1], artifact_dir=tmp_path)
    assert r.outcome is Outcome.NO_SOURCE and not r.artifact_paths
    assert r.detail == "not available: no SDK socket, torch debug server or armed NCCL pipe"


@pytest.mark.parametrize("ranks", [(["--fr-buffer", "0"], "none")], indirect=True)
async def test_recorder_sized_zero_is_not_enabled(ranks: list[Target], tmp_path: Path) -> None:
    await _wait_steps(ranks, 1)
    [r] = await FlightRecorderActor().collect_all(_opened(tmp_path), ranks[:1], artifact_dir=tmp_path)
    assert r.outcome is Outcome.NOT_ENABLED, r.detail
    assert "TORCH_FR_BUFFER_SIZE" in r.detail


async def test_a_worker_socket_that_never_answers_times_out(tmp_path: Path, spawn) -> None:
    proc = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    from agent.sdk.folders import own_dir

    own_dir(tmp_path)  # the target's user (ours) has its private SDK folder there
    path = worker_path(proc.pid, tmp_path)
    silent.bind(str(path))
    silent.listen(1)  # accepts into the backlog, never replies
    try:
        cfg = FlightRecorderConfig(timeout_s=0.5, socket_dir=tmp_path, debug_server=False)
        with anyio.fail_after(10):
            [r] = await FlightRecorderActor(cfg).collect_all(_opened(tmp_path), [Target(pid=proc.pid)], artifact_dir=tmp_path)
    finally:
        silent.close()
    assert r.outcome is Outcome.TIMED_OUT and r.retryable
    assert r.detail == "no Flight Recorder dump within 0.5s, 2 tries (waiting on: sdk_worker, sdk_worker)", r.detail
    assert r.duration_s < 5


def _worker_answering_the_second_try(path: Path, body: bytes) -> tuple[socket.socket, list[socket.socket]]:
    """A worker socket that leaves its first connection unanswered (a loaded host) and answers
    the next one with ``body`` (HTTP 200); its thread ends with the listener."""
    import threading

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    held: list[socket.socket] = []

    def serve() -> None:
        try:
            held.append(listener.accept()[0])  # never answered
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (len(body), body))

    threading.Thread(target=serve, daemon=True).start()
    return listener, held


async def test_a_read_that_runs_out_of_time_is_tried_once_more_and_a_late_answer_counts(tmp_path: Path, spawn) -> None:
    """At load 20-30 the worker server answered, just late: one more try reads it (before: one
    try, `timed_out (tried: -)`, and the verdict lost the recorder)."""
    proc = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    from agent.sdk.folders import own_dir

    own_dir(tmp_path)
    body = json.dumps({"version": "2.4", "pg_status": {"0": {"last_enqueued_collective": 3}}, "entries": []}).encode()
    listener, held = _worker_answering_the_second_try(worker_path(proc.pid, tmp_path), body)
    try:
        cfg = FlightRecorderConfig(timeout_s=0.5, socket_dir=tmp_path, debug_server=False, nccl_pipe=False)
        with anyio.fail_after(10):
            [r] = await FlightRecorderActor(cfg).collect_all(_opened(tmp_path), [Target(pid=proc.pid)], artifact_dir=tmp_path)
    finally:
        listener.close()
        for conn in held:
            conn.close()
    assert (r.outcome, r.attributes["servewatch.flightrec.source"]) == (Outcome.OK, "sdk_worker"), r.detail


async def test_the_read_budget_scales_with_the_recorder_the_rank_was_asked_to_keep(tmp_path: Path, spawn) -> None:
    """A rank that keeps 4x the default recorder (TORCH_FR_BUFFER_SIZE=8000) gets 4x the budget."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
    large = spawn([sys.executable, "-c", "import time; time.sleep(60)"], env={**env, "TORCH_FR_BUFFER_SIZE": "8000"})
    default = spawn([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    actor = FlightRecorderActor(FlightRecorderConfig(timeout_s=0.25, socket_dir=tmp_path))
    assert (actor._budget_s(large.pid, 0.25), actor._budget_s(default.pid, 0.25)) == (1.0, 0.25)


async def test_nccl_debug_info_pipe_is_triggered_and_its_pickle_read_safely(tmp_path: Path, spawn) -> None:
    env = dict(os.environ, RANK="3", TORCH_NCCL_DEBUG_INFO_PIPE_FILE=str(tmp_path / "pipe_"),
               TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(tmp_path / "trace_"))
    import subprocess

    proc = spawn([sys.executable, str(PROGRAMS / "fake_nccl_watchdog.py")], env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"READY")
    cfg = FlightRecorderConfig(timeout_s=10.0, socket_dir=tmp_path / "nosockets", debug_server=False)
    [r] = await FlightRecorderActor(cfg, environ_of=lambda pid: env).collect_all(
        _opened(tmp_path), [Target(pid=proc.pid, title="x")], artifact_dir=tmp_path)
    assert r.outcome is Outcome.OK, r.detail
    assert r.attributes["servewatch.flightrec.source"] == "nccl_pipe"
    assert r.attributes["servewatch.flightrec.rank"] == 3  # RANK from the environment
    assert r.attributes["servewatch.flightrec.rank_source"] == "environ"
    assert (r.attributes["servewatch.flightrec.last_enqueued"], r.attributes["servewatch.flightrec.last_completed"]) == (2, 2)
    assert r.attributes["servewatch.flightrec.last_op"] == "gloo:all_reduce #2"  # torch's own pickle, read safely


def test_flight_recorder_env_keeps_the_users_value_and_title_ranks() -> None:
    assert flight_recorder_env({}) == ({"TORCH_FR_BUFFER_SIZE": "2000"}, {})
    assert flight_recorder_env({"TORCH_FR_BUFFER_SIZE": "7"}) == ({}, {"TORCH_FR_BUFFER_SIZE": "7"})
    assert [rank_from_title(t) for t in ("sglang::scheduler_DP0_TP3", "sglang::scheduler_TP1_EP0", "demo::main")] == [3, 1, None]


async def test_a_worker_socket_of_another_user_is_not_trusted(tmp_path: Path, spawn) -> None:
    import shutil
    import subprocess
    import time

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to create a socket as uid 65534")
    import tempfile

    target = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    shared = Path(tempfile.mkdtemp(prefix="sw-fr-nobody-", dir="/tmp"))  # reachable by uid 65534
    shared.chmod(0o777)
    try:
        path = shared / "servewatch-0" / f"servewatch-torch.{target.pid}.sock"  # in root's SDK folder name, taken first
        code = (f"import os, socket, time; os.mkdir({str(path.parent)!r}, 0o777); s = socket.socket(socket.AF_UNIX);"
                f" s.bind({str(path)!r}); s.listen(1); time.sleep(60)")
        spawn(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c", code],
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline, "the other user's socket did not appear"
            await anyio.sleep(0.05)
        assert path.stat().st_uid == 65534
        cfg = FlightRecorderConfig(timeout_s=2.0, socket_dir=shared, debug_server=False)
        [r] = await FlightRecorderActor(cfg).collect_all(_opened(tmp_path), [Target(pid=target.pid)], artifact_dir=tmp_path)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert r.outcome is Outcome.NO_SOURCE  # never looked for through another user's folder


async def test_dump_with_pyspy_off_counts_no_errors_and_the_verdict_says_what_the_recorders_held(
        ranks: list[Target], tmp_path: Path) -> None:
    """``SERVEWATCH_PYSPY__ENABLED=false servewatch dump`` of two real gloo ranks: the skipped py-spy
    rows are no errors, and an inconclusive verdict never says "no Flight Recorder" when it read them."""
    import subprocess

    await _wait_steps(ranks, 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_PYSPY__ENABLED="false", SERVEWATCH_COREDUMP__ENABLED="false",
               SERVEWATCH_SHM_DIR=os.environ.get("SERVEWATCH_SHM_DIR", "/dev/shm"))
    argv = [sys.executable, "-m", "agent.cli.app", "dump", "--data-dir", str(tmp_path / "data"),
            *(a for t in ranks for a in ("--pid", str(t.pid)))]
    r = await anyio.to_thread.run_sync(lambda: subprocess.run(argv, capture_output=True, text=True, timeout=110,
                                                              cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, check=False))
    (manifest_path,) = (tmp_path / "data").glob("*/*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    outcomes = sorted((a["action"], a["outcome"]) for a in manifest["actions"] if a["action"] in ("pyspy.dump", ACTION))
    assert outcomes == [(ACTION, "ok"), (ACTION, "ok"), ("pyspy.dump", "skipped"), ("pyspy.dump", "skipped")], r.stderr
    text = r.stdout + r.stderr
    assert "Processes: 2 Skipped: 2 Errors: 0" in text, text
    verdict = manifest["verdict"]
    assert "no Flight Recorder" not in verdict["reason"], verdict
    if verdict["kind"] == "unknown":  # healthy ranks may step on: then "progressing", which is fine too
        assert "the Flight Recorders show no rank behind and no mismatch and no stacks" in verdict["reason"], verdict


_WATCH_THEN_OPEN = r"""
import json, sys, time
import anyio
from agent.runtime.settings import load_settings
from agent.runtime.agent import Agent
from agent.host.targets import Target
from agent.verdict import judge as judge_mod

a, b, data = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = {}

async def main() -> None:
    agent = Agent(load_settings({"data_dir": data, "target": {"pids": [a, b]}, "export": {"metrics": False}}))
    out["actors"] = sorted(agent.actors)
    async with anyio.create_task_group() as tg:
        await tg.start(agent.run)
        await anyio.sleep(1.5)  # the old start-up warm-up had begun importing torch by now
        out["watching"] = "torch" in sys.modules
        agent.incidents.judge.opened([Target(pid=a)])  # one process: no cross-rank comparison
        out["one_target"] = "torch" in sys.modules or judge_mod._warm_up_thread is not None
        agent.incidents.judge.opened([Target(pid=a), Target(pid=b)])
        thread = judge_mod.warm_up_analyzer()
        await anyio.to_thread.run_sync(thread.join, 90)
        out["two_targets"] = "torch.distributed.flight_recorder.components.types" in sys.modules
        agent.stop()
    print(json.dumps(out))

anyio.run(main)
"""


def test_a_watching_agent_never_imports_torch_and_a_multi_rank_incident_loads_the_analyzer(
        tmp_path: Path, spawn, python: str) -> None:
    """A real agent watching two processes with the Flight Recorder actor on: torch stays out of
    the agent (about 200 MB of RSS); an incident over both starts importing torch's analyzer for
    the verdict, a one-process incident does not."""
    import subprocess

    pytest.importorskip("torch.distributed.flight_recorder.components.types")
    a = spawn([python, "-c", "import time; time.sleep(120)"])
    b = spawn([python, "-c", "import time; time.sleep(120)"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env["SERVEWATCH_SHM_DIR"] = os.environ.get("SERVEWATCH_SHM_DIR", "/dev/shm")
    r = subprocess.run([python, "-c", _WATCH_THEN_OPEN, str(a.pid), str(b.pid), str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=110, cwd=tmp_path, env=env,
                       stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "flightrec" in out["actors"], out
    assert out == {"actors": out["actors"], "watching": False, "one_target": False, "two_targets": True}, r.stderr


async def test_the_rank_is_what_the_process_says_and_its_title_only_when_it_alone_names_one(tmp_path: Path, spawn) -> None:
    """No SDK, no recorder source: ``RANK`` in the environment first (a vLLM-on-Ray worker titled
    ``ray::RayWorkerWrapper``); else the title alone (``_TP1``); never a guess for
    ``Worker_PP1_TP0`` (rank 2 at TP=2: the judge reads it from all the server's titles)."""
    proc = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    cfg = FlightRecorderConfig(timeout_s=2.0, socket_dir=tmp_path / "nosockets", debug_server=False, nccl_pipe=False)
    envs = {"ray::RayWorkerWrapper": {"RANK": "2", "WORLD_SIZE": "4"}, "VLLM::Worker_TP1": {}, "VLLM::Worker_PP1_TP0": {}}
    got = {}
    for title, env in envs.items():
        [r] = await FlightRecorderActor(cfg, environ_of=lambda pid, env=env: env).collect_all(
            _opened(tmp_path), [Target(pid=proc.pid, title=title)], artifact_dir=tmp_path)
        got[title] = (r.outcome, r.attributes.get("servewatch.flightrec.rank"), r.attributes.get("servewatch.flightrec.rank_source"))
    assert got == {"ray::RayWorkerWrapper": (Outcome.NO_SOURCE, 2, "environ"),
                   "VLLM::Worker_TP1": (Outcome.NO_SOURCE, 1, "title"),
                   "VLLM::Worker_PP1_TP0": (Outcome.NO_SOURCE, None, None)}
