"""agent.host.memory: a real process's freed heap goes back to the OS with trim()."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from agent.host import memory

# Allocates ~200 MB in 1 KiB blocks (glibc's heap, not pymalloc's arenas and below the mmap
# threshold), frees all but a block at the top (so free() alone cannot shrink the heap), and
# reports its RSS before and after agent.host.memory.trim().
_PROGRAM = r"""
import json
from agent.host import memory

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6

limited = memory.limit_arenas()
blocks = [bytes(1024) for _ in range(200_000)]
pin = bytes(1024)
peak = rss_mb()
del blocks
freed = rss_mb()
trimmed = memory.trim()
print(json.dumps({"limited": limited, "peak": peak, "freed": freed, "trimmed": trimmed, "after": rss_mb()}))
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_trim_returns_freed_heap_to_the_os() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    assert result["limited"] is True and result["trimmed"] is True
    assert result["peak"] > 150  # the blocks were resident
    assert result["freed"] > result["peak"] - 50  # free() alone kept most of it
    assert result["after"] < result["freed"] - 150  # trim() gave it back


def test_off_glibc_both_are_harmless_no_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_loaded", True)
    monkeypatch.setattr(memory, "_libc", None)
    assert memory.limit_arenas() is False
    assert memory.trim() is False
