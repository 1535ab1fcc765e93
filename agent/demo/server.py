"""HTTP frontend of the demo inference server (``python -m agent.demo.server``).

Owns the frontend process: the scheduler subprocesses' lifecycle (multiprocessing, 'spawn'
context), the HTTP API, the Prometheus metrics and the ready file. Imports the standard library,
pydantic, prometheus_client and :mod:`agent.demo.scheduler` (which keeps torch inside the
children); never torch itself and never the agent side.

HTTP API (loopback by default), shaped after SGLang's:

* ``GET /health``: 200 while the frontend runs and every scheduler process is alive, even when a
  scheduler hangs (vLLM's ``/health`` also stays 200 through a deadlock; only a step watchdog
  catches that); 503 once a scheduler process has died.
* ``POST /generate``: JSON ``{"text": str}`` or ``{"input_ids": [int]}`` plus ``max_new_tokens``
  (top level, or in ``sampling_params`` as SGLang takes it). Returns ``{"output_ids": [...],
  "meta_info": {"id", "prompt_tokens", "completion_tokens", "finish_reason"}}``. Text is
  tokenized as UTF-8 bytes; prompt text is never logged.
* ``GET /metrics``: Prometheus text with SGLang's names: counters
  ``sglang:generation_tokens_total``, ``sglang:prompt_tokens_total``; gauges
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs`` (label ``model_name``).
* ``GET /server_info``: tp size, scheduler pids and titles.
* ``POST /debug/hang``: JSON ``{"tp_rank": int, "seconds": float | null}`` arms a one-shot hang
  that the rank's next forward runs inside ``_injected_hang_in_forward`` (``null``: until the
  frontend dies). The demo's injected fault.

Once ready it writes ``{"host", "port", "base_url", "pid", "tp_size", "scheduler_pids",
"scheduler_titles"}`` as JSON to ``--ready-file`` (atomically) and prints the same JSON as one
line on stdout. SIGTERM/SIGINT stop it: the schedulers are asked to stop, then terminated, then
killed, each step bounded.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, Field, ValidationError

from agent.demo import TORCH_MISSING_MESSAGE, torch_available
from agent.demo.scheduler import (
    STAT_GENERATION_TOKENS,
    STAT_PROMPT_TOKENS,
    STAT_QUEUE_REQS,
    STAT_RUNNING_REQS,
    STAT_SLOTS,
    SchedulerArgs,
    run_scheduler,
)
from agent.errors import StartupError

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "MODEL_NAME", "DemoFrontend", "DemoServerConfig", "main"]

#: Value of the ``model_name`` label on every metric.
MODEL_NAME = "servewatch-demo-tiny"
EXIT_OK = 0
EXIT_FAILED = 1  # startup failed (a scheduler died or was not ready in time)
EXIT_USAGE = 2  # bad arguments, or torch is not installed

_POLL_S = 0.5
_MAX_BODY_BYTES = 1 << 20


class DemoServerConfig(BaseModel):
    """Settings of the demo server (each is also a ``--flag`` of ``python -m agent.demo.server``).

    Attributes:
        tp: scheduler processes (tensor-parallel ranks).
        host: address to bind; loopback by default (the debug endpoint can hang the server).
        port: TCP port; 0 picks a free one (reported in the ready file).
        title_prefix: scheduler titles are ``<prefix>::scheduler_TP<rank>`` (SGLang uses
            ``sglang``).
        max_batch_size: requests decoded together in one forward step.
        max_new_tokens_limit: largest ``max_new_tokens`` a request may ask for.
        max_input_tokens: longest prompt accepted, in tokens (UTF-8 bytes for text).
        request_timeout_s: how long ``/generate`` waits for its result before answering 504.
        startup_timeout_s: how long to wait for every scheduler to load its model.
        collective_timeout_s: a rank's wait for its peers within one step before it gives up
            and exits (torch.distributed's NCCL default is 600 s).
        exit_with_parent: exit when the process that started the server dies.
        vocab_size: model vocabulary (>= 256 for byte-level text).
        hidden_size: model width.
        num_layers: transformer blocks.
    """

    tp: int = Field(default=1, ge=1, le=16)
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    title_prefix: str = "demo"
    max_batch_size: int = Field(default=8, ge=1, le=256)
    max_new_tokens_limit: int = Field(default=4096, ge=1)
    max_input_tokens: int = Field(default=8192, ge=1)
    request_timeout_s: float = Field(default=300.0, gt=0)
    startup_timeout_s: float = Field(default=120.0, gt=0)
    collective_timeout_s: float = Field(default=600.0, gt=0)
    exit_with_parent: bool = False
    vocab_size: int = Field(default=1024, ge=256)
    hidden_size: int = Field(default=128, ge=8)
    num_layers: int = Field(default=2, ge=1)

    def scheduler_title(self, rank: int) -> str:
        """SGLang-style title of rank ``rank``, e.g. ``demo::scheduler_TP0``."""
        return f"{self.title_prefix}::scheduler_TP{rank}"


@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    output_ids: list[int] | None = None


class _StatsCollector:
    """Exports rank 0's shared stats array with SGLang's metric names."""

    def __init__(self, stats: Any) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats
        labels = ["model_name"]
        values = [MODEL_NAME]
        for name, doc, idx in (
            ("sglang:generation_tokens", "Number of generation tokens processed.", STAT_GENERATION_TOKENS),
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", STAT_PROMPT_TOKENS),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(s[idx]))
            yield c
        for name, doc, idx in (
            ("sglang:num_running_reqs", "The number of running requests.", STAT_RUNNING_REQS),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", STAT_QUEUE_REQS),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(s[idx]))
            yield g


class DemoFrontend:
    """The frontend's state: scheduler processes, queues, requests in flight, metrics.

    Args:
        config: server settings.
    """

    def __init__(self, config: DemoServerConfig) -> None:
        self.config = config
        self._ctx = multiprocessing.get_context("spawn")
        self._inboxes = [self._ctx.Queue() for _ in range(config.tp)]
        self._result_q = self._ctx.Queue()
        self._ack_q = self._ctx.Queue()
        self._stats = self._ctx.RawArray("q", STAT_SLOTS)
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: monotonic time until which an injected hang may hold a forward (``inf``: for good)
        self._hang_until = 0.0
        self._dispatcher: threading.Thread | None = None
        self.scheduler_pids: list[int] = []
        self.errors: list[str] = []
        #: the ranks' process-group rendezvous (a gloo file store), removed at stop
        self._dist_dir = Path(tempfile.mkdtemp(prefix="servewatch-demo-dist-"))
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(self._stats))

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start every rank and wait until all loaded their model.

        Raises:
            StartupError: a rank died, or not all were ready within ``startup_timeout_s``.
        """
        cfg = self.config
        model = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers}
        for rank in range(cfg.tp):
            args = SchedulerArgs(
                rank=rank,
                tp_size=cfg.tp,
                parent_pid=os.getpid(),
                title=cfg.scheduler_title(rank),
                model=model,
                max_batch_size=cfg.max_batch_size,
                collective_timeout_s=cfg.collective_timeout_s,
                dist_init=f"file://{self._dist_dir / 'store'}",
            )
            proc = self._ctx.Process(
                target=run_scheduler,
                args=(args, self._inboxes, self._result_q, self._ack_q, self._stats),
                name=f"scheduler_TP{rank}",
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        ready: dict[int, int] = {}
        deadline = time.monotonic() + cfg.startup_timeout_s
        while len(ready) < cfg.tp:
            try:
                msg = self._result_q.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    raise StartupError(f"scheduler process(es) {', '.join(dead)} exited during startup") from None
                if time.monotonic() >= deadline:
                    raise StartupError(f"schedulers not ready after {cfg.startup_timeout_s} s") from None
                continue
            if msg[0] == "ready":
                ready[msg[1]] = msg[2]
            elif msg[0] == "error":
                raise StartupError(f"scheduler TP{msg[1]} failed: {msg[2]}")
        self.scheduler_pids = [ready[r] for r in range(cfg.tp)]
        self._dispatcher = threading.Thread(target=self._dispatch, name="demo-results", daemon=True)
        self._dispatcher.start()

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self._result_q.get(timeout=_POLL_S)
            except (queue.Empty, EOFError, OSError):
                continue
            if msg[0] == "done":
                with self._lock:
                    pending = self._pending.get(msg[1])
                if pending is not None:
                    pending.output_ids = list(msg[2])
                    pending.done.set()
            elif msg[0] == "error":
                self.errors.append(f"TP{msg[1]}: {msg[2]}")
                print(f"demo server: scheduler TP{msg[1]}: {msg[2]}", file=sys.stderr, flush=True)

    def stop(self, grace_s: float = 4.0) -> None:
        """Stop the ranks: ask, then SIGTERM, then SIGKILL.

        A hung rank never reads the request, so asking waits only ``grace_s / 2``, and not at all
        while an injected hang may still hold a forward (its peers wait in the collective: none
        reads it); SIGTERM (which a rank turns into a clean exit that removes its step-counter
        file) and SIGKILL wait at most ``grace_s`` each, in seconds.
        """
        self._stop.set()
        for inbox in self._inboxes:
            try:
                inbox.put(("stop",))
            except (ValueError, OSError):
                pass
        for escalate in (None, "terminate", "kill"):
            alive = [p for p in self._procs if p.is_alive()]
            if not alive:
                break
            if escalate is not None:
                for proc in alive:
                    getattr(proc, escalate)()
            if escalate is None and time.monotonic() < self._hang_until:
                continue  # hung: asking would only wait out grace_s / 2
            deadline = time.monotonic() + (grace_s / 2 if escalate is None else grace_s)
            for proc in alive:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for q in (*self._inboxes, self._result_q, self._ack_q):
            q.cancel_join_thread()
            q.close()
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=grace_s)
        shutil.rmtree(self._dist_dir, ignore_errors=True)

    # -- requests ---------------------------------------------------------------------------

    def healthy(self) -> bool:
        """True while every scheduler process is alive (a hung one still counts as alive)."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def generate(self, input_ids: list[int], max_new_tokens: int) -> tuple[str, list[int] | None]:
        """Run one request through rank 0; blocks up to ``request_timeout_s``.

        Returns:
            ``(request id, output ids)``; the ids are ``None`` when ``request_timeout_s`` passed
            or a scheduler process exited (see :meth:`healthy`).
        """
        rid = uuid.uuid4().hex
        pending = _Pending()
        with self._lock:
            self._pending[rid] = pending
        try:
            self._inboxes[0].put(("generate", rid, input_ids, max_new_tokens))
            deadline = time.monotonic() + self.config.request_timeout_s
            while self.healthy():
                left_s = deadline - time.monotonic()
                if left_s <= 0 or pending.done.wait(timeout=min(_POLL_S, left_s)):
                    break
            return rid, pending.output_ids
        finally:
            with self._lock:
                self._pending.pop(rid, None)

    def inject_hang(self, tp_rank: int, seconds: float | None) -> None:
        """Arm a one-shot hang in rank ``tp_rank``'s next forward (``None``: forever)."""
        until = math.inf if seconds is None else time.monotonic() + seconds + 1.0  # + its forward's start
        self._hang_until = max(self._hang_until, until)
        self._inboxes[tp_rank].put(("hang", seconds))

    def info(self, host: str, port: int) -> dict[str, Any]:
        """The ready-file document."""
        return {
            "host": host,
            "port": port,
            "base_url": f"http://{host}:{port}",
            "pid": os.getpid(),
            "tp_size": self.config.tp,
            "scheduler_pids": list(self.scheduler_pids),
            "scheduler_titles": [self.config.scheduler_title(r) for r in range(self.config.tp)],
        }


class _GenerateBody(BaseModel):
    text: str | None = None
    input_ids: list[int] | None = None
    max_new_tokens: int | None = Field(default=None, ge=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)


class _HangBody(BaseModel):
    tp_rank: int = Field(default=0, ge=0)
    seconds: float | None = Field(default=None, ge=0)


class _Handler(BaseHTTPRequestHandler):
    server_version = "servewatch-demo/0.1"
    protocol_version = "HTTP/1.1"
    #: an idle keep-alive connection is closed after 5 s, as uvicorn (vLLM's, SGLang's server)
    #: does: a connection held open and quiet longer is a request in flight to the agent
    #: (``metrics.open_request_quiet_s``), never an idle client's
    timeout = 5.0
    frontend: DemoFrontend  # set on the subclass made by serve()

    def log_message(self, format: str, *args: Any) -> None:
        """Silence per-request access logs (request bodies are never logged either)."""

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except ConnectionError:  # the client gave up (`curl -m 60` on a hung rank): nobody to answer
            self.close_connection = True

    def _json(self, status: int, doc: Any) -> None:
        self._send(status, json.dumps(doc).encode())

    def _read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY_BYTES:
            raise ValueError(f"body larger than {_MAX_BODY_BYTES} bytes")
        return json.loads(self.rfile.read(length) or b"{}")

    def do_GET(self) -> None:
        fe = self.frontend
        path = self.path.split("?", 1)[0]
        if path == "/health":
            if fe.healthy():
                self._json(HTTPStatus.OK, {"status": "ok"})
            else:
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"status": "scheduler exited"})
        elif path == "/metrics":
            self._send(HTTPStatus.OK, generate_latest(fe.registry), CONTENT_TYPE_LATEST)
        elif path == "/server_info":
            address = self.server.server_address
            assert isinstance(address, tuple), address  # an AF_INET(6) server
            host, port = address[:2]
            self._json(HTTPStatus.OK, fe.info(str(host), int(port)))
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no route {path}"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            doc = self._read_json()
            if path == "/generate":
                self._generate(_GenerateBody.model_validate(doc))
            elif path == "/debug/hang":
                self._hang(_HangBody.model_validate(doc))
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no route {path}"})
        except (ValueError, ValidationError) as exc:  # json.JSONDecodeError is a ValueError
            # pydantic's message may echo the input; report only the error kinds.
            detail = "; ".join(e["msg"] for e in exc.errors()) if isinstance(exc, ValidationError) else str(exc)
            self._json(HTTPStatus.BAD_REQUEST, {"error": detail})

    def _generate(self, body: _GenerateBody) -> None:
        cfg = self.frontend.config
        if (body.text is None) == (body.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
        ids = list(body.text.encode("utf-8")) if body.text is not None else list(body.input_ids or [])
        if not ids or len(ids) > cfg.max_input_tokens:
            raise ValueError(f"prompt must have 1..{cfg.max_input_tokens} tokens")
        if any(not 0 <= t < cfg.vocab_size for t in ids):
            raise ValueError(f"input_ids must be in [0, {cfg.vocab_size})")
        max_new = body.max_new_tokens or body.sampling_params.get("max_new_tokens") or 16
        if not isinstance(max_new, int) or not 1 <= max_new <= cfg.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens must be an integer in 1..{cfg.max_new_tokens_limit}")
        rid, out = self.frontend.generate(ids, max_new)
        if out is None and not self.frontend.healthy():
            self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "a scheduler process exited", "id": rid})
            return
        if out is None:
            self._json(HTTPStatus.GATEWAY_TIMEOUT, {"error": f"no result within {cfg.request_timeout_s} s", "id": rid})
            return
        self._json(
            HTTPStatus.OK,
            {
                "output_ids": out,
                "meta_info": {
                    "id": rid,
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out),
                    "finish_reason": {"type": "length", "length": len(out)},
                },
            },
        )

    def _hang(self, body: _HangBody) -> None:
        tp = self.frontend.config.tp
        if body.tp_rank >= tp:
            raise ValueError(f"tp_rank must be in 0..{tp - 1}")
        self.frontend.inject_hang(body.tp_rank, body.seconds)
        self._json(HTTPStatus.OK, {"armed": True, "tp_rank": body.tp_rank, "seconds": body.seconds})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _write_ready_file(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _parse_args(argv: Sequence[str] | None) -> tuple[DemoServerConfig, Path | None]:
    defaults = DemoServerConfig()
    p = argparse.ArgumentParser(prog="python -m agent.demo.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=defaults.tp, help="scheduler processes (TP ranks)")
    p.add_argument("--host", default=defaults.host, help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=defaults.port, help="TCP port, 0 = any free port")
    p.add_argument("--ready-file", type=Path, default=None, metavar="PATH", help="write the ready JSON here")
    p.add_argument("--title-prefix", default=defaults.title_prefix, help="scheduler titles <prefix>::scheduler_TP<n>")
    p.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size)
    p.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s, metavar="SECONDS")
    p.add_argument("--startup-timeout", type=float, default=defaults.startup_timeout_s, metavar="SECONDS")
    p.add_argument("--collective-timeout", type=float, default=defaults.collective_timeout_s, metavar="SECONDS")
    p.add_argument("--exit-with-parent", action="store_true", help="exit when the parent process dies")
    ns = p.parse_args(argv)
    try:
        cfg = DemoServerConfig(
            tp=ns.tp,
            host=ns.host,
            port=ns.port,
            title_prefix=ns.title_prefix,
            max_batch_size=ns.max_batch_size,
            request_timeout_s=ns.request_timeout,
            startup_timeout_s=ns.startup_timeout,
            collective_timeout_s=ns.collective_timeout,
            exit_with_parent=ns.exit_with_parent,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        p.error(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}")
    return cfg, ns.ready_file


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo server until SIGTERM/SIGINT (or the parent's death with ``--exit-with-parent``).

    Returns:
        :data:`EXIT_OK`, :data:`EXIT_FAILED` (startup failed) or :data:`EXIT_USAGE`
        (bad arguments exit through argparse with 2; torch missing).
    """
    if not torch_available():
        print(TORCH_MISSING_MESSAGE, file=sys.stderr)
        return EXIT_USAGE
    cfg, ready_file = _parse_args(argv)
    parent_pid = os.getppid()
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    frontend = DemoFrontend(cfg)
    httpd: _Server | None = None
    try:
        try:
            frontend.start()
        except StartupError as exc:
            print(f"demo server: {exc}", file=sys.stderr)
            return EXIT_FAILED
        handler = type("Handler", (_Handler,), {"frontend": frontend})
        httpd = _Server((cfg.host, cfg.port), handler)
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": _POLL_S}, name="demo-http", daemon=True).start()
        host, port = httpd.server_address[:2]
        info = frontend.info(str(host), int(port))
        if ready_file is not None:
            _write_ready_file(ready_file, info)
        print(json.dumps(info), flush=True)
        while not stop.wait(_POLL_S):
            if cfg.exit_with_parent and os.getppid() != parent_pid:
                break
        return EXIT_OK
    finally:
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        frontend.stop()


if __name__ == "__main__":
    sys.exit(main())
