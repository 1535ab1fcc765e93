"""Cold start of each `servewatch` command, and whole-process `servewatch dump` against py-spy.

Part 1: wall time of fresh processes: ``python -c pass`` (the floor), ``servewatch --help``,
``--version``, ``dump --help``, ``timeline --help``, ``cuda-env`` (prints its exports), ``status --help``,
interleaved over ``--repeat`` rounds; median and min per command. Target: ``--help`` <= 0.2 s.

Part 2: K = 1, 4, 8 torch-loaded target processes (``tests/programs/titled_target.py --torch``,
hung in a fake all-reduce). Per round, in alternating order: the SEQUENTIAL baseline (one
``py-spy dump --native --pid P`` after the other, what SGLang's in-process helper costs per
process) and ONE ``servewatch dump --pid ...`` of all K (start, discovery, parallel dumps,
bundle, spans, exit). Medians over ``--repeat`` rounds and the ratio servewatch / baseline.
Targets: <= 2x at K=1, <= 0.6x at K=8. A third side, in the same rounds, is the same dump with
the early py-spy runs off (``--config`` of an empty file: no setting changes, but only the plain
``dump --pid`` form starts py-spy before the imports, see agent/early.py). With K=1, part 3: the
import floor, a fresh interpreter importing only the third-party libraries a dump is built on
(:data:`FLOOR_IMPORTS`), against one py-spy dump in the same rounds.

Commands run with bytecode caching on (PYTHONDONTWRITEBYTECODE removed) after one warm-up run,
as an installed servewatch starts; without it every project module is recompiled per start.

The machine may be shared: every ratio compares runs of the same round; the spread (min..max
of the per-round ratios) is printed with it, and so are the median CPU seconds (user + system,
py-spy's included) of both sides, which the load moves much less than wall time.

Usage: ``python bench/bench_cli_start.py [--repeat 5] [--ks 1,4,8]``
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _common import kill_groups

TARGET = REPO / "tests" / "programs" / "titled_target.py"


def servewatch() -> list[str]:
    exe = Path(sys.executable).parent / "servewatch"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "agent.cli"]


def pyspy() -> str:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else (shutil.which("py-spy") or "py-spy")


#: Every timed command runs with bytecode caching on, as an installed servewatch does (pip writes
#: the .pyc files at install time); a PYTHONDONTWRITEBYTECODE=1 environment (e.g. CI sandboxes)
#: would otherwise recompile every project module on each start and measure the compiler.
BASE_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE" and not k.startswith("OTEL_EXPORTER_OTLP")}


def timed(argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 120.0) -> tuple[float, int]:
    """Run ``argv`` to its end: (wall seconds, exit code). CPU seconds of it and its children
    are added to :data:`CPU_S` under ``argv[0]``'s run (see :func:`cpu_of`)."""
    env = BASE_ENV if env is None else env
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env=env, timeout=timeout_s, check=False)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    global LAST_CPU_S
    LAST_CPU_S = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return dt, proc.returncode


#: CPU seconds (user + system, the process and the children it waited for) of the last
#: :func:`timed` run. On a shared machine wall time swings with the load; CPU time much less, so
#: the dump comparison prints both.
LAST_CPU_S = 0.0


def start_targets(k: int) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(k):
        procs.append(subprocess.Popen(
            [sys.executable, str(TARGET), f"bench::scheduler_TP{i}", "--torch", "--max-lifetime-s", "900"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        ))  # fmt: skip
    for p in procs:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 120)
        if not ready or not p.stdout.readline().startswith(b"ready"):
            kill_groups(procs, timeout_s=10)
            raise SystemExit("target did not start")
    return procs


def part1(repeat: int, work: Path) -> None:
    sw = servewatch()
    cmds = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "servewatch --help": [*sw, "--help"],
        "servewatch --version": [*sw, "--version"],
        "servewatch dump --help": [*sw, "dump", "--help"],
        "servewatch timeline --help": [*sw, "timeline", "--help"],
        "servewatch status --help": [*sw, "status", "--help"],
        "servewatch cuda-env": [*sw, "cuda-env", "--folder", str(work / "cores")],
    }
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for argv in cmds.values():  # warm-up: the .pyc files exist, as after an install
        timed(argv)
    for _ in range(repeat):
        for name, argv in cmds.items():
            dt, rc = timed(argv)
            if rc != 0:
                raise SystemExit(f"{name} exited {rc}")
            times[name].append(dt)
    print(f"cold start, {repeat} rounds (median / min seconds):")
    for name, ts in times.items():
        print(f"  {name:28s} {statistics.median(ts):6.3f} / {min(ts):6.3f}")


def _baseline(spy: str, pids: list[int]) -> tuple[float, float]:
    """Sequential `py-spy dump --native` of every pid: (total wall seconds, total CPU seconds)."""
    total, cpu = 0.0, 0.0
    for pid in pids:
        dt, rc = timed([spy, "dump", "--native", "--pid", str(pid)])
        if rc != 0:
            raise SystemExit(f"py-spy dump exited {rc}")
        total += dt
        cpu += LAST_CPU_S
    return total, cpu


def _whole(sw: list[str], pids: list[int], data: Path, *extra: str) -> tuple[float, float]:
    """One `servewatch dump` of every pid, whole process: (wall seconds, CPU seconds with py-spy's)."""
    argv = [*sw, "dump", "--data-dir", str(data), *extra] + [a for pid in pids for a in ("--pid", str(pid))]
    dt, rc = timed(argv)
    if rc != 0:
        raise SystemExit(f"servewatch dump exited {rc}")
    return dt, LAST_CPU_S


#: The third-party libraries every `servewatch dump` needs (CLI parsing, settings, the span
#: pipeline to OTLP/JSON files, the event loop, process scans): importing them alone, in a fresh
#: interpreter, is the floor under any dump built on them (see part 2's K=1 target).
FLOOR_IMPORTS = ("typer, typer._adapters, pydantic_settings, anyio, psutil, opentelemetry.sdk.trace,"
                 " google.protobuf.json_format, opentelemetry.proto.collector.trace.v1.trace_service_pb2")


def _floor(repeat: int, pid: int) -> None:
    """Part 3: the import floor against one `py-spy dump --native`, interleaved, same run."""
    spy = pyspy()
    floor, base, floor_cpu = [], [], []
    timed([sys.executable, "-c", f"import {FLOOR_IMPORTS}"])  # warm-up
    for _ in range(repeat):
        dt, rc = timed([sys.executable, "-c", f"import {FLOOR_IMPORTS}"])
        if rc != 0:
            raise SystemExit("the floor imports failed")
        floor.append(dt)
        floor_cpu.append(LAST_CPU_S)
        base.append(_baseline(spy, [pid])[0])
    ratios = [f / b for f, b in zip(floor, base)]
    print(f"import floor (python + {FLOOR_IMPORTS.count(',') + 1} libraries, no servewatch code):"
          f" {statistics.median(floor):6.3f} s (CPU {statistics.median(floor_cpu):.3f} s),"
          f" {statistics.median(ratios):.2f}x one `py-spy dump --native` ({statistics.median(base):.3f} s)")


def part2(ks: list[int], repeat: int, work: Path) -> None:
    sw, spy = servewatch(), pyspy()
    # `--config EMPTY` changes no setting but turns the early py-spy runs off (agent.early starts
    # them only for the plain `dump --pid` form): the same dump, py-spy started after the imports
    empty = work / "empty.toml"
    empty.write_text("")
    print(f"whole-process dump vs sequential `py-spy dump --native`, {repeat} rounds (medians);"
          " 'late': the same dump with the early py-spy runs off")
    for k in ks:
        procs = start_targets(k)
        try:
            pids = [p.pid for p in procs]
            runs: dict[str, list[tuple[float, float]]] = {"base": [], "ours": [], "late": []}
            _whole(sw, pids, work / f"warm-{k}")  # warm-up (bytecode of the dump path, page cache)
            _whole(sw, pids, work / f"warm-late-{k}", "--config", str(empty))
            sides = {
                "base": lambda _r, pids=pids: _baseline(spy, pids),
                "ours": lambda r, pids=pids, k=k: _whole(sw, pids, work / f"data-{k}-{r}"),
                "late": lambda r, pids=pids, k=k: _whole(sw, pids, work / f"late-{k}-{r}", "--config", str(empty)),
            }
            order = list(sides)
            for r in range(repeat):
                for name in order[r % 3:] + order[: r % 3]:  # rotate who goes first each round
                    runs[name].append(sides[name](r))
            base = [b for b, _ in runs["base"]]
            for name, label in (("ours", "servewatch dump"), ("late", "  (no early py-spy)")):
                ratios = [o / b for (o, _), b in zip(runs[name], base)]
                print(f"  K={k}: {label} {statistics.median(o for o, _ in runs[name]):6.3f} s,"
                      f" sequential py-spy {statistics.median(base):6.3f} s,"
                      f" ratio {statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}..{max(ratios):.2f});"
                      f" CPU {statistics.median(c for _, c in runs[name]):.3f} s vs {statistics.median(c for _, c in runs['base']):.3f} s")
            if k == 1:
                _floor(repeat, pids[0])
        finally:
            kill_groups(procs, timeout_s=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ks", default="1,4,8")
    ap.add_argument("--skip-dump", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="servewatch-clistart-"))
    os.chmod(work, 0o700)
    try:
        part1(args.repeat, work)
        if not args.skip_dump:
            part2([int(x) for x in args.ks.split(",")], args.repeat, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
