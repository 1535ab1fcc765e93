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

import httpx

from tests.real.server import VllmServer


def _servewatch(*args: str, env: dict[str, str] | None = None, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.entry", *args], capture_output=True, text=True, timeout=timeout_s,
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
    vllm_tp1.hang(ranks=None)
    blocked = threading.Thread(target=lambda: _swallow(vllm_tp1), daemon=True)
    blocked.start()  # a request whose forward hangs: the engine is stalled in a step
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
    blocked.join(timeout=60)


def _swallow(server: VllmServer) -> None:
    try:
        server.complete("hello", max_tokens=4, timeout_s=120)
    except httpx.HTTPError:
        pass


def test_profile_of_an_idle_vllm_server_is_timed_out_with_no_steps_and_stopped(vllm_tp1: VllmServer, tmp_path: Path) -> None:
    env = {"SERVEWATCH_PROFILER__STOP_TIMEOUT_S": "10"}
    proc = _servewatch("profile", "--url", vllm_tp1.url, "--steps", "3", "--timeout", "4", "--json", "--data-dir", str(tmp_path / "d"), env=env)
    result = json.loads(proc.stdout)
    attrs = result["attributes"]
    assert proc.returncode == 1 and result["outcome"] == "timed_out", result
    assert "(no engine step: idle server?)" in result["detail"]
    assert "servewatch.profile.steps_captured" not in attrs
    assert attrs["servewatch.profile.engine_steps_seen"] == 0
    # what it started, it stopped (vLLM may take longer than 10 s to answer on a loaded machine)
    assert attrs["servewatch.profile.stop"] in ("stopping", "sent_no_answer_in_10s"), attrs
