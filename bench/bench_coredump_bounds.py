"""CUDA coredump waits bounded by progress: how soon the coredump phase ends, measured.

Against K (``--k``) fake-CUDA-driver targets (tests/programs/fake_cuda_driver.py: real FIFOs
held by real processes), with the DEFAULT :class:`CoredumpConfig` (trigger_timeout_s 5,
consume_timeout_s 1, settle_s 2, poll_interval_s 0.1), each repetition runs the real
coredump phase (:meth:`CoredumpActor.trigger_all`) and measures with the wall clock:

* ``never-read``: drivers that hold the FIFO open but never read it. The phase must end within
  ``trigger_timeout_s + 1`` s (bound): the trigger is found unconsumed (FIONREAD) after
  ``consume_timeout_s``, instead of waiting out ``completion_timeout_s`` (the old 120 s).
* ``full``: the FIFO is already full (the write cannot even go in): ends at
  ``trigger_timeout_s``, again within the bound.
* ``normal``: drivers that write a core file; "detected" is how long after the core file's
  last write (its mtime) the action ended with ``complete``. Bound: ``settle_s + 1`` s.

Prints medians, the bound and the ratio measured / bound (must be <= 1). Printed, not asserted.
Every process it starts is killed on exit (try/finally).

    python bench/bench_coredump_bounds.py [--k 1 4] [--repeat 3]
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
from _common import emit_result, kill_groups

from agent.actors.coredump import CoredumpActor, CoredumpConfig
from agent.host.cudaenv import cuda_coredump_env
from agent.host.targets import Target
from agent.model.events import IncidentOpened, Outcome

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "programs" / "fake_cuda_driver.py"
READY_TIMEOUT_S = 60.0


def start(k: int, mode: str, workdir: Path, procs: list[subprocess.Popen[bytes]]) -> list[Target]:
    base = {name: value for name, value in os.environ.items() if not name.startswith("CUDA_")}
    base["CUDA_COREDUMP_PIPE"] = str(workdir / "pipes" / "corepipe.cuda.%h.%p")
    env = dict(cuda_coredump_env(workdir / "crash", base).env)
    statuses = []
    for i in range(k):
        status = workdir / f"{mode}-{i}.json"
        argv = [sys.executable, str(FAKE), "--mode", mode, "--status", str(status), "--chunks", "8",
                "--chunk-bytes", str(256 * 1024), "--chunk-delay-s", "0.05"]
        procs.append(subprocess.Popen(argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        statuses.append(status)
    deadline = time.monotonic() + READY_TIMEOUT_S
    for status in statuses:
        while not (status.exists() and json.loads(status.read_text()).get("armed")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake driver {status} not armed in time")
            time.sleep(0.02)
    return [Target(pid=p.pid) for p in procs[-k:]]


async def phase(actor: CoredumpActor, targets: list[Target], bundle: Path, name: str) -> tuple[float, list]:
    opened = IncidentOpened(incident_id=name, trigger="manual")
    t0 = time.monotonic()
    results = await actor.trigger_all(opened, targets, artifact_dir=bundle)
    return time.monotonic() - t0, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"host={socket.gethostname()} cpus={os.cpu_count()} python={sys.version.split()[0]}", file=sys.stderr)
    print(f"{'K':>3} {'case':<11} {'measured':>9} {'bound':>7} {'ratio':>7}  outcome/stage")
    for k in args.k:
        for mode in ("never-read", "full", "normal"):
            procs: list[subprocess.Popen[bytes]] = []
            with tempfile.TemporaryDirectory(prefix="bench-cdb-") as tmp:
                workdir = Path(tmp)
                cfg = CoredumpConfig(folder=workdir / "crash", min_free_bytes=0)  # defaults otherwise
                try:
                    targets = start(k, mode, workdir, procs)
                    measured: list[float] = []
                    stages: set[str] = set()
                    for rep in range(args.repeat):
                        actor = CoredumpActor(cfg)
                        bundle = workdir / f"inc-{rep}"
                        bundle.mkdir()
                        took, results = anyio.run(phase, actor, targets, bundle, f"bench-{mode}-{k}-{rep}")
                        stages |= {f"{r.outcome}/{r.attributes.get('servewatch.coredump.stage', '-')}" for r in results}
                        if mode == "normal":
                            if any(r.outcome is not Outcome.OK for r in results):
                                raise RuntimeError(f"coredump failed: {results}")
                            # detection latency: action end - core file's last write (mtime)
                            measured.append(max(
                                r.end_time_unix_nano / 1e9 - os.stat(r.artifact_paths[0]).st_mtime for r in results
                            ))
                        else:
                            measured.append(took)
                finally:
                    kill_groups(procs, timeout_s=10)
            bound = cfg.settle_s + 1 if mode == "normal" else cfg.trigger_timeout_s + 1
            value = statistics.median(measured)
            label = "detected" if mode == "normal" else mode
            print(f"{k:>3} {label:<11} {value:>8.3f}s {bound:>6.1f}s {value / bound:>6.3f}x  {', '.join(sorted(stages))}")
            what = "action end - core file's last write" if mode == "normal" else "the whole coredump phase"
            emit_result(f"coredump bounds K={k}, {label}: {what}", ours=value, baseline=bound, unit="s",
                        baseline_name=("bound settle_s + 1" if mode == "normal" else "bound trigger_timeout_s + 1")
                        + " (the old wait: completion_timeout_s, 120 s)",
                        spread=(min(measured), max(measured)), note=f"median of {args.repeat}, default CoredumpConfig")
    print(
        "never-read/full: whole coredump phase, bound trigger_timeout_s + 1; detected: action end - core file's"
        f" last write, bound settle_s + 1; medians of {args.repeat}; the old wait was completion_timeout_s (120 s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
