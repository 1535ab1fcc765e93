"""``servewatch profile --url`` against the real vLLM server (issue 21 item 5): exactly N engine
steps through vLLM's own ``max_iterations``, the traces found in the folder vLLM was launched
with, and the profiler stopped always — also when ``/start_profile`` got no answer because the
engine was stalled (a hung forward), where vLLM applies the start once the engine resumes."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import httpx

from tests.real.server import VllmServer


def _servewatch(*args: str, env: dict[str, str] | None = None, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli.entry", *args], capture_output=True, text=True, timeout=timeout_s,
        env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip


def _engine_steps(trace: Path) -> int:
    """Engine steps a vLLM worker trace recorded: its ``execute_context_*`` annotations (one per
    ``execute_model``, vLLM 0.32)."""
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    return sum(1 for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("execute_context_"))


def test_profile_url_steps_5_records_exactly_5_engine_steps_and_stops(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    with vllm_tp1.load(concurrency=2, max_tokens=48):
        time.sleep(1.0)
        proc = _servewatch("profile", "--url", vllm_tp1.url, "--steps", "5", "--json", "--data-dir", str(tmp_path / "d"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    attrs = result["attributes"]
    assert result["outcome"] == "ok", result
    assert attrs["servewatch.profile.output_dir"] == str(vllm_tp1.profile_dir)
    prefix = attrs["servewatch.profile.prefix"]
    files = [Path(f) for f in attrs["servewatch.profile.server_files"]]
    assert files and all(f.parent == vllm_tp1.profile_dir and f.name.startswith(prefix + "_") for f in files)
    (worker,) = [f for f in files if ".async_llm." not in f.name]
    assert _engine_steps(worker) == 5
    # the stop was sent: the API server's own profiler wrote its trace
    assert any(".async_llm." in f.name for f in files), files
    assert attrs["servewatch.profile.stop"] == "stopping"
    assert "Profile ok" in proc.stderr and str(vllm_tp1.profile_dir) in proc.stderr


def test_profile_stops_vllm_even_when_start_got_no_answer(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    vllm_tp1.slow(0.2)  # a request that is still running when the hang comes
    blocked = threading.Thread(target=lambda: _swallow(vllm_tp1, max_tokens=200), daemon=True)
    blocked.start()
    _wait_running(vllm_tp1)  # the engine stepped with it (vLLM's gauges move at engine steps only)
    vllm_tp1.hang(ranks=None)  # its next forward hangs: the engine is stalled in a step
    time.sleep(2.0)
    env = {"SERVEWATCH_PROFILER__REQUEST_TIMEOUT_S": "3", "SERVEWATCH_PROFILER__STOP_TIMEOUT_S": "3"}
    proc = _servewatch("profile", "--url", vllm_tp1.url, "--steps", "3", "--timeout", "10", "--json", "--data-dir", str(tmp_path / "d"), env=env)
    result = json.loads(proc.stdout)
    attrs = result["attributes"]
    assert proc.returncode == 1 and result["outcome"] == "timed_out", result
    assert attrs["servewatch.profile.start"] == "no_answer"
    assert attrs["servewatch.profile.stop"].startswith("sent_no_answer"), attrs
    prefix = attrs["servewatch.profile.prefix"]
    vllm_tp1.clear_fault()  # the engine resumes: vLLM applies the start, then our stop
    deadline = time.monotonic() + 90
    while not any(".async_llm." in n and n.endswith(".json.gz") for n in os.listdir(vllm_tp1.profile_dir) if n.startswith(prefix)):
        assert time.monotonic() < deadline, sorted(os.listdir(vllm_tp1.profile_dir))
        time.sleep(0.5)
    # nothing is left profiling: a new session starts and stops normally
    r = httpx.post(f"{vllm_tp1.url}/start_profile", json={"max_iterations": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{vllm_tp1.url}/stop_profile", timeout=120).status_code == 200
    blocked.join(timeout=150)


def _swallow(server: VllmServer, max_tokens: int = 4) -> None:
    try:
        server.complete("hello", max_tokens=max_tokens, timeout_s=180, ignore_eos=True)
    except httpx.HTTPError:
        pass


def _wait_running(server: VllmServer, timeout_s: float = 60.0) -> None:
    """Until vLLM's ``/metrics`` says a request is running (bounded)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        running = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:num_requests_running")
        if running > 0:
            return
        assert time.monotonic() < deadline, "no request running in vLLM's /metrics"
        time.sleep(0.2)


def test_profile_of_an_idle_vllm_server_starts_nothing_and_leaves_it_serving(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    """Before: the profile was started on the idle server and stopped at the timeout; its worker
    had recorded 16 s of its idle loop and was still gzipping that trace 120 s later, taking no
    engine step (the harness's next completion timed out and the server was restarted)."""
    env = {"SERVEWATCH_PROFILER__STOP_TIMEOUT_S": "10"}
    proc = _servewatch("profile", "--url", vllm_tp1.url, "--steps", "3", "--timeout", "4", "--json", "--data-dir", str(tmp_path / "d"), env=env)
    result = json.loads(proc.stdout)
    attrs = result["attributes"]
    assert proc.returncode == 1 and result["outcome"] == "timed_out", result
    assert "no engine step: idle server" in result["detail"] and "not started" in result["detail"], result["detail"]
    assert attrs["servewatch.profile.start"] == "not_started_idle" and "servewatch.profile.stop" not in attrs, attrs
    assert attrs["servewatch.profile.engine_steps_seen"] == 0 and attrs["servewatch.profile.idle_wait_s"] >= 4
    assert not [n for n in os.listdir(vllm_tp1.profile_dir) if n.startswith(attrs["servewatch.profile.prefix"])]
    assert "is idle (no request running or waiting)" in proc.stderr
    vllm_tp1.complete("hello", max_tokens=2, timeout_s=60)  # serving as before (raises when not)


def test_profile_of_an_idle_vllm_server_waits_for_a_request_then_records_exactly_n_steps(
        vllm_tp1: VllmServer, tmp_path: Path) -> None:
    """The traffic starts once the command said it found the server idle (not after a fixed
    delay: a command slow to start on a loaded host found the traffic already running, so it
    never waited and the test read no ``idle_wait_s``)."""
    waiting, profiled = threading.Event(), threading.Event()
    lines: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def read(name: str, stream: IO[str]) -> None:
        for line in stream:
            lines[name].append(line)
            if name == "stderr" and "is idle (no request running or waiting)" in line:
                waiting.set()

    def later() -> None:
        if waiting.wait(timeout=120.0):
            with vllm_tp1.load(concurrency=1, max_tokens=32):
                profiled.wait(timeout=15.0)  # traffic until the profile ended (at most 15 s)

    argv = [sys.executable, "-m", "agent.cli.entry", "profile", "--url", vllm_tp1.url, "--steps", "3",
            "--timeout", "90", "--json", "--data-dir", str(tmp_path / "d")]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True) as cmd:
        assert cmd.stdout is not None and cmd.stderr is not None
        threads = [threading.Thread(target=read, args=("stdout", cmd.stdout), daemon=True),
                   threading.Thread(target=read, args=("stderr", cmd.stderr), daemon=True),
                   threading.Thread(target=later, daemon=True)]
        for t in threads:
            t.start()
        try:
            returncode = cmd.wait(timeout=240)
        finally:
            profiled.set()
            waiting.set()
            if cmd.returncode is None:
                cmd.kill()
                cmd.wait(timeout=30)
        for t in threads:
            t.join(timeout=150)
    proc = subprocess.CompletedProcess(argv, returncode, "".join(lines["stdout"]), "".join(lines["stderr"]))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    attrs = result["attributes"]
    assert result["outcome"] == "ok" and attrs["servewatch.profile.start"] == "started", result
    assert attrs["servewatch.profile.idle_wait_s"] > 0, attrs  # it waited for the request, then started
    (worker,) = [Path(f) for f in attrs["servewatch.profile.server_files"] if ".async_llm." not in f]
    assert _engine_steps(worker) == 3
