"""Keeping the running agent's watching alive: a crashed watcher restarted, targets re-discovered.

Owns :func:`supervise` (one watcher run until cancelled; a crash is a ``blind`` status row with
the exception, then a fresh watcher after a jittered backoff, :class:`agent.model.backoff.Backoff`) and
:class:`TargetWatch` (re-discovery of the targets: every one found is watched for exit by the
``process`` watcher and, with an SDK step counter, by watchers of its own, started with it and
cancelled when it exits; the ``process`` and ``steps`` rows; a ``--root-pid`` server that is gone
stops the agent; the servers' own py-spy runs scanned for after an exec, at most every :data:`SERVER_DUMP_SCAN_S`). Imports anyio, :mod:`agent.model.backoff`, :mod:`agent.model.bus`, :mod:`agent.model.events`,
:mod:`agent.host.targets`, :mod:`agent.host.procinfo`, :mod:`agent.host.exits`, the watchers' protocols and the status board's
states; the runtime wires them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from agent.host.exits import ExecEvents
from agent.host.procinfo import pid_alive
from agent.host.targets import NO_TARGET_WARNING, ProcessState, Target, process_state, target_of
from agent.model.backoff import Backoff
from agent.model.bus import Publisher
from agent.model.events import WatcherStatusChanged
from agent.model.ticks import until_tick
from agent.watchers import TargetWatchers, Watcher
from agent.watchers.status import WatcherState

if TYPE_CHECKING:
    from agent.incidents.evidence import TargetFinder
    from agent.runtime.runstatus import RunStatus


class IncidentState(Protocol):
    """What discovery reads of the incident manager (:class:`agent.incidents.manager.IncidentManager`)."""

    @property
    def current(self) -> object | None: ...

    @property
    def exits_handled(self) -> Collection[int]: ...

__all__ = [
    "REDISCOVER_INTERVAL_S",
    "REDISCOVER_STABLE_AFTER_S",
    "REDISCOVER_STABLE_INTERVAL_S",
    "RESTART_BACKOFF_MAX_S",
    "RESTART_BACKOFF_S",
    "TARGET_ALIVE_INTERVAL_S",
    "IncidentState",
    "TargetWatch",
    "restartable",
    "supervise",
]

log = logging.getLogger("servewatch.runtime")

#: A crashed watcher is restarted after this many seconds, doubling up to the maximum.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 60.0
#: Seconds between target re-discovery scans.
REDISCOVER_INTERVAL_S = 2.0
#: Once the same targets were found for :data:`REDISCOVER_STABLE_AFTER_S`, full scans (every
#: process's parent, host-wide) run this often; in between, every :data:`REDISCOVER_INTERVAL_S`,
#: only the known targets are checked (a signal 0 each), and one that is gone brings a full scan
#: at once and the short interval back.
REDISCOVER_STABLE_INTERVAL_S = 10.0
REDISCOVER_STABLE_AFTER_S = 30.0
#: Seconds between checks that a target whose SDK step counter is watched still runs.
TARGET_ALIVE_INTERVAL_S = 2.0
#: Seconds between scans for the servers' own py-spy runs (their watchdog firing: a ``py-spy
#: dump`` runs longer than this, so each is seen).
SERVER_DUMP_SCAN_S = 0.25


def _innermost(exc: Exception) -> Exception:
    """The one exception inside exception groups of one."""
    while True:
        group: tuple[BaseException, ...] = getattr(exc, "exceptions", ())
        if len(group) != 1 or not isinstance(group[0], Exception):
            return exc
        exc = group[0]


async def _close_source(watcher: Any) -> None:
    """A watcher's step source holds a client (the Prometheus scrape): closed, bounded, shielded."""
    aclose = getattr(getattr(watcher, "source", None), "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            await aclose()


async def supervise(
    name: str, make: Callable[[], Any], bus: Publisher, *, restarts: dict[str, int],
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the watcher ``make()`` returns; when it raises, report ``name`` blind with the
    exception and start a fresh one after a jittered backoff (:data:`RESTART_BACKOFF_S` doubling
    to :data:`RESTART_BACKOFF_MAX_S`; reset after that long without a crash). Never raises
    except cancellation. Ready when the first watcher is ready (or has failed once).

    Args:
        restarts: restarts after a crash, by name (counted here).
    """
    backoff = Backoff(RESTART_BACKOFF_S, RESTART_BACKOFF_MAX_S)
    started = False
    while True:
        watcher = make()
        began = time.monotonic()
        try:
            async with anyio.create_task_group() as inner:
                await inner.start(watcher.run, bus)
                if not started:
                    started = True
                    task_status.started()
            return  # a watcher that returns is done
        except Exception as exc:  # the supervisor's boundary: a crash becomes a status
            if time.monotonic() - began > RESTART_BACKOFF_MAX_S:
                backoff.reset()
            exc = _innermost(exc)
            delay_s = backoff.next_delay_s()
            restarts[name] = restarts.get(name, 0) + 1
            log.error("watcher %s crashed; restarting in %.0f s", name, delay_s, exc_info=exc)
            await bus.publish(WatcherStatusChanged(
                source="runtime", watcher=name, state=WatcherState.BLIND.value,
                reason=f"watcher crashed: {type(exc).__name__}: {str(exc)[:200]}; restarting in {delay_s:.0f} s",
            ))
        finally:
            await _close_source(watcher)
        if not started:
            started = True
            task_status.started()
        await anyio.sleep(delay_s)


def restartable(first: Any, rebuild: Callable[[], Any | None]) -> Callable[[], Any]:
    """What :func:`supervise` starts: the built watcher ``first``; after a crash a fresh one
    (``rebuild()``, its registry factory), or the same one when it sets ``reusable = True``
    (e.g. ``process``, which holds what it watches)."""
    built = [first]

    def make() -> Any:
        if built:
            return built.pop()
        if getattr(first, "reusable", False):
            return first
        fresh = rebuild()
        return fresh if fresh is not None else first

    return make


def _identify(pid: int) -> Target:
    """``pid`` as a :class:`Target` with its creation time (a bare pid when it is gone already)."""
    return target_of(pid) or Target(pid=pid)


def _sdk_folder_refusals(targets: Sequence[Target]) -> list[str]:
    """Why the SDK folder name of a target's user was not trusted (another user took it), one
    line each (:func:`agent.sdk.folders.refusals`). Blocking: ``lstat`` calls."""
    from agent.sdk.folders import refusals

    return refusals(sorted({t.uid for t in targets if t.uid is not None}))


def _counters_denied(targets: Sequence[Target]) -> str | None:
    """``pid 42: /dev/shm/servewatch-0 is owned by root (0700): run as root (sudo)`` when this
    agent may not open a target's SDK step counter, else ``None``. Blocking: ``stat`` calls."""
    from agent.host.security import access_denied
    from agent.sdk.counter import counter_path

    for t in targets:
        why = access_denied(counter_path(t.pid))
        if why is not None:
            return f"pid {t.pid}: {why}"
    return None


def _unptraceable(targets: Sequence[Target]) -> str | None:
    """``pid 42 (uid 0): py-spy needs root or CAP_SYS_PTRACE: run as root (sudo)`` for the first
    target whose memory this agent may not read, else ``None``. Blocking: reads /proc/self."""
    from agent.host.security import can_ptrace

    for t in targets:
        if not can_ptrace(t.uid):
            return f"pid {t.pid} (uid {t.uid}): py-spy needs root or CAP_SYS_PTRACE: run as root (sudo)"
    return None


@dataclass(frozen=True, slots=True)
class _RoundFacts:
    """What one discovery round read on its worker thread (:meth:`TargetWatch._round_facts`).

    Attributes:
        targets: the targets found.
        step_watchers: the SDK counter watchers of each target not watched yet, by
            ``(pid, create_time_s)`` (an empty list: no counter yet).
        refused: why a target user's SDK folder was not trusted, one line each.
        denied: the target whose step counter this agent may not open, ``None`` when none (or
            read only while no counter is watched).
        unptraceable: the first target whose memory py-spy may not read, ``None`` when none.
    """

    targets: list[Target]
    step_watchers: dict[tuple[int, float], list[Watcher]]
    refused: list[str]
    denied: str | None
    unptraceable: str | None


def _plural(n: int, word: str, suffix: str = "s") -> str:
    return f"{n} {word}{suffix if n != 1 else ''}"


class TargetWatch:
    """Re-discovery of the targets, each one watched while it lives (see the module docstring).

    Args:
        discover: the targets now (blocking; the agent's ``discover``).
        finder: what discovery remembers (the ``[target]`` settings, refusals).
        watchers: the built watchers: those that are :class:`~agent.watchers.TargetWatchers` give
            each target its own.
        process_watcher: watches every target found for exit.
        bus: where the per-target watchers publish.
        status: the status rows the runtime decides.
        incidents: the incident manager (whether exits are handled, an incident runs).
        shipper: the span shipper once running (``None``: none), told which servers are watched.
        scraped: a Prometheus watchdog covers stalls (``metrics.url``), so a target without an
            SDK counter is watched all the same.
        stop: stops the agent, with a reason (a ``--root-pid`` server that is gone).
    """

    def __init__(
        self, *, discover: Callable[[], list[Target]], finder: TargetFinder, watchers: Mapping[str, Any],
        process_watcher: Any, bus: Publisher, status: RunStatus, incidents: IncidentState,
        shipper: Callable[[], Any], scraped: bool, stop: Callable[[str], None],
    ) -> None:
        self.discover = discover
        self.finder = finder
        self.per_target = [w for w in watchers.values() if isinstance(w, TargetWatchers)]
        self.process_watcher = process_watcher
        self.bus = bus
        self.status = status
        self.incidents = incidents
        self.shipper = shipper
        self.scraped = scraped
        self.stop = stop
        #: per-target step watchers, keyed by (pid, create time): cancelled when it exits
        self.step_scopes: dict[tuple[int, float], anyio.CancelScope] = {}
        #: the ``pyspy`` row's ready reason while it is blind to a target of another user
        self._pyspy_ready = ""
        #: the first target of the last round py-spy may not read (why, with the fix), or None
        self._unptraceable: str | None = None
        #: the ``--root-pid`` process as identified at start (its exit ends the watch)
        self._root: Target | None = None
        self._told_no_target = False
        #: the targets the servers line was made of, and that line (``_servers_said``)
        self._servers_key: frozenset[tuple[int, float]] | None = None
        self._servers_text = ""

    def looking_for(self) -> str:
        """What discovery looks for, in words (the ``process`` row while none is found)."""
        t = self.finder.config
        what = []
        if t.pids:
            what.append("pids " + ", ".join(map(str, t.pids)))
        if self.finder.root_pids:
            what.append("descendants of " + ", ".join(map(str, self.finder.root_pids)))
        if t.match:
            what.append("titles " + ", ".join(t.match))
        return f"waiting for a target process ({'; '.join(what)}); looking every {REDISCOVER_INTERVAL_S:g} s"

    async def announce(self) -> None:
        """Say what is looked for (the ``process`` row), or that nothing is."""
        if not self.finder.configured:
            log.warning("%s", NO_TARGET_WARNING)  # a health/metrics-only watch: incidents dump nothing
        else:
            await self.status.set("process", WatcherState.WAITING, self.looking_for())

    async def run(self, tg: TaskGroup, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Re-discover targets until the agent stops; watch new ones in ``tg`` (and scan for the
        servers' own py-spy runs there: :meth:`scan_server_dumps`).

        A failure of one round is logged and reported (``process`` blind) and the next round
        runs as usual: discovery never takes the agent down.
        """
        started = False
        found: frozenset[tuple[int, float]] = frozenset()
        same_since = time.monotonic()
        tg.start_soon(self.scan_server_dumps)
        while True:
            try:
                keys = frozenset((t.pid, t.create_time_s) for t in await self._round(tg))
                if keys != found:
                    found, same_since = keys, time.monotonic()
            except Exception as exc:  # the boundary: a bug in one round must not stop the agent
                log.exception("target discovery round failed")
                await self.status.set(
                    "process", WatcherState.BLIND,
                    f"discovery failed: {type(exc).__name__}: {str(exc)[:200]}; retrying in {REDISCOVER_INTERVAL_S:g} s",
                )
            if not started:
                started = True
                task_status.started()
            if await self._root_is_done():
                return
            await anyio.sleep(until_tick(REDISCOVER_INTERVAL_S, anyio.current_time()))
            if found and time.monotonic() - same_since >= REDISCOVER_STABLE_AFTER_S:
                await self._while_stable(found)

    async def scan_server_dumps(self) -> None:
        """Until cancelled: every :data:`SERVER_DUMP_SCAN_S`, the servers' own py-spy runs
        (:meth:`~agent.incidents.evidence.TargetFinder.scan_server_dumps`, off the event loop); a failed
        scan is logged (the first one only: 4 a second would flood the log) and the next one runs."""
        told = False
        dumps = self.finder.server_dumps
        if not await anyio.to_thread.run_sync(dumps.follow_execs):  # a py-spy run is an exec; new threads are not
            log.info("py-spy scans trigger on the kernel's last pid: %s", ExecEvents.unavailable)
        try:
            while True:
                try:
                    if self.finder.server_dumps_may_be_new():  # nothing exec'd: no listing, no thread hop
                        await anyio.to_thread.run_sync(self.finder.scan_server_dumps)
                except Exception:  # a nicety: never in the watching's way
                    if not told:
                        told = True
                        log.exception("scanning for the servers' own py-spy runs failed (said once)")
                await dumps.next_check(SERVER_DUMP_SCAN_S)
        finally:
            dumps.close()

    @staticmethod
    async def _while_stable(found: Iterable[tuple[int, float]]) -> None:
        """A stable set: check the known targets cheaply until the next full scan is due."""
        next_scan = time.monotonic() + REDISCOVER_STABLE_INTERVAL_S - REDISCOVER_INTERVAL_S
        while time.monotonic() < next_scan and all(pid_alive(pid) for pid, _ in found):
            await anyio.sleep(until_tick(REDISCOVER_INTERVAL_S, anyio.current_time()))

    async def _root_is_done(self) -> bool:
        """With ``--root-pid`` alone: once the root process is gone, every target's exit handled
        and no incident running, say so and stop the agent (nothing is left to watch; waiting
        for a pid that cannot come back would wait forever). ``launch`` stops on its own."""
        t = self.finder.config
        if not t.root_pid or t.pids or t.match or self.finder.children:
            return False
        if self._root is None:
            self._root = await anyio.to_thread.run_sync(_identify, t.root_pid)
            return False
        root = self._root
        if process_state(root.pid, create_time_s=root.create_time_s) not in (ProcessState.GONE, ProcessState.ZOMBIE):
            return False
        if not self._all_exits_handled():
            return False
        fact = next((f for tgt, f in self.process_watcher.exits if tgt.pid == root.pid), None)
        how = fact.describe() if fact is not None else "exit status unknown"
        log.warning("root pid %d %s ended (%s): nothing left to watch, stopping", root.pid,
                    repr(root.title) if root.title else "", how)
        self.stop(f"root pid {root.pid} ended")
        return True

    def _all_exits_handled(self) -> bool:
        """No target left watched, no incident running and every target's exit handled."""
        watcher = self.process_watcher
        return not (watcher.pids or self.incidents.current is not None or any(
            pid not in self.incidents.exits_handled for pid in (f.pid for _, f in watcher.exits)
        ))

    async def _round(self, tg: TaskGroup) -> list[Target]:
        """One discovery round (see :meth:`run`); returns the targets found. Everything a round
        reads (``/proc``, the SDK's folders and counters) is read in one worker-thread call
        (:meth:`_round_facts`): one hop per round, not one per target and row."""
        facts = await anyio.to_thread.run_sync(self._round_facts, self.shipper())
        for target in facts.targets:
            self.process_watcher.watch(target)
            await self._watch_steps(tg, target, facts.step_watchers.get((target.pid, target.create_time_s), ()))
        await self._steps_row(facts)
        await self._pyspy_row(facts.unptraceable)
        await self._process_row(facts.targets)
        return facts.targets

    def _round_facts(self, shipper: Any) -> _RoundFacts:
        """What one round reads (blocking): the targets (a failed discovery is logged and reads
        as none), their rings declared and attached (``shipper``), the SDK counter watchers of
        the targets not watched yet, and the facts the ``steps`` and ``pyspy`` rows say."""
        try:
            targets = self.discover()
        except Exception:  # discovery must never take the agent down
            log.exception("target discovery failed")
            targets = []
        if shipper is not None:  # declared watched, their rings attached (now and at each poll)
            shipper.watch({t.pid: t.uid for t in targets})
        watched = set(self.step_scopes)
        step_watchers: dict[tuple[int, float], list[Watcher]] = {}
        for t in targets:
            key = (t.pid, t.create_time_s)
            if key not in watched:  # they read the shm counter
                step_watchers[key] = [w for per_target in self.per_target for w in (per_target.watchers_for(t) or ())]
        counted = len(watched) + sum(1 for ws in step_watchers.values() if ws)
        return _RoundFacts(
            targets=targets, step_watchers=step_watchers,
            refused=_sdk_folder_refusals(targets) if targets else [],
            denied=_counters_denied(targets) if targets and not counted else None,
            unptraceable=_unptraceable(targets),
        )

    async def _watch_steps(self, tg: TaskGroup, target: Target, watchers: Sequence[Watcher]) -> None:
        """Start ``target``'s own watchers (its SDK counter's: ``watchers``, read by the round),
        once, if it has any now."""
        key = (target.pid, target.create_time_s)
        if key in self.step_scopes or not watchers:
            return  # watched, or no SDK counter (yet): the Prometheus watchdog, if any, covers it
        self.step_scopes[key] = await tg.start(self._run_target_watchers, target, watchers)
        log.info("watching forward steps of pid %d (%s)", target.pid, target.title)

    async def _run_target_watchers(
        self, target: Target, watchers: Sequence[Watcher], *,
        task_status: TaskStatus[anyio.CancelScope] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run one target's own watchers (the ``steps`` watchdog and step watcher of its SDK
        counter) until it exits."""
        with anyio.CancelScope() as scope:
            try:
                async with anyio.create_task_group() as tg:
                    for watcher in watchers:
                        await tg.start(watcher.run, self.bus)
                    task_status.started(scope)
                    while process_state(target.pid, create_time_s=target.create_time_s or 0.0) not in (
                        ProcessState.GONE, ProcessState.ZOMBIE
                    ):
                        await anyio.sleep(until_tick(TARGET_ALIVE_INTERVAL_S, anyio.current_time()))
                    tg.cancel_scope.cancel("target exited")
            finally:
                self.step_scopes.pop((target.pid, target.create_time_s), None)

    async def _steps_row(self, facts: _RoundFacts) -> None:
        """The ``steps`` row: how many ranks' counters are watched, that none is, or that this
        agent may not open them (``BLIND``: another user's SDK folder, with the fix)."""
        n = len(self.step_scopes)
        refused, targets = facts.refused, facts.targets
        said = f"; counter refused: {'; '.join(refused)}" if refused else ""
        denied = facts.denied if not n else None
        if n:
            await self.status.set("steps", WatcherState.READY, f"{_plural(n, 'rank')} via shm counter{said}")
        elif denied is not None:
            await self.status.set("steps", WatcherState.BLIND, f"cannot open the step counter of {denied}")
        elif (targets and not self.scraped) or self.status.board.get("steps") is not None or refused:
            await self.status.set(
                "steps", WatcherState.WAITING,
                "no SDK step counter in the targets now"
                + ("" if self.scraped else "; stalls need agent.sdk.step() or --metrics-url") + said,
            )

    def actor_blind(self, name: str, detail: str) -> str | None:
        """Why actor ``name``, whose startup check said ``detail``, cannot act on the targets of the
        last round (py-spy on another user's process without root), or ``None``
        (:meth:`agent.runtime.runstatus.RunStatus.check_actors`)."""
        if name != "pyspy" or self._unptraceable is None:
            return None
        self._pyspy_ready = f"ready: {detail}" if detail else "ready"
        return f"cannot read the stacks of {self._unptraceable}"

    async def _pyspy_row(self, blocked: str | None) -> None:
        """The ``pyspy`` row turns ``BLIND`` (with the fix) while a target is of a user whose
        memory this agent may not read (no root, no CAP_SYS_PTRACE: ``blocked`` names it, read
        by the round), and back when none is."""
        self._unptraceable = blocked
        row = self.status.board.get("pyspy")
        if row is None or row.state is WatcherState.WAITING:
            return
        if blocked is not None and row.state is WatcherState.READY:
            self._pyspy_ready = row.reason
            await self.status.set("pyspy", WatcherState.BLIND, f"cannot read the stacks of {blocked}")
        elif blocked is None and row.state is WatcherState.BLIND and self._pyspy_ready:
            await self.status.set("pyspy", WatcherState.READY, self._pyspy_ready)
            self._pyspy_ready = ""

    async def _servers_said(self, targets: Sequence[Target]) -> str:
        """``; 2 servers: pid 1234 (...), pid 1300 (...)`` (which servers the targets are:
        :meth:`~agent.incidents.evidence.TargetFinder.describe_servers`), read again only when the targets
        change; ``""`` when it cannot be read."""
        key = frozenset((t.pid, t.create_time_s) for t in targets)
        if self._servers_key != key:
            try:
                said = await anyio.to_thread.run_sync(self.finder.describe_servers, targets)
            except Exception:  # a view: the watch goes on without it
                log.exception("describing the watched servers failed")
                said = ""
            self._servers_key, self._servers_text = key, f"; {said}" if said else ""
        return self._servers_text

    async def _process_row(self, targets: Sequence[Target]) -> None:
        """The ``process`` row (how many targets, whom discovery refused), and a warning when
        none is found at first (and when one turns up after that)."""
        if not self.finder.configured:
            return
        others = self.finder.refused
        said = ""
        if others:
            shown = "; ".join(list(others.values())[:3]) + ("; ..." if len(others) > 3 else "")
            said = f"; refused {_plural(len(others), 'process', 'es')} of another uid: {shown}"
        if targets:
            servers = await self._servers_said(targets)
            await self.status.set("process", WatcherState.READY,
                                  f"watching {_plural(len(targets), 'target process', 'es')}{servers}{said}")
        else:
            await self.status.set("process", WatcherState.WAITING, self.looking_for() + said)
        t = self.finder.config
        if not targets and not self._told_no_target:
            self._told_no_target = True
            log.warning(
                "no target process found yet (pids %s, root pid %s, titles %s); still looking every %g s",
                t.pids or "-", t.root_pid or "-", t.match or "-", REDISCOVER_INTERVAL_S,
            )
        elif targets and self._told_no_target:
            self._told_no_target = False
            # good news, said by the process watcher's status line ("watching N target processes")
            log.info("found %d target process(es): %s", len(targets), ", ".join(str(x.pid) for x in targets))
