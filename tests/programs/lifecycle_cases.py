"""Lifecycle cases of the fault matrix on real processes: a server process that owns its gloo ranks
and reaps them at once (:mod:`tests.programs.rank_server`), the real agent watching them by title
(as ``servewatch run --match``), and what it made of their ends.

Cases (``LIFECYCLE_EXPECTED``): ``clean`` (every rank finishes in order, exit 0), ``sigterm`` (the
tree is stopped with SIGTERM, as systemd or kubelet do), ``oom`` (one rank is killed by the kernel's
OOM killer in a memory-limited cgroup), ``late`` (rank 3 of 4 crashed with SIGSEGV and two ranks
died after it before the agent looked: ``dump``'s manual incident, ranks left zombies).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from tests.programs.fault_matrix import ROOT, _env

SERVER = Path(__file__).with_name("rank_server.py")

#: case -> (incident trigger expected or None, culprit rank expected or None)
LIFECYCLE_EXPECTED: dict[str, tuple[str | None, int | None]] = {
    "clean": (None, None),
    "sigterm": (None, None),
    "oom": ("exit", 1),
    "late": ("manual", 3),
}

#: The memory limit of the OOM case's cgroup: a gloo rank with torch takes ~350 MiB here.
OOM_LIMIT_BYTES = 1 << 30


@dataclass
class LifecycleResult:
    """What one lifecycle case produced."""

    case: str
    records: list[Any] = field(default_factory=list)
    #: (target, ExitFact) of every exit the process watcher reported, in order
    exits: list[tuple[Any, Any]] = field(default_factory=list)
    #: rank -> pid
    ranks: dict[int, int] = field(default_factory=dict)
    server_pid: int = 0
    #: what the incident manager said of each exit (pid -> words)
    outcomes: dict[int, str] = field(default_factory=dict)
    #: the memory cgroup the OOM case used (``memory.events`` or ``memory.oom_control``)
    cgroup: str = ""


class MemoryCgroup:
    """A memory-limited cgroup made for one test (v2 where the memory controller is there, else v1),
    removed at the end; :meth:`create` returns ``None`` (and the reason) where neither is writable."""

    def __init__(self, path: Path, counter: str) -> None:
        self.path = path
        self.counter = counter

    @classmethod
    def create(cls, limit_bytes: int) -> tuple[MemoryCgroup | None, str]:
        name = f"servewatch-test-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        tried: list[str] = []
        v2 = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified/cgroup.controllers").exists() \
            else Path("/sys/fs/cgroup")
        if "memory" in _read(v2 / "cgroup.controllers").split():
            path = v2 / name
            try:
                path.mkdir()
                (path / "memory.max").write_text(str(limit_bytes))
                (path / "memory.swap.max").write_text("0") if (path / "memory.swap.max").exists() else None
                return cls(path, "memory.events"), ""
            except OSError as exc:
                tried.append(f"v2 {path}: {exc}")
                _rmdir(path)
        v1 = Path("/sys/fs/cgroup/memory")
        if (v1 / "memory.limit_in_bytes").exists():
            path = v1 / name
            try:
                path.mkdir()
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                return cls(path, "memory.oom_control"), ""
            except OSError as exc:
                tried.append(f"v1 {path}: {exc}")
                _rmdir(path)
        return None, "; ".join(tried) or "no writable memory cgroup (v1 or v2) on this machine"

    def remove(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _rmdir(self.path):
                return
            time.sleep(0.1)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def start_server(workdir: Path, tp: int, *server_args: str, rank_args: tuple[str, ...] = ()) -> tuple[
        subprocess.Popen[bytes], str]:
    """Start a rank server in its own process group; returns it and the ranks' title prefix."""
    store = workdir / f"store-{time.monotonic_ns()}"
    title = f"lifejob{os.getpid()}x{time.monotonic_ns() % 100000}::scheduler"
    argv = [sys.executable, str(SERVER), "--tp", str(tp), "--init", f"file://{store}", "--title", title,
            *server_args, "--", *rank_args]
    env = _env(Path(os.environ.get("SERVEWATCH_SHM_DIR", "/dev/shm")))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True, cwd=workdir)
    return proc, title


def wait_server_ready(proc: subprocess.Popen[bytes], tp: int, timeout_s: float = 120.0) -> dict[int, int]:
    """Block until every rank printed READY; returns rank -> pid."""
    import select

    assert proc.stdout is not None
    ranks: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(ranks) < tp:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise RuntimeError(f"rank server {proc.pid} not ready: {ranks} (exit {proc.poll()})")
        if select.select([proc.stdout], [], [], min(left, 1.0))[0]:
            line = proc.stdout.readline()
            if line.startswith(b"READY"):
                _, rank, pid = line.split()
                ranks[int(rank)] = int(pid)
    return ranks


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the server's process group (its ranks) and reap the server (bounded)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    if proc.stdout is not None:
        proc.stdout.close()


def _gone_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


async def run_lifecycle_case(case: str, *, workdir: Path | None = None, deadline_s: float = 150.0) -> LifecycleResult:
    """Run one lifecycle case end to end (the real agent in this process, watching by title)."""
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings
    from exporters.otlp.provider import build_telemetry

    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="sw-life-")) if own_dir else workdir
    assert wd is not None
    result = LifecycleResult(case=case)
    cgroup: MemoryCgroup | None = None
    tp = 4 if case == "late" else 2
    server_args: list[str] = []
    rank_args: tuple[str, ...] = ("--fault-step", "6")
    if case == "clean":
        rank_args = ("--steps", "40")
    elif case == "oom":
        cgroup, why = MemoryCgroup.create(OOM_LIMIT_BYTES)
        if cgroup is None:
            raise RuntimeError(f"no memory cgroup for the OOM case: {why}")
        result.cgroup = str(cgroup.path / cgroup.counter)
        server_args = ["--memory-cgroup", str(cgroup.path), "--cgroup-rank", "1"]
        rank_args = ("--fault", "oom", "--fault-rank", "1", "--fault-step", "30", "--linger-s", "3")
    elif case == "late":
        server_args = ["--no-reap", "--linger", "0=0.5", "--linger", "2=1", "--linger", "1=90"]
        rank_args = ("--fault", "kill", "--fault-rank", "3", "--fault-step", "6")
    proc, title = start_server(wd, tp, *server_args, rank_args=rank_args)
    try:
        result.server_pid = proc.pid
        result.ranks = await anyio.to_thread.run_sync(wait_server_ready, proc, tp)
        if case == "late":  # the crash and two deaths after it happen before any agent looks
            with anyio.fail_after(60):
                while not all(_gone_or_zombie(result.ranks[r]) for r in (3, 0, 2)):
                    await anyio.sleep(0.1)
        settings = load_settings({
            "data_dir": wd / "data",
            "host_name": "life",
            "target": {"match": [f"{title}_TP*"]},
            "watchdog": {"timeout_s": 5.0, "poll_interval_s": 0.25},
            "coredump": {"enabled": False},
            "incident": {"cooldown_s": 300.0},
        })
        telemetry = build_telemetry(settings.export, data_dir=settings.data_dir, host_name=settings.host_name)
        agent = Agent(settings, telemetry=telemetry, on_incident=result.records.append)
        with anyio.fail_after(deadline_s):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                watcher = agent.process_watcher
                while len(watcher.pids) < (1 if case == "late" else tp):
                    await anyio.sleep(0.1)
                if case == "sigterm":
                    await anyio.sleep(1.0)  # serving a few steps
                    os.killpg(proc.pid, signal.SIGTERM)  # systemd / kubelet stopping the whole tree
                if case == "late":
                    await agent.incidents.open_incident("manual", detail="servewatch dump of a collapsing job")
                else:
                    # every rank's end handled: an incident written, or none needed
                    while not (len(watcher.exits) >= tp and all(
                            p in agent.incidents.exits_handled for p in result.ranks.values())
                            and agent.incidents.current is None):
                        await anyio.sleep(0.1)
                    await anyio.sleep(1.0)  # a follow-up (health, stall) would open now
                result.exits = list(watcher.exits)
                result.outcomes = dict(agent.incidents.exit_outcomes)
                agent.stop()
                tg.cancel_scope.cancel()
        await telemetry.aclose(3.0)
    finally:
        await anyio.to_thread.run_sync(stop_server, proc)
        if cgroup is not None:
            await anyio.to_thread.run_sync(cgroup.remove)
        if own_dir:
            import shutil

            shutil.rmtree(wd, ignore_errors=True)
    return result
