"""The fault matrix on real processes: a gloo job (TP=2 and TP=4) with one faulty rank, the real
agent, and the verdict of the incident (tests/programs/fault_matrix.py drives it).

Every case must name exactly the faulty rank (none for the slow but progressing one) and no
innocent rank. bench/bench_verdict.py prints the same matrix with the time the verdict adds.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from agent.summary import summary_lines
from exporters.bundle import load_incident
from exporters.report import render_report_html
from exporters.timeline import render_timeline_text
from tests.programs.fault_matrix import EXPECTED, run_case

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
    # hard mode signalled the culprit only, and the signal is a span of the incident
    assert record.hard_signal_sent == {culprit_pid: "SIGTERM"}
    [sig] = [r for r in record.results if r.action == "hard.signal"]
    assert sig.pid == culprit_pid and sig.outcome.value == "ok" and "culprit per verdict" in sig.detail
    manifest = json.loads(record.manifest_path.read_text())
    assert manifest["verdict"]["culprit_ranks"] == [2] and manifest["verdict"]["kind"] == "behind"
    assert manifest["verdict"]["headline"] == v.headline()
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
    assert [s for s in by_name["hard.signal"] if s["traceId"] == record.opened.trace_id]
    assert len([s for s in by_name["flightrec.dump"] if s["traceId"] == record.opened.trace_id]) == 4
    assert signal.SIGTERM  # the innocent ranks were left alone: they are still in the collective
    innocent = [t.pid for t in record.targets if t.pid != culprit_pid]
    assert all(pid not in record.hard_signal_sent for pid in innocent)
    # the verdict tops `servewatch timeline` and the HTML report of the bundle
    tl = load_incident(record.bundle_dir)
    text = render_timeline_text(tl, width=200)
    assert text.index(v.headline()[:60]) < text.index("trigger") < text.index("flightrec.dump")
    html = render_report_html(tl)
    assert html.index('id="verdict"') < html.index('class="summary"') < html.index('id="timeline"')
    assert "Verdict: culprit rank 2 (pid" in html
