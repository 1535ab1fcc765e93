"""Scheduler subprocesses of the demo server: one per tensor-parallel (TP) rank.

Owns the batch loop that runs :class:`agent.demo.model.TinyLM`, the message protocol between
the HTTP frontend and the ranks, and the shared stats the frontend exports as metrics. Imports
torch (through :mod:`agent.demo.model`), setproctitle and :mod:`agent.sdk`; never the agent.

How the ranks work together (a small imitation of SGLang's TP group, without real sharding):

* The frontend sends every request to rank 0 (the leader), as SGLang's tokenizer manager sends
  to the TP-0 scheduler. Rank 0 keeps the running batch (continuous batching, up to
  ``max_batch_size`` requests; one decode step for all of them per forward).
* The ranks form a real ``torch.distributed`` process group (gloo on CPU, rendezvous through a
  file store the frontend names in :attr:`SchedulerArgs.dist_init`), with the collective Flight
  Recorder on (``TORCH_FR_BUFFER_SIZE``, set before ``init_process_group``; a user's value wins).
* Before each forward, rank 0 tells the other ranks through their inbox that a step comes (the
  work queue), then every rank takes part in two real collectives per forward: a ``broadcast``
  of the batch's input ids from rank 0 (``_broadcast_batch``) and, after the forward, an
  ``all_reduce`` of the logits (``_wait_for_all_reduce``; MAX over identical replicas, so the
  output stays exactly deterministic). A hung rank therefore stalls the whole group inside a
  real collective, as with NCCL: the hung rank shows ``_injected_hang_in_forward`` in py-spy, the
  others ``_wait_for_all_reduce`` under torch.distributed's ``all_reduce``, and the Flight
  Recorders show the hung rank one collective behind.
* Every rank counts its forward steps with :func:`agent.sdk.step` (SGLang's ``forward_ct``) and
  marks itself busy with :func:`agent.sdk.set_pending` before a forward starts.
* Every rank serves the SDK control socket (:func:`agent.sdk.serve_control`) and torch's C++
  worker server (:func:`agent.sdk.serve_torch_worker`), which answers Flight Recorder requests
  while the rank's Python thread is stuck. Rank 0 holds the
  requests: each one is an :func:`agent.sdk.request_span` from its arrival until its result is
  sent (so the socket's ``inflight`` command lists it), and each batched forward is an
  :func:`agent.sdk.forward_span` linked to the requests of the batch. Spans are exported only when
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (OTLP, ``OTEL_EXPORTER_OTLP_PROTOCOL`` ``grpc`` or
  ``http/protobuf``, the default); otherwise the tracer is a no-op and only the ids exist.
* The process group's timeout is ``collective_timeout_s`` (like torch.distributed's NCCL
  timeout): a collective that fails (timeout, a peer died) makes the rank report an error and
  exit 1.
* Every queue wait polls (0.5 s) whether the parent (the frontend) is still alive; an orphaned
  rank exits, so nothing is left running (a rank inside a collective follows when its peers go).

Messages (plain tuples, pickled by multiprocessing queues):

* frontend -> rank 0 inbox: ``("generate", rid, input_ids, max_new_tokens)``
* frontend -> any inbox: ``("hang", seconds_or_None)``, ``("stop",)``
* rank 0 -> follower inbox: ``("step", step_no, batch_size, pending_after)`` (the ids follow
  through the ``broadcast`` collective)
* rank -> frontend result queue: ``("ready", rank, pid)``, ``("done", rid, output_ids)``,
  ``("error", rank, detail)``
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import warnings
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STAT_FORWARD_CT",
    "STAT_GENERATION_TOKENS",
    "STAT_PROMPT_TOKENS",
    "STAT_QUEUE_REQS",
    "STAT_RUNNING_REQS",
    "STAT_SLOTS",
    "SchedulerArgs",
    "run_scheduler",
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
        dist_init: ``init_method`` of the ranks' process group (``file://...``; one per server).
    """

    rank: int
    tp_size: int
    parent_pid: int
    title: str
    model: dict[str, Any] = field(default_factory=dict)
    max_batch_size: int = 8
    collective_timeout_s: float = 600.0
    dist_init: str = ""


#: Flight Recorder entries kept per rank when the user did not size the buffer.
FR_BUFFER_DEFAULT = "2000"


class _CollectiveTimeout(Exception):
    """A collective failed: a peer did not answer within ``collective_timeout_s``, or died."""


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
            from agent import sdk

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

    def _broadcast_batch(self, contexts: list[list[int]] | None, batch_size: int) -> list[list[int]]:
        """The batch's input ids, sent by rank 0 to every rank (a real ``broadcast`` collective)."""
        import torch
        import torch.distributed as dist

        window = self.model.cfg.window
        ids = torch.tensor(contexts, dtype=torch.long) if contexts is not None else torch.zeros(batch_size, window, dtype=torch.long)
        self._collective(dist.broadcast, ids, src=0)
        return ids.tolist()

    def _wait_for_all_reduce(self, logits: Any) -> list[int]:
        """The all-reduce closing a TP forward (a real ``all_reduce`` collective); next ids."""
        import torch.distributed as dist

        self._collective(dist.all_reduce, logits, op=dist.ReduceOp.MAX)
        return logits.argmax(dim=-1).tolist()

    def _collective(self, collective: Any, *args: Any, **kwargs: Any) -> None:
        try:
            collective(*args, **kwargs)
        except RuntimeError as exc:  # gloo: timeout, or a peer closed its connection
            self._check_parent()
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise _CollectiveTimeout(
                f"{collective.__name__} after step {self.step_no} failed (timeout {self.args.collective_timeout_s:g} s): {detail}"
            ) from None

    def _forward(self, contexts: list[list[int]]) -> list[int]:
        import torch

        with torch.no_grad():
            logits = self.model(torch.tensor(contexts, dtype=torch.long))
        return self._wait_for_all_reduce(logits.contiguous())

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
        from agent import sdk

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
                    inbox.put(("step", self.step_no, len(contexts), pending_after))
                contexts = self._broadcast_batch(contexts, len(contexts))
                next_ids = self._forward(contexts)
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

    def _wait_for_leader(self) -> tuple | None:
        """Next message from the inbox (a step announcement, a fault, stop); ``None`` on stop."""
        while not self.stopping:
            try:
                return self.inbox.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_parent()
        return None

    def run_follower(self) -> None:
        from agent import sdk

        while not self.stopping:
            msg = self._wait_for_leader()
            if msg is None:
                break
            if msg[0] != "step":
                self._handle(msg)
                continue
            _, step_no, batch_size, pending_after = msg
            sdk.set_pending(batch_size)
            contexts = self._broadcast_batch(None, batch_size)
            self._forward(contexts)
            self.step_no = step_no
            sdk.step(pending=pending_after)


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _tracer_provider_from_env() -> Any:
    """The demo's fallback ``TracerProvider`` (used while no agent is attached to the span
    channel), or ``None`` without an endpoint.

    Built by :func:`exporters.otlp.sdk_export.tracer_provider_from_env`: the same ``OTEL_*``
    resolution, protocol default (``grpc``), TLS and lossless processor as the agent, so request
    and forward spans reach the collector the incident goes to.
    """
    from exporters.otlp.sdk_export import tracer_provider_from_env

    try:
        return tracer_provider_from_env("servewatch-demo")
    except ValueError as exc:  # ExportConfigError: a bad OTEL_* value; the demo serves without spans
        print(f"demo scheduler: no span export ({exc})", file=sys.stderr, flush=True)
        return None


def _shutdown_tracer_provider(provider: Any) -> None:
    """Flush and stop ``provider`` within :data:`_TRACE_FLUSH_TIMEOUT_S` (then give up on it)."""
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(_TRACE_FLUSH_TIMEOUT_S)


def _init_process_group(args: SchedulerArgs) -> None:
    """Join the ranks' gloo process group (the Flight Recorder is sized by then)."""
    import datetime

    import torch.distributed as dist

    if not args.dist_init:
        raise ValueError("SchedulerArgs.dist_init is required (the process group's init_method)")
    dist.init_process_group(
        "gloo",
        init_method=args.dist_init,
        rank=args.rank,
        world_size=args.tp_size,
        timeout=datetime.timedelta(seconds=args.collective_timeout_s),
    )


def run_scheduler(args: SchedulerArgs, inboxes: list, result_q, ack_q, stats) -> None:
    """Entry point of one scheduler process (the target of a 'spawn' multiprocessing Process).

    Sets the SGLang-style title, builds the model, reports ``("ready", rank, pid)`` and runs the
    batch loop until ``("stop",)``, the parent's death, SIGTERM, or a collective timeout (then
    ``("error", rank, detail)`` is reported and the process exits 1).

    Args:
        args: this rank's settings.
        inboxes: one ``multiprocessing.Queue`` per rank (index = rank).
        result_q: queue to the frontend.
        ack_q: unused (the ranks synchronise through collectives); kept for the frontend.
        stats: shared int64 array of ``STAT_SLOTS`` words (``multiprocessing.RawArray``).
    """
    import setproctitle

    setproctitle.setproctitle(args.title)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when ranks stop
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read at torch import: no c10d chatter in the demo
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    from agent import sdk

    for q in (result_q, ack_q, *inboxes):
        q.cancel_join_thread()  # never block exit on a queue nobody reads any more
    exit_code = 0
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER_DEFAULT)  # read at init_process_group
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
    provider = _tracer_provider_from_env() if args.rank == 0 else None
    sdk.tracing.set_tracer_provider(provider)
    try:
        try:
            sdk.serve_control()
        except OSError as exc:  # the demo still serves; the agent just cannot list its requests
            print(f"{args.title}: no SDK control socket: {exc}", file=sys.stderr, flush=True)
        try:
            sdk.serve_torch_worker()
        except OSError as exc:  # Flight Recorder still readable through the control socket
            print(f"{args.title}: no torch worker server: {exc}", file=sys.stderr, flush=True)
        _init_process_group(args)
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
        sdk.stop_torch_worker()
        sdk.close()
        if provider is not None:
            _shutdown_tracer_provider(provider)
    if exit_code:
        raise SystemExit(exit_code)
