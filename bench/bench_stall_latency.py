"""Stall detection latency / configured timeout: our Watchdog vs a timeout/2 poller, same runs.

Each run starts a real stepping subprocess (``tests/programs/fake_server.py``); once both
detectors are watching it steps for a random time, then freezes with work pending. Two detectors watch the same shared-memory
counter at the same time (plus one on ``/metrics``):

* ours: :class:`agent.watchers.watchdog.Watchdog` (deadline scheduling from the exact last-step
  time);
* ours on the server's ``/metrics`` (SGLang preset) at the product's default poll
  (``watchdog.poll_interval_s``, 1 s): the path of an unmodified SGLang/vLLM server, whose
  last-progress time is only known to the poll interval;
* the same, polling every ``--scrape-s`` (0.05 s: what a fast scrape buys);
* baseline: a poller that checks every ``timeout/2`` whether ``forward_ct`` changed and fires
  once it has not for ``timeout`` (the scheme of SGLang's scheduler watchdog).

Latency is measured from the exact last step (``last_step_monotonic_ns`` in the counter file)
to the moment each detector fired, divided by the timeout. Prints max / mean / p50 of each.
Target: ours (SDK counter) max <= 1.05 (the poller reaches up to 1.5); the ``/metrics`` path
is bounded by ``(timeout + poll) / timeout``, negligible at production timeouts (300 s
default). Nothing is asserted.

Usage: ``python bench/bench_stall_latency.py [--runs 20] [--timeout-s 2.0]``
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import emit_result, kill_groups

from agent.model.bus import RecordingBus
from agent.model.events import WatchdogStalled
from agent.sdk.counter import ENV_SHM_DIR
from agent.watchers.steps import PrometheusStepSource, ShmStepSource
from agent.watchers.watchdog import Watchdog, WatchdogConfig
from tests.programs import fake_server

TARGET_MAX_RATIO = 1.05


class StampingBus(RecordingBus):
    """Records the monotonic time at which the first ``WatchdogStalled`` was published."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled_at_ns: int | None = None

    async def publish(self, event: object) -> None:  # type: ignore[override]
        if isinstance(event, WatchdogStalled) and self.stalled_at_ns is None:
            self.stalled_at_ns = time.monotonic_ns()
        await super().publish(event)  # type: ignore[arg-type]


async def half_timeout_poller(source: ShmStepSource, timeout_s: float) -> int:
    """Baseline: poll every timeout/2; fire when forward_ct is unchanged for timeout_s while busy.

    Returns:
        ``time.monotonic_ns()`` when it fired.
    """
    last_ct: int | None = None
    last_change_ns = time.monotonic_ns()
    timeout_ns = int(timeout_s * 1e9)
    while True:
        reading = source.read_now()
        now = time.monotonic_ns()
        if reading is not None and reading.busy and reading.forward_ct > 0:
            if reading.forward_ct == last_ct:
                if now - last_change_ns > timeout_ns:
                    return now
            else:
                last_ct, last_change_ns = reading.forward_ct, now
        else:
            last_ct, last_change_ns = None, now
        await anyio.sleep(timeout_s / 2)


async def one_run(shm: Path, timeout_s: float, scrape_s: float, rng: random.Random) -> tuple[float, float, float, float]:
    """One frozen target, four detectors; returns latency / timeout of (ours shm, ours /metrics at
    the default poll, ours /metrics every ``scrape_s``, baseline)."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]
        procs.append(proc)
        return proc

    env = dict(os.environ, **{ENV_SHM_DIR: str(shm)})
    run_for_s = rng.uniform(0.2, 0.2 + timeout_s)  # random phase against the poller
    try:
        server = fake_server.start(spawn, "--step-interval-s", "0.005", env=env)
        source = ShmStepSource(server.pid, directory=shm)
        bus = StampingBus()
        watchdog = Watchdog(source, WatchdogConfig(timeout_s=timeout_s))
        scraped = PrometheusStepSource(server.metrics_url, preset="sglang", timeout_s=timeout_s)
        prom_bus = StampingBus()
        prom_watchdog = Watchdog(scraped, WatchdogConfig(timeout_s=timeout_s))  # the default poll
        fast = PrometheusStepSource(server.metrics_url, preset="sglang", timeout_s=timeout_s)
        fast_bus = StampingBus()
        fast_watchdog = Watchdog(fast, WatchdogConfig(timeout_s=timeout_s, poll_interval_s=scrape_s))
        fired: dict[str, int] = {}
        with anyio.fail_after(3 * timeout_s + 2 * WatchdogConfig().poll_interval_s + 60):
            while (first := source.read_now()) is None or first.forward_ct == 0:
                await anyio.sleep(0.005)
            async with anyio.create_task_group() as tg:
                await tg.start(watchdog.run, bus)
                await tg.start(prom_watchdog.run, prom_bus)
                await tg.start(fast_watchdog.run, fast_bus)

                async def baseline() -> None:
                    fired["baseline"] = await half_timeout_poller(source, timeout_s)

                tg.start_soon(baseline)
                # Both detectors have seen it stepping; then it freezes with work pending.
                await anyio.sleep(run_for_s)
                await anyio.to_thread.run_sync(lambda: server.control(mode="freeze"))
                while None in (bus.stalled_at_ns, prom_bus.stalled_at_ns, fast_bus.stalled_at_ns) or "baseline" not in fired:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
        await scraped.aclose()
        await fast.aclose()
        reading = source.read_now()
        assert reading is not None and reading.last_progress_monotonic_ns is not None
        last_ns = reading.last_progress_monotonic_ns
        assert bus.stalled_at_ns is not None and prom_bus.stalled_at_ns is not None and fast_bus.stalled_at_ns is not None
        return (
            (bus.stalled_at_ns - last_ns) / 1e9 / timeout_s,
            (prom_bus.stalled_at_ns - last_ns) / 1e9 / timeout_s,
            (fast_bus.stalled_at_ns - last_ns) / 1e9 / timeout_s,
            (fired["baseline"] - last_ns) / 1e9 / timeout_s,
        )
    finally:
        kill_groups(procs, timeout_s=10)


def summary(label: str, ratios: list[float]) -> str:
    return (
        f"  {label:<26} max {max(ratios):.3f}  mean {statistics.fmean(ratios):.3f}  "
        f"p50 {statistics.median(ratios):.3f}  min {min(ratios):.3f}"
    )


async def amain(runs: int, timeout_s: float, scrape_s: float, seed: int) -> int:
    rng = random.Random(seed)
    poll_s = WatchdogConfig().poll_interval_s
    labels = ("ours (deadline, SDK counter):", f"ours (/metrics, poll {poll_s:g}s):", f"ours (/metrics, poll {scrape_s:g}s):",
              "baseline (timeout/2 poll):")
    got: list[list[float]] = [[], [], [], []]
    with tempfile.TemporaryDirectory(prefix="servewatch-bench-") as shm:
        for i in range(runs):
            row = await one_run(Path(shm), timeout_s, scrape_s, rng)
            for column, value in zip(got, row, strict=True):
                column.append(value)
            print(f"run {i + 1:2d}/{runs}: " + "  ".join(f"{v:.3f}" for v in row), file=sys.stderr)
    print(f"stall detection latency / timeout ({timeout_s} s), {runs} runs:")
    for label, values in zip(labels, got, strict=True):
        print(summary(label, values))
    ours, prom, fast, base = got
    verdict = "meets" if max(ours) <= TARGET_MAX_RATIO else "MISSES"
    print(
        f"ours max {max(ours):.3f} {verdict} the {TARGET_MAX_RATIO} target; "
        f"mean ratio ours/baseline {statistics.fmean(ours) / statistics.fmean(base):.3f}; "
        f"/metrics at the default poll bounded by {(timeout_s + poll_s) / timeout_s:.2f}"
    )
    for name, values in (("SDK counter", ours), (f"/metrics at the default {poll_s:g} s poll", prom), (f"/metrics, {scrape_s:g} s poll", fast)):
        emit_result(f"stall latency / timeout ({timeout_s:g} s), {name}, worst of {runs}", ours=max(values), baseline=max(base),
                    baseline_name="a timeout/2 poller (SGLang's scheduler watchdog scheme)", unit="x timeout",
                    spread=(min(values), max(values)), note=f"mean {statistics.fmean(values):.3f} vs {statistics.fmean(base):.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=2.0, help="configured watchdog timeout, seconds")
    parser.add_argument(
        "--scrape-s", type=float, default=0.05, help="poll interval of the fast /metrics watchdog, seconds"
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    return anyio.run(amain, args.runs, args.timeout_s, args.scrape_s, args.seed)


if __name__ == "__main__":
    sys.exit(main())
