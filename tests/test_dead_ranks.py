"""Dead ranks are evidence only of the incident they belong to: a host-wide ``--match`` never adds
another server's dead processes, nor a rank that stopped in order long before (real process
trees from tests/programs/server_tree.py, whose main process never reaps, so dead ranks stay
zombies; a real ``servewatch run``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil

import agent.incidents.evidence as evidence_mod
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings
from tests.test_targeting import CLI, cli_env, manifests, start_tree


def _wait_zombie(*pids: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"pid {pid} did not exit")


#: The watchdog timeout of the dead-rank window test: the window is twice it (margin 0), long
#: enough for the first checks after the orderly stop (< 1 s loaded), short enough to wait out.
STALL_S = 2.5


def test_an_incident_takes_dead_ranks_of_its_own_job_and_orderly_exits_only_while_recent(
    spawn, python, tmp_path: Path, monkeypatch
) -> None:
    tag = uuid.uuid4().hex[:8]
    a = start_tree(spawn, python, tag, "--tp", "3")
    b = start_tree(spawn, python, tag)
    a_ranks = [a[f"scheduler_TP{i}"] for i in range(3)]
    settings = load_settings(
        {"data_dir": tmp_path / "data", "target": {"match": [f"sglang::scheduler*_{tag}"]}, "watchdog": {"timeout_s": STALL_S}}
    )
    monkeypatch.setattr(evidence_mod, "DEAD_RANK_MARGIN_S", 0.0)  # window: 2 x STALL_S
    agent = Agent(settings)
    assert {t.pid for t in agent.discover()} == {*a_ranks, b["scheduler_TP0"], b["scheduler_TP1"]}

    os.kill(b["scheduler_TP0"], signal.SIGTERM)  # another server: an orderly stop and a crash
    os.kill(b["scheduler_TP1"], signal.SIGKILL)
    os.kill(a["scheduler_TP2"], signal.SIGTERM)  # this server: an orderly stop, now
    _wait_zombie(b["scheduler_TP0"], b["scheduler_TP1"], a["scheduler_TP2"])
    # the stall of a's rank 0: a's dead rank is evidence, b's are not
    assert {t.pid for t in agent.incident_targets(a["scheduler_TP0"])} == set(a_ranks)

    time.sleep(2 * STALL_S + 1.0)  # past the window
    os.kill(a["scheduler_TP1"], signal.SIGKILL)  # a crash in a's job
    _wait_zombie(a["scheduler_TP1"])
    # the orderly stop long before is not a dead rank of this incident; the crash is
    assert {t.pid for t in agent.incident_targets(a["scheduler_TP0"])} == {a["scheduler_TP0"], a["scheduler_TP1"]}
    # without a subject (health, manual): the jobs with a live target; b has none left
    assert {t.pid for t in agent.incident_targets()} == {a["scheduler_TP0"], a["scheduler_TP1"]}
    # the exit of b's rank opens b's incident: b's dead ranks, none of a's
    assert {t.pid for t in agent.incident_targets(b["scheduler_TP1"])} == {
        a["scheduler_TP0"], b["scheduler_TP1"]  # a's live rank is still matched; b's TP0 stopped in order long ago
    }


def test_run_with_a_host_wide_match_names_no_dead_process_of_another_server(spawn, python, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    mine = start_tree(spawn, python, tag)
    other = start_tree(spawn, python, tag)
    err = tmp_path / "run.err"
    with err.open("wb") as err_fh:
        run = spawn(
            [*CLI, "run", "--match", f"sglang::scheduler*_{tag}", "--duration", "90", "--data-dir", "data"],
            stdout=subprocess.PIPE, stderr=err_fh, cwd=tmp_path, env=cli_env(tmp_path),
        )
    deadline = time.monotonic() + 60
    while b"watching 4 target processes" not in err.read_bytes() and time.monotonic() < deadline:
        assert run.poll() is None, err.read_text()
        time.sleep(0.1)
    assert b"watching 4 target processes" in err.read_bytes(), err.read_text()

    os.kill(other["scheduler_TP0"], signal.SIGTERM)  # the other session stops its server in order
    os.kill(other["scheduler_TP1"], signal.SIGTERM)
    _wait_zombie(other["scheduler_TP0"], other["scheduler_TP1"])
    time.sleep(3.0)  # the agent sees them gone (no incident: stopped by SIGTERM)

    os.kill(mine["scheduler_TP1"], signal.SIGKILL)  # my rank crashes
    deadline = time.monotonic() + 60
    while not manifests(tmp_path / "data") and time.monotonic() < deadline:
        time.sleep(0.2)
    deadline = time.monotonic() + 60
    while (not manifests(tmp_path / "data") or manifests(tmp_path / "data")[0]["state"] == "open") and time.monotonic() < deadline:
        time.sleep(0.2)
    run.send_signal(signal.SIGINT)
    out, _ = run.communicate(timeout=60)
    (manifest,) = manifests(tmp_path / "data")
    dumps = {x["pid"]: x["outcome"] for x in manifest["actions"] if x["action"] == "pyspy.dump"}
    assert dumps == {mine["scheduler_TP0"]: "ok", mine["scheduler_TP1"]: "dead"}, (dumps, other)
    printed = out.decode() + err.read_text()
    assert "Processes: 2 Dead: 1" in printed, printed
