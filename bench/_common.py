"""Helpers shared by the bench scripts (``python bench/<name>.py`` puts this folder on
``sys.path``, so the scripts import it as ``_common``).

Owns :func:`kill_groups`, exact child timing (:func:`run_timed`, :class:`Timed`), the load
average (:func:`loadavg`) and the one machine-readable result line every bench prints
(:func:`emit_result`, read back by ``bench/run_all.py``). Imports the standard library only.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from typing import IO, Any, NamedTuple

__all__ = ["RESULTS_ENV", "RESULT_PREFIX", "Timed", "emit_result", "kill_groups", "loadavg", "run_timed"]

#: Prefix of the one stdout line per result row a bench prints for ``bench/run_all.py``.
RESULT_PREFIX = "BENCH-RESULT "
#: Environment variable that turns the result lines on (``bench/run_all.py`` sets it to ``1``).
RESULTS_ENV = "SERVEWATCH_BENCH_RESULTS"


def kill_groups(procs: Iterable[subprocess.Popen[bytes]], *, timeout_s: float) -> None:
    """SIGKILL the process group of every started process and reap it.

    Each process must lead its own group (started with ``start_new_session=True``). A group
    that is already gone is skipped.

    Args:
        procs: the processes started by the bench.
        timeout_s: bound of each reap (``Popen.wait``), in seconds; passing it raises
            :class:`subprocess.TimeoutExpired`.
    """
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout_s)


class Timed(NamedTuple):
    """One child process run to its end, timed exactly (see :func:`run_timed`)."""

    #: wall seconds from just before the fork to the moment the kernel reported the exit
    wall_s: float
    #: user + system CPU seconds of the child and every descendant it reaped (``wait4``'s rusage)
    cpu_s: float
    #: exit code (negative: killed by that signal)
    returncode: int
    #: peak resident set of the child or of its largest reaped descendant, bytes
    maxrss_bytes: int


def run_timed(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    stdout: int | IO[Any] | None = subprocess.DEVNULL,
    stderr: int | IO[Any] | None = subprocess.DEVNULL,
    cwd: str | None = None,
) -> Timed:
    """Run ``argv`` to its end and time it exactly.

    ``subprocess.run(..., timeout=...)`` waits by polling ``waitpid(WNOHANG)`` at growing
    intervals (0.5 ms doubling up to 50 ms), so a measured time is rounded up to the next poll
    (0-50 ms). Here the exit is awaited on a pidfd (``poll`` wakes the moment the child exits,
    bounded by ``timeout_s``), then reaped with ``os.wait4`` for its exact rusage.

    Args:
        argv: the command.
        env: its environment (default: ours).
        timeout_s: bound of the wait, seconds; past it the child's process group is killed and
            :class:`subprocess.TimeoutExpired` raised.
        stdout, stderr: as for :class:`subprocess.Popen` (default: discarded).
        cwd: working directory.

    Returns:
        The :class:`Timed` run.

    Raises:
        subprocess.TimeoutExpired: the child ran past ``timeout_s``.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                            start_new_session=True)  # fmt: skip
    fd = os.pidfd_open(proc.pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(timeout_s * 1000):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            raise subprocess.TimeoutExpired(list(argv), timeout_s)
        t1 = time.perf_counter()
    finally:
        os.close(fd)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Timed(t1 - t0, usage.ru_utime + usage.ru_stime, proc.returncode, usage.ru_maxrss * 1024)


def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15-minute load averages (``/proc/loadavg``, ``os.getloadavg``)."""
    return os.getloadavg()


def emit_result(
    metric: str,
    *,
    ours: float,
    baseline: float | None = None,
    baseline_name: str = "",
    unit: str = "",
    ratio: float | None = None,
    spread: tuple[float, float] | None = None,
    note: str = "",
    noise: float | None = None,
) -> None:
    """Print one result row for ``bench/run_all.py`` (one ``BENCH-RESULT {json}`` line on
    stdout), when :data:`RESULTS_ENV` is set (run_all sets it; a bench run by hand prints only
    its own table).

    Args:
        metric: what was measured, e.g. ``"dump K=8, wall"``.
        ours: servewatch's figure, in ``unit``.
        baseline: the baseline's figure in the same run, same unit (None: the metric has a
            bound or target instead of a baseline, say so in ``baseline_name``).
        baseline_name: what the baseline is (named, with its code in bench/).
        unit: unit of ``ours``/``baseline`` (``s``, ``ms``, ``ns/call``, ``events/s``, ``MiB``...).
        ratio: ours / baseline (default: computed from both when both are given); the median of
            per-round ratios where the bench pairs rounds.
        spread: min and max of the per-round ratios (or of ``ours`` when there is no ratio).
        note: a few words (rounds, the target).
        noise: how far ``ours`` moved between repeats within this run, in ``unit`` (half the
            min..max of its per-window values); given, the row is a cost ``bench/run_all.py``
            gates: a figure above the last one recorded in ``docs/performance.md`` by more than
            this noise (and 10 %) is marked a regression.
    """
    if not os.environ.get(RESULTS_ENV):
        return
    if ratio is None and baseline:
        ratio = ours / baseline
    row = {"metric": metric, "ours": ours, "baseline": baseline, "baseline_name": baseline_name, "unit": unit,
           "ratio": ratio, "spread": list(spread) if spread else None, "note": note, "load1": loadavg()[0],
           "noise": noise}
    print(RESULT_PREFIX + json.dumps(row), flush=True)
