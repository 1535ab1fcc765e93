"""``servewatch launch`` and ``servewatch cuda-env``: start a server armed for diagnostics.

Owns: the launch environment (CUDA coredump and Flight Recorder variables planned by
:mod:`agent.cudaenv`, plus ``MTL_CAPTURE_ENABLED=1`` for MLX targets; the user's environment
always wins), starting the
server as a child in its own process group (argv, never a shell), forwarding signals to it,
running the agent beside it, and returning its exit status. May import the stdlib, anyio and
:mod:`agent.cudaenv`, never an actor; the CLI (:mod:`agent.cli`) calls in, never the reverse.

Exit status convention (what :func:`run_launched` returns, so ``sys.exit`` can pass it on): the
child's own exit code; a child killed by signal N gives ``128 + N``, as POSIX shells report it.
A command that cannot be started raises :class:`LaunchError` with ``exit_code`` 127 (not found)
or 126 (not executable), again as shells do.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import anyio
from anyio.abc import Process

from agent.cudaenv import (
    FR_BUFFER_ENV,
    SGLANG_PIPE_TEMPLATE,
    CoredumpEnvPlan,
    cuda_coredump_env,
    flight_recorder_env,
)
from agent.errors import LaunchError

__all__ = [
    "DEFAULT_FORWARDED_SIGNALS",
    "MLX_CAPTURE_ENV",
    "LaunchEnv",
    "LaunchError",
    "check_command",
    "describe_env",
    "exit_status",
    "launch_env",
    "run_launched",
    "with_parent_death_signal",
]

log = logging.getLogger(__name__)

#: Metal frame capture must be enabled at launch for ``mx.metal.start_capture`` (macOS).
MLX_CAPTURE_ENV: Mapping[str, str] = MappingProxyType({"MTL_CAPTURE_ENABLED": "1"})

#: Signals servewatch passes on to the server (a terminal's Ctrl-C, systemd/kubelet's SIGTERM,
#: reload/diagnostic signals). SIGALRM/SIGCHLD/SIGWINCH stay ours.
DEFAULT_FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


#: Run in the child before the server's exec (Linux): ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` so the
#: server dies with the launcher (``kill -9`` of servewatch, OOM killer) instead of running on
#: unwatched; then exec the server in place (same pid). argv: launcher pid, server argv...
_PDEATHSIG_EXEC = """
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    os._exit(128 + int(signal.SIGKILL))  # the launcher died before prctl: do not start at all
argv = sys.argv[2:]
try:
    os.execvp(argv[0], argv)
except FileNotFoundError:
    sys.stderr.write("servewatch: command not found: %r\\n" % argv[0])
    os._exit(127)
except OSError as exc:
    sys.stderr.write("servewatch: cannot execute %r: %s\\n" % (argv[0], exc))
    os._exit(126)
"""


def with_parent_death_signal(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so that the started server gets ``PR_SET_PDEATHSIG`` (SIGKILL) before its exec.

    anyio's ``open_process`` has no ``preexec_fn``; a tiny isolated Python (``-I -S``, stdlib
    only) sets the signal and execs the server, which keeps the pid, argv and environment it
    would have had. Elsewhere than Linux ``argv`` is returned as is.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid()), *argv]


def check_command(argv0: str, env: Mapping[str, str], cwd: str | os.PathLike[str] | None = None) -> None:
    """Raise :class:`LaunchError` (127 / 126) when ``argv0`` cannot be executed, as a shell would.

    ``servewatch launch`` calls it before it creates any folder or arms anything; a bare name is
    looked up on ``env["PATH"]``, a path relative to ``cwd`` (default ours).
    """
    if os.sep in argv0:
        path = argv0 if os.path.isabs(argv0) or cwd is None else os.path.join(os.fspath(cwd), argv0)
        if not os.path.exists(path):
            raise LaunchError(f"command not found: {argv0!r}", exit_code=127)
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            raise LaunchError(f"command not executable: {argv0!r}", exit_code=126)
        return
    if shutil.which(argv0, path=env.get("PATH", os.defpath)) is None:
        raise LaunchError(f"command not found: {argv0!r}", exit_code=127)


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """The environment a launched server starts with.

    Attributes:
        env: the complete environment for the child.
        set: variables servewatch added (name -> value).
        kept: diagnostic variables the user had already set (name -> the user's value).
        coredump: the CUDA coredump plan, or ``None`` when no crash-dump folder was given.
    """

    env: Mapping[str, str]
    set: Mapping[str, str]
    kept: Mapping[str, str]
    coredump: CoredumpEnvPlan | None


def launch_env(
    environ: Mapping[str, str] = os.environ,
    *,
    crash_dump_folder: str | os.PathLike[str] | None,
    mlx: bool = False,
    host: str | None = None,
    pipe_template: str = SGLANG_PIPE_TEMPLATE,
    flight_recorder: int | None = None,
) -> LaunchEnv:
    """Compute the server's environment: CUDA coredump arming, the collective Flight Recorder
    and, for MLX, Metal capture.

    Every variable is added only when ``environ`` lacks it (the user's value wins).

    Args:
        environ: the environment to start from (not modified).
        crash_dump_folder: arm CUDA coredumps into this folder (``None``: do not arm).
        mlx: add ``MTL_CAPTURE_ENABLED=1`` for MLX Metal captures.
        host: host name for the per-host dump folder; default the machine's.
        pipe_template: ``CUDA_COREDUMP_PIPE`` to set; default SGLang's.
        flight_recorder: arm torch's collective Flight Recorder with this many entries per
            process (``TORCH_FR_BUFFER_SIZE``, read at ``init_process_group``); ``None``: do not.

    Returns:
        The :class:`LaunchEnv`.

    Raises:
        OSError: the crash-dump folder cannot be created.
    """
    plan = None
    added: dict[str, str] = {}
    kept: dict[str, str] = {}
    env = dict(environ)
    if crash_dump_folder is not None:
        plan = cuda_coredump_env(crash_dump_folder, environ, host=host, pipe_template=pipe_template)
        added.update(plan.set)
        kept.update(plan.kept)
        env = dict(plan.env)
    if flight_recorder is not None:
        fr_set, fr_kept = flight_recorder_env(environ, buffer_size=flight_recorder)
        kept.update(fr_kept)
        added.update(fr_set)
        env.update(fr_set)
    if mlx:
        for name, value in MLX_CAPTURE_ENV.items():
            if name in environ:
                kept[name] = environ[name]
            else:
                added[name] = env[name] = value
    return LaunchEnv(
        env=MappingProxyType(env), set=MappingProxyType(added), kept=MappingProxyType(kept), coredump=plan
    )


def describe_env(planned: LaunchEnv) -> str:
    """One stderr line saying how the server was armed, e.g. for ``servewatch launch``.

    Example: ``Armed CUDA coredumps into '/var/crash/node1/' (set 6, kept user's: none)``.
    """
    parts = []
    if planned.coredump is not None:
        kept = ", ".join(sorted(planned.kept)) or "none"
        parts.append(
            f"Armed CUDA coredumps into '{planned.coredump.host_dir}/' (set {len(planned.coredump.set)},"
            f" kept user's: {kept})"
        )
    if FR_BUFFER_ENV in planned.set:
        parts.append(f"Flight Recorder armed ({FR_BUFFER_ENV}={planned.set[FR_BUFFER_ENV]})")
    elif FR_BUFFER_ENV in planned.kept:
        parts.append(f"Flight Recorder: user's {FR_BUFFER_ENV}={planned.kept[FR_BUFFER_ENV]} kept")
    if "MTL_CAPTURE_ENABLED" in planned.set:
        parts.append("MTL_CAPTURE_ENABLED=1 for Metal captures")
    return "; ".join(parts) or "No diagnostic environment added"


def exit_status(returncode: int) -> int:
    """Map a ``Popen.returncode`` to a shell exit status (signal N -> ``128 + N``)."""
    return 128 - returncode if returncode < 0 else returncode


async def _forward_signals(
    receiver: AsyncIterator[signal.Signals],
    process: Process,
    *,
    to_group: bool,
    on_forwarded: Callable[[int], None] | None = None,
) -> None:
    """Pass every signal servewatch receives on to the child (or its process group)."""
    async for signum in receiver:
        if on_forwarded is not None:
            on_forwarded(int(signum))  # before it is sent: the tree is still whole
        try:
            if to_group:
                os.killpg(process.pid, signum)
            else:
                os.kill(process.pid, signum)
        except ProcessLookupError:
            return  # the server is gone; its exit status is on its way
        except PermissionError:
            log.warning("cannot forward signal %d to pid %d: permission denied", signum, process.pid)


async def _run_agent(agent_main: Callable[[int], Awaitable[None]], pid: int, scope: anyio.CancelScope) -> None:
    """Run the agent inside ``scope``; its failure is logged, never propagated to the server."""
    with scope:
        try:
            await agent_main(pid)
        except Exception:  # boundary: a broken agent must not take the server down
            log.exception("the servewatch agent failed; the server keeps running unwatched")


async def _stop(process: Process, *, grace_s: float) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace_s`` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        with anyio.move_on_after(wait_s):
            await process.wait()
            return


async def run_launched(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    agent_main: Callable[[int], Awaitable[None]] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    forward_signals: Sequence[signal.Signals] = DEFAULT_FORWARDED_SIGNALS,
    signal_group: bool = False,
    agent_exit_grace_s: float = 5.0,
    terminate_grace_s: float = 10.0,
    on_child_exit: Callable[[int], None] | None = None,
    on_signal_forwarded: Callable[[int], None] | None = None,
) -> int:
    """Run the server ``argv`` as a child with ``env`` and the agent beside it; return its status.

    On Linux the child gets ``PR_SET_PDEATHSIG`` (SIGKILL) before its exec
    (:func:`with_parent_death_signal`): if servewatch is killed outright, the server dies too
    rather than running on unwatched.

    The child gets its own session and process group (so a terminal's Ctrl-C reaches servewatch
    first), inherits stdin/stdout/stderr, and receives every signal in ``forward_signals`` that
    servewatch receives. ``agent_main(child_pid)`` runs concurrently from the moment the child
    exists; an exception in it is logged and the server keeps running. When the child exits the
    agent gets ``agent_exit_grace_s`` seconds to finish (e.g. an incident for a crash), then is
    cancelled. If this coroutine itself is cancelled, the child's process group is sent SIGTERM
    and, after ``terminate_grace_s`` seconds, SIGKILL.

    Must be called from the main thread (signal handlers).

    Args:
        argv: the server command (``argv[0]`` is looked up on ``PATH`` from ``env``).
        env: the child's complete environment (from :func:`launch_env`).
        agent_main: the agent, given the child's pid; ``None`` runs the server alone.
        cwd: the child's working directory; default ours.
        forward_signals: signals to pass on.
        signal_group: forward to the child's whole process group instead of the child alone
            (default: the child alone, which shuts its own workers down, as SGLang does).
        agent_exit_grace_s: seconds the agent may keep running after the child exited.
        terminate_grace_s: seconds between SIGTERM and SIGKILL when cancelled.
        on_child_exit: called with the child's raw return code (``-N`` for signal N) as soon
            as it is reaped, before the agent's grace period starts (the agent's process
            watcher reads the exit status from it: the status is ours to reap).
        on_signal_forwarded: called with each signal number about to be passed on to the child,
            just before it is sent (an operator's stop is then an expected exit of the whole
            launched tree, not an incident).

    Returns:
        The child's exit status (``128 + N`` when killed by signal N).

    Raises:
        LaunchError: the command cannot be started (``exit_code`` 127 or 126).
        ValueError: ``argv`` is empty.
    """
    if not argv:
        raise ValueError("no server command given (servewatch launch [OPTIONS] -- CMD ...)")
    await anyio.to_thread.run_sync(check_command, str(argv[0]), env, cwd)  # PATH lookup: stats
    with anyio.open_signal_receiver(*forward_signals) as receiver:
        try:
            process = await anyio.open_process(
                with_parent_death_signal(argv),  # a killed launcher never orphans the server
                stdin=None,
                stdout=None,
                stderr=None,
                cwd=cwd,
                env=dict(env),
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise LaunchError(f"command not found: {argv[0]!r}", exit_code=127) from exc
        except PermissionError as exc:
            raise LaunchError(f"command not executable: {argv[0]!r}", exit_code=126) from exc
        try:
            async with anyio.create_task_group() as tg:
                forwarding = anyio.CancelScope()
                agent_scope = anyio.CancelScope()

                async def forward() -> None:
                    with forwarding:
                        await _forward_signals(
                            receiver, process, to_group=signal_group, on_forwarded=on_signal_forwarded
                        )

                tg.start_soon(forward)
                if agent_main is not None:
                    tg.start_soon(_run_agent, agent_main, process.pid, agent_scope)
                returncode = await process.wait()
                if on_child_exit is not None:
                    on_child_exit(returncode)
                forwarding.cancel()
                agent_scope.deadline = min(agent_scope.deadline, anyio.current_time() + agent_exit_grace_s)
            return exit_status(returncode)
        finally:
            if process.returncode is None:
                with anyio.CancelScope(shield=True):
                    await _stop(process, grace_s=terminate_grace_s)
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await process.aclose()
