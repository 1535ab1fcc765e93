"""A server's main process in miniature: starts the given child processes (each its own argv and
environment), prints ``CHILD <i> <pid>``, and never reaps them (a rank that dies stays a zombie,
as under a server that has not noticed yet). On SIGTERM it kills its children and exits.

Usage: ``rank_launcher.py '<json list of {"argv": [...], "env": {...}}>'``; the children inherit
stdout (their READY lines reach the caller) and this process's session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _say(line: str) -> None:
    """One line on stdout in one write (several processes share the pipe: lines never interleave)."""
    os.write(1, (line + "\n").encode())

def main() -> int:
    specs = json.loads(sys.argv[1])
    children = []
    for i, spec in enumerate(specs):
        env = {**os.environ, **spec.get("env", {})}
        children.append(subprocess.Popen(spec["argv"], env=env, stdin=subprocess.DEVNULL))
        _say(f"CHILD {i} {children[-1].pid}")

    def stop(signum: int, frame: object) -> None:
        for child in children:
            try:
                child.kill()
            except OSError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        time.sleep(1.0)  # never waits on a child: a dead one stays a zombie
    stop(0, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
