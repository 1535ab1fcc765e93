"""Helpers shared by the bench scripts (``python bench/<name>.py`` puts this folder on
``sys.path``, so the scripts import it as ``_common``).

Owns :func:`kill_groups`. Imports the standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable

__all__ = ["kill_groups"]


def kill_groups(procs: Iterable[subprocess.Popen[bytes]], *, timeout_s: float) -> None:
    """SIGKILL the process group of every started process and reap it.

    Each process must lead its own group (started with ``start_new_session=True``). A group
    that is already gone is skipped.

    Args:
        procs: the processes started by the bench.
        timeout_s: bound of each reap (``Popen.wait``), in seconds; passing it raises
            :class:`subprocess.TimeoutExpired`.
    """
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout_s)
