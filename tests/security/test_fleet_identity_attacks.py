"""One token holder of a job speaking for another host (issue 34, item 4).

Three agents' addresses on loopback, one port: node-a (the coordinator: the lowest address),
node-x (a real agent: the host to frame) and node-y's address, held by an attacker that holds the
job's token (a real other uid, ``nobody``, a stdlib program): it answers the coordinator's join as
node-y, with the token's proof, as a member would. Then it sends, signed with the token:

* ``evidence``: an evidence summary claiming to be node-x's (rank 4 stuck in compute), after
  node-x's own, then its own. Before the fix evidence was keyed by the host name it claimed, last
  write winning: the job verdict named "culprit rank 4 on node-x". Now a host name belongs to the
  identity that proved it first (the address its join answer came from, and its API port): the
  forgery is refused (409), said in the job verdict and the status.
* ``report``: (nothing at node-y's port) a detection reported first as node-x, signed as the agent
  at node-y's address on another port (a second identity of one address), then node-x's forged
  evidence. Before the fix the first proof won and the real node-x's join answer and evidence were
  refused as the conflict: "culprit rank 4 on node-x". Now a signature naming a port the member
  list does not give its address is refused (401), and the real node-x's own verified join answer
  proves node-x at its address over the earlier claim, which is the conflict.
* ``join``: a join naming a trace of its own to the coordinator. Before the fix the coordinator's
  job incident was relabelled into it. Now only the coordinator moves a job incident: refused, said.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from tests.fleet._fleet import TOKEN, free_ports, running_agent, settings_for
from tests.security._attack import NOBODY, NOBODY_PYTHON, needs_root, ready_line, run_as_nobody

pytestmark = needs_root

A, X, Y = "127.0.0.61", "127.0.0.62", "127.0.0.63"
FORGED_TRACE = "f" * 31 + "d"
FORGED_FRAME = "matmul (forged_model.py:9)"

#: The token holder at node-y's address (stdlib only, run as nobody). Usage: ``MODE HOST PORT
#: COORDINATOR TOKEN_FILE LOG GO``. Answers the coordinator's join as node-y (with the token's
#: proof), writes ``joined <trace>`` to LOG, waits for the file GO (60 s at most), then sends
#: MODE's requests to the coordinator from HOST, signed with the token (the current signature,
#: else the previous one), and appends ``{"step", "status", "body"}`` lines to LOG.
TOKEN_HOLDER = r'''
import hashlib, hmac, json, os, secrets, socket, sys, time

mode, host, port, coord, token_file, log, go = sys.argv[1:8]
port = int(port)
signed_port = port + 1 if mode == "report" else port  # "report": another identity at the same address
token = open(token_file).read().strip().encode()
COLLECTIVE = "all_reduce (torch/distributed/distributed_c10d.py:1)"


def read_message(conn):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data, {}
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode()] = value.strip().decode()
    while len(body) < int(headers.get("content-length", "0")):
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body, headers


def signature(authority, path, body, with_port):
    ts, nonce, digest = str(int(time.time())), secrets.token_hex(16), hashlib.sha256(body).hexdigest()
    parts = ["v2" if with_port else "v1", "POST", authority.lower(), path, ts, nonce, digest] + ([str(signed_port)] if with_port else [])
    sig = hmac.new(token, "\n".join(parts).encode(), hashlib.sha256).hexdigest()
    return f"Servewatch-Sig ts={ts},nonce={nonce},sha256={digest}" + (f",port={signed_port}" if with_port else "") + f",sig={sig}"


def post(step, path, doc, headers=()):
    body = json.dumps(doc).encode()
    tries = []
    for with_port in (True, False):
        authority = f"{coord}:{port}"
        head = (f"POST {path} HTTP/1.1\r\nhost: {authority}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n"
                f"authorization: {signature(authority, path, body, with_port)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n")
        with socket.create_connection((coord, port), timeout=10, source_address=(host, 0)) as s:
            s.settimeout(10)
            s.sendall(head.encode() + body)
            answer, _ = read_message(s)
        status = int(answer.split(b" ", 2)[1])
        tries.append([status, answer.partition(b"\r\n\r\n")[2].decode()])
        if status != 401:
            break
    with open(log, "a") as fh:
        fh.write(json.dumps({"step": step, "status": status, "body": tries[-1][1], "tries": tries}) + "\n")
    return json.loads(tries[-1][1] or "{}")


def evidence(trace, name, ranks):
    return {"job": "j", "host.name": name, "trace_id": trace, "incident_id": "inc-" + name, "bundle_dir": "/b",
            "ranks": ranks, "world_size": 5}


def forge_x(trace):
    forged = [{"rank": 4, "frame_class": "compute", "frame": "matmul (forged_model.py:9)"}]
    forged += [{"rank": r, "frame_class": "collective", "frame": COLLECTIVE} for r in (1, 3)]
    post("forged", "/v1/job/evidence", evidence(trace, "node-x", forged))


deadline = time.monotonic() + 60
if mode == "report":  # nothing at node-y's port: it reports first, as node-x, then sends node-x's evidence
    print("ready", flush=True)
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    answer = post("report", "/v1/job/report", {"job": "j", "host.name": "node-x", "api_port": signed_port,
                  "incident_id": "inc-node-x", "trace_id": secrets.token_hex(16), "key": "time:1",
                  "detected_time_unix_nano": time.time_ns(), "ranks": [4], "world_size": 5})
    forge_x(answer.get("trace_id") or "0" * 32)
    sys.exit(0)
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(16)
srv.settimeout(1.0)
print("ready", flush=True)
trace = None
while trace is None and time.monotonic() < deadline:
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        continue
    conn.settimeout(10)
    raw, headers = read_message(conn)
    tp = headers.get("traceparent", "")
    doc = {"status": "opened", "host.name": "node-y", "job": "j", "incident_id": "inc-node-y", "ranks": [2],
           "agent_id": "y", "trace_id": tp.split("-")[1] if tp else None}
    body = json.dumps(doc).encode()
    proof = hmac.new(token, headers.get("x-servewatch-nonce", "").encode() + b"\n202\n" + body, hashlib.sha256).hexdigest()
    conn.sendall(b"HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                 b"x-servewatch-proof: %s\r\nconnection: close\r\n\r\n%s" % (len(body), proof.encode(), body))
    conn.close()
    if raw.startswith(b"POST /v1/incidents ") and tp:
        trace = tp.split("-")[1]
with open(log, "a") as fh:
    fh.write(f"joined {trace}\n")
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
if mode == "evidence":
    forge_x(trace)
    post("own", "/v1/job/evidence", evidence(trace, "node-y", [{"rank": 2, "frame_class": "collective", "frame": COLLECTIVE}]))
else:
    post("join", "/v1/incidents", {"job": "j", "origin_host": "node-y", "incident_id": "inc-node-y", "detail": "forged",
                                   "coordinator": f"http://{host}:{port}"},
         headers=[("traceparent", "00-" + "f" * 31 + "d-" + "e" * 16 + "-01")])
'''


def _token_holder(spawn: Callable, nobody_dir: Path, mode: str, port: int) -> tuple[Path, Path]:
    program, token, log, go = (nobody_dir / n for n in ("holder.py", "token", "holder.log", "go"))
    program.write_text(TOKEN_HOLDER)
    program.chmod(0o644)  # whatever the umask
    token.write_text(TOKEN)
    os.chown(token, NOBODY, NOBODY)
    token.chmod(0o600)
    proc = run_as_nobody(spawn, [NOBODY_PYTHON, str(program), mode, Y, str(port), A, str(token), str(log), str(go)])
    ready_line(proc)
    return log, go


def _steps(log: Path) -> dict[str, dict[str, Any]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return {doc["step"]: doc for doc in (json.loads(line) for line in lines if line.startswith("{"))}


def _job_settings(tmp_path: Path, host: str, address: str, port: int) -> Any:
    job = {"job": "j", "peers": [f"{A}:{port}", f"{X}:{port}", f"{Y}:{port}"], "announce_interval_s": 600,
           "evidence_timeout_s": 30, "accept_timeout_s": 2}
    return settings_for(tmp_path, host, port, api={"host": address}, fleet=job)


async def test_a_token_holder_cannot_send_evidence_as_another_host(
    tmp_path: Path, spawn: Callable, nobody_dir: Path, host_files: Path
) -> None:
    [port] = free_ports(1)
    log, go = _token_holder(spawn, nobody_dir, "evidence", port)
    async with running_agent(_job_settings(tmp_path, "node-x", X, port)), \
            running_agent(_job_settings(tmp_path, "node-a", A, port)) as (agent_a, records_a):
        await agent_a.incidents.open_incident("manual")
        with anyio.fail_after(60):  # node-x's own evidence is in first
            while agent_a.fleet.evidence_received < 1 or "joined" not in (log.read_text() if log.exists() else ""):
                await anyio.sleep(0.05)
        go.write_text("")
        with anyio.fail_after(60):
            while agent_a.fleet.verdicts < 1:
                await anyio.sleep(0.05)
        status = await agent_a.fleet.status()
    steps = _steps(log)
    [record] = records_a
    doc = json.loads((record.bundle_dir / "job-verdict.json").read_text())
    verdict = doc["verdict"]
    # the forgery was refused, saying why; the token holder's own evidence was taken
    assert steps["forged"]["status"] == 409, steps
    assert "evidence for host node-x from" in json.loads(steps["forged"]["body"])["error"]
    assert steps["own"]["status"] == 200, steps
    # node-x is not framed: nothing of the forgery reached the verdict, which says the conflict
    assert "node-x" not in verdict["culprit_hosts"] and "rank 4 on node-x" not in verdict["headline"], verdict["headline"]
    assert 4 not in verdict["captured_ranks"] and verdict["kind"] != "behind", verdict
    assert FORGED_FRAME not in json.dumps(doc)
    assert sorted(verdict["hosts"]) == ["node-a", "node-x", "node-y"]
    assert verdict["conflicts"] and "evidence for host node-x" in verdict["conflicts"][0]
    assert "1 identity conflict: evidence for host node-x" in verdict["headline"]
    assert status["fleet"]["identity_conflicts"] >= 1


async def test_a_token_holder_cannot_relabel_the_job_trace_with_a_join(
    tmp_path: Path, spawn: Callable, nobody_dir: Path, host_files: Path
) -> None:
    [port] = free_ports(1)
    log, go = _token_holder(spawn, nobody_dir, "join", port)
    async with running_agent(_job_settings(tmp_path, "node-x", X, port)), \
            running_agent(_job_settings(tmp_path, "node-a", A, port)) as (agent_a, records_a):
        await agent_a.incidents.open_incident("manual")
        with anyio.fail_after(60):
            while "joined" not in (log.read_text() if log.exists() else ""):
                await anyio.sleep(0.05)
        trace = agent_a.fleet.job.trace_id
        go.write_text("")
        with anyio.fail_after(60):
            while "join" not in _steps(log):
                await anyio.sleep(0.05)
        job_trace_after = agent_a.fleet.job.trace_id
        summary = agent_a.fleet.job.summary()
        with anyio.fail_after(60):
            while not records_a:
                await anyio.sleep(0.05)
        moved = agent_a.fleet.moved
    step = _steps(log)["join"]
    assert step["status"] == 409 and "refused" in json.loads(step["body"])["error"], step
    assert job_trace_after == trace != FORGED_TRACE and moved == 0
    assert records_a[0].opened.trace_id == trace
    assert json.loads(records_a[0].manifest_path.read_text())["trace_id"] == trace
    assert summary["conflicts"] == 1 and FORGED_TRACE in summary["conflict"]


async def test_a_token_holder_cannot_take_a_host_name_by_reporting_first_under_another_port(
    tmp_path: Path, spawn: Callable, nobody_dir: Path, host_files: Path
) -> None:
    """The token holder at node-y's address (its port free: nobody answers there) reports a
    detection first, as node-x with rank 4, signing as the agent at node-y's address on *another*
    port (a second identity of one address), then sends node-x's forged evidence. Before the fix
    the first proof won: the coordinator bound node-x to 127.0.0.63:<port+1>, refused the real
    node-x's join answer and evidence as the conflict and judged "culprit rank 4 on node-x". Now a
    signature naming a port the member list does not give its address is refused (401, why), and
    the real node-x's own verified join answer, at the address the coordinator asked, proves
    node-x there: the earlier claim is the conflict, what it sent is dropped."""
    [port] = free_ports(1)
    log, go = _token_holder(spawn, nobody_dir, "report", port)
    async with running_agent(_job_settings(tmp_path, "node-x", X, port)), \
            running_agent(_job_settings(tmp_path, "node-a", A, port)) as (agent_a, records_a):
        go.write_text("")
        with anyio.fail_after(90):
            while agent_a.fleet.verdicts < 1:
                await anyio.sleep(0.05)
        status = await agent_a.fleet.status()
    steps = _steps(log)
    [record] = records_a
    doc = json.loads((record.bundle_dir / "job-verdict.json").read_text())
    verdict = doc["verdict"]
    # the second identity is refused at the door, saying why
    first_status, first_body = steps["report"]["tries"][0]
    assert first_status == 401 and f"signed as the agent at {Y}:{port + 1}" in first_body, steps["report"]
    # node-x is not framed: the real node-x's evidence is judged, the forgery never is
    assert "node-x" not in verdict["culprit_hosts"] and "rank 4 on node-x" not in verdict["headline"], verdict["headline"]
    assert FORGED_FRAME not in json.dumps(doc)
    assert "node-x" in verdict["hosts"], verdict["hosts"]
    assert any(f"node-x was claimed by {Y}:" in c for c in verdict["conflicts"]), verdict["conflicts"]
    assert not any(f"from {X}:{port} refused" in c for c in verdict["conflicts"]), verdict["conflicts"]
    assert status["fleet"]["identity_conflicts"] >= 1
