"""Pure parts of the job protocol: the trace's name from the stuck collective or a time bucket,
the fan-out's shape, the evidence window, the job verdict over several hosts' summaries."""

from __future__ import annotations

import anyio

from agent.fleet.fanout import bounded, plan
from agent.fleet.host_summary import fit, fr_window, world_size_of
from agent.fleet.identity import (
    JobKey,
    job_trace,
    repeat_trace,
    root_span_of,
    stuck_collective,
    time_bucket_key,
)
from agent.fleet.jobverdict import MissingHost, judge_job
from agent.fleet.messages import Evidence, RankSummary
from agent.fleet.traceparent import TraceParent


def _status(completed: int, enqueued: int) -> dict:
    # the shape torch 2.13 returns for gloo (strings), as read from a real job (FIELD-NOTES)
    return {"pg_status": {"0": {"last_completed_collective": str(completed), "last_enqueued_collective": str(enqueued),
                                "last_started_collective": "-1"}}}


def test_every_host_of_a_lockstep_hang_names_the_same_collective() -> None:
    # the culprit never entered #8; the others wait in it: all completed #7
    host_a = [_status(7, 8), _status(7, 8)]
    host_b = [_status(7, 8), _status(7, 7)]  # the culprit's host
    assert stuck_collective(host_a) == stuck_collective(host_b) == JobKey("fr", "0:8")
    assert stuck_collective([{"pg_status": {}}, {}]) is None
    key = JobKey.parse("fr:0:8")
    trace, root = job_trace("llama", key)
    assert (trace, root) == job_trace("llama", JobKey("fr", "0:8"))  # derived, no message
    assert trace != job_trace("other-job", key)[0] and trace != job_trace("llama", JobKey("fr", "0:9"))[0]
    assert root == root_span_of(trace) and TraceParent.parse(f"00-{trace}-{root}-01").trace_id == trace
    again, again_root = repeat_trace(trace, 1)
    assert again != trace and again_root == root_span_of(again)


def test_time_buckets_without_a_flight_recorder() -> None:
    t = 1_796_138_303_033_418_343
    assert time_bucket_key(t, 10) == time_bucket_key(t + 1_000_000, 10) == JobKey("time", "1796138300")
    assert time_bucket_key(t + 7_000_000_000, 10) != time_bucket_key(t, 10)


def test_the_fan_out_is_direct_below_the_threshold_and_a_two_level_tree_above() -> None:
    assert plan(list(range(5)), threshold=8) == [(i, []) for i in range(5)]
    tree = plan(list(range(1000)), threshold=64)
    assert len(tree) == 32 and sum(1 + len(children) for _, children in tree) == 1000
    assert max(len(children) for _, children in tree) <= 31
    seen: list[int] = []
    in_flight = [0, 0]

    async def one(i: int) -> None:
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        await anyio.sleep(0.001)
        seen.append(i)
        in_flight[0] -= 1

    anyio.run(lambda: bounded(list(range(50)), one, limit=4))
    assert sorted(seen) == list(range(50)) and in_flight[1] == 4


def test_the_evidence_window_keeps_the_stuck_collective_and_stays_small() -> None:
    entries = [{"record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": i + 1, "op_id": i + 1,
                "profiling_name": "gloo:all_reduce", "input_sizes": [[8, 32]], "output_sizes": [[8, 32]], "state": "scheduled",
                "is_p2p": False, "frames": [{"name": "f", "filename": "x.py", "line": 1}] * 30} for i in range(200)]
    trace = {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1, 2, 3]"}}, **_status(199, 200),
             "entries": entries}
    window = fr_window(trace)
    assert [e["collective_seq_id"] for e in window["entries"]] == [197, 198, 199, 200]
    assert all("frames" not in e for e in window["entries"])
    assert world_size_of(trace) == 4
    ev = Evidence.model_validate({"job": "j", "host.name": "h", "trace_id": "a" * 32, "incident_id": "inc-1",
                                  "ranks": [RankSummary(rank=r, fr=window) for r in range(8)]})
    assert len(fit(ev, 64 * 1024)) < 64 * 1024
    assert b'"entries"' not in fit(ev, 2000)  # too big: the windows go first, the status stays


def _rank(rank: int, enq: int, done: int, frame_class: str, frame: str = "") -> RankSummary:
    entries = [{"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": s, "profiling_name": "gloo:all_reduce",
                "input_sizes": [[8, 32]], "output_sizes": [[8, 32]], "state": "completed" if s <= done else "scheduled",
                "record_id": s, "op_id": s, "is_p2p": False} for s in range(max(1, done - 2), enq + 1)]
    fr = {"version": "2.10", "pg_config": {}, **_status(done, enq), "entries": entries}
    return RankSummary(rank=rank, pid=100 + rank, frame_class=frame_class, frame=frame, steps_before=5, steps_after=5, fr=fr)


def _host(name: str, ranks: list[RankSummary]) -> Evidence:
    return Evidence.model_validate({"job": "j", "host.name": name, "trace_id": "b" * 32, "incident_id": f"inc-{name}",
                                    "ranks": ranks, "world_size": 6})


def test_the_job_verdict_names_the_culprit_rank_and_its_host_across_hosts() -> None:
    hosts = [_host("node-a", [_rank(0, 8, 7, "collective"), _rank(1, 8, 7, "collective")]),
             _host("node-b", [_rank(2, 8, 7, "collective"), _rank(3, 7, 7, "compute", "forward (m.py:3)")]),
             _host("node-c", [_rank(4, 8, 7, "collective"), _rank(5, 8, 7, "collective")])]
    v = judge_job(hosts)
    assert (v.kind, v.culprit_ranks, v.culprit_hosts, v.confidence) == ("behind", (3,), ("node-b",), "high")
    assert v.captured_ranks == tuple(range(6)) and v.missing_ranks == () and v.world_size == 6
    assert v.headline().startswith("Job verdict: culprit rank 3 on node-b -- behind: rank 3 never entered all_reduce #8")
    # node-b alone only sees one of its two ranks behind; node-a alone sees nothing wrong
    assert judge_job(hosts[:1]).culprit_ranks != (3,)


def test_a_host_that_sent_nothing_is_named_with_its_ranks_and_holds_the_culprit() -> None:
    hosts = [_host("node-a", [_rank(0, 8, 7, "collective"), _rank(1, 8, 7, "collective")]),
             _host("node-c", [_rank(4, 8, 7, "collective"), _rank(5, 8, 7, "collective")])]
    v = judge_job(hosts, missing_hosts=[MissingHost("node-b", (2, 3), "agent unreachable (connection failed)")])
    assert (v.kind, v.culprit_ranks, v.culprit_hosts) == ("missing", (2, 3), ("node-b", "node-b"))
    assert v.missing_ranks == (2, 3) and "host node-b (ranks 2,3): agent unreachable" in v.reason
    # without a name for the missing host: the world size still says which ranks nobody captured
    v = judge_job(hosts, missing_hosts=[MissingHost("http://10.0.0.12:7207")])
    assert v.missing_hosts[0].ranks == (2, 3) and v.culprit_hosts == ("http://10.0.0.12:7207",) * 2


def test_the_job_verdict_records_the_stuck_collective_read_from_every_hosts_captured_windows() -> None:
    """The trace is named by the detection time (it costs nothing: the capture never waits); the
    stuck collective is derived after the capture from every host's evidence, where the host of
    the culprit alone would say otherwise for a rank it has not got."""
    from agent.fleet.job import _stuck_collective
    from agent.fleet.jobstate import JobIncident

    job = JobIncident(trace_id="b" * 32)
    job.evidence = {"node-a": _host("node-a", [_rank(0, 8, 7, "collective"), _rank(1, 8, 7, "collective")]),
                    "node-b": _host("node-b", [_rank(2, 8, 7, "collective"), _rank(3, 7, 7, "compute", "forward (m.py:3)")])}
    assert str(_stuck_collective(job)) == "fr:0:8"
    job.evidence["node-c"] = _host("node-c", [RankSummary(rank=4, fr=None), _rank(5, 6, 5, "compute")])  # a rank further behind
    assert str(_stuck_collective(job)) == "fr:0:6"
    assert _stuck_collective(JobIncident(trace_id="b" * 32)) is None  # no recorder anywhere: nothing is made up


def _dead(rank: int, signal: str, exit_time_s: float, *, first: bool) -> RankSummary:
    return RankSummary(rank=rank, pid=100 + rank, title=f"j::scheduler_TP{rank}", alive=False, exited_first=first,
                       exit_signal=signal, exit_time_ns=int(exit_time_s * 1e9))


def test_the_first_death_across_hosts_is_ordered_on_the_coordinators_clock() -> None:
    """Rank 3 (node-b) is SIGKILLed at T; rank 0 (node-a) aborts 5 s later. node-b's clock is 30 s
    ahead, so its own record says T+30: the job's first death is rank 3 once node-b's measured
    offset is applied, rank 0 without it. Each host's own exit came first on that host."""
    t = 1_790_000_000.0
    hosts = [_host("node-a", [_dead(0, "SIGABRT", t + 5, first=True), _rank(1, 8, 7, "collective")]),
             _host("node-b", [_rank(2, 8, 7, "collective"), _dead(3, "SIGKILL", t + 30, first=True)]),
             _host("node-c", [_rank(4, 8, 7, "collective"), _rank(5, 8, 7, "collective")])]
    v = judge_job(hosts, clock_offsets_s={"node-b": 30.0, "node-c": 0.4})
    assert (v.kind, v.culprit_ranks, v.culprit_hosts, v.confidence) == ("dead", (3,), ("node-b",), "high")
    assert v.reason.startswith("dead: rank 3 exited with SIGKILL"), v.reason
    assert "exit times of node-b put on the coordinator's clock (its clock +30.0 s)" in v.evidence
    assert not any("node-c" in line for line in v.evidence)  # 0.4 s: within the measurement's error
    # without the offset node-b's record says rank 3 died 25 s after rank 0
    assert judge_job(hosts).culprit_ranks == (0,)
