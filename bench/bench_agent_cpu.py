"""Where a watching agent's CPU goes: per thread and per component, idle or under a paced load.

Starts the demo server (``--tp`` ranks, SDK step counters and a span ring), then for each
``--src`` tree in turn (alternating, ``--rounds`` times, the same server) starts ``servewatch
run`` from that tree watching the server (health + /metrics watchdog, SDK counters, span ring,
OTLP/JSON files export), waits ``--warmup-s``, and measures a ``--window-s`` window of the AGENT
process:

* CPU seconds (user + system) per thread, from ``/proc/<pid>/task/*/stat`` at both ends of the
  window (threads named by ``comm``; Python threads without a name share the interpreter's);
* with ``--pyspy``, ``py-spy record --format raw --nonblocking`` over the same window (only
  samples of running threads count), each sample attributed to the component of the deepest
  servewatch frame on its stack (:data:`COMPONENTS`: scrape, health, discovery, counters, ring
  scan, presence, status writes, export, open requests ...); samples with no servewatch frame
  are the event loop's own;
* RSS at the end of the window;
* the spans the agent shipped to its OTLP/JSON files that ended within the window (read back once
  the agent stopped, having drained its rings and queue): the same count for every tree at the same
  load says no tree lost spans.

``--rates 0,5`` measures the idle watch, then under 5 requests/s (``--clients`` paced threads). With two ``--src``
trees (e.g. ``git archive`` of the code before a change, and this tree) the rows compare them
in the same run, alternating, on the same server; the first is the baseline.

Usage: ``python bench/bench_agent_cpu.py [--src DIR]... [--rates 0,5] [--window-s 60] [--rounds 2] [--pyspy]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit_result, loadavg
from _load import LoadGenerator, agent_env_of, bench_workspace

from agent.demo.client import DemoServer

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")

#: (path fragment of a servewatch source file, component); the first match wins.
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("agent/watchers/inflight.py", "open requests (netlink)"),
    ("agent/watchers/health.py", "health"),
    ("agent/watchers/watchdog.py", "scrape (/metrics)"),
    ("agent/watchers/steps.py", "counters"),
    ("agent/sdk/counter.py", "counters"),
    ("agent/sdk/steps.py", "counters"),
    ("agent/host/sdkclient.py", "counters"),
    ("agent/sdk/presence.py", "presence"),
    ("agent/sdk/ring.py", "ring scan"),
    ("agent/sdk/folders.py", "ring scan"),
    ("exporters/otlp/sdk_export.py", "ring scan"),
    ("agent/watchers/status.py", "status writes"),
    ("agent/runtime/runstatus.py", "status writes"),
    ("agent/watchers/process.py", "discovery"),
    ("agent/host/procinfo.py", "discovery"),
    ("agent/host/targets.py", "discovery"),
    ("agent/model/ranks.py", "discovery"),
    ("agent/verdict/servers.py", "discovery"),
    ("agent/host/pidfds.py", "discovery"),
    ("exporters/otlp/shipper.py", "ring scan"),
    ("exporters/", "export"),
    ("agent/incidents/history.py", "history"),
    ("agent/incidents/evidence.py", "evidence"),
    ("agent/model/bus.py", "event bus"),
)
#: leaf frames that are a wait, not work (``--nonblocking`` samples cannot always tell)
_WAITING = re.compile(r"^(EpollSelector\.select|Condition\.wait|Event\.wait|Thread\._wait_for_tstate_lock|_worker) ")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")


def component_of(stack: list[str], roots: tuple[str, ...]) -> tuple[str, str]:
    """``(component, deepest servewatch file)`` of one sampled stack (root first)."""
    for frame in reversed(stack):
        m = _FRAME.match(frame.strip())
        if not m:
            continue
        file = m.group("file")
        rel = next((file[len(r):].lstrip("/") for r in roots if file.startswith(r)), None)
        if rel is None and file.startswith(("agent/", "exporters/")):
            rel = file
        if rel is None and ("/agent/" in file or "/exporters/" in file) and "site-packages" not in file:
            rel = file[file.rfind("/agent/") + 1:] if "/agent/" in file else file[file.rfind("/exporters/") + 1:]
        if rel is None:
            continue
        func = m.group("func")
        if func.startswith("PrometheusStepSource._open_requests"):
            return "open requests (netlink)", rel
        if func.startswith("PrometheusStepSource"):
            return "scrape (/metrics)", rel
        for frag, comp in COMPONENTS:
            if rel.startswith(frag) or frag in rel:
                return comp, rel
        return f"other ({rel})", rel
    return "event loop / libraries (no servewatch frame)", "-"


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread name of ``pid`` (threads of one name summed)."""
    out: dict[str, float] = collections.defaultdict(float)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out["main" if tid == str(pid) else name] += (int(fields[11]) + int(fields[12])) / TICKS
    return out


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def parse_raw(path: Path, roots: tuple[str, ...]) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    comps: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return comps, files, 0
    for line in text.splitlines():
        stack_s, _, n_s = line.rpartition(" ")
        if not stack_s or not n_s.isdigit():
            continue
        n = int(n_s)
        stack = stack_s.split(";")
        if stack and _WAITING.match(stack[-1].strip()):
            continue  # a thread blocked in a wait py-spy could not tell from running
        comp, _rel = component_of(stack, roots)
        comps[comp] += n
        leaf = stack[-1].strip() if stack else "-"
        files[f"{comp} :: {leaf}"] += n
        total += n
    return comps, files, total


def shipped_spans(data: Path, start_ns: int, end_ns: int) -> tuple[int, int]:
    """``(spans that ended in [start_ns, end_ns), all spans)`` in the span files the agent wrote
    under ``data`` (the agent stopped: it drained its rings and queue first), read with this
    tree's reader: equal figures for both trees at the same load say nothing was lost."""
    from exporters.otlp.otlp_json import iter_span_files, read_span_file

    window = total = 0
    for path in iter_span_files([data]):
        if ".metrics" in path.name or "spool" in path.parts:
            continue
        try:
            for request in read_span_file(path):
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            total += 1
                            window += start_ns <= span.end_time_unix_nano < end_ns
        except (OSError, ValueError):
            continue
    return window, total


def cli_module(src: Path) -> str:
    """The CLI module of the tree ``src``: ``agent.cli.app`` since the layout by layers,
    ``agent.cli`` in a tree from before it (a ``--src`` baseline)."""
    return "agent.cli.app" if (src / "agent" / "cli" / "app.py").is_file() else "agent.cli"


def measure(src: Path, server: DemoServer, env: dict[str, str], work: Path, args: argparse.Namespace, tag: str) -> dict:
    data = Path(tempfile.mkdtemp(prefix="data-", dir=work))
    agent_env = {**agent_env_of(env), "SERVEWATCH_HOST_NAME": "cpu-node", "PYTHONPATH": str(src)}
    agent_env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    log = open(work / f"agent-{tag}.log", "wb")  # noqa: SIM115 - closed below
    agent = subprocess.Popen(
        [sys.executable, "-m", cli_module(src), "run", "--root-pid", str(server.pid),
         "--health-url", f"{server.base_url}/health", "--metrics-url", f"{server.base_url}/metrics",
         "--data-dir", str(data), "--watchdog-timeout", "60"],
        env=agent_env, cwd=str(src), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    spy = None
    raw = work / f"pyspy-{tag}.txt"
    try:
        time.sleep(args.warmup_s)
        if agent.poll() is not None:
            raise SystemExit(f"agent exited {agent.returncode}: {(work / f'agent-{tag}.log').read_text(errors='replace')[-3000:]}")
        pyspy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if args.pyspy and pyspy:
            spy = subprocess.Popen([pyspy, "record", "--format", "raw", "--nonblocking", "-r", str(args.pyspy_rate),
                                    "-d", str(int(args.window_s)), "-o", str(raw), "-p", str(agent.pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        la0 = loadavg()
        w0 = time.time_ns()
        t0, c0 = time.monotonic(), thread_cpu(agent.pid)
        time.sleep(args.window_s)
        t1, c1 = time.monotonic(), thread_cpu(agent.pid)
        w1 = time.time_ns()
        la1 = loadavg()
        rss = rss_mb(agent.pid)
        if spy is not None:
            spy.wait(60)
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
            spy.wait(10)
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
        log.close()
    if args.keep is not None and raw.exists():
        args.keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(raw, args.keep / raw.name)
    dt = t1 - t0
    threads = {k: 100.0 * (c1.get(k, 0.0) - c0.get(k, 0.0)) / dt for k in c1}
    spans_window, spans_total = shipped_spans(data, w0, w1)
    roots = (str(src.resolve()), str(REPO))
    comps, leaves, total = parse_raw(raw, roots) if spy is not None else (collections.Counter(), collections.Counter(), 0)
    return {"src": str(src), "window_s": dt, "cpu_pct": sum(threads.values()), "threads": threads, "rss_mb": rss,
            "load": (la0[0] + la1[0]) / 2, "samples": total, "spans_window": spans_window, "spans_total": spans_total, "components": dict(comps), "leaves": dict(leaves.most_common(25))}


def report(results: list[dict], srcs: list[Path], rate: float, args: argparse.Namespace) -> None:
    """Print one rate's figures per tree (per thread, per component) and emit its result rows."""
    what = "idle" if rate <= 0 else f"{rate:g} req/s"
    print(f"\nagent CPU watching the demo server (tp {args.tp}), {what}, % of one core per window:")
    meds = []
    for i, src in enumerate(srcs):
        mine = [x for x in results if x["index"] == i and x["rate"] == rate]
        cpu = sorted(x["cpu_pct"] for x in mine)
        meds.append(cpu[len(cpu) // 2])
        loads = ", ".join(f"{x['load']:.1f}" for x in mine)
        print(f"  [{i}] {src}: median {meds[-1]:.3f} % ({', '.join(f'{c:.3f}' for c in cpu)}); RSS max "
              f"{max(x['rss_mb'] for x in mine):.1f} MB; load {loads}")
        print("      spans shipped that ended in the window (per window): "
              + ", ".join(f"{x['spans_window']} ({x['spans_window'] / x['window_s']:.1f}/s)" for x in mine))
        threads: collections.Counter[str] = collections.Counter()
        comps: collections.Counter[str] = collections.Counter()
        leaves: collections.Counter[str] = collections.Counter()
        samples = 0
        for x in mine:
            threads.update({k: v / len(mine) for k, v in x["threads"].items()})
            comps.update(x["components"])
            leaves.update(x["leaves"])
            samples += x["samples"]
        print("      per thread: " + ", ".join(f"{k} {v:.3f} %" for k, v in threads.most_common() if v >= 0.005))
        if samples:
            total = sum(cpu) / len(cpu)
            print(f"      per component (py-spy, {samples} busy samples; share x the agent's mean CPU):")
            for k, n in comps.most_common():
                print(f"        {k:48s} {100 * n / samples:5.1f} %  ~{total * n / samples:.3f} % of a core")
            print("      hottest leaves:")
            for k, n in leaves.most_common(12):
                print(f"        {n:6d}  {k}")
        noise = (cpu[-1] - cpu[0]) / 2 if len(cpu) >= 2 else None
        emit_result(f"agent CPU watching the demo server, {what}" + (f", tree {i}" if len(srcs) > 1 else ""),
                    ours=meds[-1], unit="% of a core", baseline=meds[0] if i else None,
                    baseline_name=f"tree 0 ({srcs[0]})" if i else "(target <= 0.5 % idle, <= 1 % under traffic)",
                    spread=(cpu[0], cpu[-1]), noise=noise if len(srcs) == 1 else None,
                    note=f"median of {len(cpu)} windows of {args.window_s:.0f} s; RSS max {max(x['rss_mb'] for x in mine):.1f} MB")
    if len(srcs) > 1:
        for i in range(1, len(srcs)):
            pairs = [(a["cpu_pct"], b["cpu_pct"]) for a in results for b in results
                     if a["rate"] == b["rate"] == rate and a["round"] == b["round"] and a["index"] == 0 and b["index"] == i]
            ratios = sorted(b / a for a, b in pairs if a > 0)
            if ratios:
                print(f"  tree {i} / tree 0, per round: {', '.join(f'{r:.3f}' for r in ratios)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, action="append", default=None, help="source tree to run the agent from (repeat; default: this one)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rates", default="0", help="comma-separated total requests/s, one measurement each (0: idle)")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--pyspy", action="store_true", help="also attribute CPU to components with py-spy (sampled)")
    ap.add_argument("--pyspy-rate", type=int, default=100)
    ap.add_argument("--keep", type=Path, default=None, help="copy py-spy's raw stacks into this folder")
    ap.add_argument("--json", type=Path, default=None, help="write every window's figures here")
    ap.add_argument("--parse", type=Path, nargs="*", default=None, help="only attribute these saved raw files")
    args = ap.parse_args()
    if args.parse is not None:
        for path in args.parse:
            comps, leaves, total = parse_raw(path, (str(REPO),))
            print(f"{path}: {total} busy samples")
            for k, n in comps.most_common():
                print(f"  {k:48s} {100 * n / max(1, total):5.1f} %")
            for k, n in leaves.most_common(15):
                print(f"  {n:6d}  {k}")
        return
    srcs = [s.resolve() for s in (args.src or [REPO])]
    rates = [float(r) for r in args.rates.split(",")]

    work, _shm, _data, env = bench_workspace("servewatch-agentcpu-")
    server = DemoServer(tp=args.tp, env=env, title_prefix="agentcpu").start()
    results: list[dict] = []
    try:
        for rate in rates:
            load = LoadGenerator(server.base_url, clients=args.clients, rate=rate, max_new_tokens=16).start() if rate > 0 else None
            try:
                for r in range(args.rounds):
                    for i, src in enumerate(srcs):
                        res = measure(src, server, env, work, args, f"{rate:g}-{r}-{i}")
                        res["round"], res["index"], res["rate"] = r, i, rate
                        results.append(res)
                        print(f"{rate:g} req/s, round {r}, tree {i} ({src}): agent CPU {res['cpu_pct']:.3f} % of a core over "
                              f"{res['window_s']:.0f} s, RSS {res['rss_mb']:.1f} MB, load {res['load']:.2f}", flush=True)
            finally:
                if load is not None:
                    load.stop()
    finally:
        server.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    for rate in rates:
        report(results, srcs, rate, args)


if __name__ == "__main__":
    main()
