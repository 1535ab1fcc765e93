"""A stand-in for the py-spy binary that fails the way py-spy does, for the failure classes.

Usage (tests write an executable wrapper that calls it)::

    python fake_pyspy.py MODE LOGFILE [py-spy args...]

Every run appends one JSON line to LOGFILE first: ``{"mode", "pid", "argv", ...}`` (``argv`` are
the py-spy arguments it was given). Modes:

* ``hang``: starts a child, which shares its process group (logged as ``child_pid``), then sleeps
  (up to 300 s) as a hung py-spy would.
* ``native-unsupported``: with ``--native``, prints py-spy 0.4's message for wheels without
  unwinding support and exits 1; without it, runs the real py-spy.
* ``native-fails``: with ``--native``, leaves a partial header on stdout, prints an error and
  exits 1 (success is exit code 0 only); without it, runs the real py-spy.
* ``permission-denied``: prints py-spy's non-root permission message and exits 1.
* ``permission-denied-once``: the first run (an empty LOGFILE before it) is denied as above, as
  when another tracer held the target at that moment; later runs are the real py-spy.
* ``collides-twice``: the first two runs find another py-spy attached (py-spy's "Failed to suspend
  process ... EPERM" error, exit 1), and leave that other run behind: a detached process whose
  command line is ``py-spy dump --pid N`` for 0.6 s, as a tool dumping the target back to back
  would; later runs are the real py-spy.
* ``not-python-once``: the first run is py-spy's failed interpreter lookup (exit 1), as when a
  thread of the target started or ended while py-spy read the interpreter's state; later runs are
  the real py-spy.
* ``garbage``: exits 0 with stdout that is not JSON.
* ``slow``: logs ``start``/``end`` wall times around a 0.3 s sleep, then runs the real py-spy
  (to observe overlapping dumps).

The real py-spy is the one installed next to the interpreter running this script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Verbatim from py-spy 0.4 (src/config.rs, src/main.rs), so the classifier sees real messages.
NATIVE_UNSUPPORTED = "Collecting stack traces from native extensions (`--native`) is not supported on your platform."
NO_INTERPRETER = "Error: Failed to find a python interpreter in the .data section"
COLLIDED = ("Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend process\n"
            "    1: EPERM: Operation not permitted\n")
PERMISSION_DENIED = "Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'"


def log(path: str, **record: object) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def run_real(args: list[str]) -> None:
    real = str(Path(sys.executable).parent / "py-spy")
    os.execv(real, [real, *args])


def main() -> None:
    mode, log_path, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    native = "--native" in args
    if mode == "hang":
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(300)"], stdin=subprocess.DEVNULL
        )
        log(log_path, mode=mode, pid=os.getpid(), argv=args, child_pid=child.pid)
        time.sleep(300)
        sys.exit(3)
    if mode == "slow":
        log(log_path, mode=mode, pid=os.getpid(), argv=args, event="start", time_ns=time.time_ns())
        time.sleep(0.3)
        log(log_path, mode=mode, pid=os.getpid(), argv=args, event="end", time_ns=time.time_ns())
        run_real(args)
    first = not Path(log_path).exists()
    log(log_path, mode=mode, pid=os.getpid(), argv=args)
    if mode == "permission-denied-once":
        if first:
            print(PERMISSION_DENIED, file=sys.stderr)
            sys.exit(1)
        run_real(args)
    if mode == "collides-twice":
        if len(Path(log_path).read_text(encoding="utf-8").splitlines()) <= 2:
            other = Path(log_path).with_name("py-spy")
            other.write_text("#!/bin/sh\nsleep 0.6\n", encoding="utf-8")
            other.chmod(0o755)
            subprocess.Popen([str(other), "dump", "--pid", args[args.index("--pid") + 1]], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(COLLIDED, file=sys.stderr)
            sys.exit(1)
        run_real(args)
    if mode == "not-python-once":
        if first:
            print(NO_INTERPRETER, file=sys.stderr)
            sys.exit(1)
        run_real(args)
    if mode == "native-unsupported":
        if native:
            print(NATIVE_UNSUPPORTED, file=sys.stderr)
            sys.exit(1)
        run_real(args)
    elif mode == "native-fails":
        if native:
            print("Process 1: python\nPython v3.11.7 (/usr/bin/python3)\n", flush=True)
            print("Error: Failed to unwind native stack: no unwind info", file=sys.stderr)
            sys.exit(1)
        run_real(args)
    elif mode == "permission-denied":
        print(PERMISSION_DENIED, file=sys.stderr)
        sys.exit(1)
    elif mode == "garbage":
        print("this is not json {", flush=True)
        sys.exit(0)
    else:
        sys.exit(f"fake_pyspy: unknown mode {mode!r}")


if __name__ == "__main__":
    main()
