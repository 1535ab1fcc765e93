"""CUDA coredumps on the shapes real deployments have: setproctitle'd workers (empty
/proc/PID/environ), containers (own pid/uts/mount namespaces via real `unshare`), and drivers
that never read the trigger, never start the core file, or stall half-way.

The fake CUDA driver (tests/programs/fake_cuda_driver.py) is the documented boundary; every
process, namespace and setproctitle call is real. Each test asserts what the action records
(outcome and span attributes, as the manifest and the spans carry them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import psutil
import pytest

from agent.actors.coredump import CoredumpActor, CoredumpConfig
from agent.actors.coredump_target import LAUNCH_RECORD_DIR, effective_env, record_launch
from agent.host.cudaenv import cuda_coredump_env
from agent.host.targets import Target
from agent.model.events import IncidentOpened, Outcome
from tests.conftest import PROGRAMS_DIR
from tests.spanfiles import file_spans

FAKE = str(PROGRAMS_DIR / "fake_cuda_driver.py")
CLI = [sys.executable, "-m", "agent.cli.app"]
GUARD_S = 60


def fast(folder: Path, **overrides: object) -> CoredumpConfig:
    values: dict[str, object] = {"folder": folder, "min_free_bytes": 0, "settle_s": 0.2, "poll_interval_s": 0.02,
                                 "trigger_timeout_s": 2.0, "completion_timeout_s": 60.0}
    values.update(overrides)
    return CoredumpConfig(**values)  # type: ignore[arg-type]


def incident(name: str = "inc-field") -> IncidentOpened:
    return IncidentOpened(incident_id=name, trigger="manual")


def wait_json(path: Path, key: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            state = {}
        if state.get(key):
            return state
        time.sleep(0.02)
    raise AssertionError(f"{path} never had {key!r}")


def armed_env(tmp_path: Path, folder: Path, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_") and k != "SPT_NOENV"}
    base["CUDA_COREDUMP_PIPE"] = str(tmp_path / "pipes" / "corepipe.cuda.%h.%p")
    env = dict(cuda_coredump_env(folder, base).env)
    env.pop("SPT_NOENV", None)  # as a plain SGLang launch: setproctitle clears /proc/PID/environ
    env.update(extra)
    return env


@pytest.fixture
def driver(spawn: Callable, python: str, tmp_path: Path) -> Callable:
    counter = iter(range(100))

    def start(*args: str, env: dict[str, str], wrap: bool = False) -> tuple[int, Path]:
        status = tmp_path / f"driver-{next(counter)}.json"
        argv = [python, FAKE, "--status", str(status), "--chunks", "4", "--chunk-bytes", "16384", *args]
        if wrap:  # a parent that keeps the environment (SGLang's main process), the driver its child
            argv = [python, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))", *argv]
        spawn(argv, env=env, cwd=str(tmp_path), stdout=subprocess.DEVNULL)
        state = wait_json(status, "armed")
        return int(state["pid"]), status

    return start


def environ_is_clear(pid: int) -> bool:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        return b"=" not in fh.read()


# --- setproctitle ----------------------------------------------------------------------------------


async def test_setproctitle_target_with_armed_parent_uses_the_parents_template(driver, tmp_path: Path) -> None:
    crash = tmp_path / "crash"
    pid, status = driver("--title", "sglang::scheduler_TP0", env=armed_env(tmp_path, crash), wrap=True)
    assert environ_is_clear(pid)  # real setproctitle emptied it
    env = effective_env(pid)
    assert env.source == f"parent:{psutil.Process(pid).ppid()}" and env.environ_cleared
    # the agent's own folder differs: only the parent's CUDA_COREDUMP_FILE names the right one
    actor = CoredumpActor(fast(tmp_path / "elsewhere"))
    with anyio.fail_after(GUARD_S):
        result = await actor.act(incident(), Target(pid=pid), timeout_s=120, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    (core,) = json.loads(status.read_text())["cores"]
    attrs = result.attributes
    assert attrs["servewatch.coredump.path"] == core["path"] and core["path"].startswith(str(crash) + "/")
    assert attrs["servewatch.coredump.env_source"].startswith("parent:")
    assert attrs["servewatch.coredump.pipe_source"] == "fd"
    assert attrs["servewatch.coredump.stage"] == "complete" and attrs["servewatch.coredump.consumed"] is True


async def test_setproctitle_target_found_through_launch_record(driver, tmp_path: Path) -> None:
    crash = tmp_path / "crash"
    env = armed_env(tmp_path, crash)
    pid, status = driver("--title", "sglang::scheduler_TP1", env=env)
    assert environ_is_clear(pid)
    records = tmp_path / "data" / LAUNCH_RECORD_DIR
    record_launch(records, pid, psutil.Process(pid).create_time(), env)
    actor = CoredumpActor(fast(tmp_path / "elsewhere"), record_dirs=[records])
    with anyio.fail_after(GUARD_S):
        result = await actor.act(incident(), Target(pid=pid), timeout_s=120, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.coredump.env_source"] == f"launch:{pid}"
    (core,) = json.loads(status.read_text())["cores"]
    assert result.attributes["servewatch.coredump.path"] == core["path"]


async def test_setproctitle_target_without_any_record_still_finds_fifo_and_configured_core(driver, tmp_path: Path) -> None:
    crash = tmp_path / "crash"
    pid, status = driver("--title", "sglang::scheduler_TP2", env=armed_env(tmp_path, crash))
    assert environ_is_clear(pid)
    actor = CoredumpActor(fast(crash))  # the folder servewatch arms with: watched as well as the default
    with anyio.fail_after(GUARD_S):
        result = await actor.act(incident(), Target(pid=pid), timeout_s=120, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.coredump.env_source"] == "none"
    assert result.attributes["servewatch.coredump.pipe_source"] == "fd"
    (core,) = json.loads(status.read_text())["cores"]
    assert result.attributes["servewatch.coredump.path"] == core["path"]


async def test_spt_noenv_keeps_the_environ_readable(driver, tmp_path: Path) -> None:
    pid, _ = driver("--title", "sglang::scheduler_TP3", env=armed_env(tmp_path, tmp_path / "crash", SPT_NOENV="1"))
    assert not environ_is_clear(pid)
    assert effective_env(pid).source == "environ"


def test_launch_records_what_it_set_and_dump_finds_a_titled_server(tmp_path: Path) -> None:
    """`servewatch launch` records its arming; `servewatch dump` then triggers a server whose
    /proc/PID/environ setproctitle emptied (the user's own empty SPT_NOENV wins over ours)."""
    crash = tmp_path / "crash"
    status = tmp_path / "launched.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_", "CUDA_"))}
    env.update(SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), SPT_NOENV="", CUDA_COREDUMP_PIPE=str(tmp_path / "p.%h.%p"))
    server = subprocess.Popen(
        [*CLI, "launch", "--crash-dump-folder", str(crash), "--data-dir", "data", "--",
         sys.executable, FAKE, "--title", "sglang::scheduler_TP0", "--status", str(status)],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        pid = int(wait_json(status, "armed", timeout_s=60)["pid"])
        assert environ_is_clear(pid)
        (record,) = (tmp_path / "data" / LAUNCH_RECORD_DIR).glob(f"{pid}-*.json")
        assert json.loads(record.read_text())["env"]["CUDA_COREDUMP_FILE"] == f"{crash}/%h/core.cuda.%t.%p"
        r = subprocess.run(
            [*CLI, "dump", "--pid", str(pid), "--data-dir", "data"],
            capture_output=True, text=True, timeout=110, cwd=tmp_path, stdin=subprocess.DEVNULL,
            env=dict(env, SERVEWATCH_COREDUMP__FOLDER=str(tmp_path / "agent-folder")), check=False,
        )
        assert r.returncode == 0, r.stderr
    finally:
        os.killpg(server.pid, 15)
        server.communicate(timeout=30)
    (manifest,) = [json.loads(p.read_text()) for p in (tmp_path / "data").glob("*/*/manifest.json")]
    (action,) = [a for a in manifest["actions"] if a["action"] == "cuda.coredump"]
    assert action["outcome"] == "ok", action
    assert action["attributes"]["servewatch.coredump.env_source"] == f"launch:{pid}"
    (core,) = json.loads(status.read_text())["cores"]
    assert action["attributes"]["servewatch.coredump.path"] == core["path"] and core["path"].startswith(str(crash))
    (span,) = [s for s in file_spans(tmp_path / "data") if s["name"] == "cuda.coredump"]
    assert span["attributes"]["servewatch.coredump.env_source"] == f"launch:{pid}"


# --- containers ---------------------------------------------------------------------------------


def _unshare() -> str:
    path = shutil.which("unshare")
    if path is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux unshare")
    return path


async def test_container_target_paths_use_its_own_host_pid_and_mounts(spawn, python, tmp_path: Path) -> None:
    """The driver runs in its own pid, uts and mount namespaces (real `unshare`), with its pipe
    and core folder on a tmpfs only it can see: %h is the container's host name, %p its own pid."""
    unshare = _unshare()
    box = tmp_path / "box"
    box.mkdir()
    status = tmp_path / "status.json"
    hostname = f"ctr-{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    env.update(CUDA_ENABLE_USER_TRIGGERED_COREDUMP="1", CUDA_COREDUMP_PIPE=f"{box}/corepipe.cuda.%h.%p",
               CUDA_COREDUMP_FILE=f"{box}/%h/core.cuda.%t.%p")
    script = f"hostname {hostname} && mount -t tmpfs tmpfs {box} && exec {python} {FAKE} --status {status} --chunks 4"
    outer = spawn([unshare, "--pid", "--fork", "--uts", "--mount", "--mount-proc", "sh", "-c", script],
                  env=env, cwd=str(tmp_path), stdout=subprocess.DEVNULL)
    state = wait_json(status, "armed")
    ns_pid = int(state["pid"])
    (host_pid,) = [p.pid for p in psutil.Process(outer.pid).children(recursive=True) if "fake_cuda_driver" in " ".join(p.cmdline())]
    assert ns_pid != host_pid
    assert state["pipe"] == f"{box}/corepipe.cuda.{hostname}.{ns_pid}"
    assert not os.path.exists(state["pipe"])  # invisible from here: the tmpfs is in its mount namespace

    actor = CoredumpActor(fast(tmp_path / "agent-folder"))
    with anyio.fail_after(GUARD_S):
        result = await actor.act(incident(), Target(pid=host_pid), timeout_s=120, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    attrs = result.attributes
    (core,) = json.loads(status.read_text())["cores"]
    assert core["path"].startswith(f"{box}/{hostname}/core.cuda.") and core["path"].endswith(f".{ns_pid}")
    assert attrs["servewatch.coredump.path_in_target"] == core["path"]
    assert attrs["servewatch.coredump.path"] == f"/proc/{host_pid}/root{core['path']}"
    assert attrs["servewatch.coredump.size_bytes"] == core["size_bytes"] > 0
    assert attrs["servewatch.coredump.ns_pid"] == ns_pid
    assert attrs["servewatch.coredump.root"] == f"/proc/{host_pid}/root"
    assert attrs["servewatch.coredump.pipe"] == state["pipe"] and attrs["servewatch.coredump.pipe_source"] == "fd"


# --- bounded by progress ------------------------------------------------------------------------


async def test_trigger_read_but_core_never_started_ends_at_start_timeout(driver, tmp_path: Path) -> None:
    pid, status = driver("--mode", "read-no-core", env=armed_env(tmp_path, tmp_path / "crash", SPT_NOENV="1"))
    actor = CoredumpActor(fast(tmp_path / "crash", start_timeout_s=1.0, completion_timeout_s=600))
    with anyio.fail_after(GUARD_S):
        result = await actor.act(incident(), Target(pid=pid), timeout_s=900, artifact_dir=tmp_path)
    assert result.outcome is Outcome.TIMED_OUT, result.detail
    assert result.detail.startswith("not started:")
    assert result.attributes["servewatch.coredump.stage"] == "not_started"
    assert result.attributes["servewatch.coredump.consumed"] is True
    assert json.loads(status.read_text())["triggers"] == 1


async def test_core_that_stops_growing_is_stalled_at_its_size(driver, tmp_path: Path) -> None:
    pid, status = driver("--mode", "stall", "--stall-after", "2", env=armed_env(tmp_path, tmp_path / "crash", SPT_NOENV="1"))
    actor = CoredumpActor(fast(tmp_path / "crash", stall_timeout_s=1.0, completion_timeout_s=600))
    with anyio.fail_after(GUARD_S):
        result = await actor.act(incident(), Target(pid=pid), timeout_s=900, artifact_dir=tmp_path)
    stalled = wait_json(status, "stalled")["stalled"]
    assert result.outcome is Outcome.TIMED_OUT, result.detail
    assert result.detail.startswith(f"stalled at {stalled['size_bytes']} bytes")
    assert result.attributes["servewatch.coredump.stage"] == "stalled"
    assert result.attributes["servewatch.coredump.size_bytes"] == stalled["size_bytes"] == 2 * 16384
    assert result.artifact_paths == (stalled["path"],)


def test_default_limits_fit_the_phase_limit() -> None:
    from agent.actors.pyspy import PySpyConfig
    from agent.incidents.manager import IncidentConfig

    phase_s = IncidentConfig().phase_timeout_s
    assert CoredumpActor(CoredumpConfig()).budget_s <= phase_s
    assert 2 * PySpyConfig().timeout_s <= phase_s


async def test_delay_between_stacks_and_coredump_is_applied(driver, tmp_path: Path) -> None:
    pid, _ = driver(env=armed_env(tmp_path, tmp_path / "crash", SPT_NOENV="1"))
    actor = CoredumpActor(fast(tmp_path / "crash", delay_s=1.0))
    assert actor.budget_s == 1.0 + 2.0 + 1.0 + 60.0
    started_ns = time.time_ns()
    with anyio.fail_after(GUARD_S):
        (result,) = await actor.trigger_all(incident(), [Target(pid=pid)], artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.coredump.trigger_time_unix_nano"] - started_ns >= 1.0e9
