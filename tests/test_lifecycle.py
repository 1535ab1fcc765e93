"""A server's lifecycle as `servewatch run` and `launch` see it, on real processes: the README's demo
server stopped with Ctrl-C (its ranks reaped by their own frontend at once) opens no incident, with
and without the kernel's exit events (a real network namespace refuses them); a rank killed -9
opens one incident and its server's failing health check no second one; `run --root-pid` stops
once its server ended; `kill -9` of `launch` leaves no rank running; a real OOM kill is named from
the cgroup's counter when the kernel log cannot be read."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from agent.host.exits import OomWatch, oom_counter_of
from tests.programs.lifecycle_cases import (
    MemoryCgroup,
    start_server,
    stop_server,
    wait_server_ready,
)
from tests.test_targeting import CLI, cli_env, manifests, start_tree

pytestmark = pytest.mark.slow


def _start_demo(spawn, python: str, tmp_path: Path, prefix: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], dict]:
    """The README's demo server (its own process group, like a terminal's foreground job)."""
    ready = tmp_path / f"ready-{prefix}.json"
    proc = spawn([python, "-m", "agent.demo.server", "--tp", "2", "--port", "0", "--title-prefix", prefix,
                  "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "demo server did not start"
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def _wait_for(path: Path, text: bytes, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_bytes():
        assert proc.poll() is None, path.read_text()
        assert time.monotonic() < deadline, path.read_text()
        time.sleep(0.1)


def _run_cli(spawn, tmp_path: Path, argv: list[str], err: Path, env: dict[str, str], *, prefix: list[str] = ()) -> subprocess.Popen[bytes]:
    with err.open("wb") as fh:
        return spawn([*prefix, *CLI, *argv], stdout=subprocess.PIPE, stderr=fh, cwd=tmp_path, env=env)


@pytest.mark.parametrize("netns", [False, True], ids=["kernel-exit-events", "own-netns"])
def test_ctrl_c_of_the_demo_server_while_run_watches_opens_no_incident(spawn, python, tmp_path: Path, netns: bool) -> None:
    if netns and shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    # probes every 0.5 s, unhealthy after 2: a health incident for the stopped server would open within ~1 s
    env = {**cli_env(tmp_path), "SERVEWATCH_HEALTH__INTERVAL_S": "0.5", "SERVEWATCH_HEALTH__UNHEALTHY_AFTER": "2"}
    runs = 3 if not netns else 1
    for n in range(runs):
        prefix = f"life{uuid.uuid4().hex[:6]}"
        server, info = _start_demo(spawn, python, tmp_path, prefix, env)
        err = tmp_path / f"run-{n}.err"
        data = tmp_path / f"data-{n}"
        # in its own network namespace (a container's), the kernel's exit events are refused and
        # the agent cannot reach the server's HTTP port: it watches the ranks by title only
        http = [] if netns else ["--health-url", info["base_url"] + "/health", "--metrics-url", info["base_url"] + "/metrics"]
        run = _run_cli(spawn, tmp_path, ["run", *http, "--match", f"{prefix}::scheduler*", "--watchdog-timeout", "5",
                                         "--data-dir", str(data)], err, env,
                       prefix=["unshare", "--net"] if netns else [])
        _wait_for(err, b"watching 2 target processes", run)
        time.sleep(1.0)
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C in the server's terminal: its whole foreground group
        assert server.wait(timeout=60) == 0
        # both ends (each settles up to 3 s), and any health failure that would follow: 8 s; with
        # a health URL, until the agent said what the closed port's failed checks led to ("health
        # detected (...)": it judges them after the ranks' exits, and says so unless it opens a
        # health incident) and 1 s more, at most the same 8 s
        settled = time.monotonic() + 8.0
        while not netns and b"health detected" not in err.read_bytes() and time.monotonic() < settled:
            time.sleep(0.1)
        time.sleep(max(0.0, min(1.0 if not netns else 8.0, settled - time.monotonic())))
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=60)
        printed = err.read_text()
        assert manifests(data) == [], printed
        seen = [line for line in printed.splitlines() if line.startswith("  pid ") and f"{prefix}::scheduler_TP" in line]
        assert len(seen) == 2 and all("-> no incident" in line for line in seen), printed
        if netns:  # no kernel events: a zombie's /proc when the agent is first, else the rank's SDK death
            # notice (the demo's ranks serve the SDK's control socket); unknown only for a rank its
            # server had to SIGKILL (no notice)
            assert "not in the host's network namespace" in printed, printed
            assert all("[/proc while a zombie]" in line or "[its SDK's death notice]" in line
                       or "stopped with its whole server (exit status unknown)" in line for line in seen), printed
        else:
            assert all("[the kernel's exit event]" in line or "[/proc while a zombie]" in line for line in seen), printed
            assert "exit status unknown" not in printed, printed


def test_a_rank_killed_9_opens_one_incident_and_the_failing_health_check_none(spawn, python, tmp_path: Path) -> None:
    env = {**cli_env(tmp_path), "SERVEWATCH_HEALTH__INTERVAL_S": "0.5", "SERVEWATCH_HEALTH__UNHEALTHY_AFTER": "2"}
    prefix = f"life{uuid.uuid4().hex[:6]}"
    _server, info = _start_demo(spawn, python, tmp_path, prefix, env)
    err = tmp_path / "run.err"
    run = _run_cli(spawn, tmp_path, ["run", "--health-url", info["base_url"] + "/health", "--match",
                                     f"{prefix}::scheduler*", "--data-dir", "data"], err, env)
    _wait_for(err, b"watching 2 target processes", run)
    _wait_for(err, b"health: 200 OK", run)
    victim = info["scheduler_pids"][1]
    os.kill(victim, signal.SIGKILL)  # a worker SIGKILLed; the frontend reaps it and /health turns 503
    _wait_for(err, b"the same failure, no second incident", run, timeout_s=60)
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=60)
    printed = err.read_text()
    found = manifests(tmp_path / "data")
    assert [m["trigger"] for m in found] == ["exit"], printed
    assert f"pid {victim} " in found[0]["detail"] and "signal 9 (SIGKILL)" in found[0]["detail"], found[0]["detail"]
    assert "health detected" in printed and found[0]["incident_id"] in printed.split("health detected", 1)[1], printed


@pytest.mark.timeout(300)
def test_a_quick_stop_and_restart_of_the_demo_server_is_said_and_opens_no_incident(spawn, python, tmp_path: Path) -> None:
    """A deploy: the demo server stopped (Ctrl-C) and started again at once on the same port with
    new pids. Before: a health incident 30 s later, after /health was 200 again, dumping the new
    healthy ranks. Now: the stop, the new ranks and the recovery are said, no incident."""
    env = {**cli_env(tmp_path), "SERVEWATCH_HEALTH__INTERVAL_S": "0.5", "SERVEWATCH_HEALTH__UNHEALTHY_AFTER": "2"}
    prefix = f"life{uuid.uuid4().hex[:6]}"
    server, info = _start_demo(spawn, python, tmp_path, prefix, env)
    port = info["base_url"].rsplit(":", 1)[1]
    err = tmp_path / "run.err"
    run = _run_cli(spawn, tmp_path, ["run", "--health-url", info["base_url"] + "/health", "--match",
                                     f"{prefix}::scheduler*", "--data-dir", "data"], err, env)
    _wait_for(err, b"watching 2 target processes", run)
    _wait_for(err, b"health: 200 OK", run)
    os.killpg(server.pid, signal.SIGINT)
    assert server.wait(timeout=60) == 0
    ready = tmp_path / "ready-again.json"
    spawn([python, "-m", "agent.demo.server", "--tp", "2", "--port", port, "--title-prefix", prefix,
           "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _wait_for(err, b"lifecycle: server started again", run, timeout_s=200)
    deadline = time.monotonic() + 200
    while not ready.exists():  # the new server serves
        assert time.monotonic() < deadline and run.poll() is None, err.read_text()
        time.sleep(0.1)
    again = json.loads(ready.read_text())
    time.sleep(5.0)  # /health is 200 again (if it ever failed, the failure is judged by now)
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=60)
    printed = err.read_text()
    assert manifests(tmp_path / "data") == [], printed
    assert "lifecycle: server stopped: none of its watched processes runs any more" in printed, printed
    failed = [line for line in printed.splitlines() if "health detected" in line]
    assert all(line.endswith("no incident") for line in failed), printed  # healthy again, or the stopped server
    started = next(line for line in printed.splitlines() if "lifecycle: server started again" in line)
    assert all(f"pid {pid} " in started for pid in again["scheduler_pids"]), (started, again)


def test_run_root_pid_stops_once_its_server_ended(spawn, python, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    tree = start_tree(spawn, python, tag)
    err = tmp_path / "run.err"
    run = _run_cli(spawn, tmp_path, ["run", "--root-pid", str(tree["main"]), "--data-dir", "data"], err, cli_env(tmp_path))
    _wait_for(err, b"watching 4 target processes", run)
    os.kill(tree["main"], signal.SIGTERM)  # the server stops (its children with it)
    assert run.wait(timeout=60) == 0, err.read_text()
    printed = err.read_text()
    assert f"root pid {tree['main']} " in printed and "nothing left to watch, stopping" in printed, printed
    assert "4 target exit(s) seen" in printed, printed


def test_kill_9_of_launch_leaves_no_rank_running(spawn, python, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    err = tmp_path / "launch.err"
    launch = _run_cli(spawn, tmp_path, ["launch", "--data-dir", "data", "--", python,
                                        str(Path(__file__).with_name("programs") / "server_tree.py"), tag, "--tp", "2"],
                      err, cli_env(tmp_path))
    _wait_for(err, b"watching 3 target processes", launch)
    deadline = time.monotonic() + 60
    while True:  # the ranks, once titled
        ranks = [p for p in psutil.process_iter(["cmdline"])
                 if (p.info["cmdline"] or [""])[0].startswith("sglang::scheduler") and tag in p.info["cmdline"][0]]
        if len(ranks) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(ranks) == 2, ranks
    launch.kill()  # kill -9 of servewatch: the server dies with it (PR_SET_PDEATHSIG); its ranks must too
    launch.wait(timeout=10)
    _gone, alive = psutil.wait_procs(ranks, timeout=20)
    assert not alive, f"ranks left running unwatched: {alive}"
    assert b"the launcher died; stopping the server's process group" in err.read_bytes(), err.read_text()


def test_an_oom_kill_is_named_from_the_cgroup_counter_without_the_kernel_log(tmp_path: Path) -> None:
    cgroup, why = MemoryCgroup.create(64 << 20)
    if cgroup is None:
        pytest.skip(f"no writable memory cgroup here: {why}")
    hog = "import sys; sys.stdin.readline(); held = [bytearray(8 << 20) for _ in range(64)]"
    proc = subprocess.Popen([sys.executable, "-c", hog], stdin=subprocess.PIPE)
    try:
        (cgroup.path / "cgroup.procs").write_text(str(proc.pid))
        counter = oom_counter_of(proc.pid)
        assert counter is not None and counter.path == str(cgroup.path / cgroup.counter) and counter.oom_kills == 0
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == -signal.SIGKILL  # the kernel's memory-cgroup OOM killer
        evidence = OomWatch(None).killed(proc.pid, counter)  # no kernel log: the counter alone says it
        assert evidence == f"cgroup {counter.path}: oom_kill 0->1", evidence
        assert OomWatch(None).killed(proc.pid, counter.read()) == ""  # read after the kill: nothing new
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        cgroup.remove()


def test_the_keeper_stays_quiet_when_launch_ends_in_order(spawn, python, tmp_path: Path) -> None:
    err = tmp_path / "launch.err"
    launch = _run_cli(spawn, tmp_path, ["launch", "--data-dir", "data", "--", python, "-c", "import time; time.sleep(1)"],
                      err, cli_env(tmp_path))
    assert launch.wait(timeout=60) == 0, err.read_text()
    printed = err.read_text()
    assert "launcher died" not in printed and "0 incident(s) written" in printed, printed


SUBREAPER_PROBE = """
import json, os, subprocess, sys, time
from agent.cli.launch import _reap_adopted, _set_subreaper
from agent.host.procinfo import exit_fact_of
assert _set_subreaper(True)
# a server (its own session) that starts a rank and exits without waiting for it: the rank is orphaned
server = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1); raise SystemExit(5)']);"
    " print(p.pid, flush=True)"], stdout=subprocess.PIPE, start_new_session=True)
rank = int(server.stdout.readline())
server.wait()
time.sleep(0.3)
adopted = open(f"/proc/{rank}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())
deadline = time.monotonic() + 30
while time.monotonic() < deadline and open(f"/proc/{rank}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
    time.sleep(0.05)
reaped = _reap_adopted(server.pid, server.pid)
fact = exit_fact_of(rank)
print(json.dumps({"adopted": adopted, "reaped": reaped, "gone": not os.path.exists(f"/proc/{rank}"),
                  "code": fact.exit_code if fact else None, "source": fact.source.value if fact else None}))
"""


def test_launch_as_subreaper_adopts_an_orphaned_rank_reads_its_status_and_reaps_it(python: str) -> None:
    out = subprocess.run([python, "-c", SUBREAPER_PROBE], capture_output=True, text=True, timeout=60, check=False,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"adopted": True, "reaped": 1, "gone": True, "code": 5, "source": "waitid"}, got


def test_ranks_reaped_at_once_with_no_kernel_events_are_unknown_and_their_servers_stop_is_no_incident(
        spawn, tmp_path: Path) -> None:
    """The real gloo server shape (tests/programs/rank_server.py reaps each rank the moment it
    exits) watched from a network namespace of its own (a container's: no kernel exit events):
    the ranks' statuses are unknown, the server going down with them says it was a stop."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    server, title = start_server(tmp_path, 2)
    try:
        wait_server_ready(server, 2)
        err = tmp_path / "run.err"
        run = _run_cli(spawn, tmp_path, ["run", "--match", f"{title}_TP*", "--data-dir", "data"], err,
                       cli_env(tmp_path), prefix=["unshare", "--net"])
        _wait_for(err, b"watching 2 target processes", run)
        os.killpg(server.pid, signal.SIGTERM)  # systemd stopping the whole tree
        assert server.wait(timeout=60) == 0
        time.sleep(8.0)  # the settle (5 s at most) and a margin
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=60)
    finally:
        stop_server(server)
    printed = err.read_text()
    assert manifests(tmp_path / "data") == [], printed
    seen = [line for line in printed.splitlines() if line.startswith("  pid ") and f"{title}_TP" in line]
    assert len(seen) == 2, printed
    # why it was a stop: the tree going down with its server, the status unknown (the parent reaped
    # it first) -- or, when the agent read the rank's zombie before its parent reaped it, the
    # status itself (killed by SIGTERM, stopped in order). Never a crash, never an incident.
    for line in seen:
        unknown = "exit status unknown" in line and "went down with it" in line \
            and "-> no incident: stopped with its whole server (exit status unknown)" in line
        read = "killed by SIGTERM" in line and "[/proc while a zombie]" in line \
            and ("-> no incident: stopped with its whole server" in line or "-> no incident: stopped by SIGTERM" in line)
        assert unknown or read, printed
    assert any("exit status unknown" in line for line in seen) or "[/proc while a zombie]" in printed, printed


ENGINE_SERVER = Path(__file__).with_name("programs") / "engine_server.py"


def _start_engine_server(spawn, python: str, tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], dict]:
    """tests/programs/engine_server.py: vLLM 0.32's process shape and its stop/crash order."""
    ready = tmp_path / "engine-ready.json"
    proc = spawn([python, str(ENGINE_SERVER), "--ready-file", str(ready), *args], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "engine server did not start"
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def _watch_engine_server(spawn, tmp_path: Path, info: dict) -> tuple[subprocess.Popen[bytes], Path]:
    env = {**cli_env(tmp_path), "SERVEWATCH_HEALTH__INTERVAL_S": "0.5", "SERVEWATCH_HEALTH__UNHEALTHY_AFTER": "2"}
    err = tmp_path / "run.err"
    run = _run_cli(spawn, tmp_path, ["run", "--root-pid", str(info["frontend"]), "--health-url",
                                     f"http://127.0.0.1:{info['port']}/health", "--data-dir", "data"], err, env)
    _wait_for(err, b"watching 4 target processes", run)
    _wait_for(err, b"health: 200 OK", run)
    return run, err


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_server_that_kills_its_engine_before_it_closes_its_port_stopped_in_order(spawn, python, tmp_path: Path,
                                                                                   how: int) -> None:
    """vLLM 0.32's stop order on a loaded machine: the frontend SIGKILLs the engine's workers and
    the engine while its port still listens, closes the port 3 s later, exits 0. The engine went
    down as a whole while its server still served, and the server then stopped in order: a stop,
    not a crash (before: "an exit while its server still serves its port is a failure at once")."""
    server, info = _start_engine_server(spawn, python, tmp_path, "--tp", "2", "--close-delay-s", "3")
    run, err = _watch_engine_server(spawn, tmp_path, info)
    os.kill(server.pid, how)
    assert server.wait(timeout=60) == 0
    assert run.wait(timeout=90) == 0, err.read_text()  # --root-pid: it stops once every exit is handled
    printed = err.read_text()
    assert manifests(tmp_path / "data") == [], printed
    seen = [line for line in printed.splitlines() if line.startswith("  pid ")]
    assert len(seen) == 4 and all("-> no incident" in line for line in seen), printed
    engine_line = next(line for line in seen if line.startswith(f"  pid {info['engine']} "))
    assert "killed by SIGKILL" in engine_line and "took its engine down" in engine_line, printed


@pytest.mark.parametrize("victim", ["worker", "engine"])
def test_a_process_killed_while_its_server_serves_is_one_incident_though_the_server_then_exits_0(
        spawn, python, tmp_path: Path, victim: str) -> None:
    """The crash side of the same shape: a worker (or the engine alone) SIGKILLed by someone else;
    the frontend reacts within 0.3 s (port first, then the engine), and exits 0 like a stop. The
    rest of the engine was still running when the port closed: one incident, for the victim."""
    server, info = _start_engine_server(spawn, python, tmp_path, "--tp", "2", "--react-delay-s", "0.3")
    run, err = _watch_engine_server(spawn, tmp_path, info)
    pid = info["workers"][1] if victim == "worker" else info["engine"]
    os.kill(pid, signal.SIGKILL)
    assert server.wait(timeout=60) == 0
    assert run.wait(timeout=90) == 0, err.read_text()
    printed = err.read_text()
    found = manifests(tmp_path / "data")
    assert [m["trigger"] for m in found] == ["exit"], printed
    assert found[0]["detail"].startswith(f"pid {pid} ") and "signal 9 (SIGKILL)" in found[0]["detail"], found[0]["detail"]
    verdict = found[0].get("verdict") or {}
    assert pid in verdict.get("culprit_pids", []), verdict
    others = [line for line in printed.splitlines() if line.startswith("  pid ") and not line.startswith(f"  pid {pid} ")]
    assert len(others) == 3 and all("-> no incident" in line or "-> no new incident" in line for line in others), printed


def test_an_engine_left_alive_after_its_api_server_was_killed_is_named_with_its_memory(spawn, python,
                                                                                        tmp_path: Path) -> None:
    """vLLM #55510's shape: the API server SIGKILLed, EngineCore and its workers live on under pid
    1 holding memory (the next start OOMs). Before: `run --root-pid` said nothing of them."""
    server, info = _start_engine_server(spawn, python, tmp_path, "--tp", "2")
    run, err = _watch_engine_server(spawn, tmp_path, info)
    os.kill(info["frontend"], signal.SIGKILL)
    assert server.wait(timeout=60) == -signal.SIGKILL
    _wait_for(err, b"still alive after it ended", run, timeout_s=60)
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=60)
    printed = err.read_text()
    line = next(line for line in printed.splitlines() if "lifecycle: 3 process(es) of pid" in line)
    assert line.split("lifecycle: ")[1].startswith(f"3 process(es) of pid {info['frontend']} "), line
    assert "signal 9 (SIGKILL)" in line and " under pid " in line and " holding " in line, line
    assert all(f"pid {pid} " in line for pid in (info["engine"], *info["workers"])), line
    frontend = next(row for row in printed.splitlines() if row.startswith(f"  pid {info['frontend']} "))
    assert "3 process(es)" in frontend and "still alive" in frontend, printed
    # still its server's processes: still targets, and the API server's exit incident holds them
    assert f"pid {info['engine']} 'VLLM::EngineCore' outlived its root pid ({info['frontend']} ended)" in printed, printed
    found = manifests(tmp_path / "data")
    assert [m["trigger"] for m in found] == ["exit"], printed
    assert {info["engine"], *info["workers"]} <= {t["pid"] for t in found[0]["targets"]}, found[0]["targets"]
    assert "before any rank started" not in printed, printed


def test_run_root_pid_stops_soon_after_its_servers_whole_tree_ended_under_a_shell_that_lives_on(
        spawn, python, tmp_path: Path) -> None:
    """The server started from a shell script that goes on after it (``vllm serve ...; sleep``):
    its API server SIGKILLed, then its engine and workers. Before: every exit after the API
    server's waited for the shell above it to end (60 s) before it was reported, and the agent
    ran on for as long. Now it stops within seconds, saying why, exit 0."""
    ready = tmp_path / "engine-ready.json"
    spawn(["/bin/sh", "-c", '"$0" "$@"; sleep 100', python, str(ENGINE_SERVER), "--ready-file", str(ready),
           "--tp", "2"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline, "engine server did not start"
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    run, err = _watch_engine_server(spawn, tmp_path, info)
    os.kill(info["frontend"], signal.SIGKILL)
    time.sleep(1.0)
    for pid in (*info["workers"], info["engine"]):  # the operator cleans up what was left
        os.kill(pid, signal.SIGKILL)
    ended = time.monotonic()
    assert run.wait(timeout=90) == 0, err.read_text()
    took_s = time.monotonic() - ended
    printed = err.read_text()
    assert f"root pid {info['frontend']} " in printed and "nothing left to watch, stopping" in printed, printed
    assert took_s < 30, (took_s, printed)


CRASH_LOOP_SUPERVISOR = """
import subprocess, sys, time
engine = ("import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); time.sleep(2.5);"
          " raise SystemExit('engine: CUDA out of memory at start')")
deadline = time.monotonic() + 90
while time.monotonic() < deadline:  # systemd's Restart=always, RestartSec=0.5
    subprocess.run([sys.executable, "-c", engine, sys.argv[1]], stderr=subprocess.DEVNULL)
    time.sleep(0.5)
"""


def test_a_supervisor_restarting_an_engine_that_exits_1_is_one_crash_loop_incident(spawn, python,
                                                                                   tmp_path: Path) -> None:
    """Each engine exits 1 after 2.5 s and is started again: `run --match` finds each new one
    and sees it exit. Before: one incident for the first exit, the others only suppressed by the
    cooldown; the loop was never named. Now one incident counts them, naming the status."""
    title = f"VLLM::EngineCore_{uuid.uuid4().hex[:6]}"
    spawn([python, "-c", CRASH_LOOP_SUPERVISOR, title])
    err = tmp_path / "run.err"
    run = _run_cli(spawn, tmp_path, ["run", "--match", title, "--data-dir", "data"], err, cli_env(tmp_path))
    _wait_for(err, b"lifecycle: crash loop:", run, timeout_s=90)
    deadline = time.monotonic() + 30
    while True:  # one more exit, only counted
        found = manifests(tmp_path / "data")
        if found and found[0].get("crash_loop_exits", 0) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=60)
    printed = err.read_text()
    found = manifests(tmp_path / "data")
    assert [m["trigger"] for m in found] == ["exit"], printed
    assert found[0]["crash_loop_exits"] >= 4, found[0]
    (loop,) = [line for line in found[0]["lifecycle"] if line.startswith("crash loop:")]
    assert f"{title!r} exited 3 times" in loop and "(exit code 1," in loop, loop
    assert "suppressed by cooldown" not in printed, printed
