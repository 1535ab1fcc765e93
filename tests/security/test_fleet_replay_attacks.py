"""A signed peer request replayed to another agent of the job (issue 34, item 3).

Every agent of a job listens on the same port. Agent A coordinates and signs its join for each
member it asks; one member's address is held by an impostor (a real other uid, ``nobody``), which
replays A's signed join, byte for byte, to agent B at B's address. Before the fix the signature
bound only the port of ``Host`` (the same everywhere) and B's nonce cache had never seen the nonce:
B opened an incident in the impostor's replay. Now the signature is bound to the receiver as the
sender named it (its address in the member list): B refuses it, saying why.

The same agent after a restart: a signed request it accepted is replayed to it, byte for byte,
by another uid, after it restarted on the same data dir (within the signature's time window).
Before the fix the nonce cache was in memory only: the restarted agent accepted it again. Now the
receiver's nonces live in its data dir (0600 in a 0700 folder, only those still fresh): refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path

import anyio

from tests.fleet._fleet import TOKEN, free_ports, running_agent, settings_for
from tests.security._attack import NOBODY_PYTHON, needs_root, ready_line, run_as_nobody

pytestmark = needs_root

A, B, IMPOSTOR = "127.0.0.51", "127.0.0.52", "127.0.0.53"

#: The impostor (stdlib only, run as nobody): listens at a member's address, answers the first
#: join it gets with a 503, replays it byte for byte to ``TARGET``:port, and writes what the
#: target answered (status line and body) to LOG. Prints ``ready`` once listening; exits after 60 s.
REPLAYER = r'''
import socket, sys, time

host, port, target, log = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def read_message(conn):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip() or 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(16)
srv.settimeout(1.0)
print("ready", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        continue
    conn.settimeout(10)
    raw = read_message(conn)
    conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    conn.close()
    if not raw.startswith(b"POST /v1/incidents "):
        continue
    with socket.create_connection((target, port), timeout=10) as s:
        s.settimeout(10)
        s.sendall(raw)
        answer = read_message(s)
    with open(log, "wb") as fh:
        fh.write(answer)
    break
'''


async def test_a_join_signed_for_one_agent_is_refused_by_another_with_the_reason(
    tmp_path: Path, spawn: Callable, nobody_dir: Path, host_files: Path
) -> None:
    [port] = free_ports(1)  # one port for every agent of the job, as in production
    program = nobody_dir / "replay.py"
    program.write_text(REPLAYER)
    program.chmod(0o644)  # whatever the umask
    log = nobody_dir / "answer.log"
    impostor = run_as_nobody(spawn, [NOBODY_PYTHON, str(program), IMPOSTOR, str(port), B, str(log)])
    ready_line(impostor)
    job = {"job": "j", "announce_interval_s": 600, "evidence_timeout_s": 2, "accept_timeout_s": 2}
    # A lists itself and the impostor's address (not B: B only ever hears the replay)
    settings_a = settings_for(tmp_path, "node-a", port, api={"host": A}, fleet={**job, "peers": [f"{A}:{port}", f"{IMPOSTOR}:{port}"]})
    settings_b = settings_for(tmp_path, "node-b", port, api={"host": B}, fleet={**job, "peers": [f"{A}:{port}", f"{B}:{port}"]})
    async with running_agent(settings_b) as (agent_b, records_b), running_agent(settings_a) as (agent_a, records_a):
        assert agent_a.fleet.port == agent_b.fleet.port == port
        await agent_a.incidents.open_incident("manual")  # A coordinates: it asks the impostor's address to join
        with anyio.fail_after(60):
            while not log.exists() or not records_a:
                await anyio.sleep(0.05)
        answer = log.read_bytes()
        opened_b = agent_b.incidents.current is not None or bool(records_b)
        joins_b = agent_b.fleet.joins
    status_line, _, rest = answer.partition(b"\r\n")
    body = json.loads(rest.partition(b"\r\n\r\n")[2] or b"{}")
    # B refused the replay, and said it was signed for another agent
    assert status_line.split()[1] == b"401", answer
    assert f"signed for {IMPOSTOR}:{port}" in body["error"] and "not this agent" in body["error"], body
    assert joins_b == 0 and not opened_b and records_b == []


#: The replayer of captured bytes (stdlib only, run as nobody): ``SOURCE TARGET PORT RAW LOG GO``.
#: Each time the file ``GO<n>`` appears (n = 1, 2, 3; 60 s at most), it sends RAW from SOURCE to
#: TARGET:PORT and appends the answer's status and body, one JSON line, to LOG.
RESENDER = r'''
import json, os, socket, sys, time

source, target, port, raw, log, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), open(sys.argv[4], "rb").read(), sys.argv[5], sys.argv[6]
print("ready", flush=True)
deadline = time.monotonic() + 60
for n in (1, 2, 3):
    while not os.path.exists(go + str(n)) and time.monotonic() < deadline:
        time.sleep(0.05)
    with socket.create_connection((target, port), timeout=10, source_address=(source, 0)) as s:
        s.settimeout(10)
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    with open(log, "a") as fh:
        fh.write(json.dumps({"n": n, "status": int(data.split(b" ", 2)[1]), "body": data.partition(b"\r\n\r\n")[2].decode()}) + "\n")
'''


def _signed_announce(port: int) -> bytes:
    """A member's signed announce to A (as an agent of the job sends it), the bytes on the wire."""
    body = json.dumps({"job": "j", "host.name": "node-b", "api_port": port, "ranks": [2]}).encode()
    authority, path = f"{A}:{port}", "/v1/job/announce"
    ts, nonce, digest = str(int(time.time())), secrets.token_hex(16), hashlib.sha256(body).hexdigest()
    signed = "\n".join(["v2", "POST", authority, path, ts, nonce, digest, str(port)])
    sig = hmac.new(TOKEN.encode(), signed.encode(), hashlib.sha256).hexdigest()
    return (f"POST {path} HTTP/1.1\r\nhost: {authority}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n"
            f"authorization: Servewatch-Sig ts={ts},nonce={nonce},sha256={digest},port={port},sig={sig}\r\n\r\n").encode() + body


async def test_a_signed_request_accepted_before_a_restart_is_refused_after_it(
    tmp_path: Path, spawn: Callable, nobody_dir: Path, host_files: Path
) -> None:
    [port] = free_ports(1)
    raw, program, log, go = (nobody_dir / n for n in ("captured", "resend.py", "answers.log", "go"))
    raw.write_bytes(_signed_announce(port))
    program.write_text(RESENDER)
    for path in (raw, program):
        path.chmod(0o644)  # whatever the umask
    resender = run_as_nobody(spawn, [NOBODY_PYTHON, str(program), B, A, str(port), str(raw), str(log), str(go)])
    ready_line(resender)
    settings = settings_for(tmp_path, "node-a", port, api={"host": A},
                            fleet={"job": "j", "peers": [f"{A}:{port}", f"{B}:{port}"], "announce_interval_s": 600})

    async def answer(n: int) -> dict:
        Path(f"{go}{n}").write_text("")
        with anyio.fail_after(30):
            while len(log.read_text().splitlines() if log.exists() else []) < n:
                await anyio.sleep(0.05)
        return json.loads(log.read_text().splitlines()[n - 1])

    async with running_agent(settings):
        first, replay = await answer(1), await answer(2)
    async with running_agent(settings):  # the same agent, restarted on its data dir
        after_restart = await answer(3)
    assert first["status"] == 200 and json.loads(first["body"])["status"] == "member", first
    assert replay["status"] == 401 and "a replay" in replay["body"], replay
    assert after_restart["status"] == 401 and "a replay" in after_restart["body"], after_restart
    # what keeps them: only the receiver can read it
    folder = settings.data_dir / "fleet"
    [kept] = list(folder.iterdir())
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert kept.stat().st_uid == os.geteuid() and len(kept.read_text().splitlines()) == 1
