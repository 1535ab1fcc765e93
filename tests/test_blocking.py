"""The blocking-call check of async tests (tests/blocking.py) catches what it should and no more.

Probes are compiled with a file name inside the ``agent`` package, so the checker sees them as
agent code, exactly as it sees ``agent/runtime/agent.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from blockbuster import BlockingError

import agent

PROBES = """
from agent.host.targets import process_state

async def read_on_the_loop(path):
    with open(path, "rb") as f:
        return f.read()

async def read_on_a_thread(path):
    import anyio
    return await anyio.to_thread.run_sync(read_sync, path)

def read_sync(path):
    with open(path, "rb") as f:
        return f.read()

async def stat_on_the_loop(path):
    import os
    return os.stat(path).st_size

async def state_on_the_loop(pid):
    return process_state(pid)
"""


@pytest.fixture
def probes() -> dict[str, Callable[..., Any]]:
    namespace: dict[str, Any] = {}
    code = compile(PROBES, os.path.join(agent.__path__[0], "_blocking_probe.py"), "exec")
    exec(code, namespace)  # noqa: S102 - probes that the checker must take for agent code
    return namespace


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * 100)
    return path


async def test_a_file_read_by_an_agent_coroutine_on_the_loop_fails(probes: dict, data_file: Path) -> None:
    with pytest.raises(BlockingError, match="BufferedReader.read"):
        await probes["read_on_the_loop"](data_file)


async def test_a_stat_by_an_agent_coroutine_on_the_loop_fails(probes: dict, data_file: Path) -> None:
    with pytest.raises(BlockingError, match="os.stat"):
        await probes["stat_on_the_loop"](data_file)


async def test_the_same_read_on_a_worker_thread_passes(probes: dict, data_file: Path) -> None:
    assert await probes["read_on_a_thread"](data_file) == b"x" * 100


async def test_a_test_calling_a_sync_agent_helper_itself_passes(probes: dict, data_file: Path) -> None:
    assert probes["read_sync"](data_file) == b"x" * 100  # no agent coroutine on the stack
    assert data_file.read_bytes() == b"x" * 100  # the test's own I/O is not what is checked


async def test_the_documented_allowance_process_state_passes(probes: dict) -> None:
    from agent.host.targets import ProcessState

    assert await probes["state_on_the_loop"](os.getpid()) is ProcessState.RUNNING


def test_a_sync_test_is_not_checked(probes: dict, data_file: Path) -> None:
    async def main() -> bytes:
        return await probes["read_on_the_loop"](data_file)

    assert anyio.run(main) == b"x" * 100
