"""servewatch in-process SDK, imported by an inference server.

The SDK's public face: the exact forward-step counter (:func:`step`, :func:`set_pending`, from
:mod:`agent.sdk.steps`, with the hooks other SDK parts run on the model thread at each step),
profiling, ranges, request spans and the control socket, re-exported from their modules. From
the first step on, the process also leaves a death notice (:mod:`agent.sdk.exitnotice`: exit
code, uncaught exception type and place, or the signal that killed it; ``SERVEWATCH_EXIT_NOTICE=0``
turns it off), so the agent learns how a rank ended where the kernel will not tell it (a pod). Imports
only the standard library here; opentelemetry-api, torch and mlx are imported lazily by the parts
that need them. It never imports the agent side.

Typical use in a scheduler loop::

    import agent.sdk as sw
    while True:
        batch = get_next_batch()
        sw.set_pending(len(waiting) + len(batch))   # busy before the forward starts
        run_forward(batch)
        sw.step(pending=len(waiting))                # one forward step done (SGLang's forward_ct)
"""

from __future__ import annotations

from agent.sdk.control import control_path, serve_control, stop_control
from agent.sdk.counter import CounterSnapshot, counter_path, read_counter
from agent.sdk.flightrec import serve_torch_worker, stop_torch_worker
from agent.sdk.profiler import ProfilerBusyError, ProfileRequest, request_profile, request_stop
from agent.sdk.profiler import status as profile_status
from agent.sdk.steps import add_step_hook, close, forward_ct, remove_step_hook, set_pending, step
from agent.sdk.tracing import forward_span, inflight, maybe_record_function, request_span

__all__ = [
    "CounterSnapshot",
    # profiling, ranges, request spans, control socket (agent.sdk.profiler / tracing / control)
    "ProfileRequest",
    "ProfilerBusyError",
    "add_step_hook",
    "close",
    "control_path",
    "counter_path",
    "forward_ct",
    "forward_span",
    "inflight",
    "maybe_record_function",
    "profile_status",
    "read_counter",
    "remove_step_hook",
    "request_profile",
    "request_span",
    "request_stop",
    "serve_control",
    # Flight Recorder: torch's worker server next to the control socket (agent.sdk.flightrec)
    "serve_torch_worker",
    "set_pending",
    "step",
    "stop_control",
    "stop_torch_worker",
]
