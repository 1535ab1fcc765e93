"""A server whose listening process is retitled, as ``vllm serve --api-server-count N`` runs it:
the parent keeps its launch arguments (whatever is passed after ``--``, e.g. vLLM's
``--profiler-config``), the child that listens calls the real ``setproctitle`` (``--title``,
default ``VLLM::APIServer_0``), so its ``/proc/<pid>/cmdline`` is only that title.

Prints ``READY <port> <child pid>`` once the child listens; runs until killed (the parent exits
when the child does). ``--orphan``: the parent that keeps the arguments exits once the child
listens (the child is re-parented: no parent says the folder).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time


def child(title: str) -> None:
    import setproctitle

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    setproctitle.setproctitle(title)
    print(f"{sock.getsockname()[1]}", flush=True)
    while True:
        time.sleep(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--title", default="VLLM::APIServer_0")
    ap.add_argument("--orphan", action="store_true")
    args, _launch_args = ap.parse_known_args()
    if args.child:
        child(args.title)
        return
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--title", args.title], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = proc.stdout.readline().strip()
    print(f"READY {port} {proc.pid}", flush=True)
    if args.orphan:
        return
    sys.exit(proc.wait())


if __name__ == "__main__":
    main()
