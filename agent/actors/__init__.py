"""Actors: consume incident triggers and act on targets, returning :class:`ActionResult`.

Actors never import watchers; :mod:`agent.incidents` decides what runs and when. Owns the
:class:`Actor` protocol and :func:`act_all` (one actor over many targets at once). Imports anyio,
:mod:`agent.events` and :mod:`agent.targets`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import anyio

from agent.events import ActionResult, IncidentOpened
from agent.progress import report_action
from agent.targets import Target

__all__ = ["Actor", "act_all"]


class Actor(Protocol):
    """One kind of evidence gathering (``pyspy``, ``cuda_coredump``, ``profiler``)."""

    name: str

    async def act(
        self, trigger: IncidentOpened, target: Target, *, timeout_s: float, artifact_dir: Path
    ) -> ActionResult:
        """Act on ``target`` for incident ``trigger``, writing artifacts under ``artifact_dir``.

        Never raises for a target's misbehaviour: failures are outcomes on the result.
        """
        ...


async def act_all(
    actor: Actor,
    trigger: IncidentOpened,
    targets: Sequence[Target],
    *,
    timeout_s: float,
    artifact_dir: Path,
) -> list[ActionResult]:
    """Run ``actor.act`` for every target concurrently (one task each) and wait for all.

    Args:
        actor: the actor; its own limits (locks, capacity limiters) still apply.
        trigger: the incident.
        targets: processes to act on; each entry is acted on, duplicates included.
        timeout_s: budget of each target's action, in seconds (passed to ``act``).
        artifact_dir: where the actions write their artifacts.

    Each result is also handed to :func:`agent.progress.report_action` as soon as it is done.

    Returns:
        One result per target, in the order of ``targets``.
    """
    results: list[ActionResult | None] = [None] * len(targets)

    async def one(index: int, target: Target) -> None:
        result = await actor.act(trigger, target, timeout_s=timeout_s, artifact_dir=artifact_dir)
        results[index] = result
        await report_action(result)  # its span goes out now, not when the slowest target is done

    async with anyio.create_task_group() as tg:
        for index, target in enumerate(targets):
            tg.start_soon(one, index, target)
    return [r for r in results if r is not None]
