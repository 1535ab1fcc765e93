"""The SDK's death notice: how this process ended, written by the process itself.

Owns the notice's layout, a public API of both sides: the SDK installs the writer
(:func:`install`, at the first :func:`agent.sdk.step` or :func:`agent.sdk.serve_control`); the
agent reads it with :func:`read_exit_notice` from :func:`notice_path` when neither the kernel's
exit event nor the zombie's ``/proc/PID/stat`` could tell (a pod: no kernel exit events, and a rank's parent reaps
it at once; :mod:`agent.host.exits`). Imports only the standard library and the SDK's file
helpers (it runs inside the server).

Files, in the server user's private folder (:mod:`agent.sdk.folders`), each mode 0644::

    servewatch-exit.<pid>           the notice: one JSON object (below), replaced atomically
    servewatch-exit.<pid>.fault     faulthandler's output on a fatal signal (SIGSEGV, SIGABRT,
                                    SIGBUS, SIGFPE, SIGILL); empty while none came
    servewatch-exit.<pid>.sig<N>    faulthandler's output on signal N (SIGTERM, SIGHUP,
                                    SIGQUIT, SIGINT when their action was the default one);
                                    empty while none came

The notice's keys: ``v`` (1), ``pid``, ``start_time_unix_nano`` (the process's start: boot time
plus ``/proc/self/stat`` field 22, the formula of psutil's ``create_time``; 0 unknown),
``how`` and, once it ended, ``time_unix_nano`` (when the notice was written, wall clock):

* ``running``: written at install. Still there after the process died, with no signal file
  written: it died without a word Python could say -- SIGKILL (the OOM killer too), likely;
  ``os._exit`` (a forked ``multiprocessing`` child) and a C-level ``exit()`` leave it too.
* ``exit`` + ``exit_code``: the interpreter ended: the code of the last ``sys.exit(code)`` seen
  on the main thread (``code & 0xFF``, a non-int code is 1), else 0 (a ``raise SystemExit(n)``
  that bypasses ``sys.exit`` reads as 0: Python offers no hook that sees it).
* ``exception`` + ``exception`` (the uncaught exception's TYPE, qualified) + ``where``
  (``file:line`` where it was raised): the exit code is 1. Never the message (it may carry a
  prompt). An uncaught ``KeyboardInterrupt`` is ``signal`` 2 (Python >= 3.8 then dies by SIGINT).
* ``signal`` + ``signal``: it is dying by that signal.

How each is learnt, without changing how the process ends (its exit code, its death by a
signal as its parent's ``waitpid`` sees it):

* ``atexit`` (registered at install) writes ``exit`` or, when ``sys.last_value`` holds the
  uncaught exception the interpreter printed, ``exception``; ``sys.exit`` is wrapped to see
  the code (then the original runs).
* SIGTERM/SIGHUP/SIGQUIT/SIGINT whose action is the default one: ``faulthandler.register(...,
  chain=True)``, a C-level handler that writes its file then restores the default action and
  re-raises: the process dies by the signal at once, as before, even while its main thread is
  stuck in C code (a hung collective). Where a Python-level handler is installed (SIGINT's
  server's own), it is chained, never replaced: the notice notes the signal (``after_signal``)
  and calls it; how the process then ends is said as above. SIGINT's ``default_int_handler``
  is left itself (``asyncio.run`` checks its identity): its uncaught ``KeyboardInterrupt`` is
  seen at exit. An ignored signal or a handler set outside Python is left alone.
* SIGSEGV/SIGABRT/SIGBUS/SIGFPE/SIGILL: ``faulthandler.enable(file=<.fault file>)``, only when
  the process has not enabled faulthandler itself (its own output is never taken); the file's
  first line names the signal (``Fatal Python error: Segmentation fault``).
* SIGKILL cannot be caught: the ``running`` notice stays.

No thread, no polling: a few handlers and three to six file descriptors. A forked child gets its
own notice at its own first step (until then it runs with the handlers its parent had before the
SDK: faulthandler's registrations are undone in it). Opt out with ``SERVEWATCH_EXIT_NOTICE=0``
(:data:`ENV_EXIT_NOTICE`). Signal handlers need the main thread: a process whose first step runs
on another thread gets the atexit part only.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from agent.sdk._files import create_exclusive, read_regular, remove_if_ours
from agent.sdk.folders import own_dir, sdk_path

__all__ = [
    "ENV_EXIT_NOTICE",
    "FILE_PREFIX",
    "ExitNotice",
    "install",
    "notice_path",
    "process_start_unix_nano",
    "read_exit_notice",
]

#: Environment variable: ``0`` (or ``false``/``no``/``off``) turns the death notice off; default on.
ENV_EXIT_NOTICE = "SERVEWATCH_EXIT_NOTICE"
#: File name of a notice without its pid: ``servewatch-exit.<pid>``.
FILE_PREFIX = "servewatch-exit."
#: Largest notice read, bytes (a notice is about 200).
MAX_NOTICE_BYTES = 4096

#: Signals that stop a process by default and that Python can see (chained, never replaced).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: faulthandler's names of the fatal signals it handles (CPython ``faulthandler.c``).
FAULT_NAMES = {
    "Segmentation fault": int(signal.SIGSEGV),
    "Aborted": int(signal.SIGABRT),
    "Bus error": int(signal.SIGBUS),
    "Floating-point exception": int(signal.SIGFPE),
    "Illegal instruction": int(signal.SIGILL),
}


def process_start_unix_nano(pid: int | str = "self") -> int:
    """When ``pid`` started, ns since the epoch: ``/proc/stat`` ``btime`` plus ``/proc/PID/stat``
    field 22 (clock ticks since boot), psutil's ``create_time`` formula; 0 when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            ticks = int(fh.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith(b"btime "))
        return btime * 1_000_000_000 + ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return 0


def notice_path(pid: int, base: Path | None = None, uids: tuple[int, ...] | None = None) -> Path:
    """Where process ``pid``'s notice is: in the private folder of its uids in ``base``
    (:func:`agent.sdk.folders.sdk_path`; pass ``uids`` read while it lived: a dead process's
    ``/proc`` tells none)."""
    return sdk_path(pid, f"{FILE_PREFIX}{pid}", base, uids)


@dataclass(frozen=True, slots=True)
class ExitNotice:
    """A process's death notice, as read by the agent.

    Attributes:
        pid: the writer's pid (as it saw itself).
        start_time_unix_nano: the writer's start (0 unknown): compare with the process watched.
        how: ``exit``, ``exception``, ``signal``, or ``running`` (no word: SIGKILL, likely).
        time_unix_nano: when it ended (the notice's or the signal file's write), 0 for ``running``.
        exit_code: for ``exit`` (and 1 for ``exception``).
        signal: for ``signal``.
        exception: the uncaught exception's type (``exception``; ``KeyboardInterrupt`` for a SIGINT).
        where: ``file:line`` where it was raised.
        fault: faulthandler's first line (``Fatal Python error: Segmentation fault``).
    """

    pid: int
    start_time_unix_nano: int
    how: str
    time_unix_nano: int = 0
    exit_code: int | None = None
    signal: int | None = None
    exception: str = ""
    where: str = ""
    fault: str = ""

    def describe(self) -> str:
        """One line: ``exit code 3``, ``uncaught ValueError at x.py:4 (exit code 1)``, ``killed by
        SIGTERM``, ``killed without a notice (SIGKILL, likely)``."""
        if self.how == "signal" and self.signal is not None:
            return f"killed by {_signal_name(self.signal)}" + (f" ({self.fault})" if self.fault else "")
        if self.how == "exception":
            return f"uncaught {self.exception} at {self.where} (exit code {self.exit_code})"
        if self.how == "exit":
            return f"exit code {self.exit_code}"
        return "killed without a notice (SIGKILL, likely)"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _read_small(path: Path, uids: tuple[int, ...] | None) -> tuple[bytes, int] | None:
    """``(content, mtime ns)`` of a regular file owned by one of ``uids`` or root (any owner when
    ``None``), never through a symlink, at most :data:`MAX_NOTICE_BYTES`; ``None`` otherwise."""
    got = read_regular(path, MAX_NOTICE_BYTES, uids)
    return None if got is None else (got[0], got[1].st_mtime_ns)


def _signal_files(path: Path, uids: tuple[int, ...] | None) -> list[tuple[int, str, int]]:
    """Written signal files beside the notice: ``(signal, faulthandler's first line, mtime ns)``."""
    found = []
    for sig in STOP_SIGNALS:
        got = _read_small(path.with_name(f"{path.name}.sig{int(sig)}"), uids)
        if got is not None and got[0]:
            found.append((int(sig), "", got[1]))
    got = _read_small(path.with_name(f"{path.name}.fault"), uids)
    if got is not None and got[0].strip():
        first = got[0].decode("ascii", "replace").strip().splitlines()[0]
        name = first.removeprefix("Fatal Python error: ").strip()
        if name in FAULT_NAMES:
            found.append((FAULT_NAMES[name], first, got[1]))
    return found


def read_exit_notice(path: Path, uids: tuple[int, ...] | None = None) -> ExitNotice | None:
    """Read a notice and its signal files (a symlink is never followed; a file not owned by one
    of ``uids`` or root, when given, is refused).

    A written signal file is the last word (the process died by that signal right after);
    else the notice's own ``how``.

    Returns:
        The notice, or ``None`` when missing, refused, or not a notice.
    """
    got = _read_small(path, uids)
    if got is None:
        return None
    try:
        raw = json.loads(got[0])
        pid, start, how = int(raw["pid"]), int(raw.get("start_time_unix_nano", 0)), str(raw["how"])
    except (ValueError, KeyError, TypeError):
        return None
    signals = _signal_files(path, uids)
    if signals:
        sig, fault, mtime = max(signals, key=lambda s: s[2])
        return ExitNotice(pid, start, "signal", mtime, signal=sig, fault=fault)
    if how not in ("exit", "exception", "signal"):
        return ExitNotice(pid, start, "running")

    def _int(key: str) -> int | None:
        value = raw.get(key)
        return value if isinstance(value, int) else None

    return ExitNotice(pid, start, how, _int("time_unix_nano") or got[1], exit_code=_int("exit_code"),
                      signal=_int("signal"), exception=str(raw.get("exception", ""))[:200],
                      where=str(raw.get("where", ""))[:300])


# --- the writer (inside the server) ---

class _State:
    """What install() set up in this process (reset in a forked child)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.pid = 0  # the pid installed for; 0: not installed
        self.path: Path | None = None
        self.start_ns = 0
        self.final = False  # a final notice was written
        self.exit_code: int | None = None  # the last sys.exit(code) seen on the main thread
        self.after_signal = 0
        self.files: list[IO[bytes]] = []  # faulthandler's files (kept open)
        self.registered: list[int] = []  # signals registered with faulthandler
        self.fault_enabled = False


_state = _State()
_lock = threading.Lock()
_hooks_installed = False  # atexit, sys.exit wrapper, Python-level chains: once per interpreter
_original_exit = sys.exit


def _disabled() -> bool:
    return os.environ.get(ENV_EXIT_NOTICE, "1").strip().lower() in ("0", "false", "no", "off")


def _write(record: dict[str, Any]) -> None:
    """Replace the notice atomically (a temp file renamed over it). Never raises."""
    path = _state.path
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        fd = create_exclusive(tmp, 0o644)
        try:
            os.write(fd, json.dumps({"v": 1, "pid": _state.pid, "start_time_unix_nano": _state.start_ns, **record},
                                    separators=(",", ":")).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            remove_if_ours(tmp)


def _final(record: dict[str, Any]) -> None:
    if _state.pid != os.getpid() or _state.final:
        return
    _state.final = True
    if _state.after_signal:
        record["after_signal"] = _state.after_signal
    _write({**record, "time_unix_nano": time.time_ns()})


def _at_exit() -> None:
    """The interpreter is ending: an uncaught exception (``sys.last_value``) or an exit."""
    exc = getattr(sys, "last_value", None)
    if isinstance(exc, KeyboardInterrupt):
        _final({"how": "signal", "signal": int(signal.SIGINT), "exception": "KeyboardInterrupt"})
    elif isinstance(exc, BaseException) and not isinstance(exc, SystemExit):
        _final({"how": "exception", "exit_code": 1, "exception": _type_name(exc), "where": _where(exc)})
    else:
        _final({"how": "exit", "exit_code": 0 if _state.exit_code is None else _state.exit_code})


def _type_name(exc: BaseException) -> str:
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of the exception's traceback (where it was raised)."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"


def _exit(status: object = None, /) -> NoReturn:
    """``sys.exit`` seen: the code the process will end with, if nothing catches it."""
    if threading.current_thread() is threading.main_thread():
        if status is None:
            _state.exit_code = 0
        elif isinstance(status, int):
            _state.exit_code = status & 0xFF
        else:
            _state.exit_code = 1  # Python prints the object and exits 1
    _original_exit(status)  # type: ignore[arg-type]  # any object, as sys.exit takes


def _chain(signum: int, previous: Any) -> Any:
    def _on_signal(sig: int, frame: Any) -> Any:
        if _state.pid == os.getpid():
            _state.after_signal = sig
        return previous(sig, frame)

    _on_signal.__wrapped__ = previous  # type: ignore[attr-defined]
    return _on_signal


def _install_hooks() -> None:
    """Once per interpreter: atexit, the ``sys.exit`` wrapper, chains of Python-level handlers."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_at_exit)
    if sys.exit is _original_exit:
        sys.exit = _exit
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        previous = signal.getsignal(sig)
        # SIGINT's default_int_handler stays itself (asyncio.run checks its identity): its
        # uncaught KeyboardInterrupt is seen at exit (sys.last_value)
        if callable(previous) and previous is not signal.default_int_handler:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, _chain(int(sig), previous))


def _open_file(name: str, folder: Path) -> IO[bytes] | None:
    path = folder / name
    try:
        fd = create_exclusive(path, 0o644)
    except OSError:
        return None
    f = os.fdopen(fd, "wb", buffering=0)
    _state.files.append(f)
    return f


def _install_signal_files(folder: Path, pid: int) -> None:
    """faulthandler for the default-action stop signals and, unless the process has its own,
    for the fatal ones (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_DFL:
            continue
        f = _open_file(f"{FILE_PREFIX}{pid}.sig{int(sig)}", folder)
        if f is None:
            continue
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            faulthandler.register(sig, file=f, all_threads=False, chain=True)
            _state.registered.append(int(sig))
    if not faulthandler.is_enabled():
        f = _open_file(f"{FILE_PREFIX}{pid}.fault", folder)
        if f is not None:
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                faulthandler.enable(file=f, all_threads=True)
                _state.fault_enabled = True


def install() -> bool:
    """Start recording how this process ends (see the module docstring); once per process
    (again in a forked child), cheap (a few handlers, one small file), never raises.

    Returns:
        Whether the notice is installed in this process (``False``: opted out with
        :data:`ENV_EXIT_NOTICE`, or no private folder could be made).
    """
    pid = os.getpid()
    with _lock:
        if _state.pid == pid:
            return True
        if _disabled():
            return False
        try:
            folder = own_dir()
        except OSError:
            return False
        _state.pid, _state.path, _state.final = pid, folder / f"{FILE_PREFIX}{pid}", False
        _state.start_ns = process_start_unix_nano()
        with contextlib.suppress(Exception):  # a notice must never break the server
            _install_hooks()
            _install_signal_files(folder, pid)
        _write({"how": "running"})
        return True


def _after_fork_in_child() -> None:
    """A forked child is not the process installed for: undo faulthandler's registrations (they
    write into the parent's files) until its own :func:`install`."""
    global _lock
    _lock = threading.Lock()
    if _state.pid == 0:
        return
    for sig in _state.registered:
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            faulthandler.unregister(sig)
    if _state.fault_enabled:
        faulthandler.disable()
    for f in _state.files:
        with contextlib.suppress(OSError):
            f.close()
    _state.reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
