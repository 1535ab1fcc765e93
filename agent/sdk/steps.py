"""The exact forward-step counter of the served process and the hooks run at each step.

Owns :func:`step`, :func:`set_pending`, :func:`forward_ct`, the step hooks other SDK parts (the
profiler) run on the model thread (:func:`add_step_hook`) and the counter file's life
(:func:`close`, reset in a forked child). :mod:`agent.sdk` re-exports it: ``agent.sdk.step()``.
At the first step it installs the death notice (:mod:`agent.sdk.exitnotice`). Imports the
standard library, :mod:`agent.sdk.counter` and :mod:`agent.sdk.exitnotice` only.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable

from agent.sdk import exitnotice
from agent.sdk.counter import (
    W_FORWARD_CT,
    W_LAST_STEP,
    W_PENDING,
    W_RANK,
    SharedCounter,
)

__all__ = ["add_step_hook", "close", "forward_ct", "remove_step_hook", "set_pending", "step"]

_counter: SharedCounter | None = None
_words = None  # memoryview of the counter words; None until the first step
_hooks: list[Callable[[int], None]] = []
_lock = threading.Lock()
_monotonic_ns = time.monotonic_ns
#: steps left during which the rank is looked for (torch.distributed initialised after the
#: first step); 0 once found or given up
_rank_tries = 1 << 12


def _learn_rank(w: memoryview, n: int) -> None:
    """Record torch.distributed's rank in the counter (word ``rank_plus_one``) once its default
    process group is up: at the first step, then every 64th, for the first 4096 steps. torch is
    never imported here (only looked up if the server imported it)."""
    global _rank_tries
    _rank_tries -= 1
    if n != 1 and n & 63:
        return
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            w[W_RANK] = int(dist.get_rank()) + 1
            _rank_tries = 0
    except Exception:  # noqa: BLE001 - a server's torch must never break its step
        _rank_tries = 0


def _open() -> memoryview:
    global _counter, _words
    with _lock:
        if _words is None:
            # first: the counter's file appears only once its first words can follow at once (a
            # reader between its creation and the caller's pending write reads it idle)
            exitnotice.install()  # how this process ends, for the agent (agent.sdk.exitnotice)
            _counter = SharedCounter()
            _words = _counter.words
            atexit.register(close)
    return _words


def step(pending: int | None = None) -> int:
    """Count one forward step (one scheduler batch) of this process.

    The hot path is three stores into a shared memory mapping and a vDSO clock read: no
    syscall, no lock, no allocation beyond the int. Until torch.distributed's rank is recorded
    (at most the first 4096 steps) every 64th step also looks it up. Step hooks (the SDK
    profiler) run after the count, on this thread.

    Args:
        pending: work items still pending after this step (>0 means the server is busy);
            ``None`` leaves the last value.

    Returns:
        The new ``forward_ct``.
    """
    w = _words
    if w is None:
        w = _open()
    n = w[W_FORWARD_CT] + 1
    w[W_FORWARD_CT] = n
    w[W_LAST_STEP] = _monotonic_ns()
    if pending is not None:
        w[W_PENDING] = pending
    if _rank_tries:
        _learn_rank(w, n)
    if _hooks:
        for hook in tuple(_hooks):
            hook(n)
    return n


def set_pending(pending: int) -> None:
    """Record how many work items are pending (>0 = busy) without counting a step.

    Call it when work arrives at an idle loop, so a hang in the very next forward is seen as
    "busy and no progress".
    """
    w = _words
    if w is None:
        w = _open()
    w[W_PENDING] = pending


def forward_ct() -> int:
    """Steps counted so far in this process (0 before the first)."""
    w = _words
    return 0 if w is None else int(w[W_FORWARD_CT])


def add_step_hook(hook: Callable[[int], None]) -> None:
    """Run ``hook(forward_ct)`` on the stepping thread after every step (SDK-internal)."""
    with _lock:
        _hooks.append(hook)


def remove_step_hook(hook: Callable[[int], None]) -> None:
    """Remove a hook added by :func:`add_step_hook`; a no-op when absent."""
    with _lock:
        try:
            _hooks.remove(hook)
        except ValueError:
            pass


def close() -> None:
    """Unmap and remove this process's counter file (also run at exit); safe twice."""
    global _counter, _words
    with _lock:
        counter, _counter, _words = _counter, None, None
    if counter is not None:
        counter.close()


def _after_fork_in_child() -> None:
    # The child must not bump its parent's counter: start its own at its first step.
    global _counter, _words, _lock, _rank_tries
    _counter, _words, _lock = None, None, threading.Lock()
    _rank_tries = 1 << 12
    _hooks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
