"""A small real inference-style server for tests and benchmarks, plus a helper to start it.

Run as a program it serves, on 127.0.0.1:

* ``GET /health``: 200 (or the code set by ``POST /control``), answered from its own thread,
  so it keeps answering 200 while the "scheduler" loop is hung — like vLLM's ``/health``
  through a deadlock.
* ``GET /metrics``: Prometheus text (prometheus_client's own exposition, as SGLang and vLLM
  produce it) with ``sglang:generation_tokens_total`` / ``sglang:num_running_reqs``,
  ``vllm:generation_tokens_total`` / ``vllm:num_requests_running`` and custom
  ``fake:progress_total`` / ``fake:busy``, each split over two label sets (``tp_rank`` 0 and 1).
* ``POST /control`` with a JSON body: ``{"mode": "run"|"freeze"|"idle"}``,
  ``{"health_code": 503}``, ``{"health_delay_s": 1.5}``.

The main thread is the scheduler loop: in ``run`` mode it steps (``agent.sdk.step``) every
``--step-interval-s`` with work pending; in ``freeze`` mode it is stuck inside
:func:`stuck_in_forward` with work pending and the counter frozen; in ``idle`` mode it has no
work (pending 0) and does not step. ``--warmup-s`` holds work pending without any step first
(compile/warm-up). ``--freeze-after-steps N`` freezes by itself after N steps.

On start it prints one JSON line to stdout: ``{"pid": ..., "port": ...}``.

Import-side helper: :func:`start` launches it with the test's ``spawn`` fixture and returns a
:class:`FakeServer` handle (URLs, pid, ``control()``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
#: Pending work items the loop reports while busy.
PENDING_WHEN_BUSY = 4
#: Generated tokens counted per step (split over the two TP ranks).
TOKENS_PER_STEP = 2


# --- helper used by tests -------------------------------------------------------------------


@dataclass
class FakeServer:
    """A running fake server (started by :func:`start`)."""

    proc: subprocess.Popen[bytes]
    pid: int
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def health_url(self) -> str:
        return self.base_url + "/health"

    @property
    def metrics_url(self) -> str:
        return self.base_url + "/metrics"

    def control(self, timeout_s: float = 5.0, **settings: Any) -> dict[str, Any]:
        """POST ``/control`` (blocking; call from a thread in async code)."""
        request = urllib.request.Request(
            self.base_url + "/control",
            data=json.dumps(settings).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=timeout_s) as response:
            return json.loads(response.read())


def start(
    spawn: Callable[..., subprocess.Popen[bytes]],
    *args: str,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    ready_timeout_s: float = 30.0,
) -> FakeServer:
    """Start the fake server with ``spawn`` (the conftest fixture) and wait for its JSON line.

    Raises:
        RuntimeError: it exited or printed nothing within ``ready_timeout_s``.
    """
    proc = spawn([python, str(SCRIPT), *args], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + ready_timeout_s
    line = b""
    try:
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"fake server not ready after {ready_timeout_s} s")
            ready, _, _ = select.select([proc.stdout], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"fake server exited early with {proc.wait(timeout=5)}")
            line += chunk
    finally:
        proc.stdout.close()  # it prints nothing after the ready line
    info = json.loads(line.splitlines()[0])
    return FakeServer(proc=proc, pid=info["pid"], port=info["port"])


# --- the server -----------------------------------------------------------------------------


def stuck_in_forward(release: threading.Event) -> None:
    """The hang: a 'forward' that never returns while frozen (visible in py-spy stacks)."""
    while not release.wait(0.05):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from agent import sdk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--step-interval-s", type=float, default=0.01)
    parser.add_argument("--mode", choices=("run", "freeze", "idle"), default="run")
    parser.add_argument("--warmup-s", type=float, default=0.0)
    parser.add_argument("--freeze-after-steps", type=int, default=0)
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)

    if args.title:
        import setproctitle

        setproctitle.setproctitle(args.title)

    registry = CollectorRegistry()
    counters = [
        Counter("sglang:generation_tokens", "Generated tokens.", ["tp_rank"], registry=registry),
        Counter("vllm:generation_tokens", "Generated tokens.", ["tp_rank"], registry=registry),
        Counter("fake:progress", "Progress units.", ["tp_rank"], registry=registry),
    ]
    gauges = [
        Gauge("sglang:num_running_reqs", "Running requests.", ["tp_rank"], registry=registry),
        Gauge("vllm:num_requests_running", "Running requests.", ["tp_rank"], registry=registry),
        Gauge("fake:busy", "Busy flag.", ["tp_rank"], registry=registry),
    ]
    for metric in (*counters, *gauges):
        for rank in ("0", "1"):
            metric.labels(tp_rank=rank)

    state: dict[str, Any] = {"mode": args.mode, "health_code": 200, "health_delay_s": 0.0}
    changed = threading.Condition()

    def set_pending(n: int) -> None:
        for gauge in gauges:
            gauge.labels(tp_rank="0").set(n - n // 2)
            gauge.labels(tp_rank="1").set(n // 2)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                with changed:
                    code, delay_s = state["health_code"], state["health_delay_s"]
                if delay_s > 0:
                    time.sleep(delay_s)
                self._send(code, b"", "text/plain")
            elif self.path == "/metrics":
                self._send(200, generate_latest(registry), "text/plain; version=0.0.4; charset=utf-8")
            else:
                self._send(404, b"", "text/plain")

        def do_POST(self) -> None:
            if self.path != "/control":
                self._send(404, b"", "text/plain")
                return
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            with changed:
                for key in ("mode", "health_code", "health_delay_s"):
                    if key in body:
                        state[key] = body[key]
                changed.notify_all()
                snapshot = dict(state, forward_ct=sdk.forward_ct())
            self._send(200, json.dumps(snapshot).encode(), "application/json")

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    sys.stdout.write(json.dumps({"pid": os.getpid(), "port": server.server_address[1]}) + "\n")
    sys.stdout.flush()

    if args.warmup_s > 0:
        sdk.set_pending(PENDING_WHEN_BUSY)  # work is waiting while we "compile"
        set_pending(PENDING_WHEN_BUSY)
        time.sleep(args.warmup_s)

    release = threading.Event()
    while True:
        with changed:
            mode = state["mode"]
            if args.freeze_after_steps and sdk.forward_ct() >= args.freeze_after_steps and mode == "run":
                mode = state["mode"] = "freeze"
        if mode == "run":
            time.sleep(args.step_interval_s)  # the "forward"
            sdk.step(pending=PENDING_WHEN_BUSY)
            set_pending(PENDING_WHEN_BUSY)
            for counter in counters:
                counter.labels(tp_rank="0").inc(TOKENS_PER_STEP // 2)
                counter.labels(tp_rank="1").inc(TOKENS_PER_STEP - TOKENS_PER_STEP // 2)
        elif mode == "freeze":
            sdk.set_pending(PENDING_WHEN_BUSY)
            set_pending(PENDING_WHEN_BUSY)
            release.clear()
            watcher = threading.Thread(target=_release_when_mode_changes, args=(state, changed, release), daemon=True)
            watcher.start()
            stuck_in_forward(release)
        else:
            sdk.set_pending(0)
            set_pending(0)
            with changed:
                changed.wait_for(lambda: state["mode"] != "idle", timeout=1.0)


def _release_when_mode_changes(state: dict[str, Any], changed: threading.Condition, release: threading.Event) -> None:
    with changed:
        while state["mode"] == "freeze":
            changed.wait(timeout=1.0)
    release.set()


if __name__ == "__main__":
    sys.exit(main())
