"""A real server loop recording request and forward spans with agent.sdk, for the channel tests.

Usage::

    python span_server.py [--rate HZ] [--max-lifetime-s SECONDS] [--error-every N] [--paused]

Each iteration opens a request span (gen_ai attributes), runs one batched forward span linked
to it, counts a step with :func:`agent.sdk.step`, and ends the request (every ``--error-every``-th
one with an exception). Prints ``ready <pid>`` once its span ring exists. On a ``stats`` line on
stdin it prints one JSON line: the SDK channel statistics, the number of requests served, and
which telemetry encoders/network modules this process imported (it must import none of them
while an agent ships its spans). ``stop`` (or EOF) ends it.

``--paused`` serves nothing on its own: each ``serve N`` line serves N more requests one at a
time (both spans carry ``test.seq``, the request's number from 1) and prints ``served <total>``.
``--lazy-ring``: the ring is created at the first span, as in a server whose first request is
its first use of the SDK (``ready`` is printed before it exists).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from agent import sdk
from agent.sdk import channel

HEAVY = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto", "google.protobuf", "grpc", "urllib3", "requests")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--max-lifetime-s", type=float, default=120.0)
    parser.add_argument("--error-every", type=int, default=0)
    parser.add_argument("--paused", action="store_true")
    parser.add_argument("--lazy-ring", action="store_true", help="no ring before the first span (as a server that never called the SDK yet)")
    args = parser.parse_args()
    stop = threading.Event()
    served = [0]

    def one(i: int) -> None:
        seq = {"test.seq": i}
        try:
            with sdk.request_span(f"req-{i}", model="tiny", max_tokens=4, input_tokens=3, attributes=seq) as req:
                with sdk.forward_span([req], attributes=seq):
                    sdk.step(pending=0)
                req.set_output_tokens(4)
                if args.error_every and i % args.error_every == 0:
                    raise RuntimeError(f"request {i} failed")
        except RuntimeError:
            pass
        served[0] = i

    def serve() -> None:
        period = 1.0 / args.rate
        i = 0
        while not stop.is_set():
            i += 1
            one(i)
            time.sleep(period)

    if not args.lazy_ring:
        channel.ring()
    thread = threading.Thread(target=serve, daemon=True)
    if not args.paused:
        thread.start()
    print(f"ready {os.getpid()}", flush=True)
    deadline = time.monotonic() + args.max_lifetime_s
    watchdog = threading.Timer(args.max_lifetime_s, lambda: os._exit(3))
    watchdog.daemon = True
    watchdog.start()
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stats":
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"grpc", "urllib3", "requests"} or m.startswith(HEAVY))
            print(json.dumps({"channel": channel.statistics(), "served": served[0], "heavy_modules": heavy}), flush=True)
        elif cmd.startswith("serve ") and args.paused:
            for _ in range(int(cmd.split()[1])):
                one(served[0] + 1)
            print(f"served {served[0]}", flush=True)
        elif cmd == "stop" or time.monotonic() > deadline:
            break
    stop.set()
    if thread.is_alive():
        thread.join(5)


if __name__ == "__main__":
    main()
