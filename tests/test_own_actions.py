"""Nothing self-inflicted (issue 31): what servewatch itself does to a server (a profile, a
blocking py-spy stop, hard mode's signal) is recorded (:mod:`agent.host.ownactions`) and read by the
rules: a profile window pauses that server's stall rule and re-arms it with a fresh clock, our own
py-spy's ptrace stop is never a process "stopped (SIGSTOP or a debugger)", and a health failure
after our own ``--hard`` signal joins the incident that sent it.

The record's own rules (trust, expiry, what a command run alone leaves) are checked on real files
and real processes; the rules that read it on the real demo server, the real ``servewatch profile``
and a real py-spy."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import anyio
import httpx
import pytest

from agent.host.ownactions import OwnAction, OwnActionLog, local_actions, stopped_by_us
from tests.demo.hang import hang_a_watched_rank, hung_request

# -- the record ---------------------------------------------------------------------------------


def test_an_action_is_seen_by_another_process_and_ends_with_its_window(tmp_path: Path) -> None:
    (tmp_path / "h").mkdir()  # an agent runs on this data dir
    code = (
        "import sys, time; from agent.host.ownactions import OwnActionLog\n"
        f"log = OwnActionLog({str(tmp_path)!r}, 'h')\n"
        f"with log.window('profile', pid={os.getpid()}, bound_s=60, detail='2 step(s), sdk'):\n"
        "    print('begun', flush=True); sys.stdin.readline()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "begun"
        [action] = OwnActionLog(tmp_path, "h").files()
        assert action.kind == "profile" and action.pid == os.getpid() and action.by_pid == child.pid
        assert action.pgid == os.getpgid(os.getpid())
        assert 59 <= action.until_unix_s - action.started_unix_s <= 61
        assert action.describe().startswith(f"servewatch profile running (pid {child.pid}; since ")
        folder = tmp_path / "h" / "own-actions"
        [path] = folder.iterdir()
        assert (os.stat(folder).st_mode & 0o777, os.stat(path).st_mode & 0o777) == (0o700, 0o600)
        child.communicate("\n", timeout=30)
        assert child.returncode == 0
        assert OwnActionLog(tmp_path, "h").files() == []
        assert list(folder.iterdir()) == []
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=10)


def test_a_command_run_alone_leaves_nothing_and_keeps_its_action_in_memory(tmp_path: Path) -> None:
    log = OwnActionLog(tmp_path / "data", "h")  # no agent there: nobody reads a file

    def mine(actions: list[OwnAction]) -> list[str]:
        return [a.kind for a in actions if a.pid == os.getpid() and a.tracer_pid == 1]

    with log.window("pyspy_stop", pid=os.getpid(), tracer_pid=1, bound_s=10):
        assert not (tmp_path / "data").exists()
        assert mine(log.active()) == ["pyspy_stop"] and log.files() == []
        assert mine(local_actions()) == ["pyspy_stop"]
    assert mine(log.active()) == [] and mine(local_actions()) == []


def test_files_a_watched_process_could_write_or_that_expired_are_not_believed(tmp_path: Path) -> None:
    folder = tmp_path / "h" / "own-actions"
    folder.mkdir(parents=True, mode=0o700)
    now = time.time()
    doc = {"kind": "profile", "pid": 4242, "by_pid": 1, "started_unix_s": now, "until_unix_s": now + 60}
    (folder / "writable.json").write_text(json.dumps(doc))
    os.chmod(folder / "writable.json", 0o622)  # anyone in the group may write it
    (tmp_path / "elsewhere.json").write_text(json.dumps(doc))
    os.symlink(tmp_path / "elsewhere.json", folder / "link.json")  # never followed
    (folder / "expired.json").write_text(json.dumps({**doc, "until_unix_s": now - 1}))
    (folder / "huge.json").write_text(json.dumps({**doc, "detail": "x" * 10_000}))
    (folder / "garbage.json").write_text("{not json")
    (folder / "forever.json").write_text(json.dumps({**doc, "until_unix_s": now + 10 * 86400}))  # would pause a rule for good
    (folder / "nan.json").write_text(json.dumps({**doc, "started_unix_s": float("nan")}))
    for name in ("expired.json", "huge.json", "garbage.json", "forever.json", "nan.json"):
        os.chmod(folder / name, 0o600)
    assert OwnActionLog(tmp_path, "h").files() == []
    (folder / "good.json").write_text(json.dumps(doc))
    os.chmod(folder / "good.json", 0o600)
    [good] = OwnActionLog(tmp_path, "h").files()
    assert good.pid == 4242
    os.chmod(folder, 0o777)  # a folder anyone may write to: nothing in it is ours
    try:
        assert OwnActionLog(tmp_path, "h").files() == []
    finally:
        os.chmod(folder, 0o700)
    # the next writer removes what a killed writer left once it expired
    OwnActionLog(tmp_path, "h").end(OwnActionLog(tmp_path, "h").begin("profile", pid=1, bound_s=5))
    assert not (folder / "expired.json").exists()


# -- our own py-spy's stop is not "stopped (SIGSTOP or a debugger)" ------------------------------

_THREADS_PROGRAM = """
import sys, threading, time
def spin():
    while True:
        time.sleep(0.0005)
for _ in range(int(sys.argv[1])):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(120)
"""


def _pyspy() -> str | None:
    from agent.early import default_executable

    return default_executable()


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2]


@pytest.fixture
def many_threads() -> Iterator[subprocess.Popen[str]]:
    """A real Python process with 400 threads (py-spy stops each one while it dumps)."""
    proc = subprocess.Popen([sys.executable, "-c", _THREADS_PROGRAM, "400"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.slow
async def test_a_real_pyspy_dump_of_many_threads_is_never_a_stop_of_the_process(
    tmp_path: Path, many_threads: subprocess.Popen[str]
) -> None:
    """The real py-spy actor dumps a real 400-thread process again and again while another
    thread reads its ``/proc`` state as the verdict does: each time the dump holds it in a ptrace
    stop (state ``t``), the stop is ours, by the dump the actor recorded in the data dir (read
    from the file alone, as another servewatch process would) and by the judge's own reading; a
    real SIGSTOP is still a stop."""
    if _pyspy() is None:
        pytest.skip("py-spy not installed")
    import threading

    from agent.actors.config import PySpyConfig
    from agent.actors.pyspy import PySpyActor
    from agent.host.targets import target_of
    from agent.model.events import IncidentOpened
    from agent.verdict.judge import _stopped

    (tmp_path / "h").mkdir()
    target = target_of(many_threads.pid)
    assert target is not None
    actor = PySpyActor(PySpyConfig(native=False))
    actor.own_actions = OwnActionLog(tmp_path, "h")
    other_process = OwnActionLog(tmp_path, "h")  # its files only: what another servewatch reads
    judge_view = OwnActionLog(tmp_path, "h")
    caught: list[tuple[bool, bool]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if _state(target.pid) == "t":
                from_files = other_process.files()
                ours_by_file = stopped_by_us(target.pid, from_files)
                judged_stopped = bool(_stopped([target], judge_view))
                if _state(target.pid) == "t":  # still in the same stop: the reading counts
                    caught.append((ours_by_file, judged_stopped))
            time.sleep(0.0005)

    opened = IncidentOpened(incident_id="inc-own", trigger="manual")
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, sample)
        try:
            for i in range(8):
                result = await actor.act(opened, target, timeout_s=30, artifact_dir=tmp_path / "bundle" / str(i))
                assert result.outcome.value == "ok", result.detail
                assert "SIGSTOP" not in result.detail
                if len(caught) >= 5:
                    break
        finally:
            done.set()  # the sampling thread ends, whatever happened
    assert caught, "no dump caught the process in its ptrace stop"
    assert all(c[0] for c in caught), caught
    assert not any(c[1] for c in caught), caught
    assert not list((tmp_path / "h" / "own-actions").iterdir())  # each dump's record ended with it
    # and a real SIGSTOP is still a stop
    os.kill(target.pid, signal.SIGSTOP)
    for _ in range(200):
        if _state(target.pid) == "T":
            break
        await anyio.sleep(0.01)
    assert not stopped_by_us(target.pid)
    assert _stopped([target], judge_view) == frozenset({target.pid})
    os.kill(target.pid, signal.SIGCONT)


@pytest.mark.slow
def test_the_early_pyspy_of_servewatch_dump_is_never_a_stop_of_the_process(
    tmp_path: Path, many_threads: subprocess.Popen[str]
) -> None:
    """``servewatch dump`` starts py-spy before its own imports (:mod:`agent.early`); while that
    real run holds the real 400-thread target in its ptrace stop, the judge's reading never
    calls the target stopped (1 run in 4 did on a 1,000-thread target)."""
    if _pyspy() is None:
        pytest.skip("py-spy not installed")
    from agent import early
    from agent.host.targets import target_of
    from agent.verdict.judge import _stopped

    target = target_of(many_threads.pid)
    assert target is not None
    judge_view = OwnActionLog(tmp_path, "h")
    caught: list[bool] = []
    try:
        for _ in range(8):
            (run,) = early.start(["dump", "--pid", str(target.pid)])
            while run.process.poll() is None:
                if _state(target.pid) == "t":
                    judged = bool(_stopped([target], judge_view))
                    if _state(target.pid) == "t":
                        caught.append(judged)
                time.sleep(0.0005)
            early.discard_pid(target.pid)
            if len(caught) >= 5:
                break
    finally:
        early.discard_all()
    assert caught, "no early run caught the process in its ptrace stop"
    assert not any(caught), caught


# -- the rules, on the real demo server --------------------------------------------------------

from agent.demo import TORCH_MISSING_MESSAGE, torch_available

needs_torch = pytest.mark.skipif(not torch_available(), reason=TORCH_MISSING_MESSAGE)


async def _load(base_url: str, stop: anyio.Event) -> None:
    from agent.demo.client import agenerate

    while not stop.is_set():
        try:
            await agenerate(base_url, "keep the ranks busy", 2, timeout_s=120.0)
        except httpx.HTTPError:
            await anyio.sleep(0.2)


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_servewatch_profile_pauses_the_stall_rule_and_the_hang_after_it_opens_an_incident(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The real ``servewatch profile --pid`` of a rank of the real demo server, while a running
    agent watches it: the server takes no step for longer than the stall timeout during the
    profile (as torch's profiler start does: 10-28 s on a loaded host; here a hang of 7 s) and no
    incident opens; the pause is said in one log line and on the status board; once the profile
    ended, the genuine hang opens the stall incident, ``timeout_s`` after the window at the
    earliest (a fresh clock), never suppressed by an incident of our own doing."""
    from agent.demo.client import DemoServer, agenerate, ainject_hang
    from agent.incidents.manager import IncidentRecord
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings

    caplog.set_level(logging.WARNING, logger="servewatch.watchdog")
    records: list[IncidentRecord] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_HOST_NAME="node-a", SERVEWATCH_PROFILER__FIND_TIMEOUT_S="5", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    if os.environ.get("SERVEWATCH_SHM_DIR"):
        env["SERVEWATCH_SHM_DIR"] = os.environ["SERVEWATCH_SHM_DIR"]
    timeout_s = 3.0
    profile: subprocess.Popen[str] | None = None
    try:
        with anyio.fail_after(280):
            async with DemoServer(tp=1) as server:
                [rank] = server.scheduler_pids
                settings = load_settings({
                    "data_dir": tmp_path, "host_name": "node-a",
                    "target": {"root_pid": server.pid, "match": ["demo::scheduler*"]},
                    "watchdog": {"timeout_s": timeout_s, "poll_interval_s": 0.2},
                    "pyspy": {"enabled": False},
                })
                agent = Agent(settings, on_incident=records.append)
                async with anyio.create_task_group() as tg:
                    await tg.start(agent.run)
                    await agenerate(server.base_url, "warm-up", 2)
                    while rank not in set(agent.watched_step_pids):
                        await anyio.sleep(0.05)
                    stop_load = anyio.Event()
                    tg.start_soon(_load, server.base_url, stop_load)
                    profile = await anyio.to_thread.run_sync(partial(
                        subprocess.Popen,
                        [sys.executable, "-m", "agent.cli.app", "profile", "--pid", str(rank), "--steps", "3", "--activities", "CPU",
                         "--timeout", "90", "--out", str(tmp_path / "prof"), "--data-dir", str(tmp_path)],
                        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    ))
                    windows = tmp_path / "node-a" / "own-actions"
                    while not (windows.is_dir() and any(windows.iterdir())):
                        assert profile.poll() is None, profile.communicate()
                        await anyio.sleep(0.05)
                    # the server takes no step for more than the stall timeout while it is profiled
                    await ainject_hang(server.base_url, tp_rank=0, seconds=2.5 * timeout_s)
                    status_line = ""
                    while profile.poll() is None:
                        try:
                            status = json.loads((tmp_path / "node-a" / "status.json").read_text())
                        except (OSError, ValueError):
                            status = {}
                        status_line = status_line or next(
                            (w.get("reason", "") for w in status.get("watchers", []) if w.get("name") == f"stall pid {rank}"
                             and "paused" in w.get("reason", "")), "")
                        await anyio.sleep(0.2)
                    _, err = await anyio.to_thread.run_sync(partial(profile.communicate, timeout=30))
                    assert profile.returncode == 0, err
                    profile_end = time.time()
                    assert not records and agent.incidents.current is None, "an incident of our own profile's doing"
                    assert status_line.startswith(f"stall rule paused for pid {rank}: servewatch profile running (pid {profile.pid}; since ")
                    paused = [r.getMessage() for r in caplog.records if "stall rule paused" in r.getMessage()]
                    assert len(paused) == 1 and "until at most" in paused[0], paused
                    # the genuine hang afterwards: an incident, on a fresh clock
                    while any(windows.iterdir()):
                        await anyio.sleep(0.05)
                    stop_load.set()
                    await ainject_hang(server.base_url, tp_rank=0)
                    tg.start_soon(hung_request, server.base_url)
                    while not records:
                        await anyio.sleep(0.1)
                    agent.stop()
                    tg.cancel_scope.cancel("the hang's incident is in")
    finally:
        if profile is not None and profile.poll() is None:
            profile.kill()
            profile.communicate(timeout=10)
    [record] = records
    assert record.opened.trigger == "stall"
    assert record.opened.time_unix_nano / 1e9 >= profile_end + timeout_s - 0.5
    assert any("stall rule re-armed" in r.getMessage() for r in caplog.records)


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(200)
async def test_a_health_failure_after_our_own_hard_signal_joins_the_incident_that_sent_it(tmp_path: Path) -> None:
    """Hard mode SIGABRTs the hung rank of the real demo server (gloo TP=2); the other rank dies
    with it and the server's ``/health`` answers 503 from then on. That failure is our doing: it
    opens no health incident blaming "rank 1 exited with SIGABRT"; it joins the stall incident,
    whose manifest says "killed by servewatch --hard, incident <id>"."""
    from agent.demo.client import DemoServer
    from agent.incidents.manager import IncidentRecord
    from agent.runtime.agent import Agent
    from agent.runtime.settings import load_settings

    records: list[IncidentRecord] = []
    with anyio.fail_after(180):
        async with DemoServer(tp=2) as server:
            tp0, tp1 = server.scheduler_pids
            settings = load_settings({
                "data_dir": tmp_path, "host_name": "node-a",
                "target": {"root_pid": server.pid, "match": ["demo::scheduler*"]},
                "watchdog": {"timeout_s": 2.0, "poll_interval_s": 0.2, "hard": True},
                "health": {"url": f"{server.base_url}/health", "interval_s": 0.5, "unhealthy_after": 2},
                "pyspy": {"enabled": False},
            })
            agent = Agent(settings, on_incident=records.append)
            async with anyio.create_task_group() as tg:
                await tg.start(agent.run)
                await hang_a_watched_rank(agent, server, tg, tp_rank=1)
                while not {tp0, tp1} <= agent.incidents.exits_handled:
                    await anyio.sleep(0.1)
                while agent.incidents.current is not None:
                    await anyio.sleep(0.1)
                [stall] = records
                # the server's /health now fails (its ranks are gone): joined, not a new incident
                while not stall.after_hard_signal:
                    assert len(records) == 1, [r.opened.detail for r in records]
                    await anyio.sleep(0.1)
                await anyio.sleep(3)  # more failed probes: still nothing new
                agent.stop()
                tg.cancel_scope.cancel("the health failure is in")
    [record] = records
    assert record.opened.trigger == "stall"
    iid = record.opened.incident_id
    [line] = record.after_hard_signal
    assert line.startswith(f"health: {server.base_url}/health failed ") and line.endswith(f": killed by servewatch --hard, incident {iid}")
    [manifest] = list((tmp_path / "node-a").glob("*/manifest.json"))
    doc = json.loads(manifest.read_text())
    assert doc["incident_id"] == iid and doc["after_hard_signal"] == [line]
