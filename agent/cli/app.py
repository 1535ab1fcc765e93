"""The ``servewatch`` command line.

Owns argument parsing, exit codes and what is printed; every command calls into the agent or
exporters. stdout carries results (JSON with ``--json``), progress and chatter go to stderr.

Exit codes (:class:`ExitCode`): 0 success, 1 runtime failure, 2 usage error or invalid setting.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from agent.cli.common import (  # noqa: F401 (still named here: tests and docs read them from this module)
    HANG_INDENT,
    ExitCode,
    _data_dir_ready,
    _exit_now,
    _invalid,
    _LazyConsole,
    _logging,
    _pid_alive,
    _print_json,
    _print_record,
    _safe_console,
    _say_spooled,
    _settings,
    _target,
    _terminal_columns,
    err,
    fail,
    out,
    run_dump,
    run_export,
)
from agent.early import one_shot as _one_shot

if TYPE_CHECKING:  # settings (pydantic-settings, every component's model) load when a command needs them
    from agent.model.datadir import DataDir
    from agent.runtime.settings import Settings
    from agent.watchers.status import StatusSnapshot

__all__ = ["ExitCode", "app", "main"]


#: ``launch``: seconds during which the launched server may refuse connections while it starts
#: (loading weights can take many minutes); the health start-up timeout's default.
LAUNCH_REFUSED_GRACE_S = 1800.0

EXIT_CODES_HELP = "Exit codes: 0 success, 1 runtime failure, 2 usage error or invalid setting."

app = typer.Typer(
    name="servewatch",
    help="Diagnostics agent for GPU inference servers: stall detection, py-spy stacks, CUDA coredumps,"
    " bounded profiles, all as OpenTelemetry traces. " + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain click help: typer's rich help pulls rich's markdown/syntax stack (~80 ms of every
    # `--help`); results and errors still print through rich (imported when first used)
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _check_bindable(host: str, port: int) -> None:
    """Fail (exit 2, one line naming ``api.listen``) when the API address cannot be bound now."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as exc:
        fail(f"invalid setting api.listen: cannot listen on {host}:{port}: {exc.strerror or exc}", ExitCode.USAGE)








def _read_only_settings(data_dir: Path | None, config: Path | None) -> Any:
    """``data_dir`` and ``host_name`` for a read-only command (``status``, ``timeline``,
    ``report``): without the full settings model where nothing else could matter
    (:func:`agent.runtime.location.read_only_location`), else the full settings (every problem named)."""
    from agent.runtime.location import read_only_location

    where = read_only_location(data_dir, config)
    return where if where is not None else _settings({"data_dir": data_dir}, config, writes=False)


# Options shared by several commands.
ConfigOpt = typer.Option(None, "--config", metavar="FILE", help="TOML settings file (CLI > SERVEWATCH_* env > file > defaults).")
DataDirOpt = typer.Option(None, "--data-dir", metavar="DIR", readable=False,  # said with its owner and the fix
                          help="Bundles and span files (env SERVEWATCH_DATA_DIR; default ./servewatch-data).")
PidOpt = typer.Option(None, "--pid", metavar="PID", help="Target pid (repeatable).")
RootPidOpt = typer.Option(None, "--root-pid", metavar="PID", help="Watch this pid and all its descendants.")
MatchOpt = typer.Option(None, "--match", metavar="GLOB", help="Process-title glob, e.g. 'sglang::scheduler*' (repeatable).")
UidOpt = typer.Option(None, "--uid", min=0, metavar="UID", help="The server's real uid: only its processes are targets (repeatable; default: the uid of --root-pid/--pid, else servewatch's own).")
AnyUidOpt = typer.Option(False, "--any-uid", help="Act on matched processes of any uid (default: only the server's uid; another user's process titled like the glob is refused and named).")
OtlpEndpointOpt = typer.Option(None, "--otlp-endpoint", metavar="URL", help="OTLP collector, e.g. http://127.0.0.1:4317 (env OTEL_EXPORTER_OTLP_ENDPOINT; default: span files in the data dir).")
OtlpProtocolOpt = typer.Option(None, "--otlp-protocol", metavar="PROTOCOL", help="grpc or http/protobuf (env OTEL_EXPORTER_OTLP_PROTOCOL; default grpc).")
VerboseOpt = typer.Option(False, "--verbose", "-v", help="Log progress to stderr.")
PySpyOpt = typer.Option(None, "--pyspy/--no-pyspy", help="Dump Python stacks during incidents (default on; env SERVEWATCH_PYSPY__ENABLED).")
CoredumpDelayOpt = typer.Option(None, "--coredump-delay", min=0.0, max=60.0, metavar="SECONDS", help="Wait this long after the stacks before triggering CUDA coredumps (default 0).")
# shared by `run` and `launch` (a launched server is watched with the same flags)
HealthUrlOpt = typer.Option(None, "--health-url", metavar="URL", help="Health endpoint to poll, e.g. http://127.0.0.1:30000/health; repeat it for several servers (each tied to its server by its port).")
MetricsUrlOpt = typer.Option(None, "--metrics-url", metavar="URL", help="Prometheus /metrics URL (progress counter + busy gauge); repeat it for several servers (each tied to its server by its port).")
MetricsPresetOpt = typer.Option(None, "--metrics-preset", metavar="sglang|vllm", help="sglang (default) or vllm metric names.")
WatchdogTimeoutOpt = typer.Option(None, "--watchdog-timeout", metavar="SECONDS", help="Busy with no forward progress for this long is a stall (default 300).")
HardOpt = typer.Option(None, "--hard/--soft", help="Hard mode: signal the stalled target after capturing evidence.")
HardTargetsOpt = typer.Option(None, "--hard-targets", metavar="culprit|all", help="Hard mode signals the verdict's culprit rank(s) (default) or all ranks.")
CooldownOpt = typer.Option(None, "--cooldown", metavar="SECONDS", help="One incident per trigger kind per this long (default 300).")
ProfileOnIncidentOpt = typer.Option(None, "--profile-on-incident", min=0, metavar="STEPS", help="After an incident opens, profile the next STEPS forward steps (0: never).")
ApiListenOpt = typer.Option(None, "--api-listen", metavar="HOST:PORT", help="Serve the agent API (/v1/status, /v1/incidents) here, e.g. 0.0.0.0:7207 (default: off).")
ApiTokenFileOpt = typer.Option(None, "--api-token-file", metavar="FILE", help="Bearer token of the API and of the job's peers (mode 0600).")
JobOpt = typer.Option(None, "--job", metavar="NAME", help="Job (multi-node server) this agent belongs to: its incidents are captured by every peer in one trace.")
PeerOpt = typer.Option(None, "--peer", metavar="HOST:PORT", help="A peer agent of the job (repeatable; this agent is skipped).")
PeersDnsOpt = typer.Option(None, "--peers-dns", metavar="NAME[:PORT]", help="DNS name resolving to every peer (Kubernetes headless service).")
InsecurePeersOpt = typer.Option(
    None, "--allow-insecure-peers", help="Talk to the job's peers over plain HTTP although a token is set (default: peers need TLS)."
)


def _api_cli(api_listen: str | None, token_file: Path | None) -> dict[str, Any]:
    """The ``api`` settings given by ``--api-listen HOST:PORT`` and ``--api-token-file``, or exit 2."""
    from agent.fleet.config import parse_listen

    try:
        host, port = parse_listen(api_listen) if api_listen else (None, None)
    except ValueError as exc:
        _invalid(ValueError(f"invalid value for --api-listen: {exc}"))
    return {"enabled": True if api_listen else None, "host": host, "port": port, "token_file": token_file}


def _data_dir_source(flag: Path | None, config: Path | None) -> str:
    """Where the data dir setting came from, by the settings' precedence: ``--data-dir``,
    ``SERVEWATCH_DATA_DIR``, ``data_dir in FILE`` (``--config``) or ``the default``."""
    from agent.runtime.location import ENV_DATA_DIR

    if flag is not None:
        return "--data-dir"
    if any(k.upper() == ENV_DATA_DIR for k in os.environ):
        return ENV_DATA_DIR
    if config is not None:
        if sys.version_info >= (3, 11):
            import tomllib
        else:
            import tomli as tomllib
        try:
            if "data_dir" in tomllib.loads(config.read_text()):
                return f"data_dir in {config}"
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):  # read fine a moment ago
            pass
    return "the default"


def _duration_words(seconds: float) -> str:
    """``12 s``, ``3 min 4 s``, ``2 h 5 min``."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _counts(items: Any) -> list[tuple[str, int]]:
    """``[(item, count)]`` in first-seen order."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return list(counts.items())


class _IncidentPrinter:
    """Prints each incident's summary on stderr when its stacks and coredumps are in, then what
    came after (a profile) when it ends — for `run` and `launch` alike."""

    def __init__(self) -> None:
        import time

        self.shown: dict[str, int] = {}
        #: incident id -> (trigger, bundle folder), every incident seen, in order
        self.seen: dict[str, tuple[str, str]] = {}
        self.started_monotonic_s = time.monotonic()

    def _saw(self, record: Any) -> None:
        self.seen.setdefault(record.opened.incident_id, (str(record.opened.trigger), str(record.bundle_dir)))

    def stopped_line(self, layout: DataDir, *, written: int, exits: int) -> str:
        """The one line ``run``/``launch`` end with: how long, the incidents written (by trigger,
        the last one) and where their bundles are (under ``layout``), the target exits seen."""
        import time

        took = _duration_words(time.monotonic() - self.started_monotonic_s)
        data_dir = layout.root
        where = Path(next(iter(self.seen.values()))[1]).parent if self.seen else layout.host
        seen = f"{exits} target exit(s) seen"
        if not self.seen and not written:
            return f"servewatch: stopped after {took}; 0 incident(s) written (bundles would go to {where}/); {seen}"
        ids = list(self.seen)
        kinds = ", ".join(f"{n} {k}" for k, n in _counts(t for t, _ in self.seen.values()))
        return (f"servewatch: stopped after {took}; {max(written, len(ids))} incident(s) written ({kinds}), last {ids[-1]};"
                f" bundles in {where}/ (read one: servewatch timeline latest --data-dir {data_dir}); {seen}")

    def summary(self, record: Any) -> None:
        from agent.cli.summary import summary_lines

        self._saw(record)
        self.shown[record.opened.incident_id] = len(record.results)
        for line in summary_lines(record):
            err.print(line, markup=False, highlight=False)

    def finished(self, record: Any) -> None:
        from agent.cli.summary import late_result_lines, summary_lines

        self._saw(record)
        shown = self.shown.pop(record.opened.incident_id, None)
        if shown is None:  # no summary point reached (no phases ran): the whole summary now
            lines = summary_lines(record)
        elif len(record.results) > shown or record.state == "interrupted":
            lines = late_result_lines(record, shown)
        else:
            return
        for line in lines:
            err.print(line, markup=False, highlight=False)


_shown_status: dict[str, tuple[str, str]] = {}


def _print_status(status: Any) -> None:
    """One stderr line per watcher at start and on each change (``servewatch: metrics: BLIND — …``).

    A ready watcher whose reason only updates counts (``spans: 120 shipped``) is not reprinted;
    every change of state, and every new reason while waiting or blind, is.
    """
    state = status.state.value
    before = _shown_status.get(status.name)
    _shown_status[status.name] = (state, status.reason)
    if before is not None and before[0] == state == "ready":
        return
    err.print(f"servewatch: {status.line()}", markup=False, highlight=False)


# --- run -----------------------------------------------------------------------------------


@app.command()
def run(
    health_url: list[str] | None = HealthUrlOpt,
    metrics_url: list[str] | None = MetricsUrlOpt,
    metrics_preset: str | None = MetricsPresetOpt,
    pid: list[int] | None = PidOpt,
    root_pid: int | None = RootPidOpt,
    match: list[str] | None = MatchOpt,
    uid: list[int] | None = UidOpt,
    any_uid: bool = AnyUidOpt,
    watchdog_timeout: float | None = WatchdogTimeoutOpt,
    hard: bool | None = HardOpt,
    hard_targets: str | None = HardTargetsOpt,
    cooldown: float | None = CooldownOpt,
    profile_steps: int | None = ProfileOnIncidentOpt,
    duration: float | None = typer.Option(None, "--duration", min=0.0, metavar="SECONDS", help="Stop after this long (default: until SIGINT/SIGTERM)."),
    api_listen: str | None = ApiListenOpt,
    api_token_file: Path | None = ApiTokenFileOpt,
    job: str | None = JobOpt,
    peer: list[str] | None = PeerOpt,
    peers_dns: str | None = PeersDnsOpt,
    allow_insecure_peers: bool | None = InsecurePeersOpt,
    pyspy: bool | None = PySpyOpt,
    coredump_delay: float | None = CoredumpDelayOpt,
    otlp_endpoint: str | None = OtlpEndpointOpt,
    otlp_protocol: str | None = OtlpProtocolOpt,
    data_dir: Path | None = DataDirOpt,
    config: Path | None = ConfigOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Watch a server and capture evidence when it stalls, fails its health check or exits.

    A --pid or --root-pid that is not running at start exits 1; --match waits for a server that
    has not started yet.
    """
    _logging(verbose)
    settings = _settings(
        {
            "data_dir": data_dir,
            "target": _target(pid, root_pid, match, uid, any_uid),
            "health": {"url": health_url or None},  # several: one watcher each (agent.watchers.config.split_url_list)
            "metrics": {"url": metrics_url or None, "metrics_preset": metrics_preset},
            "watchdog": {"timeout_s": watchdog_timeout, "hard": hard, "hard_targets": hard_targets},
            "incident": {"cooldown_s": cooldown},
            "profiler": {"on_incident_steps": profile_steps},
            "export": {"endpoint": otlp_endpoint, "protocol": otlp_protocol},
            "api": _api_cli(api_listen, api_token_file),
            "fleet": {"job": job, "peers": peer or None, "peers_dns": peers_dns, "allow_insecure_peers": allow_insecure_peers},
            "pyspy": {"enabled": pyspy},
            "coredump": {"delay_s": coredump_delay},
        },
        config,
    )
    if not (settings.health.all_urls or settings.metrics.all_urls or settings.target.pids or settings.target.match or settings.target.root_pid):
        fail("nothing to watch: give --health-url, --metrics-url, --pid, --root-pid or --match", ExitCode.USAGE)
    gone = [p for p in [*settings.target.pids, *([settings.target.root_pid] if settings.target.root_pid else [])] if not _pid_alive(p)]
    if gone:  # a pid is a running process: waiting for it to appear would wait forever (--match waits)
        fail(f"no such process: {', '.join(map(str, gone))} (--pid/--root-pid watch a running process;"
             " --match TITLE waits for a server that is not started yet)", ExitCode.FAILURE)
    if settings.api.enabled:
        _check_bindable(settings.api.host, settings.api.port)
    _data_dir_ready(settings)
    import anyio

    from agent.model.lazy import mark_absent
    from agent.runtime.agent import Agent

    printer = _IncidentPrinter()

    async def main() -> None:
        agent = Agent.build(settings, on_incident=printer.finished, on_summary=printer.summary, on_status=_print_status)
        mark_absent()  # a watching agent: no sys.path search per HTTP request for a module not installed
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, agent)
            if duration is not None:
                tg.start_soon(_stop_after, agent, duration)
            await agent.run()
            _print_seen(agent, printer, settings)  # before the signal watcher ends: a Ctrl-C now is taken
            tg.cancel_scope.cancel()

    err.print(f"servewatch: watching (data dir {settings.data_dir}); Ctrl-C to stop", markup=False)
    anyio.run(main)


def _print_seen(agent: Any, printer: _IncidentPrinter, settings: Settings) -> None:
    """The one line ``run`` and ``launch`` end with (how long, the incidents written and where
    their bundles are, the target exits seen), then one line per exit, on stderr."""
    from agent.cli.summary import exit_lines

    exits = list(agent.process_watcher.exits)
    head = printer.stopped_line(settings.layout, written=len(agent.incidents.records), exits=len(exits))
    err.print(head + (":" if exits else ""), markup=False)
    for line in exit_lines(exits, agent.incidents.exit_outcomes):
        err.print(f"  {line}", markup=False)
    why = agent.process_watcher.kernel_exits_unavailable
    if why and any(f.source.value == "none" for _, f in exits):
        err.print(f"  (exit statuses unknown: {why})", markup=False)


async def _stop_on_signal(agent: Any) -> None:
    """The first SIGINT/SIGTERM stops ``agent``; later ones are taken too, until the caller
    cancels this after its summary: a second Ctrl-C while the agent stops must not raise
    KeyboardInterrupt in its bounded shutdown (a traceback, the summary lost). Once stopping,
    SIGINT stays ignored for the interpreter's last steps."""
    import signal

    import anyio

    stopping = False
    try:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if not stopping:
                    agent.stop(f"{signal.Signals(signum).name} received")
                    stopping = True
    finally:
        if stopping:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


async def _cancel_on_sigint(scope: Any, interrupted: list[str]) -> None:
    """On SIGINT, cancel ``scope`` (a one-shot command's session: its actor's cancel path stops
    what it started, bounded and shielded) and note it in ``interrupted``; a second SIGINT is
    taken too until the scope ends. Deterministic where asyncio's own Ctrl-C (a native cancel of
    the main task) could land inside a shielded stop and be lost: the session then ran to its
    deadline and the KeyboardInterrupt surfaced at interpreter exit."""
    import signal

    import anyio

    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            if not interrupted:
                interrupted.append("SIGINT")
                scope.cancel()


async def _stop_after(agent: Any, seconds: float) -> None:
    import anyio

    await anyio.sleep(seconds)
    agent.stop()


# --- status --------------------------------------------------------------------------------


@app.command()
def status(
    as_json: bool = typer.Option(False, "--json", help="Print the status document on stdout."),
    data_dir: Path | None = DataDirOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """Show what a running agent can see: each watcher ready, waiting (why) or BLIND (why),
    then any stalled target and the incidents (open, last written, suppressed by cooldown).

    Reads <data_dir>/<host>/status.json, which the agent rewrites on every change. Exits 1 when
    a watcher is blind, a target is stalled or the agent is not running.
    """
    settings = _read_only_settings(data_dir, config)
    path = _status_path(settings, data_dir, config)
    snap = _read_status(path)
    running = snap.host_name != settings.host_name or _pid_alive(snap.agent_pid)
    from agent.host.agentfiles import live_agents

    agents = live_agents(path.parent.parent, path.parent.name)  # every agent on this data dir, first first
    # the last writer stopped while another agent on this data dir runs on: that one is watching
    # (it rewrites the status at its next change); "NOT running" would read as no agent at all
    others = [pid for pid in agents if pid != snap.agent_pid] if not running else []
    if as_json:
        _print_json({**snap.to_json(), "agent_running": running, "agents_running": agents})
    else:
        _print_status_snapshot(snap, path, running=running, agents=agents, others=others)
    if snap.blind or (not running and not others) or (running and snap.stalled):
        raise typer.Exit(int(ExitCode.FAILURE))


def _status_path(settings: Settings, data_dir: Path | None, config: Path | None) -> Path:
    """The status file ``status`` reads: this host's, else the one agent's status in the data
    dir; unreadable or none: :func:`fail`."""
    from agent.host.security import access_denied
    from agent.watchers.status import STATUS_FILE

    path = settings.layout.status_file
    denied = access_denied(path)
    if denied is not None:  # the engineer who forgot sudo: whose it is and what to do, one line
        fail(f"cannot read the agent status in {settings.data_dir}: {denied}")
    if path.is_file():
        return path
    others = sorted(settings.data_dir.glob(f"*/{STATUS_FILE}")) if settings.data_dir.is_dir() else []
    if len(others) != 1:
        fail(
            f"no agent status in data dir {str(settings.data_dir)!r} (from {_data_dir_source(data_dir, config)};"
            f" expected {path}); is `servewatch run` using this data dir?"
        )
    return others[0]


def _read_status(path: Path) -> StatusSnapshot:
    from agent.watchers.status import read_status_file

    try:
        return read_status_file(path)
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
    except ValueError as exc:  # its message starts with the path: say it once
        fail(f"cannot read {path}: {str(exc).removeprefix(f'{path}: ')}")


def _print_status_snapshot(snap: StatusSnapshot, path: Path, *, running: bool, agents: list[int], others: list[int]) -> None:
    """``status``'s lines: its watchers and incidents on stdout, its header on stderr."""
    import time as _time

    if len(agents) > 1:  # they share one status file: say whose lines these are
        err.print(f"servewatch: {len(agents)} agents use this data dir (pids {', '.join(map(str, agents))}); the lines"
                  f" below are pid {snap.agent_pid}'s, the last to write {path}", markup=False)
    age_s = max(0.0, (_time.time_ns() - snap.updated_time_unix_nano) / 1e9)
    gone = (f" has stopped; agent pid {', '.join(map(str, others))} still runs on this data dir (its lines come with"
            " its next change; below: the stopped agent's last word)" if others
            else " is NOT running (status below is its last word; stall times as of then)")
    header = (
        f"servewatch: agent pid {snap.agent_pid} on {snap.host_name}" + ("" if running else gone)
        + f"; {len(snap.watchers)} watcher(s), {len(snap.blind)} blind; last change {age_s:.0f} s ago ({path})"
    )
    if not running:  # the fact that qualifies every line below comes first
        err.print(header, markup=False)
    for w in snap.watchers:
        out.print(w.line(), markup=False, highlight=False)
    # a gone agent saw nothing since its last word: a stall is as long as it was then
    stall_now = None if running else snap.updated_time_unix_nano or None
    for line in snap.incident_lines(stalled_as_of_unix_nano=stall_now):
        out.print(line, markup=False, highlight=False)
    if running:
        err.print(header, markup=False)


# --- dump ----------------------------------------------------------------------------------


@app.command()
def dump(
    pid: list[int] | None = PidOpt,
    root_pid: int | None = RootPidOpt,
    match: list[str] | None = MatchOpt,
    uid: list[int] | None = UidOpt,
    any_uid: bool = AnyUidOpt,
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
    metrics_url: str | None = typer.Option(
        None, "--metrics-url", metavar="URL",
        help="The server's Prometheus /metrics URL, read twice (2 s apart or more): tells a hang from work."),
    metrics_preset: str | None = MetricsPresetOpt,
    otlp_endpoint: str | None = OtlpEndpointOpt,
    otlp_protocol: str | None = OtlpProtocolOpt,
    data_dir: Path | None = DataDirOpt,
    config: Path | None = ConfigOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """One-shot incident now: dump matching processes, write bundle + spans, print a summary.

    One snapshot of stacks cannot tell a rank hung in its forward from one busy in it: give the
    server's /metrics with --metrics-url (its progress counter is read when the dump starts and
    again before the verdict), or watch it with `servewatch run`; an SDK step counter does it too.

    Exits 1 when a rank's stacks could not be captured for an error (the summary's Errors: N:
    timed out, permission denied, not Python), nothing matched or nothing was captured, or the
    collector refused the incident's spans (401, 404, 400...: said on stderr with the fix; the
    spans are kept under spool/rejected/); a dead rank is evidence, not an error, and spans
    spooled while the collector is unreachable are safe (the next agent sends them).
    """
    run_dump(pid=pid, root_pid=root_pid, match=match, uid=uid, any_uid=any_uid, as_json=as_json, metrics_url=metrics_url,
             metrics_preset=metrics_preset, otlp_endpoint=otlp_endpoint, otlp_protocol=otlp_protocol, data_dir=data_dir,
             config=config, verbose=verbose)


@app.command()
def demo(
    tp: int = typer.Option(2, "--tp", min=1, max=8, metavar="N", help="Scheduler processes (TP ranks) of the demo server."),
    watchdog_timeout: float = typer.Option(3.0, "--watchdog-timeout", metavar="SECONDS", help="Stall timeout used by the demo."),
    deadline: float = typer.Option(90.0, "--deadline", metavar="SECONDS", help="Give up if no incident is captured by then."),
    as_json: bool = typer.Option(False, "--json", help="Print the incident summary as JSON on stdout."),
    data_dir: Path | None = DataDirOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Run a real small inference server, hang one scheduler on purpose, and capture the incident."""
    _logging(verbose)
    from agent.demo import TORCH_MISSING_MESSAGE, torch_available

    if not torch_available():
        fail(TORCH_MISSING_MESSAGE, ExitCode.FAILURE)
    settings = _settings({"data_dir": data_dir}, None)
    _data_dir_ready(settings)
    from agent.demo.run import run_demo

    def captured(record: Any) -> None:  # the incident as soon as it is in, verdict first; where it went last
        _print_record(record, as_json=as_json)
        sys.stdout.flush()

    try:
        run_demo(settings, tp=tp, watchdog_timeout_s=watchdog_timeout, deadline_s=deadline, log=err,
                 on_captured=captured)
    except TimeoutError as exc:
        fail(str(exc), ExitCode.FAILURE)


# --- launch / cuda-env ----------------------------------------------------------------------


@app.command("cuda-env")
def cuda_env(
    folder: Path | None = typer.Option(None, "--folder", metavar="DIR", help="Crash-dump folder (core files go to DIR/<host>/)."),
    config: Path | None = ConfigOpt,
) -> None:
    """Print `export` lines arming CUDA coredumps (SGLang's defaults; values already set are kept).

    Creates nothing: when the crash-dump folder is missing, the first line printed is the
    `mkdir -p` that creates it (run the output in the server's shell, e.g. with eval).
    """
    import shlex

    from agent.host.cudaenv import (
        check_dump_dir,
        cuda_coredump_env,
        export_lines,
        flight_recorder_env,
        format_exports,
    )

    settings = _settings({"coredump": {"folder": folder}}, config, writes=False)
    cfg = settings.coredump
    plan = cuda_coredump_env(cfg.folder, pipe_template=cfg.pipe_template, create=False)
    exists = plan.host_dir.is_dir()
    if exists:
        check = check_dump_dir(plan.host_dir, min_free_bytes=cfg.min_free_bytes)
    else:
        out.print(f"mkdir -p {shlex.quote(str(plan.host_dir))}", markup=False, highlight=False)
    out.print(format_exports(plan), markup=False, highlight=False, end="")
    n_set, n_kept = len(plan.set), len(plan.kept)
    if settings.flightrec.enabled:  # torch's collective Flight Recorder, for the cross-rank verdict
        fr_set, fr_kept = flight_recorder_env(os.environ, buffer_size=settings.flightrec.buffer_size)
        out.print(export_lines(fr_set, fr_kept), markup=False, highlight=False, end="")
        n_set, n_kept = n_set + len(fr_set), n_kept + len(fr_kept)
    err.print(
        f"servewatch: {n_set} variable(s) set, {n_kept} kept; core files go to '{plan.host_dir}/'"
        + (" (the folder does not exist yet: the printed mkdir creates it)" if not exists
           else "" if check.ok else f" (warning: {check.reason})"),
        markup=False,
    )


@app.command(context_settings={"allow_interspersed_args": False})
def launch(
    cmd: list[str] = typer.Argument(..., metavar="-- CMD [ARGS]...", help="The server command line."),
    crash_dump_folder: Path | None = typer.Option(None, "--crash-dump-folder", metavar="DIR", help="Arm CUDA coredumps into DIR/<host>/ (default: coredump.folder)."),
    mlx: bool = typer.Option(False, "--mlx", help="MLX target: also set MTL_CAPTURE_ENABLED=1 (Metal capture)."),
    health_url: list[str] | None = HealthUrlOpt,
    metrics_url: list[str] | None = MetricsUrlOpt,
    metrics_preset: str | None = MetricsPresetOpt,
    match: list[str] | None = MatchOpt,
    uid: list[int] | None = UidOpt,
    any_uid: bool = AnyUidOpt,
    watchdog_timeout: float | None = WatchdogTimeoutOpt,
    hard: bool | None = HardOpt,
    hard_targets: str | None = HardTargetsOpt,
    cooldown: float | None = CooldownOpt,
    profile_steps: int | None = ProfileOnIncidentOpt,
    api_listen: str | None = ApiListenOpt,
    api_token_file: Path | None = ApiTokenFileOpt,
    job: str | None = JobOpt,
    peer: list[str] | None = PeerOpt,
    peers_dns: str | None = PeersDnsOpt,
    allow_insecure_peers: bool | None = InsecurePeersOpt,
    pyspy: bool | None = PySpyOpt,
    coredump_delay: float | None = CoredumpDelayOpt,
    otlp_endpoint: str | None = OtlpEndpointOpt,
    otlp_protocol: str | None = OtlpProtocolOpt,
    data_dir: Path | None = DataDirOpt,
    config: Path | None = ConfigOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Start a server armed for diagnostics (CUDA coredumps, Metal capture) and watch it; returns its exit code.

    Takes `run`'s flags except --pid, --root-pid (the launched server's tree is watched) and
    --duration (it runs as long as the server).
    """
    _logging(verbose)
    from agent.cli.launch import check_command, describe_env, launch_env, run_launched
    from agent.watchers.process import launched_target

    settings = _settings(
        {
            "data_dir": data_dir,
            "target": {"match": match or None, "uids": uid or None, "any_uid": any_uid or None},
            # the server starts with us: "connection refused" is start-up until it listens
            "health": {"url": health_url or None, "refused_grace_s": LAUNCH_REFUSED_GRACE_S},
            "metrics": {"url": metrics_url or None, "metrics_preset": metrics_preset, "refused_grace_s": LAUNCH_REFUSED_GRACE_S},
            "watchdog": {"timeout_s": watchdog_timeout, "hard": hard, "hard_targets": hard_targets},
            "incident": {"cooldown_s": cooldown},
            "profiler": {"on_incident_steps": profile_steps},
            "export": {"endpoint": otlp_endpoint, "protocol": otlp_protocol},
            "api": _api_cli(api_listen, api_token_file),
            "fleet": {"job": job, "peers": peer or None, "peers_dns": peers_dns, "allow_insecure_peers": allow_insecure_peers},
            "coredump": {"folder": crash_dump_folder, "delay_s": coredump_delay},
            "pyspy": {"enabled": pyspy},
        },
        config,
    )
    if settings.api.enabled:
        _check_bindable(settings.api.host, settings.api.port)
    check_command(cmd[0], os.environ)  # LaunchError (127/126) before any folder exists or anything is armed
    _data_dir_ready(settings)
    if settings.coredump.enabled:
        # the server's driver writes cores there: the data dir's checks (0700 when created, ours or
        # root's all the way up, nobody else may write), for the folder and its per-host folder
        import socket

        from agent.runtime.settings import ConfigError, check_data_dir

        folder = Path(settings.coredump.folder).expanduser().absolute()
        try:
            check_data_dir(folder, setting="coredump.folder")
            check_data_dir(folder / socket.gethostname(), setting="coredump.folder")  # the driver's %h
        except ConfigError as exc:
            _invalid(exc)
    try:
        planned = launch_env(
            crash_dump_folder=settings.coredump.folder if settings.coredump.enabled else None,
            mlx=mlx,
            pipe_template=settings.coredump.pipe_template,
            flight_recorder=settings.flightrec.buffer_size if settings.flightrec.enabled else None,
        )
    except OSError as exc:
        fail(f"cannot create crash-dump folder {str(settings.coredump.folder)!r}: {exc.strerror or exc}")
    import anyio

    from agent.incidents.lifecycle import LEFT_ALIVE_SETTLE_S
    from agent.model.lazy import mark_absent
    from agent.runtime.agent import Agent

    child_status: dict[str, int] = {}
    agents: list[Any] = []
    printer = _IncidentPrinter()

    def on_signal_forwarded(signum: int) -> None:
        if signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            child_status["stopped"] = signum  # the operator's stop: an expected exit
            for agent, pid in agents:
                agent.incidents.expect_exit(pid, tree=True)  # the server and all its ranks

    records: list[Path] = []

    async def agent_main(child_pid: int) -> None:
        err.print(f"servewatch: {describe_env(planned)}", markup=False)  # the child started: it is armed
        records.extend(_record_launch(settings.layout.launches, child_pid, planned.env))
        target = settings.target.model_copy(update={"root_pid": child_pid})
        agent = Agent.build(settings.model_copy(update={"target": target}), on_incident=printer.finished,
                            on_summary=printer.summary, on_status=_print_status)
        mark_absent()  # a watching agent: no sys.path search per HTTP request for a module not installed
        # watched from its first moment, with the exit status we reap (not rediscovered later)
        # its title: the one it set, else the command launched (an exit at start still names it)
        agent.process_watcher.watch(launched_target(child_pid, cmd), returncode=lambda: child_status.get("rc"))
        agents.append((agent, child_pid))

        async def stop_when_done() -> None:
            # the server is gone: stop once its exit incident (if any) is written
            while "rc" not in child_status:
                await anyio.sleep(0.1)
            # until its exit is handled: an incident written, or none needed (exit 0, the
            # operator's stop, hard mode's own signal); bounded by the incident's phase limits
            inc = settings.incident
            with anyio.move_on_after(inc.phase_timeout_s * 4 + inc.interrupt_grace_s + 30):
                while child_pid not in agent.incidents.exits_handled or agent.incidents.current is not None:
                    await anyio.sleep(0.1)
            await agent.lifecycle.wait_idle(LEFT_ALIVE_SETTLE_S + 5.0)  # what it left running, named
            agent.stop()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stop_when_done)
                await agent.run()
                tg.cancel_scope.cancel()
        finally:
            _print_seen(agent, printer, settings)

    try:
        rc = anyio.run(
            lambda: run_launched(
                cmd, env=planned.env, agent_main=agent_main,
                on_child_exit=lambda code: child_status.__setitem__("rc", code),
                on_signal_forwarded=on_signal_forwarded,
                subreaper=True,  # ranks the server orphans become ours: their exit status is read
            )
        )  # LaunchError: one line, exit 126/127 (main)
    finally:
        for record in records:  # the server is gone: its record must not arm a reused pid
            record.unlink(missing_ok=True)
    raise typer.Exit(rc)


def _record_launch(record_dir: Path, pid: int, env: Any) -> list[Path]:
    """Record the coredump arming launch gave ``pid`` in ``record_dir`` (``DataDir.launches``:
    setproctitle will empty its environ)."""
    import psutil

    from agent.actors.coredump_target import record_launch

    try:
        return [record_launch(record_dir, pid, psutil.Process(pid).create_time(), env)]
    except (OSError, psutil.Error) as exc:
        logging.getLogger("servewatch.launch").warning("cannot record the launch environment of pid %d: %s", pid, exc)
        return []


# --- export / timeline / report --------------------------------------------------------------


@app.command()
def export(
    to: str | None = typer.Option(None, "--to", metavar="ENDPOINT", help="Collector endpoint with scheme, e.g. http://127.0.0.1:4317 (gRPC) or :4318 (HTTP); https:// for TLS (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)."),
    paths: list[Path] | None = typer.Argument(None, metavar="PATH", help="Span files or folders (default: the data dir)."),
    protocol: str | None = typer.Option(None, "--protocol", metavar="PROTOCOL", help="grpc or http/protobuf (default: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else grpc)."),
    timeout: float = typer.Option(10.0, "--timeout", min=0.001, metavar="SECONDS", help="Bound on each request, retries included."),
    remove_sent: bool = typer.Option(False, "--remove-sent", help="Delete each file once all its spans were delivered (spool batches always are)."),
    resend: bool = typer.Option(False, "--resend", help="Send again what this endpoint already acknowledged (ignore the export ledger)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be sent, connecting to nothing: no span sent, no ledger written, no file removed."),
    data_dir: Path | None = DataDirOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """Replay spool or embedded-default span files to a collector (spans keep their ids and times).

    What the collector acknowledged is recorded in export-ledger.json of the data dir the files
    are in (whatever the current folder): a re-run to the same endpoint never sends a span twice.
    TLS, headers and compression come from the standard OTEL_EXPORTER_OTLP_* variables.
    """
    run_export(to=to, paths=paths, protocol=protocol, timeout=timeout, remove_sent=remove_sent, resend=resend,
               dry_run=dry_run, data_dir=data_dir, config=config)


@app.command()
def timeline(
    incident: str | None = typer.Argument(None, metavar="INCIDENT", help="Incident id (or unique prefix), 'latest', or a bundle folder (default: latest)."),
    as_json: bool = typer.Option(False, "--json", help="Print the timeline as JSON on stdout."),
    data_dir: Path | None = DataDirOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """Show an incident as a timeline: trigger, actions, hung frames, coredumps, profile (offline)."""
    from agent.views.bundle import load_incident_arg, timeline_to_dict

    settings = _read_only_settings(data_dir, config)
    tl = load_incident_arg(incident, data_dir=settings.data_dir)  # BundleError: one line, exit 1 (main)
    _say_newer_dumps(incident, settings.data_dir, tl)
    if as_json:
        _print_json(timeline_to_dict(tl))
        return
    from agent.views.timeline import render_timeline  # rich: only a drawn timeline needs it
    # a terminal: its width; a file or pipe: $COLUMNS, else 120 (rich's 80 would wrap what has room)
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
    render_timeline(tl, _safe_console(soft_wrap=True, width=width, emoji=False))


def _say_newer_dumps(incident: str | None, data_dir: Path, tl: Any) -> None:
    """``latest`` is the incident that paged (manual dumps after it do not hide it): one stderr
    line names the manual dumps taken since, and how to read the newest."""
    if incident not in (None, "latest"):
        return
    from agent.views.bundle import newer_manual_dumps

    newer = newer_manual_dumps(data_dir)
    if newer:
        err.print(f"servewatch: latest is {tl.incident_id} ({tl.trigger}), the incident that paged; manual dump(s)"
                  f" since: {', '.join(newer)} (servewatch timeline {newer[-1]} --data-dir {data_dir})",
                  markup=False, highlight=False, soft_wrap=True)


@app.command()
def report(
    incident: str | None = typer.Argument(None, metavar="INCIDENT", help="Incident id (or unique prefix), 'latest', or a bundle folder (default: latest)."),
    output: Path = typer.Option(Path("report.html"), "-o", "--output", metavar="FILE", help="HTML file to write ('-': stdout); its folder must exist."),
    data_dir: Path | None = DataDirOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """Write one self-contained HTML page (no network) with the incident timeline, stacks and artifacts."""
    from agent.views.bundle import load_incident_arg
    from agent.views.report import render_report_html, report_summary, write_report

    settings = _read_only_settings(data_dir, config)
    tl = load_incident_arg(incident, data_dir=settings.data_dir)  # BundleError: one line, exit 1 (main)
    _say_newer_dumps(incident, settings.data_dir, tl)
    if str(output) == "-":
        sys.stdout.write(render_report_html(tl))  # no control character in it: a terminal may show it
        sys.stdout.flush()
        return
    try:
        path = write_report(tl, output)
    except OSError as exc:
        fail(f"cannot write {str(output)!r}: {exc.strerror or exc}")
    err.print(report_summary(tl, path), markup=False)


# --- profile -------------------------------------------------------------------------------


@app.command()
def profile(
    steps: int | None = typer.Option(None, "--steps", min=1, metavar="N", help="Profile exactly this many forward steps (default: profiler.num_steps, 5)."),
    start_step: int | None = typer.Option(None, "--start-step", min=0, metavar="STEP", help="Start once forward_ct reaches this step."),
    activities: str | None = typer.Option(None, "--activities", metavar="LIST", help="Comma-separated: CPU, GPU, MEM, CUDA_PROFILER (sglang only) (default CPU,GPU)."),
    out_dir: Path | None = typer.Option(None, "--out", metavar="DIR", help="Where trace files go (default ./profiles)."),
    pid: int | None = typer.Option(None, "--pid", metavar="PID", help="Target serving the SDK control socket (backend sdk; default: the only one there is)."),
    url: str | None = typer.Option(None, "--url", metavar="URL", help="Server base URL (backends sglang / vllm), e.g. http://127.0.0.1:30000."),
    backend: str | None = typer.Option(None, "--backend", metavar="sdk|sglang|vllm", help="sdk (default), sglang or vllm (default with --url: asked from the server)."),
    timeout: float | None = typer.Option(None, "--timeout", min=0.001, metavar="SECONDS", help="Wall-clock bound of the session (default 60)."),
    as_json: bool = typer.Option(False, "--json", help="Print the session result as JSON on stdout."),
    otlp_endpoint: str | None = OtlpEndpointOpt,
    otlp_protocol: str | None = OtlpProtocolOpt,
    data_dir: Path | None = DataDirOpt,
    config: Path | None = ConfigOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Profile the next N forward steps of a running server (torch.profiler / Metal) and list the traces."""
    _logging(verbose)
    if url is not None:
        _check_profile_url(url)
    settings = _settings(
        {
            "data_dir": data_dir,
            # --out is also where a vLLM server writes, when its launch arguments are not readable
            "profiler": {"backend": backend, "base_url": url, "num_steps": steps, "output_dir": out_dir},
            "export": {"endpoint": otlp_endpoint, "protocol": otlp_protocol},
        },
        config,
    )
    acts = [a.strip().upper() for a in activities.split(",") if a.strip()] if activities is not None else None
    # unknown names before looking for the target, then what the target's backend takes
    _check_activities(acts, activities, "sglang")
    settings, pid = _profile_target(settings, pid=pid, url=url, backend=backend)
    _check_activities(acts, activities, settings.profiler.backend)
    out_path = _profile_out_path(settings, out_dir)
    from agent.runtime.agent import Agent

    agent = Agent.build(settings)
    result, trace_id = _profile_session(agent, settings, pid=pid, start_step=start_step, acts=acts, out_path=out_path,
                                        timeout=timeout)
    telemetry = agent.telemetry
    delivered = True
    if trace_id is not None:
        assert telemetry is not None  # the otlp exporter built it for the trace
        delivered = _say_spooled(telemetry, agent.export_statistics)
    if as_json:
        _print_json({**result.to_manifest(), "trace_id": trace_id})
    # vLLM writes into its own launch-time folder: those files are listed, not taken
    server_files = result.attributes.get("servewatch.profile.server_files") or ()
    paths = [*result.artifact_paths, *(str(f) for f in server_files)] if isinstance(server_files, tuple) else list(result.artifact_paths)
    for path in paths:
        if not as_json:
            out.print(path, markup=False, highlight=False)
    err.print(_profile_line(result, paths, trace_id, telemetry), markup=False)
    if result.outcome.value not in ("ok",) or not delivered:
        raise typer.Exit(int(ExitCode.FAILURE))


def _check_profile_url(url: str) -> None:
    from agent.watchers.health import check_http_url

    try:
        check_http_url(url)
    except ValueError as exc:
        fail(f"invalid value for --url: {exc}; see 'servewatch profile --help'", ExitCode.USAGE)


def _check_activities(acts: list[str] | None, activities: str | None, backend: str) -> None:
    """``--activities`` that ``backend`` does not take: :func:`fail` (usage)."""
    from agent.actors.profiler import activities_problem

    if acts is not None and (problem := activities_problem(acts, backend)):
        fail(f"invalid --activities {activities!r}: {problem}", ExitCode.USAGE)


def _profile_out_path(settings: Settings, out_dir: Path | None) -> Path:
    """Where ``profile``'s trace files go; an unsafe folder there: :func:`fail` (usage)."""
    # lexical, never resolved: a symlink another user planted on the way is refused, not followed
    out_path = Path(os.path.abspath(out_dir or settings.profiler.output_dir or "profiles"))
    if settings.profiler.backend != "vllm":  # vLLM writes to its own folder: nothing is created
        from agent.host.fsutil import unsafe_folder_reason

        if (why := unsafe_folder_reason(out_path)) is not None:
            key = "--out" if out_dir is not None else "profiler.output_dir" if settings.profiler.output_dir else "the default ./profiles"
            fail(f"{key} {str(out_path)!r} refused: {why}; pass --out a folder that, with every folder above it,"
                 f" belongs to root or uid {os.geteuid()}", ExitCode.USAGE)
    return out_path


def _profile_session(agent: Any, settings: Settings, *, pid: int | None, start_step: int | None, acts: list[str] | None,
                     out_path: Path, timeout: float | None) -> tuple[Any, str | None]:
    """Run ``profile``'s session: its result and trace id; SIGINT: said, exit 130."""
    import anyio

    progress = _ProgressLine(sys.stderr)

    interrupted: list[str] = []

    async def session() -> tuple[Any, str | None] | None:
        done: tuple[Any, str | None] | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(progress.tick)
            tg.start_soon(_cancel_on_sigint, tg.cancel_scope, interrupted)
            try:
                done = await agent.profile(
                    pid=pid, steps=settings.profiler.num_steps, start_step=start_step, activities=acts,
                    out_dir=out_path, timeout_s=timeout,
                    before_export=lambda: _data_dir_ready(settings),  # only a session with trace files writes
                    progress=progress,
                )
            finally:
                tg.cancel_scope.cancel()
                progress.done()
        return done

    try:
        done = anyio.run(session)
        if interrupted or done is None:
            raise KeyboardInterrupt
        return done
    except KeyboardInterrupt:  # the session was stopped on the way out (the actor's cancel path)
        where = f"the profiling session of pid {pid}" if pid is not None else f"profiling at {settings.profiler.base_url}"
        err.print(f"servewatch: interrupted (SIGINT): {where} was stopped; a trace written before the stop is"
                  f" under {out_path}"
                  + (" or the server's own profiler folder" if pid is None else ""), markup=False, highlight=False)
        raise SystemExit(130) from None


def _profile_line(result: Any, paths: list[str], trace_id: str | None, telemetry: Any) -> str:
    """``profile``'s summary line on stderr."""
    captured = result.attributes.get("servewatch.profile.steps_captured")
    return (
        f"Profile {result.outcome.value}: {len(paths)} trace file(s)"
        + (f", {captured} step(s) captured" if captured is not None else "")
        + _profile_detail(result.detail, len(paths))
        + (f"; spans in trace {trace_id} ({telemetry.destination.describe()})" if trace_id and telemetry else "")
        + _how_to_open(paths)
    )


class _ProgressLine:
    """What a long wait waits for, on stderr: on a terminal one line rewritten in place with
    the seconds waited so far (``servewatch: waiting for ... (12 s)``), erased when the wait
    ends; in a file or pipe each new line once, no rewriting."""

    def __init__(self, stream: Any) -> None:
        import time

        self._stream = stream
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._line = ""
        self._since = time.monotonic()
        self._shown = False

    def __call__(self, line: str) -> None:
        import time

        if line == self._line:
            return
        self._line, self._since = line, time.monotonic()
        if self._tty:
            self._draw()
        else:
            self._stream.write(f"servewatch: {line}\n")
            self._stream.flush()

    def _draw(self) -> None:
        import shutil
        import time

        from agent.host.security import strip_control

        waited = time.monotonic() - self._since
        line = strip_control(f"servewatch: {self._line}")
        suffix = f" ({waited:.0f} s)" if waited >= 1 else ""
        room = shutil.get_terminal_size((80, 24)).columns - 1 - len(suffix)
        if len(line) > room:  # one screen line, so \r can rewrite it; the seconds always show
            line = line[: max(0, room - 1)] + "…"
        text = line + suffix
        self._stream.write("\r" + text + "\x1b[K")
        self._stream.flush()
        self._shown = True

    async def tick(self) -> None:
        """Redraw every second on a terminal (the seconds move); nothing to do elsewhere."""
        import anyio

        while self._tty:
            await anyio.sleep(1.0)
            if self._line:
                self._draw()

    def done(self) -> None:
        """Erase the line (terminal) before the result is printed."""
        if self._tty and self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()


def _profile_detail(detail: str, n_files: int) -> str:
    """`` (why)`` after the file count, or the detail's own ``in DIR ...`` when it repeats the count."""
    rest = detail.removeprefix(f"{n_files} trace file(s) ")
    if rest != detail:
        return f" {rest}"
    return f" ({detail})" if detail else ""


def _how_to_open(paths: Sequence[str]) -> str:
    """``. Open PATH in https://ui.perfetto.dev (or chrome://tracing)``; Xcode for Metal captures."""
    traces = [p for p in paths if ".json" in Path(p).name]
    if traces:
        return f". Open {traces[0]} in https://ui.perfetto.dev (Open trace file) or chrome://tracing"
    metal = [p for p in paths if p.endswith(".gputrace")]
    if metal:
        return f". Open {metal[0]} in Xcode (a Metal GPU capture)"
    return ""


def _profile_target(settings: Settings, *, pid: int | None, url: str | None, backend: str | None) -> tuple[Settings, int | None]:
    """Settle what ``profile`` profiles, or exit with one line.

    ``--url`` without ``--backend`` asks the server which one it is; no ``--pid``/``--url`` with
    the ``sdk`` backend takes the only process serving a control socket, else it is a usage
    error listing the candidates; a ``--pid`` that serves no control socket (a server's frontend,
    an SGLang process) says what to pass instead.

    Returns:
        The settings (the backend inferred) and the target pid (``sdk``; else None).
    """
    import psutil

    from agent.host.profiletargets import pid_problem

    cfg = settings.profiler
    if pid is not None and url is not None:
        fail("give --pid PID (a process serving the SDK control socket) or --url URL (SGLang, vLLM), not both", ExitCode.USAGE)
    if pid is not None and cfg.backend != "sdk":
        fail(f"--pid is for the sdk backend; {cfg.backend} is profiled through --url", ExitCode.USAGE)
    if url is not None and backend is None and cfg.backend == "sdk":
        return _with_inferred_backend(settings, url), None
    if cfg.backend != "sdk":
        return settings, None
    if pid is None:
        return settings, _only_sdk_pid(cfg.socket_dir)
    problem = pid_problem(pid, cfg.socket_dir)
    if problem is not None:  # a refused socket is no usage error: run as its user
        usage = psutil.pid_exists(pid) and not problem.startswith("cannot reach")
        fail(problem, ExitCode.USAGE if usage else ExitCode.FAILURE)
    return settings, pid


def _with_inferred_backend(settings: Settings, url: str) -> Settings:
    """``settings`` with the backend the server at ``url`` answers as (said on stderr); unknown: :func:`fail`."""
    from agent.host.profiletargets import BackendUnknownError, infer_backend

    cfg = settings.profiler
    try:
        inferred = infer_backend(url, timeout_s=min(5.0, cfg.request_timeout_s))
    except BackendUnknownError as exc:
        fail(str(exc), ExitCode.USAGE if exc.reachable else ExitCode.FAILURE)
    err.print(f"servewatch: {url} answers as {'SGLang' if inferred == 'sglang' else 'vLLM'}", markup=False, highlight=False)
    return settings.model_copy(update={"profiler": cfg.model_copy(update={"backend": inferred})})


def _only_sdk_pid(socket_dir: Any) -> int:
    """The only process serving an SDK control socket; none or several: :func:`fail` listing the candidates."""
    from agent.host.profiletargets import candidates, describe_candidates, hidden_sdk_folders
    from agent.host.sdkclient import control_socket_pids

    pids = control_socket_pids(socket_dir)
    if len(pids) == 1:
        return pids[0]
    found = candidates(socket_dir)
    hidden = hidden_sdk_folders(socket_dir)  # the engineer who forgot sudo: whose folder may hide them
    fail("profile needs a target: --pid PID (SDK) or --url URL (SGLang, vLLM); " + describe_candidates(found, hidden),
         ExitCode.FAILURE if hidden and not found else ExitCode.USAGE)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("servewatch")
        except PackageNotFoundError:  # run from a source tree that was never installed
            v = "unknown (not installed)"
        out.print(f"servewatch {v}", markup=False, highlight=False)
        raise typer.Exit(int(ExitCode.OK))


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_version, help="Print the version and exit."),
) -> None:
    pass


#: Value names shown in ``--help`` for options declared without a ``metavar`` (typer's own are
#: ``<int>``, ``<list[str]>``...), by the option's element type.
_METAVARS: dict[type, str] = {int: "N", float: "NUMBER", str: "TEXT", Path: "PATH"}


def _plain_help(command: Any) -> None:
    """Help without typer's ``<type>`` labels: an option with no declared ``metavar`` gets one by
    its type (``N``, ``NUMBER``, ``TEXT``, ``PATH``); an argument shows only its metavar."""
    import typing

    for sub in getattr(command, "commands", {}).values():
        _plain_help(sub)
    for param in command.params:
        desc = getattr(param, "type_descriptor", None)
        if desc is None or getattr(param, "is_flag", False):
            continue
        if param.param_type_name == "argument":
            param.display_type_rich = lambda ctx: None  # the metavar names it already
        elif param.metavar is None:
            annotation = desc.annotation
            if typing.get_origin(annotation) is list:
                (annotation,) = typing.get_args(annotation)
            param.metavar = _METAVARS.get(annotation, "VALUE")


def _given_value(argv: list[str], param: Any) -> str | None:
    """The value ``argv`` gave ``param`` (an option's first), for an error message."""
    for i, arg in enumerate(argv):
        for opt in getattr(param, "opts", ()):
            if arg == opt and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(opt + "="):
                return arg[len(opt) + 1 :]
    return None


def _click_errors() -> Any:
    """The module of the click exceptions typer raises (``click.exceptions``, or the copy of click
    that typer >= 0.24 vendors)."""
    import importlib

    return importlib.import_module(typer.BadParameter.__module__)


def _usage_line(exc: Any, argv: list[str], command: Any) -> str:
    """One line for a click usage error: ``servewatch: <what>; see 'servewatch CMD --help'``."""
    errors = _click_errors()
    message = _usage_message(exc, errors)
    if isinstance(exc, errors.BadParameter) and exc.param is not None:
        given = _given_value(argv, exc.param)
        if given is not None and repr(given) not in message:
            message += f" (got {given!r})"
    where = exc.ctx.command_path if exc.ctx is not None else "servewatch"
    if where == "servewatch":  # an error while parsing a command's options carries no context
        where = next((f"servewatch {a}" for a in argv if a in getattr(command, "commands", {})), where)
    return f"servewatch: {message}; see '{where} --help'"


def _usage_message(exc: Any, errors: Any) -> str:
    """What a click usage error says, in one lower-case phrase."""
    param = getattr(exc, "param", None)
    if isinstance(exc, errors.MissingParameter) and param is not None:  # typer names the variable
        if param.param_type_name == "argument":
            return f"missing argument {param.metavar or param.name.upper()}"
        return f"missing option {' / '.join(param.opts)}"
    if isinstance(exc, errors.NoSuchOption):  # click suggests loosely (--bogus: --verbose): only a close one
        import difflib

        close = difflib.get_close_matches(exc.option_name, exc.possibilities or [], n=1, cutoff=0.8)
        return f"no such option: {exc.option_name}" + (f" (did you mean {close[0]}?)" if close else "")
    message = " ".join(exc.format_message().split()).rstrip(".")
    return message[:1].lower() + message[1:]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point.

    Every usage error, click's own included (unknown option, missing or bad value), is one
    stderr line and exit 2 (:class:`ExitCode`); ``servewatch`` alone prints the help on stdout
    and exits 0, as ``servewatch --help`` does.

    Raises:
        SystemExit: with the exit code, always, when ``argv`` is given (in-process callers). As
            the console script (``argv`` None) a one-shot command (:data:`agent.early.ONE_SHOT_COMMANDS`)
            ends the process with :func:`os._exit` instead, after flushing.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if argv is not None or not _one_shot(args):
        _main(args)
    gc.disable()  # see agent.early.ONE_SHOT_COMMANDS (its console entry did so before the imports)
    try:
        _main(args)
    except SystemExit as exc:
        _exit_now(exc.code)


def _app_for(args: list[str]) -> typer.Typer:
    """The app to build for ``args``: when they name a command, a copy of :data:`app` holding
    that command only (typer builds every registered command's click parameters, ~5 ms of
    each start); otherwise (no command, an unknown one, a bare ``--help``) :data:`app` itself."""
    name = next((a for a in args if not a.startswith("-")), None)
    if name is None:
        return app
    chosen = [
        info for info in app.registered_commands
        if (info.name or typer.main.get_command_name(info.callback.__name__ if info.callback else "")) == name
    ]  # fmt: skip
    if not chosen:
        return app
    one = copy.copy(app)
    one.registered_commands = chosen
    return one


def _main(args: list[str]) -> NoReturn:
    """Parse ``args``, run the command, and raise ``SystemExit`` with its exit code.

    A :class:`~agent.errors.ServewatchError` that ends a command is one ``servewatch: ...``
    stderr line and its :attr:`~agent.errors.ServewatchError.exit_code` (2 for a usage error).
    """
    from agent.errors import ServewatchError, one_line

    errors = _click_errors()
    command = typer.main.get_command(_app_for(args))
    _plain_help(command)
    try:
        rc = command.main(args=args, prog_name="servewatch", standalone_mode=False)
    except errors.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError" and exc.ctx is not None:  # click >= 8.2
            out.print(exc.ctx.get_help(), markup=False, highlight=False)  # as --help does
            raise SystemExit(int(ExitCode.OK)) from None
        else:
            err.print(_usage_line(exc, args, command), markup=False, highlight=False)
        raise SystemExit(int(ExitCode.USAGE)) from None
    except errors.ClickException as exc:
        err.print(f"servewatch: {' '.join(exc.format_message().split())}", markup=False, highlight=False)
        raise SystemExit(exc.exit_code) from None
    except ServewatchError as exc:  # any error of agent.errors' tree a command lets through
        err.print(f"servewatch: {one_line(exc)}", markup=False, highlight=False)
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        raise SystemExit(130) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    raise SystemExit(rc if isinstance(rc, int) else int(ExitCode.OK))


if __name__ == "__main__":  # pragma: no cover
    main()
