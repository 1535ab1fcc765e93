"""Actors: consume incident triggers and act on targets, returning :class:`ActionResult`.

Actors never import watchers; :mod:`agent.incidents` decides what runs and when.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from agent.events import ActionResult, IncidentOpened
from agent.targets import Target

__all__ = ["Actor"]


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
