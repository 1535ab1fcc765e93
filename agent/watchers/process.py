"""The process watcher: reports each watched process's exit once, with its status when known.

Owns: :class:`ProcessWatcher` and :func:`exit_status` (decoding a wait status). May import
:mod:`agent.events`, :mod:`agent.bus` (``Publisher``), :mod:`agent.targets`, :mod:`agent.procinfo`, anyio and psutil.

How an exit is noticed, per pid:

* Linux >= 5.3: a pidfd (``os.pidfd_open``) becomes readable when the process exits; the
  watcher waits on it with ``anyio.wait_readable`` (re-checked every :data:`PIDFD_RECHECK_S`
  at most, a safety net: no polling while the process lives).
* Elsewhere (or when ``pidfd_open`` is refused): polling every ``poll_interval_s``, with the
  process's creation time guarding against pid reuse. A zombie counts as exited.

How the exit status is learnt without stealing it from whoever owns the child:

* a ``subprocess.Popen`` (or any ``returncode`` callable) registered for the pid: its owner's
  API reaps and reports it (launch mode);
* otherwise, for a child of this process, ``waitid(P_PIDFD, …, WEXITED | WNOWAIT)`` reads the
  status and leaves the zombie for its owner to reap;
* for a process that is not our child, while it is a zombie (its parent has not reaped it), the
  status from ``/proc/PID/stat`` (:func:`agent.procinfo.zombie_exit_status`); once reaped it is
  unknowable: ``exit_code`` and ``signal`` are ``None``.
"""

from __future__ import annotations

import os
import select
import signal as _signal
import subprocess
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import psutil
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskGroup, TaskStatus

from agent.bus import Publisher
from agent.events import TargetExited
from agent.procinfo import note_exit, zombie_exit_status
from agent.targets import ProcessState, Target, process_state

if TYPE_CHECKING:
    from agent.registry import BuildContext, Settings


__all__ = ["PIDFD_RECHECK_S", "POLL_INTERVAL_S", "ProcessWatcher", "create", "exit_status", "signal_name"]

#: Longest wait on a pidfd before its state is checked again, seconds (a safety net only: the
#: pidfd turns readable at the exit, so a live process costs no wakeups in between).
PIDFD_RECHECK_S = 10.0

def exit_status(returncode: int | None) -> tuple[int | None, int | None]:
    """Split a ``Popen``-style return code into ``(exit_code, signal)``.

    A negative return code ``-N`` means "killed by signal N" (``subprocess`` convention).
    """
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, -returncode
    return returncode, None


def _waitid_nowait(pidfd: int | None, pid: int) -> tuple[int | None, int | None] | None:
    """Exit status of our own exited child, leaving it waitable; ``None`` if not our child."""
    waitid = getattr(os, "waitid", None)
    if waitid is None:
        return None
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    try:
        if pidfd is not None and hasattr(os, "P_PIDFD"):
            result = waitid(os.P_PIDFD, pidfd, flags)
        else:
            result = waitid(os.P_PID, pid, flags)
    except (ChildProcessError, OSError):
        return None
    if result is None:
        return None
    if result.si_code == os.CLD_EXITED:
        return result.si_status, None
    if result.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return None, result.si_status
    return None


class _Watched:
    """One watched pid."""

    def __init__(self, target: Target, returncode: Callable[[], int | None] | None) -> None:
        self.target = target
        self.returncode = returncode
        self.reported = False


class ProcessWatcher:
    """Publishes ``TargetExited(pid, exit_code, signal, title)`` once per watched pid.

    Args:
        targets: pids or :class:`~agent.targets.Target` to watch. A ``Target`` with
            ``create_time_s`` set also guards against pid reuse: if the pid already belongs to
            another process, the target is reported as exited.
        poll_interval_s: the polling period without a pidfd (fallback), in seconds. Default 1.0.
        children: ``subprocess.Popen`` objects this process owns (launch mode); their exit
            status is read through ``Popen.poll()`` so the owner keeps its ``returncode``.

    More pids can be added while running with :meth:`watch`.
    """

    name = "process"
    #: restarted as the same instance after a crash: it holds what discovery asked it to watch
    reusable = True

    def __init__(
        self,
        targets: Iterable[int | Target] = (),
        *,
        poll_interval_s: float = 1.0,
        children: Iterable[subprocess.Popen[Any]] = (),
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self.poll_interval_s = poll_interval_s
        self._watched: dict[int, _Watched] = {}
        self._tg: TaskGroup | None = None
        self._bus: Publisher | None = None
        for child in children:
            self.watch(child.pid, returncode=child.poll)
        for target in targets:
            self.watch(target)

    @property
    def pids(self) -> tuple[int, ...]:
        """Pids watched and not yet reported as exited."""
        return tuple(pid for pid, w in self._watched.items() if not w.reported)

    def watch(self, target: int | Target, *, returncode: Callable[[], int | None] | None = None) -> None:
        """Watch one more process (also while running).

        A process already watched (and not yet exited) is left as is; targets are keyed by
        (pid, creation time), so a pid reported as exited, or now held by a newer process, is
        watched anew (a new process that reused the pid).

        Args:
            target: pid or :class:`~agent.targets.Target`.
            returncode: owner's status getter, ``Popen``-style (``None`` while running,
                ``-N`` for signal N), e.g. ``popen.poll``.
        """
        if isinstance(target, int):
            target = _target_of(target)
        existing = self._watched.get(target.pid)
        if existing is not None and not existing.reported and _same_identity(existing.target, target):
            if returncode is not None and existing.returncode is None:
                existing.returncode = returncode
            return
        watched = _Watched(target, returncode)
        self._watched[target.pid] = watched
        if self._tg is not None and self._bus is not None:
            self._tg.start_soon(self._watch_one, self._bus, watched)

    async def run(self, bus: Publisher, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled; ready once every initial pid is being watched."""
        async with anyio.create_task_group() as tg:
            self._tg, self._bus = tg, bus
            try:
                for watched in tuple(self._watched.values()):
                    if not watched.reported:  # restarted after a crash: an exit is reported once
                        tg.start_soon(self._watch_one, bus, watched)
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self._tg = self._bus = None

    async def _watch_one(self, bus: Publisher, watched: _Watched) -> None:
        pid = watched.target.pid
        # anyio.wait_readable(fd) exists from anyio 4.7; older versions poll.
        pidfd = _open_pidfd(pid) if hasattr(anyio, "wait_readable") else None
        try:
            # A pid already gone (or reused by another process) is reported at once.
            if _same_process(watched.target):
                if pidfd is not None:
                    # each recheck also asks whether the pid is still our process: a pidfd opened
                    # on a pid already reaped and reused would otherwise follow the newcomer
                    while not _pidfd_exited(pidfd) and _same_process(watched.target):
                        with anyio.move_on_after(max(self.poll_interval_s, PIDFD_RECHECK_S)):
                            await anyio.wait_readable(pidfd)
                else:
                    while _alive(watched.target):
                        await anyio.sleep(self.poll_interval_s)
            exit_code, sig = await self._status(watched, pidfd)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        if watched.reported:
            return
        watched.reported = True
        note_exit(pid, create_time_s=watched.target.create_time_s, exit_code=exit_code, signal=sig)
        await bus.publish(
            TargetExited(source=self.name, pid=pid, exit_code=exit_code, signal=sig, title=watched.target.title)
        )

    async def _status(self, watched: _Watched, pidfd: int | None) -> tuple[int | None, int | None]:
        if watched.returncode is not None:
            # The owner's poll() reaps and keeps the code; the exit may take a moment to show
            # (longer on a loaded machine): the code must be known, not "None".
            with anyio.move_on_after(max(self.poll_interval_s, 2.0)):
                while True:
                    code = watched.returncode()
                    if code is not None:
                        return exit_status(code)
                    await anyio.sleep(0.01)
            return None, None
        status = _waitid_nowait(pidfd, watched.target.pid)
        if status is None:  # not our child: a zombie still shows its status in /proc/PID/stat
            status = await anyio.to_thread.run_sync(zombie_exit_status, watched.target.pid)
        return status if status is not None else (None, None)


def _same_identity(a: Target, b: Target) -> bool:
    """Same process: same pid and, where both are known, the same creation time (pid reuse)."""
    if a.pid != b.pid:
        return False
    if a.create_time_s and b.create_time_s:
        return abs(a.create_time_s - b.create_time_s) < 0.05
    return True


def _target_of(pid: int) -> Target:
    """A bare pid as a :class:`Target`: its title and, above all, its creation time, read now.

    The creation time is what tells this process from a later one that reuses the pid: without it
    a pid reaped (by its owner) before the watcher opened its pidfd would be watched as the new
    process, and the exit would never be reported. A pid already gone gets neither (reported as
    exited at once).
    """
    try:
        proc = psutil.Process(pid)
        create_time_s = proc.create_time()  # a zombie has one too
    except (psutil.Error, OSError):
        return Target(pid=pid)
    title = ""
    try:
        cmdline = [part for part in proc.cmdline() if part]
        title = cmdline[0] if cmdline else proc.name()
    except (psutil.Error, OSError):  # a zombie has no cmdline left
        pass
    return Target(pid=pid, title=title, create_time_s=create_time_s)


def _open_pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def _pidfd_exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited (zombie included)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _same_process(target: Target) -> bool:
    """The pid still belongs to the process ``target`` describes (a zombie does: not reaped yet)."""
    return process_state(target.pid, create_time_s=target.create_time_s) is not ProcessState.GONE


def _alive(target: Target) -> bool:
    """Polling fallback: still the same process, and not a zombie."""
    return process_state(target.pid, create_time_s=target.create_time_s) not in (ProcessState.GONE, ProcessState.ZOMBIE)


def signal_name(signum: int | None) -> str:
    """``"SIGKILL"`` for 9, ``""`` for ``None`` or an unknown number."""
    if signum is None:
        return ""
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return ""


#: Seconds between exit checks of targets the agent did not start (pidfd waits are woken at once).
POLL_INTERVAL_S = 0.5


def create(settings: Settings, ctx: BuildContext) -> ProcessWatcher:
    """Registry factory (:data:`agent.watchers.WATCHERS` ``process``): watches every target the
    runtime discovers (and the processes it launched, ``ctx.children``) for exit."""
    return ProcessWatcher(poll_interval_s=POLL_INTERVAL_S, children=ctx.children)
