"""Process discovery: which processes servewatch watches and acts on.

Owns :class:`Target` and discovery (descendants of a root pid, process-title globs, explicit
pids). Imports psutil and :mod:`agent.events` only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Target"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A process to watch and act on.

    Attributes:
        pid: process id.
        title: the process title as matched (first non-empty cmdline element, else the process
            name), e.g. ``"sglang::scheduler_TP0"``.
        create_time_s: psutil's creation time (seconds since the epoch); with ``pid`` it
            identifies the process across pid reuse.
        cmdline: the full argv as the kernel reports it (empty strings removed).
    """

    pid: int
    title: str = ""
    create_time_s: float = 0.0
    cmdline: tuple[str, ...] = ()
