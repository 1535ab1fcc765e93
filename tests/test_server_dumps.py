"""The py-spy runs a watched server starts itself (:class:`agent.host.procinfo.ServerDumpLog`): a
process that dumps itself through the shell, as SGLang's soft watchdog does, is seen by scanning
``/proc`` for new processes, named with the process that started it, and said in one line."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from agent.host.exits import ExecEvents
from agent.host.procinfo import ServerDump, ServerDumpLog, server_dump_lines
from tests.conftest import PROGRAMS_DIR

SELF_DUMPING = str(PROGRAMS_DIR / "self_dumping_target.py")


def _pyspy_stand_in(tmp_path: Path) -> Path:
    """A program named ``py-spy`` that runs 1 s and succeeds (what the scan sees is its name and
    its ancestry, not what it does)."""
    exe = tmp_path / "bin" / "py-spy"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nsleep 1\n")
    exe.chmod(0o755)
    return exe


def test_a_server_dumping_itself_through_the_shell_is_seen_once_and_named_with_its_pid(spawn, python, tmp_path: Path) -> None:
    exe = _pyspy_stand_in(tmp_path)
    result = tmp_path / "theirs.jsonl"
    proc = spawn([python, SELF_DUMPING, str(exe), str(result)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().split() == [b"ready", str(proc.pid).encode()]
    log, stranger = ServerDumpLog(), ServerDumpLog()
    log.scan([proc.pid])  # what runs before the dump: nothing of the kind
    stranger.scan([1])
    t0 = time.time_ns()
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    found: list[ServerDump] = []
    deadline = time.monotonic() + 30
    while not (result.exists() and result.read_text()):
        assert time.monotonic() < deadline, "the target's own dump never ended"
        found += log.scan([proc.pid])
        assert stranger.scan([1]) == []  # not started by the pids scanned for: not a server's run
        time.sleep(0.05)
    found += log.scan([proc.pid])
    (run,) = found  # the shell and the py-spy it started are one run
    assert run.dumper.started_by[0] == proc.pid, run
    assert run.dumper.command == f"/bin/sh -c {exe} dump --native --pid {proc.pid}", run
    assert run.dumper.chain[0] == proc.pid and t0 <= run.seen_unix_nano <= time.time_ns()
    assert log.between(t0, time.time_ns(), [proc.pid]) == [run]
    assert log.between(t0, time.time_ns(), [os.getpid() + 10**7]) == []  # another server's incident
    assert log.between(run.seen_unix_nano + 1, time.time_ns(), [proc.pid]) == []  # before its window
    (line,) = server_dump_lines([run], {proc.pid: "sglang::scheduler_TP1"})
    assert line.startswith(f"SGLang's own watchdog fired: pid {proc.pid} 'sglang::scheduler_TP1' ran"
                           f" '/bin/sh -c {exe} dump --native --pid {proc.pid}' (pid {run.dumper.pid}), seen at "), line
    assert line.endswith(" UTC"), line
    (plain,) = server_dump_lines([run, run])
    assert plain.startswith(f"the server's own watchdog fired: pid {proc.pid} ") and plain.endswith(" UTC, 2 runs"), plain


def test_the_agents_own_pyspy_runs_are_never_a_servers(tmp_path: Path) -> None:
    exe = _pyspy_stand_in(tmp_path)
    log = ServerDumpLog()
    log.scan([os.getpid()])
    ours = subprocess.Popen([str(exe), "dump", "--pid", "1"], stdin=subprocess.DEVNULL)
    try:
        assert log.scan([os.getpid()]) == []  # its parent is this process: our own run
    finally:
        ours.wait(timeout=10)


#: A server whose child is forked first and only later execs ``sh -c '<py-spy> dump --pid <server>'``
#: (argv: py-spy, go file): between the two the child's command line is the server's own.
FORK_THEN_EXEC = (
    "import os, sys, time\n"
    "exe, go = sys.argv[1], sys.argv[2]\n"
    "server = os.getpid()\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    deadline = time.monotonic() + 30\n"
    "    while not os.path.exists(go) and time.monotonic() < deadline:\n"
    "        time.sleep(0.01)\n"
    "    os.execv('/bin/sh', ['/bin/sh', '-c', f'{exe} dump --native --pid {server}'])\n"
    "print('ready', child, flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_child_seen_before_its_exec_is_looked_at_again_and_its_pyspy_run_seen(spawn, python, tmp_path: Path) -> None:
    exe = _pyspy_stand_in(tmp_path)
    go = tmp_path / "go"
    log = ServerDumpLog()
    proc = spawn([python, "-c", FORK_THEN_EXEC, str(exe), str(go)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, child = proc.stdout.readline().split()
    assert ready == b"ready"
    assert log.scan([proc.pid]) == []  # the child is still the server's fork: nothing to say yet
    go.touch()
    found: list[ServerDump] = []
    deadline = time.monotonic() + 10
    while not found:
        assert time.monotonic() < deadline, "the exec'd shell was never seen"
        found = log.scan([proc.pid])
        time.sleep(0.05)
    (run,) = found
    assert (run.dumper.pid, run.dumper.command) == (int(child), f"/bin/sh -c {exe} dump --native --pid {proc.pid}"), run
    assert run.dumper.started_by[0] == proc.pid, run


def test_the_scan_is_skipped_only_while_no_process_was_created_and_none_waits_for_its_exec(
        spawn, python, tmp_path: Path, monkeypatch) -> None:
    from agent.host import procinfo

    log = ServerDumpLog()
    assert log.needs_scan()  # never scanned
    before = procinfo.last_pid()
    assert isinstance(before, int) and before > 0
    log.scan([os.getpid()])
    proc = spawn([python, "-c", "import time; time.sleep(30)"])
    assert procinfo.last_pid() != before  # the kernel's counter moved with the new process
    assert log.needs_scan()
    log.scan([os.getpid()])
    # the counter held still (as on an idle host): nothing can be new, no /proc listing
    monkeypatch.setattr(procinfo, "last_pid", lambda: 4242)
    assert _drained(log, [os.getpid()])
    monkeypatch.setattr(procinfo, "last_pid", lambda: 4243)
    assert log.needs_scan()
    log.scan([proc.pid])
    # a forked child not yet exec'd is looked at again even while the counter holds still
    go = tmp_path / "go"
    forker = spawn([python, "-c", FORK_THEN_EXEC, str(_pyspy_stand_in(tmp_path)), str(go)], stdout=subprocess.PIPE)
    assert forker.stdout is not None and forker.stdout.readline().split()[0] == b"ready"
    monkeypatch.setattr(procinfo, "last_pid", lambda: 4244)
    assert log.scan([forker.pid]) == []
    assert log.needs_scan()  # the unsettled fork keeps the scans coming with no new pid
    assert _drained(log, [forker.pid])  # a fork that stays one (a forked worker) stops costing scans
    assert forker.poll() is None and not go.exists()


def _drained(log: ServerDumpLog, pids: list[int]) -> bool:
    """Scan until nothing waits to be looked at again (a fork elsewhere on this shared host is
    looked at up to UNSETTLED_SCANS times too); whether that came within 200 scans."""
    for _ in range(200):
        log.scan(pids)
        if not log.needs_scan():
            return True
        time.sleep(0.01)
    return False


# --- scans triggered by the kernel's exec events (ServerDumpLog.follow_execs) ---------------------

#: Makes threads on a line on stdin (each ends at once), says ``made N`` after each batch.
THREAD_MAKER = (
    "import sys, threading\n"
    "print('ready', flush=True)\n"
    "for line in sys.stdin:\n"
    "    for _ in range(int(line)):\n"
    "        t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
    "    print('made', line.strip(), flush=True)\n"
)


def _exec_events_or_skip() -> ExecEvents:
    events = ExecEvents.open()
    if events is None:
        pytest.skip(f"no kernel exec events here: {ExecEvents.unavailable}")
    return events


def test_a_process_making_threads_sends_no_exec_event_though_the_last_pid_moves(spawn, python) -> None:
    """The last pid (the fallback trigger) moves with every thread; the exec events name only
    processes that ran a program: the thread maker's own start, never its threads."""
    from agent.host import procinfo

    events = _exec_events_or_skip()
    try:
        proc = spawn([python, "-c", THREAD_MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        assert proc.pid in events.drain()  # its own exec (of python) is one
        before = procinfo.last_pid()
        proc.stdin.write(b"200\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"made 200\n"
        after = procinfo.last_pid()
        assert isinstance(before, int) and isinstance(after, int)
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        assert (after - before) % pid_max >= 200  # 200 new thread ids handed out: the fallback would scan
        assert proc.pid not in events.drain()  # and not one exec event of that process
        stand_in = subprocess.Popen(["/bin/sh", "-c", "exec sleep 0"])
        assert stand_in.wait(timeout=10) == 0
        assert stand_in.pid in events.drain()  # a process that runs a program is one
    finally:
        events.close()
    assert events.drain() == []  # closed: reads as nothing


def test_following_execs_a_servers_pyspy_run_is_seen_by_the_scans_its_exec_triggers(spawn, python, tmp_path: Path) -> None:
    """Following exec events, the self-dumping server's ``sh -c 'py-spy ...'`` is found by the
    scans its exec triggers (needs_scan true after each exec, read from the events waiting)."""
    exe = _pyspy_stand_in(tmp_path)
    result = tmp_path / "theirs.jsonl"
    log = ServerDumpLog()
    if not log.follow_execs():
        pytest.skip(f"no kernel exec events here: {ExecEvents.unavailable}")
    try:
        proc = spawn([python, SELF_DUMPING, str(exe), str(result)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().split() == [b"ready", str(proc.pid).encode()]
        assert log.needs_scan()  # never scanned, and the server's own start is an exec
        assert log.scan([proc.pid]) == []
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        found: list[ServerDump] = []
        deadline = time.monotonic() + 30
        while not (result.exists() and result.read_text()):
            assert time.monotonic() < deadline, "the target's own dump never ended"
            if log.needs_scan():
                found += log.scan([proc.pid])
            time.sleep(0.05)
        if log.needs_scan():
            found += log.scan([proc.pid])
        (run,) = found
        assert run.dumper.started_by[0] == proc.pid, run
        assert run.dumper.command == f"/bin/sh -c {exe} dump --native --pid {proc.pid}", run
    finally:
        log.close()
        log.close()  # safe twice


def test_following_execs_a_fork_seen_before_its_exec_is_found_after_it(spawn, python, tmp_path: Path) -> None:
    """A fork seen by a scan before its exec (its command line still the server's) is looked at
    again by the scan its exec triggers: the exec event stands in for the rescans on a timer."""
    exe = _pyspy_stand_in(tmp_path)
    go = tmp_path / "go"
    log = ServerDumpLog()
    if not log.follow_execs():
        pytest.skip(f"no kernel exec events here: {ExecEvents.unavailable}")
    try:
        proc = spawn([python, "-c", FORK_THEN_EXEC, str(exe), str(go)], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        ready, child = proc.stdout.readline().split()
        assert ready == b"ready"
        log.needs_scan()
        assert log.scan([proc.pid]) == []  # the child is still the server's fork
        go.touch()
        found: list[ServerDump] = []
        deadline = time.monotonic() + 10
        while not found:
            assert time.monotonic() < deadline, "the exec'd shell was never seen"
            if log.needs_scan():
                found = log.scan([proc.pid])
            time.sleep(0.05)
        (run,) = found
        assert (run.dumper.pid, run.dumper.command) == (int(child), f"/bin/sh -c {exe} dump --native --pid {proc.pid}"), run
    finally:
        log.close()


async def test_the_agents_scan_loop_waits_on_exec_events_and_finds_the_servers_run(spawn, python, tmp_path: Path) -> None:
    """The runtime's loop (``TargetWatch.scan_server_dumps``): following exec events it sleeps
    until one comes, finds the self-dumping server's run, and closes the socket when cancelled."""
    import anyio

    from agent.host.config import TargetConfig
    from agent.incidents.evidence import TargetFinder
    from agent.runtime.supervision import TargetWatch

    exe = _pyspy_stand_in(tmp_path)
    result = tmp_path / "theirs.jsonl"
    proc = spawn([python, SELF_DUMPING, str(exe), str(result)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().split() == [b"ready", str(proc.pid).encode()]
    finder = TargetFinder(TargetConfig(root_pid=proc.pid), stall_timeout_s=60)
    watch = TargetWatch(discover=list, finder=finder, watchers={}, process_watcher=None, bus=None, status=None,  # type: ignore[arg-type]
                        incidents=None, shipper=lambda: None, scraped=False, stop=lambda why: None)  # type: ignore[arg-type]
    t0 = time.time_ns()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch.scan_server_dumps)
        await anyio.sleep(0.3)  # the first scan: every pid now is known
        if finder.server_dumps._execs is None:
            tg.cancel_scope.cancel()
            pytest.skip(f"no kernel exec events here: {ExecEvents.unavailable}")
        execs = finder.server_dumps._execs
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        with anyio.fail_after(30):
            while not finder.server_dumps.between(t0, time.time_ns(), [proc.pid]):
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    (run,) = finder.server_dumps.between(t0, time.time_ns(), [proc.pid])
    assert run.dumper.command == f"/bin/sh -c {exe} dump --native --pid {proc.pid}", run
    assert execs.received >= 2  # the shell and the py-spy it started: exec events that triggered scans
    assert finder.server_dumps._execs is None and execs.drain() == []  # closed at the end
