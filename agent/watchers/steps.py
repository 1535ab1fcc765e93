"""Forward-step counter sources and the watcher that reports counter movement.

Owns: :class:`StepReading`, the :class:`StepSource` protocol and its two implementations —
:class:`ShmStepSource` (the SDK's shared-memory counter, exact last-step time) and
:class:`PrometheusStepSource` (a progress counter and a busy gauge scraped from ``/metrics``) —
plus :class:`StepsWatcher` (publishes ``StepsAdvanced``) and :func:`discover_shm_counters`.

May import: :mod:`agent.events`, :mod:`agent.bus` (the ``Publisher`` protocol),
:mod:`agent.sdk._counter` (the file layout only), anyio, httpx, psutil, pydantic and
prometheus_client's text parser. Never imports actors.

A source never raises because the target misbehaves: a missing file, a dead process, a refused
or malformed scrape all read as ``None`` ("no usable reading now").
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import anyio
import httpx
import psutil
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from agent.bus import Publisher
from agent.events import StepsAdvanced
from agent.sdk._counter import counter_path, read_counter, shm_dir

__all__ = [
    "PRESETS",
    "MetricsPreset",
    "StepReading",
    "StepSource",
    "ShmStepSource",
    "PrometheusStepSource",
    "StepsConfig",
    "StepsWatcher",
    "discover_shm_counters",
]

#: A counter file may be created this long before psutil's (jiffy-rounded) process start
#: time and still belong to the process, in seconds.
_CREATE_TIME_SLACK_S = 0.05


@dataclass(frozen=True, slots=True)
class StepReading:
    """One reading of a forward-progress counter.

    Attributes:
        forward_ct: counter value. For :class:`ShmStepSource` it is SGLang's ``forward_ct``
            (scheduler batches run); for :class:`PrometheusStepSource` it is the progress
            counter's value (e.g. generated tokens), summed over label sets and rounded.
        busy: work is pending (SDK ``pending > 0``, or the busy gauge ``> 0``).
        last_progress_monotonic_ns: ``CLOCK_MONOTONIC`` (ns, comparable with
            ``time.monotonic_ns()``) of the last observed progress; ``None`` before the first
            step (warm-up/compile is not progress, and never a stall).
        pid: the stepping process, or ``None`` for a server-wide scrape.
        read_monotonic_ns: when this reading was taken (``CLOCK_MONOTONIC``, ns).
    """

    forward_ct: int
    busy: bool
    last_progress_monotonic_ns: int | None
    pid: int | None
    read_monotonic_ns: int


@runtime_checkable
class StepSource(Protocol):
    """A forward-progress counter the agent can read.

    Attributes:
        name: short label used as ``counter_source`` in events (``"shm"``, ``"prometheus"``).
        pid: the process whose progress it reports, or ``None`` for a server-wide counter.
        exact: ``True`` when ``last_progress_monotonic_ns`` is the exact time of the last step
            (shared memory); ``False`` when it is only the time of the reading that saw the
            counter move (a scrape), i.e. accurate to the polling interval.
    """

    name: str
    pid: int | None
    exact: bool

    async def read(self) -> StepReading | None:
        """Take one reading; ``None`` when none is available now. Never raises for target faults."""
        ...

    async def aclose(self) -> None:
        """Release what the source holds (HTTP client); safe twice."""
        ...


# --- (a) the SDK's shared-memory counter ----------------------------------------------------


class ShmStepSource:
    """Reads the counter file ``agent.sdk.step()`` maintains in process ``pid``.

    The file is read without the target's cooperation (an ``open``/``read`` of 64 bytes on
    tmpfs). The last-step time is exact: the SDK stores ``CLOCK_MONOTONIC`` at every step.

    A reading is ``None`` when the file does not exist yet (the server has not started
    stepping), when it was written by another pid, when the process is gone, or when the file
    predates the process now holding the pid (pid reuse, stale file of a dead process).

    Args:
        pid: the stepping (scheduler) process.
        directory: folder of counter files; default :func:`agent.sdk._counter.shm_dir`
            (``$SERVEWATCH_SHM_DIR``, else ``/dev/shm``).
    """

    name = "shm"
    exact = True

    def __init__(self, pid: int, *, directory: Path | None = None) -> None:
        self.pid: int | None = pid
        self._pid = pid
        self.path = counter_path(pid, directory)
        # start_time_unix_nano of the counter file already checked against the process start
        self._verified_start_ns: int | None = None

    def _belongs_to_live_process(self, start_time_unix_nano: int) -> bool:
        if self._verified_start_ns == start_time_unix_nano:
            try:
                os.kill(self._pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        try:
            create_time_s = psutil.Process(self._pid).create_time()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        except psutil.AccessDenied:
            create_time_s = 0.0
        if start_time_unix_nano / 1e9 < create_time_s - _CREATE_TIME_SLACK_S:
            return False  # the file predates this process: the pid was reused
        self._verified_start_ns = start_time_unix_nano
        return True

    def read_now(self) -> StepReading | None:
        """Synchronous :meth:`read` (tmpfs read, microseconds); see the class docstring."""
        read_ns = time.monotonic_ns()
        snap = read_counter(self.path)
        if snap is None or snap.pid != self._pid:
            return None
        if not self._belongs_to_live_process(snap.start_time_unix_nano):
            return None
        last = snap.last_step_monotonic_ns if snap.forward_ct > 0 and snap.last_step_monotonic_ns > 0 else None
        return StepReading(
            forward_ct=snap.forward_ct,
            busy=snap.busy,
            last_progress_monotonic_ns=last,
            pid=self._pid,
            read_monotonic_ns=read_ns,
        )

    async def read(self) -> StepReading | None:
        """Read the counter file; ``None`` when missing, stale or its process is gone."""
        return self.read_now()

    async def aclose(self) -> None:
        """Nothing to release (the file is opened per read)."""


def discover_shm_counters(pids: Iterable[int] | None = None, *, directory: Path | None = None) -> dict[int, Path]:
    """Find live SDK counter files.

    Args:
        pids: keep only these pids; ``None`` keeps every live process with a counter file.
        directory: folder of counter files; default :func:`agent.sdk._counter.shm_dir`.

    Returns:
        ``{pid: path}`` for each counter file that is complete, written by that pid, and whose
        process is alive and not newer than the file (pid reuse).
    """
    folder = directory or shm_dir()
    wanted = None if pids is None else set(pids)
    found: dict[int, Path] = {}
    try:
        entries = list(folder.glob("servewatch-steps.*"))
    except OSError:
        return found
    for path in entries:
        suffix = path.name.rsplit(".", 1)[-1]
        if not suffix.isdigit():
            continue
        pid = int(suffix)
        if wanted is not None and pid not in wanted:
            continue
        if ShmStepSource(pid, directory=folder).read_now() is not None:
            found[pid] = path
    return found


# --- (b) Prometheus /metrics ---------------------------------------------------------------


class MetricsPreset(BaseModel):
    """Metric names of one server's ``/metrics``.

    Attributes:
        counter: a counter that grows while the server makes progress (full sample name,
            ``_total`` included, as the server exposes it).
        busy_gauge: a gauge that is ``> 0`` while work is running.
    """

    counter: str
    busy_gauge: str


#: Built-in presets, per SGLang's and vLLM's ``/metrics`` (SGLang needs ``--enable-metrics``).
#: SGLang has no forward-step metric, so generated tokens stand in for progress.
PRESETS: dict[str, MetricsPreset] = {
    "sglang": MetricsPreset(counter="sglang:generation_tokens_total", busy_gauge="sglang:num_running_reqs"),
    "vllm": MetricsPreset(counter="vllm:generation_tokens_total", busy_gauge="vllm:num_requests_running"),
}


def _sample_names(name: str) -> frozenset[str]:
    # prometheus_client's parser strips "_total" from a counter *family* name but keeps it on
    # the samples; we match samples, accepting the name with or without the suffix.
    if name.endswith("_total"):
        return frozenset({name})
    return frozenset({name, name + "_total"})


class PrometheusStepSource:
    """Scrapes a progress counter and a busy gauge from a Prometheus ``/metrics`` endpoint.

    The counter and the gauge are each summed over all their label sets (TP ranks, models).
    ``busy`` is ``gauge > 0``. The counter's progress time is the monotonic time at which the
    answer of the scrape that first saw the new value arrived, so it is accurate to the polling
    interval and never earlier than the real last progress;
    the first scrape that finds a non-zero counter starts the clock at that scrape. A counter
    that goes down (server restart) counts as progress.

    Args:
        url: the ``/metrics`` URL, e.g. ``http://127.0.0.1:30000/metrics``.
        preset: ``"sglang"`` or ``"vllm"`` (see :data:`PRESETS`), or ``None`` when both names
            are given.
        counter: progress counter sample name; overrides the preset's.
        busy_gauge: busy gauge name; overrides the preset's.
        client: HTTP client to use (not closed by :meth:`aclose`); default a private one.
        timeout_s: per-scrape timeout in seconds.
        pid: the process the counter belongs to, if known (events carry it).

    Raises:
        ValueError: unknown preset, or a name missing with no preset.
    """

    name = "prometheus"
    exact = False

    def __init__(
        self,
        url: str,
        *,
        preset: Literal["sglang", "vllm"] | None = "sglang",
        counter: str | None = None,
        busy_gauge: str | None = None,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 5.0,
        pid: int | None = None,
    ) -> None:
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown metrics preset {preset!r}; known: {sorted(PRESETS)}")
        base = PRESETS[preset] if preset is not None else None
        counter_name = counter or (base.counter if base else None)
        gauge_name = busy_gauge or (base.busy_gauge if base else None)
        if not counter_name or not gauge_name:
            raise ValueError("PrometheusStepSource needs a preset or both 'counter' and 'busy_gauge'")
        self.url = url
        self.pid = pid
        self.counter = counter_name
        self.busy_gauge = gauge_name
        self.timeout_s = timeout_s
        self._counter_names = _sample_names(counter_name)
        self._gauge_names = frozenset({gauge_name})
        self._client = client
        self._own_client = client is None
        self._last_value: float | None = None
        self._last_progress_ns: int | None = None
        #: scrapes that failed (refused, timeout, non-200, unparsable, metric missing)
        self.failed_scrapes = 0

    def parse(self, text: str) -> tuple[float, float] | None:
        """Sum the counter and the gauge in a Prometheus text exposition.

        Returns:
            ``(counter_sum, gauge_sum)``, or ``None`` when either metric is absent or the text
            does not parse.
        """
        counter_sum = gauge_sum = 0.0
        seen_counter = seen_gauge = False
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in self._counter_names:
                        seen_counter = True
                        counter_sum += float(sample.value)
                    elif sample.name in self._gauge_names:
                        seen_gauge = True
                        gauge_sum += float(sample.value)
        except ValueError:
            return None
        if not (seen_counter and seen_gauge) or math.isnan(counter_sum) or math.isnan(gauge_sum):
            return None
        return counter_sum, gauge_sum

    async def _get(self) -> str | None:
        if self._client is None:
            # trust_env=False: /metrics is a node-local endpoint; never route it via a proxy.
            self._client = httpx.AsyncClient(trust_env=False)
        try:
            with anyio.move_on_after(self.timeout_s):
                response = await self._client.get(self.url, timeout=self.timeout_s)
                if response.status_code != 200:
                    return None
                return response.text
        except httpx.HTTPError:
            return None
        return None

    async def read(self) -> StepReading | None:
        """Scrape once; ``None`` when the scrape fails or the counter has not started."""
        text = await self._get()
        # The time the answer arrived: the counter had its value by then. (The send time could
        # precede the last increment by a round trip and fire the watchdog early.)
        seen_ns = time.monotonic_ns()
        parsed = self.parse(text) if text is not None else None
        if parsed is None:
            self.failed_scrapes += 1
            return None
        value, gauge = parsed
        previous = self._last_value
        if previous is None:
            if value > 0:
                self._last_progress_ns = seen_ns
        elif value != previous:
            self._last_progress_ns = seen_ns
        self._last_value = value
        return StepReading(
            forward_ct=int(round(value)),
            busy=gauge > 0,
            last_progress_monotonic_ns=self._last_progress_ns,
            pid=self.pid,
            read_monotonic_ns=seen_ns,
        )

    async def aclose(self) -> None:
        """Close the private HTTP client; safe twice."""
        client, self._client = self._client, None
        if client is not None and self._own_client:
            await client.aclose()


# --- the watcher ----------------------------------------------------------------------------


class StepsConfig(BaseModel):
    """User settings of the step-counter watcher.

    Attributes:
        interval_s: seconds between readings (fixed rate). Default 1.0.
        metrics_preset: ``"sglang"`` (default) or ``"vllm"``, for the Prometheus source.
        counter: override of the preset's progress counter name.
        busy_gauge: override of the preset's busy gauge name.
        scrape_timeout_s: per-scrape timeout of ``/metrics`` in seconds. Default 5.0.
    """

    interval_s: float = Field(default=1.0, gt=0)
    metrics_preset: Literal["sglang", "vllm"] | None = "sglang"
    counter: str | None = None
    busy_gauge: str | None = None
    scrape_timeout_s: float = Field(default=5.0, gt=0)


class StepsWatcher:
    """Publishes ``StepsAdvanced`` (high-rate, may be dropped) whenever the counter moves.

    Readings are taken on a fixed-rate schedule (no drift; missed slots are skipped, not
    bunched). The first reading only sets the baseline.

    Args:
        source: the counter to read.
        interval_s: seconds between readings.
    """

    name = "steps"

    def __init__(self, source: StepSource, *, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.source = source
        self.interval_s = interval_s

    async def run(self, bus: Publisher, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Read until cancelled; publish on movement. Ready at once.

        The caller owns the source (it may be shared with a :class:`~agent.watchers.watchdog.Watchdog`)
        and closes it with ``await source.aclose()``.
        """
        interval_ns = int(self.interval_s * 1e9)
        last_ct: int | None = None
        task_status.started()
        next_ns = time.monotonic_ns()
        while True:
            reading = await self.source.read()
            if reading is not None:
                if last_ct is not None and reading.forward_ct != last_ct:
                    bus.publish_nowait(
                        StepsAdvanced(
                            source=self.name,
                            pid=reading.pid,
                            forward_ct=reading.forward_ct,
                            delta=reading.forward_ct - last_ct,
                            busy=reading.busy,
                        )
                    )
                last_ct = reading.forward_ct
            now = time.monotonic_ns()
            next_ns += interval_ns
            if next_ns <= now:  # overran: skip the missed slots, keep the phase
                next_ns += ((now - next_ns) // interval_ns + 1) * interval_ns
            await anyio.sleep((next_ns - now) / 1e9)
