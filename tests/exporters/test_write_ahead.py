"""Write-ahead: a SIGKILL at any moment of an incident, with a black-hole collector and a 10 s
export timeout, loses no span of a finished action; the next agent delivers them all once.

The target (``tests/programs/incident_spans.py``) runs the real pipeline and prints ``done k``
right after action ``k`` is mirrored; we kill it at a random moment, read its spool, then let a
new processor replay that spool to a real receiver.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporters.otlp.otlp_json import iter_span_files, read_span_file
from exporters.otlp.processor import LosslessSpanProcessor
from exporters.otlp.spool import Spool
from exporters.otlp.transport import make_sender
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


def _tracked_bundle(data_dir: Path, host: str, *, trace_id: str, root: str, actions: dict[str, str], dead_pid: int) -> Path:
    """A bundle as a killed agent leaves it: spans tracked, state open, the agent gone."""
    bundle = data_dir / host / "20261201T000000Z-stall-aaaaaa"
    bundle.mkdir(parents=True)
    t0 = time.time_ns() - 5 * 10**9
    (bundle / "manifest.json").write_text(json.dumps({
        "schema": "servewatch.incident/1", "incident_id": bundle.name, "trigger": "stall", "detail": "stuck",
        "trace_id": trace_id, "span_id": root, "opened_time_unix_nano": t0, "updated_time_unix_nano": t0 + 10**9,
        "targets": [{"pid": 7, "title": "sglang::scheduler_TP0"}], "state": "open", "agent_pid": dead_pid,
        "spans_tracked": True,
        "actions": [
            {"action": name, "pid": 7, "outcome": "ok", "start_time_unix_nano": t0, "end_time_unix_nano": t0 + 1000,
             "attributes": {"servewatch.test.list": [1, 2]}, "span_id": span_id}
            for name, span_id in actions.items()
        ],
    }))
    return bundle


def test_the_next_agent_resends_exactly_the_spans_that_never_became_durable(otlp_receiver: OtlpReceiver, tmp_path: Path) -> None:
    """Of an incident a killed agent left, the next one re-sends (same ids) the root and the
    actions that are neither in the spool nor recorded as delivered, and nothing else; then the
    bundle is marked, and a further start re-sends nothing."""
    import anyio

    from agent.incidents.manager import recover_interrupted
    from agent.model.bus import RecordingBus
    from agent.model.events import ActionCompleted, IncidentClosed, IncidentOpened
    from exporters.mirror.mirror import SpanMirror
    from exporters.otlp.provider import ExportConfig, build_telemetry
    from exporters.otlp.spans import build_span, span_id_hex
    from exporters.otlp.spool import DeliveredKeys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    trace_id, root = "ab" * 16, "0123456789abcdef"
    actions = {"pyspy.dump": "1111111111111111", "flightrec.dump": "2222222222222222", "cuda.coredump": "3333333333333333"}
    bundle = _tracked_bundle(tmp_path, "h1", trace_id=trace_id, root=root, actions=actions, dead_pid=int(dead.stdout))
    endpoint = otlp_receiver.grpc_endpoint
    otlp_receiver.stop()  # a spooled group stays in the spool
    telemetry = build_telemetry(ExportConfig(metrics=False), data_dir=tmp_path, host_name="h1",
                                environ={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    try:
        # pyspy.dump was written ahead (in the spool); flightrec.dump was delivered (its key recorded)
        spooled = build_span("pyspy.dump", trace_id=int(trace_id, 16), span_id=int(actions["pyspy.dump"], 16),
                             parent_span_id=int(root, 16), start_time_unix_nano=1, end_time_unix_nano=2)
        assert telemetry.processor.persist([spooled], key=actions["pyspy.dump"]) is True
        assert telemetry.spool_dir is not None
        DeliveredKeys(telemetry.spool_dir).add([actions["flightrec.dump"]])
        assert telemetry.durable_keys({root, *actions.values()}) == {actions["pyspy.dump"], actions["flightrec.dump"]}

        bus = RecordingBus()
        assert anyio.run(lambda: recover_interrupted(bus, tmp_path, "h1", durable=telemetry.durable_keys)) == [bundle.name]
        [opened] = bus.of_type(IncidentOpened)
        assert (opened.trace_id, opened.span_id) == (trace_id, root)
        resent = [e.result for e in bus.of_type(ActionCompleted)]
        assert [(r.action, r.span_id) for r in resent] == [("cuda.coredump", actions["cuda.coredump"])]
        assert resent[0].attributes["servewatch.test.list"] == (1, 2)
        [closed] = bus.of_type(IncidentClosed)
        assert closed.emit_root is True
        mirror = SpanMirror(telemetry.sink, host_name="h1")
        for event in bus.events:
            mirror.handle(event)
        assert (bundle / "spans.durable").is_file()
        otlp_receiver.start()
        assert telemetry.processor.flush(30.0) is True
    finally:
        telemetry.shutdown(3.0)
    got = Counter(s.span_id for s in otlp_receiver.spans())
    assert got == Counter({actions["pyspy.dump"]: 1, actions["cuda.coredump"]: 1, root: 1})
    assert {s.trace_id for s in otlp_receiver.spans()} == {trace_id}
    assert json.loads((bundle / "manifest.json").read_text())["state"] == "closed"
    again = RecordingBus()  # marked: the next start reads nothing to send
    assert anyio.run(lambda: recover_interrupted(again, tmp_path, "h1", durable=lambda keys, since: set())) == []
    assert not again.events
    assert span_id_hex(spooled.context.span_id) == actions["pyspy.dump"]
