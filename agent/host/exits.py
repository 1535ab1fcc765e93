"""How processes ended, read from the kernel where their parent's reaping hides it.

Owns: :class:`KernelExits` (the kernel's exit events, proc connector), :class:`ExecEvents` (its exec
events: whether a program started), :class:`OomWatch` (OOM
kills: the process's memory cgroup counters and the kernel log), :func:`last_ran_unix_nano` (a
zombie's last time on a CPU) and :func:`zombie_fact` (a zombie's :class:`~agent.model.events.ExitFact`);
the process watcher (:mod:`agent.watchers.process`) puts the sources in order. Imports the
stdlib, anyio and :mod:`agent.model.events`.

Why: a server's rank is reaped by its own parent at once, so ``waitid`` (ours only) and
``/proc/PID/stat`` (while a zombie) usually miss its status: an orderly exit then read as
"exit status unknown" and opened an incident. Sources, most direct first (measured on Linux 6.18):

* the kernel's exit event (``NETLINK_CONNECTOR``, ``CN_IDX_PROC``; ``linux/cn_proc.h``): every
  process's wait status (``exit_code``), its parent and ``CLOCK_MONOTONIC`` time of death, sent
  in ``do_exit`` *before* the process turns into a zombie, whoever reaps it. Needs
  ``CAP_NET_ADMIN`` in the initial network namespace (root on the host, a host-network pod);
  elsewhere subscribing fails (EPERM / no events) and this source says so once. Kernels >= 6.6
  take an event filter (exit events only); older ones get every event and drop the rest here.
  pyroute2 has a socket for it, but its 0.9 sync API drives its own asyncio core (108 ms to
  import here); three fixed structs of a stable kernel ABI are decoded with :mod:`struct`.
* OOM: the cgroup's OOM-kill counter (v2 ``memory.events`` ``oom_kill``; v1
  ``memory.oom_control`` ``oom_kill``) read when the process is first watched and again at its
  death (a SIGKILL with the counter up is an OOM kill), and the kernel's own record in
  ``/dev/kmsg`` (``Killed process PID (comm)`` / ``oom-kill:...,pid=PID,``; root, CAP_SYSLOG).
* a zombie's ``/proc/PID/stat`` (status) and ``/proc/PID/sched`` ``se.exec_start`` (its last
  time on a CPU, in the scheduler's clock: converted through this thread's own reading, an
  estimate good to order deaths seen late).
* the process's own SDK death notice (:mod:`agent.sdk.exitnotice`, :func:`sdk_notice_fact`):
  an exit code, an uncaught exception (code 1), a signal Python or faulthandler saw, with its
  time; trusted only from the private folder of the process's uids, a regular file of theirs,
  for the same pid and start time. A notice still saying ``running`` (killed without a word:
  SIGKILL, likely, or ``os._exit``) gives no status.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from agent.model.events import ExitFact, ExitSource
from agent.sdk.exitnotice import ExitNotice, notice_path, read_exit_notice

__all__ = [
    "COALESCE_S",
    "ExecEvents",
    "KernelExit",
    "KernelExits",
    "OomCounter",
    "OomWatch",
    "decode_wait_status",
    "last_ran_unix_nano",
    "oom_counter_of",
    "sdk_notice",
    "sdk_notice_fact",
    "zombie_exit_status",
    "zombie_fact",
]

log = logging.getLogger("servewatch.exits")

# linux/netlink.h, linux/connector.h, linux/cn_proc.h
_NETLINK_CONNECTOR = 11
_NLMSG_DONE = 3
_CN_IDX_PROC = 1
_CN_VAL_PROC = 1
_PROC_CN_MCAST_LISTEN = 1
_PROC_EVENT_EXEC = 0x00000002
_PROC_EVENT_EXIT = 0x80000000
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HEAD = struct.Struct("=IIQ")  # what, cpu, timestamp_ns (CLOCK_MONOTONIC)
_EXEC_EVENT = struct.Struct("=II")  # process pid, process tgid
_EXIT_EVENT = struct.Struct("=IIIIII")  # pid, tgid, exit_code (wait status), exit_signal, parent pid, parent tgid

#: Once :meth:`KernelExits.run` has read the events waiting, it waits this long before it waits
#: for more, seconds: every process and thread that ends on the host sends one (a CI runner, a
#: build, a test suite end hundreds a second), and each woke the event loop; now it wakes at
#: most this often for them. Nothing is late for it: a lookup (:meth:`KernelExits.get`) reads
#: what is waiting first, and the 4 MiB socket buffer holds thousands of events.
COALESCE_S = 0.5

#: Exits remembered (most recent kept): far more than the processes of one node's servers.
_MAX_REMEMBERED = 16384


def decode_wait_status(status: int) -> tuple[int | None, int | None]:
    """``(exit_code, signal)`` of a raw wait status (``0x700``: exit code 7; ``0x8b``: SIGSEGV, core)."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def _mono_to_unix_ns(mono_ns: int) -> int:
    return time.time_ns() - (time.monotonic_ns() - mono_ns)


@dataclass(frozen=True, slots=True)
class KernelExit:
    """One process's exit as the kernel announced it.

    Attributes:
        pid: the process (its thread-group id).
        exit_code / signal: decoded from the wait status.
        parent_pid: its parent at the time (the one that reaps it).
        time_unix_nano: when it exited (the event's CLOCK_MONOTONIC stamp, as wall clock).
    """

    pid: int
    exit_code: int | None
    signal: int | None
    parent_pid: int
    time_unix_nano: int


def _kernel_filter_supported() -> bool:
    """Linux >= 6.6 takes ``struct proc_input`` (an event-type filter) in the subscription."""
    try:
        major, minor = (int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 6)


class _Refused(Exception):
    """The kernel refused a proc connector subscription (the reason, one line)."""


def _subscribe(events: int, what: str) -> socket.socket:
    """A non-blocking proc connector socket subscribed to ``events`` (a ``PROC_EVENT_*`` mask;
    a kernel without the filter sends every event and the reader drops the rest). Raises
    :class:`_Refused` with the reason when the kernel, namespace or capability set says no."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_CONNECTOR)
    except (OSError, AttributeError) as exc:
        raise _Refused(f"no proc connector socket ({exc})") from None
    try:
        sock.bind((0, _CN_IDX_PROC))
        try:
            sock.setsockopt(socket.SOL_SOCKET, 33, 4 << 20)  # SO_RCVBUFFORCE (root): bursts of exits
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        payload = struct.pack("=II", _PROC_CN_MCAST_LISTEN, events) if _kernel_filter_supported() \
            else struct.pack("=I", _PROC_CN_MCAST_LISTEN)
        cn = _CN_MSG.pack(_CN_IDX_PROC, _CN_VAL_PROC, 0, 0, len(payload), 0) + payload
        sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(cn), _NLMSG_DONE, 0, 0, 0) + cn)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        why = ("needs CAP_NET_ADMIN" if exc.errno in (errno.EPERM, errno.EACCES)
               else "not in the host's network namespace" if exc.errno == errno.ECONNREFUSED else "")
        raise _Refused(f"kernel {what} events refused ({exc.strerror or exc}{'; ' + why if why else ''})") from None
    return sock


class _ProcEvents:
    """One proc connector subscription (:func:`_subscribe`): its socket, :meth:`fileno`,
    :meth:`close` and the reason the last ``open`` of the subclass was refused."""

    #: why the last ``open`` failed (one line), ``""`` after a success (set per subclass)
    unavailable: str = ""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def _socket(cls, events: int, what: str) -> socket.socket | None:
        """:func:`_subscribe`'s socket, or ``None`` with the reason in ``cls.unavailable``."""
        try:
            sock = _subscribe(events, what)
        except _Refused as exc:
            cls.unavailable = str(exc)
            return None
        cls.unavailable = ""
        return sock

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        """Stop listening (safe twice)."""
        self._sock.close()


class KernelExits(_ProcEvents):
    """The kernel's process-exit events (proc connector), kept per pid for a while.

    Use :meth:`open` (``None`` plus :attr:`unavailable` when the kernel refuses), run
    :meth:`run` in a task group (or call :meth:`drain` before each lookup), then :meth:`get`.
    Safe to call from several threads (:meth:`drain` and :meth:`get` take a lock).
    """

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._exits: OrderedDict[int, KernelExit] = OrderedDict()
        self._lock = threading.Lock()
        #: events the kernel dropped because the socket buffer was full (ENOBUFS)
        self.overruns = 0
        #: exits received
        self.received = 0
        #: times :meth:`run` woke for events waiting
        self.wakes = 0

    @classmethod
    def open(cls) -> KernelExits | None:
        """Subscribe to exit events; ``None`` (and the reason in ``KernelExits.unavailable``)
        when this kernel, namespace or capability set does not allow it."""
        sock = cls._socket(_PROC_EVENT_EXIT, "exit")
        return None if sock is None else cls(sock)

    def drain(self) -> int:
        """Read every event waiting on the socket (never blocks); returns how many exits were new."""
        new = 0
        with self._lock:
            while True:
                try:
                    data = self._sock.recv(65536)
                except BlockingIOError:
                    return new
                except OSError as exc:
                    if exc.errno == errno.ENOBUFS:
                        self.overruns += 1
                        continue
                    return new  # closed
                new += self._parse(data)

    def _parse(self, data: bytes) -> int:
        new = 0
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length = _NLMSGHDR.unpack_from(data, offset)[0]
            if length < _NLMSGHDR.size:
                break
            body = offset + _NLMSGHDR.size + _CN_MSG.size
            if body + _EVENT_HEAD.size + _EXIT_EVENT.size <= offset + length:
                what, _cpu, stamp_ns = _EVENT_HEAD.unpack_from(data, body)
                if what == _PROC_EVENT_EXIT:
                    pid, tgid, status, _sig, _ppid, ptgid = _EXIT_EVENT.unpack_from(data, body + _EVENT_HEAD.size)
                    if pid == tgid:  # the process, not one of its threads
                        code, sig = decode_wait_status(status)
                        self._exits[pid] = KernelExit(pid, code, sig, ptgid, _mono_to_unix_ns(stamp_ns))
                        self._exits.move_to_end(pid)
                        self.received += 1
                        new += 1
                        while len(self._exits) > _MAX_REMEMBERED:
                            self._exits.popitem(last=False)
            offset += (length + 3) & ~3
        return new

    def get(self, pid: int, after_unix_nano: int = 0) -> KernelExit | None:
        """The exit of ``pid`` that happened after ``after_unix_nano`` (its start: a reused pid's
        older exit is not it), reading what is waiting first; ``None`` when none was announced."""
        self.drain()
        with self._lock:
            found = self._exits.get(pid)
        if found is None or found.time_unix_nano < after_unix_nano:
            return None
        return found

    async def run(self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Read events as they come until cancelled (closes the socket at the end), at most once
        per :data:`COALESCE_S` (the events of that time wait in the socket, read together)."""
        task_status.started()
        try:
            while True:
                await anyio.wait_readable(self._sock)
                self.wakes += 1
                self.drain()
                await anyio.sleep(COALESCE_S)
        finally:
            self.close()


class ExecEvents(_ProcEvents):
    """The kernel's exec events (proc connector, ``PROC_EVENT_EXEC``; ``struct exec_proc_event``:
    the process's pid and tgid), counted: whether any process on the host ran a new program
    since the last :meth:`drain`. A new thread or a fork that has not exec'd sends none, so a
    ``/proc`` scan for new programs (:class:`agent.host.procinfo.ServerDumpLog`) need run only
    after one. Only where the kernel filters events per socket (Linux >= 6.6): an older one
    would send every fork, exit and thread's event here (:meth:`open` says no instead).
    """

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        #: exec events read (all processes: the host's own pid numbering)
        self.received = 0
        #: events the kernel dropped because the socket buffer was full (ENOBUFS), each read as an exec
        self.overruns = 0

    @classmethod
    def open(cls) -> ExecEvents | None:
        """Subscribe to exec events; ``None`` (and the reason in ``ExecEvents.unavailable``)
        when refused (not root, not the host's network namespace) or the kernel cannot filter."""
        if not _kernel_filter_supported():
            ExecEvents.unavailable = "kernel exec events need Linux >= 6.6 (an event filter per socket)"
            return None
        sock = cls._socket(_PROC_EVENT_EXEC, "exec")
        return None if sock is None else cls(sock)

    def drain(self) -> list[int]:
        """Read every event waiting (never blocks): the processes (tgids, the host's numbering)
        that exec'd, oldest first; a burst the kernel dropped reads as pid 0; a closed socket
        reads as none."""
        found: list[int] = []
        while True:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    break  # closed
                self.overruns += 1
                found.append(0)
                continue
            _exec_pids(data, found)
        self.received += len(found)
        return found

    async def wait(self) -> None:
        """Until an event waits to be read (cancellable)."""
        await anyio.wait_readable(self._sock)


def _exec_pids(data: bytes, found: list[int]) -> None:
    """The tgids of the exec events in one datagram of netlink messages, appended to ``found``."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length = _NLMSGHDR.unpack_from(data, offset)[0]
        if length < _NLMSGHDR.size:
            break
        body = offset + _NLMSGHDR.size + _CN_MSG.size
        if body + _EVENT_HEAD.size + _EXEC_EVENT.size <= offset + length \
                and _EVENT_HEAD.unpack_from(data, body)[0] == _PROC_EVENT_EXEC:
            found.append(_EXEC_EVENT.unpack_from(data, body + _EVENT_HEAD.size)[1])
        offset += (length + 3) & ~3


# --- OOM kills --------------------------------------------------------------------------------


def _mounts() -> list[tuple[str, str, str]]:
    """``(mount point, fs type, super options)`` of cgroup mounts, from /proc/self/mountinfo."""
    found: list[tuple[str, str, str]] = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                parts, rparts = left.split(), right.split()
                if len(parts) >= 5 and len(rparts) >= 3 and rparts[0] in ("cgroup", "cgroup2"):
                    found.append((parts[4].replace("\\040", " "), rparts[0], rparts[2]))
    except OSError:
        pass
    return found


@dataclass(frozen=True, slots=True)
class OomCounter:
    """A memory cgroup's OOM-kill counter file and the value read.

    Attributes:
        path: ``.../memory.events`` (cgroup v2) or ``.../memory.oom_control`` (v1).
        oom_kills: its ``oom_kill`` value when read (``None``: unreadable).
    """

    path: str
    oom_kills: int | None

    def read(self) -> OomCounter:
        """The same counter, read now."""
        return OomCounter(self.path, _read_oom_kill(self.path))


def _read_oom_kill(path: str) -> int | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def oom_counter_of(pid: int) -> OomCounter | None:
    """The OOM-kill counter of ``pid``'s memory cgroup, read now; ``None`` when there is none
    readable (no memory controller, another cgroup namespace, the process is gone)."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    mounts = _mounts()
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and not controllers:  # cgroup v2
            candidates = [(m, "memory.events") for m, fstype, _ in mounts if fstype == "cgroup2"]
        elif "memory" in controllers.split(","):
            candidates = [(m, "memory.oom_control") for m, fstype, opts in mounts
                          if fstype == "cgroup" and "memory" in opts.split(",")]
        else:
            continue
        for mount, name in candidates:
            file = os.path.join(mount, path.lstrip("/"), name)
            value = _read_oom_kill(file)
            if value is not None:
                return OomCounter(file, value)
    return None


_KILLED = re.compile(rb"(?:Killed process (\d+) \(([^)]*)\))|(?:oom-kill:.*?,pid=(\d+),)")


class OomWatch:
    """OOM kills named by the kernel log (``/dev/kmsg``, read from now on) and by cgroup counters.

    :meth:`open` reads the kernel log from its end (root; ``None`` otherwise: the cgroup
    counters still answer). :meth:`killed` says whether a pid was OOM-killed, and how that is known.
    """

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        self._killed: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, *, from_start: bool = False) -> OomWatch:
        """Follow the kernel log (``from_start``: also what it still holds from before)."""
        try:
            fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return cls(None)
        if not from_start:
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError:
                pass
        return cls(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _drain(self) -> None:
        if self._fd is None:
            return
        for _ in range(100000):  # bounded: the ring holds at most a few thousand records
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before we read them: go on
                    continue
                return
            if not record:
                return
            _, _, message = record.partition(b";")
            first = message.split(b"\n", 1)[0]
            match = _KILLED.search(first)
            if match is not None:
                pid = int(match.group(1) or match.group(3))
                # up to the victim's name: "Memory cgroup out of memory: Killed process 42 (python)"
                line = first[: match.end()].decode("utf-8", "replace").strip().rstrip(",")
                self._killed[pid] = f"kernel log: {line[:160]}"
                while len(self._killed) > 4096:
                    self._killed.popitem(last=False)

    def killed(self, pid: int, counter: OomCounter | None = None) -> str:
        """How ``pid`` is known to be OOM-killed (``""``: it is not). ``counter``: its cgroup's
        counter as read while it lived; the counter having gone up since also says so."""
        with self._lock:
            self._drain()
            found = self._killed.get(pid, "")
        if found:
            return found
        if counter is not None and counter.oom_kills is not None:
            now = counter.read()
            if now.oom_kills is not None and now.oom_kills > counter.oom_kills:
                return f"cgroup {counter.path}: oom_kill {counter.oom_kills}->{now.oom_kills}"
        return ""


# --- a zombie's last time on a CPU ------------------------------------------------------------


def _exec_start_ms(path: str) -> float | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("se.exec_start"):
                    return float(line.split(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def last_ran_unix_nano(pid: int) -> int:
    """When ``pid`` last ran on a CPU (for a zombie: about when it died), ns since the epoch;
    0 when unreadable (no ``/proc/PID/sched``: CONFIG_SCHED_DEBUG off).

    ``se.exec_start`` is in the scheduler's per-CPU task clock; it is turned into wall clock
    through this thread's own ``se.exec_start`` (about now). An estimate (off by up to the
    CPUs' clock skew, under a second here): it orders deaths seconds apart, not milliseconds.
    """
    theirs = _exec_start_ms(f"/proc/{pid}/sched")
    mine = _exec_start_ms("/proc/thread-self/sched")
    if theirs is None or mine is None:
        return 0
    now = time.time_ns()
    return min(now, now - int((mine - theirs) * 1e6))


def _started_unix_nano(create_time_s: float) -> int:
    return int(create_time_s * 1e9) if create_time_s else 0


def zombie_exit_status(pid: int) -> tuple[int | None, int | None] | None:
    """``(exit_code, signal)`` of a zombie from ``/proc/PID/stat``; ``None`` if not readable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw.rsplit(b")", 1)[-1].split()
    # after the comm: field 3 (state) is fields[0]; field 52 (exit_code) is fields[49]
    if len(fields) < 50 or fields[0] != b"Z":
        return None
    try:
        status = int(fields[49])
    except ValueError:
        return None
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None


def zombie_fact(pid: int, create_time_s: float = 0.0) -> ExitFact | None:
    """The fact of a zombie seen now (status from ``/proc/PID/stat``, time from
    ``/proc/PID/sched``), ``None`` when ``pid`` is not a zombie."""
    status = zombie_exit_status(pid)
    if status is None:
        return None
    ran = last_ran_unix_nano(pid)
    return ExitFact.of(pid, *status, source=ExitSource.ZOMBIE, ended_time_unix_nano=ran,
                       ended_source="last_ran" if ran else "", started_time_unix_nano=_started_unix_nano(create_time_s))


#: A notice's start time and the watched process's (psutil's ``create_time``, the same formula
#: read at another moment: ``btime`` moves with clock steps) may differ by this much, ns.
NOTICE_START_SLACK_NS = 500_000_000


def sdk_notice(pid: int, create_time_s: float, uids: tuple[int, ...], base: Path | None = None) -> ExitNotice | None:
    """Process ``pid``'s own death notice (:mod:`agent.sdk.exitnotice`) when it is its own: in
    the private folder of ``uids`` (its uids, read while it lived) in ``base`` (default the
    SDK's; no uids, as for a process that died before they were read: the agent's own, as
    :func:`agent.sdk.folders.sdk_path` does), owned by one of them (or root), for this pid and a
    start within :data:`NOTICE_START_SLACK_NS` of ``create_time_s``; ``None`` otherwise (also
    when either start is unknown). Blocking (a few small reads)."""
    if not create_time_s:
        return None
    owners = tuple(uids) or (os.geteuid(),)
    notice = read_exit_notice(notice_path(pid, base, owners), owners)
    if notice is None or notice.pid != pid or not notice.start_time_unix_nano:
        return None
    if abs(notice.start_time_unix_nano - int(create_time_s * 1e9)) > NOTICE_START_SLACK_NS:
        return None  # an earlier process that had this pid
    return notice


def sdk_notice_fact(pid: int, create_time_s: float, uids: tuple[int, ...], base: Path | None = None) -> ExitFact | None:
    """The :class:`~agent.model.events.ExitFact` of ``pid``'s death notice (:func:`sdk_notice`),
    source :attr:`ExitSource.SDK`, ended at the notice's time (``ended_source`` ``sdk``);
    ``None`` when there is none or it gives no status (``running``: killed without a notice)."""
    notice = sdk_notice(pid, create_time_s, uids, base)
    if notice is None or notice.how == "running":
        return None
    code = notice.exit_code if notice.how in ("exit", "exception") else None
    sig = notice.signal if notice.how == "signal" else None
    if code is None and sig is None:
        return None
    return ExitFact.of(pid, code, sig, source=ExitSource.SDK, ended_time_unix_nano=notice.time_unix_nano,
                       ended_source="sdk" if notice.time_unix_nano else "",
                       started_time_unix_nano=_started_unix_nano(create_time_s))
