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

import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
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
                title: str | None = None, env: dict[str, str] | None = None) -> list[subprocess.Popen[bytes]]:
    """Start ``tp`` ranks (``env``: variables set for them); the caller must :func:`stop_ranks` them
    (also on failure)."""
    store = workdir / f"store-{time.monotonic_ns()}"
    title = title or f"faultjob{os.getpid()}x{time.monotonic_ns() % 100000}::scheduler"
    procs = []
    rank_env = {**_env(Path(os.environ.get("SERVEWATCH_SHM_DIR", "/dev/shm"))), **(env or {})}
    for rank in range(tp):
        argv = [sys.executable, str(PROGRAM), "--rank", str(rank), "--world-size", str(tp), "--init", f"file://{store}",
                "--title", title, "--fault", fault, "--fault-rank", str(fault_rank), "--fault-step", str(FAULT_STEP),
                *(extra or [])]
        # unbuffered: select() on the pipe must see every line, none left in a reader's buffer
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                      bufsize=0,
                                      env=rank_env, start_new_session=True, cwd=workdir))
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
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings
    from agent.sdk import read_counter
    from agent.sdk.counter import counter_path
    from exporters.otlp.provider import build_telemetry

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


# --- the shapes real hangs take (issue 22): one function per shape ------------------------------

LAUNCHER = Path(__file__).with_name("rank_launcher.py")
IPC_ENGINE = Path(__file__).with_name("ipc_engine.py")


@dataclass
class ShapeResult:
    """What one shape produced and what its verdict must say.

    Attributes:
        name: the shape.
        record: the incident (``None`` for a shape read from a ``servewatch dump`` manifest).
        verdict: the verdict as JSON (``Verdict.to_json()`` or the manifest's ``verdict``).
        kind / ranks / pids / confidence: what the verdict must conclude.
        forbidden_pids: pids no line of the verdict may name (another server's processes).
        added_s: seconds the Flight Recorder reads plus the verdict added.
    """

    name: str
    record: Any = None
    verdict: dict[str, Any] = field(default_factory=dict)
    kind: str = ""
    ranks: tuple[int, ...] = ()
    pids: tuple[int, ...] = ()
    confidence: str = ""
    forbidden_pids: tuple[int, ...] = ()
    added_s: float = 0.0
    #: every watcher status line said while the agent watched (``name: state reason``), where the shape records them
    statuses: list[str] = field(default_factory=list)
    #: more ways the shape went wrong, besides its verdict (the shape's own checks)
    other_problems: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Every way the verdict differs from what it must say (empty: right)."""
        v = self.verdict
        out = []
        got = (v.get("kind"), tuple(v.get("culprit_ranks", ())), tuple(v.get("culprit_pids", ())), v.get("confidence"))
        want = (self.kind, self.ranks, self.pids, self.confidence)
        if got != want:
            out.append(f"(kind, culprit_ranks, culprit_pids, confidence) = {got}, expected {want}")
        text = " ".join([v.get("reason", ""), *v.get("evidence", ())])
        out += [f"names pid {p} of another server" for p in self.forbidden_pids if re.search(rf"\b{p}\b", text)]
        return out + self.other_problems

    @property
    def correct(self) -> bool:
        return not self.problems()


def _tag() -> str:
    return f"fm{os.getpid() % 1000}{time.monotonic_ns() % 1000}"


def _rank_argv(rank: int, world: int, init: str, title: str, fault: str = "none", fault_rank: int = 1,
               extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, str(PROGRAM), "--rank", str(rank), "--world-size", str(world), "--init", init,
            "--title", title, "--fault", fault, "--fault-rank", str(fault_rank), "--fault-step", str(FAULT_STEP),
            *extra]


def _start(argv: list[str], workdir: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session, stdout piped (stop with :func:`stop_ranks`)."""
    env = _env(Path(os.environ.get("SERVEWATCH_SHM_DIR", "/dev/shm")))
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True, cwd=workdir, bufsize=0)


def _launch(specs: list[dict[str, Any]], workdir: Path) -> subprocess.Popen[bytes]:
    """A :mod:`tests.programs.rank_launcher` starting ``specs`` (its own session; stop with :func:`stop_ranks`)."""
    import json

    return _start([sys.executable, str(LAUNCHER), json.dumps(specs)], workdir)


def _read_lines(proc: subprocess.Popen[bytes], want: Callable[[dict[str, list[list[str]]]], bool],
                timeout_s: float = 90.0) -> dict[str, list[list[str]]]:
    """Read ``WORD args...`` lines from ``proc`` until ``want(lines by word)`` (bounded)."""
    import select

    assert proc.stdout is not None
    seen: dict[str, list[list[str]]] = {}
    deadline = time.monotonic() + timeout_s
    while not want(seen):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"pid {proc.pid}: not ready after {timeout_s} s (saw {seen})")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if ready:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"pid {proc.pid} exited {proc.returncode} (saw {seen})")
            words = line.decode(errors="replace").split()
            if words:
                seen.setdefault(words[0], []).append(words[1:])
    return seen


def _ready_pids(seen: dict[str, list[list[str]]], word: str = "READY") -> dict[int, int]:
    """``{rank: pid}`` from ``READY <rank> <pid>`` lines."""
    return {int(r): int(p) for r, p, *_ in seen.get(word, [])}


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return False


async def _watch(settings_extra: dict[str, Any], wd: Path, *, children: list[Any] = (),  # type: ignore[assignment]
                 manual_when: Callable[[], bool] | None = None, wait_trigger: str | None = None,
                 deadline_s: float = 100.0, judged: list[Any] | None = None,
                 after_start: Callable[[Any], None] | None = None,
                 on_status: Callable[[Any], None] | None = None) -> Any:
    """Run the real agent on ``settings_extra`` targets until its first incident (of trigger
    ``wait_trigger`` when given; a manual one opened once ``manual_when()``); the incident.
    ``judged`` receives what its verdict judged (``VerdictJudge.last_evidence``: what a host
    sends its job's coordinator). ``after_start(agent)`` runs (in a worker thread) once the agent
    runs; ``on_status`` receives each watcher status the agent publishes."""
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings
    from exporters.otlp.provider import build_telemetry

    base: dict[str, Any] = {
        "data_dir": wd / "data", "host_name": "faults", "coredump": {"enabled": False},
        "incident": {"cooldown_s": 300.0},
        "watchdog": {"timeout_s": 2.0, "poll_interval_s": 0.25},
    }
    for key, value in settings_extra.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    settings = load_settings(base)
    records: list[Any] = []
    got = anyio.Event()

    def on_incident(record: Any) -> None:
        if wait_trigger is None or record.opened.trigger == wait_trigger:
            if judged is not None and not records:
                judged.extend(agent.incidents.judge.last_evidence)
            records.append(record)
            got.set()

    telemetry = build_telemetry(settings.export, data_dir=settings.data_dir, host_name=settings.host_name)
    agent = Agent(settings, telemetry=telemetry, children=list(children), on_incident=on_incident, on_status=on_status)
    with anyio.fail_after(deadline_s):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            if after_start is not None:
                await anyio.to_thread.run_sync(after_start, agent)
            if manual_when is not None:
                while not manual_when():
                    await anyio.sleep(0.2)
                await agent.incidents.open_incident("manual", detail="fault matrix")
            await got.wait()
            agent.stop()
            tg.cancel_scope.cancel()
    await telemetry.aclose(3.0)
    return records[0]


def _result(name: str, record: Any, **expected: Any) -> ShapeResult:
    v = record.verdict
    return ShapeResult(name=name, record=record, verdict=v.to_json() if v is not None else {},
                       added_s=_added_s(record), **expected)


async def shape_cascade(wd: Path) -> ShapeResult:
    """Rank 2 of 3 hangs in its forward; ranks 0 and 1 time out in the collective (gloo, 4 s) and
    exit 1. The exit incident blames the live rank outside the collective, not the first exit."""
    procs = start_ranks(3, wd, fault="hang", fault_rank=2, extra=["--timeout-s", "4", "--linger-s", "0"])
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        record = await _watch({"target": {"pids": [p.pid for p in procs]}, "watchdog": {"timeout_s": 120.0}}, wd,
                              children=procs, wait_trigger="exit")
        return _result("cascade", record, kind="cascade", ranks=(2,), pids=(procs[2].pid,), confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)


async def _crash_seen_late(wd: Path, name: str, world: int, *, counter: bool, confidence: str) -> ShapeResult:
    """The last rank of ``world`` dies of SIGSEGV; the ranks between fail in their collective and
    exit 1; rank 0 lingers. Nobody reaps them (zombies: no command line left, their real titles
    ``<tag>::scheduler_TP<r>`` cut to 15 characters in ``comm``). ``servewatch dump --match`` only
    afterwards. Without ``counter`` the ranks run with no SDK step counter (a server without the
    SDK, as vLLM)."""
    import json

    tag = _tag()
    init = f"file://{wd}/store-{tag}"
    crash = world - 1
    extra = ("--linger-s", "0", "--linger-rank", "0:120", *(() if counter else ("--no-counter",)))
    launcher = _launch([{"argv": _rank_argv(r, world, init, f"{tag}::scheduler", "kill", crash, extra)}
                        for r in range(world)], wd)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(launcher, lambda s: len(s.get("READY", [])) == world))
        pids = _ready_pids(seen)
        deadline = time.monotonic() + 60
        while not all(_zombie(pids[r]) for r in range(1, world)) and time.monotonic() < deadline:
            await anyio.sleep(0.2)
        out = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "agent.cli.entry", "dump", "--match", f"{tag}::*", "--data-dir", str(wd / "data"),
             "--json"], capture_output=True, text=True, timeout=120, env=_env(Path(os.environ.get(
                 "SERVEWATCH_SHM_DIR", "/dev/shm"))), check=False, cwd=wd))
        manifests = sorted((wd / "data").glob("*/*/manifest.json"))
        if not manifests:
            raise RuntimeError(f"dump wrote no bundle: {out.returncode} {out.stderr[-2000:]}")
        doc = json.loads(manifests[-1].read_text())
        return ShapeResult(name=name, verdict=doc.get("verdict") or {}, kind="dead", ranks=(crash,),
                           pids=(pids[crash],), confidence=confidence,
                           added_s=float((doc.get("verdict") or {}).get("duration_s", 0.0)))
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


async def shape_crash_late(wd: Path) -> ShapeResult:
    """Rank 2 of 3 dies of SIGSEGV; rank 1 fails in its collective and exits 1; rank 0 lingers;
    all seen only afterwards by ``servewatch dump``: the first death, rank 2's crash, is blamed
    (not the exit it sees first), the job is still a job, and rank 2 is named although its title
    is gone (its SDK step counter recorded torch.distributed's rank)."""
    return await _crash_seen_late(wd, "crash_late", 3, counter=True, confidence="high")


async def shape_crash_late_no_sdk(wd: Path) -> ShapeResult:
    """Rank 1 of 2 dies of SIGSEGV, rank 0 lingers, no SDK step counter: rank 1's number is
    inferred (the one rank of the world, size 2 from rank 0's ``--world-size``, no live title
    holds), said so, at medium confidence."""
    return await _crash_seen_late(wd, "crash_late_no_sdk", 2, counter=False, confidence="medium")


async def shape_two_servers(wd: Path) -> ShapeResult:
    """Two servers on one host with the same titles (two launchers, TP=2 each, both hung on rank 1);
    the agent watches server B's ``/metrics`` (served by B's rank 0) and matches host-wide. The
    stall comes from B's endpoint (no pid): the verdict is B's, and names nothing of A."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tag = _tag()
    servers = []
    for name, extra in (("a", ("--no-counter",)), ("b", ("--no-counter", "--metrics-port", str(port)))):
        init = f"file://{wd}/store-{tag}-{name}"
        servers.append(_launch([{"argv": _rank_argv(r, 2, init, f"{tag}::scheduler", "hang", 1, extra)}
                                for r in range(2)], wd))
    try:
        a, b = [_ready_pids(await anyio.to_thread.run_sync(
            lambda s=s: _read_lines(s, lambda x: len(x.get("READY", [])) == 2))) for s in servers]
        metrics = {"url": f"http://127.0.0.1:{port}/metrics", "metrics_preset": None, "counter": "fm_steps_total",
                   "busy_gauge": "fm_busy"}
        record = await _watch({"target": {"match": [f"{tag}::*"]}, "metrics": metrics}, wd, wait_trigger="stall")
        return _result("two_servers", record, kind="behind", ranks=(1,), pids=(b[1],), confidence="high",
                       forbidden_pids=tuple(a.values()))
    finally:
        await anyio.to_thread.run_sync(stop_ranks, servers)


async def shape_dp_replicas(wd: Path) -> ShapeResult:
    """SGLang ``--dp 2`` without DP attention: two replicas (two gloo worlds of TP=2) under one
    controller, titled ``scheduler_DP0_TP*`` and ``scheduler_DP1_TP*``; replica 1's rank 1 hangs.
    Only the hung replica is judged; the healthy one is never named."""
    tag = _tag()
    specs = [{"argv": _rank_argv(r, 2, f"file://{wd}/store-{tag}-dp{dp}", f"{tag}::scheduler_DP{dp}",
                                 "hang" if dp == 1 else "none", 1)} for dp in (0, 1) for r in range(2)]
    launcher = _launch(specs, wd)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(launcher, lambda s: len(s.get("READY", [])) == 4))
        children = {int(i): int(p) for i, p in seen["CHILD"]}  # spec order: DP0 TP0, DP0 TP1, DP1 TP0, DP1 TP1
        record = await _watch({"target": {"match": [f"{tag}::*"]}}, wd, wait_trigger="stall")
        return _result("dp_replicas", record, kind="behind", ranks=(1,), pids=(children[3],), confidence="high",
                       forbidden_pids=(children[0], children[1]))
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


async def shape_dp_attention(wd: Path) -> ShapeResult:
    """SGLang ``--dp 2 --enable-dp-attention``: the same ``scheduler_DP*`` titles, but one world of
    4 ranks (TP numbers unique across DP: ``DP0_TP0, DP0_TP1, DP1_TP2, DP1_TP3``); rank 3 hangs.
    One group (the ranks are connected), judged whole: rank 3 named, its peers waiting."""
    tag = _tag()
    init = f"file://{wd}/store-{tag}"
    launcher = _launch([{"argv": _rank_argv(r, 4, init, f"{tag}::scheduler_DP{r // 2}", "hang", 3)} for r in range(4)], wd)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(launcher, lambda s: len(s.get("READY", [])) == 4))
        pids = _ready_pids(seen)
        record = await _watch({"target": {"match": [f"{tag}::*"]}}, wd, wait_trigger="stall")
        return _result("dp_attention", record, kind="behind", ranks=(3,), pids=(pids[3],), confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


async def shape_ipc_deadlock(wd: Path) -> ShapeResult:
    """An engine and its worker over a pipe; the worker loses one answer with a request running:
    both wait in ``recv`` forever. Not "idle": a deadlock between the two, named."""
    tag = _tag()
    proc = _start([sys.executable, str(IPC_ENGINE), "--title", tag, "--lose-at", "8"], wd)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(proc, lambda s: "READY" in s))
        engine, worker = (int(x) for x in seen["READY"][0])
        record = await _watch({"target": {"match": [f"{tag}::*"]}}, wd, wait_trigger="stall")
        return _result("ipc_deadlock", record, kind="deadlock", ranks=(0,), pids=(worker, engine), confidence="medium")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [proc])


async def shape_engine_hang(wd: Path) -> ShapeResult:
    """The same engine and worker; the engine hangs in its own loop with a request running (as a
    hang inside vLLM's EngineCore step): the worker idles in ``recv`` waiting for work. Not "no
    collective wait (rank 0 idle)": the engine core is the culprit, by its pid (issue 32 item 1b)."""
    tag = _tag()
    proc = _start([sys.executable, str(IPC_ENGINE), "--title", tag, "--hang-at", "8"], wd)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(proc, lambda s: "READY" in s))
        engine, _worker = (int(x) for x in seen["READY"][0])
        record = await _watch({"target": {"match": [f"{tag}::*"]}}, wd, wait_trigger="stall")
        return _result("engine_hang", record, kind="coordinator", ranks=(), pids=(engine,), confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [proc])


async def shape_rendezvous(wd: Path) -> ShapeResult:
    """A world of 3 whose rank 2 never starts: ranks 0 and 1 wait in ``init_process_group`` on
    the TCPStore. The verdict names rank 2 as never arrived (no process to name)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tag = _tag()
    env = {"WORLD_SIZE": "3", "SPT_NOENV": "1"}
    launcher = _launch([{"argv": _rank_argv(r, 3, f"tcp://127.0.0.1:{port}", f"{tag}::scheduler"), "env": env}
                        for r in range(2)], wd)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(launcher, lambda x: len(x.get("INIT", [])) == 2))
        pids = _ready_pids(seen, "INIT")
        inside = time.monotonic() + 3.0  # both are inside init_process_group by now
        record = await _watch({"target": {"pids": list(pids.values())}}, wd,
                              manual_when=lambda: time.monotonic() > inside)
        return _result("rendezvous", record, kind="rendezvous", ranks=(2,), pids=(), confidence="medium")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


async def shape_pg_cycle(wd: Path) -> ShapeResult:
    """Two process groups used in opposite orders: rank 0 all-reduces on group A then B, rank 1 on
    B then A. Each waits for the other: the cycle is named, both ranks in it."""
    procs = start_ranks(2, wd, fault="cycle", fault_rank=0)
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        record = await _watch({"target": {"pids": [p.pid for p in procs]}}, wd, children=procs, wait_trigger="stall")
        return _result("pg_cycle", record, kind="cycle", ranks=(0, 1), pids=(procs[0].pid, procs[1].pid),
                       confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)


async def shape_deep(wd: Path) -> ShapeResult:
    """Rank 1 of 2 recurses 5000 frames deep (over py-spy's limit) and spins there; rank 0 waits
    in the all-reduce. py-spy cannot read rank 1; the dump says so and keeps the partial stack
    from torch's dump_traceback; the verdict still names rank 1."""
    procs = start_ranks(2, wd, fault="deep", fault_rank=1)
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        record = await _watch({"target": {"pids": [p.pid for p in procs]}}, wd, children=procs, wait_trigger="stall")
        return _result("deep", record, kind="behind", ranks=(1,), pids=(procs[1].pid,), confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)


async def shape_dstate(wd: Path) -> ShapeResult:
    """Rank 1 of 2 reads its weights in uninterruptible sleep (state D, as from a hung NFS mount:
    a real D state, :mod:`tests.programs.dstate`); rank 0 waits in the all-reduce. A blocking
    py-spy dump of rank 1 would hang to its timeout (20 s): the dump reads the state first and takes
    one ``--nonblocking`` dump; the verdict names rank 1 in D, with its wchan and frame."""
    procs = start_ranks(2, wd, fault="dstate", fault_rank=1)
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        record = await _watch({"target": {"pids": [p.pid for p in procs]}}, wd, children=procs, wait_trigger="stall")
        return _result("dstate", record, kind="uninterruptible", ranks=(1,), pids=(procs[1].pid,), confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)


async def shape_p2p_deadlock(wd: Path) -> ShapeResult:
    """Two pipeline stages (a gloo world of 2) each receive from the other before sending
    (``dist.recv(src=peer)`` first: PyTorch #172668). Both wait in recv forever: a P2P ordering
    deadlock, both ranks named (gloo's Flight Recorder records no P2P op: the stacks say it)."""
    procs = start_ranks(2, wd, fault="p2p", fault_rank=0)
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        record = await _watch({"target": {"pids": [p.pid for p in procs]}}, wd, children=procs, wait_trigger="stall")
        return _result("p2p_deadlock", record, kind="deadlock", ranks=(0, 1), pids=(procs[0].pid, procs[1].pid),
                       confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)


async def shape_p2p_behind(wd: Path) -> ShapeResult:
    """Two pipeline stages: rank 1 hangs in its forward before it sends; rank 0 waits in
    ``dist.recv(src=1)`` for it. The stage that never sends is named, not the one receiving."""
    procs = start_ranks(2, wd, fault="p2p_hang", fault_rank=1)
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        record = await _watch({"target": {"pids": [p.pid for p in procs]}}, wd, children=procs, wait_trigger="stall")
        return _result("p2p_behind", record, kind="behind", ranks=(1,), pids=(procs[1].pid,), confidence="medium")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)


#: The stand-in packages (``deep_ep``) a rank imports, put on its ``PYTHONPATH`` only.
STANDINS = Path(__file__).with_name("standins")


async def shape_ep_dispatch(wd: Path) -> ShapeResult:
    """Expert parallel (SGLang #26482): rank 1 of 2 hangs in compute before the MoE dispatch; rank 0
    spins host-side in DeepEP's ``Buffer.dispatch`` (``deep_ep/buffer.py``: a stand-in with the real
    module path), no torch.distributed call. Rank 1 is named, not "all ranks in compute"."""
    env = {"PYTHONPATH": f"{STANDINS}{os.pathsep}{ROOT}", "DEEP_EP_STANDIN_FLAGS": str(wd / "deep-ep-flags")}
    procs = start_ranks(2, wd, fault="ep", fault_rank=1, env=env)
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        record = await _watch({"target": {"pids": [p.pid for p in procs]}}, wd, children=procs, wait_trigger="stall")
        return _result("ep_dispatch", record, kind="behind", ranks=(1,), pids=(procs[1].pid,), confidence="medium")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _metrics(port: int) -> dict[str, Any]:
    """The ``[metrics]`` settings for rank 0's ``/metrics`` (``--metrics-port``): progress with no
    SDK step counter, as a vLLM or Ray server's own endpoint."""
    return {"url": f"http://127.0.0.1:{port}/metrics", "metrics_preset": None, "counter": "fm_steps_total",
            "busy_gauge": "fm_busy"}


def _titled_job(wd: Path, titles: list[str], fault_rank: int, port: int,
                env_of: Callable[[int], dict[str, str]] | None = None, fault: str = "hang",
                fault_file: Path | None = None) -> tuple[subprocess.Popen[bytes], dict[int, int]]:
    """A gloo job of ``len(titles)`` ranks titled exactly ``titles[r]``, without the servewatch SDK
    (no control socket, no step counter: as vLLM and Ray run), rank 0 serving ``/metrics`` on
    ``port``; rank ``fault_rank`` has ``fault`` (hangs in compute before the step's all-reduce), at
    the first step after ``fault_file`` exists when given.
    Returns the launcher (stop with :func:`stop_ranks`; it never reaps a rank: a dead one stays a
    zombie) and ``{rank: pid}`` once every rank is READY."""
    tag = _tag()
    world = len(titles)
    specs = []
    for r, title in enumerate(titles):
        extra = ("--proc-title", title, "--no-sdk", "--no-counter", "--max-runtime-s", "200",
                 *(("--metrics-port", str(port)) if r == 0 else ()), *(("--fault-file", str(fault_file)) if fault_file else ()))
        specs.append({"argv": _rank_argv(r, world, f"file://{wd}/store-{tag}", f"{tag}::unused", fault, fault_rank, extra),
                      "env": env_of(r) if env_of is not None else {}})
    launcher = _launch(specs, wd)
    try:
        seen = _read_lines(launcher, lambda s: len(s.get("READY", [])) == world)
        _wait_listening(port)  # rank 0 serves /metrics just after READY: the agent's first read finds it
    except BaseException:
        stop_ranks([launcher])
        raise
    return launcher, _ready_pids(seen)


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    """Block until 127.0.0.1:``port`` accepts a connection (bounded)."""
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s") from None
            time.sleep(0.1)


#: A secret in every Ray worker's environment: it must never reach an incident's files.
RAY_SECRET = "hf_servewatchNeverReadsThis0123"


def _ray_env(r: int, world: int = 3) -> dict[str, str]:
    """A Ray worker's environment: its rank variables (torch.distributed's env://), ``SPT_NOENV``
    (Ray keeps ``/proc/PID/environ`` readable, ray-project/ray #15056) and a secret."""
    return {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "SPT_NOENV": "1", "HF_TOKEN": RAY_SECRET}


async def shape_ray_worker_crash(wd: Path) -> ShapeResult:
    """vLLM on Ray: rank 1 of 3 (titled ``ray::RayWorkerWrapper`` like the others) dies of SIGSEGV;
    ranks 0 and 2 fail in their collective later. Dead, its environment reads empty: it is named
    by the ``RANK`` the agent read when it first saw it alive."""
    port = _free_port()
    go = wd / f"crash-{_tag()}"
    launcher, pids = await anyio.to_thread.run_sync(
        lambda: _titled_job(wd, ["ray::RayWorkerWrapper"] * 3, 1, port, _ray_env, fault="kill", fault_file=go))

    def crash_once_seen(agent: Any) -> None:
        agent.discover()  # the agent has seen every worker alive (as its watchers do at start)
        go.touch()

    try:
        record = await _watch({"target": {"pids": list(pids.values())}, "metrics": _metrics(port),
                               "watchdog": {"timeout_s": 120.0}}, wd, wait_trigger="exit", after_start=crash_once_seen)
        return _result("ray_worker_crash", record, kind="dead", ranks=(1,), pids=(pids[1],), confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


async def _ray_workers(wd: Path, name: str, settings: dict[str, Any]) -> ShapeResult:
    """vLLM on Ray (vLLM #2479, #50835): every worker is titled ``ray::RayWorkerWrapper``, so the
    title names no rank; rank 1 of 3 hangs in compute outside the all-reduce. Each worker's rank is
    what its own environment says (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, torch.distributed's
    env:// variables; readable as Ray sets ``SPT_NOENV``, ray-project/ray #15056), next to a
    secret the agent never reads. No SDK: progress from rank 0's ``/metrics``."""
    port = _free_port()
    launcher, pids = await anyio.to_thread.run_sync(
        lambda: _titled_job(wd, ["ray::RayWorkerWrapper"] * 3, 1, port, _ray_env))
    try:
        record = await _watch({"target": {"pids": list(pids.values())}, "metrics": _metrics(port), **settings}, wd,
                              wait_trigger="stall")
        # medium: stacks alone (no Flight Recorder source without the SDK) say who is behind
        return _result(name, record, kind="behind", ranks=(1,), pids=(pids[1],), confidence="medium")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


async def shape_ray_workers(wd: Path) -> ShapeResult:
    """:func:`_ray_workers` with the default settings (the Flight Recorder actor reads each
    worker's rank variables too)."""
    return await _ray_workers(wd, "ray_workers", {})


async def shape_ray_workers_no_fr(wd: Path) -> ShapeResult:
    """:func:`_ray_workers` with the Flight Recorder actor off (``[flightrec] enabled = false``):
    the verdict reads each worker's rank variables itself."""
    return await _ray_workers(wd, "ray_workers_no_fr", {"flightrec": {"enabled": False}})


async def shape_ray_workers_unreadable(wd: Path) -> ShapeResult:
    """vLLM on Ray with nothing that names a rank: every worker titled ``ray::RayWorkerWrapper``,
    its environment overwritten by its title (setproctitle without ``SPT_NOENV``: ``RANK`` reads
    as nothing), no SDK, no Flight Recorder source. Rank 1 of 3 hangs in compute outside the
    all-reduce the other two wait in: the stacks alone say which process is behind, named by its pid."""
    port = _free_port()
    launcher, pids = await anyio.to_thread.run_sync(
        lambda: _titled_job(wd, ["ray::RayWorkerWrapper"] * 3, 1, port,
                            lambda r: {k: v for k, v in _ray_env(r).items() if k != "SPT_NOENV"}))
    try:
        record = await _watch({"target": {"pids": list(pids.values())}, "metrics": _metrics(port)}, wd,
                              wait_trigger="stall")
        return _result("ray_workers_unreadable", record, kind="behind", pids=(pids[1],), confidence="low")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


async def shape_inherited_rank(wd: Path) -> ShapeResult:
    """SGLang TP=2 in a Kubernetes PyTorchJob pod: the pod's ``RANK=0``/``WORLD_SIZE=1`` (its node
    rank) reaches both schedulers (``SPT_NOENV``: readable); rank 1 hangs. A ``RANK`` both share
    names neither: the titles (``scheduler_TP0``/``_TP1``) do."""
    port = _free_port()
    tag = _tag()
    env = {"RANK": "0", "WORLD_SIZE": "1", "SPT_NOENV": "1"}
    launcher, pids = await anyio.to_thread.run_sync(
        lambda: _titled_job(wd, [f"{tag}::scheduler_TP0", f"{tag}::scheduler_TP1"], 1, port, lambda r: env))
    try:
        record = await _watch({"target": {"pids": list(pids.values())}, "metrics": _metrics(port)}, wd,
                              wait_trigger="stall")
        return _result("inherited_rank", record, kind="behind", ranks=(1,), pids=(pids[1],), confidence="medium")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


def pp_titles(pp: int = 2, tp: int = 2) -> list[str]:
    """vLLM's worker titles of a PP x TP engine in global rank order (``Worker_PP1_TP0`` is rank
    ``1 * tp + 0``: vllm/v1/executor/multiproc_executor.py, stages outermost)."""
    return [f"VLLM::Worker_PP{r // tp}_TP{r % tp}" for r in range(pp * tp)]


async def shape_pp_titles(wd: Path) -> ShapeResult:
    """vLLM PP=2 x TP=2 (``VLLM::Worker_PP{p}_TP{t}``, no SDK, no rank in the environment:
    vLLM's multiproc workers get their rank in-process): ``Worker_PP1_TP0`` hangs in compute, the
    others wait in the all-reduce. It is global rank 2 (never 1, which ``Worker_PP0_TP1`` is)."""
    port = _free_port()
    launcher, pids = await anyio.to_thread.run_sync(lambda: _titled_job(wd, pp_titles(), 2, port))
    try:
        record = await _watch({"target": {"pids": list(pids.values())}, "metrics": _metrics(port)}, wd,
                              wait_trigger="stall")
        return _result("pp_titles", record, kind="behind", ranks=(2,), pids=(pids[2],), confidence="medium")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


@dataclass
class JobViewResult:
    """Per host: its incident's verdict (``Verdict.to_json()``); the coordinator's job verdict
    (:class:`agent.fleet.jobverdict.JobVerdict`); ``{global rank: pid}``."""

    host_verdicts: dict[str, dict[str, Any]]
    job: Any
    pids: dict[int, int]


async def pp_two_nodes(wd: Path) -> JobViewResult:
    """The PP=2 x TP=2 job of :func:`shape_pp_titles` as two nodes: ``node-a`` runs stage 0
    (``Worker_PP0_TP0``, ``Worker_PP0_TP1``), ``node-b`` stage 1 (``Worker_PP1_TP*``), one real
    agent per node watching its own two ranks (one after the other: the hang stays). Each node's
    evidence summary (:func:`agent.fleet.host_summary.host_evidence`, what it sends its coordinator,
    through the wire model) goes to :func:`agent.fleet.jobverdict.judge_job`."""
    from agent.fleet.host_summary import host_evidence
    from agent.fleet.jobverdict import judge_job
    from agent.fleet.messages import Evidence as HostEvidence

    port = _free_port()
    launcher, pids = await anyio.to_thread.run_sync(lambda: _titled_job(wd, pp_titles(), 2, port))
    try:
        sent: list[Any] = []
        verdicts: dict[str, dict[str, Any]] = {}
        for host, ranks in (("node-a", (0, 1)), ("node-b", (2, 3))):
            judged: list[Any] = []
            record = await _watch({"host_name": host, "data_dir": wd / host, "target": {"pids": [pids[r] for r in ranks]},
                                   "metrics": _metrics(port)}, wd, wait_trigger="stall", judged=judged)
            verdicts[host] = record.verdict.to_json() if record.verdict is not None else {}
            evidence = host_evidence(job="pp", host_name=host, agent_id=f"agent-{host}", trace_id=record.opened.trace_id,
                                     incident_id=record.opened.incident_id, bundle_dir=str(record.bundle_dir),
                                     judged=judged, verdict=record.verdict)
            sent.append(HostEvidence.model_validate_json(evidence.model_dump_json(by_alias=True)))
        return JobViewResult(host_verdicts=verdicts, job=judge_job(sent), pids=pids)
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [launcher])


VLLM_LIVELOCK = Path(__file__).with_name("vllm_livelock.py")
GRAMMAR_STALL = Path(__file__).with_name("grammar_stall.py")


async def shape_livelock(wd: Path) -> ShapeResult:
    """vLLM #25538 (issue 32 item 7): the engine preempts and resumes a request every step, no step
    has output, KV usage moves; its API server serves vLLM 0.32's ``/metrics``. A stall, judged a
    livelock, the engine core named (:mod:`tests.programs.vllm_livelock`)."""
    tag = _tag()
    proc = _start([sys.executable, str(VLLM_LIVELOCK), "--title", tag, "--healthy-s", "2"], wd)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(proc, lambda s: "READY" in s))
        port, _api_server, engine = (int(x) for x in seen["READY"][0])
        settings = {"target": {"match": [f"{tag}::*"]},
                    "metrics": {"url": f"http://127.0.0.1:{port}/metrics", "metrics_preset": "vllm"}}
        record = await _watch(settings, wd, wait_trigger="stall", deadline_s=60.0)
        return _result("livelock", record, kind="livelock", ranks=(), pids=(engine,), confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [proc])


async def shape_request_stall(wd: Path) -> ShapeResult:
    """vLLM #54003 (issue 32 item 6): one request's grammar compiles forever on the grammar thread
    while the others complete (:mod:`tests.programs.grammar_stall`). A ``request_stall`` incident
    naming the request and the thread holding it; its process is the culprit, not hung."""
    proc = _start([sys.executable, str(GRAMMAR_STALL), "--stuck-at", "20"], wd)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(proc, lambda s: "READY" in s and "STUCK" in s))
        pid = int(seen["READY"][0][0])
        settings = {"target": {"pids": [pid]},
                    "request_stall": {"min_s": 3.0, "p99_multiple": 10.0, "min_completions": 5, "interval_s": 0.5}}
        record = await _watch(settings, wd, wait_trigger="request_stall", deadline_s=60.0)
        return _result("request_stall", record, kind="request", ranks=(), pids=(pid,), confidence="high")
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [proc])
    """A TCP port nothing listens on now (bound once, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The start-up budget of :func:`shape_startup_hang`, seconds.
STARTUP_BUDGET_S = 3.0


async def shape_startup_hang(wd: Path, *, http: bool = True, framework: str = "sglang") -> ShapeResult:
    """A start-up hang (SGLang #3547, vLLM #17167): ranks ``sglang::scheduler_TP0/1`` capture CUDA
    graphs before their first step in SGLang's ``DecodeCudaGraphRunner.capture()`` (the stand-in's
    real module path); rank 1 never returns from its capture of batch size 4, rank 0 waits in the
    captured forward's ``all_reduce``; the HTTP port is not listening (SGLang listens once every
    rank is ready). A ``startup_stall`` incident once the budget is spent, naming rank 1; the health
    check says the server is starting, never "wrong host or port" (``other_problems`` otherwise).
    ``http=False``: no health URL; the ranks' SDK (its control socket, no step counter before the
    first step) says what the first step would. ``framework="vllm"``: workers ``VLLM::Worker_TP0/1``
    in vLLM's ``GPUModelRunner.capture_model()`` (vLLM #17167)."""
    env = {"PYTHONPATH": f"{STANDINS}{os.pathsep}{ROOT}"}
    url = f"http://127.0.0.1:{_free_port()}/health"
    statuses: list[str] = []
    title = "VLLM::Worker" if framework == "vllm" else "sglang::scheduler"
    procs = start_ranks(2, wd, fault="graph_capture", fault_rank=1, title=title, env=env, extra=["--framework", framework])
    try:
        await anyio.to_thread.run_sync(wait_ready, procs)
        watched: dict[str, Any] = {"target": {"pids": [p.pid for p in procs]}, "startup": {"budget_s": STARTUP_BUDGET_S}}
        if http:
            watched["health"] = {"url": url, "interval_s": 0.5}
        record = await _watch(
            watched,
            wd, children=procs, wait_trigger="startup_stall",
            on_status=lambda st: statuses.append(f"{st.name}: {st.state} {st.reason}"))
        result = _result("startup_hang" + ("_vllm" if framework == "vllm" else ""), record, kind="behind", ranks=(1,), pids=(procs[1].pid,), confidence="high")
        result.statuses = statuses
        health = [line for line in statuses if line.startswith("health")]
        result.other_problems += [f"said as a wrong address: {line}" for line in health if "wrong host or port" in line]
        if http and not any("server starting" in line and str(procs[0].pid) in line for line in health):
            result.other_problems.append(f"the health check never said the server is starting: {health}")
        return result
    finally:
        await anyio.to_thread.run_sync(stop_ranks, procs)


#: The shapes, by name: ``await SHAPES[name](workdir)``.
SHAPES: dict[str, Callable[[Path], Awaitable[ShapeResult]]] = {
    "cascade": shape_cascade,
    "crash_late": shape_crash_late,
    "crash_late_no_sdk": shape_crash_late_no_sdk,
    "two_servers": shape_two_servers,
    "dp_replicas": shape_dp_replicas,
    "dp_attention": shape_dp_attention,
    "ipc_deadlock": shape_ipc_deadlock,
    "engine_hang": shape_engine_hang,
    "rendezvous": shape_rendezvous,
    "pg_cycle": shape_pg_cycle,
    "deep": shape_deep,
    "dstate": shape_dstate,
    "p2p_deadlock": shape_p2p_deadlock,
    "p2p_behind": shape_p2p_behind,
    "ep_dispatch": shape_ep_dispatch,
    "ray_workers": shape_ray_workers,
    "ray_workers_no_fr": shape_ray_workers_no_fr,
    "ray_workers_unreadable": shape_ray_workers_unreadable,
    "ray_worker_crash": shape_ray_worker_crash,
    "pp_titles": shape_pp_titles,
    "inherited_rank": shape_inherited_rank,
    "livelock": shape_livelock,
    "request_stall": shape_request_stall,
    "startup_hang": shape_startup_hang,
    "startup_hang_vllm": functools.partial(shape_startup_hang, framework="vllm"),
}
