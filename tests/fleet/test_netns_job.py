"""A real multi-host job: three hosts (real network namespaces when this machine allows them, else
three loopback addresses: :mod:`tests.fleet._netns`), a real gloo job of 6 ranks across them (2
per host, ``tests/programs/dist_rank.py``), one real ``servewatch run`` per host watching its own
two ranks, talking to the others over the hosts' network.

Faults: a rank hangs in compute (every host's watchdog fires within milliseconds: one trace, one
root, a job verdict naming the culprit rank and its host); the culprit's host has no agent (the
verdict names that host and its ranks); a host is cut off the network (namespaces only: the
verdict names it as unreachable; the cut-off host adds no second verdict, its incident under the
same root says its view is partial, and its evidence reaches the coordinator once the partition
heals, marked partial).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fleet._fleet import token_file
from tests.fleet._netns import Hosts, three_hosts

pytestmark = pytest.mark.slow

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
JOB = "netjob"
PORT = 7207
WORLD = 6


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    yield from three_hosts()


def _ranks(hosts: Hosts, spawn, tmp_path: Path, fault: str, fault_rank: int, go: Path) -> list[int]:
    pids = []
    procs = []
    for rank in range(WORLD):
        h = rank // 2
        argv = [*hosts.prefix(h), sys.executable, str(PROGRAMS / "dist_rank.py"), "--rank", str(rank), "--world-size", str(WORLD),
                "--init", f"file://{tmp_path}/store", "--title", f"{JOB}::scheduler", "--fault", fault, "--fault-rank", str(fault_rank),
                "--fault-file", str(go), "--timeout-s", "150", "--max-runtime-s", "240", "--step-sleep-s", "0.05", "--linger-s", "30"]
        procs.append(spawn(argv, env={**os.environ, "GLOO_SOCKET_IFNAME": hosts.ifname}, stdout=subprocess.PIPE))
    for proc in procs:
        line = proc.stdout.readline().decode()
        while line.startswith("INIT"):  # before init_process_group
            line = proc.stdout.readline().decode()
        assert line.startswith("READY"), line
        pids.append(int(line.split()[2]))
    return pids


def _torchrun_ranks(hosts: Hosts, spawn, tmp_path: Path, go: Path) -> list[int]:
    """The pod shape: on each host a real ``torchrun`` (static rendezvous on host-0, no restarts)
    starts and reaps its two ranks (it polls them every 0.1 s, its default), so a rank's exit
    status is its parent's, not ours; the ranks take their rank from torchrun's ``RANK``. A rank
    whose collective fails exits 1 a second later (each host then has an error exit of its own)."""
    procs = []
    for h in range(3):
        argv = [*hosts.prefix(h), sys.executable, "-m", "torch.distributed.run", "--nnodes", "3", "--nproc-per-node", "2",
                "--node-rank", str(h), "--master-addr", hosts.addresses[0], "--master-port", str(PORT + 1), "--max-restarts", "0",
                str(PROGRAMS / "dist_rank.py"), "--init", "env://", "--title", f"{JOB}::scheduler", "--fault", "none",
                "--fault-file", str(go), "--timeout-s", "150", "--max-runtime-s", "240", "--step-sleep-s", "0.05", "--linger-s", "1"]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": hosts.ifname, "OMP_NUM_THREADS": "1"}
        with (tmp_path / f"torchrun-{h}.log").open("wb") as log:  # the child keeps its own copy of the descriptor
            procs.append(spawn(argv, env=env, stdout=subprocess.PIPE, stderr=log))
    pids: dict[int, int] = {}
    for proc in procs:
        while len([r for r in pids if r // 2 == procs.index(proc)]) < 2:
            line = proc.stdout.readline().decode()
            assert line, f"torchrun ended before its ranks were ready: {(tmp_path / f'torchrun-{procs.index(proc)}.log').read_text()[-2000:]}"
            if line.startswith("READY"):
                _, rank, pid = line.split()
                pids[int(rank)] = int(pid)
    return [pids[r] for r in range(WORLD)]


def _agent(hosts: Hosts, h: int, pids: list[int], spawn, tmp_path: Path, token: Path, *, fleet: bool = True) -> subprocess.Popen[bytes]:
    """Host ``h``'s ``servewatch run`` on its two ranks (``fleet=False``: the same agent alone, no ``--job``)."""
    peers = [arg for a in hosts.addresses for arg in ("--peer", f"{a}:{PORT}")]  # the same list everywhere
    job = ["--job", JOB, *peers, "--allow-insecure-peers"] if fleet else []
    argv = [*hosts.prefix(h), sys.executable, "-m", "agent.cli.app", "run", "--verbose",
            "--pid", str(pids[2 * h]), "--pid", str(pids[2 * h + 1]), "--watchdog-timeout", "3",
            "--api-listen", f"{hosts.addresses[h]}:{PORT}", "--api-token-file", str(token), *job,
            "--data-dir", str(tmp_path / "data")]
    env = {**os.environ, "SERVEWATCH_HOST_NAME": f"host-{h}", "SERVEWATCH_EXPORT__METRICS": "false",
           "SERVEWATCH_COREDUMP__ENABLED": "false", "SERVEWATCH_FLEET__ANNOUNCE_INTERVAL_S": "1",
           "SERVEWATCH_FLEET__EVIDENCE_TIMEOUT_S": "25", "SERVEWATCH_FLEET__PEER_TIMEOUT_S": "3"}
    with (tmp_path / f"agent-{h}.log").open("wb") as log:  # the agent keeps its own copy of the descriptor
        return spawn(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _status(hosts: Hosts, h: int, token: Path) -> dict[str, Any] | None:
    """The agent's ``GET /v1/status``, asked from inside its host."""
    script = ("import httpx,sys;r=httpx.get(sys.argv[1],headers={'authorization':'Bearer '+open(sys.argv[2]).read().strip()},"
              "timeout=5,trust_env=False);print(r.text if r.status_code==200 else '')")
    done = subprocess.run([*hosts.prefix(h), sys.executable, "-c", script, f"http://{hosts.addresses[h]}:{PORT}/v1/status", str(token)],
                          capture_output=True, text=True, timeout=60, check=False)
    try:
        return json.loads(done.stdout) if done.stdout.strip() else None
    except ValueError:
        return None


def _wait(cond, timeout_s: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logs.glob("agent-*.log")))
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def _ready(hosts: Hosts, token: Path, agents: list[int]) -> bool:
    statuses = [_status(hosts, h, token) for h in agents]
    if not all(statuses):
        return False
    watching = all(all(t["step_counter_watched"] for t in s["targets"]) and len(s["targets"]) == 2 for s in statuses)
    coordinator_known = all((s["fleet"]["coordinator"] or {}).get("host.name") == "host-0" for s in statuses if s["host.name"] != "host-0")
    return watching and coordinator_known


def _manifests(data: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(data.glob("host-*/*/manifest.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out.setdefault(path.parts[-3], []).append(doc)
    return out


def _spans(data: Path, trace_id: str) -> list[dict[str, Any]]:
    from exporters.otlp.otlp_json import iter_span_files, read_span_file

    found = []
    for path in iter_span_files([data]):
        for request in read_span_file(path):
            for rs in request.resource_spans:
                host = next((kv.value.string_value for kv in rs.resource.attributes if kv.key == "host.name"), "?")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        if span.trace_id.hex() == trace_id:
                            attrs = {kv.key: kv.value for kv in span.attributes}
                            found.append({"name": span.name, "host": host, "span_id": span.span_id.hex(),
                                          "parent": span.parent_span_id.hex(), "attrs": attrs})
    return found


def _job_verdict(data: Path, host: str = "host-0") -> dict[str, Any] | None:
    paths = sorted(data.glob(f"{host}/*/job-verdict.json"))
    return json.loads(paths[0].read_text()) if paths else None


def _run_job(hosts: Hosts, spawn, tmp_path: Path, *, fault: str, fault_rank: int, agents_on: tuple[int, ...] = (0, 1, 2),
             before_fault=None, torchrun: bool = False) -> tuple[Path, dict[str, Any]]:
    token = token_file(tmp_path)
    go = tmp_path / "go"
    pids = _torchrun_ranks(hosts, spawn, tmp_path, go) if torchrun else _ranks(hosts, spawn, tmp_path, fault, fault_rank, go)
    procs = {h: _agent(hosts, h, pids, spawn, tmp_path, token) for h in agents_on}
    _wait(lambda: _ready(hosts, token, list(agents_on)), 180, "every agent watching its ranks, host-0 announced", tmp_path)
    if before_fault is not None:
        before_fault(procs, hosts, pids)
    go.touch()
    data = tmp_path / "data"
    _wait(lambda: _job_verdict(data) is not None, 150, "the job verdict", tmp_path)
    doc = _job_verdict(data)
    assert doc is not None
    return data, doc


def _one_root(data: Path, trace_id: str, hosts_with_incidents: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        spans = _spans(data, trace_id)
        roots = [s for s in spans if s["parent"] == ""]
        if roots and {s["host"] for s in spans if s["name"] == "incident"} >= hosts_with_incidents:
            break
        assert time.monotonic() < deadline, f"spans of trace {trace_id}: {[(s['name'], s['host']) for s in spans]}"
        time.sleep(0.5)
    assert [s["name"] for s in roots] == ["job.incident"], roots
    [root] = roots
    incidents = [s for s in spans if s["name"] == "incident"]
    assert all(s["parent"] == root["span_id"] for s in incidents)
    return root


def _hogs(spawn) -> None:
    """One busy loop pinned to each CPU of this machine (spawned: killed at teardown)."""
    for cpu in sorted(os.sched_getaffinity(0)):
        spawn([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])


@pytest.mark.timeout(420)
@pytest.mark.parametrize("load", ["quiet", "every-cpu-hogged"])
def test_a_rank_hung_on_one_host_is_one_trace_one_root_and_a_job_verdict_naming_rank_and_host(
    hosts: Hosts, spawn, tmp_path: Path, load: str
) -> None:
    """Quiet, and with a busy loop pinned to every CPU from before the hang (where reading the
    ranks' Flight Recorders before the incident opened was cut and split the trace)."""
    data, doc = _run_job(hosts, spawn, tmp_path, fault="hang", fault_rank=3,
                         before_fault=(lambda _procs, _hosts, _pids: _hogs(spawn)) if load != "quiet" else None)
    manifests = _manifests(data)
    assert sorted(manifests) == ["host-0", "host-1", "host-2"]
    assert all(len(m) == 1 for m in manifests.values()), {h: [x["trigger"] for x in m] for h, m in manifests.items()}
    traces = {m[0]["trace_id"] for m in manifests.values()}
    assert len(traces) == 1
    [trace] = traces
    assert doc["trace_id"] == trace and doc["coordinator"] == "host-0"
    # named by what costs nothing at detection (the capture never waited for it); the stuck
    # collective is recorded after the capture, from every host's Flight Recorder windows
    assert doc["key"].startswith("time:"), doc["key"]
    assert doc["stuck_collective"] is not None and doc["stuck_collective"].startswith("0:"), doc["stuck_collective"]
    verdict = doc["verdict"]
    assert (verdict["culprit_ranks"], verdict["culprit_hosts"]) == ([3], ["host-1"]), verdict
    assert verdict["kind"] == "behind" and verdict["confidence"] == "high", verdict
    assert verdict["captured_ranks"] == list(range(WORLD)) and verdict["world_size"] == WORLD and not verdict["missing_ranks"]
    assert any("missing ranks [3]" in line for line in verdict["torch_analysis"]), verdict["torch_analysis"]
    root = _one_root(data, trace, {"host-0", "host-1", "host-2"})
    assert root["host"] == "host-0"
    assert [v.string_value for v in root["attrs"]["servewatch.job.verdict.culprit_hosts"].array_value.values] == ["host-1"]
    assert root["attrs"]["servewatch.job.stuck_collective"].string_value == doc["stuck_collective"]


@pytest.mark.timeout(420)
def test_the_culprits_host_without_an_agent_is_named_with_its_ranks(hosts: Hosts, spawn, tmp_path: Path) -> None:
    def kill_host_1_agent(procs, _hosts, _pids) -> None:
        procs[1].kill()
        procs[1].wait(timeout=30)

    data, doc = _run_job(hosts, spawn, tmp_path, fault="hang", fault_rank=3, before_fault=kill_host_1_agent)
    verdict = doc["verdict"]
    assert doc["coordinator"] == "host-0"
    assert verdict["missing_ranks"] == [2, 3] and verdict["captured_ranks"] == [0, 1, 4, 5]
    assert verdict["missing_hosts"] == [{"host": "host-1", "ranks": [2, 3], "why": "agent unreachable (connection failed)"}], verdict
    # every captured rank waits in the same all_reduce: the culprit is among the ranks nobody captured
    assert verdict["kind"] == "missing" and verdict["culprit_ranks"] == [2, 3] and verdict["culprit_hosts"] == ["host-1", "host-1"]
    assert "host host-1 (ranks 2,3): agent unreachable" in verdict["reason"]
    _one_root(data, doc["trace_id"], {"host-0", "host-2"})


@pytest.mark.timeout(420)
def test_a_host_cut_off_the_network_is_named_unreachable_adds_no_second_verdict_and_sends_partial_evidence_later(
    hosts: Hosts, spawn, tmp_path: Path
) -> None:
    if not hosts.netns:
        pytest.skip("a partition needs real network namespaces (root and ip netns)")

    def cut_host_2(_procs, hosts_: Hosts, _pids) -> None:
        hosts_.partition(2)

    data, doc = _run_job(hosts, spawn, tmp_path, fault="none", fault_rank=0, before_fault=cut_host_2)
    verdict = doc["verdict"]
    assert doc["coordinator"] == "host-0"
    assert verdict["missing_hosts"] == [{"host": "host-2", "ranks": [4, 5],
                                         "why": "agent unreachable (timed out: host down or partitioned)"}], verdict
    assert verdict["culprit_ranks"] == [4, 5] and verdict["culprit_hosts"] == ["host-2", "host-2"]
    root = _one_root(data, doc["trace_id"], {"host-0", "host-1"})
    # host-2 saw the same hang: its incident hangs under the same root, its view said partial on
    # its own incident (hosts named as they proved themselves), never a second verdict
    deadline = time.monotonic() + 60
    while True:
        spans = _spans(data, doc["trace_id"])
        own = [s for s in spans if s["name"] == "incident" and s["host"] == "host-2"]
        if own:
            break
        assert time.monotonic() < deadline, [(s["name"], s["host"]) for s in spans]
        time.sleep(0.5)
    [incident] = own
    assert incident["parent"] == root["span_id"]
    attrs = incident["attrs"]
    assert attrs["servewatch.job.partial"].bool_value is True
    assert attrs["servewatch.job.coordinator"].string_value == "host-0"  # proven by its announce
    assert [v.string_value for v in attrs["servewatch.job.unreachable"].array_value.values] == [
        "host-0", f"http://{hosts.addresses[1]}:{PORT} (host name not proven)"]
    assert [s for s in spans if s["parent"] == ""] == [root]
    assert [(s["name"], s["host"]) for s in spans if s["name"] in ("job.incident", "job.verdict")] == [("job.incident", "host-0")]
    assert _job_verdict(data, "host-2") is None
    # the partition heals: host-2's evidence reaches the coordinator later, marked partial, not judged again
    token = tmp_path / "api-token"
    hosts.heal(2)
    _wait(lambda: ((_status(hosts, 0, token) or {}).get("fleet", {}).get("job_incident") or {}).get("partial_evidence") == ["host-2"],
          90, "host-2's partial evidence at host-0", tmp_path)
    assert _job_verdict(data, "host-0") == doc  # the verdict stands


@pytest.mark.timeout(420)
def test_a_rank_sigkilled_in_a_pod_is_named_the_first_death_across_hosts_with_its_signal(hosts: Hosts, spawn, tmp_path: Path) -> None:
    """Every agent in its own network namespace (no kernel exit events there: a pod), the ranks
    started and reaped by a real torchrun per host; rank 3 on host-1 is SIGKILLed. torchrun then
    stops rank 2 (SIGTERM), and the other hosts' ranks fail in their collective and exit 1 a
    second later (their hosts' first exits): the job's first death is rank 3, by its exit time
    across hosts, with its signal. With a busy loop pinned to every CPU (the agents wake late)."""
    if not hosts.netns:
        pytest.skip("a pod's agent needs its own network namespace (root and ip netns)")

    def kill_rank_3(_procs, _hosts, pids: list[int]) -> None:
        _hogs(spawn)
        os.kill(pids[3], signal.SIGKILL)

    data, doc = _run_job(hosts, spawn, tmp_path, fault="none", fault_rank=0, before_fault=kill_rank_3, torchrun=True)
    _one_root(data, doc["trace_id"], {"host-1"})
    logs = "".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("agent-*.log")))
    assert "not in the host's network namespace" in logs  # the pod's condition, said by the agent
    verdict = doc["verdict"]
    assert (verdict["kind"], verdict["culprit_ranks"], verdict["culprit_hosts"]) == ("dead", [3], ["host-1"]), verdict
    assert verdict["confidence"] == "high", verdict
    assert "rank 3 exited with SIGKILL" in verdict["reason"], verdict["reason"]
