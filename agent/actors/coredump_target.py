"""How a CUDA coredump target sees its own world: its arming environment and its paths.

Owns: the target's effective coredump environment when ``/proc/PID/environ`` cannot be trusted
(:func:`effective_env`: its own environ, what ``servewatch launch`` recorded for it or an
ancestor (:func:`record_launch`), an ancestor's environ), the driver's path templates as
patterns (:class:`PathTemplate`: ``%h``, ``%p``, ``%t`` matched as wildcards, ``%p`` limited to
the pids the target may know itself by), and reaching the target's paths from the agent
(:class:`TargetView`: through ``/proc/PID/root`` when it lives in another mount namespace).
Imports the stdlib, psutil, :mod:`agent.host.cudaenv` (the variables' names), :mod:`agent.host.fsutil`, :mod:`agent.host.procinfo` and :mod:`agent.model.safetext`.

Facts (FIELD-NOTES, measured here):

* setproctitle (SGLang's schedulers call it) overwrites the environ area: ``/proc/PID/environ``
  then reads as NULs. ``SPT_NOENV=1`` in the environment stops it (an empty value does not).
* The CUDA driver expands ``%h`` (its uts host name), ``%p`` (its pid in its own pid namespace,
  ``NSpid``) and ``%t`` inside the target's namespaces, so a container's paths name the
  container's host name and pid, never the agent's.
* ``readlink /proc/PID/fd/N`` and ``/proc/PID/cwd`` give paths as the target sees them;
  ``/proc/PID/root/<path>`` reaches them from another mount namespace.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import psutil

from agent.host.cudaenv import COREDUMP_VARIABLES
from agent.host.fsutil import atomic_write_text, ensure_private_dir
from agent.host.procinfo import ns_pid
from agent.model.datadir import LAUNCH_RECORD_DIR
from agent.model.safetext import safe_text

__all__ = [
    "LAUNCH_RECORD_DIR",
    "PathTemplate",
    "TargetEnv",
    "TargetView",
    "effective_env",
    "read_environ",
    "read_launch_record",
    "record_launch",
]

# LAUNCH_RECORD_DIR: the folder (under the data dir) where ``servewatch launch`` records what it
# set for each server (agent.model.datadir's: ``DataDir.launches``)
_MAX_ANCESTORS = 32
_PLACEHOLDER = re.compile(r"(%[hpt])")


# --- the environment ---------------------------------------------------------------------------


def read_environ(pid: int) -> dict[str, str]:
    """The target's start-up environment from ``/proc/PID/environ`` (``{}`` when clobbered).

    Raises:
        ProcessLookupError: the process is gone.
        PermissionError: it may not be read.
    """
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            env[safe_text(os.fsdecode(name))] = safe_text(os.fsdecode(value))
    return env


def _record_name(pid: int, create_time_s: float) -> str:
    return f"{pid}-{create_time_s:.2f}.json"


def record_launch(record_dir: str | os.PathLike[str], pid: int, create_time_s: float, env: Mapping[str, str]) -> Path:
    """Record the coredump variables ``servewatch launch`` started server ``pid`` with.

    The file (``<record_dir>/<pid>-<create_time>.json``, 0600 in a 0700 folder, written
    atomically) lets the agent find the arming and the core-file template after setproctitle has
    emptied the server's (and its workers') ``/proc/PID/environ``.

    Args:
        record_dir: ``<data_dir>/launched``.
        pid: the server's pid.
        create_time_s: its psutil creation time (tells a reused pid apart).
        env: the server's environment (only :data:`COREDUMP_VARIABLES` are kept).

    Returns:
        The record's path.
    """
    folder = Path(record_dir)
    ensure_private_dir(folder)
    kept = {name: env[name] for name in COREDUMP_VARIABLES if name in env}
    path = folder / _record_name(pid, create_time_s)
    atomic_write_text(path, json.dumps({"pid": pid, "create_time_s": create_time_s, "env": kept}, indent=2))
    return path


def read_launch_record(record_dirs: Iterable[str | os.PathLike[str]], pid: int, create_time_s: float) -> dict[str, str] | None:
    """What launch recorded for ``pid`` started at ``create_time_s`` (within 1 s), if anything."""
    for folder in record_dirs:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            head, _, rest = name.partition("-")
            if head != str(pid) or not rest.endswith(".json"):
                continue
            try:
                if abs(float(rest[: -len(".json")]) - create_time_s) > 1.0:
                    continue
                data = json.loads(Path(folder, name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            env = data.get("env") if isinstance(data, dict) else None
            if isinstance(env, dict):
                return {str(k): str(v) for k, v in env.items()}
    return None


@dataclass(frozen=True, slots=True)
class TargetEnv:
    """The coredump variables that apply to a target, and where they were found.

    Attributes:
        values: the CUDA coredump variables (name -> value), empty when none was found.
        source: ``"environ"`` (its own ``/proc/PID/environ``), ``"launch:<pid>"`` (what
            ``servewatch launch`` set for it or for that ancestor), ``"parent:<pid>"`` (that
            ancestor's environ), or ``""`` when nothing was found.
        environ_cleared: its own ``/proc/PID/environ`` held no variable at all (setproctitle).
    """

    values: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    source: str = ""
    environ_cleared: bool = False


def _cuda(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("CUDA_") and k in COREDUMP_VARIABLES}


def _chain(pid: int) -> Iterator[tuple[int, float]]:
    """``(pid, create_time_s)`` of the process and its ancestors, nearest first (pid 1 excluded)."""
    try:
        proc: psutil.Process | None = psutil.Process(pid)
        for _ in range(_MAX_ANCESTORS):
            if proc is None or proc.pid <= 1:
                return
            yield proc.pid, proc.create_time()
            proc = proc.parent()
    except psutil.Error:
        return


def effective_env(pid: int, *, record_dirs: Sequence[str | os.PathLike[str]] = ()) -> TargetEnv:
    """The coredump variables that apply to ``pid``, from the nearest trustworthy source.

    In order: its own ``/proc/PID/environ`` when it holds a CUDA coredump variable; else, for it
    and then each ancestor (nearest first), what ``servewatch launch`` recorded for that process,
    then that ancestor's environ (workers inherit the server's environment; setproctitle empties
    the worker's copy, not the parent's).

    Raises:
        ProcessLookupError / PermissionError: ``/proc/PID`` is gone or unreadable.
    """
    own = read_environ(pid)
    if _cuda(own):
        return TargetEnv(MappingProxyType(_cuda(own)), "environ")
    for index, (ancestor, create_time_s) in enumerate(_chain(pid)):
        recorded = read_launch_record(record_dirs, ancestor, create_time_s)
        if recorded is not None and _cuda(recorded):
            return TargetEnv(MappingProxyType(_cuda(recorded)), f"launch:{ancestor}", not own)
        if index == 0:
            continue
        try:
            theirs = _cuda(read_environ(ancestor))
        except (ProcessLookupError, PermissionError):
            continue
        if theirs:
            return TargetEnv(MappingProxyType(theirs), f"parent:{ancestor}", not own)
    return TargetEnv(environ_cleared=not own)


# --- paths as the target sees them --------------------------------------------------------------


def _same_namespace(pid: int, kind: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return True


@dataclass(frozen=True, slots=True)
class TargetView:
    """One target's view of paths and pids.

    Attributes:
        pid: the target's pid (ours).
        ns_pid: its pid in its own pid namespace (what the driver puts for ``%p``).
        cwd: its working directory as it sees it.
        root: prefix that reaches its paths from here: ``""`` in our mount namespace, else
            ``/proc/PID/root``.
    """

    pid: int
    ns_pid: int
    cwd: str
    root: str = ""

    @classmethod
    def of(cls, pid: int) -> TargetView:
        """Read the view of ``pid``.

        Raises:
            ProcessLookupError / PermissionError: ``/proc/PID`` is gone or unreadable.
        """
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except FileNotFoundError as exc:
            raise ProcessLookupError(pid) from exc
        root = "" if _same_namespace(pid, "mnt") else f"/proc/{pid}/root"
        return cls(pid=pid, ns_pid=ns_pid(pid), cwd=cwd, root=root)

    @property
    def pids(self) -> tuple[int, ...]:
        """The pids ``%p`` may stand for (its own namespace's, and ours)."""
        return tuple(dict.fromkeys((self.ns_pid, self.pid)))

    def here(self, path: str) -> str:
        """A path the target sees, as reachable from here."""
        return self.root + path if self.root else path

    def absolute(self, template: str) -> str:
        """``template`` made absolute against the target's cwd (placeholders untouched)."""
        return template if template.startswith("/") else os.path.join(self.cwd, template)


@dataclass(frozen=True, slots=True)
class PathTemplate:
    """A driver path template (``CUDA_COREDUMP_PIPE`` / ``_FILE``) matched in a target's view.

    ``%h`` matches any one path component part (the target's host name, which a container
    changes), ``%t`` any digits, ``%p`` only the pids the target may know itself by
    (:attr:`TargetView.pids`); every other character is literal. Relative templates are
    relative to the target's cwd.
    """

    template: str
    view: TargetView

    @property
    def absolute(self) -> str:
        return self.view.absolute(self.template)

    def _component(self, part: str) -> re.Pattern[str]:
        pieces = []
        for piece in _PLACEHOLDER.split(part):
            if piece == "%h":
                pieces.append(r"[^/]+?")
            elif piece == "%t":
                pieces.append(r"\d+")
            elif piece == "%p":
                pieces.append("(?:" + "|".join(str(p) for p in self.view.pids) + ")")
            else:
                pieces.append(re.escape(piece))
        return re.compile("".join(pieces))

    def regex(self) -> re.Pattern[str]:
        """Full-path pattern (target view) for ``fullmatch``."""
        return re.compile("/".join(self._component(part).pattern for part in self.absolute.split("/")))

    def matches(self, path: str) -> bool:
        """Whether a path the target sees (e.g. ``readlink /proc/PID/fd/N``) fits the template."""
        return self.regex().fullmatch(path) is not None

    def fixed_dir(self) -> str:
        """The deepest directory of the template without a placeholder (target view)."""
        parts = self.absolute.split("/")[:-1]
        fixed: list[str] = []
        for part in parts:
            if _PLACEHOLDER.search(part):
                break
            fixed.append(part)
        return "/".join(fixed) or "/"

    def existing(self) -> list[str]:
        """Paths (target view) that exist now and fit the template, walked component by component."""
        parts = self.absolute.split("/")[1:]
        found = ["/"]
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            nxt: list[str] = []
            for directory in found:
                if not _PLACEHOLDER.search(part):
                    candidate = os.path.join(directory, part)
                    if last or os.path.isdir(self.view.here(candidate)):
                        nxt.append(candidate)
                    continue
                pattern = self._component(part)
                try:
                    names = os.listdir(self.view.here(directory))
                except OSError:
                    continue
                nxt.extend(os.path.join(directory, n) for n in names if pattern.fullmatch(n))
            found = nxt
            if not found:
                return []
        return [p for p in found if os.path.lexists(self.view.here(p))]
