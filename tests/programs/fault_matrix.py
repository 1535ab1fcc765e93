"""The fault matrix on real processes: a gloo job of TP ranks (:mod:`tests.programs.dist_rank`),
one fault on one rank, the real agent watching, and the incident with its verdict.

Used by ``tests/test_fault_matrix.py`` and ``bench/bench_verdict.py``. Imports the agent runtime.

Each case starts ``tp`` rank processes (each leads its own process group and is a child of the
agent, as with ``servewatch launch``, so exit statuses are known), waits until every rank has
stepped, injects the fault and waits for the incident: the watchdog's stall (``hang``, ``skip``),
the rank's exit (``kill``), or a manual incident once the fault has fired (``shape``: gloo carries
on; ``slow``: nothing is stuck).
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

PROGRAM = Path(__file__).with_name("dist_rank.py")
ROOT = Path(__file__).resolve().parents[2]

#: fault -> (trigger expected, the verdict kind expected, culprit named?)
EXPECTED: dict[str, tuple[str, str, bool]] = {
    "hang": ("stall", "behind", True),
    "kill": ("exit", "dead", True),
    "skip": ("stall", "desync", True),
    "shape": ("manual", "desync", True),
    "slow": ("manual", "progressing", False),
}
FAULT_STEP = 4


@dataclass
class CaseResult:
    """What one case produced."""

    tp: int
    fault: str
    fault_rank: int
    record: Any = None
    #: seconds the Flight Recorder reads plus the verdict added to the incident
    verdict_added_s: float = 0.0
    log: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Any:
        return None if self.record is None else self.record.verdict

    @property
    def expected_culprits(self) -> tuple[int, ...]:
        return (self.fault_rank,) if EXPECTED[self.fault][2] else ()

    @property
    def correct(self) -> bool:
        v = self.verdict
        if v is None:
            return False
        _, kind, _ = EXPECTED[self.fault]
        ok = v.kind == kind and tuple(v.culprit_ranks) == self.expected_culprits
        if self.fault == "slow":
            ok = ok and not v.hung
        return ok


def _added_s(record: Any) -> float:
    fr = [r for r in record.results if r.action == "flightrec.dump"]
    span = 0.0
    if fr:
        span = (max(r.end_time_unix_nano for r in fr) - min(r.start_time_unix_nano for r in fr)) / 1e9
    return span + record.verdict_duration_s


def _env(shm_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["SERVEWATCH_SHM_DIR"] = str(shm_dir)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    return env


def start_ranks(tp: int, workdir: Path, *, fault: str = "none", fault_rank: int = 1, extra: list[str] | None = None,
                title: str | None = None) -> list[subprocess.Popen[bytes]]:
    """Start ``tp`` ranks; the caller must :func:`stop_ranks` them (also on failure)."""
    store = workdir / f"store-{time.monotonic_ns()}"
    title = title or f"faultjob{os.getpid()}x{time.monotonic_ns() % 100000}::scheduler"
    procs = []
    for rank in range(tp):
        argv = [sys.executable, str(PROGRAM), "--rank", str(rank), "--world-size", str(tp), "--init", f"file://{store}",
                "--title", title, "--fault", fault, "--fault-rank", str(fault_rank), "--fault-step", str(FAULT_STEP),
                *(extra or [])]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                      env=_env(Path(os.environ.get("SERVEWATCH_SHM_DIR", "/dev/shm"))),
                                      start_new_session=True, cwd=workdir))
    return procs


def wait_ready(procs: list[subprocess.Popen[bytes]], timeout_s: float = 90.0) -> None:
    """Block until every rank printed READY (the process group is up)."""
    import select

    deadline = time.monotonic() + timeout_s
    for proc in procs:
        assert proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise RuntimeError(f"rank pid {proc.pid} not ready (exit {proc.poll()})")
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
            if ready and proc.stdout.readline().startswith(b"READY"):
                break


def stop_ranks(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every rank's process group and reap it (bounded)."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if proc.stdout is not None:
            proc.stdout.close()


async def run_case(tp: int, fault: str, fault_rank: int, *, workdir: Path | None = None,
                   deadline_s: float = 100.0, watchdog_timeout_s: float = 2.0,
                   hard: dict[str, Any] | None = None) -> CaseResult:
    """Run one case end to end and return its incident (``record`` is ``None`` if none came).

    Args:
        hard: watchdog hard-mode settings (``{"hard": True, "signal": "SIGTERM", ...}``).
        workdir: keeps the bundle there (default: a temporary folder removed afterwards).
    """
    from agent.config import load_settings
    from agent.runtime import Agent
    from agent.sdk import read_counter
    from agent.sdk.counter import counter_path
    from exporters.provider import build_telemetry

    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="sw-faults-")) if own_dir else workdir
    assert wd is not None
    result = CaseResult(tp=tp, fault=fault, fault_rank=fault_rank)
    procs = start_ranks(tp, wd, fault=fault, fault_rank=fault_rank)
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        settings = load_settings({
            "data_dir": wd / "data",
            "host_name": "faults",
            "target": {"pids": [p.pid for p in procs]},
            "watchdog": {"timeout_s": watchdog_timeout_s, "poll_interval_s": 0.25, **(hard or {})},
            "coredump": {"enabled": False},
            "incident": {"cooldown_s": 300.0},
        })
        records: list[Any] = []
        got = anyio.Event()

        def on_incident(record: Any) -> None:
            records.append(record)
            got.set()

        telemetry = build_telemetry(settings.export, data_dir=settings.data_dir, host_name=settings.host_name)
        agent = Agent(settings, telemetry=telemetry, children=procs, on_incident=on_incident)
        with anyio.fail_after(deadline_s):
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)

                def stepped(n: int) -> bool:
                    snaps = [read_counter(counter_path(p.pid)) for p in procs]
                    return all(s is not None and s.forward_ct >= n for s in snaps)

                while not stepped(1):
                    await anyio.sleep(0.1)
                if EXPECTED[fault][0] == "manual":
                    # the fault fires at FAULT_STEP; let it be recorded a few steps deep
                    while not stepped(FAULT_STEP + 2):
                        await anyio.sleep(0.1)
                    await agent.incidents.open_incident("manual", detail=f"fault matrix: {fault} on rank {fault_rank}")
                await got.wait()
                agent.stop()
                tg.cancel_scope.cancel()
        await telemetry.aclose(3.0)
        result.record = records[0]
        result.verdict_added_s = _added_s(records[0])
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)
        if own_dir:
            import shutil

            shutil.rmtree(wd, ignore_errors=True)
    return result
