"""Incident lifecycle: trigger -> ordered actions -> bundle; dedup and cooldown.

Owns the one decision of what runs, in what order, and when to stop:

1. a trigger (health failure, watchdog stall, target exit, manual) opens an incident unless the
   same cause opened one on the same server less than ``cooldown_s`` ago: the incident key is
   ``(server, trigger)``, the server being the process-tree root its subject hangs off (or, for a
   URL's event, the server listening on its port: the ``server_of`` callable the runtime passes);
   ``None`` (a manual incident, a server not known) is the host-wide key. Two servers' faults are
   two incidents, run concurrently (one worker per server takes its triggers in order; incidents
   of one server never overlap);
2. the requests in flight are read (span links, ``requests.json``);
3. phases run in order, each bounded: ``pyspy.dump`` for every target (in parallel), then
   ``cuda.coredump`` (right after the dumps finish, not after a fixed sleep), then an optional
   ``profile.session``;
4. ``manifest.json`` is written to ``<data_dir>/<host>/<incident_id>/`` when the incident
   opens (``state: open``) and rewritten atomically as each phase finishes (``phases_done``),
   so ``servewatch timeline latest`` shows an incident from its first second; each action is
   published the moment it finishes (:func:`agent.model.progress.report_action`), so its span does
   not wait for the phase; :class:`~agent.model.events.IncidentClosed` is published at the end
   (``state: closed``);
   deferred phases (``profile.session``) run after the summary point (``on_summary``), so a
   profile never delays the summary or the bundle;
   :meth:`IncidentManager.interrupt` (SIGTERM/SIGINT) lets the current phase finish and skips
   the rest; an incident cancelled mid-phase is written ``state: interrupted`` with what it
   captured, and :func:`recover_interrupted` closes such bundles on the next start;
5. with a judge (:class:`agent.verdict.judge.VerdictJudge`), the cross-rank verdict is made from the
   evidence (culprit rank(s), reason, confidence): it goes on the incident span
   (``servewatch.verdict.*``), into the manifest and first in every summary;
6. in hard mode, after the evidence is captured, the verdict's culprit rank(s) get a signal
   (``watchdog.hard_targets``: ``culprit``, the default, or ``all``) so an orchestrator can
   restart them; each signal is a ``hard.signal`` action (a span).

What other parts add to every incident comes in through the constructor, never by a write into
the manager: the admission policies (``policies``, :class:`~agent.incidents.admission.TriggerPolicy`:
asked before the cooldown), and a job's three contributions (:class:`agent.fleet.Fleet`'s, wired
by the runtime, inert until the fleet runs): ``admit`` (asked after the cooldown: a detection
inside a job incident's window is folded), ``place`` (names an incident's trace before it opens)
and ``companions`` (run beside an incident's phases).

Imports :mod:`agent.model.events`, :mod:`agent.model.bus`, :mod:`agent.host.targets`, :mod:`agent.host.manifest` (the
``manifest.json`` model it writes and recovery reads), the trace/span id helpers of
:mod:`agent.model.ids` and the SDK client :mod:`agent.host.sdkclient` (requests in flight); actors are passed
in through the :class:`agent.actors.Actor` protocol (the registered ones, by the runtime) or as
:class:`Phase` callables, so this module never imports an actor, a watcher or an exporter.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import signal as signal_mod
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agent.host import pidfds
from agent.host.fsutil import atomic_write_text, ensure_private_dir
from agent.host.manifest import (
    MANIFEST_NAME,
    MANIFEST_SCHEMA,
    SPANS_DURABLE_NAME,
    IncidentState,
    Manifest,
    ManifestAction,
    ManifestError,
    ManifestHistoryPoint,
    ManifestTarget,
    ManifestVerdict,
    load_manifest,
)
from agent.host.ownactions import OwnActionLog
from agent.host.procinfo import pid_alive
from agent.host.sdkclient import InflightRequest
from agent.host.security import redact_cmdline, redact_text
from agent.host.stall import StallBoard
from agent.host.targets import Target
from agent.incidents.admission import (
    STOP_SIGNALS,
    ExitPolicy,
    TriggerPolicy,
    describe_exit,
    exit_admission,
    stop_signal_of,
)
from agent.incidents.admission import server_tree as _server_tree
from agent.incidents.config import IncidentConfig
from agent.model.bus import EventBus
from agent.model.datadir import DataDir
from agent.model.events import (
    Action,
    ActionCompleted,
    ActionResult,
    AttributeValue,
    Event,
    HardSignalSent,
    IncidentClosed,
    IncidentOpened,
    IncidentRetraced,
    InflightSpan,
    Outcome,
    Trigger,
    TriggerEvent,
    WatchdogRearmed,
    frozen_attrs,
    now_ns,
)
from agent.model.ids import new_span_id_hex, new_trace_id_hex
from agent.model.progress import ActionSink, action_stream
from agent.model.ranks import target_attributes
from agent.verdict.rules import Verdict, hard_signal_plan

__all__ = [
    "DEFERRED_PHASES",
    "PLACEMENT_ATTRIBUTE",
    "SERVER_ATTRIBUTE",
    "STATE_CLOSED",
    "STATE_INTERRUPTED",
    "STATE_OPEN",
    "STOP_SIGNALS",
    "TRIGGER_EVENTS",
    "IncidentConfig",
    "IncidentManager",
    "IncidentRecord",
    "InflightRequest",
    "Phase",
    "describe_exit",
    "exit_admission",
    "recover_interrupted",
    "stop_signal_of",
]

#: ``manifest.json`` ``state`` values (:class:`agent.host.manifest.IncidentState`).
STATE_OPEN: str = IncidentState.OPEN.value
STATE_CLOSED: str = IncidentState.CLOSED.value
STATE_INTERRUPTED: str = IncidentState.INTERRUPTED.value
#: Phases run after the summary point: they never delay the summary or the bundle.
DEFERRED_PHASES = frozenset({Action.PROFILE_SESSION})

log = logging.getLogger("servewatch.incidents")


#: Root-span attribute naming the incident's server (its process-tree root pid), when it has one.
SERVER_ATTRIBUTE = "servewatch.server.pid"
#: Root-span attribute said when naming the incident's job trace failed or was cut (it opened in
#: a trace of its own); absent when it was placed.
PLACEMENT_ATTRIBUTE = "servewatch.job.placement"

#: Cooldown windows kept before those that are over are forgotten (one per server and trigger).
MAX_COOLDOWN_KEYS = 1024

#: An incident's key: ``(server, trigger)``, the server its tree root pid (``None``: host-wide).
IncidentKey = tuple[int | None, str]

#: Events that can open an incident: the base of every trigger event (a new kind subclasses it).
TRIGGER_EVENTS: tuple[type[Event], ...] = (TriggerEvent,)


#: One phase of an incident: act on all targets, sending each result to the stream as soon as it
#: is done (:mod:`agent.model.progress`), and return one result per action.
Phase = Callable[[IncidentOpened, Sequence[Target], Path, ActionSink], Awaitable[list[ActionResult]]]
#: Reads the requests in flight in the targets (bounded by the caller).
InflightProvider = Callable[[Sequence[Target]], Awaitable[list[InflightRequest]]]
#: Started right after an incident opens, beside its phases (e.g. asking a job's peers to
#: capture); returns how to collect its action events before the manifest is written.
Companion = Callable[[IncidentOpened], Callable[[], Awaitable[list[ActionCompleted]]]]
#: Names the trace of an incident about to open (trigger, targets, detection time in ns: the
#: trigger event's, the parent it was opened with or ``None``): ``(trace_id, parent_span_id,
#: root attributes)`` hex, or ``None`` for a trace of its own (e.g. a job's agents derive one
#: trace from the stuck collective, :mod:`agent.fleet.identity`). Bounded by the caller's own timeout.
Placement = Callable[[str, Sequence[Target], int, tuple[str, str] | None],
                     Awaitable[tuple[str, str, Mapping[str, AttributeValue]] | None]]


@dataclass(slots=True)
class IncidentRecord:
    """What an incident did; also the content of ``manifest.json``."""

    opened: IncidentOpened
    targets: list[Target]
    results: list[ActionResult] = field(default_factory=list)
    inflight: list[InflightRequest] = field(default_factory=list)
    closed_time_unix_nano: int = 0
    hard_signal_sent: dict[int, str] = field(default_factory=dict)
    #: exits after hard mode's signal that opened no incident (pid -> how it exited)
    exits_after_hard_signal: dict[int, str] = field(default_factory=dict)
    #: health failures that followed hard mode's signal, each in one line ("killed by servewatch --hard, incident X")
    after_hard_signal: list[str] = field(default_factory=list)
    #: ``open`` until closed; ``interrupted`` when the agent stopped mid-incident
    state: str = STATE_OPEN
    #: phases finished so far, in order (``phases_pending`` still to run)
    phases_done: list[str] = field(default_factory=list)
    phases_pending: list[str] = field(default_factory=list)
    #: why it was cut short (``interrupted``), in words
    interrupted_reason: str = ""
    #: IncidentClosed was published (the root span is on its way)
    root_published: bool = False
    #: the cross-rank verdict (an :class:`agent.verdict.rules.Verdict`), when a judge made one
    verdict: Any = None
    #: more attributes of its root span, set by a companion before it closes (a job's host that
    #: reached no other host says its view is partial: ``servewatch.job.*``)
    attributes: dict[str, Any] = field(default_factory=dict)
    #: seconds spent making the verdict after the evidence was in
    verdict_duration_s: float = 0.0
    #: the host it ran on (``host.name`` in the manifest)
    host_name: str = ""
    #: the server's history before it opened (:class:`agent.incidents.history.HistoryPoint`), oldest first
    history: list[Any] = field(default_factory=list)
    #: what became of the server after it opened, one line each (:mod:`agent.incidents.lifecycle`)
    lifecycle: list[str] = field(default_factory=list)
    #: non-zero exits of the same process counted on it (a crash loop); 0: none
    crash_loop_exits: int = 0
    #: the server it is about (its process-tree root pid), ``None``: host-wide (manual, unknown)
    server: int | None = None
    #: the verdict's lines saying the server's own watchdog fired (its py-spy runs), as last noted
    server_dump_lines: tuple[str, ...] = ()
    #: :meth:`manifest_targets` once made, with the targets it was made of
    _manifest_targets: tuple[list[Target], tuple[ManifestTarget, ...]] | None = field(default=None, repr=False)
    #: held while its manifest is taken and written: two writes never cross (the later snapshot lands last)
    _manifest_lock: anyio.Lock = field(default_factory=anyio.Lock, repr=False, compare=False)

    def manifest_targets(self) -> tuple[ManifestTarget, ...]:
        """The targets as the manifest shows them, secrets in titles and argv redacted; made once
        per target list (a target's argv is up to 2 MB of words it chose: redacting it can take
        seconds of CPU, so :meth:`IncidentManager._save_manifest` makes it off the event loop)."""
        cached = self._manifest_targets
        key = list(self.targets)  # the same Target objects (compared by identity first): reused
        if cached is not None and cached[0] == key:
            return cached[1]
        made = tuple(
            # secrets in argv never reach a bundle
            ManifestTarget(pid=t.pid, title=redact_text(t.title), create_time_s=t.create_time_s,
                           cmdline=tuple(redact_cmdline(t.cmdline)))
            for t in self.targets
        )
        self._manifest_targets = (key, made)
        return made

    @property
    def bundle_dir(self) -> Path:
        return Path(self.opened.bundle_dir)

    @property
    def manifest_path(self) -> Path:
        return self.bundle_dir / MANIFEST_NAME

    @property
    def duration_s(self) -> float:
        return max(0, self.closed_time_unix_nano - self.opened.time_unix_nano) / 1e9

    def outcome_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
        return counts

    def to_manifest(self, *, host_name: str | None = None) -> Manifest:
        """The incident as its ``manifest.json`` (:class:`agent.host.manifest.Manifest`), as of now.

        Args:
            host_name: ``host.name``; ``None``: :attr:`host_name`.
        """
        o = self.opened
        return Manifest(
            schema_version=MANIFEST_SCHEMA,
            incident_id=o.incident_id,
            trigger=o.trigger,
            detail=o.detail,
            host_name=self.host_name if host_name is None else host_name,
            trace_id=o.trace_id,
            span_id=o.span_id,
            parent_span_id=o.parent_span_id,
            opened_time_unix_nano=o.time_unix_nano,
            closed_time_unix_nano=self.closed_time_unix_nano,
            duration_s=round(self.duration_s, 6),
            targets=self.manifest_targets(),
            actions=tuple(ManifestAction.from_result(r) for r in self.results),
            inflight_requests=len(self.inflight),
            hard_signal_sent={str(pid): sig for pid, sig in self.hard_signal_sent.items()},
            exits_after_hard_signal={str(pid): how for pid, how in self.exits_after_hard_signal.items()},
            after_hard_signal=tuple(self.after_hard_signal),
            state=IncidentState(self.state),
            phases_done=tuple(self.phases_done),
            phases_pending=tuple(self.phases_pending),
            interrupted_reason=self.interrupted_reason,
            interrupted=self.state == STATE_INTERRUPTED,  # never "interrupted": false beside that state
            root_published=self.root_published,
            spans_tracked=True,
            agent_pid=os.getpid(),
            updated_time_unix_nano=now_ns(),
            verdict=(
                ManifestVerdict.model_validate({**self.verdict.to_json(), "duration_s": round(self.verdict_duration_s, 6)})
                if self.verdict is not None else None
            ),
            history=tuple(
                ManifestHistoryPoint(time_unix_nano=p.time_unix_nano, kind=p.kind, pid=p.pid, forward_ct=p.forward_ct,
                                     detail=redact_text(p.detail))
                for p in self.history
            ),
            lifecycle=tuple(redact_text(line) for line in self.lifecycle),
            crash_loop_exits=self.crash_loop_exits,
        )


def _write_json(path: Path, data: dict[str, Any] | Manifest, durable: bool = True) -> bool:
    """Write a bundle file atomically (0600, never through a symlink); a full or vanished disk
    is logged, never raised (the agent goes on) and leaves the previous complete file or none.
    ``durable`` (default) fsyncs the file and its folder (see :func:`atomic_write_bytes`)."""
    try:
        atomic_write_text(path, data.to_json() if isinstance(data, Manifest) else json.dumps(data, indent=2), durable=durable)
    except OSError as exc:
        log.error("cannot write %s: %s", path, exc)
        return False
    return True


def _unfinished(
    name: str, targets: Sequence[Target], finished: Sequence[ActionResult], limit_s: float, *, started_ns: int
) -> list[ActionResult]:
    """A phase cut by its time limit: one ``TIMED_OUT`` result per target whose action had not
    finished (the finished ones are kept as reported; never one pid-less result for them all)."""
    done = {r.pid for r in finished if r.pid is not None}
    t = now_ns()
    unfinished = [
        ActionResult(action=name, outcome=Outcome.TIMED_OUT, pid=target.pid, retryable=True,
                     detail=f"unfinished when the {name} phase reached its {limit_s:g} s limit",
                     start_time_unix_nano=started_ns, end_time_unix_nano=t)
        for target in targets
        if target.pid not in done
    ]
    if not unfinished and not finished:
        unfinished.append(ActionResult(action=name, outcome=Outcome.TIMED_OUT, detail=f"phase exceeded {limit_s:g}s",
                                       start_time_unix_nano=started_ns, end_time_unix_nano=t))
    return unfinished


def _incident_id(trigger: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{trigger}-{secrets.token_hex(3)}"


class IncidentManager:
    """Opens incidents from trigger events and runs their phases in order.

    Args:
        bus: where IncidentOpened / ActionCompleted / IncidentClosed are published.
        config: cooldown, hard mode, ...
        data_dir: bundles go to ``<data_dir>/<host_name>/<incident_id>/``.
        host_name: this host (``host.name``).
        discover: returns the current targets (process discovery); called at each open.
        discover_for: when given, called instead of ``discover`` with the pid whose stall or exit
            opens the incident (``None`` for health and manual ones) and the incident's server
            (its tree root pid, ``None``: host-wide), so its targets are that server's and the
            dead ranks it adds that pid's job's (the runtime's
            :meth:`~agent.runtime.agent.Agent.incident_targets`).
        server_of: the server of a trigger event (blocking, run on a worker thread; ``None``:
            host-wide): the first half of the incident key ``(server, trigger)`` (cooldown,
            dedup, suppression per server). Default: every event host-wide (one key per trigger).
        actors: the incident's phases, run in this order (:class:`agent.actors.Actor`: each
            one's ``run_phase`` over all targets; ``completed`` published once per result;
            ``deferred`` ones after the summary point). The runtime passes the registered ones.
        phases: more phases as ``(name, phase, event_class)``, run after the actors'; a name in
            :data:`DEFERRED_PHASES` is deferred.
        inflight: optional reader of in-flight requests (SDK control sockets).
        on_incident: optional callback with each finished :class:`IncidentRecord`.
        on_summary: optional callback when the summary's evidence is in (stacks, coredumps):
            before deferred phases (a profile) run, so printing it never waits for them.
        hard_signal: hard mode (``WatchdogConfig.hard``): after a stall incident's evidence is
            captured, send this signal number; ``None`` = soft.
        hard_targets: who gets it: ``culprit`` (the verdict's culprit(s), only when named at high
            confidence; a lone stalled process that is no distributed job is its own culprit;
            never every target for want of one: :func:`agent.verdict.rules.hard_signal_plan`) or ``all``
            (every target).
        judge: makes the cross-rank verdict (:class:`agent.verdict.judge.VerdictJudge`); ``None``: none.
        history: the server's recent history (:class:`agent.incidents.history.ProgressHistory`: its
            ``snapshot(until_unix_nano=, cause=)``), recorded into each incident at open;
            ``None``: none.
        policies: more admission policies (:class:`~agent.incidents.admission.TriggerPolicy`), asked
            after the exit policy (:class:`~agent.incidents.admission.ExitPolicy`, always first).
        stalls: the stalls not over (:class:`~agent.host.stall.StallBoard`; the runtime's, fed from
            the bus); default: one fed by the trigger events this manager handles.
        admit: asked, after the policies and the cooldown, whether a detected trigger (its name and
            one-line detail) opens an incident; ``False``: folded elsewhere (a job's peer already
            opened this one: :meth:`agent.fleet.Fleet.admit`) and counted in :attr:`suppressed`.
            ``None``: every trigger the policies and the cooldown let through opens one.
        place: names the trace of every incident before it opens (see :data:`Placement`;
            :meth:`agent.fleet.Fleet.place`), bounded here; ``None``: its parent's, else its own.
        companions: started beside the phases of every incident (see :data:`Companion`;
            :meth:`agent.fleet.Fleet.companion`), collected before its manifest is final.
        server_tree: the rest of the servers an incident's targets belong to, added to its targets
            (called with its trigger and targets, blocking; ``[]``: none): their frontends, engine
            core and coordinators (issue 32 item 1; the runtime's ``TargetFinder.server_tree``).
            ``None``: the targets alone.
        on_phase: called with what an incident starts doing now (a phase's name, ``verdict``):
            the CLI's progress line on a terminal (``servewatch dump``); ``None``: nobody listens.
        server_dumps: the lines saying a server's own watchdog fired during an incident, given
            its open time and now (ns since the epoch) and its processes' pids (the runtime's:
            the py-spy runs those processes started, :class:`agent.host.procinfo.ServerDumpLog`);
            added to the verdict's evidence once it is made and again when it closes. ``None``: none.

    Attributes:
        exits: the exit policy (``launch`` tells it which exits it expects).
        policies: the admission policies asked for every trigger event, in order.
        admit, place, companions, server_tree, on_phase: the constructor's (set only there: no
            other part writes them).
    """

    def __init__(
        self,
        *,
        bus: EventBus,
        config: IncidentConfig,
        data_dir: Path,
        host_name: str,
        discover: Callable[[], list[Target]],
        actors: Sequence[Any] = (),  # agent.actors.Actor (never imported here: layers)
        phases: Sequence[tuple[str, Phase, type[ActionCompleted]]] = (),
        inflight: InflightProvider | None = None,
        on_incident: Callable[[IncidentRecord], None] | None = None,
        hard_signal: int | None = None,
        on_summary: Callable[[IncidentRecord], None] | None = None,
        hard_targets: str = "culprit",
        judge: Any = None,
        discover_for: Callable[[int | None, int | None], list[Target]] | None = None,
        history: Any = None,
        policies: Sequence[TriggerPolicy] = (),
        stalls: StallBoard | None = None,
        server_of: Callable[[TriggerEvent], int | None] | None = None,
        server_dumps: Callable[[int, int, Sequence[int]], list[str]] | None = None,
        admit: Callable[[str, str], bool] | None = None,
        place: Placement | None = None,
        companions: Sequence[Companion] = (),
        server_tree: Callable[[str, list[Target]], list[Target]] | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        self.server_dumps = server_dumps
        #: called when the evidence that makes the summary is captured (before deferred phases)
        self.on_summary = on_summary
        self.on_phase = on_phase
        self._interrupt: str = ""
        self.exits = ExitPolicy(config)
        self.policies: list[TriggerPolicy] = [self.exits, *policies]
        #: pids whose TargetExited was handled (an incident written, or none needed)
        self.exits_handled: set[int] = self.exits.exits_handled
        #: what each exit led to, in words (``incident <id>``, ``no incident: stopped by SIGTERM ...``)
        self.exit_outcomes: dict[int, str] = self.exits.exit_outcomes
        self._hard_signalled: set[int] = self.exits.hard_signalled_pids
        self._hard_windows = self.exits._hard_windows
        self.bus = bus
        self.config = config
        self.data_dir = Path(data_dir)
        self.host_name = host_name
        #: every path under the data dir for this host (bundles: ``layout.incident(id)``)
        self.layout = DataDir(self.data_dir, host_name)
        self.discover = discover
        self.discover_for = discover_for
        self.server_of = server_of
        self.phases = [(str(a.action), a.run_phase, a.completed) for a in actors] + list(phases)
        #: phases run after the summary point
        self.deferred = set(DEFERRED_PHASES) | {str(a.action) for a in actors if a.deferred}
        self.inflight = inflight
        self.on_incident = on_incident
        self.hard_signal = hard_signal
        self.hard_targets = hard_targets
        self.judge = judge
        self.history = history
        self.records: list[IncidentRecord] = []
        #: the incidents running now, by id, oldest first (several servers' at once)
        self.running: dict[str, IncidentRecord] = {}
        #: the incident running now, if any: the most recently opened of :attr:`running`
        self.current: IncidentRecord | None = None
        #: consulted before a detected trigger opens an incident; False: folded elsewhere
        #: (a job's peer already opened this one)
        self.admit = admit
        #: started beside the phases of every incident (see :data:`Companion`)
        self.companions: tuple[Companion, ...] = tuple(companions)
        #: names the trace of an incident about to open (see :data:`Placement`)
        self.place = place
        self.server_tree = server_tree
        #: triggers ignored because the same cause is cooling down
        self.suppressed = 0
        #: the ``on_state`` given to :meth:`run` (``None`` before it runs)
        self.on_state: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        #: by incident key ``(server, trigger)`` (one cooldown per server and trigger: TP ranks run
        #: in lockstep, so a hang stalls, or a crash ends, every rank of a server at once, and one
        #: incident already dumps every target of that server): when its window opened, the
        #: incident that opened it, and the window whose suppression was told
        self._last_open: dict[IncidentKey, float] = {}
        #: incident id -> how many lifecycle lines its manifest on disk holds (a line noted while its
        #: last write was under way is written once it is no longer running: :meth:`rewrite` leaves
        #: a running incident's manifest to the incident itself)
        self._lines_written: dict[str, int] = {}
        self._cooldown_ids: dict[IncidentKey, str] = {}
        self._suppression_told: dict[IncidentKey, float] = {}
        #: the stalls not over (the watchdogs' word on the bus), shown in :meth:`state`
        self.stalls = stalls if stalls is not None else StallBoard()
        #: one lock per server: a server's incidents run one at a time, two servers' at once
        self._locks: dict[int | None, anyio.Lock] = {}
        #: the server of each trigger event being handled (by ``id``), for the policies
        self._event_servers: dict[int, int | None] = {}
        #: one queue per server (its worker takes that server's triggers in order), in :meth:`run`
        self._queues: dict[int | None, MemoryObjectSendStream[TriggerEvent]] = {}
        #: the judge is one object: its verdicts are made one at a time
        self._judge_lock = anyio.Lock()

    # -- triggers ---------------------------------------------------------------------------

    def classify(self, event: Event) -> tuple[str, int | None, str] | None:
        """Map a trigger event to ``(trigger, pid, detail)``, or ``None`` when it opens no incident
        on its own facts (not a :class:`~agent.model.events.TriggerEvent`, or a policy refuses it)."""
        if not isinstance(event, TriggerEvent):
            return None
        for policy in self.policies:
            if policy.refuses(event) is not None:
                return None
        return event.trigger, event.subject_pid, event.describe()

    def expect_exit(self, pid: int, *, tree: bool = False) -> None:
        """The exit of ``pid`` is expected (it was asked to stop): it opens no incident.

        With ``tree``, so are the exits of all its descendants now (launch's server and its
        ranks, which exit because the server stops them).
        """
        self.exits.expect_exit(pid, tree=tree)

    def interrupt(self, reason: str = "agent stopping") -> bool:
        """Finish the running phase, skip the rest, and write the incident ``interrupted``.

        Returns:
            Whether an incident was running.
        """
        self._interrupt = reason or "agent stopping"
        return bool(self.running) or self.current is not None

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for every running incident (if any) to be written.

        Returns:
            True when none runs any more.
        """
        with anyio.move_on_after(timeout_s):
            while self.running or self.current is not None:
                await anyio.sleep(0.05)
        return not self.running and self.current is None

    async def rewrite(self, record: IncidentRecord) -> None:
        """Write ``record``'s manifest again after something was noted on it (durable); a
        running incident writes its own at its next phase, so it is left to that."""
        if record is not self.current and not any(record is r for r in self.running.values()):
            await self._save_manifest(record)
            self._lines_written.pop(record.opened.incident_id, None)  # kept only while it runs

    async def _save_manifest(self, record: IncidentRecord, *, durable: bool = True) -> None:
        """Write the record's manifest off the event loop (an atomic write); the manifest is
        taken from the record here, on the loop, so the file shows this moment's state.

        Args:
            durable: fsync it (default). The snapshots an incident writes while it runs (open,
                after each phase) pass ``False``: readers see each at once all the same (the
                rename is atomic, and a killed agent loses nothing from the page cache), and
                only the incident's last write, always durable, must survive a power cut. Each
                fsync pair waits for a journal commit: several ms each on a busy disk.
        """
        # one write at a time per record: an incident's own last write and a lifecycle line's
        # rewrite (an orphan's end noted as the incident closed) both run in threads; unordered,
        # the older snapshot could be renamed over the newer one and a noted line lost
        async with record._manifest_lock:
            await anyio.to_thread.run_sync(record.manifest_targets)  # the redaction: CPU, off the loop, once
            lines = len(record.lifecycle)
            manifest = record.to_manifest(host_name=self.host_name)
            await anyio.to_thread.run_sync(_write_json, record.manifest_path, manifest, durable)
            self._lines_written[record.opened.incident_id] = lines

    def _cooling_down(self, trigger: str, server: int | None = None) -> bool:
        """Whether ``(server, trigger)`` opened an incident less than ``cooldown_s`` ago; if not,
        its window starts now (the caller opens one)."""
        key = (server, trigger)
        now = time.monotonic()
        last = self._last_open.get(key)
        if last is not None and now - last < self.config.cooldown_s:
            return True
        self._last_open[key] = now
        if len(self._last_open) > MAX_COOLDOWN_KEYS:  # servers come and go (restarts): windows over are forgotten
            for old in [k for k, t in self._last_open.items() if now - t >= self.config.cooldown_s]:
                for kept in (self._last_open, self._cooldown_ids, self._suppression_told):
                    kept.pop(old, None)
        return False

    def claim_cooldown(self, trigger: str, detail: str = "", *, server: int | None = None) -> tuple[float, str]:
        """Start the cooldown window of ``(server, trigger)`` for an incident opened outside the
        bus (a manual one over the API; ``server`` ``None``: host-wide), as every trigger event
        does: ``(0.0, "")`` when one may open now, else ``(seconds left, id of the incident that
        opened the window)``; a refusal is counted in ``suppressed`` and told once per window."""
        if not self._cooling_down(trigger, server):
            return 0.0, ""
        key = (server, trigger)
        self.suppressed += 1
        self._say_suppressed(key, detail or trigger)
        left_s = self.config.cooldown_s - (time.monotonic() - self._last_open.get(key, 0.0))
        return max(0.0, left_s), self._cooldown_ids.get(key, "")

    def cooldown_opened(self, trigger: str, incident_id: str, *, server: int | None = None) -> None:
        """Name the incident that opened the current cooldown window of ``(server, trigger)``
        (see :meth:`claim_cooldown`)."""
        self._cooldown_ids[(server, trigger)] = incident_id

    def event_server(self, event: Event) -> int | None:
        """The server of a trigger event being handled now (its tree root pid), ``None`` when
        host-wide or not known (read by the admission policies)."""
        return self._event_servers.get(id(event))

    async def _server_key(self, event: TriggerEvent) -> int | None:
        """The server of ``event`` (:attr:`server_of` on a worker thread: ``/proc`` reads);
        ``None`` (host-wide) without one or when it fails."""
        if self.server_of is None:
            return None
        try:
            return await anyio.to_thread.run_sync(self.server_of, event)
        except Exception:  # a server not told apart is host-wide, never a crash
            log.exception("finding the server of %s failed", type(event).__name__)
            return None

    async def run(self, *, on_state: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Consume trigger events from the bus and open incidents until cancelled (or the bus
        closes): one worker per server takes that server's triggers in order, so a server's
        incidents run one at a time and two servers' at once.

        Args:
            on_state: awaited with :meth:`state` whenever it changes while this runs (an incident
                opens or closes, a trigger is suppressed, a target stalls or resumes): the
                runtime shows it in ``servewatch status``.
        """
        self.on_state = on_state
        async with anyio.create_task_group() as tg, self.bus.subscribe(
            *TRIGGER_EVENTS, WatchdogRearmed, name="incidents"
        ) as sub:
            task_status.started()
            try:
                async with anyio.create_task_group() as workers:
                    try:
                        async for event in sub:
                            if isinstance(event, TriggerEvent) and any(p.settles(event) for p in self.policies):
                                tg.start_soon(self._settled, event)  # e.g. the exits of a stopping server first
                                continue
                            await self._dispatch(event, workers)
                    finally:
                        for queue in self._queues.values():  # each worker ends once its queue is drained
                            queue.close()
            finally:
                self._queues.clear()
            tg.cancel_scope.cancel()

    async def _dispatch(self, event: Event, workers: TaskGroup) -> None:
        """Hand ``event`` to its server's worker (started on the server's first trigger)."""
        self.stalls.observe(event)  # in the bus's order, whichever worker takes it
        if not isinstance(event, TriggerEvent):
            await self._handle_one(event)
            return
        server = await self._server_key(event)
        queue = self._queues.get(server)
        if queue is None:
            queue, received = anyio.create_memory_object_stream[TriggerEvent](max_buffer_size=math.inf)
            self._queues[server] = queue
            workers.start_soon(self._serve, server, received)
        queue.send_nowait(event)

    async def _serve(self, server: int | None, received: MemoryObjectReceiveStream[TriggerEvent]) -> None:
        """One server's worker: its triggers, in order, each to its end (an incident included);
        it ends when none is left (the next trigger of that server starts another)."""
        async with received:
            async for event in received:
                await self._handle_one(event, server=server)
                if not received.statistics().current_buffer_used:  # no await since: no trigger slips in
                    queue = self._queues.pop(server, None)
                    if queue is not None:
                        queue.close()
                    break

    async def _handle_one(self, event: Event, *, server: int | None = None) -> None:
        self._event_servers[id(event)] = server
        try:
            await self._handle_trigger(event, server=server)
        except Exception:  # a bug here must not stop the agent: log it, take the next trigger
            log.exception("handling %s failed", type(event).__name__)
        finally:
            self._event_servers.pop(id(event), None)
            if isinstance(event, TriggerEvent):
                for policy in self.policies:
                    policy.handled(event)

    async def _settled(self, event: TriggerEvent) -> None:
        """Judge ``event`` once the policies that wait for something (a health check refused
        while the server stops: its processes' exits) have settled it."""
        server = await self._server_key(event)
        self._event_servers[id(event)] = server
        for policy in self.policies:
            if policy.settles(event):
                await policy.settle(event, self)
        await self._handle_one(event, server=server)

    async def _handle_trigger(self, event: Event, *, server: int | None = None) -> None:
        """Open an incident for one trigger event of ``server`` (``None``: host-wide), unless a
        policy refuses or folds it, its key ``(server, trigger)`` is cooling down or the job does
        not admit it."""
        stall = self.stalls.observe(event)
        triggered = self.classify(event)
        await self._save_noted()
        if triggered is None or not isinstance(event, TriggerEvent):
            await self._notify()
            return
        trigger, pid, detail = triggered
        if await self._folded(event, stall):
            await self._save_noted()  # a health failure joined to the incident whose --hard caused it
            return
        key = (server, trigger)
        if self._cooling_down(trigger, server):
            self.suppressed += 1
            self._say_suppressed(key, detail)
            cooldown_id = self._cooldown_ids.get(key, "")
            self._decided(event, f"no new incident: cooldown of {cooldown_id or 'the last'}")
            if stall is not None:
                stall.update(incident=cooldown_id, suppressed=True)
            await self._notify()
            return
        if self.admit is not None and not self.admit(trigger, detail):
            self.suppressed += 1
            await self._notify()
            return
        record = await self.open_incident(trigger, detail=detail, pid=pid, cause=event, server=server)
        self._cooldown_ids[key] = record.opened.incident_id
        self._decided(event, f"incident {record.opened.incident_id}")
        if stall is not None:
            stall.update(incident=record.opened.incident_id, suppressed=False)
        await self._notify()

    async def _save_noted(self) -> None:
        """Rewrite the written incidents the exit policy noted something on (knock-on exits)."""
        for record in self.exits.changed:
            # a running one writes its own
            if isinstance(record, IncidentRecord) and not any(record is r for r in self.running.values()):
                await self._save_manifest(record)
        self.exits.changed.clear()

    async def _folded(self, event: TriggerEvent, stall: dict[str, Any] | None) -> bool:
        """Whether a policy folds ``event`` into what is already known (said and counted)."""
        for policy in self.policies:
            fold = await policy.folds(event, self)
            if fold is None:
                continue
            if fold.counted:
                self.suppressed += 1
                if stall is not None:
                    stall.update(incident=fold.incident_id, suppressed=True)
            await self._notify()
            return True
        return False

    def _decided(self, event: TriggerEvent, outcome: str) -> None:
        for policy in self.policies:
            policy.decided(event, outcome)

    def _say_suppressed(self, key: IncidentKey, detail: str) -> None:
        """Say a suppressed trigger once per cooldown window of its key ``(server, trigger)`` (a
        warning: `run` prints it); the others in that window are only counted
        (:attr:`suppressed`, `servewatch status`)."""
        server, trigger = key
        window = self._last_open.get(key, 0.0)
        if self._suppression_told.get(key) == window:
            log.info("%s detected (%s), suppressed by cooldown", trigger, detail)
            return
        self._suppression_told[key] = window
        age_s = time.monotonic() - window
        incident = self._cooldown_ids.get(key, "")
        log.warning(
            "%s detected (%s), suppressed by cooldown (%s opened %.0f s ago; no new %s incident for %.0f s more,"
            " incident.cooldown_s %g); more within this window are counted in `servewatch status`",
            trigger, detail, f"incident {incident}" if incident else f"the last {trigger} incident"
            + (f" of server pid {server}" if server is not None else ""), age_s, trigger,
            max(0.0, self.config.cooldown_s - age_s), self.config.cooldown_s,
        )

    def state(self) -> dict[str, Any]:
        """What `servewatch status` shows of incidents (JSON-ready): ``open`` (the running
        incident, the most recently opened when several servers' run: ``id``, ``trigger``,
        ``detail``, ``opened_time_unix_nano``, ``server`` (its tree root pid, ``None``:
        host-wide); ``None`` when none), ``running`` (every running one, same keys, oldest first),
        ``last`` (the last written one, same keys), ``written`` (count), ``suppressed`` (triggers
        ignored while their cause cooled down) and ``stalled`` (stalls not over: ``pid``,
        ``series``, ``timeout_s``, ``since_time_unix_nano`` (no progress since), ``incident``
        (the one that holds its evidence), ``suppressed`` (it opened none: cooldown))."""
        def brief(record: IncidentRecord | None) -> dict[str, Any] | None:
            if record is None:
                return None
            o = record.opened
            return {"id": o.incident_id, "trigger": o.trigger, "detail": o.detail, "opened_time_unix_nano": o.time_unix_nano,
                    "server": record.server}

        return {
            "open": brief(self.current),
            "running": [brief(r) for r in self.running.values()],
            "last": brief(self.records[-1] if self.records else None),
            "written": len(self.records),
            "suppressed": self.suppressed,
            "stalled": self.stalls.entries(),
        }

    def _say_phase(self, what: str) -> None:
        if self.on_phase is None:
            return
        try:
            self.on_phase(what)
        except Exception:  # a progress line is a view; the incident goes on
            log.exception("reporting the incident's phase failed")

    async def _notify(self) -> None:
        if self.on_state is None:
            return
        try:
            await self.on_state(self.state())
        except Exception:  # status is a view; the incident goes on
            log.exception("reporting the incident state failed")

    # -- one incident -----------------------------------------------------------------------

    async def open_incident(
        self,
        trigger: str,
        *,
        detail: str = "",
        pid: int | None = None,
        cause: Event | None = None,
        parent: tuple[str, str] | None = None,
        server: int | None = None,
    ) -> IncidentRecord:
        """Run one incident to the end and return its record. Never raises for target trouble.
        Incidents of one server run one at a time (a second waits for the first); two servers'
        run at once.

        Args:
            trigger: ``stall``, ``health``, ``exit``, ``manual`` or ``peer``.
            detail: one line on why.
            pid: the process that caused it, when known (it is acted on first).
            cause: the trigger event, kept for the time of detection.
            parent: ``(trace_id, parent_span_id)`` hex of a trace begun elsewhere (a W3C
                ``traceparent``): the root span joins that trace under that span.
            server: the server it is about (its process-tree root pid): its targets are that
                server's processes only; ``None``: host-wide (every target).
        """
        lock = self._locks.setdefault(server, anyio.Lock())
        async with lock:  # the run's end rewrites the status file itself (its finally)
            return await self._run_incident(trigger, detail, pid, cause, parent, server)

    async def retrace(self, incident_id: str, trace_id: str, parent_span_id: str) -> bool:
        """Move the running incident ``incident_id`` into another trace (see :class:`IncidentRetraced`).

        Returns:
            False when that incident is not running.
        """
        record = self.running.get(incident_id)
        if record is None:
            return False
        previous = record.opened.trace_id
        record.opened = replace(record.opened, trace_id=trace_id, parent_span_id=parent_span_id)
        await self.bus.publish(
            IncidentRetraced(source="incidents", incident_id=incident_id, trace_id=trace_id,
                             parent_span_id=parent_span_id, previous_trace_id=previous)
        )
        return True

    async def _run_incident(
        self, trigger: str, detail: str, pid: int | None, cause: Event | None, parent: tuple[str, str] | None = None,
        server: int | None = None,
    ) -> IncidentRecord:
        incident_id = _incident_id(trigger)
        bundle_dir = self.layout.incident(incident_id)
        try:
            # 0700: stacks and request ids are not for every user
            await anyio.to_thread.run_sync(ensure_private_dir, bundle_dir)
        except OSError as exc:  # disk full, data dir removed: the spans still carry the evidence
            log.error("cannot create bundle folder %s: %s", bundle_dir, exc)
        try:
            record, steps_at_open = await self._open_record(incident_id, bundle_dir, trigger, detail, pid, cause, parent,
                                                            server)
        except BaseException:  # stopped before anything was captured: no empty, nameless folder left behind
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_remove_if_empty, bundle_dir)
            raise
        self.running[incident_id] = record
        self.current = record
        _RUNNING_HERE.add(incident_id)
        await self._notify()
        try:
            return await self._run_phases(record, trigger, pid, cause=cause, steps_at_open=steps_at_open)
        except BaseException:
            if not any(r is record for r in self.records):  # else already written closed and recorded
                with anyio.CancelScope(shield=True):
                    await self._write_interrupted(record)
            raise
        finally:
            _RUNNING_HERE.discard(incident_id)
            self.running.pop(incident_id, None)
            self.current = next(reversed(self.running.values()), None)
            if not self.running:
                self._interrupt = ""
            # a lifecycle line noted while its last write was under way (an orphan's end 0 s after
            # the open): written now, bounded, never in a cancellation's way
            written = self._lines_written.pop(incident_id, None)
            if written is not None and written != len(record.lifecycle) and any(r is record for r in self.records):
                with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
                    await self._save_manifest(record)
                self._lines_written.pop(incident_id, None)
            # the status file says it is over (else `servewatch status` shows it OPEN, 0 written,
            # until something else rewrites the file); bounded, and never in a cancellation's way
            with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                await self._notify()

    async def _open_record(
        self, incident_id: str, bundle_dir: Path, trigger: str, detail: str, pid: int | None, cause: Event | None,
        parent: tuple[str, str] | None, server: int | None = None,
    ) -> tuple[IncidentRecord, dict[int, int]]:
        """What an incident knows when it opens: its targets (``server``'s), their step counters,
        the trace it joins, the requests in flight; returns the record and the step counters."""
        targets = await self._targets_of(pid, server)
        targets = await self._with_server_tree(trigger, targets)
        steps_at_open = await self._steps_at_open(targets, trigger)
        parent, placed_attributes = await self._placement(trigger, targets, cause, parent)
        inflight = await self._inflight_of(targets)
        opened = IncidentOpened(
            source="incidents",
            incident_id=incident_id,
            trigger=trigger,
            detail=detail,
            pids=tuple(t.pid for t in targets),
            bundle_dir=str(bundle_dir),
            trace_id=parent[0] if parent else new_trace_id_hex(),
            span_id=new_span_id_hex(),
            parent_span_id=parent[1] if parent else "",
            links=tuple((r.trace_id, r.span_id) for r in inflight if r.trace_id and r.span_id),
            inflight=tuple(_inflight_span(r) for r in inflight if r.trace_id and r.span_id),
            attributes=_opened_attributes(targets, placed_attributes, server),
        )
        record = IncidentRecord(opened=opened, targets=targets, inflight=inflight, host_name=self.host_name, server=server)
        self._read_history(record, cause, pid, server)
        record.phases_pending = [name for name, _, _ in self.phases] if targets else []
        return record, steps_at_open

    def _read_history(self, record: IncidentRecord, cause: Event | None, pid: int | None, server: int | None) -> None:
        """Set ``record.history``: the server's story up to the open (``server``'s processes' only);
        a failed read is logged and leaves it as it is."""
        if self.history is None:
            return
        try:
            points = self.history.snapshot(until_unix_nano=record.opened.time_unix_nano, cause=cause)
            if server is not None:  # this server's processes' story, not another's on the host
                pids = {t.pid for t in record.targets} | ({pid} if pid is not None else set())
                points = [p for p in points if p.pid is None or p.pid in pids]
            record.history = list(points)
        except Exception:  # the history is context; the evidence comes first
            log.exception("reading the server's history failed")

    async def _targets_of(self, pid: int | None, server: int | None = None) -> list[Target]:
        """The incident's targets (``server``'s only, with the dead ranks of ``pid``'s job, when
        the runtime says which), the culprit first. An exited target stays in the incident when
        discovery returns it: its actions report it dead (with its exit status), which is often
        why the others hang."""
        try:
            if self.discover_for is not None:
                targets = await anyio.to_thread.run_sync(self.discover_for, pid, server)  # a /proc scan
            else:
                targets = await anyio.to_thread.run_sync(self.discover)
        except Exception:  # discovery must never take the agent down
            log.exception("target discovery failed")
            return []
        if pid is not None:  # the culprit first
            targets.sort(key=lambda t: t.pid != pid)
        return targets

    async def _with_server_tree(self, trigger: str, targets: list[Target]) -> list[Target]:
        """``targets`` and the rest of their servers' trees (:attr:`server_tree`), sorted by pid
        after the first (the culprit first stays first); ``targets`` alone when none is added or
        reading the trees fails (never fatal)."""
        if self.server_tree is None:
            return targets
        try:
            more = await anyio.to_thread.run_sync(self.server_tree, trigger, list(targets))  # /proc reads
        except Exception:  # the tree is more evidence; the targets come first
            log.exception("reading the servers' process trees failed")
            return targets
        have = {t.pid for t in targets}
        return targets + [t for t in more if t.pid not in have]

    async def _steps_at_open(self, targets: Sequence[Target], trigger: str = "") -> dict[int, int]:
        """The targets' step counters now, for the verdict (``{}`` without a judge); the judge
        reads the server's progress counter now for an incident of ``trigger`` that needs it."""
        if self.judge is None:
            return {}
        try:
            # /proc and the SDK's folders: a worker thread (microseconds of reading, not the loop's)
            async with self._judge_lock:
                return await anyio.to_thread.run_sync(self.judge.opened, targets, trigger)
        except Exception:  # the verdict is a nicety; the evidence comes first
            log.exception("reading step counters for the verdict failed")
            return {}

    async def _placement(
        self, trigger: str, targets: Sequence[Target], cause: Event | None, parent: tuple[str, str] | None,
    ) -> tuple[tuple[str, str] | None, Mapping[str, AttributeValue]]:
        """The trace the incident joins (``parent``, or the one :attr:`place` names) and the
        root-span attributes that came with it; bounded."""
        if self.place is None:
            return parent, {}
        bound_s = min(5.0, self.config.phase_timeout_s)
        with anyio.move_on_after(bound_s) as scope:
            try:
                placed = await self.place(trigger, targets, cause.time_unix_nano if cause is not None else now_ns(), parent)
                if placed is not None:
                    return (placed[0], placed[1]), placed[2]
            except Exception:  # the trace's name is a nicety; the evidence comes first
                log.exception("placing the incident in its job's trace failed")
                return parent, {PLACEMENT_ATTRIBUTE: "failed: opened in its own trace"}
        if scope.cancelled_caught:  # said, never silent: the capture goes on in a trace of its own
            log.warning("placing the %s incident in its job's trace took over %.1f s: it opens in its own trace", trigger, bound_s)
            return parent, {PLACEMENT_ATTRIBUTE: f"cut after {bound_s:g} s: opened in its own trace"}
        return parent, {}

    async def _inflight_of(self, targets: Sequence[Target]) -> list[InflightRequest]:
        """The requests in flight in the targets (bounded; ``[]`` when they cannot be read)."""
        if self.inflight is None or not targets:
            return []
        with anyio.move_on_after(min(5.0, self.config.phase_timeout_s)):
            try:
                return await self.inflight(targets)
            except Exception:
                log.exception("reading in-flight requests failed")
        return []

    async def _write_interrupted(self, record: IncidentRecord) -> None:
        """Cancelled mid-phase (agent stopping past the grace): keep what was captured, written
        ``interrupted``, its root span out if it can be within a second, recorded once."""
        record.state = STATE_INTERRUPTED
        during = record.phases_pending[0] if record.phases_pending else "the incident"
        record.interrupted_reason = record.interrupted_reason or f"{self._interrupt or 'agent stopped'} during {during}"
        record.closed_time_unix_nano = now_ns()
        await self._save_manifest(record)
        with anyio.move_on_after(1.0):
            await self._publish_closed(record)
            record.root_published = True
            await self._save_manifest(record)
        self.records.append(record)
        if self.on_incident is not None:
            try:
                self.on_incident(record)
            except Exception:  # a printing callback must not hide the cancellation
                log.exception("incident callback failed")

    async def _publish_closed(self, record: IncidentRecord) -> None:
        o = record.opened
        await self.bus.publish(
            IncidentClosed(
                source="incidents",
                incident_id=o.incident_id,
                trigger=o.trigger,
                bundle_dir=str(record.bundle_dir),
                manifest_path=str(record.manifest_path),
                outcomes=tuple((r.action, r.outcome.value) for r in record.results),
                state=record.state,
                attributes={**(record.verdict.attributes() if record.verdict is not None else {}), **record.attributes},
            )
        )

    async def _run_one_phase(
        self, record: IncidentRecord, name: str, phase: Phase, event_cls: type[ActionCompleted]
    ) -> None:
        """Run one phase; each action is published when it finishes (sent on the phase's stream),
        the manifest when it ends."""
        opened = record.opened
        reported: list[ActionResult] = []
        self._say_phase(name)

        async def publish(result: ActionResult) -> None:
            result = _with_span_id(result)
            record.results.append(result)
            await self.bus.publish(event_cls(source=name, incident_id=opened.incident_id, result=result))

        async def receive_reports() -> None:
            async with source:
                async for result in source:
                    reported.append(result)
                    await publish(result)

        results: list[ActionResult] = []
        phase_started_ns = now_ns()
        sink, source = action_stream()
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive_reports)  # ends once the sink is closed and what it holds is published
            with anyio.move_on_after(self.config.phase_timeout_s) as scope, sink:
                try:
                    results = await phase(opened, record.targets, record.bundle_dir, sink)
                except Exception as exc:  # an actor's boundary: an outcome, never a crash
                    log.exception("phase %s failed", name)
                    t = now_ns()
                    results = [
                        ActionResult(action=name, outcome=Outcome.FAILED, detail=f"{type(exc).__name__}: {exc}",
                                     start_time_unix_nano=t, end_time_unix_nano=t)
                    ]
        if scope.cancelled_caught:
            # keep what finished (already reported); one timed-out result per unfinished target
            results = _unfinished(name, record.targets, reported, self.config.phase_timeout_s, started_ns=phase_started_ns)
        for result in results:
            if not any(result is r for r in reported):  # else already published when it finished
                await publish(result)
        record.phases_done.append(name)
        if name in record.phases_pending:
            record.phases_pending.remove(name)
        await self._save_manifest(record, durable=False)

    def _stop_phases(self, record: IncidentRecord) -> bool:
        """True (and the record marked interrupted) when an interrupt asked to skip what is left."""
        if not self._interrupt:
            return False
        if record.phases_pending:
            record.state = STATE_INTERRUPTED
            record.interrupted_reason = f"{self._interrupt}: skipped {', '.join(record.phases_pending)}"
        return True

    async def _run_phases(
        self, record: IncidentRecord, trigger: str, pid: int | None, *,
        cause: Event | None = None, steps_at_open: dict[int, int] | None = None,
    ) -> IncidentRecord:
        opened = record.opened
        await self._save_manifest(record, durable=False)  # visible at once: state open
        await self.bus.publish(opened)
        log.info("incident %s opened: %s: %s", opened.incident_id, trigger, opened.detail)
        companions = [start(opened) for start in self.companions]
        deferred = await self._run_phases_before_summary(record)
        await self._write_requests(record)
        await self._judge(record, cause, steps_at_open or {})
        await self._collect(record, companions)
        if self.hard_signal is not None and trigger == Trigger.STALL and not self._interrupt:
            await self._hard_mode(record, pid)
        await self._save_manifest(record, durable=False)
        if self.on_summary is not None:
            self.on_summary(record)  # stacks and coredumps are in: a profile never delays this
        for name, phase, event_cls in deferred:
            if self._stop_phases(record):
                break
            await self._run_one_phase(record, name, phase, event_cls)
        await self._close(record)
        return record

    async def _run_phases_before_summary(self, record: IncidentRecord) -> list[tuple[str, Phase, type[ActionCompleted]]]:
        """Run the phases before the summary point in order (an interrupt skips the rest); the
        deferred ones are returned, to run after it."""
        later = []
        for name, phase, event_cls in self.phases:
            if not record.targets:
                break
            if name in self.deferred:
                later.append((name, phase, event_cls))
                continue
            if self._stop_phases(record):
                break
            await self._run_one_phase(record, name, phase, event_cls)
        return later

    async def _write_requests(self, record: IncidentRecord) -> None:
        """``requests.json``: the requests in flight when it opened (prompts only when asked)."""
        if not record.inflight:
            return
        opened = record.opened
        requests = {
            "incident_id": opened.incident_id,
            "captured_time_unix_nano": opened.time_unix_nano,
            "requests": [r.to_json(with_prompt=self.config.capture_prompts) for r in record.inflight],
        }
        await anyio.to_thread.run_sync(_write_json, record.bundle_dir / "requests.json", requests)

    async def _judge(self, record: IncidentRecord, cause: Event | None, steps_at_open: dict[int, int]) -> None:
        """The cross-rank verdict from the evidence, bounded (none without a judge)."""
        if self.judge is None:
            return
        self._say_phase("verdict")
        t0 = time.monotonic()
        with anyio.move_on_after(min(10.0, self.config.phase_timeout_s)):
            try:
                async with self._judge_lock:  # one judge: another server's verdict waits its turn
                    record.verdict = await self.judge.decide(record.targets, record.results, cause, steps_at_open)
            except Exception:  # the verdict is a nicety; the evidence comes first
                log.exception("making the verdict failed")
        record.verdict_duration_s = time.monotonic() - t0
        self._note_server_dumps(record)
        if record.verdict is not None:
            # INFO: the summary shows it (every command prints one), the bundle and spans hold it
            log.info("incident %s: %s", record.opened.incident_id, record.verdict.headline())

    def _note_server_dumps(self, record: IncidentRecord) -> None:
        """The verdict's evidence says whether the server's own watchdog fired (ran py-spy) since
        the incident's window began: one line per server process that did (see ``server_dumps``)."""
        if self.server_dumps is None or record.verdict is None:
            return
        pids = [t.pid for t in record.targets] + ([record.server] if record.server is not None else [])
        try:
            lines = tuple(self.server_dumps(record.opened.time_unix_nano, now_ns(), pids))
        except Exception:  # a nicety: never in the evidence's way
            log.exception("reading the server's own py-spy runs failed")
            return
        if lines == record.server_dump_lines:
            return
        kept = tuple(line for line in record.verdict.evidence if line not in record.server_dump_lines)
        record.verdict = replace(record.verdict, evidence=kept + lines)
        record.server_dump_lines = lines

    async def _collect(self, record: IncidentRecord, companions: Sequence[Callable[[], Awaitable[list[ActionCompleted]]]]) -> None:
        """The companions' action events (a job's peers' captures), each bounded by the phase limit."""
        for collect in companions:
            with anyio.move_on_after(self.config.phase_timeout_s):
                for event in await collect():
                    event = replace(event, result=_with_span_id(event.result))
                    record.results.append(event.result)
                    await self.bus.publish(event)

    async def _hard_mode(self, record: IncidentRecord, pid: int | None) -> None:
        """Hard mode, once the evidence is in: signal the culprit rank(s), one ``hard.signal`` action each."""
        # the server's tree before the signal (its ranks exit soon after the culprit): a /proc scan
        tree = await anyio.to_thread.run_sync(_server_tree, record.targets)
        # a thread: a pidfd not held is opened and verified against /proc (blocking reads)
        sent = await anyio.to_thread.run_sync(partial(self._send_hard_signal, record, pid, server_tree=tree))
        for result in sent:
            result = _with_span_id(result)
            record.results.append(result)
            await self.bus.publish(HardSignalSent(source="incidents", incident_id=record.opened.incident_id, result=result))

    async def _close(self, record: IncidentRecord) -> None:
        """Write the incident closed, record it once and publish its end (see below)."""
        record.closed_time_unix_nano = now_ns()
        self._note_server_dumps(record)  # a run seen since the verdict
        if record.state == STATE_OPEN:
            record.state = STATE_CLOSED
        # shielded, bounded file writes: an incident written closed is not turned "interrupted"
        # by a cancellation arriving during the write, nor recorded twice
        with anyio.CancelScope(shield=True):
            await self._save_manifest(record, durable=False)  # the last write below is durable
        self.records.append(record)
        try:
            await self._publish_closed(record)
            record.root_published = True
        finally:
            # cancelled while the end waited for room on the bus (the agent stopping): the incident
            # stays closed and recorded once (never rewritten "interrupted"); its end gets one more
            # bounded try, and the manifest says whether it went out
            with anyio.CancelScope(shield=True):
                if not record.root_published:
                    with anyio.move_on_after(1.0):
                        await self._publish_closed(record)
                        record.root_published = True
                await self._save_manifest(record)
            if self.on_incident is not None:
                self.on_incident(record)

    def _send_hard_signal(
        self, record: IncidentRecord, pid: int | None, *, server_tree: Iterable[int] = ()
    ) -> list[ActionResult]:
        """Signal the culprit rank(s) (or every target, per ``hard_targets``); one result each.

        ``server_tree``: the server's processes (:func:`_server_tree`), whose exits within the
        grace are knock-on exits of this signal, not new incidents.
        """
        sig = self.hard_signal
        if sig is None:
            return []
        pids, why = hard_signal_plan(record.verdict, target_pids=[t.pid for t in record.targets], stalled_pid=pid,
                                     policy=self.hard_targets)
        if not pids:
            log.warning("hard mode: no signal sent (%s)", why)
            return []
        name = signal_mod.Signals(sig).name
        results: list[ActionResult] = []
        tree = frozenset({*pids, *(t.pid for t in record.targets), *server_tree})
        by_pid = {t.pid: t for t in record.targets}
        for target_pid in pids:
            start = now_ns()
            try:
                # only the process judged: through its pidfd (taken when it was identified)
                pidfds.send_signal(by_pid.get(target_pid) or Target(pid=target_pid), sig)
            except (ProcessLookupError, PermissionError) as exc:
                record.hard_signal_sent[target_pid] = f"failed: {type(exc).__name__}"
                outcome = Outcome.NO_SUCH_PROCESS if isinstance(exc, ProcessLookupError) else Outcome.PERMISSION_DENIED
                detail = f"{name} to pid {target_pid} failed: {type(exc).__name__}" + (
                    " (the process judged is gone; its pid may belong to another process now: not signalled)"
                    if isinstance(exc, ProcessLookupError) else "")
            else:
                record.hard_signal_sent[target_pid] = name
                self.exits.hard_signalled_pids.add(target_pid)
                OwnActionLog(self.data_dir, self.host_name).begin(  # for the other servewatch processes here
                    "hard_signal", pid=target_pid, incident_id=record.opened.incident_id,
                    bound_s=self.config.hard_mode_exit_grace_s, detail=name)
                outcome, detail = Outcome.OK, f"sent {name} to pid {target_pid} ({why})"
                log.warning("hard mode: sent %s to pid %d (%s)", name, target_pid, why)
            if target_pid in self.exits.hard_signalled_pids:  # its server's exits now are knock-on exits
                self.exits.knock_on_window(record, tree)
            results.append(
                ActionResult(
                    action=Action.HARD_SIGNAL, outcome=outcome, pid=target_pid, detail=detail,
                    start_time_unix_nano=start, end_time_unix_nano=now_ns(),
                    attributes={"servewatch.hard.signal": name, "servewatch.hard.targets": self.hard_targets},
                )
            )
        return results


def _with_span_id(result: ActionResult) -> ActionResult:
    """``result`` with the span id of its span chosen now (kept when it has one): recorded in
    the manifest, so a later agent can re-send exactly this span if it never became durable."""
    return result if result.span_id else replace(result, span_id=new_span_id_hex())


#: incidents running in this process right now (several agents may share one process in tests
#: and demos): never "recovered" by another agent's start
_RUNNING_HERE: set[str] = set()


#: ``durable(keys, since_time_unix_nano) -> the durable subset``: which write-ahead span groups
#: (keyed by their span id, hex) are on disk or delivered (the telemetry's ``durable_keys``).
DurableKeys = Callable[[set[str], int], set[str]]


def _unfinished_bundles(data_dir: Path, host_name: str, *, tracked: bool = False) -> list[tuple[Path, Manifest]]:
    """Manifests under ``<data_dir>/<host_name>/`` of an agent that is gone, left ``open`` or
    ``interrupted`` (and with ``tracked``, also closed ones whose spans were never all marked
    durable: :data:`agent.host.manifest.SPANS_DURABLE_NAME`). A live agent's running incident is left
    alone. A manifest that does not read (corrupt, an unknown version) is logged and left as it is."""
    found: list[tuple[Path, Manifest]] = []
    host_dir = DataDir(Path(data_dir), host_name).host
    try:
        paths = sorted(host_dir.glob(f"*/{MANIFEST_NAME}"))
    except OSError:
        return found
    for path in paths:
        try:
            m = load_manifest(path)
        except OSError:
            continue
        except ManifestError as exc:
            log.warning("not recovering %s", exc)
            continue
        unfinished = m.state in (IncidentState.OPEN, IncidentState.INTERRUPTED)
        if not unfinished and not (tracked and m.spans_tracked and not (path.parent / SPANS_DURABLE_NAME).exists()):
            continue
        owner = m.agent_pid
        if owner is not None and owner != os.getpid() and pid_alive(owner):
            continue
        if m.incident_id in _RUNNING_HERE:
            continue
        found.append((path, m))
    return found


def _inflight_span(r: InflightRequest) -> InflightSpan:
    """What the span mirror shows of a request in flight (its in-flight span, the root's link)."""
    name = f"{r.operation} {r.model}" if r.operation and r.model else (r.operation or r.model or "request")
    return InflightSpan(
        pid=r.pid, request_id=r.request_id, trace_id=r.trace_id, span_id=r.span_id, parent_span_id=r.parent_span_id,
        start_time_unix_nano=r.start_time_unix_nano, name=name, operation=r.operation, model=r.model,
        input_tokens=r.prompt_tokens if isinstance(r.prompt_tokens, int) else None,
        output_tokens=r.generated_tokens if isinstance(r.generated_tokens, int) else None, age_s=r.age_s,
    )


def _remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` when it holds nothing (an incident stopped before it captured anything)."""
    try:
        folder.rmdir()
    except OSError:  # not empty (keep what is there), or already gone
        pass


def _read_links(bundle_dir: Path) -> tuple[tuple[str, str], ...]:
    """The in-flight requests' span links recorded in ``requests.json`` (none when absent)."""
    try:
        data = json.loads((bundle_dir / "requests.json").read_text())
        return tuple(
            (str(r["trace_id"]), str(r["span_id"])) for r in data.get("requests", ()) if r.get("trace_id") and r.get("span_id")
        )
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return ()


def _verdict_attributes(m: Manifest) -> dict[str, Any]:
    v = m.verdict
    if v is None:
        return {}
    return Verdict(
        kind=v.kind, hung=v.hung, culprit_ranks=v.culprit_ranks, culprit_pids=v.culprit_pids, reason=v.reason,
        confidence=v.confidence, evidence=v.evidence, stragglers=v.stragglers, ranks=v.ranks, rule=v.rule,
    ).attributes()


def _opened_attributes(
    targets: Sequence[Target], placed: Mapping[str, Any], server: int | None,
) -> Mapping[str, AttributeValue]:
    """An opened incident's attributes: its targets', its placement's and its server's."""
    return frozen_attrs({**target_attributes(t.title for t in targets), **placed,
                         **({SERVER_ATTRIBUTE: server} if server is not None else {})})


def _closed_event(path: Path, m: Manifest, bundle: str, root_missing: bool) -> IncidentClosed:
    """The re-sent close of ``m`` (at its close, else its last update, else now)."""
    end_ns = next((v for v in (m.closed_time_unix_nano, m.updated_time_unix_nano) if v), now_ns())
    return IncidentClosed(
        source="incidents", time_unix_nano=end_ns, incident_id=m.incident_id, trigger=m.trigger, bundle_dir=bundle,
        manifest_path=str(path), outcomes=tuple((str(a.action), str(a.outcome)) for a in m.actions),
        state=STATE_CLOSED if m.state is IncidentState.CLOSED else STATE_INTERRUPTED,
        attributes=frozen_attrs(_verdict_attributes(m)), emit_root=root_missing,
    )


async def _resend(bus: EventBus, path: Path, m: Manifest, durable: DurableKeys) -> int:
    """Publish again, with their recorded ids, the spans of ``m`` that are not durable (root and
    actions); the mirror writes them ahead and marks the bundle once all are. Returns how many
    groups were re-sent."""
    actions = [a for a in m.actions if a.span_id]
    keys = {a.span_id for a in actions} | ({m.span_id} if m.span_id else set())
    have = await anyio.to_thread.run_sync(durable, keys, m.opened_time_unix_nano)
    missing = [a for a in actions if a.span_id not in have]
    root_missing = bool(m.span_id) and m.span_id not in have
    bundle = str(path.parent)
    await bus.publish(
        IncidentOpened(
            source="incidents", time_unix_nano=m.opened_time_unix_nano, incident_id=m.incident_id, trigger=m.trigger,
            detail=m.detail, pids=tuple(t.pid for t in m.targets), bundle_dir=bundle, trace_id=m.trace_id,
            span_id=m.span_id, parent_span_id=m.parent_span_id,
            links=await anyio.to_thread.run_sync(_read_links, path.parent) if root_missing else (),
            attributes=frozen_attrs(target_attributes(t.title for t in m.targets)),
        )
    )
    for action in missing:
        await bus.publish(ActionCompleted(source="incidents", incident_id=m.incident_id, result=action.to_result()))
    await bus.publish(_closed_event(path, m, bundle, root_missing))
    return len(missing) + int(root_missing)


async def recover_interrupted(bus: EventBus, data_dir: Path, host_name: str, *, durable: DurableKeys | None = None) -> list[str]:
    """Finish what a previous agent left: close the bundles it left ``open`` (killed) or
    ``interrupted`` (stopped mid-incident), and re-send the incident spans that never became
    durable.

    Each open or interrupted manifest becomes ``state: closed`` with ``interrupted: true`` and
    the reason in words. With ``durable`` (the telemetry's ``durable_keys``), every bundle whose
    spans are tracked (``spans_tracked``) and not marked durable is checked span by span: the
    root and each action the manifest records are re-sent, with their recorded trace and span
    ids, exactly when they are neither in the spool nor delivered; together with the
    delivered-keys ledger this sends each span once. Older bundles (and without ``durable``):
    the root is sent when it was never published. Never raises for a bad bundle (one that does
    not read is left alone).

    Returns:
        The incident ids closed or completed.
    """
    done: list[str] = []
    found = await anyio.to_thread.run_sync(partial(_unfinished_bundles, Path(data_dir), host_name, tracked=durable is not None))
    for path, m in found:
        end_ns = next((v for v in (m.closed_time_unix_nano, m.updated_time_unix_nano) if v), now_ns())
        unfinished = m.state in (IncidentState.OPEN, IncidentState.INTERRUPTED)
        reason = m.interrupted_reason or (
            "the agent stopped before the incident finished (killed?); closed on its next start"
        )
        if durable is not None and m.spans_tracked:
            if (path.parent / SPANS_DURABLE_NAME).exists():
                resent = 0  # every span durable (the mirror marked it): only the manifest to close
            else:
                resent = await _resend(bus, path, m, durable)
            if resent:
                log.warning("incident %s: %d span group(s) were not durable when its agent stopped; sent again", m.incident_id, resent)
        elif not m.root_published:
            await bus.publish(
                IncidentOpened(
                    source="incidents",
                    time_unix_nano=m.opened_time_unix_nano,
                    incident_id=m.incident_id,
                    trigger=m.trigger,
                    detail=m.detail,
                    pids=tuple(t.pid for t in m.targets),
                    bundle_dir=str(path.parent),
                    trace_id=m.trace_id,
                    span_id=m.span_id,
                    parent_span_id=m.parent_span_id,
                )
            )
            await bus.publish(
                IncidentClosed(
                    source="incidents",
                    time_unix_nano=end_ns,
                    incident_id=m.incident_id,
                    trigger=m.trigger,
                    bundle_dir=str(path.parent),
                    manifest_path=str(path),
                    outcomes=tuple((str(a.action), str(a.outcome)) for a in m.actions),
                    state=STATE_INTERRUPTED,
                )
            )
        if unfinished:
            recovered = m.model_copy(update={
                "state": IncidentState.CLOSED,
                "interrupted": True,
                "interrupted_reason": reason,
                "closed_time_unix_nano": m.closed_time_unix_nano or end_ns,
                "root_published": True,
                "recovered_time_unix_nano": now_ns(),
            })
            await anyio.to_thread.run_sync(_write_json, path, recovered)
            log.warning("incident %s was interrupted (%s); its bundle is closed now", m.incident_id, reason)
        done.append(m.incident_id)
    return done
