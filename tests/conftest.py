"""Shared fixtures: subprocesses that are always cleaned up, even when a test fails."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.blocking import blocking_checked

TESTS_DIR = Path(__file__).resolve().parent
PROGRAMS_DIR = TESTS_DIR / "programs"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """Start a subprocess in its own process group; killed (group and all) at teardown.

    Usage: ``proc = spawn([sys.executable, script, ...], env=..., cwd=...)``.
    """
    procs: list[subprocess.Popen[bytes]] = []

    def _spawn(argv: list[str], **kwargs) -> subprocess.Popen[bytes]:
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, **kwargs)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        _kill_group(proc)


@pytest.fixture
def python() -> str:
    """The interpreter running the tests (targets run under it too)."""
    return sys.executable


@pytest.fixture(autouse=True, scope="session")
def _private_shm_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Step counters and SDK control sockets of the test run (and its children) go to a private
    folder, not /dev/shm: a target killed with SIGKILL cannot leave files behind there, and
    tests never see another run's files."""
    previous = os.environ.get("SERVEWATCH_SHM_DIR")
    os.environ["SERVEWATCH_SHM_DIR"] = str(tmp_path_factory.mktemp("shm"))
    yield
    if previous is None:
        os.environ.pop("SERVEWATCH_SHM_DIR", None)
    else:
        os.environ["SERVEWATCH_SHM_DIR"] = previous


@pytest.fixture(autouse=True, scope="session")
def _no_sudo_user() -> Iterator[None]:
    """The suite run through ``sudo`` trusts no extra uid's folders (agent.fsutil.trusted_uids):
    the refusals the tests assert are the same however they were started."""
    previous = os.environ.pop("SUDO_UID", None)
    yield
    if previous is not None:
        os.environ["SUDO_UID"] = previous


@pytest.fixture(autouse=True)
def no_blocking_on_the_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every ``async def`` test runs with blocking calls on the event loop from agent or
    exporter code made errors (blockbuster; tests/blocking.py says what is checked and allowed)."""
    if not inspect.iscoroutinefunction(getattr(request.node, "function", None)) or request.node.get_closest_marker(
        "blocking_unchecked"
    ):
        yield
        return
    with blocking_checked():
        yield
