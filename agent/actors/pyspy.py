"""The py-spy actor: Python (and native) stacks of every target process, captured concurrently.

Owns :class:`PySpyActor` (settings: :class:`~agent.actors.config.PySpyConfig`), the py-spy failure classifier
(:func:`classify`), the parsing/rendering of ``py-spy dump --json`` output
(:func:`parse_dump`, :func:`parse_threads`, :func:`render_text`) and the hung-frame rule
(:func:`hung_location`, :func:`hung_frame`), which :mod:`agent.views.bundle` also reads
bundles with. Imports anyio, psutil (through :mod:`agent.host.targets`), pydantic,
:func:`agent.actors.act_all`, :mod:`agent.model.events`, :mod:`agent.model.ranks` (titles' roles) and
:mod:`agent.host.targets`; never a watcher.

How one dump runs (per target, see :meth:`PySpyActor.act`):

1. The target is probed first: a pid that is gone (or reused) or a zombie is reported at once,
   without starting py-spy.
2. The targets are dumped in waves (:func:`dump_waves`): a server's ranks and coordinators
   together first, its other roles (detokenizer, launcher) once those ended.
   At most one dump per pid at a time (a per-pid :class:`anyio.Lock`), and at most
   ``max_concurrency`` py-spy processes at once (one :class:`anyio.CapacityLimiter`).
3. Another py-spy attached to the target (a second dump at the same moment) is waited for, at most
   :data:`TRACER_WAIT_S`; any other tracer means one ``--nonblocking`` attempt. A run of the same
   argv that the console entry started early (:mod:`agent.early`) is taken over instead of
   starting a new one.
   A target with a thread in uninterruptible sleep (``/proc`` state ``D``: a read from a hung
   network filesystem or device; any thread, not only the main one, since py-spy stops every
   thread and waits for each) is never attached blocking: a thread in ``D`` takes no signal, so
   a blocking dump hangs until its timeout (20 s seen in the field). One ``--nonblocking``
   attempt reads it at once, and the detail names the kernel function it waits in (its
   ``wchan``). A blocking attempt that timed out is followed by that attempt too when the target
   is in ``D`` by then (at most :data:`DSLEEP_NONBLOCKING_S` beyond the budget).
4. ``py-spy dump --json --pid N --native`` runs as an argv list in its own session/process group,
   bounded by ``timeout_s``. Success is exit code 0 only (a failed ``--native`` run can leave a
   partial header on stdout). On a timeout or cancellation the whole process group is killed, and
   a target left stopped (psutil status ``stopped`` / ``tracing-stop``) gets ``SIGCONT``; that
   cleanup is shielded from cancellation and bounded by its own short timeout.
5. A failure is sorted into an :class:`~agent.model.events.Outcome` by :func:`classify` (exit code,
   stderr, and the target's state after the failure). Only failures a plain run may fix are retried
   without ``--native``; ``--native`` unsupported on this host is remembered for the actor's life.
   A denial while nobody is attached any more is retried once after :data:`TRANSIENT_RETRY_S`
   (another tracer may have come and gone); a denial while another py-spy is attached or about to
   attach is waited out and retried, at most :data:`COLLISION_RETRIES` times.

Messages matched (py-spy 0.4.x, ``src/main.rs``, ``src/config.rs``,
``src/python_process_info.rs``; the first three seen by running py-spy 0.4.3 here against a
root process as ``nobody``, a ``sleep`` and a dead pid / zombie; the others from py-spy's source
and field logs):

* ``Permission Denied: Try running again with elevated permissions ...`` (non-root), or
  ``Permission Denied`` / ``Permission denied (os error 13)`` / ``Operation not permitted`` (root
  without CAP_SYS_PTRACE).
* ``Failed to find python version from target process`` (not a Python process).
* ``Failed to get process executable name. Check that the process is running.`` (dead pid or
  zombie: told apart by probing the target); ``No such process (os error 3)`` (exited mid-dump).
* ``Collecting stack traces from native extensions (`--native`) is not supported on your
  platform.`` (0.4 wheels without unwinding, e.g. aarch64/macOS); clap's unknown-argument error
  for ``--native`` in older builds.
* ``Unsupported version of Python: X`` (interpreter too new for this py-spy).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import stat as stat_mod
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import anyio
from anyio.abc import ByteReceiveStream

from agent.actors import act_all
from agent.actors.config import PySpyConfig
from agent.early import (
    EarlyRun,
    claim,
    default_executable,
    discard_all,
    discard_pid,
    is_early_tracer,
    pending,
    pyspy_argv,
    pyspy_env,
)
from agent.host import pidfds
from agent.host.fsutil import atomic_write_bytes, atomic_write_text, ensure_private_dir
from agent.host.ownactions import OwnActionLog, stopped_by_us
from agent.host.procinfo import (
    Death,
    Dumper,
    Tracer,
    ancestry,
    death_of,
    deleted_mappings,
    dumpers_of,
    tracer_of,
)
from agent.host.security import process_uids, trusted_owner
from agent.host.targets import (
    ProcessState,
    Target,
    UninterruptibleThread,
    process_state,
    uninterruptible_threads,
)
from agent.model.events import (
    Action,
    ActionResult,
    AttributeValue,
    ComponentStatus,
    IncidentOpened,
    Outcome,
    StacksDumped,
    frozen_attrs,
    now_ns,
)
from agent.model.ranks import parse_title
from agent.model.safetext import safe_text
from agent.model.stacks import (
    clip,
    hung_frame,
    idle_and_stuck,
    parse_dump,
    parse_faulthandler,
    render_text,
    summarize,
    threads_to_json,
)

if TYPE_CHECKING:
    from agent.host.registry import BuildContext
    from agent.model.progress import ActionSink


__all__ = [
    "ACTION",
    "NOTE_ATTR",
    "PERMISSION_HINT",
    "PYSPY_MAX_DEPTH",
    "Classification",
    "PySpyActor",
    "PySpyConfig",
    "PySpyStatistics",
    "classify",
    "create",
    "default_executable",
    "dump_waves",
    "is_python_process",
    "permission_hint",
]

logger = logging.getLogger(__name__)

#: Span name of a py-spy dump (one per target process).
ACTION = Action.PYSPY_DUMP

#: How to grant what py-spy needs to read another process (one line, shown on PERMISSION_DENIED
#: when servewatch does not run as root).
PERMISSION_HINT = (
    "py-spy needs CAP_SYS_PTRACE to read another process: run servewatch as root in the target's "
    "PID namespace, or grant the capability (docker: --cap-add SYS_PTRACE; Kubernetes: "
    "securityContext.capabilities.add: [SYS_PTRACE]; see "
    "https://github.com/benfred/py-spy#how-do-i-run-py-spy-in-docker)"
)
_GRANT = "docker: --cap-add SYS_PTRACE; Kubernetes: securityContext.capabilities.add: [SYS_PTRACE]"
#: bit of CAP_SYS_PTRACE in /proc/PID/status CapEff (linux/capability.h)
_CAP_SYS_PTRACE_BIT = 19


def _own_ptrace_facts() -> tuple[bool | None, str | None]:
    """``(CAP_SYS_PTRACE in this process's effective set, Yama's ptrace_scope)``; ``None`` unknown."""
    cap: bool | None = None
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    cap = bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE_BIT & 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as fh:
            scope: str | None = fh.read().strip()
    except OSError:
        scope = None
    return cap, scope


def permission_hint(*, euid: int | None = None, cap_sys_ptrace: bool | None = None, ptrace_scope: str | None = None) -> str:
    """What to do about a ptrace refusal, for who servewatch runs as (one line).

    Not root: :data:`PERMISSION_HINT` (run as root or grant CAP_SYS_PTRACE). Root: never "run as
    root" again; root without CAP_SYS_PTRACE (a container's default) is told to grant it, root with
    it is told what else refuses ptrace (Yama's ``ptrace_scope`` 3, a seccomp/LSM policy, a target
    in another user namespace).

    Args:
        euid / cap_sys_ptrace / ptrace_scope: this process's facts (read from ``/proc`` when ``None``).
    """
    if euid is None:
        euid = os.geteuid()
    if euid != 0:
        return PERMISSION_HINT
    if cap_sys_ptrace is None and ptrace_scope is None:
        cap_sys_ptrace, ptrace_scope = _own_ptrace_facts()
    if cap_sys_ptrace is False:
        return f"servewatch runs as root but without CAP_SYS_PTRACE, which py-spy needs: grant it ({_GRANT})"
    scope = f"Yama ptrace_scope is {ptrace_scope}" + (" (3: ptrace is off for everyone, until reboot)" if ptrace_scope == "3" else "")
    return (f"servewatch runs as root with CAP_SYS_PTRACE and was still refused: {scope if ptrace_scope else 'check Yama ptrace_scope'},"
            " or a seccomp/AppArmor/SELinux policy forbids ptrace, or the target is in another user namespace")


_MAX_STDERR_BYTES = 64 * 1024
_MAX_DETAIL_CHARS = 300


class PySpyStatistics(NamedTuple):
    """Counters of a :class:`PySpyActor` since it was created."""

    #: dumps requested (calls of act(), including those answered without running py-spy)
    dumps: int
    #: dumps that ended OK
    ok: int
    #: py-spy processes started
    attempts: int
    #: attempts killed because they passed their timeout (or were cancelled)
    groups_killed: int
    #: targets found stopped after a killed attempt and sent SIGCONT
    targets_continued: int


# --- classification -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Classification:
    """What one failed (or successful) py-spy attempt means.

    Attributes:
        outcome: servewatch's name for it.
        detail: one line for a human (includes the fix where there is one).
        retry_plain: a retry without ``--native`` may succeed.
        native_unsupported: this host's py-spy cannot do ``--native`` at all (remember it).
        retryable: the whole action may succeed later (the result's ``retryable``).
    """

    outcome: Outcome
    detail: str = ""
    retry_plain: bool = False
    native_unsupported: bool = False
    retryable: bool = False
    #: py-spy could read the target but not suspend it: another tracer attached at that moment
    collided: bool = False
    #: the target runs but a file py-spy opens is gone (a mapped python/libpython deleted or replaced)
    missing_file: bool = False


def _first_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for line in lines:
        if line.lower().startswith(("error", "permission denied")):
            return clip(line, _MAX_DETAIL_CHARS)
    return clip(lines[0], _MAX_DETAIL_CHARS) if lines else ""


def classify(
    returncode: int | None,
    stderr: str,
    *,
    native: bool,
    timed_out: bool = False,
    target_state: ProcessState = ProcessState.RUNNING,
    pid: int = 0,
    launch_error: OSError | None = None,
) -> Classification:
    """Sort one py-spy attempt into an outcome: the one place py-spy's failures are read.

    Args:
        returncode: py-spy's exit status (``None`` when it was killed).
        stderr: py-spy's stderr (decoded).
        native: whether the attempt passed ``--native``.
        timed_out: the attempt passed its timeout and was killed.
        target_state: the target's state probed right after the failure (py-spy prints the
            same message for a dead pid and a zombie, and a bare "Failed to get stack traces"
            for a stopped one: ``STOPPED`` makes the detail say so, without a plain retry).
        pid: the target, for the detail line.
        launch_error: why py-spy could not be started at all (then the other arguments are
            ignored).

    Returns:
        The classification; ``OK`` only for exit status 0.
    """
    what = f"py-spy dump of pid {pid}"
    settled = _classify_settled(returncode, native=native, timed_out=timed_out, target_state=target_state,
                                pid=pid, launch_error=launch_error, what=what)
    if settled is not None:
        return settled
    error = _first_error_line(stderr)
    lowered = stderr.lower()
    refused = _classify_refused(stderr, lowered, error, native=native, target_state=target_state, what=what)
    if refused is not None:
        return refused
    return _classify_failed(returncode, lowered, error, native=native, target_state=target_state, pid=pid, what=what)


def _classify_settled(
    returncode: int | None, *, native: bool, timed_out: bool, target_state: ProcessState, pid: int,
    launch_error: OSError | None, what: str,
) -> Classification | None:
    """The outcomes decided without reading stderr (``None``: read it)."""
    if launch_error is not None:
        return Classification(
            Outcome.MISSING_TOOL,
            f"could not start py-spy ({type(launch_error).__name__}: {launch_error}): pip install py-spy",
        )
    if timed_out:
        return Classification(
            Outcome.TIMED_OUT,
            f"{what} timed out and was killed" + (" (with --native)" if native else ""),
            retry_plain=native,
            retryable=True,
        )
    if returncode == 0:
        return Classification(Outcome.OK)
    if target_state is ProcessState.GONE:
        return Classification(Outcome.NO_SUCH_PROCESS, f"pid {pid} exited before py-spy could read it")
    if target_state is ProcessState.ZOMBIE:
        return Classification(Outcome.ZOMBIE, f"pid {pid} is a zombie (exited, not reaped): no stacks to read")
    return None


def _classify_refused(
    stderr: str, lowered: str, error: str, *, native: bool, target_state: ProcessState, what: str,
) -> Classification | None:
    """``--native`` refused, another tracer's collision, or permission denied (``None``: none of them)."""
    if native and (
        "is not supported on your platform" in lowered
        or ("--native" in stderr and ("unexpected argument" in lowered or "wasn't expected" in lowered))
    ):
        return Classification(
            Outcome.UNSUPPORTED,
            f"py-spy --native is not supported on this host: {error}",
            retry_plain=True,
            native_unsupported=True,
        )
    if ("failed to suspend process" in lowered and ("eperm" in lowered or "operation not permitted" in lowered)
            and target_state is not ProcessState.STOPPED):
        # the memory was readable (py-spy checks that first), only the ptrace attach was refused:
        # another tracer (a second py-spy, a debugger) held the target at that moment
        return Classification(
            Outcome.FAILED,
            f"{what}: could not suspend it ({error or 'EPERM'}): another tracer was attached at that moment",
            retryable=True,
            collided=True,
        )
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return Classification(Outcome.PERMISSION_DENIED, f"{what}: permission denied. {permission_hint()}")
    return None


def _classify_failed(
    returncode: int | None, lowered: str, error: str, *, native: bool, target_state: ProcessState, pid: int,
    what: str,
) -> Classification:
    """The remaining failures, read from stderr's words and the target's state."""
    if "failed to find python version" in lowered or "failed to find a python interpreter" in lowered:
        return Classification(Outcome.NOT_PYTHON, f"pid {pid} is not a Python process ({error})")
    if "unsupported version of python" in lowered:
        return Classification(Outcome.UNSUPPORTED, f"{what}: {error}; upgrade py-spy")
    if target_state is ProcessState.STOPPED:
        # py-spy must suspend (ptrace) the target; a job-control stop makes that fail with
        # "Failed to suspend process" / "Failed to get stack traces", which says nothing of the stop
        return Classification(
            Outcome.FAILED,
            f"pid {pid} is stopped (state T: SIGSTOP or a debugger): py-spy cannot suspend it"
            f" ({error or 'no error output'}); `kill -CONT {pid}` resumes it",
            retryable=True,
        )
    if "no such process" in lowered or "check that the process is running" in lowered or "check if it is running" in lowered:
        return Classification(Outcome.NO_SUCH_PROCESS, f"pid {pid} is not running ({error})")
    if "no such file or directory" in lowered:
        # the target runs, yet a file py-spy opens is gone: one it maps (its python or libpython)
        # was deleted or replaced since it started (py-spy #109); no attempt of ours brings it back
        return Classification(Outcome.FAILED, f"{what} failed: a file it maps is gone ({error})", missing_file=True)
    status = "killed" if returncode is None else (f"signal {-returncode}" if returncode < 0 else f"exit {returncode}")
    return Classification(
        Outcome.FAILED,
        f"{what} failed ({status}): {error or 'no error output'}",
        retry_plain=native,
        retryable=True,
    )


# --- running py-spy --------------------------------------------------------------------------


@dataclass(slots=True)
class _Attempt:
    argv: list[str]
    native: bool
    returncode: int | None = None
    stdout: bytes = b""
    stderr: str = ""
    stdout_truncated: bool = False
    timed_out: bool = False
    killed: bool = False
    launch_error: OSError | None = None
    early: bool = False
    #: wall-clock start of an early run, ns since the epoch (0: started by this actor)
    early_start_ns: int = 0
    #: the target's threads in uninterruptible sleep (state D) that made this a --nonblocking attempt
    dsleep: tuple[UninterruptibleThread, ...] = ()
    #: that attempt followed a blocking one that timed out
    after_timeout: bool = False


async def _drain(stream: ByteReceiveStream | None, buf: bytearray, limit_bytes: int) -> bool:
    """Read ``stream`` to EOF, keeping at most ``limit_bytes``; returns whether data was dropped."""
    if stream is None:
        return False
    dropped = False
    async for chunk in stream:
        room = limit_bytes - len(buf)
        if room > 0:
            buf += chunk[:room]
        if len(chunk) > room:
            dropped = True
    return dropped


async def _probe(target: Target) -> ProcessState:
    """:func:`process_state` of the target, off the event loop (psutil reads /proc files)."""
    return await anyio.to_thread.run_sync(functools.partial(process_state, target.pid, create_time_s=target.create_time_s))


async def _dsleep(target: Target) -> tuple[UninterruptibleThread, ...]:
    """:func:`~agent.host.targets.uninterruptible_threads` of the target, off the event loop."""
    return await anyio.to_thread.run_sync(uninterruptible_threads, target.pid)


def _said_dsleep(pid: int, dsleep: Sequence[UninterruptibleThread]) -> str:
    """``pid 42 is in uninterruptible sleep (D) in kernel_clone`` (the first thread in ``D``,
    main thread first; another thread is named by its id, more threads are counted)."""
    first = dsleep[0]
    who = f"pid {pid}" if first.main else f"pid {pid} (thread {first.tid})"
    more = f" (+{len(dsleep) - 1} more threads in D)" if len(dsleep) > 1 else ""
    return f"{who} is in uninterruptible sleep (D) in {first.where()}{more}"


#: Longest time a ``--nonblocking`` attempt of a target found in state D after a blocking attempt
#: timed out may add beyond the dump's budget, seconds (such an attempt takes ~0.01-0.5 s).
DSLEEP_NONBLOCKING_S = 5.0

#: Longest wait for another py-spy attached to a target to let go before dumping it, seconds
#: (a py-spy dump of a torch process takes ~0.1-2 s).
TRACER_WAIT_S = 5.0
#: Pause before the one retry of a py-spy that was denied while nobody is attached any more
#: (another tool's attach may have come and gone), seconds.
TRANSIENT_RETRY_S = 0.3
#: Most tries after a dump collided with another py-spy attached to the same target (each after
#: waiting for it to let go, :data:`TRACER_WAIT_S`): with SGLang-style dumps of one scheduler back to
#: back, CI once saw the single retry there was collide again.
COLLISION_RETRIES = 3


def _is_pyspy(tracer: Tracer) -> bool:
    """Whether the tracer's command is a py-spy (another dump of the same target)."""
    first = tracer.title.split(" ", 1)[0] if tracer.title else ""
    return os.path.basename(first).strip("'\"") == "py-spy"


async def _wait_untraced(pid: int, timeout_s: float, seen: dict[int, Dumper] | None = None) -> Tracer | None:
    """Poll (every 50 ms, at most ``timeout_s`` seconds) until nobody is ptrace-attached to
    ``pid`` and no other py-spy run aims at it (:func:`_others`: one about to attach); returns the
    tracer still attached then, or ``None``. The py-spy runs met go into ``seen``."""
    with anyio.move_on_after(timeout_s):
        while True:
            tracer, dumpers = await anyio.to_thread.run_sync(_tracer_and_dumpers, pid)
            if seen is not None:
                seen.update((d.pid, d) for d in dumpers)
            if tracer is None and not dumpers:
                return None
            await anyio.sleep(0.05)
    return await anyio.to_thread.run_sync(_tracer_but_early, pid)


async def _clear_of_others(pid: int, base: dict[str, AttributeValue], seen: dict[int, Dumper]) -> Tracer | None:
    """Before attaching: another dump (a second servewatch, SGLang's own watchdog) attached to
    ``pid`` or about to attach is waited for (it detaches within its dump), at most
    :data:`TRACER_WAIT_S`, rather than collided with (of two attaches, the second fails EPERM);
    returns the tracer still attached (``None``: none), the py-spy runs met go into ``seen``."""
    tracer, dumpers = await anyio.to_thread.run_sync(_tracer_and_dumpers, pid)
    seen.update((d.pid, d) for d in dumpers)
    if (tracer is not None and _is_pyspy(tracer)) or dumpers:
        base["servewatch.pyspy.waited_for_pid"] = tracer.pid if tracer is not None else dumpers[0].pid
        tracer = await _wait_untraced(pid, TRACER_WAIT_S, seen)
    return tracer


def _others(pid: int) -> list[Dumper]:
    """Other py-spy runs aimed at ``pid`` (:func:`agent.host.procinfo.dumpers_of`), not this agent's own
    (its children: its runs and its early runs)."""
    return dumpers_of(pid, exclude_parent=os.getpid())


def _tracer_and_dumpers(pid: int) -> tuple[Tracer | None, list[Dumper]]:
    return _tracer_but_early(pid), _others(pid)


def _server_watchdog_note(target: Target, seen: Mapping[int, Dumper]) -> tuple[str, Dumper] | None:
    """The server's own watchdog dumped ``target`` too (a py-spy run started by the target itself,
    as SGLang's soft watchdog does, or by one of its ancestors, as SGLang's launcher does before a
    crash): one line saying so and that run; ``None`` for none or for a stranger's run."""
    if not seen:
        return None
    family = {target.pid, *ancestry(target.pid)}
    for dumper in seen.values():
        by_pid, by_title = dumper.started_by
        if by_pid in family or target.pid in dumper.chain:
            who = "SGLang's own watchdog" if "sglang" in f"{by_title} {target.title}".lower() else "the server's own watchdog"
            return f"{who} fired: it ran {dumper.describe()} on this process too", dumper
    return None


def _tracer_but_early(pid: int) -> Tracer | None:
    """:func:`tracer_of` ``pid``, except our own early py-spy run reading it (:mod:`agent.early`)."""
    tracer = tracer_of(pid)
    return None if tracer is not None and is_early_tracer(tracer.pid) else tracer


def dump_waves(targets: Sequence[Target]) -> list[list[int]]:
    """The order :meth:`PySpyActor.dump_all` dumps ``targets`` in: indexes into ``targets``, one
    list per wave, each wave's dumps concurrent and a wave starting when the one before it ended.

    The first wave holds the processes whose title names a rank or a coordinator
    (:func:`agent.model.ranks.parse_title`: ``sglang::scheduler_TP1``, ``VLLM::Worker_TP0``,
    ``VLLM::EngineCore``): where a hang is, and what the verdict reads first. The second holds the
    server's other processes (frontends such as ``sglang::detokenizer``, a launcher that kept its
    command line, untitled helpers). Without any rank or coordinator among the targets (a plain
    ``torchrun`` job) there is one wave of all of them.
    """
    first = [i for i, t in enumerate(targets) if _named_role(t.title)]
    if not first or len(first) == len(targets):
        return [list(range(len(targets)))] if targets else []
    chosen = set(first)
    return [first, [i for i in range(len(targets)) if i not in chosen]]


def _named_role(title: str) -> bool:
    info = parse_title(title)
    return info is not None and info.role in ("rank", "coordinator")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _note_watchdog(target: Target, seen: dict[int, Dumper], base: dict[str, AttributeValue]) -> None:
    watchdog = _server_watchdog_note(target, seen)
    if watchdog is not None:
        base[NOTE_ATTR] = watchdog[0]
        base["servewatch.pyspy.server_watchdog_pid"] = watchdog[1].pid


def _note_nonblocking(base: dict[str, AttributeValue], *, stopped: bool, tracer: Tracer | None) -> None:
    """Say why the dump was ``--nonblocking``: the target was stopped, or another tracer held it."""
    if stopped:
        base["servewatch.pyspy.target_stopped"] = True
        base["servewatch.pyspy.nonblocking"] = True
    if tracer is not None:
        base["servewatch.pyspy.traced_by_pid"] = tracer.pid
        base["servewatch.pyspy.traced_by"] = clip(tracer.describe())
        base["servewatch.pyspy.nonblocking"] = True


def _note_attempts(pid: int, attempts: list[tuple[_Attempt, Classification]], base: dict[str, AttributeValue]) -> str:
    """Put the attempts' facts in ``base``; returns what uninterruptible sleep made of the last one."""
    last = attempts[-1][0]
    base["servewatch.pyspy.attempts"] = len(attempts)
    said_d = _note_dsleep(pid, last, base)
    base["servewatch.pyspy.native"] = last.native
    if any(a.early for a, _ in attempts):  # the first attempt started before the CLI's imports
        base["servewatch.pyspy.early_start"] = True
    if any(a.killed for a, _ in attempts):
        base["servewatch.pyspy.killed"] = True
    return said_d


async def _free_stem(artifact_dir: Path, pid: int) -> Path:
    """The first ``pyspy-<pid>[-<serial>]`` stem with neither a ``.txt`` nor an ``.err.txt`` file."""
    stem = artifact_dir / f"pyspy-{pid}"
    serial = 1
    while await anyio.Path(stem.with_name(stem.name + ".txt")).exists() or await anyio.Path(
        stem.with_name(stem.name + ".err.txt")
    ).exists():
        serial += 1
        stem = artifact_dir / f"pyspy-{pid}-{serial}"
    return stem


def _dump_header(target: Target, last: _Attempt, tracer: Tracer | None, said_stopped: str, said_d: str) -> str:
    header = safe_text(f"Process {target.pid}: {target.title or '?'}\n$ {' '.join(last.argv)}\n")
    if said_stopped:
        header += f"# {said_stopped}\n"
    if said_d:
        header += f"# {said_d}\n"
    if tracer is not None:
        header += f"# ptrace-attached by {tracer.describe()}: dumped with --nonblocking (not paused; stacks may be torn)\n"
    return header


def _dump_detail(
    pid: int, thread_count: int, hung: str, idle: tuple[str, ...], stuck: tuple[str, ...], tracer: Tracer | None,
    said_stopped: str, said_d: str,
) -> str:
    if hung:
        detail = f"{thread_count} threads; hung frame: {hung}"
    else:
        detail = f"{thread_count} threads, all idle (waiting for work): nothing is stuck"
    if idle:
        detail += f"; stuck: {', '.join(stuck) or 'none'}; idle: {', '.join(idle)}"
    if said_stopped:
        detail = f"{said_stopped}; {detail}"
    if said_d:
        detail = f"{said_d}; {detail}"
    if tracer is not None:
        detail = (
            f"pid {pid} is ptrace-attached by {tracer.describe()}: dumped with --nonblocking "
            f"(not paused; stacks may be torn); {detail}"
        )
    return detail


class PySpyActor:
    """Dumps Python stacks with py-spy (see the module docstring for the rules).

    One instance per agent: it holds the concurrency limit, the per-pid locks and what it has
    learnt about this host (``--native`` unsupported).
    """

    name = "pyspy"
    action = ACTION
    completed = StacksDumped
    deferred = False

    def __init__(self, config: PySpyConfig | None = None) -> None:
        """Args:
        config: settings; defaults when ``None``.
        """
        self.config = config if config is not None else PySpyConfig()
        #: where each blocking py-spy run is recorded while it holds its target stopped (ptrace),
        #: so that no rule reads that stop as the server's (memory only until the factory sets it)
        self.own_actions = OwnActionLog(None)
        self._native_supported = True
        self._limiter: anyio.CapacityLimiter | None = None
        self._pid_locks: dict[int, anyio.Lock] = {}
        self._dumps = 0
        self._ok = 0
        self._attempts = 0
        self._groups_killed = 0
        self._targets_continued = 0

    # -- status -----------------------------------------------------------------------------

    @property
    def native_enabled(self) -> bool:
        """Whether the next dump will try ``--native`` (config, ``nonblocking`` and what this
        host's py-spy was found to support)."""
        return self.config.native and not self.config.nonblocking and self._native_supported

    def statistics(self) -> PySpyStatistics:
        """Counters since creation."""
        return PySpyStatistics(self._dumps, self._ok, self._attempts, self._groups_killed, self._targets_continued)

    def check(self) -> tuple[ComponentStatus, str]:
        """Startup check, reported as the component's status (the agent keeps running).

        Returns:
            ``(OK, "py-spy at PATH")``, or ``(PERMANENT_ERROR, hint)`` when the binary is missing
            or not executable; dumps then return ``MISSING_TOOL``.
        """
        exe = self.config.executable
        if not exe:
            return (
                ComponentStatus.PERMANENT_ERROR,
                ("py-spy not found next to the Python interpreter or on PATH: pip install py-spy "
                "(or set pyspy.executable)"),
            )
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            return ComponentStatus.PERMANENT_ERROR, f"py-spy executable {exe!r} is missing or not executable: pip install py-spy"
        return ComponentStatus.OK, f"py-spy at {exe}"

    # -- acting -----------------------------------------------------------------------------

    async def run_phase(
        self, opened: IncidentOpened, targets: Sequence[Target], artifact_dir: Path, report: ActionSink
    ) -> list[ActionResult]:
        """The incident phase (:class:`agent.actors.Actor`): :meth:`dump_all`."""
        return await self.dump_all(opened, list(targets), artifact_dir=artifact_dir, report=report)

    async def dump_all(
        self,
        trigger: IncidentOpened,
        targets: Sequence[Target],
        *,
        artifact_dir: Path,
        timeout_s: float | None = None,
        report: ActionSink | None = None,
    ) -> list[ActionResult]:
        """Dump every target concurrently (bounded by ``max_concurrency``, one dump per pid at
        a time), in the waves of :func:`dump_waves`: a server's ranks and coordinators (the
        culprit candidates) all at once first, its other roles (detokenizer, launcher, API
        server) once those are done, so that the ranks' stacks do not share the CPUs with them.

        Args:
            trigger: the incident.
            targets: processes to dump; a pid listed twice is dumped twice, one after the other.
            artifact_dir: where ``pyspy-<pid>.json`` / ``.txt`` go.
            timeout_s: budget of each target's attempts in seconds, counted once its dump starts
                (default: twice ``PySpyConfig.timeout_s``, room for ``--native`` and a fallback).
            report: where each result is sent as soon as it is done (an incident's stream).

        Returns:
            One result per target, in the order of ``targets``.
        """
        budget_s = timeout_s if timeout_s is not None else 2 * self.config.timeout_s
        results: list[ActionResult | None] = [None] * len(targets)
        try:
            for wave in dump_waves(targets):  # the ranks first, all at once; the other roles after
                done = await act_all(self, trigger, [targets[i] for i in wave], timeout_s=budget_s,
                                     artifact_dir=artifact_dir, report=report)  # fmt: skip
                for i, result in zip(wave, done, strict=True):
                    results[i] = result
            return [r for r in results if r is not None]
        finally:
            if pending():  # early runs (agent.early) no dump claimed: not needed any more
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(discard_all, self.config.kill_grace_s)

    async def act(
        self, trigger: IncidentOpened, target: Target, *, timeout_s: float, artifact_dir: Path
    ) -> ActionResult:
        """Dump one target's stacks (action ``pyspy.dump``).

        Args:
            trigger: the incident (used for logging only).
            target: the process.
            timeout_s: budget of all attempts in seconds, counted from when this dump gets its
                slot (waiting for another dump of the same pid or for a free slot is not counted);
                each attempt is further bounded by ``PySpyConfig.timeout_s``.
            artifact_dir: where ``pyspy-<pid>.json`` and ``pyspy-<pid>.txt`` (or
                ``pyspy-<pid>.err.txt`` on failure) are written; created if missing. A further
                dump of the same pid into the same folder writes ``pyspy-<pid>-2.*`` and so on.

        Returns:
            ``OK`` with the stacks summarised in ``attributes``; else ``TIMED_OUT``,
            ``PERMISSION_DENIED``, ``NO_SUCH_PROCESS``, ``ZOMBIE``, ``NOT_PYTHON``,
            ``UNSUPPORTED``, ``MISSING_TOOL`` or ``FAILED``. Never raises for the target's or
            py-spy's misbehaviour (cancellation propagates, after cleanup).
        """
        self._dumps += 1
        start_ns = now_ns()
        base: dict[str, AttributeValue] = {"process.pid": target.pid}
        if target.title:
            base["process.title"] = clip(target.title)
        try:
            result = await self._act(target, timeout_s=timeout_s, artifact_dir=artifact_dir, start_ns=start_ns, base=base)
        except Exception as exc:  # actor boundary: a bug or an OS error becomes an outcome
            logger.exception("pyspy: dump of pid %d for incident %s failed", target.pid, trigger.incident_id)
            result = ActionResult(
                action=ACTION,
                outcome=Outcome.FAILED,
                pid=target.pid,
                retryable=True,
                detail=clip(f"py-spy dump of pid {target.pid} failed: {type(exc).__name__}: {exc}", _MAX_DETAIL_CHARS),
                start_time_unix_nano=start_ns,
                end_time_unix_nano=now_ns(),
                attributes=frozen_attrs(base),
            )
        if result.outcome is Outcome.OK:
            self._ok += 1
        return result

    def _pid_lock(self, pid: int) -> anyio.Lock:
        lock = self._pid_locks.get(pid)
        if lock is None:
            lock = self._pid_locks[pid] = anyio.Lock()
        return lock

    def _release_pid_lock(self, pid: int) -> None:
        lock = self._pid_locks.get(pid)
        if lock is not None and not lock.locked() and lock.statistics().tasks_waiting == 0:
            del self._pid_locks[pid]

    async def _act(
        self,
        target: Target,
        *,
        timeout_s: float,
        artifact_dir: Path,
        start_ns: int,
        base: dict[str, AttributeValue],
    ) -> ActionResult:
        def result(
            outcome: Outcome,
            detail: str,
            *,
            retryable: bool = False,
            paths: tuple[str, ...] = (),
            extra: Mapping[str, AttributeValue] | None = None,
            **attrs: AttributeValue,
        ) -> ActionResult:
            return ActionResult(
                action=ACTION,
                outcome=outcome,
                pid=target.pid,
                retryable=retryable,
                detail=clip(detail, _MAX_DETAIL_CHARS * 2),
                start_time_unix_nano=start_ns,
                end_time_unix_nano=now_ns(),
                artifact_paths=paths,
                attributes=frozen_attrs({**base, **(extra or {})}, **attrs),
            )

        def dead(death: Death) -> ActionResult:
            detail = f"{death.describe(target.title)}: no stacks to read"
            return result(Outcome.DEAD, detail, extra=death.attributes())

        death = await anyio.to_thread.run_sync(death_of, target)
        if death is not None:  # a dead rank is evidence (often why the others hang), not an error
            return dead(death)
        if not self.config.enabled:
            return result(Outcome.SKIPPED, "py-spy dumps are disabled (pyspy.enabled = false)")
        exe = self.config.executable
        status, why = await anyio.to_thread.run_sync(self.check)
        if status is not ComponentStatus.OK or not exe:
            return result(Outcome.MISSING_TOOL, why)

        state = await _probe(target)
        if state is ProcessState.GONE:
            return result(Outcome.NO_SUCH_PROCESS, f"pid {target.pid} is not running (or was reused)")

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.config.max_concurrency)
        lock = self._pid_lock(target.pid)
        try:
            async with lock:
                async with self._limiter:
                    seen: dict[int, Dumper] = {}
                    tracer = await _clear_of_others(target.pid, base, seen)
                    # a stopped process (SIGSTOP, state T) cannot be suspended by py-spy, but it
                    # does not run either: --nonblocking reads it whole, without ptrace
                    stopped = state is ProcessState.STOPPED and tracer is None and not await anyio.to_thread.run_sync(
                        self._stopped_by_us, target.pid)
                    # a thread in uninterruptible sleep (D) never stops for a blocking py-spy
                    dsleep = await _dsleep(target)
                    nonblocking = tracer is not None or stopped or bool(dsleep)
                    attempts = await self._attempts_for(target, exe, timeout_s, nonblocking=nonblocking, dsleep=dsleep)
                    tracer, more = await self._once_more(target, exe, timeout_s, base, seen, attempts[-1][1], tracer=tracer,
                                                         nonblocking=nonblocking)  # fmt: skip
                    attempts += more
                    _note_watchdog(target, seen, base)
                early_ns = attempts[0][0].early_start_ns
                if early_ns:  # the dump began with the early run: its span says so (time and duration)
                    start_ns = min(start_ns, early_ns)
                if attempts[-1][1].outcome in (Outcome.NO_SUCH_PROCESS, Outcome.ZOMBIE):
                    death = await anyio.to_thread.run_sync(death_of, target)
                    if death is not None:
                        return dead(death)
                _note_nonblocking(base, stopped=stopped, tracer=tracer)
                return await self._report(target, attempts, artifact_dir, result, base, tracer=tracer, stopped=stopped)
        finally:
            self._release_pid_lock(target.pid)

    async def _once_more(
        self, target: Target, exe: str, timeout_s: float, base: dict[str, AttributeValue], seen: dict[int, Dumper],
        last: Classification, *, tracer: Tracer | None, nonblocking: bool,
    ) -> tuple[Tracer | None, list[tuple[_Attempt, Classification]]]:
        """The attempts after a first failure that a second try may mend: a denial with no
        tracer seen (:meth:`_after_denial`), or "not a Python process" of a Python process (py-spy
        reads the interpreter's state before it suspends the target, so a thread starting or
        ending at that instant fails the lookup once; py-spy's own ``record`` retries it; a stack
        too deep fails every time). Returns the tracer now and the further attempts (none: no
        second try helps)."""
        if tracer is None and (last.outcome is Outcome.PERMISSION_DENIED or last.collided):
            return await self._after_denial(target, exe, timeout_s, base, seen)
        if last.outcome is Outcome.NOT_PYTHON and await anyio.to_thread.run_sync(is_python_process, target.pid):
            await anyio.sleep(TRANSIENT_RETRY_S)
            base["servewatch.pyspy.retried_not_python"] = True
            return tracer, await self._attempts_for(target, exe, timeout_s, nonblocking=nonblocking)
        return tracer, []

    async def _after_denial(
        self, target: Target, exe: str, timeout_s: float, base: dict[str, AttributeValue],
        seen: dict[int, Dumper] | None = None,
    ) -> tuple[Tracer | None, list[tuple[_Attempt, Classification]]]:
        """py-spy was denied though nobody traced the target before: attached by another tool
        since (or between) our probes. Ask who: another py-spy is waited for and the dump tried
        again, at most :data:`COLLISION_RETRIES` times while each try collides with another py-spy
        (a tool that dumps back to back, as SGLang's watchdog and its fallback do, can attach in
        the instant between our look and our attach) and while ``timeout_s`` seconds have not
        passed; another tracer means a ``--nonblocking`` attempt; nobody means one retry after
        :data:`TRANSIENT_RETRY_S` (a tracer may have come and gone: two dumps at once).

        Returns:
            The tracer (``None``: none now) and the attempts made.
        """
        deadline = anyio.current_time() + max(timeout_s, 0.0)
        done: list[tuple[_Attempt, Classification]] = []
        for collision in range(1, COLLISION_RETRIES + 1):
            tracer = await anyio.to_thread.run_sync(tracer_of, target.pid)
            dumpers = await anyio.to_thread.run_sync(_others, target.pid)
            if seen is not None:
                seen.update((d.pid, d) for d in dumpers)
            if (tracer is not None and _is_pyspy(tracer)) or (tracer is None and dumpers):
                base["servewatch.pyspy.waited_for_pid"] = tracer.pid if tracer is not None else dumpers[0].pid
                base["servewatch.pyspy.retried_after_collision"] = True
                base["servewatch.pyspy.collision_retries"] = collision
                tracer = await _wait_untraced(target.pid, TRACER_WAIT_S, seen)
                done += await self._attempts_for(target, exe, timeout_s, nonblocking=tracer is not None)
                last = done[-1][1]
                denied = last.outcome is Outcome.PERMISSION_DENIED or last.collided
                if tracer is not None or not denied or anyio.current_time() >= deadline:
                    return tracer, done
                continue
            if tracer is not None:
                return tracer, done + await self._attempts_for(target, exe, timeout_s, nonblocking=True)
            if done:  # collided before, and nobody is there now: one more plain try, as below
                return None, done + await self._attempts_for(target, exe, timeout_s)
            await anyio.sleep(TRANSIENT_RETRY_S)
            base["servewatch.pyspy.retried_after_denial"] = True
            return None, await self._attempts_for(target, exe, timeout_s)
        return None, done

    async def _report(
        self,
        target: Target,
        attempts: list[tuple[_Attempt, Classification]],
        artifact_dir: Path,
        result: Callable[..., ActionResult],
        base: dict[str, AttributeValue],
        *,
        tracer: Tracer | None = None,
        stopped: bool = False,
    ) -> ActionResult:
        """Write the artifacts of a finished dump and build its result (under the pid's lock,
        so a second dump of the same pid picks the next free file name). ``stopped``: the target
        was stopped (state T) and dumped with ``--nonblocking``; the detail says so."""
        said_stopped = f"pid {target.pid} is stopped (state T: SIGSTOP or a debugger; `kill -CONT {target.pid}` resumes it): dumped with --nonblocking"
        last, verdict = attempts[-1]
        said_d = _note_attempts(target.pid, attempts, base)
        await anyio.to_thread.run_sync(ensure_private_dir, artifact_dir)
        stem = await _free_stem(Path(artifact_dir), target.pid)

        if verdict.outcome is not Outcome.OK:
            return await self._report_failure(target, attempts, stem, result, base, tracer=tracer, said=said_d)

        if last.stdout_truncated:
            return result(Outcome.FAILED, f"py-spy output for pid {target.pid} exceeded {self.config.max_output_bytes} bytes", retryable=False)
        try:
            threads = parse_dump(last.stdout)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            return result(Outcome.FAILED, f"py-spy exited 0 but its JSON for pid {target.pid} is unreadable: {exc}", retryable=True)

        json_path = stem.with_name(stem.name + ".json")
        txt_path = stem.with_name(stem.name + ".txt")
        header = _dump_header(target, last, tracer, said_stopped if stopped else "", said_d)
        await anyio.to_thread.run_sync(atomic_write_bytes, json_path, last.stdout)
        await anyio.to_thread.run_sync(atomic_write_text, txt_path, render_text(threads, header=header))
        hung = hung_frame(threads)
        stacks = summarize(threads, max_threads=self.config.max_threads, max_frames=self.config.max_frames)
        idle, stuck = idle_and_stuck(threads)
        cap = self.config.max_threads
        detail = _dump_detail(target.pid, len(threads), hung, idle, stuck, tracer, said_stopped if stopped else "", said_d)
        return result(
            Outcome.OK,
            detail,
            paths=(str(json_path), str(txt_path)),
            **{
                "servewatch.pyspy.thread_count": len(threads),
                "servewatch.pyspy.hung_frame": clip(hung),
                "servewatch.pyspy.stacks": stacks,
                "servewatch.pyspy.threads_truncated": len(threads) > cap,
                "servewatch.pyspy.idle_threads": tuple(clip(x) for x in idle[:cap]),
                "servewatch.pyspy.stuck_threads": tuple(clip(x) for x in stuck[:cap]),
            },
        )

    async def _report_failure(
        self,
        target: Target,
        attempts: list[tuple[_Attempt, Classification]],
        stem: Path,
        result: Callable[..., ActionResult],
        base: dict[str, AttributeValue],
        *,
        tracer: Tracer | None,
        said: str = "",
    ) -> ActionResult:
        """The result of a dump that failed: its attempts in ``pyspy-<pid>.err.txt``; a Python
        process py-spy calls "not Python" is a stack too deep for py-spy (:meth:`_too_deep`).
        ``said``: what the target's state made of the attempt (uninterruptible sleep), first in the detail."""
        last, verdict = attempts[-1]
        if verdict.outcome is Outcome.NOT_PYTHON and await anyio.to_thread.run_sync(is_python_process, target.pid):
            return await self._too_deep(target, attempts, stem, result)
        err_path = stem.with_name(stem.name + ".err.txt")
        report = "".join(
            f"$ {' '.join(a.argv)}\n-> {v.outcome.value}"
            f"{'' if a.returncode is None else f' (exit {a.returncode})'}: {v.detail}\n{a.stderr}\n"
            for a, v in attempts
        )
        await anyio.to_thread.run_sync(atomic_write_text, err_path, report)
        if last.returncode is not None:
            base["servewatch.pyspy.exit_code"] = last.returncode
        detail = verdict.detail
        if verdict.missing_file and (gone := await anyio.to_thread.run_sync(deleted_mappings, target.pid)):
            base["servewatch.pyspy.deleted_files"] = tuple(clip(path) for path in gone)
            detail = (f"py-spy cannot read pid {target.pid}: {gone[0]}, which it maps, was deleted or replaced since it "
                      "started (e.g. upgraded under the running process; py-spy reads the interpreter from that file, py-spy "
                      "#109): restore the file or restart the process to dump it")
        if said:
            detail = f"{said}; {detail}"
        if tracer is not None:
            detail = f"pid {target.pid} is ptrace-attached by {tracer.describe()}; {detail}"
        return result(verdict.outcome, detail, retryable=verdict.retryable, paths=(str(err_path),))

    async def _too_deep(
        self, target: Target, attempts: list[tuple[_Attempt, Classification]], stem: Path,
        result: Callable[..., ActionResult],
    ) -> ActionResult:
        """py-spy says "not a Python process" of a process that runs Python: its stack is deeper
        than py-spy reads (about 4096 frames: py-spy then fails to validate the interpreter). Say
        so, and keep what can be read: the innermost frames of every thread from torch's worker
        server (``dump_traceback``, faulthandler's 100 innermost frames per thread), where the
        process serves one (:func:`agent.sdk.serve_torch_worker`)."""
        err_path = stem.with_name(stem.name + ".err.txt")
        report = "".join(f"$ {' '.join(a.argv)}\n-> {v.outcome.value}: {v.detail}\n{a.stderr}\n" for a, v in attempts)
        await anyio.to_thread.run_sync(atomic_write_text, err_path, report)
        why = (f"py-spy could not read the stack of Python process pid {target.pid}: most likely deeper than py-spy "
               f"reads (about {PYSPY_MAX_DEPTH} frames; it then reports 'Failed to find a python interpreter')")
        text = await _dump_traceback(target.pid)
        if text is None:
            note = "stack too deep for py-spy; no partial stack (no torch worker server: agent.sdk.serve_torch_worker())"
            return result(Outcome.FAILED, f"{why}; no torch worker server to ask for a partial stack",
                          paths=(str(err_path),), **{NOTE_ATTR: note})
        threads, truncated = parse_faulthandler(text, pid=target.pid)
        json_path, txt_path = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".txt")
        await anyio.to_thread.run_sync(atomic_write_bytes, json_path, json.dumps(threads_to_json(threads)).encode())
        header = f"Process {target.pid}: {target.title or '?'}\n# {why}\n# partial stack: torch dump_traceback\n"
        await anyio.to_thread.run_sync(atomic_write_text, txt_path, safe_text(header) + text)
        hung = hung_frame(threads)
        part = "innermost 100 frames per thread" if truncated else "every frame"
        note = f"stack too deep for py-spy; partial stack ({part}) from torch dump_traceback"
        return result(
            Outcome.OK, f"{why}; {note}" + (f"; hung frame: {hung}" if hung else ""),
            paths=(str(json_path), str(txt_path), str(err_path)),
            **{NOTE_ATTR: note, "servewatch.pyspy.partial": truncated, "servewatch.pyspy.source": "torch_dump_traceback",
               "servewatch.pyspy.thread_count": len(threads), "servewatch.pyspy.hung_frame": clip(hung)},
        )

    async def _attempts_for(
        self, target: Target, exe: str, timeout_s: float, *, nonblocking: bool = False,
        dsleep: tuple[UninterruptibleThread, ...] = (),
    ) -> list[tuple[_Attempt, Classification]]:
        """Run ``--native`` then, if the failure says it may help, a plain attempt, within
        ``timeout_s`` seconds in all (``nonblocking``: one ``--nonblocking`` attempt, never
        ``--native``, for a target another tool holds ptrace-attached, stopped, or with
        ``dsleep``: its threads in uninterruptible sleep). A blocking attempt that timed out on a
        target in state D now is followed by one ``--nonblocking`` attempt (:data:`DSLEEP_NONBLOCKING_S`)."""
        deadline = anyio.current_time() + max(timeout_s, 0.0)
        native = self.native_enabled and not nonblocking
        done: list[tuple[_Attempt, Classification]] = []
        after_timeout = False
        while True:
            remaining = deadline - anyio.current_time()
            attempt = await self._run_once(
                target, exe, native=native, nonblocking=nonblocking, timeout_s=max(0.0, min(self.config.timeout_s, remaining))
            )
            attempt.dsleep, attempt.after_timeout = (dsleep, after_timeout) if nonblocking else ((), False)
            after = ProcessState.RUNNING
            if attempt.returncode != 0 and attempt.launch_error is None:
                after = await _probe(target)
            verdict = classify(
                attempt.returncode,
                attempt.stderr,
                native=native,
                timed_out=attempt.timed_out,
                target_state=after,
                pid=target.pid,
                launch_error=attempt.launch_error,
            )
            done.append((attempt, verdict))
            if verdict.native_unsupported and self._native_supported:
                self._native_supported = False
                logger.warning("pyspy: --native is not supported by %s on this host; dumping without it from now on", exe)
            if verdict.outcome is Outcome.TIMED_OUT and not nonblocking and (dsleep := await _dsleep(target)):
                # it hung on a thread in D (which takes no stop): read it without stopping it, once
                nonblocking, native, after_timeout = True, False, True
                deadline = max(deadline, anyio.current_time() + DSLEEP_NONBLOCKING_S)
                continue
            if not (verdict.retry_plain and native) or deadline - anyio.current_time() <= 0:
                return done
            native = False

    async def _run_once(self, target: Target, exe: str, *, native: bool, timeout_s: float, nonblocking: bool = False) -> _Attempt:
        """One bounded py-spy run in its own process group; killed (group and all) on timeout
        or cancellation, and the target continued if it was left stopped."""
        argv = pyspy_argv(exe, target.pid, native=native, nonblocking=self.config.nonblocking or nonblocking, locals_=self.config.locals)
        attempt = _Attempt(argv=argv, native=native)
        self._attempts += 1
        # recorded before py-spy starts (or an early run is taken over): its ptrace stop is ours
        # from the first moment
        token = await self._note_stop(target, None, timeout_s, argv)
        early = claim(argv)  # the same run, started before the CLI's imports (agent.early)
        if early is not None:
            try:
                return await self._adopt(early, attempt, target, timeout_s)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._end_stop(token)
        if pending():  # an early run of another argv for this pid must not attach beside ours
            await anyio.to_thread.run_sync(discard_pid, target.pid, self.config.kill_grace_s)
        env = pyspy_env()
        stdout = bytearray()
        stderr = bytearray()
        try:
            proc = await anyio.open_process(argv, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        except OSError as exc:  # vanished or not executable since check(): classified, not raised
            attempt.launch_error = exc
            await self._end_stop(token)
            return attempt
        try:
            return await self._finish_run(proc, attempt, target, timeout_s, stdout, stderr)
        finally:
            with anyio.CancelScope(shield=True):
                await self._end_stop(token)

    async def _note_stop(self, target: Target, tracer_pid: int | None, timeout_s: float, argv: Sequence[str]) -> str | None:
        """Record a blocking run (no ``--nonblocking``) as a ``pyspy_stop`` of ``target`` (by
        ``tracer_pid`` when already known), bounded by the run's own timeout and kill grace;
        ``None`` for a non-blocking run (it never stops the target)."""
        if "--nonblocking" in argv:
            return None
        bound_s = timeout_s + self.config.kill_grace_s + 5.0
        return await anyio.to_thread.run_sync(functools.partial(
            self.own_actions.begin, "pyspy_stop", pid=target.pid, tracer_pid=tracer_pid, bound_s=bound_s,
            detail=f"py-spy dump pid {tracer_pid}"))

    def _stopped_by_us(self, pid: int) -> bool:
        """``pid``'s stop is another servewatch py-spy's dump of it (blocking: reads files)."""
        return stopped_by_us(pid, self.own_actions.active())

    async def _end_stop(self, token: str | None) -> None:
        if token is not None:
            with anyio.move_on_after(2.0):
                await anyio.to_thread.run_sync(self.own_actions.end, token)

    async def _finish_run(self, proc: anyio.abc.Process, attempt: _Attempt, target: Target, timeout_s: float,
                          stdout: bytearray, stderr: bytearray) -> _Attempt:
        """Read a started py-spy run to its end (see :meth:`_run_once`)."""
        scope = anyio.move_on_after(timeout_s)
        try:
            with scope:
                async with anyio.create_task_group() as tg:

                    async def read_stdout() -> None:
                        attempt.stdout_truncated = await _drain(proc.stdout, stdout, self.config.max_output_bytes)

                    tg.start_soon(read_stdout)
                    tg.start_soon(_drain, proc.stderr, stderr, _MAX_STDERR_BYTES)
                attempt.returncode = await proc.wait()
            attempt.timed_out = scope.cancelled_caught
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.kill_grace_s):
                # A timed-out run whose leader already exited may leave group members holding
                # its pipes; the group id cannot be reused while any member lives, so killing it
                # is safe either way.
                if proc.returncode is None or scope.cancelled_caught:
                    attempt.killed = True
                    self._groups_killed += 1
                    _kill_group(proc.pid)
                    await proc.wait()
                    if await _probe(target) is ProcessState.STOPPED:
                        try:
                            # only the process dumped (its pidfd; a /proc read when not held: off the loop)
                            await anyio.to_thread.run_sync(pidfds.send_signal, target, signal.SIGCONT)
                            self._targets_continued += 1
                            logger.warning("pyspy: pid %d was left stopped by a killed py-spy; sent SIGCONT", target.pid)
                        except (ProcessLookupError, PermissionError):
                            pass
                await proc.aclose()
        attempt.stdout = bytes(stdout)
        attempt.stderr = stderr.decode("utf-8", "replace")
        if attempt.timed_out:
            attempt.returncode = None
        return attempt

    async def _adopt(self, early: EarlyRun, attempt: _Attempt, target: Target, timeout_s: float) -> _Attempt:
        """Finish ``attempt`` from an early run of its argv: wait for it (``timeout_s`` counts from
        its start), and on a timeout or cancellation kill its group, reap it and continue the
        target, as :meth:`_run_once` does for its own runs."""
        attempt.early = True
        attempt.early_start_ns = early.started_unix_ns
        remaining_s = timeout_s - (time.monotonic() - early.started_s)
        returncode: int | None = None
        try:
            returncode = await anyio.to_thread.run_sync(early.wait, remaining_s, abandon_on_cancel=True)
        finally:
            with anyio.CancelScope(shield=True):
                if returncode is None:
                    attempt.killed = True
                    self._groups_killed += 1
                    if await anyio.to_thread.run_sync(early.kill, self.config.kill_grace_s):
                        self._targets_continued += 1
                        logger.warning("pyspy: pid %d was left stopped by a killed py-spy; sent SIGCONT", target.pid)
                else:
                    early.close()
        attempt.timed_out = returncode is None
        attempt.returncode = returncode
        attempt.stdout = bytes(early.stdout)
        attempt.stdout_truncated = early.stdout_truncated
        attempt.stderr = early.stderr.decode("utf-8", "replace")
        return attempt


def _note_dsleep(pid: int, last: _Attempt, base: dict[str, AttributeValue]) -> str:
    """Say (in ``base``'s attributes and the returned words) that the last attempt was a
    ``--nonblocking`` one for threads in uninterruptible sleep; ``""`` when it was not."""
    if not last.dsleep:
        return ""
    first = last.dsleep[0]
    base["servewatch.pyspy.nonblocking"] = True
    base["servewatch.pyspy.uninterruptible_wchan"] = clip(first.where())
    base["servewatch.pyspy.uninterruptible_tids"] = tuple(t.tid for t in last.dsleep)
    if last.after_timeout:
        base["servewatch.pyspy.nonblocking_after_timeout"] = True
        return f"{_said_dsleep(pid, last.dsleep)}: the blocking dump timed out; dumped with --nonblocking"
    return f"{_said_dsleep(pid, last.dsleep)}: dumped with --nonblocking"


#: py-spy reads at most this many frames of a thread (its interpreter check fails past it).
PYSPY_MAX_DEPTH = 4096
#: Attribute saying what happened reading a stack, when not plain (read by the verdict).
NOTE_ATTR = "servewatch.pyspy.note"
#: Longest reply read from torch's worker server's ``dump_traceback``, bytes.
_MAX_TRACEBACK_BYTES = 8 * 1024 * 1024


def is_python_process(pid: int) -> bool:
    """Whether ``pid`` runs a Python interpreter: its executable is ``python*`` or it maps
    ``libpython`` (an embedded interpreter)."""
    try:
        if Path(os.readlink(f"/proc/{pid}/exe")).name.startswith("python"):
            return True
        with open(f"/proc/{pid}/maps", "rb") as fh:
            return b"libpython" in fh.read(4 * 1024 * 1024)
    except OSError:
        return False


async def _dump_traceback(pid: int, timeout_s: float = 5.0) -> str | None:
    """faulthandler's traceback of every thread of ``pid`` from torch's worker server on the SDK
    socket (``POST /handler/dump_traceback``, answered on C++ threads); ``None`` when there is no
    such server, it is not the target's user's, or it does not answer in time."""
    import httpx

    from agent.sdk.flightrec import worker_path

    path = await anyio.to_thread.run_sync(worker_path, pid)  # /proc and the SDK's folders: off the loop
    owners = await anyio.to_thread.run_sync(process_uids, pid)
    try:
        st = await anyio.to_thread.run_sync(os.lstat, path)
    except OSError:
        return None
    if not stat_mod.S_ISSOCK(st.st_mode) or not trusted_owner(st, owners):
        return None
    transport = httpx.AsyncHTTPTransport(uds=str(path))
    try:
        async with httpx.AsyncClient(transport=transport, timeout=timeout_s) as client:
            reply = await client.post("http://localhost/handler/dump_traceback")
    except httpx.HTTPError:
        return None
    if reply.status_code != 200 or len(reply.content) > _MAX_TRACEBACK_BYTES:
        return None
    return reply.content.decode("utf-8", "surrogateescape")


def create(config: PySpyConfig, ctx: BuildContext) -> PySpyActor:
    """Registry factory (:data:`agent.actors.ACTORS` ``pyspy``): the stack dumper of ``config``
    (``[pyspy]``; always built: with ``enabled`` off its results say so)."""
    actor = PySpyActor(config)
    actor.own_actions = OwnActionLog(ctx.agent.data_dir, ctx.agent.host_name)
    return actor
