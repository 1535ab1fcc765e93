"""Spans finished vs delivered vs duplicated when the agent is SIGKILLed mid-incident, and the
time from a collector's recovery to every spooled span delivered.

Two parts, each against a real OTLP receiver (gRPC and HTTP lives alternate) and a real target
(``tests/programs/fake_server.py``, an SDK step counter that hangs in "forward" on request):

1. **Kill loop** (``tests/kill_loop.py``): ``--kills`` lives of ``servewatch run``, each
   SIGKILLed at a random moment (uniform in 0-``--max-delay-s`` after its stall incident's
   manifest appeared); the collector is down for every ``--outage-every``-th life and
   ``servewatch export`` runs after every ``--export-every``-th; then a last agent recovers and
   stops. Printed: incidents, spans the manifests record (roots + actions), delivered, lost,
   duplicated (extra copies: the at-least-once window), incidents a kill interrupted.
2. **Outage recovery**: one agent (default retry settings: backoff 0.25 s doubling to 5 s)
   captures ``--outage-incidents`` stall incidents while the collector is down (their spans go to
   the spool), then the collector comes back: the seconds until every spooled span was
   delivered (spool empty, receiver count settled), ``--outage-rounds`` times.

``--agent-repo PATH`` runs the agents of another checkout (e.g. ``git worktree add /tmp/before
<commit>``) with the same harness: the before/after of a change in one table.

    python bench/bench_kill_loop.py                         # 30 kills + 3 outage rounds (~3 min)
    python bench/bench_kill_loop.py --kills 60 --agent-repo /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from _common import emit_result, kill_groups, loadavg

from tests.kill_loop import HOST, KillLoop, _spool_spans, _wait
from tests.otlp_receiver import OtlpReceiver
from tests.programs import fake_server


def _spawner(procs: list[subprocess.Popen[bytes]]) -> Callable[..., subprocess.Popen[bytes]]:
    def spawn(argv: list[str], **kwargs) -> subprocess.Popen[bytes]:
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, **kwargs)
        procs.append(proc)
        return proc

    return spawn


def kill_loop(args: argparse.Namespace, work: Path) -> dict[str, float]:
    procs: list[subprocess.Popen[bytes]] = []
    shm = work / "shm-kills"
    shm.mkdir()
    receiver = OtlpReceiver().start()
    try:
        server = fake_server.start(_spawner(procs), env=KillLoop.target_env(shm))
        loop = KillLoop(
            data_dir=work / "data-kills", receiver=receiver, server=server, shm_dir=shm, rng=random.Random(args.seed),
            max_delay_s=args.max_delay_s, outage_every=args.outage_every, export_every=args.export_every,
            log=(lambda line: print("  " + line, flush=True)) if args.verbose else (lambda line: None),
            agent_repo=args.agent_repo,
        )
        t0 = time.monotonic()
        for _ in range(args.kills):
            loop.life()
        r = loop.finish()
        took = time.monotonic() - t0
    finally:
        receiver.stop()
        kill_groups(procs, timeout_s=10)
    print(f"kill loop: {r.kills} SIGKILLs in {took:.0f} s ({args.agent_repo}), load {loadavg()[0]:.1f}")
    print(f"  incidents {r.incidents} (interrupted by a kill: {r.interrupted}); spans recorded {r.expected}: "
          f"delivered {r.delivered}, lost {len(r.lost)}, duplicated {r.duplicated}; sent by servewatch export between lives: {r.exported}")
    for line in r.lost[:10]:
        print(f"  lost: {line}")
    emit_result("kill loop: recorded spans lost", ours=len(r.lost), unit="spans", note=f"{r.expected} recorded, {r.kills} kills; target 0")
    emit_result("kill loop: extra copies delivered", ours=r.duplicated, unit="spans",
                note=f"{r.expected} recorded, {r.kills} kills; at-least-once window only")
    return {"kills": r.kills, "expected": r.expected, "lost": len(r.lost), "duplicated": r.duplicated}


def outage_recovery(args: argparse.Namespace, work: Path) -> list[float]:
    """Seconds from the collector's return to every spooled span delivered, per round."""
    procs: list[subprocess.Popen[bytes]] = []
    shm = work / "shm-outage"
    shm.mkdir()
    data = work / "data-outage"
    receiver = OtlpReceiver().start()
    times: list[float] = []
    try:
        server = fake_server.start(_spawner(procs), env=KillLoop.target_env(shm))
        loop = KillLoop(data_dir=data, receiver=receiver, server=server, shm_dir=shm, rng=random.Random(args.seed),
                        agent_repo=args.agent_repo, quick_retry=False)
        agent = loop._start_agent("grpc")
        procs.append(agent)
        _wait(lambda: (data / HOST / "status.json").exists() and '"steps"' in (data / HOST / "status.json").read_text(), 60,
              "the agent watching")
        for _ in range(args.outage_rounds):
            receiver.stop()
            for _ in range(args.outage_incidents):
                before = len(list((data / HOST).glob("*/manifest.json")))
                server.control(mode="freeze")
                _wait(lambda before=before: len(list((data / HOST).glob("*/manifest.json"))) > before, 30, "an incident")
                time.sleep(0.6)  # the incident's phases end (its spans go to the spool)
                server.control(mode="run")
                time.sleep(0.6)  # the watchdog rearms on progress
            spooled = _spool_spans(data)
            receiver.clear()
            receiver.start()
            t0 = time.monotonic()
            _wait(lambda n=spooled: _spool_spans(data) == 0 and receiver.span_count >= n, 120, "the spool delivered", interval_s=0.02)
            times.append(time.monotonic() - t0)
            print(f"outage round: {spooled} spooled span(s) delivered {times[-1]:.2f} s after the collector came back")
    finally:
        receiver.stop()
        kill_groups(procs, timeout_s=10)
    emit_result("collector back -> spool delivered", ours=statistics.median(times), unit="s",
                spread=(min(times), max(times)), note=f"{args.outage_rounds} rounds, retry backoff 0.25 s doubling to 5 s")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=30, help="agent lives ended by SIGKILL (default 30)")
    parser.add_argument("--max-delay-s", type=float, default=0.8, metavar="SECONDS",
                        help="kill moment: uniform in 0..this after the incident's manifest appeared (default 0.8)")
    parser.add_argument("--outage-every", type=int, default=3, help="the collector is down every Nth life (0: never; default 3)")
    parser.add_argument("--export-every", type=int, default=10, help="servewatch export after every Nth life (0: never; default 10)")
    parser.add_argument("--outage-rounds", type=int, default=3, help="outage-recovery rounds (0: skip; default 3)")
    parser.add_argument("--outage-incidents", type=int, default=3, help="incidents captured per outage (default 3)")
    parser.add_argument("--agent-repo", type=Path, default=ROOT, help="checkout whose agent runs (default: this one)")
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--verbose", action="store_true", help="one line per agent life")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args()
    args.agent_repo = args.agent_repo.resolve()
    with tempfile.TemporaryDirectory(prefix="bench-kill-loop-") as tmp:
        work = Path(tmp)
        figures: dict[str, object] = {}
        if args.kills:
            figures["kill_loop"] = kill_loop(args, work)
        if args.outage_rounds:
            figures["recovery_s"] = outage_recovery(args, work)
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    raise SystemExit(main())
