"""The process watcher against real subprocesses: children (exit code, signal) and non-children."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

import anyio
import psutil
import pytest

from agent.host.targets import Target
from agent.model.bus import RecordingBus
from agent.model.events import ExitSource, TargetExited
from agent.watchers.process import ProcessWatcher, exit_status, signal_name
from tests.watchers import wait_until

WAIT_FOR_STDIN = "import sys; sys.stdin.read(); sys.exit(int(sys.argv[1]))"


async def _run_until_exits(watcher: ProcessWatcher, bus: RecordingBus, count: int, *, then=None) -> list[TargetExited]:
    async with anyio.create_task_group() as tg:
        await tg.start(watcher.run, bus)
        if then is not None:
            then()
        await wait_until(lambda: len(bus.of_type(TargetExited)) >= count)
        tg.cancel_scope.cancel()
    return bus.of_type(TargetExited)


async def test_child_exit_code_through_its_popen_owner(spawn, python) -> None:
    proc = spawn([python, "-c", WAIT_FOR_STDIN, "3"], stdin=subprocess.PIPE)
    bus = RecordingBus()
    watcher = ProcessWatcher(children=[proc], poll_interval_s=0.2)

    def finish() -> None:
        assert proc.stdin is not None
        proc.stdin.close()

    (exited,) = await _run_until_exits(watcher, bus, 1, then=finish)
    assert (exited.pid, exited.exit_code, exited.signal) == (proc.pid, 3, None)
    # a launched child that set no title of its own is named by its command line (clipped at 120)
    command = shlex.join([python, "-c", WAIT_FOR_STDIN, "3"])
    assert exited.title == (command if len(command) <= 120 else command[:117] + "..."), exited.title
    assert proc.returncode == 3  # the owner still has it
    assert watcher.pids == ()


async def test_child_killed_by_signal(spawn, python) -> None:
    proc = spawn([python, "-c", WAIT_FOR_STDIN, "0"], stdin=subprocess.PIPE)
    bus = RecordingBus()
    watcher = ProcessWatcher(children=[proc], poll_interval_s=0.2)
    try:
        (exited,) = await _run_until_exits(watcher, bus, 1, then=lambda: os.kill(proc.pid, signal.SIGKILL))
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
    assert (exited.exit_code, exited.signal) == (None, signal.SIGKILL)
    assert signal_name(exited.signal) == "SIGKILL"


async def test_child_status_is_read_without_stealing_it_from_its_owner(spawn, python) -> None:
    # Only the pid is given: the watcher peeks with waitid(WNOWAIT); Popen.wait() still works.
    proc = spawn([python, "-c", WAIT_FOR_STDIN, "5"], stdin=subprocess.PIPE)
    bus = RecordingBus()
    watcher = ProcessWatcher([proc.pid], poll_interval_s=0.2)

    def finish() -> None:
        assert proc.stdin is not None
        proc.stdin.close()

    (exited,) = await _run_until_exits(watcher, bus, 1, then=finish)
    assert (exited.exit_code, exited.signal) == (5, None)
    assert proc.wait(timeout=10) == 5


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "polling"])
async def test_non_child_exit_is_reported_without_status(spawn, python, monkeypatch, use_pidfd: bool) -> None:
    if not use_pidfd:
        monkeypatch.delattr(os, "pidfd_open")
    # The grandchild belongs to the intermediate process, not to us.
    launcher = spawn(
        [
            python,
            "-c",
            ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
            " print(p.pid, flush=True); p.wait()"),
        ],
        stdout=subprocess.PIPE,
    )
    assert launcher.stdout is not None
    with anyio.fail_after(30):
        line = await anyio.to_thread.run_sync(launcher.stdout.readline, abandon_on_cancel=True)
    launcher.stdout.close()
    grandchild = int(line)
    assert psutil.Process(grandchild).ppid() == launcher.pid

    bus = RecordingBus()
    watcher = ProcessWatcher([Target(pid=grandchild, title="fake::scheduler_TP0")], poll_interval_s=0.1)
    (exited,) = await _run_until_exits(watcher, bus, 1, then=lambda: os.kill(grandchild, signal.SIGTERM))
    assert (exited.pid, exited.exit_code, exited.title) == (grandchild, None, "fake::scheduler_TP0")
    # read from its zombie when we looked before its parent reaped it, else unknowable
    assert exited.signal in (None, signal.SIGTERM)
    assert launcher.wait(timeout=10) == 0  # its own parent reaped it: nothing stolen


async def test_gone_and_reused_pids_are_reported_at_once_and_pids_can_be_added(spawn, python) -> None:
    gone = spawn([python, "-c", "pass"])
    gone.wait(timeout=30)
    me = psutil.Process()
    reused = Target(pid=os.getpid(), title="old", create_time_s=me.create_time() - 3600)
    bus = RecordingBus()
    watcher = ProcessWatcher([gone.pid], poll_interval_s=0.2)
    late = spawn([python, "-c", WAIT_FOR_STDIN, "7"], stdin=subprocess.PIPE)

    def add_more() -> None:
        watcher.watch(reused)
        watcher.watch(late.pid, returncode=late.poll)
        watcher.watch(late.pid)  # already watched: ignored
        assert late.stdin is not None
        late.stdin.close()

    events = await _run_until_exits(watcher, bus, 3, then=add_more)
    by_pid = {e.pid: e for e in events}
    assert set(by_pid) == {gone.pid, os.getpid(), late.pid}
    assert (by_pid[gone.pid].exit_code, by_pid[gone.pid].signal) == (None, None)  # already reaped
    assert by_pid[os.getpid()].title == "old"
    assert by_pid[late.pid].exit_code == 7
    assert len(events) == 3


def test_a_bare_pid_is_watched_with_its_creation_time_so_a_reused_pid_is_not_mistaken_for_it(spawn, python) -> None:
    # Read when watch() is called: by the time the watcher opens its pidfd the owner may have
    # reaped the process and the pid may belong to another one, which must not be watched instead.
    proc = spawn([python, "-c", WAIT_FOR_STDIN, "0"], stdin=subprocess.PIPE)
    watcher = ProcessWatcher([proc.pid], poll_interval_s=0.2)
    watcher.watch(proc.pid)  # the same process: still one entry
    [watched] = watcher._watched.values()
    assert watched.target.create_time_s == psutil.Process(proc.pid).create_time()
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def test_exit_status_decodes_popen_return_codes() -> None:
    assert exit_status(None) == (None, None)
    assert exit_status(0) == (0, None)
    assert exit_status(2) == (2, None)
    assert exit_status(-signal.SIGSEGV) == (None, signal.SIGSEGV)
    assert signal_name(None) == "" and signal_name(999) == ""
    with pytest.raises(ValueError, match="poll_interval_s"):
        ProcessWatcher(poll_interval_s=0)


@pytest.mark.parametrize(("how", "notice"), [(signal.SIGTERM, True), (signal.SIGSEGV, True), (signal.SIGTERM, False)],
                         ids=["sigterm", "sigsegv", "notice-off"])
async def test_a_rank_reaped_at_once_without_kernel_events_is_told_by_its_sdk_death_notice(
        spawn, python, monkeypatch, how: int, notice: bool) -> None:
    """A pod: no kernel exit events, and the rank's own parent (a real process waiting on it)
    reaps it before the agent reads its zombie. The SDK's death notice says how it ended; with
    the notice off the status is unknown (what the agent said before the notice existed)."""
    from agent.host.exits import KernelExits
    from tests.conftest import PROGRAMS_DIR

    monkeypatch.setattr(KernelExits, "open", classmethod(lambda cls: None))  # refused in a pod's netns
    monkeypatch.setattr("agent.watchers.process.zombie_exit_status", lambda pid: None)  # the parent won the race
    env = {**os.environ, "PYTHONPATH": str(PROGRAMS_DIR.parent.parent)}
    if not notice:
        env["SERVEWATCH_EXIT_NOTICE"] = "0"
    parent = spawn([python, str(PROGRAMS_DIR / "exit_notice_target.py"), "spawn-wait"], stdout=subprocess.PIPE, env=env)
    assert parent.stdout is not None
    with anyio.fail_after(30):
        line = await anyio.to_thread.run_sync(parent.stdout.readline, abandon_on_cancel=True)
    parent.stdout.close()
    rank = int(line.split()[1])
    assert psutil.Process(rank).ppid() == parent.pid

    bus = RecordingBus()
    watcher = ProcessWatcher([Target(pid=rank, create_time_s=psutil.Process(rank).create_time(), title="rank0")],
                             poll_interval_s=0.1)
    (exited,) = await _run_until_exits(watcher, bus, 1, then=lambda: os.kill(rank, how))
    assert parent.wait(timeout=10) == 0  # its parent reaped it: nothing stolen
    assert exited.fact is not None
    if notice:
        assert (exited.fact.source, exited.signal, exited.exit_code) == (ExitSource.SDK, how, None), exited.fact
        assert exited.fact.ended_source == "sdk" and exited.fact.ended_time_unix_nano > 0
        from agent.cli.summary import exit_lines
        assert exit_lines([(watcher.exits[0][0], exited.fact)], {})[0].endswith("[its SDK's death notice]")
    else:
        assert (exited.fact.source, exited.signal) == (ExitSource.NONE, None), exited.fact


async def test_kernel_exit_events_wake_the_loop_once_for_many_and_none_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process that ends on the host sends an exit event: the reader wakes for the first,
    then lets the next ones wait in the socket (here an hour: ``COALESCE_S``); a lookup reads
    them itself, so 10 processes that ended meanwhile are each found with their exit code."""
    from agent.host import exits
    from agent.host.exits import KernelExits

    kernel = await anyio.to_thread.run_sync(KernelExits.open)
    if kernel is None:
        pytest.skip(f"no kernel exit events here: {KernelExits.unavailable}")
    monkeypatch.setattr(exits, "COALESCE_S", 3600.0)
    async with anyio.create_task_group() as tg:
        await tg.start(kernel.run)
        await anyio.to_thread.run_sync(lambda: subprocess.run(["true"], check=True))  # an exit (the host's others may come first)
        with anyio.fail_after(10):
            while kernel.wakes == 0:
                await anyio.sleep(0.01)
        started = int(time.time() * 1e9) - 10**9
        procs = await anyio.to_thread.run_sync(lambda: [subprocess.Popen(["sh", "-c", f"exit {n}"]) for n in range(1, 11)])
        codes = await anyio.to_thread.run_sync(lambda: [p.wait(timeout=10) for p in procs])
        found = await anyio.to_thread.run_sync(lambda: [kernel.get(p.pid, started) for p in procs])
        wakes = kernel.wakes
        tg.cancel_scope.cancel()
    assert codes == list(range(1, 11))
    assert [f.exit_code if f is not None else None for f in found] == codes
    assert wakes == 1  # the reader slept through the 10 (and whatever else ended on the host)
