"""Hang a rank of a real demo server under a running in-process agent (shared by the tests that
watch what the agent does after a stall: hard mode's knock-on, own actions, a stall's ending)."""

from __future__ import annotations

import anyio
import httpx
from anyio.abc import TaskGroup

from agent.demo.client import DemoServer, agenerate, ainject_hang
from agent.runtime.agent import Agent


async def hung_request(base_url: str) -> None:
    """One request that meets the hang (its forward never ends, or the server loses its ranks
    under it: either way it is dropped here). Bounded by its 120 s timeout."""
    try:
        await agenerate(base_url, "meets the hang", 4, timeout_s=120.0)
    except httpx.HTTPError:
        pass


async def hang_a_watched_rank(agent: Agent, server: DemoServer, tg: TaskGroup, *, tp_rank: int) -> None:
    """Warm the server up, wait until the agent watches both ranks' step counters, hang TP
    ``tp_rank`` and send a request into the hang (in ``tg``). The caller bounds the wait
    (``anyio.fail_after``)."""
    await agenerate(server.base_url, "warm-up", 2)
    while not set(server.scheduler_pids) <= set(agent.watched_step_pids):
        await anyio.sleep(0.05)
    await ainject_hang(server.base_url, tp_rank=tp_rank)
    tg.start_soon(hung_request, server.base_url)
