"""Livelock is not progress (issue 32 item 7, vLLM #25538): the engine preempts and resumes a request
at every step and no step produces an output token; its KV-cache usage gauge keeps moving. On a
real two-process server shaped like vLLM 0.32 (its API server serving exactly vLLM 0.32's
``/metrics``, its ``<prefix>::EngineCore`` stepping in its own loop) and the real agent watching
that ``/metrics`` with the vLLM preset: the moving gauge is not progress, the stall fires, and the
verdict says livelock with the count and names the engine core. A one-shot ``servewatch dump
--metrics-url`` of the same server says so too (its two readings of ``/metrics``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.programs.fault_matrix import _read_lines, _start, _tag, _watch, stop_ranks

LIVELOCK = Path(__file__).parent / "programs" / "vllm_livelock.py"

pytestmark = pytest.mark.slow


async def test_a_preempt_resume_livelock_is_a_stall_whose_verdict_says_livelock(tmp_path: Path) -> None:
    tag = _tag()
    proc = _start([sys.executable, str(LIVELOCK), "--title", tag, "--healthy-s", "2"], tmp_path)
    try:
        seen = await anyio.to_thread.run_sync(lambda: _read_lines(proc, lambda s: "READY" in s))
        port, _api_server, engine = (int(x) for x in seen["READY"][0])
        settings = {"target": {"match": [f"{tag}::*"]},
                    "metrics": {"url": f"http://127.0.0.1:{port}/metrics", "metrics_preset": "vllm"}}
        record = await _watch(settings, tmp_path, wait_trigger="stall", deadline_s=60.0)
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [proc])
    assert record.opened.trigger == "stall"
    v = record.verdict
    assert v is not None, "no verdict"
    assert v.kind == "livelock", v.reason
    assert v.hung is True
    assert v.culprit_pids == (engine,) and v.culprit_ranks == (), v.reason
    assert v.confidence == "high", v.reason
    assert str(engine) in re.findall(r"\d+", v.next_step), v.next_step  # what to do next names the engine core
    m = re.match(r"livelock: requests preempted (\d+) times in (\d+) s with no output token", v.reason)
    assert m is not None, v.reason
    assert int(m.group(1)) >= 3, v.reason


def test_a_one_shot_dump_of_a_livelocked_server_says_livelock(tmp_path: Path) -> None:
    tag = _tag()
    proc = _start([sys.executable, str(LIVELOCK), "--title", tag, "--healthy-s", "1"], tmp_path)
    try:
        seen = _read_lines(proc, lambda s: "READY" in s and "LIVELOCK" in s)
        port, _api_server, engine = (int(x) for x in seen["READY"][0])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
        r = subprocess.run(
            [sys.executable, "-m", "agent.cli.app", "dump", "--match", f"{tag}::*", "--metrics-url",
             f"http://127.0.0.1:{port}/metrics", "--metrics-preset", "vllm", "--json", "--data-dir", str(tmp_path / "data")],
            capture_output=True, text=True, timeout=90, cwd=tmp_path, env={**env, "SERVEWATCH_SHM_DIR": str(tmp_path / "shm")},
            stdin=subprocess.DEVNULL, check=False)
    finally:
        stop_ranks([proc])
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)["verdict"]
    assert (v["kind"], v["culprit_pids"], v["confidence"]) == ("livelock", [engine], "high"), (v["headline"], r.stderr)
    assert re.match(r"livelock: requests preempted \d+ times in \d+ s with no output token", v["reason"]), v["reason"]
    assert v["next"].startswith(f"py-spy dump --pid {engine} "), v["next"]
