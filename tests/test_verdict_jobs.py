"""The cross-rank verdict judges one job at a time: a host-wide ``--match`` that picks the
schedulers of two servers never numbers them as one job nor blames one server's rank for the
other's stall (real process trees from tests/programs/server_tree.py)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
import uuid

from agent.host.targets import Target, discover, zombie_descendants
from agent.model.events import TargetExited, WatchdogStalled
from agent.verdict.judge import VerdictJudge, job_groups, pick_incident_verdict
from agent.verdict.rules import FrameClass, RankEvidence, decide
from tests.test_cli_conventions import _titled, sw
from tests.test_targeting import start_tree


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return False


def _await_zombie(pid: int, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until ``pid`` has exited and is left unreaped, a dead rank's shape."""
    deadline = time.monotonic() + timeout_s
    while not _zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _zombie(pid), f"pid {pid} is not a zombie after {timeout_s} s"


def test_two_servers_matched_host_wide_are_judged_as_two_jobs(spawn, python, tmp_path) -> None:
    tag = uuid.uuid4().hex[:8]
    a = start_tree(spawn, python, tag)
    b = start_tree(spawn, python, tag, "--exit", "scheduler_TP1=9@0.5")
    _await_zombie(b["scheduler_TP1"])
    glob = f"sglang::scheduler*_{tag}"
    targets = discover(title_globs=[glob]) + zombie_descendants([a["main"], b["main"]], [glob])
    assert {t.pid for t in targets} == {a["scheduler_TP0"], a["scheduler_TP1"], b["scheduler_TP0"], b["scheduler_TP1"]}

    groups = job_groups(targets)
    assert sorted(map(sorted, groups)) == sorted([sorted([a["scheduler_TP0"], a["scheduler_TP1"]]),
                                                  sorted([b["scheduler_TP0"], b["scheduler_TP1"]])])

    judge = VerdictJudge(shm_dir=tmp_path)
    # server a stalled: its verdict is a's, numbered 0..1, and b's dead rank is not blamed
    stall = WatchdogStalled(pid=a["scheduler_TP0"], forward_ct=3, stalled_for_s=5.0, timeout_s=3.0)
    v = judge._decide(targets, [], stall, {})
    assert v is not None
    assert v.ranks == (0, 1), v
    assert v.kind != "dead" and b["scheduler_TP1"] not in v.culprit_pids, v
    assert any("2 servers" in line and str(a["scheduler_TP0"]) in line for line in v.evidence), v.evidence
    # server b's rank exited: the verdict is b's, naming its rank 1 only
    exited = TargetExited(pid=b["scheduler_TP1"], exit_code=9, title=f"sglang::scheduler_TP1_{tag}")
    v = judge._decide(targets, [], exited, {})
    assert v is not None
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.ranks) == ("dead", (1,), (b["scheduler_TP1"],), (0, 1)), v


def test_the_incident_verdict_is_the_stalled_job_s_without_a_trigger_pid() -> None:
    calm = decide([RankEvidence(rank=r, pid=10 + r, frame_class=FrameClass.COMPUTE, steps_before=1, steps_after=5) for r in range(2)])
    stuck = decide([RankEvidence(rank=0, pid=20, frame_class=FrameClass.COLLECTIVE, frame="all_reduce (d.py:1)"),
                    RankEvidence(rank=1, pid=21, frame_class=FrameClass.COMPUTE, frame="forward (m.py:2)")])
    assert not calm.hung and stuck.culprit_ranks == (1,)
    v = pick_incident_verdict([([10, 11], calm), ([20, 21], stuck)], None, 2)
    assert v.culprit_pids == (21,) and v.kind == "behind"
    assert pick_incident_verdict([([10, 11], calm), ([20, 21], stuck)], 11, 2).kind == "progressing"
    assert pick_incident_verdict([([20, 21], stuck)], None, 1) == stuck


def test_targets_of_one_tree_stay_one_job() -> None:
    import os

    me = Target(pid=os.getpid())
    assert job_groups([me]) == [[os.getpid()]]
    assert job_groups([]) == []


def test_a_rank_stopped_by_sigterm_is_never_a_culprit(spawn, python, tmp_path) -> None:
    """A real rank that caught SIGTERM and exited 143 (or died of the signal) was asked to stop:
    no culprit, not hung; a real crash exit of the same rank stays ``dead``, high."""
    tag = uuid.uuid4().hex[:8]
    tree = start_tree(spawn, python, tag, "--exit", "scheduler_TP1=143@0.5")
    _await_zombie(tree["scheduler_TP1"])
    glob = f"sglang::scheduler*_{tag}"
    targets = discover(title_globs=[glob]) + zombie_descendants([tree["main"]], [glob])
    pid = tree["scheduler_TP1"]
    title = f"sglang::scheduler_TP1_{tag}"
    judge = VerdictJudge(shm_dir=tmp_path)
    for cause, how in ((TargetExited(pid=pid, exit_code=143, title=title), "SIGTERM"),
                       (TargetExited(pid=pid, signal=15, title=title), "SIGTERM"),
                       (TargetExited(pid=pid, signal=2, title=title), "SIGINT")):
        v = judge._decide(targets, [], cause, {})
        assert v is not None
        assert (v.kind, v.culprit_ranks, v.culprit_pids, v.hung, v.rule) == ("stopped", (), (), False, "stopped"), v
        assert v.reason.startswith(f"terminated by a signal: rank 1 was terminated by {how}"), v.reason
    v = judge._decide(targets, [], TargetExited(pid=pid, signal=9, title=title), {})
    assert v is not None and (v.kind, v.culprit_ranks, v.confidence) == ("dead", (1,), "high"), v
    assert v.reason.startswith("dead: rank 1 exited with SIGKILL"), v.reason
    # its title unknown (a zombie's comm is cut): no made-up rank number, named by pid
    v = judge._decide(targets, [], TargetExited(pid=pid, signal=9), {})
    assert v is not None and (v.kind, v.culprit_ranks, v.culprit_pids) == ("dead", (), (pid,)), v
    assert v.ranks == (0,), v


def test_a_rank_gone_by_sigterm_during_a_stall_is_no_culprit() -> None:
    ev = [RankEvidence(rank=0, pid=5, frame_class=FrameClass.COLLECTIVE, frame="all_reduce"),
          RankEvidence(rank=1, pid=6, alive=False, exit_code=143)]
    v = decide(ev)
    assert v.kind != "dead" and 1 not in v.culprit_ranks, v


_BUSY = """import sys, time


def inner_work():
    time.sleep(0.05)


print("ready", flush=True)
while True:
    inner_work()
"""


def test_dump_of_one_plain_process_says_where_it_is_and_blames_no_rank(spawn, python, tmp_path) -> None:
    """`servewatch dump --pid` of a plain Python loop (no rank, no collective): no culprit
    wording; a titled scheduler rank alone (TP=1) gets the rank rules, which, without a progress
    source in a one-shot dump, name no culprit."""
    script = tmp_path / "busy.py"
    script.write_text(_BUSY, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    busy = spawn([python, str(script)], stdout=subprocess.PIPE, env=env)
    assert busy.stdout is not None
    ready, _, _ = select.select([busy.stdout], [], [], 30)
    assert ready and busy.stdout.readline() == b"ready\n"

    r = sw(tmp_path, "dump", "--pid", str(busy.pid), "--data-dir", str(tmp_path / "data"), timeout_s=90)
    assert r.returncode == 0, r.stderr
    (headline,) = [line for line in r.stdout.splitlines() if line.startswith("Verdict:")]
    assert headline == (
        f"Verdict: 1 process (pid {busy.pid}), not a distributed job: in inner_work (busy.py:5) [confidence medium]"
    ), r.stdout
    assert "culprit" not in r.stdout
    (manifest,) = (tmp_path / "data").glob("*/*/manifest.json")
    verdict = json.loads(manifest.read_text(encoding="utf-8"))["verdict"]
    assert (verdict["kind"], verdict["culprit_ranks"], verdict["culprit_pids"]) == ("single", [], [])

    rank = _titled(spawn, python, f"single{os.getpid()}::scheduler_TP0")
    r = sw(tmp_path, "dump", "--pid", str(rank.pid), "--data-dir", str(tmp_path / "data2"), timeout_s=90)
    assert r.returncode == 0, r.stderr
    # a rank (the compute rule, not `single`), but one snapshot with no progress source cannot
    # tell its hang from work: no culprit (issue 22 F7)
    assert "Verdict: no culprit rank -- all ranks in compute: no collective wait (rank 0 in hung_in_fake_allreduce" in r.stdout, r.stdout
    assert "cannot tell a hang from work" in r.stdout, r.stdout
