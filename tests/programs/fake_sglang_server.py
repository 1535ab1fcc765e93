"""A fake SGLang server: SGLang's profiling endpoints in front of a real small torch model loop.

Implements, on 127.0.0.1, the documented boundary (per FIELD-NOTES):

* ``POST /start_profile`` with SGLang's JSON body fields ``output_dir`` (default
  ``$SGLANG_TORCH_PROFILER_DIR``, else /tmp), ``start_step``, ``num_steps``, ``activities``
  (``CPU``, ``GPU``, ``MEM``, ``CUDA_PROFILER``), ``profile_by_stage``, ``with_stack``,
  ``record_shapes``, ``profile_prefix``, ``merge_profiles``; an empty body is allowed (vLLM-style
  clients). Unknown fields -> 400. Already profiling -> 500 "Profiling is already in progress.
  Call /stop_profile first."
* ``POST /stop_profile``: stops and exports now; nothing running -> 500 "Profiling is not in
  progress. Call /start_profile first." (SGLang raises it as a RuntimeError).

The "scheduler" runs in the main thread (SGLang's scheduler is its own process; the HTTP side
waits for its reply), steps a real MLP, counts ``forward_ct``, starts torch.profiler when
``forward_ct`` reaches ``start_step`` (or at once), calls ``prof.step()`` per forward and stops by
itself after ``num_steps``, writing ``<output_dir>/[<prefix>-]<profile_id>-TP-0.trace.json.gz``.

* ``GET /get_model_info``: ``{"model_path": ...}`` as SGLang answers it; with ``--flavor vllm``
  ``GET /version`` (``{"version": ...}``) as vLLM does instead, with ``--flavor none`` neither.

Options: ``--export-delay-s`` (the trace file appears this much later, so a client's stop can arrive
after the auto-stop), ``--no-profile-endpoints`` (404 on both, like vLLM launched without profiling),
``--flavor``, ``--max-runtime-s``. Prints ``{"pid": ..., "port": ...}`` on stdout when serving.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FIELDS = {
    "output_dir", "start_step", "num_steps", "activities", "profile_by_stage", "with_stack",
    "record_shapes", "profile_prefix", "merge_profiles",
}
ALREADY = "Profiling is already in progress. Call /stop_profile first."
NOT_IN_PROGRESS = "Profiling is not in progress. Call /start_profile first."


class Command:
    def __init__(self, kind: str, body: dict[str, Any]) -> None:
        self.kind = kind
        self.body = body
        self.reply: queue.Queue[tuple[bool, str]] = queue.Queue(maxsize=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-sleep-s", type=float, default=0.01)
    ap.add_argument("--export-delay-s", type=float, default=0.0)
    ap.add_argument("--no-profile-endpoints", action="store_true")
    ap.add_argument("--flavor", choices=("sglang", "vllm", "none"), default="sglang")
    ap.add_argument("--max-runtime-s", type=float, default=120.0)
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
    from torch.profiler import ProfilerAction, ProfilerActivity

    commands: queue.Queue[Command] = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:  # quiet
            pass

        def _send(self, code: int, text: str) -> None:
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if args.flavor == "sglang" and self.path == "/get_model_info":
                self._send(200, json.dumps({"model_path": "fake/mlp", "is_generation": True}))
            elif args.flavor == "vllm" and self.path == "/version":
                self._send(200, json.dumps({"version": "0.0.0+fake"}))
            else:
                self._send(404, "Not Found")

        def do_POST(self) -> None:
            if self.path not in ("/start_profile", "/stop_profile") or args.no_profile_endpoints:
                self._send(404, "Not Found")
                return
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                self._send(400, "bad JSON")
                return
            if not isinstance(body, dict) or set(body) - FIELDS:
                self._send(400, f"unknown fields: {sorted(set(body) - FIELDS) if isinstance(body, dict) else body}")
                return
            cmd = Command("start" if self.path == "/start_profile" else "stop", body)
            commands.put(cmd)
            try:
                ok, message = cmd.reply.get(timeout=30)
            except queue.Empty:
                self._send(504, "scheduler did not answer")
                return
            self._send(200 if ok else 500, message if not ok else message + "\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(json.dumps({"pid": os.getpid(), "port": server.server_address[1]}), flush=True)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    x = torch.randn(8, 64)
    forward_ct = 0
    prof: Any = None
    pending: dict[str, Any] | None = None  # accepted, waiting for start_step
    started_ct = 0

    def start_now(body: dict[str, Any]) -> None:
        nonlocal prof, started_ct
        acts = [ProfilerActivity.CPU] if "CPU" in body.get("activities", ["CPU", "GPU"]) else []
        if "GPU" in body.get("activities", ["CPU", "GPU"]) and torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=acts or [ProfilerActivity.CPU],
            schedule=lambda _s: ProfilerAction.RECORD,
            with_stack=bool(body.get("with_stack")),
            record_shapes=bool(body.get("record_shapes")),
            profile_memory="MEM" in body.get("activities", []),
        )
        prof.body = body
        prof.start()
        started_ct = forward_ct

    def stop_now() -> None:
        nonlocal prof
        p, prof = prof, None
        p.stop()
        body = p.body
        out = body.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp"
        os.makedirs(out, exist_ok=True)
        prefix = body.get("profile_prefix")
        name = f"{prefix + '-' if prefix else ''}{time.time()}-TP-0.trace.json.gz"
        if not args.export_delay_s:
            p.export_chrome_trace(os.path.join(out, name))
            return
        # a slow export (a big trace, gzip): the file shows up later, while the scheduler goes on
        os.makedirs(os.path.join(out, ".pending"), exist_ok=True)
        tmp = os.path.join(out, ".pending", name)
        p.export_chrome_trace(tmp)

        def publish() -> None:
            time.sleep(args.export_delay_s)
            os.replace(tmp, os.path.join(out, name))

        threading.Thread(target=publish, daemon=True).start()

    deadline = time.monotonic() + args.max_runtime_s
    try:
        while time.monotonic() < deadline:
            while True:
                try:
                    cmd = commands.get_nowait()
                except queue.Empty:
                    break
                if cmd.kind == "start":
                    if prof is not None or pending is not None:
                        cmd.reply.put((False, ALREADY))
                        continue
                    pending = cmd.body
                    cmd.reply.put((True, "Start profiling."))
                else:
                    if pending is not None and prof is None:
                        pending = None
                        cmd.reply.put((True, "Stop profiling."))
                    elif prof is None:
                        cmd.reply.put((False, NOT_IN_PROGRESS))
                    else:
                        stop_now()
                        cmd.reply.put((True, "Stop profiling. This will take some time."))
            if pending is not None and forward_ct >= int(pending.get("start_step") or 0):
                start_now(pending)
                pending = None
            with torch.no_grad():
                net(x)
            forward_ct += 1
            if prof is not None:
                n = prof.body.get("num_steps")
                if n is not None and forward_ct - started_ct >= int(n):
                    stop_now()
                else:
                    prof.step()
            time.sleep(args.step_sleep_s)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
