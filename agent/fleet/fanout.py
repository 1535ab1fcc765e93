"""The coordinator's fan-out: who asks whom, and how many at once.

Owns :func:`plan` (direct below a threshold; above it, a two-level tree: the peers split into
about sqrt(N) groups, the first of each group a relay that asks the rest of its group) and
:func:`bounded` (run one coroutine per item with at most ``limit`` in flight).

Why: the old fan-out opened every connection at once (1,000 peers: all of them timed out over
mTLS on the 2-core coordinator, whose handshakes queued), and every host fanned out (N(N-1)
requests). Now one coordinator asks only the hosts that did not report, at most
``fanout_concurrency`` at a time, and above ``tree_threshold`` peers it asks sqrt(N) relays
instead: its own work is O(sqrt(N)) handshakes, each relay's O(sqrt(N)), the whole job's N-1
requests. Imports anyio and the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

__all__ = ["bounded", "plan"]

T = TypeVar("T")


def plan(peers: Sequence[T], *, threshold: int) -> list[tuple[T, list[T]]]:
    """Who the coordinator asks, and whom each of those asks in turn.

    Args:
        peers: the peers to ask (in a stable order).
        threshold: up to this many, all are asked directly.

    Returns:
        ``[(peer, [peers it relays to]), ...]``: with ``len(peers) <= threshold`` every relay
        list is empty; above, ``ceil(sqrt(N))`` groups of at most ``ceil(N / groups)`` peers.
    """
    n = len(peers)
    if n <= threshold:
        return [(p, []) for p in peers]
    groups = math.ceil(math.sqrt(n))
    size = math.ceil(n / groups)
    out: list[tuple[T, list[T]]] = []
    for start in range(0, n, size):
        chunk = list(peers[start:start + size])
        out.append((chunk[0], chunk[1:]))
    return out


async def bounded(items: Sequence[T], call: Callable[[T], Awaitable[None]], *, limit: int) -> None:
    """Await ``call(item)`` for every item, at most ``limit`` at a time; returns when all ended.

    ``call`` must not raise (each peer's failure is its own outcome).
    """
    if not items:
        return
    limiter = anyio.CapacityLimiter(max(1, limit))

    async def one(item: T) -> None:
        async with limiter:
            await call(item)

    async with anyio.create_task_group() as tg:
        for item in items:
            tg.start_soon(one, item)
