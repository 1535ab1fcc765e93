"""The start-up rule: a server whose ranks were found starting and took no first step within the
start-up budget is an incident of its own (trigger ``startup_stall``; issue 32 item 5).

The field shape (SGLang #3547, vLLM #17167): one rank never returns from CUDA-graph capture or
weight loading, the others wait for it in the captured collective, and the HTTP frontend is not
up yet (SGLang and vLLM listen only once every rank is ready). The watchdog's stall rule is blind
to it (its clock starts at the first step) and the health check waits for the first answer
(``health.startup_timeout_s``, 30 min), so until now it only said "connection refused ... wrong
host or port" for as long as the hang lasted.

Names :class:`StartupConfig` (the ``[startup]`` table, :mod:`agent.host.config`), owns :class:`StartupStalled` (the trigger
event) and :class:`StartupRule`, a task of the runtime's: it reads the targets (the agent's
discovery, a ``/proc`` scan) every :meth:`StartupRule.interval_s` and, from the bus, what says the server's start-up is
over, and publishes :class:`StartupStalled`. Its rules:

* **a rank** is a target whose title names one (:func:`agent.model.ranks.rank_from_title`:
  ``sglang::scheduler_TP0``, ``VLLM::Worker_TP1``);
* **judged** only where something could say its start-up is over: the rank uses the SDK (its
  step counter, or its control socket before the first step opens the counter), or the agent
  probes the server over HTTP (``health.url``, ``metrics.url``) and found the rank younger than
  the budget (seen starting: a rank found older, with nothing listening at the URL, is more
  likely a serving server behind a wrong URL). Without either, a healthy server would look stuck
  in start-up forever: such ranks are never judged;
* **settled**: nothing is judged before the agent has looked for :data:`SETTLE_S` (or the budget,
  if shorter): an agent started next to a server that serves already hears it answer first;
* **start-up over** (for the ranks created before it): the rank's own SDK step counter reached 1
  (its first forward step), any step counter moved (``StepsAdvanced``), or the server answered
  over HTTP (a ``/health`` probe got any HTTP status, the ``metrics`` watcher turned ready:
  SGLang and vLLM serve HTTP only once their ranks finished start-up);
* **a start-up stall**: ranks judged, start-up not over for them, the oldest of them older than
  ``startup.budget_s`` (from its creation time, psutil's): one :class:`StartupStalled` naming them (once per set of
  ranks: a restart's new ranks are judged afresh; the incident's cooldown applies as for any
  trigger). The verdict then reads the ranks' stacks and Flight Recorders as for a stall: one
  rank outside the collective the others wait in is the culprit.

What it says while ranks start (:meth:`StartupRule.starting`) is what the health and metrics
watchers say of a port nothing listens on yet (``server starting``), not "wrong host or port".

The rule is agent-wide: a step or an answer of any watched server ends the start-up of every rank
created before it (the watchers' URLs are not tied to a server here).

Imports :mod:`agent.model.events`, :mod:`agent.model.bus`, :mod:`agent.model.ranks`, :mod:`agent.host.targets`,
:mod:`agent.host.sdkclient` (the step counter's read, lazily), anyio and pydantic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import anyio
from anyio.abc import TaskStatus

from agent.host.config import DEFAULT_BUDGET_S, StartupConfig
from agent.host.procinfo import NewProcesses
from agent.host.targets import Target, command_words, target_of
from agent.model.bus import EventBus
from agent.model.events import (
    Event,
    HealthProbed,
    StepsAdvanced,
    TriggerEvent,
    WatcherStatusChanged,
)
from agent.model.ranks import rank_from_title

__all__ = [
    "DEFAULT_BUDGET_S",
    "LOOK_INTERVAL_S",
    "MAX_RANKS_REMEMBERED",
    "SETTLE_S",
    "STARTUP_STALL",
    "StartupConfig",
    "StartupRule",
    "StartupStalled",
    "startup_progress",
]

log = logging.getLogger("servewatch.startup")

#: The trigger's name (``IncidentOpened.trigger``, ``servewatch.incident.trigger``).
STARTUP_STALL = "startup_stall"
#: Seconds between two looks at the ranks: a twentieth of the budget, within these bounds (a
#: stall is said within this long after the budget is spent; each look is a discovery).
LOOK_INTERVAL_S = (0.5, 5.0)
#: Ranks named in one line at most.
MAX_NAMED = 4
#: Seconds the rule looks before it judges (capped by the budget): a server that serves already
#: answers the health check's first probe within it (``health.timeout_s``: 5 s by default).
SETTLE_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StartupStalled(TriggerEvent):
    """Ranks seen starting took no first step within the start-up budget.

    Attributes:
        pids / titles: the ranks still in start-up, oldest first (their titles, same order).
        waited_s: seconds since the oldest of them started.
        budget_s: the budget (``startup.budget_s``), seconds.
    """

    TRIGGER: ClassVar[str] = STARTUP_STALL
    pids: tuple[int, ...]
    titles: tuple[str, ...] = ()
    waited_s: float
    budget_s: float

    @property
    def subject_pid(self) -> int | None:
        return self.pids[0] if self.pids else None

    def describe(self) -> str:
        return (f"no first step {self.waited_s:.0f} s after its ranks started (start-up budget {self.budget_s:g} s):"
                f" {_named(self.pids, self.titles)}")


def _named(pids: Sequence[int], titles: Sequence[str]) -> str:
    shown = [f"pid {p}" + (f" {t!r}" if t else "") for p, t in zip(pids, titles, strict=False)][:MAX_NAMED]
    more = len(pids) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _sdk_forward_ct(pid: int) -> int | None:
    """``pid``'s SDK step counter (forward steps); 0 for a process that serves the SDK's control
    socket and has no counter yet (the SDK opens it at the first step); ``None`` without the SDK.
    Blocking (a tmpfs read, a folder listing; the SDK's default shm folder)."""
    from agent.host.sdkclient import control_socket_pids, read_step_counter

    snap = read_step_counter(pid)
    if snap is not None:
        return snap.forward_ct
    return 0 if pid in control_socket_pids() else None


#: Ranks whose age at first sight is remembered (beyond, only the ones the last look found).
MAX_RANKS_REMEMBERED = 4096


class StartupRule:
    """The start-up rule (the module docstring), run by the runtime (:meth:`run`).

    Args:
        config: the ``[startup]`` table (default: its defaults).
        discover: the targets now (the agent's discovery; blocking).
        forward_ct: a rank's step counter now (default: its SDK counter; blocking), ``None``
            without one.
        http_watched: the agent probes the server over HTTP (a ``health`` or ``metrics`` URL):
            its answer would end the start-up.
        server_pids: the server's own processes the agent was given by pid (``target.root_pid``,
            the command ``run`` launched): one created within the budget while no rank is found
            yet is a server starting (vLLM and SGLang import for seconds before they start ranks).

    Attributes:
        published: every :class:`StartupStalled` published, oldest first.
    """

    def __init__(self, config: StartupConfig | None = None, *, discover: Callable[[], list[Target]],
                 forward_ct: Callable[[int], int | None] = _sdk_forward_ct, http_watched: bool = False,
                 server_pids: Callable[[], Sequence[int]] = tuple) -> None:
        self.config = config or StartupConfig()
        self._discover = discover
        self._server_pids = server_pids
        #: at the last look no rank was found and these server processes were younger than the budget
        self._server_young: list[Target] = []
        self._forward_ct = forward_ct
        self.http_watched = http_watched
        #: when the rule first looked, seconds since the epoch (0: not yet)
        self._first_look_s = 0.0
        #: when start-up was last seen over (a step, an HTTP answer), seconds since the epoch
        self.over_s = 0.0
        self._fired: set[tuple[int, float]] = set()
        #: the ranks found so far, by (pid, creation time): found younger than the budget
        self._young_at_sight: dict[tuple[int, float], bool] = {}
        #: at the last look, a rank in start-up had no SDK to say so (the HTTP answer alone would)
        self._by_http_only = False
        #: the ranks in start-up at the last look, oldest first, and when that was
        self._starting: list[Target] = []
        self._looked_s = 0.0
        #: a process created since the last look that succeeded
        self._created = NewProcesses()
        self.published: list[StartupStalled] = []

    @property
    def interval_s(self) -> float:
        """Seconds between two looks (:data:`LOOK_INTERVAL_S`)."""
        low, high = LOOK_INTERVAL_S
        return min(high, max(low, self.config.budget_s / 20))

    # -- what the watchers say of a port nothing listens on ---------------------------------------

    def starting(self) -> str | None:
        """One line on the ranks in start-up at the last look (``its ranks took no first step yet
        (pid 7 'sglang::scheduler_TP0', ...; start-up budget 480 s)``), ``None`` when none is. It
        changes only with the ranks and once the budget is spent (a status line, said on change)."""
        ranks = self._starting
        if not self.config.budget_s:
            return None
        if not ranks:
            return self._server_starting()
        names = _named([t.pid for t in ranks], [t.title for t in ranks])
        if self._looked_s - ranks[0].create_time_s >= self.config.budget_s:
            return (f"its ranks took no first step within the start-up budget of {self.config.budget_s:g} s ({names})"
                    + (", or this is the wrong host or port" if self._by_http_only else ""))
        return f"its ranks took no first step yet ({names}; start-up budget {self.config.budget_s:g} s)"

    def _server_starting(self) -> str | None:
        """``it started less than the start-up budget ago and has no rank yet (pid 7 'python vllm
        serve'; start-up budget 480 s)`` while no rank was found and a server process given by pid
        is younger than the budget (from its creation time); ``None`` otherwise. The line does not
        change while it holds (a status line is said on change)."""
        young = [t for t in self._server_young if time.time() - t.create_time_s < self.config.budget_s]
        if not young:
            return None
        names = _named([t.pid for t in young], [command_words(t.cmdline) or t.title for t in young])
        return f"it started less than the start-up budget ago and has no rank yet ({names}; start-up budget {self.config.budget_s:g} s)"

    # -- the rule -------------------------------------------------------------------------------

    def note(self, event: Event) -> None:
        """Take what ``event`` says of the start-up: a step, or an HTTP answer, ends it for the
        ranks created before it."""
        if isinstance(event, StepsAdvanced) and event.forward_ct > 0 \
                or isinstance(event, HealthProbed) and (event.ok or event.status_code is not None) \
                or isinstance(event, WatcherStatusChanged) and event.watcher.startswith("metrics") and event.state == "ready":
            self.over_s = max(self.over_s, event.time_unix_nano / 1e9)

    def needs_look(self) -> bool:
        """Whether :meth:`look` can say anything new: a rank was in start-up at the last look (its
        budget runs), or a process was created since (:class:`~agent.host.procinfo.NewProcesses`), or
        none looked yet. With every rank's start-up over and no new process, a look would find the
        same ranks over again: an idle watch skips it (no ``/proc`` scan, no worker-thread hop).
        Cheap, on the event loop."""
        if not self.config.budget_s:
            return False
        return bool(self._starting or self._server_young) or self._created.since()

    def look(self, now_s: float | None = None) -> StartupStalled | None:
        """One look at the ranks (blocking: discovery and counter reads); the stall to publish, if any."""
        if not self.config.budget_s:
            return None
        now_s = time.time() if now_s is None else now_s
        self._first_look_s = self._first_look_s or now_s
        ranks = self._ranks()
        self._remember_young({(t.pid, t.create_time_s) for t in ranks}, now_s)
        self._by_http_only = False
        starting = sorted((t for t in ranks if self._in_startup(t)), key=lambda t: t.create_time_s)
        self._starting, self._looked_s = starting, now_s
        self._server_young = [] if ranks else self._young_servers(now_s)
        if not starting or not self._overdue(starting[0], now_s):
            return None
        keys = {(t.pid, t.create_time_s) for t in starting}
        if keys <= self._fired:
            return None
        self._fired |= keys
        return StartupStalled(source="startup", pids=tuple(t.pid for t in starting), titles=tuple(t.title for t in starting),
                              waited_s=now_s - starting[0].create_time_s, budget_s=self.config.budget_s)

    def _ranks(self) -> list[Target]:
        """The ranks discovery finds now (blocking)."""
        before = self._created.before_look()
        ranks = [t for t in self._discover() if rank_from_title(t.title) is not None and t.create_time_s > 0]
        self._created.looked(before)  # a discovery that raised is tried again at the next interval
        return ranks

    def _remember_young(self, keys: set[tuple[int, float]], now_s: float) -> None:
        """Note, per rank ``(pid, create time)``, whether it was young when first seen."""
        # kept for a rank one look missed (a discovery under load): seen again past the budget, it
        # is still the rank seen young, whose start-up only HTTP would end (not "down": blind)
        for key in keys:
            self._young_at_sight.setdefault(key, now_s - key[1] < self.config.budget_s)
        if len(self._young_at_sight) > MAX_RANKS_REMEMBERED:
            self._young_at_sight = {k: v for k, v in self._young_at_sight.items() if k in keys}

    def _overdue(self, oldest: Target, now_s: float) -> bool:
        """The oldest starting rank passed the budget, and the watch has settled."""
        return not (now_s - oldest.create_time_s < self.config.budget_s
                    or now_s - self._first_look_s < min(SETTLE_S, self.config.budget_s))

    def _young_servers(self, now_s: float) -> list[Target]:
        """The server processes given by pid that live and are younger than the budget, oldest first
        (blocking: one ``/proc`` read each)."""
        found = (target_of(pid) for pid in dict.fromkeys(self._server_pids()))
        young = [t for t in found if t is not None and 0 < now_s - t.create_time_s < self.config.budget_s]
        return sorted(young, key=lambda t: t.create_time_s)

    def _in_startup(self, t: Target) -> bool:
        """Judged (something could say its start-up is over), and nothing said so."""
        if self.over_s > t.create_time_s:
            return False
        forward_ct = self._forward_ct(t.pid)
        if forward_ct is not None:
            return forward_ct == 0  # its first step ends its own start-up
        judged = self.http_watched and self._young_at_sight.get((t.pid, t.create_time_s), False)
        self._by_http_only |= judged
        return judged

    # -- the task -------------------------------------------------------------------------------

    async def run(self, bus: EventBus, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow the bus and look at the ranks every :attr:`interval_s` until cancelled;
        publish each :class:`StartupStalled`. A failed look is logged (once) and the next runs."""
        if not self.config.budget_s:  # off: nothing to follow
            task_status.started()
            await anyio.sleep_forever()
        async with anyio.create_task_group() as tg, bus.subscribe(StepsAdvanced, HealthProbed, WatcherStatusChanged,
                                                                  name="startup") as sub:
            tg.start_soon(self._follow, sub)
            task_status.started()
            told = False
            while True:
                try:
                    stalled = await anyio.to_thread.run_sync(self.look) if self.needs_look() else None
                except Exception:  # a view of the server's start-up: never the agent's end
                    if not told:
                        told = True
                        log.exception("looking at the ranks' start-up failed (said once)")
                    stalled = None
                if stalled is not None:
                    log.warning("start-up stall: %s", stalled.describe())
                    self.published.append(stalled)
                    await bus.publish(stalled)
                await anyio.sleep(self.interval_s)

    async def _follow(self, sub: object) -> None:
        async for event in sub:  # type: ignore[attr-defined]
            self.note(event)


def startup_progress(cause: Event | None, pids: set[int]) -> tuple[bool, str, bool, None] | None:
    """The server's progress as a start-up stall says it, for the verdict of the server whose
    processes are ``pids``: ``(False, "no first step ...", True, None)`` (no progress, start-up
    work pending, no progress counter's listener) when ``cause`` is a :class:`StartupStalled` of
    its ranks; ``None`` otherwise (the verdict reads progress as usual)."""
    if not isinstance(cause, StartupStalled) or not pids & set(cause.pids):
        return None
    return (False, f"no first step {cause.waited_s:.0f} s after its ranks started (start-up budget {cause.budget_s:g} s)",
            True, None)
