"""The `servewatch` command line, run as a real subprocess (argv -> settings, exit codes, output)."""

from __future__ import annotations

import itertools
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import PROGRAMS_DIR

CLI = [sys.executable, "-m", "agent.cli.app"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVEWATCH_", "OTEL_"))}
    env.update(SERVEWATCH_SHM_DIR=str(tmp_path / "shm"), **extra)
    return env


def _cli(tmp_path: Path, *args: str, timeout_s: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout_s, cwd=tmp_path, env=_env(tmp_path, **env),
        stdin=subprocess.DEVNULL, check=False,
    )


def _titled(spawn, python: str, title: str) -> subprocess.Popen[bytes]:
    proc = spawn([python, str(PROGRAMS_DIR / "titled_target.py"), title, "--max-lifetime-s", "60"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready and proc.stdout.readline().startswith(b"ready"), "target did not start"
    return proc


def test_help_lists_every_command_and_the_exit_codes(tmp_path: Path) -> None:
    r = _cli(tmp_path, "--help")
    assert r.returncode == 0
    for command in ("run", "dump", "demo", "launch", "cuda-env", "profile", "export", "timeline", "report"):
        assert command in r.stdout
    assert "2 usage error" in " ".join(r.stdout.split())


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["run", "--pid", "1", "--watchdog-timeout", "-1"], {}, "servewatch: invalid value for --watchdog-timeout"),
        (["run", "--pid", "1"], {"SERVEWATCH_WATCHDOG__TIMEOUT_S": "soon"}, "servewatch: invalid setting watchdog.timeout_s"),
        (["run", "--pid", "1"], {"SERVEWATCH_INCIDENT__COOLDOWN_S": "0"}, "servewatch: invalid setting incident.cooldown_s"),
        (["run"], {}, "servewatch: nothing to watch"),
        (["dump"], {}, "servewatch: no targets"),
        (["run", "--pid", "1", "--config", "missing.toml"], {}, "servewatch: invalid value for --config: no such file"),
        (["export", "--to", "http://127.0.0.1:1", "--protocol", "carrier-pigeon"], {}, "servewatch: invalid value for --protocol"),
        (["run", "--pid", "1"], {"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}, "servewatch: invalid setting"),
        (["run", "--pid", "1", "--otlp-protocol", "smtp"], {}, "servewatch: invalid value for --otlp-protocol"),
        (["run", "--pid", "1", "--data-dir", "/proc/nope"], {}, "servewatch: invalid setting data_dir: '/proc/nope' is not a writable folder"),
        (["dump", "--pid", "1"], {"SERVEWATCH_DATA_DIR": "/proc/nope"}, "servewatch: invalid setting data_dir"),
        (["run", "--pid", "-1"], {}, "servewatch: invalid value for --pid"),
        (["run", "--pid", "1"], {"SERVEWATCH_TARGET__MATCH": "sglang*"}, "servewatch: invalid setting"),
        (["run", "--pid", "1"], {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:99999"}, "servewatch: invalid setting OTEL_EXPORTER_OTLP_ENDPOINT"),
        (["run", "--health-url", "ftp://x/"], {}, "servewatch: invalid value for --health-url"),
        (["profile", "--url", "127.0.0.1:30000", "--steps", "5"], {}, "servewatch: invalid value for --url"),
        (["profile", "--url", "notaurl"], {}, "servewatch: invalid value for --url"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], env: dict[str, str], expected: str) -> None:
    r = _cli(tmp_path, *args, **env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), r.stderr


def test_dump_of_processes_that_are_no_ranks_does_not_say_no_stacks(tmp_path: Path, spawn, python: str) -> None:
    """Two hung processes that are no distributed job's ranks: their stacks are read and the
    verdict's reason must not claim there were none."""
    prefix = f"norank{os.getpid()}::worker"
    a = _titled(spawn, python, f"{prefix}_a")
    b = _titled(spawn, python, f"{prefix}_b")
    r = _cli(tmp_path, "dump", "--pid", str(a.pid), "--pid", str(b.pid), "--json", "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 0, r.stderr
    verdict = json.loads(r.stdout)["verdict"]
    assert (verdict["kind"], verdict["culprit_pids"], verdict["confidence"]) == ("unknown", [], "low")
    assert len(verdict["evidence"]) == 2  # both stacks are there
    assert "no stacks" not in verdict["reason"] and "2 processes, none a rank of a distributed job" in verdict["reason"]


def test_dump_of_ranks_py_spy_may_not_read_says_why_in_the_summary_verdict(tmp_path: Path, spawn, python: str) -> None:
    """py-spy denied on every rank (the engineer who forgot sudo): the summary's verdict line says
    why there is no stack and what to do, not only "no conclusive evidence"."""
    exe = tmp_path / "py-spy-denied"
    exe.write_text(
        f"#!{sys.executable}\nimport runpy, sys\n"
        f"sys.argv = [sys.argv[0], 'permission-denied', {str(tmp_path / 'pyspy.log')!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({str(PROGRAMS_DIR / 'fake_pyspy.py')!r}, run_name='__main__')\n"
    )
    exe.chmod(0o755)
    ranks = [_titled(spawn, python, f"denied{os.getpid()}::scheduler_TP{rank}") for rank in (0, 1)]
    args = [a for p in ranks for a in ("--pid", str(p.pid))]
    r = _cli(tmp_path, "dump", *args, "--data-dir", str(tmp_path / "data"), SERVEWATCH_PYSPY__EXECUTABLE=str(exe))
    verdict = next((line for line in r.stdout.splitlines() if line.startswith("Verdict:")), r.stdout + r.stderr)
    as_root = os.geteuid() == 0  # root refused is told so, never "run as root (sudo)"
    note = ("py-spy was refused although servewatch runs as root (a ptrace policy or another tracer: see its py-spy line)" if as_root
            else "py-spy was denied: run servewatch as root (sudo) or with CAP_SYS_PTRACE")
    assert verdict == f"Verdict: no culprit rank -- no conclusive evidence (no Flight Recorder and no stacks); {note} [confidence low]"
    nxt = r.stdout.splitlines()[r.stdout.splitlines().index(verdict) + 1]
    assert nxt.startswith("next: ") and ("sudo" in nxt) is not as_root, nxt


def test_out_of_range_option_is_a_usage_error(tmp_path: Path) -> None:
    r = _cli(tmp_path, "run", "--pid", "1", "--duration", "-1")
    assert r.returncode == 2
    assert "--duration" in r.stderr and "Traceback" not in r.stderr


def test_dump_json_captures_matching_processes(tmp_path: Path, spawn, python: str) -> None:
    prefix = f"clitest{os.getpid()}::scheduler"  # unique: other test runs may have schedulers too
    a = _titled(spawn, python, f"{prefix}_TP0")
    b = _titled(spawn, python, f"{prefix}_TP1")
    r = _cli(tmp_path, "dump", "--match", f"{prefix}_TP*", "--json", "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["trigger"] == "manual"
    assert {p["pid"] for p in summary["processes"]} == {a.pid, b.pid}
    dumps = [x for x in summary["actions"] if x["action"] == "pyspy.dump"]
    assert {(x["pid"], x["outcome"]) for x in dumps} == {(a.pid, "ok"), (b.pid, "ok")}
    assert all("hung_in_fake_allreduce" in x["hung_frame"] for x in dumps)
    bundle = Path(summary["bundle_path"])
    if not bundle.is_absolute():
        bundle = tmp_path / bundle
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["incident_id"] == summary["incident_id"]
    # embedded default: the incident's spans are in an OTLP/JSON lines file with hex ids
    span_files = list((tmp_path / "data").glob("*/spans/*.jsonl"))
    assert span_files
    assert summary["trace_id"] in "".join(f.read_text() for f in span_files)

    # the same bundle read back offline
    t = _cli(tmp_path, "timeline", summary["incident_id"], "--json", "--data-dir", str(tmp_path / "data"))
    assert t.returncode == 0, t.stderr
    assert json.loads(t.stdout)["incident_id"] == summary["incident_id"]
    rep = _cli(tmp_path, "report", summary["incident_id"], "-o", "r.html", "--data-dir", str(tmp_path / "data"))
    assert rep.returncode == 0, rep.stderr
    assert "hung_in_fake_allreduce" in (tmp_path / "r.html").read_text()


def test_dump_with_nothing_matching_fails_cleanly(tmp_path: Path) -> None:
    r = _cli(tmp_path, "dump", "--match", "no-such-title-*", "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == "servewatch: no process matched the given --pid/--root-pid/--match"


def test_timeline_of_missing_incident_is_one_line_exit_1(tmp_path: Path) -> None:
    r = _cli(tmp_path, "timeline", "nope", "--data-dir", str(tmp_path / "empty"))
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("servewatch: ")


def test_cuda_env_prints_exports_that_keep_user_values(tmp_path: Path) -> None:
    r = _cli(tmp_path, "cuda-env", "--folder", str(tmp_path / "crash"), CUDA_COREDUMP_SHOW_PROGRESS="0")
    assert r.returncode == 0, r.stderr
    assert "export CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1" in r.stdout
    assert f"export CUDA_COREDUMP_FILE={tmp_path}/crash/%h/core.cuda.%t.%p" in r.stdout
    assert "export CUDA_COREDUMP_SHOW_PROGRESS" not in r.stdout  # the user's value is kept
    assert "export TORCH_FR_BUFFER_SIZE=2000" in r.stdout  # the collective Flight Recorder, armed
    mine = _cli(tmp_path, "cuda-env", "--folder", str(tmp_path / "crash"), TORCH_FR_BUFFER_SIZE="64")
    assert "export TORCH_FR_BUFFER_SIZE" not in mine.stdout and "# kept TORCH_FR_BUFFER_SIZE" in mine.stdout


def test_run_exits_within_seconds_with_the_collector_unreachable(tmp_path: Path, spawn, python: str) -> None:
    target = _titled(spawn, python, "sglang::scheduler_TP0")
    start = time.monotonic()
    r = _cli(
        tmp_path, "run", "--pid", str(target.pid), "--duration", "1", "--data-dir", str(tmp_path / "data"),
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
    )
    elapsed = time.monotonic() - start
    assert r.returncode == 0, r.stderr
    assert elapsed < 30  # hang guard only; bench/bench_export.py measures shutdown time
    assert "watching" in r.stderr


@pytest.mark.parametrize("case", ["timed_out", "not_python"])
def test_dump_exits_1_when_a_rank_s_stacks_could_not_be_captured(tmp_path: Path, spawn, python: str, case: str) -> None:
    ok = _titled(spawn, python, f"exit{os.getpid()}::scheduler_TP0")
    env: dict[str, str] = {}
    if case == "timed_out":  # py-spy cannot even start within 1 ms
        pids, env = [ok.pid], {"SERVEWATCH_PYSPY__TIMEOUT_S": "0.001"}
    else:  # a real process that is not Python, beside a Python rank that dumps fine
        other = spawn(["sleep", "60"])
        pids = [other.pid, ok.pid]
    args = [a for p in pids for a in ("--pid", str(p))]
    r = _cli(tmp_path, "dump", *args, "--data-dir", str(tmp_path / "data"), timeout_s=90, **env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert case in r.stdout and "Errors: 1" in r.stdout, r.stdout
    if case == "not_python":
        assert "Wrote 1 stack dump(s)" in r.stdout


def test_dump_of_ranks_that_all_dumped_exits_0(tmp_path: Path, spawn, python: str) -> None:
    ok = _titled(spawn, python, f"exit{os.getpid()}::scheduler_TP0")
    r = _cli(tmp_path, "dump", "--pid", str(ok.pid), "--data-dir", str(tmp_path / "data"), timeout_s=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Wrote 1 stack dump(s)" in r.stdout and "Errors: 0" in r.stdout


def test_dump_says_once_that_its_metrics_url_gave_no_reading(tmp_path: Path, spawn, python: str) -> None:
    """`dump --metrics-url` to a port nothing listens on: one stderr line says so (before, not a
    word), and the verdict never advises passing the --metrics-url that was given."""
    import socket

    rank = _titled(spawn, python, f"murl{os.getpid()}::scheduler_TP0")
    with socket.socket() as held:  # bound, never listening: a connect is refused
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}/metrics"
        r = _cli(tmp_path, "dump", "--pid", str(rank.pid), "--data-dir", str(tmp_path / "data"), "--metrics-url", url,
                 timeout_s=90)
    assert r.returncode == 0, r.stdout + r.stderr
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("servewatch: --metrics-url: ")]
    assert said == [(f"servewatch: --metrics-url: no reading: connection refused at {url} (nothing listens there: "
                     "wrong host or port, or the server is down)")], r.stderr
    assert "--metrics-url" not in r.stdout, r.stdout


def test_ctrl_c_of_run_pressed_again_while_it_stops_prints_no_traceback_and_keeps_its_summary(
    tmp_path: Path, spawn, python: str
) -> None:
    """Ctrl-C, then Ctrl-C again every 20 ms while `run` stops (an impatient user, or tmux sending
    it twice): before, a second SIGINT after the first had been handled raised KeyboardInterrupt
    in the exporters' flush (an asyncio traceback) and lost the summary line."""
    target = _titled(spawn, python, f"sigint{os.getpid()}::scheduler_TP0")
    run = spawn([*CLI, "run", "--pid", str(target.pid), "--data-dir", str(tmp_path / "data")],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path, env=_env(tmp_path), bufsize=0)
    assert run.stderr is not None  # unbuffered: select() sees every line readline() has not taken
    deadline = time.monotonic() + 60
    line = b""
    while b"watching 1 target process" not in line:
        ready, _, _ = select.select([run.stderr], [], [], max(0.0, deadline - time.monotonic()))
        line = run.stderr.readline() if ready else b""
        assert ready and line, "run never said it watches its target"
    run.send_signal(signal.SIGINT)
    for _ in range(500):  # bounded: 10 s of presses
        if run.poll() is not None:
            break
        run.send_signal(signal.SIGINT)
        time.sleep(0.02)
    text = run.stderr.read().decode()
    assert run.wait(timeout=60) == 0, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert text.splitlines()[-1].startswith("servewatch: stopped after "), text


def _read_all(fd: int, proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    """Everything written to the pty ``fd`` until ``proc`` exits and the pty is drained (bounded)."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the other end closed (EIO)
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out


def test_dump_says_what_it_is_doing_on_a_terminal_and_nothing_extra_on_a_pipe(tmp_path: Path, spawn, python: str) -> None:
    """Before: a blank screen until the summary. On a terminal, one progress line rewritten in
    place per phase and erased before the summary; on a pipe, not a byte of it."""
    import pty

    rank = _titled(spawn, python, f"prog{os.getpid()}::scheduler_TP0")
    argv = [*CLI, "dump", "--pid", str(rank.pid), "--data-dir", str(tmp_path / "data")]
    leader, follower = pty.openpty()
    try:
        proc = spawn(argv, stdout=subprocess.PIPE, stderr=follower, cwd=tmp_path, env=_env(tmp_path))
        os.close(follower)
        follower = -1
        screen = _read_all(leader, proc, 90).decode()
        assert proc.wait(timeout=30) == 0, screen
        assert proc.stdout is not None
        assert "Wrote 1 stack dump(s)" in proc.stdout.read().decode()
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    steps = screen.split("\r\x1b[K")
    assert steps[0] == "" and steps[-1] == "", screen  # rewritten in place, erased at the end
    said = [s for s in steps if s]
    assert said[0] == "servewatch: dump of 1 process(es): finding the processes, opening the incident…", said
    assert "servewatch: dump of 1 process(es): dumping stacks (py-spy)…" in said, said
    assert "servewatch: dump of 1 process(es): judging the evidence…" in said, said

    piped = _cli(tmp_path, "dump", "--pid", str(rank.pid), "--data-dir", str(tmp_path / "data"), timeout_s=90)
    assert piped.returncode == 0, piped.stderr
    assert "servewatch: dump of" not in piped.stderr and "\x1b" not in piped.stderr, piped.stderr


def test_a_warning_during_dump_on_a_terminal_gets_its_own_row_and_the_progress_comes_back(
        tmp_path: Path, spawn, python: str) -> None:
    """Before: a warning logged while the progress line showed was written after it, on the same
    row (``...opening the incident…servewatch: warning: in-flight ...``). Now the progress line is
    erased before the warning and drawn again after it, then erased before the summary."""
    import pty

    from agent.sdk.control import control_path

    rank = _titled(spawn, python, f"warn{os.getpid()}::scheduler_TP0")
    ctl = control_path(rank.pid, tmp_path / "shm")  # not a socket: in-flight requests unavailable (a warning)
    ctl.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    ctl.write_text("")
    argv = [*CLI, "dump", "--pid", str(rank.pid), "--data-dir", str(tmp_path / "data")]
    leader, follower = pty.openpty()
    try:
        proc = spawn(argv, stdout=subprocess.PIPE, stderr=follower, cwd=tmp_path, env=_env(tmp_path))
        os.close(follower)
        follower = -1
        screen = _read_all(leader, proc, 90).decode()
        assert proc.wait(timeout=30) == 0, screen
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    rows = screen.split("\r\n")  # the pty ends lines with CR LF
    at = next(i for i, r in enumerate(rows) if "in-flight requests of pid" in r)
    shown = rows[at].rsplit("\r\x1b[K", 1)[-1]  # what the row shows: text after the last erase
    assert shown.startswith(f"servewatch: warning: in-flight requests of pid {rank.pid} unavailable"), repr(rows[at])
    assert "…servewatch" not in screen, repr(screen)
    after = "\r\n".join(rows[at + 1:])
    assert after.startswith("\r\x1b[Kservewatch: dump of 1 process(es): "), repr(after)  # drawn again
    assert after.endswith("\r\x1b[K"), repr(after)  # and erased at the end


def test_timeline_latest_after_the_paged_steps_shows_the_paging_incident_and_names_the_dump(tmp_path: Path) -> None:
    """The Paged section's step 3 (`dump`) made a newer manual incident: `timeline latest` still
    shows the stall that paged, and one stderr line names the dump and how to read it."""
    data = tmp_path / "data"
    for incident_id, trigger, opened_s in (("20261201T190000Z-stall-bbbbbb", "stall", 0),
                                           ("20261201T191000Z-manual-cccccc", "manual", 600)):
        bundle = data / "h1" / incident_id
        bundle.mkdir(parents=True)
        opened = (1_796_151_600 + opened_s) * 10**9
        (bundle / "manifest.json").write_text(json.dumps({
            "schema": "servewatch.incident/1", "incident_id": incident_id, "trigger": trigger, "detail": "d",
            "host.name": "h1", "trace_id": "", "span_id": "", "opened_time_unix_nano": opened,
            "closed_time_unix_nano": opened + 10**9, "duration_s": 1.0, "targets": [], "actions": [],
            "inflight_requests": 0}))
    r = _cli(tmp_path, "timeline", "latest", "--data-dir", str(data), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["incident_id"] == "20261201T190000Z-stall-bbbbbb"
    assert r.stderr.splitlines() == [
        ("servewatch: latest is 20261201T190000Z-stall-bbbbbb (stall), the incident that paged; manual dump(s) since:"
        f" 20261201T191000Z-manual-cccccc (servewatch timeline 20261201T191000Z-manual-cccccc --data-dir {data})")]
    named = _cli(tmp_path, "timeline", "cccccc", "--data-dir", str(data), "--json")
    assert (named.returncode, named.stderr) == (0, ""), named.stderr


#: A verdict like the demo's, its rank lines longer than a 120-column box.
VERDICT_HEADLINE = ("Verdict: culprit rank(s) 0 -- compute: rank 0 hung in its forward "
                    "(_injected_hang_in_forward) while rank 1 waits for it [confidence high]")
VERDICT_EVIDENCE = [
    ("rank 0 pid 12454 [TP0]; compute: _injected_hang_in_forward (agent/demo/model.py:62); steps 4->4; "
     "1 request(s) in flight, the oldest for 9.3 s; no forward progress for 6.0 s"),
    ("rank 1 pid 12455 [TP1]; collective: all_reduce (torch/distributed/distributed_c10d.py:2050); "
     "steps 4->4; waiting for rank 0 in the collective for 6.0 s"),
]


#: The verdict of :func:`write_verdict_bundle` (a manifest from before the ``next`` line: rebuilt on reading)
VERDICT = {"headline": VERDICT_HEADLINE, "culprit_ranks": [0], "reason": "compute", "confidence": "high",
           "kind": "compute", "hung": True, "evidence": VERDICT_EVIDENCE}


def write_verdict_bundle(data: Path) -> str:
    """An incident under ``data`` whose verdict has :data:`VERDICT_EVIDENCE`; its id."""
    incident_id = "20261201T190000Z-stall-dddddd"
    bundle = data / "h1" / incident_id
    bundle.mkdir(parents=True)
    opened = 1_796_151_600 * 10**9
    (bundle / "manifest.json").write_text(json.dumps({
        "schema": "servewatch.incident/1", "incident_id": incident_id, "trigger": "stall", "detail": "d",
        "host.name": "h1", "trace_id": "", "span_id": "", "opened_time_unix_nano": opened,
        "closed_time_unix_nano": opened + 10**9, "duration_s": 1.0, "targets": [], "actions": [],
        "inflight_requests": 0,
        "verdict": VERDICT}))
    return incident_id


def assert_verdict_box_lines_hang(screen: str) -> int:
    """In the top verdict box of ``screen``, each line (headline, its ``next:`` line, then each evidence line) starts
    a row, and its continuation rows start no further left than its first row's text (before:
    an evidence line's continuation started at the box's left edge, left of ``  rank 0 ...``).
    Returns how many continuation rows the evidence lines took."""
    rows = screen.splitlines()
    start = next(i for i, r in enumerate(rows) if r.lstrip().startswith("╭─ verdict"))
    inner = []
    for row in rows[start + 1:]:
        if row.lstrip().startswith("╰"):
            break
        inner.append(row.strip().removeprefix("│").removesuffix("│")[1:].rstrip())  # the border, its padding
    continued = 0
    i = 0
    from agent.verdict.rules import next_step_of

    for n, line in enumerate([VERDICT_HEADLINE, f"next: {next_step_of(VERDICT)}", *VERDICT_EVIDENCE]):
        first = inner[i]
        lead = len(first) - len(first.lstrip(" "))
        assert line.startswith(first.strip()), f"row {first!r} starts no line\n" + "\n".join(inner)
        got = first.split()
        i += 1
        while len(got) < len(line.split()):
            row = inner[i]
            assert len(row) - len(row.lstrip(" ")) >= lead, (  # hanging (+4) or aligned, never left of it
                f"{row!r} continues {first!r} left of its text\n" + "\n".join(inner))
            got += row.split()
            continued += 1 if n > 1 else 0  # the evidence lines (after the headline and next:)
            i += 1
        assert got == line.split(), "\n".join(inner)
    return continued


def test_timeline_in_a_pipe_hangs_each_verdict_line_s_continuation_under_its_own_text(tmp_path: Path) -> None:
    """`servewatch timeline ... | less` (120 columns): the top verdict box's rank lines wrap with
    their continuation rows indented under ``  rank 0 ...``, not at the box's left edge."""
    data = tmp_path / "data"
    incident_id = write_verdict_bundle(data)
    r = _cli(tmp_path, "timeline", incident_id, "--data-dir", str(data))
    assert r.returncode == 0, r.stderr
    assert max(len(ln) for ln in r.stdout.splitlines()) == 120, r.stdout
    assert assert_verdict_box_lines_hang(r.stdout) > 0, r.stdout


def _line_with(stream, needle: bytes, timeout_s: float) -> bytes:
    """The first line of ``stream`` (unbuffered) holding ``needle``; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([stream], [], [], max(0.0, left))
        line = stream.readline() if ready else b""
        assert ready and line, f"no line with {needle!r} within {timeout_s:g} s"
        if needle in line:
            return line


def test_a_second_agent_on_one_data_dir_says_so_and_status_shows_both(tmp_path: Path, spawn) -> None:
    """Before: no word, and `status` showed whichever agent wrote last as if it were alone."""
    data = tmp_path / "data"
    argv = [*CLI, "run", "--match", f"nothing{os.getpid()}::*", "--data-dir", str(data)]
    env = _env(tmp_path, SERVEWATCH_HOST_NAME="h1")
    first = spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path, env=env, bufsize=0)
    _line_with(first.stderr, b"still looking", 60)
    second = spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path, env=env, bufsize=0)
    said = _line_with(second.stderr, b"another agent", 60).decode().rstrip("\n")
    assert said == (f"servewatch: warning: another agent (pid {first.pid}) already uses data dir {data}: both write"
                    " its status and incidents (`servewatch status` shows both); give this one its own --data-dir")
    _line_with(second.stderr, b"still looking", 60)  # its status is written too
    try:
        status = _cli(tmp_path, "status", "--json", "--data-dir", str(data), SERVEWATCH_HOST_NAME="h1")
        doc = json.loads(status.stdout)
        assert doc["agents_running"] == [first.pid, second.pid], status.stdout
        text = _cli(tmp_path, "status", "--data-dir", str(data), SERVEWATCH_HOST_NAME="h1")
        assert (f"servewatch: 2 agents use this data dir (pids {first.pid}, {second.pid}); the lines below are pid"
                f" {doc['agent_pid']}'s, the last to write ") in text.stderr, text.stderr
        # the last writer stops, the other runs on: not "NOT running" (a new-user trial read the
        # agent as dead), and no failure for it
        last = second if doc["agent_pid"] == second.pid else first
        other = first if last is second else second
        last.send_signal(signal.SIGTERM)
        last.wait(timeout=60)
        after = _cli(tmp_path, "status", "--data-dir", str(data), SERVEWATCH_HOST_NAME="h1")
        if json.loads(_cli(tmp_path, "status", "--json", "--data-dir", str(data), SERVEWATCH_HOST_NAME="h1").stdout)["agent_pid"] == last.pid:
            assert (f"servewatch: agent pid {last.pid} on h1 has stopped; agent pid {other.pid} still runs on this data dir"
                    in after.stderr), after.stderr
            assert "NOT running" not in after.stderr and after.returncode == 0, (after.returncode, after.stderr)
    finally:
        for proc in (second, first):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert not list((data / "h1" / "agents").iterdir())  # a clean stop removes its presence file
    alone = _cli(tmp_path, "status", "--json", "--data-dir", str(data), SERVEWATCH_HOST_NAME="h1")
    assert json.loads(alone.stdout)["agents_running"] == []


def _gone_pid() -> int:
    """The pid of a process that ran and was reaped (no process has it now)."""
    proc = subprocess.Popen(["true"], stdin=subprocess.DEVNULL)
    proc.wait(timeout=30)
    return proc.pid


def test_run_and_dump_of_a_pid_that_does_not_exist_exit_1_at_once_with_one_line(tmp_path: Path) -> None:
    pid = _gone_pid()
    run = _cli(tmp_path, "run", "--pid", str(pid), "--duration", "40", "--data-dir", str(tmp_path / "data"), timeout_s=90)
    assert run.returncode == 1, run.stderr  # not a 40 s wait ending in 0
    assert run.stderr.startswith(f"servewatch: no such process: {pid} ") and run.stderr.count("\n") == 1, run.stderr
    assert "--match" in run.stderr and not (tmp_path / "data").exists()
    dump = _cli(tmp_path, "dump", "--pid", str(pid), "--data-dir", str(tmp_path / "data"))
    assert dump.returncode == 1 and f"no such process: {pid}" in dump.stderr and dump.stderr.count("\n") == 1


def test_run_by_title_waits_for_a_server_not_started_yet(tmp_path: Path) -> None:
    r = _cli(tmp_path, "run", "--match", f"notyet{os.getpid()}::*", "--duration", "2", "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 0, r.stderr
    assert "still looking" in r.stderr
    # it ends with one line: how long, what it opened, where bundles go
    last = r.stderr.splitlines()[-1]
    assert last.startswith("servewatch: stopped after 2 s; 0 incident(s) written (bundles would go to "), r.stderr
    assert last.endswith("; 0 target exit(s) seen"), r.stderr


def test_a_target_that_appears_is_said_by_the_status_line_not_as_a_warning(tmp_path: Path, spawn, python: str) -> None:
    title = f"later{os.getpid()}::scheduler_TP0"
    run = spawn([*CLI, "run", "--match", f"later{os.getpid()}::*", "--duration", "7", "--data-dir", str(tmp_path / "data")],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=_env(tmp_path))
    time.sleep(2.5)
    _titled(spawn, python, title)
    _, err = run.communicate(timeout=60)
    text = err.decode()
    assert run.returncode == 0, text
    assert "warning: no target process found yet" in text  # nothing to watch: worth a warning
    assert "servewatch: process: watching 1 target process" in text, text  # found: the status line says it
    assert "warning: found" not in text and "found 1 target" not in text, text
    assert text.splitlines()[-1].startswith("servewatch: stopped after "), text


@pytest.mark.slow
def test_demo_prints_the_incident_verdict_first_as_soon_as_it_is_captured(tmp_path: Path) -> None:
    r = subprocess.run(
        [*CLI, "demo"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=150, cwd=tmp_path,
        env=_env(tmp_path), stdin=subprocess.DEVNULL, check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:]
    lines = r.stdout.splitlines()  # what a terminal shows: progress (stderr) and the incident (stdout) as they came
    captured = next(i for i, ln in enumerate(lines) if ln.endswith("] incident captured:"))
    assert lines[captured + 1].startswith("Verdict: culprit rank 0 "), lines[captured:captured + 3]
    # then what to do next, on the culprit's own pid
    culprit = re.match(r"Verdict: culprit rank 0 \(pid (\d+)\) -- behind:", lines[captured + 1])
    assert culprit is not None, lines[captured + 1]
    assert lines[captured + 2] == f"next: py-spy dump --native --pid {culprit.group(1)} (what it does instead of the collective)"
    assert lines[captured + 3].startswith("Incident ") and "(stall)" in lines[captured + 3]
    view = next(i for i, ln in enumerate(lines) if ln.startswith("View: servewatch timeline "))
    bundle = next(i for i, ln in enumerate(lines) if "] bundle: " in ln)
    spans = next(i for i, ln in enumerate(lines) if "] spans: " in ln)
    assert captured < view < bundle < spans == len(lines) - 1  # where the bundle and spans are comes last
    # the agent stopped right after the incident: its status file says it closed and was written
    # (before: 'incident: OPEN', '0 written' -- the last rewrite was cancelled by the stop)
    status = _cli(tmp_path, "status", "--json")
    incidents = json.loads(status.stdout)["incidents"]
    assert (incidents["open"], incidents["written"], incidents["last"]["trigger"]) == (None, 1, "stall"), incidents
    from agent.host.cudaenv import cuda_driver_present

    if not cuda_driver_present():  # a CPU-only host: one quiet line for the coredumps, no arming hint
        assert [ln for ln in lines if "cuda.coredump" in ln] == [
            "  cuda.coredump   none: no GPU/CUDA driver on this host (2 process(es))"
        ], lines
        assert "SPT_NOENV" not in r.stdout


@pytest.mark.slow
def test_ctrl_c_while_the_demo_server_starts_says_it_stops_it_at_once(tmp_path: Path, spawn) -> None:
    """SIGINT during the demo server's start: "stopping the demo server…" at once (its start
    takes seconds to unwind), then it stops; exit 130 and no scheduler left behind."""
    import psutil

    demo = spawn([*CLI, "demo"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path, env=_env(tmp_path))
    assert demo.stderr is not None
    first = demo.stderr.readline().decode()
    assert "starting the demo inference server" in first, first
    time.sleep(1.0)  # the server is importing and spawning its schedulers
    children = [c.pid for c in psutil.Process(demo.pid).children(recursive=True)]
    sent = time.monotonic()
    demo.send_signal(signal.SIGINT)
    ready, _, _ = select.select([demo.stderr], [], [], 5)
    said = demo.stderr.readline().decode() if ready else ""
    assert said.startswith("SIGINT received: stopping the demo server"), said
    assert time.monotonic() - sent < 5
    rest = demo.stderr.read().decode()
    assert demo.wait(timeout=60) == 130, rest
    assert "demo server stopped" in rest, rest
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_ctrl_c_mid_incident_in_the_demo_names_the_interrupted_bundle(tmp_path: Path, spawn) -> None:
    """SIGINT while the demo's incident captures stacks (py-spy hangs): the demo names the bundle
    it leaves interrupted, and that manifest says ``interrupted: true`` beside its state."""
    log = tmp_path / "pyspy.log"
    exe = tmp_path / "py-spy-hangs"
    exe.write_text(
        f"#!{sys.executable}\nimport runpy, sys\n"
        f"sys.argv = [sys.argv[0], 'hang', {str(log)!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({str(PROGRAMS_DIR / 'fake_pyspy.py')!r}, run_name='__main__')\n"
    )
    exe.chmod(0o755)
    env = _env(tmp_path, SERVEWATCH_PYSPY__EXECUTABLE=str(exe), SERVEWATCH_PYSPY__TIMEOUT_S="100",
               SERVEWATCH_INCIDENT__INTERRUPT_GRACE_S="1", SERVEWATCH_HOST_NAME="h1")
    demo = spawn([*CLI, "demo", "--data-dir", str(tmp_path / "data")], stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE, cwd=tmp_path, env=env)
    assert demo.stderr is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not log.exists() and demo.poll() is None:
        time.sleep(0.1)  # py-spy (hanging) has started: the incident is mid-phase
    assert log.exists(), "the demo's incident never started py-spy"
    demo.send_signal(signal.SIGINT)
    assert demo.wait(timeout=60) == 130
    text = demo.stderr.read().decode()
    bundles = list((tmp_path / "data" / "h1").glob("*-stall-*/manifest.json"))
    assert len(bundles) == 1, text
    m = json.loads(bundles[0].read_text())
    assert (m["state"], m["interrupted"]) == ("interrupted", True)
    said = [ln for ln in text.splitlines() if f"incident {m['incident_id']} was interrupted" in ln]
    assert said and f"{bundles[0].parent}/" in said[0], text


@pytest.mark.slow
def test_demo_on_an_80_column_terminal_wraps_its_lines_at_words_with_a_hanging_indent(tmp_path: Path, spawn) -> None:
    """Before: the demo's step lines were written whole and the terminal broke them mid-word
    (``(TP=2, a small torch model per sched`` / ``uler)``), and the "interrupted" message's
    continuation rows were indented 1. Now every row fits 80 columns, and a line's continuation
    rows are indented 4 (interrupted mid-incident, as Ctrl-C while py-spy hangs)."""
    import fcntl
    import pty
    import struct
    import termios

    from agent.cli.app import HANG_INDENT

    log = tmp_path / "pyspy.log"
    exe = tmp_path / "py-spy-hangs"
    exe.write_text(
        f"#!{sys.executable}\nimport runpy, sys\n"
        f"sys.argv = [sys.argv[0], 'hang', {str(log)!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({str(PROGRAMS_DIR / 'fake_pyspy.py')!r}, run_name='__main__')\n"
    )
    exe.chmod(0o755)
    env = _env(tmp_path, SERVEWATCH_PYSPY__EXECUTABLE=str(exe), SERVEWATCH_PYSPY__TIMEOUT_S="100",
               SERVEWATCH_INCIDENT__INTERRUPT_GRACE_S="1", SERVEWATCH_HOST_NAME="h1")
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 80, 0, 0))
    try:
        demo = spawn([*CLI, "demo", "--data-dir", str(tmp_path / "data")], stdout=subprocess.DEVNULL,
                     stderr=follower, cwd=tmp_path, env=env)
        os.close(follower)
        follower = -1
        screen = b""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not log.exists() and demo.poll() is None:
            ready, _, _ = select.select([leader], [], [], 0.1)  # py-spy (hanging) has started: mid-incident
            if ready:
                screen += os.read(leader, 65536)
        assert log.exists(), screen.decode()
        demo.send_signal(signal.SIGINT)
        screen += _read_all(leader, demo, 60)
        assert demo.wait(timeout=60) == 130, screen.decode()
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    rows = [r for r in screen.decode().split("\r\n") if r]
    text = "\n".join(rows)
    # servewatch wrapped them, not the terminal (a word wider than a row, a path, stays whole)
    assert all(len(r) <= 80 or len(r.split()) == 1 for r in rows), text
    step = next(i for i, r in enumerate(rows) if "] starting the demo inference server (TP=2, a small" in r)
    assert rows[step + 1].startswith(" " * HANG_INDENT), text
    assert f"{rows[step]} {rows[step + 1].strip()}".endswith("(TP=2, a small torch model per scheduler)"), text
    for i, row in enumerate(rows):
        if row.startswith(" "):  # a continuation row: under a line's first row, indented 4 more
            first = next(rows[k] for k in range(i - 1, -1, -1) if not rows[k].startswith(" "))
            assert row.startswith(" " * HANG_INDENT) and row[HANG_INDENT] != " ", f"{first!r} / {row!r}\n{text}"
    bundle = next((tmp_path / "data" / "h1").glob("*-stall-*"))
    at = next(i for i, r in enumerate(rows) if r.startswith(f"incident {bundle.name} was interrupted;"))
    more = list(itertools.takewhile(lambda r: r.startswith(" " * HANG_INDENT), rows[at + 1:]))
    assert more, text
    said = " ".join([rows[at], *(r.strip() for r in more)])
    assert said == (f"incident {bundle.name} was interrupted; what it captured is kept in {bundle}/ "
                    f"(View: servewatch timeline {bundle.name})"), text


@pytest.mark.slow
def test_demo_runs_the_main_job_end_to_end(tmp_path: Path) -> None:
    r = _cli(tmp_path, "demo", "--json", timeout_s=150)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["trigger"] == "stall"
    hung = {x["title"]: x.get("hung_frame", "") for x in summary["actions"] if x["action"] == "pyspy.dump"}
    assert set(hung) == {"demo::scheduler_TP0", "demo::scheduler_TP1"}
    assert "_injected_hang_in_forward" in hung["demo::scheduler_TP0"]
    assert all(x["outcome"] == "ok" for x in summary["actions"] if x["action"] == "pyspy.dump")
    # the verdict names TP0 (hung in its forward) and not TP1 (waiting for it in a real all_reduce)
    assert "all_reduce" in hung["demo::scheduler_TP1"]
    tp0 = next(p["pid"] for p in summary["processes"] if p["title"] == "demo::scheduler_TP0")
    assert summary["verdict"]["kind"] == "behind" and summary["verdict"]["culprit_ranks"] == [0]
    assert summary["verdict"]["culprit_pids"] == [tp0]
    assert "rank 0 never entered all_reduce #" in summary["verdict"]["reason"]
    # the hung rank is in compute (stuck in its forward), as the py-spy summary says, not idle
    rank0 = next(line for line in summary["verdict"]["evidence"] if line.startswith("rank 0 "))
    assert "compute: _injected_hang_in_forward" in rank0 and "idle" not in rank0, rank0
    assert all(x["outcome"] == "ok" for x in summary["actions"] if x["action"] == "flightrec.dump")
    bundle = tmp_path / summary["bundle_path"]
    assert (bundle / "manifest.json").is_file()
    # it says where the bundle and the spans are; the spans folder holds the incident's trace
    (bundle_line,) = [ln for ln in r.stderr.splitlines() if "] bundle: " in ln]
    assert bundle_line.split("] bundle: ", 1)[1].rstrip("/").endswith(summary["bundle_path"].rstrip("/"))
    (spans_line,) = [ln for ln in r.stderr.splitlines() if "] spans: " in ln]
    spans_dir = tmp_path / spans_line.split("] spans: ", 1)[1].split("/ (", 1)[0]
    assert spans_dir.is_dir() and spans_dir.name == "spans", spans_line
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert any(manifest["trace_id"] in f.read_text() for f in spans_dir.iterdir() if f.is_file()), spans_line
    # nothing of the demo is left running
    import psutil

    assert not [p["pid"] for p in summary["processes"] if psutil.pid_exists(p["pid"])]


@pytest.mark.slow
def test_demo_with_one_rank_names_the_rank_stuck_in_its_forward(tmp_path: Path) -> None:
    r = _cli(tmp_path, "demo", "--tp", "1", "--json", timeout_s=150)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["trigger"] == "stall"
    tp0 = next(p["pid"] for p in summary["processes"] if p["title"] == "demo::scheduler_TP0")
    v = summary["verdict"]
    assert (v["kind"], v["culprit_ranks"], v["culprit_pids"], v["hung"]) == ("compute", [0], [tp0], True), v
    assert v["reason"].startswith("all ranks in compute: no collective wait; rank 0 stuck"), v
    assert "_injected_hang_in_forward" in v["reason"] and "idle" not in v["headline"], v


def test_profile_captures_exactly_n_steps_and_ships_the_session_as_spans(tmp_path: Path, spawn, python: str) -> None:
    env = _env(tmp_path)
    proc = spawn([python, str(PROGRAMS_DIR / "profiled_model.py"), "--max-runtime-s", "90"], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and proc.stdout.readline().startswith(b"READY"), "model did not start"
    r = _cli(tmp_path, "profile", "--pid", str(proc.pid), "--steps", "3", "--activities", "CPU", "--out", "prof",
             "--json", "--data-dir", "data", timeout_s=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["outcome"] == "ok"
    assert result["attributes"]["servewatch.profile.steps_captured"] == 3
    [trace_file] = [p for p in result["artifact_paths"] if ".json" in p]
    assert Path(trace_file).parent == tmp_path / "prof"
    # the session and its imported ProfilerStep ranges are spans of one trace in the span files
    lines = "".join(f.read_text() for f in (tmp_path / "data").glob("*/spans/*.jsonl"))
    assert result["trace_id"] in lines
    assert lines.count('"name":"ProfilerStep#') == 3
    assert '"name":"profile.session"' in lines


def test_launch_arms_the_child_and_returns_its_exit_code(tmp_path: Path) -> None:
    script = ("import os, sys; print(os.environ['CUDA_COREDUMP_FILE']); print(os.environ['CUDA_COREDUMP_SHOW_PROGRESS']);"
              " print(os.environ['TORCH_FR_BUFFER_SIZE']); sys.exit(3)")
    r = _cli(
        tmp_path, "launch", "--crash-dump-folder", str(tmp_path / "crash"), "--data-dir", "data", "--",
        sys.executable, "-c", script, CUDA_COREDUMP_SHOW_PROGRESS="0",
    )
    assert r.returncode == 3, r.stderr
    core_file, progress, fr_size = r.stdout.split()[:3]
    assert fr_size == "2000"  # launch arms the collective Flight Recorder
    assert core_file == f"{tmp_path}/crash/%h/core.cuda.%t.%p"
    assert progress == "0"  # the user's own value wins
    assert "Armed CUDA coredumps" in r.stderr
    # the server's death is an incident, with the exit status servewatch reaped
    [manifest] = [json.loads(p.read_text()) for p in (tmp_path / "data").glob("*/*/manifest.json")]
    assert manifest["trigger"] == "exit" and manifest["detail"].endswith("exited (exit code 3)")


def test_launch_of_a_server_dying_at_start_has_a_verdict_naming_its_command(tmp_path: Path) -> None:
    """New-user trial F8: the launched server exits 1 at start, before any rank (`--match`) appears:
    the exit incident's summary starts with a verdict naming the server by its command line (it
    set no title), and the manifest holds it."""
    script = "import sys, time; time.sleep(1.0); sys.exit(1)"
    r = _cli(tmp_path, "launch", "--match", "sglang::scheduler*", "--crash-dump-folder", str(tmp_path / "crash"),
             "--data-dir", "data", "--", sys.executable, "-c", script)
    assert r.returncode == 1, r.stderr
    [manifest] = [json.loads(p.read_text()) for p in (tmp_path / "data").glob("*/*/manifest.json")]
    pid = int(manifest["detail"].split()[1])
    v = manifest["verdict"]
    assert v is not None, manifest
    assert (v["kind"], v["rule"], v["culprit_ranks"], v["culprit_pids"], v["confidence"]) == (
        "dead", "server_exited", [], [pid], "high"), v
    command = f"{sys.executable} -c {shlex.quote(script)}"
    assert v["reason"] == f"the server (pid {pid} {command!r}) exited with exit code 1 before any rank started", v
    assert manifest["detail"] == f"pid {pid} {command!r} exited (exit code 1)", manifest["detail"]
    said = (r.stdout + r.stderr).splitlines()  # the verdict first, what to do next, then the incident's line
    first = next(i for i, line in enumerate(said) if line.startswith(("Verdict:", "Incident ")))
    assert said[first] == v["headline"] and said[first + 2].startswith(f"Incident {manifest['incident_id']} (exit)"), said
    assert said[first + 1] == ("next: the end of the server's own output (its stderr; under servewatch launch, just "
                               "above): the error before exit code 1") == f"next: {v['next']}", said


def test_launch_forwards_sigterm_to_the_server(tmp_path: Path) -> None:
    import signal

    ready = tmp_path / "ready"
    script = f"import pathlib, time; pathlib.Path({str(ready)!r}).write_text('x'); time.sleep(60)"
    proc = subprocess.Popen(
        [*CLI, "launch", "--crash-dump-folder", str(tmp_path / "crash"), "--data-dir", "data", "--", sys.executable, "-c", script],
        cwd=tmp_path, env=_env(tmp_path), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "server did not start"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, err
        # an operator's stop is an expected exit, not an incident
        assert not list((tmp_path / "data").glob("*/*/manifest.json"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_api_port_in_use_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import socket

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _cli(tmp_path, "run", "--match", "nothing-here*", "--api-listen", f"127.0.0.1:{port}",
                 "--api-token-file", str(token), "--duration", "1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"servewatch: invalid setting api.listen: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "Traceback" not in r.stderr


def test_replay_command_always_has_a_scheme() -> None:
    from exporters.otlp.provider import Destination

    folder = Path("/d/spool")
    assert Destination("127.0.0.1:4317", "grpc").replay_command(folder) == "servewatch export --to http://127.0.0.1:4317 --protocol grpc /d/spool"
    assert Destination("otel:4317", "grpc", insecure=False).replay_command(folder).startswith("servewatch export --to https://otel:4317 ")
    assert Destination("https://otel:4318", "http/protobuf", insecure=True).replay_command(folder).startswith(
        "servewatch export --to https://otel:4318 --protocol http/protobuf"
    )


def test_cuda_env_counts_every_export_it_prints(tmp_path: Path) -> None:
    r = _cli(tmp_path, "cuda-env", "--folder", str(tmp_path / "crash"))
    assert r.returncode == 0, r.stderr
    exports = [line for line in r.stdout.splitlines() if line.startswith("export ")]
    assert "export TORCH_FR_BUFFER_SIZE=2000" in exports
    assert f"servewatch: {len(exports)} variable(s) set, 0 kept;" in r.stderr


def test_plain_lines_asking_rich_not_to_wrap_are_still_wrapped_at_words_on_a_terminal(monkeypatch, capsys) -> None:
    """A plain line printed with rich's ``soft_wrap=True`` (the spool, --metrics-url and newer-dump
    lines) takes the CLI's own path: on a terminal broken at words, continuation rows hanging by 4."""
    from agent.cli import common as cli  # the consoles' module (agent.cli.app imports them from it)

    monkeypatch.setattr(cli, "_terminal_columns", lambda stream: 40)
    line = "servewatch: --metrics-url: no reading: connection refused at http://127.0.0.1:1/metrics (the verdict names it)"
    cli._LazyConsole(stderr=True, soft_wrap=True).print(line, markup=False, highlight=False, soft_wrap=True)
    rows = capsys.readouterr().err.rstrip("\n").split("\n")
    assert len(rows) > 1 and all(len(r) <= 40 or " " not in r.strip() for r in rows), rows
    assert all(r.startswith("    ") and not r.startswith("     ") for r in rows[1:]), rows
    assert " ".join(r.strip() for r in rows) == line
