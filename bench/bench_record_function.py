"""Cost of ``agent.sdk.maybe_record_function`` with no profiler active, against
``torch.profiler.record_function`` (also inactive) as the baseline, in one run.

Prints ns/call for both and their ratio (target <= 0.05x). Each is timed as a full
``with ...: pass`` block, best of ``--repeat`` runs of ``--calls`` calls.

    python bench/bench_record_function.py [--calls 200000] [--repeat 5]

Measured on the shared build box (torch 2.13 CPU): 117 ns/call vs 4405 ns/call -> 0.027x; with
the process-wide torch profiler gate and ``enabled`` (issue 8): 165 ns/call vs 4721 ns/call -> 0.035x.
"""

from __future__ import annotations

import argparse
import time
import warnings


def _best_ns_per_call(fn, calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn(calls)
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.profiler import record_function

    from agent.sdk.tracing import maybe_record_function, profiling_active

    assert not profiling_active()

    def ours(n: int) -> None:
        for _ in range(n):
            with maybe_record_function("servewatch.bench"):
                pass

    def torchs(n: int) -> None:
        for _ in range(n):
            with record_function("servewatch.bench"):
                pass

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    torch_calls = max(1000, args.calls // 20)
    loop_ns = _best_ns_per_call(empty, args.calls, args.repeat)
    ours_ns = _best_ns_per_call(ours, args.calls, args.repeat)
    torch_ns = _best_ns_per_call(torchs, torch_calls, args.repeat)
    ratio = ours_ns / torch_ns
    print(f"empty loop                        {loop_ns:10.1f} ns/iter")
    print(f"maybe_record_function (inactive)  {ours_ns:10.1f} ns/call  ({args.calls} calls x{args.repeat})")
    print(f"torch record_function (inactive)  {torch_ns:10.1f} ns/call  ({torch_calls} calls x{args.repeat})")
    print(f"ratio ours/torch                  {ratio:10.4f}x  (target <= 0.05x) {'PASS' if ratio <= 0.05 else 'FAIL'}")


if __name__ == "__main__":
    main()
