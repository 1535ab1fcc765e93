"""Run ``servewatch`` (``agent.cli.app``) under tracemalloc, writing allocation-growth reports.

Diagnostic for the soak (``bench_soak.py --trace-alloc``): argv is passed to the CLI unchanged.
Every ``SOAK_TRACE_EVERY_S`` seconds (default 120) a daemon thread takes a snapshot and appends
to ``SOAK_TRACE_OUT`` the top 25 allocation sites (traceback of 6 frames, grouped by their
innermost frame in the agent's own code) whose size grew most since the first snapshot taken
after ``SOAK_TRACE_WARMUP_S`` seconds (default 120). tracemalloc itself costs memory and CPU,
so slope and CPU of a traced run are not the bench's figures.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import tracemalloc


def _site(stat: tracemalloc.StatisticDiff) -> str:
    frames = list(stat.traceback)
    return " <- ".join(
        f"{os.path.relpath(f.filename) if 'servewatch' in f.filename or '/wt/' in f.filename else f.filename.split('site-packages/')[-1]}:{f.lineno}"
        for f in frames[:6]
    )


def _reporter(out: str, every: float, warmup: float) -> None:
    time.sleep(warmup)
    base = tracemalloc.take_snapshot()
    t0 = time.monotonic()
    while True:
        time.sleep(every)
        snap = tracemalloc.take_snapshot()
        diffs = sorted(snap.compare_to(base, "traceback"), key=lambda s: -s.size_diff)[:25]
        total = sum(s.size for s in snap.statistics("filename"))
        with open(out, "a") as f:
            f.write(
                f"=== +{time.monotonic() - t0:.0f}s after warm-up; traced {total / 1e6:.2f} MB\n"
            )
            f.writelines(
                f"{s.size_diff / 1e3:+9.1f} kB {s.count_diff:+7d} blocks (now {s.size / 1e3:8.1f} kB)  {_site(s)}\n"
                for s in diffs
            )


def main() -> None:
    tracemalloc.start(6)
    out = os.environ.get("SOAK_TRACE_OUT", "tracemalloc.txt")
    t = threading.Thread(
        target=_reporter,
        args=(
            out,
            float(os.environ.get("SOAK_TRACE_EVERY_S", "120")),
            float(os.environ.get("SOAK_TRACE_WARMUP_S", "120")),
        ),
        daemon=True,
    )
    t.start()
    from agent.cli.app import main as cli_main

    sys.argv[0] = "servewatch"
    cli_main()


if __name__ == "__main__":
    main()
