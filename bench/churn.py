"""Process and thread churn beside a bench: what a busy host (a test run, a build) does.

Every ``--every-s`` seconds it starts a thread that ends at once (a new thread id: the kernel's
last pid moves), and every ``--proc-every`` such tick a short process (``/bin/true``: a fork and an
exec), until ``--duration-s`` has passed. Prints what it made at the end. Imports the standard
library only.

Usage: ``python bench/churn.py [--every-s 0.05] [--proc-every 10] [--duration-s 300]`` beside, e.g.,
``bench/bench_agent_cpu.py --rates 0``.
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every-s", type=float, default=0.05, help="seconds between new threads")
    parser.add_argument("--proc-every", type=int, default=10,
                        help="a short process every this many threads (0: threads only)")
    parser.add_argument("--duration-s", type=float, default=300.0, help="seconds to run")
    args = parser.parse_args()
    threads = procs = 0
    end = time.monotonic() + args.duration_s
    tick = time.monotonic()
    while tick < end:
        worker = threading.Thread(target=lambda: None)
        worker.start()
        worker.join()
        threads += 1
        if args.proc_every and threads % args.proc_every == 0:
            subprocess.run(["/bin/true"], check=False, timeout=10)
            procs += 1
        tick += args.every_s
        time.sleep(max(0.0, tick - time.monotonic()))
    print(f"churn: {threads} threads, {procs} processes in {args.duration_s:g} s")


if __name__ == "__main__":
    main()
