"""A real Python target with a process title, as inference-server workers have.

Usage::

    python titled_target.py TITLE [--torch] [--threads N] [--child TITLE[/TITLE...]]...
                                  [--max-lifetime-s SECONDS] [--exit-after-s SECONDS --exit-code N]

Sets its title with setproctitle (e.g. ``sglang::scheduler_TP0``), optionally imports torch (as
a scheduler would), starts ``--threads`` idle worker threads named ``worker-<i>``, starts one
child per ``--child`` (``a/b`` makes a child titled ``a`` that has its own child titled ``b``,
like SGLang's data-parallel controller and its schedulers), prints ``ready <pid>`` on stdout once
everything is set up (children included), then blocks in :func:`hung_in_fake_allreduce` so the
hung frame is visible in a stack dump (``--idle``: it waits for work on a queue instead, as an
idle scheduler does). Exits by itself after ``--max-lifetime-s`` (default 300)
so nothing outlives a crashed test run; with ``--exit-after-s`` it instead exits with
``--exit-code`` that long after it started waiting (a rank that dies).
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import threading
import time


def worker_idle_loop(stop_at_monotonic_s: float) -> None:
    """An idle worker thread: waits for work on a queue that never gets any."""
    work: queue.Queue[object] = queue.Queue()
    while time.monotonic() < stop_at_monotonic_s:
        try:
            work.get(timeout=0.2)
        except queue.Empty:
            pass


def idle_main_loop(stop_at_monotonic_s: float) -> None:
    """``--idle``: the main thread waits for requests, as an idle scheduler does."""
    worker_idle_loop(stop_at_monotonic_s)


def hung_in_fake_allreduce(stop_at_monotonic_s: float) -> None:
    """The distinctive frame a stack dump must show: a rank stuck waiting for its peers."""
    peers_arrived = threading.Event()
    while time.monotonic() < stop_at_monotonic_s and not peers_arrived.wait(timeout=0.2):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("title")
    parser.add_argument("--torch", action="store_true", help="import torch before reporting ready")
    parser.add_argument("--threads", type=int, default=0, help="idle worker threads to start")
    parser.add_argument("--child", action="append", default=[], help="child title chain a/b/c")
    parser.add_argument("--max-lifetime-s", type=float, default=300.0)
    parser.add_argument("--exit-after-s", type=float, default=None, help="exit with --exit-code this long after ready")
    parser.add_argument("--exit-code", type=int, default=1)
    parser.add_argument("--idle", action="store_true", help="the main thread waits for work instead of hanging")
    args = parser.parse_args()

    import setproctitle

    setproctitle.setproctitle(args.title)
    if args.torch:
        import warnings

        warnings.simplefilter("ignore")  # torch warns when numpy is absent; not our concern
        import torch

        torch.set_num_threads(1)
        torch.ones(4).sum()

    stop_at = time.monotonic() + args.max_lifetime_s
    if args.exit_after_s is not None:
        stop_at = time.monotonic() + args.exit_after_s
    for i in range(args.threads):
        threading.Thread(target=worker_idle_loop, args=(stop_at,), name=f"worker-{i}", daemon=True).start()

    children = []
    for chain in args.child:
        head, _, rest = chain.partition("/")
        argv = [sys.executable, os.path.abspath(__file__), head, "--max-lifetime-s", str(args.max_lifetime_s)]
        if rest:
            argv += ["--child", rest]
        if args.torch:
            argv.append("--torch")
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        children.append(child)
    for child in children:
        assert child.stdout is not None
        line = child.stdout.readline()  # "ready <pid>" or EOF if the child died
        if not line.startswith(b"ready"):
            sys.exit(f"child {child.pid} failed to start")

    print(f"ready {os.getpid()}", flush=True)
    try:
        (idle_main_loop if args.idle else hung_in_fake_allreduce)(stop_at)
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=5)
    if args.exit_after_s is not None:
        sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
