"""Evidence servewatch gathers from a real vLLM worker: the Flight Recorder step asks only a real
debug endpoint (issue 21 item 7), and ``profile --pid <worker>`` points at the server's HTTP port,
not a gloo port (item 8)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agent.actors.flightrec import FlightRecorderActor, FlightRecorderConfig
from agent.events import IncidentOpened, Outcome, Trigger, now_ns
from agent.targets import discover
from tests.real.server import VllmServer


def _opened() -> IncidentOpened:
    return IncidentOpened(time_unix_nano=now_ns(), source="test", incident_id="inc-real", trigger=Trigger.MANUAL, trace_id="0" * 32, span_id="0" * 16)


def test_profile_pid_of_a_vllm_worker_suggests_the_servers_http_port(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    (worker,) = vllm_tp1.workers()
    assert any(c.status == "LISTEN" and c.laddr.port != vllm_tp1.port for c in worker.net_connections(kind="tcp"))
    proc = subprocess.run(
        [sys.executable, "-m", "agent.entry", "profile", "--pid", str(worker.pid), "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"is a vLLM process without the SDK: profile it with --url {vllm_tp1.url}" in proc.stderr, proc.stderr


async def test_flight_recorder_on_vllm_workers_is_not_available_not_an_error(vllm_tp2: VllmServer, tmp_path: Path) -> None:
    workers = vllm_tp2.workers()
    listening = [len([c for c in w.net_connections(kind="tcp") if c.status == "LISTEN"]) for w in workers]
    assert min(listening) >= 2  # gloo's ports: what used to be POSTed to
    targets = discover(pids=[w.pid for w in workers])
    actor = FlightRecorderActor(FlightRecorderConfig(timeout_s=2.0, socket_dir=tmp_path))
    results = await actor.collect_all(_opened(), targets, artifact_dir=tmp_path)
    assert [r.outcome for r in results] == [Outcome.NO_SOURCE, Outcome.NO_SOURCE], [r.detail for r in results]
    assert all(r.detail.startswith("not available:") for r in results)
