"""cuda.coredump against the fake CUDA driver (tests/programs/fake_cuda_driver.py), real FIFOs.

Each target is a real process holding a real FIFO; the actor finds it through /proc, writes to it
and measures the core file the fake writes. Hang guards (``fail_after``) only stop a broken test;
no assertion is about speed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from agent.actors import coredump
from agent.actors.coredump import (
    CoredumpActor,
    CoredumpConfig,
    PipeLocation,
    locate_pipe,
    template_glob,
    trigger_pipe,
)
from agent.host.cudaenv import cuda_coredump_env
from agent.host.targets import Target
from agent.model.events import IncidentOpened, Outcome
from tests.conftest import PROGRAMS_DIR

FAKE = str(PROGRAMS_DIR / "fake_cuda_driver.py")
HOST = socket.gethostname()
CHUNKS, CHUNK_BYTES = 4, 32 * 1024
HANG_GUARD_S = 30

_FAST = {"settle_s": 0.2, "poll_interval_s": 0.02, "trigger_timeout_s": 2.0, "completion_timeout_s": 10.0}


def fast_config(tmp_path: Path, **overrides: object) -> CoredumpConfig:
    values: dict[str, object] = {"folder": tmp_path / "dumps", "min_free_bytes": 0, **_FAST}
    values.update(overrides)
    return CoredumpConfig(**values)


def incident(incident_id: str = "inc-1") -> IncidentOpened:
    return IncidentOpened(incident_id=incident_id, trigger="manual", source="test")


def wait_status(path: Path, *, timeout_s: float = 20.0, key: str = "armed") -> dict:
    """Poll the fake's JSON state until ``key`` is truthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            state = json.loads(path.read_text())
            if state.get(key) or (key == "armed" and state.get("mode") == "no-reader" and state.get("pipe")):
                return state
        time.sleep(0.02)
    raise AssertionError(f"fake driver did not report {key!r} in {path}")


def read_status(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture
def start_fake(spawn: Callable, python: str, tmp_path: Path) -> Callable:
    """Start the fake driver armed for ``tmp_path/dumps``; returns (proc, state, status_path)."""
    counter = iter(range(1000))

    def _start(
        *,
        mode: str = "normal",
        env_overrides: dict[str, str] | None = None,
        drop: tuple[str, ...] = (),
        cwd: Path | None = None,
        extra: tuple[str, ...] = (),
        armed: bool = True,
    ) -> tuple[subprocess.Popen[bytes], dict, Path]:
        n = next(counter)
        status = tmp_path / f"status-{n}.json"
        base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
        # Keep pipes inside tmp_path: the user's (our) value wins over SGLang's /tmp default.
        base["CUDA_COREDUMP_PIPE"] = str(tmp_path / "pipes" / "corepipe.cuda.%h.%p")
        base.update(env_overrides or {})
        env = dict(cuda_coredump_env(tmp_path / "dumps", base, host=HOST).env) if armed else base
        for name in drop:
            env.pop(name, None)
        argv = [python, FAKE, "--mode", mode, "--status", str(status), "--chunks", str(CHUNKS)]
        argv += ["--chunk-bytes", str(CHUNK_BYTES), *extra]
        proc = spawn(argv, env=env, cwd=str(cwd or tmp_path), stdout=subprocess.DEVNULL)
        state = wait_status(status) if armed else _wait_unarmed(status)
        return proc, state, status

    return _start


def _wait_unarmed(status: Path) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if status.exists():
            return read_status(status)
        time.sleep(0.02)
    raise AssertionError("fake driver did not start")


def target_of(proc: subprocess.Popen[bytes]) -> Target:
    return Target(pid=proc.pid, title="fake-cuda")


def test_template_glob_escapes_literals_and_wildcards_time() -> None:
    assert template_glob("/tmp/core[1].%h.%t.%p", host="n1", pid=42) == "/tmp/core[[]1].n1.*.42"
    assert template_glob("corepipe.cuda.%h.%p", host="n1", pid=7, cwd="/w") == "/w/corepipe.cuda.n1.7"


def test_default_config_is_valid_and_fresh() -> None:
    a, b = CoredumpConfig(), CoredumpConfig()
    assert a == b and a is not b
    assert a.pipe_template == "/tmp/corepipe.cuda.%h.%p"
    with pytest.raises(ValueError):
        CoredumpConfig(trigger_timeout_s=0)
    with pytest.raises(ValueError):
        CoredumpConfig(unknown_key=1)


def test_all_names_are_exported() -> None:
    public = {n for n in vars(coredump) if not n.startswith("_") and getattr(getattr(coredump, n), "__module__", "") == coredump.__name__}
    assert public <= set(coredump.__all__)
    for name in coredump.__all__:
        assert hasattr(coredump, name)


# --- triggering the fake driver -----------------------------------------------------------------


async def test_armed_target_dump_found_and_measured(tmp_path: Path, start_fake: Callable) -> None:
    proc, state, status = start_fake()
    actor = CoredumpActor(fast_config(tmp_path), host=HOST)
    with anyio.fail_after(HANG_GUARD_S):
        result = await actor.act(incident(), target_of(proc), timeout_s=20, artifact_dir=tmp_path)
    final = read_status(status)
    assert result.outcome is Outcome.OK, result.detail
    assert final["bytes_read"] == 1 and final["triggers"] == 1
    [core] = final["cores"]
    assert core["size_bytes"] == CHUNKS * CHUNK_BYTES
    assert Path(core["path"]).parent == tmp_path / "dumps" / HOST
    attrs = result.attributes
    assert attrs["servewatch.coredump.path"] == core["path"]
    assert attrs["servewatch.coredump.size_bytes"] == CHUNKS * CHUNK_BYTES == os.path.getsize(core["path"])
    assert attrs["servewatch.coredump.pipe"] == state["pipe"]
    assert attrs["servewatch.coredump.pipe_source"] == "fd"
    assert attrs["servewatch.coredump.complete"] is True
    assert attrs["process.pid"] == proc.pid
    assert result.artifact_paths == (core["path"],)
    assert result.action == "cuda.coredump" and result.pid == proc.pid


async def test_no_reader_is_not_armed_without_blocking(tmp_path: Path, start_fake: Callable) -> None:
    proc, state, _ = start_fake(mode="no-reader")
    assert Path(state["pipe"]).exists()
    actor = CoredumpActor(fast_config(tmp_path, trigger_timeout_s=60, completion_timeout_s=60), host=HOST)
    with anyio.fail_after(HANG_GUARD_S):
        result = await actor.act(incident(), target_of(proc), timeout_s=120, artifact_dir=tmp_path)
    assert result.outcome is Outcome.NOT_ARMED
    assert "no process has" in result.detail and "ENXIO" in result.detail
    assert result.attributes["servewatch.coredump.pipe_source"] == "environ"


async def test_full_pipe_reader_that_never_reads_times_out(tmp_path: Path, start_fake: Callable) -> None:
    proc, _state, status = start_fake(mode="full")
    actor = CoredumpActor(fast_config(tmp_path, trigger_timeout_s=0.5), host=HOST)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    with anyio.fail_after(HANG_GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            result = await actor.act(incident(), target_of(proc), timeout_s=120, artifact_dir=tmp_path)
            tg.cancel_scope.cancel()
    assert result.outcome is Outcome.TIMED_OUT, result.detail
    assert ticks >= 3  # the event loop kept running while the pipe stayed full
    assert "stayed full" in result.detail
    assert result.attributes["servewatch.coredump.triggered"] is False
    assert read_status(status)["cores"] == []


async def test_reader_that_never_reads_is_not_consumed_long_before_completion_timeout(
    tmp_path: Path, start_fake: Callable
) -> None:
    proc, _, status = start_fake(mode="never-read")
    actor = CoredumpActor(fast_config(tmp_path, completion_timeout_s=600), host=HOST)
    with anyio.fail_after(HANG_GUARD_S):  # far below the 600 s completion bound
        result = await actor.act(incident(), target_of(proc), timeout_s=900, artifact_dir=tmp_path)
    assert result.outcome is Outcome.TIMED_OUT
    assert result.detail.startswith("not consumed:") and "1 byte(s) in the pipe" in result.detail
    assert result.attributes["servewatch.coredump.triggered"] is True
    assert result.attributes["servewatch.coredump.consumed"] is False
    assert result.attributes["servewatch.coredump.stage"] == "not_consumed"
    assert read_status(status)["cores"] == []


async def test_time_placeholder_in_pipe_template(tmp_path: Path, start_fake: Callable) -> None:
    template = str(tmp_path / "tpipes" / "cuda.%h.%p.%t.fifo")
    proc, state, _ = start_fake(env_overrides={"CUDA_COREDUMP_PIPE": template})
    assert state["pipe"].startswith(str(tmp_path / "tpipes" / f"cuda.{HOST}.{proc.pid}."))
    # The fallback (environ template, %t as a wildcard) finds the same FIFO as the fd scan.
    by_env = locate_pipe(proc.pid, host=HOST, scan_fds=False)
    assert (by_env.path, by_env.source) == (state["pipe"], "environ")
    by_fd = locate_pipe(proc.pid, host=HOST)
    assert (by_fd.path, by_fd.source) == (state["pipe"], "fd")
    actor = CoredumpActor(fast_config(tmp_path), host=HOST)
    with anyio.fail_after(HANG_GUARD_S):
        result = await actor.act(incident(), target_of(proc), timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail


async def test_relative_default_pipe_in_target_cwd(tmp_path: Path, start_fake: Callable) -> None:
    work = tmp_path / "work dir"
    work.mkdir()
    proc, state, status = start_fake(drop=("CUDA_COREDUMP_PIPE",), cwd=work)
    assert state["pipe"] == str(work / f"corepipe.cuda.{HOST}.{proc.pid}")
    by_default = locate_pipe(proc.pid, host=HOST, scan_fds=False)
    assert (by_default.path, by_default.source) == (state["pipe"], "default")
    actor = CoredumpActor(fast_config(tmp_path), host=HOST)
    with anyio.fail_after(HANG_GUARD_S):
        result = await actor.act(incident(), target_of(proc), timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.coredump.pipe"] == state["pipe"]
    assert read_status(status)["bytes_read"] == 1


async def test_pipe_variable_set_only_at_runtime(tmp_path: Path, start_fake: Callable) -> None:
    runtime_template = str(tmp_path / "rt" / "corepipe.cuda.%h.%p")
    proc, state, _ = start_fake(mode="runtime-env", drop=("CUDA_COREDUMP_PIPE",), extra=("--runtime-pipe", runtime_template))
    environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
    assert b"CUDA_COREDUMP_PIPE=" not in environ
    fallback = locate_pipe(proc.pid, host=HOST, scan_fds=False)
    assert fallback.path is None and "CUDA_COREDUMP_PIPE is unset" in fallback.reason
    actor = CoredumpActor(fast_config(tmp_path), host=HOST)
    with anyio.fail_after(HANG_GUARD_S):
        result = await actor.act(incident(), target_of(proc), timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.coredump.pipe"] == state["pipe"]
    assert result.attributes["servewatch.coredump.pipe_source"] == "fd"


async def test_two_triggers_in_one_incident_write_once(tmp_path: Path, start_fake: Callable) -> None:
    proc, _, status = start_fake()
    actor = CoredumpActor(fast_config(tmp_path), host=HOST)
    target = target_of(proc)
    with anyio.fail_after(HANG_GUARD_S):
        results = await actor.trigger_all(incident("inc-A"), [target, target], artifact_dir=tmp_path)
        again = await actor.act(incident("inc-A"), target, timeout_s=20, artifact_dir=tmp_path)
    assert sorted(r.outcome for r in results) == sorted([Outcome.OK, Outcome.SKIPPED])
    assert again.outcome is Outcome.SKIPPED and "already triggered" in again.detail
    final = read_status(status)
    assert final["bytes_read"] == 1 and len(final["cores"]) == 1


async def test_trigger_all_dumps_every_armed_target(tmp_path: Path, start_fake: Callable) -> None:
    fakes = [start_fake() for _ in range(3)]
    plain, _, _ = start_fake(armed=False)
    # the fake driver stands for a GPU host: the unarmed target gets the arming hint
    actor = CoredumpActor(fast_config(tmp_path), host=HOST, driver_present=lambda _pid: True)
    targets = [target_of(p) for p, _, _ in fakes] + [target_of(plain)]
    with anyio.fail_after(HANG_GUARD_S):
        results = await actor.trigger_all(incident(), targets, artifact_dir=tmp_path)
    assert [r.pid for r in results] == [t.pid for t in targets]
    assert [r.outcome for r in results] == [Outcome.OK] * 3 + [Outcome.NOT_ARMED]
    assert "CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1 is not in the target's environment" in results[3].detail
    paths = {r.attributes["servewatch.coredump.path"] for r in results[:3]}
    assert paths == {read_status(s)["cores"][0]["path"] for _, _, s in fakes}


async def test_disk_guard_refuses_before_trigger(tmp_path: Path, start_fake: Callable) -> None:
    proc, _, status = start_fake()
    actor = CoredumpActor(fast_config(tmp_path, min_free_bytes=1 << 62), host=HOST)
    with anyio.fail_after(HANG_GUARD_S):
        result = await actor.act(incident(), target_of(proc), timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.REFUSED
    assert "below min_free_bytes" in result.detail
    assert result.attributes["servewatch.coredump.dump_dir"] == str(tmp_path / "dumps" / HOST)
    assert read_status(status)["bytes_read"] == 0


async def test_unwritable_dump_dir_refused(tmp_path: Path, start_fake: Callable) -> None:
    (tmp_path / "dumps").mkdir()
    blocker = tmp_path / "dumps" / "blocker"
    blocker.write_text("not a dir")
    proc, _, status = start_fake(env_overrides={"CUDA_COREDUMP_FILE": f"{blocker}/%h/core.%p"})
    actor = CoredumpActor(fast_config(tmp_path), host=HOST)
    with anyio.fail_after(HANG_GUARD_S):
        result = await actor.act(incident(), target_of(proc), timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.REFUSED and "cannot be created" in result.detail
    assert read_status(status)["bytes_read"] == 0


async def test_armed_env_but_no_cuda_init_and_impostor_file(tmp_path: Path, spawn: Callable, python: str) -> None:
    env = {"PATH": os.environ["PATH"], "CUDA_ENABLE_USER_TRIGGERED_COREDUMP": "1", "CUDA_COREDUMP_PIPE": str(tmp_path / "p.%p")}
    proc = spawn([python, "-c", "import time; time.sleep(600)"], env=env, cwd=str(tmp_path))
    deadline = time.monotonic() + 10  # under load /proc may briefly show the pre-exec image
    while "CUDA_COREDUMP_PIPE" not in coredump._read_environ(proc.pid) and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    location = locate_pipe(proc.pid, host=HOST)
    assert location.path is None and "CUDA not initialised yet" in location.reason
    impostor = tmp_path / f"p.{proc.pid}"
    impostor.write_bytes(b"precious")
    location = locate_pipe(proc.pid, host=HOST)
    assert location.path is None and "is not a FIFO" in location.reason
    forced = PipeLocation(pid=proc.pid, path=str(impostor), source="environ", pattern=str(impostor))
    with anyio.fail_after(HANG_GUARD_S):
        fired = await trigger_pipe(forced, timeout_s=1)
    assert fired.outcome is Outcome.NOT_ARMED and "not a FIFO" in fired.detail
    assert impostor.read_bytes() == b"precious"


async def test_exited_process_is_no_such_process(tmp_path: Path, python: str) -> None:
    with anyio.fail_after(30):
        done = await anyio.run_process([python, "-c", "import os; print(os.getpid())"], check=True)
    pid = int(done.stdout)
    actor = CoredumpActor(fast_config(tmp_path), host=HOST)
    result = await actor.act(incident(), Target(pid=pid), timeout_s=5, artifact_dir=tmp_path)
    assert result.outcome is Outcome.NO_SUCH_PROCESS


async def test_disabled_actor_skips(tmp_path: Path) -> None:
    actor = CoredumpActor(fast_config(tmp_path, enabled=False))
    result = await actor.act(incident(), Target(pid=os.getpid()), timeout_s=5, artifact_dir=tmp_path)
    assert result.outcome is Outcome.SKIPPED


async def test_on_a_host_without_a_cuda_driver_an_unarmed_target_is_one_quiet_fact(tmp_path: Path, start_fake: Callable) -> None:
    """This CPU-only host (no /proc/driver/nvidia, no /dev/nvidiactl, no libcuda in the target):
    ``not_armed`` says there is no GPU, with ``servewatch.coredump.no_gpu``, not how to arm it."""
    from agent.host.cudaenv import NO_CUDA_DRIVER, cuda_driver_present

    plain, _, _ = start_fake(armed=False)
    if cuda_driver_present(plain.pid):
        pytest.skip("this host has an NVIDIA driver")
    actor = CoredumpActor(fast_config(tmp_path), host=HOST)
    with anyio.fail_after(HANG_GUARD_S):
        result = await actor.act(incident(), target_of(plain), timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.NOT_ARMED
    assert result.detail == NO_CUDA_DRIVER and "SPT_NOENV" not in result.detail
    assert result.attributes["servewatch.coredump.no_gpu"] is True
    # with a driver there (a GPU host), the same target gets the arming hint
    gpu_host = CoredumpActor(fast_config(tmp_path), host=HOST, driver_present=lambda _pid: True)
    with anyio.fail_after(HANG_GUARD_S):
        hinted = await gpu_host.act(incident("inc-B"), target_of(plain), timeout_s=20, artifact_dir=tmp_path)
    assert hinted.outcome is Outcome.NOT_ARMED and "not armed:" in hinted.detail
    assert "servewatch.coredump.no_gpu" not in hinted.attributes


async def test_a_coredump_is_recorded_as_servewatch_pausing_its_target_while_it_runs(tmp_path: Path, start_fake: Callable) -> None:
    """The trigger pauses the target while the driver writes its core: an own action of that pid
    (:mod:`agent.host.ownactions`) for the incident, readable by another servewatch on the data dir,
    gone when the action ends."""
    import threading

    from agent.host.ownactions import OwnActionLog

    proc, _, _ = start_fake()
    (tmp_path / "data" / "h").mkdir(parents=True)
    actor = CoredumpActor(fast_config(tmp_path), host=HOST)
    actor.own_actions = OwnActionLog(tmp_path / "data", "h")
    reader = OwnActionLog(tmp_path / "data", "h")
    seen: list[tuple[str, int | None, str]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set() and not seen:
            seen.extend((a.kind, a.pid, a.incident_id) for a in reader.files())
            time.sleep(0.0002)

    with anyio.fail_after(HANG_GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, watch)
            try:
                result = await actor.act(incident("inc-core"), target_of(proc), timeout_s=20, artifact_dir=tmp_path)
            finally:
                done.set()
    assert result.outcome is Outcome.OK, result.detail
    assert seen == [("coredump_pause", proc.pid, "inc-core")]
    assert reader.files() == []
