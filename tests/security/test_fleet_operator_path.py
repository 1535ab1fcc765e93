"""The local operator's way into the agent API under a connection flood (issue 34, item 7).

A real other uid (``nobody``) holds 16 idle TCP connections to the API from 127.0.0.1, the
operator's own address, reconnecting whenever one is closed. Before the fix the per-address
limit (16) shut the operator out: 0 of 64 calls answered. Now a new connection from an address at
its share takes the slot of that address's oldest unauthenticated one, and the operator has a
path no TCP flood reaches: the unix socket (``<data_dir>/<host name>.api.sock`` by default; here
one in a folder every user may enter), whose callers the kernel names
(``SO_PEERCRED``: root and the agent's user only; another uid is closed at accept even when the
socket's mode would let it connect).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from tests.fleet._fleet import TOKEN, free_ports, running_agent, settings_for
from tests.security._attack import NOBODY_PYTHON, needs_root, ready_line, run_as_nobody

pytestmark = needs_root

AUTH = {"authorization": f"Bearer {TOKEN}"}
#: The operator's own request rate is not what this test is about.
GENEROUS = {"rate_burst": 1000, "rate_per_s": 1000.0}
CALLS = 64

#: Another uid asking the unix socket for the status (stdlib only): prints what happened.
ASK_SOCKET = r'''
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("refused", exc.errno)
    sys.exit(0)
try:
    s.sendall(b"GET /v1/status HTTP/1.1\r\nhost: agent\r\nconnection: close\r\n\r\n")
    data = s.recv(65536)
except OSError:
    data = b""
print("answered" if data else "cut off")
'''


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A root-owned 0755 folder under /tmp: any user may reach what is in it (unlike the data dir)."""
    path = Path(tempfile.mkdtemp(prefix="sw-op-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _ask_as_nobody(program: Path, socket_path: Path) -> str:
    done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", NOBODY_PYTHON,
                           str(program), str(socket_path)], capture_output=True, text=True, timeout=30, check=False)
    return done.stdout.strip()


async def _operator_calls(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> int:
    answered = 0
    for _ in range(CALLS):
        try:
            answered += (await client.get(url, headers=headers)).status_code == 200
        except httpx.HTTPError:
            pass
    return answered


async def test_an_idle_flood_from_the_operators_address_leaves_the_operator_a_way_in(
    tmp_path: Path, spawn: Callable, attack_programs: Path, nobody_dir: Path, host_files: Path, open_folder: Path
) -> None:
    [port] = free_ports(1)
    socket_path = open_folder / "api.sock"
    settings = settings_for(tmp_path, "node-a", port, api={**GENEROUS, "unix_socket": str(socket_path)})
    async with running_agent(settings) as (agent, _):
        attacker = run_as_nobody(spawn, [NOBODY_PYTHON, str(attack_programs / "attack_api_slots.py"), "--port", str(port),
                                         "--connections", "16", "--same-address", "--mode", "idle", "--seconds", "60"])
        held = int((await anyio.to_thread.run_sync(ready_line, attacker)).split()[1])
        assert held == settings.api.max_connections_per_client == 16  # the operator's address holds its share
        limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection per call
        async with httpx.AsyncClient(trust_env=False, timeout=5, limits=limits) as tcp:
            over_tcp = await _operator_calls(tcp, f"http://127.0.0.1:{port}/v1/status", AUTH)
        transport = httpx.AsyncHTTPTransport(uds=str(socket_path))
        async with httpx.AsyncClient(trust_env=False, timeout=5, transport=transport) as unix:
            over_unix = await _operator_calls(unix, "http://agent/v1/status", {})  # the uid is the credential
            status = (await unix.get("http://agent/v1/status")).json()
        # another uid on the socket: its mode (0600) keeps it out; opened to all, the kernel's word
        # on the caller's uid does
        program = nobody_dir / "ask.py"
        program.write_text(ASK_SOCKET)
        program.chmod(0o644)  # whatever the umask
        mode = socket_path.stat().st_mode & 0o777
        kept_out = await anyio.to_thread.run_sync(_ask_as_nobody, program, socket_path)
        socket_path.chmod(0o666)
        closed = await anyio.to_thread.run_sync(_ask_as_nobody, program, socket_path)
        stats = agent.fleet.server.statistics()
        attacker.kill()
    assert (over_tcp, over_unix) == (CALLS, CALLS), (over_tcp, over_unix, stats)
    assert stats.evicted_connections >= 1  # an operator's call took an idle flood connection's slot
    assert status["api"]["unix_connections"] == 1 and json.dumps(status["host.name"]) == '"node-a"'
    assert mode == 0o600 and kept_out == "refused 13"  # EACCES: the socket's mode
    assert closed == "cut off"  # connected, then closed at accept without an answer: uid 65534 is not admitted
    assert stats.unix_refused == 1
    assert not socket_path.exists()  # removed when the agent stopped
