"""No blocking file, process or socket call on the event loop from agent code, checked in tests.

:func:`blocking_checked` (the ``no_blocking_on_the_loop`` fixture in conftest.py wraps every
``async def`` test in it) activates `blockbuster <https://github.com/cbornet/blockbuster>`_: a
blocking call (``open``/``read`` of a file, ``os.stat``/``mkdir``/``listdir``/``scandir``, a psutil
read of ``/proc``, ``time.sleep``, a blocking socket) made on a thread running an asyncio event loop
raises :class:`blockbuster.BlockingError`, failing the test, when a coroutine of ``agent`` or
``exporters`` is on the stack: the agent's async code blocked its own loop. Not flagged:

- code run through ``anyio.to_thread.run_sync`` (a worker thread has no loop);
- a test calling a synchronous agent helper itself (``target_of(proc)`` while setting up): no agent
  coroutine is on the stack, and the test's own blocking is not what this checks;
- ``threading.Lock.acquire``: blockbuster flags it only while another thread holds the lock, so the
  outcome would depend on timing (a flaky test); our locks guard a few field updates.

Allowed on the loop (``ALLOWED``), each bounded: a few hundred bytes of procfs, or once per
process; never a disk write or a scan over all processes, which stay errors:

- :func:`agent.host.targets.process_state`: reads ``/proc/PID/stat`` of one process (psutil: creation
  time and state; ``os.stat("/proc/PID")`` when it is gone), a few hundred bytes the kernel formats
  from the task struct without taking the target's mmap lock, so a target stuck in the driver
  (state D) cannot hang the reader; the process watcher and the runtime poll it once a second per
  target. ``cmdline``, ``environ``, ``maps`` and fd reads take that lock or grow with the target,
  and scans over all pids grow with the host: those stay errors and run on worker threads.
- :func:`agent.host.procinfo.last_pid` (``os.read``): ``/proc/loadavg``, ~40 bytes the kernel formats
  from two counters, four times a second: the servers' own py-spy runs are scanned for (a
  ``/proc`` listing on a worker thread) only when a process was created since the last scan.
- :meth:`agent.watchers.steps.ShmStepSource.read_now` (``os.read``): ``ShmStepSource.read``
  reads an SDK step counter (64 bytes) on the loop only once the file was found on a memory
  filesystem (:func:`agent.host.fsutil.memory_backed`, checked on a worker thread): a read of tmpfs
  pages, a few microseconds, against ~100 us of CPU for a worker-thread hop, several times a second
  per rank (a first reading, or one that needs ``/proc``, is taken on a worker thread).
- :meth:`agent.model.lazy.LazyModule._load`: the first use of a lazily imported module imports it, once
  per process (``prometheus_client`` reads ``/proc/self/stat`` at import). Imports at the top of
  a function are not flagged at all (blockbuster allows importlib's own file reads).
- :func:`agent.host.memory._glibc`: finding libc (``ctypes.util.find_library`` runs ``ldconfig -p``)
  once per process, at the agent's start, on the loop thread on purpose: glibc's arena limit
  must be set before any thread (an anyio worker included) starts.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from blockbuster import BlockBuster

__all__ = ["ALLOWED", "SCANNED", "UNCHECKED", "blocking_checked"]

#: Packages whose coroutines must not block the loop.
SCANNED = ("agent", "exporters")
#: Wrapped functions left off (see the module docstring).
UNCHECKED = ("threading.Lock.acquire", "threading.Lock.acquire_lock")
#: What reading and finding files calls (an import, ``find_library``): no writes.
_READS = (
    "io.BufferedReader.read", "io.TextIOWrapper.read", "os.read", "os.stat", "os.listdir", "os.scandir",
    "os.getcwd", "os.path.abspath", "os.path.islink", "os.readlink", "os.access",
)
#: Bounded blocking calls allowed on the loop: (file suffix, function names) -> wrapped calls.
ALLOWED: dict[tuple[str, frozenset[str]], tuple[str, ...]] = {
    ("agent/model/lazy.py", frozenset({"_load"})): _READS,
    ("agent/host/memory.py", frozenset({"_glibc"})): _READS,
    ("agent/host/targets.py", frozenset({"process_state"})): ("io.BufferedReader.read", "os.stat"),
    ("agent/host/procinfo.py", frozenset({"last_pid"})): ("os.read",),
    ("agent/watchers/steps.py", frozenset({"read_now"})): ("os.read",),
}

_ASYNC_FLAGS = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
_PREFIXES = tuple(importlib.import_module(name).__path__[0] + "/" for name in SCANNED)


def _agent_coroutine_on_stack() -> bool:
    """Whether a coroutine (or async generator) of a scanned package is a caller of this frame."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_flags & _ASYNC_FLAGS and code.co_filename.startswith(_PREFIXES):
            return True
        frame = frame.f_back
    return False


def _only_from_agent_coroutines(allowed: Callable[..., bool]) -> Callable[..., bool]:
    def can_block(*args: Any, **kwargs: Any) -> bool:
        return allowed(*args, **kwargs) or not _agent_coroutine_on_stack()

    return can_block


@contextmanager
def blocking_checked() -> Iterator[BlockBuster]:
    """Blocking calls on an event loop thread under an agent or exporter coroutine raise
    :class:`blockbuster.BlockingError` inside this block."""
    bb = BlockBuster(list(SCANNED))
    for name in UNCHECKED:
        del bb.functions[name]
    for function in bb.functions.values():
        function.can_block_predicate = _only_from_agent_coroutines(function.can_block_predicate)
    for (filename, functions), names in ALLOWED.items():
        for name in names:
            bb.functions[name].can_block_in(filename, set(functions))
    bb.activate()
    try:
        yield bb
    finally:
        bb.deactivate()
