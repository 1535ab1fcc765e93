"""CUDA coredump triggering: incident open -> every armed pid triggered, servewatch vs SGLang.

For K = 1 and 8 (``--k``) fake-CUDA-driver targets (tests/programs/fake_cuda_driver.py: a real
FIFO held open by a real Python process that writes a core file gradually on a trigger), each
repetition opens an incident and measures, with the wall clock:

* servewatch, for real: the incident's py-spy dumps (:meth:`PySpyActor.dump_all`, as the lead's
  incident runs them), then :meth:`CoredumpActor.trigger_all` called the moment they finish.
  "triggered" is the latest trigger write time the results record; "complete" is when every
  core file was found and had stopped growing.
* SGLang's path, modelled as documented rather than slept through: it sleeps 5 s before the
  dumps (``SGLANG_PYSPY_DUMP_BEFORE_CRASH`` path) and waits a fixed
  ``SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS`` = 60 s after triggering. Its open->triggered is
  taken as 5 s + the same dumps' measured duration + our measured trigger time (generous to it),
  and its open->done as that + 60 s.

Prints medians per K and the ratios ours / SGLang's. Printed, not asserted. Every process it
starts is killed on exit (try/finally).

    python bench/bench_coredump.py [--k 1 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from _common import kill_groups

from agent.actors.coredump import CoredumpActor, CoredumpConfig
from agent.actors.pyspy import PySpyActor
from agent.cudaenv import cuda_coredump_env
from agent.events import IncidentOpened, Outcome, now_ns
from agent.targets import Target

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "programs" / "fake_cuda_driver.py"
READY_TIMEOUT_S = 60.0
SGLANG_SLEEP_BEFORE_DUMP_S = 5.0
SGLANG_WAIT_AFTER_TRIGGER_S = 60.0


def start_targets(k: int, workdir: Path, procs: list[subprocess.Popen[bytes]]) -> list[Target]:
    """Start k armed fake drivers (appended to ``procs`` at once) and wait until each is armed."""
    base = {name: value for name, value in os.environ.items() if not name.startswith("CUDA_")}
    base["CUDA_COREDUMP_PIPE"] = str(workdir / "pipes" / "corepipe.cuda.%h.%p")
    env = dict(cuda_coredump_env(workdir / "crash", base).env)
    statuses = []
    for i in range(k):
        status = workdir / f"fake-{i}.json"
        argv = [sys.executable, str(FAKE), "--status", str(status), "--chunks", "8", "--chunk-bytes", str(256 * 1024)]
        procs.append(
            subprocess.Popen(argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        )
        statuses.append(status)
    deadline = time.monotonic() + READY_TIMEOUT_S
    for status in statuses:
        while not (status.exists() and json.loads(status.read_text()).get("armed")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake driver {status} not armed within {READY_TIMEOUT_S} s")
            time.sleep(0.02)
    return [Target(pid=p.pid, title="fake-cuda") for p in procs[-k:]]


async def one_incident(
    pyspy: PySpyActor, actor: CoredumpActor, targets: list[Target], bundle: Path, incident_id: str
) -> dict[str, float]:
    """Open an incident, dump stacks, trigger coredumps; returns seconds since open."""
    opened = IncidentOpened(incident_id=incident_id, trigger="manual", pids=tuple(t.pid for t in targets))
    t0 = now_ns()
    stacks = await pyspy.dump_all(opened, targets, artifact_dir=bundle)
    t_dumps = now_ns()
    cores = await actor.trigger_all(opened, targets, artifact_dir=bundle)
    t_done = now_ns()
    bad = [r for r in cores if r.outcome is not Outcome.OK]
    if bad:
        raise RuntimeError(f"coredump failed: {bad[0].outcome}: {bad[0].detail}")
    stack_failures = sum(r.outcome is not Outcome.OK for r in stacks)
    t_triggered = max(int(r.attributes["servewatch.coredump.trigger_time_unix_nano"]) for r in cores)
    return {
        "dumps_s": (t_dumps - t0) / 1e9,
        "triggered_s": (t_triggered - t0) / 1e9,
        "trigger_overhead_s": (t_triggered - t_dumps) / 1e9,
        "complete_s": (t_done - t0) / 1e9,
        "stack_failures": float(stack_failures),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    print(f"host={socket.gethostname()} cpus={os.cpu_count()} python={sys.version.split()[0]}", file=sys.stderr)
    header = (
        f"{'K':>3} {'dumps':>8} {'ours:trig':>10} {'+trig ms':>9} {'sglang:trig':>12} {'ratio':>7}"
        f" {'ours:done':>10} {'sglang:done':>12} {'ratio':>7}"
    )
    print(header)
    for k in args.k:
        procs: list[subprocess.Popen[bytes]] = []
        with tempfile.TemporaryDirectory(prefix="bench-coredump-") as tmp:
            workdir = Path(tmp)
            try:
                targets = start_targets(k, workdir, procs)
                actor = CoredumpActor(
                    CoredumpConfig(folder=workdir / "crash", min_free_bytes=0, settle_s=0.2, poll_interval_s=0.02)
                )
                pyspy = PySpyActor()
                runs = []
                for rep in range(args.repeat):
                    bundle = workdir / f"inc-{rep}"
                    bundle.mkdir()
                    runs.append(anyio.run(one_incident, pyspy, actor, targets, bundle, f"bench-{k}-{rep}"))
            finally:
                kill_groups(procs, timeout_s=10)

        dumps, triggered, overhead, done = (
            statistics.median(r[key] for r in runs)
            for key in ("dumps_s", "triggered_s", "trigger_overhead_s", "complete_s")
        )
        sglang_trig = SGLANG_SLEEP_BEFORE_DUMP_S + dumps + overhead
        sglang_done = sglang_trig + SGLANG_WAIT_AFTER_TRIGGER_S
        print(
            f"{k:>3} {dumps:>7.3f}s {triggered:>9.3f}s {overhead * 1e3:>8.1f} {sglang_trig:>11.3f}s"
            f" {triggered / sglang_trig:>6.3f}x {done:>9.3f}s {sglang_done:>11.3f}s {done / sglang_done:>6.3f}x"
        )
        if any(r["stack_failures"] for r in runs):
            print(f"    note: {int(max(r['stack_failures'] for r in runs))} py-spy dumps failed in a run", file=sys.stderr)
    print(
        "dumps = py-spy dump_all; ours:trig = open -> last trigger written; +trig = dumps end -> last trigger;"
        " sglang = 5 s sleep + dumps + trigger (+60 s fixed wait for done); medians of"
        f" {args.repeat} incidents",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
