"""What the fleet adds to a host's capture: the hang-to-first-dump time of each host of a real
3-host job, with ``--job`` (the fleet) and without it (the same agents alone), quiet and loaded.

Three real network-namespace hosts (:mod:`tests.fleet._netns`; root and ``ip netns``), a real
6-rank gloo job across them (``tests/programs/dist_rank.py``, 2 ranks per host), one real
``servewatch run`` per host watching its own two ranks (watchdog 3 s), as in
``tests/fleet/test_netns_job.py``. Rank 3 (host-1) hangs in compute at the first step after the
bench's go; every rank's step stops, so every host's watchdog fires. Per host: from the go to the
start of its first ``pyspy.dump`` (the manifest's ``start_time_unix_nano``): the local capture's
start, whatever the trace is named. ``loaded``: one busy loop pinned to each CPU from before the go.

The baseline, same machine and run: the agents without ``--job`` (nothing to place, report or
join). The figure: the fleet's median minus the baseline's, per load (issue target: <= 0.3 s).

Usage: ``python bench/bench_fleet_capture.py [--runs 2] [--loads quiet,loaded]`` (root, ip netns).
Nothing is asserted; the figures are printed.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import emit_result, kill_groups, loadavg

#: Longest wait for the agents to watch their ranks, then for every host's first dump, seconds.
READY_S = 180.0
CAPTURE_S = 120.0


def _spawner(procs: list[subprocess.Popen[bytes]]):
    def spawn(argv: list[str], **kwargs) -> subprocess.Popen[bytes]:
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, **kwargs)
        procs.append(proc)
        return proc
    return spawn


def _first_dumps_ns(data: Path) -> dict[str, tuple[int, int]]:
    """Each host's earliest ``pyspy.dump`` start and its incident's opening (ns since the epoch),
    from its manifests."""
    first: dict[str, tuple[int, int]] = {}
    for path in data.glob("host-*/*/manifest.json"):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        starts = [a["start_time_unix_nano"] for a in doc.get("actions", ()) if a.get("action") == "pyspy.dump"]
        host = path.parts[-3]
        if starts and (host not in first or min(starts) < first[host][0]):
            first[host] = (min(starts), int(doc["opened_time_unix_nano"]))
    return first


def _watching(hosts, token: Path) -> bool:
    from tests.fleet.test_netns_job import _status

    statuses = [_status(hosts, h, token) for h in range(3)]
    return all(s and len(s["targets"]) == 2 and all(t["step_counter_watched"] for t in s["targets"]) for s in statuses)


def one_run(*, fleet: bool, loaded: bool) -> dict[str, tuple[float, float]]:
    """One job, one hang: seconds from the go to each host's first dump and to its incident's opening."""
    from tests.fleet._fleet import token_file
    from tests.fleet._netns import three_hosts
    from tests.fleet.test_netns_job import _agent, _ranks

    procs: list[subprocess.Popen[bytes]] = []
    spawn = _spawner(procs)
    gen = three_hosts()
    hosts = next(gen)
    try:
        with tempfile.TemporaryDirectory(prefix="sw-fleetcap-") as tmp:
            work = Path(tmp)
            token = token_file(work)
            go = work / "go"
            pids = _ranks(hosts, spawn, work, "hang", 3, go)
            for h in range(3):
                _agent(hosts, h, pids, spawn, work, token, fleet=fleet)
            deadline = time.monotonic() + READY_S
            while not _watching(hosts, token):
                if time.monotonic() > deadline:
                    raise SystemExit("bench_fleet_capture: the agents did not watch their ranks within 180 s")
                time.sleep(0.5)
            if loaded:
                for cpu in sorted(os.sched_getaffinity(0)):
                    spawn([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
                time.sleep(1.0)
            go_ns = time.time_ns()
            go.touch()
            deadline = time.monotonic() + CAPTURE_S
            while len(first := _first_dumps_ns(work / "data")) < 3:
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench_fleet_capture: only {sorted(first)} captured within {CAPTURE_S:.0f} s")
                time.sleep(0.25)
            return {h: ((dump - go_ns) / 1e9, (opened - go_ns) / 1e9) for h, (dump, opened) in sorted(first.items())}
    finally:
        kill_groups(procs, timeout_s=30)
        gen.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="jobs per mode and load (default 2)")
    ap.add_argument("--loads", default="quiet,loaded", help="quiet, loaded or both (default both)")
    args = ap.parse_args()
    from tests.fleet._netns import netns_available

    if not netns_available():
        print("bench_fleet_capture: needs root and ip netns (real network namespaces)", file=sys.stderr)
        return 2
    print(f"{'load':<7} {'mode':<9} {'run':>3}  go -> first dump (go -> incident open) per host, s              load1")
    for load in [x for x in args.loads.split(",") if x]:
        medians: dict[bool, float] = {}
        for fleet in (False, True):
            seconds: list[float] = []
            for run in range(args.runs):
                per_host = one_run(fleet=fleet, loaded=load == "loaded")
                seconds += [dump for dump, _ in per_host.values()]
                hosts = "  ".join(f"{h} {dump:6.3f} ({opened:5.3f})" for h, (dump, opened) in per_host.items())
                print(f"{load:<7} {'fleet' if fleet else 'alone':<9} {run + 1:>3}  {hosts}  {loadavg()[0]:.1f}", flush=True)
            medians[fleet] = statistics.median(seconds)
        added = medians[True] - medians[False]
        print(f"{load:<7} median: alone {medians[False]:.3f} s, fleet {medians[True]:.3f} s: the fleet adds {added * 1000:+.0f} ms"
              f" (target <= +300 ms)")
        emit_result(f"fleet capture start, {load}: go -> first dump, median of 3 hosts x {args.runs} runs", ours=medians[True],
                    baseline=medians[False], baseline_name="the same agents without --job", unit="s",
                    note=f"the fleet adds {added * 1000:+.0f} ms (target <= +300 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
