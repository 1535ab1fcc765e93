"""A process using the SDK that ends one way: its death notice (agent.sdk.exitnotice) must say how.

Usage: ``python exit_notice_target.py MODE`` with MODE one of ``exit3`` (``sys.exit(3)``),
``end`` (the main module returns), ``raise`` (an uncaught ValueError whose message must not be
written), ``segv`` (``ctypes.string_at(0)``), ``wait`` (prints ``ready <pid>`` and sleeps up to
120 s: for a signal sent by the test), ``own-handler`` (as ``wait``, with the server's own
SIGTERM handler that exits 0, installed before the SDK), ``fork`` (forks a child that never
steps and dies by SIGSEGV; prints ``child <wait status>``, exits 0),
``spawn-wait`` (starts ``wait`` as its child, prints the
child's pid and reaps it at once when it ends, exiting 0: a server's parent). Stdlib + agent.sdk only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from agent import sdk


def main(mode: str) -> int:
    if mode == "spawn-wait":
        child = subprocess.Popen([sys.executable, __file__, "wait"], stdout=subprocess.PIPE)
        assert child.stdout is not None
        print(child.stdout.readline().decode().strip(), flush=True)
        child.wait()  # reaped the moment it ends, as a server reaps its rank
        return 0
    if mode == "own-handler":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sdk.step(pending=0)
    print(f"ready {os.getpid()}", flush=True)
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("a prompt that must never be written")
    if mode == "segv":
        ctypes.string_at(0)
    if mode == "fork":
        child = os.fork()
        if child == 0:  # no step here: the parent's notice files are not this process's
            os.kill(os.getpid(), signal.SIGSEGV)
            os._exit(7)
        print(f"child {os.waitpid(child, 0)[1]}", flush=True)
    if mode in ("wait", "own-handler"):
        time.sleep(120)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "end":
        main("end")
    else:
        sys.exit(main(sys.argv[1]))
