"""A real user-triggered CUDA coredump through the same code path as production (needs a GPU).

arm the environment (cuda_coredump_env) -> start a small CUDA process -> CoredumpActor finds the
driver's FIFO in /proc -> writes the trigger -> waits for the core file -> file is non-empty.
Skipped where no NVIDIA GPU with a working driver is present.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from agent.actors.coredump import CoredumpActor, CoredumpConfig, locate_pipe
from agent.host.cudaenv import cuda_coredump_env
from agent.host.targets import Target
from agent.model.events import IncidentOpened, Outcome

TARGET = str(Path(__file__).with_name("cuda_target.py"))


def _cuda_usable() -> bool:
    try:
        probe = subprocess.run([sys.executable, TARGET, "--probe"], capture_output=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _cuda_usable(), reason="needs an NVIDIA GPU with a working CUDA driver (libcuda.so.1)"),
]


async def test_real_user_triggered_coredump(tmp_path: Path, spawn: Callable) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_COREDUMP")}
    base["CUDA_COREDUMP_PIPE"] = str(tmp_path / "corepipe.cuda.%h.%p")
    plan = cuda_coredump_env(tmp_path / "crash", base)
    ready = tmp_path / "ready"
    proc = spawn([sys.executable, TARGET, "--ready-file", str(ready)], env=dict(plan.env), cwd=str(tmp_path))
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, "CUDA target exited before it was ready"
        assert time.monotonic() < deadline, "CUDA target not ready in 120 s"
        await anyio.sleep(0.1)
    location = locate_pipe(proc.pid)
    assert location.path is not None, location.reason
    actor = CoredumpActor(CoredumpConfig(folder=tmp_path / "crash", min_free_bytes=0, completion_timeout_s=240))
    opened = IncidentOpened(incident_id="gpu-1", trigger="manual", pids=(proc.pid,))
    with anyio.fail_after(300):
        [result] = await actor.trigger_all(opened, [Target(pid=proc.pid)], artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    core = Path(str(result.attributes["servewatch.coredump.path"]))
    assert core.parent == tmp_path / "crash" / socket.gethostname()
    assert core.stat().st_size > 0
    assert core.stat().st_size == result.attributes["servewatch.coredump.size_bytes"]
