"""Stand-in of SGLang's ``sglang/srt/managers/detokenizer_manager.py``: the detokenizer process
(``sglang::detokenizer``) receives each step's token ids from scheduler rank 0, decodes them
incrementally per request and sends the text of the frontend's requests back to it.

With a fault file that exists, the incremental decode of the next batch never ends (SGLang #26482,
#34740: the detokenizer spins in its decode while the schedulers keep generating; the tokenizer
manager waits for text that never comes and ``/health`` turns 503)."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection


class DetokenizerManager:
    """Decodes token ids into text, per request."""

    def __init__(self, recv_from_scheduler: Connection, send_to_tokenizer: Connection, fault_file: str) -> None:
        self.recv_from_scheduler = recv_from_scheduler
        self.send_to_tokenizer = send_to_tokenizer
        self.fault_file = fault_file
        self.decoded: dict[str, str] = {}

    def _decode_incremental(self, rid: str, token_id: int) -> str:
        """The new text of one token; with the fault, the search for a complete character never
        ends (the offsets never settle)."""
        if self.fault_file and os.path.exists(self.fault_file):
            offset, settled = 0, False
            while not settled:
                offset = (offset * 1103515245 + token_id) % 2147483648  # never settles
        return chr(97 + token_id % 26)

    def handle_batch_token_id_out(self, rids: list[str], ids: list[int]) -> None:
        for rid, token_id in zip(rids, ids):
            text = self._decode_incremental(rid, token_id)
            if rid.startswith("bg-"):
                self.decoded[rid] = (self.decoded.get(rid, "") + text)[-64:]
            else:
                self.send_to_tokenizer.send((rid, text))

    def event_loop(self) -> None:
        while True:
            rids, ids = self.recv_from_scheduler.recv()  # idle: waiting for the next step
            self.handle_batch_token_id_out(rids, ids)


def run_detokenizer_process(recv_from_scheduler: Connection, send_to_tokenizer: Connection, fault_file: str) -> None:
    import setproctitle

    setproctitle.setproctitle("sglang::detokenizer")
    DetokenizerManager(recv_from_scheduler, send_to_tokenizer, fault_file).event_loop()
