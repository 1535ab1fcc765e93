"""`servewatch launch` internals with real children: env precedence, signals, exit status, agent.

Signals are sent to the test process itself, exactly as a terminal or kubelet would send them
to servewatch, and must arrive at the child. ``fail_after`` only guards against hangs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from pathlib import Path

import anyio
import pytest

from agent.actors.coredump import CoredumpActor, CoredumpConfig
from agent.cli import launch
from agent.cli.launch import LaunchError, describe_env, exit_status, launch_env, run_launched
from agent.host.targets import Target
from agent.model.events import IncidentOpened, Outcome
from tests.conftest import PROGRAMS_DIR

HANG_GUARD_S = 60
HOST = socket.gethostname()

DUMP_ENV = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w')); sys.exit(int(sys.argv[2]))"
WAIT_FOREVER = (
    "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(600)"
)
EXIT_42_ON_USR1 = (
    "import os, signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: os._exit(42)); "
    "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); os.replace(sys.argv[1] + '.tmp', sys.argv[1]); "
    "time.sleep(600)"
)


def base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "MTL_"))}


async def wait_for_file(path: Path, *, timeout_s: float = 30) -> str:
    """Runs as the agent's body inside launch: its file checks stay off the event loop."""
    with anyio.fail_after(timeout_s):
        while not await anyio.Path(path).exists():
            await anyio.sleep(0.02)
    return await anyio.Path(path).read_text()


def test_launch_env_user_values_win(tmp_path: Path) -> None:
    user = {"CUDA_COREDUMP_PIPE": "/run/mine.%p", "MTL_CAPTURE_ENABLED": "0", "PATH": "/bin"}
    planned = launch_env(user, crash_dump_folder=tmp_path / "crash", mlx=True, host="h1")
    assert dict(planned.kept) == {"CUDA_COREDUMP_PIPE": "/run/mine.%p", "MTL_CAPTURE_ENABLED": "0"}
    assert planned.env["CUDA_COREDUMP_PIPE"] == "/run/mine.%p"
    assert planned.env["MTL_CAPTURE_ENABLED"] == "0"
    assert planned.set["CUDA_COREDUMP_FILE"] == f"{tmp_path}/crash/%h/core.cuda.%t.%p"
    assert planned.env["PATH"] == "/bin"
    assert planned.coredump is not None and planned.coredump.host_dir == tmp_path / "crash" / "h1"
    assert (tmp_path / "crash" / "h1").is_dir()
    line = describe_env(planned)
    assert f"'{tmp_path}/crash/h1/'" in line and "set 6" in line  # 5 CUDA variables + SPT_NOENV=1
    assert "kept user's: CUDA_COREDUMP_PIPE, MTL_CAPTURE_ENABLED" in line and "MTL_CAPTURE_ENABLED=1" not in line


def test_launch_env_without_folder_or_mlx_adds_nothing() -> None:
    planned = launch_env({"A": "1"}, crash_dump_folder=None)
    assert dict(planned.env) == {"A": "1"} and not planned.set and planned.coredump is None
    mlx_only = launch_env({"A": "1"}, crash_dump_folder=None, mlx=True)
    assert dict(mlx_only.set) == {"MTL_CAPTURE_ENABLED": "1"}


@pytest.mark.parametrize(("returncode", "status"), [(0, 0), (3, 3), (-15, 143), (-9, 137)])
def test_exit_status_follows_shell_convention(returncode: int, status: int) -> None:
    assert exit_status(returncode) == status


async def test_child_runs_armed_and_its_exit_code_is_returned(tmp_path: Path, python: str) -> None:
    user = base_env() | {"CUDA_COREDUMP_FILE": str(tmp_path / "mine.%p")}
    planned = launch_env(user, crash_dump_folder=tmp_path / "crash", mlx=True)
    out = tmp_path / "env.json"
    with anyio.fail_after(HANG_GUARD_S):
        status = await run_launched([python, "-c", DUMP_ENV, str(out), "3"], env=planned.env)
    assert status == 3
    seen = json.loads(out.read_text())
    assert seen["CUDA_ENABLE_USER_TRIGGERED_COREDUMP"] == "1"
    assert seen["CUDA_COREDUMP_PIPE"] == "/tmp/corepipe.cuda.%h.%p"
    assert seen["CUDA_COREDUMP_FILE"] == str(tmp_path / "mine.%p")  # the user's value, kept
    assert seen["MTL_CAPTURE_ENABLED"] == "1"


async def test_sigterm_to_servewatch_is_forwarded_to_child(tmp_path: Path, python: str) -> None:
    ready = tmp_path / "pid"
    seen: dict[str, int] = {}

    async def agent_main(pid: int) -> None:
        seen["pid"] = pid
        seen["child_pid"] = int(await wait_for_file(ready))
        seen["pgid"] = os.getpgid(pid)
        os.kill(os.getpid(), signal.SIGTERM)  # what kubelet does to servewatch
        await anyio.sleep_forever()

    with anyio.fail_after(HANG_GUARD_S):
        status = await run_launched(
            [python, "-c", WAIT_FOREVER, str(ready)], env=base_env(), agent_main=agent_main, agent_exit_grace_s=0.1
        )
    assert status == 128 + signal.SIGTERM
    assert seen["pid"] == seen["child_pid"] == seen["pgid"]  # its own process group
    assert seen["pgid"] != os.getpgrp()


async def test_signal_reaches_child_handler(tmp_path: Path, python: str) -> None:
    ready = tmp_path / "pid"

    async def agent_main(pid: int) -> None:
        await wait_for_file(ready)
        os.kill(os.getpid(), signal.SIGUSR1)

    with anyio.fail_after(HANG_GUARD_S):
        status = await run_launched([python, "-c", EXIT_42_ON_USR1, str(ready)], env=base_env(), agent_main=agent_main)
    assert status == 42


async def test_agent_failure_leaves_server_running(
    tmp_path: Path, python: str, caplog: pytest.LogCaptureFixture
) -> None:
    ready = tmp_path / "pid"
    script = f"import time, sys; time.sleep(0.3); open({str(ready)!r}, 'w').write('done'); sys.exit(7)"

    async def agent_main(pid: int) -> None:
        raise RuntimeError("agent bug")

    with caplog.at_level(logging.ERROR, logger="agent.cli.launch"), anyio.fail_after(HANG_GUARD_S):
        status = await run_launched([python, "-c", script], env=base_env(), agent_main=agent_main)
    assert status == 7
    assert ready.read_text() == "done"
    assert "server keeps running" in caplog.text


async def test_agent_is_cancelled_after_child_exit(tmp_path: Path, python: str) -> None:
    events: list[str] = []

    async def agent_main(pid: int) -> None:
        events.append(f"started {pid}")
        try:
            await anyio.sleep_forever()
        finally:
            events.append("cancelled")

    with anyio.fail_after(HANG_GUARD_S):
        status = await run_launched(
            [python, "-c", "import time; time.sleep(0.2)"], env=base_env(), agent_main=agent_main, agent_exit_grace_s=0.1
        )
    assert status == 0
    assert events[0].startswith("started ") and events[-1] == "cancelled"


async def test_cancelled_launch_stops_child(tmp_path: Path, python: str) -> None:
    ready = tmp_path / "pid"
    with anyio.move_on_after(HANG_GUARD_S) as outer:
        async with anyio.create_task_group() as tg:

            async def cancel_when_ready() -> None:
                await wait_for_file(ready)
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_when_ready)
            await run_launched([python, "-c", WAIT_FOREVER, str(ready)], env=base_env(), terminate_grace_s=5)
    assert not outer.cancelled_caught
    pid = int(ready.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_missing_command_is_usage_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        await run_launched([str(tmp_path / "no-such-server")], env=base_env())
    assert info.value.exit_code == 127
    with pytest.raises(ValueError):
        await run_launched([], env=base_env())


async def test_launch_arms_child_and_agent_triggers_its_coredump(tmp_path: Path, python: str) -> None:
    """servewatch launch end to end on the fake driver: arm -> start -> find pipe -> trigger -> file."""
    status_file = tmp_path / "fake.json"
    user = base_env() | {"CUDA_COREDUMP_PIPE": str(tmp_path / "corepipe.cuda.%h.%p")}
    planned = launch_env(user, crash_dump_folder=tmp_path / "crash")
    actor = CoredumpActor(
        CoredumpConfig(folder=tmp_path / "crash", min_free_bytes=0, settle_s=0.2, poll_interval_s=0.02), host=HOST
    )
    results = []

    async def agent_main(pid: int) -> None:
        with anyio.fail_after(30):
            status = anyio.Path(status_file)  # the agent's body: file checks off the event loop
            while not (await status.exists() and json.loads(await status.read_text()).get("armed")):
                await anyio.sleep(0.02)
        opened = IncidentOpened(incident_id="inc-launch", trigger="manual", pids=(pid,))
        results.extend(await actor.trigger_all(opened, [Target(pid=pid)], artifact_dir=tmp_path))
        os.kill(pid, signal.SIGTERM)

    argv = [python, str(PROGRAMS_DIR / "fake_cuda_driver.py"), "--status", str(status_file), "--chunks", "3"]
    with anyio.fail_after(HANG_GUARD_S):
        status = await run_launched(argv, env=planned.env, agent_main=agent_main)
    assert status == 128 + signal.SIGTERM
    [result] = results
    assert result.outcome is Outcome.OK, result.detail
    core = Path(str(result.attributes["servewatch.coredump.path"]))
    assert core.parent == tmp_path / "crash" / HOST
    assert core.name.startswith("core.cuda.") and core.name.endswith(f".{result.pid}")
    assert core.stat().st_size == result.attributes["servewatch.coredump.size_bytes"] == 3 * 64 * 1024


def test_all_names_are_exported() -> None:
    public = {n for n, v in vars(launch).items() if not n.startswith("_") and getattr(v, "__module__", "") == launch.__name__}
    assert public <= set(launch.__all__)
    for name in launch.__all__:
        assert hasattr(launch, name)


def test_launch_env_arms_the_flight_recorder_and_keeps_the_users_size() -> None:
    planned = launch_env({"A": "1"}, crash_dump_folder=None, flight_recorder=2000)
    assert planned.set == {"TORCH_FR_BUFFER_SIZE": "2000"} and planned.env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert "Flight Recorder armed (TORCH_FR_BUFFER_SIZE=2000)" in describe_env(planned)
    mine = launch_env({"TORCH_FR_BUFFER_SIZE": "50"}, crash_dump_folder=None, flight_recorder=2000)
    assert not mine.set and mine.kept == {"TORCH_FR_BUFFER_SIZE": "50"} and mine.env["TORCH_FR_BUFFER_SIZE"] == "50"
    assert "user's TORCH_FR_BUFFER_SIZE=50 kept" in describe_env(mine)
