"""servewatch against a real vLLM 0.32 CPU server (``tests/real``'s fixture: its cached venv and
tiny Llama, TP=1, under the machine-wide real-vLLM lock), four figures in one run:

1. **hang -> incident**: the fault plugin hangs the worker's forward inside a request seen running
   and stepping on ``/metrics`` (vLLM publishes its scheduler statistics after each step: a forward
   hung in a request's first step never shows it running, so no watchdog on /metrics sees it);
   ``servewatch run --metrics-url .../metrics --metrics-preset vllm --root-pid <server>
   --watchdog-timeout T`` watches. Latency from the hang (the trigger written: the worker's
   next forward blocks) to the incident's ``opened_time_unix_nano``, and to its last ``pyspy.dump`` ending
   (stacks captured). Target: opened <= T + 2 s. Ratio: latency / (T + 2 s).
2. **agent CPU and RSS** while it watches the server under a closed-loop load (health, /metrics
   and process watchers, defaults): CPU seconds per wall second (a fraction of one core) and the
   peak RSS, sampled every second after a settle. Targets: <= 1 % of a core, <= 100 MB.
3. **server CPU per request, agent attached vs not**: the same server and load; windows with the
   agent running alternate with windows where it is paused (SIGSTOP: it costs nothing), order
   balanced per round (AB, BA, ...). Per window, CPU seconds of the whole server tree (API server,
   EngineCore, worker; psutil user + system) per completed request. Median of per-round ratios
   attached / not, with the spread. Target: <= 1.01x.
4. **profile of N steps**: wall time of ``servewatch profile --url ... --steps N`` (the CLI, a
   fresh process, including its start) against vLLM's own ``POST /start_profile
   {"max_iterations": N}``, waiting for the worker's trace, ``POST /stop_profile`` (a plain
   client, the baseline), alternated, under load.

Nothing is asserted; the figures print as a table (and result rows for ``bench/run_all.py``).
Needs ``python -m tests.real.install`` first (exits 2 saying so otherwise).

Usage: ``python bench/bench_real_vllm.py [--rounds 3] [--window-s 20] [--watch-s 40] [--timeout-s 5]
[--only hang|agent|overhead|profile ...]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import emit_result

from tests.real import install as real_install
from tests.real.server import VllmServer, server_lock

SERVEWATCH = [sys.executable, "-m", "agent.cli.entry"]


def _agent(server: VllmServer, data_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = [
        *SERVEWATCH, "run", "--metrics-url", f"{server.url}/metrics", "--metrics-preset", "vllm",
        "--health-url", f"{server.url}/health", "--root-pid", str(server.pid), "--data-dir", str(data_dir), *extra,
    ]  # fmt: skip
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd=ROOT)  # fmt: skip


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _manifests(data_dir: Path) -> list[dict]:
    out = []
    for m in data_dir.glob("*/*/manifest.json"):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(m.read_text()))
    return out


def _wait_manifest(data_dir: Path, pred: Callable[[dict], bool], timeout_s: float) -> dict | None:
    """The first manifest in ``data_dir`` for which ``pred`` holds, polled every 0.1 s (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in _manifests(data_dir):
            if pred(m):
                return m
        time.sleep(0.1)
    return None


def _metric(server: VllmServer, name: str) -> float:
    """The sum of ``name``'s samples on the server's /metrics (0 when the scrape fails)."""
    try:
        text = server.metrics()
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def _hang_mid_request(server: VllmServer, timeout_s: float = 60.0) -> int:
    """Once a request is seen running and a step of it is seen on /metrics, hang the worker's
    next forward (the fault plugin): the wall-clock ns of the hang, 0 if the request was not
    seen within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _metric(server, "vllm:num_requests_running") < 1:
        if time.monotonic() > deadline:
            return 0
        time.sleep(0.05)
    steps = _metric(server, "vllm:iteration_tokens_total_count")
    while _metric(server, "vllm:iteration_tokens_total_count") <= steps:
        if time.monotonic() > deadline:
            return 0
        time.sleep(0.05)
    server.hang(ranks=None)
    return time.time_ns()


def hang_to_incident(server: VllmServer, rounds: int, timeout_s: float) -> None:
    opened, captured = [], []
    for r in range(rounds):
        data = Path(tempfile.mkdtemp(prefix="bench-real-vllm-"))
        agent = _agent(server, data, "--watchdog-timeout", str(timeout_s))
        try:
            time.sleep(4.0)  # the agent is up and has scraped the idle server
            with server.load(concurrency=2, max_tokens=200, request_timeout_s=timeout_s + 120):
                # vLLM publishes its scheduler statistics after each step: a forward hung in a
                # request's first step never shows it running. Hang inside running requests (two
                # in a closed loop: one is running whenever the other has just ended).
                t0 = _hang_mid_request(server)
                found = _wait_manifest(data, lambda m: m.get("trigger") == "stall", timeout_s + 60) if t0 else None
                if found is not None:  # the stacks are taken while the forward still hangs
                    found = _wait_manifest(data, lambda m: "pyspy.dump" in m.get("phases_done", ()) or m.get("state") == "closed", 60) or found
                server.clear_fault()
            if found is None:
                print(f"round {r}: no stall incident within {timeout_s + 60:.0f} s" if t0 else
                      f"round {r}: the request was not seen running and stepping on /metrics within 60 s", file=sys.stderr)
                continue
            opened.append((found["opened_time_unix_nano"] - t0) / 1e9)
            dumps = [a["end_time_unix_nano"] for a in found.get("actions", []) if a["action"] == "pyspy.dump" and a["end_time_unix_nano"]]
            if dumps:
                captured.append((max(dumps) - t0) / 1e9)
        finally:
            server.clear_fault()
            _stop(agent)
        server.serves(timeout_s=60)
    bound = timeout_s + 2.0
    for name, values in (("hang -> incident opened", opened), ("hang -> stacks captured", captured)):
        if not values:
            continue
        med = statistics.median(values)
        print(f"{name:28s} median {med:6.2f} s  max {max(values):6.2f} s  (watchdog {timeout_s:g} s; target <= {bound:g} s)  ratio {med / bound:.2f}")
        emit_result(name, ours=med, baseline=bound, baseline_name=f"watchdog timeout + 2 s ({timeout_s:g} + 2)", unit="s",
                    spread=(min(values), max(values)), note=f"{len(values)} rounds, real vLLM TP=1")  # fmt: skip


def _tree_cpu_s(server: VllmServer) -> float:
    total = 0.0
    for p in server.tree():
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def agent_cost(server: VllmServer, watch_s: float, settle_s: float = 8.0) -> None:
    data = Path(tempfile.mkdtemp(prefix="bench-real-vllm-"))
    agent = _agent(server, data)
    try:
        proc = psutil.Process(agent.pid)
        with server.load(concurrency=2, max_tokens=32):
            time.sleep(settle_s)
            t = proc.cpu_times()
            cpu0, wall0 = t.user + t.system, time.monotonic()
            rss: list[int] = []
            windows: list[float] = []  # CPU share of each third of the watch: the run's own noise
            mark_cpu, mark_wall = cpu0, wall0
            while time.monotonic() - wall0 < watch_s:
                rss.append(proc.memory_info().rss)
                time.sleep(1.0)
                now = time.monotonic()
                if now - mark_wall >= watch_s / 3:
                    t = proc.cpu_times()
                    windows.append((t.user + t.system - mark_cpu) / (now - mark_wall))
                    mark_cpu, mark_wall = t.user + t.system, now
            t = proc.cpu_times()
            core = (t.user + t.system - cpu0) / (time.monotonic() - wall0)
    finally:
        _stop(agent)
    noise = (max(windows) - min(windows)) / 2 * 100 if len(windows) >= 2 else None
    peak_mb = max(rss) / 2**20
    print(f"{'agent CPU while watching':28s} {core * 100:6.2f} % of a core (target <= 1 %)  ratio {core / 0.01:.2f}")
    print(f"{'agent RSS while watching':28s} {peak_mb:6.1f} MB peak (target <= 100 MB)  ratio {peak_mb / 100:.2f}")
    emit_result("agent CPU while watching real vLLM", ours=core * 100, baseline=1.0, baseline_name="target 1 % of a core", unit="% core",
                note=f"{watch_s:g} s under load; windows {', '.join(f'{w * 100:.2f}' for w in windows)} %",
                noise=noise)  # fmt: skip
    emit_result("agent RSS while watching real vLLM", ours=peak_mb, baseline=100.0, baseline_name="target 100 MB", unit="MB",
                note=f"peak of {len(rss)} samples")  # fmt: skip


def server_overhead(server: VllmServer, rounds: int, window_s: float) -> None:
    data = Path(tempfile.mkdtemp(prefix="bench-real-vllm-"))
    agent = _agent(server, data)
    ratios: list[float] = []
    per_req: dict[str, list[float]] = {"attached": [], "not": []}
    try:
        time.sleep(5.0)
        with server.load(concurrency=2, max_tokens=32) as stats:
            time.sleep(5.0)
            for r in range(rounds):
                order = ("attached", "not") if r % 2 == 0 else ("not", "attached")
                got: dict[str, float] = {}
                for mode in order:
                    os.killpg(agent.pid, signal.SIGCONT if mode == "attached" else signal.SIGSTOP)
                    time.sleep(1.0)
                    cpu0, ok0 = _tree_cpu_s(server), stats["ok"]
                    time.sleep(window_s)
                    done = stats["ok"] - ok0
                    if done:
                        got[mode] = (_tree_cpu_s(server) - cpu0) / done
                        per_req[mode].append(got[mode] * 1000)
                if len(got) == 2:
                    ratios.append(got["attached"] / got["not"])
    finally:
        _stop(agent)
    if not ratios:
        print("server CPU per request: no complete round", file=sys.stderr)
        return
    med = statistics.median(ratios)
    print(f"{'server CPU per request':28s} attached {statistics.median(per_req['attached']):7.1f} ms  not {statistics.median(per_req['not']):7.1f} ms"
          f"  ratio {med:.3f} (spread {min(ratios):.3f}..{max(ratios):.3f}; target <= 1.01)")  # fmt: skip
    emit_result("real vLLM server CPU per request, agent attached / not", ours=statistics.median(per_req["attached"]),
                baseline=statistics.median(per_req["not"]), baseline_name="agent paused (SIGSTOP)", unit="ms CPU/request",
                ratio=med, spread=(min(ratios), max(ratios)), note=f"{rounds} paired rounds of {window_s:g} s")  # fmt: skip


def _plain_profile(server: VllmServer, steps: int) -> float:
    prefix = f"bench-{os.urandom(3).hex()}"
    t0 = time.monotonic()
    httpx.post(f"{server.url}/start_profile", json={"max_iterations": steps, "profile_prefix": prefix}, timeout=60).raise_for_status()
    deadline = time.monotonic() + 120
    while not any(n.startswith(prefix + "_rank") for n in os.listdir(server.profile_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    httpx.post(f"{server.url}/stop_profile", timeout=120).raise_for_status()
    return time.monotonic() - t0


def _servewatch_profile(server: VllmServer, steps: int, data: Path) -> float | None:
    t0 = time.monotonic()
    done = subprocess.run([*SERVEWATCH, "profile", "--url", server.url, "--steps", str(steps), "--data-dir", str(data)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)  # fmt: skip
    wall = time.monotonic() - t0
    if done.returncode != 0:
        print(f"servewatch profile failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return wall


def profile_wall(server: VllmServer, rounds: int, steps: int) -> None:
    ours: list[float] = []
    plain: list[float] = []
    data = Path(tempfile.mkdtemp(prefix="bench-real-vllm-"))
    with server.load(concurrency=2, max_tokens=48):
        time.sleep(2.0)
        for r in range(rounds):
            for which in (("ours", "plain") if r % 2 == 0 else ("plain", "ours")):
                if which == "ours":
                    w = _servewatch_profile(server, steps, data)
                    if w is not None:
                        ours.append(w)
                else:
                    plain.append(_plain_profile(server, steps))
    if not ours or not plain:
        return
    o, p = statistics.median(ours), statistics.median(plain)
    print(f"{'profile ' + str(steps) + ' steps, wall':28s} servewatch {o:6.2f} s  vLLM's own start/stop {p:6.2f} s  ratio {o / p:.2f}")
    emit_result(f"profile {steps} steps of real vLLM, wall", ours=o, baseline=p, baseline_name="POST /start_profile max_iterations + /stop_profile (httpx)",
                unit="s", spread=(min(ours) / p, max(ours) / p), note=f"{len(ours)} rounds, CLI start included")  # fmt: skip


#: The figures, in the order they run (``--only``).
FIGURES = ("hang", "agent", "overhead", "profile")


def main() -> int:
    ap = argparse.ArgumentParser(description="servewatch against a real vLLM 0.32 CPU server (tests/real's fixture, TP=1): hang -> incident, agent CPU/RSS, server CPU per request attached vs paused, profile wall time.")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the hang, overhead and profile figures")
    ap.add_argument("--window-s", type=float, default=20.0, help="SECONDS per overhead window")
    ap.add_argument("--watch-s", type=float, default=40.0, help="SECONDS the agent's own cost is sampled")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="watchdog timeout, SECONDS, for the hang figure")
    ap.add_argument("--steps", type=int, default=5, help="steps per profile")
    ap.add_argument("--only", choices=list(FIGURES), action="append", help="run only this figure (repeatable); default all")
    args = ap.parse_args()
    inst = real_install.ready()
    if inst is None:
        print(f"bench_real_vllm: no real vLLM install ({real_install.unavailable_reason() or 'run python -m tests.real.install'})", file=sys.stderr)
        return 2
    with server_lock():
        real_install.refresh_plugin(inst)  # this checkout's fault plugin, as the test session does
        t0 = time.monotonic()
        server = VllmServer.start(inst, tp=1)
        print(f"real vLLM 0.32.0 (CPU) TP=1 serving after {time.monotonic() - t0:.0f} s at {server.url}; load average {os.getloadavg()[0]:.1f}")
        try:
            only = args.only or list(FIGURES)
            if "hang" in only:
                hang_to_incident(server, args.rounds, args.timeout_s)
            if "agent" in only:
                agent_cost(server, args.watch_s)
            if "overhead" in only:
                server_overhead(server, args.rounds, args.window_s)
            if "profile" in only:
                profile_wall(server, args.rounds, args.steps)
        finally:
            server.discard()
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
