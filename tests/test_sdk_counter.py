"""The SDK's shared-memory step counter, read from another process, across fork, and in-process."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import sdk
from agent.sdk.counter import (
    ENV_SHM_DIR,
    MAGIC,
    SIZE_BYTES,
    SharedCounter,
    counter_path,
    read_counter,
    shm_dir,
)

# A target driven over stdin: "step N [pending]", "pending N", "fork", "exit". Each command
# answers one JSON line on stdout.
DRIVEN = r"""
import json, os, sys, time
import agent.sdk as sdk

def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n"); sys.stdout.flush()

for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "step":
        for _ in range(int(args[0])):
            n = sdk.step(pending=int(args[1]) if len(args) > 1 else None)
        say(forward_ct=n, monotonic_ns=time.monotonic_ns(), pid=os.getpid())
    elif cmd == "pending":
        sdk.set_pending(int(args[0])); say(ok=True)
    elif cmd == "fork":
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(r)
            before = sdk.forward_ct()
            n = sdk.step(pending=1)
            os.write(w, json.dumps({"before": before, "forward_ct": n, "pid": os.getpid()}).encode())
            os.close(w)
            os._exit(0)
        os.close(w)
        data = os.read(r, 4096); os.close(r)
        _, status = os.waitpid(child, 0)
        say(child=json.loads(data), status=status, parent_ct=sdk.forward_ct())
    elif cmd == "exit":
        say(ok=True); break
"""


class Driven:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def ask(self, command: str, timeout_s: float = 30.0) -> dict:
        """Send one command; wait (bounded) for its one-line JSON answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no answer to {command!r} within {timeout_s} s"
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                assert chunk, f"target exited: {self.proc.poll()}"
                line += chunk
        return json.loads(line)


@pytest.fixture
def driven(spawn, python, tmp_path: Path) -> Iterator[Driven]:
    env = dict(os.environ, **{ENV_SHM_DIR: str(tmp_path)})
    proc = spawn([python, "-c", DRIVEN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
    try:
        yield Driven(proc)
    finally:
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def test_steps_and_pending_are_visible_to_a_reader_in_another_process(driven: Driven, tmp_path: Path) -> None:
    answer = driven.ask("step 5 3")
    pid = answer["pid"]
    snap = read_counter(counter_path(pid, tmp_path))
    assert snap is not None
    assert (snap.pid, snap.forward_ct, snap.pending, snap.profiling) == (pid, 5, 3, False)
    assert snap.busy and snap.started
    assert 0 < snap.last_step_monotonic_ns <= answer["monotonic_ns"] <= time.monotonic_ns()
    assert snap.start_time_unix_nano <= time.time_ns()

    driven.ask("pending 0")
    idle = read_counter(counter_path(pid, tmp_path))
    assert idle is not None
    assert (idle.forward_ct, idle.pending, idle.busy) == (5, 0, False)
    assert idle.last_step_monotonic_ns == snap.last_step_monotonic_ns  # set_pending is not a step

    answer = driven.ask("step 2")  # pending=None keeps the last value
    later = read_counter(counter_path(pid, tmp_path))
    assert later is not None
    assert (later.forward_ct, later.pending) == (7, 0)
    assert later.last_step_monotonic_ns > snap.last_step_monotonic_ns

    driven.ask("exit")
    assert driven.proc.wait(timeout=30) == 0
    assert not counter_path(pid, tmp_path).exists()  # removed at exit


def test_a_forked_child_counts_in_its_own_file(driven: Driven, tmp_path: Path) -> None:
    parent = driven.ask("step 4 2")["pid"]
    answer = driven.ask("fork")
    child = answer["child"]
    assert answer["status"] == 0
    assert child["before"] == 0 and child["forward_ct"] == 1  # it did not inherit the parent's counter
    assert child["pid"] != parent
    assert answer["parent_ct"] == 4
    snap = read_counter(counter_path(parent, tmp_path))
    assert snap is not None and (snap.pid, snap.forward_ct) == (parent, 4)  # the child never bumped it


def test_in_process_step_hooks_close_and_env_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SHM_DIR, str(tmp_path))
    assert shm_dir() == tmp_path
    sdk.close()
    seen: list[int] = []
    sdk.add_step_hook(seen.append)
    try:
        assert sdk.forward_ct() == 0
        assert sdk.step(pending=1) == 1
        assert sdk.step() == 2
        sdk.remove_step_hook(seen.append)
        sdk.remove_step_hook(seen.append)  # absent: a no-op
        assert sdk.step() == 3
        assert seen == [1, 2]
        snap = read_counter(counter_path(os.getpid(), tmp_path))
        assert snap is not None and (snap.forward_ct, snap.pending) == (3, 1)
    finally:
        sdk.remove_step_hook(seen.append)
        sdk.close()
    assert not counter_path(os.getpid(), tmp_path).exists()
    assert sdk.forward_ct() == 0
    sdk.close()  # safe twice


def test_read_counter_rejects_missing_short_and_foreign_files(tmp_path: Path) -> None:
    assert read_counter(tmp_path / "absent") is None
    short = tmp_path / "short"
    short.write_bytes(b"\0" * (SIZE_BYTES - 1))
    assert read_counter(short) is None
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"\1" * SIZE_BYTES)
    assert read_counter(foreign) is None
    counter = SharedCounter(tmp_path / "mine", pid=4242)
    try:
        snap = read_counter(tmp_path / "mine")
        assert snap is not None and snap.pid == 4242 and snap.forward_ct == 0 and not snap.started
        assert int.from_bytes((tmp_path / "mine").read_bytes()[:8], "little", signed=True) == MAGIC
    finally:
        counter.close()
        counter.close()
    assert not (tmp_path / "mine").exists()


def test_counter_files_are_found_by_the_pid_in_their_name(tmp_path: Path) -> None:
    from agent.sdk.counter import FILE_PREFIX, counter_files
    from agent.sdk.folders import own_dir

    folder = own_dir(tmp_path)  # files live in their user's private folder
    for name in (f"{FILE_PREFIX}12", f"{FILE_PREFIX}7", f"{FILE_PREFIX}x", f"{FILE_PREFIX}12.tmp", "servewatch-ctl.5.sock"):
        (folder / name).write_bytes(b"")
    (tmp_path / f"{FILE_PREFIX}9").write_bytes(b"")  # the old flat layout: not looked at
    assert counter_files(tmp_path) == {12: folder / f"{FILE_PREFIX}12", 7: folder / f"{FILE_PREFIX}7"}
    assert counter_files(tmp_path / "absent") == {}


def test_the_layout_constants_describe_what_the_writer_writes(tmp_path: Path) -> None:
    import struct

    from agent.sdk.counter import SLOTS, W_FORWARD_CT, W_MAGIC, W_PENDING, W_PID

    counter = SharedCounter(counter_path(os.getpid(), tmp_path))
    try:
        counter.words[W_FORWARD_CT] = 41
        counter.words[W_PENDING] = 3
        words = struct.unpack(f"<{SLOTS}q", counter_path(os.getpid(), tmp_path).read_bytes())
    finally:
        counter.close()
    assert SIZE_BYTES == SLOTS * 8
    assert (words[W_MAGIC], words[W_PID], words[W_FORWARD_CT], words[W_PENDING]) == (MAGIC, os.getpid(), 41, 3)


# Two ranks of a real gloo job: one step before init_process_group (no rank yet), then steps
# until a look at step 64, then "go" on stdin ends them. Each prints its pid after the first step
# and "stepped" once the rank can be recorded.
GLOO_RANK = r"""
import os, sys
import agent.sdk as sdk
import torch.distributed as dist
rank, store = int(sys.argv[1]), sys.argv[2]
sdk.step()
print("pid", os.getpid(), flush=True)
sys.stdin.readline()
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
for _ in range(70):
    sdk.step()
print("stepped", flush=True)
sys.stdin.readline()
dist.destroy_process_group()
"""


def test_the_counter_records_torch_distributed_s_rank_once_the_group_is_up(spawn, python, tmp_path: Path) -> None:
    """A zombie keeps no title to read its rank from; its counter file keeps torch.distributed's."""
    env = dict(os.environ, **{ENV_SHM_DIR: str(tmp_path)})
    ranks = [spawn([python, "-c", GLOO_RANK, str(r), str(tmp_path / "store")], stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, env=env) for r in (0, 1)]
    try:
        pids = [int(_line(p).split()[1]) for p in ranks]
        before = [read_counter(counter_path(pid, tmp_path)) for pid in pids]
        assert [(s.forward_ct, s.rank) for s in before if s is not None] == [(1, None), (1, None)]
        for p in ranks:
            _say(p, b"init\n")
        assert [_line(p, 120) for p in ranks] == ["stepped", "stepped"]
        after = [read_counter(counter_path(pid, tmp_path)) for pid in pids]
        assert [(s.forward_ct, s.rank) for s in after if s is not None] == [(71, 0), (71, 1)]
        for p in ranks:
            _say(p, b"go\n")
        assert [p.wait(timeout=60) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()


def _say(proc: subprocess.Popen[bytes], data: bytes) -> None:
    assert proc.stdin is not None
    proc.stdin.write(data)
    proc.stdin.flush()


def _line(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    """One line of ``proc``'s stdout (bounded)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"pid {proc.pid}: no line within {timeout_s} s"
    return proc.stdout.readline().decode().strip()
