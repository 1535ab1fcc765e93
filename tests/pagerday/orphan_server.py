"""A server whose engine outlives its frontend, for the pager day's orphaned engine (vLLM #55510:
the API server SIGKILLed while EngineCore and its workers live on under pid 1, holding memory).

``python orphan_server.py --title-prefix P --ready-file F [--tp 2] [--max-lifetime-s 300]``

The frontend (a plain command line, ``GET /health`` on a free loopback port) starts ``--tp`` ranks
titled ``<P>::scheduler_TP<i>`` (``tests/programs/titled_target.py --idle``: real Python
processes waiting for work) that, unlike the demo server's ranks, never watch their parent: SIGKILL
the frontend and they live on under pid 1 (or the nearest subreaper). Writes ``{"port",
"frontend", "ranks"}`` to the ready file (atomically) once every rank is up. SIGTERM stops the
frontend and its ranks in order; the ranks end by themselves after ``--max-lifetime-s`` so nothing
outlives a crashed run. Standard library only (setproctitle in the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TITLED = Path(__file__).resolve().parents[1] / "programs" / "titled_target.py"


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--title-prefix", required=True)
    ap.add_argument("--ready-file", type=Path, required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--max-lifetime-s", type=float, default=300.0)
    args = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=http.serve_forever, daemon=True, name="http").start()
    ranks = [subprocess.Popen([sys.executable, str(TITLED), f"{args.title_prefix}::scheduler_TP{i}", "--idle",
                               "--max-lifetime-s", str(args.max_lifetime_s)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE) for i in range(args.tp)]
    for rank in ranks:
        assert rank.stdout is not None
        if not rank.stdout.readline().startswith(b"ready"):
            print(f"orphan_server: rank {rank.pid} did not start", file=sys.stderr)
            return 1
    tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
    tmp.write_text(json.dumps({"port": http.server_address[1], "frontend": os.getpid(),
                               "ranks": [r.pid for r in ranks]}))
    os.replace(tmp, args.ready_file)
    stop.wait(args.max_lifetime_s)
    http.shutdown()
    for rank in ranks:
        rank.terminate()
    for rank in ranks:
        try:
            rank.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rank.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
