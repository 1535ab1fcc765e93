"""A local user pre-creating the SDK's names in a shared shm folder (stdlib only, run as nobody).

Creates, in ``--dir`` (a folder like /dev/shm: mode 1777), for the next ``--pids`` pids from its
own: the step counter, control socket, span ring and torch socket names of the flat layout
(``servewatch-steps.<pid>``...), and for each uid of ``--uids`` the name of that user's private
SDK folder ``servewatch-<uid>``: ``--kind folder`` (a 0777 folder of nobody, holding a forged
busy counter for each of those pids), ``symlink`` (to a folder of nobody) or ``file``. Prints
``ready <names created>``.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import time

MAGIC = 0x3130_5045_5453_5753  # the counter file's word 0 (agent.sdk.counter.MAGIC)


def forged_counter(pid: int) -> bytes:
    """A counter that says busy, one step long ago: a stall to whoever believes it."""
    return struct.pack("<8q", MAGIC, pid, time.time_ns(), 5, 1, 7, 0, 0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--pids", type=int, default=3000)
    p.add_argument("--uids", default="0")
    p.add_argument("--kind", choices=("folder", "symlink", "file"), default="folder")
    args = p.parse_args()
    base = args.dir
    first = os.getpid() + 1
    pids = range(first, first + args.pids)
    made = 0
    for pid in pids:
        for name in (f"servewatch-steps.{pid}", f"servewatch-ctl.{pid}.sock", f"servewatch-spans.{pid}",
                     f"servewatch-torch.{pid}.sock"):
            try:
                os.close(os.open(os.path.join(base, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
                made += 1
            except OSError:
                pass
    for uid in (int(u) for u in args.uids.split(",")):
        target = os.path.join(base, f"servewatch-{uid}")
        if args.kind == "file":
            os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        else:
            real = target if args.kind == "folder" else os.path.join(base, f"nobody-{uid}")
            os.mkdir(real)
            os.chmod(real, 0o777)
            for pid in pids:
                with open(os.path.join(real, f"servewatch-steps.{pid}"), "wb") as fh:
                    fh.write(forged_counter(pid))
            if args.kind == "symlink":
                os.symlink(real, target)
        made += 1
    print("ready", made, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
