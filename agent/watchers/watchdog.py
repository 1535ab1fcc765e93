"""The stall watchdog: busy, and no forward progress for ``timeout_s``.

Owns: :class:`Watchdog` (timing: :class:`~agent.host.stall.WatchdogConfig`), which publishes ``WatchdogStalled`` and
``WatchdogRearmed``. May import :mod:`agent.model.events`, :mod:`agent.model.bus` (``Publisher``),
:mod:`agent.watchers.steps` (the ``StepSource`` protocol), anyio and pydantic.

Rules (after SGLang's scheduler watchdog, which counts ``forward_ct`` while a batch runs):

* The clock starts at the first step: before it (``forward_ct == 0``: warm-up, CUDA graph
  capture, ``torch.compile``) nothing is a stall.
* An idle target (no pending work) never stalls. When work appears after an idle spell, the
  clock starts when the watchdog first sees it busy, not at the last step before the idle spell.
* It fires once per stall; it re-arms (``WatchdogRearmed``) when the counter moves again.
* servewatch's own profile of the server pauses the rule (:mod:`agent.host.ownactions`: a profile's
  start, warm-up and trace writing take no step for seconds): while a ``profile`` own action
  covers the watched pid (its process group: the server's ranks) or the ``/metrics`` port,
  nothing is a stall; the pause is bounded by the action's own end, said in one log line and on
  the status board (``stall pid X``), and the rule re-arms after it with a fresh clock, so a
  genuine hang afterwards is a stall ``timeout_s`` after the window, not before.
* Deadline scheduling: the watchdog sleeps until exactly ``last_progress + timeout_s`` (capped
  by ``poll_interval_s`` so idle spells are noticed), instead of polling every ``timeout/2``
  as SGLang does, which fires anywhere between 1.0x and 1.5x the timeout. With the exact
  shared-memory counter the detection latency is the timeout plus scheduling jitter; with a
  Prometheus scrape the last-progress time is only known to the polling interval, so it is
  within ``timeout_s + poll_interval_s``.
* Idle backoff (the ``/metrics`` scrape only, ``idle_backoff``): while every series reads idle
  the scrape waits longer, doubling from ``poll_interval_s`` to :func:`idle_poll_max_s` (5 s, at
  most 1/20 of the timeout); the first busy reading returns to the poll interval. The busy
  scrape after such a wait dates the work from the open requests (when the kernel received the
  oldest), so the clock starts when the work arrived; undated (a remote URL), it starts at most
  1/20 of the timeout late. The SDK counter is read at every poll as before.

Soft by default: the watchdog only reports. Hard mode (``hard=True``) is carried in the config
and executed by the incident code *after* the evidence is captured, by sending ``signal`` to
the target so an orchestrator restarts it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from agent.host.ownactions import OwnAction, OwnActionLog, process_group
from agent.host.stall import StallClock, WatchdogConfig
from agent.model.bus import Publisher
from agent.model.events import WatchdogRearmed, WatchdogStalled, WatcherStatusChanged
from agent.model.ticks import until_tick
from agent.verdict.servers import port_of_url
from agent.watchers.group import WatcherGroup, url_label
from agent.watchers.status import StatusReporter, WatcherState
from agent.watchers.steps import StepReading, StepSource

if TYPE_CHECKING:
    from agent.host.registry import BuildContext
    from agent.host.targets import Target
    from agent.watchers.config import MetricsConfig
    from agent.watchers.steps import PrometheusStepSource


__all__ = ["IDLE_POLL_MAX_S", "IDLE_POLL_TIMEOUT_SHARE", "SERIES_FORGET_READINGS", "STEPS_SHARED_MAX_AGE_S", "SdkStepWatchers", "Watchdog",
           "WatchdogConfig", "create_prometheus", "create_sdk", "idle_poll_max_s", "progress_source"]

log = logging.getLogger("servewatch.watchdog")

#: A series absent from this many successful readings in a row loses its stall bookkeeping.
SERIES_FORGET_READINGS = 60
#: Most series with stall bookkeeping at once; past it the longest absent are forgotten first
#: (a source caps one reading's series itself: ``agent.watchers.steps.MAX_SERIES``).
MAX_TRACKED_SERIES = 1024
#: Longest wait between two readings of a source that backs off while idle (the ``/metrics``
#: scrape, ``idle_backoff``) while every series it reads is idle, seconds: the wait doubles from
#: ``poll_interval_s`` up to it, and the first busy reading returns to ``poll_interval_s``.
IDLE_POLL_MAX_S = 5.0
#: ... and at most this share of the stall timeout: a busy reading after such a wait that no
#: open request dates (a remote URL) starts the clock at most this much of the timeout late.
IDLE_POLL_TIMEOUT_SHARE = 0.05


def idle_poll_max_s(rule: WatchdogConfig) -> float:
    """Longest wait between two idle readings of a backing-off source under the stall rule
    ``rule``, seconds: :data:`IDLE_POLL_MAX_S`, at most :data:`IDLE_POLL_TIMEOUT_SHARE` of its
    timeout, never below its poll interval (then it does not back off)."""
    return max(rule.poll_interval_s, min(IDLE_POLL_MAX_S, rule.timeout_s * IDLE_POLL_TIMEOUT_SHARE))


class _SeriesState:
    """Stall bookkeeping of one series (one counter, or one Prometheus label set)."""

    __slots__ = ("busy_from_first_reading", "clock", "fired_ct", "missed", "stalled")

    def __init__(self, timeout_s: float) -> None:
        self.clock = StallClock(timeout_s)
        #: busy at every reading since the first: when work arrived is unknown (it may be long
        #: before this agent looked), so a stall counts from the counter's own last step
        self.busy_from_first_reading = True
        self.stalled = False
        self.fired_ct: int | None = None
        #: readings in a row without this series
        self.missed = 0


class Watchdog:
    """Watches one :class:`~agent.watchers.steps.StepSource` for stalls (one per scheduler pid).

    A source with ``read_series()`` (Prometheus) is watched per series: each label set has its
    own clock, so one stuck vLLM engine among progressing ones is a stall of that engine, and
    ``WatchdogStalled.series`` names it. A source with ``status()`` has its status published
    after each reading as ``WatcherStatusChanged`` (``metrics: BLIND — 401 Unauthorized …``).

    Args:
        source: the counter to watch; the caller owns it (and closes it).
        config: timeouts; default :class:`WatchdogConfig`.
        own_actions: servewatch's own actions on the servers (a ``profile`` covering this
            source pauses the rule); ``None``: never paused.

    Attributes:
        stalled: a stall was reported and progress has not resumed since (any series).
        stalls: stalls reported so far.
    """

    name = "watchdog"

    def __init__(self, source: StepSource, config: WatchdogConfig | None = None, *,
                 own_actions: OwnActionLog | None = None) -> None:
        self.source = source
        self.config = config or WatchdogConfig()
        self.own_actions = own_actions
        #: the profile that pauses the rule now (``None``: not paused)
        self.paused_by: OwnAction | None = None
        #: pauses so far
        self.pauses = 0
        url = getattr(source, "url", None)
        self._port = port_of_url(url) if isinstance(url, str) else None
        self.stalls = 0
        self._series: dict[str, _SeriesState] = {}
        self._poll_ns = int(self.config.poll_interval_s * 1e9)
        #: longest wait between two idle readings, ns (the poll interval: no backing off)
        self._idle_max_ns = int(idle_poll_max_s(self.config) * 1e9) if getattr(source, "idle_backoff", False) else self._poll_ns
        #: the wait before the next reading, ns (more than the poll interval: backed off, idle)
        self.next_wait_ns = self._poll_ns
        self.status: StatusReporter | None = None
        if callable(getattr(source, "status", None)):
            state, reason = source.status()  # type: ignore[attr-defined]
            self.status = StatusReporter(getattr(source, "status_name", source.name), WatcherState(state), reason)

    @property
    def stalled(self) -> bool:
        return any(st.stalled for st in self._series.values())

    @property
    def pid(self) -> int | None:
        """The watched process (from the source), or ``None`` for a server-wide counter."""
        return self.source.pid

    def _forget_absent(self, present: set[str]) -> None:
        """Forget the series missing from :data:`SERIES_FORGET_READINGS` successful readings in
        a row (a label set that went away), so churning label sets never pile up."""
        gone = []
        for series, st in self._series.items():
            if series not in present:
                st.missed += 1
                if st.missed >= SERIES_FORGET_READINGS:
                    gone.append(series)
        for series in gone:
            del self._series[series]
        if len(self._series) > MAX_TRACKED_SERIES:
            for series, _ in sorted(self._series.items(), key=lambda item: -item[1].missed)[: len(self._series) - MAX_TRACKED_SERIES]:
                del self._series[series]

    @property
    def tracked_series(self) -> int:
        """Series with stall bookkeeping now."""
        return len(self._series)

    async def _readings(self, bus: Publisher, *, after_idle_gap: bool = False) -> list[StepReading]:
        read_series = getattr(self.source, "read_series", None)
        if callable(read_series):
            readings = await (read_series(after_idle_gap=after_idle_gap) if after_idle_gap else read_series())
        else:
            one = await self.source.read()
            readings = None if one is None else [one]
        if self.status is not None:
            state, reason = self.source.status()  # type: ignore[attr-defined]
            await self.status.set(bus, WatcherState(state), reason)
        return readings or []

    async def _pausing(self) -> OwnAction | None:
        """The ``profile`` own action covering this source now, or ``None`` (never raises)."""
        if self.own_actions is None:
            return None
        actions = await anyio.to_thread.run_sync(self.own_actions.active)  # reads the data dir's files
        profiles = [a for a in actions if a.kind == "profile"]
        if not profiles:
            return None
        pid = self.pid
        pgid = process_group(pid) if pid is not None else None
        return next((a for a in profiles if a.covers(pid, pgid=pgid, port=self._port)), None)

    def _who(self) -> str:
        return f"pid {self.pid}" if self.pid is not None else f"{self.source.name} port {self._port}"

    async def _pause_or_resume(self, bus: Publisher, now_ns: int) -> bool:
        """Apply a profile window: ``True`` while one pauses the rule. When it ends, every
        series' clock restarts from now (a fresh clock: the window's silence never counts)."""
        window = await self._pausing()
        name = f"stall {self._who()}"
        if window is not None:
            if self.paused_by is None or self.paused_by.started_unix_s != window.started_unix_s:
                self.pauses += 1
                line = f"stall rule paused for {self._who()}: {window.describe()}"
                log.warning("%s", line)
                await bus.publish(WatcherStatusChanged(source=self.name, watcher=name, state="waiting", reason=line))
            self.paused_by = window
            return True
        if self.paused_by is not None:
            self.paused_by = None
            for st in self._series.values():
                st.clock = StallClock(self.config.timeout_s, busy_since_ns=now_ns)
                st.busy_from_first_reading = False
            line = f"stall rule re-armed for {self._who()} after servewatch's profile: a fresh {self.config.timeout_s:g} s clock"
            log.warning("%s", line)
            await bus.publish(WatcherStatusChanged(source=self.name, watcher=name, state="ready", reason=line))
        return False

    def _idle_wait_ns(self, readings: list[StepReading], wait_ns: int) -> int:
        """The wait before the next reading when this one found every series idle: the last
        wait doubled, up to the idle ceiling (:func:`idle_poll_max_s`); ``wait_ns`` (the poll
        interval, or a sooner wake) when it did not: a busy series, a failed scrape, a stall
        not over, a paused rule, or a source that does not back off."""
        if (self._idle_max_ns <= self._poll_ns or not readings or wait_ns < self._poll_ns or self.paused_by is not None
                or any(r.busy for r in readings) or self.stalled):
            return wait_ns
        return min(max(self.next_wait_ns, self._poll_ns) * 2, self._idle_max_ns)

    async def run(self, bus: Publisher, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled. Ready at once (the first reading may come later).

        A source that backs off while idle (``idle_backoff``: the ``/metrics`` scrape) is read
        less often while every series is idle (:meth:`_idle_wait_ns`); the reading after such a
        wait asks it to date a busy reading from the open requests (``after_idle_gap``)."""
        poll_ns = self._poll_ns
        timeout_ns = int(self.config.timeout_s * 1e9)
        counter_source = f"{self.source.name}"
        if self.status is not None:
            await self.status.initial(bus)
        task_status.started()
        while True:
            readings = await self._readings(bus, after_idle_gap=self.next_wait_ns > poll_ns)
            now = time.monotonic_ns()
            sleep_ns = poll_ns
            # a profile window matters only where a stall clock can run (a busy series) or one
            # paused must be re-armed: an idle watch reads no own-action files (a worker-thread hop)
            if (self.paused_by is not None or any(r.busy for r in readings)) and await self._pause_or_resume(bus, now):
                self.next_wait_ns = poll_ns
                await anyio.sleep(poll_ns / 1e9)
                continue
            fired: list[tuple[StepReading, int]] = []
            if readings and len(self._series) >= len(readings):
                self._forget_absent({r.series for r in readings})
            for reading in readings:
                wake_ns = await self._check(bus, reading, now, timeout_ns, fired)
                if wake_ns is not None:
                    sleep_ns = min(sleep_ns, wake_ns)
            if fired:
                await self._publish_stall(bus, fired, counter_source)
                sleep_ns = 0
            sleep_ns = self.next_wait_ns = self._idle_wait_ns(readings, sleep_ns)
            await anyio.sleep(self._until_reading_s(sleep_ns))

    def _until_reading_s(self, wait_ns: int) -> float:
        """Seconds to sleep for a wait of ``wait_ns``: a wait of the poll interval or more ends
        on the loops' shared tick of the poll interval (:func:`~agent.model.ticks.until_tick`:
        up to one poll interval sooner, never later); a sooner one (a deadline) exactly."""
        if wait_ns < self._poll_ns:
            return max(wait_ns, 0) / 1e9
        return (wait_ns - self._poll_ns) / 1e9 + until_tick(self.config.poll_interval_s, anyio.current_time())

    async def _check(
        self, bus: Publisher, reading: StepReading, now: int, timeout_ns: int, fired: list[tuple[StepReading, int]]
    ) -> int | None:
        """The stall rule on one series' reading (a stall is added to ``fired`` with its start);
        ns until the series must be read again (``None``: no sooner than the poll interval)."""
        st = self._series.get(reading.series)
        if st is None:
            st = self._series[reading.series] = _SeriesState(self.config.timeout_s)
        st.missed = 0
        st.busy_from_first_reading = st.busy_from_first_reading and reading.busy
        # the stall rule (busy first seen now: an idle spell before it is not a stall)
        deadline = st.clock.deadline_ns(busy=reading.busy, last_progress_ns=reading.last_progress_monotonic_ns,
                                        read_ns=reading.read_monotonic_ns, busy_since_ns=reading.busy_since_ns)
        if st.stalled:
            if reading.forward_ct != st.fired_ct:
                st.stalled = False
                st.fired_ct = None
                await bus.publish(
                    WatchdogRearmed(source=self.name, pid=reading.pid, forward_ct=reading.forward_ct)
                )
                return 0
            return None
        if deadline is None:
            return None
        if reading.read_monotonic_ns >= deadline:
            st.stalled = True
            st.fired_ct = reading.forward_ct
            start = deadline - timeout_ns
            if st.busy_from_first_reading and reading.last_progress_monotonic_ns is not None:
                # an agent started after the hang saw it busy only now, but the step is
                # older (a series once seen idle keeps the rule's clock: work pending
                # began when it was seen busy again)
                start = min(start, reading.last_progress_monotonic_ns)
            fired.append((reading, start))
            return None
        return deadline - now

    async def _publish_stall(self, bus: Publisher, fired: list[tuple[StepReading, int]], counter_source: str) -> None:
        """One ``WatchdogStalled`` for the series that stalled together (TP ranks in lockstep)."""
        reading, start = min(fired, key=lambda f: f[1])
        self.stalls += 1
        await bus.publish(
            WatchdogStalled(
                source=self.name,
                pid=reading.pid,
                forward_ct=sum(r.forward_ct for r, _ in fired),
                stalled_for_s=(reading.read_monotonic_ns - start) / 1e9,
                timeout_s=self.config.timeout_s,
                counter_source=counter_source,
                series="; ".join(r.series for r, _ in fired if r.series),
                url=str(getattr(self.source, "url", "") or ""),
                **_preempted(fired),
            )
        )


def _preempted(fired: list[tuple[StepReading, int]]) -> dict[str, Any]:
    """``WatchdogStalled``'s livelock fields of the series that stalled together: requests
    preempted since their last progress (summed) and over how long (the longest), per vLLM #25538."""
    churned = [r for r, _ in fired if r.preempted_since_progress > 0 and r.preempted_since_ns is not None]
    if not churned:
        return {}
    since = min(r.preempted_since_ns for r in churned if r.preempted_since_ns is not None)
    return {"preempted": sum(r.preempted_since_progress for r in churned),
            "preempted_in_s": (max(r.read_monotonic_ns for r in churned) - since) / 1e9}


def stall_rule(ctx: BuildContext) -> WatchdogConfig:
    """The stall rule's settings, as every component gets them (``ctx.agent.watchdog``: the
    ``[watchdog]`` table)."""
    return ctx.agent.watchdog


#: Longest time a reading of no open request stands while a server's gauges say idle, seconds
#: (a reading asks the kernel to walk its whole TCP table: ~1 ms of CPU or more per family, 2-3 ms
#: for a reading on a loaded 2-core VM, 2026-12-07).
OPEN_REQUEST_IDLE_REUSE_S = 15.0


def open_request_idle_reuse_s(rule: WatchdogConfig) -> float:
    """How long a reading of no open request stands for the stall rule ``rule``: at most
    :data:`OPEN_REQUEST_IDLE_REUSE_S` and a quarter of its timeout. A request found later is
    dated from when the kernel received it (``StepReading.busy_since_ns``), so the stall fires
    when it would have with a reading at every poll, as long as it is found before the timeout."""
    return min(OPEN_REQUEST_IDLE_REUSE_S, rule.timeout_s / 4)


def create_prometheus(config: MetricsConfig, ctx: BuildContext) -> Watchdog | WatcherGroup | None:
    """Registry factory (:data:`agent.watchers.WATCHERS` ``metrics``): the stall watchdog over
    the server's Prometheus ``/metrics`` (``config``: ``[metrics]``); with several URLs (``urls``)
    one each, run as a :class:`~agent.watchers.group.WatcherGroup` (status rows ``metrics
    HOST:PORT``; each stall names its URL, so its server); ``None`` without a URL."""
    from agent.watchers.steps import PrometheusStepSource

    urls = config.all_urls
    watchdogs = []
    own_actions = OwnActionLog(ctx.agent.data_dir, ctx.agent.host_name, cache_s=0.5)
    for url in urls:
        source = PrometheusStepSource(
            url, preset=config.metrics_preset, counter=config.counter, busy_gauge=config.busy_gauge,
            timeout_s=config.scrape_timeout_s, refused_grace_s=config.refused_grace_s,
            open_requests=config.open_requests, open_request_quiet_s=config.open_request_quiet_s,
            open_request_idle_reuse_s=open_request_idle_reuse_s(stall_rule(ctx)),
        )
        source.starting = ctx.starting
        if len(urls) > 1:
            source.status_name = url_label("metrics", url)
        watchdogs.append(Watchdog(source, stall_rule(ctx), own_actions=own_actions))
    if len(watchdogs) <= 1:
        return watchdogs[0] if watchdogs else None
    return WatcherGroup("metrics", watchdogs)


def progress_source(config: MetricsConfig) -> PrometheusStepSource | None:
    """The server's ``/metrics`` progress counter for a one-shot verdict (``servewatch dump
    --metrics-url``: :attr:`agent.verdict.judge.VerdictJudge.progress_source` reads it twice), or
    ``None`` without a ``url``. The caller closes it (``aclose``)."""
    from agent.watchers.steps import PrometheusStepSource

    if not config.url:
        return None
    return PrometheusStepSource(config.url, preset=config.metrics_preset, counter=config.counter,
                                busy_gauge=config.busy_gauge, timeout_s=config.scrape_timeout_s,
                                open_requests=config.open_requests, open_request_quiet_s=config.open_request_quiet_s)


#: Oldest watchdog reading of an SDK counter the step watcher reuses, seconds (the watchdog reads
#: it every ``watchdog.poll_interval_s``, 1 s by default, and the step watcher every second).
STEPS_SHARED_MAX_AGE_S = 1.5


class SdkStepWatchers:
    """Per-target watchers of an SDK step counter (``agent.sdk.step()``): a stall
    :class:`Watchdog` and a :class:`~agent.watchers.steps.StepsWatcher` (one reading a second).

    Args:
        config: the watchdog settings (timeout, poll interval).
        own_actions: servewatch's own actions (a profile pauses the stall rule); ``None``: none.
    """

    status_name = "steps"

    def __init__(self, config: WatchdogConfig, own_actions: OwnActionLog | None = None) -> None:
        self.config = config
        self.own_actions = own_actions

    def watchers_for(self, target: Target) -> list[Any] | None:
        """The two watchers of ``target``'s counter, or ``None`` when it has no counter (yet).

        They share one reading a second: the step watcher reuses the watchdog's last reading
        when it is at most :data:`STEPS_SHARED_MAX_AGE_S` old (a ``StepsAdvanced`` is then at
        most that late), and reads the file itself otherwise."""
        from agent.watchers.steps import RecentReading, ShmStepSource, StepsWatcher

        source = ShmStepSource(target.pid)
        if source.read_now() is None:
            return None
        shared = RecentReading(source, max_age_s=STEPS_SHARED_MAX_AGE_S)
        return [Watchdog(source, self.config, own_actions=self.own_actions), StepsWatcher(shared, interval_s=1.0)]


def create_sdk(config: None, ctx: BuildContext) -> SdkStepWatchers:
    """Registry factory (:data:`agent.watchers.WATCHERS` ``steps``): per-target SDK step-counter
    watchers (started by the runtime for each target that has a counter)."""
    return SdkStepWatchers(stall_rule(ctx), OwnActionLog(ctx.agent.data_dir, ctx.agent.host_name, cache_s=0.5))
