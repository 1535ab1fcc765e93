"""A minimal server using the SDK, whose counter and socket paths can be squatted before it starts.

Usage: ``python sdk_server.py [--hang]``. Prints ``pid <pid>`` and waits for a line on stdin
(time for a test to plant files at its paths), then counts a step, serves the control socket,
prints one JSON line ``{"published", "control_running", "control_error", "forward_ct",
"counter"}`` and keeps stepping (every 0.1 s) until killed or 120 s passed; with ``--hang`` it
steps no more, with work pending (a hung forward). Stdlib + agent.sdk only.
"""

from __future__ import annotations

import json
import os
import sys
import time

from agent import sdk
from agent.sdk import control, steps


def main() -> int:
    print(f"pid {os.getpid()}", flush=True)
    sys.stdin.readline()
    sdk.step(pending=1)
    server = control.serve_control()
    counter = steps._counter
    print(json.dumps({
        "published": bool(counter is not None and counter.published),
        "control_running": server.running,
        "control_error": server.error,
        "forward_ct": sdk.forward_ct(),
        "counter": str(counter.path) if counter is not None else None,
    }), flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if "--hang" not in sys.argv:
            sdk.step(pending=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
