"""What attaching the agent costs the served process: demo server under a fixed load.

One demo server (real torch model, ``--tp`` ranks; rank 0 records a request span per request and
a forward span per batched step with agent.sdk) serves a closed-loop load (``--clients``
threads, ``--max-new-tokens`` each) for the whole run. Windows of ``--window-s`` seconds (after
``--settle-s`` seconds of settling) are measured in three configurations, on the SAME server
process:

* A: no agent running (the server's spans take the SDK's fallback: no OTel SDK installed,
  nothing exported);
* B: ``servewatch run`` attached (health, /metrics watchdog, step counters), span shipping off;
* C: as B, and the agent ships the server's request/forward spans from its span ring to an OTLP
  gRPC receiver (``tests/otlp_receiver.py`` in its own process): the server only records.

Both agents start once, before the first window, and a window resumes the one it measures
(SIGCONT) while the other is paused (SIGSTOP: no CPU; its ring heartbeat goes stale within 2 s,
so the server falls back exactly as with no agent). Windows thus compare steady states, not
agent start-ups. The order is balanced (ABC, CBA, BCA, ACB, CAB, BAC, ...), so slow drifts of a shared machine
cancel over the run. Per round, paired ratios B/A and C/A of throughput and p99 latency; printed
as the median with the spread (min..max over rounds) and a trend-adjusted estimate (least
squares of the metric on time plus configuration, ratio at the mean time). Targets (issue 15):
C/A >= 0.99 throughput and p99 <= 1.05x.

Also per window: the CPU seconds the served process tree (the server and its ranks, psutil
user + system) spent per request served, in ms. On a shared machine throughput moves with
everyone else's load; the server's own CPU per request much less, so its C/A ratio shows what the
served process pays for telemetry (recording only, when the agent ships) more steadily.

Usage: ``python bench/bench_serving_overhead.py [--rounds 6] [--window-s 30] [--clients 4]``
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
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

ORDERS = ["ABC", "CBA", "BCA", "ACB", "CAB", "BAC"]


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (small dense systems)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-12:
            raise ZeroDivisionError("singular")
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def trend_adjusted(rows: list[tuple[float, str, float]], config: str) -> float:
    """Ratio config/A from y = a + b*t + c_B*[B] + c_C*[C], at the mean time."""
    x = [[1.0, t, 1.0 if c == "B" else 0.0, 1.0 if c == "C" else 0.0] for t, c, _ in rows]
    y = [v for _, _, v in rows]
    xtx = [[sum(r[i] * r[j] for r in x) for j in range(4)] for i in range(4)]
    xty = [sum(r[i] * v for r, v in zip(x, y, strict=True)) for i in range(4)]
    try:
        a, b, cb, cc = solve(xtx, xty)
    except ZeroDivisionError:  # too few rounds to separate the trend
        return float("nan")
    base = a + b * statistics.mean(t for t, _, _ in rows)
    return (base + (cb if config == "B" else cc)) / base


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) so far of ``pid`` and its descendants alive now (psutil)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class AgentProc:
    """`servewatch run` watching the server, started and stopped per window."""

    def __init__(self, server: DemoServer, env: dict[str, str], data: Path, ship: bool, receiver: RemoteReceiver) -> None:
        agent_env = {**agent_env_of(env), "SERVEWATCH_SPANS__SHIP": "true" if ship else "false",
                     "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        self.log = open(data.parent / f"agent-{'C' if ship else 'B'}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli.app", "run", "--root-pid", str(server.pid),
             "--health-url", f"{server.base_url}/health", "--metrics-url", f"{server.base_url}/metrics",
             "--data-dir", str(data), "--watchdog-timeout", "120"],
            env=agent_env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, start_new_session=True,
        )  # fmt: skip

    def pause(self) -> None:
        """SIGSTOP: no CPU at all; its heartbeat goes stale, so the server acts as without agent."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()

    _work, _shm, data, env = bench_workspace("servewatch-overhead-")
    receiver = RemoteReceiver()
    server = DemoServer(tp=args.tp, env=env, title_prefix="overhead").start()
    load = LoadGenerator(server.base_url, clients=args.clients, max_new_tokens=args.max_new_tokens).start()
    rows: list[tuple[float, str, float, float]] = []  # (t, config, throughput, p99)
    cpu_per_request_ms: list[tuple[float, str, float]] = []  # (t, config, server CPU ms per request)
    received: dict[str, int] = {"A": 0, "B": 0, "C": 0}
    t0 = time.monotonic()
    # Both agents start once and stay: a window resumes the one it needs (SIGCONT) and pauses the
    # others (SIGSTOP), so no window pays for an agent's start-up (imports, first discovery).
    agents = {"B": AgentProc(server, env, data, ship=False, receiver=receiver),
              "C": AgentProc(server, env, data, ship=True, receiver=receiver)}
    try:
        time.sleep(max(15.0, args.settle_s))  # both agents up; the server warm under load
        for a in agents.values():
            if a.proc.poll() is not None:
                raise SystemExit(f"agent exited early ({a.proc.returncode}); its log ends:\n{Path(a.log.name).read_text(errors='replace')[-3000:]}")
            a.pause()
        print(f"demo server pid {server.pid} (tp {args.tp}), {args.clients} closed-loop clients x {args.max_new_tokens} tokens; "
              f"{args.rounds} rounds of A/B/C windows of {args.window_s:.0f} s", flush=True)
        for r in range(args.rounds):
            for config in ORDERS[r % len(ORDERS)]:
                agent = agents.get(config)
                if agent is not None:
                    agent.resume()
                try:
                    time.sleep(args.settle_s)
                    receiver.clear()
                    w0, c0 = time.monotonic(), tree_cpu_s(server.pid)
                    time.sleep(args.window_s)
                    w1, c1 = time.monotonic(), tree_cpu_s(server.pid)
                    w = load.window(w0, w1)
                    received[config] += receiver.span_count
                finally:
                    if agent is not None:
                        agent.pause()
                rows.append(((w0 - t0), config, w.throughput_rps, w.p99_s))
                served = w.throughput_rps * (w1 - w0)
                cpu_ms = (c1 - c0) * 1000 / served if served else float("nan")
                cpu_per_request_ms.append(((w0 - t0), config, cpu_ms))
                print(f"  round {r + 1} {config}: {w.throughput_rps:6.2f} req/s  p99 {w.p99_s * 1000:6.1f} ms"
                      f"  max {w.max_s * 1000:6.1f} ms  errors {w.errors}  server CPU {cpu_ms:6.2f} ms/request", flush=True)
    finally:
        load.stop()
        for a in agents.values():
            a.stop()
        server.stop()
        receiver.close()
    print()
    for config in "BC":
        thr, p99 = [], []
        for r in range(args.rounds):
            got = {c: (tp, pp) for t, c, tp, pp in rows[r * 3 : r * 3 + 3]}
            thr.append(got[config][0] / got["A"][0])
            p99.append(got[config][1] / got["A"][1])
        tthr = trend_adjusted([(t, c, tp) for t, c, tp, _ in rows], config)
        tp99 = trend_adjusted([(t, c, pp) for t, c, _, pp in rows], config)
        print(f"{config}/A throughput: median {statistics.median(thr):.3f} (rounds {min(thr):.3f}..{max(thr):.3f}),"
              f" trend-adjusted {tthr:.3f}")
        print(f"{config}/A p99:        median {statistics.median(p99):.3f} (rounds {min(p99):.3f}..{max(p99):.3f}),"
              f" trend-adjusted {tp99:.3f}")
        cpu = []
        for r in range(args.rounds):
            got_cpu = {c: v for _, c, v in cpu_per_request_ms[r * 3 : r * 3 + 3]}
            cpu.append(got_cpu[config] / got_cpu["A"])
        tcpu = trend_adjusted(cpu_per_request_ms, config)
        print(f"{config}/A server CPU per request: median {statistics.median(cpu):.3f}"
              f" (rounds {min(cpu):.3f}..{max(cpu):.3f}), trend-adjusted {tcpu:.3f}")
        what = "agent shipping the server's spans" if config == "C" else "agent attached, not shipping"
        for name, values, trend, unit in (("throughput", thr, tthr, "x"), ("p99 latency", p99, tp99, "x"),
                                          ("server tree CPU per request", cpu, tcpu, "x")):
            emit_result(f"serving overhead, {what}: {name}", ours=statistics.median(values), unit=unit,
                        baseline_name="the same server, same run, no agent (A)", ratio=statistics.median(values),
                        spread=(min(values), max(values)), note=f"{args.rounds} balanced rounds of {args.window_s:g} s; trend-adjusted {trend:.3f}")
    print(f"spans received by the collector: A {received['A']}, B {received['B']}, C {received['C']}"
          " (only C ships the server's spans; B/C also send the agent's own telemetry)")
    print("targets: C/A >= 0.99 throughput, p99 <= 1.05x")
    if received["C"] == 0:  # C measured an agent that shipped nothing: not the figure it claims
        print("FAIL: no span of the server reached the collector in C (the agent did not ship)", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
