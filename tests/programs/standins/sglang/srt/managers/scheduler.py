"""Stand-in of SGLang's ``sglang/srt/managers/scheduler.py``: a scheduler process per TP rank
(``sglang::scheduler_TP<i>``) that generates without end for its running requests, one token per
request per step (the shared ``generation_tokens_total`` counter the frontend's ``/metrics`` serves),
and, on TP rank 0, sends each step's token ids to the detokenizer (as SGLang's rank 0 does). A
health request from the frontend gets one token in the next step."""

from __future__ import annotations

import queue
import threading
import time
from multiprocessing.connection import Connection
from typing import Any


class Scheduler:
    """One TP rank's event loop."""

    def __init__(self, tp_rank: int, requests: Connection | None, detokenizer: Connection | None, tokens: Any,
                 running: int) -> None:
        self.tp_rank = tp_rank
        self.requests = requests
        self.detokenizer = detokenizer
        self.tokens = tokens
        self.running = running
        self.forward_ct = 0
        #: the outputs on their way to the detokenizer (ZeroMQ's send buffer in SGLang: a step
        #: never waits for the detokenizer; what a full buffer cannot take is dropped)
        self.outbox: queue.Queue[tuple[list[str], list[int]]] = queue.Queue(maxsize=1000)
        if detokenizer is not None:
            threading.Thread(target=self._send_outputs, daemon=True, name="send-to-detokenizer").start()

    def _send_outputs(self) -> None:
        assert self.detokenizer is not None
        while True:
            self.detokenizer.send(self.outbox.get())

    def run_batch(self) -> list[int]:
        """One forward of the running batch: some arithmetic, one token id per request."""
        acc = 0
        for i in range(20000):
            acc = (acc * 31 + i + self.forward_ct) % 1000003
        self.forward_ct += 1
        return [(acc + r) % 50000 for r in range(self.running)]

    def event_loop_normal(self) -> None:
        while True:
            rids = [f"bg-{r}" for r in range(self.running)]
            if self.requests is not None:
                while self.requests.poll():
                    rids.append(self.requests.recv())  # a health check's request: one token
            ids = self.run_batch()
            with self.tokens.get_lock():
                self.tokens.value += self.running
            if self.detokenizer is not None:
                try:
                    self.outbox.put_nowait((rids, ids + [7] * (len(rids) - len(ids))))
                except queue.Full:
                    pass
            time.sleep(0.02)


def run_scheduler_process(tp_rank: int, requests: Connection | None, detokenizer: Connection | None, tokens: Any,
                          running: int) -> None:
    import setproctitle

    setproctitle.setproctitle(f"sglang::scheduler_TP{tp_rank}")
    Scheduler(tp_rank, requests, detokenizer, tokens, running).event_loop_normal()
