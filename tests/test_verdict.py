"""The cross-rank verdict (agent.verdict): pure rules on synthetic evidence.

Real processes for every fault are in tests/test_fault_matrix.py; here each rule is pinned on
hand-built Flight Recorder dumps and py-spy stacks.
"""

from __future__ import annotations

from typing import Any

import agent.verdict as verdict_mod
from agent.stacks import Frame, ThreadStack
from agent.verdict import FrameClass, RankEvidence, classify_stack, decide


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
    v = decide(ev)
    assert (v.kind, v.culprit_ranks, v.reason) == ("compute", (), "all ranks in compute: no collective wait")


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
    from agent.stacks import hung_frame, idle_and_stuck

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
    where = decide([RankEvidence(rank=0, pid=7, ranked=False, frame_class=FrameClass.COMPUTE, frame="inner_work (busy.py:6)")])
    assert (where.kind, where.culprit_ranks, where.culprit_pids, where.hung, where.confidence) == ("single", (), (), True, "medium")
    assert where.reason == "1 process (pid 7), not a distributed job: in inner_work (busy.py:6)"
    assert where.headline() == f"Verdict: {where.reason} [confidence medium]"
    assert "culprit" not in where.headline() and "rank" not in where.headline()

    idle = decide([RankEvidence(rank=0, pid=7, ranked=False, frame_class=FrameClass.IDLE, frame="select (s.py:1)",
                                steps_before=2, steps_after=9)])
    assert (idle.kind, idle.hung) == ("single", False)
    assert idle.reason == "1 process (pid 7), not a distributed job: idle (waiting for work) in select (s.py:1) (steps 2->9: progressing)"

    crashed = decide([RankEvidence(rank=0, pid=7, ranked=False, alive=False, exited_first=True, exit_signal="SIGSEGV")])
    assert (crashed.kind, crashed.culprit_ranks, crashed.confidence) == ("single", (), "high")
    assert crashed.reason.endswith("not a distributed job: exited with SIGSEGV")
    assert decide([RankEvidence(rank=0, ranked=False)]).confidence == "low"

    # a rank (its title, RANK or torch.distributed), a Flight Recorder read or a collective wait: rank rules
    assert decide([RankEvidence(rank=0, pid=7, frame_class=FrameClass.COMPUTE, frame="f (m.py:1)")]).culprit_ranks == (0,)
    assert decide([RankEvidence(rank=0, pid=7, ranked=False, fr={"entries": [], "pg_status": {}},
                                frame_class=FrameClass.COMPUTE, frame="f (m.py:1)")]).kind == "compute"
    assert decide([RankEvidence(rank=0, pid=7, ranked=False, frame_class=FrameClass.COLLECTIVE,
                                frame="all_reduce (d.py:1)")]).kind != "single"
