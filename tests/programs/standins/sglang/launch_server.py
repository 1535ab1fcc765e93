"""Stand-in of SGLang's main process (``python -m sglang.launch_server``; no title): an asyncio HTTP
server with its tokenizer manager, ``--tp`` schedulers ``sglang::scheduler_TP<i>`` that generate
without end and the detokenizer ``sglang::detokenizer`` (real setproctitle titles, spawned by
multiprocessing as SGLang does, each a child of this process).

* ``GET /health``: a 1-token generation through scheduler rank 0 and the detokenizer, 200 when its
  text comes back within ``--health-timeout-s``, else 503 (SGLang's ``/health`` waits for it the same way).
* ``GET /metrics``: ``sglang:generation_tokens_total`` (the schedulers' tokens), ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``.

Usage: ``python -m sglang.launch_server --tp N --ready-file F [--fault-file P] [--running R]
[--health-timeout-s S] [--max-lifetime-s L]``; writes ``{"port", "main", "schedulers", "detokenizer"}``
to the ready file once every child is up. The detokenizer spins from when ``--fault-file`` exists.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import sys
import threading
from pathlib import Path
from typing import Any

from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
from sglang.srt.managers.scheduler import run_scheduler_process


class TokenizerManager:
    """The frontend's side: requests to scheduler rank 0, text back from the detokenizer."""

    def __init__(self, to_scheduler: Any, from_detokenizer: Any, tokens: Any, running: int) -> None:
        self.to_scheduler = to_scheduler
        self.from_detokenizer = from_detokenizer
        self.tokens = tokens
        self.running = running
        self.waiting: dict[str, asyncio.Future[str]] = {}
        self.ids = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._read_detokenizer, daemon=True, name="detokenizer-reader").start()

    def _read_detokenizer(self) -> None:
        while True:
            try:
                rid, text = self.from_detokenizer.recv()
            except EOFError:
                return
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._done, rid, text)

    def _done(self, rid: str, text: str) -> None:
        future = self.waiting.pop(rid, None)
        if future is not None and not future.done():
            future.set_result(text)

    async def health_generate(self, timeout_s: float) -> bool:
        rid = f"health-{next(self.ids)}"
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting[rid] = future
        self.to_scheduler.send(rid)
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except asyncio.TimeoutError:
            self.waiting.pop(rid, None)
            return False

    def metrics(self) -> bytes:
        return (
            "# TYPE sglang:generation_tokens_total counter\n"
            f"sglang:generation_tokens_total{{model_name=\"standin\"}} {float(self.tokens.value)}\n"
            "# TYPE sglang:num_running_reqs gauge\n"
            f"sglang:num_running_reqs{{model_name=\"standin\"}} {float(self.running)}\n"
            "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name=\"standin\"} 0.0\n"
        ).encode()


def _response(code: int, body: bytes) -> bytes:
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}.get(code, "Error")
    head = f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tm: TokenizerManager,
                 health_timeout_s: float) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
        if method == "GET" and path in ("/health", "/health_generate"):
            ok = await tm.health_generate(health_timeout_s)
            out = _response(200 if ok else 503, b"")
        elif method == "GET" and path == "/metrics":
            out = _response(200, tm.metrics())
        else:
            out = _response(404, b"")
        writer.write(out)
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def serve(args: argparse.Namespace, tm: TokenizerManager, pids: dict[str, Any]) -> None:
    tm.start()
    server = await asyncio.start_server(lambda r, w: handle(r, w, tm, args.health_timeout_s), "127.0.0.1", 0)
    pids["port"] = server.sockets[0].getsockname()[1]
    tmp = Path(args.ready_file + ".tmp")
    tmp.write_text(json.dumps(pids))
    os.replace(tmp, args.ready_file)
    async with server:
        await asyncio.wait_for(server.serve_forever(), args.max_lifetime_s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--fault-file", default="")
    ap.add_argument("--running", type=int, default=4)
    ap.add_argument("--health-timeout-s", type=float, default=2.0)
    ap.add_argument("--max-lifetime-s", type=float, default=120.0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    tokens = ctx.Value("q", 0)
    req_mine, req_theirs = ctx.Pipe()
    detok_in, sched_out = ctx.Pipe(duplex=False)
    text_in, detok_out = ctx.Pipe(duplex=False)
    detokenizer = ctx.Process(target=run_detokenizer_process, args=(detok_in, detok_out, args.fault_file), daemon=True)
    detokenizer.start()
    schedulers = []
    for rank in range(args.tp):
        first = rank == 0
        proc = ctx.Process(target=run_scheduler_process, daemon=True, args=(
            rank, req_theirs if first else None, sched_out if first else None, tokens, args.running))
        proc.start()
        schedulers.append(proc.pid)
    tm = TokenizerManager(req_mine, text_in, tokens, args.running)
    pids = {"main": os.getpid(), "schedulers": schedulers, "detokenizer": detokenizer.pid}
    try:
        asyncio.run(serve(args, tm, pids))
    except asyncio.TimeoutError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
