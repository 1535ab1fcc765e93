"""Stack capture: servewatch's concurrent py-spy dumps against a sequential baseline, in one run.

For K = 1, 4, 8 (``--k``) titled Python processes that have imported torch and idle in a named
function (tests/programs/titled_target.py), measures:

* sequential: one process at a time, ``py-spy dump --json --native --pid N`` and, if that fails,
  the same without ``--native`` (what SGLang's crash-dump helper does), each bounded by a
  timeout;
* servewatch: :meth:`PySpyActor.dump_all` from the call (the trigger) until every stack is parsed
  and written, with the default config (``max_concurrency`` = max(8, 2 x CPUs)).

Each is run ``--repeat`` times (default 9) in back-to-back pairs, alternating which of the two
goes first, after one warm-up dump of every process. The table shows the median times, the median of the per-pair
ratios servewatch / sequential (pairs run back to back, so load from other work on the machine
hits both alike; target at K=8 on 2 cores: <= 0.55x, about the 2-core limit) and the slowest single
dump (what servewatch approaches when cores >= K), and the CPU floor: py-spy's CPU seconds in one
servewatch round divided by the CPU count.
Printed, not asserted. Every process it starts is killed on exit (try/finally).

    python bench/bench_stacks.py [--k 1 4 8] [--repeat 9] [--concurrency N]
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from _common import emit_result, kill_groups, run_timed

from agent.actors.pyspy import PySpyActor, PySpyConfig, default_executable
from agent.host.targets import Target, discover
from agent.model.events import IncidentOpened, Outcome

ROOT = Path(__file__).resolve().parent.parent
TITLED = ROOT / "tests" / "programs" / "titled_target.py"
READY_TIMEOUT_S = 180.0


def start_targets(k: int, procs: list[subprocess.Popen[bytes]]) -> list[Target]:
    """Start k torch-importing titled targets (appended to ``procs`` at once) and wait for ready."""
    tag = f"{os.getpid()}"
    started = []
    for i in range(k):
        proc = subprocess.Popen(
            [sys.executable, str(TITLED), f"bench::scheduler_TP{i}_{tag}", "--torch", "--max-lifetime-s", "900"],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        procs.append(proc)
        started.append(proc)
    deadline = time.monotonic() + READY_TIMEOUT_S
    for proc in started:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if readable else b""  # "ready <pid>" once torch is imported
        proc.stdout.close()
        if not line.startswith(b"ready"):
            raise RuntimeError(f"target {proc.pid} did not start within {READY_TIMEOUT_S} s: {line!r}")
    targets = discover(title_globs=[f"bench::scheduler_TP*_{tag}"])
    if len(targets) != k:
        raise RuntimeError(f"found {len(targets)} of {k} targets")
    return targets


def sequential_dump(exe: str, pid: int, timeout_s: float) -> float:
    """One dump the SGLang way: --native, then plain on failure; returns seconds taken (each
    attempt timed exactly: :func:`_common.run_timed`, no polling wait)."""
    total = 0.0
    for extra in (["--native"], []):
        argv = [exe, "dump", "--json", "--pid", str(pid), *extra]
        try:
            done = run_timed(argv, timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            total += timeout_s
            continue
        total += done.wall_s
        if done.returncode == 0:
            return total
    raise RuntimeError(f"sequential dump of {pid} failed")


def sequential(exe: str, targets: list[Target], timeout_s: float) -> tuple[float, float]:
    """All targets one after the other; returns (total seconds, slowest single dump seconds)."""
    t0 = time.perf_counter()
    singles = [sequential_dump(exe, t.pid, timeout_s) for t in targets]
    return time.perf_counter() - t0, max(singles)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def servewatch(actor: PySpyActor, targets: list[Target], artifact_dir: Path) -> tuple[float, float]:
    """dump_all from trigger to all stacks parsed and written; returns (seconds, py-spy CPU
    seconds)."""
    trigger = IncidentOpened(incident_id="bench", trigger="manual")

    async def run() -> float:
        t0 = time.perf_counter()
        results = await actor.dump_all(trigger, targets, artifact_dir=artifact_dir)
        elapsed = time.perf_counter() - t0
        bad = [r for r in results if r.outcome is not Outcome.OK]
        if bad:
            raise RuntimeError(f"servewatch dump failed: {bad[0].detail}")
        return elapsed

    cpu0 = _children_cpu_s()
    elapsed = anyio.run(run)
    return elapsed, _children_cpu_s() - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 8], help="process counts")
    ap.add_argument("--repeat", type=int, default=9, help="timed runs of each method per K")
    ap.add_argument("--concurrency", type=int, default=None, help="PySpyConfig.max_concurrency (default: CPUs)")
    args = ap.parse_args()

    exe = default_executable()
    if exe is None:
        sys.exit("py-spy not found: pip install py-spy")
    config = PySpyConfig() if args.concurrency is None else PySpyConfig(max_concurrency=args.concurrency)
    actor = PySpyActor(config)
    cpus = os.cpu_count() or 1
    print(f"py-spy {exe}; {cpus} CPUs; max_concurrency={config.max_concurrency}; repeat={args.repeat}", file=sys.stderr)

    rows = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-stacks-") as tmp:
            for k in args.k:
                print(f"K={k}: starting {k} torch targets...", file=sys.stderr)
                targets = start_targets(k, procs)
                sequential(exe, targets, config.timeout_s)  # warm-up: page cache, symbol files
                seq_s, ours_s, slowest_s, ratios, cpu_s = [], [], [], [], []
                for i in range(args.repeat):
                    if i % 2:  # alternate which goes first
                        ours, cpu = servewatch(actor, targets, Path(tmp) / f"k{k}-{i}")
                        total, slowest = sequential(exe, targets, config.timeout_s)
                    else:
                        total, slowest = sequential(exe, targets, config.timeout_s)
                        ours, cpu = servewatch(actor, targets, Path(tmp) / f"k{k}-{i}")
                    seq_s.append(total)
                    slowest_s.append(slowest)
                    ours_s.append(ours)
                    ratios.append(ours / total)
                    cpu_s.append(cpu)
                emit_result(f"all stacks of K={k} torch processes, wall", ours=statistics.median(ours_s),
                            baseline=statistics.median(seq_s), unit="s",
                            baseline_name="sequential `py-spy dump --json --native` (SGLang's crash-dump helper's order)",
                            ratio=statistics.median(ratios), spread=(min(ratios), max(ratios)),
                            note=f"{args.repeat} pairs; CPU floor {statistics.median(cpu_s) / cpus:.3f} s" + ("; target <= 0.55x" if k == 8 else ""))
                rows.append(
                    (
                        k,
                        statistics.median(seq_s),
                        statistics.median(ours_s),
                        statistics.median(ratios),
                        statistics.median(slowest_s),
                        statistics.median(cpu_s) / cpus,
                    )
                )
                for proc in procs:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
                procs.clear()
    finally:
        kill_groups(procs, timeout_s=30)

    print(f"{'K':>3} {'sequential_s':>13} {'servewatch_s':>13} {'ratio':>7} {'slowest_single_s':>17} {'cpu_floor_s':>12}")
    for k, seq, ours, ratio, slowest, floor in rows:
        print(f"{k:>3} {seq:>13.3f} {ours:>13.3f} {ratio:>6.2f}x {slowest:>17.3f} {floor:>12.3f}")
    print("cpu_floor_s: py-spy CPU time of one servewatch round / CPUs (no schedule can beat it)")
    print(f"target: ratio at K=8 <= 0.55x on 2 CPUs (this machine: {cpus} CPUs)")


if __name__ == "__main__":
    main()
