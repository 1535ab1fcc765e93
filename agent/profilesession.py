"""One profiling session through the agent's wiring (``servewatch profile``): the session itself
is the profiler actor's (:func:`agent.actors.profiler.profile_once`), its ``profile.session``
trace goes through the registered exporters like an incident's.

Owns :func:`profile_session`. Imports the agent (for types), and lazily the profiler actor, the
span mirror and the telemetry's destination.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from agent.events import ActionResult

if TYPE_CHECKING:
    from agent.runtime import Agent

__all__ = ["profile_session"]


async def profile_session(
    agent: Agent,
    *,
    pid: int | None,
    steps: int,
    start_step: int | None = None,
    activities: Sequence[str] | None = None,
    out_dir: Path,
    timeout_s: float | None = None,
    before_export: Callable[[], None] | None = None,
) -> tuple[ActionResult, str | None]:
    """One profiling session now (``servewatch profile``) per ``settings.profiler``, mirrored
    as a ``profile.session`` trace through ``agent``'s registered exporters (then flushed and
    shut down, as :meth:`agent.runtime.Agent.dump`).

    Args:
        agent: the agent built for it (its settings, exporters and telemetry).
        pid: the target serving the SDK control socket (backend ``sdk``; ``None``: the only one).
        steps: forward steps to capture (``num_steps``).
        start_step: start once ``forward_ct`` reaches this step.
        activities: ``CPU``, ``GPU``, ``MEM``... (default: the settings').
        out_dir: where the trace files go.
        timeout_s: wall-clock bound of the session, seconds (default: ``profiler.max_duration_s``).
        before_export: called (in a worker thread) before the exporters start, only when
            something is exported: the CLI creates and checks the data dir there.

    Returns:
        The session's result (outcome, trace files) and the hex trace id of its spans;
        ``None`` when the session wrote no trace file and spans go to the embedded files:
        then nothing is exported and no folder is created (a failed profile leaves nothing
        behind). With a collector configured a failed session is exported too (its
        ``profile.session`` span says why), through the spool in the data dir as any export.
    """
    from agent.actors.profiler import profile_once
    from exporters.mirror import mirror_profile_session
    from exporters.provider import resolve_destination

    result = await profile_once(
        agent.settings.profiler, pid=pid, steps=steps, start_step=start_step, activities=activities,
        out_dir=out_dir, timeout_s=timeout_s,
    )
    if not result.artifact_paths and resolve_destination(agent.settings.export).endpoint is None:
        return result, None
    if before_export is not None:
        await anyio.to_thread.run_sync(before_export)  # the data dir: file system
    agent._start_exporters(one_shot=True)
    assert agent.telemetry is not None, "the otlp exporter is registered"
    try:
        trace_id = await anyio.to_thread.run_sync(mirror_profile_session, agent.telemetry.sink, result)
    finally:
        await agent._close_telemetry(None)
    return result, trace_id
