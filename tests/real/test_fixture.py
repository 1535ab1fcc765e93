"""The fixture itself on the real server: the process tree vLLM 0.32 builds, and the fault plugin
hanging the forward of the chosen rank inside the real worker (TP=1 and TP=2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.real.server import VllmServer, server_lock

PYSPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def _dump(pid: int) -> str:
    out = subprocess.run([PYSPY, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60, check=False)
    return out.stdout + out.stderr


def _until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s} s")
        time.sleep(0.5)


def _request_in_background(server: VllmServer) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def go() -> None:
        try:
            result["body"] = server.complete("hello", max_tokens=4, timeout_s=120)
        except httpx.HTTPError as exc:
            result["error"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, result


def test_tp1_tree_has_engine_core_and_one_worker_whose_forward_the_plugin_hangs(vllm_tp1: VllmServer) -> None:
    (worker,) = vllm_tp1.workers()
    assert worker.cmdline()[0] == "VLLM::Worker"
    assert vllm_tp1.engine_core().pid in {p.pid for p in worker.parents()}
    vllm_tp1.hang(ranks=None)
    t, result = _request_in_background(vllm_tp1)
    _until(lambda: "fault_point" in _dump(worker.pid), 60, "hung in the forward")
    assert "LlamaForCausalLM" in _dump(worker.pid) or "_model_forward" in _dump(worker.pid)
    assert t.is_alive()  # the request waits on the hung forward
    vllm_tp1.clear_fault()
    t.join(timeout=60)
    assert result.get("body", {}).get("usage", {}).get("completion_tokens") == 4, result


def test_tp2_hang_in_tp0_forward_leaves_tp1_in_the_cpu_allreduce(vllm_tp2: VllmServer) -> None:
    tp0, tp1 = vllm_tp2.workers()
    assert [tp0.cmdline()[0], tp1.cmdline()[0]] == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    vllm_tp2.hang(ranks=(0,))
    t, result = _request_in_background(vllm_tp2)
    _until(lambda: "fault_point" in _dump(tp0.pid), 60, "TP0 hung in the forward")
    _until(lambda: "cpu_communicator" in _dump(tp1.pid), 60, "TP1 waiting in the all-reduce")
    assert "fault_point" not in _dump(tp1.pid)
    vllm_tp2.clear_fault()
    t.join(timeout=60)
    assert "body" in result, result


def test_server_lock_keeps_a_second_process_out_and_names_the_holder() -> None:
    code = (
        "import sys; from tests.real.server import server_lock\n"
        "try:\n"
        "    with server_lock(timeout_s=1.0): sys.exit(0)\n"
        "except TimeoutError as e: print(e); sys.exit(3)\n"
    )
    with server_lock(timeout_s=60.0), server_lock(timeout_s=0.0):  # re-entrant in one process
        held = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=os.getcwd(), check=False)
    assert held.returncode == 3, held
    assert "/tmp/servewatch-realvllm.lock held for 1 s by: pid" in held.stdout, held
