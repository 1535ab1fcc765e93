"""Signals that can only reach the process the agent judged: through a pidfd taken when the target
was identified, never ``kill(pid)`` on whoever holds the number now.

Owns :func:`hold` (take a target's pidfd at identification: discovery, the process watcher),
:func:`release`, :func:`send_signal` (every signal the agent sends a target: hard mode's, py-spy's
``SIGCONT``, ``launch``'s) and :func:`open_verified`. Imports the stdlib and :mod:`agent.host.targets`.

A pidfd (``os.pidfd_open``, Linux >= 5.3) refers to one process, not to a number: once that
process is reaped, ``signal.pidfd_send_signal`` fails with ``ESRCH`` even when another process
has taken its pid (a pid namespace reuses numbers within seconds). A pidfd is only trusted when
it was verified at opening: the pid's creation time then equals the target's (a pidfd opened on
a newcomer holding the number is refused). Without pidfds (another OS, an old kernel), the
creation time is checked right before ``os.kill`` (a narrow race remains there, and is said).
"""

from __future__ import annotations

import os
import signal as _signal
import threading

from agent.host.targets import ProcessState, Target, process_state

__all__ = ["PIDFD_SUPPORTED", "held", "hold", "open_verified", "release", "release_exited", "send_signal"]

#: Whether this Python and kernel offer pidfds (``os.pidfd_open`` + ``signal.pidfd_send_signal``).
PIDFD_SUPPORTED = hasattr(os, "pidfd_open") and hasattr(_signal, "pidfd_send_signal")

_held: dict[tuple[int, float], int] = {}
_lock = threading.Lock()


def open_verified(target: Target) -> int | None:
    """A pidfd of ``target``'s own process, or ``None``: it is gone, its pid now belongs to
    another process (creation time differs), or pidfds are unavailable.

    The pidfd pins whatever process held the pid at ``pidfd_open``; the creation time read
    *after* it proves that process is the target (a later newcomer would read differently).
    """
    if not PIDFD_SUPPORTED:
        return None
    try:
        fd = os.pidfd_open(target.pid)
    except OSError:
        return None
    if process_state(target.pid, create_time_s=target.create_time_s) is ProcessState.GONE or not _same_start(target):
        os.close(fd)
        return None
    return fd


def _same_start(target: Target) -> bool:
    """The pid's process started when ``target`` did, to the clock tick.

    :func:`~agent.host.targets.process_state` allows a second (psutil's wall-clock creation time moves
    with /proc/stat's ``btime``, in whole seconds); here the start since boot (``/proc/PID/stat``,
    exact) is compared with ``create_time_s`` less the boot time now: equal within 50 ms, or off
    by whole seconds only (``btime`` stepped). A newcomer on a reused pid starts later, by a
    fraction of a second in a busy pid namespace.
    """
    if not target.create_time_s:
        return True  # nothing to compare: process_state decided
    import psutil

    try:
        with open(f"/proc/{target.pid}/stat", "rb") as fh:
            ticks = int(fh.read().rsplit(b")", 1)[1].split()[19])  # field 22: starttime, clock ticks since boot
        started_s = ticks / os.sysconf("SC_CLK_TCK")
        expected_s = target.create_time_s - psutil.boot_time()
    except (OSError, ValueError, IndexError):
        return False  # gone meanwhile
    diff = abs(started_s - expected_s)
    return min(diff % 1.0, 1.0 - diff % 1.0) < 0.05 and diff < 2.05


def hold(target: Target) -> bool:
    """Take ``target``'s pidfd now (at identification) unless held already; False when it
    could not be (gone, reused, no pidfds). Held until :func:`release`."""
    key = (target.pid, target.create_time_s)
    with _lock:
        if key in _held:
            return True
    fd = open_verified(target)
    if fd is None:
        return False
    with _lock:
        if key in _held:
            os.close(fd)
        else:
            _held[key] = fd
    return True


def held(target: Target) -> bool:
    """Whether a pidfd of ``target`` is held."""
    with _lock:
        return (target.pid, target.create_time_s) in _held


def release(target: Target) -> None:
    """Close ``target``'s pidfd (safe when none is held)."""
    with _lock:
        fd = _held.pop((target.pid, target.create_time_s), None)
    if fd is not None:
        os.close(fd)


def release_exited(pid: int, started_unix_nano: int = 0) -> None:
    """Close the pidfd held for ``pid``'s process that exited (``started_unix_nano``: its start,
    so a newer process on the same pid keeps its own; 0: any held for ``pid``)."""
    with _lock:
        keys = [k for k in _held if k[0] == pid and (
            not started_unix_nano or not k[1] or abs(k[1] - started_unix_nano / 1e9) < 0.05)]
        fds = [_held.pop(k) for k in keys]
    for fd in fds:
        os.close(fd)


def send_signal(target: Target, sig: int) -> str:
    """Send ``sig`` to ``target``'s own process only.

    Through the pidfd held since it was identified (:func:`hold`), else one opened and verified
    now (:func:`open_verified`); without pidfds, after checking its creation time.

    Returns:
        How it was sent: ``pidfd`` (held since identification), ``pidfd-now``, ``kill``.

    Raises:
        ProcessLookupError: the process is gone (its pid may belong to another process now):
            nothing was signalled.
        PermissionError: not allowed to signal it.
    """
    with _lock:
        fd = _held.get((target.pid, target.create_time_s))
    if fd is not None:
        _signal.pidfd_send_signal(fd, sig)  # ESRCH (ProcessLookupError) once it was reaped
        return "pidfd"
    if PIDFD_SUPPORTED:
        fd = open_verified(target)
        if fd is None:
            raise ProcessLookupError(f"pid {target.pid} is gone (or now belongs to another process)")
        try:
            _signal.pidfd_send_signal(fd, sig)
        finally:
            os.close(fd)
        return "pidfd-now"
    if process_state(target.pid, create_time_s=target.create_time_s) is ProcessState.GONE:
        raise ProcessLookupError(f"pid {target.pid} is gone (or now belongs to another process)")
    os.kill(target.pid, sig)
    return "kill"
