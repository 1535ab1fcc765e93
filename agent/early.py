"""Early py-spy runs: a one-shot ``servewatch dump --pid N ...`` starts its dumps before its imports.

A one-shot dump spends ~0.25 CPU-second starting Python and importing what it needs (typer,
pydantic-settings, anyio, the OTel SDK, the actors) before its py-spy actor runs, and py-spy
itself takes ~0.1 s per torch-importing target (``--native`` reads libtorch's symbols). The
console entry (:func:`agent.cli.entry.main`) calls :func:`start` with argv before any of those
imports: for the plain form ``servewatch dump --pid N [--pid M ...]`` it starts, for each pid, the
first attempt the py-spy actor would run (the argv of :func:`pyspy_argv` with the actor's
defaults: ``py-spy dump --json --pid N --native``) in its own session, and a thread per run that
drains its pipes (bounded). The actor :func:`claim`\\ s a run whose argv equals the one it was about
to start and waits for it instead; what nobody claims (the pid was not a target, a setting
changed the argv, the command failed before dumping) is killed with its process group and reaped
by :func:`discard_all` before the process ends, and a target left stopped gets ``SIGCONT``.

Nothing changes in what a dump records: the same argv, the same bounds (the run's ``timeout_s``
counts from its early start), the same classification. Only the start is earlier.

This module imports the standard library only (it runs before everything else).
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ONE_SHOT_COMMANDS", "EarlyRun", "claim", "default_executable", "discard_all", "discard_pid", "dumping", "is_early_tracer", "one_shot", "pending", "plan", "pyspy_argv", "pyspy_env", "start"]

#: Most early runs started at once: the py-spy actor's default ``max_concurrency`` (twice the
#: CPUs, at least 8), so early runs never exceed what the actor itself would run at once.
MAX_EARLY = max(8, 2 * (os.cpu_count() or 1))

#: stdout kept from one early run, in bytes: the actor's default ``pyspy.max_output_bytes``
#: (32 MiB). More is drained and dropped, and the run says so (the actor reports ``FAILED``).
MAX_STDOUT_BYTES = 32 * 1024 * 1024
#: stderr kept from one early run, in bytes (as the actor keeps).
MAX_STDERR_BYTES = 64 * 1024

#: Options of ``servewatch dump`` that leave the py-spy argv at its defaults (each takes a value
#: unless listed in :data:`_FLAGS`). Any other option (``--config`` may change ``[pyspy]``;
#: ``--root-pid``, ``--match``, ``--uid`` select targets by discovery) means no early run.
_OPTIONS_WITH_VALUE = frozenset({"--pid", "--data-dir", "--otlp-endpoint", "--otlp-protocol"})
_FLAGS = frozenset({"--json", "-v", "--verbose"})
#: Environment prefix of the settings that may change the py-spy argv (``SERVEWATCH_PYSPY__*``):
#: any present, no early run (settings come only from ``--config``, env and flags).
_ENV_PREFIXES = ("SERVEWATCH_PYSPY",)


#: Commands that end within seconds on their own (and the bare ``--help`` / ``--version``). They
#: run with the cyclic garbage collector off, from before their imports: start-up imports build
#: ~10^5 long-lived objects, and each collection would only walk them again; what such a command
#: leaves is bounded and freed at exit. They also end with :func:`agent.cli.app._exit_now`, skipping
#: the interpreter's module teardown (tens of ms of freeing the same objects). ``run``,
#: ``launch``, ``demo``, ``profile`` and ``export`` keep the collector and the normal exit.
ONE_SHOT_COMMANDS = frozenset({"dump", "status", "timeline", "report", "cuda-env"})


def one_shot(args: Sequence[str]) -> bool:
    """Whether ``args`` (argv without the program) name a one-shot command or no command."""
    command = next((a for a in args if not a.startswith("-")), None)
    return command is None or command in ONE_SHOT_COMMANDS


def default_executable() -> str | None:
    """The py-spy binary servewatch uses unless configured: next to ``sys.executable`` (the
    PyPI wheel installs it into the same ``bin/``), else the first ``py-spy`` on ``PATH``.

    Returns:
        An absolute path, or ``None`` when py-spy is not installed.
    """
    beside = Path(sys.executable).parent / "py-spy"
    try:
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
    except OSError:  # a venv in a folder this user may not enter (root's, without sudo): look on PATH
        pass
    return shutil.which("py-spy")


def pyspy_argv(exe: str, pid: int, *, native: bool, nonblocking: bool = False, locals_: bool = False) -> list[str]:
    """The argv of one ``py-spy dump`` attempt (the one place it is built: the actor and early
    runs alike), per py-spy 0.4's ``dump`` options: ``--json`` output, ``--native`` frames,
    ``--nonblocking`` (don't pause the target), ``--locals``."""
    argv = [exe, "dump", "--json", "--pid", str(pid)]
    if native:
        argv.append("--native")
    if nonblocking:
        argv.append("--nonblocking")
    if locals_:
        argv.append("--locals")
    return argv


def pyspy_env() -> dict[str, str]:
    """py-spy's environment: ours, with ``RUST_BACKTRACE=0`` (one-line errors, no backtrace)."""
    return dict(os.environ, RUST_BACKTRACE="0")


def plan(args: Sequence[str], environ: dict[str, str] | os._Environ[str] | None = None) -> list[int]:
    """The pids to dump early for ``args`` (argv without the program), or ``[]``.

    Only ``dump`` with ``--pid`` values and options that leave the py-spy argv at its defaults
    qualifies (see :data:`_OPTIONS_WITH_VALUE`, :data:`_FLAGS`, :data:`_ENV_PREFIXES`); any
    other, malformed or help form yields ``[]`` (the CLI then reports it as usual). Pids are
    positive integers, in order, without repeats, at most :data:`MAX_EARLY`.
    """
    env = os.environ if environ is None else environ
    if not args or args[0] != "dump" or any(k.startswith(_ENV_PREFIXES) for k in env):
        return []
    pids: list[int] = []
    rest = list(args[1:])
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if arg in _FLAGS:
            continue
        if name not in _OPTIONS_WITH_VALUE:
            return []
        if not eq:
            if not rest:
                return []
            value = rest.pop(0)
        if name == "--pid":
            if not value.isdigit() or int(value) <= 0:
                return []
            if int(value) not in pids:
                pids.append(int(value))
    return pids[:MAX_EARLY]


def _traced_or_gone(pid: int) -> bool:
    """Whether ``pid`` is gone, a zombie, or ptrace-attached (``TracerPid``, per proc(5)): the
    actor reports the first two without py-spy and dumps the last with ``--nonblocking``."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            status = fh.read()
    except OSError:
        return True
    for line in status.splitlines():
        if line.startswith("State:") and line.split()[1:2] in (["Z"], ["X"]):
            return True
        if line.startswith("TracerPid:"):
            return line.split()[1:2] != ["0"]
    return False


class EarlyRun:
    """One py-spy run started early, its pipes drained by a thread (bounded).

    Attributes:
        argv: the command line.
        pid: the target pid.
        started_s: ``time.monotonic()`` at the start, in seconds.
        started_unix_ns: wall-clock time of the start, ns since the epoch.
        stdout, stderr: what was kept (at most :data:`MAX_STDOUT_BYTES` / :data:`MAX_STDERR_BYTES`).
        stdout_truncated: stdout passed its bound (the rest was dropped).
    """

    def __init__(self, argv: list[str], pid: int) -> None:
        """Start the run. Raises ``OSError`` when py-spy cannot be started."""
        self.argv = argv
        self.pid = pid
        self.started_s = time.monotonic()
        self.started_unix_ns = time.time_ns()
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.stdout_truncated = False
        #: the target's pidfd, taken now (when it was named): SIGCONT never reaches a reused pid
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:
                self._pidfd = None
        self.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, env=pyspy_env(),
        )
        self._drained = threading.Event()
        threading.Thread(target=self._drain, name=f"servewatch-early-pyspy-{pid}", daemon=True).start()

    def _drain(self) -> None:
        streams = {self.process.stdout: (self.stdout, MAX_STDOUT_BYTES), self.process.stderr: (self.stderr, MAX_STDERR_BYTES)}
        try:
            with selectors.DefaultSelector() as sel:
                for stream in streams:
                    if stream is not None:
                        sel.register(stream, selectors.EVENT_READ)
                while sel.get_map():
                    for key, _ in sel.select():
                        chunk = os.read(key.fd, 65536)
                        if not chunk:
                            sel.unregister(key.fileobj)
                            continue
                        buf, limit = streams[key.fileobj]  # type: ignore[index]
                        room = limit - len(buf)
                        buf += chunk[: max(room, 0)]
                        if len(chunk) > room and key.fileobj is self.process.stdout:
                            self.stdout_truncated = True
        except (OSError, ValueError):  # pipes closed under us by discard(): nothing more to read
            pass
        finally:
            self._drained.set()

    def wait(self, timeout_s: float) -> int | None:
        """Block until the run ended and its pipes are drained, at most ``timeout_s`` seconds.

        Returns:
            The exit code (negative: killed by that signal), or ``None`` if still running.
        """
        if not self._drained.wait(max(timeout_s, 0.0)):
            return None
        try:
            return self.process.wait(timeout=max(0.05, timeout_s - (time.monotonic() - self.started_s)))
        except subprocess.TimeoutExpired:  # pipes closed but the process lingers
            return None

    def close(self) -> None:
        """Close the run's pipes (once it ended and was drained, or was killed) and the target's pidfd."""
        self._close_pipes()
        self._close_pidfd()

    def _close_pipes(self) -> None:
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()

    def kill(self, grace_s: float = 2.0) -> bool:
        """Kill the run's process group (SIGKILL), reap it (within ``grace_s`` seconds) and send
        ``SIGCONT`` to the target if the killed py-spy left it stopped.

        Returns:
            Whether the target was continued.
        """
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        self._drained.wait(grace_s)
        self._close_pipes()
        continued = False
        if _stopped(self.pid) and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGCONT)  # ESRCH once reaped: never a newcomer
                continued = True
            except (ProcessLookupError, PermissionError):
                pass
        self._close_pidfd()
        return continued

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is in a stop state (``T`` stopped or ``t`` tracing stop, per proc(5))."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] in ("T", "t")


_RUNS: dict[tuple[str, ...], EarlyRun] = {}
_LOCK = threading.Lock()


def start(args: Sequence[str], exe: str | None = None) -> list[EarlyRun]:
    """Start the early runs :func:`plan` gives for ``args`` (argv without the program), with
    py-spy at ``exe`` (default :func:`default_executable`, the actor's default too).

    Never raises: a pid that is gone, a zombie or ptrace-attached is left to the actor, and a
    py-spy that cannot be started is simply not started early.

    Returns:
        The runs started (also kept for :func:`claim`).
    """
    pids = plan(args)
    exe = (exe or default_executable()) if pids else None
    started: list[EarlyRun] = []
    for pid in pids:
        if exe is None or _traced_or_gone(pid):
            continue
        argv = pyspy_argv(exe, pid, native=True)
        try:
            run = EarlyRun(argv, pid)
        except OSError:
            return started
        with _LOCK:
            _RUNS[tuple(argv)] = run
        started.append(run)
    return started


def pending() -> int:
    """How many early runs are waiting to be claimed."""
    with _LOCK:
        return len(_RUNS)


def is_early_tracer(pid: int) -> bool:
    """Whether ``pid`` (a ``TracerPid``, per proc(5): a task id) is an unclaimed early py-spy
    run or one of its threads: a target it is reading shows it as its tracer meanwhile."""
    with _LOCK:
        runs = list(_RUNS.values())
    return any(run.process.pid == pid or os.path.exists(f"/proc/{run.process.pid}/task/{pid}") for run in runs)


def dumping(pid: int) -> bool:
    """Whether an unclaimed early run of target ``pid`` is still running (it may hold it stopped)."""
    with _LOCK:
        runs = list(_RUNS.values())
    return any(run.pid == pid and run.process.poll() is None for run in runs)


def claim(argv: Sequence[str]) -> EarlyRun | None:
    """The early run of exactly ``argv``, taken (the caller now owns it), or ``None``."""
    with _LOCK:
        return _RUNS.pop(tuple(argv), None)


def discard_pid(pid: int, grace_s: float = 2.0) -> int:
    """Kill and reap the unclaimed early runs of target ``pid`` (an attempt of another argv is
    about to run: two py-spy must not attach to one target at once).

    Returns:
        How many were discarded.
    """
    with _LOCK:
        runs = [run for key, run in _RUNS.items() if run.pid == pid]
        for run in runs:
            del _RUNS[tuple(run.argv)]
    for run in runs:
        run.kill(grace_s)
    return len(runs)


def discard_all(grace_s: float = 2.0) -> int:
    """Kill and reap every early run nobody claimed (see :meth:`EarlyRun.kill`).

    Returns:
        How many were discarded.
    """
    with _LOCK:
        runs = list(_RUNS.values())
        _RUNS.clear()
    for run in runs:
        run.kill(grace_s)
    return len(runs)
