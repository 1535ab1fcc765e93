"""Tests of agent.watchers, and helpers they share (bounded waits, the fake server's env)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import anyio

from agent.sdk.counter import ENV_SHM_DIR


def server_env(shm_dir: Path) -> dict[str, str]:
    """Environment for a target whose SDK counter files go to ``shm_dir`` (not /dev/shm)."""
    env = dict(os.environ)
    env[ENV_SHM_DIR] = str(shm_dir)
    return env


async def wait_until(predicate: Callable[[], object], *, timeout_s: float = 15.0, every_s: float = 0.01) -> None:
    """Poll ``predicate`` until truthy; fail the test after ``timeout_s`` seconds."""
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(every_s)
