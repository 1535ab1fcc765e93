"""Forward-step counter sources and the watcher that reports counter movement.

Owns: :class:`StepReading`, the :class:`StepSource` protocol and its two implementations —
:class:`ShmStepSource` (the SDK's shared-memory counter, exact last-step time) and
:class:`PrometheusStepSource` (a progress counter and a busy gauge scraped from ``/metrics``) —
plus :class:`StepsWatcher` (publishes ``StepsAdvanced``) and :func:`discover_shm_counters`.

May import: :mod:`agent.model.events`, :mod:`agent.model.bus` (the ``Publisher`` protocol),
:mod:`agent.sdk.counter` (the SDK's public counter file layout and reader), anyio, httpx,
psutil, pydantic and prometheus_client's text parser. Never imports actors or a private SDK
module.

A source never raises because the target misbehaves: a missing file, a dead process, a refused
or malformed scrape all read as ``None`` ("no usable reading now").
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, runtime_checkable

import anyio
import psutil
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus
from pydantic import BaseModel

from agent.host.fsutil import memory_backed
from agent.host.security import open_trusted, process_uids
from agent.model.bus import Publisher
from agent.model.events import StepsAdvanced
from agent.model.lazy import LazyModule
from agent.model.ticks import until_tick
from agent.sdk.counter import SIZE_BYTES, counter_files, counter_path, parse_counter, shm_dir
from agent.watchers.config import StepsConfig

if TYPE_CHECKING:
    import httpx
    from prometheus_client import parser as prometheus_parser
    from prometheus_client.samples import Sample

    from agent.watchers.inflight import OpenRequestsReader
else:
    httpx = LazyModule("httpx")  # imported at first use: a fast CLI cold start
    prometheus_parser = LazyModule("prometheus_client.parser")  # at the first scrape parsed

__all__ = [
    "MAX_METRICS_BODY_BYTES",
    "MAX_SERIES",
    "PRESETS",
    "MetricsPreset",
    "PrometheusStepSource",
    "RecentReading",
    "ShmStepSource",
    "StepReading",
    "StepSource",
    "StepsConfig",
    "StepsWatcher",
    "discover_shm_counters",
    "series_name",
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
        series: the label set of a Prometheus series (``engine="1"``); ``""`` for a whole
            counter (shared memory, or a sum).
        busy_since_ns: when the work pending became pending, where the reading knows it
            (``CLOCK_MONOTONIC`` ns): a request the kernel says the server received then, while
            the server's gauges say idle or on the first busy scrape after an idle gap;
            ``None`` otherwise.
        preempted_since_progress: requests the engine preempted since this series' last
            progress (the preset's churn counter, vLLM's ``vllm:num_preemptions_total``); with
            work pending and no output it is a livelock (vLLM #25538). 0 when unknown.
        preempted_since_ns: ``CLOCK_MONOTONIC`` ns since which ``preempted_since_progress``
            counts (the last progress, else the first reading); ``None`` when unknown.
    """

    forward_ct: int
    busy: bool
    last_progress_monotonic_ns: int | None
    pid: int | None
    read_monotonic_ns: int
    series: str = ""
    busy_since_ns: int | None = None
    preempted_since_progress: int = 0
    preempted_since_ns: int | None = None


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


class _OffTheLoop(Exception):
    """A counter reading needs a ``/proc`` read: take it on a worker thread."""


class ShmStepSource:
    """Reads the counter file ``agent.sdk.step()`` maintains in process ``pid``.

    The file is read without the target's cooperation (an ``open``/``read`` of 64 bytes on
    tmpfs). The last-step time is exact: the SDK stores ``CLOCK_MONOTONIC`` at every step.

    A reading is ``None`` when the file does not exist yet (the server has not started
    stepping), when it was written by another pid, when the process is gone, or when the file
    predates the process now holding the pid (pid reuse, stale file of a dead process). It is
    also ``None`` when the file is a symlink or is owned by anyone but the process's uid or
    root, or sits in a folder that is not its user's private one (:mod:`agent.sdk.folders`):
    another local user can create ``/dev/shm/servewatch-<uid>/servewatch-steps.<pid>`` first for
    a server that does not use the SDK, and a forged stall must never dump, let alone signal,
    that server.

    Args:
        pid: the stepping (scheduler) process.
        directory: folder of counter files; default :func:`agent.sdk.counter.shm_dir`
            (``$SERVEWATCH_SHM_DIR``, else ``/dev/shm``).
        uid: the process's uid, when known (else read from ``/proc/PID``).
    """

    name = "shm"
    exact = True

    def __init__(self, pid: int, *, directory: Path | None = None, uid: int | None = None) -> None:
        self.pid: int | None = pid
        self._pid = pid
        self._uids: tuple[int, ...] | None = (uid,) if uid is not None else None
        self.path = counter_path(pid, directory)
        # start_time_unix_nano of the counter file already checked against the process start
        self._verified_start_ns: int | None = None
        # whether the counter file is on a memory filesystem (decided once, at the first reading)
        self._memory_backed: bool | None = None
        #: the last reading :meth:`read` returned that was not ``None`` (:class:`RecentReading`)
        self.last: StepReading | None = None

    def _belongs_to_live_process(self, start_time_unix_nano: int, *, on_loop: bool = False) -> bool:
        if self._verified_start_ns == start_time_unix_nano:
            try:
                os.kill(self._pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        if on_loop:  # a new counter file: its check reads /proc, off the loop
            raise _OffTheLoop
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

    def read_now(self, *, on_loop: bool = False) -> StepReading | None:
        """Synchronous :meth:`read` (tmpfs read, microseconds); see the class docstring.

        Raises:
            _OffTheLoop: with ``on_loop``, when the reading needs more than the counter file
                (the process's uids, or a new file checked against the process's start).
        """
        if on_loop and self._uids is None:
            raise _OffTheLoop
        if self._uids is None:
            self._uids = process_uids(self._pid)
            if not self._uids:
                self._uids = None
                return None
        raw = open_trusted(self.path, self._uids, max_bytes=SIZE_BYTES)
        # the reading's time: once the file is read, so no step it records is later than it (a
        # time taken before the read could precede a step the process wrote meanwhile)
        read_ns = time.monotonic_ns()
        snap = None if raw is None else parse_counter(raw)
        if snap is None or snap.pid != self._pid:
            return None
        if not self._belongs_to_live_process(snap.start_time_unix_nano, on_loop=on_loop):
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
        """Read the counter file; ``None`` when missing, stale or its process is gone.

        On a memory filesystem (``/dev/shm`` is tmpfs), once a first reading verified the file,
        the read is done on the event loop: an ``open``/``fstat``/``read`` of 64 bytes of memory
        and a ``kill(pid, 0)``, a few microseconds, where a worker-thread hop costs ~100 us of
        CPU (measured here), several times a second per watched rank. Elsewhere, and for the
        first reading of a file, on a worker thread.
        """
        reading: StepReading | None
        if self._memory_backed:
            try:
                reading = self.read_now(on_loop=True)
            except _OffTheLoop:
                reading = await anyio.to_thread.run_sync(self._read_off_loop)
        else:
            reading = await anyio.to_thread.run_sync(self._read_off_loop)
        if reading is not None:
            self.last = reading
        return reading

    def _read_off_loop(self) -> StepReading | None:
        reading = self.read_now()
        if reading is not None and self._memory_backed is None:
            self._memory_backed = memory_backed(self.path)  # one mountinfo read per source
        return reading

    async def aclose(self) -> None:
        """Nothing to release (the file is opened per read)."""


class RecentReading:
    """A second reader of one :class:`ShmStepSource`: :meth:`read` returns the reading the
    source's other reader took at most ``max_age_s`` ago, and reads the file itself only when
    there is none that recent. The per-target watchdog and step watcher share one counter read
    a second this way (one worker-thread hop and file open instead of two).

    Args:
        source: the shared source (its owner closes it).
        max_age_s: oldest reading reused, seconds (> 0).

    Raises:
        ValueError: ``max_age_s`` is not > 0.
    """

    exact = True

    def __init__(self, source: ShmStepSource, *, max_age_s: float) -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.source = source
        self.name = source.name
        self.pid = source.pid
        self.max_age_ns = int(max_age_s * 1e9)
        #: readings taken from the file by this reader (the others were shared)
        self.own_reads = 0

    async def read(self) -> StepReading | None:
        """The shared source's last reading when recent enough, else a fresh one (``None`` when
        the counter is missing, stale or its process is gone)."""
        last = self.source.last
        if last is not None and time.monotonic_ns() - last.read_monotonic_ns <= self.max_age_ns:
            return last
        self.own_reads += 1
        return await self.source.read()

    async def aclose(self) -> None:
        """Nothing to release (the shared source's owner closes it)."""


def discover_shm_counters(pids: Iterable[int] | None = None, *, directory: Path | None = None) -> dict[int, Path]:
    """Find live SDK counter files.

    Args:
        pids: keep only these pids; ``None`` keeps every live process with a counter file.
        directory: folder of counter files; default :func:`agent.sdk.counter.shm_dir`.

    Returns:
        ``{pid: path}`` for each counter file that is complete, written by that pid, and whose
        process is alive and not newer than the file (pid reuse).
    """
    folder = directory or shm_dir()
    wanted = None if pids is None else set(pids)
    found: dict[int, Path] = {}
    for pid, path in sorted(counter_files(folder).items()):
        if wanted is not None and pid not in wanted:
            continue
        if ShmStepSource(pid, directory=folder).read_now() is not None:
            found[pid] = path
    return found


# --- (b) Prometheus /metrics ---------------------------------------------------------------


class MetricsPreset(BaseModel):
    """Metric names of one server's ``/metrics``.

    Attributes:
        counter: a counter that grows on every engine step while the server makes progress (full
            sample name, ``_total`` / ``_count`` included, as the server exposes it).
        fallback_counters: counters tried in order when ``counter`` is absent (older releases).
        busy_gauge: a gauge that is ``> 0`` while work is running.
        queued_gauge: a gauge of requests waiting to be scheduled, added to ``busy_gauge``: a
            server with queued requests and no step is stalled too.
        summed_labels: labels of the counter summed over (a category label such as SGLang's
            ``mode``: one progress series per engine, not per category).
        step_gauges: gauges the engine republishes at every step: any change of one is a step
            even when the counter stands still.
        churn_counter: a counter of work undone (vLLM's ``vllm:num_preemptions_total``): a
            step gauge that moved in an interval where it advanced is preempt/resume churn, not
            a step. Progress is work completed (tokens out, steps with output), never a gauge
            that moves (vLLM #25538: preempted every step, no output token, KV usage moving).
    """

    counter: str
    fallback_counters: tuple[str, ...] = ()
    busy_gauge: str
    queued_gauge: str | None = None
    summed_labels: tuple[str, ...] = ()
    step_gauges: tuple[str, ...] = ()
    churn_counter: str | None = None


#: Built-in presets, per SGLang's and vLLM's ``/metrics`` (SGLang needs ``--enable-metrics``).
#: Progress is a series that advances on every engine step, prefill-only steps too: a long
#: chunked prefill (minutes; vLLM #25677) generates no token while the engine works, and is no
#: stall. vLLM: ``vllm:iteration_tokens_total`` is a histogram with one observation per engine
#: step that produced output (its ``_count``; measured on vLLM 0.32: a 198-token prompt prefilled
#: in 7 chunks of 32 tokens counts once, at its first token). Its scheduler statistics, though,
#: reach ``/metrics`` after every step, outputs or not (``Scheduler.update_from_output``: "we must
#: return the stats even if there are no request outputs this step"), and a prefill chunk
#: allocates KV blocks: a change of ``vllm:kv_cache_usage_perc`` is a step too. SGLang: ``sglang:cuda_graph_passes_total{mode}`` counts forward passes
#: (prefill and decode, with or without CUDA graphs); before it existed,
#: ``sglang:realtime_tokens_total{mode}`` (prefill and decode tokens, per log interval), then
#: generated tokens. Busy is running plus queued (waiting) requests, for both.
PRESETS: dict[str, MetricsPreset] = {
    "sglang": MetricsPreset(
        counter="sglang:cuda_graph_passes_total",
        fallback_counters=("sglang:realtime_tokens_total", "sglang:generation_tokens_total"),
        busy_gauge="sglang:num_running_reqs",
        queued_gauge="sglang:num_queue_reqs",
        summed_labels=("mode",),
    ),
    "vllm": MetricsPreset(
        counter="vllm:iteration_tokens_total_count",
        fallback_counters=("vllm:generation_tokens_total",),
        busy_gauge="vllm:num_requests_running",
        queued_gauge="vllm:num_requests_waiting",
        step_gauges=("vllm:kv_cache_usage_perc",),
        churn_counter="vllm:num_preemptions_total",
    ),
}


def _sample_names(name: str) -> frozenset[str]:
    # prometheus_client's parser strips "_total" from a counter *family* name but keeps it on
    # the samples; we match samples, accepting the name with or without the suffix.
    if name.endswith("_total"):
        return frozenset({name})
    return frozenset({name, name + "_total"})


#: Most bytes of a ``/metrics`` answer read; a bigger answer makes the source blind.
MAX_METRICS_BODY_BYTES = 8 * 1024 * 1024

#: A counter series absent from this many successful scrapes in a row is forgotten (label sets
#: that come and go, e.g. per-request or per-restart labels, never pile up in the agent).
SERIES_FORGET_SCRAPES = 60
#: Most label sets of the progress counter (or the busy gauge) one scrape may hold: more make the
#: source blind ("too many series"), since a label whose value changes every scrape (a request
#: id, a timestamp) makes every series new and would only fill the agent's memory.
MAX_SERIES = 512
#: Most counter series remembered at once (present or recently absent); past it the longest
#: absent are forgotten first.
MAX_TRACKED_SERIES = 2 * MAX_SERIES

#: One label set, as sorted ``(name, value)`` pairs.
LabelKey = tuple[tuple[str, str], ...]


def series_name(labels: LabelKey) -> str:
    """``engine="0",model_name="m"`` for a label set; ``""`` for none."""
    return ",".join(f'{k}="{v}"' for k, v in labels)


def _similar_names(wanted: str, present: Iterable[str], limit: int = 4) -> list[str]:
    """Names in ``present`` that look like ``wanted`` (renamed metric, other server's prefix)."""
    import difflib

    names = sorted(set(present))
    close = difflib.get_close_matches(wanted, names, n=limit, cutoff=0.6)
    tail = wanted.split(":", 1)[-1].removesuffix("_total")
    for name in names:
        if len(close) >= limit:
            break
        if name not in close and tail and tail in name:
            close.append(name)
    return close


class _SeriesTrack:
    """Progress bookkeeping of one counter series."""

    __slots__ = ("churn", "churn_base", "churn_base_ns", "last_progress_ns", "mark", "missed", "restarts", "value")

    def __init__(self) -> None:
        self.value: float | None = None
        #: the step gauges' values at the last reading (a change is a step)
        self.mark: tuple[float, ...] | None = None
        self.last_progress_ns: int | None = None
        self.restarts = 0
        #: successful scrapes in a row without this series
        self.missed = 0
        #: the churn counter (preemptions) at the last reading, and at the last progress (or the
        #: first reading) with when that was
        self.churn: float | None = None
        self.churn_base: float | None = None
        self.churn_base_ns: int | None = None

    def _progressed(self, seen_ns: int) -> None:
        self.last_progress_ns = seen_ns
        self.churn_base, self.churn_base_ns = self.churn, seen_ns

    @property
    def churned(self) -> int:
        """Churn (preemptions) since the last progress, or the first reading; 0 when unknown."""
        if self.churn is None or self.churn_base is None:
            return 0
        return max(0, round(self.churn - self.churn_base))

    def _churn(self, churn: float | None, seen_ns: int) -> bool:
        """Take the churn counter's reading; whether it advanced since the last one."""
        previous, self.churn = self.churn, churn
        if churn is None:
            return False
        if self.churn_base is None or previous is None or churn < previous:  # first seen, or restarted
            self.churn_base, self.churn_base_ns = churn, seen_ns
            return False
        return churn > previous

    def observe(self, value: float, seen_ns: int, mark: tuple[float, ...] | None = None, churn: float | None = None) -> bool:
        """Record a reading (``mark``: the step gauges' values, a change of which is a step with
        the counter unchanged, unless ``churn``, the churn counter, advanced with it: preempt/
        resume moves the gauges and completes nothing); returns whether the counter went
        backwards (a restart)."""
        previous = self.value
        self.value = value
        previous_mark, self.mark = self.mark, mark
        churned = self._churn(churn, seen_ns)
        if previous is not None and value == previous and mark is not None and previous_mark is not None and mark != previous_mark:
            if not churned and (value > 0 or self.last_progress_ns is not None):
                self._progressed(seen_ns)
            return False
        if previous is None:
            if value > 0:
                self._progressed(seen_ns)
            return False
        if value > previous:
            self._progressed(seen_ns)
            return False
        if value < previous:
            # a restart, not progress: warm-up after it is not a stall; the clock starts at
            # the first step of the new process
            self.restarts += 1
            self.last_progress_ns = None
            self.churn_base, self.churn_base_ns = self.churn, seen_ns
            return True
        return False


_V = TypeVar("_V")


def _labelled(values: Mapping[LabelKey, _V], key: LabelKey) -> _V | None:
    """The value of a counter series' labels among ``values`` (step gauges, the churn counter):
    same labels, else the one whose labels all match, else none (a value that cannot be told
    apart is no evidence)."""
    if not values:
        return None
    value = values.get(key)
    if value is not None:
        return value
    matching = [v for g, v in values.items() if g and set(g) <= set(key)]
    return matching[0] if len(matching) == 1 else None


def _preset_of(preset: str | None) -> MetricsPreset | None:
    """The named preset (``None``: none); ValueError when unknown."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown metrics preset {preset!r}; known: {sorted(PRESETS)}")
    return PRESETS[preset] if preset is not None else None


def _metric_names(
    base: MetricsPreset | None, counter: str | None, busy_gauge: str | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The counter names to try and the busy gauges to sum; ValueError when a name is missing."""
    counter_name = counter or (base.counter if base else None)
    gauge_name = busy_gauge or (base.busy_gauge if base else None)
    if not counter_name or not gauge_name:
        raise ValueError("PrometheusStepSource needs a preset or both 'counter' and 'busy_gauge'")
    counters = (counter_name,) if counter or base is None else (counter_name, *base.fallback_counters)
    queued = (base.queued_gauge,) if base is not None and not busy_gauge and base.queued_gauge else ()
    return counters, (gauge_name, *queued)


class PrometheusStepSource:
    """Scrapes a progress counter and a busy gauge from a Prometheus ``/metrics`` endpoint.

    Each label set of the counter (vLLM's data-parallel ``engine="0"``/``"1"``, several models,
    ranks) is tracked as its own series (:meth:`read_series`): one engine stuck while another
    progresses is a stall of that engine, which a sum would hide. A series' busy flag is the
    busy gauge with the same labels when the server exposes one, else the gauge summed.
    :meth:`read` gives the sum over every series (the ``StepsWatcher`` view).

    A series' progress time is the monotonic time at which the answer of the scrape that first
    saw the new value arrived, so it is accurate to the polling interval and never earlier than
    the real last progress; the first scrape that finds a non-zero counter starts the clock at
    that scrape. A counter that goes down is a server restart, not progress: the clock waits
    for the next step.

    The answer is read with a cap (``max_body_bytes``, default 8 MiB). What the source can see
    after each scrape is :meth:`status` (``ready`` / ``waiting`` / ``blind`` with the reason):
    401/403/404, refused, timeout, an oversized or unparsable answer, the preset's names absent
    (with similar names that exist), a NaN or infinite value all make it blind, and such a
    scrape reads as ``None``.

    Args:
        url: the ``/metrics`` URL, e.g. ``http://127.0.0.1:30000/metrics``.
        preset: ``"sglang"`` or ``"vllm"`` (see :data:`PRESETS`), or ``None`` when both names
            are given.
        counter: progress counter sample name; overrides the preset's.
        busy_gauge: busy gauge name; overrides the preset's.
        client: HTTP client to use (not closed by :meth:`aclose`); default a private one.
        timeout_s: per-scrape timeout in seconds.
        pid: the process the counter belongs to, if known (events carry it).
        max_body_bytes: most bytes of an answer read.
        open_requests: also count a request the server accepted and has not answered as busy
            (:mod:`agent.watchers.inflight`: the kernel's state of the connections to the URL's
            port, when that is a local address). vLLM and SGLang publish their running/waiting
            gauges only after an engine step: a forward that hangs in the first step after an
            idle spell leaves them at 0, and only the open connection says work is pending. It
            makes every series busy only while no series' gauge is busy (a data-parallel engine
            with nothing to do stays idle while another one works).
        open_request_quiet_s: a connection quiet both ways for this long and still open is an
            open request (a streaming response whose headers went out); above the server's
            keep-alive timeout (uvicorn's: 5 s).
        open_request_idle_reuse_s: while the gauges say idle, a reading of no open request
            stands this long (seconds; 0: read at every scrape); a request found at a later
            reading is dated from when the kernel received it (``StepReading.busy_since_ns``).

    Raises:
        ValueError: unknown preset, or a name missing with no preset.
    """

    name = "prometheus"
    exact = False
    #: name of this source in watcher statuses
    status_name = "metrics"
    #: the watchdog may read it less often while every series is idle
    #: (:func:`agent.watchers.watchdog.idle_poll_max_s`): a scrape costs an HTTP round trip, and
    #: the first busy reading after such a gap is dated by the open requests (``read_series``)
    idle_backoff = True

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
        max_body_bytes: int = MAX_METRICS_BODY_BYTES,
        refused_grace_s: float = 0.0,
        open_requests: bool = False,
        open_request_idle_reuse_s: float = 0.0,
        open_request_quiet_s: float = 10.0,
    ) -> None:
        base = _preset_of(preset)
        counters, gauges = _metric_names(base, counter, busy_gauge)
        self.url = url
        self.pid = pid
        self.preset = preset
        #: the progress counter in use (the first of the candidates the server exposes)
        self.counter = counters[0]
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        #: counter names tried in order; an explicit ``counter`` is the only one
        self.counters: tuple[str, ...] = counters
        #: busy = the sum of these gauges (running, and queued where the preset has it)
        self.busy_gauges: tuple[str, ...] = gauges
        self.busy_gauge = " + ".join(gauges)
        own = base if base is not None and not counter else None  # the preset's names, not overridden
        self._summed_labels = frozenset(own.summed_labels if own else ())
        #: gauges whose change is a step (preset only; not with an explicit counter)
        self.step_gauges: tuple[str, ...] = own.step_gauges if own else ()
        self._marks: dict[LabelKey, tuple[float, ...]] = {}
        #: the counter whose advance makes a step gauge's move churn, not a step (preset only)
        self.churn_counter: str | None = own.churn_counter if own else None
        self._churn: dict[LabelKey, float] = {}
        #: the last answer that parsed, and what it gave (an idle server answers the same text
        #: scrape after scrape: it is not parsed again)
        self._last_text: str | None = None
        self._last_parsed: tuple[dict[LabelKey, float], dict[LabelKey, float]] | None = None
        self._set_sample_names()
        self._client = client
        self._own_client = client is None
        self._total = _SeriesTrack()
        self._series: dict[LabelKey, _SeriesTrack] = {}
        #: scrapes that failed (refused, timeout, non-200, unparsable, metric missing)
        self.failed_scrapes = 0
        #: times a counter went backwards (server restarts)
        self.restarts = 0
        self._state = "waiting"
        self._reason = f"waiting for the first scrape of {url}"
        self._problem = ""
        #: "connection refused" before the first answer within this long is a server starting
        self.refused_grace_s = refused_grace_s
        #: one line on the server's ranks still in start-up (``None``: none, or not known): then
        #: "connection refused" says the server is starting (:func:`agent.watchers.health.refused_status`)
        self.starting: Callable[[], str | None] | None = None
        self._created_s = time.monotonic()
        self._answered = False
        from agent.watchers.inflight import local_port_of

        #: the local port whose connections say a request is open (``None``: not watched)
        self.requests_port: int | None = local_port_of(url) if open_requests else None
        self.open_request_quiet_s = open_request_quiet_s
        #: seconds a reading of no open request stands while the gauges say idle (the next one
        #: dates a request found then from when the kernel received it)
        self.open_request_idle_reuse_s = open_request_idle_reuse_s
        #: open requests on :attr:`requests_port` at the last reading (``None``: not known)
        self.open_requests: int | None = None
        self._requests_reader: OpenRequestsReader | None = None
        self._open_since_ns: int | None = None

    def _set_sample_names(self) -> None:
        """The sample names parsed, and the prefixes of their lines."""
        self._canonical = {name: c for c in self.counters for name in _sample_names(c)}
        self._counter_names = frozenset(self._canonical)
        self._churn_names = {self.churn_counter} if self.churn_counter else set()
        self._gauge_names = frozenset(self.busy_gauges)
        # a sample line starts with its name, then labels or a space
        self._line_prefixes = tuple(n + c for n in sorted(self._counter_names | self._gauge_names | set(self.step_gauges) | self._churn_names)
                                    for c in "{ \t")

    # -- status ---------------------------------------------------------------------------

    def status(self) -> tuple[str, str]:
        """``(state, reason)`` after the last scrape: ``ready``, ``waiting`` or ``blind``."""
        return self._state, self._reason

    def _blind(self, reason: str) -> None:
        self._state, self._reason = "blind", reason

    # -- parsing --------------------------------------------------------------------------

    def parse_series(self, text: str) -> tuple[dict[LabelKey, float], dict[LabelKey, float]] | None:
        """Counter and gauge values per label set; ``None`` (and a blind status) when the text
        does not parse, a name is absent, or a value is NaN or infinite."""
        # Only the two metrics' sample lines are parsed (a server's /metrics has hundreds of
        # others, histograms above all); the whole text only when they are not all there, to
        # name what is (the blind status's hints) or to report text that does not parse.
        wanted = self._line_prefixes
        lines = [line for line in text.splitlines() if line.startswith(wanted)]
        if lines:
            parsed = self._parse_samples("\n".join(lines) + "\n")
            if parsed is not None and parsed[0] and parsed[1]:
                counters, gauges, _ = parsed
                return self._checked(counters, gauges)
        parsed = self._parse_samples(text)
        if parsed is None:
            return None
        counters, gauges, present = parsed
        wanted_names = ((self.counters, counters), (self.busy_gauges[:1], gauges))
        missing = [names for names, seen in wanted_names if not seen]
        if missing:
            self._blind_missing(missing, present)
            return None
        return self._checked(counters, gauges)

    def _blind_missing(self, missing: list[tuple[str, ...]], present: set[str]) -> None:
        """Blind: the ``missing`` names are absent, with similar names among ``present``."""
        preset = f" (preset {self.preset})" if self.preset else ""
        hints = []
        for names in missing:
            similar = list(dict.fromkeys(n for name in names for n in _similar_names(name, present)))[:4]
            hints.append(f"{names[-1]}: " + (f"similar names there: {', '.join(similar)}" if similar else "nothing similar"))
        said = " and ".join(names[0] if len(names) == 1 else f"{names[0]} (or {', '.join(names[1:])})" for names in missing)
        self._blind(
            f"{said} absent from {self.url}{preset}; expected counter {' or '.join(self.counters)} and"
            f" gauge {self.busy_gauge}; " + "; ".join(hints)
            + " (wrong --metrics-preset, or the server renamed its metrics: set metrics.counter / metrics.busy_gauge)"
        )

    def _parse_samples(self, text: str) -> tuple[dict[LabelKey, float], dict[LabelKey, float], set[str]] | None:
        """Counter and gauge values per label set and every sample name in ``text``; ``None``
        (and a blind status) when it does not parse."""
        by_name: dict[str, dict[LabelKey, float]] = {}
        marks: dict[LabelKey, dict[str, float]] = {}
        churn: dict[LabelKey, float] = {}
        gauges: dict[LabelKey, float] = {}
        present: set[str] = set()
        try:
            for family in prometheus_parser.text_string_to_metric_families(text):
                for sample in family.samples:
                    present.add(sample.name)
                    self._take_sample(sample, by_name, gauges, marks, churn)
        except (ValueError, TypeError, IndexError) as exc:
            self._blind(f"answer from {self.url} is not Prometheus text ({str(exc)[:120]})")
            return None
        chosen = next((c for c in self.counters if by_name.get(c)), None)
        if chosen is not None:
            self.counter = chosen
        self._marks = {k: tuple(v[n] for n in sorted(v)) for k, v in marks.items()}
        self._churn = {k: v for k, v in churn.items() if math.isfinite(v)}
        return by_name.get(chosen, {}) if chosen else {}, gauges, present

    def _take_sample(
        self,
        sample: Sample,
        by_name: dict[str, dict[LabelKey, float]],
        gauges: dict[LabelKey, float],
        marks: dict[LabelKey, dict[str, float]],
        churn: dict[LabelKey, float],
    ) -> None:
        """Add one sample to the values of the metric it belongs to (if any)."""
        if sample.name in self._counter_names:
            key = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in self._summed_labels))
            values = by_name.setdefault(self._canonical[sample.name], {})
            values[key] = values.get(key, 0.0) + float(sample.value)
        elif sample.name in self._gauge_names:
            key = tuple(sorted(sample.labels.items()))
            gauges[key] = gauges.get(key, 0.0) + float(sample.value)
        if sample.name in self.step_gauges:
            key = tuple(sorted(sample.labels.items()))
            marks.setdefault(key, {})[sample.name] = float(sample.value)
        elif sample.name in self._churn_names:
            churn[tuple(sorted(sample.labels.items()))] = float(sample.value)

    def _checked(
        self, counters: dict[LabelKey, float], gauges: dict[LabelKey, float]
    ) -> tuple[dict[LabelKey, float], dict[LabelKey, float]] | None:
        """``(counters, gauges)``, or ``None`` (and a blind status) when a value is NaN,
        infinite, or a counter overflows."""
        for kind, name, values in (("counter", self.counter, counters), ("gauge", self.busy_gauge, gauges)):
            for key, value in values.items():
                if not math.isfinite(value):
                    shown = "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
                    where = f"{{{series_name(key)}}}" if key else ""
                    self._blind(f"{kind} {name}{where} is {shown} at {self.url}; progress cannot be judged")
                    return None
                if kind == "counter" and abs(value) >= 2.0**63:
                    where = f"{{{series_name(key)}}}" if key else ""
                    self._blind(f"counter {name}{where} overflows ({value:g}) at {self.url}; progress cannot be judged")
                    return None
        return counters, gauges

    def parse(self, text: str) -> tuple[float, float] | None:
        """Sum the counter and the gauge in a Prometheus text exposition.

        Returns:
            ``(counter_sum, gauge_sum)``, or ``None`` when either metric is absent, a value is
            NaN or infinite, or the text does not parse.
        """
        parsed = self.parse_series(text)
        if parsed is None:
            return None
        counters, gauges = parsed
        return sum(counters.values()), sum(gauges.values())

    # -- scraping -------------------------------------------------------------------------

    async def _get(self) -> str | None:
        from agent.watchers.health import (
            ERROR_REFUSED,
            classify_error,
            http_status_text,
            read_capped,
            refused_status,
        )

        if self._client is None:
            # trust_env=False: /metrics is a node-local endpoint; never route it via a proxy.
            self._client = httpx.AsyncClient(trust_env=False)
        with anyio.move_on_after(self.timeout_s):
            try:
                async with self._client.stream("GET", self.url, timeout=self.timeout_s) as response:
                    if response.status_code != 200:
                        code = response.status_code
                        hint = {
                            401: " (the endpoint needs credentials we do not have)",
                            403: " (the endpoint needs credentials we do not have)",
                            404: " (wrong path, or metrics disabled: SGLang needs --enable-metrics)",
                        }.get(code, "")
                        self._blind(f"{http_status_text(code)} from {self.url}{hint}")
                        return None
                    self._answered = True
                    body, truncated = await read_capped(response, self.max_body_bytes)
                    if truncated:
                        self._blind(
                            f"answer from {self.url} is larger than {self.max_body_bytes // (1024 * 1024)} MiB;"
                            " not read further"
                        )
                        return None
                    return body.decode("utf-8", "replace")
            except httpx.HTTPError as exc:
                if classify_error(exc) == ERROR_REFUSED and not self._answered and (
                    time.monotonic() - self._created_s < self.refused_grace_s
                ):
                    self._state, self._reason = "waiting", (
                        f"server starting: nothing listens at {self.url} yet"
                        f" (waiting up to {self.refused_grace_s:g} s for it to listen)"
                    )
                elif classify_error(exc) == ERROR_REFUSED:
                    self._state, self._reason = refused_status(self.url, self.starting)
                else:
                    self._blind(f"cannot scrape {self.url}: {type(exc).__name__}: {str(exc)[:120]}")
                return None
        self._blind(f"no answer within {self.timeout_s:g} s from {self.url}")
        return None

    async def read_series(self, *, after_idle_gap: bool = False) -> list[StepReading] | None:
        """Scrape once; one reading per counter label set (``series`` names it), or ``None``
        when the scrape fails (see :meth:`status`).

        Args:
            after_idle_gap: the previous scrape found every series idle and this one comes later
                than the watchdog's poll interval (it backed off): when the gauges say busy now,
                the open requests are read afresh and date the busy readings from when the
                kernel received the oldest one (``busy_since_ns``), so the stall clock starts
                when the work arrived, not when the slower scrape saw it."""
        text = await self._get()
        # The time the answer arrived: the counter had its value by then. (The send time could
        # precede the last increment by a round trip and fire the watchdog early.)
        seen_ns = time.monotonic_ns()
        parsed = self._parsed(text)
        if parsed is None or self._too_many_series(*parsed):
            self.failed_scrapes += 1
            return None
        counters, gauges = parsed
        pending, pending_since = await self._pending(sum(gauges.values()), after_idle_gap)
        restarted: list[str] = []
        readings = [
            self._series_reading(key, counters[key], gauges, seen_ns, pending, pending_since, restarted)
            for key in sorted(counters)
        ]
        if len(self._series) > len(counters):
            self._forget_absent(counters)
        all_marks = tuple(v for k in sorted(self._marks) for v in self._marks[k]) or None
        all_churn = sum(self._churn.values()) if self._churn else None
        if self._total.observe(sum(counters.values()), seen_ns, all_marks, all_churn) and not restarted:
            restarted.append(self.counter)
        self._settle_status(counters, readings, restarted)
        return readings

    async def _pending(self, gauge_total: float, after_idle_gap: bool) -> tuple[bool, int | None]:
        """``(pending, since_ns)``: an open request makes the series busy (only while no gauge
        says busy), and when the oldest was received (read while the gauges say idle, and
        afresh on a busy scrape after an idle gap, to date it; ``None``: none, or not read)."""
        dating = after_idle_gap and gauge_total > 0
        if gauge_total > 0 and not dating:
            return False, None
        found = await self._open_requests(fresh=dating)
        return bool(found) and gauge_total <= 0, self._open_since_ns if found else None

    def _parsed(self, text: str | None) -> tuple[dict[LabelKey, float], dict[LabelKey, float]] | None:
        """``parse_series(text)``, the last result again when the text is the same."""
        if text is not None and text == self._last_text and self._last_parsed is not None:
            return self._last_parsed
        parsed = self.parse_series(text) if text is not None else None
        self._last_text, self._last_parsed = (text, parsed) if parsed is not None else (None, None)
        return parsed

    def _too_many_series(self, counters: dict[LabelKey, float], gauges: dict[LabelKey, float]) -> bool:
        if max(len(counters), len(gauges)) <= MAX_SERIES:
            return False
        # a label that changes every scrape: watching each series would only fill memory
        self._series.clear()
        self._blind(
            f"too many series: {len(counters)} label sets of {self.counter} and {len(gauges)} of {self.busy_gauge}"
            f" at {self.url} (at most {MAX_SERIES}); a label whose value changes every scrape cannot be watched"
            " (set metrics.counter / metrics.busy_gauge to metrics without it)"
        )
        return True

    def _series_reading(
        self,
        key: LabelKey,
        value: float,
        gauges: dict[LabelKey, float],
        seen_ns: int,
        pending: bool,
        pending_since: int | None,
        restarted: list[str],
    ) -> StepReading:
        """Observe one counter series; its reading (a restart is added to ``restarted``)."""
        track = self._series.get(key)
        if track is None:
            track = self._series[key] = _SeriesTrack()
        track.missed = 0
        if track.observe(value, seen_ns, _labelled(self._marks, key), _labelled(self._churn, key)):
            self.restarts += 1
            restarted.append(series_name(key) or self.counter)
        busy_value = gauges.get(key)
        if busy_value is None:
            # the gauge with the fewest labels that all match this series, else the total
            matching = [v for g, v in gauges.items() if set(g) <= set(key) and g]
            busy_value = matching[0] if matching else sum(gauges.values())
        return StepReading(
            forward_ct=round(value),
            busy=busy_value > 0 or pending,
            last_progress_monotonic_ns=track.last_progress_ns,
            pid=self.pid,
            read_monotonic_ns=seen_ns,
            series=series_name(key),
            busy_since_ns=pending_since,
            preempted_since_progress=track.churned,
            preempted_since_ns=track.churn_base_ns,
        )

    def _settle_status(self, counters: dict[LabelKey, float], readings: list[StepReading], restarted: list[str]) -> None:
        n = len(counters)
        label = f"{n} series" if n > 1 or (n == 1 and next(iter(counters))) else "1 series"
        if restarted:
            self._state, self._reason = "waiting", (
                f"{self.counter} went backwards ({', '.join(restarted)}): server restarted; waiting for its first step"
            )
        elif all(r.last_progress_monotonic_ns is None for r in readings):
            if self._state != "waiting" or "restarted" not in self._reason:
                self._state, self._reason = "waiting", f"no forward progress yet ({self.counter} is 0 at {self.url})"
        else:
            also = f" (and requests open on port {self.requests_port})" if self.requests_port is not None else ""
            self._state, self._reason = "ready", f"{self.counter} ({label}) and {self.busy_gauge}{also} from {self.url}"

    async def _open_requests(self, *, fresh: bool = False) -> int | None:
        """Requests open on :attr:`requests_port` now (``None``: not watched, or not known);
        ``fresh``: a reading of none that still stands is not reused (work arrived since)."""
        if self.requests_port is None:
            return None
        from agent.watchers.inflight import OpenRequestsReader

        reader = self._requests_reader
        if reader is None or reader.port != self.requests_port or reader.quiet_s != self.open_request_quiet_s:
            reader = self._requests_reader = OpenRequestsReader(self.requests_port, quiet_s=self.open_request_quiet_s)
        reader.idle_reuse_s = 0.0 if fresh else self.open_request_idle_reuse_s
        found = reader.recent()  # a reading that still stands costs no worker-thread hop (~100 us)
        if found is None:
            found = await anyio.to_thread.run_sync(reader.read)
        self.open_requests = None if found is None else found.open
        self._open_since_ns = None if found is None else found.open_since_ns
        return self.open_requests

    def _forget_absent(self, present: Mapping[LabelKey, float]) -> None:
        """Count one more miss for each tracked series not in ``present``; forget those missing
        :data:`SERIES_FORGET_SCRAPES` times in a row."""
        gone = []
        for key, track in self._series.items():
            if key not in present:
                track.missed += 1
                if track.missed >= SERIES_FORGET_SCRAPES:
                    gone.append(key)
        for key in gone:
            del self._series[key]
        if len(self._series) > MAX_TRACKED_SERIES:  # the longest absent go first
            for key, _ in sorted(self._series.items(), key=lambda item: -item[1].missed)[: len(self._series) - MAX_TRACKED_SERIES]:
                del self._series[key]

    @property
    def tracked_series(self) -> int:
        """Counter series remembered now (present, or absent for fewer than
        :data:`SERIES_FORGET_SCRAPES` scrapes)."""
        return len(self._series)

    async def read(self) -> StepReading | None:
        """Scrape once; the counter summed over every series (``None`` when the scrape fails)."""
        readings = await self.read_series()
        if readings is None:
            return None
        total = self._total
        return StepReading(
            forward_ct=round(total.value or 0.0),
            busy=any(r.busy for r in readings),
            busy_since_ns=None if any(r.busy and r.busy_since_ns is None for r in readings)
            else min((r.busy_since_ns for r in readings if r.busy_since_ns is not None), default=None),
            last_progress_monotonic_ns=total.last_progress_ns,
            pid=self.pid,
            read_monotonic_ns=readings[0].read_monotonic_ns if readings else time.monotonic_ns(),
            preempted_since_progress=total.churned,
            preempted_since_ns=total.churn_base_ns,
        )

    async def aclose(self) -> None:
        """Close the private HTTP client; safe twice."""
        client, self._client = self._client, None
        if client is not None and self._own_client:
            await client.aclose()


# --- the watcher ----------------------------------------------------------------------------


class StepsWatcher:
    """Publishes ``StepsAdvanced`` (high-rate, may be dropped) whenever the counter moves.

    Readings are taken on a fixed-rate schedule: each at the next multiple of ``interval_s`` on
    the event loop's clock (the loops' shared tick, :mod:`agent.model.ticks`: no drift; missed
    slots are skipped, not bunched). The first reading only sets the baseline.

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
        last_ct: int | None = None
        task_status.started()
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
            await anyio.sleep(until_tick(self.interval_s, anyio.current_time()))  # the loops' shared tick
