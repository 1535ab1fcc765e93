"""servewatch on a real SGLang 0.5.23 server (CPU engine, tiny Llama; issue 33, "Build" item 2).

Each case runs ``servewatch run --root-pid <launcher>`` (every process of the tree: the launcher,
which keeps its command line and runs the HTTP server and tokenizer manager, the schedulers, the
detokenizer) with the server's ``/metrics`` and ``/health``, watchdog timeout 5 s:

- TP=1, the scheduler's forward hung (``sglang::scheduler``, no ``_TP`` suffix): one stall
  incident within the timeout + 2 s naming that scheduler, the detokenizer and the launcher
  dumped beside it; SGLang's ``/health`` (a one-token generation) turns 503 20 s into the hang and
  joins the stall incident: one incident, not two;
- TP=1, the scheduler SIGSTOPped with a request sent: the verdict says it is stopped (suspended);
- TP=1, ``servewatch profile --url <server> --steps 5``: SGLang's own ``/start_profile`` records
  exactly 5 forward steps, stops by itself, the trace is listed, and the stop is sent (SGLang
  answers it with a bare 500: "already stopped", not a failure);
- TP=1, servewatch's ``dump`` and SGLang's own ``py-spy dump --native`` of the hung scheduler at
  once, back to back: every servewatch dump succeeds (it waits for a py-spy run aimed at its
  target); an SGLang-style dump that starts while servewatch's is attached still fails EPERM:
  counted and printed;
- TP=1, SIGTERM to the launcher (systemd / kubelet): SGLang stops its tree, no incident;
- ``launch -- python -m sglang.launch_server`` (its own server, with ``--crash-dump-folder`` and
  ``--soft-watchdog-timeout 3``): the launcher is armed with SGLang's own crash-dump variables;
  the project's fake CUDA driver runs inside the real scheduler (started by the fault hook), so a
  hung forward's stall incident triggers the FIFO of that scheduler's pid and records the core
  file the driver wrote; SGLang's soft watchdog fires in the hung scheduler (it py-spys itself
  through the shell) and the verdict's evidence says so, naming the scheduler and when;
- TP=2, TP1's forward hung (TP0 waits in the all-reduce): the stall incident within the timeout
  + 2 s names TP1. ``sglang:num_running_reqs`` stays 0 during a hung forward (SGLang refreshes it
  between batches): busy comes from the request's open connection on the server's port.

Servers are the shared ``sglang_tp1`` / ``sglang_tp2`` (one start each per run); every wait is
bounded.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.real.conftest import RealSglang
from tests.real.server import _free_port
from tests.real.sglang_server import SglangServer

pytestmark = [pytest.mark.realvllm, pytest.mark.realsglang, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WATCHDOG_S = 5.0
#: the issue's bound: the stall incident opens within the watchdog timeout + 2 s of the hang
STALL_SLACK_S = 2.0


class Run:
    """One ``servewatch run`` subprocess; its stderr goes to a file."""

    def __init__(self, tmp_path: Path, args: list[str]) -> None:
        self.data = tmp_path / "data"
        self.err_path = tmp_path / "run.err"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_")) and k != "VIRTUAL_ENV"}
        env.update(SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), SERVEWATCH_COREDUMP__ENABLED="false",
                   SERVEWATCH_HEALTH__INTERVAL_S="1", SERVEWATCH_HEALTH__UNHEALTHY_AFTER="2")  # fmt: skip
        argv = [sys.executable, "-m", "agent.cli.entry", "run", "--watchdog-timeout", str(WATCHDOG_S), "--data-dir", str(self.data), *args]
        with self.err_path.open("wb") as fh:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=fh, cwd=ROOT, env=env,
                                         start_new_session=True)  # fmt: skip

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, *needles: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(n in self.err for n in needles):
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


def _watch(tmp_path: Path, server: SglangServer) -> Run:
    """``run --root-pid <launcher>`` with the server's /metrics and /health, once it watches."""
    run = Run(tmp_path, ["--root-pid", str(server.pid), "--metrics-url", f"{server.url}/metrics", "--health-url", f"{server.url}/health"])
    try:
        run.wait_for("metrics: sglang:cuda_graph_passes_total", f"(and requests open on port {server.port})", "health: 200 OK",
                     "process: watching", timeout_s=120)  # fmt: skip
    except BaseException:
        run.stop()
        raise
    return run


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
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"not {what} after {timeout_s} s"
        time.sleep(0.25)
    return time.monotonic() - t0


def _dumped(m: dict[str, Any]) -> dict[int, str]:
    """pid -> outcome of the incident's py-spy dumps."""
    return {a["pid"]: a["outcome"] for a in m["actions"] if a["action"] == "pyspy.dump"}


def _hang_until_stall(server: SglangServer, run: Run, ranks: tuple[int, ...] | None) -> tuple[float, threading.Thread]:
    """Hang ``ranks``' forward, send a request (the hang starts with its first forward): the
    seconds from the request to the stall incident's opening, and the request's thread."""
    server.hang(ranks=ranks)
    sent_ns = time.time_ns()
    t = _in_background(lambda: server.complete("hello", max_tokens=4, timeout_s=180))
    _until(lambda: bool(run.manifests()), WATCHDOG_S + 30, "a stall incident")
    return (run.manifests()[0]["opened_time_unix_nano"] - sent_ns) / 1e9, t


# --- TP=1 (shared server) ----------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_tp1_hang_is_one_stall_naming_the_scheduler_with_its_other_roles_and_the_health_503_joins_it(
        sglang_tp1: SglangServer, tmp_path: Path) -> None:  # fmt: skip
    (scheduler,) = sglang_tp1.schedulers()
    assert scheduler.cmdline()[0] == "sglang::scheduler"  # TP=1: no _TP0 suffix
    detokenizer = sglang_tp1.detokenizer()
    run = _watch(tmp_path, sglang_tp1)
    try:
        took, t = _hang_until_stall(sglang_tp1, run, ranks=None)
        # SGLang's /health waits 20 s for its one-token generation, then answers 503
        run.wait_for("lifecycle: health check failed during the stall", timeout_s=60)
        sglang_tp1.clear_fault()
        t.join(timeout=120)
        time.sleep(2.0)
    finally:
        sglang_tp1.clear_fault()
        printed = run.stop()
    found = run.manifests()
    assert [m["trigger"] for m in found] == ["stall"], printed  # the health failure opened none
    m = found[0]
    v = m["verdict"]
    assert (v["culprit_pids"], v["culprit_ranks"], v["hung"]) == ([scheduler.pid], [0], True), v
    assert "fault_point" in v["reason"], v["reason"]
    dumped = _dumped(m)
    for pid in (scheduler.pid, detokenizer.pid, sglang_tp1.pid):  # the scheduler and the server's other roles
        assert dumped.get(pid) == "ok", (pid, dumped)
    assert any(f"pid {detokenizer.pid} 'sglang::detokenizer'; frontend" in line for line in v["evidence"]), v["evidence"]
    (joined,) = [line for line in m["lifecycle"] if line.startswith("health check failed during the stall")]
    assert f"{sglang_tp1.url}/health failed" in joined and m["incident_id"] in joined, joined
    assert WATCHDOG_S - 1.0 <= took <= WATCHDOG_S + STALL_SLACK_S, took
    print(f"SGLang TP=1 hung forward: stall incident {took:.1f} s after the request (watchdog {WATCHDOG_S:g} s)")


@pytest.mark.timeout(600)
def test_tp1_a_sigstopped_scheduler_is_the_culprit_said_suspended(sglang_tp1: SglangServer, tmp_path: Path) -> None:
    (scheduler,) = sglang_tp1.schedulers()
    run = _watch(tmp_path, sglang_tp1)
    try:
        sglang_tp1.sigstop(scheduler)  # SIGCONT by the fixture at the test's end, whatever happens
        t = _in_background(lambda: sglang_tp1.complete("hello", max_tokens=4, timeout_s=180))
        _until(lambda: bool(run.manifests()), WATCHDOG_S + 30, "a stall incident")
        # still stopped once the evidence is in (the verdict looks twice)
        _until(lambda: "\nIncident " in run.err, 60, "the incident written")
        sglang_tp1.resume_all()
        t.join(timeout=120)
    finally:
        sglang_tp1.resume_all()
        printed = run.stop()
    (m,) = run.manifests()
    v = m["verdict"]
    assert (m["trigger"], v["kind"], v["culprit_pids"], v["culprit_ranks"]) == ("stall", "suspended", [scheduler.pid], [0]), (v, printed)
    assert v["reason"].startswith(f"rank 0 (pid {scheduler.pid}) is stopped (SIGSTOP or a debugger; kill -CONT {scheduler.pid}"), v


def _forward_steps(trace: Path) -> int:
    """Forward steps an SGLang scheduler trace recorded: its ``step[<MODE> bs=<n>]`` annotations
    (one per batch run, SGLang 0.5.23)."""
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    return sum(1 for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("step["))


@pytest.mark.timeout(600)
def test_tp1_profile_url_steps_5_records_exactly_5_forward_steps_and_is_stopped(sglang_tp1: SglangServer, tmp_path: Path) -> None:
    out = tmp_path / "profiles"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    with sglang_tp1.load(concurrency=2, max_tokens=48) as stats:
        time.sleep(1.0)
        proc = subprocess.run([sys.executable, "-m", "agent.cli.entry", "profile", "--url", sglang_tp1.url, "--steps", "5", "--json",
                               "--out", str(out), "--data-dir", str(tmp_path / "d")],
                              capture_output=True, text=True, timeout=240, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    attrs = result["attributes"]
    assert result["outcome"] == "ok", result
    assert "answers as SGLang" in proc.stderr, proc.stderr
    assert attrs["servewatch.profile.start"] == "started"
    # SGLang stopped itself after 5 steps; its /stop_profile then answers a bare 500
    assert attrs["servewatch.profile.stop"] == "already_stopped", attrs
    (trace,) = sorted(out.glob("servewatch-*-TP-0.trace.json.gz"))
    assert attrs["servewatch.profile.files"] == 1 and str(trace) in proc.stderr, (attrs, proc.stderr)
    assert _forward_steps(trace) == 5
    assert stats["ok"] >= 1 and stats["failed"] == 0, stats
    assert "Profiling is not in progress" in sglang_tp1.log_text()  # the stop was sent


@pytest.mark.timeout(600)
def test_tp1_servewatch_dumps_the_hung_scheduler_while_sglang_style_pyspy_runs_and_every_one_of_its_dumps_succeeds(sglang_tp1: SglangServer,
                                                                                              tmp_path: Path) -> None:  # fmt: skip
    """SGLang's soft watchdog runs ``py-spy dump --native --pid <scheduler>`` (its venv's py-spy,
    through the shell), then without ``--native`` if that failed, while servewatch dumps the same
    hung scheduler back to back: every servewatch dump succeeds (it waits for a py-spy run aimed
    at its target, attached or about to attach). Not fully avoided: an SGLang-style ``--native``
    dump that starts while servewatch's is attached fails ("Failed to suspend process: EPERM");
    the figures are printed."""
    (scheduler,) = sglang_tp1.schedulers()
    pyspy = str(sglang_tp1.install.bin / "py-spy")
    theirs: list[subprocess.CompletedProcess[str]] = []
    stop = threading.Event()

    fallbacks: list[subprocess.CompletedProcess[str]] = []

    def sglang_style() -> None:  # back to back, as long as servewatch dumps; SGLang's own fallback
        while not stop.is_set():
            native = subprocess.run([pyspy, "dump", "--native", "--pid", str(scheduler.pid)], capture_output=True, text=True,
                                    timeout=60, check=False)  # fmt: skip
            theirs.append(native)
            if native.returncode != 0:
                fallbacks.append(subprocess.run([pyspy, "dump", "--pid", str(scheduler.pid)], capture_output=True, text=True,
                                                timeout=60, check=False))  # fmt: skip

    sglang_tp1.hang(ranks=None)
    t = _in_background(lambda: sglang_tp1.complete("hello", max_tokens=4, timeout_s=180))
    ours = []
    try:
        _until(lambda: "fault_point" in subprocess.run([pyspy, "dump", "--pid", str(scheduler.pid)], capture_output=True, text=True,
                                                         timeout=60, check=False).stdout, 90, "the scheduler hung")  # fmt: skip
        other = threading.Thread(target=sglang_style, daemon=True)
        other.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
        for i in range(3):
            done = subprocess.run([sys.executable, "-m", "agent.cli.entry", "dump", "--root-pid", str(sglang_tp1.pid), "--match",
                                   "sglang::scheduler*", "--data-dir", str(tmp_path / f"d{i}")], capture_output=True, text=True,
                                  timeout=180, check=False, cwd=ROOT, env=env)  # fmt: skip
            (manifest,) = (tmp_path / f"d{i}").glob("*/*/manifest.json")
            ours.append((done, json.loads(manifest.read_text())))
        stop.set()
        other.join(timeout=90)
    finally:
        stop.set()
        sglang_tp1.clear_fault()
    t.join(timeout=120)
    for done, m in ours:
        assert _dumped(m) == {scheduler.pid: "ok"}, (done.stdout[-2000:], done.stderr[-2000:])
        # one snapshot, no progress source: the hung frame is there, no culprit is claimed
        assert any(line.startswith(f"rank 0 pid {scheduler.pid}") and "fault_point" in line for line in m["verdict"]["evidence"]), m["verdict"]
    assert len(theirs) >= 2, len(theirs)
    ok = [r for r in theirs if r.returncode == 0]
    assert ok and all("fault_point" in r.stdout for r in ok), [r.stderr[-300:] for r in theirs]
    # servewatch waits for a py-spy run aimed at its target (attached or about to attach) before
    # attaching; one of theirs that starts while servewatch's is attached still fails EPERM
    # (back to back, theirs can start at any instant): counted and printed
    failed = [r for r in theirs if r.returncode != 0]
    assert all("Failed to suspend process" in r.stderr for r in failed), [r.stderr[-500:] for r in failed]
    attrs = [a["attributes"] for _, m in ours for a in m["actions"] if a["action"] == "pyspy.dump"]
    waited = sum("servewatch.pyspy.waited_for_pid" in a for a in attrs)
    retried = sum("servewatch.pyspy.retried_after_collision" in a for a in attrs)
    print(f"3 servewatch dumps ok ({waited} waited for a py-spy run of theirs, {retried} retried after a collision);"
          f" SGLang-style py-spy --native back to back at the same time: {len(ok)}/{len(theirs)} ok, {len(failed)} EPERM;"
          f" its fallback without --native: {sum(r.returncode == 0 for r in fallbacks)}/{len(fallbacks)} ok")


@pytest.mark.timeout(600)
def test_tp1_a_stuck_detokenizer_is_named_while_the_scheduler_idles_and_requests_wait(sglang_tp1: SglangServer,
                                                                                      tmp_path: Path) -> None:  # fmt: skip
    """Issue 32 item 1a on the real server (SGLang #26482, #34740): the detokenizer spins in its
    incremental decode (the fault module's ``detokenizer_spin``). The scheduler finishes each request
    and polls for more (on the CPU: SGLang's loop does not block), the requests stay open with no
    answer, no forward step: a stall. ``run --root-pid <launcher>`` watches the whole tree: the stall
    names the detokenizer, never the idle scheduler (before: "rank 0 stuck in
    SchedulerStageMetricsRecorder._sample" [medium])."""
    (scheduler,) = sglang_tp1.schedulers()
    detokenizer = sglang_tp1.detokenizer()
    # no --health-url: SGLang's /health runs a one-token generation, a forward the stall's one
    # snapshot of the idle scheduler can catch (CI saw it once: "rank 0 stuck in UnquantizedLinearMethod.apply")
    run = Run(tmp_path, ["--root-pid", str(sglang_tp1.pid), "--metrics-url", f"{sglang_tp1.url}/metrics"])
    started = time.monotonic()
    try:
        run.wait_for("metrics: sglang:cuda_graph_passes_total", "process: watching", timeout_s=120)
        sglang_tp1.spin_detokenizer()
        # two requests the scheduler finishes at once; their answers never leave: they stay open
        waiting = [_in_background(lambda: sglang_tp1.complete("hello", max_tokens=8, timeout_s=180)) for _ in range(2)]
        _until(lambda: [m for m in run.manifests() if m.get("verdict")], 120, "an incident with its verdict")
    finally:
        sglang_tp1.clear_fault()
        printed = run.stop()
    for t in waiting:
        t.join(timeout=120)
    found = run.manifests()
    assert [m["trigger"] for m in found] == ["stall"], printed
    v = found[0]["verdict"]
    print(f"\n{v['headline']}\nnext: {v['next']}\n(in all: {time.monotonic() - started:.1f} s)")
    assert (v["kind"], v["rule"], v["culprit_pids"], v["culprit_roles"], v["hung"], v["confidence"]) == (
        "frontend", "frontend_blocked", [detokenizer.pid], ["frontend"], True, "high"), v
    # named by its framework's own frame (the real decode the fault's spin sits in)
    assert re.fullmatch(rf"the detokenizer pid {detokenizer.pid} 'sglang::detokenizer' is stuck in "
                        r"DetokenizerManager\.handle_batch_token_id_out \(detokenizer_manager\.py:\d+\): requests wait "
                        r"with no progress while every rank idles \(waiting for work\)", v["reason"]), v["reason"]
    assert any(line.startswith(f"rank 0 pid {scheduler.pid}") and "; idle: " in line for line in v["evidence"]), v["evidence"]
    dumped = _dumped(found[0])
    assert dumped.get(detokenizer.pid) == "ok" and dumped.get(scheduler.pid) == "ok", dumped
    # the fault's spin is innermost in the detokenizer's stacks, the real decode under it
    (stacks,) = list(run.data.rglob(f"pyspy-{detokenizer.pid}.txt"))
    assert re.search(r"detokenizer_spin_point .*\n.*_decode_batch_token_id_output .*\n.*DetokenizerManager\.handle_batch_token_id_out",
                     stacks.read_text(encoding="utf-8")), stacks.read_text(encoding="utf-8")[:2000]
    assert sglang_tp1.serves(timeout_s=120)  # released: it answers again


@pytest.mark.timeout(600)
def test_tp1_sigterm_to_the_launcher_stops_sglang_and_opens_no_incident(sglang_tp1: SglangServer, tmp_path: Path) -> None:
    """Last of the TP=1 cases: it ends the shared server (the next test gets a new one)."""
    pids = {p.pid for p in sglang_tp1.tree()}
    run = _watch(tmp_path, sglang_tp1)
    try:
        sglang_tp1.complete("hello", max_tokens=4)
        t0 = time.monotonic()
        os.kill(sglang_tp1.pid, signal.SIGTERM)  # systemd / kubelet: the main process
        sglang_tp1.proc.wait(timeout=120)
        stopped_s = time.monotonic() - t0
        run.proc.wait(timeout=120)  # --root-pid: run stops once the tree ended and its exits are judged
    finally:
        printed = run.stop()
    assert run.manifests() == [], printed
    assert "nothing left to watch, stopping" in printed, printed
    seen = [line for line in printed.splitlines() if line.startswith("  pid ")]
    assert {int(line.split()[1]) for line in seen} == pids, (pids, printed)
    assert all("-> no incident" in line for line in seen), printed
    # SGLang drains, its scheduler exits 0, then it SIGKILLs its other children while its port
    # still listens (kill_process_tree), then closes the port and exits 0: a stop, not a crash
    killed = [line for line in seen if "killed by SIGKILL" in line]
    assert killed and all("stopped with its whole server" in line for line in killed), printed
    print(f"SGLang TP=1 stopped {stopped_s:.1f} s after SIGTERM to its launcher (exit {sglang_tp1.proc.returncode}); no incident")


# --- launch (its own server) -------------------------------------------------------------------

#: SGLang 0.5.23's own crash-dump defaults (``--crash-dump-folder``), asked from SGLang itself.
SGLANG_CRASH_ENV = (
    "import os, json, sys\n"
    "from types import SimpleNamespace\n"
    "from sglang.srt.arg_groups.serving_hook import handle_crash_dump_env\n"
    "handle_crash_dump_env(SimpleNamespace(crash_dump_folder=sys.argv[1]))\n"
    "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith(('CUDA_ENABLE_', 'CUDA_COREDUMP_'))}))\n"
)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


#: the project's fake CUDA driver, run inside each scheduler by the fault hook (no GPU here)
FAKE_DRIVER = ROOT / "tests" / "programs" / "fake_cuda_driver.py"
#: SGLang's ``--soft-watchdog-timeout`` there: it fires 3-4.5 s into the hang (it polls every
#: 1.5 s), after the stall began and before servewatch's incident (watchdog 5 s) closes (the
#: launcher's TokenizerManager also py-spys itself every 3-4.5 s while the server starts)
SOFT_WATCHDOG_S = 3.0


@pytest.mark.timeout(900)
def test_launch_of_sglang_launch_server_arms_the_cuda_coredump_environment_as_sglang_does_and_its_coredump_step_runs(
        real_sglang: RealSglang, tmp_path: Path) -> None:  # fmt: skip
    """``launch`` arms SGLang's launcher with SGLang's own crash-dump variables; then, with the
    fake CUDA driver playing the driver inside the real scheduler (its FIFO at
    ``/tmp/corepipe.cuda.<host>.<scheduler pid>``, created by the scheduler process), a hung
    forward's stall incident triggers that scheduler's pipe and records the core file the driver
    wrote there (``<folder>/<host>/core.cuda.<t>.<scheduler pid>``)."""
    inst = real_sglang.install
    folder = tmp_path / "crash"
    host = socket.gethostname()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "SERVEWATCH_", "OTEL_")) and k != "PYTHONPATH"}
    asked = subprocess.run([str(inst.python), "-c", SGLANG_CRASH_ENV, str(folder)], capture_output=True, text=True, timeout=300,
                           env={**clean, "SGLANG_USE_CPU_ENGINE": "1"}, stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    assert asked.returncode == 0, asked.stderr[-2000:]
    sglang_own = json.loads(asked.stdout.strip().splitlines()[-1])
    assert len(sglang_own) == 6 and sglang_own["CUDA_ENABLE_USER_TRIGGERED_COREDUMP"] == "1", sglang_own
    real_sglang.drop_shared()  # one server at a time
    workdir = tmp_path / "server"
    workdir.mkdir()
    driver_dir = tmp_path / "driver"
    driver_dir.mkdir()
    port = _free_port()
    # SGLang's own --crash-dump-folder too: it sets only what is not set yet, and says so ("Auto-set")
    # and SGLang's own soft watchdog: a batch stuck SOFT_WATCHDOG_S makes the scheduler py-spy itself
    argv, env = SglangServer.command(inst, workdir, tp=1, port=port, extra_args=(
        "--crash-dump-folder", str(folder), "--soft-watchdog-timeout", f"{SOFT_WATCHDOG_S:g}"))
    env = {k: v for k, v in env.items() if not k.startswith(("CUDA_", "SERVEWATCH_", "OTEL_"))}
    if os.environ.get("PYTHONPATH"):  # the agent's own checkout (the server does not need it)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    env.update(SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), REALSGLANG_FAKE_CUDA_DRIVER=str(FAKE_DRIVER),
               REALSGLANG_FAKE_CUDA_STATUS_DIR=str(driver_dir))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    log = (tmp_path / "launch.log").open("wb")
    launch = subprocess.Popen([sys.executable, "-m", "agent.cli.entry", "launch", "--crash-dump-folder", str(folder), "--data-dir",
                               str(data), "--match", "sglang::scheduler*", "--health-url", f"{url}/health", "--metrics-url",
                               f"{url}/metrics", "--watchdog-timeout", str(WATCHDOG_S), "--", *argv],
                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                              start_new_session=True)  # fmt: skip
    log.close()
    fault = workdir / "fault"
    pipes: list[Path] = []

    def printed() -> str:
        return (tmp_path / "launch.log").read_text(errors="replace")

    def closed() -> dict[str, Any] | None:
        for path in data.glob("*/*/manifest.json"):
            with contextlib.suppress(OSError, ValueError):
                m = json.loads(path.read_text())
                return m if m["state"] == "closed" else None
        return None

    try:
        def serving() -> bool:
            assert launch.poll() is None, printed()[-3000:]
            try:
                httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2}, timeout=30).raise_for_status()
            except httpx.HTTPError:
                return False
            return True

        started_s = _until(serving, 420, "the launched server serving")
        (launcher,) = [p for p in psutil.Process(launch.pid).children() if "sglang.launch_server" in " ".join(p.cmdline())]
        armed = _environ(launcher.pid)
        for key, value in sglang_own.items():  # every variable SGLang's own --crash-dump-folder sets, to its value
            assert armed.get(key) == value, (key, armed.get(key), value)
        assert (folder / host).is_dir(), list(folder.iterdir())
        (scheduler,) = [p for p in launcher.children(recursive=True) if p.cmdline()[:1] == ["sglang::scheduler"]]
        pipe = Path(f"/tmp/corepipe.cuda.{host}.{scheduler.pid}")  # SGLang's pipe template, %p the scheduler's pid
        pipes.append(pipe)
        driver_status = driver_dir / f"{scheduler.pid}.json"
        # the driver's side runs in the scheduler itself: its FIFO, held open by the scheduler
        assert json.loads(driver_status.read_text())["pipe"] == str(pipe)
        held = {os.readlink(f"/proc/{scheduler.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{scheduler.pid}/fd")}
        assert pipe.is_fifo() and str(pipe) in held, (pipe, sorted(held))
        # a hung forward: the stall incident's coredump step triggers that pipe
        fault.write_text("mode=hang\nranks=all\n", encoding="utf-8")
        sent_ns = time.time_ns()
        t = _in_background(lambda: httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                                              timeout=180))  # fmt: skip
        _until(lambda: closed() is not None, WATCHDOG_S + 120, "the stall incident written closed")
        fault.unlink()
        t.join(timeout=120)
        m = closed()
        assert m is not None
        state = json.loads(driver_status.read_text())
    finally:
        fault.unlink(missing_ok=True)
        t0 = time.monotonic()
        if launch.poll() is None:
            launch.send_signal(signal.SIGTERM)  # launch stops the server it started
        try:
            launch.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pass
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(p.pid) == launch.pid:
                    p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            launch.wait(timeout=30)
        stop_s = time.monotonic() - t0
        for leftover in pipes:  # a scheduler SIGKILLed by SGLang's stop leaves its FIFO behind
            leftover.unlink(missing_ok=True)
    text = printed()
    assert "Auto-set" not in text, text  # SGLang found nothing of its own left to set
    assert m["trigger"] == "stall" and m["verdict"]["culprit_pids"] == [scheduler.pid], (m["verdict"], text[-3000:])
    (done,) = [a for a in m["actions"] if a["action"] == "cuda.coredump"]
    attrs = done["attributes"]
    assert (done["pid"], done["outcome"], attrs["servewatch.coredump.pipe"]) == (scheduler.pid, "ok", str(pipe)), (done, text[-3000:])
    core = Path(attrs["servewatch.coredump.path"])
    assert core.parent == folder / host and core.name.startswith("core.cuda.") and core.name.endswith(f".{scheduler.pid}"), core
    assert done["artifact_paths"] == [str(core)] and attrs["servewatch.coredump.complete"] is True, done
    # the fake driver in the scheduler read the one trigger and wrote that very file, whole
    assert (state["pid"], state["triggers"], state["cores"]) == (
        scheduler.pid, 1, [{"path": str(core), "size_bytes": core.stat().st_size}]), state
    assert attrs["servewatch.coredump.size_bytes"] == core.stat().st_size == 5 * 64 * 1024, attrs
    took_s = (done["end_time_unix_nano"] - sent_ns) / 1e9
    # SGLang's soft watchdog fired in the hung scheduler (its log says so) and the bundle says so,
    # naming the scheduler that ran py-spy on itself through the shell, and when
    assert f"Scheduler watchdog timeout (self.watchdog_timeout={SOFT_WATCHDOG_S}, self.soft=True)" in text, text[-3000:]
    native = f"py-spy dump --native --pid {scheduler.pid}"
    assert f"Pyspy dump for PID {scheduler.pid} ({native})" in text or f"Pyspy failed ({native})" in text, text[-3000:]
    said = [line for line in m["verdict"]["evidence"] if "watchdog fired" in line]
    fired = [line for line in said if line.startswith(f"SGLang's own watchdog fired: pid {scheduler.pid} 'sglang::scheduler' ran '")]
    assert len(fired) == 1, said
    assert f"py-spy dump --native --pid {scheduler.pid}' (pid " in fired[0], fired  # the shell, or the py-spy it started
    # the only other watchdog that may have fired: the launcher's TokenizerManager dumping itself
    # (SGLang's soft watchdog there fires every 3-4.5 s while it starts, until its loop runs)
    assert all(line in fired or line.startswith(f"SGLang's own watchdog fired: pid {launcher.pid} ") for line in said), said
    fired_at = fired[0].split(" at ", 1)[1]
    print(f"launch armed SGLang's launcher with {len(sglang_own)} CUDA coredump variables, SGLang's own values"
          f" (serving after {started_s:.0f} s); hung forward: scheduler pid {scheduler.pid}'s pipe triggered, core file"
          f" {core.stat().st_size} bytes in {attrs['servewatch.coredump.write_duration_s']} s, {took_s:.1f} s after the request"
          f" (stopped in {stop_s:.0f} s, launch exit {launch.returncode}); SGLang's soft watchdog"
          f" ({SOFT_WATCHDOG_S:g} s) said in the bundle: first run at {fired_at}")


# --- TP=2 (shared server) ----------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_tp2_tp1_hung_forward_is_a_stall_within_the_timeout_naming_tp1(sglang_tp2: SglangServer, tmp_path: Path) -> None:
    tp0, tp1 = sglang_tp2.schedulers()
    assert [tp0.cmdline()[0], tp1.cmdline()[0]] == ["sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    run = _watch(tmp_path, sglang_tp2)
    try:
        took, t = _hang_until_stall(sglang_tp2, run, ranks=(1,))
        _until(lambda: "Incident " in run.err, 60, "the incident said")
        sglang_tp2.clear_fault()
        t.join(timeout=120)
        time.sleep(2.0)
    finally:
        sglang_tp2.clear_fault()
        printed = run.stop()
    (m,) = run.manifests()
    v = m["verdict"]
    assert (m["trigger"], v["culprit_pids"], v["culprit_ranks"], v["kind"]) == ("stall", [tp1.pid], [1], "behind"), (v, printed)
    assert "rank 0 waits in one" in v["reason"] and "fault_point" in v["reason"], v["reason"]
    assert all(_dumped(m).get(p.pid) == "ok" for p in (tp0, tp1)), _dumped(m)
    assert WATCHDOG_S - 1.0 <= took <= WATCHDOG_S + STALL_SLACK_S, took
    print(f"SGLang TP=2, TP1 hung: stall incident {took:.1f} s after the request (watchdog {WATCHDOG_S:g} s)")
