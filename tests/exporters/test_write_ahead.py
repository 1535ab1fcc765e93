"""Write-ahead: a SIGKILL at any moment of an incident, with a black-hole collector and a 10 s
export timeout, loses no span of a finished action; the next agent delivers them all once.

The target (``tests/programs/incident_spans.py``) runs the real pipeline and prints ``done k``
right after action ``k`` is mirrored; we kill it at a random moment, read its spool, then let a
new processor replay that spool to a real receiver.
"""

from __future__ import annotations

import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporters.otlp_json import iter_span_files, read_span_file
from exporters.processor import LosslessSpanProcessor
from exporters.spool import Spool
from exporters.transport import make_sender
from tests.otlp_receiver import OtlpReceiver

REPO = Path(__file__).resolve().parents[2]
ACTIONS = 12
KILLS = 20


@pytest.fixture(scope="module")
def black_hole() -> Iterator[str]:
    """A TCP port that accepts connections (kernel backlog) and never answers: requests hang."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _spooled_names(spool_root: Path) -> list[str]:
    names = []
    for path in iter_span_files([spool_root]):
        if "rejected" in path.parts:
            continue
        for request in read_span_file(path):
            names.extend(s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
    return names


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("run", range(KILLS // 2))
def test_sigkill_at_a_random_moment_loses_no_finished_action(
    black_hole: str, otlp_receiver: OtlpReceiver, protocol: str, run: int, tmp_path: Path
) -> None:
    rng = random.Random(1000 + run * 7 + len(protocol))
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": black_hole,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_TIMEOUT": "10000",  # 10 s: longer than the whole incident
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.programs.incident_spans", str(tmp_path), str(ACTIONS)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while "ready" not in lines and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                lines.append(proc.stdout.readline().strip())
        assert "ready" in lines, "the target did not start"
        # kill anywhere from the incident's start to the middle of the (black-holed) shutdown
        kill_at = time.monotonic() + rng.uniform(0.0, 1.2)
        while time.monotonic() < kill_at:
            if select.select([proc.stdout], [], [], max(0.0, kill_at - time.monotonic()))[0]:
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line.strip())
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # what it printed before dying (already in the pipe)
        rest = proc.stdout.read()
        lines.extend(x.strip() for x in rest.splitlines())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    finished = {f"action.{line.split()[1]}" for line in lines if line.startswith("done ")}
    spool_root = tmp_path / "h" / "spool"
    on_disk = _spooled_names(spool_root) if spool_root.exists() else []
    assert finished <= set(on_disk), f"lost finished actions: {sorted(finished - set(on_disk))}"
    if "closed" in lines:
        assert "incident" in on_disk
    # the next agent delivers every one of them exactly once
    if not on_disk:
        return
    processor = LosslessSpanProcessor(make_sender(otlp_receiver.endpoint(protocol), protocol), spool=Spool(spool_root, max_bytes=1 << 30))
    try:
        assert processor.flush(30.0) is True
    finally:
        processor.shutdown(3.0)
    received = [s.name for s in otlp_receiver.spans()]
    assert sorted(n for n in received if n.startswith("action.")) == sorted(n for n in on_disk if n.startswith("action."))
    assert finished <= set(received)
