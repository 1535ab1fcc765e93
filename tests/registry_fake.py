"""A fake actor and a fake exporter, each added to servewatch by one registration line
(:func:`register`), as a newcomer adds a component. Used by tests/test_registry.py, in process
and in a real ``servewatch`` subprocess (``python -m tests.registry_fake dump --pid ...``).

* actor ``probe``: reads each target's ``/proc/<pid>/cmdline`` (a real read of a real process)
  into ``probe-<pid>.txt`` in the incident bundle; action ``probe.read``.
* watcher ``one_failure`` (registered on its own by :func:`register_watcher`): once ready,
  publishes one ``HealthCheckFailed`` (as a health watcher does after N failed probes).
* exporter ``probe_log``: at the ``start`` stage, appends a line per incident event it mirrors
  to ``<data_dir>/probe-log.txt`` (and one when it is built, saying whether for a one-shot).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from anyio import TASK_STATUS_IGNORED
from pydantic import BaseModel, Field

from agent.actors import ACTORS, Actor
from agent.host.targets import Target
from agent.model.events import (
    ActionCompleted,
    ActionResult,
    Event,
    HealthCheckFailed,
    IncidentClosed,
    IncidentOpened,
    Outcome,
    now_ns,
)
from agent.watchers import WATCHERS, Watcher
from exporters import EXPORTERS, Exporter

PROBE_ACTION = "probe.read"
LOG_NAME = "probe-log.txt"


class ProbeActor:
    name = "probe"
    action = PROBE_ACTION
    completed = ActionCompleted
    deferred = False

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    async def run_phase(
        self, opened: IncidentOpened, targets: Sequence[Target], artifact_dir: Path, report: Any
    ) -> list[ActionResult]:
        results = []
        for target in targets:
            start = now_ns()
            try:
                # file reads off the event loop (tests/blocking.py checks): cmdline waits on the target's mmap lock
                raw = (await anyio.Path(f"/proc/{target.pid}/cmdline").read_bytes())[: self.max_bytes]
            except OSError as exc:
                results.append(ActionResult(action=PROBE_ACTION, outcome=Outcome.NO_SUCH_PROCESS, pid=target.pid,
                                            detail=str(exc), start_time_unix_nano=start, end_time_unix_nano=now_ns()))
                continue
            out = artifact_dir / f"probe-{target.pid}.txt"
            await anyio.Path(out).write_bytes(raw.replace(b"\0", b" ").strip())
            results.append(ActionResult(action=PROBE_ACTION, outcome=Outcome.OK, pid=target.pid,
                                        detail=f"{len(raw)} bytes of cmdline", artifact_paths=(str(out),),
                                        start_time_unix_nano=start, end_time_unix_nano=now_ns()))
        return results


class ProbeLimits(BaseModel):
    """Settings of the ``limited_probe`` actor (its own table, ``[probe_limits]``)."""

    max_bytes: int = Field(4096, gt=0, description="most bytes of a target's cmdline read")


def create_actor(config: Any, ctx: Any) -> Actor:
    return ProbeActor(max_bytes=4096)


def create_limited_actor(config: ProbeLimits, ctx: Any) -> Actor:
    return ProbeActor(max_bytes=config.max_bytes)


class ProbeLog:
    events: tuple[type[Event], ...] = (IncidentOpened, ActionCompleted, IncidentClosed)

    def __init__(self, path: Path, *, one_shot: bool) -> None:
        self.path = path
        self._write(f"built one_shot={one_shot}")

    def _write(self, line: str) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def handle(self, event: Event) -> None:
        if isinstance(event, ActionCompleted):
            self._write(f"action {event.result.action} {event.result.outcome.value}")
        elif isinstance(event, IncidentOpened | IncidentClosed):
            self._write(f"{type(event).__name__} {event.trigger}")


def create_exporter(config: Any, ctx: Any) -> Exporter | None:
    if ctx.stage != "start":
        return None
    return ProbeLog(Path(ctx.agent.data_dir) / LOG_NAME, one_shot=ctx.one_shot)


class OneFailure:
    name = "one_failure"

    async def run(self, bus: Any, *, task_status: Any = TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await bus.publish(HealthCheckFailed(source=self.name, url="fake://probe", status_code=503, latency_s=0.0,
                                            error_class="5xx", consecutive_failures=3))
        await anyio.sleep_forever()


def create_watcher(config: Any, ctx: Any) -> Watcher:
    return OneFailure()


def register_watcher() -> None:
    WATCHERS.register("one_failure", factory="tests.registry_fake:create_watcher")


def register() -> None:
    """The registration lines (one per component)."""
    ACTORS.register("probe", factory="tests.registry_fake:create_actor")
    EXPORTERS.register("probe_log", factory="tests.registry_fake:create_exporter")


def register_configured() -> None:
    """An actor with settings of its own: one registration line naming its model and table."""
    ACTORS.register("limited_probe", config="tests.registry_fake:ProbeLimits", table="probe_limits",
                    factory="tests.registry_fake:create_limited_actor")


def unregister() -> None:
    for registry, name in ((ACTORS, "probe"), (EXPORTERS, "probe_log"), (WATCHERS, "one_failure"),
                           (ACTORS, "limited_probe"), (ACTORS, "twin")):
        if name in registry:
            registry.unregister(name)


if __name__ == "__main__":  # servewatch with the fake components registered: argv as the CLI's
    register()
    from agent.cli.app import main

    sys.argv = ["servewatch", *sys.argv[1:]]
    main()
