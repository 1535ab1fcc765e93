"""Fan-out latency: incident open on the first agent -> capture start on the last peer.

For each peer count (2, 8, 32, 64 by default) the bench starts that many peer agents on loopback
(real :class:`agent.runtime.Agent` instances with the API on, each with its own data dir, host
name and port, spread over ``--workers`` processes), plus one origin agent in this process with
every peer in its static peer list. Each run opens an incident on the origin
(``IncidentManager.open_incident``) and measures, from the origin's ``IncidentOpened`` time
(wall clock):

* ``last``: to the latest peer incident's ``IncidentOpened`` time (capture start on the last peer),
  read from each peer's ``GET /v1/incidents``;
* ``p50``: to the median peer's capture start;
* ``answers``: to the moment the origin had every peer's answer (its fan-out was done).

Peers have no targets, so "capture start" is the incident opening (a peer with targets starts
its py-spy dumps right then). Runs are spaced beyond the job's dedup window, so each one opens a
fresh incident everywhere. The agents' data dirs live on ``/dev/shm`` by default: the simulated
hosts share this machine's disk and event loops, and their bundle fsyncs would otherwise queue
each other's capture behind them, which separate hosts never do. Then it prints the shape of the last trace of the smallest job, read
back from the agents' OTLP/JSON span files, as Jaeger would draw it.

Target: ``last`` p50 <= 200 ms at 64 peers on this machine, and cost at most linear in peers: the
marginal cost of each added peer (the slope of ``last`` between consecutive peer counts, the
fixed cost cancelled) must not grow with the peer count. Nothing is asserted; the figures are printed.

Usage: ``python bench/bench_fanout.py [--peers 2,8,32,64] [--runs 5] [--workers 2]``
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import emit_result, kill_groups

from agent.config import load_settings
from agent.runtime import Agent

TARGET_MS_AT_64 = 200.0
JOB = "bench-fanout"
TOKEN = "bench-fanout-token"
DEDUP_WINDOW_S = 0.5


def _settings(data_dir: Path, host: str, port: int, token_file: Path, peers: list[str]) -> Any:
    return load_settings({
        "data_dir": data_dir / host,
        "host_name": host,
        "api": {"enabled": True, "host": "127.0.0.1", "port": port, "token_file": token_file, "rate_burst": 1000, "rate_per_s": 1000},
        "fleet": {"job": JOB, "peers": peers, "dedup_window_s": DEDUP_WINDOW_S, "peer_timeout_s": 5.0},
        "export": {"metrics": False, "schedule_delay_s": 0.2},
    })


def _free_ports(n: int) -> list[int]:
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# --- worker: hosts some peer agents ---------------------------------------------------------------


async def _worker(data_dir: Path, token_file: Path, ports: list[int], first_index: int) -> None:
    logging.getLogger("servewatch").setLevel(logging.ERROR)  # "no processes to dump": peers have none
    agents = [Agent(_settings(data_dir, f"peer-{first_index + i:02d}", port, token_file, [])) for i, port in enumerate(ports)]
    async with anyio.create_task_group() as tg:
        for agent in agents:
            await tg.start(agent.run)
        print("ready", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)  # until the bench closes our stdin
        for agent in agents:
            agent.stop()


# --- the bench ------------------------------------------------------------------------------------------


def _start_workers(data_dir: Path, token_file: Path, ports: list[int], workers: int) -> list[subprocess.Popen[bytes]]:
    procs = []
    chunks = [ports[i::workers] for i in range(workers)]
    start = 0
    for chunk in chunks:
        if not chunk:
            continue
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", "--data-dir", str(data_dir), "--token-file", str(token_file),
             "--ports", ",".join(map(str, chunk)), "--first-index", str(start)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        ))
        start += len(chunk)
    for proc in procs:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith(b"ready"):
            raise RuntimeError(f"peer worker failed to start: {line!r}")
    return procs


async def _peer_open_times(client: httpx.AsyncClient, ports: list[int]) -> dict[str, int]:
    """incident id -> opened time of every peer's newest incident."""
    out: dict[str, int] = {}

    async def one(port: int) -> None:
        r = await client.get(f"http://127.0.0.1:{port}/v1/incidents", headers={"authorization": f"Bearer {TOKEN}"})
        items = [i for i in r.json()["incidents"] if i.get("opened_time_unix_nano")]
        if items:
            newest = max(items, key=lambda i: int(i["opened_time_unix_nano"]))
            out[newest["incident_id"]] = int(newest["opened_time_unix_nano"])

    async with anyio.create_task_group() as tg:
        for port in ports:
            tg.start_soon(one, port)
    return out


async def _measure(n: int, runs: int, workers: int, base: Path, token_file: Path) -> dict[str, Any]:
    ports = _free_ports(n + 1)
    origin_port, peer_ports = ports[0], ports[1:]
    data_dir = base / f"peers-{n}"
    procs = _start_workers(data_dir, token_file, peer_ports, min(workers, n))
    results: list[dict[str, float]] = []
    try:
        origin = Agent(_settings(data_dir, "origin", origin_port, token_file, [f"127.0.0.1:{p}" for p in peer_ports]))
        async with anyio.create_task_group() as tg, httpx.AsyncClient(trust_env=False, timeout=10) as client:
            await tg.start(origin.run)
            for run in range(runs + 1):  # run 0 warms connections and code paths; not counted
                await anyio.sleep(DEDUP_WINDOW_S + 0.3)
                record = await origin.incidents.open_incident("manual", detail=f"bench run {run}")
                answered = max(r.end_time_unix_nano for r in record.results if r.action == "peer.capture")
                ok = sum(1 for r in record.results if r.action == "peer.capture" and r.outcome.value == "ok")
                with anyio.fail_after(30):
                    while True:
                        opened = await _peer_open_times(client, peer_ports)
                        mine = {i: t for i, t in opened.items() if t >= record.opened.time_unix_nano}
                        if len(mine) == n:
                            break
                        await anyio.sleep(0.1)
                t0 = record.opened.time_unix_nano
                deltas = sorted((t - t0) / 1e6 for t in mine.values())
                if run > 0:
                    results.append({"last": deltas[-1], "p50": statistics.median(deltas), "answers": (answered - t0) / 1e6, "ok": ok})
            origin.stop()
            trace_id = record.opened.trace_id
    finally:
        for proc in procs:
            proc.stdin.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        kill_groups(procs, timeout_s=10)
    return {"n": n, "runs": results, "trace_id": trace_id, "data_dir": data_dir}


def _trace_tree(data_dir: Path, trace_id: str, max_children: int = 3) -> list[str]:
    """The trace as Jaeger draws it (a text tree), from every agent's span files."""
    from exporters.otlp_json import iter_span_files, read_span_file

    spans: dict[str, dict[str, Any]] = {}
    for path in iter_span_files([data_dir]):
        for request in read_span_file(path):
            for rs in request.resource_spans:
                host = next((kv.value.string_value for kv in rs.resource.attributes if kv.key == "host.name"), "?")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        if span.trace_id.hex() != trace_id:
                            continue
                        attrs = {kv.key: kv.value for kv in span.attributes}
                        spans[span.span_id.hex()] = {
                            "name": span.name, "host": host, "parent": span.parent_span_id.hex(), "start": span.start_time_unix_nano,
                            "dur_ms": (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6,
                            "outcome": attrs["servewatch.outcome"].string_value if "servewatch.outcome" in attrs else "",
                            "peer": attrs["servewatch.peer.host.name"].string_value if "servewatch.peer.host.name" in attrs else "",
                            "ranks": ",".join(v.string_value for v in attrs["servewatch.target.ranks"].array_value.values)
                            if "servewatch.target.ranks" in attrs else "",
                        }
    children: dict[str, list[str]] = {}
    for sid, s in spans.items():
        children.setdefault(s["parent"], []).append(sid)
    lines: list[str] = []

    def label(s: dict[str, Any]) -> str:
        extra = f" -> {s['peer']}" if s["peer"] else ""
        outcome = f" [{s['outcome']}]" if s["outcome"] else ""
        where = f"{s['host']}, {s['ranks']}" if s["ranks"] else s["host"]
        return f"{s['name']}{extra} ({where}){outcome} {s['dur_ms']:.1f} ms"

    def walk(sid: str, prefix: str, last: bool, depth: int) -> None:
        s = spans[sid]
        lines.append(f"{prefix}{'' if depth == 0 else ('└─ ' if last else '├─ ')}{label(s)}")
        kids = sorted(children.get(sid, []), key=lambda k: (spans[k]["name"] != "peer.capture", spans[k]["start"]))
        groups: dict[str, list[str]] = {}
        for k in kids:
            groups.setdefault(spans[k]["name"], []).append(k)
        shown: list[str] = []
        hidden: dict[str, int] = {}
        for name, ks in groups.items():
            shown += ks[:max_children]
            if len(ks) > max_children:
                hidden[name] = len(ks) - max_children
        child_prefix = prefix + ("" if depth == 0 else ("   " if last else "│  "))
        for i, k in enumerate(shown):
            walk(k, child_prefix, i == len(shown) - 1 and not hidden, depth + 1)
        for j, (name, count) in enumerate(hidden.items()):
            lines.append(f"{child_prefix}{'└─ ' if j == len(hidden) - 1 else '├─ '}... {count} more {name}")

    for root in (sid for sid, s in spans.items() if s["parent"] not in spans):
        walk(root, "", True, 0)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="2,8,32,64", help="peer counts, comma separated")
    parser.add_argument("--runs", type=int, default=5, help="measured runs per peer count")
    parser.add_argument("--workers", type=int, default=2, help="processes hosting the peer agents")
    parser.add_argument("--data-root", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                        help="where the agents' data dirs go (default /dev/shm: every simulated host gets its own"
                             " fast disk instead of all sharing this machine's fsyncs)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--token-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    parser.add_argument("--first-index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        anyio.run(_worker, args.data_dir, args.token_file, [int(p) for p in args.ports.split(",")], args.first_index)
        return 0

    logging.getLogger("servewatch").setLevel(logging.ERROR)
    counts = [int(x) for x in args.peers.split(",")]
    with tempfile.TemporaryDirectory(prefix="servewatch-bench-fanout-", dir=args.data_root) as tmp:
        base = Path(tmp)
        os.chmod(base, 0o700)
        token_file = base / "token"
        token_file.write_text(TOKEN)
        os.chmod(token_file, 0o600)
        measured = []
        for n in counts:
            m = anyio.run(_measure, n, args.runs, args.workers, base, token_file)
            measured.append(m)
            runs = m["runs"]
            last = statistics.median(r["last"] for r in runs)
            print(f"peers={n:3d}  last peer capture start: p50 {last:7.1f} ms  max {max(r['last'] for r in runs):7.1f} ms"
                  f"  | median peer {statistics.median(r['p50'] for r in runs):7.1f} ms"
                  f"  | all answers {statistics.median(r['answers'] for r in runs):7.1f} ms"
                  f"  | per peer {last / n:6.2f} ms  | ok {min(r['ok'] for r in runs)}/{n}", flush=True)
        print()
        # at most linear: the marginal cost of each added peer (the slope between consecutive
        # peer counts, the fixed cost cancelled) does not grow with the peer count
        prev = None
        for m in measured:
            last = statistics.median(r["last"] for r in m["runs"])
            if prev is not None:
                slope = (last - prev[1]) / (m["n"] - prev[0])
                print(f"marginal cost {prev[0]:3d} -> {m['n']:3d} peers: {slope:6.2f} ms per added peer")
                emit_result(f"fan-out: marginal cost per added peer, {prev[0]} -> {m['n']} peers", ours=slope, unit="ms/peer",
                            baseline_name="(none: linear means it does not grow with the peer count)",
                            note=f"median of {len(m['runs'])} runs each")
            prev = (m["n"], last)
        at64 = [m for m in measured if m["n"] == 64]
        if at64:
            last64 = statistics.median(r["last"] for r in at64[0]["runs"])
            print(f"target: last peer capture start at 64 peers <= {TARGET_MS_AT_64:g} ms: {last64:.1f} ms"
                  f" ({'met' if last64 <= TARGET_MS_AT_64 else 'MISSED'})")
            runs64 = [r["last"] for r in at64[0]["runs"]]
            emit_result("fan-out: open -> capture start on the last of 64 peers", ours=last64, unit="ms",
                        baseline_name=f"(target <= {TARGET_MS_AT_64:g} ms)", spread=(min(runs64), max(runs64)),
                        note=f"median of {len(runs64)} runs")
        print()
        smallest = measured[0]
        print(f"trace shape ({smallest['n']} peers, trace {smallest['trace_id']}), as Jaeger shows it:")
        for line in _trace_tree(smallest["data_dir"], smallest["trace_id"]):
            print("  " + line)
        if len(measured) > 1:
            big = measured[-1]
            print(f"\ntrace shape ({big['n']} peers, trace {big['trace_id']}), children grouped:")
            for line in _trace_tree(big["data_dir"], big["trace_id"], max_children=2):
                print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
