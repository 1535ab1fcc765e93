"""Planning the environment a GPU server starts with: CUDA coredumps and the Flight Recorder.

Owns, as the one source of truth for ``servewatch launch``, ``servewatch cuda-env`` and the
coredump actor: the CUDA driver's coredump variables (``CUDA_ENABLE_COREDUMP_ON_EXCEPTION``,
``CUDA_ENABLE_USER_TRIGGERED_COREDUMP``, ``CUDA_COREDUMP_PIPE``, ``CUDA_COREDUMP_FILE``...) and
their path templates (SGLang's and the driver's defaults), the plan that arms a server
(:func:`cuda_coredump_env`: SGLang's ``--crash-dump-folder`` defaults, the user's values always
win), torch's collective Flight Recorder buffer (:func:`flight_recorder_env`), the shell lines
``cuda-env`` prints (:func:`format_exports`, :func:`export_lines`) and the dump-folder guard
(:func:`check_dump_dir`). Imports only the standard library (``cuda-env`` starts fast); the
actor (:mod:`agent.actors.coredump`), :mod:`agent.cli.launch` and :mod:`agent.cli.app` import it.
"""

from __future__ import annotations

import os
import shlex
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

__all__ = [
    "COREDUMP_VARIABLES",
    "DRIVER_DEFAULT_FILE_TEMPLATE",
    "DRIVER_DEFAULT_PIPE_TEMPLATE",
    "ENV_ENABLE_ON_EXCEPTION",
    "ENV_ENABLE_USER_TRIGGER",
    "ENV_FILE",
    "ENV_GENERATION_FLAGS",
    "ENV_PIPE",
    "ENV_SHOW_PROGRESS",
    "ENV_SPT_NOENV",
    "FR_BUFFER_DEFAULT",
    "FR_BUFFER_ENV",
    "LIGHTWEIGHT_GENERATION_FLAGS",
    "NO_CUDA_DRIVER",
    "SGLANG_FILE_TEMPLATE",
    "SGLANG_PIPE_TEMPLATE",
    "CoredumpEnvPlan",
    "DumpDirCheck",
    "check_dump_dir",
    "cuda_coredump_env",
    "cuda_driver_present",
    "export_lines",
    "flight_recorder_env",
    "format_exports",
]

#: ``1``: a GPU exception writes a coredump (driver variable).
ENV_ENABLE_ON_EXCEPTION = "CUDA_ENABLE_COREDUMP_ON_EXCEPTION"
#: ``1``: the driver creates and reads ``CUDA_COREDUMP_PIPE`` (must be set before CUDA init).
ENV_ENABLE_USER_TRIGGER = "CUDA_ENABLE_USER_TRIGGERED_COREDUMP"
#: ``1``: the driver prints coredump progress on the target's stderr.
ENV_SHOW_PROGRESS = "CUDA_COREDUMP_SHOW_PROGRESS"
#: Comma-separated ``skip_*`` flags selecting what a coredump contains.
ENV_GENERATION_FLAGS = "CUDA_COREDUMP_GENERATION_FLAGS"
#: Core file path template (``%h`` host, ``%p`` pid, ``%t`` time).
ENV_FILE = "CUDA_COREDUMP_FILE"
#: Trigger FIFO path template (``%h`` host, ``%p`` pid, ``%t`` time).
ENV_PIPE = "CUDA_COREDUMP_PIPE"
#: ``1``: setproctitle leaves ``/proc/PID/environ`` alone (its documented switch).
ENV_SPT_NOENV = "SPT_NOENV"

#: SGLang's lightweight flag set (CU_COREDUMP_LIGHTWEIGHT_FLAGS spelled as driver words).
LIGHTWEIGHT_GENERATION_FLAGS = (
    "skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory,skip_constbank_memory"
)
#: SGLang's ``CUDA_COREDUMP_FILE`` under ``--crash-dump-folder`` (``{folder}`` is filled in).
SGLANG_FILE_TEMPLATE = "{folder}/%h/core.cuda.%t.%p"
#: SGLang's ``CUDA_COREDUMP_PIPE`` (per FIELD-NOTES: under /tmp, not under the folder).
SGLANG_PIPE_TEMPLATE = "/tmp/corepipe.cuda.%h.%p"
#: The driver's own pipe name when ``CUDA_COREDUMP_PIPE`` is unset (relative to the target's cwd).
DRIVER_DEFAULT_PIPE_TEMPLATE = "corepipe.cuda.%h.%p"
#: The driver's own core file name when ``CUDA_COREDUMP_FILE`` is unset (relative to the cwd).
DRIVER_DEFAULT_FILE_TEMPLATE = "core_%t_%h_%p.nvcudmp"

#: The environment variables that arm and direct a CUDA coredump (what ``launch`` records for
#: a server, what the actor reads back from a target), in the order a plan sets them.
COREDUMP_VARIABLES = (
    ENV_ENABLE_ON_EXCEPTION,
    ENV_ENABLE_USER_TRIGGER,
    ENV_SHOW_PROGRESS,
    ENV_GENERATION_FLAGS,
    ENV_FILE,
    ENV_PIPE,
    ENV_SPT_NOENV,
)

#: torch's collective Flight Recorder: entries kept per process group (read at ``init_process_group``).
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
#: What ``launch`` / ``cuda-env`` arm it with (``flightrec.buffer_size``'s default).
FR_BUFFER_DEFAULT = "2000"


def export_lines(set_vars: Mapping[str, str], kept: Mapping[str, str]) -> str:
    """Shell lines for a planned environment: ``export NAME=VALUE`` per variable set (values
    quoted with :func:`shlex.quote`), a ``# kept NAME (already set)`` comment per user's value kept.

    Returns:
        The lines, newline-terminated (empty when nothing is set or kept).
    """
    lines = [f"export {name}={shlex.quote(value)}" for name, value in set_vars.items()]
    lines += [f"# kept {name} (already set)" for name in kept]
    return "".join(line + "\n" for line in lines)


def flight_recorder_env(
    environ: Mapping[str, str], *, buffer_size: int = int(FR_BUFFER_DEFAULT)
) -> tuple[dict[str, str], dict[str, str]]:
    """Variables arming torch's Flight Recorder (:data:`FR_BUFFER_ENV`), the user's values kept.

    Args:
        environ: the environment the server would start with (not modified).
        buffer_size: entries per process group to set when the user has not.

    Returns:
        ``(set, kept)``: what to add, and the user's own values left as they are.
    """
    if FR_BUFFER_ENV in environ:
        return {}, {FR_BUFFER_ENV: environ[FR_BUFFER_ENV]}
    return {FR_BUFFER_ENV: str(buffer_size)}, {}


@dataclass(frozen=True, slots=True)
class CoredumpEnvPlan:
    """The CUDA coredump environment for one crash-dump folder.

    Attributes:
        folder: the crash-dump folder (absolute).
        host_dir: ``folder/<host>``, created by :func:`cuda_coredump_env`.
        set: variables this plan adds (name -> value); the user had not set them.
        kept: coredump variables the user had already set (name -> the user's value), untouched.
        env: the complete environment to start the target with (the input plus ``set``).
    """

    folder: Path
    host_dir: Path
    set: Mapping[str, str]
    kept: Mapping[str, str]
    env: Mapping[str, str] = field(repr=False)


def cuda_coredump_env(
    folder: str | os.PathLike[str],
    environ: Mapping[str, str] = os.environ,
    *,
    host: str | None = None,
    pipe_template: str = SGLANG_PIPE_TEMPLATE,
    create: bool = True,
) -> CoredumpEnvPlan:
    """Compute the CUDA coredump environment for ``folder`` with SGLang's defaults.

    Per SGLang's ``--crash-dump-folder`` handling: each variable is set only where ``environ``
    does not already have it (the user's value wins, even an empty one). Creates
    ``folder/<host>`` so the driver can write ``%h`` paths, unless ``create`` is false (``servewatch
    cuda-env`` only prints).

    Args:
        folder: crash-dump folder; made absolute.
        environ: the environment to start from (not modified).
        host: host name ``%h`` expands to; default :func:`socket.gethostname`.
        pipe_template: ``CUDA_COREDUMP_PIPE`` to set; default SGLang's.
        create: create ``folder/<host>`` now.

    Returns:
        The plan: what was set, what was kept, and the full environment.

    Raises:
        OSError: the per-host folder cannot be created (bad configuration).
    """
    folder_path = Path(folder).expanduser().absolute()
    host_name = host or socket.gethostname()
    defaults = {
        ENV_ENABLE_ON_EXCEPTION: "1",
        ENV_ENABLE_USER_TRIGGER: "1",
        ENV_SHOW_PROGRESS: "1",
        ENV_GENERATION_FLAGS: LIGHTWEIGHT_GENERATION_FLAGS,
        ENV_FILE: SGLANG_FILE_TEMPLATE.format(folder=str(folder_path)),
        ENV_PIPE: pipe_template,
        # setproctitle (SGLang's schedulers) would otherwise empty /proc/PID/environ, where the
        # agent reads this arming back (an empty user value still clears it: kept as the user's).
        ENV_SPT_NOENV: "1",
    }
    added: dict[str, str] = {}
    kept: dict[str, str] = {}
    for name, value in defaults.items():
        if name in environ:
            kept[name] = environ[name]
        else:
            added[name] = value
    host_dir = folder_path / host_name
    if create:
        host_dir.mkdir(parents=True, exist_ok=True)
    env = dict(environ)
    env.update(added)
    return CoredumpEnvPlan(
        folder=folder_path,
        host_dir=host_dir,
        set=MappingProxyType(added),
        kept=MappingProxyType(kept),
        env=MappingProxyType(env),
    )


def format_exports(plan: CoredumpEnvPlan) -> str:
    """Shell lines arming a target started from that shell (``servewatch cuda-env``).

    One ``export NAME=VALUE`` line per variable the plan sets, values quoted with
    :func:`shlex.quote`; a ``#`` comment line per variable kept from the user's environment.

    Args:
        plan: from :func:`cuda_coredump_env`.

    Returns:
        The lines, newline-terminated (empty when nothing is set or kept).
    """
    return export_lines(plan.set, plan.kept)


class DumpDirCheck(NamedTuple):
    """Result of :func:`check_dump_dir`."""

    #: True when a core file can be written there
    ok: bool
    #: why not (or the free space found, when ok)
    reason: str


#: The ``cuda.coredump`` detail of a target that is not armed on a host without a CUDA driver:
#: nothing to arm there (no arming hint: there is nothing to fix).
NO_CUDA_DRIVER = "no GPU: no NVIDIA/CUDA driver on this host, nothing to dump"

#: Where an NVIDIA driver shows itself: its kernel module's proc folder and its control device.
_DRIVER_MARKS = ("/proc/driver/nvidia", "/dev/nvidiactl")


def cuda_driver_present(pid: int | None = None) -> bool:
    """Whether a CUDA driver can be there: the NVIDIA kernel module or its device on this host
    (``/proc/driver/nvidia``, ``/dev/nvidiactl``), or ``libcuda.so`` mapped into ``pid``.

    A CPU-only host has none of them; a container with GPUs sees the device nodes. Never raises
    (an unreadable ``/proc/PID/maps`` counts as no library seen).
    """
    if any(os.path.exists(mark) for mark in _DRIVER_MARKS):
        return True
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/maps", "rb") as fh:
            return any(b"libcuda.so" in line for line in fh)
    except OSError:
        return False


def check_dump_dir(path: str | os.PathLike[str], *, min_free_bytes: int) -> DumpDirCheck:
    """Check that a core file can be written to directory ``path``.

    The directory must exist or be creatable, be writable (proved by creating and removing a
    probe file, so root and read-only mounts are judged correctly), and have at least
    ``min_free_bytes`` available to unprivileged writers (``statvfs`` ``f_bavail``).

    Args:
        path: the directory the core file will be written to (created when missing).
        min_free_bytes: required free space, in bytes.

    Returns:
        ``(ok, reason)``.
    """
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        return DumpDirCheck(False, f"dump directory {str(directory)!r} is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return DumpDirCheck(False, f"dump directory {str(directory)!r} cannot be created: {exc.strerror or exc}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".servewatch-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return DumpDirCheck(False, f"dump directory {str(directory)!r} is not writable: {exc.strerror or exc}")
    try:
        vfs = os.statvfs(directory)
    except OSError as exc:
        return DumpDirCheck(False, f"cannot read free space of {str(directory)!r}: {exc.strerror or exc}")
    free_bytes = vfs.f_bavail * vfs.f_frsize
    if free_bytes < min_free_bytes:
        return DumpDirCheck(
            False,
            f"only {free_bytes} bytes free in {str(directory)!r}, below min_free_bytes={min_free_bytes}",
        )
    return DumpDirCheck(True, f"{free_bytes} bytes free in {str(directory)!r}")
