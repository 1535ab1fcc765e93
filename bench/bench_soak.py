"""Soak: `servewatch run` watching the demo server under load; its RSS slope and CPU.

Starts the demo server (real torch model, ``--tp`` ranks; rank 0 records request and forward
spans with agent.sdk), a paced load (``--clients`` threads, ``--rate`` requests/s in total), and
``servewatch run`` watching the server tree (health + /metrics watchdog, SDK step counters, span
shipping from the server's span ring) exporting over OTLP gRPC to a real receiver in its own
process (``tests/otlp_receiver.py``, emptied every sample; ``--files`` uses the embedded
OTLP/JSON files instead; ``--no-ship`` leaves the server's spans unshipped, a baseline). Every
``--sample-s`` seconds it samples the AGENT process: RSS and CPU time (user + system). At the end
it prints:

* RSS slope by least squares over the samples after ``--warmup-s`` (goal < 1 MB/h), and
  first/last/max RSS;
* CPU of the agent as % of one core over the same window (goal <= 1 %);
* what the agent shipped (the ``spans`` line of its status file: shipped, drops on both sides),
  and the load actually served.

Usage: ``python bench/bench_soak.py --duration 3600 [--tp 2] [--clients 2] [--rate 5]``.
Progress goes to stdout one line per sample (so a log shows a run in progress).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from _common import emit_result
from _load import LoadGenerator, agent_env_of, bench_workspace
from bench_export import RemoteReceiver

from agent.demo.client import DemoServer
from agent.watchers.status import read_status_file, status_path

HOST = "soak-node"


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    den = sum((p[0] - mx) ** 2 for p in points)
    return float("nan") if den == 0 else sum((p[0] - mx) * (p[1] - my) for p in points) / den * 3600.0


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def spans_line(data_dir: Path) -> str:
    try:
        snap = read_status_file(status_path(data_dir, HOST))
    except (OSError, ValueError):
        return "(no status file)"
    spans = snap.get("spans")
    return f"{spans.state.value}: {spans.reason}" if spans else "(no spans status)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds of load with the agent watching")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--rate", type=float, default=5.0, help="total requests/s")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=120.0, help="samples before this are left out of slope and CPU")
    ap.add_argument("--files", action="store_true", help="export to the embedded OTLP/JSON files, not a receiver")
    ap.add_argument("--no-ship", action="store_true", help="baseline: the agent does not ship the server's spans")
    ap.add_argument("--trace-alloc", type=Path, default=None,
                    help="diagnostic: run the agent under tracemalloc, growth reports to this file (figures then include its cost)")
    args = ap.parse_args()

    work, _shm, data, env = bench_workspace("servewatch-soak-")
    receiver = None if args.files else RemoteReceiver()
    received = 0
    server = DemoServer(tp=args.tp, env=env, title_prefix="soak").start()
    procs: list[subprocess.Popen[bytes]] = []
    load = None
    agent_env = {**agent_env_of(env), "SERVEWATCH_HOST_NAME": HOST}
    if receiver is not None:
        agent_env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.grpc_endpoint
        agent_env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc"
    if args.no_ship:
        agent_env["SERVEWATCH_SPANS__SHIP"] = "false"
    entry = ["-m", "agent.cli.app"]
    if args.trace_alloc is not None:
        entry = [str(Path(__file__).resolve().parent / "_traced_agent.py")]
        agent_env["SOAK_TRACE_OUT"] = str(args.trace_alloc.resolve())
        agent_env["SOAK_TRACE_WARMUP_S"] = str(args.warmup_s)
        agent_env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    try:
        agent_log = open(work / "agent.log", "wb")  # noqa: SIM115 - closed below
        agent = subprocess.Popen(
            [sys.executable, *entry, "run", "--root-pid", str(server.pid),
             "--health-url", f"{server.base_url}/health", "--metrics-url", f"{server.base_url}/metrics",
             "--data-dir", str(data), "--watchdog-timeout", "60"],
            env=agent_env, stdin=subprocess.DEVNULL, stdout=agent_log, stderr=agent_log,
            start_new_session=True,
        )  # fmt: skip
        procs.append(agent)
        proc = psutil.Process(agent.pid)
        load = LoadGenerator(server.base_url, clients=args.clients, rate=args.rate, max_new_tokens=args.max_new_tokens).start()
        deadline = time.monotonic() + 60
        while not args.no_ship and "shipping" not in spans_line(data) and time.monotonic() < deadline:
            time.sleep(1)
        print(f"soak: agent pid {agent.pid}, server pid {server.pid} (tp {args.tp}), {args.rate} req/s, "
              f"{args.duration:.0f} s; spans: {spans_line(data)}", flush=True)
        t_start = time.monotonic()
        samples: list[tuple[float, float, float]] = []  # (t, rss MB, cpu s)
        while True:
            t = time.monotonic() - t_start
            cpu = proc.cpu_times()
            samples.append((t, proc.memory_info().rss / 1e6, cpu.user + cpu.system))
            w = load.window(time.monotonic() - args.sample_s, time.monotonic())
            if receiver is not None:  # count what arrived, then forget it (bounded receiver memory)
                received += receiver.span_count
                receiver.clear()
            print(f"t={t:7.0f}s rss={samples[-1][1]:7.2f}MB cpu={samples[-1][2]:7.2f}s "
                  f"load={w.throughput_rps:5.2f}rps p99={w.p99_s * 1000:6.1f}ms received={received}", flush=True)
            if agent.poll() is not None:
                raise SystemExit(f"agent exited with {agent.returncode}; its log ends:\n{(work / 'agent.log').read_text(errors='replace')[-3000:]}")
            if t >= args.duration:
                break
            time.sleep(min(args.sample_s, max(0.0, args.duration - t)))
        final_spans = spans_line(data)
        total = load.window(t_start, time.monotonic())
        load.stop()
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        agent_log.close()
        if receiver is not None:
            received += receiver.wait_for_spans(1, 2.0) if receiver.span_count else 0
    finally:
        if load is not None:
            load.stop()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        server.stop()
        if receiver is not None:
            receiver.close()
    steady = [s for s in samples if s[0] >= args.warmup_s] or samples
    rss_slope = slope_per_hour([(s[0], s[1]) for s in steady])
    cpu_pct = 100.0 * (steady[-1][2] - steady[0][2]) / max(1e-9, steady[-1][0] - steady[0][0])
    # the noise: CPU % of each window of about a minute (at least 2 samples each), min..max
    step = max(1, round(60.0 / args.sample_s))
    windows = [100.0 * (b[2] - a[2]) / (b[0] - a[0]) for a, b in zip(steady[::step], steady[step::step], strict=False) if b[0] > a[0]]
    cpu_noise = (max(windows) - min(windows)) / 2 if len(windows) >= 2 else None
    result = {
        "duration_s": samples[-1][0],
        "window_s": steady[-1][0] - steady[0][0],
        "rss_mb_first": steady[0][1],
        "rss_mb_last": steady[-1][1],
        "rss_mb_max": max(s[1] for s in steady),
        "rss_slope_mb_per_h": rss_slope,
        "cpu_pct_of_core": cpu_pct,
        "cpu_pct_windows": windows,
        "requests": total.completed,
        "errors": total.errors,
        "throughput_rps": total.throughput_rps,
        "p99_ms": total.p99_s * 1000,
        "spans": final_spans,
        "received_by_collector": received if receiver is not None else None,
        "shipping": not args.no_ship,
        "destination": "files" if receiver is None else "otlp-grpc",
    }
    print()
    print(f"RSS slope {rss_slope:+.3f} MB/h (goal < 1 MB/h: {_met(rss_slope < 1.0)}) over {result['window_s']:.0f} s after"
          f" {args.warmup_s:.0f} s warm-up; RSS {result['rss_mb_first']:.1f} -> {result['rss_mb_last']:.1f} MB"
          f" (max {result['rss_mb_max']:.1f})")
    print(f"agent CPU {cpu_pct:.2f} % of one core (goal <= 1 %: {_met(cpu_pct <= 1.0)})")
    print(f"load: {total.completed} requests ({total.errors} errors), {total.throughput_rps:.2f} req/s, p99 {result['p99_ms']:.1f} ms")
    print(f"spans: {final_spans}" + (f"; collector received {received}" if receiver is not None else ""))
    print(json.dumps(result))
    if result["shipping"] and receiver is not None and not received:  # an agent that shipped nothing
        print("FAIL: the agent was to ship the server's spans and none reached the collector", file=sys.stderr)
        raise SystemExit(1)
    soak = f"soak {result['window_s']:.0f} s, {args.rate:g} req/s, {'shipping to ' + result['destination'] if result['shipping'] else 'not shipping'}"
    emit_result(f"{soak}: agent RSS slope", ours=rss_slope, unit="MB/h", baseline_name="(target < 1 MB/h)",
                note=f"RSS {result['rss_mb_first']:.1f} -> {result['rss_mb_last']:.1f} MB after {args.warmup_s:.0f} s warm-up")
    emit_result(f"{soak}: agent CPU", ours=cpu_pct, unit="% of a core", baseline_name="(target <= 1 %)",
                note=f"{result['requests']} requests, {result['errors']} errors", noise=cpu_noise,
                spread=(min(windows), max(windows)) if windows else None)


if __name__ == "__main__":
    main()
