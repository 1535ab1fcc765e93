"""Cost of ``agent.sdk.maybe_record_function`` with no profiler active, beside three baselines in
one run.

Each is timed as the block a server would write around its forward step, no profiler active:

* ``if FLAG: ...`` with ``FLAG`` false: the cheapest gate a server can write by hand (a module
  global checked per call; nothing is entered);
* ``with contextlib.nullcontext():``: the cheapest *context manager* (what a hand-written
  ``record_function(name) if profiling else nullcontext()`` costs when not profiling);
* ``with maybe_record_function("name"):`` (ours);
* ``with torch.profiler.record_function("name"):`` (torch's own, inactive: it still builds a
  RecordFunction handle per call).

Prints ns/call (best of ``--repeat`` runs of ``--calls`` calls, the empty loop subtracted) and
the ratios ours / each baseline. Target: ours <= 0.05x torch's. Wall-clock timings on a shared
machine drift, so every baseline runs in the same process, interleaved with ours.

    python bench/bench_record_function.py [--calls 200000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit_result

FLAG = False


def _best_ns_per_call(fn: Callable[[int], None], calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn(calls)
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.profiler import record_function

    from agent.sdk.tracing import maybe_record_function, profiling_active

    assert not profiling_active()
    nullcontext = contextlib.nullcontext

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    def flag(n: int) -> None:
        for _ in range(n):
            if FLAG:
                pass

    def null(n: int) -> None:
        for _ in range(n):
            with nullcontext():
                pass

    def ours(n: int) -> None:
        for _ in range(n):
            with maybe_record_function("servewatch.bench"):
                pass

    def torchs(n: int) -> None:
        for _ in range(n):
            with record_function("servewatch.bench"):
                pass

    torch_calls = max(1000, args.calls // 20)
    sides: dict[str, tuple[Callable[[int], None], int]] = {
        "empty loop": (empty, args.calls), "if FLAG (false)": (flag, args.calls), "contextlib.nullcontext()": (null, args.calls),
        "maybe_record_function": (ours, args.calls), "torch record_function": (torchs, torch_calls),
    }  # fmt: skip
    best = {name: float("inf") for name in sides}
    for _ in range(3):  # interleaved: a drift of the machine hits every side alike
        for name, (fn, calls) in sides.items():
            best[name] = min(best[name], _best_ns_per_call(fn, calls, args.repeat))
    loop = best.pop("empty loop")
    net = {name: max(ns - loop, 0.1) for name, ns in best.items()}
    print(f"no profiler active; ns per call, best of {3 * args.repeat} runs, the empty loop ({loop:.1f} ns/iter) subtracted")
    for name, ns in net.items():
        print(f"  {name:<26} {ns:10.1f} ns/call  ({best[name]:.1f} with the loop)")
    o = net["maybe_record_function"]
    for name in ("if FLAG (false)", "contextlib.nullcontext()", "torch record_function"):
        print(f"  ours / {name:<26} {o / net[name]:8.3f}x" + ("  (target <= 0.05x)" if name.startswith("torch") else ""))
        emit_result(f"maybe_record_function, inactive vs {name}", ours=o, baseline=net[name], baseline_name=name, unit="ns/call",
                    note="best of runs, empty loop subtracted" + ("; target <= 0.05x" if name.startswith("torch") else ""))


if __name__ == "__main__":
    main()
