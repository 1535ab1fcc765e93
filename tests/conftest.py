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
    """SIGKILL ``proc``'s process group, also when ``proc`` (its leader) exited first and left a
    child in it (a launcher that exits once its server listens). A reaped leader's pid names no
    other process while a member of its group lives (the kernel keeps the number), so the group
    is killed unless that pid was given to a new process: then the group is empty."""
    leader_alive = proc.poll() is None
    if leader_alive or not os.path.exists(f"/proc/{proc.pid}"):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            if leader_alive:
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
    """The suite run through ``sudo`` trusts no extra uid's folders (agent.host.fsutil.trusted_uids):
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


# -- per-group durations (issue 38 item 5: where CI's time goes) ------------------------------

_GROUP_SECONDS: dict[str, list[float]] = {}


def _duration_group(nodeid: str) -> str:
    """A test's group: its top-level folder under tests/ (``tests/exporters``), else its file."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else path


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Adds each phase's seconds (setup, call, teardown) to its group's total; counts a test once."""
    seconds = _GROUP_SECONDS.setdefault(_duration_group(report.nodeid), [0.0, 0])
    seconds[0] += report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        seconds[1] += 1


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After ``--durations``: seconds per group (folder or file), slowest first, with the groups'
    share of the run, so the suite's growth shows where it lands."""
    if not _GROUP_SECONDS:
        return
    total = sum(s for s, _ in _GROUP_SECONDS.values()) or 1.0
    terminalreporter.write_sep("=", "durations per group (setup + call + teardown)")
    rows = sorted(_GROUP_SECONDS.items(), key=lambda kv: kv[1][0], reverse=True)
    for group, (seconds, count) in rows[:25]:
        terminalreporter.write_line(
            f"{seconds:9.2f}s {100 * seconds / total:5.1f}% {int(count):5d} tests  {group}"
        )
    if len(rows) > 25:
        rest = rows[25:]
        terminalreporter.write_line(
            f"{sum(r[1][0] for r in rest):9.2f}s {100 * sum(r[1][0] for r in rest) / total:5.1f}% "
            f"{int(sum(r[1][1] for r in rest)):5d} tests  ({len(rest)} more groups)"
        )
    terminalreporter.write_line(f"{total:9.2f}s in tests (setup + call + teardown)")
