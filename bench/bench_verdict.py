"""The fault matrix, measured: per case the verdict, whether it named exactly the right culprit(s)
at the right confidence, and the time the verdict adds to the incident.

Each case runs real processes (``tests/programs/fault_matrix.py``):

* the rank faults, on a gloo job of TP ranks (``tests/programs/dist_rank.py``): hang in compute,
  killed, a skipped collective, a collective of another shape, slow but progressing;
* the shapes real hangs take: a collective-timeout cascade, a crash seen late (``servewatch dump``
  after the fact), two servers on one host, DP replicas, an IPC deadlock with a request running,
  an engine core hung in its own loop while its worker idles (a request running), a rendezvous
  hang, an ordering deadlock across two process groups, a stack too deep for py-spy,
  a rank in uninterruptible sleep (state D: a weight read from a hung network filesystem), two
  pipeline stages both receiving first (a P2P ordering deadlock), a stage receiving from a stage
  hung before it sends, a rank hung before DeepEP's
  dispatch while its peer spins in it (a host-side wait, no torch.distributed call), vLLM-on-Ray
  workers all titled ``ray::RayWorkerWrapper`` (the rank from each one's environment, with the
  Flight Recorder actor on and off; one crashing), schedulers that inherited one ``RANK`` (named by
  their titles), a PP=2 x TP=2 vLLM job whose ``Worker_PP1_TP0`` hangs (rank 2), a rank hung in
  CUDA-graph capture before the first step while its peer waits in the captured all-reduce (a
  ``startup_stall``: SGLang's and vLLM's runners);
* the frontends (``tests/programs/frontend_cases.py``, health incidents): vLLM's API server blocked in
  a chat-template render on its event loop, SGLang's detokenizer spinning while the schedulers
  generate, and the same with the agent started after the hang.

"Added" is the Flight Recorder phase (all ranks, in parallel) plus making the verdict, the two
things the verdict adds to an incident; for the rank faults it is also shown as a share of the
whole incident (stacks included). Right = the verdict's kind and culprit ranks are the expected
ones (none for the slow case) and, for the shapes, its culprit pids and confidence too, and it
names no process of another server.

Target: every case right (100 %), added <= 1 s at TP=8. Nothing is asserted. The temporary folder
(bundles, the SDK's counter files and sockets) is removed at the end, also after a failure.

Usage: ``python bench/bench_verdict.py [--tp 2 4 8] [--runs 1] [--shapes all|none|NAME...]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit_result

from tests.programs.fault_matrix import EXPECTED, SHAPES, run_case
from tests.programs.frontend_cases import FRONTEND_SHAPES

#: every shape: the fault matrix's and the frontends' (issue 32 item 1)
ALL_SHAPES = {**SHAPES, **FRONTEND_SHAPES}

FAULTS = ("hang", "kill", "skip", "shape", "slow")


def _faults(tps: list[int], runs: int, rows: list[tuple[str, bool, float]]) -> None:
    for tp in tps:
        for fault in FAULTS:
            k = 1 if tp == 2 else 2
            for _ in range(runs):
                r = anyio.run(run_case, tp, fault, k)
                v = r.verdict
                total = r.record.duration_s if r.record is not None else float("nan")
                rows.append((f"tp{tp}-{fault}", r.correct, r.verdict_added_s))
                head = v.headline() if v is not None else "(no verdict)"
                print(f"{f'tp{tp}-{fault}':<14} {'yes' if r.correct else 'NO':<5} {r.verdict_added_s:8.3f} "
                      f"{total:10.2f} {r.verdict_added_s / total:6.1%}  {head}", flush=True)


def _shapes(names: list[str], runs: int, workdir: Path, rows: list[tuple[str, bool, float]]) -> None:
    for name in names:
        for i in range(runs):
            wd = workdir / f"{name}-{i}"
            wd.mkdir(parents=True)
            r = anyio.run(ALL_SHAPES[name], wd)
            rows.append((name, r.correct, r.added_s))
            why = "" if r.correct else f"  <- {'; '.join(r.problems())}"
            print(f"{name:<14} {'yes' if r.correct else 'NO':<5} {r.added_s:8.3f} {'':>10} {'':>6}  "
                  f"{r.verdict.get('headline', '(no verdict)')}{why}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--runs", type=int, default=1, help="runs per case")
    ap.add_argument("--shapes", nargs="*", default=["all"], help="shapes to run: all, none, or names")
    args = ap.parse_args()
    names = sorted(ALL_SHAPES) if args.shapes == ["all"] else [] if args.shapes == ["none"] else args.shapes
    workdir = Path(tempfile.mkdtemp(prefix="sw-bench-verdict-"))
    os.environ["SERVEWATCH_SHM_DIR"] = str(workdir / "shm")  # counters and sockets of the ranks, removed below
    (workdir / "shm").mkdir()
    rows: list[tuple[str, bool, float]] = []
    try:
        print(f"{'case':<14} {'right':<5} {'added s':>8} {'incident s':>10} {'share':>6}  verdict")
        _faults(args.tp, args.runs, rows)
        _shapes(names, args.runs, workdir, rows)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    for tp in args.tp:
        mine = [row for row in rows if row[0].startswith(f"tp{tp}-")]
        adds = [row[2] for row in mine]
        print(f"TP={tp}: right {sum(1 for row in mine if row[1])}/{len(mine)}; added s max {max(adds):.3f} "
              f"mean {statistics.mean(adds):.3f}" + (" (target <= 1 s at TP=8)" if tp == 8 else ""))
        emit_result(f"fault matrix TP={tp}: time the verdict adds to an incident, worst case", ours=max(adds), unit="s",
                    baseline_name="(target <= 1 s at TP=8)", spread=(min(adds), max(adds)),
                    note=f"right {sum(1 for row in mine if row[1])}/{len(mine)} cases")
    shaped = [row for row in rows if not row[0].startswith("tp")]
    if shaped:
        print(f"shapes: right {sum(1 for row in shaped if row[1])}/{len(shaped)}; added s max "
              f"{max(row[2] for row in shaped):.3f}")
    right = sum(1 for row in rows if row[1])
    print(f"matrix accuracy: {right}/{len(rows)} = {right / len(rows):.0%} (target 100 %)")
    emit_result("fault matrix: cases whose verdict is right (kind, culprit ranks and pids, confidence)",
                ours=100.0 * right / len(rows), unit="%", baseline_name="(target 100 %)",
                note=f"{right}/{len(rows)} cases")
    print(f"expected kinds: { {f: EXPECTED[f][1] for f in FAULTS} }")
    print(f"temporary folder removed: {not workdir.exists()} ({workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
