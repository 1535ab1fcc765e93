"""Scheduler subprocesses of the demo server: one per tensor-parallel (TP) rank.

Owns the batch loop that runs :class:`agent.demo.model.TinyLM`, the message protocol between
the HTTP frontend and the ranks, and the shared stats the frontend exports as metrics. Imports
torch (through :mod:`agent.demo.model`), setproctitle and :mod:`agent.sdk`; never the agent.

How the ranks work together (a small imitation of SGLang's TP group, without real sharding):

* The frontend sends every request to rank 0 (the leader), as SGLang's tokenizer manager sends
  to the TP-0 scheduler. Rank 0 keeps the running batch (continuous batching, up to
  ``max_batch_size`` requests; one decode step for all of them per forward).
* Before each forward, rank 0 broadcasts the batch's input ids to the other ranks; every rank
  runs the same full model on them (weights are identical, from the same seed). After the
  forward, rank 0 waits for every other rank's acknowledgement: this stands in for the
  all-reduce of a real TP forward. So a hung rank stalls the whole group, as it would with
  NCCL: the hung rank shows ``_injected_hang_in_forward`` in py-spy, the others show
  ``_wait_for_all_reduce`` (rank 0) or ``_wait_for_leader_broadcast`` (followers).
* Every rank counts its forward steps with :func:`agent.sdk.step` (SGLang's ``forward_ct``) and
  marks itself busy with :func:`agent.sdk.set_pending` before a forward starts.
* Every rank serves the SDK control socket (:func:`agent.sdk.serve_control`). Rank 0 holds the
  requests: each one is an :func:`agent.sdk.request_span` from its arrival until its result is
  sent (so the socket's ``inflight`` command lists it), and each batched forward is an
  :func:`agent.sdk.forward_span` linked to the requests of the batch. Spans are exported only when
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (OTLP, ``OTEL_EXPORTER_OTLP_PROTOCOL`` ``grpc`` or
  ``http/protobuf``, the default); otherwise the tracer is a no-op and only the ids exist.
* Like torch.distributed's NCCL timeout, a collective wait gives up after
  ``collective_timeout_s``: the rank reports an error and exits 1.
* Every wait polls (0.5 s) whether the parent (the frontend) is still alive; an orphaned rank
  exits, so nothing is left running.

Messages (plain tuples, pickled by multiprocessing queues):

* frontend -> rank 0 inbox: ``("generate", rid, input_ids, max_new_tokens)``
* frontend -> any inbox: ``("hang", seconds_or_None)``, ``("stop",)``
* rank 0 -> follower inbox: ``("step", step_no, contexts, pending_after)``
* follower -> rank 0 ack queue: ``("ack", rank, step_no)``
* rank -> frontend result queue: ``("ready", rank, pid)``, ``("done", rid, output_ids)``,
  ``("error", rank, detail)``
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import warnings
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SchedulerArgs",
    "run_scheduler",
    "STAT_GENERATION_TOKENS",
    "STAT_PROMPT_TOKENS",
    "STAT_RUNNING_REQS",
    "STAT_QUEUE_REQS",
    "STAT_FORWARD_CT",
    "STAT_SLOTS",
]

# Indexes into the shared int64 stats array written by rank 0 and read by the frontend.
STAT_GENERATION_TOKENS = 0  # tokens generated so far (SGLang's generation_tokens_total)
STAT_PROMPT_TOKENS = 1  # prompt tokens admitted so far (prompt_tokens_total)
STAT_RUNNING_REQS = 2  # requests in the running batch (num_running_reqs)
STAT_QUEUE_REQS = 3  # requests waiting for a batch slot (num_queue_reqs)
STAT_FORWARD_CT = 4  # forward steps of rank 0
STAT_SLOTS = 5

_POLL_S = 0.5
#: gen_ai.request.model of the demo's request spans.
MODEL_NAME = "demo-tinylm"
#: Longest wait for the span exporter to flush at exit, seconds (the OTel SDK's own shutdown can
#: block for its export timeout and retries when the collector is down).
_TRACE_FLUSH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SchedulerArgs:
    """What one scheduler process needs (pickled to the spawned child).

    Attributes:
        rank: TP rank, 0 is the leader.
        tp_size: ranks in the group.
        parent_pid: the frontend's pid; the rank exits when its parent changes.
        title: process title set with setproctitle, e.g. ``"demo::scheduler_TP0"``.
        model: a :class:`agent.demo.model.TinyLMConfig` as a dict (keeps torch out of the parent).
        max_batch_size: requests decoded together per forward.
        collective_timeout_s: how long a rank waits for its peers in one step before giving up,
            in seconds (torch.distributed's NCCL default is 600 s).
    """

    rank: int
    tp_size: int
    parent_pid: int
    title: str
    model: dict[str, Any] = field(default_factory=dict)
    max_batch_size: int = 8
    collective_timeout_s: float = 600.0


class _CollectiveTimeout(Exception):
    """A peer did not answer within ``collective_timeout_s``."""


class _ParentGone(Exception):
    """The frontend died; this rank must exit."""


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    #: holds the request's open ``agent.sdk.request_span`` (rank 0) until the result is sent
    scope: ExitStack = field(default_factory=ExitStack)
    #: the span's handle (token counts, ids for forward-step links)
    handle: Any = None


class _Scheduler:
    def __init__(self, args: SchedulerArgs, inboxes: list, result_q, ack_q, stats) -> None:
        # torch is imported here, in the child, after the title is set.
        from agent.demo.model import HangFault, TinyLM, TinyLMConfig

        self.args = args
        self.inbox = inboxes[args.rank]
        self.followers = inboxes[1:] if args.rank == 0 else []
        self.result_q = result_q
        self.ack_q = ack_q
        self.stats = stats
        self.fault = HangFault(self._parent_alive)
        self.model = TinyLM(TinyLMConfig(**args.model), fault=self.fault)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.step_no = 0
        self.stopping = False
        self.open_requests: dict[str, _Req] = {}

    # -- plumbing ---------------------------------------------------------------------------

    def _parent_alive(self) -> bool:
        return os.getppid() == self.args.parent_pid

    def _check_parent(self) -> None:
        if not self._parent_alive():
            raise _ParentGone

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "generate":
            import agent.sdk as sdk

            _, rid, input_ids, max_new_tokens = msg
            req = _Req(rid=rid, tokens=list(input_ids), max_new_tokens=int(max_new_tokens))
            req.handle = req.scope.enter_context(
                sdk.request_span(
                    rid,
                    model=MODEL_NAME,
                    operation="text_completion",
                    max_tokens=req.max_new_tokens,
                    input_tokens=len(req.tokens),
                )
            )
            req.handle.set_output_tokens(0)
            self.open_requests[rid] = req
            self.waiting.append(req)
            self.stats[STAT_PROMPT_TOKENS] += len(input_ids)
        elif kind == "hang":
            self.fault.arm(msg[1])
        elif kind == "stop":
            self.stopping = True

    def warm_up(self) -> None:
        """One untimed forward so the first real step is not slowed by lazy init (not a step)."""
        self.model.decode_step([self.model.context([1])])

    # -- rank 0 ----------------------------------------------------------------------------

    def _wait_for_all_reduce(self, step_no: int) -> None:
        """Wait until every follower finished forward ``step_no`` (the emulated all-reduce)."""
        missing = set(range(1, self.args.tp_size))
        deadline = time.monotonic() + self.args.collective_timeout_s
        while missing:
            try:
                _, rank, acked = self.ack_q.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_parent()
                if time.monotonic() > deadline:
                    raise _CollectiveTimeout(
                        f"all-reduce of step {step_no} timed out after {self.args.collective_timeout_s} s "
                        f"waiting for TP ranks {sorted(missing)}"
                    ) from None
                continue
            if acked == step_no:
                missing.discard(rank)

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=_POLL_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        self._handle(msg)
        while True:
            try:
                self._handle(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _finish_request(self, req: _Req) -> None:
        """End the request's span, then send its result (so it is never listed after its answer)."""
        self.open_requests.pop(req.rid, None)
        req.scope.close()
        self.result_q.put(("done", req.rid, req.output))

    def end_requests(self, exc: BaseException | None) -> None:
        """End the spans of requests still open when the loop exits (an error span if ``exc``)."""
        reqs, self.open_requests = list(self.open_requests.values()), {}
        for req in reqs:
            if exc is None:
                req.scope.close()
            else:
                req.scope.__exit__(type(exc), exc, exc.__traceback__)

    def _publish_queue_stats(self) -> None:
        self.stats[STAT_RUNNING_REQS] = len(self.running)
        self.stats[STAT_QUEUE_REQS] = len(self.waiting)

    def run_leader(self) -> None:
        import agent.sdk as sdk

        while not self.stopping:
            self._check_parent()
            idle = not self.running and not self.waiting
            self._drain_inbox(block=idle)
            if self.stopping:
                break
            while self.waiting and len(self.running) < self.args.max_batch_size:
                self.running.append(self.waiting.popleft())
            self._publish_queue_stats()
            if not self.running:
                continue
            sdk.set_pending(len(self.running) + len(self.waiting))
            finishing = sum(1 for r in self.running if len(r.output) + 1 >= r.max_new_tokens)
            pending_after = len(self.running) - finishing + len(self.waiting)
            contexts = [self.model.context(r.tokens) for r in self.running]
            self.step_no += 1
            with sdk.forward_span([r.handle for r in self.running]):
                for inbox in self.followers:
                    inbox.put(("step", self.step_no, contexts, pending_after))
                next_ids = self.model.decode_step(contexts)
                self._wait_for_all_reduce(self.step_no)
            still_running: list[_Req] = []
            for req, tok in zip(self.running, next_ids):
                req.tokens.append(tok)
                req.output.append(tok)
                req.handle.set_output_tokens(len(req.output))
                if len(req.output) >= req.max_new_tokens:
                    self._finish_request(req)
                else:
                    still_running.append(req)
            self.running = still_running
            self.stats[STAT_GENERATION_TOKENS] += len(next_ids)
            self.stats[STAT_FORWARD_CT] += 1
            self._publish_queue_stats()
            sdk.step(pending=len(self.running) + len(self.waiting))

    # -- ranks 1..N-1 ----------------------------------------------------------------------

    def _wait_for_leader_broadcast(self, busy: bool) -> tuple | None:
        """Next message from the inbox; while ``busy`` the wait is a collective and is bounded."""
        deadline = time.monotonic() + self.args.collective_timeout_s
        while not self.stopping:
            try:
                return self.inbox.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_parent()
                if busy and time.monotonic() > deadline:
                    raise _CollectiveTimeout(
                        f"broadcast after step {self.step_no} timed out after "
                        f"{self.args.collective_timeout_s} s waiting for TP rank 0"
                    ) from None
        return None

    def run_follower(self) -> None:
        import agent.sdk as sdk

        busy = False
        while not self.stopping:
            msg = self._wait_for_leader_broadcast(busy)
            if msg is None:
                break
            if msg[0] != "step":
                self._handle(msg)
                continue
            _, step_no, contexts, pending_after = msg
            sdk.set_pending(len(contexts))
            self.model.decode_step(contexts)
            self.step_no = step_no
            self.ack_q.put(("ack", self.args.rank, step_no))
            sdk.step(pending=pending_after)
            busy = pending_after > 0


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _tracer_provider_from_env() -> Any:
    """An OTel SDK ``TracerProvider`` exporting over OTLP, or ``None`` without an endpoint.

    Set only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or its traces-specific variant) is set; the
    exporter reads the endpoint, headers and timeout from the standard ``OTEL_*`` variables and
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` picks gRPC (``grpc``) or HTTP (``http/protobuf``, default).
    """
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    attrs: dict[str, Any] = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "servewatch-demo"}
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def _shutdown_tracer_provider(provider: Any) -> None:
    """Flush and stop ``provider`` within :data:`_TRACE_FLUSH_TIMEOUT_S` (then give up on it)."""
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(_TRACE_FLUSH_TIMEOUT_S)


def run_scheduler(args: SchedulerArgs, inboxes: list, result_q, ack_q, stats) -> None:
    """Entry point of one scheduler process (the target of a 'spawn' multiprocessing Process).

    Sets the SGLang-style title, builds the model, reports ``("ready", rank, pid)`` and runs the
    batch loop until ``("stop",)``, the parent's death, SIGTERM, or a collective timeout (then
    ``("error", rank, detail)`` is reported and the process exits 1).

    Args:
        args: this rank's settings.
        inboxes: one ``multiprocessing.Queue`` per rank (index = rank).
        result_q: queue to the frontend.
        ack_q: followers' acknowledgements to rank 0.
        stats: shared int64 array of ``STAT_SLOTS`` words (``multiprocessing.RawArray``).
    """
    import setproctitle

    setproctitle.setproctitle(args.title)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when ranks stop
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import agent.sdk as sdk

    for q in (result_q, ack_q, *inboxes):
        q.cancel_join_thread()  # never block exit on a queue nobody reads any more
    exit_code = 0
    provider = _tracer_provider_from_env() if args.rank == 0 else None
    sdk.tracing.set_tracer_provider(provider)
    try:
        try:
            sdk.serve_control()
        except OSError as exc:  # the demo still serves; the agent just cannot list its requests
            print(f"{args.title}: no SDK control socket: {exc}", file=sys.stderr, flush=True)
        sched = _Scheduler(args, inboxes, result_q, ack_q, stats)
        sched.warm_up()
        result_q.put(("ready", args.rank, os.getpid()))
        try:
            if args.rank == 0:
                sched.run_leader()
            else:
                sched.run_follower()
        except BaseException as exc:
            sched.end_requests(None if isinstance(exc, _ParentGone) else exc)
            raise
        sched.end_requests(None)
    except _ParentGone:
        exit_code = 0
    except _CollectiveTimeout as exc:
        result_q.put(("error", args.rank, str(exc)))
        print(f"{args.title}: {exc}", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        sdk.stop_control()
        sdk.close()
        if provider is not None:
            _shutdown_tracer_provider(provider)
    if exit_code:
        raise SystemExit(exit_code)
