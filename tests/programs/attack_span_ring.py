"""A local user's span ring, forged to speak as the agent or to make it allocate (run as nobody).

Uses the SDK's public ring layout (:mod:`agent.sdk.ring`, stdlib only; ``PYTHONPATH`` must
point at the checkout) in the folder ``--dir`` (the agent's shm folder):

* ``--mode forge``: a ring declaring ``service.name=--service``, another host, pid and uid and a
  ``servewatch.*`` resource key, holding an ``incident`` span with ``servewatch.incident.id``, a
  ``pyspy.dump`` span, a span with a ``servewatch.trigger`` attribute, one with a
  ``service.name`` attribute, and one honest ``request`` span;
* ``--mode huge``: a 256 MiB sparse ring file that claims to be full (every byte unread).

Prints ``ready <path>`` and sleeps (the agent watches this pid) until killed.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

from agent.sdk import ring


def forge(path: Path, service: str) -> None:
    meta = {"resource": {"service.name": service, "host.name": "elsewhere", "process.pid": 1, "process.user.id": 0,
                         "servewatch.agent": "yes"}, "pid": os.getpid()}
    writer = ring.RingWriter(1 << 16, metadata=meta, path=path)
    now = time.time_ns()
    trace = int("4bf92f3577b34da6a3ce929d0e0e4736", 16)

    def record(name: str, span_id: int, attrs: dict) -> None:
        rec = [name, 0, trace, span_id, 0, now - 1_000_000, now, attrs, 0, "", [], []]
        assert writer.write(json.dumps(rec).encode())

    record("incident", 1, {"servewatch.incident.id": "forged", "servewatch.trigger": "manual"})
    record("pyspy.dump", 2, {"process.pid": 1})
    record("handle", 3, {"servewatch.trigger": "stall"})
    record("handle", 4, {"service.name": "servewatch"})
    record("request", 5, {"gen_ai.request.model": "tiny"})


def huge(path: Path) -> None:
    cap = 256 * 1024 * 1024
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, ring.HEADER_BYTES + ring.META_BYTES + cap)  # sparse: costs this user nothing
        words = [0] * ring.HEADER_WORDS
        words[1], words[2], words[3] = ring.VERSION, os.getpid(), cap
        words[4], words[5] = cap, 0  # written everything, nothing read: "full"
        words[11], words[14] = time.time_ns(), 2
        os.pwrite(fd, b"{}", ring.HEADER_BYTES)
        os.pwrite(fd, struct.pack(f"<{ring.HEADER_WORDS}q", *words), 0)
        os.pwrite(fd, struct.pack("<q", ring.MAGIC), 0)
    finally:
        os.close(fd)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--mode", choices=("forge", "huge"), required=True)
    p.add_argument("--service", default="servewatch")
    args = p.parse_args()
    path = ring.ring_path(os.getpid(), Path(args.dir))
    if args.mode == "forge":
        forge(path, args.service)
    else:
        huge(path)
    print("ready", path, flush=True)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
