"""A start-up hang on the real vLLM server (issue 32 item 5; vLLM #17167).

``vllm serve`` at TP=1 starts with the fault plugin's ``load_hang`` trigger already written: its
worker (``VLLM::Worker``) blocks inside ``LlamaForCausalLM.load_weights``, the real loader's stack
above it (as a read from a hung network filesystem does), before its first step. The EngineCore
waits for it and the API server does not listen yet. The real agent watches the server's tree
from its start with the server's ``/health`` and ``/metrics``: a ``startup_stall`` incident once
the start-up budget is spent, whose verdict names the worker stuck in the weight load; the health
check says the server is starting all along (before any rank exists: the API server, given by pid,
started within the budget), never that nothing listens there. Released, the server serves.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio

from tests.programs.fault_matrix import _watch
from tests.real.conftest import RealVllm
from tests.real.server import VllmServer

#: The start-up budget of the test (``startup.budget_s``), seconds: the worker is created ~16-20 s
#: after ``vllm serve`` starts on this machine (till then the API server is the server starting)
#: and reaches the weight load within seconds.
BUDGET_S = 30.0


async def _watch_startup(server: VllmServer, wd: Path, statuses: list[str]) -> Any:
    """The real agent on ``server`` from its start (``VLLM::*`` under its API server's pid, its
    ``/health`` and ``/metrics``, the start-up budget :data:`BUDGET_S`): its start-up stall
    (the fault matrix's in-process harness)."""
    return await _watch({
        "target": {"match": ["VLLM::*"], "root_pid": server.pid},
        "health": {"url": f"{server.url}/health", "interval_s": 1.0, "timeout_s": 3.0},
        "metrics": {"url": f"{server.url}/metrics", "metrics_preset": "vllm", "scrape_timeout_s": 2.0},
        "startup": {"budget_s": BUDGET_S},
    }, wd, wait_trigger="startup_stall", deadline_s=300.0,
        on_status=lambda st: statuses.append(f"{st.name}: {st.state} {st.reason}"))


def test_a_worker_hung_in_its_weight_load_is_a_startup_stall_naming_it(real_vllm: RealVllm, tmp_path: Path) -> None:
    started = time.monotonic()
    server = real_vllm.dedicated(tp=1, fault={"mode": "load_hang"}, wait=False)
    statuses: list[str] = []
    try:
        record = anyio.run(_watch_startup, server, tmp_path, statuses)
    finally:
        server.clear_fault()
    v = record.verdict.to_json()
    (worker,) = server.workers()
    print(f"\n{record.opened.detail}\n{v['headline']}\nnext: {v['next']}\n(in all: {time.monotonic() - started:.1f} s)")
    assert record.opened.trigger == "startup_stall", record.opened
    assert record.opened.detail.startswith("no first step ") and f"(start-up budget {BUDGET_S:g} s)" in record.opened.detail
    assert f"pid {worker.pid} 'VLLM::Worker'" in record.opened.detail, record.opened.detail
    assert (v["kind"], v["culprit_ranks"], v["culprit_pids"], v["hung"]) == ("compute", [0], [worker.pid], True), v
    assert v["confidence"] == "high", v
    # the hung frame is the fault's poll; the real loader is what called it
    assert "rank 0 in load_fault_point (" in v["reason"], v["reason"]
    (dump,) = [r for r in record.results if r.action == "pyspy.dump" and r.pid == worker.pid]
    stacks = Path(next(p for p in dump.artifact_paths if p.endswith(".txt"))).read_text(encoding="utf-8")
    assert "load_weights" in stacks and "load_model" in stacks, stacks[-3000:]
    assert str(worker.pid) in v["next"], v["next"]
    health = [line for line in statuses if line.startswith("health:")]
    # never blind: "nothing listens there" is said as the server starting all along (past the
    # budget, without the SDK, the line adds "or this is the wrong host or port": only HTTP says so)
    assert not [line for line in health if line.startswith("health: blind")], health
    assert any("server starting: nothing listens at" in line for line in health), health
    # before any rank: the API server, given by pid, is the server starting (named by its command)
    assert any(f"it started less than the start-up budget ago and has no rank yet (pid {server.pid} 'python vllm serve';"
               in line for line in health), health
    # released: the weight load returns and the server serves (its start-up was only held)
    server.wait_serving(240)
