"""Cost of ``agent.sdk.step()`` per call, against an empty Python function call in the same run.

Prints ns per call for both and their ratio (target: ``step()`` <= 300 ns per call). Nothing is
asserted. The counter file goes to a temporary folder (``SERVEWATCH_SHM_DIR``) and is removed.

Usage: ``python bench/bench_step.py [--calls N] [--repeat R]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit_result

TARGET_NS = 300.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="calls per timing run")
    parser.add_argument("--repeat", type=int, default=7, help="timing runs; the fastest is reported")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="servewatch-bench-") as shm:
        os.environ["SERVEWATCH_SHM_DIR"] = shm
        from agent import sdk

        def empty() -> None:
            return None

        step = sdk.step
        step()  # create the counter file outside the timing
        namespace = {"step": step, "empty": empty}
        results: dict[str, float] = {}
        for label, stmt in (("empty()", "empty()"), ("step()", "step()"), ("step(pending=3)", "step(3)")):
            best_s = min(timeit.repeat(stmt, globals=namespace, number=args.calls, repeat=args.repeat))
            results[label] = best_s / args.calls * 1e9
        sdk.close()

    base = results["empty()"]
    print(f"calls per run: {args.calls}, best of {args.repeat}, python {sys.version.split()[0]}")
    for label, ns in results.items():
        print(f"  {label:<17} {ns:8.1f} ns/call   {ns / base:5.2f}x empty()")
    for label in ("step()", "step(pending=3)"):
        emit_result(f"agent.sdk.{label} per call", ours=results[label], baseline=base, unit="ns/call",
                    baseline_name="an empty Python function call", note=f"best of {args.repeat} x {args.calls}; target <= {TARGET_NS:.0f} ns")
    worst = max(results["step()"], results["step(pending=3)"])
    verdict = "meets" if worst <= TARGET_NS else "MISSES"
    print(f"step() worst {worst:.1f} ns/call: {verdict} the {TARGET_NS:.0f} ns target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
