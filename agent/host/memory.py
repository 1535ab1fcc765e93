"""The agent's memory footprint over a long run: glibc heap arenas and trimming.

Owns :func:`limit_arenas` and :func:`trim`. A long-running agent allocates on several threads
(the span shipper, the export worker, the metrics reader, anyio's workers); glibc gives each
thread its own heap arena (up to 8 per core) and returns little of a fragmented arena to the OS,
so the resident size creeps up although the Python heap does not grow (``bench/bench_soak.py
--trace-alloc`` shows it flat). Fewer arenas and a periodic ``malloc_trim(0)`` keep the resident
size flat. On anything but glibc both are no-ops. Imports ctypes only (loaded at first use).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["ARENA_MAX", "limit_arenas", "trim"]

log = logging.getLogger("servewatch.memory")

#: Heap arenas the agent's process keeps (glibc's default is 8 per core).
ARENA_MAX = 2
#: ``mallopt`` parameter number of ``M_ARENA_MAX`` in glibc's malloc.h.
_M_ARENA_MAX = -8

_libc: Any = None
_loaded = False


def _glibc() -> Any:
    """glibc's handle, or ``None`` elsewhere (musl, macOS) or when it has no ``malloc_trim``."""
    global _libc, _loaded
    if not _loaded:
        _loaded = True
        if sys.platform.startswith("linux"):
            import ctypes  # here, not at import: a one-shot command never calls this (~2.5 ms)
            import ctypes.util

            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                if (
                    hasattr(libc, "malloc_trim")
                    and hasattr(libc, "mallopt")
                    and hasattr(libc, "gnu_get_libc_version")
                ):
                    libc.malloc_trim.argtypes = [ctypes.c_size_t]
                    libc.malloc_trim.restype = ctypes.c_int
                    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                    libc.mallopt.restype = ctypes.c_int
                    _libc = libc
            except OSError:
                _libc = None
    return _libc


def limit_arenas(arenas: int = ARENA_MAX) -> bool:
    """Cap glibc's heap arenas for this process at ``arenas`` (threads started afterwards share
    them). Call before starting threads. Returns whether it took effect (``False`` off glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, arenas))


def trim() -> bool:
    """Return the free memory at the top of each heap arena and whole free pages inside them to
    the OS (``malloc_trim(0)``; it walks every arena under its lock, so call it from a worker
    thread). Returns whether memory was released (``False`` off glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))
