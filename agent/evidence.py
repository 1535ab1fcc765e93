"""Which processes an incident is about: the targets alive now, and the dead ranks that are its
evidence.

Owns :class:`TargetFinder`: discovery per the ``[target]`` settings (and the processes ``launch``
started), remembering every target seen alive (bounded) with its job (the server it hangs off), so
that a rank that died is still reported, dead with its exit status, in the incidents it belongs
to (:meth:`TargetFinder.incident_targets`), and the policy of which dead ranks those are
(:data:`DEAD_RANK_MARGIN_S`). Imports :mod:`agent.targets`, :mod:`agent.procinfo`,
:mod:`agent.pidfds` and the standard library.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from agent import pidfds
from agent.procinfo import DEAD_MEMORY_S, Death, death_of, exit_noted_at
from agent.targets import (
    Target,
    TargetConfig,
    discover,
    parent_pid,
    server_of,
    server_uids,
    spread_warning,
    zombie_descendants,
)

__all__ = ["DEAD_RANK_MARGIN_S", "MAX_REMEMBERED_TARGETS", "TargetFinder"]

log = logging.getLogger("servewatch.runtime")

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
        self._refused_told: dict[int, str] = {}
        self._warned_spread = False
        self._seen: dict[int, tuple[Target, float]] = {}
        #: each remembered target's job: the process it hung off when first seen (its server)
        self._job_of: dict[int, int | None] = {}

    @property
    def root_pids(self) -> list[int]:
        """``--root-pid`` and the launched processes: their descendants are targets."""
        return list(filter(None, [self.config.root_pid])) + [c.pid for c in self.children]

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
        for target in found:  # identified: signals to them go through these pidfds, never to a reused pid
            pidfds.hold(target)
        self._remember(found)
        if not self._warned_spread:
            warning = spread_warning(found, title_globs=t.match, root_pids=root_pids)
            if warning is not None:
                self._warned_spread = True  # once per agent: the operator has been told
                log.warning("%s", warning)
        return found

    def _remember(self, found: Sequence[Target]) -> None:
        """Keep the targets seen alive (bounded), so one that dies is still reported in incidents,
        with its job (:func:`~agent.targets.server_of`, read once, when it is first seen)."""
        now = time.monotonic()
        pids = [t.pid for t in found]
        for target in found:
            known = self._seen.get(target.pid)
            if known is None or known[0].create_time_s != target.create_time_s:
                self._job_of[target.pid] = server_of(target.pid, pids)
            self._seen[target.pid] = (target, now)
        if len(self._seen) > MAX_REMEMBERED_TARGETS:
            for pid, _ in sorted(self._seen.items(), key=lambda item: item[1][1])[: len(self._seen) - MAX_REMEMBERED_TARGETS]:
                del self._seen[pid]
                self._job_of.pop(pid, None)

    # -- an incident's targets ------------------------------------------------------------------

    def incident_targets(self, live: Sequence[Target], subject: int | None = None) -> list[Target]:
        """Targets of an incident: ``live`` (discovered now), plus the dead ranks that are its evidence.

        A target seen alive within :data:`~agent.procinfo.DEAD_MEMORY_S` that died since (or a
        zombie of the watched trees) is in the incident, reported as dead with its exit status,
        when it is of the incident's job (:meth:`_incident_jobs`: the tree of ``subject``, the
        pid whose stall or exit opened it, else of the live targets) and died recently enough
        (:meth:`_dead_rank_counts`). A host-wide ``--match`` thus never adds other servers' dead
        processes, nor a rank that stopped in order long ago.

        Args:
            live: the targets alive now.
            subject: the pid whose stall or exit opens the incident (``None``: health, manual).
        """
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
                dead.append(target)
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
