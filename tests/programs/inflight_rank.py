"""A serving rank with requests in flight: SDK request spans left open, control socket served.

Usage: ``python -m tests.programs.inflight_rank REQUESTS``. Opens ``REQUESTS`` request spans
(``req-<pid>-<k>``) and keeps them open, serves the SDK control socket (``SERVEWATCH_SHM_DIR``),
prints ``ready <pid>`` and sleeps until killed (at most 120 s). Stdlib + agent.sdk only.
"""

from __future__ import annotations

import os
import sys
import time

from agent import sdk
from agent.sdk import control


def main() -> int:
    count = int(sys.argv[1])
    requests = [sdk.request_span(f"req-{os.getpid()}-{k}", model="m") for k in range(count)]
    for request in requests:  # kept referenced: in flight until the process dies
        request.__enter__()
    control.serve_control()
    print(f"ready {os.getpid()}", flush=True)
    time.sleep(120)
    return 0 if requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
