"""A real ptrace holder, as a debugger, strace or another profiler is: ``PTRACE_SEIZE`` a pid.

Usage: ``python ptrace_holder.py PID [--max-lifetime-s SECONDS]``. Attaches with
``PTRACE_SEIZE`` (the tracee keeps running; its ``TracerPid`` becomes our pid), prints
``attached <pid>`` and holds the attachment until killed (the kernel detaches on our exit).
Stdlib (ctypes) only; needs the right to ptrace the pid (same user without Yama restrictions,
or CAP_SYS_PTRACE).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys
import time

PTRACE_SEIZE = 0x4206


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pid", type=int)
    ap.add_argument("--max-lifetime-s", type=float, default=120.0)
    args = ap.parse_args()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    if libc.ptrace(PTRACE_SEIZE, args.pid, None, None) != 0:
        err = ctypes.get_errno()
        sys.exit(f"PTRACE_SEIZE {args.pid} failed: {os.strerror(err)}")
    print(f"attached {os.getpid()}", flush=True)
    time.sleep(args.max_lifetime_s)


if __name__ == "__main__":
    main()
