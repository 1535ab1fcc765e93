"""An engine and its worker talking over a pipe, as vLLM's EngineCore drives its workers: the
engine sends each step to the worker and waits for its answer, counting steps with the SDK (one
request running: ``pending=1``). With ``--lose-at N`` the worker drops its answer to step N and
waits for the next step: both wait for a message forever while a request is pending (a deadlock
over IPC, everyone blocked in ``recv``). With ``--hang-at N`` the engine itself hangs in its own
loop before sending step N (a busy wait in :func:`_engine_step_hang`, as a hang inside vLLM's
EngineCore step): the worker idles in ``recv`` waiting for work while the request stays pending.

Titles: ``<prefix>::EngineCore`` and ``<prefix>::Worker``. Prints ``READY <engine pid> <worker pid>``
after the first step, ``LOST <n>`` when the answer is dropped, ``HUNG <n>`` when the engine hangs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection


def _say(line: str) -> None:
    """One line on stdout in one write (several processes share the pipe: lines never interleave)."""
    os.write(1, (line + "\n").encode())

def worker(conn: Connection, title: str, lose_at: int) -> None:
    import setproctitle

    setproctitle.setproctitle(f"{title}::Worker")
    while True:
        step = conn.recv()
        if step == lose_at:
            _say(f"LOST {step}")
            continue  # the answer is lost: the engine waits for it, the worker for the next step
        conn.send(("done", step))


def _engine_step_hang(step: int, until: float) -> None:
    """The engine's own loop stuck before it sends ``step`` (never waiting on its worker)."""
    _say(f"HUNG {step}")
    while time.monotonic() < until:
        time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--title", required=True)
    ap.add_argument("--lose-at", type=int, default=-1)
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--max-runtime-s", type=float, default=90.0)
    args = ap.parse_args()
    import setproctitle

    setproctitle.setproctitle(f"{args.title}::EngineCore")
    from agent import sdk

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(theirs, args.title, args.lose_at), daemon=True)
    proc.start()
    deadline = time.monotonic() + args.max_runtime_s
    step = 0
    while time.monotonic() < deadline:
        step += 1
        sdk.set_pending(1)
        if step == args.hang_at:
            _engine_step_hang(step, deadline)
            break
        mine.send(step)
        mine.recv()
        sdk.step(pending=1)
        if step == 1:
            _say(f"READY {os.getpid()} {proc.pid}")
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
