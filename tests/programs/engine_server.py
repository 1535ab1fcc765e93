"""A server shaped like real vLLM 0.32 on CPU, for the lifecycle tests: an HTTP frontend (plain
command line, listening on a TCP port, ``GET /health``), its engine ``VLLM::EngineCore`` and the
engine's workers ``VLLM::Worker_TP<i>`` (real setproctitle titles, each reaped by its own parent at
once), stopping and failing in vLLM's own order.

Usage::

    python engine_server.py --ready-file F [--tp N] [--close-delay-s S] [--react-delay-s R]
                            [--max-lifetime-s L]

Orderly stop (SIGTERM or SIGINT to the frontend), as vLLM 0.32's API server does in its default
``shutdown_timeout`` 0 ("abort") mode (``vllm/entrypoints/launchers/launcher.py`` then
``vllm/v1/utils.py`` ``shutdown`` and ``kill_process_tree``, seen in its log): SIGTERM to the
engine, then at once SIGKILL to the engine's children and then to the engine, all while the HTTP
port still listens; the port closes ``--close-delay-s`` later (the time a loaded API server takes
to get to its HTTP shutdown: 0.1 s on a quiet machine, seconds at load 13); exit 0.

A worker's death (a crash, e.g. ``kill -9``): the engine notices (it reaps it) and tells the
frontend; the engine keeps running. ``--react-delay-s`` later (vLLM: ``EngineDeadError`` and its
watchdog) the frontend closes its port first, then stops the engine (SIGTERM, SIGKILL) and exits 0
— the same exit 0 as an orderly stop. The engine killed alone leaves its workers running (vLLM's
do, orphaned); the frontend reacts the same way.

The engine handles SIGTERM by starting its shutdown (a flag), so the SIGKILL that follows is what
ends it, as vLLM's EngineCore. Writes ``{"port", "frontend", "engine", "workers"}`` to the ready
file once every worker is up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TITLED = str(Path(__file__).with_name("titled_target.py"))


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _kill_tree(pid: int, children: list[int]) -> None:
    """vLLM's ``kill_process_tree``: SIGKILL to every child first, then to the parent."""
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def engine(tp: int, max_lifetime_s: float) -> None:
    import setproctitle

    setproctitle.setproctitle("VLLM::EngineCore")
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())  # its shutdown starts; a SIGKILL ends it
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    workers = [subprocess.Popen([sys.executable, TITLED, f"VLLM::Worker_TP{i}", "--idle",
                                 "--max-lifetime-s", str(max_lifetime_s)], stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL) for i in range(tp)]
    for w in workers:
        assert w.stdout is not None
        w.stdout.readline()
    print("ready", *(w.pid for w in workers), flush=True)
    told = False
    deadline = time.monotonic() + max_lifetime_s
    while time.monotonic() < deadline:
        for w in workers:
            if w.poll() is not None and not told and not stopping.is_set():  # reaped at once, as vLLM's sentinel
                print("dead", w.pid, w.returncode, flush=True)
                told = True
        time.sleep(0.02)


def frontend(args: argparse.Namespace) -> None:
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=http.serve_forever, daemon=True, name="http").start()
    eng = subprocess.Popen([sys.executable, __file__, "--role", "engine", "--tp", str(args.tp),
                            "--max-lifetime-s", str(args.max_lifetime_s)],
                           stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert eng.stdout is not None
    words = eng.stdout.readline().split()
    workers = [int(w) for w in words[1:]]
    stop = threading.Event()
    engine_dead = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def read_engine() -> None:
        assert eng.stdout is not None
        for line in eng.stdout:
            if line.startswith(b"dead"):
                engine_dead.set()
        engine_dead.set()  # the engine itself ended (its pipe closed)

    threading.Thread(target=read_engine, daemon=True, name="engine-output").start()
    tmp = Path(args.ready_file + ".tmp")
    tmp.write_text(json.dumps({"port": http.server_address[1], "frontend": os.getpid(), "engine": eng.pid,
                               "workers": workers}))
    os.replace(tmp, args.ready_file)
    deadline = time.monotonic() + args.max_lifetime_s
    while not stop.is_set() and not engine_dead.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)
    if stop.is_set():  # the operator: the engine first, the HTTP port last
        eng.terminate()
        _kill_tree(eng.pid, workers)
        eng.wait()
        time.sleep(args.close_delay_s)
        http.shutdown()
        http.server_close()
    else:  # the engine died or reported a dead worker: the HTTP port first, then the engine
        time.sleep(args.react_delay_s)
        http.shutdown()
        http.server_close()
        time.sleep(0.2)  # the lifespan's shutdown, then the engine client's
        eng.terminate()
        _kill_tree(eng.pid, workers)
        eng.wait()
    sys.exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["frontend", "engine"], default="frontend")
    ap.add_argument("--ready-file", default="")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--close-delay-s", type=float, default=0.1)
    ap.add_argument("--react-delay-s", type=float, default=0.5)
    ap.add_argument("--max-lifetime-s", type=float, default=120.0)
    args = ap.parse_args()
    if args.role == "engine":
        engine(args.tp, args.max_lifetime_s)
    else:
        frontend(args)


if __name__ == "__main__":
    main()
