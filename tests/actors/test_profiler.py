"""agent.actors.profiler against real targets: the SDK model (tests/programs/profiled_model.py)
and a fake SGLang server running a real torch loop (tests/programs/fake_sglang_server.py)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pydantic
import pytest

from agent.actors.profiler import (
    ACTION,
    ProfilerActor,
    ProfilerConfig,
    find_new_files,
    profile_once,
    snapshot_dir,
)
from agent.host.sdkclient import read_inflight, sdk_call
from agent.host.targets import Target
from agent.model.events import IncidentOpened, Outcome
from exporters.mirror.torch_trace import import_torch_trace
from exporters.otlp.spans import InMemorySink, new_span_id, new_trace_id
from tests.sdk._helpers import ProgramLauncher, load_trace, profiler_steps


@pytest.fixture
def launch(spawn, python: str, tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], str]]]:
    launcher = ProgramLauncher(spawn, python, tmp_path / "shm")
    yield launcher.start
    launcher.close()


def _sdk_config(tmp_path: Path, **kw: Any) -> ProfilerConfig:
    kw.setdefault("activities", ("CPU",))
    return ProfilerConfig(backend="sdk", socket_dir=tmp_path / "shm", find_timeout_s=20, **kw)


def _opened(**kw: Any) -> IncidentOpened:
    return IncidentOpened(incident_id="inc-1", trigger="manual", **kw)


# --- sdk backend -------------------------------------------------------------------------------


async def test_sdk_session_captures_exactly_n_steps_and_imports(launch, tmp_path: Path) -> None:
    _proc, line = launch("profiled_model.py")
    pid = int(line.split()[1])
    out = tmp_path / "out"
    result = await profile_once(_sdk_config(tmp_path), pid=pid, steps=3, out_dir=out, timeout_s=30)
    assert result.action == ACTION and result.outcome is Outcome.OK, result.detail
    assert result.pid == pid
    a = result.attributes
    assert a["servewatch.profile.steps_captured"] == 3 and a["servewatch.profile.state"] == "completed"
    assert a["servewatch.profile.files"] == 1 and a["servewatch.profile.size_bytes"] > 0
    (path,) = result.artifact_paths
    assert Path(path).parent == out.resolve()
    assert profiler_steps(load_trace(path)) == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    # the trace becomes spans under the session span, inside the session's time window
    sink = InMemorySink()
    stats = import_torch_trace(path, sink, trace_id=new_trace_id(), parent_span_id=new_span_id())
    assert stats.profiler_steps == 3
    steps = [s for s in sink.spans if s.name.startswith("ProfilerStep#")]
    assert all(result.start_time_unix_nano <= s.start_time <= s.end_time <= result.end_time_unix_nano for s in steps)


async def test_sdk_pid_is_found_when_only_one_socket(launch, tmp_path: Path) -> None:
    launch("profiled_model.py")
    result = await profile_once(_sdk_config(tmp_path), steps=1, out_dir=tmp_path / "o", timeout_s=30)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.profile.steps_captured"] == 1


async def test_sdk_mlx_session_on_linux_says_no_metal_trace(launch, tmp_path: Path) -> None:
    mx = pytest.importorskip("mlx.core")
    if mx.metal.is_available():
        pytest.skip("covers hosts without Metal")
    _, line = launch("profiled_model.py")
    pid = int(line.split()[1])
    result = await profile_once(_sdk_config(tmp_path, sdk_profiler="mlx"), pid=pid, steps=2, out_dir=tmp_path / "m", timeout_s=30)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.profile.metal_trace_captured"] is False
    assert result.attributes["servewatch.profile.profiler"] == "mlx"
    assert "no Metal trace captured" in result.detail
    (path,) = result.artifact_paths
    assert path.endswith(".mlx-steps.json") and len(json.loads(Path(path).read_text())["steps"]) == 2


async def test_sdk_idle_target_times_out_with_zero_steps(launch, tmp_path: Path) -> None:
    _, line = launch("profiled_model.py", "--idle")
    pid = int(line.split()[1])
    result = await profile_once(_sdk_config(tmp_path), pid=pid, steps=3, out_dir=tmp_path / "o", timeout_s=0.5)
    assert result.outcome is Outcome.TIMED_OUT, result.detail
    assert result.attributes["servewatch.profile.steps_captured"] == 0
    assert result.attributes["servewatch.profile.state"] == "expired"
    assert "no profiler was started" in result.detail and result.artifact_paths == ()


async def test_sdk_busy_target_refuses_and_missing_socket_is_no_such_process(launch, tmp_path: Path) -> None:
    _, line = launch("profiled_model.py")
    pid = int(line.split()[1])
    cfg = _sdk_config(tmp_path)
    sock = ProfilerActor(cfg).socket_for(pid)
    (tmp_path / "x").mkdir(mode=0o700)  # a session folder's shape: existing, 0700, the server's uid
    (tmp_path / "x").chmod(0o700)
    reply = await sdk_call(sock, {"cmd": "profile.start", "num_steps": 100000, "activities": ["CPU"], "output_dir": str(tmp_path / "x")}, timeout_s=10)
    assert reply["ok"]
    try:
        result = await profile_once(cfg, pid=pid, steps=1, out_dir=tmp_path / "o", timeout_s=10)
        assert result.outcome is Outcome.REFUSED and result.retryable and "already" in result.detail
    finally:
        stop = await sdk_call(sock, {"cmd": "profile.stop"}, timeout_s=10)
        assert stop["status"] in ("stopping", "stopped")  # running, or still waiting for its first step
    gone = await profile_once(cfg, pid=1, steps=1, out_dir=tmp_path / "o", timeout_s=5)
    assert gone.outcome is Outcome.NO_SUCH_PROCESS and "serve_control" in gone.detail


async def test_incident_phase_profiles_sdk_targets_and_reads_inflight(launch, tmp_path: Path) -> None:
    _, line = launch("profiled_model.py")
    pid = int(line.split()[1])
    actor = ProfilerActor(_sdk_config(tmp_path, on_incident_steps=2))
    targets = [Target(pid=pid, title="model"), Target(pid=1, title="init")]
    results = await actor.profile_incident(_opened(), targets, artifact_dir=tmp_path / "bundle")
    assert [(r.pid, r.outcome) for r in results] == [(pid, Outcome.OK)]
    assert results[0].attributes["servewatch.profile.steps_captured"] == 2
    assert Path(results[0].artifact_paths[0]).parent == (tmp_path / "bundle").resolve()
    one = await actor.act(_opened(), targets[0], timeout_s=30, artifact_dir=tmp_path / "b2")
    assert one.outcome is Outcome.OK and one.attributes["servewatch.profile.steps_captured"] == 2
    skipped = await actor.profile_incident(_opened(), targets[1:], artifact_dir=tmp_path / "bundle")
    assert [r.outcome for r in skipped] == [Outcome.SKIPPED]
    inflight = await read_inflight(targets, socket_dir=tmp_path / "shm")
    assert inflight and {r.pid for r in inflight} == {pid}
    assert all(r.request_id.startswith("req-") and len(r.span_id) == 16 and r.age_s >= 0 for r in inflight)
    assert inflight[0].prompt_tokens == 8


# --- sglang / vllm backends --------------------------------------------------------------------


def _http_config(port: int, backend: str = "sglang", **kw: Any) -> ProfilerConfig:
    kw.setdefault("activities", ("CPU",))
    return ProfilerConfig(backend=backend, base_url=f"http://127.0.0.1:{port}", settle_s=0.3, find_timeout_s=20, **kw)


async def test_sglang_session_stops_itself_after_n_steps(launch, tmp_path: Path) -> None:
    _, line = launch("fake_sglang_server.py")
    port = json.loads(line)["port"]
    out = tmp_path / "traces"
    result = await profile_once(_http_config(port), steps=4, start_step=None, out_dir=out, timeout_s=30)
    assert result.outcome is Outcome.OK, result.detail
    # the stop is always sent (bounded); SGLang stopped itself after num_steps
    assert result.attributes["servewatch.profile.stop"] == "already_stopped"
    (path,) = result.artifact_paths
    assert path.endswith("-TP-0.trace.json.gz") and Path(path).name.startswith("servewatch-")
    assert len(profiler_steps(load_trace(path))) == 4


async def test_sglang_stop_after_auto_stop_is_already_stopped(launch, tmp_path: Path) -> None:
    # the export is slow, so the trace is not there by the deadline and the actor sends a stop,
    # which SGLang answers "Profiling is not in progress" (HTTP 500)
    # margins for a loaded machine: 2 profiled steps (profiler start included) must fit in 8 s,
    # and the trace must still be unpublished then (export delay 12 s)
    _, line = launch("fake_sglang_server.py", "--export-delay-s", "12")
    port = json.loads(line)["port"]
    result = await profile_once(_http_config(port), steps=2, out_dir=tmp_path / "t", timeout_s=8)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.profile.stop"] == "already_stopped"
    assert len(profiler_steps(load_trace(result.artifact_paths[0]))) == 2


async def test_sglang_busy_is_refused(launch, tmp_path: Path) -> None:
    _, line = launch("fake_sglang_server.py")
    port = json.loads(line)["port"]
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        r = await c.post("/start_profile", json={"output_dir": str(tmp_path / "x"), "activities": ["CPU"]})
        assert r.status_code == 200
        result = await profile_once(_http_config(port), steps=1, out_dir=tmp_path / "t", timeout_s=5)
        assert result.outcome is Outcome.REFUSED and "already in progress" in result.detail
        assert (await c.post("/stop_profile")).status_code == 200
        again = await c.post("/stop_profile")
        assert again.status_code == 500 and "not in progress" in again.text


async def test_server_without_profiling_is_unsupported(launch, tmp_path: Path) -> None:
    _, line = launch("fake_sglang_server.py", "--no-profile-endpoints")
    port = json.loads(line)["port"]
    result = await profile_once(_http_config(port, "vllm"), out_dir=tmp_path / "o", timeout_s=5)
    assert result.outcome is Outcome.UNSUPPORTED and "launched" in result.detail


# --- pieces ------------------------------------------------------------------------------------


async def test_find_new_files_waits_for_growth_to_stop_and_is_bounded(tmp_path: Path) -> None:
    (tmp_path / "old.trace.json").write_text("{}")
    before = snapshot_dir(tmp_path)
    assert await find_new_files(tmp_path, before, timeout_s=0.3, settle_s=0.1, poll_interval_s=0.05) == []
    new = tmp_path / "new.trace.json.gz"
    new.write_bytes(b"x" * 10)
    (tmp_path / "notes.txt").write_text("not a trace")
    found = await find_new_files(tmp_path, before, timeout_s=5, settle_s=0.1, poll_interval_s=0.05)
    assert found == [new]


def test_config_validates_and_defaults() -> None:
    cfg = ProfilerConfig()
    assert (cfg.backend, cfg.on_incident_steps, cfg.activities) == ("sdk", 0, ("CPU", "GPU"))
    assert ProfilerConfig(activities="cpu,mem").activities == ("CPU", "MEM")
    for bad in ({"backend": "tgi"}, {"activities": "tpu"}, {"num_steps": 0}, {"find_timeout_s": 0}, {"typo": 1}):
        with pytest.raises(pydantic.ValidationError):
            ProfilerConfig(**bad)


def test_the_stall_window_counts_busy_time_only_not_an_idle_spell_before_work_came(tmp_path: Path) -> None:
    """An idle server (last step long ago) that gets work is not stalled at once: the window
    starts when work is first seen pending; no step for the whole window is a stall; a step
    restarts it. A real counter file, written as the SDK writes it."""
    import os
    import time

    from agent.actors.profiler import _StallWatch
    from agent.sdk.counter import W_FORWARD_CT, W_LAST_STEP, W_PENDING, SharedCounter, counter_path

    counter = SharedCounter(counter_path(os.getpid(), tmp_path))
    try:
        words = counter.words
        words[W_FORWARD_CT], words[W_LAST_STEP], words[W_PENDING] = 7, time.monotonic_ns(), 0
        watch = _StallWatch(os.getpid(), tmp_path, window_s=1.0)
        assert not watch.stalled()  # idle
        time.sleep(1.5)  # idle for longer than the window
        words[W_PENDING] = 3  # a request arrives (the SDK's set_pending)
        busy_at = time.monotonic()
        assert not watch.stalled()  # the old rule saw a step 1.5 s old and said stalled here
        deadline = busy_at + 20
        while not watch.stalled():
            assert time.monotonic() < deadline, "never called stalled"
            time.sleep(0.05)
        assert time.monotonic() - busy_at >= 1.0  # a whole window of busy time, not less
        words[W_FORWARD_CT], words[W_LAST_STEP] = 8, time.monotonic_ns()  # a step: the window restarts
        assert not watch.stalled()
    finally:
        counter.close()


def test_a_trace_bundle_is_made_private_without_following_a_symlink_in_it(tmp_path: Path) -> None:
    """A Metal ``.gputrace`` is a folder: taken from the session folder, every file in it becomes
    0600 and every folder 0700, and a symlink inside (planted, or part of the bundle) never
    changes the file it points to."""
    import os
    import stat

    from agent.host.fsutil import SessionFolder

    outside = tmp_path / "outside.txt"
    outside.write_text("not ours to change")
    outside.chmod(0o644)
    folder = SessionFolder.create(tmp_path / "session")
    bundle = folder.path / "capture.gputrace"
    (bundle / "sub").mkdir(parents=True)
    (bundle / "sub" / "part.bin").write_bytes(b"x")
    (bundle / "index").write_bytes(b"y")
    for p in (bundle, bundle / "sub", bundle / "sub" / "part.bin", bundle / "index"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    os.symlink(outside, bundle / "link")
    single = folder.path / "trace.json"
    single.write_text("{}")
    single.chmod(0o644)
    claimed = folder.claim([bundle, single])
    assert claimed.paths == (str(bundle), str(single)) and claimed.size_bytes == 4
    assert claimed.ignored == (f"{bundle}/link: a symlink, never followed",)
    modes = {str(p.relative_to(folder.path)): stat.S_IMODE(p.stat().st_mode)
             for p in (bundle, bundle / "sub", bundle / "sub" / "part.bin", bundle / "index")}
    assert modes == {"capture.gputrace": 0o700, "capture.gputrace/sub": 0o700,
                     "capture.gputrace/sub/part.bin": 0o600, "capture.gputrace/index": 0o600}
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644
    assert stat.S_IMODE(single.stat().st_mode) == 0o600


async def test_sdk_never_starts_or_stops_a_profiler_the_server_is_running_itself(launch, tmp_path: Path) -> None:
    # the server's own torch.profiler runs (an always-on profile, SGLang's /start_profile): the
    # SDK refuses and leaves it alone; the server later stops it and exports its trace, alive
    own = tmp_path / "own.trace.json"
    proc, line = launch("profiled_model.py", "--own-profiler-steps", "400", "--own-trace", str(own), "--max-runtime-s", "60")
    pid = int(line.split()[1])
    assert proc.stdout is not None
    assert (await anyio.to_thread.run_sync(proc.stdout.readline)).decode().strip() == "OWN-PROFILING"
    result = await profile_once(_sdk_config(tmp_path), pid=pid, steps=2, out_dir=tmp_path / "out", timeout_s=20)
    assert result.outcome is Outcome.REFUSED, result.detail
    assert "the server is already profiling" in result.detail
    assert not result.artifact_paths
    with anyio.fail_after(60):
        said = (await anyio.to_thread.run_sync(proc.stdout.readline)).decode().strip()
    assert said == f"OWN-TRACE {own}" and proc.poll() is None  # its own stop and export worked
    assert '"traceEvents"' in own.read_text()
    # once its profiler is done, servewatch may profile
    after = await profile_once(_sdk_config(tmp_path), pid=pid, steps=2, out_dir=tmp_path / "out2", timeout_s=30)
    assert after.outcome is Outcome.OK, after.detail


async def test_a_session_by_url_is_recorded_for_the_server_listening_there_while_it_runs(launch, tmp_path: Path) -> None:
    """``servewatch profile --url`` (SGLang here; vLLM alike, which takes no engine step while it
    writes its trace) is an own action of the server's port and of the process listening on it
    (whose process group holds its engine and workers), for as long as the session runs: a
    running agent on the same data dir pauses that server's stall rule meanwhile."""
    from agent.host.ownactions import OwnActionLog

    _, line = launch("fake_sglang_server.py", "--export-delay-s", "2")
    info = json.loads(line)
    (tmp_path / "data" / "h").mkdir(parents=True)
    reader = OwnActionLog(tmp_path / "data", "h")
    seen: list[tuple[str, int | None, int | None]] = []

    async def watch() -> None:
        while not seen:
            seen.extend((a.kind, a.pid, a.port) for a in await anyio.to_thread.run_sync(reader.files))
            await anyio.sleep(0.05)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        result = await profile_once(_http_config(info["port"]), steps=2, out_dir=tmp_path / "t", timeout_s=30,
                                    own_actions=OwnActionLog(tmp_path / "data", "h"))
        tg.cancel_scope.cancel()
    assert result.outcome is Outcome.OK, result.detail
    assert seen[:1] == [("profile", info["pid"], info["port"])]
    assert reader.files() == []
