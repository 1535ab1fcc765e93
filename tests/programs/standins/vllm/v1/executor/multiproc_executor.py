"""Stand-in of vLLM's ``vllm/v1/executor/multiproc_executor.py``: a worker process titled
``VLLM::Worker_TP<rank>`` that waits for the engine core's next step and answers it."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection


class WorkerProc:
    """One worker: the engine core's steps in, one answer each."""

    @staticmethod
    def worker_main(conn: Connection, rank: int) -> None:
        import setproctitle

        setproctitle.setproctitle(f"VLLM::Worker_TP{rank}")
        conn.send(("ready", os.getpid()))
        while True:
            step = conn.recv()  # idle: waiting for work
            conn.send(("done", step))
