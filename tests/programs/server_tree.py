"""A process tree shaped like a real SGLang server, for targeting and dead-rank tests.

Usage::

    python server_tree.py TAG [--tp N] [--detokenizer] [--exit ROLE=CODE@SECONDS]...
                              [--max-lifetime-s SECONDS] [--torch]

The main process keeps its plain command line (SGLang's main process has no title) and starts,
in its own process group, ``--tp`` schedulers titled ``sglang::scheduler_TP<i>_<TAG>`` and, with
``--detokenizer``, ``sglang::detokenizer_<TAG>`` (each a real titled_target.py, which calls
setproctitle). ``--exit scheduler_TP1=7@3`` makes that child exit with code 7 three seconds after
it is ready; the main process never reaps its children until it ends, so a dead child stays a
zombie (as when SGLang's main process is busy). Prints ``ready MAIN_PID ROLE=PID ...`` once every
child is ready, then waits until killed or ``--max-lifetime-s``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

TITLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "titled_target.py")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tag")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--detokenizer", action="store_true")
    ap.add_argument("--exit", action="append", default=[], metavar="ROLE=CODE@SECONDS")
    ap.add_argument("--max-lifetime-s", type=float, default=120.0)
    ap.add_argument("--torch", action="store_true")
    args = ap.parse_args()

    exits: dict[str, tuple[int, float]] = {}
    for spec in args.exit:
        role, _, rest = spec.partition("=")
        code, _, after = rest.partition("@")
        exits[role] = (int(code), float(after))
    roles = [f"scheduler_TP{i}" for i in range(args.tp)] + (["detokenizer"] if args.detokenizer else [])
    children: dict[str, subprocess.Popen[bytes]] = {}
    for role in roles:
        argv = [sys.executable, TITLED, f"sglang::{role}_{args.tag}", "--max-lifetime-s", str(args.max_lifetime_s)]
        if role in exits:
            code, after = exits[role]
            argv += ["--exit-after-s", str(after), "--exit-code", str(code)]
        if args.torch:
            argv.append("--torch")
        children[role] = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)

    def stop(signum: int, _frame: object) -> None:
        for child in children.values():
            child.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    for role, child in children.items():
        assert child.stdout is not None
        if not child.stdout.readline().startswith(b"ready"):
            stop(signal.SIGTERM, None)
    print("ready", os.getpid(), *(f"{role}={child.pid}" for role, child in children.items()), flush=True)
    deadline = time.monotonic() + args.max_lifetime_s
    while time.monotonic() < deadline:
        time.sleep(0.2)  # never reaps: a dead child stays a zombie
    stop(signal.SIGTERM, None)


if __name__ == "__main__":
    main()
