"""A real small torch model loop using agent.sdk: step() per batch, request spans, control socket.

Used by the SDK control-socket and profiler-actor tests as the "server". It serves the SDK
control socket, then runs forward steps of a small MLP, each batch serving a few simulated
requests (each request lives ``--request-steps`` steps, in a ``request_span``). Prints
``READY <pid> <socket path>`` on stdout once the socket is up. Exits after ``--max-runtime-s``
seconds whatever happens (a test target must never outlive its test).

    python tests/programs/profiled_model.py [--step-sleep-s 0.01] [--idle] [--hang-after-steps N] [--socket PATH]
        [--own-profiler-steps N --own-trace PATH]

``--own-profiler-steps N``: the server's own code runs a ``torch.profiler.profile()`` from the start
(prints ``OWN-PROFILING``) until step N, then stops it and exports ``--own-trace`` (prints
``OWN-TRACE <path>``), as an operator's always-on profiler or SGLang's ``/start_profile`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time
import warnings

from agent import sdk
from agent.sdk import control, tracing


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-sleep-s", type=float, default=0.01, help="pause between steps, SECONDS")
    ap.add_argument("--request-steps", type=int, default=5, help="steps each simulated request lives")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight at a time")
    ap.add_argument("--idle", action="store_true", help="serve the socket but never step (an idle server)")
    ap.add_argument("--hang-after-steps", type=int, default=0,
                    help="after this many steps, hang inside the next forward with work pending (a stalled rank)")
    ap.add_argument("--socket", default=None, help="control socket path (default: from the pid)")
    ap.add_argument("--max-runtime-s", type=float, default=120.0)
    ap.add_argument("--own-profiler-steps", type=int, default=0, help="the server's own profiler runs until this step")
    ap.add_argument("--own-trace", default="", help="where the server's own profiler exports its trace")
    args = ap.parse_args()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch

    server = control.serve_control(args.socket)
    print(f"READY {os.getpid()} {server.path}", flush=True)
    deadline = time.monotonic() + args.max_runtime_s
    if args.idle:
        while time.monotonic() < deadline:
            time.sleep(0.1)
        return 0

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    x = torch.randn(8, 64)
    ids = itertools.count(1)
    active: list[tuple[contextlib.ExitStack, tracing.RequestHandle, int]] = []

    def admit() -> None:
        # new requests join as soon as others finish, so requests are always in flight
        while len(active) < args.concurrency:
            stack = contextlib.ExitStack()
            rid = f"req-{next(ids)}"
            span = tracing.request_span(rid, model="tiny-mlp", max_tokens=args.request_steps, input_tokens=8)
            active.append((stack, stack.enter_context(span), 0))

    own = None
    if args.own_profiler_steps:
        own = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        own.start()
        print("OWN-PROFILING", flush=True)
    try:
        admit()
        while time.monotonic() < deadline:
            sdk.set_pending(len(active))
            if args.hang_after_steps and sdk.forward_ct() >= args.hang_after_steps:
                while time.monotonic() < deadline:  # hung in its forward: busy, no step
                    time.sleep(0.05)
                break
            with torch.no_grad(), tracing.maybe_record_function("forward"):
                net(x)
            done = []
            for i, (stack, handle, n) in enumerate(active):
                handle.set_output_tokens(n + 1)
                active[i] = (stack, handle, n + 1)
                if n + 1 >= args.request_steps:
                    done.append(i)
            for i in reversed(done):
                active.pop(i)[0].close()
            admit()
            sdk.step(pending=len(active))
            if own is not None and sdk.forward_ct() >= args.own_profiler_steps:
                own.stop()
                own.export_chrome_trace(args.own_trace)
                own = None
                print(f"OWN-TRACE {args.own_trace}", flush=True)
            time.sleep(args.step_sleep_s)
    finally:
        for stack, _, _ in active:
            stack.close()
        control.stop_control()
    return 0


if __name__ == "__main__":
    sys.exit(main())
