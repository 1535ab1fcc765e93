"""Stand-in of vLLM's API server (``python -m vllm.entrypoints.openai.api_server``; untitled, as
``vllm serve`` with one API server): an asyncio event loop serving HTTP on 127.0.0.1, its engine core
``VLLM::EngineCore`` and the engine's workers ``VLLM::Worker_TP<i>`` (real setproctitle titles,
spawned by multiprocessing as vLLM does).

* ``GET /health``: 200 while the engine core lives (vLLM's answer), from the event loop.
* ``GET /metrics``: vLLM's ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
  ``vllm:generation_tokens_total``, from the event loop.
* ``POST /v1/chat/completions`` with ``messages`` and a request-level ``chat_template``: the template
  is rendered by :func:`vllm.entrypoints.chat_utils.apply_hf_chat_template` synchronously, inside the
  handler, on the event loop's thread (as before vLLM PR #38157); then the request goes to the engine
  core and its answer comes back. A template that renders for long blocks the loop: ``/health`` and
  ``/metrics`` time out while the engine core and its workers idle.

Usage: ``python -m vllm.entrypoints.openai.api_server --tp N --ready-file F [--max-lifetime-s S]``;
writes ``{"port", "api_server", "engine", "workers"}`` to the ready file once every worker is up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import threading
from pathlib import Path
from typing import Any

from vllm.entrypoints.chat_utils import apply_hf_chat_template
from vllm.v1.engine.core import EngineCoreProc


class EngineClient:
    """The API server's side of the engine core's pipe (one request at a time)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.tokens = 0

    def generate(self, prompt: str) -> str:
        with self.lock:
            self.conn.send(len(prompt))
            self.conn.recv()
            self.tokens += 1
            return "ok"


def _response(code: int, body: bytes, kind: str = "text/plain") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(code, "Error")
    head = f"HTTP/1.1 {code} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


def _metrics(engine: EngineClient) -> bytes:
    return (
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"standin\"} 0.0\n"
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"standin\"} 0.0\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        f"vllm:generation_tokens_total{{model_name=\"standin\"}} {float(engine.tokens)}\n"
    ).encode()


async def create_chat_completion(body: dict[str, Any], engine: EngineClient) -> bytes:
    """The chat handler: the template rendered in line, on the event loop (vLLM before PR #38157)."""
    prompt = apply_hf_chat_template(body.get("messages") or [], body.get("chat_template") or "{{ messages }}")
    text = await asyncio.get_running_loop().run_in_executor(None, engine.generate, prompt)
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, engine: EngineClient) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
        length = 0
        for line in head.decode().split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        body = await reader.readexactly(length) if length else b""
        if method == "GET" and path == "/health":
            out = _response(200, b"")
        elif method == "GET" and path == "/metrics":
            out = _response(200, _metrics(engine))
        elif method == "POST" and path == "/v1/chat/completions":
            out = _response(200, await create_chat_completion(json.loads(body or b"{}"), engine), "application/json")
        else:
            out = _response(404, b"")
        writer.write(out)
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def serve(args: argparse.Namespace, engine: EngineClient, engine_pid: int, workers: list[int]) -> None:
    server = await asyncio.start_server(lambda r, w: handle(r, w, engine), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tmp = Path(args.ready_file + ".tmp")
    tmp.write_text(json.dumps({"port": port, "api_server": os.getpid(), "engine": engine_pid, "workers": workers}))
    os.replace(tmp, args.ready_file)
    async with server:
        await asyncio.wait_for(server.serve_forever(), args.max_lifetime_s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--max-lifetime-s", type=float, default=120.0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    ctx.Process(target=EngineCoreProc.run_engine_core, args=(theirs, args.tp)).start()
    _, engine_pid, workers = mine.recv()
    try:
        asyncio.run(serve(args, EngineClient(mine), engine_pid, workers))
    except asyncio.TimeoutError:
        pass
    finally:
        for child in mp.active_children():
            child.kill()  # its workers read end-of-file and exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
