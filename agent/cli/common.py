"""What the commands share, and ``servewatch dump`` itself, without the CLI framework.

Owns :class:`ExitCode`, the ``out`` / ``err`` consoles (rich only when a line needs it), the
log handler, settings loading for a command (:func:`_settings`: one ``servewatch: ...`` line and
exit 2 on an invalid setting), :func:`fail`, the one-shot exit (:func:`_exit_now`) and the body
of ``dump`` (:func:`run_dump`, with its progress line). :mod:`agent.cli.app` (typer) parses the
command line and calls these; the console entry (:mod:`agent.cli.entry`) runs the plain form
``servewatch dump --pid N ...`` (:func:`plain_dump_args`) through :func:`run_plain_dump` without
importing typer at all: the CLI framework is not needed to dump stacks (issue 38).

A command run through typer exits with ``typer.Exit``; the plain dump, where typer is not loaded,
with ``SystemExit`` of the same code (:func:`_command_exit`). An invalid setting in the plain
dump runs the whole command again through typer (:class:`_NeedsFullCli`), so its message names
the flag exactly as typer's context says. Imports the standard library and :mod:`agent.early`
at load; the rest when a command needs it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from rich.console import Console

    from agent.runtime.settings import Settings

__all__ = ["ExitCode", "err", "fail", "out", "plain_dump_args", "plain_export_args", "run_dump", "run_export",
           "run_plain_dump", "run_plain_export"]


class _NeedsFullCli(Exception):
    """The plain dump met an invalid setting: the command is run again through typer, whose
    message names the flag that gave it (:func:`run_plain_dump`)."""


#: ``servewatch dump`` (``servewatch export``) while the plain form runs it without typer
#: (:func:`run_plain_dump`, :func:`run_plain_export`): the command named in an invalid setting's
#: "see '... --help'"; ``None`` otherwise.
_plain_command: str | None = None
#: The unknown ``SERVEWATCH_*`` variables were said (by the plain dump, before it handed over to typer).
_env_warned = False


class ExitCode(enum.IntEnum):
    """Process exit codes of every ``servewatch`` command."""

    OK = 0
    FAILURE = 1
    USAGE = 2


def _safe_console(**kwargs: Any) -> Any:
    """A rich Console (rich is imported here: only commands that print results pay for it)."""
    from rich.console import Console

    class _SafeConsole(Console):
        """A rich Console that strips control characters from every string it is given.

        Titles, thread, function and file names and request ids are chosen by the target (another
        user, possibly): an ``ESC]0;...`` or ``ESC[41m`` in them must never reach the operator's
        terminal. Rich's own styling is added after this, so colours still work.
        """

        def print(self, *objects: Any, **kwargs: Any) -> None:
            from agent.host.security import strip_control

            super().print(*(strip_control(o, keep_newlines=True) if isinstance(o, str) else o for o in objects), **kwargs)

    return _SafeConsole(**kwargs)


#: Continuation rows of a line wrapped for a terminal are indented this many columns more than
#: the line itself (a hanging indent: where a line starts stays plain to see).
HANG_INDENT = 4


def _terminal_columns(stream: Any) -> int | None:
    """Columns of the terminal ``stream`` writes to, or ``None`` when it is none (a file or a
    pipe: lines stay whole there, for machines to read)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else None
    except (AttributeError, OSError, ValueError):
        return None


def _wrap_for_terminal(text: str, columns: int | None) -> str:
    """``text`` with each line longer than ``columns`` broken at spaces, never inside a word (a
    path, an id), its continuation rows indented :data:`HANG_INDENT` more than the line; as it
    is when ``columns`` is ``None`` (no terminal). A word wider than a row stays whole."""
    if columns is None or columns < 2 * HANG_INDENT + 16:
        return text
    import textwrap

    rows: list[str] = []
    for line in text.split("\n"):
        body = line.lstrip(" ")
        lead = line[: len(line) - len(body)]
        if len(line) <= columns or not body:
            rows.append(line)
            continue
        rows += textwrap.wrap(body, width=columns, initial_indent=lead, subsequent_indent=lead + " " * HANG_INDENT,
                              break_long_words=False, break_on_hyphens=False, expand_tabs=False,
                              replace_whitespace=False) or [line]
    return "\n".join(rows)


class _LazyConsole:
    """Stands for a :func:`_safe_console` made at its first use."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._console: Any = None

    def print(self, *objects: Any, sep: str = " ", end: str = "\n", markup: bool | None = None,
              highlight: bool | None = None, **kwargs: Any) -> None:
        """Plain text lines (``markup=False``) are written without importing rich, control
        characters stripped: on a terminal wrapped at words with a hanging indent
        (:func:`_wrap_for_terminal`), whole in a file or pipe; anything else goes to rich."""
        stream = sys.stderr if self._kwargs.get("stderr") else sys.stdout
        with _progress_aside():  # dump's progress line is erased first, drawn again after
            plain = {k: v for k, v in kwargs.items() if k != "soft_wrap"}  # rich's "never wrap": ours wraps at words
            if not plain and markup is False and all(isinstance(o, str) for o in objects):
                # plain lines: on a terminal wrapped at words with a hanging indent, whole elsewhere
                from agent.host.security import strip_control

                text = sep.join(strip_control(o, keep_newlines=True) for o in objects)
                stream.write(_wrap_for_terminal(text, _terminal_columns(stream)) + end)
                stream.flush()
                return
            self.__getattr__("print")(*objects, sep=sep, end=end, markup=markup, highlight=highlight, **kwargs)

    @property
    def console(self) -> Console:
        """The rich Console itself (made now if not yet), for code that takes a ``Console``."""
        if self._console is None:
            self._console = _safe_console(**self._kwargs)
        return self._console

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_kwargs", "_console"):
            raise AttributeError(name)
        if self._console is None:
            self._console = _safe_console(**self._kwargs)
        return getattr(self._console, name)


def _print_json(doc: Any) -> None:
    """A result as JSON on stdout: readable UTF-8, every control and bidi character a ``\\u``
    escape (:func:`agent.host.security.dumps_safe`), so a target's chosen text never acts on a terminal."""
    from agent.host.security import dumps_safe

    sys.stdout.write(dumps_safe(doc) + "\n")
    sys.stdout.flush()


class _SafeFormatter(logging.Formatter):
    """Log lines on stderr carry no control characters (they may quote a target's title)."""

    def format(self, record: logging.LogRecord) -> str:
        from agent.host.security import strip_control

        return strip_control(super().format(record), keep_newlines=True)


out = _LazyConsole(soft_wrap=True)  # results
err = _LazyConsole(stderr=True, soft_wrap=True)  # progress, chatter, errors


def _command_exit(code: int) -> BaseException:
    """What ends a command with exit code ``code``: ``typer.Exit`` when typer runs it (typer
    returns the code), ``SystemExit`` in the plain dump (typer is not loaded there)."""
    typer = sys.modules.get("typer")
    return SystemExit(code) if typer is None or _click_context() is None else typer.Exit(code)


def fail(message: str, code: int = ExitCode.FAILURE) -> NoReturn:
    """Print one ``servewatch: ...`` line on stderr and exit with ``code``."""
    err.print(f"servewatch: {message}", markup=False, highlight=False)
    raise _command_exit(int(code))


class _CliFormatter(_SafeFormatter):
    """Log lines shaped as the CLI's own: ``servewatch: warning: no target process found yet ...``."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return f"servewatch: {record.levelname.lower()}: {record.message}"

    def format(self, record: logging.LogRecord) -> str:
        """The line, wrapped at words with a hanging indent when stderr is a terminal."""
        return _wrap_for_terminal(super().format(record), _terminal_columns(sys.stderr))


class _CliHandler(logging.StreamHandler):
    """Log lines on stderr that never land on ``dump``'s progress line: it is erased before the
    line is written and drawn again after it (:func:`_progress_aside`)."""

    def emit(self, record: logging.LogRecord) -> None:
        with _progress_aside():
            super().emit(record)


def _logging(verbose: bool) -> None:
    """Log to stderr: warnings and errors as ``servewatch: warning: ...`` lines, like the CLI's
    own; with ``--verbose``, everything from INFO, with timestamps and logger names."""
    handler = _CliHandler(sys.stderr)
    handler.setFormatter(
        _SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s") if verbose else _CliFormatter()
    )
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        handlers=[handler],
    )
    from agent.views.console import quiet_sdk_logs

    quiet_sdk_logs(verbose=verbose)  # the OTel SDK's own log lines are counted, not printed


def _say_spooled(telemetry: Any, stats: Any) -> bool:
    """After a one-shot command: say how many spans wait in the spool and how to replay them,
    and how many were refused or lost. Returns whether every span was delivered or is safe in
    the spool (``False``: some were refused or lost; the command exits 1)."""
    from agent.views.console import spooled_summary, undelivered_summary

    if telemetry is None or stats is None:  # never built, or its shutdown ran out of time
        return True
    line = spooled_summary(telemetry, stats)
    if line:
        err.print(line, markup=False, highlight=False, soft_wrap=True)
    lost = undelivered_summary(telemetry, stats)
    if lost:
        err.print(f"servewatch: {lost}", markup=False, highlight=False, soft_wrap=True)
    return lost is None


def _settings(cli: dict[str, Any], config: Path | None, *, writes: bool = True, lean: bool = False) -> Settings:
    """Load settings and validate the telemetry destination, or exit 2 with one line.

    Creates nothing: a command that writes calls :func:`_data_dir_ready` once its own checks
    passed, so a failed command leaves no data dir behind.

    Args:
        writes: the command exports telemetry: check the destination (read-only commands never
            export).
        lean: no pydantic-settings when nothing but ``cli`` could matter (:func:`agent.runtime.settings.load_settings`).

    Raises:
        _NeedsFullCli: in the plain dump (:func:`run_plain_dump`), an invalid setting: its message
            is typer's to write (it names the flag that gave the value).
    """
    from agent.runtime.settings import ConfigError, load_settings, unknown_env_warnings
    from exporters.otlp.provider import ExportConfigError

    global _env_warned
    if not _env_warned:
        for line in unknown_env_warnings():  # a typo must not pass for a setting that took effect
            err.print(f"servewatch: warning: {line}", markup=False, highlight=False)
    _env_warned = _plain_command is not None  # the plain dump's run again through typer says them once
    try:
        settings = load_settings(cli, config_file=config, flag_for=_flag_for, lean=lean)
        if writes:
            _ = settings.export_destination  # resolved once, now: OTEL_* env problems surface now, not mid-run
    except (ConfigError, ExportConfigError) as exc:
        if _plain_command is not None and _click_context() is None:
            raise _NeedsFullCli(str(exc)) from None
        _invalid(exc)
    return settings


def _click_context() -> Any:
    """The running typer (click) command's context, ``None`` when none runs or typer is not
    loaded (the plain dump)."""
    typer = sys.modules.get("typer")
    if typer is None:
        return None
    import importlib

    base = typer.BadParameter.__module__.rpartition(".")[0]  # click, or typer's vendored copy
    return importlib.import_module(f"{base}.globals").get_current_context(silent=True)


def _flag_for(key: str, value: Any) -> str | None:
    """The flag of the running command that gave setting ``key`` (dotted) this ``value``
    (``("metrics.metrics_preset", "foo")`` -> ``"--metrics-preset"``), or None (no command is
    running, or no flag given on the command line matches)."""
    import difflib

    ctx = _click_context()
    if ctx is None:
        return None
    given = {}
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if param.param_type_name == "option" and source is not None and source.name == "COMMANDLINE":
            given[param.name] = param
    by_value = [name for name, _ in given.items() if ctx.params.get(name) == value]
    wanted = key.replace(".", "_")
    pick = by_value if len(by_value) == 1 else difflib.get_close_matches(wanted, by_value or list(given), n=1, cutoff=0.5)
    if not pick:
        return None
    opts = [o for o in given[pick[0]].opts if o.startswith("--")]
    return opts[0] if opts else given[pick[0]].opts[0]


def _invalid(exc: Exception) -> NoReturn:
    msg = str(exc)
    if not msg.startswith(("invalid setting", "invalid value for", "invalid config file")):
        msg = f"invalid setting {msg}"
    if not msg.endswith("--help'"):  # point at the command's help, as usage errors do
        ctx = _click_context()
        msg += f"; see '{ctx.command_path if ctx is not None else _plain_command or 'servewatch'} --help'"
    fail(msg, ExitCode.USAGE)


def _data_dir_ready(settings: Settings) -> None:
    """Create the data dir (0700) if needed and check it is safe and writable, or exit 2.

    Called by a command that writes bundles or spans, after its own checks passed.
    """
    from agent.runtime.settings import ConfigError, check_data_dir

    try:
        check_data_dir(settings.data_dir)
    except ConfigError as exc:
        _invalid(exc)
    if settings.profiler.output_dir is not None:  # said at start, not at the first incident's profile
        from agent.host.fsutil import unsafe_folder_reason

        if (why := unsafe_folder_reason(settings.profiler.output_dir)) is not None:
            fail(f"profiler.output_dir {str(settings.profiler.output_dir)!r} refused: {why}", ExitCode.USAGE)


def _target(
    pid: list[int] | None, root_pid: int | None, match: list[str] | None, uid: list[int] | None = None, any_uid: bool = False
) -> dict[str, Any]:
    return {"pids": pid or None, "root_pid": root_pid, "match": match or None, "uids": uid or None, "any_uid": any_uid or None}


def _pid_alive(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)


def _print_record(record: Any, *, as_json: bool) -> None:
    from agent.cli.summary import incident_summary, summary_lines

    if as_json:
        _print_json(incident_summary(record))
        return
    from agent.host.security import strip_control

    for line in summary_lines(record):
        out.print(strip_control(line), markup=False, highlight=False)


def _no_match_why(t: Any, refused: dict[int, str]) -> str:
    """Why ``dump`` found no process: the given pids that do not exist, those of another user it refused."""
    from agent.host.security import strip_control

    gone = [p for p in ([*t.pids, t.root_pid] if t.root_pid else t.pids) if not _pid_alive(p)]
    why = f" (no such process: {', '.join(map(str, gone))})" if gone else ""
    if refused:
        why += f"; refused {len(refused)} of another user: " + "; ".join(strip_control(r) for r in list(refused.values())[:5])
    return why


def _dump_with_progress(agent_class: Any, settings: Any, n_pids: int) -> tuple[Any, Any]:
    """One dump by an agent built from ``settings``, its phases on one progress line when stderr
    is a terminal: ``(record, agent)``."""
    import anyio

    progress = _DumpProgress(n_pids or None) if sys.stderr.isatty() else None  # a pipe gets nothing extra
    agent = agent_class.build(settings, on_phase=None if progress is None else progress.phase)
    if progress is not None:
        progress.phase("starting")
    try:
        return anyio.run(lambda: agent.dump(handle_signals=True)), agent
    finally:
        if progress is not None:
            progress.done()


def _phase_words() -> dict[str, str]:
    """What a phase of ``dump`` does, in words (an unknown phase: its name)."""
    from agent.model.events import Action

    return {"starting": "finding the processes, opening the incident", Action.PYSPY_DUMP: "dumping stacks (py-spy)",
            Action.FLIGHTREC_DUMP: "reading the Flight Recorder", Action.CUDA_COREDUMP: "GPU coredumps",
            "verdict": "judging the evidence", Action.PROFILE_SESSION: "profiling"}


class _DumpProgress:
    """``dump``'s one progress line on a terminal (stderr): what it does now, rewritten in place
    as each phase starts (``servewatch: dump of 2 process(es): dumping stacks (py-spy)…``), erased
    before the summary. Cut to the terminal's width (one row: ``\r`` rewrites only the last), and
    put aside while a log line or a print reaches the terminal (:func:`_progress_aside`)."""

    def __init__(self, n_pids: int | None) -> None:
        import threading

        self.of = f" of {n_pids} process(es)" if n_pids else ""
        self.line = ""  # what is on the terminal now ("" once erased)
        self.lock = threading.RLock()  # log lines come from worker threads too

    def phase(self, name: str) -> None:
        from agent.host.security import strip_control

        global _live_progress
        line = strip_control(f"servewatch: dump{self.of}: {_phase_words().get(name) or name}…")
        columns = _terminal_columns(sys.stderr)
        if columns and len(line) > columns - 1:
            line = line[: max(1, columns - 2)] + "…"
        with self.lock:
            self.line = line
            _live_progress = self
            self.draw()

    def draw(self) -> None:
        sys.stderr.write(f"\r\x1b[K{self.line}")
        sys.stderr.flush()

    def erase(self) -> None:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()

    def done(self) -> None:
        global _live_progress
        with self.lock:
            self.erase()
            self.line = ""
            if _live_progress is self:
                _live_progress = None


#: ``dump``'s progress line while it is on the terminal.
_live_progress: _DumpProgress | None = None


@contextlib.contextmanager
def _progress_aside() -> Iterator[None]:
    """Erase ``dump``'s progress line (when one is shown) for what is written in this block, and
    draw it again after: a log line or a print never lands on the same row as the progress."""
    progress = _live_progress
    if progress is None:
        yield
        return
    with progress.lock:
        shown = bool(progress.line)
        if shown:
            progress.erase()
        try:
            yield
        finally:
            if shown and progress.line and _live_progress is progress:
                progress.draw()


# --- demo ----------------------------------------------------------------------------------


def _exit_now(code: object) -> NoReturn:
    """End the process with ``code`` (a ``SystemExit`` code) once output and logs are flushed,
    without the interpreter's teardown. Nothing of a one-shot command needs it: its telemetry is
    shut down (bounded) and its files are closed before the command returns."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = int(ExitCode.FAILURE)
    from agent import early

    early.discard_all()  # early py-spy runs nobody claimed (e.g. the command failed first)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    os._exit(status)


def run_dump(
    *, pid: list[int] | None, root_pid: int | None, match: list[str] | None, uid: list[int] | None, any_uid: bool,
    as_json: bool, metrics_url: str | None, metrics_preset: str | None, otlp_endpoint: str | None,
    otlp_protocol: str | None, data_dir: Path | None, config: Path | None, verbose: bool,
) -> None:
    """The body of ``servewatch dump`` (its options, as :func:`agent.cli.app.dump` documents them)."""
    _logging(verbose)
    settings = _settings(
        {
            "data_dir": data_dir,
            "target": _target(pid, root_pid, match, uid, any_uid),
            "metrics": {"url": metrics_url, "metrics_preset": metrics_preset},
            "export": {"endpoint": otlp_endpoint, "protocol": otlp_protocol},
        },
        config,
        lean=True,  # a one-shot dump: no pydantic-settings unless --config or a SERVEWATCH_* variable is given
    )
    t = settings.target
    if not (t.pids or t.match or t.root_pid):
        fail("no targets: give --pid, --root-pid or --match", ExitCode.USAGE)
    from agent.host.targets import discover
    from agent.runtime.agent import Agent

    refused: dict[int, str] = {}
    if not discover(root_pids=[t.root_pid] if t.root_pid else [], title_globs=t.match, pids=t.pids, uids=t.uids,
                    any_uid=t.any_uid, refused=refused):
        fail(f"no process matched the given --pid/--root-pid/--match{_no_match_why(t, refused)}", ExitCode.FAILURE)
    _data_dir_ready(settings)
    record, agent = _dump_with_progress(Agent, settings, len(t.pids))
    judge = agent.incidents.judge
    if judge is not None and judge.progress_unread:  # given, not read: said once, before the summary
        err.print(f"servewatch: {'--metrics-url' if metrics_url else 'metrics.url'}: {judge.progress_unread}",
                  markup=False, highlight=False, soft_wrap=True)
    _print_record(record, as_json=as_json)
    delivered = _say_spooled(agent.telemetry, agent.export_statistics)
    from agent.cli.summary import GONE_OUTCOMES, stack_dump_errors
    from agent.model.events import Outcome

    # exit 1 when a rank's stacks could not be captured for an error (the summary's Errors: N),
    # nothing was captured at all (py-spy off, no other evidence), or the collector refused the
    # incident's spans (or they were lost); a dead rank is evidence, and spans spooled through an
    # outage are safe (the next agent sends them)
    captured = any(r.outcome is Outcome.OK or r.outcome in GONE_OUTCOMES for r in record.results)
    if record.state == "interrupted" or stack_dump_errors(record) or not captured or not delivered:
        raise _command_exit(int(ExitCode.FAILURE))


def run_export(
    *, to: str | None, paths: Sequence[Path] | None, protocol: str | None, timeout: float, remove_sent: bool,
    resend: bool, dry_run: bool, data_dir: Path | None, config: Path | None,
) -> None:
    """The body of ``servewatch export`` (its options, as :func:`agent.cli.app.export` documents
    them; ``timeout`` in seconds)."""
    folder, table = _export_settings(data_dir, config)
    destination, endpoint = _export_destination(table, to, protocol)
    from exporters.otlp.replay import (  # after the checks: a bad value is said without it
        ledger_path,
        replay,
    )

    sources = list(paths or [folder])
    try:
        result = replay(
            sources, endpoint=endpoint, protocol=destination.protocol, timeout_s=timeout, remove_sent=remove_sent,
            headers=dict(destination.headers), insecure=destination.insecure, tls=destination.tls,
            compression=destination.compression, signal_specific=destination.signal_specific,
            ledger=None if resend else ledger_path,
            batch_spans=table.batch_spans, batch_bytes=table.batch_bytes, dry_run=dry_run,
        )
    except FileNotFoundError as exc:
        fail(f"no such file or folder {str(exc.filename)!r}" if exc.filename else str(exc), ExitCode.USAGE)
    except ValueError as exc:
        fail(str(exc), ExitCode.USAGE)
    except OSError as exc:
        fail(f"cannot read TLS files: {exc}", ExitCode.USAGE)
    err.print(_export_line(result, endpoint, destination.protocol, dry_run=dry_run), markup=False)
    if result.failed and result.detail:
        err.print(f"servewatch: send failed: {result.detail}", markup=False)
    if result.failed or result.bad_files or result.corrupt_lines:
        raise _command_exit(int(ExitCode.FAILURE))


def _export_settings(data_dir: Path | None, config: Path | None) -> tuple[Path, Any]:
    """``export``'s data dir and ``[export]`` table (:class:`exporters.config.ExportConfig`):
    without the full settings model where nothing else could matter (no ``--config``, no
    ``SERVEWATCH_*`` variable but the data dir's and host name's:
    :func:`agent.runtime.location.read_only_location`, as the read-only commands), the table's
    defaults then; else the full settings' (every problem named, unknown variables said)."""
    from agent.runtime.location import read_only_location

    where = read_only_location(data_dir, config)
    if where is None:
        settings = _settings({"data_dir": data_dir}, config, writes=False)
        return settings.data_dir, settings.export
    from exporters.config import ExportConfig

    return where.data_dir, ExportConfig()


def _export_destination(table: Any, to: str | None, protocol: str | None) -> tuple[Any, str]:
    """``export``'s destination and its endpoint with a scheme (``--to``/``--protocol`` over the
    ``[export]`` table ``table``); a bad value or no endpoint: :func:`fail` (usage)."""
    from exporters.otlp.provider import ExportConfigError, resolve_destination, scheme_problem

    if to is not None and (problem := scheme_problem(to)):
        fail(f"invalid value for --to: {problem} (got {to!r}); see 'servewatch export --help'", ExitCode.USAGE)
    if protocol is not None and protocol not in ("grpc", "http/protobuf"):
        fail(f"invalid value for --protocol: expected grpc or http/protobuf (got {protocol!r}); see 'servewatch export --help'",
             ExitCode.USAGE)
    overrides: dict[str, object] = {}
    if to is not None:
        overrides["endpoint"] = to
    if protocol is not None:
        overrides["protocol"] = protocol
    try:
        destination = resolve_destination(table.model_copy(update=overrides))
    except ExportConfigError as exc:
        fail(f"invalid setting {exc}", ExitCode.USAGE)
    endpoint = destination.endpoint
    if endpoint is None:
        fail("no collector endpoint: pass --to http://HOST:4317 or set OTEL_EXPORTER_OTLP_ENDPOINT", ExitCode.USAGE)
    if scheme_problem(endpoint):
        # a bare host:port from OTEL_EXPORTER_OTLP_*ENDPOINT: the OTLP spec's gRPC form, read as
        # `run` reads it (TLS when OTEL_EXPORTER_OTLP_INSECURE=false or TLS files are set)
        secure = destination.insecure is False or (destination.insecure is None and destination.tls.configured)
        endpoint = ("https://" if secure else "http://") + endpoint
    return destination, endpoint


def _export_line(result: Any, endpoint: str, protocol: str, *, dry_run: bool) -> str:
    """``export``'s one summary line."""
    head = (f"Dry run: would send {result.sent} span(s) from {result.files} file(s) in {result.requests} request(s) to"
            f" {endpoint} ({protocol}); nothing sent." if dry_run else
            f"Sent {result.sent} span(s) from {result.files} file(s) in {result.requests} request(s) to {endpoint} "
            f"({protocol}). Failed: {result.failed}")
    return (
        head
        + (f" Already sent earlier: {result.already_sent}" if result.already_sent else "")
        + (f" Bad files: {result.bad_files}" if result.bad_files else "")
        + (f" Skipped (spool of a running agent): {result.locked_files} file(s)" if result.locked_files else "")
        + (f" Torn lines skipped: {result.torn_lines}" if result.torn_lines else "")
        + (f" Corrupt lines skipped: {result.corrupt_lines} (first: {result.first_corrupt})" if result.corrupt_lines else "")
    )


#: Options of the plain ``servewatch dump --pid N ...`` (:func:`plain_dump_args`): value options
#: and flags, each with its :func:`run_dump` argument. Any other option leaves the command to typer.
_PLAIN_VALUES = {"--pid": "pid", "--data-dir": "data_dir", "--otlp-endpoint": "otlp_endpoint", "--otlp-protocol": "otlp_protocol"}
_PLAIN_FLAGS = {"--json": "as_json", "-v": "verbose", "--verbose": "verbose"}


def plain_dump_args(args: Sequence[str]) -> dict[str, Any] | None:
    """:func:`run_dump`'s arguments for the plain form ``dump --pid N [--pid M ...]`` with only
    ``--data-dir``, ``--otlp-endpoint``, ``--otlp-protocol`` (a value each, ``--opt V`` or
    ``--opt=V``), ``--json`` and ``-v``/``--verbose`` besides, as typer would parse them (the last
    of a repeated value option wins; pids in order, repeats kept); ``None`` for any other form
    (help, another option, a missing, empty or dash-led value, a pid that is not a positive
    decimal number): typer parses those and says what is wrong.
    """
    if not args or args[0] != "dump":
        return None
    kwargs: dict[str, Any] = {"pid": [], "root_pid": None, "match": None, "uid": None, "any_uid": False, "as_json": False,
                              "metrics_url": None, "metrics_preset": None, "otlp_endpoint": None, "otlp_protocol": None,
                              "data_dir": None, "config": None, "verbose": False}
    if not _parse_plain(args[1:], kwargs, _PLAIN_FLAGS, _PLAIN_VALUES, _take_plain_value):
        return None
    return kwargs if kwargs["pid"] else None


def _parse_plain(
    args: Sequence[str], kwargs: dict[str, Any], flags: dict[str, str], values: dict[str, str],
    take_value: Callable[[dict[str, Any], str, str], bool], take_word: Callable[[str], bool] | None = None,
) -> bool:
    """Read a plain form's ``args`` (after the command word) into ``kwargs`` as typer would:
    ``flags`` set their argument to ``True``, ``values`` (``--opt V`` or ``--opt=V``) go through
    ``take_value``, a word that is not an option through ``take_word`` (none: not taken).
    ``False`` for anything the plain form leaves to typer (another option, a missing value, a
    value or word refused)."""
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg in flags:
            kwargs[flags[arg]] = True
            continue
        if take_word is not None and not arg.startswith("-"):
            if not take_word(arg):
                return False
            continue
        name, eq, value = arg.partition("=")
        if name not in values or (not eq and not rest) or not take_value(kwargs, name, value if eq else rest.pop(0)):
            return False
    return True


def _take_plain_value(kwargs: dict[str, Any], name: str, value: str) -> bool:
    """Put option ``name``'s ``value`` in ``kwargs`` as typer would; ``False`` when the plain
    form cannot take it (empty, dash-led, a pid that is not a positive decimal number)."""
    if not value or value.startswith("-"):
        return False
    if name == "--pid":
        if not (value.isascii() and value.isdigit()) or int(value) <= 0:
            return False
        kwargs["pid"].append(int(value))
    else:
        kwargs[_PLAIN_VALUES[name]] = Path(value) if name == "--data-dir" else value
    return True


#: Options of the plain ``servewatch export ...`` (:func:`plain_export_args`): value options and
#: flags, each with its :func:`run_export` argument. Any other option leaves the command to typer.
_EXPORT_VALUES = {"--to": "to", "--protocol": "protocol", "--data-dir": "data_dir"}
_EXPORT_FLAGS = {"--dry-run": "dry_run", "--resend": "resend", "--remove-sent": "remove_sent"}


def plain_export_args(args: Sequence[str]) -> dict[str, Any] | None:
    """:func:`run_export`'s arguments for the plain form ``export [PATH ...]`` with only ``--to``,
    ``--protocol``, ``--data-dir`` (a value each, ``--opt V`` or ``--opt=V``, the last of a
    repeat wins), ``--dry-run``, ``--resend`` and ``--remove-sent`` besides, as typer would parse
    them; ``None`` for any other form (help, another option such as ``--timeout`` or
    ``--config``, ``--``, a missing, empty or dash-led value, a PATH that exists but cannot be
    read: typer says what is wrong with those)."""
    if not args or args[0] != "export":
        return None
    kwargs: dict[str, Any] = {"to": None, "paths": None, "protocol": None, "timeout": 10.0, "remove_sent": False,
                              "resend": False, "dry_run": False, "data_dir": None, "config": None}
    paths: list[Path] = []

    def take_path(word: str) -> bool:
        if not _plain_readable(word):
            return False
        paths.append(Path(word))
        return True

    if not _parse_plain(args[1:], kwargs, _EXPORT_FLAGS, _EXPORT_VALUES, _take_export_value, take_path):
        return None
    kwargs["paths"] = paths or None
    return kwargs


def _take_export_value(kwargs: dict[str, Any], name: str, value: str) -> bool:
    """Put option ``name``'s ``value`` in ``kwargs`` as typer would; ``False`` when the plain
    form leaves it to typer (empty, dash-led, a NUL in it)."""
    if not value or value.startswith("-") or "\0" in value:
        return False
    kwargs[_EXPORT_VALUES[name]] = Path(value) if name == "--data-dir" else value
    return True


def _plain_readable(path: str) -> bool:
    """Whether typer takes ``path`` as a PATH argument without a word (click's ``Path`` check, as
    ``export`` declares it: need not exist, must be readable when it does)."""
    if "\0" in path:
        return False
    try:
        os.stat(path)
    except OSError:
        return bool(path)
    return os.access(path, os.R_OK)


def run_plain_dump(kwargs: dict[str, Any]) -> None:
    """Run ``servewatch dump`` with ``kwargs`` (:func:`plain_dump_args`) without typer, and end
    the process as the one-shot console command does (:func:`_exit_now`), with the exit code
    and stderr lines typer's run would give: 0, 1 or 2 from the command, 130 on Ctrl-C, a
    :class:`~agent.errors.ServewatchError` as one ``servewatch: ...`` line and its code.
    Returns only on an invalid setting (:class:`_NeedsFullCli`): the caller
    (:func:`agent.cli.entry.main`) then runs the command again through typer, which says it as
    it always does (this module does not import the CLI module, which imports it)."""
    code = _plain_code("servewatch dump", run_dump, kwargs)
    if code is not _HANDED_OVER:
        _exit_now(code)


def run_plain_export(kwargs: dict[str, Any]) -> None:
    """Run ``servewatch export`` with ``kwargs`` (:func:`plain_export_args`) without typer, with
    the exit code and stderr lines typer's run gives, and raise ``SystemExit`` with that code
    (``export`` is not a one-shot command: the interpreter ends as it does after typer's run).
    Returns only on an invalid setting, as :func:`run_plain_dump` does."""
    code = _plain_code("servewatch export", run_export, kwargs)
    if code is not _HANDED_OVER:
        raise SystemExit(code)


#: :func:`_plain_code`'s answer when the command is to be run again through typer.
_HANDED_OVER = object()


def _plain_code(command: str, body: Any, kwargs: dict[str, Any]) -> object:
    """``body(**kwargs)`` run as ``command`` without typer: its end as an exit code (what typer's
    run returns), or :data:`_HANDED_OVER` on an invalid setting (:class:`_NeedsFullCli`)."""
    global _plain_command
    _plain_command = command
    try:
        return _plain_body_code(body, kwargs)
    except _NeedsFullCli:
        return _HANDED_OVER
    finally:
        _plain_command = None


def _plain_body_code(body: Any, kwargs: dict[str, Any]) -> object:
    """``body(**kwargs)`` (:func:`run_dump`, :func:`run_export`), its end as an exit code (what
    typer's run returns)."""
    import errno

    from agent.errors import ServewatchError, one_line

    try:
        body(**kwargs)
    except SystemExit as exc:
        return exc.code
    except EOFError:  # as typer's main: a blank line on stderr, then "aborted"
        print(file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        return 130
    except ServewatchError as exc:
        err.print(f"servewatch: {one_line(exc)}", markup=False, highlight=False)
        return exc.exit_code
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
        return 1  # a closed stdout: typer exits 1 quietly (the flush at exit ignores the pipe)
    return int(ExitCode.OK)
