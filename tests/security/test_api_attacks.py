"""Attacks on the agent API (issue 23, items 7 and 9), by a real other uid on the same host.

The agent runs in this (root) process with its API on 127.0.0.1; the attacker is a stdlib
program run as nobody (``tests/programs/attack_api_*.py``). Requests from the test itself are
the legitimate client holding the token.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest

from agent.runtime.settings import load_settings
from tests.fleet._fleet import TOKEN, free_ports, running_agent, settings_for, token_file
from tests.security._attack import NOBODY, NOBODY_PYTHON, needs_root, ready_line, run_as_nobody

pytestmark = needs_root

AUTH = {"authorization": f"Bearer {TOKEN}"}
#: The legitimate client's own request rate is not what these tests are about.
GENEROUS = {"rate_burst": 1000, "rate_per_s": 1000.0}


def _pki(folder: Path) -> dict[str, Path]:
    from tests.fleet.test_api import _pki as make

    return make(folder)


async def _lines(proc) -> str:
    out, _ = await anyio.to_thread.run_sync(proc.communicate)
    return out.decode()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["idle", "slow", "tls-idle"])
async def test_connections_held_by_another_user_never_lock_out_the_api(
    tmp_path: Path, spawn: Callable, attack_programs: Path, host_files: Path, mode: str
) -> None:
    [port] = free_ports(1)
    verify: ssl.SSLContext | bool = False
    if mode.startswith("tls"):
        pki = _pki(tmp_path)
        settings = load_settings({
            "data_dir": tmp_path / "d", "host_name": "node-a", "export": {"metrics": False},
            "api": {"enabled": True, "port": port, "tls_cert_file": pki["server"], "tls_key_file": pki["server-key"],
                    "tls_client_ca_file": pki["ca"], "token_file": token_file(tmp_path), **GENEROUS},
        })
        verify = ssl.create_default_context(cafile=str(pki["ca"]))
        verify.load_cert_chain(str(pki["client"]), str(pki["client-key"]))
        base = f"https://127.0.0.1:{port}"
    else:
        settings = settings_for(tmp_path, "node-a", port, api=GENEROUS)
        base = f"http://127.0.0.1:{port}"
    async with running_agent(settings) as (agent, _):
        attacker = run_as_nobody(spawn, [NOBODY_PYTHON, str(attack_programs / "attack_api_slots.py"), "--port", str(port),
                                         "--connections", "300", "--mode", mode.removeprefix("tls-"), "--seconds", "25"])
        held = int((await anyio.to_thread.run_sync(ready_line, attacker)).split()[1])
        assert held >= settings.api.max_connections  # every slot was taken before we came
        answered = 0
        limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection per request
        async with httpx.AsyncClient(trust_env=False, timeout=5, verify=verify, limits=limits) as client:
            for _ in range(104):
                try:
                    answered += (await client.get(base + "/v1/status", headers=AUTH)).status_code == 200
                except httpx.HTTPError:
                    pass
        stats = agent.fleet.server.statistics()
        assert answered == 104, (answered, stats)
        assert stats.evicted_connections > 0 and stats.open_connections <= settings.api.max_connections
        attacker.kill()


async def test_pipelined_requests_each_get_an_answer(tmp_path: Path) -> None:
    [port] = free_ports(1)

    def pipelined(*requests: bytes) -> list[int]:
        """Send every request in one write; the status of each answer, in order."""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"".join(requests))
            buf, codes = b"", []
            while len(codes) < len(requests):
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0:
                    head = buf[:head_end].decode("latin-1").split("\r\n")
                    length = next(int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:"))
                    if len(buf) >= head_end + 4 + length:
                        codes.append(int(head[0].split()[1]))
                        buf = buf[head_end + 4 + length:]
                        continue
                data = s.recv(65536)
                if not data:
                    break
                buf += data
        return codes

    get = f"GET /v1/status HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n\r\n".encode()
    listing = f"GET /v1/incidents HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n\r\n".encode()
    guess = b"GET /v1/status HTTP/1.1\r\nhost: x\r\nauthorization: Bearer nope\r\n\r\n"
    post = (f"POST /v1/incidents/none HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
            "content-length: 2\r\n\r\n{}").encode()
    async with running_agent(settings_for(tmp_path, "node-a", port, api=GENEROUS)):
        assert await anyio.to_thread.run_sync(pipelined, get, listing) == [200, 200]
        assert await anyio.to_thread.run_sync(pipelined, guess, get, get) == [401, 200, 200]  # proven mid-stream
        assert await anyio.to_thread.run_sync(pipelined, post, get) == [405, 200]


async def test_token_guesses_from_rotating_addresses_are_limited_for_all_clients(
    tmp_path: Path, spawn: Callable, attack_programs: Path, host_files: Path
) -> None:
    [port] = free_ports(1)
    settings = settings_for(tmp_path, "node-a", port)  # defaults: 20/5 per address, 30/1 per s for all guesses
    async with running_agent(settings) as (agent, _), httpx.AsyncClient(trust_env=False, timeout=10) as keep_alive:
        base = f"http://127.0.0.1:{port}"
        assert (await keep_alive.get(base + "/v1/status", headers=AUTH)).status_code == 200  # connection proven
        attacker = run_as_nobody(spawn, [NOBODY_PYTHON, str(attack_programs / "attack_api_requests.py"), "--port", str(port),
                                         "--count", "400", "--rotate"])
        counts = json.loads(await _lines(attacker))
        assert counts.get("401", 0) <= 30 + 10, counts  # at most the burst (30), plus what refilled
        assert counts.get("429", 0) >= 300, counts
        assert agent.fleet.api.unauthorized == counts.get("401", 0)
        # the authenticated keep-alive connection is still served while guesses are refused
        assert (await keep_alive.get(base + "/v1/status", headers=AUTH)).status_code == 200
        async with httpx.AsyncClient(trust_env=False, timeout=10) as fresh:
            r = await fresh.get(base + "/v1/status", headers=AUTH)
            if r.status_code == 429:  # a new connection waits like everyone else, then gets in
                await anyio.sleep(float(r.headers["retry-after"]))
                r = await fresh.get(base + "/v1/status", headers=AUTH)
            assert r.status_code == 200


async def test_manual_incidents_over_the_api_share_the_cooldown(
    tmp_path: Path, spawn: Callable, python: str, attack_programs: Path, host_files: Path, nobody_dir: Path
) -> None:
    import subprocess

    target = spawn([python, str(Path(__file__).parents[1] / "programs" / "titled_target.py"), "demo::scheduler_TP0"],
                   stdout=subprocess.PIPE)
    assert target.stdout.readline().startswith(b"ready")
    [port] = free_ports(1)
    shared_token = nobody_dir / "token"  # a token holder of another uid
    shared_token.write_text(TOKEN)
    os.chown(shared_token, NOBODY, NOBODY)  # the holder's own token, whatever the umask
    settings = settings_for(tmp_path, "node-a", port, target={"pids": [target.pid]}, coredump={"enabled": False})
    async with running_agent(settings) as (agent, records):
        holder = run_as_nobody(spawn, [NOBODY_PYTHON, str(attack_programs / "attack_api_requests.py"), "--port", str(port),
                                       "--count", "8", "--method", "POST", "--path", "/v1/incidents",
                                       "--token-file", str(shared_token), "--interval", "1.2"])
        counts = json.loads(await _lines(holder))
        assert counts == {"202": 1, "429": 7}, counts
        with anyio.fail_after(60):
            while agent.incidents.current is not None or not records:
                await anyio.sleep(0.05)
        assert [r.opened.trigger for r in records] == ["manual"]
        assert agent.incidents.state()["suppressed"] == 7
