"""The cross-rank verdict (agent.verdict.rules): pure rules on synthetic evidence.

Real processes for every fault are in tests/test_fault_matrix.py; here each rule is pinned on
hand-built Flight Recorder dumps and py-spy stacks.
"""

from __future__ import annotations

import json
import types
from typing import Any

import pytest

import agent.verdict.rules as verdict_mod
from agent.model.stacks import Frame, ThreadStack
from agent.verdict.rules import Evidence, FrameClass, RankEvidence, classify_stack, decide


def _entry(seq: int, op: str = "all_reduce", sizes: Any = ((8, 32),), pg: int = 0) -> dict[str, Any]:
    return {
        "pg_id": pg, "process_group": [str(pg), "default_pg"], "collective_seq_id": seq,
        "profiling_name": f"gloo:{op}", "input_sizes": [list(s) for s in sizes], "output_sizes": [list(s) for s in sizes],
        "input_dtypes": ["Float"], "output_dtypes": ["Float"], "state": "scheduled", "is_p2p": False,
        "time_created_ns": seq,
    }


def _pattern(n: int) -> list[dict[str, Any]]:
    """n collectives of the loop broadcast[4,16], all_reduce[8,32], ..."""
    return [_entry(s, "broadcast", ((4, 16),)) if s % 2 else _entry(s) for s in range(1, n + 1)]


def _fr(entries: list[dict[str, Any]], enqueued: int, completed: int) -> dict[str, Any]:
    return {"entries": entries, "pg_status": {"0": {"last_enqueued_collective": str(enqueued),
                                                    "last_completed_collective": str(completed)}}}


def test_public_names_match_all() -> None:
    assert all(hasattr(verdict_mod, n) for n in verdict_mod.__all__)


def test_rank_that_never_entered_the_collective_is_named_behind() -> None:
    ev = [RankEvidence(rank=r, pid=100 + r, fr=_fr(_pattern(42), 42, 41), frame_class=FrameClass.COLLECTIVE,
                       frame="all_reduce (torch/distributed/distributed_c10d.py:1)", steps_before=20, steps_after=20)
          for r in (0, 2, 3)]
    ev.append(RankEvidence(rank=1, pid=101, fr=_fr(_pattern(41), 41, 41), frame_class=FrameClass.COMPUTE,
                           frame="matmul (model.py:7)", steps_before=20, steps_after=20))
    v = decide(ev)
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.hung, v.confidence) == ("behind", (1,), (101,), True, "high")
    assert v.reason.startswith("behind: rank 1 never entered all_reduce #42 of pg 0; ranks 0,2,3 wait in it")
    attrs = v.attributes()
    assert attrs["servewatch.verdict.culprit_ranks"] == (1,) and attrs["servewatch.verdict.kind"] == "behind"
    assert v.headline().startswith("Verdict: culprit rank 1 (pid 101) -- behind:")


def test_desync_names_the_minority_rank() -> None:
    good = _pattern(41) + [_entry(42, sizes=((8, 32),))]
    bad = _pattern(41) + [_entry(42, sizes=((8, 31),))]
    ev = [RankEvidence(rank=r, fr=_fr(bad if r == 2 else good, 42, 41)) for r in range(4)]
    v = decide(ev)
    assert (v.kind, v.culprit_ranks, v.confidence) == ("desync", (2,), "high")
    assert "desync: ranks issued different ops/sizes at #42 of pg 0" in v.reason
    assert any("SIZE_OR_SYNTAX_MISMATCH" in e for e in v.evidence)  # torch's own analyzer agrees


def test_desync_between_two_ranks_is_settled_by_the_repeating_pattern() -> None:
    # rank 1 skipped broadcast #41: its #41 is the all_reduce the pattern puts at #42
    skipper = _pattern(40) + [_entry(41, "all_reduce")]
    ev = [RankEvidence(rank=0, fr=_fr(_pattern(41), 41, 40)), RankEvidence(rank=1, fr=_fr(skipper, 41, 40))]
    v = decide(ev)
    assert (v.kind, v.culprit_ranks) == ("desync", (1,))
    assert any("COLLECTIVE_TYPE_MISMATCH" in e for e in v.evidence)


def test_dead_rank_is_the_culprit_not_the_peers_that_failed_after_it() -> None:
    ev = [RankEvidence(rank=2, pid=7, alive=False, exited_first=True, exit_signal="SIGSEGV"),
          RankEvidence(rank=0, frame_class=FrameClass.COLLECTIVE), RankEvidence(rank=1, alive=False, exit_code=1),
          RankEvidence(rank=3, frame_class=FrameClass.COLLECTIVE)]
    v = decide(ev)
    assert (v.kind, v.culprit_ranks, v.culprit_pids) == ("dead", (2,), (7,))
    assert v.reason == "dead: rank 2 exited with SIGSEGV; ranks 0,3 wait in a collective; rank 1 exited after it"


def test_progressing_ranks_are_not_hung_even_with_a_lagging_recorder() -> None:
    slow = [{**e, "time_created_ns": e["time_created_ns"] + (300_000_000 if e["collective_seq_id"] % 2 == 0 else 0)}
            for e in _pattern(17)]
    ev = [RankEvidence(rank=0, fr=_fr(_pattern(18), 18, 17), frame_class=FrameClass.IDLE, steps_before=6, steps_after=9),
          RankEvidence(rank=1, fr=_fr(slow, 17, 17), frame_class=FrameClass.IDLE, steps_before=6, steps_after=9)]
    v = decide(ev)
    assert (v.kind, v.hung, v.culprit_ranks, v.stragglers) == ("progressing", False, (), (1,))
    assert "slowest: rank 1 (enters collectives last" in v.reason


def test_stacks_alone_name_the_rank_outside_the_collective() -> None:
    ev = [RankEvidence(rank=0, frame_class=FrameClass.COLLECTIVE, frame="all_reduce (c10d.py:1)"),
          RankEvidence(rank=1, frame_class=FrameClass.COMPUTE, frame="hot_loop (model.py:3)")]
    v = decide(ev)
    assert (v.kind, v.culprit_ranks, v.confidence) == ("behind", (1,), "medium")
    assert v.reason == "behind: rank 1 not in a collective (rank 1 in compute: hot_loop (model.py:3)); rank 0 waits in one"
    ev.append(RankEvidence(rank=2, frame_class=FrameClass.COLLECTIVE, frame="all_reduce (c10d.py:1)"))
    assert decide(ev).reason.endswith("; ranks 0,2 wait in one")  # subject and verb agree


def test_one_waiting_rank_beside_a_dead_one_waits() -> None:
    ev = [RankEvidence(rank=1, pid=7, alive=False, exited_first=True, exit_signal="SIGSEGV"),
          RankEvidence(rank=0, frame_class=FrameClass.COLLECTIVE)]
    assert decide(ev).reason == "dead: rank 1 exited with SIGSEGV; rank 0 waits in a collective"


def test_all_ranks_in_compute_names_nobody() -> None:
    ev = [RankEvidence(rank=r, frame_class=FrameClass.COMPUTE, frame="loop (m.py:1)") for r in range(2)]
    v = decide(ev, trigger="stall")
    assert (v.kind, v.culprit_ranks, v.reason) == ("compute", (), "all ranks in compute: no collective wait")


def test_a_given_progress_source_that_gave_no_reading_is_named_not_advised() -> None:
    """`dump --metrics-url` to a port nothing listens on: the verdict says what failed, and never
    advises passing the --metrics-url the user gave."""
    ranks = [RankEvidence(rank=r, frame_class=FrameClass.COMPUTE, frame="loop (m.py:1)") for r in range(2)]
    detail = "no reading: connection refused at http://127.0.0.1:9/metrics"
    v = decide(Evidence.of(ranks, trigger="manual", server_progress=None, server_progress_detail=detail))
    assert (v.kind, v.culprit_ranks, v.confidence) == ("compute", (), "low")
    assert v.reason.endswith(f"; one snapshot cannot tell a hang from work ({detail})"), v.reason
    assert "--metrics-url" not in v.reason


def test_one_shot_dump_of_a_busy_rank_without_a_progress_source_blames_nobody() -> None:
    """New-user trial F7: `dump` of a healthy, busy vLLM (TP=1: the Worker in a torch op, the
    EngineCore waiting on it) has one snapshot of stacks and nothing else: no SDK step counter,
    no /metrics reading, no stall. A busy forward and a hung one look the same: no culprit."""
    worker = RankEvidence(rank=0, pid=21040, title="VLLM::Worker", frame_class=FrameClass.COMPUTE,
                          frame="OpOverloadPacket.__call__ (torch/_ops.py:1279)")
    engine = RankEvidence(pid=20928, role=verdict_mod.Role.COORDINATOR, title="VLLM::EngineCore",
                          frame_class=FrameClass.COMPUTE, frame="step (vllm/v1/engine/core.py:300)")
    v = decide([worker, engine], trigger="manual")
    assert (v.kind, v.rule, v.culprit_ranks, v.culprit_pids, v.hung, v.confidence) == (
        "compute", "compute", (), (), False, "low"), v
    assert v.reason.startswith("all ranks in compute: no collective wait (rank 0 in OpOverloadPacket.__call__"), v.reason
    assert "cannot tell a hang from work" in v.reason and "--metrics-url" in v.reason, v.reason
    assert v.headline().startswith("Verdict: no culprit rank -- all ranks in compute"), v.headline()
    # evidence of no progress keeps the culprit: a stall, the rank's counter or the server's standing still
    for stalled in (decide([worker, engine], trigger="stall"),
                    decide([verdict_mod.replace(worker, steps_before=3, steps_after=3), engine], trigger="manual"),
                    decide(Evidence.of([worker, engine], trigger="manual", server_progress=False,
                                       server_progress_detail="vllm:iteration_tokens_total_count 7->7 in 2.0 s"))):
        assert (stalled.kind, stalled.culprit_ranks, stalled.culprit_pids, stalled.hung) == ("compute", (0,), (21040,), True)
    # the server's own counter advanced across the dump: progressing, not hung
    moving = decide(Evidence.of([worker, engine], trigger="manual", server_progress=True,
                                server_progress_detail="vllm:iteration_tokens_total_count 7->19 in 2.0 s"))
    assert (moving.kind, moving.rule, moving.culprit_ranks, moving.hung, moving.confidence) == (
        "progressing", "progressing", (), False, "medium"), moving
    assert "7->19" in moving.reason, moving.reason
    # ... but a stall trigger wins over it (the watchdog saw no progress for its whole timeout)
    assert decide(Evidence.of([worker, engine], trigger="stall", server_progress=True)).culprit_ranks == (0,)


def test_a_stopped_rank_is_named_before_the_deadlock_it_causes() -> None:
    """New-user trial F6: a SIGSTOPped vLLM Worker under `run` (stall on /metrics): py-spy reads it
    --nonblocking where it stopped (its message queue: idle), the EngineCore waits for its answer.
    Every process "waits for a message while work is pending" -- but the Worker cannot run at all."""
    worker = RankEvidence(rank=0, pid=21040, title="VLLM::Worker", frame_class=FrameClass.IDLE,
                          frame="dequeue (vllm/distributed/device_communicators/shm_broadcast.py:500)", stopped=True)
    engine = RankEvidence(pid=20928, role=verdict_mod.Role.COORDINATOR, title="VLLM::EngineCore",
                          frame_class=FrameClass.IDLE, frame="get_response (vllm/v1/executor/multiproc_executor.py:250)")
    v = decide([worker, engine], trigger="stall")
    assert (v.kind, v.rule, v.culprit_ranks, v.culprit_pids, v.hung) == ("suspended", "suspended", (0,), (21040,), True), v
    assert v.reason.startswith("rank 0 (pid 21040) is stopped (SIGSTOP or a debugger; kill -CONT 21040 resumes it)"), v.reason
    assert "pid 20928 'VLLM::EngineCore' in get_response" in v.reason, v.reason
    assert v.confidence == "high"  # the kernel says it cannot run, and the server made no progress
    assert any("stopped (state T" in line for line in v.evidence), v.evidence
    assert verdict_mod.hard_signal_plan(v, target_pids=[21040, 20928], stalled_pid=None)[0] == []  # resume, never kill
    # not stopped (py-spy's own brief ptrace stop is not seen twice): the deadlock rule as before
    assert decide([verdict_mod.replace(worker, stopped=False), engine], trigger="stall").kind == "deadlock"
    # no progress reading (a one-shot dump): still named, at medium
    assert (decide([worker, engine], trigger="manual").kind, decide([worker, engine], trigger="manual").confidence) == (
        "suspended", "medium")
    # a stopped coordinator is named by its pid and title, never given a rank
    v = decide([verdict_mod.replace(worker, stopped=False), verdict_mod.replace(engine, stopped=True)], trigger="stall")
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.confidence) == ("suspended", (), (20928,), "medium"), v


def test_a_rank_in_uninterruptible_sleep_is_named_with_its_wchan_and_frame() -> None:
    """The field shape: rank 1 reads weights from a hung NFS mount (state D, seen at open and again
    once the evidence was in), rank 0 waits in barrier(); before the Flight Recorder's `behind`."""
    sleeper = RankEvidence(rank=1, pid=42, frame_class=FrameClass.COMPUTE, frame="load_weights (model.py:7)",
                           uninterruptible=True, wchan="rpc_wait_bit_killable", steps_before=4, steps_after=4,
                           fr=_fr(_pattern(3), 3, 3))
    waiter = RankEvidence(rank=0, pid=41, frame_class=FrameClass.COLLECTIVE, frame="barrier (distributed_c10d.py:4881)",
                          steps_before=4, steps_after=4, fr=_fr(_pattern(4), 4, 3))
    v = decide([waiter, sleeper], trigger="stall")
    assert (v.kind, v.rule, v.culprit_ranks, v.culprit_pids, v.confidence, v.hung) == (
        "uninterruptible", "uninterruptible", (1,), (42,), "high", True), v
    assert v.reason == ("rank 1 (pid 42) is in uninterruptible sleep (D) in rpc_wait_bit_killable at load_weights "
                        "(model.py:7): the kernel is waiting on a filesystem or device; waiting for it: rank 0 in "
                        "barrier (distributed_c10d.py:4881)"), v.reason
    assert any("uninterruptible sleep (D) in rpc_wait_bit_killable" in line for line in v.evidence), v.evidence
    assert v.next_step.startswith("cat /proc/42/stack (where in the kernel it waits, as root), then ls -l /proc/42/fd")
    # no progress reading (a one-shot dump): still named, at medium; its wchan hidden: said so
    v = decide([waiter, verdict_mod.replace(sleeper, wchan="", steps_before=None, steps_after=None, fr=None)], trigger="manual")
    assert (v.kind, v.culprit_pids, v.confidence) == ("uninterruptible", (42,), "medium"), v
    assert "in uninterruptible sleep (D) in an unknown kernel function at load_weights" in v.reason
    # seen once only (a brief disk read: not in D again when the evidence was in): not the culprit
    assert decide([waiter, verdict_mod.replace(sleeper, uninterruptible=False)], trigger="stall").kind != "uninterruptible"
    # in D but its steps advance: a slow read, not a hang
    assert decide([verdict_mod.replace(waiter, steps_after=9),
                   verdict_mod.replace(sleeper, steps_after=9)], trigger="manual").kind != "uninterruptible"
    # in D with nobody waiting for it and no progress reading: nothing says it hangs
    lone = decide([verdict_mod.replace(waiter, frame_class=FrameClass.COMPUTE, frame="f (m.py:1)", fr=None),
                   verdict_mod.replace(sleeper, steps_before=None, steps_after=None, fr=None)], trigger="manual")
    assert lone.kind != "uninterruptible", lone
    # one process, no distributed job: never a culprit, but its D state is said
    single = decide([RankEvidence(pid=7, role=verdict_mod.Role.PROCESS, frame_class=FrameClass.COMPUTE, frame="main (m.py:3)",
                                  uninterruptible=True, wchan="kernel_clone")])
    assert single.kind == "single" and single.reason.endswith(
        "in main (m.py:3); a thread in uninterruptible sleep (D) in kernel_clone"), single.reason


def test_no_evidence_is_unknown() -> None:
    v = decide([RankEvidence(rank=0), RankEvidence(rank=1)])
    assert (v.kind, v.culprit_ranks, v.confidence) == ("unknown", (), "low")
    assert decide([]).kind == "unknown"


def _thread(frames: list[Frame], *, active: bool = True) -> ThreadStack:
    return ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=active, frames=tuple(frames))


def test_classify_stack_tells_collective_compute_and_idle_apart() -> None:
    wait = Frame(name="c10d::Work::wait", filename="libtorch_cpu.so", module="libtorch_cpu.so")
    ar = Frame(name="all_reduce", filename="/v/torch/distributed/distributed_c10d.py", short_filename="torch/distributed/distributed_c10d.py", line=9)
    mine = Frame(name="forward", filename="/app/model.py", short_filename="model.py", line=3)
    assert classify_stack([_thread([wait, ar, mine])]) == (FrameClass.COLLECTIVE, "all_reduce (torch/distributed/distributed_c10d.py:9)")
    assert classify_stack([_thread([mine])]) == (FrameClass.COMPUTE, "forward (model.py:3)")
    assert classify_stack([]) == (FrameClass.UNKNOWN, "")


def test_classify_stack_agrees_with_the_pyspy_summary_on_stuck_vs_idle() -> None:
    """A forward stuck in a time.sleep loop is off CPU (py-spy: not active) but stuck, not idle."""
    from agent.model.stacks import hung_frame, idle_and_stuck

    hang = Frame(name="_injected_hang_in_forward", filename="/app/agent/demo/model.py", short_filename="agent/demo/model.py", line=55)
    fwd = Frame(name="forward", filename="/app/agent/demo/model.py", short_filename="agent/demo/model.py", line=95)
    get = Frame(name="Queue.get", filename="/usr/lib/python3.11/queue.py", short_filename="queue.py", line=171)
    wait = Frame(name="Condition.wait", filename="/usr/lib/python3.11/threading.py", short_filename="threading.py", line=320)
    sleep = Frame(name="sleep", filename="/usr/lib/python3.11/time.py", short_filename="time.py", line=1)
    loop = Frame(name="event_loop", filename="/app/sched.py", short_filename="sched.py", line=9)
    stuck = [_thread([hang, fwd], active=False)]
    assert idle_and_stuck(stuck) == ((), ("MainThread",))
    assert classify_stack(stuck) == (FrameClass.COMPUTE, "_injected_hang_in_forward (agent/demo/model.py:55)")
    assert hung_frame(stuck) == "_injected_hang_in_forward (agent/demo/model.py:55)"
    assert classify_stack([_thread([sleep, fwd])]) == (FrameClass.COMPUTE, "forward (agent/demo/model.py:95)")
    waiting = [_thread([wait, get, loop], active=False)]
    assert idle_and_stuck(waiting) == (("MainThread",), ())
    assert classify_stack(waiting)[0] is FrameClass.IDLE
    # the main thread waits for work while a worker thread is stuck in the forward: stuck
    worker = ThreadStack(pid=1, thread_id=2, os_thread_id=2, thread_name="fwd", active=False, frames=(hang, fwd))
    assert classify_stack([*waiting, worker])[0] is FrameClass.COMPUTE


def test_the_only_rank_stuck_in_compute_is_named() -> None:
    v = decide([RankEvidence(rank=0, pid=7, frame_class=FrameClass.COMPUTE, frame="_injected_hang_in_forward (m.py:5)",
                             steps_before=3, steps_after=3, fr={"entries": [], "pg_status": {}})])
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.hung) == ("compute", (0,), (7,), True)
    assert v.reason == "all ranks in compute: no collective wait; rank 0 stuck (rank 0 in _injected_hang_in_forward (m.py:5))"
    assert "idle" not in v.headline()


def test_the_rank_whose_steps_stopped_in_compute_is_named_among_advancing_ones() -> None:
    ev = [RankEvidence(rank=0, frame_class=FrameClass.COMPUTE, frame="a (m.py:1)", steps_before=3, steps_after=3),
          RankEvidence(rank=1, frame_class=FrameClass.COMPUTE, frame="b (m.py:2)", steps_before=3, steps_after=5)]
    v = decide(ev)
    assert (v.kind, v.culprit_ranks) == ("compute", (0,))


def test_inconclusive_verdict_says_whether_the_recorders_were_read_empty_or_missing() -> None:
    assert decide([RankEvidence(rank=0), RankEvidence(rank=1)]).reason == \
        "no conclusive evidence (no Flight Recorder and no stacks)"
    empty = {"entries": [{"is_p2p": True}], "pg_status": {}}  # read, but nothing of a collective in it
    assert decide([RankEvidence(rank=0, fr=empty), RankEvidence(rank=1, fr=empty)]).reason == \
        "no conclusive evidence (Flight Recorder empty and no stacks)"


def test_one_process_that_is_not_a_rank_is_located_not_blamed() -> None:
    where = decide([RankEvidence(pid=7, frame_class=FrameClass.COMPUTE, frame="inner_work (busy.py:6)")])
    assert (where.kind, where.culprit_ranks, where.culprit_pids, where.hung, where.confidence) == ("single", (), (), True, "medium")
    assert where.reason == "1 process (pid 7), not a distributed job: in inner_work (busy.py:6)"
    assert where.headline() == f"Verdict: {where.reason} [confidence medium]"
    assert "culprit" not in where.headline() and "rank" not in where.headline()

    idle = decide([RankEvidence(pid=7, frame_class=FrameClass.IDLE, frame="select (s.py:1)",
                                steps_before=2, steps_after=9)])
    assert (idle.kind, idle.hung) == ("single", False)
    assert idle.reason == "1 process (pid 7), not a distributed job: idle (waiting for work) in select (s.py:1) (steps 2->9: progressing)"

    crashed = decide([RankEvidence(pid=7, alive=False, exited_first=True, exit_signal="SIGSEGV")])
    assert (crashed.kind, crashed.culprit_ranks, crashed.confidence) == ("single", (), "high")
    assert crashed.reason.endswith("not a distributed job: exited with SIGSEGV")
    assert decide([RankEvidence(pid=None)]).confidence == "low"

    # a rank (its title, RANK or torch.distributed), a Flight Recorder read or a collective wait: rank rules
    assert decide([RankEvidence(rank=0, pid=7, frame_class=FrameClass.COMPUTE, frame="f (m.py:1)")], trigger="stall").culprit_ranks == (0,)
    assert decide([RankEvidence(pid=7, fr={"entries": [], "pg_status": {}},
                                frame_class=FrameClass.COMPUTE, frame="f (m.py:1)")]).kind != "single"
    assert decide([RankEvidence(pid=7, frame_class=FrameClass.COLLECTIVE,
                                frame="all_reduce (d.py:1)")]).kind != "single"


# --- the rule table -------------------------------------------------------------------------------


def test_the_rule_table_is_the_documentation_and_it_is_current() -> None:
    from pathlib import Path

    names = [r.name for r in verdict_mod.RULES]
    assert len(names) == len(set(names)) and names[-1] == "inconclusive"
    assert all(r.when and r.concludes and r.confidence and r.kind for r in verdict_mod.RULES)
    doc = Path(__file__).resolve().parents[1] / "docs" / "verdict-rules.md"
    assert doc.read_text(encoding="utf-8") == verdict_mod.rules_markdown(), (
        "docs/verdict-rules.md is stale: python -m agent.verdict.rules > docs/verdict-rules.md")
    # every verdict records its rule
    assert decide([RankEvidence(rank=0), RankEvidence(rank=1)]).rule == "inconclusive"


def test_a_cascade_blames_the_live_rank_outside_the_collective_not_the_first_exit() -> None:
    hung_fr = _fr(_pattern(41), 41, 41)  # nothing in flight: it never entered #42
    ev = [RankEvidence(rank=2, pid=12, frame_class=FrameClass.COMPUTE, frame="_hang_in_compute (d.py:40)",
                       steps_before=20, steps_after=20, fr=hung_fr),
          RankEvidence(rank=1, pid=11, alive=False, exited_first=True, exit_code=1, exit_time_ns=100),
          RankEvidence(rank=0, pid=10, alive=False, exit_code=1, exit_time_ns=110),
          RankEvidence(rank=3, pid=13, alive=False, exit_code=1, exit_time_ns=120)]
    v = decide(ev, trigger="exit")
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.confidence, v.rule) == ("cascade", (2,), (12,), "high", "cascade")
    assert v.reason.startswith("collective timeout cascade: rank 2 alive outside the collective (rank 2 in _hang_in_compute")
    assert "ranks 0,1,3 exited after it (exit code 1): consequences, not causes" in v.reason
    # the same exits with no live rank outside a collective: the first exit is blamed
    alone = [e for e in ev if e.rank != 2] + [RankEvidence(rank=2, pid=12, frame_class=FrameClass.COLLECTIVE)]
    v = decide(alone, trigger="exit")
    assert (v.kind, v.culprit_ranks, v.confidence) == ("dead", (1,), "high")


def test_deaths_are_ordered_by_when_they_happened_not_when_they_were_seen() -> None:
    ev = [RankEvidence(rank=0, pid=10, alive=False, exited_first=True, exit_code=1, exit_time_ns=300),
          RankEvidence(rank=2, pid=12, alive=False, exit_code=1, exit_time_ns=310),
          RankEvidence(rank=3, pid=13, alive=False, exit_signal="SIGSEGV", exit_time_ns=200),
          RankEvidence(rank=1, pid=11, alive=False, exit_code=1)]
    v = decide(ev, trigger="exit")
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.confidence, v.rule) == ("dead", (3,), (13,), "high", "crash")
    assert v.reason == "dead: rank 3 exited with SIGSEGV; ranks 0,1,2 exited after it"
    oom = decide([RankEvidence(rank=0, pid=5, alive=False, exited_first=True, oom_killed=True, exit_signal="SIGKILL"),
                  RankEvidence(rank=1, pid=6, frame_class=FrameClass.COLLECTIVE)])
    assert oom.reason == "dead: rank 0 was killed by the OOM killer; rank 1 waits in a collective"


def test_an_unknown_exit_status_is_never_high_confidence_and_an_orderly_exit_never_a_culprit() -> None:
    unknown = decide([RankEvidence(rank=0, pid=5, alive=False, exited_first=True),
                      RankEvidence(rank=1, pid=6, frame_class=FrameClass.IDLE)], trigger="exit")
    assert (unknown.kind, unknown.culprit_ranks, unknown.confidence) == ("dead", (0,), "low")
    assert unknown.reason.startswith("dead: rank 0 exited (exit status unknown)")
    for how in ({"exit_code": 0}, {"exit_code": 143}, {"exit_signal": "SIGINT"}):
        v = decide([RankEvidence(rank=0, pid=5, alive=False, exited_first=True, **how),  # type: ignore[arg-type]
                    RankEvidence(rank=1, pid=6, frame_class=FrameClass.COLLECTIVE)], trigger="exit")
        assert (v.kind, v.culprit_ranks, v.culprit_pids, v.hung) == ("stopped", (), (), False), v


def _status(**groups: tuple[int, int]) -> dict[str, Any]:
    return {pg: {"last_enqueued_collective": str(e), "last_completed_collective": str(c)} for pg, (e, c) in groups.items()}


def test_an_ordering_deadlock_across_two_groups_is_named_as_a_cycle() -> None:
    """rank 0 all-reduces on pg 1 then pg 2, rank 1 on pg 2 then pg 1 (gloo's recorders, as read)."""
    def dump(first_pg: int) -> dict[str, Any]:
        entries = [_entry(s, pg=pg) for s in (1, 2, 3) for pg in (0, 1, 2)] + [_entry(4, pg=first_pg)]
        for i, e in enumerate(entries):
            e.update(process_group=[str(e["pg_id"]), "undefined"], record_id=i, p2p_seq_id=0, op_id=i)
        enq = {"0": (3, 3), "1": (4 if first_pg == 1 else 3, 3), "2": (4 if first_pg == 2 else 3, 3)}
        return {"entries": entries, "pg_status": _status(**enq), "version": "2.10"}

    ev = [RankEvidence(rank=0, pid=10, fr=dump(1), frame_class=FrameClass.COLLECTIVE, frame="all_reduce (c10d.py:1)"),
          RankEvidence(rank=1, pid=11, fr=dump(2), frame_class=FrameClass.COLLECTIVE, frame="all_reduce (c10d.py:1)")]
    v = decide(ev, trigger="stall")
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.confidence, v.rule) == ("cycle", (0, 1), (10, 11), "high", "cycle")
    assert v.reason == ("cycle: ordering deadlock across process groups: rank 0 waits in all_reduce #4 of pg 1 for "
                        "rank 1; rank 1 waits in all_reduce #4 of pg 2 for rank 0")
    assert "cycle from torch flight_recorder missing ranks" in v.evidence  # torch's analyzer found the missing ranks


def test_a_rendezvous_hang_names_the_ranks_that_never_arrived() -> None:
    waiting = [RankEvidence(rank=r, pid=10 + r, frame_class=FrameClass.RENDEZVOUS,
                            frame="init_process_group (torch/distributed/distributed_c10d.py:1)") for r in range(3)]
    v = decide(waiting, world_size=4, trigger="manual")
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.confidence) == ("rendezvous", (3,), (), "medium")
    assert v.reason == ("rendezvous: rank 3 never arrived (rank 3 never started); ranks 0,1,2 wait in "
                        "the rendezvous (init_process_group) (world size 4)")
    assert v.headline().startswith("Verdict: culprit rank 3 (no process) -- rendezvous:")
    late = [*waiting, RankEvidence(rank=3, pid=13, frame_class=FrameClass.COMPUTE, frame="load_weights (m.py:3)")]
    v = decide(late, world_size=4)
    assert (v.culprit_ranks, v.culprit_pids) == ((3,), (13,))
    assert "rank 3 is elsewhere (compute: load_weights (m.py:3))" in v.reason
    assert decide(waiting).confidence == "low"  # world size unknown, nobody known missing


def test_one_rank_waiting_for_a_message_alone_is_no_deadlock_it_says_its_sender_was_not_watched() -> None:
    """Field shape: SGLang's detokenizer stuck, watched with the README's ``--match 'sglang::scheduler*'``:
    the one scheduler captured waits in its ZeroMQ poll with requests pending. It read "deadlock
    between rank 0 (pid 11): each waits for a message" (a deadlock of one) and its next step
    dumped the scheduler's locals; the detokenizer was never named."""
    alone = [RankEvidence(rank=0, pid=11, title="sglang::scheduler", frame_class=FrameClass.IDLE,
                          frame="recv_requests (sglang/srt/managers/scheduler.py:1)")]
    v = decide(alone, trigger="stall")
    assert (v.kind, v.rule, v.culprit_ranks, v.culprit_pids, v.hung, v.confidence) == (
        "unknown", "ipc_wait_alone", (), (), True, "low")
    assert v.reason == ("rank 0 (pid 11) waits for a message while work is pending (in recv_requests "
                        "(sglang/srt/managers/scheduler.py:1)) and no other process of its server was captured: the one"
                        " that should send it (a tokenizer, detokenizer or API server?) is not watched")
    assert verdict_mod.next_step(v) == ("servewatch dump --root-pid $(ps -o ppid= -p 11) (every process of its server:"
                                        " which one should have sent the message)")
    assert decide(alone, work_pending=False).kind == "idle"  # nothing pending: it waits for work


def test_everyone_waiting_for_a_message_is_a_deadlock_with_work_pending_and_idle_without() -> None:
    ev = [RankEvidence(rank=0, pid=11, frame_class=FrameClass.IDLE, frame="recv (worker.py:9)"),
          RankEvidence(pid=10, role=verdict_mod.Role.COORDINATOR, title="eng::engine",
                       frame_class=FrameClass.IDLE, frame="recv (engine.py:5)")]
    stuck = decide(ev, trigger="stall")
    assert (stuck.kind, stuck.culprit_ranks, stuck.culprit_pids, stuck.hung) == ("deadlock", (0,), (11, 10), True)
    assert stuck.reason == ("deadlock between rank 0 (pid 11) and pid 10 'eng::engine': each waits for a message "
                            "while work is pending (rank 0 in recv (worker.py:9); pid 10 'eng::engine' in recv (engine.py:5))")
    assert decide(ev, work_pending=False).kind == "idle" and not decide(ev, work_pending=False).hung
    unknown = decide(ev)
    assert (unknown.kind, unknown.confidence) == ("idle", "low")
    assert unknown.reason == "all idle (waiting for work): nothing is stuck (no reading of pending work)"
    # pending work from an SDK counter (no stall): still a deadlock
    assert decide([*ev[:1], verdict_mod.replace(ev[1], pending=1)]).kind == "deadlock"


def test_a_coordinator_is_evidence_never_a_rank() -> None:
    ev = [RankEvidence(pid=10, role=verdict_mod.Role.COORDINATOR, title="VLLM::EngineCore",
                       frame_class=FrameClass.IDLE, frame="dequeue (shm_broadcast.py:5)"),
          RankEvidence(rank=0, pid=11, title="VLLM::Worker", frame_class=FrameClass.COMPUTE,
                       frame="forward (llama.py:9)", steps_before=3, steps_after=3)]
    v = decide(ev, trigger="stall")
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.ranks) == ("compute", (0,), (11,), (0,))
    # no worker stack: the coordinator waiting on its worker points at it
    blind = [verdict_mod.replace(ev[0], waits_on=(11,)), RankEvidence(rank=0, pid=11, title="VLLM::Worker")]
    v = decide(blind, trigger="stall")
    assert (v.kind, v.culprit_ranks, v.culprit_pids, v.rule, v.confidence) == ("behind", (0,), (11,), "coordinator_waits", "low")


def _engine_hang_shape() -> tuple[list[RankEvidence], RankEvidence]:
    """The real vLLM 0.32 shape of a hang in the EngineCore's own busy loop (TP=2): both Workers
    idle in their message queue, the EngineCore stuck in its own step (not in the executor's RPC)."""
    workers = [RankEvidence(rank=r, pid=30101 + r, title=f"VLLM::Worker_TP{r}", frame_class=FrameClass.IDLE,
                            frame="dequeue (vllm/distributed/device_communicators/shm_broadcast.py:605)")
               for r in (0, 1)]
    engine = RankEvidence(pid=30100, role=verdict_mod.Role.COORDINATOR, title="VLLM::EngineCore",
                          frame_class=FrameClass.COMPUTE, frame="engine_fault_point (servewatch_realvllm_plugin.py:88)")
    return workers, engine


def test_an_engine_core_stuck_in_its_own_loop_while_every_rank_idles_is_the_culprit() -> None:
    """Issue 32 item 1b: every rank waits for work, the EngineCore is stuck in its own code while
    the server is busy and not stepping: the engine core is the culprit, named with its frame
    (before: "no culprit rank -- no collective wait (rank 0 idle, rank 1 idle) [confidence low]")."""
    workers, engine = _engine_hang_shape()
    v = decide([*workers, engine], trigger="stall")
    assert (v.kind, v.rule, v.culprit_ranks, v.culprit_pids, v.hung, v.confidence) == (
        "coordinator", "coordinator_stuck", (), (30100,), True, "high"), v
    assert v.culprit_names == ("pid 30100 'VLLM::EngineCore'",), v.culprit_names
    assert v.reason.startswith("the engine core pid 30100 'VLLM::EngineCore' is stuck in engine_fault_point "
                               "(servewatch_realvllm_plugin.py:88) while every rank idles (waiting for work)"), v.reason
    assert "rank 0 in dequeue (" in v.reason and "rank 1 in dequeue (" in v.reason, v.reason
    assert v.headline().startswith("Verdict: culprit pid 30100 'VLLM::EngineCore' -- the engine core pid 30100 "), v.headline()
    assert v.headline().endswith("[confidence high]"), v.headline()
    assert any(line.startswith("pid 30100 'VLLM::EngineCore'; coordinator; compute: engine_fault_point")
               for line in v.evidence), v.evidence
    assert v.next_step == "py-spy dump --native --pid 30100 (what the engine core's own loop is stuck in; its " \
                          "workers wait for work)", v.next_step
    # its own step counter standing still agrees too; the server's /metrics standing still with work pending
    counted = verdict_mod.replace(engine, steps_before=7, steps_after=7)
    assert decide([*workers, counted], work_pending=True).confidence == "high"
    still = Evidence.of([*workers, engine], work_pending=True, server_progress=False,
                        server_progress_detail="vllm:iteration_tokens_total_count 7->7 in 2.0 s")
    assert (decide(still).kind, decide(still).confidence) == ("coordinator", "high")
    # stacks and pending work alone (no stall, no counter read twice): medium
    pending = decide([*workers, engine], work_pending=True)
    assert (pending.kind, pending.culprit_pids, pending.confidence) == ("coordinator", (30100,), "medium"), pending
    # a DP controller (SGLang) is a coordinator too: "the coordinator", by its title
    ctl = verdict_mod.replace(engine, title="sglang::data_parallel_controller")
    v = decide([*workers, ctl], trigger="stall")
    assert (v.kind, v.culprit_pids) == ("coordinator", (30100,))
    assert v.reason.startswith("the coordinator pid 30100 'sglang::data_parallel_controller' is stuck in "), v.reason


def test_an_engine_core_in_its_own_code_is_no_culprit_without_a_busy_server_or_with_a_rank_at_work() -> None:
    workers, engine = _engine_hang_shape()
    # nothing says work was pending: the previous verdict stands (no culprit, low)
    for ev in (decide([*workers, engine], trigger="manual"), decide([*workers, engine], work_pending=False)):
        assert (ev.kind, ev.culprit_pids, ev.confidence) == ("unknown", (), "low"), ev
        assert ev.reason == "no collective wait (rank 0 idle, rank 1 idle)", ev.reason
    # the engine core waits on its workers (the executor's RPC): not stuck in its own code
    waiting = verdict_mod.replace(engine, frame_class=FrameClass.IDLE,
                                  frame="get_response (vllm/v1/executor/multiproc_executor.py:250)")
    assert decide([*workers, waiting], trigger="stall").kind == "deadlock"
    assert decide([*workers, verdict_mod.replace(engine, waits_on=(30101, 30102))], trigger="stall").kind != "coordinator"
    # its own counter advanced: busy, not stuck
    moving = verdict_mod.replace(engine, steps_before=7, steps_after=9)
    assert decide([*workers, moving], work_pending=True).kind != "coordinator"
    # a rank in compute or in a collective: the rank rules decide, as before
    busy_rank = verdict_mod.replace(workers[1], frame_class=FrameClass.COMPUTE, frame="forward (llama.py:9)")
    assert decide([workers[0], busy_rank, engine], trigger="stall").kind != "coordinator"
    # a rank without a stack: not known to idle
    blind = verdict_mod.replace(workers[1], frame_class=FrameClass.UNKNOWN, frame="")
    assert decide([workers[0], blind, engine], trigger="stall").kind != "coordinator"
    # a frontend stuck in its own code is no coordinator: at a stall with every rank idle, the frontend is named
    api = verdict_mod.replace(engine, role=verdict_mod.Role.FRONTEND, title="VLLM::APIServer")
    named = decide([*workers, api], trigger="stall")
    assert (named.kind, named.rule, named.culprit_roles) == ("frontend", "frontend_blocked", ("frontend",)), named


def test_hard_mode_treats_a_stuck_engine_core_as_any_culprit() -> None:
    plan = verdict_mod.hard_signal_plan
    workers, engine = _engine_hang_shape()
    targets = [30100, 30101, 30102]
    high = decide([*workers, engine], trigger="stall")
    assert plan(high, target_pids=targets, stalled_pid=None) == (
        [30100], f"culprit per verdict: {high.reason}")  # the engine core only, never its idle workers
    medium = decide([*workers, engine], work_pending=True)
    assert plan(medium, target_pids=targets, stalled_pid=None) == (
        [], "verdict confidence medium: hard mode acts only on a high-confidence culprit")
    # a culprit that is not one of the incident's targets (never identified: no pidfd) is never signalled
    assert plan(high, target_pids=[30101, 30102], stalled_pid=None)[0] == []


def test_hard_mode_acts_only_on_a_high_confidence_culprit() -> None:
    plan = verdict_mod.hard_signal_plan
    behind = decide([RankEvidence(rank=0, pid=5, frame_class=FrameClass.COLLECTIVE),
                     RankEvidence(rank=1, pid=6, frame_class=FrameClass.COMPUTE, frame="f (m.py:1)")])
    assert behind.confidence == "medium"
    assert plan(behind, target_pids=[5, 6], stalled_pid=5) == (
        [], "verdict confidence medium: hard mode acts only on a high-confidence culprit")
    assert plan(behind, target_pids=[5, 6], stalled_pid=5, policy="all")[0] == [5, 6]
    high = verdict_mod.replace(behind, confidence="high")
    assert plan(high, target_pids=[5, 6], stalled_pid=5)[0] == [6]
    assert plan(None, target_pids=[5, 6], stalled_pid=5)[0] == []
    assert plan(None, target_pids=[5], stalled_pid=5)[0] == [5]  # one process that stalled: itself
    idle = decide([RankEvidence(rank=0, pid=5, frame_class=FrameClass.IDLE)], work_pending=False)
    assert plan(idle, target_pids=[5], stalled_pid=5)[0] == []


# --- stacks: the communication layers and the idle helpers ----------------------------------------


def _f(name: str, path: str, line: int = 1, native: bool = False) -> Frame:
    short = path.split("site-packages/")[-1]
    if native:
        return Frame(name=name, filename=path, module=path.rsplit("/", 1)[-1])
    return Frame(name=name, filename=path, short_filename=short, line=line)


_SP = "/v/lib/python3.11/site-packages/"
_TH = "/usr/lib/python3.11/threading.py"


def test_serving_frameworks_communication_layers_are_collective_waits() -> None:
    """vLLM TP=2 on CPU: the waiting rank sits in parallel_state -> cpu_communicator -> shm_allreduce."""
    vllm = [_f("wait_for_all", "_C.abi3.so", native=True), _f("shm_allreduce", "_C.abi3.so", native=True),
            _f("CpuCommunicator.all_reduce", _SP + "vllm/distributed/device_communicators/cpu_communicator.py", 80),
            _f("GroupCoordinator.all_reduce", _SP + "vllm/distributed/parallel_state.py", 500),
            _f("RowParallelLinear.forward", _SP + "vllm/model_executor/layers/linear.py", 1400)]
    assert classify_stack([_thread(vllm)]) == (
        FrameClass.COLLECTIVE, "CpuCommunicator.all_reduce (vllm/distributed/device_communicators/cpu_communicator.py:80)")
    sglang = [_f("all_reduce", _SP + "sglang/srt/distributed/parallel_state.py", 7), _f("forward", "/app/m.py", 3)]
    assert classify_stack([_thread(sglang)])[0] is FrameClass.COLLECTIVE
    pynccl = [_f("ncclAllReduce", "libnccl.so.2", native=True), _f("forward", "/app/m.py", 3)]
    assert classify_stack([_thread(pynccl)])[0] is FrameClass.COLLECTIVE
    rdzv = [_f("TCPStore.__init__", "libtorch_python.so", native=True),
            _f("_create_c10d_store", _SP + "torch/distributed/rendezvous.py", 189),
            _f("init_process_group", _SP + "torch/distributed/distributed_c10d.py", 1600),
            _f("main", "/app/train.py", 9)]
    assert classify_stack([_thread(rdzv)]) == (FrameClass.RENDEZVOUS, "_create_c10d_store (torch/distributed/rendezvous.py:189)")


def test_parked_helper_threads_and_message_queues_are_idle_not_stuck() -> None:
    """A healthy idle vLLM process: signal-callback and tqdm's monitor park on an Event; the
    worker's main thread spins in shm_broadcast's dequeue (on CPU to py-spy)."""
    from agent.model.stacks import hung_frame, idle_and_stuck, thread_is_idle

    park = [_f("Condition.wait", _TH, 355), _f("Event.wait", _TH, 655)]
    boot = [_f("Thread.run", _TH, 1010), _f("Thread._bootstrap_inner", _TH, 1073), _f("Thread._bootstrap", _TH, 1030)]
    signal_cb = ThreadStack(pid=1, thread_id=2, os_thread_id=2, thread_name="signal-callback", frames=(*park, _f("SignalCallback._run", _SP + "vllm/v1/engine/utils.py", 395), *boot))
    tqdm = ThreadStack(pid=1, thread_id=3, os_thread_id=3, thread_name="Thread-1", frames=(*park, _f("TMonitor.run", _SP + "tqdm/_monitor.py", 60), *boot[1:]))
    main = ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=True, frames=(
        _f("SpinCondition.wait", _SP + "vllm/distributed/device_communicators/shm_broadcast.py", 200),
        _f("MessageQueue.acquire_read", _SP + "vllm/distributed/device_communicators/shm_broadcast.py", 864),
        _f("MessageQueue.dequeue", _SP + "vllm/distributed/device_communicators/shm_broadcast.py", 971),
        _f("WorkerProc.worker_busy_loop", _SP + "vllm/v1/executor/multiproc_executor.py", 1000)))
    threads = [main, signal_cb, tqdm]
    assert all(thread_is_idle(t) for t in threads)
    assert idle_and_stuck(threads) == (("MainThread", "signal-callback", "Thread-1"), ())
    assert hung_frame(threads) == "" and classify_stack(threads)[0] is FrameClass.IDLE
    # right after a request the worker spins through vLLM's own sched_yield helper (innermost on
    # the real vLLM 0.32 CPU worker: 'sched_yield (vllm/distributed/utils.py:46)'): still idle
    spinning = ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=True,
                           frames=(_f("sched_yield", _SP + "vllm/distributed/utils.py", 46), *main.frames))
    assert thread_is_idle(spinning) and classify_stack([spinning, signal_cb, tqdm])[0] is FrameClass.IDLE
    # the helper alone proves nothing: called from a model's own loop it is that loop that spins
    own_spin = ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=True,
                           frames=(_f("sched_yield", _SP + "vllm/distributed/utils.py", 46), _f("forward", "/app/m.py", 3)))
    assert not thread_is_idle(own_spin)
    # a forward that waits in Event.wait deep in the model is stuck, on any thread
    deep = ThreadStack(pid=1, thread_id=4, os_thread_id=4, thread_name="fwd", frames=(*park, _f("hook", "/app/m.py", 1), _f("layer", "/app/m.py", 2), _f("forward", "/app/m.py", 3), *boot))
    assert not thread_is_idle(deep)
    assert classify_stack([*threads, deep]) == (FrameClass.COMPUTE, "hook (/app/m.py:1)")


def test_a_thread_woken_in_its_queue_wait_reads_active_but_is_idle() -> None:
    """py-spy reads ``active`` off the OS thread state: a worker woken an instant before the dump to
    re-check its queue's timeout reads active while its native frames are still the lock wait
    (seen once in ~40 dumps of tests/programs/titled_target.py's idle workers). Its wait for work
    is idle; the same native wait under a model's own code is not."""
    from agent.model.stacks import thread_is_idle

    wait = (_f("0x7fe2182a3f16", "/usr/lib/x86_64-linux-gnu/libc.so.6", native=True),
            _f("PyThread_acquire_lock_timed", "/usr/lib/libpython3.11.so.1.0", native=True),
            _f("lock_PyThread_acquire_lock", "/usr/lib/libpython3.11.so.1.0", native=True))
    queue_get = (_f("Condition.wait", _TH, 331), _f("Queue.get", "/usr/lib/python3.11/queue.py", 180),
                 _f("worker_idle_loop", "/app/titled_target.py", 34))
    woken = ThreadStack(pid=1, thread_id=2, os_thread_id=2, thread_name="worker-0", active=True, frames=(*wait, *queue_get))
    assert thread_is_idle(woken)
    # without the native wait (a dump without --native, or the thread already running Python): not idle
    assert not thread_is_idle(ThreadStack(pid=1, thread_id=2, os_thread_id=2, thread_name="worker-0", active=True,
                                          frames=queue_get))
    model = (_f("Condition.wait", _TH, 331), _f("Event.wait", _TH, 655), _f("hung_in_fake_allreduce", "/app/m.py", 48))
    assert not thread_is_idle(ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=True,
                                          frames=(*wait, *model)))


def test_the_sdks_own_threads_in_the_sdks_code_are_idle_never_stuck() -> None:
    """``servewatch-control`` serving the agent's in-flight read while py-spy looks (the demo's
    dump saw it 'stuck' one run in two), and ``servewatch-presence`` between looks, are the SDK
    working for the agent; the same name running the server's code is judged like any thread."""
    from agent.model.stacks import idle_and_stuck, thread_is_idle

    boot = [_f("Thread.run", _TH, 1010), _f("Thread._bootstrap_inner", _TH, 1073), _f("Thread._bootstrap", _TH, 1030)]
    serving = ThreadStack(pid=1, thread_id=2, os_thread_id=2, thread_name="servewatch-control", active=True, frames=(
        _f("_inflight", _SP + "agent/sdk/control.py", 420), _f("_handle", _SP + "agent/sdk/control.py", 360),
        _f("_serve", _SP + "agent/sdk/control.py", 318), *boot))
    conn = ThreadStack(pid=1, thread_id=3, os_thread_id=3, thread_name="servewatch-control-conn", frames=(
        _f("recv", "/usr/lib/python3.11/socket.py", 1), _f("_connection", "/w/agent/sdk/control.py", 330), *boot))
    main = ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=True, frames=(
        _f("forward", "/app/m.py", 3),))
    assert thread_is_idle(serving) and thread_is_idle(conn)
    assert idle_and_stuck([main, serving, conn]) == (("servewatch-control", "servewatch-control-conn"), ("MainThread",))
    # the SDK's thread inside the server's code (a profiler start in torch): judged, here stuck
    in_torch = ThreadStack(pid=1, thread_id=4, os_thread_id=4, thread_name="servewatch-control", active=True, frames=(
        _f("start", _SP + "torch/profiler/profiler.py", 700), _f("_start", _SP + "agent/sdk/profiler.py", 200), *boot))
    assert not thread_is_idle(in_torch)
    # a server thread that only happens to call the SDK is not one of the SDK's own
    named = ThreadStack(pid=1, thread_id=5, os_thread_id=5, thread_name="worker", active=True, frames=(
        _f("step", _SP + "agent/sdk/steps.py", 50), *boot))
    assert not thread_is_idle(named)


def test_a_frontend_that_died_leaving_its_ranks_alive_names_them_and_their_memory() -> None:
    """The incident of a :class:`~agent.model.events.FrontendExited` (its real shape: the frontend's pid,
    title and exit, the survivors' pids and titles, the memory they hold, their new parent).
    Before: "1 process (pid <frontend>), not a distributed job: exited with SIGKILL" and a dmesg
    next step. Now: ``orphaned``, the survivors the culprits, ``kill`` them the next step."""
    import signal
    import subprocess
    import sys

    from agent.host.targets import Target
    from agent.model.events import ExitFact, FrontendExited
    from agent.verdict.judge import VerdictJudge
    from agent.verdict.rules import hard_signal_plan, next_step_of

    # the frontend: a process that was SIGKILLed and is gone; the survivors: two live processes
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone.kill()
    gone.wait(timeout=10)
    survivors = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        a, b = (p.pid for p in survivors)
        cause = FrontendExited(
            source="process", pid=gone.pid, signal=int(signal.SIGKILL), title="python -m demo.launch_server",
            fact=ExitFact.of(gone.pid, None, int(signal.SIGKILL)), left_alive=(a, b),
            left_alive_titles=("demo::scheduler_TP0", "demo::scheduler_TP1"), held_bytes=400_000_000, reparented_to=1)
        targets = [Target(pid=a, title="demo::scheduler_TP0"), Target(pid=b, title="demo::scheduler_TP1")]
        v = VerdictJudge(warm_up=False)._decide(targets, [], cause, {})
    finally:
        for p in survivors:
            p.kill()
            p.wait(timeout=10)
    assert v is not None
    assert (v.kind, v.rule, v.confidence, v.hung) == ("orphaned", "frontend_exited", "high", False)
    assert v.culprit_pids == (a, b)
    assert v.headline() == (
        f"Verdict: server's frontend pid {gone.pid} 'python -m demo.launch_server' exited (signal 9 (SIGKILL)); "
        f"2 processes of it still alive under pid 1 holding 0.40 GB: pid {a} 'demo::scheduler_TP0', "
        f"pid {b} 'demo::scheduler_TP1' [confidence high]")
    line = (f"kill {a} {b} (they hold the server's memory: a restart beside them can run out of memory), "
            "then restart the server")
    assert v.next_step == line
    assert next_step_of({**v.to_json(), "next": ""}) == line  # an older bundle's, rebuilt
    assert hard_signal_plan(v, target_pids=[a, b], stalled_pid=None)[0] == []  # not hung: hard mode leaves them


def test_survivors_that_ended_before_the_verdict_are_not_orphans() -> None:
    """Every process left alive ended before it was judged: no ``orphaned`` verdict."""
    ev = Evidence.of([RankEvidence(pid=40, role=verdict_mod.Role.PROCESS, title="launcher", alive=False,
                                   exited_first=True, exit_signal="SIGKILL"),
                      RankEvidence(rank=0, pid=41, alive=False, exit_code=0)],
                     trigger="exit", orphaned_pids=(41,), orphaned_bytes=1)
    assert decide(ev).kind != "orphaned"


def test_the_servers_own_watchdog_dumping_a_process_too_reaches_the_verdict(spawn, python) -> None:
    """The py-spy actor's note that SGLang's own watchdog dumped the process too
    (``servewatch.pyspy.note``) is said in the verdict of that process."""
    from agent.actors.pyspy import NOTE_ATTR
    from agent.host.targets import Target
    from agent.model.events import Action, ActionResult, Outcome, frozen_attrs
    from agent.verdict.judge import VerdictJudge

    proc = spawn([python, "-c", "import time; time.sleep(60)"])
    note = "SGLang's own watchdog fired: it ran py-spy pid 7 'py-spy dump --native --pid 8' started by pid 8 'sglang::scheduler' on this process too"
    dump = ActionResult(action=Action.PYSPY_DUMP, outcome=Outcome.OK, pid=proc.pid,
                        attributes=frozen_attrs({"process.pid": proc.pid, NOTE_ATTR: note}))  # fmt: skip
    v = VerdictJudge(warm_up=False)._decide([Target(pid=proc.pid, title="python")], [dump], None, {})
    assert v is not None
    assert note in v.reason, v.reason


def test_torchs_analyzer_gets_each_groups_recorded_name_even_when_the_last_rank_never_touched_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the names came from the last rank's recorder only (an indentation slip), so a
    group it never issued a collective on reached ``build_db`` as ``("1", "1")``."""
    import agent.verdict.flightrec as fr_mod

    seen: dict[str, Any] = {}

    def build_db(details: dict[str, Any], args: Any, version: str) -> Any:
        seen.update(details)
        return types.SimpleNamespace(collectives=[])

    monkeypatch.setattr(fr_mod, "_analyzer", lambda: (build_db, None, None))
    tp = [{**_entry(s, pg=1), "process_group": ["1", "tp_group"]} for s in (1, 2)]
    frs = {0: fr_mod.RankRecorder.of({"entries": [_entry(1), *tp]}),
           1: fr_mod.RankRecorder.of({"entries": [_entry(1), *tp]}),
           2: fr_mod.RankRecorder.of({"entries": [_entry(1)]})}
    assert fr_mod.torch_missing_ranks({r: f for r, f in frs.items() if f is not None}) == []
    config = seen["rank0"]["pg_config"]
    assert config["1"]["name"] == "1" and config["1"]["desc"] == "tp_group"
    assert config["0"]["desc"] == "default_pg"
    assert json.loads(config["1"]["ranks"]) == [0, 1]
