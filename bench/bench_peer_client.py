"""A job's fan-out as a client: N small JSON POSTs at once, one to each of N peers, through the
fan-out's own h11 client (agent/fleet/client.py ``post_json``: one connection per request) against
httpx, the project's HTTP client (a fresh ``AsyncClient`` per request, as the fan-out uses one per
peer, and one shared ``AsyncClient`` for all; both with one TLS context built once).

The N peers are N real agent API servers (agent/fleet/http.py ``HttpServer``, the server peers run)
in a separate process, on 127.0.0.1. Per round and per client: wall time of the whole fan-out and
this process's CPU time, the clients in turn; the ratios are httpx / h11 per round, median (min..max).

    python bench/bench_peer_client.py [--peers 8 64 256] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit_result, kill_groups, loadavg

from agent.fleet.client import post_json

BODY = {"incident_id": "20261201T000000Z-stall-abcdef", "trace_id": "0" * 32, "host.name": "bench", "ranks": [0, 1]}

SERVERS = """
import json, sys, anyio
from agent.fleet.http import HttpServer, json_response

async def main(n):
    async def handler(request):
        return json_response(200, {"host.name": "peer", "status": "accepted"})
    servers = [HttpServer(handler, max_connections=4096, max_connections_per_client=4096, reserved_for_authenticated=0)
               for _ in range(n)]
    async with anyio.create_task_group() as tg:
        for s in servers:
            await tg.start(s.serve)
        print(json.dumps([s.port for s in servers]), flush=True)
        await anyio.sleep_forever()

anyio.run(main, int(sys.argv[1]))
"""


async def _h11(ports: list[int]) -> None:
    async def one(port: int) -> None:
        answer = await post_json("127.0.0.1", port, "/v1/job/report", BODY, headers={})
        assert answer.status == 200, answer

    async with anyio.create_task_group() as tg:
        for port in ports:
            tg.start_soon(one, port)


#: one TLS context for every httpx client (building one per client costs ~20 ms of CPU: not the
#: protocol's cost, so not counted against httpx)
_TLS = ssl.create_default_context()


async def _httpx_each(ports: list[int]) -> None:
    async def one(port: int) -> None:
        async with httpx.AsyncClient(verify=_TLS) as client:
            response = await client.post(f"http://127.0.0.1:{port}/v1/job/report", json=BODY)
            assert response.status_code == 200, response

    async with anyio.create_task_group() as tg:
        for port in ports:
            tg.start_soon(one, port)


async def _httpx_shared(ports: list[int]) -> None:
    limits = httpx.Limits(max_connections=len(ports), max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, verify=_TLS) as client:
        async def one(port: int) -> None:
            response = await client.post(f"http://127.0.0.1:{port}/v1/job/report", json=BODY)
            assert response.status_code == 200, response

        async with anyio.create_task_group() as tg:
            for port in ports:
                tg.start_soon(one, port)


CLIENTS: dict[str, Callable[[list[int]], Awaitable[None]]] = {
    "h11": _h11, "httpx_each": _httpx_each, "httpx_shared": _httpx_shared,
}


def _timed(client: Callable[[list[int]], Awaitable[None]], ports: list[int]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    anyio.run(client, ports)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(f"load average {loadavg()}")
    for n in args.peers:
        proc = subprocess.Popen([sys.executable, "-c", SERVERS, str(n)], stdout=subprocess.PIPE, env=env,
                                start_new_session=True)
        try:
            assert proc.stdout is not None
            ports = json.loads(proc.stdout.readline())
            for client in CLIENTS.values():  # warm: imports, first connections
                _timed(client, ports)
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CLIENTS}
            for _ in range(args.rounds):
                for name, client in CLIENTS.items():
                    runs[name].append(_timed(client, ports))
        finally:
            kill_groups([proc], timeout_s=10)
        base_wall = [w for w, _ in runs["h11"]]
        base_cpu = [c for _, c in runs["h11"]]
        print(f"\n{n} peers, {args.rounds} rounds: median wall / CPU per fan-out")
        print(f"  h11 (post_json)     {statistics.median(base_wall) * 1e3:8.1f} ms  {statistics.median(base_cpu) * 1e3:8.1f} ms")
        for name in ("httpx_each", "httpx_shared"):
            walls = [w / b for (w, _), b in zip(runs[name], base_wall, strict=True)]
            cpus = [c / b for (_, c), b in zip(runs[name], base_cpu, strict=True)]
            wall_ms = statistics.median(w for w, _ in runs[name]) * 1e3
            cpu_ms = statistics.median(c for _, c in runs[name]) * 1e3
            print(f"  {name:18s}  {wall_ms:8.1f} ms  {cpu_ms:8.1f} ms   wall x{statistics.median(walls):.2f}"
                  f" ({min(walls):.2f}..{max(walls):.2f}), CPU x{statistics.median(cpus):.2f} ({min(cpus):.2f}..{max(cpus):.2f})")
            emit_result(f"fan-out client {n} peers, {name}, wall", ours=wall_ms, baseline=statistics.median(base_wall) * 1e3,
                        baseline_name="h11 post_json (agent/fleet/client.py)", unit="ms", ratio=statistics.median(walls),
                        spread=(min(walls), max(walls)), note=f"{args.rounds} rounds")


if __name__ == "__main__":
    main()
