"""py-spy evidence on the shapes real deployments have, end to end through `servewatch dump`
(manifest and span files asserted): a target another tool holds ptrace-attached, a native frame
py-spy cannot resolve, names that are not UTF-8, idle threads, and dead ranks."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

from agent.actors.pyspy import default_executable
from agent.host.procinfo import tracer_of
from agent.model.stacks import (
    Frame,
    ThreadStack,
    hung_frame,
    idle_and_stuck,
    parse_dump,
    thread_is_idle,
)
from tests.conftest import PROGRAMS_DIR
from tests.spanfiles import file_spans

CLI = [sys.executable, "-m", "agent.cli.app"]


def ready(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> str:
    assert proc.stdout is not None
    got, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert got, "program did not start"
    line = proc.stdout.readline().decode()
    assert line.split()[:1] in (["ready"], ["attached"]), line
    return line


def dump(tmp_path: Path, pid: int, *extra: str, data: str = "data", env_extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
    """`servewatch dump --pid PID`; returns the run, its manifest and its spans."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), SERVEWATCH_COREDUMP__ENABLED="false", **(env_extra or {}))
    r = subprocess.run(
        [*CLI, "dump", "--pid", str(pid), "--data-dir", data, *extra],
        capture_output=True, text=True, timeout=110, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, check=False,
    )
    (manifest_path,) = (tmp_path / data).glob("*/*/manifest.json")
    return r, json.loads(manifest_path.read_text()), file_spans(tmp_path / data)


def pyspy_action(manifest: dict[str, Any], pid: int) -> dict[str, Any]:
    (action,) = [a for a in manifest["actions"] if a["action"] == "pyspy.dump" and a["pid"] == pid]
    return action


def artifact(tmp_path: Path, action: dict[str, Any], suffix: str) -> Path:
    """The action's artifact ending in ``suffix`` (paths in the manifest are as the CLI saw them)."""
    return tmp_path / next(p for p in action["artifact_paths"] if p.endswith(suffix))


def pyspy_span(spans: list[dict[str, Any]], pid: int) -> dict[str, Any]:
    (span,) = [s for s in spans if s["name"] == "pyspy.dump" and s["attributes"].get("process.pid") == pid]
    return span


def test_target_held_by_another_tracer_is_dumped_nonblocking_and_says_who(spawn, python, tmp_path: Path) -> None:
    target = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), "sglang::scheduler_TP0", "--max-lifetime-s", "90"],
                   stdout=subprocess.PIPE)
    ready(target)
    holder = spawn([python, str(PROGRAMS_DIR / "ptrace_holder.py"), str(target.pid), "--max-lifetime-s", "90"],
                   stdout=subprocess.PIPE)
    ready(holder)
    try:
        _traced_target_is_dumped(tmp_path, target.pid, holder.pid)
    finally:  # the tracer goes first: a traced child can only be reaped once its tracer let go
        holder.kill()
        holder.wait(timeout=30)


def _traced_target_is_dumped(tmp_path: Path, target_pid: int, holder_pid: int) -> None:
    tracer = tracer_of(target_pid)
    assert tracer is not None and tracer.pid == holder_pid

    # the real failure this avoids: a blocking dump of a traced target fails even as root
    plain = subprocess.run([str(default_executable()), "dump", "--pid", str(target_pid)], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, RUST_BACKTRACE="0"), check=False)
    assert plain.returncode != 0

    r, manifest, spans = dump(tmp_path, target_pid)
    assert r.returncode == 0, r.stderr
    action = pyspy_action(manifest, target_pid)
    assert action["outcome"] == "ok", action
    attrs = action["attributes"]
    assert attrs["servewatch.pyspy.traced_by_pid"] == holder_pid
    assert "ptrace_holder.py" in attrs["servewatch.pyspy.traced_by"]
    assert attrs["servewatch.pyspy.nonblocking"] is True and attrs["servewatch.pyspy.native"] is False
    assert f"ptrace-attached by pid {holder_pid}" in action["detail"] and "--nonblocking" in action["detail"]
    assert attrs["servewatch.pyspy.hung_frame"].startswith("hung_in_fake_allreduce (")
    text = artifact(tmp_path, action, ".txt").read_text()
    assert "--nonblocking" in text and "ptrace-attached" in text
    span = pyspy_span(spans, target_pid)
    assert span["attributes"]["servewatch.pyspy.traced_by_pid"] == holder_pid
    assert span["attributes"]["servewatch.pyspy.nonblocking"] is True


def test_unresolved_native_frame_is_never_the_hung_frame(spawn, python, tmp_path: Path) -> None:
    target = spawn([python, str(PROGRAMS_DIR / "native_blocker.py"), "--max-lifetime-s", "90"], stdout=subprocess.PIPE)
    ready(target)
    r, manifest, spans = dump(tmp_path, target.pid)
    assert r.returncode == 0, r.stderr
    action = pyspy_action(manifest, target.pid)
    assert action["outcome"] == "ok" and action["attributes"]["servewatch.pyspy.native"] is True, action
    threads = parse_dump(artifact(tmp_path, action, ".json").read_bytes())
    frames = threads[0].frames
    unresolved = [f for f in frames if f.unresolved]
    assert unresolved, [f.describe() for f in frames]  # the deleted extension's frame, as py-spy reports it
    assert all(f.module is None and f.filename == "?" for f in unresolved)
    hung = action["attributes"]["servewatch.pyspy.hung_frame"]
    assert hung.startswith("main.<locals>.hung_in_python (") and "native_blocker.py:" in hung, hung
    assert pyspy_span(spans, target.pid)["attributes"]["servewatch.pyspy.hung_frame"] == hung


def test_invalid_utf8_names_never_lose_stacks_and_report_works(spawn, python, tmp_path: Path) -> None:
    target = spawn([python, str(PROGRAMS_DIR / "bad_names_target.py"), "--max-lifetime-s", "90"], stdout=subprocess.PIPE)
    ready(target)
    with open(f"/proc/{target.pid}/cmdline", "rb") as fh:
        assert fh.read().startswith(b"sched\xff\xfe_TP0\0")
    r, manifest, spans = dump(tmp_path, target.pid)
    assert r.returncode == 0, r.stderr
    (t,) = manifest["targets"]
    assert t["title"] == "sched\\xff\\xfe_TP0"
    action = pyspy_action(manifest, target.pid)
    assert action["outcome"] == "ok", action
    assert action["attributes"]["servewatch.pyspy.hung_frame"].startswith("hung_in_bad_names (")
    txt = artifact(tmp_path, action, ".txt")
    text = txt.read_text(encoding="utf-8")
    assert "sched\\xff\\xfe_TP0" in text and "hung_in_bad_names" in text
    span = pyspy_span(spans, target.pid)
    assert span["attributes"]["process.title"] == "sched\\xff\\xfe_TP0"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    for command in (["report", "-o", "report.html"], ["timeline"]):
        shown = subprocess.run([*CLI, *command, "--data-dir", "data"], capture_output=True, text=True, timeout=60,
                               cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, check=False)
        assert shown.returncode == 0, shown.stderr
    assert "hung_in_bad_names" in (tmp_path / "report.html").read_text(encoding="utf-8")


def test_idle_threads_are_not_hung_and_summary_says_which(spawn, python, tmp_path: Path) -> None:
    busy = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), "sglang::scheduler_TP0", "--threads", "2",
                  "--max-lifetime-s", "90"], stdout=subprocess.PIPE)
    ready(busy)
    idle = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), "sglang::scheduler_TP1", "--threads", "1", "--idle",
                  "--max-lifetime-s", "90"], stdout=subprocess.PIPE)
    ready(idle)

    r, manifest, spans = dump(tmp_path, busy.pid, "--pid", str(idle.pid))
    assert r.returncode == 0, r.stderr
    stuck = pyspy_action(manifest, busy.pid)
    assert stuck["attributes"]["servewatch.pyspy.hung_frame"].startswith("hung_in_fake_allreduce (")
    assert stuck["attributes"]["servewatch.pyspy.stuck_threads"] == ["MainThread"]
    assert sorted(stuck["attributes"]["servewatch.pyspy.idle_threads"]) == ["worker-0", "worker-1"]
    assert "stuck: MainThread; idle: worker-" in stuck["detail"]

    waiting = pyspy_action(manifest, idle.pid)
    assert waiting["outcome"] == "ok"
    assert waiting["attributes"]["servewatch.pyspy.hung_frame"] == ""
    assert sorted(waiting["attributes"]["servewatch.pyspy.idle_threads"]) == ["MainThread", "worker-0"]
    assert "all idle (waiting for work)" in waiting["detail"]
    span = pyspy_span(spans, idle.pid)
    assert sorted(span["attributes"]["servewatch.pyspy.idle_threads"]) == ["MainThread", "worker-0"]
    # the CLI summary says it too, and the timeline
    assert "all idle (waiting for work)" in r.stdout and "idle: " in r.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    shown = subprocess.run([*CLI, "timeline", "--data-dir", "data"], capture_output=True, text=True, timeout=60,
                           cwd=tmp_path, env=dict(env, COLUMNS="250"), stdin=subprocess.DEVNULL, check=False)
    assert shown.returncode == 0, shown.stderr
    assert "all threads idle (waiting for work)" in shown.stdout and "hung_in_fake_allreduce" in shown.stdout


def _thread(*frames: Frame, active: bool = False, name: str = "MainThread") -> ThreadStack:
    return ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name=name, active=active, frames=frames)


def test_hung_frame_rule_table() -> None:
    unresolved = Frame(name="0x7f00", filename="?", short_filename="?")
    libc = Frame(name="select", filename="/lib/libc.so.6", module="/lib/libc.so.6")
    user = Frame(name="hung_here", filename="/srv/model.py", line=7)
    cond = Frame(name="Condition.wait", filename="/usr/lib/python3.11/threading.py", line=320)
    qget = Frame(name="Queue.get", filename="/usr/lib/python3.11/queue.py", line=171)
    zmq = Frame(name="Socket.recv", filename="/venv/lib/python3.11/site-packages/zmq/sugar/socket.py", line=3)
    assert unresolved.unresolved and unresolved.native and not user.native
    assert hung_frame([_thread(libc, unresolved, user)]) == "hung_here (/srv/model.py:7)"
    assert hung_frame([_thread(libc, unresolved)]) == "select (/lib/libc.so.6)"  # never the unresolved one
    assert hung_frame([_thread(unresolved)]) == ""
    assert thread_is_idle(_thread(cond, qget, user)) and thread_is_idle(_thread(zmq, user))
    assert not thread_is_idle(_thread(cond, user)) and not thread_is_idle(_thread(cond, qget, user, active=True))
    threads = [_thread(cond, qget, user), _thread(cond, user, name="worker")]
    assert hung_frame(threads) == "hung_here (/srv/model.py:7)"  # the idle main thread is skipped
    assert idle_and_stuck(threads) == (("MainThread",), ("worker",))
    assert hung_frame([_thread(cond, qget, user)]) == ""


def test_parse_dump_keeps_stacks_with_invalid_utf8_bytes() -> None:
    raw = (b'[{"pid": 1, "thread_id": 1, "os_thread_id": 1, "thread_name": "w\xfe", "active": true,'
           b' "frames": [{"name": "f\xff", "filename": "/x/\xff.py", "short_filename": "\xff.py", "line": 3, "module": null}]}]')
    (thread,) = parse_dump(raw)
    assert thread.thread_name == "w\\xfe" and thread.frames[0].name == "f\\xff"
    assert thread.frames[0].describe().encode("utf-8")


def test_pyspy_switched_off_records_skipped(spawn, python, tmp_path: Path) -> None:
    target = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), "sglang::scheduler_TP0", "--max-lifetime-s", "90"],
                   stdout=subprocess.PIPE)
    ready(target)
    r, manifest, spans = dump(tmp_path, target.pid, env_extra={"SERVEWATCH_PYSPY__ENABLED": "false"})
    assert r.returncode == 1  # nothing was dumped: dump says so with its exit code
    action = pyspy_action(manifest, target.pid)
    assert action["outcome"] == "skipped" and "pyspy.enabled = false" in action["detail"]
    assert not action["artifact_paths"]
    assert pyspy_span(spans, target.pid)["attributes"]["servewatch.outcome"] == "skipped"


def test_a_target_held_by_another_py_spy_is_waited_for_then_dumped_blocking(spawn, python, tmp_path: Path) -> None:
    """Another py-spy attached (a second servewatch, SGLang's own helper): its attachment ends
    within its dump, so the dump waits for it and then reads a paused target (``--native``),
    instead of reading a running one. The holder is a real PTRACE_SEIZE whose command is py-spy."""
    target = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), "sglang::scheduler_TP0", "--max-lifetime-s", "90"],
                   stdout=subprocess.PIPE)
    ready(target)
    as_pyspy = tmp_path / "bin" / "py-spy"  # argv[0] of the holder reads py-spy, as a real one's does
    as_pyspy.parent.mkdir()
    as_pyspy.symlink_to(python)
    holder = spawn([str(as_pyspy), str(PROGRAMS_DIR / "ptrace_holder.py"), str(target.pid), "--max-lifetime-s", "3.0"],
                   stdout=subprocess.PIPE)
    ready(holder)
    assert (tracer := tracer_of(target.pid)) is not None and tracer.pid == holder.pid
    r, manifest, spans = dump(tmp_path, target.pid)
    assert r.returncode == 0, r.stderr
    action = pyspy_action(manifest, target.pid)
    assert action["outcome"] == "ok", action
    attrs = pyspy_span(spans, target.pid)["attributes"]
    assert attrs["servewatch.pyspy.waited_for_pid"] == holder.pid
    assert "servewatch.pyspy.nonblocking" not in attrs and attrs["servewatch.pyspy.native"] is True


def test_two_dumps_of_one_target_at_once_both_capture_its_stacks(spawn, python, tmp_path: Path) -> None:
    """Two `servewatch dump` of the same process started together (an operator's dump while
    `run` captures an incident): each py-spy may find the other attached; both dumps succeed."""
    target = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), "sglang::scheduler_TP0", "--max-lifetime-s", "90"],
                   stdout=subprocess.PIPE)
    ready(target)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), SERVEWATCH_COREDUMP__ENABLED="false")
    for round_ in range(3):
        runs = [
            subprocess.Popen([*CLI, "dump", "--pid", str(target.pid), "--data-dir", f"d{round_}-{i}"], cwd=tmp_path, env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)
        ]
        for i, run in enumerate(runs):
            _out, err = run.communicate(timeout=110)
            assert run.returncode == 0, err
            (manifest_path,) = (tmp_path / f"d{round_}-{i}").glob("*/*/manifest.json")
            action = pyspy_action(json.loads(manifest_path.read_text()), target.pid)
            assert action["outcome"] == "ok", action
    assert Path(f"/proc/{target.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("R", "S")
