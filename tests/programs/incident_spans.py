"""Target program for the write-ahead kill test: one incident mirrored through the agent's real
telemetry pipeline (build_telemetry + SpanMirror) to whatever ``OTEL_EXPORTER_OTLP_*`` says.

Usage: ``python -m tests.programs.incident_spans DATA_DIR ACTIONS``. Prints ``ready``, then
``done <k>`` right after action ``k``'s span was handed to the mirror, ``closed`` after the
incident root, ``exit`` after telemetry shutdown. Request spans (not write-ahead) flow meanwhile.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from agent.model.events import (
    ActionCompleted,
    ActionResult,
    IncidentClosed,
    IncidentOpened,
    Outcome,
    now_ns,
)
from exporters.mirror.mirror import SpanMirror
from exporters.otlp.provider import ExportConfig, build_telemetry
from exporters.otlp.spans import build_span, new_trace_id


def main() -> int:
    data_dir, actions = Path(sys.argv[1]), int(sys.argv[2])
    telemetry = build_telemetry(ExportConfig(metrics=False), data_dir=data_dir, host_name="h")
    mirror = SpanMirror(telemetry.sink, host_name="h")
    print("ready", flush=True)
    mirror.handle(IncidentOpened(time_unix_nano=now_ns(), source="test", incident_id="inc-1", trigger="manual"))
    for k in range(actions):
        start = now_ns()
        for _ in range(20):  # request spans keep flowing through the memory queue meanwhile
            telemetry.sink.emit(build_span("request", trace_id=new_trace_id(), start_time_unix_nano=start, end_time_unix_nano=start + 1))
        time.sleep(random.uniform(0.0, 0.05))
        result = ActionResult(action=f"action.{k}", outcome=Outcome.OK, start_time_unix_nano=start, end_time_unix_nano=now_ns(),
                              attributes={"servewatch.test.k": k})
        mirror.handle(ActionCompleted(time_unix_nano=now_ns(), source="test", incident_id="inc-1", result=result))
        print(f"done {k}", flush=True)
    mirror.handle(IncidentClosed(time_unix_nano=now_ns(), source="test", incident_id="inc-1", trigger="manual", bundle_dir="", manifest_path=""))
    print("closed", flush=True)
    telemetry.shutdown()
    print("exit", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
