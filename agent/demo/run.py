"""``servewatch demo``: the main job end to end on a real (small) inference server.

Starts the demo server (HTTP frontend + TP scheduler subprocesses running a torch model), runs
the agent watching it (health, SDK step counters, process titles), sends a few requests, makes
scheduler TP0 hang on purpose with a request in flight, waits for the stall incident (stacks of
every scheduler, bundle, spans), then shuts everything down and says where the bundle and the
spans are. Everything is bounded by ``deadline_s``.

Imports the agent runtime and :mod:`agent.demo.client`; nothing imports this module but the CLI.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import httpx
from rich.console import Console

from agent.incidents.manager import STATE_INTERRUPTED, IncidentRecord
from agent.runtime.settings import Settings, load_settings

__all__ = ["run_demo"]

class Log(Protocol):
    """Where the demo's progress lines go: the CLI's stderr (on a terminal it wraps them at words
    with a hanging indent), or a rich Console. Each line is printed with ``markup=False,
    highlight=False`` and nothing else: plain text, never rich markup."""

    def print(self, *objects: Any, **kwargs: Any) -> None: ...


#: Requests sent before the fault, so every scheduler has stepped (the watchdog clock starts
#: at the first step: warm-up is never a stall).
WARMUP_REQUESTS = 4


def run_demo(
    settings: Settings,
    *,
    tp: int = 2,
    watchdog_timeout_s: float = 3.0,
    deadline_s: float = 90.0,
    log: Log | None = None,
    on_captured: Callable[[IncidentRecord], None] | None = None,
) -> IncidentRecord:
    """Run the demo and return the stall incident it captured.

    The progress lines go to ``log``; the incident is handed to ``on_captured`` as soon as it is
    captured (before the shutdown), and where its bundle and spans are comes last.

    Args:
        settings: base settings (data dir, export); targets, health and watchdog are set here.
        tp: scheduler processes (TP ranks).
        watchdog_timeout_s: stall timeout, seconds.
        deadline_s: upper bound on the whole demo, seconds.
        log: progress lines (stderr): the CLI's, which wraps them at words on a terminal.
        on_captured: called once with the finished incident, before the server is stopped (the
            CLI prints it: the verdict first).

    Raises:
        TimeoutError: no incident was captured within ``deadline_s``.
        KeyboardInterrupt: SIGINT or SIGTERM arrived (Ctrl-C); the demo server was stopped first,
            saying so at once (its start can take many seconds to unwind).
    """
    return anyio.run(_demo_until_signal, settings, tp, watchdog_timeout_s, deadline_s, log or Console(stderr=True),
                     on_captured)


async def _demo_until_signal(
    settings: Settings, tp: int, watchdog_timeout_s: float, deadline_s: float, log: Log,
    on_captured: Callable[[IncidentRecord], None] | None,
) -> IncidentRecord:
    """:func:`_demo`, ended by SIGINT/SIGTERM: the first says "stopping the demo server…" at
    once, cancels the demo (the server's own cleanup runs shielded), then raises KeyboardInterrupt."""
    import signal

    got: list[int] = []
    result: list[IncidentRecord] = []
    records: list[IncidentRecord] = []  # every incident the demo's agent wrote, interrupted ones too

    async def watch_signals(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                got.append(signum)
                log.print(f"{signal.Signals(signum).name} received: stopping the demo server…", markup=False,
                          highlight=False)
                scope.cancel()
                return

    async def demo(scope: anyio.CancelScope) -> None:
        result.append(await _demo(settings, tp, watchdog_timeout_s, deadline_s, log, on_captured, records))
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_signals, tg.cancel_scope)
        tg.start_soon(demo, tg.cancel_scope)
    if got:
        log.print("demo server stopped", markup=False, highlight=False)
        for record in records:
            if record.state == STATE_INTERRUPTED:  # the stop cut it short: what it kept, and where
                log.print(f"incident {record.opened.incident_id} was interrupted; what it captured is kept in "
                          f"{record.bundle_dir}/ (View: servewatch timeline {record.opened.incident_id})",
                          markup=False, highlight=False)
        raise KeyboardInterrupt
    return result[0]


async def _demo(
    settings: Settings, tp: int, watchdog_timeout_s: float, deadline_s: float, log: Log,
    on_captured: Callable[[IncidentRecord], None] | None, records: list[IncidentRecord] | None = None,
) -> IncidentRecord:
    from agent.demo.client import DemoServer, agenerate, ainject_hang
    from agent.runtime.agent import Agent

    t0 = time.monotonic()

    def say(msg: str) -> None:
        log.print(f"[{time.monotonic() - t0:5.1f}s] {msg}", markup=False, highlight=False)

    records = [] if records is None else records
    got_incident = anyio.Event()

    def on_incident(record: IncidentRecord) -> None:
        records.append(record)
        got_incident.set()

    try:
        with anyio.fail_after(deadline_s):
            say(f"starting the demo inference server (TP={tp}, a small torch model per scheduler)")
            async with DemoServer(tp=tp) as server:
                say(f"server pid {server.pid} at {server.base_url}; schedulers {server.scheduler_pids}")
                demo_settings = _demo_settings(settings, server, watchdog_timeout_s)
                agent = Agent.build(demo_settings, on_incident=on_incident)
                async with anyio.create_task_group() as tg:
                    await tg.start(agent.run)
                    say(f"servewatch watching: health {server.base_url}/health, step counters of {tp} scheduler(s)")
                    say(f"sending {WARMUP_REQUESTS} requests")
                    async with anyio.create_task_group() as reqs:
                        for i in range(WARMUP_REQUESTS):
                            reqs.start_soon(agenerate, server.base_url, f"warm-up request {i}", 8)
                    while not set(server.scheduler_pids) <= agent.watched_step_pids:
                        await anyio.sleep(0.1)
                    say("injecting a hang into scheduler TP0 and sending one more request")
                    await ainject_hang(server.base_url, tp_rank=0)
                    tg.start_soon(_request_in_flight, server.base_url)
                    say(f"waiting for the watchdog (busy, no forward progress for {watchdog_timeout_s:g}s)")
                    await got_incident.wait()
                    say("incident captured:")
                    if on_captured is not None:
                        on_captured(records[0])
                    say("shutting down")
                    agent.stop()
                    tg.cancel_scope.cancel()
    except TimeoutError:
        raise TimeoutError(f"no incident captured within {deadline_s:g}s") from None
    record = records[0]
    say(f"bundle: {record.bundle_dir}/")
    say(f"spans: {_spans_where(agent.telemetry)}")
    return record


def _spans_where(telemetry: Any) -> str:
    """Where the demo's spans went: the embedded default's folder, or the OTLP endpoint."""
    if telemetry is None:
        return "not exported (span export is off)"
    if telemetry.spans_dir is not None:
        return f"{telemetry.spans_dir}/ (OTLP/JSON lines; replay with servewatch export)"
    return f"exported to {telemetry.destination.endpoint}"


async def _request_in_flight(base_url: str) -> None:
    from agent.demo.client import agenerate

    try:
        await agenerate(base_url, "this request meets the hang", 4, timeout_s=120.0)
    except httpx.HTTPError:
        pass  # the server is stopped under it at the end of the demo


def _demo_settings(settings: Settings, server: Any, watchdog_timeout_s: float) -> Settings:
    return load_settings(
        {
            "data_dir": settings.data_dir,
            "host_name": settings.host_name,
            # exactly this server's schedulers (titled demo::scheduler_TP<n>); a title glob would
            # also pick up another demo running on the same machine
            "target": {"pids": list(server.scheduler_pids)},
            "health": {"url": f"{server.base_url}/health", "interval_s": 1.0, "timeout_s": 2.0},
            "watchdog": {"timeout_s": watchdog_timeout_s, "poll_interval_s": 0.5},
            "coredump": {"folder": settings.layout.cuda_coredumps},
            "incident": {"cooldown_s": 300.0},
        }
    )
