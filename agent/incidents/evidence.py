"""Which processes an incident is about: the targets alive now, and the dead ranks that are its
evidence.

Owns :class:`TargetFinder`: discovery per the ``[target]`` settings (and the processes ``launch``
started), remembering every target seen alive (bounded) with its job (the server it hangs off), so
that a rank that died is still reported, dead with its exit status, in the incidents it belongs
to (:meth:`TargetFinder.incident_targets`), and the policy of which dead ranks those are
(:data:`DEAD_RANK_MARGIN_S`), and which server an incident is about (:meth:`TargetFinder.server_of_pid`,
:meth:`TargetFinder.server_of_port`: the process-tree root, the first half of the incident key).
Imports :mod:`agent.model.events`, :mod:`agent.host.targets`, :mod:`agent.model.ranks`, :mod:`agent.verdict.servers`,
:mod:`agent.host.procinfo`, :mod:`agent.host.pidfds` and the standard library.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from agent.host import pidfds
from agent.host.config import TargetConfig
from agent.host.procinfo import (
    DEAD_MEMORY_S,
    Death,
    ServerDumpLog,
    death_of,
    exit_noted_at,
    server_dump_lines,
)
from agent.host.targets import (
    ProcessState,
    Target,
    discover,
    parent_pid,
    process_state,
    rank_environ,
    server_of,
    server_uids,
    spread_warning,
    zombie_descendants,
)
from agent.model.events import HealthCheckFailed, Trigger, TriggerEvent, WatchdogStalled
from agent.model.ranks import RankEnviron
from agent.verdict.servers import (
    ancestors,
    listener_of_port,
    listening_ports,
    port_of_url,
    server_tree,
)

__all__ = ["DEAD_RANK_MARGIN_S", "MAX_REMEMBERED_TARGETS", "TargetFinder"]

log = logging.getLogger("servewatch.runtime")

#: Ports whose last server is remembered (:meth:`TargetFinder.server_of_port`), the oldest forgotten first.
MAX_PORTS_REMEMBERED = 1024

#: Servers named in :meth:`TargetFinder.describe_servers` (the others counted).
MAX_SERVERS_SAID = 4
#: Titles named per server there (the others counted).
MAX_TITLES_SAID = 4

#: Targets remembered after they were last seen alive (to report a rank that died as dead).
MAX_REMEMBERED_TARGETS = 4096
#: A dead rank is evidence of an incident when it died at most ``2 * watchdog.timeout_s`` plus
#: this many seconds before it (its siblings hang from its death, and the watchdog fires one
#: timeout later), or, for a crash (not exit 0 / SIGTERM / SIGINT), since the previous incident.
DEAD_RANK_MARGIN_S = 60.0


def _orderly(death: Death) -> bool:
    """An exit someone asked for: code 0, SIGTERM or SIGINT (directly or as 128+N)."""
    if death.signal is not None:
        return death.signal in (signal.SIGTERM, signal.SIGINT)
    return death.exit_code in (0, 128 + signal.SIGTERM, 128 + signal.SIGINT)


def _short_titles(titles: Sequence[str]) -> str:
    """``demo::scheduler_TP0, _TP1``: the first title whole, each other one from where it parts
    from the first (at a ``:``/``_``/``-``/space boundary); at most :data:`MAX_TITLES_SAID`."""
    first = titles[0]
    out = [first]
    for title in titles[1:MAX_TITLES_SAID]:
        common = 0
        while common < min(len(first), len(title)) and first[common] == title[common]:
            common += 1
        cut = max((i for i in range(common) if first[i] in ":_- "), default=-1)
        out.append(title[cut:] if cut > 0 else title)
    more = f", +{len(titles) - MAX_TITLES_SAID}" if len(titles) > MAX_TITLES_SAID else ""
    return ", ".join(out) + more


class TargetFinder:
    """The targets of ``[target]`` (pids, a root pid's descendants, title globs; plus the
    processes the agent launched), and what it remembers of them.

    Args:
        config: the ``[target]`` settings.
        children: processes the agent launched (``servewatch launch``): their descendants are targets.
        stall_timeout_s: the stall rule's timeout (``watchdog.timeout_s``): a dead rank that
            died within twice this (plus :data:`DEAD_RANK_MARGIN_S`) is an incident's evidence.
        last_incident_unix_nano: when this agent's last incident opened (``None``: none yet).

    Attributes:
        refused: processes the last discovery left out for their uid, ``{pid: why}``.
        server_dumps: the py-spy runs the servers' own processes started (:meth:`scan_server_dumps`).
    """

    def __init__(
        self, config: TargetConfig, children: Sequence[Any] = (), *, stall_timeout_s: float,
        last_incident_unix_nano: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.config = config
        self.children = children
        self.stall_timeout_s = stall_timeout_s
        self.last_incident_unix_nano = last_incident_unix_nano
        self.refused: dict[int, str] = {}
        #: the py-spy runs the servers started themselves (their own watchdog firing)
        self.server_dumps = ServerDumpLog()
        self._refused_told: dict[int, str] = {}
        self._warned_spread = False
        self._outlived_told: set[int] = set()
        self._seen: dict[int, tuple[Target, float]] = {}
        #: each remembered target's job: the process it hung off when first seen (its server)
        self._job_of: dict[int, int | None] = {}
        #: each remembered target's rank variables, read once when first seen alive (a dead
        #: rank titled ``ray::RayWorkerWrapper`` is still named by its ``RANK``)
        self._rank_env_of: dict[int, RankEnviron | None] = {}
        #: the server last seen listening on each port (a crashed or stopped server's health
        #: failure is still its own: nothing listens there any more); bounded like the servers
        self._port_server: dict[int, int] = {}

    @property
    def root_pids(self) -> list[int]:
        """``--root-pid`` and the launched processes: their descendants are targets."""
        return list(filter(None, [self.config.root_pid])) + [c.pid for c in self.children]

    def scan_server_dumps(self) -> None:
        """Look for py-spy runs the servers started themselves (:attr:`server_dumps`: a ``/proc``
        listing plus the processes new since the last scan), started by the root pids or a target
        remembered. Blocking; nothing to do before a target is known."""
        pids = [*self.root_pids, *self._seen]
        if pids:
            self.server_dumps.scan(pids)

    def server_dumps_may_be_new(self) -> bool:
        """Whether :meth:`scan_server_dumps` can find a run now (:meth:`ServerDumpLog.needs_scan`):
        cheap, on the event loop; nothing to look for before a target is known."""
        new = self.server_dumps.needs_scan()  # first: it reads the exec events waiting, whatever the answer
        return new and bool(self.root_pids or self._seen)

    def server_dump_lines(self, opened_unix_nano: int, until_unix_nano: int, pids: Sequence[int]) -> list[str]:
        """The lines saying ``pids``' own watchdog fired (ran py-spy) in an incident's window: from
        one stall timeout before it opened (when a stall began) to ``until_unix_nano`` (ns since
        the epoch); one per process that did (:func:`~agent.host.procinfo.server_dump_lines`)."""
        since = opened_unix_nano - int(self.stall_timeout_s * 1e9)
        titles = {pid: self._seen[pid][0].title for pid in pids if pid in self._seen}
        return server_dump_lines(self.server_dumps.between(since, until_unix_nano, pids), titles)

    @property
    def configured(self) -> bool:
        """Whether anything names targets (else a health/metrics-only watch: incidents dump nothing)."""
        t = self.config
        return bool(t.pids or t.match or t.root_pid or self.children)

    def discover(self) -> list[Target]:
        """The targets now (blocking: a /proc scan); each is held by a pidfd and remembered.
        Refusals (another uid) and a spread over several servers are logged once each."""
        t = self.config
        root_pids = self.root_pids
        refused: dict[int, str] = {}
        found = discover(root_pids=root_pids, title_globs=t.match, pids=t.pids, uids=t.uids, any_uid=t.any_uid, refused=refused)
        for pid, why in refused.items():
            if self._refused_told.get(pid) != why:
                log.warning("not a target: %s", why)  # once per process: discovery says whom it refused and why
        self.refused = refused
        self._refused_told = dict(refused)
        if root_pids:
            found += self._outlived(root_pids, found)
        for target in found:  # identified: signals to them go through these pidfds, never to a reused pid
            pidfds.hold(target)
        self._remember(found)
        if not self._warned_spread:
            warning = spread_warning(found, title_globs=t.match, root_pids=root_pids)
            if warning is not None:
                self._warned_spread = True  # once per agent: the operator has been told
                log.warning("%s", warning)
        return found

    def _outlived(self, root_pids: Sequence[int], found: Sequence[Target]) -> list[Target]:
        """Targets seen below a root that has ended and still running (an engine and its
        workers under pid 1 after their API server died): no longer its descendants, still its
        server's processes, so still targets, never dropped (said once each). Blocking."""
        if all(process_state(pid) in (ProcessState.RUNNING, ProcessState.STOPPED) for pid in root_pids):
            return []
        have = {t.pid for t in found}
        outlived = []
        for pid, (target, _) in list(self._seen.items()):
            if pid in have or process_state(pid, create_time_s=target.create_time_s) not in (
                    ProcessState.RUNNING, ProcessState.STOPPED):
                continue
            outlived.append(target)
            if pid not in self._outlived_told:
                self._outlived_told.add(pid)
                log.warning("pid %d %r outlived its root pid (%s ended): still watched", pid, target.title,
                            ", ".join(map(str, root_pids)))
        return outlived

    def _remember(self, found: Sequence[Target]) -> None:
        """Keep the targets seen alive (bounded), so one that dies is still reported in incidents,
        with its job (:func:`~agent.host.targets.server_of`, read once, when it is first seen)."""
        now = time.monotonic()
        pids = [t.pid for t in found]
        for target in found:
            known = self._seen.get(target.pid)
            if known is None or known[0].create_time_s != target.create_time_s:
                self._job_of[target.pid] = server_of(target.pid, pids)
                self._rank_env_of[target.pid] = rank_environ(target.pid)  # one /proc read per new process
            self._seen[target.pid] = (target, now)
        if len(self._seen) > MAX_REMEMBERED_TARGETS:
            for pid, _ in sorted(self._seen.items(), key=lambda item: item[1][1])[: len(self._seen) - MAX_REMEMBERED_TARGETS]:
                del self._seen[pid]
                self._job_of.pop(pid, None)
                self._rank_env_of.pop(pid, None)

    # -- servers ------------------------------------------------------------------------------------

    def server_of_pid(self, pid: int) -> int | None:
        """The server ``pid`` is part of: the process its job hangs off (its tree root:
        :func:`~agent.host.targets.server_of`), remembered from when it was first seen alive; a tree
        root is its own server (a launched server, a frontend, whose ranks are targets); else read
        now; ``None`` when unknown (gone and never seen). Blocking (``/proc`` reads)."""
        job = self._job_of.get(pid)
        if job is not None:
            return job
        if pid in self._job_of.values():
            return pid
        return server_of(pid, self._seen)

    def server_of_listener(self, listener: int) -> int:
        """The server of the process listening on a watched URL's port: the tree root of the
        targets it is (or is an ancestor of) when that names one server, else ``listener``
        itself (its own key). Blocking (``/proc`` reads)."""
        own = self._job_of.get(listener)
        if own is not None:  # the listener is itself a target (a matched frontend)
            return own
        roots = {job for job in self._job_of.values() if job is not None}
        if listener in roots:
            return listener
        above = {root for root in roots if listener in ancestors(root)}
        return above.pop() if len(above) == 1 else listener

    def server_of_event(self, event: TriggerEvent, *, metrics_urls: Sequence[str] = ()) -> int | None:
        """The server a trigger event is about (its process-tree root pid), the first half of the
        incident key: the subject pid's (a stall, an exit: :meth:`server_of_pid`), else the server
        listening on the port of the event's URL (``/health``, ``/metrics``; a stall without one
        is the only one of ``metrics_urls``'s); ``None`` (host-wide) when neither tells.
        Blocking (``/proc`` reads, a socket table scan)."""
        pid = event.subject_pid
        if pid is not None:
            return self.server_of_pid(pid)
        url = event.url if isinstance(event, (HealthCheckFailed, WatchdogStalled)) else ""
        if not url and isinstance(event, WatchdogStalled) and len(metrics_urls) == 1:
            url = metrics_urls[0]
        port = port_of_url(url) if url else None
        return self.server_of_port(port) if port is not None else None

    def server_of_port(self, port: int) -> int | None:
        """The server behind TCP ``port`` on this host (:func:`~agent.verdict.servers.listener_of_port`,
        then :meth:`server_of_listener`); when nothing listens there now (the server crashed or
        is stopping), the server last seen listening on it (by this call or
        :meth:`describe_servers`), so its health failure is keyed to it, never host-wide behind
        another server's cooldown; ``None`` when none was ever seen. Blocking."""
        listener = listener_of_port(port)
        server = None if listener is None else self.server_of_listener(listener)
        if server is None:  # gone (crashed, stopping): the server that listened there last
            return self._port_server.get(port)
        self._remember_port(port, server)
        return server

    def _remember_port(self, port: int, server: int) -> None:
        self._port_server.pop(port, None)
        self._port_server[port] = server
        while len(self._port_server) > MAX_PORTS_REMEMBERED:
            self._port_server.pop(next(iter(self._port_server)))

    def servers(self, targets: Sequence[Target]) -> dict[int | None, list[Target]]:
        """``targets`` by server (tree root pid; ``None``: not known), in the targets' order."""
        out: dict[int | None, list[Target]] = {}
        for target in targets:
            out.setdefault(self.server_of_pid(target.pid), []).append(target)
        return out

    def describe_servers(self, targets: Sequence[Target]) -> str:
        """Which servers ``targets`` are, in words: ``2 servers: pid 1234 (demo::scheduler_TP0,
        _TP1; :8001), pid 1300 (demo::scheduler_TP0, _TP1; :8002)`` (each server's tree root,
        its targets' titles, the TCP ports it listens on); at most :data:`MAX_SERVERS_SAID`
        named. ``""`` without targets. Blocking (``/proc`` reads, the root's sockets)."""
        if not targets:
            return ""
        groups = self.servers(targets)
        said = []
        for server, members in list(groups.items())[:MAX_SERVERS_SAID]:
            titles = _short_titles([t.title or f"pid {t.pid}" for t in members])
            ports: list[int] = []
            if server is not None:
                ports = listening_ports(server)
                for port in ports:
                    self._remember_port(port, server)
            where = "; " + ", ".join(f":{port}" for port in ports) if ports else ""
            said.append(f"{'pid ' + str(server) if server is not None else 'server unknown'} ({titles}{where})")
        more = ", ..." if len(groups) > MAX_SERVERS_SAID else ""
        return f"{len(groups)} server{'s' if len(groups) != 1 else ''}: {', '.join(said)}{more}"

    # -- an incident's targets ------------------------------------------------------------------

    def server_tree(self, trigger: str, targets: Sequence[Target], urls: Sequence[str] = ()) -> list[Target]:
        """The rest of the servers of a health incident's ``targets`` (``target.server_tree``;
        :func:`agent.verdict.servers.server_tree`): their frontends, engine cores, coordinators and
        unmatched ranks, each judged in its role (issue 32 item 1), of the server's uids (unless
        ``any_uid``), never past a ``--root-pid``; the processes listening on ``urls``' ports (the
        watched ``/health``, ``/metrics``) count as the server's. ``[]`` for other triggers or
        when turned off. Blocking (``/proc`` reads)."""
        t = self.config
        if trigger != Trigger.HEALTH or not t.server_tree:
            return []
        uids = None if t.any_uid else server_uids(
            uids=[*t.uids, *(x.uid for x in targets if x.uid is not None)], root_pids=self.root_pids, pids=t.pids)
        ports = {port for url in urls if (port := port_of_url(url)) is not None}
        listeners = {pid for port in ports if (pid := listener_of_port(port)) is not None}
        return server_tree([x for x in targets if process_state(x.pid, create_time_s=x.create_time_s) is ProcessState.RUNNING],
                           uids=uids, stop=self.root_pids, listeners=listeners)

    def incident_targets(self, live: Sequence[Target], subject: int | None = None, server: int | None = None) -> list[Target]:
        """Targets of an incident: ``live`` (discovered now), plus the dead ranks that are its evidence.

        A target seen alive within :data:`~agent.host.procinfo.DEAD_MEMORY_S` that died since (or a
        zombie of the watched trees) is in the incident, reported as dead with its exit status,
        when it is of the incident's job (:meth:`_incident_jobs`: the tree of ``subject``, the
        pid whose stall or exit opened it, else of the live targets) and died recently enough
        (:meth:`_dead_rank_counts`). A host-wide ``--match`` thus never adds other servers' dead
        processes, nor a rank that stopped in order long ago.

        With ``server`` (the incident's, its tree root pid), only that server's live targets are
        in it: two servers under one host-wide ``--match`` are two incidents, each bundle its own
        server's processes. When none of them is that server's (a URL whose listener no target
        hangs off) and no ``subject`` says otherwise, every live target is kept.

        Args:
            live: the targets alive now.
            subject: the pid whose stall or exit opens the incident (``None``: health, manual).
            server: the incident's server (``None``: host-wide).
        """
        if server is not None:
            mine = [t for t in live if self.server_of_pid(t.pid) == server]
            live = mine if mine or subject is not None else live
        jobs = self._incident_jobs(live, subject)
        dead = self._remembered_dead(live, subject, jobs)
        dead += self._unseen_zombies(live, jobs)
        return sorted([*live, *dead], key=lambda t: t.pid)

    def _remembered_dead(self, live: Sequence[Target], subject: int | None, jobs: set[int] | None) -> list[Target]:
        """The targets seen alive lately that died since, of the incident's jobs."""
        pids = {t.pid for t in live}
        now = time.monotonic()
        horizon = now - DEAD_MEMORY_S
        dead: list[Target] = []
        for pid, (target, seen) in list(self._seen.items()):
            if pid in pids or seen < horizon:
                continue
            if pid != subject and jobs is not None and self._job_of.get(pid) not in jobs:
                continue  # another server's process
            death = death_of(target)
            if death is not None and (pid == subject or self._dead_rank_counts(target, death, seen, now)):
                dead.append(replace(target, rank_env=self._rank_env_of.get(pid)))
        return dead

    def _unseen_zombies(self, live: Sequence[Target], jobs: set[int] | None) -> list[Target]:
        """Zombies of the watched trees never seen alive by this agent (``servewatch dump``)."""
        t = self.config
        roots = self.root_pids
        if not roots and t.match:
            # host-wide --match: a dead rank is a zombie beside its live siblings, under their parent
            roots = sorted({ppid for ppid in (parent_pid(x.pid) for x in live) if ppid and ppid > 1})
            if jobs is not None:
                roots = [r for r in roots if r in jobs]
        known = {x.pid for x in live} | set(self._seen)  # a zombie seen alive was judged above
        return [
            z for z in zombie_descendants(roots, t.match)
            if z.pid not in known and (t.any_uid or z.uid in server_uids(uids=t.uids, root_pids=roots, pids=t.pids))
        ]

    def _incident_jobs(self, live: Sequence[Target], subject: int | None) -> set[int] | None:
        """The jobs (servers) whose dead ranks belong to an incident: the subject's (the stalled
        or exited pid), else every job with a live target; ``None`` (no filter) when neither is
        known (every target is gone)."""
        job = self._job_of.get(subject) if subject is not None else None
        if job is not None:
            return {job}
        pids = [t.pid for t in live]
        jobs = {job for t in live if (job := self._job_of.get(t.pid) or server_of(t.pid, pids)) is not None}
        return jobs or None

    def _previous_incident_mono(self) -> float:
        """When this agent's last incident opened, on :func:`time.monotonic`'s clock (-inf: none)."""
        opened = self.last_incident_unix_nano()
        if opened is None:
            return float("-inf")
        age_s = (time.time_ns() - opened) / 1e9
        return time.monotonic() - max(0.0, age_s)

    def _dead_rank_counts(self, target: Target, death: Death, seen: float, now: float) -> bool:
        """Whether a dead target of the incident's job died recently enough to be its evidence
        (see :data:`DEAD_RANK_MARGIN_S`): an orderly exit (0, SIGTERM, SIGINT, 143, 130) only
        within the window, a crash also when it came after the previous incident."""
        died = exit_noted_at(target.pid, target.create_time_s) or seen  # else: after it was last seen alive
        if died >= now - (2 * self.stall_timeout_s + DEAD_RANK_MARGIN_S):
            return True
        return not _orderly(death) and died >= self._previous_incident_mono()
