"""Cold start of each `servewatch` command, and whole-process `servewatch dump` against py-spy.

Part 1: wall time of fresh processes: ``python -c pass`` (the floor), ``servewatch --help``,
``--version``, ``dump --help``, ``timeline --help``, ``cuda-env`` (prints its exports), ``status --help``
and the read-only commands on a real bundle (one ``servewatch dump`` of a hung target, made first)
and a status file: ``status`` (and ``--json``), ``timeline`` (and ``--json``), ``report``,
``export --dry-run --to URL`` (reads the span files, connects to nothing);
interleaved over ``--repeat`` rounds; median and min per command, and the median of the per-round
ratios to ``python -c pass``. Targets: ``--help`` <= 0.2 s; each read-only command <= 3x
``python -c pass`` + 0.1 s (issue 38; the goal line is printed with the load average). With
``--baseline-tree DIR`` (a source tree of an earlier commit, e.g. ``git archive REV agent exporters``)
the read-only commands of that tree run in the same rounds (``[baseline]`` rows).

Part 2: K = 1, 4, 8 torch-loaded target processes (``tests/programs/titled_target.py --torch``,
hung in a fake all-reduce). Per round, in alternating order: the SEQUENTIAL baseline (one
``py-spy dump --native --pid P`` after the other, what SGLang's in-process helper costs per
process) and ONE ``servewatch dump --pid ...`` of all K (start, discovery, parallel dumps,
bundle, spans, exit). Medians over ``--repeat`` rounds and the ratio servewatch / baseline.
Targets: <= 2x at K=1, <= 0.6x at K=8. A third side, in the same rounds, is the same dump with
the early py-spy runs off (``--config`` of an empty file: no setting changes, but only the plain
``dump --pid`` form starts py-spy before the imports, see agent/early.py). With K=1, part 3: a
fourth side, the import floor (a fresh interpreter importing only the third-party libraries a
dump is built on, :data:`FLOOR_IMPORTS`); the K=1 dump is compared with the floor plus one
py-spy dump of the same round (target: at most 1x).

Every child is timed exactly (:func:`_common.run_timed`: its exit is awaited on a pidfd and
reaped with ``wait4``, whose rusage gives its CPU seconds, its reaped children's included).
``subprocess.run(timeout=...)`` would poll for the exit at 0.5 ms doubling up to 50 ms and round
every figure up to the next poll, K times on the sequential side.

Commands run with bytecode caching on (PYTHONDONTWRITEBYTECODE removed) after one warm-up run,
as an installed servewatch starts; without it every project module is recompiled per start.

The machine may be shared: every ratio compares runs of the same round; the spread (min..max
of the per-round ratios) is printed with it, and so are the median CPU seconds (user + system,
py-spy's included) of both sides, which the load moves much less than wall time.

Usage: ``python bench/bench_cli_start.py [--repeat 5] [--ks 1,4,8] [--skip-dump] [--skip-read-only] [--baseline-tree DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
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

from _common import RESULTS_ENV, emit_result, kill_groups, loadavg, run_timed

TARGET = REPO / "tests" / "programs" / "titled_target.py"


def servewatch() -> list[str]:
    exe = Path(sys.executable).parent / "servewatch"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "agent.cli.app"]


def pyspy() -> str:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else (shutil.which("py-spy") or "py-spy")


#: Every timed command runs with bytecode caching on, as an installed servewatch does (pip writes
#: the .pyc files at install time); a PYTHONDONTWRITEBYTECODE=1 environment (e.g. CI sandboxes)
#: would otherwise recompile every project module on each start and measure the compiler.
#: run_all.py's own SERVEWATCH_BENCH_RESULTS is left out too: the commands would warn about an
#: unknown SERVEWATCH_* variable (loading the settings model to name it) and time that.
BASE_ENV = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONDONTWRITEBYTECODE", RESULTS_ENV) and not k.startswith("OTEL_EXPORTER_OTLP")}


def timed(argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 120.0) -> tuple[float, int]:
    """Run ``argv`` to its end, timed exactly (:func:`_common.run_timed`: the exit is awaited on
    a pidfd, not polled): (wall seconds, exit code). Its CPU seconds, its reaped children's
    included, are left in :data:`LAST_CPU_S`."""
    global LAST_CPU_S
    run = run_timed(argv, env=BASE_ENV if env is None else env, timeout_s=timeout_s)
    LAST_CPU_S = run.cpu_s
    return run.wall_s, run.returncode


#: CPU seconds (user + system, the process and the children it waited for) of the last
#: :func:`timed` run. On a shared machine wall time swings with the load; CPU time much less, so
#: the dump comparison prints both.
LAST_CPU_S = 0.0


def start_targets(k: int, *, torch: bool = True) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(k):
        procs.append(subprocess.Popen(
            [sys.executable, str(TARGET), f"bench::scheduler_TP{i}", *(["--torch"] if torch else []), "--max-lifetime-s", "900"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        ))  # fmt: skip
    for p in procs:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 120)
        if not ready or not p.stdout.readline().startswith(b"ready"):
            kill_groups(procs, timeout_s=10)
            raise SystemExit("target did not start")
    return procs


def _read_only_data(work: Path) -> tuple[Path, str]:
    """A data dir for the read-only commands: one real bundle (a ``servewatch dump`` of a hung
    target: py-spy stacks, manifest, span file) and a status file: (data dir, incident id)."""
    data = work / "ro-data"
    (proc,) = start_targets(1, torch=False)
    try:
        _, rc = timed([*servewatch(), "dump", "--pid", str(proc.pid), "--data-dir", str(data)])
        if rc != 0:
            raise SystemExit(f"servewatch dump (read-only data) exited {rc}")
    finally:
        kill_groups([proc], timeout_s=10)
    (host_dir,) = [d for d in data.iterdir() if d.is_dir()]
    (bundle,) = [d for d in host_dir.iterdir() if (d / "manifest.json").is_file()]
    (host_dir / "status.json").write_text(json.dumps({  # this bench's pid: an agent that is running
        "schema": "servewatch.status/1", "host.name": host_dir.name, "agent_pid": os.getpid(),
        "updated_time_unix_nano": time.time_ns(), "watchers": []}))
    return data, bundle.name


#: Read-only commands and their goal: each at most 3x `python -c pass` + 0.1 s (issue 38).
READ_ONLY = ("servewatch --help", "servewatch --version", "servewatch status", "servewatch status --json",
             "servewatch timeline", "servewatch timeline --json", "servewatch report", "servewatch export --dry-run")


def part1(repeat: int, work: Path, baseline_tree: Path | None = None) -> None:
    sw = servewatch()
    data, incident = _read_only_data(work)
    dd = ["--data-dir", str(data)]
    cmds = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "servewatch --help": [*sw, "--help"],
        "servewatch --version": [*sw, "--version"],
        "servewatch dump --help": [*sw, "dump", "--help"],
        "servewatch timeline --help": [*sw, "timeline", "--help"],
        "servewatch status --help": [*sw, "status", "--help"],
        "servewatch cuda-env": [*sw, "cuda-env", "--folder", str(work / "cores")],
        "servewatch status": [*sw, "status", *dd],
        "servewatch status --json": [*sw, "status", "--json", *dd],
        "servewatch timeline": [*sw, "timeline", "latest", *dd],
        "servewatch timeline --json": [*sw, "timeline", incident, "--json", *dd],
        "servewatch report": [*sw, "report", incident, "-o", str(work / "report.html"), *dd],
        # connects to nothing, writes nothing: says what the bundle's span file would send
        "servewatch export --dry-run": [*sw, "export", "--dry-run", "--to", "http://127.0.0.1:4317", *dd],
    }
    envs: dict[str, dict[str, str]] = {name: BASE_ENV for name in cmds}
    if baseline_tree is not None:  # the same commands run from another source tree, same rounds
        old_env = {**BASE_ENV, "PYTHONPATH": str(baseline_tree)}
        for name in READ_ONLY:
            cmds[f"{name} [baseline]"] = [sys.executable, "-P", "-c", "from agent.cli.entry import main; main()", *cmds[name][len(sw):]]
            envs[f"{name} [baseline]"] = old_env
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for name, argv in cmds.items():  # warm-up: the .pyc files exist, as after an install
        timed(argv, envs[name])
    for _ in range(repeat):
        for name, argv in cmds.items():
            dt, rc = timed(argv, envs[name])
            if rc not in (0, 1) or (rc == 1 and "status" not in name):  # status: 1 when a watcher is blind
                raise SystemExit(f"{name} exited {rc}")
            times[name].append(dt)
    load = loadavg()
    base = times["python -c pass"]
    print(f"cold start, {repeat} rounds (median / min seconds; ratio: median of per-round ratios to `python -c pass`);"
          f" load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}:")
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        print(f"  {name:40s} {statistics.median(ts):6.3f} / {min(ts):6.3f}  {statistics.median(ratios):5.2f}x")
    goal = 3 * statistics.median(base) + 0.1
    print(f"read-only commands: goal <= 3x `python -c pass` + 0.1 s = {goal:.3f} s (median of {repeat}, this run):")
    for name in READ_ONLY:
        median = statistics.median(times[name])
        was = times.get(f"{name} [baseline]")
        then = f"; baseline tree {statistics.median(was):6.3f} s" if was else ""
        print(f"  {name:28s} {median:6.3f} s  {'ok  ' if median <= goal else 'OVER'}{then}")
    for name in ("servewatch --help", "servewatch cuda-env", *READ_ONLY[1:]):
        ratios = [t / b for t, b in zip(times[name], base)]
        note = f"{repeat} rounds; load {load[0]:.1f}"
        if name.endswith("--help"):
            note += "; target <= 0.2 s"
        elif name in READ_ONLY:
            note += f"; goal <= 3x + 0.1 s = {goal:.3f} s"
        emit_result(f"`{name}`, wall", ours=statistics.median(times[name]), baseline=statistics.median(base), unit="s",
                    baseline_name="`python -c pass` (the interpreter's own start)", ratio=statistics.median(ratios),
                    spread=_spread(ratios), note=note)


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


def _whole(sw: list[str], pids: list[int], data: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[float, float]:
    """One `servewatch dump` of every pid, whole process: (wall seconds, CPU seconds with py-spy's)."""
    argv = [*sw, "dump", "--data-dir", str(data), *extra] + [a for pid in pids for a in ("--pid", str(pid))]
    dt, rc = timed(argv, env)
    if rc != 0:
        raise SystemExit(f"servewatch dump exited {rc}")
    return dt, LAST_CPU_S


#: The third-party libraries every `servewatch dump` needs (CLI parsing, settings, the span
#: pipeline to OTLP/JSON files, the event loop, process scans): importing them alone, in a fresh
#: interpreter, is the floor under any dump built on them (see part 2's K=1 target).
FLOOR_IMPORTS = ("typer, typer._adapters, pydantic_settings, anyio, psutil, opentelemetry.sdk.trace,"
                 " google.protobuf.json_format, opentelemetry.proto.collector.trace.v1.trace_service_pb2")


def _floor_once() -> tuple[float, float]:
    """One fresh interpreter importing :data:`FLOOR_IMPORTS`: (wall seconds, CPU seconds)."""
    dt, rc = timed([sys.executable, "-c", f"import {FLOOR_IMPORTS}"])
    if rc != 0:
        raise SystemExit("the floor imports failed")
    return dt, LAST_CPU_S


def _spread(ratios: list[float]) -> tuple[float, float]:
    return min(ratios), max(ratios)


def _tree_servewatch(tree: Path) -> tuple[list[str], dict[str, str]]:
    """The console entry of the source tree ``tree`` (``-P``: not the current folder's), and its env."""
    return [sys.executable, "-P", "-c", "from agent.cli.entry import main; main()"], {**BASE_ENV, "PYTHONPATH": str(tree)}


def part2(ks: list[int], repeat: int, work: Path, baseline_tree: Path | None = None) -> None:
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
            runs: dict[str, list[tuple[float, float]]] = {"base": [], "ours": [], "late": [], "floor": [], "then": []}
            _whole(sw, pids, work / f"warm-{k}")  # warm-up (bytecode of the dump path, page cache)
            _whole(sw, pids, work / f"warm-late-{k}", "--config", str(empty))
            _floor_once()
            sides = {
                "base": lambda _r, pids=pids: _baseline(spy, pids),
                "ours": lambda r, pids=pids, k=k: _whole(sw, pids, work / f"data-{k}-{r}"),
                "late": lambda r, pids=pids, k=k: _whole(sw, pids, work / f"late-{k}-{r}", "--config", str(empty)),
                "floor": lambda _r: _floor_once(),
            }
            if baseline_tree is not None and k == 1:  # the dump of an earlier tree, same rounds
                then_sw, then_env = _tree_servewatch(baseline_tree)
                _whole(then_sw, pids, work / f"warm-then-{k}", env=then_env)
                sides["then"] = lambda r, pids=pids, k=k, tsw=then_sw, tenv=then_env: _whole(tsw, pids, work / f"then-{k}-{r}", env=tenv)
            order = list(sides) if k == 1 else ["base", "ours", "late"]
            for r in range(repeat):
                for name in order[r % len(order):] + order[: r % len(order)]:  # rotate who goes first each round
                    runs[name].append(sides[name](r))
            base = [b for b, _ in runs["base"]]
            base_cpu = [c for _, c in runs["base"]]
            for name, label in (("ours", "servewatch dump"), ("late", "  (no early py-spy)")):
                ratios = [o / b for (o, _), b in zip(runs[name], base)]
                cpu_ratios = [o / b for (_, o), b in zip(runs[name], base_cpu)]
                wall = statistics.median(o for o, _ in runs[name])
                cpu = statistics.median(c for _, c in runs[name])
                print(f"  K={k}: {label} {wall:6.3f} s,"
                      f" sequential py-spy {statistics.median(base):6.3f} s,"
                      f" ratio {statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}..{max(ratios):.2f});"
                      f" CPU {cpu:.3f} s vs {statistics.median(base_cpu):.3f} s ({statistics.median(cpu_ratios):.2f}x)")
                if name == "ours":
                    baseline_name = f"{k} sequential `py-spy dump --native` (SGLang's crash helper)"
                    emit_result(f"dump of K={k} torch processes, wall", ours=wall, baseline=statistics.median(base), unit="s",
                                baseline_name=baseline_name, ratio=statistics.median(ratios), spread=_spread(ratios),
                                note=f"{repeat} rounds, exact child timing")
                    emit_result(f"dump of K={k} torch processes, CPU (user+sys, py-spy included)", ours=cpu,
                                baseline=statistics.median(base_cpu), unit="s", baseline_name=baseline_name,
                                ratio=statistics.median(cpu_ratios), spread=_spread(cpu_ratios), note=f"{repeat} rounds")
            if k == 1:
                _report_floor(runs, repeat)
        finally:
            kill_groups(procs, timeout_s=10)


def _report_floor(runs: dict[str, list[tuple[float, float]]], repeat: int) -> None:
    """Part 3: the K=1 dump against the import floor plus one py-spy dump, same rounds."""
    floor = [f for f, _ in runs["floor"]]
    floor_cpu = [c for _, c in runs["floor"]]
    floor_plus = [f + b for (f, _), (b, _) in zip(runs["floor"], runs["base"])]
    floor_plus_cpu = [f + b for (_, f), (_, b) in zip(runs["floor"], runs["base"])]
    ratios = [o / fp for (o, _), fp in zip(runs["ours"], floor_plus)]
    cpu_ratios = [o / fp for (_, o), fp in zip(runs["ours"], floor_plus_cpu)]
    n_libs = FLOOR_IMPORTS.count(",") + 1
    print(f"import floor (python + {n_libs} libraries, no servewatch code): {statistics.median(floor):6.3f} s"
          f" (CPU {statistics.median(floor_cpu):.3f} s); + one py-spy dump: {statistics.median(floor_plus):.3f} s"
          f" (CPU {statistics.median(floor_plus_cpu):.3f} s)")
    print(f"  K=1 dump / (floor + one py-spy dump): wall {statistics.median(ratios):.2f}x"
          f" (rounds {min(ratios):.2f}..{max(ratios):.2f}), CPU {statistics.median(cpu_ratios):.2f}x"
          f" (rounds {min(cpu_ratios):.2f}..{max(cpu_ratios):.2f})")
    if runs["then"]:
        then_ratios = [t / fp for (t, _), fp in zip(runs["then"], floor_plus)]
        print(f"  baseline tree's K=1 dump: {statistics.median(t for t, _ in runs['then']):6.3f} s"
              f" (CPU {statistics.median(c for _, c in runs['then']):.3f} s), / (floor + one py-spy dump):"
              f" {statistics.median(then_ratios):.2f}x (rounds {min(then_ratios):.2f}..{max(then_ratios):.2f})")
    load = loadavg()
    print(f"  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    name = f"import floor ({n_libs} libraries, fresh python) + one `py-spy dump --native`"
    emit_result("dump of 1 torch process vs import floor + one py-spy dump, wall", ours=statistics.median(o for o, _ in runs["ours"]),
                baseline=statistics.median(floor_plus), unit="s", baseline_name=name, ratio=statistics.median(ratios),
                spread=_spread(ratios), note=f"{repeat} rounds; target <= 1x")
    emit_result("dump of 1 torch process vs import floor + one py-spy dump, CPU", ours=statistics.median(c for _, c in runs["ours"]),
                baseline=statistics.median(floor_plus_cpu), unit="s", baseline_name=name, ratio=statistics.median(cpu_ratios),
                spread=_spread(cpu_ratios), note=f"{repeat} rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ks", default="1,4,8")
    ap.add_argument("--skip-dump", action="store_true")
    ap.add_argument("--skip-read-only", action="store_true", help="skip part 1 (help, --version, the read-only commands)")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="a source tree of servewatch (e.g. `git archive` of an earlier commit): its read-only commands"
                         " and its K=1 dump run in the same rounds, for a before/after in one run")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="servewatch-clistart-"))
    os.chmod(work, 0o700)
    try:
        if not args.skip_read_only:
            part1(args.repeat, work, args.baseline_tree)
        if not args.skip_dump:
            part2([int(x) for x in args.ks.split(",")], args.repeat, work, args.baseline_tree)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
