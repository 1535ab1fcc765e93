"""A tiny supervisor for the pager day's crash loop (``python supervisor.py --runs N
--restart-delay-s S -- CMD...``).

Starts ``CMD`` and starts it again each time it exits, ``--runs`` times in all, ``--restart-delay-s``
after each exit (systemd's ``Restart=always`` or a Kubernetes container restart, without the
back-off), then exits 0. Prints ``started <pid>`` and ``exited <pid> <returncode>`` lines on stdout
(flushed) so the day knows every engine pid. SIGTERM/SIGINT stop it and its running child.
Standard library only.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="starts of CMD in all")
    ap.add_argument("--restart-delay-s", type=float, default=0.5, metavar="SECONDS")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command after --")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    for _ in range(args.runs):
        if stop.is_set():
            break
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        print(f"started {child.pid}", flush=True)
        while child.poll() is None:
            if stop.wait(0.05):
                child.terminate()
                try:
                    child.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait(timeout=5)
        print(f"exited {child.pid} {child.returncode}", flush=True)
        stop.wait(args.restart_delay_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
