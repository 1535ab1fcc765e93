"""Frontend processes are part of the server (issue 32 item 1), on real process trees: stand-ins of
SGLang and vLLM with their real module paths and titles (``tests/programs/standins/sglang``,
``.../vllm``: asyncio HTTP frontends, spawned children titled with setproctitle), the real agent
watching with the README's title globs, real py-spy, and the health incident with its verdict.

Used by ``tests/test_frontend_verdict.py`` and ``bench/bench_verdict.py`` (:data:`FRONTEND_SHAPES`).

* ``api_server_blocked`` (vLLM PR #38157): a chat request's template renders for ever on the API
  server's event loop; ``/health`` and ``/metrics`` time out while the engine core and its workers
  idle. The agent matches ``VLLM::*`` (the engine core, the workers) in the server's tree: the API
  server, untitled, is dumped too, and named.
* ``detokenizer_spins`` (SGLang #26482, #34740): the detokenizer spins in its incremental decode
  while the schedulers keep generating (``sglang:generation_tokens_total`` rising); ``/health`` turns
  503. The agent matches ``sglang::scheduler*`` only: the detokenizer is dumped too, and named.
* ``agent_after_hang``: the same SGLang hang, the agent started only after it: the 503 is not read
  as start-up (the server's ``/metrics`` already counts generated tokens), the incident opens and
  names the detokenizer.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from tests.programs.fault_matrix import ROOT, STANDINS, ShapeResult, _env, _result, stop_ranks


def _start_standin(module: str, args: list[str], wd: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """``python -m <module> ...`` of a stand-in server in its own session (stop with
    :func:`~tests.programs.fault_matrix.stop_ranks`), and its ready file once written (bounded)."""
    ready = wd / f"ready-{module}-{time.monotonic_ns()}.json"
    env = {**_env(Path(os.environ.get("SERVEWATCH_SHM_DIR", "/dev/shm"))), "PYTHONPATH": f"{STANDINS}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-m", module, "--ready-file", str(ready), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env, start_new_session=True, cwd=wd)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_ranks([proc])
            raise RuntimeError(f"{module} not ready (exit {proc.poll()})")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def _settings(port: int, preset: str, match: str, root: int) -> dict[str, Any]:
    """The agent's settings: the README's title glob within the server's tree (``--root-pid``: other
    servers on this host, other tests', are never this one's), its ``/health`` and ``/metrics``."""
    base = f"http://127.0.0.1:{port}"
    return {
        "target": {"match": [match], "root_pid": root},
        "health": {"url": f"{base}/health", "interval_s": 0.5, "timeout_s": 3.0, "unhealthy_after": 2,
                   "healthy_after": 1},
        "metrics": {"url": f"{base}/metrics", "metrics_preset": preset, "scrape_timeout_s": 2.0},
        "watchdog": {"timeout_s": 30.0, "poll_interval_s": 1.0},
        "pyspy": {"native": False},
    }


async def _health_incident(settings_extra: dict[str, Any], wd: Path,
                           inject: Callable[[], Awaitable[None]] | None = None, deadline_s: float = 120.0) -> Any:
    """Run the real agent until its first health incident: ``inject()`` once its health check has
    seen the server answer (``None``: the fault is already there when it starts). The incident."""
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings
    from exporters.otlp.provider import build_telemetry

    base: dict[str, Any] = {"data_dir": wd / "data", "host_name": "frontends", "coredump": {"enabled": False},
                            "incident": {"cooldown_s": 300.0}}
    settings = load_settings({**base, **settings_extra})
    records: list[Any] = []
    got = anyio.Event()

    def on_incident(record: Any) -> None:
        if record.opened.trigger == "health":
            records.append(record)
            got.set()

    telemetry = build_telemetry(settings.export, data_dir=settings.data_dir, host_name=settings.host_name)
    agent = Agent(settings, telemetry=telemetry, on_incident=on_incident)
    with anyio.fail_after(deadline_s):
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            if inject is not None:
                while not getattr(agent.watchers.get("health"), "ready", False):
                    await anyio.sleep(0.2)
                await anyio.sleep(1.0)  # a few good answers: healthy
                await inject()
            await got.wait()
            agent.stop()
            tg.cancel_scope.cancel()
    await telemetry.aclose(3.0)
    return records[0]


def _send_and_leave(port: int, body: dict[str, Any]) -> socket.socket:
    """POST ``body`` to the chat endpoint and leave the answer unread (the caller closes the socket)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


#: A chat template that renders for ever (10^10 loop turns in jinja2's sandbox).
ENDLESS_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages }}"


async def shape_api_server_blocked(wd: Path, *, health_only: bool = False) -> ShapeResult:
    """vLLM's API server blocked in a synchronous chat-template render on its event loop (vLLM PR
    #38157): the API server is named by its pid, its role and frame; the idle engine core and
    workers are not. ``health_only``: the agent is given the server's URLs alone (no glob, no pid):
    the tree is found from the process listening on the health URL's port."""
    proc, info = await anyio.to_thread.run_sync(_start_standin, "vllm.entrypoints.openai.api_server", ["--tp", "2"], wd)
    sockets: list[socket.socket] = []

    async def inject() -> None:
        sockets.append(_send_and_leave(info["port"], {"messages": [{"role": "user", "content": "hi"}],
                                                      "chat_template": ENDLESS_TEMPLATE}))

    try:
        settings = _settings(info["port"], "vllm", "VLLM::*", info["api_server"])
        if health_only:
            del settings["target"]
        record = await _health_incident(settings, wd, inject)
        return _result("api_server_blocked_health_only" if health_only else "api_server_blocked", record, kind="frontend", ranks=(), pids=(info["api_server"],),
                       confidence="high")
    finally:
        for sock in sockets:
            sock.close()
        await anyio.to_thread.run_sync(stop_ranks, [proc])


async def _sglang(wd: Path, *, after: bool) -> ShapeResult:
    fault = wd / f"detokenizer-fault-{time.monotonic_ns()}"
    if after:
        fault.touch()
    proc, info = await anyio.to_thread.run_sync(_start_standin, "sglang.launch_server",
                                                ["--tp", "2", "--fault-file", str(fault)], wd)

    async def inject() -> None:
        fault.touch()

    try:
        if after:  # the agent starts once /health has turned 503 (the detokenizer spins already)
            await anyio.sleep(3.0)
        record = await _health_incident(_settings(info["port"], "sglang", "sglang::scheduler*", info["main"]), wd,
                                        None if after else inject)
        name = "agent_after_hang" if after else "detokenizer_spins"
        return _result(name, record, kind="frontend", ranks=(), pids=(info["detokenizer"],), confidence="high",
                       forbidden_pids=())
    finally:
        await anyio.to_thread.run_sync(stop_ranks, [proc])


async def shape_detokenizer_spins(wd: Path) -> ShapeResult:
    """SGLang's detokenizer spins in its incremental decode while the schedulers generate (SGLang
    #26482, #34740): the detokenizer is named, never a progressing scheduler."""
    return await _sglang(wd, after=False)


async def shape_agent_after_hang(wd: Path) -> ShapeResult:
    """The detokenizer already spins when the agent starts: the 503 is no start-up."""
    return await _sglang(wd, after=True)


#: The frontend shapes, by name: ``await FRONTEND_SHAPES[name](workdir)``.
FRONTEND_SHAPES: dict[str, Callable[[Path], Awaitable[ShapeResult]]] = {
    "api_server_blocked": shape_api_server_blocked,
    "api_server_blocked_health_only": lambda wd: shape_api_server_blocked(wd, health_only=True),
    "detokenizer_spins": shape_detokenizer_spins,
    "agent_after_hang": shape_agent_after_hang,
}
