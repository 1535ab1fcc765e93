"""Actors: consume incident triggers and act on targets, returning :class:`ActionResult`.

Actors never import watchers; :mod:`agent.incidents.manager` decides what runs and when. Owns the
:class:`Actor` protocol (the seam the incident manager calls: one phase of an incident),
:func:`act_all` (one actor over many targets at once) and :data:`ACTORS`, the actor registry
(:mod:`agent.host.registry`): one line per actor below. Registration order is the order of an
incident's phases; a factory returns ``None`` when the settings turn its actor off. Imports
anyio and :mod:`agent.host.registry` (:mod:`agent.model.events`, :mod:`agent.model.progress`, the
results' stream, and :mod:`agent.host.targets` for annotations only).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio

from agent.host.registry import Registry

if TYPE_CHECKING:  # annotations only: the settings read the registry without the events' classes
    from agent.host.targets import Target
    from agent.model.events import ActionCompleted, ActionResult, IncidentOpened
    from agent.model.progress import ActionSink

__all__ = ["ACTORS", "Actor", "PerTargetActor", "act_all"]

#: The actor registry: name -> (settings model, factory); registration order = phase order.
ACTORS: Registry[Actor] = Registry("actor")
ACTORS.register("pyspy", config="agent.actors.config:PySpyConfig", factory="agent.actors.pyspy:create")
ACTORS.register("flightrec", config="agent.actors.config:FlightRecorderConfig", factory="agent.actors.flightrec:create")
ACTORS.register("cuda_coredump", config="agent.actors.config:CoredumpConfig", table="coredump",
                factory="agent.actors.coredump:create")
ACTORS.register("profiler", config="agent.actors.config:ProfilerConfig", factory="agent.actors.profiler:create")


class Actor(Protocol):
    """One kind of evidence gathering (``pyspy``, ``cuda_coredump``, ``profiler``): one phase
    of every incident, called by :class:`agent.incidents.manager.IncidentManager`.

    Attributes:
        name: the registry name.
        action: the phase's name, each result's ``action`` and its span name (an
            :class:`~agent.model.events.Action`).
        completed: the event published for each result (a subclass of ``ActionCompleted``).
        deferred: the phase runs after the summary point (a profile never delays the summary).

    Optional: ``check() -> (ComponentStatus, detail)``, a startup check published as the actor's
    component status and status row (py-spy's binary); ``warm_up()``, slow imports paid on a
    worker thread when the agent starts. (torch's Flight Recorder analyzer is not one: the
    judge imports it only when an incident spans several ranks, see
    :meth:`agent.verdict.judge.VerdictJudge.opened`, so a watching agent never carries torch.)
    """

    name: str
    action: str
    completed: type[ActionCompleted]
    deferred: bool

    async def run_phase(
        self, opened: IncidentOpened, targets: Sequence[Target], artifact_dir: Path, report: ActionSink
    ) -> list[ActionResult]:
        """Act on every target for incident ``opened``, writing artifacts under ``artifact_dir``.

        Each result may be sent to ``report`` as soon as it is done (its span goes out then; the
        results returned may include those sent: each is published once). Bounded by the incident's phase limit (the caller cancels).
        Never raises for a target's misbehaviour: failures are outcomes on the results.

        Returns:
            The results, one per action (usually one per target, in ``targets`` order).
        """
        ...


class PerTargetActor(Protocol):
    """An actor acting on one target at a time (what :func:`act_all` fans out)."""

    name: str

    async def act(
        self, trigger: IncidentOpened, target: Target, *, timeout_s: float, artifact_dir: Path
    ) -> ActionResult:
        """Act on ``target`` for incident ``trigger``, writing artifacts under ``artifact_dir``.

        Never raises for a target's misbehaviour: failures are outcomes on the result.
        """
        ...


async def act_all(
    actor: PerTargetActor,
    trigger: IncidentOpened,
    targets: Sequence[Target],
    *,
    timeout_s: float,
    artifact_dir: Path,
    report: ActionSink | None = None,
) -> list[ActionResult]:
    """Run ``actor.act`` for every target concurrently (one task each) and wait for all.

    Args:
        actor: the actor; its own limits (locks, capacity limiters) still apply.
        trigger: the incident.
        targets: processes to act on; each entry is acted on, duplicates included.
        timeout_s: budget of each target's action, in seconds (passed to ``act``).
        artifact_dir: where the actions write their artifacts.
        report: where each result is sent as soon as it is done (the incident's stream).

    Returns:
        One result per target, in the order of ``targets``.
    """
    results: list[ActionResult | None] = [None] * len(targets)

    async def one(index: int, target: Target) -> None:
        result = await actor.act(trigger, target, timeout_s=timeout_s, artifact_dir=artifact_dir)
        results[index] = result
        if report is not None:
            await report.send(result)  # its span goes out now, not when the slowest target is done

    async with anyio.create_task_group() as tg:
        for index, target in enumerate(targets):
            tg.start_soon(one, index, target)
    return [r for r in results if r is not None]
