"""CUDA GPU coredumps: trigger an armed target's driver pipe, wait for the dump.

Owns: finding a target's coredump FIFO from ground truth (:func:`locate_pipe`), triggering it
without ever blocking (:func:`trigger_pipe`), waiting for the core file, and the actor tying them
together (:class:`CoredumpActor`, span ``cuda.coredump``). Arming a target (the environment
variables, their templates, the dump-folder guard) is :mod:`agent.host.cudaenv`'s, shared with
``launch`` and ``cuda-env``. May import the stdlib, anyio, pydantic, :func:`agent.actors.act_all`,
:mod:`agent.host.cudaenv`, :mod:`agent.model.events`,
:mod:`agent.actors.coredump_target` (the target's own view: environment sources, path templates,
namespaces), :mod:`agent.host.procinfo` and :mod:`agent.host.targets` only.

Facts this module relies on (see FIELD-NOTES "CUDA user-triggered coredump"):

* The CUDA driver, inside the target, creates the FIFO named by ``CUDA_COREDUMP_PIPE`` at CUDA
  init (``%h`` host name, ``%p`` pid, ``%t`` time are expanded by the driver) and keeps it open
  for reading; any write to it starts a GPU coredump written to ``CUDA_COREDUMP_FILE``. The
  default pipe is ``corepipe.cuda.<host>.<pid>`` relative to the target's cwd. It only does so
  when ``CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1`` was in the environment before CUDA init.
* The default core file is ``core_<time>_<host>_<pid>.nvcudmp`` in the target's cwd (per the
  CUDA-GDB manual's GPU core dump section), i.e. the template ``core_%t_%h_%p.nvcudmp``.
* A blocking open of a FIFO with no reader hangs forever; a non-blocking write-open fails with
  ``ENXIO``. So every open here is ``O_WRONLY | O_NONBLOCK`` and every write is bounded.
* Variables a process sets in ``os.environ`` after start are missing from ``/proc/PID/environ``,
  and setproctitle empties it: the environment is a hint (taken from the nearest trustworthy
  source, see :func:`~agent.actors.coredump_target.effective_env`), the FIFOs the target holds
  open (``/proc/PID/fd``) are the truth.
* In a container ``%h``/``%p`` are the container's host name and pid: matched as wildcards
  (``%p`` the target's ``NSpid``), its paths reached through ``/proc/PID/root``.
* A driver thread that reads the FIFO empties it at once: bytes still unread (``FIONREAD``)
  after ``consume_timeout_s`` mean the trigger was not consumed.

Outcomes of ``cuda.coredump`` (never exceptions): ``OK`` (triggered, core file complete),
``NOT_ARMED`` (no reader / no pipe, with the reason), ``REFUSED`` (dump directory missing,
unwritable or short of space; decided before any trigger), ``TIMED_OUT`` (the pipe stayed full;
or, with ``servewatch.coredump.stage``, ``not_consumed`` / ``not_started`` / ``stalled`` at N
bytes / still ``growing`` at the outer bound), ``SKIPPED`` (already triggered for this pid in
this incident, or disabled), ``DEAD`` (the target exited or is a zombie), ``NO_SUCH_PROCESS``,
``PERMISSION_DENIED``, ``FAILED``.
"""

from __future__ import annotations

import array
import errno
import fcntl
import functools
import glob
import logging
import os
import re
import socket
import stat
import termios
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from agent.actors import act_all
from agent.actors.config import CoredumpConfig
from agent.actors.coredump_target import (
    PathTemplate,
    TargetEnv,
    TargetView,
    effective_env,
    read_environ,
)
from agent.host.cudaenv import (
    DRIVER_DEFAULT_FILE_TEMPLATE,
    DRIVER_DEFAULT_PIPE_TEMPLATE,
    ENV_ENABLE_USER_TRIGGER,
    ENV_FILE,
    ENV_PIPE,
    NO_CUDA_DRIVER,
    SGLANG_FILE_TEMPLATE,
    SGLANG_PIPE_TEMPLATE,
    DumpDirCheck,
    check_dump_dir,
    cuda_driver_present,
)
from agent.host.ownactions import OwnActionLog
from agent.host.procinfo import death_of, same_uts_namespace
from agent.host.targets import Target
from agent.model.events import (
    Action,
    ActionResult,
    AttributeValue,
    CoredumpTriggered,
    IncidentOpened,
    Outcome,
    frozen_attrs,
    now_ns,
)

if TYPE_CHECKING:
    from agent.host.registry import BuildContext
    from agent.model.progress import ActionSink


__all__ = [
    "ACTION",
    "TRIGGER_PAYLOAD",
    "CoredumpActor",
    "CoredumpConfig",
    "PipeLocation",
    "TriggerResult",
    "core_file_glob",
    "core_file_templates",
    "create",
    "locate_pipe",
    "template_glob",
    "trigger_pipe",
]

log = logging.getLogger(__name__)

#: Span name of the action.
ACTION = Action.CUDA_COREDUMP

#: What we write into the FIFO; the driver starts a dump on any data.
TRIGGER_PAYLOAD = b"1"

_PLACEHOLDER = re.compile(r"(%[hpt])")
_MAX_REMEMBERED_INCIDENTS = 256


# --- configuration ----------------------------------------------------------------------------


# --- finding the pipe ---------------------------------------------------------------------------


def template_glob(template: str, *, host: str, pid: int, cwd: str | None = None) -> str:
    """Turn a CUDA path template into a glob pattern for one process (host-side helper).

    ``%h`` and ``%p`` are expanded, ``%t`` (a time chosen by the driver) becomes ``*``, every
    other character is matched literally. A relative template is taken relative to ``cwd``.
    The actor itself matches through :class:`~agent.actors.coredump_target.PathTemplate`
    (``%h`` a wildcard, ``%p`` the target's own namespace pid), which is right in containers.

    Args:
        template: e.g. ``"/tmp/corepipe.cuda.%h.%p"``.
        host: the host name ``%h`` stands for.
        pid: the pid ``%p`` stands for.
        cwd: the target's working directory, for relative templates.

    Returns:
        A pattern for :func:`glob.glob` / :func:`fnmatch.fnmatchcase`.
    """
    pieces: list[str] = []
    for piece in _PLACEHOLDER.split(template):
        if piece == "%h":
            pieces.append(glob.escape(host))
        elif piece == "%p":
            pieces.append(str(pid))
        elif piece == "%t":
            pieces.append("*")
        else:
            pieces.append(glob.escape(piece))
    pattern = "".join(pieces)
    if cwd is not None and not template.startswith("/"):
        pattern = os.path.join(glob.escape(cwd), pattern)
    return pattern


def _guard_dir(template: PathTemplate, host: str | None) -> str:
    """Directory (target view) a core file from ``template`` lands in, as far as it is known.

    ``%p`` becomes the target's namespace pid and ``%h`` its host name when known (same uts
    namespace); the path is cut before the first component still holding a placeholder.
    """
    view = template.view
    expanded = template.absolute.replace("%p", str(view.ns_pid))
    if host is not None:
        expanded = expanded.replace("%h", host)
    directory = os.path.dirname(expanded)
    parts = directory.split("/")
    for index, part in enumerate(parts):
        if _PLACEHOLDER.search(part):
            parts = parts[:index]
            break
    return "/".join(parts) or "/"


def _read_environ(pid: int) -> dict[str, str]:
    """The target's start-up environment, from ``/proc/PID/environ``."""
    return read_environ(pid)


def _read_cwd(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/cwd")


def _fd_access_mode(pid: int, fd: str) -> int | None:
    """``O_ACCMODE`` bits of one of the target's fds (``/proc/PID/fdinfo``), or None."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & os.O_ACCMODE
    except (OSError, ValueError, IndexError):
        return None
    return None


def _open_fds(pid: int) -> Iterator[tuple[str, str, os.stat_result]]:
    """(fd number, link target as the target sees it, stat of the open file) for each fd.

    Raises:
        ProcessLookupError / PermissionError: the fd table cannot be read.
    """
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    for name in names:
        link = f"/proc/{pid}/fd/{name}"
        try:
            target = os.readlink(link)
            st = os.stat(link)
        except OSError:
            continue  # closed since listdir
        yield name, target, st


@dataclass(frozen=True, slots=True)
class PipeLocation:
    """Where a target's coredump FIFO is, or why none was found.

    Attributes:
        pid: the target.
        path: the FIFO as the target sees it, or ``None``.
        source: how it was found: ``"fd"`` (a FIFO the target holds open for reading),
            ``"environ"`` (the ``CUDA_COREDUMP_PIPE`` that applies to it, see
            :func:`~agent.actors.coredump_target.effective_env`) or ``"default"`` (the driver's
            default name in the target's cwd); ``""`` when not found.
        pattern: the template the environment/default gave (absolute, placeholders kept).
        reason: when ``path`` is ``None``: why the target counts as not armed.
        fd: the target's fd number when ``source == "fd"``.
        inode: ``(st_dev, st_ino)`` of the FIFO when found.
        root: prefix reaching the target's paths from here (``/proc/PID/root`` in another mount
            namespace, else ``""``).
        env_source: where the coredump environment came from (``environ``, ``launch:<pid>``,
            ``parent:<pid>``, ``""``).
    """

    pid: int
    path: str | None
    source: str
    pattern: str
    reason: str = ""
    fd: str | None = None
    inode: tuple[int, int] | None = None
    root: str = ""
    env_source: str = ""


def _pipe_templates(env: TargetEnv, extra_templates: Sequence[str]) -> list[str]:
    """Pipe templates to accept in the fd scan, the applicable one first."""
    names = [env.values.get(ENV_PIPE) or DRIVER_DEFAULT_PIPE_TEMPLATE, *extra_templates, SGLANG_PIPE_TEMPLATE]
    return list(dict.fromkeys(names))


def locate_pipe(
    pid: int,
    *,
    host: str | None = None,
    extra_templates: Sequence[str] = (SGLANG_PIPE_TEMPLATE,),
    scan_fds: bool = True,
    record_dirs: Sequence[str | os.PathLike[str]] = (),
    env: TargetEnv | None = None,
) -> PipeLocation:
    """Find the coredump FIFO of process ``pid`` from ground truth, in the target's own view.

    First a FIFO the target holds open for reading (``/proc/PID/fd``, ``S_ISFIFO``,
    ``/proc/PID/fdinfo`` access mode) whose path, as the target sees it, fits the pipe template
    that applies to it, one of ``extra_templates``, or the driver's default name
    ``corepipe.cuda.%h.%p`` in any directory (``%h`` any host name, ``%p`` its namespace pid:
    a container's driver names them). Then, as a fallback, the applicable template's existing
    FIFOs, reached through ``/proc/PID/root`` when the target has its own mount namespace.

    The applicable environment is :func:`~agent.actors.coredump_target.effective_env`: its own
    ``/proc/PID/environ``, else what ``servewatch launch`` recorded (``record_dirs``), else an
    ancestor's environ, because setproctitle empties a worker's ``/proc/PID/environ``.

    Args:
        pid: the target process.
        host: unused for matching (kept for callers; ``%h`` is matched as a wildcard).
        extra_templates: more pipe templates to accept in the fd scan (e.g. the configured one).
        scan_fds: scan the target's fds (``False`` only to exercise the fallback).
        record_dirs: folders of launch records (``<data_dir>/launched``).
        env: the applicable environment when the caller already has it.

    Returns:
        The location; ``path is None`` with a ``reason`` when not armed.

    Raises:
        ProcessLookupError: the process does not exist.
        PermissionError: ``/proc/PID`` cannot be read (needs the same user or root).
    """
    del host
    view = TargetView.of(pid)
    if env is None:
        env = effective_env(pid, record_dirs=record_dirs)
    env_template = env.values.get(ENV_PIPE)
    template = env_template or DRIVER_DEFAULT_PIPE_TEMPLATE
    source = "environ" if env_template else "default"
    applicable = PathTemplate(template, view)
    located = functools.partial(
        PipeLocation, pid=pid, pattern=applicable.absolute, root=view.root, env_source=env.source
    )

    if scan_fds:
        held = _held_fifo(pid, view, _pipe_templates(env, extra_templates))
        if held is not None:
            fd, target, st = held
            return located(path=target, source="fd", fd=fd, inode=(st.st_dev, st.st_ino))

    fifos, non_fifo = _existing_fifos(applicable, view)
    if fifos:
        _, path, inode = max(fifos)
        return located(path=path, source=source, inode=inode)
    return located(path=None, source="", reason=_not_armed_reason(pid, env, applicable, non_fifo=non_fifo,
                                                                  env_template=env_template))


def _held_fifo(pid: int, view: TargetView, templates: Sequence[str]) -> tuple[str, str, os.stat_result] | None:
    """The first FIFO ``pid`` holds open for reading whose path fits one of ``templates`` or
    the driver's default name in any directory: ``(fd, path, stat)``; ``None``: none."""
    accepted = [PathTemplate(t, view).regex() for t in templates]
    accepted.append(PathTemplate("/" + DRIVER_DEFAULT_PIPE_TEMPLATE, view).regex())
    anywhere = re.compile(r".*/" + accepted[-1].pattern.lstrip("/"))
    for fd, target, st in _open_fds(pid):
        if not stat.S_ISFIFO(st.st_mode) or not target.startswith("/"):
            continue  # anonymous pipes read as "pipe:[inode]"
        if _fd_access_mode(pid, fd) not in (os.O_RDONLY, os.O_RDWR):
            continue
        if any(p.fullmatch(target) for p in accepted) or anywhere.fullmatch(target):
            return fd, target, st
    return None


def _existing_fifos(
    applicable: PathTemplate, view: TargetView,
) -> tuple[list[tuple[float, str, tuple[int, int]]], str]:
    """The template's existing FIFOs as ``(mtime, path, inode)``, and the last match that is not a FIFO."""
    fifos: list[tuple[float, str, tuple[int, int]]] = []
    non_fifo = ""
    for candidate in applicable.existing():
        try:
            st = os.stat(view.here(candidate))
        except OSError:
            continue
        if stat.S_ISFIFO(st.st_mode):
            fifos.append((st.st_mtime, candidate, (st.st_dev, st.st_ino)))
        else:
            non_fifo = candidate
    return fifos, non_fifo


def _not_armed_reason(pid: int, env: TargetEnv, applicable: PathTemplate, *, non_fifo: str, env_template: str | None) -> str:
    """Why no coredump FIFO was found, and what to do about it."""
    if env.values.get(ENV_ENABLE_USER_TRIGGER) != "1":
        if env.environ_cleared:
            return (
                f"not armed: it holds no coredump FIFO open, and its /proc/{pid}/environ is empty (setproctitle"
                " clears it; start it with SPT_NOENV=1) while no launch record or parent environment has"
                f" {ENV_ENABLE_USER_TRIGGER}=1"
            )
        return (
            f"not armed: {ENV_ENABLE_USER_TRIGGER}=1 is not in the target's environment and it holds no "
            "coredump FIFO open (start it with `servewatch launch` or the `servewatch cuda-env` exports)"
        )
    if non_fifo:
        return f"not armed: {non_fifo!r} matches the pipe template but is not a FIFO"
    if env_template:
        return (
            f"not armed: no FIFO matches {applicable.absolute!r} from {ENV_PIPE} (CUDA not initialised yet in the "
            "target, or the pipe path differs)"
        )
    return (
        f"not armed: {ENV_PIPE} is unset and the driver's default FIFO {applicable.absolute!r} does not exist "
        "(CUDA not initialised yet in the target, or the pipe path differs)"
    )


# --- triggering ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TriggerResult:
    """What one write to a coredump FIFO did.

    Attributes:
        outcome: ``OK`` (payload written and read by the driver), ``NOT_ARMED`` (no reader,
            vanished, not a FIFO), ``TIMED_OUT`` (pipe full until the deadline, or the payload
            still unread after ``consume_timeout_s``: ``consumed`` is False),
            ``PERMISSION_DENIED`` or ``FAILED``.
        detail: one line.
        time_unix_nano: when the payload was written (0 when it was not).
        consumed: the driver read the payload (``None`` when not checked).
        consume_s: seconds from the write until the pipe was empty again.
    """

    outcome: Outcome
    detail: str
    time_unix_nano: int = 0
    consumed: bool | None = None
    consume_s: float | None = None


def _open_for_trigger(location: PipeLocation) -> int:
    """Open the FIFO write-only without blocking; verify it is the FIFO that was found.

    Tries the path through the target's root (another mount namespace), then as is, then the
    target's own fd (``/proc/PID/fd/N``); the inode found must be the one located.
    """
    path = location.path
    assert path is not None
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC
    candidates = [location.root + path] if location.root else [path]
    if location.fd is not None:
        candidates.append(f"/proc/{location.pid}/fd/{location.fd}")
    fd = -1
    error: OSError | None = None
    for candidate in candidates:
        try:
            fd = os.open(candidate, flags)
        except FileNotFoundError as exc:
            error = exc
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISFIFO(st.st_mode):
                raise OSError(errno.EINVAL, "is not a FIFO", path)
            if location.inode is not None and (st.st_dev, st.st_ino) != location.inode:
                if candidate != candidates[-1]:
                    os.close(fd)
                    fd = -1
                    continue  # a different file of the same name here: try the next way in
                raise OSError(errno.EINVAL, "was replaced since it was found", path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return fd
    assert error is not None
    raise error


def _unread_bytes(fd: int) -> int:
    """Bytes waiting in the pipe (``FIONREAD`` on our writer fd); -1 when unknown."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return -1
    return buf[0]


async def trigger_pipe(
    location: PipeLocation,
    *,
    timeout_s: float,
    poll_interval_s: float = 0.01,
    payload: bytes = TRIGGER_PAYLOAD,
    consume_timeout_s: float | None = None,
) -> TriggerResult:
    """Write ``payload`` to a coredump FIFO, never blocking, bounded by ``timeout_s``; then
    (with ``consume_timeout_s``) watch the driver read it.

    Opens with ``O_WRONLY | O_NONBLOCK`` (``ENXIO`` = nobody reads = not armed), refuses
    anything but a FIFO, then retries ``EAGAIN`` (pipe full: a reader that stopped reading)
    with anyio sleeps until the deadline. A driver thread that reads the pipe empties it at
    once: bytes still there (``FIONREAD``) after ``consume_timeout_s`` mean the trigger was
    not consumed, and no core file will come.

    Args:
        location: from :func:`locate_pipe`, with ``path`` set.
        timeout_s: deadline for open + write, in seconds.
        poll_interval_s: wait between retries of a full pipe, in seconds.
        payload: bytes to write; the driver starts a dump on any data.
        consume_timeout_s: how long the written bytes may stay unread, in seconds (``None``:
            not checked).

    Returns:
        The :class:`TriggerResult`.
    """
    if location.path is None:
        return TriggerResult(Outcome.NOT_ARMED, location.reason)
    path = location.path
    try:
        fd = _open_for_trigger(location)
    except OSError as exc:
        return TriggerResult(*_classify_open_error(exc, path))
    try:
        written = await _write_trigger(fd, path, payload, timeout_s=timeout_s, poll_interval_s=poll_interval_s)
        if isinstance(written, TriggerResult):
            return written
        if consume_timeout_s is None:
            return TriggerResult(Outcome.OK, f"triggered through {path!r}", written)
        return await _watch_consumed(fd, path, written, consume_timeout_s=consume_timeout_s, poll_interval_s=poll_interval_s)
    finally:
        os.close(fd)


async def _write_trigger(fd: int, path: str, payload: bytes, *, timeout_s: float, poll_interval_s: float) -> TriggerResult | int:
    """Write ``payload`` to the FIFO, retrying a full pipe until ``timeout_s``: the time it was
    written (ns since the epoch), or the result that ends the trigger."""
    written_ns = 0
    with anyio.move_on_after(timeout_s) as scope:
        while True:
            try:
                written = os.write(fd, payload)
            except BlockingIOError:
                await anyio.sleep(poll_interval_s)
                continue
            except BrokenPipeError:
                return TriggerResult(Outcome.NOT_ARMED, f"not armed: the reader of {path!r} went away")
            except OSError as exc:
                return TriggerResult(Outcome.FAILED, f"write to {path!r} failed: {exc.strerror or exc}")
            if written > 0:
                written_ns = now_ns()
                break
    if not written_ns:
        assert scope.cancelled_caught
        return TriggerResult(
            Outcome.TIMED_OUT, f"{path!r} stayed full for {timeout_s:g} s: its reader is not reading"
        )
    return written_ns


async def _watch_consumed(fd: int, path: str, written_ns: int, *, consume_timeout_s: float, poll_interval_s: float) -> TriggerResult:
    """Wait until the driver read the trigger (the pipe is empty), at most ``consume_timeout_s``."""
    start = anyio.current_time()
    while True:
        unread = _unread_bytes(fd)
        waited = anyio.current_time() - start
        if unread == 0:
            return TriggerResult(Outcome.OK, f"triggered through {path!r}", written_ns, True, round(waited, 6))
        if unread < 0:
            return TriggerResult(Outcome.OK, f"triggered through {path!r}", written_ns, None)
        if waited >= consume_timeout_s:
            return TriggerResult(
                Outcome.TIMED_OUT,
                f"not consumed: the trigger written to {path!r} was still unread after {consume_timeout_s:g} s"
                f" ({unread} byte(s) in the pipe): the driver's reader is not reading, no core file will come",
                written_ns,
                False,
            )
        await anyio.sleep(min(poll_interval_s, 0.01))


def _classify_open_error(exc: OSError, path: str) -> tuple[Outcome, str]:
    """Sort an ``open(2)`` failure on the FIFO into our terms (the one place that does)."""
    if exc.errno == errno.ENXIO:
        return Outcome.NOT_ARMED, f"not armed: no process has {path!r} open for reading (ENXIO)"
    if isinstance(exc, FileNotFoundError):
        return Outcome.NOT_ARMED, f"not armed: {path!r} disappeared before the trigger"
    if isinstance(exc, PermissionError):
        return Outcome.PERMISSION_DENIED, f"cannot open {path!r} for writing: permission denied"
    if exc.errno == errno.EINVAL:
        return Outcome.NOT_ARMED, f"not armed: {path!r} {exc.strerror}"
    return Outcome.FAILED, f"cannot open {path!r}: {exc.strerror or exc}"


# --- completion ---------------------------------------------------------------------------------


def core_file_templates(env: TargetEnv, config: CoredumpConfig) -> list[str]:
    """Core-file templates to watch for one target, the applicable one first.

    The target's own ``CUDA_COREDUMP_FILE`` when known; when its environment is unknown
    (setproctitle cleared it and nothing else told), also the one servewatch arms with
    (``{folder}/%h/core.cuda.%t.%p``); and always the driver's default
    (``core_%t_%h_%p.nvcudmp`` in its cwd).
    """
    names: list[str] = []
    if env.values.get(ENV_FILE):
        names.append(env.values[ENV_FILE])
    if not env.values:
        names.append(SGLANG_FILE_TEMPLATE.format(folder=str(Path(config.folder).absolute())))
    names.append(DRIVER_DEFAULT_FILE_TEMPLATE)
    return list(dict.fromkeys(names))


def core_file_glob(pid: int, *, host: str | None = None) -> tuple[str, str]:
    """Glob pattern of ``pid``'s core file and the template it came from (host-side helper).

    From ``CUDA_COREDUMP_FILE`` that applies to it (else the driver's default
    ``core_%t_%h_%p.nvcudmp``), ``%h``/``%p`` expanded, ``%t`` a wildcard, relative to the
    target's cwd.

    Raises:
        ProcessLookupError / PermissionError: ``/proc/PID`` is gone or unreadable.
    """
    env = effective_env(pid)
    cwd = TargetView.of(pid).cwd
    template = env.values.get(ENV_FILE) or DRIVER_DEFAULT_FILE_TEMPLATE
    return template_glob(template, host=host or socket.gethostname(), pid=pid, cwd=cwd), template


def _snapshot(templates: Sequence[PathTemplate]) -> dict[str, int]:
    """path (target view) -> mtime (ns) of every current match, to tell new dumps from old ones."""
    found: dict[str, int] = {}
    for template in templates:
        for path in template.existing():
            try:
                found[path] = os.stat(template.view.here(path)).st_mtime_ns
            except OSError:
                continue
    return found


def _newest_new(templates: Sequence[PathTemplate], before: Mapping[str, int]) -> tuple[str, int] | None:
    """The newest regular file matching a template that is new or changed since ``before``."""
    best: tuple[int, str, int] | None = None
    for template in templates:
        for path in template.existing():
            try:
                st = os.stat(template.view.here(path))
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if path in before and st.st_mtime_ns <= before[path]:
                continue
            if best is None or st.st_mtime_ns > best[0]:
                best = (st.st_mtime_ns, path, st.st_size)
    return None if best is None else (best[1], best[2])


def _held_open_by(pid: int, path: str) -> bool:
    """Whether ``pid`` still has ``path`` (target view) open (the driver is still writing it)."""
    try:
        return any(target == path for _, target, _ in _open_fds(pid))
    except (ProcessLookupError, PermissionError):
        return False


def _opened_core(pid: int, templates: Sequence[PathTemplate], before: Mapping[str, int]) -> str | None:
    """A file fitting a core template that the target holds open and that is new (started)."""
    try:
        for _, target, st in _open_fds(pid):
            if stat.S_ISREG(st.st_mode) and target not in before and any(t.matches(target) for t in templates):
                return target
    except (ProcessLookupError, PermissionError):
        return None
    return None


@dataclass(slots=True)
class _Completion:
    path: str | None = None
    size_bytes: int = 0
    complete: bool = False
    end_unix_nano: int = 0
    #: how the wait ended: complete, not_started, stalled, growing (outer bound), gone
    stage: str = ""
    waited_s: float = 0.0


async def _await_core_file(
    pid: int,
    templates: Sequence[PathTemplate],
    before: Mapping[str, int],
    *,
    timeout_s: float,
    settle_s: float,
    poll_interval_s: float,
    start_timeout_s: float,
    stall_timeout_s: float,
) -> _Completion:
    """Wait for a new core file, bounded by progress: it must start within ``start_timeout_s``
    (a new matching file, or one the target opened), and grow (or be closed) at least every
    ``stall_timeout_s``; it is complete once its size held for ``settle_s`` and the target no
    longer holds it open. ``timeout_s`` bounds the whole wait."""
    seen = _Completion()
    begin = anyio.current_time()
    changed_at = begin
    with anyio.move_on_after(timeout_s):
        while True:
            found = await anyio.to_thread.run_sync(_newest_new, templates, before)
            now = anyio.current_time()
            seen.waited_s = now - begin
            if found is None:
                opened = await anyio.to_thread.run_sync(_opened_core, pid, templates, before)
                if opened is not None:
                    found = (opened, 0)
            if found is None:
                if now - begin >= start_timeout_s:
                    seen.stage = "not_started"
                    return seen
            elif (found[0], found[1]) != (seen.path, seen.size_bytes):
                seen.path, seen.size_bytes = found
                seen.end_unix_nano = now_ns()
                changed_at = now
            else:
                held = await anyio.to_thread.run_sync(_held_open_by, pid, found[0])
                if not held and found[1] > 0 and now - changed_at >= settle_s:
                    seen.complete, seen.stage = True, "complete"
                    return seen
                if now - changed_at >= stall_timeout_s:
                    seen.stage = "stalled"
                    return seen
            await anyio.sleep(poll_interval_s)
    seen.waited_s = anyio.current_time() - begin
    seen.stage = "growing" if seen.path else "not_started"
    return seen


# --- the actor ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Prepared:
    location: PipeLocation
    templates: tuple[PathTemplate, ...]
    dump_dir: Path
    guard: DumpDirCheck | None = None
    before: Mapping[str, int] = field(default_factory=dict)
    env: TargetEnv = field(default_factory=TargetEnv)
    view: TargetView | None = None


@contextmanager
def _proc_errors(pid: int) -> Iterator[list[tuple[Outcome, str]]]:
    """Turn ``/proc`` access failures into outcomes (the one place that does)."""
    failure: list[tuple[Outcome, str]] = []
    try:
        yield failure
    except ProcessLookupError:
        failure.append((Outcome.NO_SUCH_PROCESS, f"process {pid} does not exist"))
    except PermissionError:
        failure.append(
            (Outcome.PERMISSION_DENIED, f"cannot read /proc/{pid}: run servewatch as the target's user or root")
        )



def _note_prepared(attrs: dict[str, AttributeValue], prepared: _Prepared) -> None:
    """The span attributes of what was learnt before triggering: where a core file goes, the
    pipe and where it was found, the target's namespace pid and root."""
    assert prepared.view is not None
    attrs["servewatch.coredump.file_pattern"] = tuple(t.absolute for t in prepared.templates)
    attrs["servewatch.coredump.pipe_source"] = prepared.location.source
    attrs["servewatch.coredump.env_source"] = prepared.env.source or "none"
    attrs["servewatch.coredump.ns_pid"] = prepared.view.ns_pid
    if prepared.view.root:
        attrs["servewatch.coredump.root"] = prepared.view.root


def _note_fired(attrs: dict[str, AttributeValue], fired: TriggerResult) -> None:
    """The span attributes of the trigger: whether it was written, read by the driver, and when."""
    attrs["servewatch.coredump.triggered"] = bool(fired.time_unix_nano)
    if fired.consumed is not None:
        attrs["servewatch.coredump.consumed"] = fired.consumed
    if fired.time_unix_nano:
        attrs["servewatch.coredump.trigger_time_unix_nano"] = fired.time_unix_nano
    if fired.outcome is not Outcome.OK and fired.consumed is False:
        attrs["servewatch.coredump.stage"] = "not_consumed"

class CoredumpActor:
    """Triggers CUDA user coredumps of incident targets and waits for the core files.

    One trigger per ``(incident_id, pid)`` at most; later calls for the same pair return
    ``SKIPPED``. Every wait is bounded by progress (see :class:`CoredumpConfig`). Span
    ``cuda.coredump`` attributes: ``process.pid``, ``servewatch.coredump.pipe``,
    ``.pipe_source``, ``.env_source``, ``.ns_pid``, ``.root``, ``.file_pattern`` (templates
    watched), ``.dump_dir``, ``.triggered``, ``.trigger_time_unix_nano``, ``.consumed``,
    ``.stage`` (``not_consumed``, ``not_started``, ``stalled``, ``growing``, ``complete``),
    ``.path``, ``.path_in_target``, ``.size_bytes``, ``.write_duration_s`` (trigger to
    complete file), ``.complete``.
    """

    name = "cuda_coredump"
    action = ACTION
    completed = CoredumpTriggered
    deferred = False

    def __init__(
        self,
        config: CoredumpConfig | None = None,
        *,
        host: str | None = None,
        trusted_uids: Sequence[int] = (),
        record_dirs: Sequence[str | os.PathLike[str]] = (),
        driver_present: Callable[[int], bool] = cuda_driver_present,
    ) -> None:
        """Create the actor.

        Args:
            config: user configuration; defaults when ``None``.
            host: the agent's host name (``%h`` of a target in the agent's own uts namespace);
                default :func:`socket.gethostname`. A target in another uts namespace has its
                ``%h`` matched as a wildcard.
            trusted_uids: uids (besides root and the agent's own) whose targets may have their
                core files written outside ``config.folder`` (the ``target.uids`` setting).
            record_dirs: folders holding ``servewatch launch`` records (``<data_dir>/launched``).
            driver_present: whether a CUDA driver can be there for a pid (default
                :func:`~agent.host.cudaenv.cuda_driver_present`: the NVIDIA module, its device, or
                ``libcuda.so`` in the target). A target not armed where it is absent ends
                ``not_armed`` with :data:`~agent.host.cudaenv.NO_CUDA_DRIVER` and the attribute
                ``servewatch.coredump.no_gpu`` instead of the arming hint. Tests that stand in
                for the CUDA driver (its FIFO) say a GPU host is there.
        """
        self.config = config or CoredumpConfig()
        self._driver_present = driver_present
        self.host = host or socket.gethostname()
        self.trusted_uids = frozenset({0, os.geteuid(), *trusted_uids})
        self.record_dirs = tuple(record_dirs)
        self._triggered: OrderedDict[str, set[int]] = OrderedDict()
        #: where each coredump is recorded while it pauses its target (memory only by default)
        self.own_actions = OwnActionLog(None)

    def _claim(self, incident_id: str, pid: int) -> bool:
        """Record a trigger of ``pid`` for ``incident_id``; False when already recorded."""
        pids = self._triggered.get(incident_id)
        if pids is None:
            pids = self._triggered[incident_id] = set()
            while len(self._triggered) > _MAX_REMEMBERED_INCIDENTS:
                self._triggered.popitem(last=False)
        if pid in pids:
            return False
        pids.add(pid)
        return True

    @property
    def budget_s(self) -> float:
        """Bound of one target's action with this config: delay + trigger + consume + completion."""
        cfg = self.config
        return cfg.delay_s + cfg.trigger_timeout_s + cfg.consume_timeout_s + cfg.completion_timeout_s

    async def run_phase(
        self, opened: IncidentOpened, targets: Sequence[Target], artifact_dir: Path, report: ActionSink
    ) -> list[ActionResult]:
        """The incident phase (:class:`agent.actors.Actor`): :meth:`trigger_all`, registered
        after the stack dumps so it runs right when they finish."""
        return await self.trigger_all(opened, list(targets), artifact_dir=artifact_dir, report=report)

    async def trigger_all(
        self, trigger: IncidentOpened, targets: Sequence[Target], *, artifact_dir: Path, report: ActionSink | None = None
    ) -> list[ActionResult]:
        """Trigger every armed target at once, then wait (bounded) for all core files.

        Call right after the incident's py-spy dumps finished; after ``delay_s`` (default 0)
        every trigger is written within milliseconds (all targets concurrently), then each core
        file is awaited.

        Args:
            trigger: the incident.
            targets: processes to dump (duplicates by pid are dumped once).
            artifact_dir: the incident bundle directory.
            report: where each result is sent as soon as it is done (an incident's stream).

        Returns:
            One result per target, in ``targets`` order.
        """
        if self.config.delay_s > 0 and self.config.enabled:
            await anyio.sleep(self.config.delay_s)
        timeout_s = self.budget_s - self.config.delay_s
        return await act_all(self, trigger, targets, timeout_s=timeout_s, artifact_dir=artifact_dir, report=report)

    async def act(
        self, trigger: IncidentOpened, target: Target, *, timeout_s: float, artifact_dir: Path
    ) -> ActionResult:
        """Trigger ``target``'s CUDA coredump and wait for the core file, within ``timeout_s``.

        Never raises for a target's misbehaviour (cancellation propagates).

        Args:
            trigger: the incident (``incident_id`` deduplicates triggers).
            target: the process.
            timeout_s: bound on the whole action, in seconds (the trigger and completion bounds
                of the config apply within it).
            artifact_dir: the incident bundle directory (the core file stays where the driver
                wrote it; its path is recorded).

        Returns:
            The ``cuda.coredump`` result (see the module docstring for outcomes).
        """
        start_ns = now_ns()
        attrs: dict[str, AttributeValue] = {"process.pid": target.pid}

        def result(outcome: Outcome, detail: str, *, retryable: bool = False, paths: tuple[str, ...] = ()) -> ActionResult:
            return ActionResult(
                action=ACTION,
                outcome=outcome,
                pid=target.pid,
                retryable=retryable,
                detail=detail,
                start_time_unix_nano=start_ns,
                end_time_unix_nano=now_ns(),
                artifact_paths=paths,
                attributes=frozen_attrs(attrs),
            )

        death = await anyio.to_thread.run_sync(death_of, target)
        if death is not None:  # reported as dead in every action: a dead rank is evidence
            attrs.update(death.attributes())
            return result(Outcome.DEAD, f"{death.describe(target.title)}: no GPU coredump to trigger")
        if not self.config.enabled:
            return result(Outcome.SKIPPED, "cuda coredumps are disabled in the configuration")
        # the driver pauses the target while it writes the core: servewatch's doing, recorded
        token = await anyio.to_thread.run_sync(functools.partial(
            self.own_actions.begin, "coredump_pause", pid=target.pid, bound_s=timeout_s, incident_id=trigger.incident_id))
        try:
            with anyio.move_on_after(timeout_s) as scope:
                return await self._act(trigger, target, attrs, result, timeout_s=timeout_s)
            assert scope.cancelled_caught
            return result(Outcome.TIMED_OUT, f"cuda coredump did not finish within {timeout_s:g} s", retryable=True)
        except Exception as exc:  # boundary: a target's misbehaviour never crashes the agent
            log.exception("cuda coredump of pid %d failed", target.pid)
            return result(Outcome.FAILED, f"unexpected error: {type(exc).__name__}: {exc}")
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                await anyio.to_thread.run_sync(self.own_actions.end, token)

    async def _act(
        self,
        trigger: IncidentOpened,
        target: Target,
        attrs: dict[str, AttributeValue],
        result: Callable[..., ActionResult],
        *,
        timeout_s: float,
    ) -> ActionResult:
        """Body of :meth:`act` (outcomes returned; ``attrs`` filled in as facts are learnt)."""
        cfg = self.config
        pid = target.pid
        deadline = anyio.current_time() + timeout_s
        if pid in self._triggered.get(trigger.incident_id, ()):
            return result(Outcome.SKIPPED, f"already triggered pid {pid} in incident {trigger.incident_id}")

        prepared: _Prepared | None = None
        with _proc_errors(pid) as failure:
            # One worker-thread hop for all of /proc and the disk guard: triggers go out fast.
            prepared = await anyio.to_thread.run_sync(self._prepare, pid, target.uid)
        if failure:
            outcome, detail = failure[0]
            if outcome is Outcome.PERMISSION_DENIED and not await anyio.to_thread.run_sync(self._driver_present, pid):
                # no GPU on this host: nothing to dump, whoever runs servewatch (as root sees it)
                attrs["servewatch.coredump.no_gpu"] = True
                return result(Outcome.NOT_ARMED, NO_CUDA_DRIVER)
            return result(outcome, detail)
        assert prepared is not None and prepared.view is not None
        location, view = prepared.location, prepared.view
        _note_prepared(attrs, prepared)
        if location.path is None:
            if not await anyio.to_thread.run_sync(self._driver_present, pid):  # /proc reads
                attrs["servewatch.coredump.no_gpu"] = True
                return result(Outcome.NOT_ARMED, NO_CUDA_DRIVER)
            return result(Outcome.NOT_ARMED, location.reason)
        attrs["servewatch.coredump.pipe"] = location.path
        attrs["servewatch.coredump.dump_dir"] = str(prepared.dump_dir)
        if prepared.guard is not None and not prepared.guard.ok:
            return result(Outcome.REFUSED, f"refused before triggering: {prepared.guard.reason}", retryable=True)

        if not self._claim(trigger.incident_id, pid):
            return result(Outcome.SKIPPED, f"already triggered pid {pid} in incident {trigger.incident_id}")
        fired = await trigger_pipe(
            location,
            timeout_s=min(cfg.trigger_timeout_s, max(0.0, deadline - anyio.current_time())),
            poll_interval_s=min(0.01, cfg.poll_interval_s),
            consume_timeout_s=cfg.consume_timeout_s,
        )
        _note_fired(attrs, fired)
        if fired.outcome is not Outcome.OK:
            return result(fired.outcome, fired.detail, retryable=fired.outcome is Outcome.TIMED_OUT)

        wait_s = min(cfg.completion_timeout_s, max(0.0, deadline - anyio.current_time()))
        done = await _await_core_file(
            pid,
            prepared.templates,
            prepared.before,
            timeout_s=wait_s,
            settle_s=cfg.settle_s,
            poll_interval_s=cfg.poll_interval_s,
            start_timeout_s=cfg.start_timeout_s,
            stall_timeout_s=cfg.stall_timeout_s,
        )
        return self._completion_result(done, prepared, view, fired, attrs, result, wait_s=wait_s)

    def _completion_result(
        self,
        done: _Completion,
        prepared: _Prepared,
        view: TargetView,
        fired: TriggerResult,
        attrs: dict[str, AttributeValue],
        result: Callable[..., ActionResult],
        *,
        wait_s: float,
    ) -> ActionResult:
        """The result once the wait for the core file ended (``attrs`` filled in with its facts)."""
        cfg, location = self.config, prepared.location
        attrs["servewatch.coredump.complete"] = done.complete
        attrs["servewatch.coredump.stage"] = done.stage
        watched = " or ".join(repr(t.absolute) for t in prepared.templates)
        if done.path is None:
            if done.stage == "not_started":
                return result(
                    Outcome.TIMED_OUT,
                    f"not started: triggered through {location.path!r} (consumed) but no core file matching {watched}"
                    f" appeared or was opened within {min(cfg.start_timeout_s, wait_s):g} s",
                    retryable=True,
                )
            return result(
                Outcome.TIMED_OUT,
                f"triggered through {location.path!r} but no core file matching {watched} appeared within {wait_s:g} s",
                retryable=True,
            )
        here = view.here(done.path)
        attrs["servewatch.coredump.path"] = here
        if here != done.path:
            attrs["servewatch.coredump.path_in_target"] = done.path
        attrs["servewatch.coredump.size_bytes"] = done.size_bytes
        attrs["servewatch.coredump.write_duration_s"] = round(
            max(0, done.end_unix_nano - fired.time_unix_nano) / 1e9, 6
        )
        if done.stage == "stalled":
            return result(
                Outcome.TIMED_OUT,
                f"stalled at {done.size_bytes} bytes: core file {here!r} stopped growing for"
                f" {cfg.stall_timeout_s:g} s while the target still holds it open",
                paths=(here,),
                retryable=True,
            )
        if not done.complete:
            return result(
                Outcome.TIMED_OUT,
                f"core file {here!r} still growing after {wait_s:g} s ({done.size_bytes} bytes so far)",
                paths=(here,),
                retryable=True,
            )
        return result(Outcome.OK, f"core file {here!r} ({done.size_bytes} bytes)", paths=(here,))

    def _prepare(self, pid: int, uid: int | None = None) -> _Prepared:
        """Blocking part before the trigger (runs in a worker thread): pipe, core file, guard.

        The core-file folder comes from the target's own environment, so it is only created
        when it lies inside ``config.folder``; outside it, a missing folder is refused (never
        created as root), and a target of an untrusted uid (not root, not the agent's, not in
        ``trusted_uids``) is refused before any trigger, so it can neither make root create
        folders nor hold the incident waiting for a core file it never writes.

        Raises:
            ProcessLookupError / PermissionError: ``/proc/PID`` is gone or unreadable.
        """
        view = TargetView.of(pid)
        env = effective_env(pid, record_dirs=self.record_dirs)
        location = locate_pipe(pid, extra_templates=(self.config.pipe_template,), env=env)
        templates = tuple(PathTemplate(t, view) for t in core_file_templates(env, self.config))
        host = self.host if same_uts_namespace(pid) else None
        dump_dir = Path(view.here(_guard_dir(templates[0], host)))
        if location.path is None:
            return _Prepared(location, templates, dump_dir, env=env, view=view)
        if uid is None:
            uid = os.stat(f"/proc/{pid}").st_uid
        guard = self._outside_folder_guard(dump_dir, uid)
        if guard is None:
            guard = check_dump_dir(dump_dir, min_free_bytes=self.config.min_free_bytes)
        before = _snapshot(templates) if guard.ok else {}
        return _Prepared(location, templates, dump_dir, guard, before, env=env, view=view)

    def _outside_folder_guard(self, dump_dir: Path, uid: int | None) -> DumpDirCheck | None:
        """``None`` when ``dump_dir`` is inside ``config.folder``, else why it is refused, if it is."""
        folder = os.path.realpath(self.config.folder)
        real = os.path.realpath(dump_dir)
        if real == folder or real.startswith(folder.rstrip("/") + "/"):
            return None
        if uid is None or uid not in self.trusted_uids:
            return DumpDirCheck(
                False,
                f"core file folder {str(dump_dir)!r} (from the target's own environment) is outside"
                f" coredump.folder {str(self.config.folder)!r} and the target's uid {uid} is not trusted"
                " (add it with --uid / target.uids)",
            )
        if not os.path.isdir(real):
            return DumpDirCheck(
                False, f"core file folder {str(dump_dir)!r} is outside coredump.folder and missing: not created"
            )
        return None


def create(config: CoredumpConfig, ctx: BuildContext) -> CoredumpActor | None:
    """Registry factory (:data:`agent.actors.ACTORS` ``cuda_coredump``): the CUDA coredump
    trigger of ``config`` (``[coredump]``), trusting the server's uids (``ctx.agent.target_uids``)
    and reading what ``launch`` armed under ``<data_dir>/launched``; ``None`` with ``enabled`` off."""
    if not config.enabled:
        return None
    actor = CoredumpActor(config, trusted_uids=ctx.agent.target_uids, record_dirs=[ctx.agent.layout.launches])
    actor.own_actions = OwnActionLog(ctx.agent.data_dir, ctx.agent.host_name)
    return actor
