"""Frontend processes are part of the server, on the real vLLM server (issue 32 item 1).

The API server's event loop blocks in a synchronous call inside its async completion handler (the
fault plugin's ``api_hang``: the shape of vLLM PR #38157's chat-template render on the loop):
``/health`` and ``/metrics`` time out while the EngineCore and its Worker idle. ``run`` watches with
``--match 'VLLM::*'`` in the server's tree: the health incident dumps the API server too (no glob
matches it) and names it, by pid, role and frame; before, its verdict read "nothing is stuck [low]".
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from tests.real.server import VllmServer


async def _watch_health(server: VllmServer, data_dir: Path, make_it_fail: Any) -> Any:
    """The real agent on ``server`` (``VLLM::*`` under its API server's pid, its ``/health`` and
    ``/metrics``); once its health check saw 200, ``make_it_fail()`` (in a thread). Its first health
    incident."""
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings
    from exporters.otlp.provider import build_telemetry

    settings = load_settings({
        "data_dir": data_dir, "host_name": "real", "target": {"match": ["VLLM::*"], "root_pid": server.pid},
        "health": {"url": f"{server.url}/health", "interval_s": 0.5, "timeout_s": 3.0, "unhealthy_after": 2},
        "metrics": {"url": f"{server.url}/metrics", "metrics_preset": "vllm", "scrape_timeout_s": 2.0},
        "watchdog": {"timeout_s": 60.0, "poll_interval_s": 1.0}, "coredump": {"enabled": False},
    })
    records: list[Any] = []
    got = anyio.Event()

    def on_incident(record: Any) -> None:
        if record.opened.trigger == "health":
            records.append(record)
            got.set()

    telemetry = build_telemetry(settings.export, data_dir=settings.data_dir, host_name=settings.host_name)
    agent = Agent(settings, telemetry=telemetry, on_incident=on_incident)
    with anyio.fail_after(240):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            while not getattr(agent.watchers.get("health"), "ready", False):
                await anyio.sleep(0.2)
            await anyio.to_thread.run_sync(make_it_fail)
            await got.wait()
            agent.stop()
            tg.cancel_scope.cancel()
    await telemetry.aclose(3.0)
    return records[0]


def test_the_api_servers_blocked_event_loop_is_named_while_the_engine_core_idles(vllm_tp1: VllmServer,
                                                                               tmp_path: Path) -> None:
    engine = vllm_tp1.engine_core()
    threads: list[threading.Thread] = []

    def block_the_event_loop() -> None:
        vllm_tp1.hang_api_server()

        def go() -> None:
            try:
                vllm_tp1.complete("hello", max_tokens=2, timeout_s=300)
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=go, daemon=True)
        t.start()
        threads.append(t)

    started = time.monotonic()
    try:
        record = anyio.run(_watch_health, vllm_tp1, tmp_path / "data", block_the_event_loop)
    finally:
        vllm_tp1.clear_fault()
        for t in threads:
            t.join(timeout=300)
    v = record.verdict.to_json()
    print(f"\n{v['headline']}\nnext: {v['next']}\n(in all: {time.monotonic() - started:.1f} s)")
    assert (v["kind"], v["rule"], v["culprit_pids"], v["culprit_roles"], v["hung"], v["confidence"]) == (
        "frontend", "frontend_blocked", [vllm_tp1.pid], ["frontend"], True, "high"), v
    assert v["reason"].startswith("the API server's event loop is blocked in "), v["reason"]
    assert v["reason"].endswith("/health fails while the engine core and every rank idle (waiting for work)"), v
    assert f"(pid {vllm_tp1.pid} 'python vllm serve')" in v["reason"], v["reason"]  # its command, none of its arguments
    dumped = {r.pid for r in record.results if r.action == "pyspy.dump" and r.outcome.value == "ok"}
    assert {vllm_tp1.pid, engine.pid} <= dumped, (dumped, [(t.pid, t.title) for t in record.targets])
    assert any(line.startswith(f"pid {engine.pid} 'VLLM::EngineCore'; coordinator; idle") for line in v["evidence"]), v
    assert vllm_tp1.serves(timeout_s=120), vllm_tp1.log_tail()  # released: the server answers again
