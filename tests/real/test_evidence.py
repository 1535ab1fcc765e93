"""Evidence servewatch gathers from a real vLLM server: the Flight Recorder step asks only a real
debug endpoint (issue 21 item 7), ``profile --pid <worker>`` points at the server's HTTP port, not
a gloo port (item 8), and a SIGSTOPped EngineCore is dumped with ``py-spy --nonblocking`` and said
to be stopped (item 12)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anyio

from agent.actors.flightrec import FlightRecorderActor, FlightRecorderConfig
from agent.actors.pyspy import PySpyActor
from agent.host.targets import ProcessState, discover, process_state
from agent.model.events import IncidentOpened, Outcome, Trigger, now_ns
from tests.real.server import VllmServer


def _opened() -> IncidentOpened:
    return IncidentOpened(time_unix_nano=now_ns(), source="test", incident_id="inc-real", trigger=Trigger.MANUAL, trace_id="0" * 32, span_id="0" * 16)


def test_profile_pid_of_a_vllm_worker_suggests_the_servers_http_port(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    (worker,) = vllm_tp1.workers()
    assert any(c.status == "LISTEN" and c.laddr.port != vllm_tp1.port for c in worker.net_connections(kind="tcp"))
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli.entry", "profile", "--pid", str(worker.pid), "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"is a vLLM process without the SDK: profile it with --url {vllm_tp1.url}" in proc.stderr, proc.stderr


async def test_a_sigstopped_engine_core_is_dumped_nonblocking_and_said_stopped(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    core = vllm_tp1.engine_core()
    vllm_tp1.sigstop(core)  # SIGCONT at the test's end (the fixture)
    deadline = time.monotonic() + 10
    while process_state(core.pid) is not ProcessState.STOPPED:
        assert time.monotonic() < deadline
        await anyio.sleep(0.05)
    (target,) = discover(pids=[core.pid])
    result = await PySpyActor().act(_opened(), target, timeout_s=30, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert result.detail.startswith(f"pid {core.pid} is stopped (state T: SIGSTOP or a debugger")
    assert result.attributes["servewatch.pyspy.target_stopped"] is True
    assert result.attributes["servewatch.pyspy.nonblocking"] is True
    stacks = Path(result.artifact_paths[0]).with_suffix(".txt").read_text()
    assert "VLLM::EngineCore" in stacks and "vllm/v1/engine/core.py" in stacks
    assert process_state(core.pid) is ProcessState.STOPPED  # left as the operator left it


async def test_flight_recorder_on_vllm_workers_is_not_available_not_an_error(vllm_tp2: VllmServer, tmp_path: Path) -> None:
    workers = vllm_tp2.workers()
    listening = [len([c for c in w.net_connections(kind="tcp") if c.status == "LISTEN"]) for w in workers]
    assert min(listening) >= 2  # gloo's ports: what used to be POSTed to
    targets = discover(pids=[w.pid for w in workers])
    actor = FlightRecorderActor(FlightRecorderConfig(timeout_s=2.0, socket_dir=tmp_path))
    results = await actor.collect_all(_opened(), targets, artifact_dir=tmp_path)
    assert [r.outcome for r in results] == [Outcome.NO_SOURCE, Outcome.NO_SOURCE], [r.detail for r in results]
    assert all(r.detail.startswith("not available:") for r in results)
