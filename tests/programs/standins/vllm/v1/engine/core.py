"""Stand-in of vLLM's ``vllm/v1/engine/core.py``: the engine core process (``VLLM::EngineCore``)
starts its workers (``VLLM::Worker_TP<i>``), says its pids to the API server, then runs its busy
loop: it waits for requests and steps its workers for each (idle while no request comes)."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import Connection


class EngineCoreProc:
    """The engine core's loop."""

    def __init__(self, conn: Connection, workers: list[Connection]) -> None:
        self.conn = conn
        self.workers = workers

    def run_busy_loop(self) -> None:
        while True:
            request = self.conn.recv()  # idle: waiting for a request
            for w in self.workers:
                w.send(request)
            for w in self.workers:
                w.recv()
            self.conn.send(("output", request))

    @staticmethod
    def run_engine_core(conn: Connection, tp: int) -> None:
        import setproctitle

        from vllm.v1.executor.multiproc_executor import WorkerProc

        setproctitle.setproctitle("VLLM::EngineCore")
        ctx = mp.get_context("spawn")
        ends = []
        for rank in range(tp):
            mine, theirs = ctx.Pipe()
            ctx.Process(target=WorkerProc.worker_main, args=(theirs, rank), daemon=True).start()
            ends.append(mine)
        pids = [w.recv()[1] for w in ends]
        conn.send(("ready", os.getpid(), pids))
        EngineCoreProc(conn, ends).run_busy_loop()
