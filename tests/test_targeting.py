"""Targeting on process trees shaped like real SGLang servers: ``--root-pid`` ∩ ``--match``,
``launch --match``, and the warnings for host-wide matches and health-only watches.

Real processes throughout: tests/programs/server_tree.py starts a main process with children
that really call setproctitle (``sglang::scheduler_TP<i>_<tag>``, ``sglang::detokenizer_<tag>``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from agent.host.targets import NO_TARGET_WARNING, discover, process_trees, spread_warning
from tests.conftest import PROGRAMS_DIR
from tests.spanfiles import file_spans

TREE = str(PROGRAMS_DIR / "server_tree.py")
CLI = [sys.executable, "-m", "agent.cli.app"]


def start_tree(spawn, python: str, tag: str, *extra: str) -> dict[str, int]:
    """Start server_tree.py (its own process group) and return ``{"main": pid, role: pid, ...}``."""
    proc = spawn([python, TREE, tag, "--detokenizer", "--max-lifetime-s", "90", *extra], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, "server tree did not start"
    words = proc.stdout.readline().decode().split()
    assert words[:2] == ["ready", str(proc.pid)], words
    return {"main": proc.pid, **{k: int(v) for k, v in (w.split("=") for w in words[2:])}}


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), SERVEWATCH_COREDUMP__ENABLED="false")
    return env


def manifests(data: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(data.glob("*/*/manifest.json"))]


def test_root_pid_and_match_is_the_intersection(spawn, python) -> None:
    tag = uuid.uuid4().hex[:8]
    a = start_tree(spawn, python, tag)
    b = start_tree(spawn, python, tag)
    glob = f"sglang::scheduler*_{tag}"

    mine = discover(root_pids=[a["main"]], title_globs=[glob])
    assert [t.pid for t in mine] == sorted([a["scheduler_TP0"], a["scheduler_TP1"]])  # not a's detokenizer, not b's
    assert {t.title for t in mine} == {f"sglang::scheduler_TP0_{tag}", f"sglang::scheduler_TP1_{tag}"}
    # the whole tree without a glob, the host with a glob alone
    assert {t.pid for t in discover(root_pids=[a["main"]])} == set(a.values())
    host_wide = discover(title_globs=[glob])
    assert {t.pid for t in host_wide} == {a["scheduler_TP0"], a["scheduler_TP1"], b["scheduler_TP0"], b["scheduler_TP1"]}

    trees = process_trees(host_wide)
    assert [t.pgid for t in trees] == sorted([a["main"], b["main"]])
    warning = spread_warning(host_wide, title_globs=[glob], root_pids=[])
    assert warning is not None and "2 process trees" in warning
    assert f"group {a['main']} " in warning and f"group {b['main']} " in warning
    assert spread_warning(mine, title_globs=[glob], root_pids=[a["main"]]) is None
    assert spread_warning(discover(root_pids=[a["main"]], title_globs=[glob]), title_globs=[glob], root_pids=[]) is None


def test_dump_with_root_pid_and_match_dumps_only_that_servers_schedulers(spawn, python, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    a = start_tree(spawn, python, tag)
    b = start_tree(spawn, python, tag)
    glob = f"sglang::scheduler*_{tag}"

    r = subprocess.run(
        [*CLI, "dump", "--root-pid", str(a["main"]), "--match", glob, "--data-dir", "data"],
        capture_output=True, text=True, timeout=110, cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "process trees" not in r.stderr
    (manifest,) = manifests(tmp_path / "data")
    wanted = sorted([a["scheduler_TP0"], a["scheduler_TP1"]])
    assert [t["pid"] for t in manifest["targets"]] == wanted
    assert sorted(x["pid"] for x in manifest["actions"] if x["action"] == "pyspy.dump") == wanted
    assert all(x["outcome"] == "ok" for x in manifest["actions"] if x["action"] == "pyspy.dump")
    pids = sorted(s["attributes"]["process.pid"] for s in file_spans(tmp_path / "data") if s["name"] == "pyspy.dump")
    assert pids == wanted  # nothing of b's, nor a's detokenizer
    assert not {b["scheduler_TP0"], b["scheduler_TP1"], a["detokenizer"]} & {t["pid"] for t in manifest["targets"]}

    # host-wide: both servers' schedulers, and ONE warning naming both trees
    r = subprocess.run(
        [*CLI, "dump", "--match", glob, "--data-dir", "data2"],
        capture_output=True, text=True, timeout=110, cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "process trees" in line]
    assert len(warnings) == 1, r.stderr
    assert f"group {a['main']} " in warnings[0] and f"group {b['main']} " in warnings[0]
    (manifest,) = manifests(tmp_path / "data2")
    assert len(manifest["targets"]) == 4


def test_launch_match_filters_the_launched_tree(python, tmp_path: Path) -> None:
    """`launch --match` acts on the launched server's schedulers only: its detokenizer's exit
    opens no incident, a scheduler's exit does, and only schedulers are dumped."""
    tag = uuid.uuid4().hex[:8]
    argv = [
        *CLI, "launch", "--match", f"sglang::scheduler*_{tag}", "--data-dir", "data", "--",
        python, TREE, tag, "--detokenizer", "--max-lifetime-s", "90",
        "--exit", "detokenizer=3@1", "--exit", "scheduler_TP1=7@4",
    ]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "launched server did not start"
        words = proc.stdout.readline().decode().split()
        roles = {k: int(v) for k, v in (w.split("=") for w in words[2:])}
        deadline = time.monotonic() + 90
        while not manifests(tmp_path / "data") and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # room for a (wrong) second incident to show up
        found = manifests(tmp_path / "data")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    assert len(found) == 1, err
    (manifest,) = found
    assert manifest["trigger"] == "exit" and f"pid {roles['scheduler_TP1']} " in manifest["detail"], manifest["detail"]
    acted = {x["pid"] for x in manifest["actions"]}
    assert roles["scheduler_TP0"] in acted
    assert not acted & {roles["detokenizer"], int(words[1])}  # neither the detokenizer nor the main process
    tp0 = [x for x in manifest["actions"] if x["pid"] == roles["scheduler_TP0"] and x["action"] == "pyspy.dump"]
    assert [x["outcome"] for x in tp0] == ["ok"]
    # the rank that died is in the incident as dead, with the exit status read from its zombie
    assert "(exit code 7)" in manifest["detail"]
    (dead,) = [x for x in manifest["actions"] if x["pid"] == roles["scheduler_TP1"] and x["action"] == "pyspy.dump"]
    assert dead["action"] == "pyspy.dump" and dead["outcome"] == "dead", dead
    assert dead["attributes"]["servewatch.target.state"] == "zombie"
    assert dead["attributes"]["process.exit.code"] == 7
    assert "is dead (exit code 7; zombie" in dead["detail"]
    (span,) = [x for x in file_spans(tmp_path / "data")
               if x["name"] == "pyspy.dump" and x["attributes"]["process.pid"] == roles["scheduler_TP1"]]
    assert span["attributes"]["servewatch.outcome"] == "dead" and span["attributes"]["process.exit.code"] == 7


def test_health_url_without_a_target_warns_once_at_start(tmp_path: Path) -> None:
    r = subprocess.run(
        [*CLI, "run", "--health-url", "http://127.0.0.1:9/health", "--duration", "2", "--data-dir", "data"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(NO_TARGET_WARNING) == 1, r.stderr


def test_host_wide_match_reports_a_zombie_sibling_of_the_live_ranks_as_dead(spawn, python, tmp_path: Path) -> None:
    # no --root-pid: the dead rank is found beside its live siblings, under their parent
    tag = uuid.uuid4().hex[:8]
    a = start_tree(spawn, python, tag, "--exit", "scheduler_TP1=9@0.5")
    deadline = time.monotonic() + 30
    while psutil.Process(a["scheduler_TP1"]).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    r = subprocess.run(
        [*CLI, "dump", "--match", f"sglang::scheduler*_{tag}", "--data-dir", "data"],
        capture_output=True, text=True, timeout=110, cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 0, r.stderr
    (manifest,) = manifests(tmp_path / "data")
    dumps = {x["pid"]: x for x in manifest["actions"] if x["action"] == "pyspy.dump"}
    assert set(dumps) == {a["scheduler_TP0"], a["scheduler_TP1"]}
    dead = dumps[a["scheduler_TP1"]]
    assert dead["outcome"] == "dead" and dead["attributes"]["process.exit.code"] == 9, dead


def test_one_shot_dump_reports_a_zombie_rank_of_the_tree_as_dead(spawn, python, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    a = start_tree(spawn, python, tag, "--exit", "scheduler_TP1=7@0.5")
    deadline = time.monotonic() + 30
    while psutil.Process(a["scheduler_TP1"]).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    r = subprocess.run(
        [*CLI, "dump", "--root-pid", str(a["main"]), "--match", f"sglang::scheduler*_{tag}", "--data-dir", "data"],
        capture_output=True, text=True, timeout=110, cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 0, r.stderr
    (manifest,) = manifests(tmp_path / "data")
    dumps = {x["pid"]: x for x in manifest["actions"] if x["action"] == "pyspy.dump"}
    assert set(dumps) == {a["scheduler_TP0"], a["scheduler_TP1"]}  # the detokenizer is not matched
    assert dumps[a["scheduler_TP0"]]["outcome"] == "ok"
    dead = dumps[a["scheduler_TP1"]]
    assert dead["outcome"] == "dead" and dead["attributes"]["process.exit.code"] == 7, dead
    assert dead["attributes"]["servewatch.target.state"] == "zombie"
    (span,) = [s for s in file_spans(tmp_path / "data")
               if s["name"] == "pyspy.dump" and s["attributes"]["process.pid"] == a["scheduler_TP1"]]
    assert span["attributes"]["servewatch.outcome"] == "dead"
    assert "Dead: 1" in r.stdout


def test_a_tree_whose_leader_is_gone_is_named_by_what_is_known(spawn, python) -> None:
    from agent.host.targets import ProcessTree, Target

    child = spawn([python, "-c", "import time; time.sleep(60)"])  # its own group: pgid == its pid
    leaderless = ProcessTree(pgid=child.pid, leader_title="", pids=(child.pid + 1,), member_title="sglang::scheduler_TP0")
    assert leaderless.describe() == f"group {child.pid} (leader gone or unreadable; pid {child.pid + 1} 'sglang::scheduler_TP0') (pids {child.pid + 1})"
    unknown = ProcessTree(pgid=7, leader_title="", pids=(8,))
    assert unknown.describe() == "group 7 (leader gone or unreadable) (pids 8)"
    (tree,) = process_trees([Target(pid=child.pid, title="worker")])
    assert "?" not in tree.describe() and tree.leader_title  # a live leader is named by its title
