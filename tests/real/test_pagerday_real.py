"""A pager day on the real vLLM server (issue 31, "Done when"): each event under a running
`servewatch run` with the incidents it must open, exactly — no false one, no missed one.

- first forward after idle hangs: one stall incident within the watchdog timeout + a few s,
  naming the hung Worker (vLLM publishes running/waiting only after a step: the request's open
  connection says the server is busy); the old busy rule (gauges only) misses it;
- `vllm serve` stopped by SIGTERM with two requests in flight (the API server closes its port,
  drains its clients, SIGKILLs its own EngineCore and Worker), then started again on the same port
  with new pids: no incident;
- a Worker hung until vLLM's own ``execute_model`` RPC times out and the server kills itself: the
  stall incident, and the server's end recorded on it (not "stopped by SIGTERM: no incident");
- two TP=1 replicas under one host-wide ``--match '<prefix>::*'`` with both ``--metrics-url``: the
  first's hang and, 15 s later, the second's: two stall incidents, each naming its own Worker.

Watchdog timeout 5 s everywhere; every wait is bounded, and waits on the agent's own lines
(the judged health check, the stop said, the recovery) rather than sleeping; the two replicas
start at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.real.conftest import RealVllm
from tests.real.server import VllmServer

pytestmark = [pytest.mark.realvllm, pytest.mark.slow]

#: Host-wide cases title their servers' processes ``<PREFIX>::EngineCore`` (``VLLM_PROCESS_NAME_PREFIX``)
#: and match ``<PREFIX>::*``: the README's host-wide form, blind to other vLLM servers a shared
#: host runs meanwhile (seen here: another session's TP=2 server's exits in this agent's output).
PREFIX = f"VLLMpd{os.getpid()}"
PREFIX_ENV = {"VLLM_PROCESS_NAME_PREFIX": PREFIX}

ROOT = Path(__file__).resolve().parents[2]
WATCHDOG_S = 5.0
#: seconds after the watchdog timeout an incident may take to be written (a scrape interval,
#: the stacks of two processes on a loaded 2-core host)
SLACK_S = 12.0


class Run:
    """One ``servewatch run`` subprocess; its stderr goes to a file."""

    def __init__(self, tmp_path: Path, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.data = tmp_path / f"data-{name}"
        self.err_path = tmp_path / f"{name}.err"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_")) and k != "VIRTUAL_ENV"}
        base.update(SERVEWATCH_SHM_DIR=str(tmp_path / f"shm-{name}"), SERVEWATCH_COREDUMP__ENABLED="false",
                    SERVEWATCH_HEALTH__INTERVAL_S="1", SERVEWATCH_HEALTH__UNHEALTHY_AFTER="2", **(env or {}))
        argv = [sys.executable, "-m", "agent.cli.entry", "run", "--watchdog-timeout", str(WATCHDOG_S), "--data-dir", str(self.data),
                *(["--verbose"] if os.environ.get("REALVLLM_AGENT_VERBOSE") == "1" else []), *args]  # fmt: skip
        with self.err_path.open("wb") as fh:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=fh, cwd=ROOT, env=base,
                                         start_new_session=True)  # fmt: skip

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, *needles: str, timeout_s: float = 120.0, after: int = 0) -> None:
        """Until every needle is in the stderr (from character ``after`` on)."""
        deadline = time.monotonic() + timeout_s
        while not all(n in self.err[after:] for n in needles):
            assert self.proc.poll() is None, f"run exited {self.proc.returncode}:\n{self.err}"
            assert time.monotonic() < deadline, f"no {needles} after {timeout_s} s:\n{self.err}"
            time.sleep(0.25)

    def manifests(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.data.glob("*/*/manifest.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                pass  # being written
        return sorted(found, key=lambda m: m["opened_time_unix_nano"])

    def stop(self, timeout_s: float = 90.0) -> str:
        """SIGINT (Ctrl-C), bounded; then SIGKILL. Returns the stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        return self.err

    def end(self, timeout_s: float) -> str:
        """Wait for it to stop by itself (``--root-pid``: the tree ended), else :meth:`stop`."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        return self.stop()


def _watch_args(server: VllmServer) -> list[str]:
    return ["--metrics-url", f"{server.url}/metrics", "--metrics-preset", "vllm", "--health-url", f"{server.url}/health"]


def _ready(run: Run, server: VllmServer, after: int = 0, timeout_s: float = 120.0) -> None:
    run.wait_for("metrics: vllm:iteration_tokens_total_count", f"from {server.url}/metrics", "health: 200 OK",
                 "process: watching", timeout_s=timeout_s, after=after)  # fmt: skip


def _in_background(fn: Callable[[], object]) -> threading.Thread:
    def go() -> None:
        try:
            fn()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _until(pred: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Wait until ``pred()``; the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"not {what} after {timeout_s} s"
        time.sleep(0.25)
    return time.monotonic() - t0


def _verdict_pids(m: dict[str, Any]) -> list[int]:
    return list((m.get("verdict") or {}).get("culprit_pids") or [])


# --- (d) the first forward after an idle spell -----------------------------------------------


@pytest.mark.timeout(600)
def test_a_hang_in_the_first_forward_after_idle_is_a_stall_naming_the_worker(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    (worker,) = vllm_tp1.workers()
    args = ["--root-pid", str(vllm_tp1.pid), "--match", "VLLM::*", *_watch_args(vllm_tp1)]
    run = Run(tmp_path, "run", args)
    gauges_only = Run(tmp_path, "gauges-only", args, env={"SERVEWATCH_METRICS__OPEN_REQUESTS": "false"})
    try:
        for r in (run, gauges_only):
            _ready(r, vllm_tp1)
        time.sleep(2.0)  # idle: nothing running, nothing waiting, the last step long before
        vllm_tp1.hang(ranks=None)
        t = _in_background(lambda: vllm_tp1.complete("hello", max_tokens=4, timeout_s=180))
        took = _until(lambda: bool(run.manifests()), WATCHDOG_S + SLACK_S, "a stall incident")
        time.sleep(4.0)  # the gauges-only agent had as long, and more
        vllm_tp1.clear_fault()
        t.join(timeout=120)
        time.sleep(3.0)  # progress again: no second incident
    finally:
        vllm_tp1.clear_fault()
        printed, control = run.stop(), gauges_only.stop()
    found = run.manifests()
    assert [m["trigger"] for m in found] == ["stall"], printed
    assert _verdict_pids(found[0]) == [worker.pid], found[0].get("verdict")
    assert WATCHDOG_S <= took + 1.0, took  # not before the timeout (1 s: the scrape interval)
    assert "requests open on port" in printed, printed
    # the old rule (busy = the gauges vLLM publishes after a step) sees nothing: this is the miss
    assert gauges_only.manifests() == [], control
    print(f"first-forward hang: stall incident {took:.1f} s after the request (watchdog {WATCHDOG_S:g} s)")


# --- (a) + (b): a restart with new pids, then a stop with two requests in flight -------------

STOP_IN_FLIGHT = "stop (SIGTERM) with 2 requests in flight"
#: the agent's line once a failing health check is judged (no incident, or folded into one)
HEALTH_JUDGED = "health detected ("
#: how long the in-flight clients wait at the stop: vLLM's API server drains them that long
CLIENT_TIMEOUT_S = 6.0
RESTART = "stop + start again on its port, new pids"


@pytest.mark.timeout(900)
def test_a_restart_with_new_pids_and_a_stop_with_requests_in_flight_open_no_incident(real_vllm: RealVllm, tmp_path: Path) -> None:
    first = real_vllm.dedicated(tp=1, env=PREFIX_ENV)
    port, old_pids = first.port, {p.pid for p in first.tree()}
    # host-wide, as the README says: the restarted server's new pids are found by title
    run = Run(tmp_path, "run", ["--match", f"{PREFIX}::*", *_watch_args(first)])
    events: dict[str, list[str]] = {}
    seen = 0

    def event(name: str) -> None:
        nonlocal seen
        found = [m["trigger"] for m in run.manifests()]
        events[name], seen = found[seen:], len(found)

    try:
        _ready(run, first)
        first.complete("hello", max_tokens=4)
        # (a) the deploy: stop in order, start again on the same port (new pids)
        stop_at = len(run.err)
        first.stop()
        before = len(run.err)
        second = real_vllm.dedicated(tp=1, port=port, env=PREFIX_ENV)
        assert not old_pids & {p.pid for p in second.tree()}
        _ready(run, second, after=before, timeout_s=180)
        second.complete("hello", max_tokens=4)
        # a health incident came ~30 s after /health was 200 again (issue 31: the refused check's
        # settle, HEALTH_SETTLE_S): until the failing check is judged and the recovery said
        run.wait_for(HEALTH_JUDGED, "lifecycle: server healthy again", timeout_s=60, after=stop_at)
        time.sleep(2.0)
        event(RESTART)
        # (b) the operator's stop with two requests in flight: vLLM SIGKILLs its own EngineCore and
        # Worker, closes its port and waits on its clients (here until they give up, 6 s)
        second.slow(0.2)
        threads = [_in_background(lambda: second.complete("hello", max_tokens=100, timeout_s=CLIENT_TIMEOUT_S)) for _ in range(2)]
        _until(lambda: _running(second) == 2, 60, "two requests running")
        t0, stop_at = time.monotonic(), len(run.err)
        os.kill(second.pid, signal.SIGTERM)  # systemd / kubelet: the main process
        second.proc.wait(timeout=120)
        print(f"vllm serve stopped {time.monotonic() - t0:.0f} s after SIGTERM with 2 requests in flight (exit {second.proc.returncode})")
        # the exits are judged once the API server ended (an exit incident, or the stop said), and
        # the failing health check
        run.wait_for(HEALTH_JUDGED, timeout_s=60, after=stop_at)
        _until(lambda: any(n in run.err[stop_at:] for n in ("lifecycle: server stopped", "(exit): ")), 60, "the exits judged")
        time.sleep(2.0)
        event(STOP_IN_FLIGHT)
        for t in threads:
            t.join(timeout=30)
    finally:
        printed = run.stop()
    print(f"pager events -> incidents: {events}")
    assert events == {RESTART: [], STOP_IN_FLIGHT: []}, printed


def _running(server: VllmServer) -> float:
    total = 0.0
    for line in server.metrics().splitlines():
        if line.startswith("vllm:num_requests_running{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- (c) vLLM's own execute_model timeout kills the server after the stall -------------------

#: vLLM 0.32 reads it in vllm/v1/executor/multiproc_executor.py (default 300 s); the stall
#: incident must be open before it: the watchdog timeout and a loaded host's stack dumps
EXECUTE_TIMEOUT_S = 15


@pytest.mark.timeout(600)
def test_a_server_killing_itself_after_its_rpc_timeout_ends_the_stall_incident(real_vllm: RealVllm, tmp_path: Path) -> None:
    server = real_vllm.dedicated(tp=1, env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(EXECUTE_TIMEOUT_S)})
    (worker,) = server.workers()
    engine = server.engine_core()
    run = Run(tmp_path, "run", ["--root-pid", str(server.pid), "--match", "VLLM::*", *_watch_args(server)])
    answer: list[int] = []
    try:
        _ready(run, server)
        server.hang(ranks=None)

        def ask() -> None:
            try:
                server.complete("hello", max_tokens=4, timeout_s=180)
                answer.append(200)
            except httpx.HTTPStatusError as exc:
                answer.append(exc.response.status_code)

        t = _in_background(ask)
        _until(lambda: bool(run.manifests()), WATCHDOG_S + SLACK_S, "a stall incident")
        opened_at = len(run.err)
        server.proc.wait(timeout=EXECUTE_TIMEOUT_S + 90)  # vLLM's RPC times out: EngineDeadError, the server exits
        t.join(timeout=60)
        # every exit judged: the agent looks for new targets (or, once it can, ends by itself)
        # bounded by the stall incident's own phases, which may still run on a loaded host (CI:
        # not within 60 s once, while it passed in 40 s alone)
        _until(lambda: run.proc.poll() is not None or "waiting for a target process" in run.err[opened_at:], 180,
               "the server's exits judged")
    finally:
        server.clear_fault()
        printed = run.stop()
    assert answer and answer[0] >= 500, answer  # the client saw the server fail
    found = run.manifests()
    assert [m["trigger"] for m in found] == ["stall"], printed  # no second (exit or health) incident
    stall = found[0]
    assert _verdict_pids(stall) == [worker.pid], stall.get("verdict")
    # the server's end is the stall's ending: the exits of its EngineCore and Worker are on that
    # incident (today: "-> no incident: stopped by SIGTERM", as if an operator had stopped it)
    exits = [line for line in printed.splitlines() if any(line.startswith(f"  pid {p} ") for p in (engine.pid, worker.pid))]
    assert len(exits) == 2 and all(stall["incident_id"] in line and "no incident" not in line for line in exits), printed


# --- (e) two replicas, one host-wide agent ---------------------------------------------------


def _both(first: Callable[[], VllmServer], second: Callable[[], VllmServer]) -> tuple[VllmServer, VllmServer]:
    """Start two servers at once (each start waits mostly on its own imports and warm-up)."""
    got: dict[int, VllmServer | BaseException] = {}

    def start(i: int, fn: Callable[[], VllmServer]) -> None:
        try:
            got[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            got[i] = exc

    threads = [threading.Thread(target=start, args=(i, fn), daemon=True) for i, fn in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v in got.values():
        if isinstance(v, BaseException):
            raise v
    a, b = got[0], got[1]
    assert isinstance(a, VllmServer) and isinstance(b, VllmServer)
    return a, b


@pytest.mark.timeout(900)
def test_two_replicas_two_hangs_two_incidents_each_naming_its_own_worker(real_vllm: RealVllm, tmp_path: Path) -> None:
    real_vllm.drop_shared()  # once, before the two starts
    a, b = _both(lambda: real_vllm.dedicated(tp=1, env=PREFIX_ENV), lambda: real_vllm.dedicated(tp=1, env=PREFIX_ENV))
    (wa,), (wb,) = a.workers(), b.workers()
    args = ["--match", f"{PREFIX}::*", "--metrics-preset", "vllm"]
    for s in (a, b):
        args += ["--metrics-url", f"{s.url}/metrics", "--health-url", f"{s.url}/health"]
    run = Run(tmp_path, "run", args)
    threads = []
    try:
        run.wait_for(f"from {a.url}/metrics", f"from {b.url}/metrics", "process: watching", timeout_s=45)
        for server, n in ((a, 1), (b, 2)):
            server.hang(ranks=None)
            threads.append(_in_background(lambda s=server: s.complete("hello", max_tokens=4, timeout_s=300)))  # type: ignore[misc]
            _until(lambda n=n: len(run.manifests()) >= n, WATCHDOG_S + SLACK_S + 5, f"incident {n}")  # type: ignore[misc]
            # its stacks read before the next step (the manifest is written when it opens: a fault
            # cleared then leaves the dumps reading a Worker that steps again)
            _until(lambda n=n: run.err.count("View: servewatch timeline ") >= n, 60, f"incident {n} written")  # type: ignore[misc]
    finally:
        for s in (a, b):
            s.clear_fault()
        printed = run.stop()
    found = run.manifests()
    assert [(m["trigger"], _verdict_pids(m)) for m in found] == [("stall", [wa.pid]), ("stall", [wb.pid])], printed
    for m, theirs in ((found[0], b), (found[1], a)):
        assert not {t["pid"] for t in m["targets"]} & {p.pid for p in theirs.tree()}, m["targets"]
    for t in threads:
        t.join(timeout=60)
