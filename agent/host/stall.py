"""The stall rule, "busy and no forward progress for ``watchdog.timeout_s``", its settings, and
the one answer to "is this target stalled now?".

Names :class:`WatchdogConfig` (the ``[watchdog]`` table: the rule's timeout and poll interval,
and hard mode, which the incident logic carries out; :mod:`agent.host.config` holds it, so the
settings load it without this module), owns :class:`StallClock` (the rule itself, over
successive readings of a forward-step counter: the watchdog applies it to every counter, the
profiler to one session) and :class:`StallBoard` (the stalls not over, from the bus: a
``WatchdogStalled`` not yet followed by its ``WatchdogRearmed`` or the target's exit; the
incidents' view of stalls, ``servewatch status``, and what tells the profiler a profile could
never finish). Imports anyio, :mod:`agent.host.config`, :mod:`agent.model.events` and the standard library.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskStatus

from agent.host.config import WatchdogConfig
from agent.model.events import Event, TargetExited, WatchdogRearmed, WatchdogStalled

if TYPE_CHECKING:
    from agent.host.targets import Target
    from agent.model.bus import EventBus
    from agent.sdk.counter import CounterSnapshot

__all__ = ["StallBoard", "StallClock", "WatchdogConfig"]


class StallClock:
    """The stall rule over successive readings of one counter: busy, and no forward progress for
    ``timeout_s`` since the later of the last step and the first reading that saw it busy (an
    idle spell before work arrived is never a stall).

    Args:
        timeout_s: the rule's ``T``, seconds.
        before_first_step: a counter that never stepped stalls too, its clock started when it was
            first seen busy (a profile session waiting for a step); ``False`` (the watchdog): it
            cannot (a server warming up has taken no step yet).
        busy_since_ns: when it was first seen busy (monotonic ns), if known before the first
            reading (``0``: since ever, for a judgement on one reading alone).
    """

    __slots__ = ("before_first_step", "busy_since_ns", "timeout_ns")

    def __init__(self, timeout_s: float, *, before_first_step: bool = False, busy_since_ns: int | None = None) -> None:
        self.timeout_ns = int(timeout_s * 1e9)
        self.before_first_step = before_first_step
        self.busy_since_ns = busy_since_ns

    def deadline_ns(self, *, busy: bool, last_progress_ns: int | None, read_ns: int,
                    busy_since_ns: int | None = None) -> int | None:
        """Take one reading; the monotonic time (ns) at which it is a stall, ``None`` while it
        cannot be one (idle, or no step yet without ``before_first_step``).

        Args:
            busy: work was pending at the reading.
            last_progress_ns: monotonic ns of the last forward step (``None``: none yet).
            read_ns: monotonic ns of the reading.
            busy_since_ns: when the reading knows the work became pending (before ``read_ns``:
                a request the kernel says was received then); the clock of a reading that first
                sees it busy starts there instead of at ``read_ns``.
        """
        if not busy:
            self.busy_since_ns = None
            return None
        if self.busy_since_ns is None:
            self.busy_since_ns = read_ns if busy_since_ns is None else min(read_ns, busy_since_ns)
        if last_progress_ns is None and not self.before_first_step:
            return None
        return max(last_progress_ns or 0, self.busy_since_ns) + self.timeout_ns

    def stalled(self, *, busy: bool, last_progress_ns: int | None, read_ns: int) -> bool:
        """Take one reading: is it a stall at ``read_ns``?"""
        deadline = self.deadline_ns(busy=busy, last_progress_ns=last_progress_ns, read_ns=read_ns)
        return deadline is not None and read_ns >= deadline


#: Reads a target's SDK step counter now (``None``: it has none): :func:`agent.host.sdkclient.read_step_counter`.
CounterReader = Callable[[int], "CounterSnapshot | None"]


def _since(event: WatchdogStalled) -> int:
    """When the stall began: no progress since (ns since the epoch)."""
    return event.time_unix_nano - int(event.stalled_for_s * 1e9)


class StallBoard:
    """The stalls not over: each ``WatchdogStalled`` until its ``WatchdogRearmed`` or the exit of
    its target, by ``(pid, series)`` (a server-wide counter's stall has pid ``None``).

    Fed from the bus (:meth:`run`, its own subscription, so it is current while an incident
    runs) and by the incident manager as it handles each event (:meth:`observe` takes each event
    once, whoever hands it first). A one-shot incident, with no watchdog on the bus, takes one
    reading of each target's counter instead (:meth:`read_now`).
    """

    def __init__(self) -> None:
        self._open: dict[tuple[int | None, str], dict[str, Any]] = {}
        #: time of the last event taken, by pid (an older or the same one is not taken again)
        self._last_ns: dict[int | None, int] = {}
        #: targets a one-shot reading found stalled
        self._read: set[int] = set()

    def observe(self, event: Event) -> dict[str, Any] | None:
        """Take ``event`` (stalled, rearmed, exited; others are ignored); the entry of a stall
        (the same entry when this event was taken before), else ``None``."""
        if not isinstance(event, (WatchdogStalled, WatchdogRearmed, TargetExited)):
            return None
        pid = event.pid
        fresh = event.time_unix_nano > self._last_ns.get(pid, -1)
        if not fresh:  # taken before: its entry, while that stall is not over
            if not isinstance(event, WatchdogStalled):
                return None
            entry = self._open.get((pid, event.series))
            return entry if entry is not None and entry["since_time_unix_nano"] == _since(event) else None
        self._last_ns[pid] = event.time_unix_nano
        if isinstance(event, WatchdogStalled):
            entry = {
                "pid": pid, "series": event.series, "timeout_s": event.timeout_s,
                "since_time_unix_nano": _since(event), "incident": "", "suppressed": False,
            }
            self._open[(pid, event.series)] = entry
            return entry
        for key in [k for k in self._open if k[0] == pid]:  # progress again, or the target is gone
            del self._open[key]
        if pid is not None:
            self._read.discard(pid)
        return None

    def stalled(self, targets: Sequence[Target]) -> bool:
        """Whether one of ``targets`` is stalled now: a stall of its own not over, or a
        server-wide one (its server's counter)."""
        pids = {t.pid for t in targets}
        return bool(pids & self._read) or any(pid is None or pid in pids for pid, _ in self._open)

    def entries(self) -> list[dict[str, Any]]:
        """The stalls not over (JSON-ready): ``pid``, ``series``, ``timeout_s``,
        ``since_time_unix_nano`` (no progress since), ``incident`` (the one that holds its
        evidence) and ``suppressed`` (it opened none)."""
        return [dict(v) for v in self._open.values()]

    def read_now(self, targets: Iterable[Target], reader: CounterReader, timeout_s: float) -> None:
        """One reading of each target's counter, judged by the rule alone (busy and no step for
        ``timeout_s``): for a one-shot incident, where no watchdog has watched. Blocking."""
        now = time.monotonic_ns()
        for target in targets:
            snap = reader(target.pid)
            if snap is None:
                continue
            last = snap.last_step_monotonic_ns if snap.forward_ct > 0 and snap.last_step_monotonic_ns > 0 else None
            if StallClock(timeout_s, busy_since_ns=0).stalled(busy=snap.busy, last_progress_ns=last, read_ns=now):
                self._read.add(target.pid)

    async def run(self, bus: EventBus, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Take the watchdogs' word from ``bus`` until cancelled."""
        async with bus.subscribe(WatchdogStalled, WatchdogRearmed, TargetExited, name="stalls") as sub:
            task_status.started()
            async for event in sub:
                self.observe(event)
