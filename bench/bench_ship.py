"""Agent CPU per shipped span: the span shipper draining a real server's ring into span files.

A real server process (``tests/programs/span_server.py``: agent.sdk request + forward spans at
``--rate`` iterations/s, two spans each) records into its span ring; a child process runs the
agent side alone: :class:`exporters.otlp.shipper.SpanShipper` polling every ``--poll-s`` seconds into
the lossless processor writing OTLP/JSON span files (the embedded default), or with ``--grpc``
exporting over OTLP/gRPC to a real receiver in its own process (what a watching agent with a
collector does; the soak's configuration). The child measures
its own CPU time (user + system, every thread: drain, decode, encode, write) over ``--window-s``
seconds after a warm-up and the spans shipped in that window, and prints CPU microseconds per
shipped span.

``--src A --src B`` compares two source trees (e.g. a checkout of the code before a change, and
this one): rounds alternate A, B, A, B... (``--rounds`` each) so a shared machine's noise hits
both; it prints each tree's median and the paired ratio B/A per round with its median.
Printed, not asserted.

Usage: ``python bench/bench_ship.py [--src DIR]... [--grpc] [--rate 1000] [--window-s 20] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def child(args: argparse.Namespace) -> None:
    """One measurement with the code on ``sys.path`` (the source tree under test)."""
    try:
        from exporters.otlp.provider import ExportConfig, build_telemetry
        from exporters.otlp.shipper import SpanShipper
    except ModuleNotFoundError:  # a --src tree from before the layout by layers
        from exporters.provider import ExportConfig, build_telemetry  # type: ignore[no-redef]
        from exporters.shipper import SpanShipper  # type: ignore[no-redef]

    with tempfile.TemporaryDirectory(prefix="bench-ship-") as tmp:
        shm = Path(tmp) / "shm"
        shm.mkdir(mode=0o700)
        env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "OTEL_SERVICE_NAME": "bench-llm",
               "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
        server = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "programs" / "span_server.py"), "--rate", str(args.rate),
             "--max-lifetime-s", str(args.warmup_s + args.window_s + 60)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        telemetry = None
        try:
            assert server.stdout is not None
            line = server.stdout.readline().decode()
            if not line.startswith("ready"):
                raise SystemExit(f"server did not start: {line!r}")
            config = ExportConfig(metrics=False, endpoint=args.endpoint, protocol="grpc") if args.endpoint else ExportConfig(metrics=False)
            telemetry = build_telemetry(config, data_dir=Path(tmp) / "data", host_name="bench")
            shipper = SpanShipper(telemetry.processor, host_name="bench", directory=shm, poll_interval_s=args.poll_s)
            if not shipper.attach(server.pid, os.geteuid()):
                raise SystemExit("could not attach to the server's ring")
            shipper.start(args.poll_s)
            time.sleep(args.warmup_s)
            t0, s0 = os.times(), shipper.statistics().shipped
            time.sleep(args.window_s)
            t1, s1 = os.times(), shipper.statistics().shipped
            cpu = (t1.user - t0.user) + (t1.system - t0.system)
            stats = shipper.close()
            shipped = s1 - s0
            print(json.dumps({
                "cpu_s": cpu, "shipped": shipped, "us_per_span": 1e6 * cpu / max(1, shipped),
                "dropped": stats.dropped, "spans_per_s": shipped / args.window_s,
            }), flush=True)
        finally:
            if telemetry is not None:
                telemetry.shutdown(5)
            server.kill()
            server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", action="append", default=[], help="source tree to measure (repeat to compare)")
    parser.add_argument("--rate", type=float, default=1000.0, help="server iterations/s (2 spans each)")
    parser.add_argument("--poll-s", type=float, default=0.5, help="shipper poll interval (spans.poll_interval_s)")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grpc", action="store_true", help="export over OTLP/gRPC to a real receiver (not span files)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    srcs = [str(Path(s).resolve()) for s in args.src] or [str(ROOT)]
    receiver = None
    if args.grpc:
        sys.path.insert(0, str(HERE))
        from bench_export import RemoteReceiver

        receiver = RemoteReceiver()
    try:
        _rounds(args, srcs, receiver)
    finally:
        if receiver is not None:
            receiver.close()


def _rounds(args: argparse.Namespace, srcs: list[str], receiver: Any) -> None:
    results: dict[str, list[dict[str, float]]] = {s: [] for s in srcs}
    for rnd in range(args.rounds):
        for src in srcs:
            out = subprocess.run(
                [sys.executable, str(HERE / "bench_ship.py"), "--child", "--rate", str(args.rate), "--poll-s", str(args.poll_s),
                 "--warmup-s", str(args.warmup_s), "--window-s", str(args.window_s),
                 *(["--endpoint", receiver.grpc_endpoint] if receiver is not None else [])],
                check=False, env={**os.environ, "PYTHONPATH": src}, cwd=src, capture_output=True, text=True, timeout=args.window_s + 120,
            )
            if out.returncode:
                raise SystemExit(f"child failed ({src}):\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            if receiver is not None:
                res["received"] = receiver.span_count
                receiver.clear()
            results[src].append(res)
            print(f"round {rnd + 1} {src}: {res['us_per_span']:.1f} us CPU/span "
                  f"({res['shipped']} spans, {res['spans_per_s']:.0f}/s, dropped {res['dropped']}"
                  + (f", collector received {res['received']}" if receiver is not None else "") + ")", flush=True)
    for src, rows in results.items():
        per_span = [r["us_per_span"] for r in rows]
        print(f"{src}: median {statistics.median(per_span):.1f} us CPU per shipped span")
        if src == srcs[-1]:
            sys.path.insert(0, str(HERE))
            from _common import emit_result

            emit_result(f"agent CPU per shipped span ({'OTLP/gRPC' if receiver is not None else 'span files'}, ~{2 * args.rate:.0f} spans/s)",
                        ours=statistics.median(per_span), unit="us", spread=(min(per_span), max(per_span)),
                        baseline=statistics.median(r["us_per_span"] for r in results[srcs[0]]) if len(srcs) > 1 else None,
                        baseline_name=f"--src {srcs[0]}" if len(srcs) > 1 else "(none: --src OLD compares a tree)",
                        note=f"{args.rounds} rounds of {args.window_s:g} s")
    if len(srcs) > 1:
        base = results[srcs[0]]
        for src in srcs[1:]:
            ratios = [b["us_per_span"] / a["us_per_span"] for a, b in zip(base, results[src], strict=True)]
            print(f"{src} / {srcs[0]}: paired ratios {', '.join(f'{x:.2f}' for x in ratios)}; "
                  f"median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
