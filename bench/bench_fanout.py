"""A job of N hosts, one hang: one trace, requests per incident, capture spread, coordinator CPU.

Each simulated host is the real job protocol (:class:`agent.fleet.Fleet` with its real HTTP API,
real signed requests, plain HTTP or mutual TLS, a real :class:`agent.incidents.manager.IncidentManager`
on a real event bus, a real span mirror) on its own loopback address (``127.x.y.z``; each host
binds its API there and sends from there, so per-client limits see N clients). Each host holds
``--ranks`` ranks (8) as its discovery finds them (titled SGLang schedulers with their global TP
numbers; its announce and join answers carry them) but captures nothing (so "capture start" is
its incident opening, the moment a host with real ranks starts its py-spy dumps). Hosts run
in-process, ``--workers`` processes of them; host 0 (the lowest address, holding global rank 0:
it announces itself and coordinates) runs alone in this process, so its CPU is measured alone.

Modes, for each N of ``--hosts`` (8, 64, 256, 1000):

* ``race``: every host detects the hang in the same millisecond (each worker publishes a
  ``WatchdogStalled`` on each of its hosts' buses at one agreed wall time, mid time bucket);
* ``one``: only the highest host detects (it reports; the coordinator asks the N-2 others,
  directly, or through sqrt(N) relays above ``fleet.tree_threshold``).

Per run it checks and prints: traces (distinct trace ids of the N incidents: must be 1) and
roots (spans without a parent in that trace, from every host's mirror: must be 1, the
coordinator's ``job.incident``), incidents moved (0: the hosts agreed with no message), requests
of the protocol (reports + joins + evidence summaries received, all hosts: target <= 2N), the
capture spread (last host's incident open minus the first's: target <= 200 ms at 64 hosts, and
linear beyond: the marginal ms per added host must not grow), the coordinator's CPU seconds from
the go to its job verdict, per host, and the job trace's size in OTLP protobuf bytes. The span
bytes of a real host's capture (8 real titled ranks, real py-spy) are measured once
(``--sample-ranks``) and added N times, for the trace size a real N-host incident has (target:
under Tempo's default 5 MB per trace at 1,000 hosts).

The baseline, same machine and run: ``--mode one`` is the old shape's best case (one host asks
all others); before this design every host fanned out in a race: N(N-1) requests.

Loaded rows (``--loaded-hosts``, 8 and 64): ``race`` over plain HTTP again with a busy loop pinned
to every CPU, against the same sizes quiet: one trace one root, and detection to capture start of
the slowest host (the placement step runs before every host's incident opens).

Usage: ``python bench/bench_fanout.py [--hosts 8,64,256,1000] [--modes race,one] [--tls plain,mtls]
[--runs 3] [--workers 4] [--ranks 8] [--loaded-hosts 8,64]``. Nothing is asserted; the figures are printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import emit_result, kill_groups

JOB = "bench-job"
TOKEN = "bench-fanout-token-0123456789abcdef"
#: the hosts' API port (each on its own address): a free one, picked once per run (``--port``)
PORT = 0
#: ranks per simulated host (``--ranks``)
RANKS = 8
BUCKET_S = 10.0
#: a job incident is remembered this long: longer than a run's capture spread, shorter than the runs' spacing
DEDUP_WINDOW_S = 10.0
TARGET_SPREAD_MS_AT_64 = 200.0
TEMPO_TRACE_LIMIT_BYTES = 5 * 1024 * 1024


def _free_port() -> int:
    """A port free on the coordinator's address (another bench run on this machine may hold another)."""
    import socket

    with socket.socket() as s:
        s.bind((_address(0), 0))
        return int(s.getsockname()[1])


def _address(i: int) -> str:
    """Host ``i``'s loopback address; host 0 is the lowest."""
    return f"127.{10 + i // 62500}.{1 + (i // 250) % 250}.{1 + i % 250}"


# --- one simulated host ----------------------------------------------------------------------------


class SimHost:
    """The job protocol of one host: Fleet + IncidentManager + bus + span mirror, no targets."""

    def __init__(self, index: int, n: int, base: Path, tls: dict[str, str], ranks: int = 0) -> None:
        from agent.fleet.config import ApiConfig, FleetConfig
        from agent.fleet.job import Fleet
        from agent.host.targets import Target
        from agent.incidents.manager import IncidentConfig, IncidentManager
        from agent.model.bus import EventBus
        from exporters.mirror.mirror import SpanMirror
        from exporters.otlp.spans import InMemorySink

        self.index = index
        host = f"h{index:04d}"
        # its ranks as discovery finds them: titled SGLang schedulers with their global TP numbers
        # (this process stands in for each: no RANK in its environment, so the titles say the ranks)
        self.targets = [Target(pid=os.getpid(), title=f"{JOB}::scheduler_TP{index * ranks + r}") for r in range(ranks)]
        self.settings = SimpleNamespace(host_name=host, data_dir=base / "data")
        self.bus = EventBus()
        self.records: list[Any] = []
        self.watched_step_pids: frozenset[int] = frozenset()
        self.sink = InMemorySink()
        self.mirror = SpanMirror(self.sink, host_name=host)
        api = ApiConfig(enabled=True, host=_address(index), port=PORT, token_file=base / "token", rate_per_s=1e6, rate_burst=10**6,
                        max_connections=2048, max_connections_per_client=64, reserved_for_authenticated=64, **tls)
        fleet = FleetConfig(job=JOB, peers=[f"{_address(i)}:{PORT}" for i in range(n)], dedup_window_s=DEDUP_WINDOW_S, peer_timeout_s=10.0,
                            evidence_timeout_s=60.0, announce_interval_s=3600.0, allow_insecure_peers=not tls, time_bucket_s=BUCKET_S)
        self.fleet = Fleet(self, api, fleet)
        self.incidents = IncidentManager(bus=self.bus, config=IncidentConfig(cooldown_s=0.001), data_dir=base / "data",
                                         host_name=host, discover=list, on_incident=self.records.append,
                                         admit=self.fleet.admit, place=self.fleet.place, companions=[self.fleet.companion])

    def discover(self) -> list[Any]:
        return list(self.targets)

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        from exporters.mirror.mirror import MIRRORED_EVENTS

        async with anyio.create_task_group() as tg:
            sub = self.bus.subscribe(*MIRRORED_EVENTS, name="mirror", max_buffer=float("inf"))
            tg.start_soon(self.mirror.run, sub)
            await tg.start(self.incidents.run)
            await tg.start(self.fleet.run)
            task_status.started()

    async def detect(self, run: int, at_ns: int) -> None:
        """This host's watchdog fired at ``at_ns`` (every host's at the same instant: the event is
        stamped with it; publishing it here is this host's own work, serialized with its worker's)."""
        from agent.model.events import WatchdogStalled

        self._detected_ns = at_ns
        await self.bus.publish(WatchdogStalled(source="bench", time_unix_nano=at_ns, pid=10_000_000 + run, forward_ct=1,
                                               stalled_for_s=3.0, timeout_s=3.0))

    def report(self, run: int) -> dict[str, Any]:
        record = next((r for r in reversed(self.records) if r.opened.time_unix_nano >= self._since), None)
        f = self.fleet
        spans = [s for s in self.sink.spans if record is not None and f"{s.context.trace_id:032x}" == record.opened.trace_id]
        from exporters.otlp.encode import encode_spans_fast

        own = [s for s in spans if s.name == "incident"]
        return {
            "host": self.index, "run": run,
            "trace_id": record.opened.trace_id if record else None,
            "opened_ns": record.opened.time_unix_nano if record else None,
            "parent": record.opened.parent_span_id if record else None,
            "protocol_requests": f.reports_received + f.joins + f.evidence_received - self._requests_before,
            "moved": f.moved - self._moved_before, "verdicts": f.verdicts - self._verdicts_before,
            "roots": sum(1 for s in spans if s.parent is None), "spans": len(spans),
            "span_bytes": len(encode_spans_fast(spans).SerializeToString()) if spans else 0,
            "incident_span_bytes": len(encode_spans_fast(own).SerializeToString()) if own else 0,
            "job_verdict_hosts": len(f.job.verdict.hosts) if f.job is not None and f.job.verdict is not None else 0,
            "asked": len(f.job.asked) if f.job is not None else 0, "reported": len(f.job.reported) if f.job is not None else 0,
            "detect_to_open_ms": (record.opened.time_unix_nano - self._detected_ns) / 1e6 if record and self._detected_ns else None,
        }

    def mark(self) -> None:
        f = self.fleet
        self._since = time.time_ns()
        self._requests_before = f.reports_received + f.joins + f.evidence_received
        self._moved_before, self._verdicts_before = f.moved, f.verdicts
        self._detected_ns = 0
        self.sink = type(self.sink)()
        self.mirror.sink = self.sink


# --- worker processes -----------------------------------------------------------------------------


async def _worker(indices: list[int], n: int, base: Path, tls: dict[str, str], ranks: int) -> None:
    logging.getLogger("servewatch").setLevel(logging.CRITICAL)
    hosts = [SimHost(i, n, base, tls, ranks) for i in indices]
    async with anyio.create_task_group() as tg:
        for h in hosts:
            await tg.start(h.run)
        print("ready", flush=True)
        stdin = anyio.wrap_file(sys.stdin)
        async for line in stdin:
            cmd = json.loads(line)
            if cmd["op"] == "mark":
                for h in hosts:
                    h.mark()
                print("marked", flush=True)
            elif cmd["op"] == "go":
                await anyio.sleep(max(0.0, cmd["at_s"] - time.time()))
                for h in hosts:
                    if cmd["who"] == "all" or h.index in cmd["who"]:
                        await h.detect(cmd["run"], int(cmd["at_s"] * 1e9))
            elif cmd["op"] == "report":
                print(json.dumps([h.report(cmd["run"]) for h in hosts]), flush=True)
            elif cmd["op"] == "stop":
                break
        tg.cancel_scope.cancel()


def _start_workers(n: int, workers: int, base: Path, tls: dict[str, str]) -> list[subprocess.Popen[str]]:
    others = list(range(1, n))
    chunks = [others[i::workers] for i in range(workers)]
    procs = []
    for chunk in chunks:
        if chunk:
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", "--n", str(n), "--base", str(base), "--indices", ",".join(map(str, chunk)),
                 "--tls-json", json.dumps(tls), "--port", str(PORT), "--ranks", str(RANKS)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
            ))
    for proc in procs:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("ready"):
            raise RuntimeError(f"worker failed to start: {line!r}")
    return procs


def _send(procs: list[subprocess.Popen[str]], cmd: dict[str, Any]) -> None:
    for proc in procs:
        proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]


def _read(procs: list[subprocess.Popen[str]]) -> list[str]:
    return [proc.stdout.readline() for proc in procs]  # type: ignore[union-attr]


# --- the bench ------------------------------------------------------------------------------------------


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _measure(n: int, mode: str, runs: int, workers: int, base: Path, tls: dict[str, str]) -> list[dict[str, Any]]:
    procs = await anyio.to_thread.run_sync(_start_workers, n, min(workers, n - 1), base, tls)
    coordinator = SimHost(0, n, base, tls, RANKS)
    results = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(coordinator.run)
            for run in range(runs + 1):  # run 0 warms code paths and connections; not counted
                coordinator.mark()
                _send(procs, {"op": "mark"})
                await anyio.to_thread.run_sync(_read, procs)
                # go mid time bucket, at least 1 s from now (every host names the same bucket)
                now = time.time()
                at = (math.floor((now + 1.0) / BUCKET_S) + 0.5) * BUCKET_S
                at = at if at > now + 1.0 else at + BUCKET_S
                who: Any = "all" if mode == "race" else [n - 1]
                _send(procs, {"op": "go", "at_s": at, "who": who, "run": run})
                await anyio.sleep(max(0.0, at - time.time()))
                cpu0 = _cpu_s()
                if mode == "race":
                    await coordinator.detect(run, int(at * 1e9))
                with anyio.fail_after(240):
                    while coordinator.fleet.verdicts <= coordinator._verdicts_before:
                        await anyio.sleep(0.02)
                cpu = _cpu_s() - cpu0
                await anyio.sleep(1.5)  # the hosts' roots (incident spans) are emitted when their incidents close
                _send(procs, {"op": "report", "run": run})
                rows = [coordinator.report(run)] + [r for line in await anyio.to_thread.run_sync(_read, procs) for r in json.loads(line)]
                opened = [r["opened_ns"] for r in rows if r["opened_ns"]]
                traces = {r["trace_id"] for r in rows if r["trace_id"]}
                row = {
                    "run": run, "hosts": len(rows), "incidents": len(opened), "traces": len(traces),
                    "roots": sum(r["roots"] for r in rows), "moved": sum(r["moved"] for r in rows),
                    "requests": sum(r["protocol_requests"] for r in rows), "spread_ms": (max(opened) - min(opened)) / 1e6,
                    "coordinator_cpu_s": cpu, "trace_bytes": sum(r["span_bytes"] for r in rows),
                    "host_incident_bytes": sum(r["incident_span_bytes"] for r in rows),
                    "verdict_hosts": coordinator.report(run)["job_verdict_hosts"],
                    "asked": rows[0]["asked"], "reported": rows[0]["reported"],
                    "delay_ms": max((r["detect_to_open_ms"] for r in rows if r["detect_to_open_ms"] is not None), default=0.0),
                }
                if run > 0:
                    results.append(row)
                await anyio.sleep(DEDUP_WINDOW_S + 0.5)  # past the dedup window
            tg.cancel_scope.cancel()
    finally:
        _send(procs, {"op": "stop"})
        deadline = time.monotonic() + 20
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        kill_groups(procs, timeout_s=10)
    return results


def _sample_once(pids: list[int], linked: bool) -> int:
    """OTLP bytes in the job's trace of one real incident on ``pids`` (see :func:`_host_sample_bytes`)."""
    from agent.model.events import TRACE_DETAIL_ATTR
    from agent.model.ids import new_span_id_hex, new_trace_id_hex
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings
    from exporters.mirror.mirror import SpanMirror
    from exporters.otlp.encode import encode_spans_fast
    from exporters.otlp.spans import InMemorySink

    sink = InMemorySink()
    trace = new_trace_id_hex()

    async def place(trigger: str, targets: Any, detected_ns: int, parent: Any) -> Any:
        return trace, new_span_id_hex(), ({TRACE_DETAIL_ATTR: "linked"} if linked else {})

    with tempfile.TemporaryDirectory(prefix="servewatch-bench-sample-") as tmp:
        settings = load_settings({"data_dir": tmp, "host_name": "gpu-node-0001.cluster.example", "export": {"metrics": False},
                                  "target": {"pids": pids}})

        async def main() -> None:
            agent = Agent(settings)
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                mirror = SpanMirror(sink, host_name=settings.host_name)
                sub = agent.bus.subscribe(*mirror.events, name="sample", max_buffer=float("inf"))
                tg.start_soon(mirror.run, sub)
                agent.incidents.place = place
                await agent.incidents.open_incident("stall", detail="bench sample")
                await anyio.sleep(0.5)
                agent.stop()
                sub.close()

        anyio.run(main)
    in_trace = [sp for sp in sink.spans if f"{sp.context.trace_id:032x}" == trace]
    return len(encode_spans_fast(in_trace).SerializeToString())


def _host_sample_bytes(k: int) -> tuple[int, int]:
    """OTLP bytes a real host's incident puts in the job's trace: a real agent dumping ``k`` real
    titled ranks (py-spy, Flight Recorder read, coredump check), with its action spans inline (a
    small job) and linked to a trace of their own (a job above ``fleet.trace_detail_max_hosts``)."""
    programs = ROOT / "tests" / "programs" / "titled_target.py"
    procs = [subprocess.Popen([sys.executable, str(programs), f"sample::scheduler_TP{i}"], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, start_new_session=True) for i in range(k)]
    try:
        for p in procs:
            p.stdout.readline()  # type: ignore[union-attr]
        pids = [p.pid for p in procs]
        return _sample_once(pids, False), _sample_once(pids, True)
    finally:
        kill_groups(procs, timeout_s=10)


def _tls_material(base: Path) -> dict[str, str]:
    """A job CA and one agent certificate good for server and client auth (what every host uses)."""
    sys.path.insert(0, str(ROOT))
    from tests.fleet.test_api import _pki

    (base / "pki").mkdir(mode=0o700, exist_ok=True)
    pki = _pki(base / "pki")
    return {"tls_cert_file": str(pki["server"]), "tls_key_file": str(pki["server-key"]), "tls_client_ca_file": str(pki["ca"])}


def _summary(n: int, mode: str, tls_name: str, rows: list[dict[str, Any]], sample: tuple[int, int], k: int, *,
             load: str = "quiet") -> dict[str, Any]:
    keys = ("requests", "spread_ms", "coordinator_cpu_s", "trace_bytes", "host_incident_bytes")
    med = {key: statistics.median(r[key] for r in rows) for key in keys}
    ok = sum(1 for r in rows if r["traces"] == 1 and r["roots"] == 1 and r["incidents"] == n)
    # each simulated host's own incident span replaced by a real host's (k real ranks): inline
    # action spans up to fleet.trace_detail_max_hosts (64) hosts, the linked summary above
    per_host = sample[0] if n <= 64 else sample[1]
    real_bytes = med["trace_bytes"] - med["host_incident_bytes"] + n * per_host
    print(f"{mode:4s} {tls_name:5s}{' loaded' if load != 'quiet' else ''} N={n:4d}  one trace one root: {ok}/{len(rows)}  moved {max(r['moved'] for r in rows)}"
          f"  | requests {med['requests']:6.0f} ({med['requests'] / n:4.2f} N)  | capture spread {med['spread_ms']:8.1f} ms"
          f" (max {max(r['spread_ms'] for r in rows):8.1f})  | coordinator CPU {med['coordinator_cpu_s'] * 1000 / n:6.2f} ms/host"
          f"  | trace {real_bytes / 1e6:6.2f} MB with {k} real ranks per host  | verdict hosts {min(r['verdict_hosts'] for r in rows)}"
          f"  | asked {max(r['asked'] for r in rows)} reported {min(r['reported'] for r in rows)}"
          f"  | detection -> capture start, slowest host {statistics.median(r['delay_ms'] for r in rows):7.1f} ms",
          flush=True)
    return {"n": n, "mode": mode, "tls": tls_name, "ok": ok, "runs": len(rows), **med, "real_trace_bytes": real_bytes,
            "spreads": [r["spread_ms"] for r in rows], "load": load,
            "delay_ms": statistics.median(r["delay_ms"] for r in rows)}


def _hogs() -> list[subprocess.Popen[bytes]]:
    """One busy loop pinned to each CPU of this machine (the loaded rows)."""
    return [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"],
                             start_new_session=True) for cpu in sorted(os.sched_getaffinity(0))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="8,64,256,1000", help="job sizes, comma separated")
    parser.add_argument("--modes", default="race,one", help="race (all detect at once), one (one host detects)")
    parser.add_argument("--tls", default="plain,mtls", help="plain (HTTP, signed requests), mtls (mutual TLS with a job CA)")
    parser.add_argument("--runs", type=int, default=3, help="measured runs per size (one warm-up run more)")
    parser.add_argument("--workers", type=int, default=4, help="processes hosting the hosts other than the coordinator")
    parser.add_argument("--ranks", type=int, default=8, help="ranks per simulated host, as discovery finds them (default 8)")
    parser.add_argument("--loaded-hosts", default="8,64",
                        help="job sizes run again, race mode over plain HTTP, with a busy loop pinned to every CPU ('' for none)")
    parser.add_argument("--sample-ranks", type=int, default=8, help="real ranks of the host whose span bytes are sampled (0: skip)")
    parser.add_argument("--data-root", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--indices", help=argparse.SUPPRESS)
    parser.add_argument("--tls-json", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global PORT, RANKS
    PORT = args.port or _free_port()
    RANKS = args.ranks
    if args.worker:
        anyio.run(_worker, [int(i) for i in args.indices.split(",")], args.n, args.base, json.loads(args.tls_json), args.ranks)
        return 0

    logging.getLogger("servewatch").setLevel(logging.CRITICAL)
    sizes = [int(x) for x in args.hosts.split(",")]
    sample = _host_sample_bytes(args.sample_ranks) if args.sample_ranks else (0, 0)
    print(f"one real host's incident in the job's trace ({args.sample_ranks} real ranks, py-spy): {sample[0]} bytes of OTLP"
          f" protobuf with its action spans inline, {sample[1]} bytes linked (its summary span)\n", flush=True)
    summaries = []
    with tempfile.TemporaryDirectory(prefix="servewatch-bench-fanout-", dir=args.data_root) as tmp:
        base = Path(tmp)
        os.chmod(base, 0o700)
        (base / "token").write_text(TOKEN)
        os.chmod(base / "token", 0o600)
        tls_modes = {"plain": {}, "mtls": _tls_material(base)}
        for tls_name in args.tls.split(","):
            for mode in args.modes.split(","):
                for n in sizes:
                    rows = anyio.run(_measure, n, mode, args.runs, args.workers, base, tls_modes[tls_name])
                    summaries.append(_summary(n, mode, tls_name, rows, sample, args.sample_ranks))
        loaded = [int(x) for x in args.loaded_hosts.split(",") if x]
        if loaded:
            print(f"\nloaded: a busy loop pinned to each of the {len(os.sched_getaffinity(0))} CPUs", flush=True)
            hogs = _hogs()
            try:
                for n in loaded:
                    rows = anyio.run(_measure, n, "race", args.runs, args.workers, base, tls_modes["plain"])
                    summaries.append(_summary(n, "race", "plain", rows, sample, args.sample_ranks, load="loaded"))
            finally:
                kill_groups(hogs, timeout_s=10)
    print()
    for tls_name in args.tls.split(","):
        for mode in args.modes.split(","):
            ms = [s for s in summaries if s["mode"] == mode and s["tls"] == tls_name and s["load"] == "quiet"]
            for prev, cur in itertools.pairwise(ms):
                slope = (cur["spread_ms"] - prev["spread_ms"]) / (cur["n"] - prev["n"])
                cpu_slope = (cur["coordinator_cpu_s"] - prev["coordinator_cpu_s"]) * 1000 / (cur["n"] - prev["n"])
                print(f"{mode} {tls_name}: marginal cost {prev['n']:4d} -> {cur['n']:4d} hosts: capture spread {slope:6.3f} ms"
                      f" and coordinator CPU {cpu_slope:6.3f} ms per added host")
                emit_result(f"fan-out {mode} {tls_name}: capture spread, marginal ms per added host {prev['n']}->{cur['n']}",
                            ours=slope, unit="ms/host", baseline_name="(linear: does not grow with N)")
                emit_result(f"fan-out {mode} {tls_name}: coordinator CPU, marginal ms per added host {prev['n']}->{cur['n']}",
                            ours=cpu_slope, unit="ms/host", baseline_name="(linear: does not grow with N)")
            for s in ms:
                emit_result(f"fan-out {mode} {tls_name}: requests per incident, N={s['n']}", ours=s["requests"], unit="requests",
                            baseline=float(s["n"] * (s["n"] - 1)) if mode == "race" else None,
                            baseline_name="every host fans out: N(N-1)" if mode == "race" else "(target <= 2N)")
                emit_result(f"fan-out {mode} {tls_name}: one trace one root, N={s['n']}", ours=s["ok"], unit=f"of {s['runs']} runs")
                if s["n"] == 64:
                    emit_result(f"fan-out {mode} {tls_name}: capture spread at 64 hosts", ours=s["spread_ms"], unit="ms",
                                baseline_name=f"(target <= {TARGET_SPREAD_MS_AT_64:g} ms)", spread=(min(s["spreads"]), max(s["spreads"])))
                emit_result(f"fan-out {mode} {tls_name}: job trace size, N={s['n']}", ours=s["real_trace_bytes"] / 1e6, unit="MB",
                            baseline=TEMPO_TRACE_LIMIT_BYTES / 1e6, baseline_name="Tempo's default per-trace limit")
    for s in summaries:
        if s["load"] == "loaded":
            emit_result(f"fan-out race plain, every CPU hogged: one trace one root, N={s['n']}", ours=s["ok"], unit=f"of {s['runs']} runs")
            emit_result(f"fan-out race plain, every CPU hogged: detection -> capture start, slowest host, N={s['n']}",
                        ours=s["delay_ms"], unit="ms", baseline=next((q["delay_ms"] for q in summaries if q["load"] == "quiet"
                                                                      and q["n"] == s["n"] and q["mode"] == "race" and q["tls"] == "plain"), None),
                        baseline_name="the same, quiet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
