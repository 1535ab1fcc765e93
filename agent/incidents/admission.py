"""Which trigger events open an incident: the admission policies the incident manager asks in turn.

Owns :class:`TriggerPolicy` (the seam: one policy per concern, :attr:`IncidentManager.policies
<agent.incidents.manager.IncidentManager.policies>`), :class:`Fold` and :class:`ExitPolicy`, the policy of
exits (the exit rules of a server's life, measured on real servers):

* an exit refused on its own facts (:func:`exit_admission`): an orderly exit (code 0,
  SIGTERM/SIGINT or 143/130) is a stop someone asked for; an exit during its server's orderly
  stop is part of that stop; a failure opens an incident;
* an expected exit (:meth:`ExitPolicy.expect_exit`: ``launch`` passed the operator's signal on)
  and the knock-on exits of hard mode's signal (its window, :meth:`ExitPolicy.hard_signalled`)
  open none (they are noted on the incident that signalled);
* a later trigger of the same failure (a health check, or a stall of the dead rank's server,
  within ``incident.exit_followup_s`` of an exit incident) is folded into that incident; a health
  check failing after every watched process stopped in order is the stopped server's port;
* a health failure of a server within hard mode's window of its signal is that
  signal's consequence: it joins the incident that signalled ("killed by servewatch --hard,
  incident X", noted on it), never a new incident blaming the server;
* a refused health check (or a 5xx) is judged once the watched processes' exits are in
  (:meth:`ExitPolicy.settle`).

Imports :mod:`agent.model.events`, :mod:`agent.host.pidfds`, psutil (lazily) and the standard library; it
reads the incident manager through :class:`Incidents` (never imports it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio

from agent.host import pidfds
from agent.model.events import STOP_SIGNALS as EVENT_STOP_SIGNALS
from agent.model.events import (
    ExitFact,
    ExitKind,
    HealthCheckFailed,
    TargetExited,
    Trigger,
    TriggerEvent,
)

if TYPE_CHECKING:
    from agent.host.targets import Target
    from agent.model.events import IncidentOpened

__all__ = [
    "HEALTH_SETTLE_CLASSES",
    "HEALTH_SETTLE_S",
    "STOP_SIGNALS",
    "ExitPolicy",
    "ExitRules",
    "Fold",
    "Incident",
    "Incidents",
    "TriggerPolicy",
    "describe_exit",
    "exit_admission",
    "server_tree",
    "stop_signal_of",
]

log = logging.getLogger("servewatch.incidents")

#: Health failures that may be a server stopping in order, judged once its processes' exits are
#: in, at most this many seconds later (by the probe's error class): a closed port (``refused``:
#: a frontend closes it first, then stops its ranks, which may take their grace periods) or a 5xx
#: (SGLang answers 503 while it shuts down).
HEALTH_SETTLE_S: dict[str, float] = {"refused": 30.0, "5xx": 5.0}
HEALTH_SETTLE_CLASSES = frozenset(HEALTH_SETTLE_S)

#: signals that ask a process to stop (an operator, systemd, a job scheduler), not crash it
STOP_SIGNALS: dict[int, str] = dict(EVENT_STOP_SIGNALS)


@dataclass(frozen=True, slots=True)
class Fold:
    """A trigger that belongs to something already seen, so it opens no incident.

    Attributes:
        incident_id: the incident that holds its evidence (``""``: none, e.g. an orderly stop).
        counted: counted in the manager's ``suppressed`` (a detection folded into an incident).
    """

    incident_id: str = ""
    counted: bool = True


class ExitRules(Protocol):
    """The incident settings the exit policy follows (:class:`agent.incidents.manager.IncidentConfig`)."""

    on_exit_codes_only_nonzero: bool
    signal_stop_is_incident: bool
    operator_stop_is_incident: bool
    hard_mode_exit_is_incident: bool
    hard_mode_exit_grace_s: float
    exit_followup_s: float


class Incident(Protocol):
    """One incident as a policy reads it (:class:`agent.incidents.manager.Incident`)."""

    @property
    def opened(self) -> IncidentOpened: ...

    @property
    def targets(self) -> Sequence[Target]: ...

    @property
    def exits_after_hard_signal(self) -> dict[int, str]: ...

    @property
    def after_hard_signal(self) -> list[str]: ...

    @property
    def server(self) -> int | None: ...


class Incidents(Protocol):
    """The incident manager as a policy reads it (:class:`agent.incidents.manager.IncidentManager`)."""

    @property
    def current(self) -> Incident | None: ...

    @property
    def running(self) -> Mapping[str, Incident]: ...

    def event_server(self, event: TriggerEvent) -> int | None: ...

    @property
    def records(self) -> Sequence[Incident]: ...

    def discover(self) -> list[Target]: ...


class TriggerPolicy(Protocol):
    """One concern of admission, asked by the incident manager for every trigger event, in the
    order of its ``policies`` (then the cooldown, then the job's own admission)."""

    def settles(self, event: TriggerEvent) -> bool:
        """Whether ``event`` is judged only after :meth:`settle` (the manager goes on meanwhile)."""
        ...

    async def settle(self, event: TriggerEvent, manager: Incidents) -> None:
        """Wait, bounded, until ``event`` can be judged."""
        ...

    def refuses(self, event: TriggerEvent) -> str | None:
        """Why ``event`` opens no incident on its own facts (said by the policy), else ``None``."""
        ...

    async def folds(self, event: TriggerEvent, manager: Incidents) -> Fold | None:
        """The :class:`Fold` when ``event`` belongs to an incident already opened or to an orderly
        stop (said by the policy), else ``None``."""
        ...

    def decided(self, event: TriggerEvent, outcome: str) -> None:
        """What became of an admitted ``event``: ``incident <id>``, ``no new incident: cooldown of <id>``."""
        ...

    def handled(self, event: TriggerEvent) -> None:
        """``event`` is done with, whatever became of it."""
        ...


def stop_signal_of(event: TargetExited) -> str | None:
    """``"SIGTERM"`` or ``"SIGINT"`` when the target ended because it was asked to stop, else ``None``.

    Either the signal itself ended it (``signal`` 15 or 2, a ``-15`` return code), or it caught the
    signal and exited with the shell convention ``128 + N`` (``exit_code`` 143 or 130).
    SIGKILL (9, exit code 137: the OOM killer, ``kill -9``) and crash signals are never a stop.
    """
    return event.exit.stop_signal or None


def describe_exit(event: TargetExited) -> str:
    """``exit code 3``, ``signal 9 (SIGKILL)``, ``killed by the OOM killer (signal 9 (SIGKILL);
    kernel log: ...)``, or the unknown status in words with what was seen (never ``None``)."""
    return event.exit.status_words()


def exit_admission(fact: ExitFact, *, exit_zero_is_incident: bool, signal_stop_is_incident: bool) -> str:
    """Whether an exit opens an incident on its own facts: ``""`` when it does, else why not.

    The exit policy, in order: an orderly exit (code 0, SIGTERM/SIGINT or 143/130) is a stop
    someone asked for; an exit during its server's orderly stop (``tree_stopped``: the parent
    stopped in order right after, or, status unknown, the whole tree went down with it; never a
    crash signal nor the OOM killer) is part of that stop; a failure (non-zero code, a crash or
    kill signal, the OOM killer) opens one; so does an unknown status while the rest of its tree
    runs on (the verdict then says "exit status unknown", never a crash at high confidence).
    """
    if fact.kind is ExitKind.ORDERLY:
        if fact.stop_signal:
            return "" if signal_stop_is_incident else f"stopped by {fact.stop_signal} ({fact.status_words()})"
        return "" if exit_zero_is_incident else f"exited in order ({fact.status_words()})"
    if fact.tree_stopped and not fact.oom:
        return f"stopped with its whole server ({fact.status_words()}; {fact.orderly_reason})" \
            if fact.kind is not ExitKind.UNKNOWN else "stopped with its whole server (exit status unknown)"
    return ""


def _descendants(pids: Sequence[int]) -> set[int]:
    """All live descendants of ``pids`` (zombies included: their exits are still to come)."""
    import psutil

    found: set[int] = set()
    for pid in pids:
        try:
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except (psutil.Error, OSError):
            continue
    return found


def _listener_of_url(url: str) -> int | None:
    """The pid listening on ``url``'s port, ``None`` when none or unreadable (blocking)."""
    from agent.verdict.servers import listener_of_port, port_of_url

    port = port_of_url(url)
    return listener_of_port(port) if port is not None else None


def server_tree(targets: Sequence[Target]) -> set[int]:
    """The targets' parents (not this agent nor its ancestors) and all their descendants."""
    import psutil

    ours = {os.getpid()}
    try:
        ours.update(p.pid for p in psutil.Process().parents())
    except (psutil.Error, OSError):
        pass
    parents: set[int] = set()
    for target in targets:
        try:
            ppid = psutil.Process(target.pid).ppid()
        except (psutil.Error, OSError):
            continue
        if ppid not in ours and ppid > 1:
            parents.add(ppid)
    return parents | _descendants([*parents, *(t.pid for t in targets)])


class ExitPolicy:
    """The exit rules (see the module docstring), and what each exit led to.

    Args:
        config: the incident settings (``on_exit_codes_only_nonzero``, ``signal_stop_is_incident``,
            ``operator_stop_is_incident``, ``hard_mode_exit_is_incident``,
            ``hard_mode_exit_grace_s``, ``exit_followup_s``).

    Attributes:
        exits_handled: pids whose :class:`~agent.model.events.TargetExited` was handled (an incident
            written, or none needed).
        exit_outcomes: what each exit led to, in words (``incident <id>``, ``no incident:
            stopped by SIGTERM ...``).
        hard_signalled_pids: pids hard mode signalled (their exits open no new incident).
    """

    def __init__(self, config: ExitRules) -> None:
        self.config = config
        self.exits_handled: set[int] = set()
        self.exit_outcomes: dict[int, str] = {}
        self.hard_signalled_pids: set[int] = set()
        #: (monotonic time, one line) of the last exit admitted as an orderly stop; time of the last failing exit
        self.last_orderly_stop: tuple[float, str] = (0.0, "")
        self.last_failed_exit = 0.0
        self._expected: set[int] = set()
        #: after hard mode's signal: (until, pids of that server's tree, the incident)
        self._hard_windows: list[tuple[float, frozenset[int], Incident]] = []
        #: incidents whose manifest changed since they were written (a knock-on exit noted)
        self.changed: list[Incident] = []
        #: when the health check last turned healthy again, ns since the epoch (0: never seen;
        #: set by :class:`agent.incidents.lifecycle.Lifecycle`): a failure before it is judged at once
        self.health_recovered_ns = 0

    # -- what the manager tells it --------------------------------------------------------------

    def expect_exit(self, pid: int, *, tree: bool = False) -> None:
        """The exit of ``pid`` is expected (it was asked to stop): it opens no incident.

        With ``tree``, so are the exits of all its descendants now (launch's server and its
        ranks, which exit because the server stops them).
        """
        self._expected.add(pid)
        if tree:
            self._expected.update(_descendants([pid]))

    def knock_on_window(self, record: Incident, tree: Iterable[int]) -> None:
        """Hard mode signalled for ``record``: exits of ``tree`` (the server's processes) within
        ``hard_mode_exit_grace_s`` are knock-on exits of it, noted on ``record`` (one window per
        incident)."""
        if not any(w[2] is record for w in self._hard_windows):
            self._hard_windows.append((time.monotonic() + self.config.hard_mode_exit_grace_s, frozenset(tree), record))

    # -- TriggerPolicy ------------------------------------------------------------------------

    def settles(self, event: TriggerEvent) -> bool:
        return isinstance(event, HealthCheckFailed) and event.error_class in HEALTH_SETTLE_CLASSES

    async def settle(self, event: TriggerEvent, manager: Incidents) -> None:
        """A health check refused or answered 5xx: a server stopping in order closes its port
        (or says 503) before its ranks end. Wait (:data:`HEALTH_SETTLE_S`) for the watched
        processes' exits (their own checks run meanwhile), so that it is judged with them: no
        incident when they all stopped in order, the exit incident's when one failed."""
        try:
            live = await anyio.to_thread.run_sync(manager.discover)
        except Exception:  # judged at once, as any other trigger
            log.exception("discovery for the health check's incident failed")
            live = []
        if not (live or self.last_orderly_stop[0]):
            return
        since = time.monotonic()
        error_class = event.error_class if isinstance(event, HealthCheckFailed) else ""
        with anyio.move_on_after(HEALTH_SETTLE_S.get(error_class, 5.0)):  # processes to watch end: a moment
            while not await self._server_stopped_in_order(manager):
                if self.health_recovered_ns > event.time_unix_nano:
                    return  # healthy again (a restart): judged now, by the lifecycle's rule
                if self.last_failed_exit > since:
                    # a failure: the health failure follows from its exit incident, once open
                    while self._exit_incident_before(event, manager) is None:
                        await anyio.sleep(0.05)
                    return
                await anyio.sleep(0.2)

    def refuses(self, event: TriggerEvent) -> str | None:
        if not isinstance(event, TargetExited):
            return None
        why = self._refusal(event)
        if why is None:
            self.last_failed_exit = time.monotonic()
        return why

    def _refusal(self, event: TargetExited) -> str | None:
        if event.pid in self._expected and not self.config.operator_stop_is_incident:
            log.info("pid %d exited after the operator's stop (%s): no incident", event.pid, describe_exit(event))
            self.exit_outcomes[event.pid] = "no incident: the operator's stop"
            self.last_orderly_stop = (time.monotonic(), f"pid {event.pid} stopped by the operator")
            return "the operator's stop"  # stopped on purpose (an operator's signal passed on by launch)
        knock_on = self._hard_window_of(event.pid)
        if not self.config.hard_mode_exit_is_incident and (knock_on is not None or event.pid in self.hard_signalled_pids):
            log.info("pid %d exited after hard mode's signal (%s): no new incident", event.pid, describe_exit(event))
            self.exit_outcomes[event.pid] = "no new incident: after hard mode's signal"
            if knock_on is not None:
                self._note_knock_on(knock_on, event)
            return "after hard mode's signal"  # the stall incident that signalled it already holds the evidence
        ours = event.pid in self._expected or event.pid in self.hard_signalled_pids or knock_on is not None
        why_not = exit_admission(
            event.exit, exit_zero_is_incident=not self.config.on_exit_codes_only_nonzero,
            signal_stop_is_incident=self.config.signal_stop_is_incident or ours,  # settings above decided those
        )
        if why_not:
            log.info("pid %d %r %s: no incident", event.pid, event.title, why_not)
            self.exit_outcomes[event.pid] = f"no incident: {why_not}"
            self.last_orderly_stop = (time.monotonic(), f"pid {event.pid} {why_not}")
            return why_not  # asked to stop, or stopped with its server: not a crash
        return None

    async def folds(self, event: TriggerEvent, manager: Incidents) -> Fold | None:
        signalled = await self._hard_incident_of(event)
        if signalled is not None:
            words = f"killed by servewatch --hard, incident {signalled.opened.incident_id}"
            log.warning("%s detected (%s): %s; joined to that incident, no new incident", event.trigger, event.describe(), words)
            signalled.after_hard_signal.append(f"{event.trigger}: {event.describe()}: {words}")
            if signalled not in self.changed:
                self.changed.append(signalled)
            return Fold(signalled.opened.incident_id)
        followed = self._exit_incident_before(event, manager)
        if followed is not None:
            age_s = max(0.0, (time.time_ns() - followed.opened.time_unix_nano) / 1e9)
            log.warning("%s detected (%s) %.0f s after exit incident %s (%s): the same failure, no second incident",
                        event.trigger, event.describe(), age_s, followed.opened.incident_id, followed.opened.detail)
            return Fold(followed.opened.incident_id)
        if isinstance(event, HealthCheckFailed) and await self._server_stopped_in_order(manager):
            log.warning("health detected (%s) after every watched process stopped in order (last: %s): the server"
                        " was stopped, no incident", event.describe(), self.last_orderly_stop[1])
            return Fold(counted=False)
        return None

    def decided(self, event: TriggerEvent, outcome: str) -> None:
        if isinstance(event, TargetExited):
            self.exit_outcomes[event.pid] = outcome

    def handled(self, event: TriggerEvent) -> None:
        if isinstance(event, TargetExited):
            self.exits_handled.add(event.pid)
            pidfds.release_exited(event.pid, event.exit.started_time_unix_nano)

    # -- the rules ------------------------------------------------------------------------------

    def _hard_window_of(self, pid: int) -> Incident | None:
        now = time.monotonic()
        self._hard_windows[:] = [w for w in self._hard_windows if w[0] > now]
        for _, pids, record in self._hard_windows:
            if pid in pids:
                return record
        return None

    async def _hard_incident_of(self, event: TriggerEvent) -> Incident | None:
        """The incident whose hard-mode signal the health failure ``event`` follows (the exits
        are :meth:`refuses`'s; a stall is the hang's own, never the signal's): a window of it is
        open and the listener of the health URL's port is in that window's server tree; with no
        listener (the server gone), the only window open. ``None`` otherwise, or when
        ``hard_mode_exit_is_incident`` is set."""
        if not isinstance(event, HealthCheckFailed) or self.config.hard_mode_exit_is_incident:
            return None
        now = time.monotonic()
        self._hard_windows[:] = [w for w in self._hard_windows if w[0] > now]
        if not self._hard_windows:
            return None
        pid = await anyio.to_thread.run_sync(_listener_of_url, event.url)
        if pid is not None:
            return next((record for _, pids, record in self._hard_windows if pid in pids), None)
        return self._hard_windows[0][2] if len(self._hard_windows) == 1 else None

    def _note_knock_on(self, record: Incident, event: TargetExited) -> None:
        """Record a knock-on exit on the incident whose hard signal caused it (its manifest is
        rewritten by the manager, off the loop)."""
        record.exits_after_hard_signal[event.pid] = f"{event.title or 'pid ' + str(event.pid)}: {describe_exit(event)}"
        if record not in self.changed:
            self.changed.append(record)

    async def _server_stopped_in_order(self, manager: Incidents) -> bool:
        """The watched processes all ended, the last exits being orderly stops (within
        ``exit_followup_s``, no failing exit since): a health check failing now is the stopped
        server's port, not an incident."""
        when, _ = self.last_orderly_stop
        if not when or time.monotonic() - when > max(self.config.exit_followup_s, 1.0):
            return False
        if self.last_failed_exit >= when:
            return False
        try:
            live = await anyio.to_thread.run_sync(manager.discover)
        except Exception:  # discovery failing is no reason to drop a health incident
            log.exception("discovery for the health check's incident failed")
            return False
        return not live

    def _exit_incident_before(self, event: TriggerEvent, manager: Incidents) -> Incident | None:
        """The exit incident (running, or opened within ``exit_followup_s``) that another trigger
        (a health failure; a stall of one of its targets) follows from: one death, one incident;
        never another server's (both servers known and not the same)."""
        if isinstance(event, TargetExited) or self.config.exit_followup_s <= 0:
            return None
        pid = event.subject_pid
        server = manager.event_server(event)
        now = time.time_ns()
        running = list(manager.running.values())
        if manager.current is not None and not any(manager.current is r for r in running):
            running.append(manager.current)
        for record in [*reversed(running), *reversed(manager.records)]:
            if record.opened.trigger != Trigger.EXIT:
                continue
            if (now - record.opened.time_unix_nano) / 1e9 > self.config.exit_followup_s:
                continue
            if server is not None and record.server not in (None, server):
                continue  # another server's death
            if pid is None or pid in {t.pid for t in record.targets}:
                return record
        return None
