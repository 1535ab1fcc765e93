"""A server using the SDK whose one structured-output request compiles its grammar forever on the
engine's grammar thread while the other requests complete (vLLM #54003).

Requests arrive at a steady rate (``--rate`` per second), each served on its own handler thread
inside ``agent.sdk.request_span`` (the SDK's in-flight registry; its completions give the p99); a
plain request decodes for ``--decode-s`` and completes. Request number ``--stuck-at`` asks for a
JSON-schema grammar: its compile is handed to the grammar thread (a one-worker
``ThreadPoolExecutor`` named ``structured_output_grammar``, as vLLM compiles grammars off its
scheduler loop), which holds the request (``RequestHandle.held_here``) and spins forever in
:func:`compile_grammar`. The engine loop steps the SDK counter (``agent.sdk.step``) all along: the
server progresses, only that request is stuck.

Prints ``READY <pid>`` once the control socket serves, then ``STUCK <request id> <native tid>``
when the stuck compile starts. Stops after ``--max-lifetime-s``. Stdlib + agent.sdk only.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from agent import sdk
from agent.sdk import control
from agent.sdk.tracing import RequestHandle, request_span


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def compile_grammar(schema: str, deadline: float) -> int:
    """The grammar compile that never ends for this schema: a busy loop (the compiler's own code,
    not a wait), bounded only by the program's lifetime."""
    states = 0
    while time.monotonic() < deadline:
        states = (states * 31 + len(schema)) % 1_000_003
    return states


class Engine:
    """The scheduler loop (steps while requests are in flight) and the grammar thread."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.inflight = 0
        self.lock = threading.Lock()
        self.grammar = ThreadPoolExecutor(max_workers=1, thread_name_prefix="structured_output_grammar")

    def loop(self) -> None:
        while time.monotonic() < self.deadline:
            with self.lock:
                pending = self.inflight
            sdk.step(pending=pending)
            time.sleep(0.01)

    def _compile_held(self, req: RequestHandle, schema: str) -> int:
        with req.held_here():
            _say(f"STUCK {req.request_id} {threading.get_native_id()}")
            return compile_grammar(schema, self.deadline)

    def serve(self, rid: str, decode_s: float, schema: str | None) -> None:
        with self.lock:
            self.inflight += 1
        try:
            with request_span(rid, model="tiny", operation="text_completion", provider="vllm", input_tokens=5) as req:
                if schema is not None:
                    self.grammar.submit(self._compile_held, req, schema).result()
                time.sleep(decode_s)
                req.set_output_tokens(8)
        finally:
            with self.lock:
                self.inflight -= 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--decode-s", type=float, default=0.02)
    parser.add_argument("--stuck-at", type=int, default=30)
    parser.add_argument("--max-lifetime-s", type=float, default=120.0)
    args = parser.parse_args()
    deadline = time.monotonic() + args.max_lifetime_s
    engine = Engine(deadline)
    control.serve_control()
    sdk.step(pending=0)
    threading.Thread(target=engine.loop, name="EngineCoreLoop", daemon=True).start()
    _say(f"READY {os.getpid()}")
    n = 0
    while time.monotonic() < deadline:
        n += 1
        schema = '{"type": "object", "properties": {"a": {"$ref": "#"}}}' if n == args.stuck_at else None
        threading.Thread(target=engine.serve, args=(f"cmpl-{n:04d}", args.decode_s, schema), name=f"request-{n}",
                         daemon=True).start()
        time.sleep(1.0 / args.rate)
    os._exit(0)  # the grammar thread never returns: do not wait for it


if __name__ == "__main__":
    sys.exit(main())
