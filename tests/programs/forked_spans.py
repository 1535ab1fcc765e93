"""Target program for the fork test: a server process that records request spans through the SDK
channel, forks, and records more in the parent and in the child (as a pre-fork worker model or a
``multiprocessing`` "fork" start does).

Usage: ``python -m tests.programs.forked_spans SPANS``. Each process plays its own agent (it
attaches a :class:`~agent.sdk.ring.RingReader` to its own ring and heartbeats it, as
``servewatch run`` does), records ``SPANS`` request spans, reads its ring back and prints one JSON
line ``{"pid": ..., "ids": [[trace_id, span_id], ...]}`` (ids as hex). The parent waits for the
child. ``SERVEWATCH_SHM_DIR`` must name a private folder.
"""

from __future__ import annotations

import json
import os
import sys

from agent import sdk
from agent.sdk import channel
from agent.sdk import ring as _ring


def record(count: int) -> None:
    channel.ring()  # this process's own ring (the child opens a new one after the fork)
    reader = _ring.RingReader(os.getpid(), trusted_uids={os.geteuid()})
    reader.heartbeat()
    for k in range(count):
        with sdk.request_span(f"req-{os.getpid()}-{k}", model="m"):
            pass
    records = [json.loads(p) for p in reader.read()]
    reader.close()
    ids = [[f"{r[2]:032x}", f"{r[3]:016x}"] for r in records]
    # one write per line: the parent and the child share the pipe
    os.write(1, (json.dumps({"pid": os.getpid(), "ids": ids}) + "\n").encode())


def main() -> int:
    count = int(sys.argv[1])
    record(1)  # the parent's generator has been used before the fork, as a serving process's has
    pid = os.fork()
    if pid == 0:
        try:
            record(count)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)  # the child's line first, then the parent's: never interleaved
    record(count)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    raise SystemExit(main())
