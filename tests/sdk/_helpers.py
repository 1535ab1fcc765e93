"""Shared helpers of the SDK tests: a small real torch model stepped through agent.sdk.step(),
and a launcher of the test programs that waits for their ready line."""

from __future__ import annotations

import gzip
import json
import os
import select
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent import sdk
from agent.sdk import profiler
from tests.conftest import PROGRAMS_DIR

torch = profiler._import_torch()


class TinyModel:
    """A real (small) torch MLP; ``forward_step()`` runs one batch and counts one step."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        self.x = torch.randn(4, 32)

    def forward_step(self, pending: int = 1) -> int:
        with torch.no_grad():
            self.net(self.x)
        return sdk.step(pending=pending)


def load_trace(path: str | Path) -> dict[str, Any]:
    """Load a (small) torch Chrome trace written by the test."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def profiler_steps(trace: dict[str, Any]) -> list[str]:
    """Names of the ``ProfilerStep#k`` CPU ranges in a trace, in time order."""
    evs = [
        e for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    return [e["name"] for e in sorted(evs, key=lambda e: e["ts"])]


def drain(model: TinyModel, max_steps: int = 50) -> None:
    """Leave the process's profiler idle: cancel a pending session, step a running one out."""
    profiler.request_stop()
    for _ in range(max_steps):
        if profiler.status()["state"] == "idle":
            return
        model.forward_step(pending=0)
    raise AssertionError(f"profiler not idle after {max_steps} steps: {profiler.status()}")


def read_line(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    """Read one line of ``proc``'s piped stdout, bounded.

    Args:
        proc: a process started with ``stdout=subprocess.PIPE``.
        timeout_s: bound of the whole read, in seconds.

    Returns:
        The line, decoded, with its newline.

    Raises:
        AssertionError: the process exited or the bound passed before a full line arrived.
    """
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise AssertionError(f"target not ready (rc={proc.poll()}, got {line!r})")
        r, _, _ = select.select([proc.stdout], [], [], left)
        if r:
            line += os.read(proc.stdout.fileno(), 1)
    return line.decode()


class ProgramLauncher:
    """Starts programs of ``tests/programs`` with stdout piped and waits for their ready line.

    Args:
        spawn: the ``spawn`` fixture (processes run in their own group, killed at its teardown).
        python: the interpreter to run them with.
        shm_dir: their ``SERVEWATCH_SHM_DIR``.
    """

    def __init__(self, spawn: Callable[..., subprocess.Popen[bytes]], python: str, shm_dir: Path) -> None:
        self._spawn = spawn
        self._python = python
        self._shm_dir = shm_dir
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, program: str, *extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
        """Start ``program`` with arguments ``extra`` and wait (60 s at most) for its first line.

        Args:
            program: file name under ``tests/programs``.
            *extra: its arguments.
            env: variables added to the inherited environment.

        Returns:
            The process and its first stdout line (decoded, with the newline).
        """
        full = dict(os.environ, SERVEWATCH_SHM_DIR=str(self._shm_dir), **(env or {}))
        proc = self._spawn([self._python, str(PROGRAMS_DIR / program), *extra], stdout=subprocess.PIPE, env=full)
        self._procs.append(proc)
        return proc, read_line(proc)

    def close(self) -> None:
        """Kill and reap every started process (30 s bound each) and close its stdout."""
        for proc in self._procs:
            proc.kill()
            proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
