"""A real uninterruptible sleep (``/proc`` state ``D``) without a network filesystem.

What a rank reading weights from a hung NFS mount looks like to ``/proc`` and py-spy, made on any
Linux box: the calling thread ``clone()``s a child with ``CLONE_VM | CLONE_VFORK`` and waits, in
state ``D`` (``TASK_KILLABLE``, kernel ``wait_for_vfork_done``; wchan ``kernel_clone``), until the
child exits. The child runs libc's ``sleep(seconds)`` on a stack of its own and never returns into
Python (it shares the parent's memory). Measured here (Linux 6.x, py-spy 0.4.3): a blocking
``py-spy dump`` of such a process hangs until killed (py-spy waits for every thread to stop, and
a thread in ``D`` never does); ``py-spy dump --nonblocking`` returns its Python stack at once.

Cleanup: the child is bounded by ``seconds`` and lives in the caller's process group (killing the
group kills both, as :func:`tests.programs.fault_matrix.stop_ranks` does); SIGKILL of the caller
ends the wait at once (``TASK_KILLABLE``). Run as a program it sleeps on a worker thread (the main
thread stays free to handle SIGTERM/SIGINT: it kills the child, so nothing is left) and prints
``READY <pid> <tid>`` once that thread is in ``D``.

Note: the child shares the caller's memory, so its ``/proc/PID/cmdline`` reads as the caller's
(title included): a title glob matches it too; name such a target by pid.

Usage: ``python tests/programs/dstate.py [--seconds S]`` (default 120).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

#: clone(2) flags: share memory, suspend the caller until the child exits (vfork's semantics)
CLONE_VM = 0x00000100
CLONE_VFORK = 0x00004000
#: the child's stack, bytes (libc's sleep() needs little)
_STACK_BYTES = 256 * 1024


def uninterruptible_sleep(seconds: int) -> int:
    """Hold the calling thread in state ``D`` for ``seconds`` (or until the child is killed).

    Args:
        seconds: how long the child sleeps, whole seconds (the longest the caller waits).

    Returns:
        The child's pid (already exited), or -1 when ``clone`` failed (errno in ``ctypes.get_errno()``).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    stack = ctypes.create_string_buffer(_STACK_BYTES)
    top = ctypes.c_void_p(ctypes.addressof(stack) + _STACK_BYTES - 64)  # stacks grow down (x86_64, aarch64)
    sleep_fn = ctypes.cast(libc.sleep, ctypes.c_void_p)
    libc.clone.restype = ctypes.c_int
    libc.clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    # fn(arg) = sleep(seconds): the argument register carries the number; the child exits with
    # sleep()'s return value, never running Python
    return int(libc.clone(sleep_fn, top, CLONE_VM | CLONE_VFORK | signal.SIGCHLD, ctypes.c_void_p(max(1, int(seconds)))))


def children_of(pid: int) -> list[int]:
    """The child processes of every thread of ``pid`` (``/proc/PID/task/*/children``); ``[]`` when unreadable."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as fh:
                out += [int(x) for x in fh.read().split()]
        except (OSError, ValueError):
            continue
    return out


def kill_children(pid: int) -> None:
    """SIGKILL the children of ``pid`` (the sleeping clone), which ends the ``D`` wait."""
    for child in children_of(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def thread_state(pid: int, tid: int) -> str:
    """One thread's state letter (``/proc/PID/task/TID/stat``, the field after the name); ``""`` gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


def start(spawn: Callable[..., subprocess.Popen[bytes]], seconds: int = 120) -> tuple[int, int]:
    """Run this program with ``spawn`` (the tests' fixture: its own process group, killed at
    teardown) and wait for its ``READY`` line (bounded: it gives up after 10 s itself).

    Returns:
        ``(pid, tid)``: the process and its thread in state ``D``.

    Raises:
        AssertionError: it did not get into ``D`` (printed ``NOT-D`` or died).
    """
    proc = spawn([sys.executable, __file__, "--seconds", str(seconds)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    words = line.split()
    assert len(words) == 3 and words[0] == b"READY" and int(words[1]) == proc.pid, line
    return proc.pid, int(words[2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seconds", type=int, default=120)
    args = ap.parse_args()
    tid_box: list[int] = []

    def load_weights() -> None:
        tid_box.append(threading.get_native_id())
        uninterruptible_sleep(args.seconds)

    def stop(signum: int, frame: object) -> None:
        kill_children(os.getpid())
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker = threading.Thread(target=load_weights, name="weights", daemon=True)
    worker.start()
    deadline = time.monotonic() + 10.0
    while (not tid_box or thread_state(os.getpid(), tid_box[0]) != "D") and time.monotonic() < deadline:
        time.sleep(0.01)
    if not tid_box or thread_state(os.getpid(), tid_box[0]) != "D":
        print("NOT-D", flush=True)
        kill_children(os.getpid())
        return 1
    print(f"READY {os.getpid()} {tid_box[0]}", flush=True)
    try:
        worker.join(args.seconds + 5.0)
    finally:
        kill_children(os.getpid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
