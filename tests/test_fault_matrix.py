"""The fault matrix on real processes: a gloo job (TP=2 and TP=4) with one faulty rank, the real
agent, and the verdict of the incident (tests/programs/fault_matrix.py drives it); then the shapes
real hangs take (a collective-timeout cascade, a crash seen late with and without the SDK's step
counter, two servers on one host, DP replicas, an IPC deadlock with a request running, a rendezvous
hang, an ordering deadlock across two process groups, a stack too deep for py-spy, a rank in
uninterruptible sleep, two pipeline stages both receiving first (a P2P ordering deadlock), a stage receiving from a stage
hung before it sends, a rank
hung before DeepEP's dispatch while its peer spins in it, vLLM-on-Ray workers all titled
``ray::RayWorkerWrapper`` whose ranks are in their environments (one crashing: named by the
``RANK`` read while it lived), schedulers that inherited one ``RANK`` (named by their titles), a PP=2 x TP=2 vLLM job whose
``Worker_PP1_TP0`` is global rank 2 on one host and across two nodes' job verdict, a rank hung in
CUDA-graph capture before its first step while its peer waits in the captured all-reduce: a
start-up stall). Lifecycle cases
(tests/programs/lifecycle_cases.py): ranks owned and reaped at once by their server process, the
agent watching by title: a clean exit and the tree's SIGTERM open no incident, a real OOM kill
(a memory-limited cgroup) is named, a crash seen late (zombies at dump time) is blamed first.

Every case must name exactly the faulty rank (none for the slow but progressing one) and no
innocent rank, at the confidence its evidence supports. bench/bench_verdict.py prints the same
matrix with the time the verdict adds.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from agent.cli.summary import summary_lines
from agent.model.events import ExitKind, ExitSource
from agent.views.bundle import load_incident
from agent.views.report import render_report_html, report_summary
from agent.views.timeline import render_timeline_text
from tests.programs.fault_matrix import EXPECTED, RAY_SECRET, SHAPES, pp_two_nodes, run_case
from tests.programs.lifecycle_cases import LIFECYCLE_EXPECTED, run_lifecycle_case

pytestmark = pytest.mark.slow

CASES = [(tp, fault) for tp in (2, 4) for fault in ("hang", "kill", "skip", "shape", "slow")]


@pytest.mark.parametrize(("tp", "fault"), CASES, ids=[f"tp{tp}-{fault}" for tp, fault in CASES])
async def test_verdict_names_exactly_the_faulty_rank(tp: int, fault: str, tmp_path: Path) -> None:
    k = tp - 1 if tp == 2 else 2
    result = await run_case(tp, fault, k, workdir=tmp_path)
    record = result.record
    v = record.verdict
    trigger, kind, named = EXPECTED[fault]
    assert record.opened.trigger == trigger
    assert v is not None, "no verdict"
    assert v.kind == kind, v.reason
    assert v.culprit_ranks == ((k,) if named else ()), v.reason
    assert v.hung is (fault != "slow")
    if fault == "slow":
        assert v.stragglers == (k,)
    # one Flight Recorder read per rank; every live one ok, read from the SDK's worker server
    fr = [r for r in record.results if r.action == "flightrec.dump"]
    assert len(fr) == len(record.targets)
    live = [r for r in fr if fault != "kill" or r.attributes.get("servewatch.flightrec.rank") != k]
    assert all(r.outcome.value == "ok" and r.attributes["servewatch.flightrec.source"] == "sdk_worker" for r in live), [
        (r.pid, r.outcome, r.detail) for r in fr]
    assert {r.attributes["servewatch.flightrec.rank"] for r in live} == {t for t in range(tp) if not (fault == "kill" and t == k)}
    ranks = {r.pid: r.attributes["servewatch.flightrec.rank"] for r in live}
    if named and fault != "kill":
        assert v.culprit_pids == tuple(p for p, r in ranks.items() if r == k)
    if fault == "kill":  # the dead rank is the one whose exit opened the incident
        assert f"pid {v.culprit_pids[0]} " in record.opened.detail and "signal 11" in record.opened.detail


async def test_verdict_reaches_span_manifest_summary_and_hard_mode_signals_only_the_culprit(tmp_path: Path) -> None:
    result = await run_case(4, "hang", 2, workdir=tmp_path, hard={"hard": True, "signal": "SIGTERM"})
    record = result.record
    v = record.verdict
    assert (v.kind, v.culprit_ranks) == ("behind", (2,))
    culprit_pid = v.culprit_pids[0]
    # the first line of the summary is the verdict
    lines = summary_lines(record)
    assert lines[0].startswith("Verdict: culprit rank 2 (pid ") and "behind: rank 2 never entered all_reduce #" in lines[0]
    assert "ranks 0,1,3 wait in it" in lines[0]
    # then what to do next, on the culprit's pid: the same line in the manifest, the span, timeline and report
    step = f"py-spy dump --native --pid {culprit_pid} (what it does instead of the collective)"
    assert lines[1] == f"next: {step}" and v.next_step == step
    # hard mode signalled the culprit only, and the signal is a span of the incident
    assert record.hard_signal_sent == {culprit_pid: "SIGTERM"}
    [sig] = [r for r in record.results if r.action == "hard.signal"]
    assert sig.pid == culprit_pid and sig.outcome.value == "ok" and "culprit per verdict" in sig.detail
    manifest = json.loads(record.manifest_path.read_text())
    assert manifest["verdict"]["culprit_ranks"] == [2] and manifest["verdict"]["kind"] == "behind"
    assert manifest["verdict"]["headline"] == v.headline() and manifest["verdict"]["next"] == step
    spans = [json.loads(line) for f in (tmp_path / "data").glob("*/spans/*.jsonl") for line in f.read_text().splitlines()]
    by_name: dict[str, list[dict]] = {}
    for req in spans:
        for rs in req["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    by_name.setdefault(sp["name"], []).append(sp)
    [root] = [s for s in by_name["incident"] if s["traceId"] == record.opened.trace_id]
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    assert attrs["servewatch.verdict.kind"] == {"stringValue": "behind"}
    assert attrs["servewatch.verdict.culprit_ranks"]["arrayValue"]["values"] == [{"intValue": "2"}]
    assert attrs["servewatch.verdict.next"] == {"stringValue": step}
    assert [s for s in by_name["hard.signal"] if s["traceId"] == record.opened.trace_id]
    assert len([s for s in by_name["flightrec.dump"] if s["traceId"] == record.opened.trace_id]) == 4
    assert signal.SIGTERM  # the innocent ranks were left alone: they are still in the collective
    innocent = [t.pid for t in record.targets if t.pid != culprit_pid]
    assert all(pid not in record.hard_signal_sent for pid in innocent)
    # the verdict tops `servewatch timeline` and the HTML report of the bundle
    tl = load_incident(record.bundle_dir)
    text = render_timeline_text(tl, width=200)
    assert text.index(v.headline()[:60]) < text.index(f"next: {step}") < text.index("trigger") < text.index("flightrec.dump")
    html = render_report_html(tl)
    assert f"<code>{step}</code>" in html
    assert html.index('id="verdict"') < html.index('class="summary"') < html.index('id="timeline"')
    assert "Verdict: culprit rank 2 (pid" in html


# --- the shapes real hangs take (issue 22) ---------------------------------------------------------


#: Shapes whose own test files run them with every assertion below and more (tests/test_livelock.py,
#: tests/test_request_stall.py, tests/test_startup_stall.py): not run a second time here.
OWN_TESTS = frozenset({"livelock", "request_stall", "startup_hang", "startup_hang_vllm"})


@pytest.mark.parametrize("shape", sorted(set(SHAPES) - OWN_TESTS))
async def test_the_verdict_names_the_culprit_of_each_real_hang_shape(shape: str, tmp_path: Path) -> None:
    """Each shape on real processes (gloo jobs, real titles, real py-spy, real exits): the
    structured verdict names exactly the culprit ranks and pids, at the confidence the evidence
    supports, and never a process of another server."""
    result = await SHAPES[shape](tmp_path)
    v = result.verdict
    assert result.correct, (result.problems(), v.get("headline"), v.get("evidence"))
    # what to do next names the culprit's own pid (a rank that never started has none)
    assert v["next"] and (not v["culprit_pids"] or str(v["culprit_pids"][0]) in re.findall(r"\d+", v["next"])), (
        shape, v["next"])
    reason = v["reason"]
    if shape == "cascade":  # the exit that opened the incident is a victim, not the culprit
        assert result.record.opened.trigger == "exit" and reason.startswith("collective timeout cascade: rank 2 alive")
        assert f"pid {v['culprit_pids'][0]} " not in result.record.opened.detail
    elif shape == "crash_late":
        assert reason.startswith("dead: rank 2 exited with SIGSEGV") and "not a distributed job" not in reason
        assert v["ranks"] == [0, 1, 2]
        assert any(line.startswith("rank 2 pid ") and "rank from its SDK step counter" in line for line in v["evidence"])
    elif shape == "crash_late_no_sdk":  # inferred, said so, and not at high confidence
        assert reason.startswith("dead: rank 1 exited with SIGSEGV"), reason
        assert any(line.startswith("rank 1 pid ") and "rank 1 inferred: its title went with it" in line
                   and "(size 2)" in line for line in v["evidence"]), v["evidence"]
    elif shape in ("two_servers", "dp_replicas"):
        assert v["ranks"] == [0, 1] and reason.startswith("behind: rank 1 never entered all_reduce")
    elif shape == "dp_attention":  # one world: not split by its DP coordinates
        assert v["ranks"] == [0, 1, 2, 3] and "ranks 0,1,2 wait in it" in reason
    elif shape == "ipc_deadlock":
        assert reason.startswith("deadlock between rank 0 (pid ") and v["hung"] and v["kind"] != "idle"
        # the Errors counts of dump's summary, timeline and report agree (no Flight Recorder source
        # here, py-spy ok: 0 everywhere)
        record = result.record
        assert {r.outcome.value for r in record.results if r.action == "flightrec.dump"} == {"no_source"}
        tl = load_incident(record.bundle_dir)
        report = tmp_path / "r.html"
        report.write_text(render_report_html(tl))
        assert next(line for line in summary_lines(record) if line.startswith("Wrote ")).endswith(" Errors: 0")
        assert "errors   0 (processes whose stacks could not be captured)" in render_timeline_text(tl, width=200)
        assert " Errors: 0. " in report_summary(tl, report)
    elif shape == "engine_hang":  # the engine core, by pid and frame; its idle worker is no culprit
        engine = v["culprit_pids"][0]
        assert v["rule"] == "coordinator_stuck" and v["hung"] and v["culprit_ranks"] == [] and v["ranks"] == [0], v
        assert re.match(rf"the engine core pid {engine} '\S+::EngineCore' is stuck in _engine_step_hang \(", reason), reason
        assert "while every rank idles (waiting for work): rank 0 in " in reason, reason
        assert v["next"].startswith(f"py-spy dump --native --pid {engine} (what the engine core's own loop"), v["next"]
    elif shape == "rendezvous":
        assert reason.startswith("rendezvous: rank 2 never arrived (rank 2 never started); ranks 0,1 wait")
    elif shape == "pg_cycle":
        assert "rank 0 waits in all_reduce #1 of pg 1 for rank 1; rank 1 waits in all_reduce #1 of pg 2 for rank 0" in reason
    elif shape == "deep":  # py-spy could not read it: said, and the partial stack kept
        [dump] = [r for r in result.record.results if r.action == "pyspy.dump" and r.pid == v["culprit_pids"][0]]
        assert dump.outcome.value == "ok" and "stack too deep for py-spy" in dump.detail, dump.detail
        assert dump.attributes["servewatch.pyspy.source"] == "torch_dump_traceback"
        assert any("stack too deep for py-spy; partial stack" in line for line in v["evidence"])
        assert "_hang_in_compute (" in reason
    elif shape == "dstate":  # read --nonblocking at once (a blocking dump would hang to its 20 s timeout)
        pid = v["culprit_pids"][0]
        [dump] = [r for r in result.record.results if r.action == "pyspy.dump" and r.pid == pid]
        wchan = dump.attributes["servewatch.pyspy.uninterruptible_wchan"]
        assert dump.outcome.value == "ok" and dump.detail.startswith(
            f"pid {pid} is in uninterruptible sleep (D) in {wchan}: dumped with --nonblocking"), dump.detail
        assert dump.attributes["servewatch.pyspy.attempts"] == 1 and "servewatch.pyspy.killed" not in dump.attributes
        assert dump.attributes["servewatch.pyspy.uninterruptible_tids"] == (pid,)  # its main thread
        if os.geteuid() == 0:  # the kernel shows wchan to root and the owner
            assert wchan == "kernel_clone", wchan
        assert reason.startswith(f"rank 1 (pid {pid}) is in uninterruptible sleep (D) in {wchan} at "), reason
        # its frame: the innermost of its own code (where the syscall is made), under _load_weights
        assert " at uninterruptible_sleep (" in reason and "waiting for it: rank 0 in all_reduce (" in reason, reason
        assert any("_load_weights (" in line for line in dump.attributes["servewatch.pyspy.stacks"])
        assert v["next"].startswith(f"cat /proc/{pid}/stack"), v["next"]
    elif shape == "p2p_deadlock":  # both stages posted recv first: named from their stacks (gloo records no P2P)
        assert v["rule"] == "p2p_deadlock" and v["hung"], v
        assert reason == ("P2P ordering deadlock: rank 0 waits in recv, rank 1 waits in recv: each waits for the "
                          "other to send first"), reason
        assert all(re.search(r"; p2p recv: recv \(torch/distributed/distributed_c10d\.py:\d+\)", line)
                   for line in v["evidence"][:2]), v["evidence"]
        pids = v["culprit_pids"]
        assert v["next"] == (f"py-spy dump --pid {pids[0]}; py-spy dump --pid {pids[1]} (each one's send/recv call "
                             "site: one stage must send before it receives)"), v["next"]
    elif shape == "p2p_behind":  # the stage that never sends is the culprit, the receiving one waits for it
        assert v["rule"] == "stacks_behind", v
        assert reason.startswith("behind: rank 1 not in a collective (rank 1 in compute: _hang_in_compute ("), reason
        assert reason.endswith("rank 0 waits in a P2P recv for it"), reason
    elif shape in ("ray_workers", "ray_workers_no_fr"):  # every title ray::RayWorkerWrapper: RANK in each environment
        assert v["ranks"] == [0, 1, 2] and reason.startswith("behind: rank 1 not in a collective"), (reason, v["ranks"])
        assert all(re.match(r"rank \d pid \d+; rank from its environment \(RANK\); ", line) for line in v["evidence"]), (
            v["evidence"])
        # of the environment only the rank variables are read: the secret beside them is in no file of the incident
        files = [f for f in Path(result.record.bundle_dir).rglob("*") if f.is_file()]
        assert files and not [f for f in files if RAY_SECRET.encode() in f.read_bytes()]
    elif shape == "ray_workers_unreadable":  # no rank anywhere: the stacks alone, by pid, at low confidence
        culprit = v["culprit_pids"][0]
        assert v["rule"] == "stacks_behind_by_pid" and v["ranks"] == [] and v["culprit_roles"] == ["process"], v
        assert reason.startswith(f"behind: pid {culprit} 'ray::RayWorkerWrapper' not in a collective (in compute: "
                                 "_hang_in_compute ("), reason
        assert reason.endswith("wait in one (no process's rank could be read: named by pid)"), reason
        assert not any("rank from its environment" in line for line in v["evidence"]), v["evidence"]
    elif shape == "ray_worker_crash":  # dead, its environment reads empty: the RANK read while it was alive
        assert reason == "dead: rank 1 exited with SIGSEGV" and v["ranks"] == [0, 1, 2], reason
        assert any(re.match(rf"rank 1 pid {v['culprit_pids'][0]}; rank from its environment \(RANK\); gone \(killed by "
                            r"SIGSEGV\)", line) for line in v["evidence"]), v["evidence"]
    elif shape == "inherited_rank":  # RANK=0 in both schedulers' environments (the pod's): the titles name them
        assert v["ranks"] == [0, 1] and reason.startswith("behind: rank 1 not in a collective"), reason
        assert not any("rank from its environment" in line for line in v["evidence"]), v["evidence"]
    elif shape == "pp_titles":  # VLLM::Worker_PP1_TP0 at TP=2 is global rank 2, never 1 (Worker_PP0_TP1's)
        assert v["ranks"] == [0, 1, 2, 3] and reason.startswith("behind: rank 2 not in a collective"), reason
        assert any(line.startswith(f"rank 2 pid {v['culprit_pids'][0]} [PP1_TP0]; compute: ") for line in v["evidence"])
        # `servewatch timeline` and the report number the stages' ranks alike (from all the titles)
        tl = load_incident(result.record.bundle_dir)
        text = render_timeline_text(tl, width=200)
        assert f"rank 2 · pid {v['culprit_pids'][0]}" in text and "rank 1 · pid " in text, text
        html = render_report_html(tl)
        assert f"rank 2 pid {v['culprit_pids'][0]}" in html
    elif shape == "ep_dispatch":  # rank 0 spins in DeepEP's dispatch (no torch.distributed call) for rank 1
        assert v["rule"] == "stacks_behind", v
        assert reason.startswith("behind: rank 1 not in a collective (rank 1 in compute: _hang_in_compute ("), reason
        assert reason.endswith("rank 0 waits in one"), reason
        assert any(line.startswith("rank 0 pid ") and "collective: Buffer.dispatch (" in line and "deep_ep/buffer.py:"
                   in line for line in v["evidence"]), v["evidence"]


async def test_a_pipeline_stage_hung_on_its_node_is_named_by_its_global_rank_in_the_job_verdict(tmp_path: Path) -> None:
    """vLLM PP=2 x TP=2 over two nodes (stage 0 on node-a, stage 1 on node-b, one real agent
    each, titles ``VLLM::Worker_PP{p}_TP{t}``, no SDK): ``Worker_PP1_TP0`` hangs. node-b's own
    verdict names global rank 2 (not 1: that is node-a's ``Worker_PP0_TP1``), and the job verdict
    made from both nodes' summaries names rank 2 on node-b, with no identity conflict."""
    result = await pp_two_nodes(tmp_path)
    a, b = result.host_verdicts["node-a"], result.host_verdicts["node-b"]
    assert a["ranks"] == [0, 1] and a["culprit_ranks"] == [], a  # stage 0 only sees its ranks waiting
    assert (b["kind"], b["culprit_ranks"], b["culprit_pids"], b["ranks"]) == ("behind", [2], [result.pids[2]], [2, 3]), b
    job = result.job
    assert (job.kind, job.culprit_ranks, job.culprit_hosts, job.confidence) == ("behind", (2,), ("node-b",), "medium"), (
        job.reason, job.conflicts)
    assert job.captured_ranks == (0, 1, 2, 3) and job.conflicts == ()
    assert job.reason.startswith("behind: rank 2 not in a collective") and "ranks 0,1,3 wait in one" in job.reason


# --- lifecycle: ranks owned (and reaped at once) by their server, the agent watching by title -----

LIFECYCLE_CASES = list(LIFECYCLE_EXPECTED)


@pytest.mark.parametrize("case", LIFECYCLE_CASES)
async def test_lifecycle_orderly_stops_open_nothing_and_failures_name_their_cause(case: str, tmp_path: Path) -> None:
    result = await run_lifecycle_case(case, workdir=tmp_path)
    trigger, culprit_rank = LIFECYCLE_EXPECTED[case]
    facts = {f.pid: f for _, f in result.exits}
    if trigger is None:
        # a clean exit / the tree's SIGTERM, each rank reaped by its server at once: no incident,
        # and each status read from the kernel (never "unknown", never a crash)
        assert result.records == [], [r.opened.detail for r in result.records]
        assert set(facts) == set(result.ranks.values())
        for pid, fact in facts.items():
            assert fact.kind is ExitKind.ORDERLY and fact.source is ExitSource.KERNEL, fact
            assert fact.exit_code == 0 if case == "clean" else fact.signal == signal.SIGTERM, fact
            assert result.outcomes[pid].startswith("no incident"), result.outcomes
        return
    assert [r.opened.trigger for r in result.records] == [trigger], [r.opened.detail for r in result.records]
    record = result.records[0]
    v = record.verdict
    assert v is not None and v.kind == "dead", v
    culprit_pid = result.ranks[culprit_rank]  # type: ignore[index]
    assert v.culprit_pids == (culprit_pid,), v.reason
    assert v.confidence == "high", v.reason
    if case == "oom":
        # the kernel's OOM killer, named from its own record; one incident for the whole collapse
        assert v.culprit_ranks == (culprit_rank,), v.reason
        fact = facts[culprit_pid]
        assert fact.kind is ExitKind.OOM and fact.signal == signal.SIGKILL and fact.oom_evidence, fact
        assert "killed by the OOM killer" in record.opened.detail and "killed by the OOM killer" in v.reason
        assert all(f.kind is not ExitKind.UNKNOWN for f in facts.values()), facts
    else:
        # rank 3 crashed first (SIGSEGV), ranks 0 and 2 died after it (exit code 1): all zombies when
        # the dump ran, their titles gone with them; the crash is the culprit, not a victim's exit,
        # and its rank is known from its SDK step counter (torch.distributed's rank)
        assert v.culprit_ranks == (culprit_rank,), (v.reason, v.evidence)
        assert "SIGSEGV" in v.reason and "1 process" not in v.reason, v.reason
        victims = {result.ranks[0], result.ranks[2]}
        assert not victims & set(v.culprit_pids)
