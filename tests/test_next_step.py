"""Every verdict ends with one ``next:`` line (issue 31, Build 4): the command or check to run
next, with the verdict's own pids; for every kind the code can conclude (derived from the code:
the rule table, the job verdict's own kinds, and every kind literal in the two modules); on the
terminal summary, in ``timeline`` and the report, as ``servewatch.verdict.next`` on the incident
span and in the manifest (an older bundle's rebuilt, never a crash); in the README's kind table.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from agent.fleet import jobverdict
from agent.fleet.jobverdict import JOB_KINDS, JOB_NEXT_STEPS, MISSING, MissingHost, judge_job
from agent.host.manifest import MANIFEST_NAME
from agent.model.stacks import Frame, ThreadStack
from agent.verdict.rules import (
    NEXT_STEPS,
    RULES,
    Evidence,
    FrameClass,
    RankEvidence,
    Role,
    _cell,
    classify_stack,
    decide,
    next_step_of,
)
from agent.views.bundle import load_incident
from agent.views.report import render_report_html
from agent.views.timeline import render_timeline_text
from tests.conftest import PROGRAMS_DIR
from tests.fleet.test_identity import _host, _rank
from tests.test_manifest import _cli
from tests.test_verdict import _entry, _fr, _pattern

ROOT = Path(__file__).resolve().parent.parent


# --- every kind has one, derived from the code -------------------------------------------------------


def _kind_literals(path: Path) -> set[str]:
    """Every verdict kind the module writes as a literal: ``_verdict(ev, "<kind>", ...)``,
    ``kind="<kind>"`` keywords (rules, ``Verdict(...)``, ``JobVerdict(...)``) and ``kind, ... =
    "<kind>", ...`` assignments."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name == "_verdict" and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                found.add(node.args[1].value)
            found |= {k.value.value for k in node.keywords
                      if k.arg == "kind" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)}
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
            for target, value in zip(node.targets[0].elts, node.value.elts):
                if getattr(target, "id", "") == "kind" and isinstance(value, ast.Constant):
                    found.add(value.value)
    return found


def test_every_verdict_kind_the_code_can_conclude_has_a_next_step() -> None:
    kinds = {r.kind for r in RULES}
    literals = _kind_literals(ROOT / "agent" / "verdict" / "rules.py") | _kind_literals(ROOT / "agent" / "fleet" / "jobverdict.py")
    assert literals >= {"dead", "behind", "single", "unknown"}  # the reader finds them
    assert literals <= kinds | {MISSING}, literals - kinds  # a kind concluded outside the rule table
    assert JOB_KINDS == kinds | {MISSING}
    for kind in sorted(JOB_KINDS):
        doc = NEXT_STEPS[kind].doc if kind in NEXT_STEPS else JOB_NEXT_STEPS.get(kind, "")
        assert doc, f"verdict kind {kind!r} has no next step (agent/verdict/rules.py NEXT_STEPS)"
    assert set(NEXT_STEPS) == kinds  # none for a kind nothing concludes


def test_the_readme_kind_table_has_each_kinds_next_column_as_the_code_says() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    head = "| kind | it means | `next:` (in general; the line has the real pids) |"
    assert head in readme
    rows = re.findall(r"^\| `(\w+)` \| .* \| (.+) \|$", readme.split(head, 1)[1].split("\n\n", 1)[0], re.MULTILINE)
    table = dict(rows)
    assert set(table) == JOB_KINDS
    for kind, cell in table.items():
        doc = NEXT_STEPS[kind].doc if kind in NEXT_STEPS else JOB_NEXT_STEPS[kind]
        assert cell == _cell(doc), kind
    rules_md = (ROOT / "docs" / "verdict-rules.md").read_text(encoding="utf-8")
    assert all(f"| `{k}` | {_cell(s.doc)} |" in rules_md for k, s in NEXT_STEPS.items())


# --- concrete lines, with the verdict's facts ---------------------------------------------------------


_SP = "/v/lib/python3.11/site-packages/"


def _stack(*frames: Frame) -> list[ThreadStack]:
    return [ThreadStack(pid=1, thread_id=1, os_thread_id=1, thread_name="MainThread", active=True, frames=frames)]


def test_a_stall_over_real_stack_shapes_says_py_spy_native_on_the_culprit_pid() -> None:
    """vLLM TP=2: rank 0 waits in the CPU communicator's all-reduce; rank 1 runs its own forward."""
    waiting = _stack(Frame(name="shm_allreduce", filename="_C.abi3.so", module="_C.abi3.so"),
                     Frame(name="CpuCommunicator.all_reduce", filename=_SP + "vllm/distributed/device_communicators/cpu_communicator.py",
                           short_filename="vllm/distributed/device_communicators/cpu_communicator.py", line=80),
                     Frame(name="RowParallelLinear.forward", filename=_SP + "vllm/model_executor/layers/linear.py",
                           short_filename="vllm/model_executor/layers/linear.py", line=1400))
    hung = _stack(Frame(name="_injected_hang", filename="/app/model.py", short_filename="model.py", line=62))
    ev = []
    for rank, pid, threads in ((0, 4242, waiting), (1, 4243, hung)):
        cls, frame = classify_stack(threads)
        ev.append(RankEvidence(rank=rank, pid=pid, title=f"VLLM::Worker_TP{rank}", frame_class=cls, frame=frame))
    v = decide(ev, trigger="stall")
    assert (v.kind, v.rule, v.culprit_pids) == ("behind", "stacks_behind", (4243,))
    assert v.next_step == "py-spy dump --native --pid 4243 (what it does instead of the collective)"
    assert v.attributes()["servewatch.verdict.next"] == v.next_step
    assert v.to_json()["next"] == v.next_step


def _crash(**how: object) -> list[RankEvidence]:
    return [RankEvidence(rank=1, pid=7, alive=False, exited_first=True, **how),  # type: ignore[arg-type]
            RankEvidence(rank=0, pid=6, frame_class=FrameClass.COLLECTIVE, frame="all_reduce (c10d.py:1)")]


@pytest.mark.parametrize(("evidence", "kind", "line"), [
    (_crash(exit_signal="SIGSEGV"), "dead",
     "coredumpctl info 7 (the native backtrace of its SIGSEGV; a CUDA coredump is in the bundle when armed)"),
    (_crash(exit_signal="SIGKILL", oom_killed=True), "dead",
     "dmesg -T | grep -i -e oom -e killed (the kernel's record of who killed pid 7)"),
    (_crash(exit_code=1), "dead",
     "the last lines of pid 7's log (stderr, or journalctl _PID=7): the error before exit code 1"),
    ([RankEvidence(rank=0, pid=41, alive=False, exited_first=True, exit_signal="SIGTERM"),
      RankEvidence(rank=1, pid=42, frame_class=FrameClass.IDLE)], "stopped",
     "nothing to fix if the stop was planned; else who sent SIGTERM: journalctl -S -15min (or the orchestrator's events)"),
    ([RankEvidence(rank=0, pid=41, stopped=True), RankEvidence(rank=1, pid=42, frame_class=FrameClass.COLLECTIVE)],
     "suspended", "grep TracerPid /proc/41/status (a debugger attached?), else kill -CONT 41"),
    ([RankEvidence(rank=0, pid=41, frame_class=FrameClass.COLLECTIVE, frame="barrier (c10d.py:1)"),
      RankEvidence(rank=1, pid=42, uninterruptible=True, wchan="kernel_clone")], "uninterruptible",
     ("cat /proc/42/stack (where in the kernel it waits, as root), then ls -l /proc/42/fd and df -h on those paths: "
      "which filesystem or device hangs (NFS: dmesg -T | grep -i nfs)")),
    ([RankEvidence(rank=r, pid=40 + r, frame_class=FrameClass.COMPUTE, frame="loop (m.py:1)") for r in range(2)],
     "compute", "nvidia-smi (every rank stuck alike in compute: a GPU hang, an Xid?), then py-spy dump --native --pid 40"),
    ([RankEvidence(rank=r, pid=40 + r, stack_note="py-spy was denied: run servewatch as root (sudo) or with CAP_SYS_PTRACE")
      for r in range(2)], "unknown", "sudo servewatch dump --pid 40 --pid 41 (as root: py-spy was denied)"),
    ([RankEvidence(rank=0, pid=41, frame_class=FrameClass.IDLE, frame="recv (zmq.py:1)"),
      RankEvidence(pid=43, role=Role.COORDINATOR, title="VLLM::EngineCore", frame_class=FrameClass.IDLE, frame="get (queue.py:1)")],
     "deadlock", "py-spy dump --locals --pid 41 (the queue or socket it waits on; then pid 43)"),
    ([RankEvidence(pid=42, role=Role.PROCESS, frame_class=FrameClass.COMPUTE, frame="inner (busy.py:6)")], "single",
     "py-spy dump --native --pid 42 (where it is, native frames included)"),
    ([], "unknown", "servewatch status (which processes it watches: check --match, --pid, --root-pid)"),
])
def test_each_kind_says_a_concrete_command_with_the_verdicts_own_pids(evidence: list[RankEvidence], kind: str,
                                                                       line: str) -> None:
    trigger = "stall" if kind in ("compute", "suspended", "deadlock", "uninterruptible") else ""
    v = decide(evidence, trigger=trigger)
    assert (v.kind, v.next_step) == (kind, line)
    # read back from a manifest written before the line existed: rebuilt the same from its own fields
    assert next_step_of({**v.to_json(), "next": ""}) == line


def test_a_desync_names_the_two_flight_recorder_files_to_compare() -> None:
    good, bad = _pattern(41) + [_entry(42, sizes=((8, 32),))], _pattern(41) + [_entry(42, sizes=((8, 31),))]
    v = decide([RankEvidence(rank=r, pid=10 + r, fr=_fr(bad if r == 2 else good, 42, 41)) for r in range(4)])
    assert v.kind == "desync"
    assert v.next_step == ("compare entry #42 of pg 0 in flightrec-rank2-12.json and flightrec-rank0-10.json "
                           "(the bundle): which code issued rank 2's op")


def test_a_health_incident_with_idle_ranks_asks_the_health_url_again() -> None:
    ev = Evidence.of([RankEvidence(rank=r, pid=40 + r, frame_class=FrameClass.IDLE, frame="recv (zmq.py:1)") for r in range(2)],
                     trigger="health", work_pending=False, health_url="http://127.0.0.1:30000/health")
    v = decide(ev)
    assert v.kind == "idle"
    assert v.next_step == "curl -sS -m 10 -i http://127.0.0.1:30000/health (the ranks wait for work: does the frontend answer?)"


def test_an_older_manifests_verdict_reads_with_a_rebuilt_line_or_none_never_a_crash() -> None:
    assert next_step_of({"kind": "behind", "culprit_ranks": [1], "culprit_pids": [101]}) == (
        "py-spy dump --native --pid 101 (what it does instead of the collective)")
    # culprit ranks without their pids in the dict: each rank's pid is read off its evidence line
    assert next_step_of({"kind": "compute", "hung": True, "culprit_ranks": [0],
                         "evidence": ["rank 0 pid 12454 [TP0]; compute: f (m.py:1); steps 4->4"]}) == (
        "py-spy dump --native --pid 12454 (the kernel, lock or loop it sits in)")
    assert next_step_of({"kind": "a_kind_from_a_newer_agent"}) == ""
    assert next_step_of({"kind": "dead", "culprit_pids": ["not a pid"]}) == ""
    assert next_step_of({}).startswith("servewatch status")  # no kind: unknown, nothing known


# --- the job verdict --------------------------------------------------------------------------------


def test_the_job_verdict_says_the_next_step_on_the_culprits_host() -> None:
    hosts = [_host("node-a", [_rank(0, 8, 7, "collective"), _rank(1, 8, 7, "collective")]),
             _host("node-b", [_rank(2, 8, 7, "collective"), _rank(3, 7, 7, "compute", "forward (m.py:3)")]),
             _host("node-c", [_rank(4, 8, 7, "collective"), _rank(5, 8, 7, "collective")])]
    v = judge_job(hosts)
    assert (v.kind, v.culprit_hosts) == ("behind", ("node-b",))
    assert v.next_step == "on node-b: py-spy dump --native --pid 103 (what it does instead of the collective)"
    assert v.attributes()["servewatch.job.verdict.next"] == v.next_step and v.to_json()["next"] == v.next_step


def test_a_missing_host_is_where_the_job_verdict_sends_you() -> None:
    hosts = [_host("node-a", [_rank(0, 8, 7, "collective"), _rank(1, 8, 7, "collective")]),
             _host("node-b", [_rank(2, 8, 7, "collective"), _rank(3, 8, 7, "collective")])]
    v = judge_job(hosts, missing_hosts=[MissingHost("node-c", (4, 5), "agent unreachable")])
    assert v.kind == MISSING == jobverdict.MISSING
    assert v.next_step == ("on node-c (ranks 4,5: agent unreachable): servewatch status (why its agent sent "
                           "nothing), then servewatch dump --match '<rank titles>' there")


# --- a real incident: terminal, manifest, span, timeline, report -------------------------------------


def test_a_real_dump_prints_the_next_line_and_records_it_everywhere(tmp_path: Path, spawn, python: str) -> None:
    title = f"nexttest{os.getpid()}::scheduler_TP0"
    proc = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), title, "--max-lifetime-s", "60"], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
    r = _cli(tmp_path, "dump", "--pid", str(proc.pid), "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("Verdict: ") and lines[1].startswith("next: "), r.stdout
    step = lines[1].removeprefix("next: ")
    # one snapshot of a rank in its own code, no progress source: fresh stacks with the server's /metrics
    assert step == f"servewatch dump --pid {proc.pid} --metrics-url http://HOST:PORT/metrics (tells a hang from work)"
    # the manifest holds it, the incident span carries it
    (bundle,) = [p.parent for p in (tmp_path / "data").glob(f"*/*/{MANIFEST_NAME}")]
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    assert manifest["verdict"]["next"] == step
    spans = [sp for f in (tmp_path / "data").glob("*/spans/*.jsonl") for line in f.read_text().splitlines()
             for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for sp in ss["spans"]]
    (root,) = [sp for sp in spans if sp["name"] == "incident"]
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    assert attrs["servewatch.verdict.next"] == {"stringValue": step}
    # timeline and report show the same line, first and (timeline) last
    tl = load_incident(bundle)
    text = render_timeline_text(tl, width=400)
    assert text.count(f"next: {step}") == 2, text
    html = render_report_html(tl)
    assert f'<p id="verdict-next"><strong>next:</strong> <code>{step}</code></p>' in html.replace("&#39;", "'")
    # a bundle from before the line existed: rebuilt the same from the verdict's own fields
    manifest["verdict"].pop("next")
    (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))
    old = load_incident(bundle)
    assert old.verdict is not None and old.verdict["next"] == step
    assert f"next: {step}" in render_timeline_text(old, width=400)
    manifest["verdict"]["kind"] = "a_kind_from_a_newer_agent"
    (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert "next:" not in render_timeline_text(load_incident(bundle), width=400)  # omitted, not a crash


def test_a_job_verdict_naming_nobody_says_it_on_each_host_by_title_never_by_one_hosts_pid() -> None:
    from agent.fleet.messages import Evidence as HostEvidence
    from agent.fleet.messages import RankSummary

    def host(name: str, ranks: range) -> HostEvidence:
        return _host(name, [RankSummary(rank=r, pid=100 + r, title=f"sglang::scheduler_TP{r}") for r in ranks])

    v = judge_job([host("node-a", range(3)), host("node-b", range(3, 6))])
    assert (v.kind, v.culprit_ranks) == ("unknown", ())
    assert v.next_step == "on each host (node-a, node-b): servewatch dump --match 'sglang::scheduler*' (fresh stacks)"
