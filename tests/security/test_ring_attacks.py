"""Attacks through a server's span ring (issue 23, items 5 and 8): a local user's process the
agent watches writes a ring that speaks as the agent, or that claims 256 MiB of unread spans.

The attacker is a real nobody process using the SDK's public ring layout; the agent is the real
``servewatch run`` (root) shipping to a real OTLP receiver. The operator chose to watch that
user's server (``--uid 65534``): the agent must still not lend it its own voice or memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from agent.watchers.status import read_status_file, status_path
from tests.otlp_receiver import OtlpReceiver
from tests.security._attack import (
    NOBODY,
    NOBODY_PYTHON,
    REPO,
    needs_root,
    ready_line,
    run_as_nobody,
)

pytestmark = needs_root


@pytest.fixture
def receiver():
    r = OtlpReceiver().start()
    try:
        yield r
    finally:
        r.stop()


def _attacker(spawn: Callable, attack_programs: Path, shm: Path, *args: str) -> int:
    proc = run_as_nobody(spawn, ["env", f"PYTHONPATH={REPO}", NOBODY_PYTHON, str(attack_programs / "attack_span_ring.py"),
                                 "--dir", str(shm), *args])
    ready_line(proc)
    return proc.pid


def _run_agent(spawn: Callable, tmp_path: Path, shm: Path, pid: int, receiver: OtlpReceiver | None, seconds: float):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(shm), SERVEWATCH_COREDUMP__ENABLED="false", SERVEWATCH_HOST_NAME="node-a",
               SERVEWATCH_SPANS__POLL_INTERVAL_S="0.2")
    if receiver is not None:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    return spawn([sys.executable, "-m", "agent.cli.app", "run", "--pid", str(pid), "--uid", str(NOBODY), "--duration", str(seconds),
                  "--data-dir", str(tmp_path / "data")], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _spans_status(tmp_path: Path) -> str:
    status = read_status_file(status_path(tmp_path / "data", "node-a")).get("spans")
    return "" if status is None else f"{status.state.value}: {status.reason}"


@pytest.mark.slow
def test_a_ring_declaring_the_agents_service_name_is_refused(
    spawn: Callable, tmp_path: Path, shared_tmpfs: Path, attack_programs: Path, receiver: OtlpReceiver, host_files: Path
) -> None:
    pid = _attacker(spawn, attack_programs, shared_tmpfs, "--mode", "forge", "--service", "servewatch")
    agent = _run_agent(spawn, tmp_path, shared_tmpfs, pid, receiver, 4)
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err
    assert receiver.spans() == []  # nothing at all shipped under the agent's name
    assert "the agent's own" in _spans_status(tmp_path) and str(pid) in _spans_status(tmp_path)


@pytest.mark.slow
def test_spans_from_a_ring_carry_the_writers_identity_and_never_servewatchs_names(
    spawn: Callable, tmp_path: Path, shared_tmpfs: Path, attack_programs: Path, receiver: OtlpReceiver, host_files: Path
) -> None:
    pid = _attacker(spawn, attack_programs, shared_tmpfs, "--mode", "forge", "--service", "tiny-llm")
    agent = _run_agent(spawn, tmp_path, shared_tmpfs, pid, receiver, 4)
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err
    assert receiver.wait_for_spans(1, timeout_s=10)
    time.sleep(0.5)
    got = receiver.spans()
    assert [s.name for s in got] == ["request"]  # incident, pyspy.dump and the servewatch.* / service.name ones refused
    [span] = got
    assert span.resource["service.name"] == "tiny-llm"
    assert span.resource["process.pid"] == pid and span.resource["process.user.id"] == NOBODY  # what the agent saw
    assert span.resource["host.name"] == "node-a"
    assert not [k for k in span.resource if k.startswith("servewatch")]
    assert f"4 span record(s) from pid {pid} refused" in err.decode()


@pytest.mark.slow
def test_a_huge_sparse_ring_claiming_to_be_full_costs_the_agent_no_memory(
    spawn: Callable, tmp_path: Path, shared_tmpfs: Path, attack_programs: Path, host_files: Path
) -> None:
    pid = _attacker(spawn, attack_programs, shared_tmpfs, "--mode", "huge")
    agent = _run_agent(spawn, tmp_path, shared_tmpfs, pid, None, 6)
    peak = 0
    proc = psutil.Process(agent.pid)
    while agent.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err
    print(f"agent peak RSS with a 256 MiB ring: {peak / 2**20:.0f} MiB")
    assert peak < 200 * 2**20, f"agent RSS reached {peak / 2**20:.0f} MiB"
    assert "more than the agent accepts" in _spans_status(tmp_path)
