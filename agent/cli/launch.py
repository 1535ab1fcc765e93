"""``servewatch launch`` and ``servewatch cuda-env``: start a server armed for diagnostics.

Owns: the launch environment (CUDA coredump and Flight Recorder variables planned by
:mod:`agent.host.cudaenv`, plus ``MTL_CAPTURE_ENABLED=1`` for MLX targets; the user's environment
always wins), starting the
server as a child in its own process group (argv, never a shell), forwarding signals to it,
running the agent beside it, and returning its exit status. May import the stdlib, anyio,
:mod:`agent.host.cudaenv` and :mod:`agent.host.procinfo`, never an actor; the CLI (:mod:`agent.cli.app`) calls
in, never the reverse.

Nothing of the server outlives servewatch unwatched: the server gets ``PR_SET_PDEATHSIG``
(SIGKILL) before its exec, and a small keeper process (its own session, stdlib only) holds the
read end of a pipe from servewatch: when servewatch dies without saying goodbye (``kill -9``, the
OOM killer), the pipe ends and the keeper stops every process still in the server's process group
(SIGTERM, then SIGKILL after :data:`KEEPER_GRACE_S`), each through a pidfd verified to be a
member. With ``subreaper`` (the CLI), servewatch is the child subreaper of the server's tree:
ranks orphaned by their server become servewatch's children, so their exit status is read with
``waitid`` (noted for the process watcher) and they are reaped.

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
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import anyio
from anyio.abc import Process

from agent.errors import LaunchError
from agent.host.cudaenv import (
    FR_BUFFER_ENV,
    SGLANG_PIPE_TEMPLATE,
    CoredumpEnvPlan,
    cuda_coredump_env,
    flight_recorder_env,
)
from agent.host.procinfo import note_exit

__all__ = [
    "DEFAULT_FORWARDED_SIGNALS",
    "KEEPER_GRACE_S",
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


#: Seconds the keeper waits after SIGTERM before it SIGKILLs what is left of the server's group.
KEEPER_GRACE_S = 5.0

#: The keeper (``python -I -S -c``, stdlib only). argv: pipe fd, process group id, grace seconds.
#: EOF on the pipe without ``done``: the launcher died; stop the group's members, each through a
#: pidfd whose process is checked (after opening it) to still be in the group.
_KEEPER = r"""
import os, signal, sys, time
fd, pgid, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
data = b""
while True:
    try:
        chunk = os.read(fd, 64)
    except InterruptedError:
        continue
    if not chunk:
        break
    data += chunk
if b"done" in data:
    sys.exit(0)

def group_of(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None, b""
    return int(fields[2]), fields[0]

def members():
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            group, state = group_of(int(name))
            if group == pgid and state != b"Z":
                found.append(int(name))
    return found

def signal_all(sig):
    for pid in members():
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if group_of(pid)[0] == pgid:
                signal.pidfd_send_signal(pidfd, sig)
        except OSError:
            pass
        finally:
            os.close(pidfd)

left = members()
if left:
    sys.stderr.write("servewatch: the launcher died; stopping the server's process group %d (%d processes)\n"
                     % (pgid, len(left)))
    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while members() and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_all(signal.SIGKILL)
"""

_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper(on: bool) -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER)`` on this process (Linux); False elsewhere or when refused."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap_adopted(server_pid: int, session: int) -> int:
    """Reap our zombie children of the server's session other than the server itself (ranks it
    orphaned, adopted by us as subreaper), noting each exit status first; returns how many."""
    import psutil

    reaped = 0
    try:
        children = psutil.Process().children()
    except (psutil.Error, OSError):
        return 0
    for child in children:
        if child.pid == server_pid:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE or os.getsid(child.pid) != session:
                continue
            create_time_s = child.create_time()
        except (psutil.Error, OSError):
            continue
        try:
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if info is not None:
            code, sig = (info.si_status, None) if info.si_code == os.CLD_EXITED else (None, info.si_status)
            note_exit(child.pid, create_time_s=create_time_s, exit_code=code, signal=sig)
        try:
            os.waitpid(child.pid, os.WNOHANG)
            reaped += 1
        except ChildProcessError:
            pass
    return reaped


async def _reap_adopted_forever(server_pid: int, session: int, interval_s: float = 1.0) -> None:
    """Every ``interval_s``, reap the orphans we adopted, each exit status noted first
    (:func:`agent.host.procinfo.note_exit`: the process watcher reads it there if it comes later)."""
    while True:
        await anyio.sleep(interval_s)
        await anyio.to_thread.run_sync(_reap_adopted, server_pid, session)


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


def _signal_child(process: Process, pidfd: int | None, sig: int, *, to_group: bool) -> None:
    """Signal our child (or its process group) while it is not reaped.

    The child alone: through its pidfd (taken at its start). Its group: ``killpg`` only while
    the child (the group's leader) is unreaped: its pid, hence the group id, cannot belong to
    anyone else then. Once reaped, nothing is sent (raises ``ProcessLookupError``).
    """
    if process.returncode is not None:
        raise ProcessLookupError(f"pid {process.pid} was reaped")
    if to_group:
        os.killpg(process.pid, sig)
    elif pidfd is not None:
        signal.pidfd_send_signal(pidfd, sig)
    else:
        os.kill(process.pid, sig)  # our unreaped child: its pid cannot be reused


async def _forward_signals(
    receiver: AsyncIterator[signal.Signals],
    process: Process,
    *,
    to_group: bool,
    on_forwarded: Callable[[int], None] | None = None,
    pidfd: int | None = None,
) -> None:
    """Pass every signal servewatch receives on to the child (or its process group)."""
    async for signum in receiver:
        if on_forwarded is not None:
            on_forwarded(int(signum))  # before it is sent: the tree is still whole
        try:
            _signal_child(process, pidfd, signum, to_group=to_group)
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
    """SIGTERM the child's process group, SIGKILL it after ``grace_s`` seconds (only while the
    child is unreaped: see :func:`_signal_child`)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            _signal_child(process, None, sig, to_group=True)
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
    subreaper: bool = False,
    keeper: bool = True,
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
        subreaper: make this process the child subreaper of the server's tree while it runs
            (the CLI: orphaned ranks become ours, their exit status read and noted, then reaped).
        keeper: start the keeper that stops the server's process group if this process dies
            without finishing (``kill -9``).

    Returns:
        The child's exit status (``128 + N`` when killed by signal N).

    Raises:
        LaunchError: the command cannot be started (``exit_code`` 127 or 126).
        ValueError: ``argv`` is empty.
    """
    if not argv:
        raise ValueError("no server command given (servewatch launch [OPTIONS] -- CMD ...)")
    await anyio.to_thread.run_sync(check_command, str(argv[0]), env, cwd)  # PATH lookup: stats
    if subreaper and not _set_subreaper(True):
        log.info("launch: cannot become the child subreaper; ranks orphaned by the server are reaped by init")
        subreaper = False
    try:
        return await _launch(argv, env, agent_main, cwd, forward_signals, signal_group, agent_exit_grace_s,
                             terminate_grace_s, on_child_exit, on_signal_forwarded, subreaper=subreaper, keeper=keeper)
    finally:
        if subreaper:
            _set_subreaper(False)


async def _start_keeper(pgid: int) -> tuple[Process, int] | None:
    """Start the keeper of process group ``pgid``; returns it and the pipe end to say ``done`` on."""
    if not sys.platform.startswith("linux"):
        return None
    read_fd, write_fd = os.pipe()  # both close-on-exec: only the keeper gets the read end
    try:
        keeper = await anyio.open_process(
            [sys.executable, "-I", "-S", "-c", _KEEPER, str(read_fd), str(pgid), str(KEEPER_GRACE_S)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None, pass_fds=(read_fd,),
            start_new_session=True,  # a terminal's Ctrl-C for the server is not the keeper's
        )
    except OSError as exc:
        os.close(write_fd)
        log.warning("launch: cannot start the keeper (%s): a kill -9 of servewatch would leave the ranks running", exc)
        return None
    finally:
        os.close(read_fd)
    return keeper, write_fd


async def _stop_keeper(started: tuple[Process, int] | None) -> None:
    """Tell the keeper all went in order and reap it (bounded)."""
    if started is None:
        return
    keeper, write_fd = started
    def goodbye() -> None:
        try:
            os.write(write_fd, b"done")
        except OSError:
            pass
        os.close(write_fd)

    await anyio.to_thread.run_sync(goodbye)
    with anyio.move_on_after(5):
        await keeper.wait()
    if keeper.returncode is None:
        keeper.kill()
    with anyio.move_on_after(2):
        await keeper.aclose()


async def _launch(
    argv: Sequence[str],
    env: Mapping[str, str],
    agent_main: Callable[[int], Awaitable[None]] | None,
    cwd: str | os.PathLike[str] | None,
    forward_signals: Sequence[signal.Signals],
    signal_group: bool,
    agent_exit_grace_s: float,
    terminate_grace_s: float,
    on_child_exit: Callable[[int], None] | None,
    on_signal_forwarded: Callable[[int], None] | None,
    *,
    subreaper: bool,
    keeper: bool,
) -> int:
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
        pidfd: int | None = None
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
            try:
                pidfd = os.pidfd_open(process.pid)  # our unreaped child: it is the server
            except OSError:
                pidfd = None
        kept = await _start_keeper(process.pid) if keeper else None
        try:
            async with anyio.create_task_group() as tg:
                forwarding = anyio.CancelScope()
                agent_scope = anyio.CancelScope()
                reaping = anyio.CancelScope()

                async def forward() -> None:
                    with forwarding:
                        await _forward_signals(
                            receiver, process, to_group=signal_group, on_forwarded=on_signal_forwarded, pidfd=pidfd
                        )

                async def reap() -> None:
                    with reaping:
                        await _reap_adopted_forever(process.pid, process.pid)

                tg.start_soon(forward)
                if subreaper:
                    tg.start_soon(reap)
                if agent_main is not None:
                    tg.start_soon(_run_agent, agent_main, process.pid, agent_scope)
                returncode = await process.wait()
                if on_child_exit is not None:
                    on_child_exit(returncode)
                forwarding.cancel()
                agent_scope.deadline = min(agent_scope.deadline, anyio.current_time() + agent_exit_grace_s)
                reaping.deadline = agent_scope.deadline
            return exit_status(returncode)
        finally:
            if process.returncode is None:
                with anyio.CancelScope(shield=True):
                    await _stop(process, grace_s=terminate_grace_s)
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await process.aclose()
            with anyio.CancelScope(shield=True):
                await _stop_keeper(kept)
                if subreaper:
                    await anyio.to_thread.run_sync(_reap_adopted, process.pid, process.pid)
            if pidfd is not None:
                os.close(pidfd)
