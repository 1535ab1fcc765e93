"""The py-spy actor: real py-spy against real titled Python subprocesses, and stub executables
(tests/programs/fake_pyspy.py) for the failure classes py-spy cannot be made to show on demand."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pydantic
import pytest

import agent.actors.pyspy as pyspy_module
from agent.actors.pyspy import (
    Classification,
    PySpyActor,
    PySpyConfig,
    classify,
    default_executable,
    dump_waves,
    permission_hint,
)
from agent.host.procinfo import dumpers_of
from agent.host.targets import ProcessState, Target, process_state, target_of
from agent.model.events import ComponentStatus, IncidentOpened, Outcome
from agent.model.stacks import hung_frame, parse_dump, render_text, summarize
from tests.conftest import PROGRAMS_DIR

TITLED = str(PROGRAMS_DIR / "titled_target.py")
FAKE = str(PROGRAMS_DIR / "fake_pyspy.py")
HUNG = "hung_in_fake_allreduce"
TRIGGER = IncidentOpened(incident_id="inc-test", trigger="manual")

Spawn = Callable[..., subprocess.Popen[bytes]]


def _titled(spawn: Spawn, python: str, title: str, *extra: str) -> Target:
    proc = spawn([python, TITLED, title, "--max-lifetime-s", "120", *extra], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "ready <pid>" once set up, or EOF if it died
    proc.stdout.close()
    assert line.split() == [b"ready", str(proc.pid).encode()], line
    target = target_of(proc.pid)
    assert target is not None
    return target


def _stub(tmp_path: Path, mode: str) -> tuple[str, Path]:
    """An executable standing in for py-spy; returns (path, log of its runs)."""
    log = tmp_path / f"{mode}.log"
    exe = tmp_path / f"fake-py-spy-{mode}"
    exe.write_text(
        f"#!{sys.executable}\n"
        "import runpy, sys\n"
        f"sys.argv = [sys.argv[0], {mode!r}, {str(log)!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({FAKE!r}, run_name='__main__')\n",
        encoding="utf-8",
    )
    exe.chmod(0o755)
    return str(exe), log


def _runs(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def _wait_dead(pid: int, timeout_s: float = 10.0) -> ProcessState:
    """Bounded wait until pid is gone (or a zombie awaiting an init that does not reap)."""
    deadline = time.monotonic() + timeout_s
    state = process_state(pid)
    while state not in (ProcessState.GONE, ProcessState.ZOMBIE) and time.monotonic() < deadline:
        time.sleep(0.02)
        state = process_state(pid)
    return state


def _reaped_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


# --- real py-spy, real targets ---------------------------------------------------------------


async def test_dump_captures_hung_frame_and_writes_artifacts(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0", "--threads", "2")
    actor = PySpyActor()
    result = await actor.act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path / "bundle")

    assert result.outcome is Outcome.OK, result.detail
    assert result.action == "pyspy.dump"
    assert result.pid == target.pid
    attrs = result.attributes
    assert attrs["process.pid"] == target.pid
    assert attrs["process.title"] == "sglang::scheduler_TP0"
    assert attrs["servewatch.pyspy.native"] is True
    assert attrs["servewatch.pyspy.attempts"] == 1
    assert attrs["servewatch.pyspy.thread_count"] == 3
    assert str(attrs["servewatch.pyspy.hung_frame"]).startswith(f"{HUNG} (")
    assert "titled_target.py:" in str(attrs["servewatch.pyspy.hung_frame"])
    stacks = attrs["servewatch.pyspy.stacks"]
    assert isinstance(stacks, tuple)
    assert any(s.startswith(f"MainThread: {HUNG} (") for s in stacks)
    assert any(s.startswith("worker-0: worker_idle_loop (") for s in stacks)
    assert HUNG in result.detail
    assert result.end_time_unix_nano >= result.start_time_unix_nano > 0

    json_path, txt_path = (Path(p) for p in result.artifact_paths)
    assert json_path == tmp_path / "bundle" / f"pyspy-{target.pid}.json"
    threads = parse_dump(json_path.read_bytes())
    assert {t.thread_name for t in threads} == {"MainThread", "worker-0", "worker-1"}
    assert threads[0].thread_name == "MainThread"
    assert HUNG in [f.name for f in threads[0].frames]
    assert any(f.native for f in threads[0].frames)  # --native added C frames
    text = txt_path.read_text(encoding="utf-8")
    assert text.startswith(f"Process {target.pid}: sglang::scheduler_TP0\n")
    assert f"    {HUNG} (" in text
    assert '"worker-1"' in text
    assert actor.statistics().ok == 1


async def test_span_summary_is_bounded(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "demo::scheduler_TP1", "--threads", "20")
    actor = PySpyActor(PySpyConfig(max_threads=4, max_frames=2))
    result = await actor.act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.pyspy.thread_count"] == 21
    assert result.attributes["servewatch.pyspy.threads_truncated"] is True
    stacks = result.attributes["servewatch.pyspy.stacks"]
    assert isinstance(stacks, tuple)
    assert 4 <= len(stacks) <= 8
    assert all(len(s) <= 256 for s in stacks)
    assert stacks[0].startswith("MainThread: ")  # the main thread survives truncation
    # the artifact keeps every thread
    assert len(parse_dump(Path(result.artifact_paths[0]).read_bytes())) == 21


async def test_dump_all_dumps_every_target_and_keeps_order(spawn, python, tmp_path: Path) -> None:
    targets = [_titled(spawn, python, f"sglang::scheduler_TP{i}") for i in range(3)]
    gone = Target(pid=_reaped_pid(), title="sglang::scheduler_TP9")
    order = [targets[2], gone, targets[0], targets[1]]
    actor = PySpyActor(PySpyConfig(max_concurrency=2))
    results = await actor.dump_all(TRIGGER, order, artifact_dir=tmp_path)
    assert [r.pid for r in results] == [t.pid for t in order]
    assert [r.outcome for r in results] == [Outcome.OK, Outcome.NO_SUCH_PROCESS, Outcome.OK, Outcome.OK]
    for result, target in zip(results, order):
        if result.outcome is Outcome.OK:
            assert result.attributes["process.title"] == target.title
            assert str(result.attributes["servewatch.pyspy.hung_frame"]).startswith(HUNG)
    assert results[1].retryable is False
    assert actor.statistics().attempts == 3  # the gone pid never started py-spy


def test_dump_waves_put_ranks_and_coordinators_first_and_keep_one_wave_without_them() -> None:
    t = [Target(pid=10 + i, title=title) for i, title in enumerate(
        ["python -m sglang.launch_server --tp 2", "sglang::scheduler_TP1", "sglang::detokenizer", "sglang::scheduler_TP0",
         "VLLM::EngineCore", "VLLM::APIServer_0"])]  # fmt: skip
    assert dump_waves(t) == [[1, 3, 4], [0, 2, 5]]
    plain = [Target(pid=1, title="python train.py"), Target(pid=2, title="torchrun")]
    assert dump_waves(plain) == [[0, 1]]
    assert dump_waves([t[1], t[3]]) == [[0, 1]]
    assert dump_waves([]) == []


async def test_dump_all_dumps_the_ranks_together_first_and_the_other_roles_after(spawn, python, tmp_path: Path) -> None:
    """An SGLang tree: both schedulers' dumps overlap, and every other role's dump starts after
    the last scheduler's ended (they do not share the CPUs with the ranks' dumps)."""
    titles = ["sglang::detokenizer", "sglang::scheduler_TP0", "launcher sglang.launch_server", "sglang::scheduler_TP1"]
    targets = [_titled(spawn, python, title) for title in titles]
    exe, log = _stub(tmp_path, "slow")
    actor = PySpyActor(PySpyConfig(executable=exe, native=False))
    results = await actor.dump_all(TRIGGER, targets, artifact_dir=tmp_path)
    assert [r.pid for r in results] == [t.pid for t in targets]
    assert [r.outcome for r in results] == [Outcome.OK] * 4
    ranks, others = [results[1], results[3]], [results[0], results[2]]
    assert all(str(r.attributes["servewatch.pyspy.hung_frame"]).startswith(HUNG) for r in results)
    assert max(r.end_time_unix_nano for r in ranks) <= min(r.start_time_unix_nano for r in others)
    starts = {int(run["argv"][run["argv"].index("--pid") + 1]): run["time_ns"] for run in _runs(log) if run["event"] == "start"}
    ends = {int(run["argv"][run["argv"].index("--pid") + 1]): run["time_ns"] for run in _runs(log) if run["event"] == "end"}
    rank_pids = [targets[1].pid, targets[3].pid]
    assert max(starts[p] for p in rank_pids) < min(ends[p] for p in rank_pids), "the ranks' dumps did not overlap"


async def test_a_dump_waits_for_the_servers_own_pyspy_about_to_attach_neither_fails_and_says_its_watchdog_fired(
        spawn, python, tmp_path: Path) -> None:  # fmt: skip
    """SGLang's soft watchdog: the scheduler runs ``sh -c 'py-spy dump --native --pid <itself>'``
    (here a py-spy that takes 1 s before it attaches, the window in which an attach of ours would
    make it fail EPERM). servewatch's dump sees that run aimed at its target, waits for it, then
    dumps: both succeed, and the result says the server's own watchdog fired."""
    real = default_executable()
    assert real
    slow = tmp_path / "bin" / "py-spy"
    slow.parent.mkdir()
    slow.write_text(f"#!/bin/sh\nsleep 1\nexec {real} \"$@\"\n")
    slow.chmod(0o755)
    theirs = tmp_path / "theirs.jsonl"
    proc = spawn([python, str(PROGRAMS_DIR / "self_dumping_target.py"), str(slow), str(theirs)], stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().split() == [b"ready", str(proc.pid).encode()]
    found = target_of(proc.pid)
    assert found is not None
    target = dataclasses.replace(found, title="sglang::scheduler")
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 10
    while not (dumpers := dumpers_of(proc.pid)):
        assert time.monotonic() < deadline, "the target's own py-spy run never showed"
        await anyio.sleep(0.02)
    assert dumpers[0].started_by[0] == proc.pid, dumpers
    actor = PySpyActor(PySpyConfig())
    # the server's run is a shell, then the py-spy it execs or forks: every pid seen dumping it counts
    seen = {d.pid for d in dumpers}

    async def watch_dumpers(done: anyio.Event) -> None:
        while not done.is_set():
            seen.update(d.pid for d in dumpers_of(proc.pid))
            await anyio.sleep(0.01)

    done = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_dumpers, done)
        (result,) = await actor.dump_all(TRIGGER, [target], artifact_dir=tmp_path / "out")
        done.set()
    deadline = time.monotonic() + 60
    while not theirs.exists() or not theirs.read_text():
        assert time.monotonic() < deadline, "the target's own dump never ended"
        await anyio.sleep(0.05)
    runs = [json.loads(line) for line in theirs.read_text().splitlines()]
    assert [r["returncode"] for r in runs] == [0], runs  # theirs: --native, first try
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.pyspy.waited_for_pid"] in seen | {proc.pid}
    assert result.attributes["servewatch.pyspy.native"] is True
    note = str(result.attributes[pyspy_module.NOTE_ATTR])
    assert note.startswith("SGLang's own watchdog fired: it ran py-spy pid "), note
    assert f"started by pid {proc.pid}" in note, note
    assert result.attributes["servewatch.pyspy.server_watchdog_pid"] in seen


async def test_same_pid_twice_is_serialized(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    other = _titled(spawn, python, "sglang::scheduler_TP1")
    exe, log = _stub(tmp_path, "slow")
    actor = PySpyActor(PySpyConfig(executable=exe, native=False, max_concurrency=8))
    results = await actor.dump_all(TRIGGER, [target, other, target], artifact_dir=tmp_path)
    assert [r.outcome for r in results] == [Outcome.OK] * 3
    spans: dict[int, list[tuple[int, int]]] = {}
    starts: dict[int, int] = {}
    for run in _runs(log):
        pid = int(run["argv"][run["argv"].index("--pid") + 1])
        if run["event"] == "start":
            starts[run["pid"]] = run["time_ns"]
        else:
            spans.setdefault(pid, []).append((starts[run["pid"]], run["time_ns"]))
    (first, second) = sorted(spans[target.pid])
    assert first[1] <= second[0], "two dumps of one pid overlapped"
    assert len(spans[other.pid]) == 1
    # each dump keeps its own files
    assert results[0].artifact_paths != results[2].artifact_paths
    assert {Path(p).name for p in results[0].artifact_paths + results[2].artifact_paths} == {
        f"pyspy-{target.pid}.json", f"pyspy-{target.pid}.txt", f"pyspy-{target.pid}-2.json", f"pyspy-{target.pid}-2.txt"
    }


async def test_capacity_limit_bounds_concurrent_pyspy(spawn, python, tmp_path: Path) -> None:
    targets = [_titled(spawn, python, f"demo::scheduler_TP{i}") for i in range(3)]
    exe, log = _stub(tmp_path, "slow")
    actor = PySpyActor(PySpyConfig(executable=exe, native=False, max_concurrency=1))
    results = await actor.dump_all(TRIGGER, targets, artifact_dir=tmp_path)
    assert [r.outcome for r in results] == [Outcome.OK] * 3
    events = sorted((run["time_ns"], run["event"]) for run in _runs(log))
    running = peak = 0
    for _, event in events:
        running += 1 if event == "start" else -1
        peak = max(peak, running)
    assert peak == 1


async def test_not_python_process_is_not_python_without_retry(spawn, tmp_path: Path) -> None:
    sleeper = spawn(["/bin/sleep", "60"])
    target = target_of(sleeper.pid)
    assert target is not None
    actor = PySpyActor()
    result = await actor.act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.NOT_PYTHON, result.detail
    assert result.attributes["servewatch.pyspy.attempts"] == 1
    assert result.attributes["servewatch.pyspy.exit_code"] == 1
    assert result.retryable is False
    (err,) = result.artifact_paths
    assert "Failed to find python version" in Path(err).read_text(encoding="utf-8")


async def test_dead_pid_is_no_such_process_without_running_pyspy(tmp_path: Path) -> None:
    actor = PySpyActor()
    result = await actor.act(TRIGGER, Target(pid=_reaped_pid()), timeout_s=5, artifact_dir=tmp_path)
    assert result.outcome is Outcome.NO_SUCH_PROCESS
    assert actor.statistics().attempts == 0


async def test_zombie_is_reported_dead_with_its_exit_code(spawn, tmp_path: Path) -> None:
    zombie = spawn([sys.executable, "-c", "import sys; sys.exit(7)"])  # not waited for until teardown
    assert _wait_dead(zombie.pid) is ProcessState.ZOMBIE
    actor = PySpyActor()
    result = await actor.act(TRIGGER, Target(pid=zombie.pid), timeout_s=5, artifact_dir=tmp_path)
    assert result.outcome is Outcome.DEAD
    assert result.attributes["servewatch.target.state"] == "zombie"
    assert result.attributes["process.exit.code"] == 7
    assert "is dead (exit code 7; zombie" in result.detail
    assert actor.statistics().attempts == 0


async def test_permission_denied_for_real_as_unprivileged_user(spawn, python, tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    real = default_executable()
    if os.geteuid() != 0 or setpriv is None or real is None:
        pytest.skip("needs root and setpriv to run py-spy as 'nobody' against a root-owned target")
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    wrapper = tmp_path / "py-spy-as-nobody"
    wrapper.write_text(
        f"#!{sys.executable}\nimport os, sys\n"
        f"os.execv({setpriv!r}, [{setpriv!r}, '--reuid=65534', '--regid=65534', '--clear-groups', {real!r}, *sys.argv[1:]])\n",
        encoding="utf-8",
    )
    wrapper.chmod(0o755)
    result = await PySpyActor(PySpyConfig(executable=str(wrapper))).act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.PERMISSION_DENIED, result.detail
    # servewatch itself is root here: the hint is about root's ptrace (never "run as root")
    assert "CAP_SYS_PTRACE" in result.detail and permission_hint() in result.detail
    assert "run servewatch as root" not in result.detail
    # no retry without --native; one retry after a pause (nobody attached: a tracer may have gone)
    assert result.attributes["servewatch.pyspy.attempts"] == 2
    assert result.attributes["servewatch.pyspy.retried_after_denial"] is True


# --- stubs for the failure classes -----------------------------------------------------------


async def test_hung_pyspy_times_out_and_its_process_group_is_killed(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, log = _stub(tmp_path, "hang")
    actor = PySpyActor(PySpyConfig(executable=exe, timeout_s=3.0, native=False))
    result = await actor.act(TRIGGER, target, timeout_s=10, artifact_dir=tmp_path)
    assert result.outcome is Outcome.TIMED_OUT, result.detail
    assert result.retryable is True
    assert result.attributes["servewatch.pyspy.attempts"] == 1
    assert result.attributes["servewatch.pyspy.killed"] is True
    (run,) = _runs(log)  # the stub logs within its first second; it was given three
    assert _wait_dead(run["pid"]) is ProcessState.GONE  # killed and reaped by the actor
    assert _wait_dead(run["child_pid"]) in (ProcessState.GONE, ProcessState.ZOMBIE)  # its group too
    assert actor.statistics().groups_killed == 1
    assert process_state(target.pid) is ProcessState.RUNNING


async def test_native_timeout_gets_one_plain_attempt_within_the_budget(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, _ = _stub(tmp_path, "hang")
    actor = PySpyActor(PySpyConfig(executable=exe, timeout_s=0.5))
    result = await actor.act(TRIGGER, target, timeout_s=5, artifact_dir=tmp_path)
    assert result.outcome is Outcome.TIMED_OUT
    assert result.attributes["servewatch.pyspy.attempts"] == 2
    assert result.attributes["servewatch.pyspy.native"] is False  # the last attempt was plain
    assert actor.statistics().groups_killed == 2
    assert actor.native_enabled  # a timeout says nothing about --native support
    # no budget left after the first timeout: no second attempt
    short = await actor.act(TRIGGER, target, timeout_s=0.5, artifact_dir=tmp_path)
    assert short.outcome is Outcome.TIMED_OUT
    assert short.attributes["servewatch.pyspy.attempts"] == 1


async def test_cancelled_dump_still_kills_pyspy(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, log = _stub(tmp_path, "hang")
    actor = PySpyActor(PySpyConfig(executable=exe, timeout_s=60))
    with anyio.move_on_after(60) as outer:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: actor.act(TRIGGER, target, timeout_s=60, artifact_dir=tmp_path))
            while not _runs(log):  # bounded by the outer scope
                await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
    assert not outer.cancelled_caught
    (run,) = _runs(log)
    assert _wait_dead(run["pid"]) is ProcessState.GONE
    assert _wait_dead(run["child_pid"]) in (ProcessState.GONE, ProcessState.ZOMBIE)


async def test_stopped_target_is_continued_after_a_killed_attempt(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    os.kill(target.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while process_state(target.pid) is not ProcessState.STOPPED and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    assert process_state(target.pid) is ProcessState.STOPPED
    exe, _ = _stub(tmp_path, "hang")
    actor = PySpyActor(PySpyConfig(executable=exe, timeout_s=0.5, native=False))
    result = await actor.act(TRIGGER, target, timeout_s=5, artifact_dir=tmp_path)
    assert result.outcome is Outcome.TIMED_OUT
    assert process_state(target.pid) is ProcessState.RUNNING
    assert actor.statistics().targets_continued == 1


async def test_a_target_stopped_by_sigstop_is_dumped_nonblocking_said_stopped_and_left_stopped(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    os.kill(target.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while process_state(target.pid) is not ProcessState.STOPPED and time.monotonic() < deadline:
            await anyio.sleep(0.02)
        assert process_state(target.pid) is ProcessState.STOPPED
        result = await PySpyActor().act(TRIGGER, target, timeout_s=30, artifact_dir=tmp_path)  # real py-spy
        # py-spy cannot suspend a stopped process, but --nonblocking reads it (it does not run)
        assert result.outcome is Outcome.OK, result.detail
        assert result.detail.startswith(f"pid {target.pid} is stopped (state T")
        assert f"kill -CONT {target.pid}" in result.detail and "dumped with --nonblocking" in result.detail
        assert result.attributes["servewatch.pyspy.target_stopped"] is True
        assert result.attributes["servewatch.pyspy.nonblocking"] is True
        assert result.attributes["servewatch.pyspy.attempts"] == 1
        assert "--nonblocking" in Path(result.artifact_paths[0]).with_suffix(".txt").read_text()
        assert process_state(target.pid) is ProcessState.STOPPED  # the operator's stop is theirs to end
    finally:
        os.kill(target.pid, signal.SIGCONT)


async def test_native_unsupported_is_retried_plain_and_remembered(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, log = _stub(tmp_path, "native-unsupported")
    actor = PySpyActor(PySpyConfig(executable=exe))
    assert actor.native_enabled
    first = await actor.act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert first.outcome is Outcome.OK, first.detail
    assert first.attributes["servewatch.pyspy.attempts"] == 2
    assert first.attributes["servewatch.pyspy.native"] is False
    assert str(first.attributes["servewatch.pyspy.hung_frame"]).startswith(HUNG)
    assert not actor.native_enabled

    second = await actor.act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert second.outcome is Outcome.OK
    assert second.attributes["servewatch.pyspy.attempts"] == 1
    assert ["--native" in r["argv"] for r in _runs(log)] == [True, False, False]


async def test_native_failure_falls_back_without_forgetting_native(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, log = _stub(tmp_path, "native-fails")
    actor = PySpyActor(PySpyConfig(executable=exe))
    result = await actor.act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail  # exit 1 with stdout is still a failure
    assert result.attributes["servewatch.pyspy.attempts"] == 2
    assert actor.native_enabled
    assert ["--native" in r["argv"] for r in _runs(log)] == [True, False]


async def test_permission_denied_message_is_classified_with_hint_and_retried_once(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, log = _stub(tmp_path, "permission-denied")
    result = await PySpyActor(PySpyConfig(executable=exe)).act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.PERMISSION_DENIED
    assert permission_hint() in result.detail
    if os.geteuid() == 0:  # already root: no "run as root" advice
        assert "run servewatch as root" not in result.detail
    assert result.retryable is False
    # a denial with nobody attached is retried once (a tracer may have come and gone), no more
    assert len(_runs(log)) == 2
    assert result.attributes["servewatch.pyspy.retried_after_denial"] is True
    assert "Permission Denied" in Path(result.artifact_paths[0]).read_text(encoding="utf-8")


async def test_a_denial_with_nobody_attached_any_more_is_retried_and_dumps(spawn, python, tmp_path: Path) -> None:
    """Two dumps of one target at once: the other's py-spy held it at our attach and had let go
    by the time we asked who: one retry gets the stacks."""
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, log = _stub(tmp_path, "permission-denied-once")
    result = await PySpyActor(PySpyConfig(executable=exe)).act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert result.attributes["servewatch.pyspy.retried_after_denial"] is True
    assert HUNG in result.detail
    assert len(_runs(log)) == 2


async def test_a_dump_that_collides_with_another_py_spy_twice_in_a_row_waits_each_out_and_dumps(spawn, python, tmp_path: Path) -> None:
    """A tool dumping the target back to back (SGLang's watchdog and its fallback) can attach in
    the instant between our look and our attach, twice in a row: each collision is waited out
    (the other py-spy is seen aimed at the target) and the third try gets the stacks."""
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, log = _stub(tmp_path, "collides-twice")
    result = await PySpyActor(PySpyConfig(executable=exe)).act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert HUNG in result.detail
    assert result.attributes["servewatch.pyspy.collision_retries"] == 2
    assert result.attributes["servewatch.pyspy.retried_after_collision"] is True
    assert result.attributes["servewatch.pyspy.waited_for_pid"] > 0
    assert len(_runs(log)) == 3


async def test_a_failed_interpreter_lookup_of_a_python_process_is_retried_once_and_dumps(spawn, python, tmp_path: Path) -> None:
    """py-spy reads the interpreter's state before it suspends the target, so a thread starting
    or ending at that instant fails the lookup ("not a Python process") once: CI saw it on a real
    vLLM worker, whose dump was then called a stack too deep for py-spy. One retry gets the stacks."""
    target = _titled(spawn, python, "VLLM::Worker_TP0")
    exe, log = _stub(tmp_path, "not-python-once")
    result = await PySpyActor(PySpyConfig(executable=exe)).act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    assert HUNG in result.detail
    assert result.attributes["servewatch.pyspy.retried_not_python"] is True
    assert result.attributes["servewatch.pyspy.attempts"] == 2
    assert ["--native" in r["argv"] for r in _runs(log)] == [True, True]


async def test_exit_zero_with_unreadable_json_is_failed(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, _ = _stub(tmp_path, "garbage")
    result = await PySpyActor(PySpyConfig(executable=exe)).act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.FAILED
    assert "unreadable" in result.detail


async def test_missing_pyspy_is_missing_tool_and_a_permanent_error(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    actor = PySpyActor(PySpyConfig(executable=str(tmp_path / "no-such-py-spy")))
    status, hint = actor.check()
    assert status is ComponentStatus.PERMANENT_ERROR
    assert "pip install py-spy" in hint
    result = await actor.act(TRIGGER, target, timeout_s=5, artifact_dir=tmp_path)
    assert result.outcome is Outcome.MISSING_TOOL
    assert result.retryable is False
    assert PySpyActor(PySpyConfig(executable=None)).check()[0] is ComponentStatus.PERMANENT_ERROR
    assert PySpyActor().check()[0] is ComponentStatus.OK


async def test_pyspy_that_cannot_start_is_missing_tool(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    broken = tmp_path / "py-spy"
    broken.write_text("#!/nonexistent/interpreter\n", encoding="utf-8")
    broken.chmod(0o755)
    actor = PySpyActor(PySpyConfig(executable=str(broken)))
    assert actor.check()[0] is ComponentStatus.OK  # looks fine until exec
    result = await actor.act(TRIGGER, target, timeout_s=5, artifact_dir=tmp_path)
    assert result.outcome is Outcome.MISSING_TOOL
    assert "could not start py-spy" in result.detail
    assert result.attributes["servewatch.pyspy.attempts"] == 1  # no retry without --native


async def test_locals_are_opt_in(spawn, python, tmp_path: Path) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    exe, log = _stub(tmp_path, "slow")
    default = await PySpyActor(PySpyConfig(executable=exe)).act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path / "a")
    opted = await PySpyActor(PySpyConfig(executable=exe, locals=True)).act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path / "b")
    assert default.outcome is Outcome.OK and opted.outcome is Outcome.OK
    assert ["--locals" in r["argv"] for r in _runs(log) if r["event"] == "start"] == [False, True]
    frames = [f for t in json.loads(Path(opted.artifact_paths[0]).read_text(encoding="utf-8")) for f in t["frames"]]
    assert any(f["locals"] for f in frames)  # the file has them...
    assert "stop_at_monotonic_s" not in repr(dict(opted.attributes))  # ...the span does not


# --- units: config, classifier, parser ------------------------------------------------------


def test_exports_match_all() -> None:
    public = {n for n in dir(pyspy_module) if not n.startswith("_")}
    exported = {n for n in public if getattr(getattr(pyspy_module, n), "__module__", None) == "agent.actors.pyspy"}
    # default_executable lives in agent.early (the console entry needs it before any import);
    # PySpyConfig in agent.actors.config (the settings model the registry names, light to import)
    assert exported | {"ACTION", "NOTE_ATTR", "PERMISSION_HINT", "PYSPY_MAX_DEPTH", "default_executable", "PySpyConfig"} == set(
        pyspy_module.__all__)


def test_default_config_is_valid_and_finds_pyspy() -> None:
    config = PySpyConfig()
    assert config.executable is not None and os.access(config.executable, os.X_OK)
    assert (config.timeout_s, config.native, config.nonblocking) == (10.0, True, False)
    assert config.max_concurrency == max(8, 2 * (os.cpu_count() or 1))
    with pytest.raises(pydantic.ValidationError, match="timeout_s"):
        PySpyConfig(timeout_s=0)
    with pytest.raises(pydantic.ValidationError, match="max_concurrency"):
        PySpyConfig(max_concurrency=0)
    with pytest.raises(pydantic.ValidationError, match="natve"):
        PySpyConfig.model_validate({"natve": False})


def test_nonblocking_disables_native() -> None:
    assert PySpyActor(PySpyConfig(nonblocking=True)).native_enabled is False


# Real stderr of py-spy 0.4.3 (RUST_BACKTRACE=0) captured on this machine, plus py-spy's own
# messages from its source for what this machine cannot show (no native support, root in docker).
_GONE = "Error: Failed to get process executable name. Check that the process is running.\n\nCaused by:\n    0: No such file or directory (os error 2)\n"
_NOT_PY = "Error: Failed to find python version from target process\n"
_PERM = "Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'\n"
_PERM_DOCKER = "Permission Denied\n\nIt looks like you are running in a docker container. Please make sure you started your container with the SYS_PTRACE capability.\n"
_NATIVE = "Collecting stack traces from native extensions (`--native`) is not supported on your platform.\n"
_CLAP = "error: unexpected argument '--native' found\n\nUsage: py-spy dump [OPTIONS]\n"
_TOO_NEW = "Error: Unsupported version of Python: 3.99.0\n"
# Seen in the field: root without CAP_SYS_PTRACE, and a pid that exited during the dump.
_PERM_ROOT = "Error: Failed to copy Py_Version symbol\n\nCaused by:\n    0: Permission denied (os error 13)\n"
_ESRCH = "Error: No such process (os error 3)\n"
# py-spy 0.4 on a SIGSTOPped target (as root)
_SUSPEND = (
    "Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend process\n"
    "    1: unexpected waitpid result PtraceEvent(Pid(42), SIGSTOP, 128) to 42\n"
)

# py-spy 0.4.3 on a target another tracer (py-spy, ptrace_holder.py) holds attached, captured here:
# the memory read works, the attach does not
_COLLIDE = (
    "Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend process\n"
    "    1: EPERM: Operation not permitted\n    2: EPERM: Operation not permitted\n"
)


@pytest.mark.parametrize(
    ("rc", "stderr", "native", "timed_out", "state", "expected"),
    [
        (0, "", True, False, ProcessState.RUNNING, Classification(Outcome.OK)),
        (None, "", True, True, ProcessState.RUNNING, (Outcome.TIMED_OUT, True, False, True)),
        (None, "", False, True, ProcessState.RUNNING, (Outcome.TIMED_OUT, False, False, True)),
        (1, _GONE, True, False, ProcessState.GONE, (Outcome.NO_SUCH_PROCESS, False, False, False)),
        (1, _GONE, True, False, ProcessState.ZOMBIE, (Outcome.ZOMBIE, False, False, False)),
        (1, _GONE, True, False, ProcessState.RUNNING, (Outcome.NO_SUCH_PROCESS, False, False, False)),
        (1, _NOT_PY, True, False, ProcessState.RUNNING, (Outcome.NOT_PYTHON, False, False, False)),
        (1, _PERM, True, False, ProcessState.RUNNING, (Outcome.PERMISSION_DENIED, False, False, False)),
        (1, _PERM_DOCKER, True, False, ProcessState.RUNNING, (Outcome.PERMISSION_DENIED, False, False, False)),
        (1, _PERM_ROOT, True, False, ProcessState.RUNNING, (Outcome.PERMISSION_DENIED, False, False, False)),
        (1, _ESRCH, True, False, ProcessState.RUNNING, (Outcome.NO_SUCH_PROCESS, False, False, False)),
        (1, _ESRCH, True, False, ProcessState.GONE, (Outcome.NO_SUCH_PROCESS, False, False, False)),
        (1, _NATIVE, True, False, ProcessState.RUNNING, (Outcome.UNSUPPORTED, True, True, False)),
        (2, _CLAP, True, False, ProcessState.RUNNING, (Outcome.UNSUPPORTED, True, True, False)),
        (1, _TOO_NEW, True, False, ProcessState.RUNNING, (Outcome.UNSUPPORTED, False, False, False)),
        (1, "Error: Failed to copy PyThreadState\n", True, False, ProcessState.RUNNING, (Outcome.FAILED, True, False, True)),
        (1, "Error: Failed to copy PyThreadState\n", False, False, ProcessState.RUNNING, (Outcome.FAILED, False, False, True)),
        (-9, "", False, False, ProcessState.RUNNING, (Outcome.FAILED, False, False, True)),
        (1, _SUSPEND, True, False, ProcessState.STOPPED, (Outcome.FAILED, False, False, True)),
        (1, _SUSPEND, True, False, ProcessState.RUNNING, (Outcome.FAILED, True, False, True)),
        (1, _COLLIDE, True, False, ProcessState.RUNNING, (Outcome.FAILED, False, False, True)),
        (1, _COLLIDE, False, False, ProcessState.RUNNING, (Outcome.FAILED, False, False, True)),
    ],
)
def test_classify_table(rc, stderr, native, timed_out, state, expected) -> None:
    got = classify(rc, stderr, native=native, timed_out=timed_out, target_state=state, pid=42)
    if isinstance(expected, Classification):
        assert got == expected
    else:
        assert (got.outcome, got.retry_plain, got.native_unsupported, got.retryable) == expected
        assert got.detail and "\n" not in got.detail


def test_a_refused_attach_is_a_collision_not_a_permission_problem() -> None:
    got = classify(1, _COLLIDE, native=True, pid=42)
    assert got.collided and got.outcome is Outcome.FAILED and got.retryable
    assert "another tracer was attached" in got.detail and "CAP_SYS_PTRACE" not in got.detail
    assert not classify(1, _COLLIDE, native=True, pid=42, target_state=ProcessState.STOPPED).collided
    assert not classify(1, _SUSPEND, native=True, pid=42).collided


def test_classify_detail_names_the_signal_and_error() -> None:
    assert "signal 9" in classify(-9, "", native=False, pid=7).detail
    assert "Failed to copy PyThreadState" in classify(1, "Error: Failed to copy PyThreadState\n", native=False, pid=7).detail


def test_parse_render_and_summary_of_a_recorded_dump() -> None:
    dump = [
        {
            "pid": 10, "thread_id": 2, "thread_name": "worker", "os_thread_id": 11, "active": False, "owns_gil": False,
            "frames": [{"name": "wait", "filename": "/usr/lib/python3.11/threading.py", "short_filename": "threading.py", "line": 320, "module": None}],
        },
        {
            "pid": 10, "thread_id": 1, "thread_name": "MainThread", "os_thread_id": 10, "active": True, "owns_gil": True,
            "frames": [
                {"name": "0x7f00", "filename": "/lib/libc.so.6", "short_filename": "libc.so.6", "line": 0, "module": "/lib/libc.so.6"},
                {"name": "ncclAllReduce", "filename": "/x/libnccl.so.2", "short_filename": "libnccl.so.2", "line": 0, "module": "/x/libnccl.so.2"},
                {"name": "Event.wait", "filename": "/usr/lib/python3.11/threading.py", "short_filename": "threading.py", "line": 629, "module": None},
                {"name": "all_reduce", "filename": "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", "short_filename": "torch/distributed/c10d.py", "line": 2501, "module": None},
                {"name": "forward", "filename": "/srv/model.py", "short_filename": "model.py", "line": 7, "module": None},
            ],
        },
    ]
    threads = parse_dump(json.dumps(dump))
    assert [t.thread_name for t in threads] == ["MainThread", "worker"]
    # site-packages is not the standard library: torch's frame is where it hangs
    assert hung_frame(threads) == "all_reduce (torch/distributed/c10d.py:2501)"
    assert summarize(threads, max_frames=3) == (
        "MainThread: ncclAllReduce (libnccl.so.2)",
        "MainThread: Event.wait (threading.py:629)",
        "MainThread: all_reduce (torch/distributed/c10d.py:2501)",
        "worker: wait (threading.py:320)",
    )
    text = render_text(threads, header="Process 10: sglang::scheduler_TP0")
    assert text.splitlines()[:3] == [
        "Process 10: sglang::scheduler_TP0",
        'Thread 10 (active, gil): "MainThread"',
        "    0x7f00 (libc.so.6)",
    ]
    assert '    wait (threading.py:320)' in text
    assert hung_frame([]) == ""


@pytest.mark.parametrize("bad", ["{}", "[1]", "not json"])
def test_parse_dump_rejects_what_is_not_a_thread_list(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_dump(bad)


@pytest.mark.parametrize(
    ("euid", "cap", "scope", "says", "never"),
    [
        (1000, None, None, "run servewatch as root", "runs as root"),
        (0, False, "1", "runs as root but without CAP_SYS_PTRACE", "run servewatch as root"),
        (0, True, "3", "Yama ptrace_scope is 3 (3: ptrace is off for everyone", "run servewatch as root"),
        (0, True, "1", "seccomp/AppArmor/SELinux", "run servewatch as root"),
    ],
)
def test_permission_hint_never_tells_root_to_run_as_root(euid: int, cap: bool | None, scope: str | None, says: str, never: str) -> None:
    hint = permission_hint(euid=euid, cap_sys_ptrace=cap, ptrace_scope=scope)
    assert says in hint and never not in hint


def _libpython_or_binary() -> Path:
    """The file this interpreter takes its Python runtime from: its libpython when it links one
    (py-spy then reads that), else its executable."""
    with open("/proc/self/maps", encoding="utf-8") as fh:
        for line in fh:
            path = line.split(None, 5)[-1].strip()
            if "/libpython3" in path:
                return Path(path)
    return Path(os.path.realpath(sys.executable))


async def test_a_python_whose_libpython_was_deleted_since_it_started_is_said_so_once(spawn, tmp_path: Path) -> None:
    """py-spy #109 on its real shape: the target's libpython (or its python, when static) removed
    after it started, as an upgrade under a running server does: py-spy fails "No such file or
    directory (os error 2)", with or without --native. One attempt, and the detail names the file."""
    runtime = _libpython_or_binary()
    copy_dir = tmp_path / "gone"
    copy_dir.mkdir()
    copy = copy_dir / runtime.name
    shutil.copy2(runtime, copy)
    if "libpython" in runtime.name:
        argv, env = [os.path.realpath(sys.executable)], {**os.environ, "LD_LIBRARY_PATH": str(copy_dir)}
    else:
        argv, env = [str(copy)], dict(os.environ)
    proc = spawn([*argv, "-c", "import sys, time; print('ready', flush=True); time.sleep(60)"], env=env, stdout=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"ready")
    assert str(copy) in Path(f"/proc/{proc.pid}/maps").read_text(), "the copy is not what the target runs"
    copy.unlink()
    target = target_of(proc.pid)
    assert target is not None
    result = await PySpyActor().act(TRIGGER, target, timeout_s=20, artifact_dir=tmp_path)
    assert result.outcome is Outcome.FAILED and result.retryable is False, result.detail
    assert result.attributes["servewatch.pyspy.attempts"] == 1  # no plain retry: it cannot help
    assert result.detail.startswith(f"py-spy cannot read pid {proc.pid}: {copy}, which it maps, was deleted or replaced"), result.detail
    assert result.attributes["servewatch.pyspy.deleted_files"][0] == str(copy)
    assert "No such file or directory" in Path(result.artifact_paths[0]).read_text(encoding="utf-8")
