"""Process discovery against real titled Python subprocesses (setproctitle), real zombies and
real exited pids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import psutil
import pytest

import agent.host.targets as targets_module
from agent.host.targets import (
    ProcessState,
    ScanErrors,
    Target,
    discover,
    process_state,
    psutil_errors,
    target_of,
)
from tests.conftest import PROGRAMS_DIR

TITLED = str(PROGRAMS_DIR / "titled_target.py")


def _start_titled(spawn: Callable[..., subprocess.Popen[bytes]], python: str, title: str, *extra: str) -> subprocess.Popen[bytes]:
    """Start titled_target.py and wait (bounded) for its ``ready`` line."""
    proc = spawn([python, TITLED, title, "--max-lifetime-s", "120", *extra], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the program prints "ready <pid>" or dies (EOF); pytest-timeout bounds it
    proc.stdout.close()  # it prints nothing after "ready"
    assert line.split() == [b"ready", str(proc.pid).encode()], line
    return proc


def _wait_for_state(pid: int, wanted: ProcessState, timeout_s: float = 10.0) -> ProcessState:
    deadline = time.monotonic() + timeout_s
    state = process_state(pid)
    while state is not wanted and time.monotonic() < deadline:
        time.sleep(0.02)
        state = process_state(pid)
    return state


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _reaped_pid(python: str) -> int:
    proc = subprocess.Popen([python, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_exports_match_all() -> None:
    public = {n for n in dir(targets_module) if not n.startswith("_")} - {"annotations"}
    exported = {n for n in public if getattr(getattr(targets_module, n), "__module__", "") == "agent.host.targets"}
    assert exported == set(targets_module.__all__)


def test_title_glob_matches_setproctitle_title_beyond_comm_limit(spawn, python) -> None:
    token = uuid.uuid4().hex[:8]
    tp0 = _start_titled(spawn, python, f"sglang::scheduler_TP0_{token}")
    tp1 = _start_titled(spawn, python, f"demo::scheduler_TP1_{token}")

    # The kernel's comm is cut at 15 characters; the full title lives in cmdline.
    with open(f"/proc/{tp0.pid}/comm", encoding="utf-8") as f:
        assert f.read().strip() == "sglang::schedul"

    found = discover(title_globs=[f"sglang::scheduler*_{token}"])
    assert [t.pid for t in found] == [tp0.pid]
    (target,) = found
    assert target.title == f"sglang::scheduler_TP0_{token}"
    assert target.cmdline == (f"sglang::scheduler_TP0_{token}",)  # setproctitle's padding removed
    assert target.create_time_s == pytest.approx(psutil.Process(tp0.pid).create_time())

    both = discover(title_globs=[f"sglang::*_{token}", f"demo::scheduler_TP?_{token}"])
    assert [t.pid for t in both] == sorted([tp0.pid, tp1.pid])
    assert discover(title_globs=[f"vllm::*_{token}"]) == []


def test_glob_matches_process_name_when_cmdline_is_a_path(spawn) -> None:
    sleeper = spawn(["/bin/sleep", "60"])
    assert _wait_for_state(sleeper.pid, ProcessState.RUNNING) is ProcessState.RUNNING
    found = {t.pid: t for t in discover(title_globs=["sleep"])}
    assert sleeper.pid in found
    assert found[sleeper.pid].title == "/bin/sleep"  # first cmdline element; the name matched
    assert found[sleeper.pid].cmdline == ("/bin/sleep", "60")


def test_descendants_of_root_are_found_recursively(spawn, python) -> None:
    root = _start_titled(
        spawn, python, _unique("demo::main"), "--child", "demo::dp_controller/demo::scheduler_TP0", "--child", "demo::detokenizer"
    )
    found = discover(root_pids=[root.pid])
    titles = {t.title for t in found}
    assert [t.pid for t in found] == sorted(t.pid for t in found)
    assert len(found) == 4
    assert {"demo::dp_controller", "demo::scheduler_TP0", "demo::detokenizer"} <= titles
    assert root.pid in {t.pid for t in found}
    grandchild = next(t for t in found if t.title == "demo::scheduler_TP0")
    assert psutil.Process(grandchild.pid).parent().parent().pid == root.pid

    without_root = discover(root_pids=[root.pid], include_roots=False)
    assert root.pid not in {t.pid for t in without_root}
    assert len(without_root) == 3


def test_a_pyspy_run_in_the_tree_is_no_target_unless_named_by_pid(spawn, python, tmp_path) -> None:
    """SGLang's soft watchdog runs ``sh -c 'py-spy dump --native --pid <scheduler>'`` from the
    scheduler: that shell and py-spy are in the server's tree for a second, a tool and not the
    server (no dump of them, no incident when they exit)."""
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!{python}\nimport time\ntime.sleep(60)\n")
    fake.chmod(0o755)
    code = ("import subprocess, sys\n"
            "kids = [subprocess.Popen([sys.argv[1], 'dump', '--native', '--pid', '1']),\n"
            "        subprocess.Popen(['/bin/sh', '-c', sys.argv[1] + ' dump --pid 1; true']),\n"
            "        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])]\n"
            "print('ready', *[k.pid for k in kids], flush=True)\n"
            "kids[0].wait()\n")  # fmt: skip
    root = spawn([python, "-c", code, str(fake)], stdout=subprocess.PIPE)
    assert root.stdout is not None
    words = root.stdout.readline().split()
    assert words[0] == b"ready", words
    pyspy, shell, plain = (int(w) for w in words[1:])
    deadline = time.monotonic() + 10
    while len(psutil.Process(root.pid).children(recursive=True)) < 4:  # the shell's own py-spy child too
        assert time.monotonic() < deadline
        time.sleep(0.02)
    found = {t.pid for t in discover(root_pids=[root.pid])}
    assert found == {root.pid, plain}, (found, pyspy, shell)
    assert pyspy in {t.pid for t in discover(pids=[pyspy])}  # an explicit pid is always a target
    assert targets_module.runs_pyspy(["/bin/sh", "-c", "py-spy dump --native --pid 42"])
    assert targets_module.runs_pyspy(["/usr/bin/py-spy", "dump", "--pid", "42"])
    assert not targets_module.runs_pyspy(["python", "-m", "sglang.launch_server"])
    assert not targets_module.runs_pyspy(["/bin/sh", "-c", "sleep 1"])


def test_union_of_sources_is_deduplicated_and_sorted(spawn, python) -> None:
    title = _unique("sglang::scheduler_TP3")
    a = _start_titled(spawn, python, title)
    b = _start_titled(spawn, python, _unique("demo::other"))
    found = discover(root_pids=[a.pid], title_globs=[title], pids=[b.pid, a.pid, b.pid])
    assert [t.pid for t in found] == sorted([a.pid, b.pid])


def test_own_pid_is_never_a_target() -> None:
    me = os.getpid()
    assert discover(pids=[me]) == []
    assert me not in {t.pid for t in discover(root_pids=[os.getppid()])}


def test_exited_pid_is_skipped_and_counted(python) -> None:
    gone = _reaped_pid(python)
    errors = ScanErrors()
    assert discover(pids=[gone], root_pids=[gone], errors=errors) == []
    assert errors.vanished == 2
    assert errors.last is ProcessState.GONE
    assert target_of(gone) is None
    assert process_state(gone) is ProcessState.GONE


def test_zombie_is_skipped_by_every_source(spawn, python) -> None:
    title = _unique("demo::zombie_parent")
    parent = _start_titled(spawn, python, title)
    zombie = spawn([python, "-c", "pass"])  # never waited for until teardown: stays a zombie
    assert _wait_for_state(zombie.pid, ProcessState.ZOMBIE) is ProcessState.ZOMBIE

    errors = ScanErrors()
    assert discover(pids=[zombie.pid], errors=errors) == []
    assert errors.zombies == 1
    assert errors.last is ProcessState.ZOMBIE
    # Our own children (the zombie among them) are skipped, live ones found.
    children = {t.pid for t in discover(root_pids=[os.getpid()], include_roots=False)}
    assert parent.pid in children
    assert zombie.pid not in children


def test_process_state_tells_stopped_running_and_reused(spawn, python) -> None:
    proc = _start_titled(spawn, python, _unique("demo::stopped"))
    target = target_of(proc.pid)
    assert target is not None and target.pid == proc.pid
    assert process_state(proc.pid, create_time_s=target.create_time_s) is ProcessState.RUNNING
    # Same pid, different creation time: the process we meant is gone (pid reuse).
    assert process_state(proc.pid, create_time_s=target.create_time_s - 3600) is ProcessState.GONE
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        assert _wait_for_state(proc.pid, ProcessState.STOPPED) is ProcessState.STOPPED
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert _wait_for_state(proc.pid, ProcessState.RUNNING) is ProcessState.RUNNING


@pytest.mark.parametrize(
    ("exc", "state", "field"),
    [
        (psutil.NoSuchProcess(1), ProcessState.GONE, "vanished"),
        (psutil.ZombieProcess(1), ProcessState.ZOMBIE, "zombies"),
        (psutil.AccessDenied(1), ProcessState.ACCESS_DENIED, "denied"),
    ],
)
def test_psutil_errors_maps_each_exception_once(exc: Exception, state: ProcessState, field: str) -> None:
    errors = ScanErrors()
    with psutil_errors(errors):
        raise exc
    assert errors.last is state
    assert getattr(errors, field) == 1
    assert sum((errors.vanished, errors.zombies, errors.denied)) == 1


def test_psutil_errors_lets_other_exceptions_through() -> None:
    with pytest.raises(ValueError), psutil_errors():
        raise ValueError("not a psutil error")


def test_target_keeps_its_fields() -> None:
    t = Target(pid=7, title="sglang::scheduler_TP0", create_time_s=1.5, cmdline=("sglang::scheduler_TP0",))
    assert (t.pid, t.title, t.create_time_s, t.cmdline) == (7, "sglang::scheduler_TP0", 1.5, ("sglang::scheduler_TP0",))


def test_descendants_are_walked_again_only_when_the_pids_in_proc_change(spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parents are read again for a root only once a process came or went, and then only
    the new processes' (and the tree's own: reparenting), never every process's again; a child
    started since is found."""
    import psutil

    from agent.host import targets as targets_mod

    code = "import sys, subprocess, time; sys.stdin.readline(); subprocess.Popen(['sleep', '60']); time.sleep(60)"
    parent = spawn([sys.executable, "-c", code], stdin=subprocess.PIPE)
    root = psutil.Process(parent.pid)
    reads: list[int] = []
    real = targets_mod._stat_parent

    def counted(pid: int) -> tuple[int, int] | None:
        reads.append(pid)
        return real(pid)

    monkeypatch.setattr(targets_mod, "_stat_parent", counted)
    listdir = os.listdir
    fixed = listdir("/proc")
    monkeypatch.setattr(os, "listdir", lambda path=".": list(fixed) if path == "/proc" else listdir(path))
    assert targets_mod.descendants(root) == []
    first = len(reads)
    assert targets_mod.descendants(root) == []
    assert len(reads) == first  # the same pids in /proc: nothing read again
    monkeypatch.setattr(os, "listdir", listdir)
    assert parent.stdin is not None
    parent.stdin.write(b"go\n")
    parent.stdin.flush()
    deadline = time.monotonic() + 10
    while not (found := targets_mod.descendants(root)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p.name() for p in found] == ["sleep"]
    again = reads[first:]
    unchanged = [int(name) for name in fixed if name.isdigit() and os.path.exists(f"/proc/{name}")]
    assert 1 in unchanged and 1 not in again  # init: neither new, nor in the tree, nor its parent gone
    monkeypatch.undo()


#: top -> middle -> ``sleep 60``; prints the middle's and the sleep's pids. The first line on
#: stdin ends the middle (the top does not reap it: a zombie), the second has it reaped.
REPARENTED = (
    "import os, subprocess, sys, time\n"
    "r, w = os.pipe()\n"
    "end_r, end_w = os.pipe()\n"
    "middle = os.fork()\n"
    "if middle == 0:\n"
    "    child = subprocess.Popen(['sleep', '60'])\n"
    "    os.write(w, str(child.pid).encode())\n"
    "    os.read(end_r, 1)\n"
    "    os._exit(0)\n"
    "print(middle, os.read(r, 32).decode(), flush=True)\n"
    "sys.stdin.readline()\n"
    "os.write(end_w, b'x')\n"
    "sys.stdin.readline()\n"
    "os.waitpid(middle, 0)\n"
    "print('reaped', flush=True)\n"
    "time.sleep(60)\n"
)


def test_the_parent_cache_sees_a_child_reparented_while_its_parent_is_a_zombie_and_after_it_is_reaped(spawn) -> None:
    """top -> middle -> sleep, all seen; the middle ends (its sleep goes to init at once, while
    the middle stays a zombie, still listed in /proc), then is reaped. The sleep, its parent read
    while it was the middle, leaves the top's tree at the next change of /proc's pids (as
    psutil's walk of every parent says)."""
    import psutil

    from agent.host import targets as targets_mod

    top = spawn([sys.executable, "-c", REPARENTED], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert top.stdout is not None and top.stdin is not None
    middle, sleep = (int(x) for x in top.stdout.readline().split())
    try:
        root = psutil.Process(top.pid)
        assert sorted(p.pid for p in targets_mod.descendants(root)) == sorted([middle, sleep])
        top.stdin.write(b"end\n")
        top.stdin.flush()
        deadline = time.monotonic() + 10
        while psutil.Process(middle).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the middle process never ended"
            time.sleep(0.02)
        assert psutil.Process(sleep).ppid() != middle  # reparented already
        other = spawn(["sleep", "60"])  # /proc's pids change: the tree is looked at again
        assert other.poll() is None
        members = sorted(p.pid for p in targets_mod.descendants(root))
        assert members == sorted(p.pid for p in root.children(recursive=True)) == [middle]  # the zombie, not its orphan
        top.stdin.write(b"reap\n")
        top.stdin.flush()
        assert top.stdout.readline() == b"reaped\n"
        assert targets_mod.descendants(root) == []
    finally:
        os.kill(sleep, signal.SIGKILL)


# --- uninterruptible sleep (state D), per thread --------------------------------------------------


def test_a_thread_in_uninterruptible_sleep_is_read_with_its_wchan(spawn) -> None:
    from tests.programs.dstate import start

    pid, tid = start(spawn)
    found = targets_module.uninterruptible_threads(pid)
    # the worker thread, not the main one (which waits in join: state S); /proc/PID/stat alone
    # (the main thread's state) would not tell
    assert [t.tid for t in found] == [tid] and tid != pid, found
    assert found[0].main is False
    if os.geteuid() == 0:  # the kernel hides wchan from others than root and the owner
        assert found[0].wchan == "kernel_clone", found
    assert found[0].where() == (found[0].wchan or "an unknown kernel function")
    assert targets_module.process_state(pid) is ProcessState.RUNNING  # D is not a stop


def test_no_thread_in_uninterruptible_sleep_reads_empty_and_a_gone_pid_too(spawn) -> None:
    proc = spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    proc.stdout.close()
    assert targets_module.uninterruptible_threads(proc.pid) == ()
    proc.kill()
    proc.wait(timeout=10)
    assert targets_module.uninterruptible_threads(proc.pid) == ()


def test_the_state_letter_is_read_after_the_last_parenthesis(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_bytes(b"42 (a (b) D c) D 1 42 42 0 -1\n")
    assert targets_module._thread_state(str(stat)) == "D"
    stat.write_bytes(b"42 (weird) name) S 1\n")
    assert targets_module._thread_state(str(stat)) == "S"
    assert targets_module._thread_state(str(tmp_path / "missing")) == ""
    wchan = tmp_path / "wchan"
    wchan.write_text("0")
    assert targets_module._wchan(str(wchan)) == ""
    wchan.write_text("rpc_wait_bit_killable")
    assert targets_module._wchan(str(wchan)) == "rpc_wait_bit_killable"
