"""A server shaped like vLLM 0.32 whose scheduler livelocks: every step preempts a running request
and resumes another, and no step produces an output token (vLLM #25538).

Two processes, as vLLM's: the API server (plain command line; HTTP ``GET /metrics`` and
``GET /health`` on 127.0.0.1) and its engine, titled ``<prefix>::EngineCore`` (setproctitle, as
``VLLM_PROCESS_NAME_PREFIX`` sets it). The engine steps in its own loop and sends its scheduler
statistics after every step to the API server (a pipe; vLLM uses ZeroMQ), which serves them on
``/metrics`` as exactly vLLM 0.32's exposition: the series, labels, HELP/TYPE lines and order of a
real ``vllm serve`` (``vllm032_metrics.prom``, captured from the tiny model of ``tests/real``),
with the scheduler's values put in.

For ``--healthy-s`` seconds the engine runs normally (4 requests running, one token each per step:
``vllm:generation_tokens_total`` and ``vllm:iteration_tokens_total_count`` rise); then it livelocks:
8 requests running, each step preempts one (``vllm:num_preemptions_total`` + 1) and resumes it,
``vllm:kv_cache_usage_perc`` moves at every step, and no counter of completed work moves.

Usage: ``python vllm_livelock.py --title PREFIX [--healthy-s S] [--step-s S] [--max-lifetime-s L]``.
Prints ``READY <port> <api server pid> <engine pid>`` once the engine stepped; ``LIVELOCK`` when the
livelock begins. Stdlib + setproctitle only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TEMPLATE = Path(__file__).with_name("vllm032_metrics.prom")
#: the one engine's labels in vLLM 0.32's exposition (``engine``, ``model_name``)
LABELS = 'engine="0",model_name="tiny"'
_SAMPLE = re.compile(r"^([a-z_:]+)\{([^}]*)\} (\S+)$")


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


# --- the engine -------------------------------------------------------------------------------


class Scheduler:
    """The engine's scheduler state, as vLLM's ``SchedulerStats`` / ``IterationStats`` count it."""

    def __init__(self) -> None:
        self.running = 4
        self.waiting = 0
        self.kv_usage = 0.25
        self.preemptions = 0
        self.generation_tokens = 10
        self.iterations = 10

    def step_with_output(self) -> None:
        """A decode step: one token per running request."""
        self.generation_tokens += self.running
        self.iterations += 1
        self.kv_usage = min(0.9, self.kv_usage + 0.001)

    def step_preempting(self, step: int) -> None:
        """The livelocked step: the KV cache is full, a running request is preempted to make
        room (its blocks freed), the preempted one is resumed (its blocks allocated again) and
        the step ends before any request produces a token."""
        self.running, self.waiting = 8, 1
        self._preempt(step)
        self._resume(step)

    def _preempt(self, step: int) -> None:
        self.preemptions += 1
        self.kv_usage = 0.875 + (step % 97) / 1000  # blocks freed: a different level every step

    def _resume(self, step: int) -> None:
        self.kv_usage = min(1.0, self.kv_usage + 0.015625)  # its blocks allocated again

    def stats(self) -> dict[str, float]:
        return {"vllm:num_requests_running": self.running, "vllm:num_requests_waiting": self.waiting,
                "vllm:kv_cache_usage_perc": self.kv_usage, "vllm:num_preemptions_total": self.preemptions,
                "vllm:generation_tokens_total": self.generation_tokens,
                "vllm:iteration_tokens_total_count": self.iterations}


def engine(prefix: str, healthy_s: float, step_s: float, max_lifetime_s: float) -> None:
    import setproctitle

    setproctitle.setproctitle(f"{prefix}::EngineCore")
    sched = Scheduler()
    start = time.monotonic()
    said = False
    step = 0
    while time.monotonic() - start < max_lifetime_s:
        step += 1
        if time.monotonic() - start < healthy_s:
            sched.step_with_output()
        else:
            if not said:
                _say("LIVELOCK")
                said = True
            sched.step_preempting(step)
        sys.stdout.write(json.dumps(sched.stats()) + "\n")
        sys.stdout.flush()
        time.sleep(step_s)


# --- the API server ------------------------------------------------------------------------------


class Exposition:
    """vLLM 0.32's ``/metrics`` text with the engine's last statistics put in."""

    def __init__(self) -> None:
        self.lines = TEMPLATE.read_text(encoding="utf-8").splitlines()
        self.stats: dict[str, float] = {}
        self.lock = threading.Lock()

    def text(self) -> str:
        with self.lock:
            stats = dict(self.stats)
        out = []
        for line in self.lines:
            m = _SAMPLE.match(line)
            if m and m.group(2) == LABELS and m.group(1) in stats:
                line = f"{m.group(1)}{{{m.group(2)}}} {float(stats[m.group(1)])!r}"
            out.append(line)
        return "\n".join(out) + "\n"


def _handler(expo: Exposition) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = expo.text().encode() if self.path == "/metrics" else b""
            self.send_response(200 if self.path in ("/metrics", "/health") else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def api_server(args: argparse.Namespace) -> None:
    expo = Exposition()
    child = subprocess.Popen([sys.executable, __file__, "--engine", "--title", args.title, "--healthy-s", str(args.healthy_s),
                              "--step-s", str(args.step_s), "--max-lifetime-s", str(args.max_lifetime_s)],
                             stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert child.stdout is not None
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(expo))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    ready = False
    for raw in child.stdout:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("{"):
            _say(line)
            continue
        with expo.lock:
            expo.stats = json.loads(line)
        if not ready:
            _say(f"READY {httpd.server_address[1]} {os.getpid()} {child.pid}")
            ready = True
    child.wait(timeout=5)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--title", required=True)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--healthy-s", type=float, default=2.0)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--max-lifetime-s", type=float, default=120.0)
    args = parser.parse_args()
    if args.engine:
        engine(args.title, args.healthy_s, args.step_s, args.max_lifetime_s)
    else:
        api_server(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
