"""One rank of a small real torch.distributed (gloo) job that can misbehave on purpose.

Run N copies (ranks 0..N-1) with the same ``--init`` (a ``file://`` store). Each rank is titled
``<title>_TP<rank>`` (``--proc-title``: exactly that title, as Ray's ``ray::RayWorkerWrapper`` or
vLLM's ``VLLM::Worker_PP1_TP0``), serves the SDK control socket, torch's worker server (unless
``--no-sdk``) and a forward-step counter, and loops: ``broadcast`` of a [4, 16] tensor from rank
0, a small matmul, ``all_reduce`` of an [8, 32] tensor, ``agent.sdk.step()``.

Faults (on ``--fault-rank`` at step ``--fault-step``):

* ``hang``: the rank spins in compute forever (``_hang_in_compute``); the others wait in the
  step's ``all_reduce``.
* ``kill``: the rank kills itself with SIGSEGV (no core file).
* ``skip``: the rank skips that step's ``broadcast``; its next collective meets the others'
  broadcast (gloo: the group hangs until its timeout).
* ``shape``: the rank all-reduces its tensor viewed as [16, 16] (same bytes, so gloo carries on:
  a desync only the Flight Recorder shows).
* ``slow``: from that step on the rank takes 0.3 s more per step (slow, still progressing).
* ``cycle``: two more process groups (both ranks, made at start); at the fault step the faulty rank
  all-reduces on group A then B, the others on B then A: an ordering deadlock across groups.
* ``deep``: the rank recurses ``--deep-frames`` frames deep (over py-spy's ~4096-frame limit) and
  spins in compute at the bottom; the others wait in the step's ``all_reduce``.
* ``dstate``: the rank "loads weights" (``_load_weights``) in uninterruptible sleep (state D, as a
  read from a hung NFS mount: :mod:`tests.programs.dstate`) until the runtime cap; the others wait
  in the step's ``all_reduce``. A blocking py-spy dump of it hangs; ``--nonblocking`` reads it.
* ``p2p``: at the fault step every rank, as a pipeline stage, receives from its peer (``rank ^ 1``)
  before it sends (``_stage_receive_first``): both post ``recv`` first, a P2P ordering deadlock
  (PyTorch #172668). Run with an even world size.
* ``p2p_hang``: at the fault step the faulty rank, a pipeline stage, hangs in compute before it
  sends; its peer (``rank ^ 1``) waits in ``recv`` for it.
* ``ep``: at the fault step the faulty rank hangs in compute before the MoE layer's dispatch; the
  others enter DeepEP's ``Buffer.dispatch`` (``deep_ep`` on ``PYTHONPATH``: the stand-in under
  ``tests/programs/standins/``, flags in ``$DEEP_EP_STANDIN_FLAGS``) and spin there on the host,
  waiting for it, with no torch.distributed call.
* ``graph_capture``: before the first step, every rank captures CUDA graphs in SGLang's
  ``DecodeCudaGraphRunner.capture()`` (``--framework vllm``: vLLM's ``GPUModelRunner.capture_model()``;
  the stand-ins under ``tests/programs/standins/``, their real module paths, on ``PYTHONPATH``); the
  faulty rank never returns from its capture of size 4, the others wait in the captured forward's
  ``all_reduce`` (SGLang #3547, vLLM #17167). No step is ever taken.
* ``oom``: the rank allocates and touches memory (64 MiB at a time) until the kernel's OOM killer
  ends it (run it in a memory-limited cgroup: :mod:`tests.programs.rank_server`).

``--steps N`` ends every rank in order after N steps (the last collective done by all, the process
group destroyed, exit 0): a job or server that finishes cleanly.

A rank whose collective fails (a peer died, the group timed out) stays in place ``--linger-s``
seconds (``--linger-rank R:S`` for one rank), as NCCL peers sit in the collective until its
timeout, then exits 1.

Prints ``INIT <rank> <pid>`` before ``init_process_group``, ``READY <rank> <pid>`` once the process
group is up, ``FAULT <rank> <fault>`` when the fault fires.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import signal
import sys
import time


def _say(line: str) -> None:
    """One line on stdout in one write (several processes share the pipe: lines never interleave)."""
    os.write(1, (line + "\n").encode())

def _hang_in_compute(x, deadline: float) -> None:
    """The injected hang: busy compute that never finishes (until the runtime cap)."""
    import torch

    m = torch.rand(192, 192)
    while time.monotonic() < deadline:
        chunk_end = time.monotonic() + 0.005
        while time.monotonic() < chunk_end:
            m = torch.tanh(m @ m)
        time.sleep(0.001)  # mostly compute, with room for the 2 shared cores of CI


def _allocate_until_killed(limit_bytes: int) -> None:
    """The injected OOM: keep 64 MiB blocks, every page written, until the kernel kills us (or,
    outside a memory-limited cgroup, ``limit_bytes`` are held: never more, on a shared machine)."""
    held = []
    while len(held) * (64 << 20) < limit_bytes:
        block = bytearray(64 << 20)
        block[::4096] = b"\x01" * (len(block) // 4096)
        held.append(block)


def _slow_compute(seconds: float) -> None:
    time.sleep(seconds)


def _deep(n: int, deadline: float) -> None:
    """The injected deep stack: ``n`` more frames, then busy compute at the bottom."""
    if n <= 0:
        _hang_in_compute(None, deadline)
        return
    _deep(n - 1, deadline)


def _load_weights(deadline: float) -> None:
    """The injected uninterruptible sleep: as a weight read from a hung network filesystem, the
    main thread in state D until ``deadline`` (the child sleeping for it is in the rank's process
    group: killing the group ends both)."""
    from tests.programs.dstate import uninterruptible_sleep

    uninterruptible_sleep(max(1, int(deadline - time.monotonic())))


def _stage_receive_first(x: object, peer: int) -> None:
    """The injected P2P ordering deadlock: receive the peer stage's activations, then send ours."""
    import torch.distributed as dist

    dist.recv(x, src=peer)  # type: ignore[arg-type]
    dist.send(x, dst=peer)  # type: ignore[arg-type]


def _moe_dispatch(x: object) -> None:
    """The MoE layer's token dispatch through DeepEP (a host-side wait for every rank)."""
    import torch.distributed as dist
    from deep_ep import Buffer

    Buffer(dist.group.WORLD).dispatch(x)


def _capture_cuda_graphs(framework: str, hang: bool, deadline: float) -> None:
    """The server's start-up before its first step: CUDA-graph capture (SGLang's or vLLM's runner)."""
    if framework == "vllm":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        GPUModelRunner(hang_size=4 if hang else None, deadline=deadline).capture_model()
        return
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    DecodeCudaGraphRunner(hang_bs=4 if hang else None, deadline=deadline).capture()


def _serve_metrics(port: int) -> object:
    """The job's own ``/metrics`` (as SGLang's and vLLM's frontends serve): ``fm_steps_total``
    (one per step) and ``fm_busy`` (1); returns the counter."""
    from prometheus_client import Counter, Gauge, start_http_server

    steps_total = Counter("fm_steps", "forward steps of the job")
    Gauge("fm_busy", "requests running").set(1)
    start_http_server(port, addr="127.0.0.1")
    return steps_total


def _between_collectives(args: argparse.Namespace, step: int, x: object, groups: tuple[object, ...],
                         deadline: float) -> None:
    """The faults that fire between the step's broadcast and its all-reduce."""
    import torch.distributed as dist

    mine = args.rank == args.fault_rank
    fire = mine and step == args.fault_step
    if fire and args.fault == "hang":
        _hang_in_compute(x, deadline)
    if fire and args.fault == "kill":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fire and args.fault == "oom":
        _allocate_until_killed(args.oom_limit_mib << 20)
    if fire and args.fault == "dstate":
        _load_weights(deadline)
    if fire and args.fault == "deep":
        sys.setrecursionlimit(args.deep_frames + 1000)
        _deep(args.deep_frames, deadline)
    if args.fault == "cycle" and step == args.fault_step:
        for g in (groups if mine else groups[::-1]):
            dist.all_reduce(x, group=g)
    if args.fault == "p2p" and step == args.fault_step:
        _stage_receive_first(x, args.rank ^ 1)
    if args.fault == "p2p_hang" and step == args.fault_step:
        if mine:
            _hang_in_compute(x, deadline)
        _stage_receive_first(x, args.rank ^ 1)
    if args.fault == "ep" and step == args.fault_step:
        if mine:
            _hang_in_compute(x, deadline)
        _moe_dispatch(x)
    if mine and args.fault == "slow" and step >= args.fault_step:
        _slow_compute(0.3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=None, help="default: $RANK (as torchrun sets it)")
    ap.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE (as torchrun sets it)")
    ap.add_argument("--init", required=True, help="init_method, e.g. file:///tmp/x/store")
    ap.add_argument("--title", default="faultjob::scheduler")
    ap.add_argument("--proc-title", default="", help="the exact process title (else <title>_TP<rank>)")
    ap.add_argument("--fault", default="none", choices=["none", "hang", "kill", "skip", "shape", "slow", "cycle", "deep", "dstate", "oom",
                                                   "p2p", "p2p_hang", "ep", "graph_capture"])
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--framework", choices=["sglang", "vllm"], default="sglang", help="whose start-up graph_capture hangs in")
    ap.add_argument("--fault-step", type=int, default=5)
    ap.add_argument("--fault-file", default=None, help="the fault fires at the first step after this file exists (else at --fault-step)")
    ap.add_argument("--step-sleep-s", type=float, default=0.05)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="process group timeout")
    ap.add_argument("--max-runtime-s", type=float, default=90.0)
    ap.add_argument("--linger-s", type=float, default=5.0)
    ap.add_argument("--linger-rank", default="", help="R:S: rank R lingers S seconds instead")
    ap.add_argument("--deep-frames", type=int, default=5000)
    ap.add_argument("--oom-limit-mib", type=int, default=2048, help="most memory the oom fault takes")
    ap.add_argument("--steps", type=int, default=0, help="exit 0 in order after this many steps (0: run on)")
    ap.add_argument("--fr-buffer", default=None, help="TORCH_FR_BUFFER_SIZE (default: 200 unless set)")
    ap.add_argument("--no-sdk", action="store_true", help="no SDK sockets (the Flight Recorder has no source)")
    ap.add_argument("--debug-server", action="store_true", help="start torch's per-rank debug worker server (TCP)")
    ap.add_argument("--no-counter", action="store_true", help="no SDK step counter (progress only from --metrics-port)")
    ap.add_argument("--metrics-port", type=int, default=0,
                    help="rank 0 serves Prometheus /metrics on 127.0.0.1:PORT: fm_steps_total, fm_busy")
    args = ap.parse_args()
    # under torchrun (env:// rendezvous) the rank and world size are its environment's
    args.rank = int(os.environ["RANK"]) if args.rank is None else args.rank
    args.world_size = int(os.environ["WORLD_SIZE"]) if args.world_size is None else args.world_size

    import setproctitle

    setproctitle.setproctitle(args.proc_title or f"{args.title}_TP{args.rank}")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if args.fr_buffer is not None:
        os.environ["TORCH_FR_BUFFER_SIZE"] = args.fr_buffer
    else:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "200")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from agent import sdk

    if not args.no_sdk:
        sdk.serve_control()
        sdk.serve_torch_worker()
    _say(f"INIT {args.rank} {os.getpid()}")
    dist.init_process_group(
        "gloo", init_method=args.init, rank=args.rank, world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    groups = (dist.new_group(list(range(args.world_size))), dist.new_group(list(range(args.world_size)))) \
        if args.fault == "cycle" else ()
    worker = None
    if args.debug_server:
        # what torch.distributed.debug.start_debug_server() starts on every rank (its rank-0 HTTP
        # frontend needs aiohttp, which the agent does not use)
        from torch._C._distributed_c10d import _WorkerServer

        worker = _WorkerServer("::", 0)
    _say(f"READY {args.rank} {os.getpid()}")
    deadline = time.monotonic() + args.max_runtime_s
    steps_total = _serve_metrics(args.metrics_port) if args.metrics_port and args.rank == 0 else None
    b = torch.zeros(4, 16)
    w = torch.ones(32, 32) / 32
    mine = args.rank == args.fault_rank
    if args.fault == "graph_capture":
        _capture_cuda_graphs(args.framework, mine, deadline)
    step = 0
    fault_at: int | None = None
    try:
        while time.monotonic() < deadline:
            step += 1
            if args.fault_file is not None and fault_at is None:
                # the fault's step is the first one after the file exists; none before
                fault_at = step if os.path.exists(args.fault_file) else None
                args.fault_step = fault_at if fault_at is not None else 10**9
            fire = mine and step == args.fault_step
            if fire:
                _say(f"FAULT {args.rank} {args.fault}")
            if not args.no_counter:
                sdk.set_pending(1)
            if not (fire and args.fault == "skip"):
                dist.broadcast(b, 0)
            x = torch.ones(8, 32) @ w
            _between_collectives(args, step, x, groups, deadline)
            dist.all_reduce(x.view(16, 16) if fire and args.fault == "shape" else x)
            if not args.no_counter:
                sdk.step(pending=1)
            if steps_total is not None:
                steps_total.inc()  # type: ignore[attr-defined]
            if args.steps and step >= args.steps:
                dist.barrier()
                dist.destroy_process_group()
                return 0
            time.sleep(args.step_sleep_s)
    except RuntimeError as exc:
        print(f"COLLECTIVE-ERROR {args.rank}: {str(exc).splitlines()[0][:200]}", file=sys.stderr, flush=True)
        rank, _, seconds = args.linger_rank.partition(":")
        time.sleep(float(seconds) if rank and int(rank) == args.rank else args.linger_s)
        return 1
    finally:
        del worker
    return 0


if __name__ == "__main__":
    sys.exit(main())
