"""Gathers an incident's evidence, server by server, and asks :mod:`agent.verdict.rules` for the verdict.

Owns the I/O around the pure verdict: forward-step counters read when the incident opens and
again once the evidence is in, process states, the exit facts of the process whose exit
triggered the incident, the py-spy dumps and Flight Recorder dumps the incident's actions wrote
(read back from their artifacts, so the verdict is a function of the bundle plus those readings),
and the server boundaries (:func:`agent.verdict.servers.server_groups`): each server is judged apart, and
the incident's verdict is the server of the process (or the endpoint) that opened it.

Used by :mod:`agent.incidents.manager` through the two calls of :class:`VerdictJudge`; imports
:mod:`agent.verdict.rules`, :mod:`agent.model.events`, :mod:`agent.host.targets`, :mod:`agent.verdict.servers`, the SDK's
public counter reader (:mod:`agent.sdk.counter`), the stack model (:mod:`agent.model.stacks`) and
:mod:`agent.model.ranks`; never an actor, a watcher or an exporter.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal as signal_mod
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio

from agent.host.exits import ExitFact, zombie_fact
from agent.host.ownactions import OwnActionLog, stopped_by_us
from agent.host.procinfo import exit_fact_of
from agent.host.startup import startup_progress
from agent.host.targets import (
    ProcessState,
    Target,
    process_state,
    rank_environ,
    uninterruptible_threads,
)
from agent.model.events import (
    Action,
    ActionResult,
    Event,
    FrontendExited,
    HealthCheckFailed,
    Outcome,
    RequestStalled,
    TargetExited,
    Trigger,
    TriggerEvent,
    WatchdogStalled,
)
from agent.model.ranks import distinct_env_ranks, parse_title, world_ranks
from agent.model.stacks import ThreadStack, parse_dump
from agent.sdk.counter import CounterSnapshot
from agent.verdict.rules import (
    Evidence,
    FrameClass,
    RankEvidence,
    Role,
    Verdict,
    classify_wait,
    decide,
    warm_up,
)
from agent.verdict.servers import (
    ServerGroup,
    ancestors,
    command_words,
    frontend_command,
    listener_of_port,
    port_of_url,
    server_groups,
)

__all__ = [
    "MIN_PROGRESS_INTERVAL_S",
    "ProgressSource",
    "VerdictJudge",
    "job_groups",
    "pick_incident_verdict",
    "read_steps",
    "signal_name",
    "trigger_of",
    "warm_up_analyzer",
]

log = logging.getLogger("servewatch.judge")

#: Largest artifact read back for the verdict, bytes.
_MAX_ARTIFACT_BYTES = 64 * 1024 * 1024
#: Attribute of a ``pyspy.dump`` result that says what happened reading the stack, when not plain
#: (:data:`agent.actors.pyspy.NOTE_ATTR`: the judge reads results, it imports no actor).
PYSPY_NOTE_ATTR = "servewatch.pyspy.note"


def signal_name(number: int | None) -> str | None:
    """``11`` -> ``"SIGSEGV"``; ``None`` stays ``None``."""
    if number is None:
        return None
    try:
        return signal_mod.Signals(number).name
    except ValueError:
        return f"signal {number}"


_warm_up_lock = threading.Lock()
_warm_up_thread: threading.Thread | None = None


def warm_up_analyzer() -> threading.Thread:
    """Start importing torch's Flight Recorder analyzer (:func:`agent.verdict.rules.warm_up`) on a
    daemon thread, once per process; later calls return the same thread (alive or finished).
    Never raises: torch is optional and a failed import only leaves ``Op.match`` out of a verdict."""
    global _warm_up_thread
    with _warm_up_lock:
        if _warm_up_thread is None:
            _warm_up_thread = threading.Thread(target=warm_up, name="servewatch-fr-analyzer", daemon=True)
            _warm_up_thread.start()
        return _warm_up_thread


def _snapshots(pids: Sequence[int], socket_dir: Path | None) -> dict[int, CounterSnapshot]:
    """Counters of ``pids`` from their own user's SDK folder and owned by it (never another user's forgery)."""
    from agent.host.sdkclient import read_step_counter

    out: dict[int, CounterSnapshot] = {}
    for pid in pids:
        snap = read_step_counter(pid, socket_dir)
        if snap is not None and snap.pid == pid:
            out[pid] = snap
    return out


def read_steps(pids: Sequence[int], socket_dir: Path | None = None) -> dict[int, int]:
    """Forward-step counters of ``pids`` that have an SDK counter file (tmpfs reads)."""
    return {pid: snap.forward_ct for pid, snap in _snapshots(pids, socket_dir).items()}


def _read_json(path: str) -> Any:
    p = Path(path)
    try:
        if p.stat().st_size > _MAX_ARTIFACT_BYTES:
            return None
        return json.loads(p.read_bytes())
    except (OSError, ValueError):
        return None


def trigger_of(cause: Event | None) -> str:
    """``stall``, ``exit``, ``health``, a trigger event's own ``TRIGGER`` (``startup_stall``) or
    ``manual`` (no cause) for the event that opened an incident."""
    if isinstance(cause, WatchdogStalled):
        return "stall"
    if isinstance(cause, TargetExited):
        return "exit"
    if isinstance(cause, HealthCheckFailed):
        return "health"
    if isinstance(cause, RequestStalled):
        return Trigger.REQUEST_STALL
    if isinstance(cause, TriggerEvent) and cause.TRIGGER:  # a trigger of its own (startup_stall)
        return cause.TRIGGER
    return "manual" if cause is None else type(cause).__name__


#: Least time between the two readings of a server's progress counter in a one-shot dump or a
#: health incident, seconds (a busy vLLM or SGLang steps many times a second and its step gauges
#: move at every step: 0.75 s sees several; the wait is most of what a frontend verdict adds).
MIN_PROGRESS_INTERVAL_S = 0.75


class _Reading(Protocol):
    forward_ct: int
    busy: bool
    last_progress_monotonic_ns: int | None
    read_monotonic_ns: int


class ProgressSource(Protocol):
    """A server-wide progress counter the judge reads twice around a one-shot incident
    (:class:`agent.watchers.steps.PrometheusStepSource`: its ``read`` says when the counter or a
    step gauge last moved; ``None`` when the scrape failed)."""

    url: str
    counter: str

    async def read(self) -> _Reading | None: ...

    def status(self) -> tuple[str, str]:
        """``(state, reason)`` after the last read (``blind`` with why it failed)."""
        ...


_Source = TypeVar("_Source", bound=ProgressSource)

#: Frames of a coordinator that waits on its workers' answer (vLLM's executor RPC).
_WAITS_ON_WORKERS = re.compile(r"vllm/v1/executor/|collective_rpc|execute_model")


@dataclass(slots=True)
class _Readings:
    """What was read for every process of the incident once."""

    results: list[ActionResult]
    cause: Event | None
    steps_before: dict[int, int]
    after: dict[int, CounterSnapshot]
    #: processes stopped (state T/t) when the incident opened and still when the evidence was in
    stopped: frozenset[int] = frozenset()
    #: processes with a thread in uninterruptible sleep (state D) when the incident opened and the
    #: same thread still when the evidence was in: pid -> the kernel function it waits in ("": unknown)
    dsleep: Mapping[int, str] = field(default_factory=dict)
    #: the server's progress counter: (advanced, in words, busy, the pid listening on its URL)
    progress: tuple[bool, str, bool, int | None] | None = None
    #: no target was found: the only process is the one whose exit opened the incident
    no_targets: bool = False
    #: the pids listening on the ports of the watched URLs and the failed health URL: HTTP frontends
    #: (read for a health incident only: a socket table scan, ~10 ms a port)
    listeners: frozenset[int] = frozenset()


def _unread(source: ProgressSource) -> str:
    """Why ``source`` gave no reading, in words: its ``status()`` reason."""
    state, reason = source.status()
    return f"no reading: {reason}" if state != "ready" and reason else f"no reading of {source.url}"


class VerdictJudge:
    """The two calls :class:`agent.incidents.manager.IncidentManager` makes around an incident.

    Args:
        shm_dir: folder of the SDK's counter files (default: the SDK's).
        warm_up: start loading torch's analyzer when a multi-target incident opens.
        endpoint_urls: the server URLs the agent watches (``/metrics``, ``/health``): a stall or a
            health failure without a pid is attributed to the server listening on that URL's port.
    """

    def __init__(self, *, shm_dir: Path | None = None, warm_up: bool = True,
                 endpoint_urls: Sequence[str] = (), own_actions: OwnActionLog | None = None) -> None:
        """Args:
        shm_dir: folder of the SDK counter files (default: the SDK's).
        warm_up: start loading torch's analyzer when a multi-target incident opens (a watching
            agent); a one-shot ``dump`` sets it off: it ends in a second, and ``Op.match`` is
            only asked when two ranks' signatures differ (then it is imported on the spot).
        endpoint_urls: see the class docstring.
        own_actions: what servewatch itself does to the servers (its py-spy's ptrace stops are
            never a process "stopped"); ``None``: this process's own actions only.
        """
        self.shm_dir = shm_dir
        self.own_actions = own_actions or OwnActionLog(None)
        self.warm_up = warm_up
        self.endpoint_urls = tuple(u for u in endpoint_urls if u)
        #: a one-shot incident's progress source (``servewatch dump --metrics-url``): read when
        #: the incident opens and again, at least :data:`MIN_PROGRESS_INTERVAL_S` later, before
        #: the verdict; ``None``: none (a watching agent has its watchdog)
        self.progress_source: ProgressSource | None = None
        #: the triggers whose verdict reads :attr:`progress_source` (a watching agent's health
        #: incidents: :meth:`read_progress`); ``None``: every incident (a one-shot ``dump``)
        self.progress_triggers: frozenset[str] | None = None
        self._progress_at_open: _Reading | None = None
        #: why the given :attr:`progress_source` gave no reading for the last verdict, in words
        #: (``""``: it was read, or none was given)
        self.progress_unread = ""
        #: the preemptions with no progress across the last two readings of :attr:`progress_source`
        #: and the seconds they were counted over (vLLM #25538); ``None``: none, or not read
        self.progress_preempted: tuple[int, float] | None = None
        #: pids stopped (state T/t) when the last incident of their server opened
        self._stopped_at_open: frozenset[int] = frozenset()
        #: each target's threads in uninterruptible sleep (state D) when its incident opened
        self._dsleep_at_open: dict[int, frozenset[int]] = {}
        self._groups: list[ServerGroup] = []
        #: the evidence of each server judged by the last :meth:`decide` (a job's coordinator
        #: judges every host's together: :mod:`agent.fleet.host_summary` sends it on)
        self.last_evidence: list[Evidence] = []

    def opened(self, targets: Sequence[Target], trigger: str = "") -> dict[int, int]:
        """Step counters when the incident opens (microseconds; blocking: each counter is found in
        its user's private folder and checked against its owner, ``/proc`` reads).

        With more than one target, also starts importing torch's Flight Recorder analyzer
        (:func:`agent.verdict.rules.warm_up`, seconds, once per process) on a daemon thread, so it is
        loaded while the incident's evidence is gathered rather than in :meth:`decide`. A single
        process never needs it (no cross-rank comparison), and an agent that only watches never
        imports torch (about 200 MB of RSS and a larger heap for the garbage collector to walk).
        """
        if self.warm_up and len(targets) > 1:
            warm_up_analyzer()
        # several servers' incidents may be open at once: these targets' states replace only theirs
        pids = {t.pid for t in targets}
        self._stopped_at_open = _stopped(targets, self.own_actions) | frozenset(p for p in self._stopped_at_open if p not in pids)
        self._dsleep_at_open = {**{p: t for p, t in self._dsleep_at_open.items() if p not in pids}, **_in_dsleep(targets)}
        wanted = self.progress_triggers is None or trigger in self.progress_triggers
        self._progress_at_open = self._read_progress() if wanted else None
        return read_steps([t.pid for t in targets], self.shm_dir)

    def read_progress(self, source: _Source | None, *triggers: str) -> _Source | None:
        """Read ``source`` (the server's ``/metrics``) twice for each verdict, when the incident
        opens and before its verdict: with ``triggers``, only for incidents of those, its HTTP
        client closed after each verdict (a watching agent: its watchdog covers stalls; a health
        incident needs to know whether the ranks still progress, issue 32 item 1); without, for
        every incident (a one-shot ``dump``, which closes ``source`` itself). Returns ``source``."""
        self.progress_source = source
        self.progress_triggers = frozenset(triggers) if triggers else None
        return source

    def _read_progress(self) -> _Reading | None:
        """One reading of :attr:`progress_source` from this worker thread (``None``: no source,
        a failed scrape, or not called from an anyio worker thread). Never raises."""
        if self.progress_source is None:
            return None
        try:
            return anyio.from_thread.run(self.progress_source.read)
        except RuntimeError as exc:  # not from an anyio worker thread (a direct call): no reading
            log.warning("reading %s for the verdict failed: %s", self.progress_source.url, exc)
            return None

    def _close_progress(self) -> None:
        """Close :attr:`progress_source`'s HTTP client (made again at its next read). Never raises."""
        close = getattr(self.progress_source, "aclose", None)
        if close is None:
            return
        try:
            anyio.from_thread.run(close)
        except (RuntimeError, OSError) as exc:  # a client that fails to close costs a socket, never the verdict
            log.warning("closing %s failed: %s", getattr(self.progress_source, "url", "?"), exc)

    def _progress(self, trigger: str) -> tuple[bool, str, bool, int | None] | None:
        """The server's counter read again, at least :data:`MIN_PROGRESS_INTERVAL_S` after the
        first reading (when the incident opened): (advanced, in words, busy, the pid listening on
        its URL), or ``None`` (no source, another trigger than :attr:`progress_triggers`)."""
        first, source = self._progress_at_open, self.progress_source
        self.progress_unread = ""
        self.progress_preempted = None
        if source is None or (self.progress_triggers is not None and trigger not in self.progress_triggers):
            return None
        try:
            return self._progress_from(first, source)
        finally:
            if self.progress_triggers is not None:  # a watching agent: no client held between incidents
                self._close_progress()

    def _progress_from(self, first: _Reading | None, source: ProgressSource) -> tuple[bool, str, bool, int | None] | None:
        """:meth:`_progress` from its first reading on."""
        if first is None:
            self.progress_unread = _unread(source)
            return None
        wait_s = MIN_PROGRESS_INTERVAL_S - (time.monotonic_ns() - first.read_monotonic_ns) / 1e9
        if wait_s > 0:
            time.sleep(wait_s)
        second = self._read_progress()
        if second is None:
            self.progress_unread = _unread(source)
            return None
        moved = second.last_progress_monotonic_ns is not None and second.last_progress_monotonic_ns > first.read_monotonic_ns
        dt_s = (second.read_monotonic_ns - first.read_monotonic_ns) / 1e9
        words = f"{source.counter} {first.forward_ct}->{second.forward_ct} in {dt_s:.1f} s at {source.url}"
        if moved and second.forward_ct == first.forward_ct:
            words += " (its step gauges moved)"
        self.progress_preempted = _preempted_between(second, moved=moved)
        if self.progress_preempted is not None:
            words += f" (preempted {self.progress_preempted[0]} times meanwhile, no output)"
        port = port_of_url(source.url)
        return moved, words, second.busy, listener_of_port(port) if port else None

    async def decide(
        self, targets: Sequence[Target], results: Sequence[ActionResult], cause: Event | None, steps_before: dict[int, int]
    ) -> Verdict | None:
        """The verdict, or ``None`` for a single process with no distributed evidence."""
        return await anyio.to_thread.run_sync(self._decide, list(targets), list(results), cause, steps_before)

    def _decide(
        self, targets: list[Target], results: list[ActionResult], cause: Event | None, steps_before: dict[int, int]
    ) -> Verdict | None:
        exited_pid = cause.pid if isinstance(cause, TargetExited) else None
        everyone = _with_exited(targets, cause)
        readings = _Readings(results=results, cause=cause, steps_before=steps_before,
                             after=_snapshots([t.pid for t in everyone], self.shm_dir),
                             stopped=self._stopped_at_open & _stopped(everyone, self.own_actions),
                             progress=self._progress(trigger_of(cause)),
                             dsleep=_still_in_dsleep(everyone, self._dsleep_at_open),
                             no_targets=exited_pid is not None and not targets,
                             listeners=self._listeners(cause) if isinstance(cause, HealthCheckFailed) else frozenset())
        groups = server_groups(everyone)
        self._groups = groups
        self.last_evidence = []
        if isinstance(cause, FrontendExited) and cause.left_alive:
            orphaned = self._orphaned(everyone, readings, cause)
            if orphaned is not None:
                return orphaned
        verdicts = self._group_verdicts(groups, everyone, readings, exited_pid)
        if not verdicts:
            return None
        return pick_incident_verdict(verdicts, self._trigger_pids(cause), len(groups))

    def _group_verdicts(self, groups: Sequence[ServerGroup], everyone: list[Target], readings: _Readings,
                        exited_pid: int | None) -> list[tuple[ServerGroup, Verdict]]:
        """Each server's verdict (:meth:`_decide_group`), those that have one."""
        verdicts: list[tuple[ServerGroup, Verdict]] = []
        for group in groups:
            members = [t for t in everyone if t.pid in group.pids]
            verdict = self._decide_group(members, readings, exited_pid)
            if verdict is not None:
                verdicts.append((group, verdict))
        return verdicts

    def _orphaned(self, everyone: list[Target], readings: _Readings, cause: FrontendExited) -> Verdict | None:
        """The verdict of a server whose frontend died leaving processes alive: the frontend and
        those processes judged as one server (no longer one process tree: they hang off pid 1
        now), ``orphaned`` while they live; ``None`` when none is alive any more (then the
        servers are judged as usual)."""
        known = {t.pid for t in everyone}
        titles = dict(zip(cause.left_alive, cause.left_alive_titles))
        everyone.extend(Target(pid=pid, title=titles.get(pid, "")) for pid in cause.left_alive if pid not in known)
        members = [t for t in everyone if t.pid == cause.pid or t.pid in cause.left_alive]
        verdict = self._decide_group(members, readings, cause.pid, orphaned=cause)
        if verdict is not None and verdict.kind == "orphaned":
            return verdict
        self.last_evidence = []
        return None

    def _listeners(self, cause: Event | None) -> frozenset[int]:
        """The pids listening on the ports of the watched URLs (and the failed health URL): each
        an HTTP frontend of its server, whatever its title. Blocking (a socket table scan)."""
        urls = {*self.endpoint_urls, *([cause.url] if isinstance(cause, HealthCheckFailed) else [])}
        ports = {port for url in urls if (port := port_of_url(url)) is not None}
        return frozenset(pid for port in ports if (pid := listener_of_port(port)) is not None)

    def _trigger_pids(self, cause: Event | None) -> set[int]:
        """The pids that opened the incident: the stalled or exited pid, else the server listening
        on the port of the endpoint that stalled (``/metrics``) or failed (``/health``)."""
        pid = getattr(cause, "pid", None)
        if isinstance(pid, int):
            return {pid}
        urls: list[str] = []
        if isinstance(cause, HealthCheckFailed):
            urls = [cause.url]
        elif isinstance(cause, WatchdogStalled) and cause.counter_source == "prometheus":
            urls = list(self.endpoint_urls)
        found: set[int] = set()
        for url in urls:
            port = port_of_url(url)
            owner = listener_of_port(port) if port else None
            if owner is not None:
                found.add(owner)
        return found

    def _decide_group(self, members: list[Target], readings: _Readings, exited_pid: int | None, *,
                      orphaned: FrontendExited | None = None) -> Verdict | None:
        """The verdict of one server; ``None``: a lone process with neither a stack nor a Flight
        Recorder result (nothing read of it), unless its exit opened the incident (its exit
        status is evidence: a server that died before any rank started)."""
        pids = {t.pid for t in members}
        dumps = _results_of(readings.results, Action.PYSPY_DUMP, pids)
        frs = _results_of(readings.results, Action.FLIGHTREC_DUMP, pids)
        if len(members) < 2 and not frs and not dumps and exited_pid not in pids:
            return None
        world_size = _world_size(members) or _fr_world_size(frs.values())
        ranks, how = _ranks(members, frs, readings.after, world_size)
        evidence = [replace(self._evidence(t, ranks.get(t.pid), dumps.get(t.pid), frs.get(t.pid), readings, exited_pid),
                            rank_source=how.get(t.pid, ""))
                    for t in members]
        evidence = _with_waits(evidence, members, dumps)
        trigger = trigger_of(readings.cause)
        progress = readings.progress if _serves(members, readings.progress, single=len(self._groups) == 1) else None
        progress = startup_progress(readings.cause, pids) or progress  # a start-up stall: no first step
        judged = Evidence.of(evidence, trigger=trigger, world_size=world_size,
                             **self._server_facts(readings, progress, trigger, orphaned, dumps))
        self.last_evidence.append(judged)
        return decide(judged)

    def _server_facts(self, readings: _Readings, progress: tuple[bool, str, bool, int | None] | None, trigger: str,
                      orphaned: FrontendExited | None, dumps: Mapping[int, ActionResult]) -> dict[str, Any]:
        """The :class:`~agent.verdict.rules.Evidence` fields of one server beside its processes':
        its progress, the incident's cause and the processes its dead frontend left."""
        return dict(
            server_progress=progress[0] if progress else None,
            server_progress_detail=progress[1] if progress else self.progress_unread,
            work_pending=progress[2] if progress and trigger != Trigger.STALL else None,
            no_targets=readings.no_targets,
            health_url=readings.cause.url if isinstance(readings.cause, HealthCheckFailed) else "",
            orphaned_pids=orphaned.left_alive if orphaned is not None else (),
            orphaned_bytes=orphaned.held_bytes if orphaned is not None else 0,
            orphaned_under=orphaned.reparented_to if orphaned is not None else 0,
            **_livelock_facts(readings.cause, self.progress_preempted if progress else None),
            **_request_facts(readings.cause, dumps))

    def _evidence(self, target: Target, rank: int | None, dump: ActionResult | None, fr: ActionResult | None,
                  readings: _Readings, exited_pid: int | None) -> RankEvidence:
        threads = _threads(dump)
        frame_class, frame, p2p = classify_wait(threads) if threads else (FrameClass.UNKNOWN, "", "")
        exited = target.pid == exited_pid
        cause = readings.cause if exited and isinstance(readings.cause, TargetExited) else None
        state = ProcessState.GONE if exited else process_state(target.pid, create_time_s=target.create_time_s)
        alive = state not in (ProcessState.GONE, ProcessState.ZOMBIE)
        fact = cause.exit if cause is not None else _ended_fact(target, state)
        info = parse_title(target.title)
        role, title = _role_and_title(target, _role(info.role if info is not None else "", rank), readings.listeners)
        if role is Role.FRONTEND and threads:
            frame = _frontend_frame(threads) or frame
        return RankEvidence(
            rank=rank if role is Role.RANK else None,
            pid=target.pid,
            role=role,
            title=title,
            label=info.label if info is not None else "",
            alive=alive,
            exited_first=exited,
            **_exit_fields(fact),
            frame_class=frame_class,
            frame=frame,
            p2p=p2p,
            stack_note=_stack_note(dump),
            **_step_fields(target.pid, readings),
            fr=_fr_dump(fr),
            **_held_fields(target.pid, alive, readings),
            event_loop=role is Role.FRONTEND and frame_class is FrameClass.COMPUTE and _in_event_loop(threads),
        )


def _results_of(results: Iterable[ActionResult], action: Action, pids: set[int]) -> dict[int, ActionResult]:
    """The results of ``action`` for ``pids``, by pid (the last one of a pid)."""
    return {r.pid: r for r in results if r.action == action and r.pid in pids}


def _held_fields(pid: int, alive: bool, readings: _Readings) -> dict[str, Any]:
    """The :class:`~agent.verdict.rules.RankEvidence` fields of a live process held still: stopped
    (SIGSTOP) or in uninterruptible sleep (and its kernel wait channel)."""
    return {
        "stopped": alive and pid in readings.stopped,
        "uninterruptible": alive and pid in readings.dsleep,
        "wchan": readings.dsleep.get(pid, "") if alive else "",
    }


def _with_exited(targets: list[Target], cause: Event | None) -> list[Target]:
    """The targets, the one whose exit opened the incident (``cause``) under the title it had, and
    first when discovery no longer found it."""
    everyone = list(targets)
    if isinstance(cause, TargetExited):
        # the title the process had (a zombie's own is its comm, cut at 15 characters)
        everyone = [replace(t, title=cause.title) if t.pid == cause.pid and cause.title else t for t in everyone]
        if all(t.pid != cause.pid for t in targets):
            everyone.insert(0, Target(pid=cause.pid, title=cause.title))
    return everyone


def _ended_fact(target: Target, state: ProcessState) -> ExitFact | None:
    """How a target that did not open the incident ended: a zombie's status, else (gone, reaped)
    the fact the process watcher noted (the kernel's status and time of death); None while it runs."""
    if state is ProcessState.ZOMBIE:
        return zombie_fact(target.pid, target.create_time_s)
    if state is ProcessState.GONE:
        return exit_fact_of(target.pid, target.create_time_s)
    return None


def _role_and_title(target: Target, role: Role, listeners: frozenset[int]) -> tuple[Role, str]:
    """A process's role and title: an untitled HTTP frontend (vllm serve, SGLang's main process)
    is one, named by its command, not its interpreter's path."""
    if role is Role.PROCESS and (frontend_command(target.cmdline) or target.pid in listeners):
        return Role.FRONTEND, command_words(target.cmdline) or target.title
    return role, target.title


def _exit_fields(fact: ExitFact | None) -> dict[str, Any]:
    """The :class:`~agent.verdict.rules.RankEvidence` fields of how a process ended (``fact``)."""
    return {
        "exit_signal": fact.signal_name or None if fact is not None else None,
        "exit_code": fact.exit_code if fact is not None else None,
        "oom_killed": fact.oom if fact is not None else False,
        "exit_time_ns": (fact.ended_time_unix_nano or None) if fact is not None else None,
        "exit_detail": fact.describe() if fact is not None else "",
        "exit_fact": fact,
    }


def _step_fields(pid: int, readings: _Readings) -> dict[str, Any]:
    """The :class:`~agent.verdict.rules.RankEvidence` fields of a process's step counter."""
    snap = readings.after.get(pid)
    return {
        "steps_before": readings.steps_before.get(pid),
        "steps_after": snap.forward_ct if snap is not None else None,
        "pending": snap.pending if snap is not None else None,
    }


def _livelock_facts(cause: Event | None, read: tuple[int, float] | None = None) -> dict[str, Any]:
    """The :class:`~agent.verdict.rules.Evidence` fields of preemptions with no progress (vLLM #25538):
    the stall's ``preempted`` count and the seconds it was counted over, else those of a one-shot
    incident's two readings of the server's counter (``read``); none without."""
    if isinstance(cause, WatchdogStalled) and cause.preempted > 0:
        return {"preempted": cause.preempted, "preempted_in_s": cause.preempted_in_s}
    if read is not None:
        return {"preempted": read[0], "preempted_in_s": read[1]}
    return {}


def _preempted_between(second: _Reading, *, moved: bool) -> tuple[int, float] | None:
    """Preemptions with no progress up to ``second`` (a reading that says how many:
    ``StepReading.preempted_since_progress``), and over how many seconds; ``None`` when the
    counter moved or nothing was preempted."""
    n = getattr(second, "preempted_since_progress", 0)
    since = getattr(second, "preempted_since_ns", None)
    if moved or not isinstance(n, int) or n <= 0 or not isinstance(since, int):
        return None
    return n, (second.read_monotonic_ns - since) / 1e9


def _request_facts(cause: Event | None, dumps: Mapping[int, ActionResult]) -> dict[str, Any]:
    """The :class:`~agent.verdict.rules.Evidence` fields of one stuck request (vLLM #54003): the request
    in words and the thread holding it, found in its process's py-spy dump by the thread id the
    SDK reported (named by its name, tid and innermost frame); none for another cause."""
    if not isinstance(cause, RequestStalled):
        return {}
    request = (f"request {cause.request_id} (pid {cause.pid}) in flight {cause.age_s:.1f} s, over {cause.threshold_s:.1f} s"
               f" ({cause.p99_s:.3f} s p99 of {cause.recent} recent completions; the last {cause.completed_ago_s:.1f} s ago)")
    threads = _threads(dumps.get(cause.pid))
    held = next((t for t in threads if cause.thread_id and t.thread_id == cause.thread_id
                 or cause.native_thread_id and t.os_thread_id == cause.native_thread_id), None)
    if held is None:
        return {"stuck_request": request, "stuck_request_pid": cause.pid}
    frame = next((f for f in held.frames if not f.native and not f.unresolved), held.frames[0] if held.frames else None)
    where = frame.describe() if frame is not None else "no frame"
    state = "busy" if held.active else "idle"
    thread = f"thread '{held.label}' (tid {held.os_thread_id or held.thread_id}, {state}) in {where}"
    return {"stuck_request": request, "stuck_request_pid": cause.pid, "stuck_thread": thread,
            "stuck_thread_busy": held.active}


#: A serving framework's own code (its package's files), where a frontend's stuck frame is named.
_FRAMEWORK_FILE = re.compile(r"(^|/)(vllm|sglang)/")
#: An asyncio event loop's run loop (the stdlib's, uvloop's): the thread serves an event loop.
_EVENT_LOOP_FRAME = re.compile(r"/asyncio/(base_events|runners|events)\.py$|(^|/)uvloop/")


def _stuck_thread(threads: Sequence[ThreadStack]) -> ThreadStack | None:
    """The thread a frontend's stall is read from: its main thread unless idle, else the first
    active one that is not idle (:func:`agent.model.stacks.thread_is_idle`)."""
    from agent.model.stacks import thread_is_idle

    for pick in (lambda t: t.is_main, lambda t: t.active):
        found = next((t for t in threads if pick(t) and t.frames and not thread_is_idle(t)), None)
        if found is not None:
            return found
    return None


def _frontend_frame(threads: Sequence[ThreadStack]) -> str:
    """A frontend's stuck frame in its framework's own code (``apply_hf_chat_template
    (vllm/entrypoints/chat_utils.py:40)`` under a jinja2 render, the detokenizer's decode), the
    innermost such Python frame of its stuck thread; ``""`` when none (the caller keeps the
    innermost frame of its own code)."""
    thread = _stuck_thread(threads)
    if thread is None:
        return ""
    own = next((f for f in thread.frames if not f.native and _FRAMEWORK_FILE.search(f.filename)), None)
    return own.label if own is not None else ""


def _in_event_loop(threads: Sequence[ThreadStack]) -> bool:
    """The frontend's stuck thread runs an asyncio event loop (a run-loop frame below the stuck
    one): while it is stuck, the loop answers no request (``/health``, ``/metrics``)."""
    thread = _stuck_thread(threads)
    return thread is not None and any(_EVENT_LOOP_FRAME.search(f.filename) for f in thread.frames)


def _stack_note(dump: ActionResult | None) -> str:
    """What happened reading a stack, for the verdict: py-spy's note, or why it could not read it
    (``py-spy was denied: run servewatch as root (sudo) or with CAP_SYS_PTRACE``; as root, that
    root was refused, never "run as root", and the ``next:`` line has no ``sudo``)."""
    if dump is None:
        return ""
    note = str(dump.attributes.get(PYSPY_NOTE_ATTR, ""))
    if not note and dump.outcome is Outcome.PERMISSION_DENIED:
        if os.geteuid() == 0:  # "run as root" would send root to sudo; the py-spy line says what refused it
            return "py-spy was refused although servewatch runs as root (a ptrace policy or another tracer: see its py-spy line)"
        return "py-spy was denied: run servewatch as root (sudo) or with CAP_SYS_PTRACE"
    return note


def _stopped(targets: Iterable[Target], own: OwnActionLog) -> frozenset[int]:
    """The targets stopped now (``/proc`` state T or t: SIGSTOP, a debugger, or a tracer's brief
    stop), less those servewatch's own py-spy holds stopped while it dumps them
    (:func:`agent.host.ownactions.stopped_by_us`)."""
    stopped = [t.pid for t in targets if process_state(t.pid, create_time_s=t.create_time_s) is ProcessState.STOPPED]
    if not stopped:
        return frozenset()
    actions = own.active()
    return frozenset(pid for pid in stopped if not stopped_by_us(pid, actions))


def _in_dsleep(targets: Iterable[Target]) -> dict[int, frozenset[int]]:
    """The targets with threads in uninterruptible sleep (state D) now: pid -> their thread ids
    (:func:`~agent.host.targets.uninterruptible_threads`; blocking, ``/proc`` reads)."""
    out: dict[int, frozenset[int]] = {}
    for target in targets:
        found = uninterruptible_threads(target.pid)
        if found:
            out[target.pid] = frozenset(t.tid for t in found)
    return out


def _still_in_dsleep(targets: Iterable[Target], at_open: Mapping[int, frozenset[int]]) -> dict[int, str]:
    """The targets with a thread in state D when the incident opened (``at_open``) and the same
    thread in D now: pid -> the kernel function it waits in (its wchan; ``""``: hidden). A brief
    disk read is never seen twice; blocking (``/proc`` reads)."""
    out: dict[int, str] = {}
    for target in targets:
        tids = at_open.get(target.pid)
        if not tids:
            continue
        same = [t for t in uninterruptible_threads(target.pid) if t.tid in tids]
        if same:
            out[target.pid] = same[0].wchan
    return out


def _serves(members: Sequence[Target], progress: tuple[bool, str, bool, int | None] | None, *, single: bool) -> bool:
    """The server progress reading belongs to this group: its URL's listener is a member or an
    ancestor of one; else, with one group only, it is that group's."""
    if progress is None:
        return False
    owner = progress[3]
    if owner is None:
        return single
    return any(t.pid == owner or owner in ancestors(t.pid) for t in members)


def _role(title_role: str, rank: int | None) -> Role:
    if title_role == "coordinator":
        return Role.COORDINATOR
    if title_role == "frontend":
        return Role.FRONTEND
    return Role.RANK if rank is not None else Role.PROCESS


def _threads(dump: ActionResult | None) -> list[ThreadStack]:
    if dump is None or dump.outcome is not Outcome.OK:
        return []
    path = next((p for p in dump.artifact_paths if p.endswith(".json")), None)
    if path is None:
        return []
    try:
        return parse_dump(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s for the verdict: %s", path, exc)
        return []


def _fr_dump(fr: ActionResult | None) -> Mapping[str, Any] | None:
    if fr is None or fr.outcome is not Outcome.OK or not fr.artifact_paths:
        return None
    doc = _read_json(fr.artifact_paths[0])
    if isinstance(doc, dict) and isinstance(doc.get("trace"), dict):
        return doc["trace"]
    return None


def _ranks(members: list[Target], frs: Mapping[int, ActionResult], counters: Mapping[int, CounterSnapshot],
           world_size: int | None) -> tuple[dict[int, int], dict[int, str]]:
    """Each rank's number, and for those not read from torch.distributed or the title how it was found.

    Sources, in order (what the process itself says first, its title last):

    1. torch.distributed's, as its Flight Recorder read named it (the SDK's ``status``), else a
       title that names a rank alone (``scheduler_TP1``: :func:`agent.model.ranks.rank_from_title`);
    2. ``RANK`` in its environment (:func:`agent.host.targets.rank_environ`, read now, else when the
       target finder first saw it alive: torch.distributed's ``env://`` variables, as torchrun and
       launchers set them; vLLM on Ray titles every worker ``ray::RayWorkerWrapper``, vLLM #2479,
       #50835, and Ray keeps the environment readable), unless another process of the server has
       the same (:func:`agent.model.ranks.distinct_env_ranks`: inherited from a launcher);
    3. torch.distributed's as the SDK recorded it in the process's step counter (it outlives the
       title: a zombie keeps no command line and 15 characters of its title in ``comm``,
       ``VLLM::Worker_TP``);
    4. its title's in this server's world (:func:`agent.model.ranks.world_ranks`: ``Worker_PP1_TP0`` is
       rank 2 at TP=2);
    5. :func:`_inferred_ranks`.

    A process that is no rank, or whose number another process already holds, gets none (never a
    made-up number).

    Returns:
        ``({pid: rank}, {pid: how})``; ``how`` is ``"environ"`` (its environment), ``"sdk"`` (the
        step counter) or the words of an inference (the verdict then lowers its confidence).
    """
    by_title = dict(zip((t.pid for t in members), world_ranks([t.title for t in members])))
    # read now, else while it lived; a RANK several processes share was inherited: none
    by_env = dict(zip((t.pid for t in members), distinct_env_ranks([rank_environ(t.pid) or t.rank_env for t in members])))
    ranks: dict[int, int] = {}
    how: dict[int, str] = {}
    for target in members:
        rank, source = _read_rank(frs.get(target.pid), by_env.get(target.pid), counters.get(target.pid))
        if rank is None:
            rank = by_title.get(target.pid)
        if rank is not None and rank not in ranks.values():
            ranks[target.pid] = rank
            if source:
                how[target.pid] = source
    for pid, (rank, words) in _inferred_ranks(members, ranks, world_size).items():
        ranks[pid] = rank
        how[pid] = words
    return ranks, how


def _read_rank(fr: ActionResult | None, env_rank: int | None, snap: CounterSnapshot | None) -> tuple[int | None, str]:
    """The rank a process says it is (sources 1-3 of :func:`_ranks`) and how (``""`` for
    torch.distributed's or a title's, ``"environ"``, ``"sdk"``); ``(None, "")`` when it says none.
    The Flight Recorder read's rank taken from the environment is the judge's own read
    (``env_rank``, :func:`agent.model.ranks.distinct_env_ranks`: the read did not see the other processes)."""
    rank = fr.attributes.get("servewatch.flightrec.rank") if fr is not None else None
    if isinstance(rank, int) and fr is not None and fr.attributes.get("servewatch.flightrec.rank_source") != "environ":
        return rank, ""
    if env_rank is not None:
        return env_rank, "environ"
    if snap is not None and snap.rank is not None:
        return snap.rank, "sdk"
    return None, ""


#: ``comm`` keeps this many characters of a process's name (TASK_COMM_LEN - 1).
_COMM_LEN = 15


def _inferred_ranks(members: Sequence[Target], ranks: Mapping[int, int],
                    world_size: int | None) -> dict[int, tuple[int, str]]:
    """The rank of a dead process whose title is gone, when only one can be its: the world size
    is known (``WORLD_SIZE`` / ``--world-size`` of a rank, else a live rank's Flight Recorder
    read: torch.distributed's ``get_world_size()``), exactly one rank of it is held by no
    process, and exactly one dead process is left without a rank whose ``comm`` (its title cut to
    15 characters) begins the titles of ranked processes.

    Returns:
        ``{pid: (rank, how, in words)}`` (empty when the world size is unknown, or nothing or
        more than one fits).
    """
    if not world_size:
        return {}
    titles = [t.title for t in members if t.pid in ranks]
    candidates = [t for t in members if t.pid not in ranks and len(t.title) == _COMM_LEN
                  and process_state(t.pid, create_time_s=t.create_time_s) in (ProcessState.ZOMBIE, ProcessState.GONE)
                  and any(title.startswith(t.title) and len(title) > _COMM_LEN for title in titles)]
    missing = sorted(set(range(world_size)) - set(ranks.values()))
    if len(candidates) != 1 or len(missing) != 1:
        return {}
    [dead], [rank] = candidates, missing
    words = (f"rank {rank} inferred: its title went with it ({dead.title!r} left) and rank {rank} is the one rank"
             f" of the world (size {world_size}) no other process holds")
    return {dead.pid: (rank, words)}


def _with_waits(evidence: list[RankEvidence], members: list[Target], dumps: Mapping[int, ActionResult]) -> list[RankEvidence]:
    """A coordinator whose main thread waits in its executor's RPC waits on its descendant ranks."""
    out = []
    for e in evidence:
        if e.role is Role.COORDINATOR and e.pid is not None:
            threads = _threads(dumps.get(e.pid))
            main = next((t for t in threads if t.is_main), None)
            if main is not None and any(_WAITS_ON_WORKERS.search(f"{f.filename} {f.name}") for f in main.frames):
                workers = tuple(r.pid for r in evidence if r.is_rank and r.pid and e.pid in ancestors(r.pid))
                e = replace(e, waits_on=workers)
        out.append(e)
    return out


_WORLD_FLAG = re.compile(r"^--world[-_]size(?:=(\d+))?$")


def _world_size(members: Sequence[Target]) -> int | None:
    """The world size the ranks were started with: ``WORLD_SIZE`` in a rank's environment, else a
    ``--world-size N`` argument; ``None`` when neither is readable."""
    for t in members:
        size = _env_world_size(t.pid) or _argv_world_size(t.cmdline)
        if size:
            return size
    return None


def _fr_world_size(frs: Iterable[ActionResult]) -> int | None:
    """The default process group's size as a live rank's Flight Recorder read names it: the
    SDK's ``servewatch.world_size`` (torch.distributed's ``get_world_size()``), else the ranks of
    the default group in the dump's ``pg_config`` (``desc`` ``default_pg``, or the only group
    there); ``None`` when none does. A titled process has neither ``--world-size`` nor, often,
    ``WORLD_SIZE`` left to read."""
    for fr in frs:
        trace = _fr_dump(fr)
        size = _trace_world_size(trace) if trace is not None else None
        if size is not None:
            return size
    return None


def _trace_world_size(trace: Mapping[str, Any]) -> int | None:
    """:func:`_fr_world_size` of one Flight Recorder dump."""
    meta = trace.get("servewatch")
    size = meta.get("world_size") if isinstance(meta, dict) else None
    if isinstance(size, int) and size > 0:
        return size
    config = trace.get("pg_config")
    groups = [g for g in config.values() if isinstance(g, dict)] if isinstance(config, dict) else []
    default = [g for g in groups if g.get("desc") == "default_pg"] or (groups if len(groups) == 1 else [])
    if not default:
        return None
    try:
        ranks = json.loads(default[0].get("ranks", ""))
    except (TypeError, ValueError):
        return None
    return len(ranks) if isinstance(ranks, list) and ranks else None


def _env_world_size(pid: int) -> int | None:
    env = rank_environ(pid)
    return env.world_size if env is not None else None


def _argv_world_size(argv: Sequence[str]) -> int | None:
    for i, arg in enumerate(argv):
        m = _WORLD_FLAG.match(arg)
        if not m:
            continue
        value = m.group(1) or (argv[i + 1] if i + 1 < len(argv) else "")
        return int(value) if value.isdigit() else None
    return None


def job_groups(targets: Sequence[Target]) -> list[list[int]]:
    """The targets' pids grouped by server (:func:`agent.verdict.servers.server_groups`), groups ordered
    by their first pid."""
    return [list(g.pids) for g in server_groups(targets)]


#: Which server's verdict is the incident's when no trigger pid picks it: a hung one with a
#: culprit first, strongest kind first.
_KIND_ORDER = ("dead", "orphaned", "cascade", "suspended", "uninterruptible", "desync", "cycle", "behind", "coordinator", "frontend", "deadlock", "rendezvous", "compute", "single",
               "unknown", "idle", "stopped", "progressing")


def pick_incident_verdict(verdicts: Sequence[tuple[ServerGroup | Sequence[int], Verdict]], trigger: int | set[int] | None,
                          jobs: int) -> Verdict:
    """The incident's verdict among its servers' verdicts.

    The server of the process whose exit or stall opened the incident (or the server listening on
    the endpoint that stalled), when known; else the server that stalled (hung, with a culprit,
    strongest kind). With more than one server the evidence says which one was judged and how it
    was told apart.
    """
    wanted = {trigger} if isinstance(trigger, int) else set(trigger or ())

    def pids_of(g: ServerGroup | Sequence[int]) -> tuple[int, ...]:
        return g.pids if isinstance(g, ServerGroup) else tuple(g)

    def holds(g: ServerGroup | Sequence[int]) -> bool:
        pids = set(pids_of(g))
        return bool(wanted & pids) or any(w in ancestors(p) for p in pids for w in wanted)

    chosen = next(((g, v) for g, v in verdicts if wanted and holds(g)), None)
    if chosen is None:
        def order(item: tuple[Any, Verdict]) -> tuple[int, int, int]:
            v = item[1]
            kind = _KIND_ORDER.index(v.kind) if v.kind in _KIND_ORDER else len(_KIND_ORDER)
            return (not v.hung, not v.culprit_pids, kind)

        chosen = min(verdicts, key=order)
    group, verdict = chosen
    if jobs < 2:
        return verdict
    how = f"; {group.how}" if isinstance(group, ServerGroup) else ""
    note = f"job of pids {','.join(map(str, sorted(pids_of(group))))} (1 of {jobs} servers matched{how})"
    return replace(verdict, evidence=(*verdict.evidence, note))
