"""The Flight Recorder actor's NCCL paths on a real GPU (skipped without one).

* the NCCL debug-info pipe: ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` armed, no SDK: the actor writes to
  ``<stem><rank>.pipe``, NCCL's watchdog dumps the recorder (torch's pickle) to
  ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`` and the actor reads ``nccl:all_reduce`` entries;
* NCCL's Flight Recorder through the SDK's worker server (``fr_trace_json`` served by C++).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from agent.actors.flightrec import FlightRecorderActor, FlightRecorderConfig
from agent.host.targets import Target
from agent.model.events import IncidentOpened, Outcome

PROGRAM = str(Path(__file__).with_name("nccl_rank.py"))
ROOT = Path(__file__).resolve().parents[2]


def _nccl_usable() -> bool:
    try:
        probe = subprocess.run([sys.executable, PROGRAM, "--probe"], capture_output=True, timeout=180, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _nccl_usable(), reason="needs an NVIDIA GPU with torch's CUDA build and NCCL"),
]


def _start(spawn: Callable, tmp_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        RANK="0", WORLD_SIZE="1", TORCH_FR_BUFFER_SIZE="200", TORCH_NCCL_TRACE_BUFFER_SIZE="200",
        TORCH_NCCL_DEBUG_INFO_PIPE_FILE=str(tmp_path / "nccl_pipe_"),
        TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(tmp_path / "nccl_trace_rank_"),
        TORCH_FR_DUMP_TEMP_FILE=str(tmp_path / "nccl_trace_rank_"),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    proc = spawn([sys.executable, PROGRAM, "--init", f"file://{tmp_path / 'store'}", *extra], env=env,
                 stdout=subprocess.PIPE, cwd=str(tmp_path))
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"READY"), "NCCL rank did not start"
    return proc


async def test_nccl_debug_info_pipe_dumps_the_recorder(tmp_path: Path, spawn: Callable) -> None:
    proc = _start(spawn, tmp_path)
    cfg = FlightRecorderConfig(timeout_s=60.0, socket_dir=tmp_path / "no-sdk", debug_server=False)
    opened = IncidentOpened(incident_id="gpu-fr", trigger="manual", pids=(proc.pid,))
    with anyio.fail_after(120):
        [r] = await FlightRecorderActor(cfg).collect_all(opened, [Target(pid=proc.pid)], artifact_dir=tmp_path)
    assert r.outcome is Outcome.OK, r.detail
    assert r.attributes["servewatch.flightrec.source"] == "nccl_pipe"
    assert r.attributes["servewatch.flightrec.rank"] == 0
    assert str(r.attributes["servewatch.flightrec.last_op"]).startswith("nccl:all_reduce #")
    assert (tmp_path / "nccl_pipe_0.pipe").exists()


async def test_nccl_flight_recorder_through_the_sdk_worker_server(tmp_path: Path, spawn: Callable) -> None:
    proc = _start(spawn, tmp_path, "--sdk")
    cfg = FlightRecorderConfig(timeout_s=30.0, debug_server=False, nccl_pipe=False)
    opened = IncidentOpened(incident_id="gpu-fr2", trigger="manual", pids=(proc.pid,))
    with anyio.fail_after(60):
        [r] = await FlightRecorderActor(cfg).collect_all(opened, [Target(pid=proc.pid)], artifact_dir=tmp_path)
    assert r.outcome is Outcome.OK, r.detail
    assert r.attributes["servewatch.flightrec.source"] == "sdk_worker"
    assert r.attributes["servewatch.flightrec.entries"] >= 3
    assert str(r.attributes["servewatch.flightrec.last_op"]).startswith("nccl:all_reduce #")
