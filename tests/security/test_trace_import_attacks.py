"""Issue 34 item 1: no trace file a watched server writes can wedge the root agent.

The attacker is a real other uid (``nobody``, through ``setpriv``) serving a real SDK control
socket, like a profiled server: told to profile into the session folder the agent made and handed
to it, it writes there an unterminated 100 MB Chrome trace (``{"traceEvents":[{"name":"aaaa…``,
no closing quote), a 1 TiB *sparse* one (4 KiB of blocks) and a 200,000-deep nested array, and
reports them as its trace files. The real profiler actor (root) claims them; the real agent
(``Agent.run``: bus, span mirror, trace importer, OTLP export to a real receiver) mirrors the
session into an incident. Before the fix the import ran inside the mirror's worker, quadratic in
the unterminated string: every later span queued behind it for minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from agent.actors.profiler import ProfilerConfig, profile_once
from agent.model.events import ActionResult, IncidentClosed, IncidentOpened, Outcome, ProfileStopped
from agent.model.ids import new_span_id, new_trace_id, span_id_hex, trace_id_hex
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver_fixture
from tests.security._attack import AS_NOBODY, NOBODY, NOBODY_PYTHON, hostile_sdk_source, needs_root

pytestmark = needs_root

#: A profiled "server" run as nobody: answers the SDK's profile.start by writing hostile trace
#: files into the folder it is told to use.
_HOSTILE_WRITER = hostile_sdk_source("""
    hang = os.path.join(out, "hang.pt.trace.json")
    with open(hang, "w") as f:  # 100 MB, the string never closed
        f.write('{"traceEvents":[{"name":"')
        block = "a" * (1 << 20)
        for _ in range(100):
            f.write(block)
    sparse = os.path.join(out, "sparse.pt.trace.json")
    with open(sparse, "w") as f:
        f.write('{"traceEvents":[{"name":"')
    os.truncate(sparse, 1 << 40)  # 1 TiB apparent, one block written
    deep = os.path.join(out, "deep.pt.trace.json")
    with open(deep, "w") as f:
        f.write('{"traceEvents":' + "[" * 200000 + "]" * 200000 + "}")
    files = [hang, sparse, deep]
""")


@pytest.fixture
def otlp_receiver():
    yield from otlp_receiver_fixture()


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A root-owned 0755 folder in /tmp nobody can pass through (pytest's tmp_path is closed to it)."""
    path = Path(tempfile.mkdtemp(prefix="sw-trace-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def _hostile_profile(spawn: Callable, tmp_path: Path) -> tuple[ActionResult, int]:
    """The real profiler actor against the hostile writer: its claimed trace files."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    template = str(shm / f"servewatch-{NOBODY}" / "servewatch-ctl.{pid}.sock")
    proc = spawn([*AS_NOBODY, NOBODY_PYTHON, "-c", _HOSTILE_WRITER, template], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
    config = ProfilerConfig(backend="sdk", socket_dir=shm, find_timeout_s=5, request_timeout_s=30)
    with anyio.fail_after(120):
        result = await profile_once(config, pid=proc.pid, steps=5, out_dir=tmp_path / "profiles", timeout_s=60)
    names = sorted(Path(p).name for p in result.artifact_paths)
    assert names == ["deep.pt.trace.json", "hang.pt.trace.json", "sparse.pt.trace.json"], result
    sparse = next(Path(p) for p in result.artifact_paths if p.endswith("sparse.pt.trace.json"))
    st = sparse.stat()
    assert st.st_size == 1 << 40 and st.st_blocks * 512 <= 1 << 20  # really sparse: the writer paid a block
    return result, proc.pid


async def _incident(agent: Agent, *, profile: ActionResult | None, pid: int) -> tuple[str, str]:
    """One incident through the agent's own bus (as the incident manager publishes it): opened,
    optionally a profile session, closed. Returns its (trace id, root span id) in hex."""
    trace_id, span_id = trace_id_hex(new_trace_id()), span_id_hex(new_span_id())
    incident_id = f"inc-{span_id}"
    await agent.bus.publish(IncidentOpened(source="test", incident_id=incident_id, trigger="manual", pids=(pid,),
                                           trace_id=trace_id, span_id=span_id))
    if profile is not None:
        await agent.bus.publish(ProfileStopped(source="test", incident_id=incident_id, result=profile))
    await agent.bus.publish(IncidentClosed(source="test", incident_id=incident_id, trigger="manual", bundle_dir="",
                                           manifest_path=""))
    return trace_id, span_id


def _wait_for(receiver: OtlpReceiver, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float) -> list[ReceivedSpan]:
    """Poll the receiver (bounded) until ``predicate(spans)``; returns the spans seen last."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.spans()
        if predicate(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def _settings(tmp_path: Path, receiver: OtlpReceiver, pid: int):
    return load_settings({
        "data_dir": tmp_path / "data",
        "host_name": "node-a",
        "target": {"pids": [pid]},
        "coredump": {"enabled": False},
        "export": {"endpoint": receiver.endpoint("grpc"), "protocol": "grpc", "metrics": False},
    })


async def test_hostile_trace_files_never_delay_a_span_and_a_restart_skips_them(
    spawn: Callable, tmp_path: Path, public_dir: Path, otlp_receiver: OtlpReceiver
) -> None:
    result, pid = await _hostile_profile(spawn, public_dir)
    settings = _settings(tmp_path, otlp_receiver, pid)

    agent = Agent(settings)
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            first = await _incident(agent, profile=result, pid=pid)
            later = await _incident(agent, profile=None, pid=pid)
            # the later incident's root ships at its normal pace, whatever the import does (before
            # the fix it queued behind a minutes-long import of the unterminated trace)
            spans = await anyio.to_thread.run_sync(
                _wait_for, otlp_receiver, lambda s: any(x.span_id == later[1] for x in s), 30.0)
            assert any(s.span_id == later[1] and s.name == "incident" for s in spans)
            spans = await anyio.to_thread.run_sync(
                _wait_for, otlp_receiver, lambda s: any(x.name == "profile.trace_import" for x in s), 60.0)
            agent.stop()
    mirror = agent.exporters["mirror"]
    assert mirror.importer is not None and mirror.importer.statistics().imported == 1

    in_first = [s for s in otlp_receiver.spans() if s.trace_id == first[0]]
    [root] = [s for s in in_first if s.name == "incident"]
    [session] = [s for s in in_first if s.name == "profile.session"]
    assert session.parent_span_id == root.span_id
    assert session.attributes["servewatch.trace_import.state"] == "deferred"
    [imported] = [s for s in in_first if s.name == "profile.trace_import"]
    assert imported.parent_span_id == session.span_id
    assert imported.attributes["servewatch.trace_import.errors"] == 3
    assert imported.attributes["servewatch.trace_import.files"] == 0
    assert imported.attributes["servewatch.trace_import.skipped"] == 0
    assert imported.span.status.code == 2  # ERROR: the import failed, said on the span
    marks = sorted(json.loads(p.read_text())["reason"] for p in (tmp_path / "data" / "trace-imports").glob("*.json"))
    assert len(marks) == 3
    assert any("longer than 4.0 MiB" in m and "unterminated" in m for m in marks), marks  # the 100 MB string
    assert any("1.0 TiB (4.0 KiB allocated (sparse)) is over the 4.0 GiB cap" in m for m in marks), marks
    assert any("nested too deeply" in m for m in marks), marks

    # a restarted agent (the same data dir) handed the same session again, as recovery re-sends
    # an interrupted incident's actions: every file is skipped with its reason, none read again
    agent = Agent(settings)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            again = await _incident(agent, profile=result, pid=pid)
            await anyio.to_thread.run_sync(
                _wait_for, otlp_receiver,
                lambda s: any(x.name == "profile.trace_import" and x.trace_id == again[0] for x in s), 30.0)
            agent.stop()
    [skipped] = [s for s in otlp_receiver.spans() if s.trace_id == again[0] and s.name == "profile.trace_import"]
    assert skipped.attributes["servewatch.trace_import.skipped"] == 3
    assert skipped.attributes["servewatch.trace_import.errors"] == 0
    assert "skipped: an earlier import failed" in str(skipped.attributes["servewatch.trace_import.error"])


def _big_valid_trace(path: Path, events: int) -> None:
    """A valid torch-shaped trace of ``events`` tiny CPU ops (a legitimate file, only large)."""
    with open(path, "w") as f:
        f.write('{"schemaVersion":1,"traceEvents":[')
        row = '{"ph":"X","cat":"cpu_op","name":"aten::add","pid":1,"tid":1,"ts":%d.5,"dur":1.0,"args":{"External id":1}}'
        chunk = 10_000
        for base in range(0, events, chunk):
            f.write(",".join(row % (base + i) for i in range(chunk)))
            f.write("," if base + chunk < events else "")
        f.write('],"baseTimeNanoseconds":1700000000000000000}')


async def test_agent_stop_cancels_a_long_import_within_the_grace(tmp_path: Path, otlp_receiver: OtlpReceiver) -> None:
    trace = tmp_path / "big.pt.trace.json"
    _big_valid_trace(trace, 2_000_000)  # ~210 MB: seconds of import on this box
    os.chmod(trace, 0o600)
    result = ActionResult(action="profile.session", outcome=Outcome.OK, artifact_paths=(str(trace),))
    agent = Agent(_settings(tmp_path, otlp_receiver, os.getpid()))
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            first = await _incident(agent, profile=result, pid=os.getpid())
            importer = agent.exporters["mirror"].importer
            # stop as soon as the worker has taken the session (not after the incident's spans
            # reached the receiver: an export delay let a fast box finish the 210 MB import first)
            while importer._thread is None or tuple(importer.statistics()) != (0, 0, 0, 0):  # none queued, none ended
                await anyio.sleep(0.01)
            agent.stop()  # the import of 210 MB is still running: cut within the mirror's grace
    assert importer.statistics().cancelled == 1, importer.statistics()
    await anyio.to_thread.run_sync(_wait_for, otlp_receiver, lambda s: any(x.span_id == first[1] for x in s), 10.0)
    assert any(x.span_id == first[1] for x in otlp_receiver.spans())  # the incident was shipped whole
    assert importer._thread is not None and not importer._thread.is_alive()  # stopped, not left behind
    spans = await anyio.to_thread.run_sync(
        _wait_for, otlp_receiver, lambda s: any(x.name == "profile.trace_import" for x in s), 10.0)
    [imported] = [s for s in spans if s.name == "profile.trace_import"]
    assert imported.attributes["servewatch.trace_import.cancelled"] is True
    assert "import cancelled (the agent is stopping)" in str(imported.attributes["servewatch.trace_import.error"])
