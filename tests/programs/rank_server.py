"""A server process that owns its ranks, as SGLang's and vLLM's main processes do: it starts ``--tp``
real gloo ranks (:mod:`tests.programs.dist_rank`, setproctitle titles ``<title>_TP<rank>``) as its
own children and reaps each one the moment it exits, so nobody else can read their exit status
from ``waitid`` or ``/proc`` (the shape that made an orderly stop read as a crash).

Usage::

    python rank_server.py --tp N --init file:///tmp/x/store --title T [--no-reap]
        [--memory-cgroup DIR --cgroup-rank K] [--linger RANK=SECONDS]... [-- dist_rank args...]

Prints ``READY <rank> <pid>`` for each rank (relayed from the rank), then ``SERVER <pid>``.
SIGTERM/SIGINT: passed on to every rank, which are reaped, then the server exits 0 (an orderly
stop). With ``--no-reap`` the server never reaps (dead ranks stay zombies, as when a main process
is busy). With ``--memory-cgroup`` rank K is moved into that cgroup (its ``cgroup.procs``) before
it starts its process group (a container's memory limit). The server exits 0 once every rank ended.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_rank.py")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--init", required=True)
    ap.add_argument("--title", required=True)
    ap.add_argument("--no-reap", action="store_true")
    ap.add_argument("--memory-cgroup", default=None)
    ap.add_argument("--cgroup-rank", type=int, default=-1)
    ap.add_argument("--linger", action="append", default=[], metavar="RANK=SECONDS")
    ap.add_argument("--max-lifetime-s", type=float, default=120.0)
    args, rest = ap.parse_known_args()
    rest = [a for a in rest if a != "--"]
    linger = {int(r): s for r, _, s in (x.partition("=") for x in args.linger)}

    ranks: list[subprocess.Popen[bytes]] = []
    for rank in range(args.tp):
        argv = [sys.executable, PROGRAM, "--rank", str(rank), "--world-size", str(args.tp), "--init", args.init,
                "--title", args.title, *rest]
        if rank in linger:
            argv += ["--linger-s", linger[rank]]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        if rank == args.cgroup_rank and args.memory_cgroup:
            with open(os.path.join(args.memory_cgroup, "cgroup.procs"), "w") as fh:
                fh.write(str(proc.pid))
        ranks.append(proc)

    def relay(proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()

    def reap(proc: subprocess.Popen[bytes]) -> None:
        proc.wait()  # at once: the status is ours alone

    for proc in ranks:
        threading.Thread(target=relay, args=(proc,), daemon=True).start()
        if not args.no_reap:
            threading.Thread(target=reap, args=(proc,), daemon=True).start()

    stop = threading.Event()

    def on_stop(signum: int, _frame: object) -> None:
        for proc in ranks:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass
        stop.set()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    print(f"SERVER {os.getpid()}", flush=True)
    deadline = time.monotonic() + args.max_lifetime_s
    while time.monotonic() < deadline:
        if args.no_reap:
            time.sleep(0.2)
            continue
        if all(p.poll() is not None for p in ranks):
            return 0
        stop.wait(0.1)
        if stop.is_set():
            for proc in ranks:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            return 0
    for proc in ranks:
        proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
