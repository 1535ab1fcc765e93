"""The fault matrix, measured: per case the verdict, whether it named exactly the right rank(s),
and the time the verdict adds to the incident.

Each case runs real processes (``tests/programs/fault_matrix.py``): a gloo job of TP ranks
(``tests/programs/dist_rank.py``), one fault on one rank (hang in compute, killed, skips a
collective, a collective of another shape, slow but progressing), the real agent with its
Flight Recorder actor and verdict. "Added" is the Flight Recorder phase (all ranks, in parallel)
plus making the verdict, the two things this feature adds to an incident; it is also shown as a
share of the whole incident (stacks included). Right = the verdict's kind is the expected one
and its culprit ranks are exactly the faulty rank (none for the slow case; no innocent rank).

Target: every case right, added <= 1 s at TP=4. Nothing is asserted.

Usage: ``python bench/bench_verdict.py [--tp 2 4] [--runs 1]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit_result

from tests.programs.fault_matrix import EXPECTED, run_case

FAULTS = ("hang", "kill", "skip", "shape", "slow")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--runs", type=int, default=1, help="runs per case")
    args = ap.parse_args()
    if "SERVEWATCH_SHM_DIR" in os.environ:
        return _run(args)
    # the ranks' SDK sockets and counters go to a private folder, removed with what is left in it
    with tempfile.TemporaryDirectory(prefix="sw-bench-shm-") as shm:
        os.environ["SERVEWATCH_SHM_DIR"] = shm
        try:
            return _run(args)
        finally:
            del os.environ["SERVEWATCH_SHM_DIR"]


def _run(args: argparse.Namespace) -> int:
    rows = []
    print(f"{'case':<12} {'right':<5} {'added s':>8} {'incident s':>10} {'share':>6}  verdict")
    for tp in args.tp:
        for fault in FAULTS:
            k = 1 if tp == 2 else 2
            for _ in range(args.runs):
                r = anyio.run(run_case, tp, fault, k)
                v = r.verdict
                added = r.verdict_added_s
                total = r.record.duration_s if r.record is not None else float("nan")
                rows.append((tp, fault, r.correct, added))
                head = v.headline() if v is not None else "(no verdict)"
                print(f"tp{tp}-{fault:<8} {'yes' if r.correct else 'NO':<5} {added:8.3f} {total:10.2f} {added / total:6.1%}  {head}",
                      flush=True)
    print()
    for tp in args.tp:
        mine = [row for row in rows if row[0] == tp]
        adds = [row[3] for row in mine]
        print(f"TP={tp}: right {sum(1 for row in mine if row[2])}/{len(mine)}; added s max {max(adds):.3f} "
              f"mean {statistics.mean(adds):.3f} (target <= 1 s at TP=4)")
        emit_result(f"fault matrix TP={tp}: time the verdict adds to an incident, worst case", ours=max(adds), unit="s",
                    baseline_name="(target <= 1 s at TP=4)", spread=(min(adds), max(adds)),
                    note=f"right {sum(1 for row in mine if row[2])}/{len(mine)} cases")
    expected = {f: EXPECTED[f][1] for f in FAULTS}
    print(f"expected kinds: {expected}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
