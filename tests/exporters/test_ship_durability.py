"""Span shipping survives a SIGKILLed agent: a real SDK server, real `servewatch run` processes.

Every span the server records is in the span files (or the OTLP receiver), or counted as
dropped by the server; duplicates are allowed (a span exported just before the kill, whose ring
record was not yet released, is shipped again by the next agent), loss is not.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agent.watchers.status import WatcherState, read_status_file, status_path
from exporters.otlp.provider import ExportConfig, build_telemetry
from exporters.otlp.shipper import SpanShipper
from tests.conftest import PROGRAMS_DIR
from tests.otlp_receiver import OtlpReceiver, attr_value
from tests.sdk._helpers import read_line
from tests.spanfiles import file_spans

SPAN_SERVER = str(PROGRAMS_DIR / "span_server.py")
CLI = [sys.executable, "-m", "agent.cli.app"]
REPO = str(PROGRAMS_DIR.parent.parent)
HOST = "ship-host"


def _server(spawn, shm: Path, fallback: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "OTEL_SERVICE_NAME": "tiny-llm", "PYTHONPATH": REPO,
           "SERVEWATCH_SPAN_FALLBACK": fallback}
    proc = spawn([sys.executable, SPAN_SERVER, "--paused", "--max-lifetime-s", "110"], env=env,
                 stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    assert read_line(proc).startswith("ready")
    return proc


def _say(proc: subprocess.Popen[bytes], line: str) -> str:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()
    return read_line(proc, timeout_s=60)


def _stats(proc: subprocess.Popen[bytes]) -> dict:
    return json.loads(_say(proc, "stats"))["channel"]


def _serve(proc: subprocess.Popen[bytes], n: int) -> None:
    assert _say(proc, f"serve {n}").startswith("served")


def _wait_attached(server: subprocess.Popen[bytes], attached: int, agent: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + 60
    while _stats(server)["attached"] != attached:
        assert agent is None or agent.poll() is None, agent.communicate(timeout=10)
        assert time.monotonic() < deadline, f"server never saw attached={attached}"
        time.sleep(0.1)


def _agent(spawn, tmp_path: Path, shm: Path, server_pid: int, endpoint: str | None,
           schedule_delay_s: float = 60.0) -> subprocess.Popen[str]:
    # partial batches wait up to 60 s in the agent's memory queue: a kill finds them there
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "SERVEWATCH_HOST_NAME": HOST, "PYTHONPATH": REPO,
           "SERVEWATCH_EXPORT__SCHEDULE_DELAY_S": str(schedule_delay_s)}
    argv = [*CLI, "run", "--pid", str(server_pid), "--data-dir", str(tmp_path / "data")]
    if endpoint:
        argv += ["--otlp-endpoint", endpoint, "--otlp-protocol", "http/protobuf"]
    return spawn(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _spans_status(tmp_path: Path) -> str:
    try:
        spans = read_status_file(status_path(tmp_path / "data", HOST)).get("spans")
    except (OSError, ValueError):
        return ""
    return spans.reason if spans is not None and spans.state is WatcherState.READY else ""


def _watching(tmp_path: Path) -> bool:
    """The agent's status file says it watches its target process (and its spans row is up)."""
    try:
        snap = read_status_file(status_path(tmp_path / "data", HOST))
    except (OSError, ValueError):
        return False
    process, spans = snap.get("process"), snap.get("spans")
    return process is not None and process.state is WatcherState.READY and spans is not None


def _wait_status(tmp_path: Path, agent: subprocess.Popen[str], want: str) -> None:
    deadline = time.monotonic() + 60
    while want not in _spans_status(tmp_path):
        assert agent.poll() is None and time.monotonic() < deadline, (want, _spans_status(tmp_path))
        time.sleep(0.1)


@pytest.mark.parametrize("sink", ["files", "otlp-http"])
def test_a_sigkilled_agent_loses_no_span_the_next_one_ships_or_counts_them(
    spawn, tmp_path: Path, sink: str, request: pytest.FixtureRequest
) -> None:
    receiver: OtlpReceiver | None = request.getfixturevalue("otlp_receiver") if sink == "otlp-http" else None
    endpoint = receiver.endpoint("http/protobuf") if receiver is not None else None
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    server = _server(spawn, shm, fallback="drop")
    first = _agent(spawn, tmp_path, shm, server.pid, endpoint)
    _wait_attached(server, 1, first)
    _serve(server, 25)
    _wait_status(tmp_path, first, ": 50 shipped;")
    # SIGKILL once the agent took all 50 spans from the ring: they wait in its memory queue
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    _serve(server, 10)  # the heartbeat is still fresh for ~2 s: these go to the ring, or are counted
    _wait_attached(server, 0)
    _serve(server, 10)  # nobody attached: counted dropped (no agent)
    no_agent = _stats(server)["dropped_no_agent"]
    second = _agent(spawn, tmp_path, shm, server.pid, endpoint)
    _wait_attached(server, 1, second)
    _serve(server, 15)
    before_stop = _stats(server)
    # the status line follows the counts (written when they change), server drops included
    _wait_status(tmp_path, second, f"no agent {before_stop['dropped_no_agent']},")
    second.send_signal(signal.SIGTERM)
    _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err[-3000:]
    # its first spans line already counts the drops from before it came
    first_line = next(x for x in err.splitlines() if "spans: shipping request spans" in x)
    assert f"no agent {no_agent}," in first_line and no_agent >= 20, first_line
    server_stats = _stats(server)

    if receiver is None:
        got = [(s["name"], s["attributes"].get("test.seq")) for s in file_spans(tmp_path / "data")
               if s["attributes"].get("test.seq") is not None]
    else:
        got = [(s.span.name, attr_value(a.value)) for s in receiver.spans() for a in s.span.attributes if a.key == "test.seq"]
    counts = Counter(got)
    recorded = 2 * 60
    assert server_stats["written"] + server_stats["dropped_no_agent"] + server_stats["dropped_full"] == recorded
    dropped = server_stats["dropped_no_agent"] + server_stats["dropped_full"] + server_stats["dropped_too_large"]
    # every recorded span arrived (some maybe twice) or was counted: none vanished
    assert len(counts) + dropped == recorded, (sorted(set(range(1, 61)) - {seq for _, seq in counts}), server_stats)
    assert dropped >= 20  # the 10 requests served with no agent attached
    # the 25 requests before the kill: every span is there
    assert all(counts[(name, seq)] >= 1 for seq in range(1, 26) for name in ("chat tiny", "forward"))
    assert server_stats["unread_bytes"] == 0  # the second agent released everything it shipped


def test_status_counts_fallback_spans_and_the_drops_before_the_agent_came(spawn, tmp_path: Path) -> None:
    """Spans sent to a no-op OTel fallback before any agent attached are shown beside the drops,
    from the first statistics on (the ring's counters are read at attach)."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    server = _server(spawn, shm, fallback="otel")
    _serve(server, 10)
    telemetry = build_telemetry(ExportConfig(metrics=False), data_dir=tmp_path / "data", host_name="h")
    shipper = SpanShipper(telemetry.processor, host_name="h", directory=shm)
    try:
        assert shipper.attach(server.pid, os.geteuid())
        line = shipper.statistics().line()
    finally:
        shipper.close()
        telemetry.shutdown(5)
    assert _stats(server)["fallback_spans"] == 20
    assert re.search(r": 0 shipped; dropped 0 \(.*\); fallback 20 \(sent to the server's own OTel path", line), line
    assert shipper.statistics().to_dict()["fallback_spans"] == 20


def test_the_first_requests_spans_reach_the_collector_while_an_agent_already_watches(
    spawn, tmp_path: Path, otlp_receiver: OtlpReceiver
) -> None:
    """A server whose first request is its first span (no ring before it), watched by an agent
    from the start: the first spans are not sent to the server's own (no-op) OTel path and lost;
    the SDK sees the agent that declares it watches this pid and holds them in the ring until the
    agent attaches, which it does at its next ring poll."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "OTEL_SERVICE_NAME": "tiny-llm", "PYTHONPATH": REPO,
           "SERVEWATCH_SPAN_FALLBACK": "otel"}
    server = spawn([sys.executable, SPAN_SERVER, "--paused", "--lazy-ring", "--max-lifetime-s", "110"], env=env,
                   stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    assert read_line(server).startswith("ready")
    agent = _agent(spawn, tmp_path, shm, server.pid, otlp_receiver.http_endpoint, schedule_delay_s=0.5)
    deadline = time.monotonic() + 60
    while not _watching(tmp_path):  # the agent watches the server, which has no ring yet
        assert agent.poll() is None, agent.communicate(timeout=10)
        assert time.monotonic() < deadline, "the agent never watched the server"
        time.sleep(0.1)
    assert not list(shm.glob("servewatch-spans.*"))
    _serve(server, 5)  # the first request creates the ring
    stats = _stats(server)
    assert otlp_receiver.wait_for_spans(10, timeout_s=60), (otlp_receiver.span_count, stats, _spans_status(tmp_path))
    assert stats["fallback_spans"] == 0 and stats["dropped_no_agent"] == 0, stats
    seqs = Counter(s.attributes.get("test.seq") for s in otlp_receiver.spans())
    assert seqs == Counter({i: 2 for i in range(1, 6)})  # request + forward span of each of the 5
